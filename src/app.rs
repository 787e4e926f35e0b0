//! The one place where the parts are wired together: store, cache,
//! write-behind, gRPC server (with health and reflection, over TLS if
//! configured) and the metrics listener. [`Application::build`] binds,
//! [`Application::start`] starts ([`Running`]), and [`Running::stop`] stops
//! in the documented order.

mod journaling;
mod linger;
mod sampler;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use readstates_routing::Node;
use tokio::net::TcpListener;
use tokio::task::{JoinError, JoinHandle};
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic_health::server::HealthReporter;

use futures::StreamExt;
use linger::{LINGER, Lingering};

use crate::cache::Cache;
use crate::cache::recount::{self, RECOUNT_EVERY};
use crate::cluster::backup::held::Backups;
use crate::cluster::backup::mirror::Mirror;
use crate::cluster::backup::takeover::Takeover;
use crate::cluster::copier::Copier;
use crate::cluster::lease::{BackupName, Holder};
use crate::cluster::member::{Member, MemberConfig};
use crate::cluster::peers::GrpcPeers;
use crate::cluster::presence::Presence;
use crate::cluster::ring_store::RingStore;
use crate::cluster::ring_store::cassandra::CassandraRingStore;
use crate::config::{Config, StoreKind};
use crate::grpc::apply::MAX_BATCH_BYTES;
use crate::grpc::fleet::FleetService;
use crate::grpc::node_calls::NodeCalls;
use crate::grpc::route::Router;
use crate::grpc::{ReadStatesService, ServiceConfig};
use crate::journal::Journal;
use crate::journal::disk::{self, Disk};
use crate::metrics;
use crate::ownership::Ownership;
use crate::proto::fleet_server::FleetServer;
use crate::proto::read_states_server::ReadStatesServer;
use crate::store::Store;
use crate::store::cassandra::{self, CassandraConfig, CassandraStore};
use crate::store::embedded::EmbeddedStore;
use crate::store::instrumented::Instrumented;
use crate::store::memory::MemoryStore;
use crate::tls::{self, Tls};
use crate::write_behind::{ShutdownReport, WriteBehind, WriteBehindConfig};
use tonic::service::interceptor::InterceptedService;

/// In-flight requests get this long to finish once shutdown begins.
const REQUEST_GRACE: Duration = Duration::from_secs(10);
/// HTTP/2 flow-control windows of the gRPC port. h2 closes a connection
/// (GOAWAY `ENHANCE_YOUR_CALM`) once the small DATA frames it holds unread
/// cost more than half the connection window, at 256 bytes of budget per
/// frame less its payload, and one Watch subscribe is a frame of about 12
/// bytes. So one stream's window of them must fit in that budget: a gateway
/// that writes a stream window of subscribes at once (after a restart or a
/// move) must never lose the connection while the stream reads them
/// (128 KiB of 12-byte frames cost 2.6 MiB of a 4 MiB budget). hyper's
/// defaults, 1 MiB each, allowed about 2,100. The stream window still holds
/// a whole MessageCreated of 10,000 users.
const STREAM_WINDOW: u32 = 128 * 1024;
const CONNECTION_WINDOW: u32 = 8 * 1024 * 1024;
/// `/metrics` connections get this long to finish after the final drain: a
/// scraper that sends half a request must not keep the process from exiting.
const METRICS_GRACE: Duration = Duration::from_secs(1);

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A built, bound, not yet serving instance of the service.
#[derive(Debug)]
pub struct Application {
    config: Config,
    grpc: TcpListener,
    metrics: TcpListener,
    cache: Arc<Cache>,
    /// Where the ring is kept, for a node of a fleet (`--node-id`).
    ring_store: Option<Arc<dyn RingStore>>,
    /// The gRPC port's TLS (`--tls-cert`), also used to call other nodes.
    tls: Option<Arc<Tls>>,
    /// Where changes are journaled (`--journal`), replayed already.
    journal: Option<Arc<Journal>>,
}

impl Application {
    /// Opens the store and binds both listeners (port 0 picks a free one).
    pub async fn build(config: Config) -> Result<Application, BoxError> {
        let store = open_store(&config).await?;
        let ring_store: Option<Arc<dyn RingStore>> = match config.node_id {
            Some(_) => Some(Arc::new(
                CassandraRingStore::connect(&config.cassandra()).await?,
            )),
            None => None,
        };
        Application::build_with(config, store, ring_store).await
    }

    /// [`Application::build`] on a store of the caller's (tests wrap one in
    /// [`crate::store::faulty`]); `config.store` is not looked at.
    pub async fn build_with_store(
        config: Config,
        store: Arc<dyn Store>,
    ) -> Result<Application, BoxError> {
        Application::build_with(config, store, None).await
    }

    /// [`Application::build_with_store`], its journal (if any) on a disk
    /// of the caller's (tests make it fail, see
    /// [`crate::journal::disk::faulty`]).
    pub async fn build_with_disk(
        config: Config,
        store: Arc<dyn Store>,
        disk: Arc<dyn Disk>,
    ) -> Result<Application, BoxError> {
        Application::build_on(config, store, None, disk).await
    }

    /// A node of a fleet whose ring is kept in `ring_store` (tests keep it
    /// in memory), under `config.node_id`, on a store of the caller's.
    pub async fn build_with(
        config: Config,
        store: Arc<dyn Store>,
        ring_store: Option<Arc<dyn RingStore>>,
    ) -> Result<Application, BoxError> {
        Application::build_on(config, store, ring_store, Arc::new(disk::Fs)).await
    }

    async fn build_on(
        config: Config,
        store: Arc<dyn Store>,
        ring_store: Option<Arc<dyn RingStore>>,
        disk: Arc<dyn Disk>,
    ) -> Result<Application, BoxError> {
        if ring_store.is_some() && config.node_id.is_none() {
            return Err("a node of a fleet needs its node_id".into());
        }
        if ring_store.is_some() && config.fleet_secret.is_none() {
            return Err("a node of a fleet needs the fleet's secret (fleet_secret)".into());
        }
        let ownership = Arc::new(match ring_store {
            Some(_) => Ownership::member(),
            None => Ownership::standalone(),
        });
        let cache = Cache::with_ownership(
            config.cache(),
            Arc::new(Instrumented::new(store)),
            ownership,
        );
        // Few (only the channels the backend switched), and every user's
        // counts may read one: all of them, before serving.
        let channels = cache.channels().load_stored().await?;
        if channels > 0 {
            tracing::info!(channels, "channels counted by channel loaded");
        }
        // Before anything is served or handed over: what a crash left.
        let journal = journaling::open(&config, &cache, disk)?;
        let tls = config.tls_files().map(Tls::load).transpose()?;
        if let (Some(tls), Some(_)) = (&tls, &config.node_id) {
            tls.check_node_certificate()?;
        }
        let grpc = TcpListener::bind(config.listen).await?;
        let metrics = TcpListener::bind(config.metrics_listen).await?;
        Ok(Application {
            config,
            grpc,
            metrics,
            cache,
            ring_store,
            tls,
            journal,
        })
    }

    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc.local_addr().unwrap_or(self.config.listen)
    }

    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics
            .local_addr()
            .unwrap_or(self.config.metrics_listen)
    }

    /// Serves until `shutdown` resolves (or the server fails), then stops.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ShutdownReport, BoxError> {
        let mut running = self.start().await?;
        running.serve_until(shutdown).await;
        running.stop().await
    }

    /// Starts everything: write-behind, the metrics sampler and listener,
    /// and the gRPC server with health and reflection.
    pub async fn start(self) -> Result<Running, BoxError> {
        let Application {
            config,
            grpc,
            metrics: metrics_listener,
            cache,
            ring_store,
            tls,
            journal,
        } = self;
        let (grpc_addr, metrics_addr) = (grpc.local_addr()?, metrics_listener.local_addr()?);
        let stop = CancellationToken::new();
        let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
        let sampler = sampler::spawn(cache.clone(), stop.clone());
        let recount = tokio::spawn(recount::run(cache.clone(), RECOUNT_EVERY, stop.clone()));
        let trimmer = (journal.clone())
            .map(|journal| journaling::spawn_trimmer(journal, cache.clone(), stop.clone()));
        metrics::build_info(config.node_id.as_deref().unwrap_or("standalone"));
        let metrics_server = tokio::spawn(metrics::server::serve(
            metrics_listener,
            metrics::handle(),
            stop.clone(),
        ));

        let (health, health_service) = tonic_health::server::health_reporter();
        // A fleet node is ready once it routes (below).
        if ring_store.is_none() {
            health
                .set_serving::<ReadStatesServer<ReadStatesService>>()
                .await;
        } else {
            health
                .set_not_serving::<ReadStatesServer<ReadStatesService>>()
                .await;
        }
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()?;
        // Only the fleet's nodes may call Fleet or speak as a node.
        let node_calls = NodeCalls::new(config.fleet_credential(), config.fleet_auth);
        let mut service =
            ReadStatesService::new(cache.clone(), ServiceConfig::from(&config), stop.clone())
                .trusting(node_calls.clone());
        // A node of a fleet follows the ring, routes, and answers the other
        // nodes' ReleaseSlots.
        // A node that joins and drains by itself (`--join-weight`,
        // `--drain-timeout`).
        let presence = match (&ring_store, &config.node_id, &config.advertise) {
            (Some(ring_store), Some(node_id), Some(advertise)) => Some(Presence {
                ring_store: ring_store.clone(),
                node: Node {
                    id: node_id.clone(),
                    address: advertise.clone(),
                    weight: config.join_weight.unwrap_or(0),
                },
            }),
            _ => None,
        };
        let backups = Arc::new(Backups::with_budget(config.backup_budget()));
        let (fleet, follower, copier, ready, lease, backup, takes) =
            match (ring_store, &config.node_id, config.fleet_credential()) {
                (Some(ring_store), Some(node_id), Some(credential)) => {
                    let peers = Arc::new(GrpcPeers::new(tls.clone(), credential));
                    let member = Member::new(
                        node_id.clone(),
                        ring_store.clone(),
                        cache.clone(),
                        peers.clone(),
                        MemberConfig {
                            ring_poll: config.ring_poll,
                            ..MemberConfig::default()
                        },
                    );
                    let follower = member.start(stop.clone());
                    // Stopped last, once nothing is served (see `Running::stop`).
                    let lease_stop = CancellationToken::new();
                    let ring_store_for_takeover = ring_store.clone();
                    // Which copy of its unwritten changes may take it over:
                    // the lease names it, the backup stream asks.
                    let backup_name = BackupName::new();
                    let holder = Holder::new(
                        ring_store,
                        member.clone(),
                        config.lease(),
                        backup_name.clone(),
                    );
                    // Restarted in place, it takes its lease back at once
                    // (`docs/failover.md`); the next start finds this one.
                    let predecessor = match &journal {
                        Some(journal) => {
                            journal.record_incarnation(holder.incarnation())?;
                            journal.predecessor()
                        }
                        None => None,
                    };
                    let holder = holder.restarted_in_place(predecessor);
                    let takes = holder.takes();
                    let incarnation = holder.incarnation().to_owned();
                    let lease = (lease_stop.clone(), tokio::spawn(holder.run(lease_stop)));
                    // Ready once the ring is read and the lease held: before,
                    // every request would be refused (Kubernetes sends none
                    // until then).
                    let (ready, routing) = (health.clone(), member.clone());
                    let ready = tokio::spawn(async move {
                        routing.routing().await;
                        // And holds its lease: a restart after kill -9 waits
                        // out the one before (see `cluster::lease`).
                        while !routing.ownership().leased() {
                            tokio::time::sleep(LEASE_POLL).await;
                        }
                        ready
                            .set_serving::<ReadStatesServer<ReadStatesService>>()
                            .await;
                    });
                    let copier = Copier::new(member.clone(), peers.clone());
                    let copying = tokio::spawn(copier.clone().run(stop.clone()));
                    // Its unwritten changes held by the next node, which
                    // takes over should it die; and the same for others.
                    // The stream stops after the final writes, not with
                    // `stop`: what they have not written yet is held there
                    // too, should the machine be lost meanwhile (see
                    // `Running::stop`).
                    let backup_stop = CancellationToken::new();
                    let backed_up = journal.clone().filter(|j| config.backup && j.syncs());
                    let mirror = backed_up.map(|journal| {
                        Mirror::new(journal, backup_name, incarnation).run(
                            member.clone(),
                            peers.clone(),
                            backup_stop.clone(),
                        )
                    });
                    let takeover = Takeover {
                        member: member.clone(),
                        backups: backups.clone(),
                        ring_store: ring_store_for_takeover,
                        store: cache.store().clone(),
                        lease: config.lease(),
                    };
                    // Takeovers stop with `stop`: a takeover of another
                    // node started during the final writes would be cut off
                    // by the end of this one (found in review).
                    let backup = tokio::spawn({
                        let stop = stop.clone();
                        async move {
                            let mirroring = async {
                                if let Some(mirror) = mirror {
                                    mirror.await;
                                }
                            };
                            tokio::join!(mirroring, takeover.run(stop));
                        }
                    });
                    let backup = (backup_stop, backup);
                    let router = Router {
                        member,
                        peers,
                        copier,
                    };
                    service = service.routed(router.clone());
                    let lease = Some(lease);
                    (
                        Some(router),
                        Some(follower),
                        Some(copying),
                        Some(ready),
                        lease,
                        Some(backup),
                        Some(takes),
                    )
                }
                _ => (None, None, None, None, None, None, None),
            };
        let read_states = ReadStatesServer::new(service).max_decoding_message_size(MAX_BATCH_BYTES);
        let fleet = fleet.map(|router| {
            let service = FleetService::new(router, backups, node_calls.clone());
            let server = FleetServer::new(service)
                .max_decoding_message_size(crate::cluster::backup::MAX_MESSAGE);
            InterceptedService::new(server, move |request| node_calls.fleet(request))
        });
        let router = Server::builder()
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .add_service(health_service)
            .add_service(reflection)
            .add_service(read_states)
            .add_optional_service(fleet);
        let stopped = stop.clone().cancelled_owned();
        let lingering = Lingering::default();
        let (server, tls_reloader) = match tls {
            None => {
                let lingers = lingering.clone();
                let incoming = incoming(grpc).map(move |io| io.map(|io| lingers.wrap(io)));
                (
                    tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped)),
                    None,
                )
            }
            Some(tls) => {
                let reloader = tls.clone().spawn_reloader(config.tls_poll, stop.clone());
                let lingers = lingering.clone();
                let incoming = tls::incoming::incoming(grpc, tls, config.tls_handshake_timeout)
                    .map(move |io| io.map(|io| lingers.wrap(io)));
                (
                    tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped)),
                    Some(reloader),
                )
            }
        };
        // Once the gRPC port serves (the nodes handing slots over reach it),
        // each time the lease is taken: a node taken out of the ring while
        // it lived, or while it started again, adds itself back.
        let joiner = match (&presence, config.join_weight, takes) {
            (Some(presence), Some(_), Some(takes)) => {
                let (presence, stop) = (presence.clone(), stop.clone());
                Some(tokio::spawn(
                    async move { presence.keep(takes, &stop).await },
                ))
            }
            _ => None,
        };
        tracing::info!(
            version = env!("CARGO_PKG_VERSION"),
            grpc = %grpc_addr,
            metrics = %metrics_addr,
            store = cache.store().name(),
            write_delay = ?config.write_delay,
            node = config.node_id.as_deref().unwrap_or("standalone"),
            advertise = config.advertise.as_deref().unwrap_or("-"),
            tls = tls_reloader.is_some(),
            "serving"
        );
        Ok(Running {
            shutdown_timeout: config.shutdown_timeout,
            drain: presence.filter(|_| !config.drain_timeout.is_zero()),
            drain_timeout: config.drain_timeout,
            joiner,
            health,
            stop,
            server,
            server_ended: None,
            lingering,
            write_behind,
            sampler,
            recount,
            metrics_server,
            follower,
            ready,
            copier,
            backup,
            tls_reloader,
            journal,
            trimmer,
            lease,
        })
    }
}

/// How often readiness looks whether a fleet node holds its lease yet.
const LEASE_POLL: Duration = Duration::from_millis(20);

/// A started application; [`Running::stop`] stops it in order.
#[derive(Debug)]
pub struct Running {
    shutdown_timeout: Duration,
    /// A fleet node that hands its slots to the others before it stops.
    drain: Option<Presence>,
    drain_timeout: Duration,
    /// Adds the node to the ring (`--join-weight`), stopped with `stop`.
    joiner: Option<JoinHandle<()>>,
    health: HealthReporter,
    /// Stops the gRPC server's accept loop, the sampler and `/metrics`.
    stop: CancellationToken,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    /// The connections closed, still read until their clients close them.
    lingering: Lingering,
    /// The server's outcome, if it ended on its own.
    server_ended: Option<Result<Result<(), tonic::transport::Error>, JoinError>>,
    write_behind: WriteBehind,
    sampler: JoinHandle<()>,
    /// Tells Watch streams of counts moved with channels, stopped with `stop`.
    recount: JoinHandle<()>,
    metrics_server: JoinHandle<std::io::Result<()>>,
    /// A fleet node's ring follower, stopped with `stop`.
    follower: Option<JoinHandle<()>>,
    /// Reports a fleet node serving once it routes; stopped first at
    /// shutdown, so that it never says so after shutdown said otherwise.
    ready: Option<JoinHandle<()>>,
    /// A fleet node's copier of channels counted by channel, stopped with
    /// `stop`.
    copier: Option<JoinHandle<()>>,
    /// A fleet node's backup stream, stopped after the final writes, and
    /// takeovers, stopped with `stop`.
    backup: Option<(CancellationToken, JoinHandle<()>)>,
    /// Reads the TLS files again now and then, stopped with `stop`.
    tls_reloader: Option<JoinHandle<()>>,
    /// Closed after the final writes: emptied if they wrote everything.
    journal: Option<Arc<Journal>>,
    /// Deletes what the store holds from the journal, stopped with `stop`.
    trimmer: Option<JoinHandle<()>>,
    /// A fleet node's lease, renewed until everything is written, then
    /// released.
    lease: Option<(CancellationToken, JoinHandle<()>)>,
}

impl Running {
    /// Returns when `shutdown` resolves or the gRPC server ends on its own.
    pub async fn serve_until(&mut self, shutdown: impl Future<Output = ()>) {
        if self.server_ended.is_some() {
            return;
        }
        tokio::select! {
            () = shutdown => {}
            ended = &mut self.server => self.server_ended = Some(ended),
        }
    }

    /// Stops in order: drains a fleet node that drains itself (its slots
    /// handed to the other nodes, see [`Presence::drain`]), reports not
    /// serving, stops taking connections, gives
    /// the requests under way [`REQUEST_GRACE`], then refuses changes and
    /// writes every unwritten one (see [`WriteBehind::shutdown`]), ends the
    /// backup stream, releases the lease, and last stops the metrics
    /// ([`METRICS_GRACE`]). The report says what could not be written.
    pub async fn stop(mut self) -> Result<ShutdownReport, BoxError> {
        if let Some(presence) = self.drain.take()
            && self.server_ended.is_none()
        {
            tracing::info!(within = ?self.drain_timeout, "draining: handing this node's slots to the others");
            match presence.drain(self.drain_timeout).await {
                Ok(()) => tracing::info!("drained: the other nodes serve this node's slots"),
                Err(e) => {
                    tracing::warn!(error = %e, "not drained; shutting down with the slots still here")
                }
            }
        }
        tracing::info!("shutting down: no new requests; writing unwritten changes");
        if let Some(ready) = self.ready.take() {
            ready.abort();
            let _ = ready.await;
        }
        self.health
            .set_not_serving::<ReadStatesServer<ReadStatesService>>()
            .await;
        self.stop.cancel();
        let server_result = match self.server_ended.take() {
            Some(result) => result,
            None => match tokio::time::timeout(REQUEST_GRACE, &mut self.server).await {
                Ok(result) => result,
                Err(_) => {
                    // Connection tasks may go on; the closed cache refuses
                    // their changes from here on.
                    tracing::warn!("requests still running after {REQUEST_GRACE:?}; cut off");
                    self.server.abort();
                    Ok(Ok(()))
                }
            },
        };
        for task in [
            self.follower.take(),
            self.copier.take(),
            self.tls_reloader.take(),
            self.joiner.take(),
            self.trimmer.take(),
        ]
        .into_iter()
        .flatten()
        {
            let _ = task.await;
        }
        let report = self.write_behind.shutdown(self.shutdown_timeout).await;
        if report.unwritten > 0 {
            tracing::error!(
                unwritten = report.unwritten,
                "read states could not be written before the deadline"
            );
        } else {
            tracing::info!("every change written");
        }
        // Only now: until the final writes are done, the backup holds what
        // they have not written, and takes this node over should its
        // machine be lost meanwhile (the stream breaks, the lease lapses).
        // Ended earlier, the journal alone held it (found in review).
        if let Some((stop, backup)) = self.backup.take() {
            stop.cancel();
            let _ = backup.await;
        }
        if let Some(journal) = self.journal.take() {
            // Kept whole if something is unwritten: the next start replays it.
            let written = report.unwritten == 0;
            tokio::task::spawn_blocking(move || journal.close(written)).await?;
        }
        if let Some((stop, holder)) = self.lease.take() {
            stop.cancel();
            let _ = holder.await;
        }
        // The last bytes of the last connections reach their clients only
        // while their sockets stay open (see `linger`), meanwhile the
        // writes above went on.
        if tokio::time::timeout(LINGER, self.lingering.wait())
            .await
            .is_err()
        {
            tracing::warn!("connections still lingering after {LINGER:?}; closed");
        }
        let _ = self.sampler.await;
        let _ = self.recount.await;
        if tokio::time::timeout(METRICS_GRACE, &mut self.metrics_server)
            .await
            .is_err()
        {
            self.metrics_server.abort();
        }
        server_result??;
        Ok(report)
    }
}

/// Creates the Cassandra keyspace and tables: `readstates migrate`.
pub async fn migrate(cassandra: &CassandraConfig) -> Result<(), BoxError> {
    let session = cassandra::connect(cassandra).await?;
    cassandra::schema::migrate(&session, &cassandra.keyspace, &cassandra.replication).await?;
    Ok(())
}

/// Connections accepted from `listener`, with Nagle's algorithm off: a
/// response is several small writes (headers, data, trailers), and Nagle
/// would hold the later ones until the client's delayed ACK, up to 40 ms.
/// (`Server::tcp_nodelay` only applies to listeners tonic binds itself.)
pub fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

async fn open_store(config: &Config) -> Result<Arc<dyn Store>, BoxError> {
    Ok(match config.store {
        StoreKind::Embedded => Arc::new(EmbeddedStore::open(&config.data_dir)?),
        StoreKind::Memory => {
            tracing::warn!(
                "--store memory keeps nothing across restarts: for tests and benchmarks only"
            );
            Arc::new(MemoryStore::new())
        }
        StoreKind::Cassandra => {
            let cassandra = config.cassandra();
            if config.init_schema {
                migrate(&cassandra).await?;
            }
            Arc::new(CassandraStore::connect(&cassandra).await?)
        }
    })
}
