//! The `readstates.v1.ReadStates` gRPC service: one file per RPC, each
//! turning a request into validated domain calls on the cache.
//!
//! Every call takes the path in [`pipeline`]: routed to its user's owner or
//! split by owner, then run, which bounds the requests in progress, records
//! the method's status and latency, and maps [`Error`] to a gRPC status.

mod ack;
mod ack_all;
pub mod apply;
mod bulk_ack;
mod by_channel;
mod change_channel;
mod convert;
mod deadline;
mod delete_read_states;
pub mod fleet;
mod follow_thread;
mod forward;
mod get_badge_counts;
mod get_read_states;
mod get_routing_table;
mod hand_over;
mod in_progress;
mod message_created;
mod message_deleted;
mod mirror;
pub mod node_calls;
mod pipeline;
mod recipients;
mod reply;
pub mod route;
mod scatter;
mod set_channel_counting;
mod set_muted;
mod timed;
pub mod validate;
mod watch;

use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status, Streaming};

use crate::cache::Cache;
use crate::config::{Config, FleetAuth};
use crate::metrics::MethodMetrics;
use crate::proto::read_states_server::ReadStates;
use crate::proto::*;
use in_progress::InProgress;

/// What the service takes from the configuration.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// Requests in progress beyond which new ones are refused.
    pub max_in_progress: usize,
    /// Events one Watch stream holds for its client.
    pub watch_buffer: usize,
    /// This node's id (`standalone` without one), a label of its metrics.
    pub node: String,
    /// Apply streams served at once.
    pub max_apply_streams: usize,
    /// Thread read states are taken (see `Config::threads`).
    pub threads: bool,
    /// Requests slower than this are logged with their breakdown
    /// (`Config::slow_request`; zero: none).
    pub slow_request: std::time::Duration,
}

impl From<&Config> for ServiceConfig {
    fn from(config: &Config) -> ServiceConfig {
        ServiceConfig {
            max_in_progress: config.max_concurrent_requests,
            watch_buffer: config.watch_buffer,
            node: config
                .node_id
                .clone()
                .unwrap_or_else(|| "standalone".to_owned()),
            max_apply_streams: config.max_apply_streams,
            threads: config.threads,
            slow_request: config.slow_request,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ReadStatesService {
    cache: Arc<Cache>,
    in_progress: Arc<InProgress>,
    config: ServiceConfig,
    /// Cancelled when shutdown begins: Watch streams end with UNAVAILABLE.
    stopping: CancellationToken,
    metrics: Arc<Methods>,
    /// Each Apply item kind's metrics.
    item_metrics: Arc<apply::ItemMetrics>,
    /// Bounds the Apply streams.
    apply_streams: Arc<Semaphore>,
    /// What the Apply streams hold, node-wide.
    apply_memory: apply::Memory,
    /// A fleet node's ring and peers; `None` when standalone.
    router: Option<route::Router>,
    /// Who may speak as a node.
    node_calls: node_calls::NodeCalls,
}

/// Each method's request metrics.
#[derive(Debug)]
struct Methods {
    get_read_states: MethodMetrics,
    ack: MethodMetrics,
    bulk_ack: MethodMetrics,
    message_created: MethodMetrics,
    delete_read_states: MethodMetrics,
    get_badge_counts: MethodMetrics,
    ack_all: MethodMetrics,
    message_deleted: MethodMetrics,
    set_muted: MethodMetrics,
    set_channel_counting: MethodMetrics,
    follow_thread: MethodMetrics,
    watch: MethodMetrics,
    apply: MethodMetrics,
    get_routing_table: MethodMetrics,
}

impl Methods {
    fn new(node: &str) -> Methods {
        Methods {
            get_read_states: MethodMetrics::new("GetReadStates", node),
            ack: MethodMetrics::new("Ack", node),
            bulk_ack: MethodMetrics::new("BulkAck", node),
            message_created: MethodMetrics::new("MessageCreated", node),
            delete_read_states: MethodMetrics::new("DeleteReadStates", node),
            get_badge_counts: MethodMetrics::new("GetBadgeCounts", node),
            ack_all: MethodMetrics::new("AckAll", node),
            message_deleted: MethodMetrics::new("MessageDeleted", node),
            set_muted: MethodMetrics::new("SetMuted", node),
            set_channel_counting: MethodMetrics::new("SetChannelCounting", node),
            follow_thread: MethodMetrics::new("FollowThread", node),
            watch: MethodMetrics::new("Watch", node),
            apply: MethodMetrics::new("Apply", node),
            get_routing_table: MethodMetrics::new("GetRoutingTable", node),
        }
    }
}

/// Where a request came from and how long it may take: read from a unary
/// call's metadata, or from an Apply stream's and its batch's.
#[derive(Clone, Debug)]
struct Origin {
    started: Instant,
    until: Option<Instant>,
    hop: route::Hop,
    /// The epoch of the node that sent it on, if it said (see
    /// [`route::Router::send`]); 0 otherwise.
    epoch: u64,
}

impl Origin {
    fn of(metadata: &MetadataMap, hop: route::Hop) -> Origin {
        let started = Instant::now();
        let epoch = match hop {
            route::Hop::First => 0,
            _ => route::epoch_of(metadata),
        };
        Origin {
            started,
            until: deadline::budget(metadata).map(|budget| started + budget),
            hop,
            epoch,
        }
    }
}

impl ReadStatesService {
    pub fn new(
        cache: Arc<Cache>,
        config: ServiceConfig,
        stopping: CancellationToken,
    ) -> ReadStatesService {
        let metrics = Methods::new(&config.node);
        ReadStatesService {
            cache,
            in_progress: Arc::new(InProgress::new(config.max_in_progress)),
            stopping,
            metrics: Arc::new(metrics),
            item_metrics: Arc::new(apply::ItemMetrics::new(&config.node)),
            apply_streams: Arc::new(Semaphore::new(config.max_apply_streams)),
            apply_memory: apply::Memory::default(),
            router: None,
            node_calls: node_calls::NodeCalls::new(None, FleetAuth::Required),
            config,
        }
    }

    /// Takes calls marked as a node's only as `node_calls` says (see
    /// [`node_calls`]); without it, none.
    pub fn trusting(mut self, node_calls: node_calls::NodeCalls) -> ReadStatesService {
        self.node_calls = node_calls;
        self
    }

    /// How far `request` has come, refused (PERMISSION_DENIED) if it says
    /// a node sent it and no node did.
    fn hop_of<T>(&self, request: &Request<T>) -> Result<route::Hop, Status> {
        let hop = route::Hop::of(request.metadata());
        (self.node_calls).read_states(&hop, request.metadata(), request.remote_addr())?;
        Ok(hop)
    }

    /// A node of a fleet: routes by `router` (see [`route`]).
    pub fn routed(mut self, router: route::Router) -> ReadStatesService {
        self.router = Some(router);
        self
    }
}

#[tonic::async_trait]
impl ReadStates for ReadStatesService {
    async fn get_read_states(
        &self,
        request: Request<GetReadStatesRequest>,
    ) -> Result<Response<GetReadStatesResponse>, Status> {
        self.call_routed(
            &self.metrics.get_read_states,
            request,
            get_read_states::handle,
        )
        .await
    }

    async fn ack(&self, request: Request<AckRequest>) -> Result<Response<AckResponse>, Status> {
        self.call_routed(&self.metrics.ack, request, ack::handle)
            .await
    }

    async fn bulk_ack(
        &self,
        request: Request<BulkAckRequest>,
    ) -> Result<Response<BulkAckResponse>, Status> {
        self.call_routed(&self.metrics.bulk_ack, request, bulk_ack::handle)
            .await
    }

    async fn message_created(
        &self,
        request: Request<MessageCreatedRequest>,
    ) -> Result<Response<MessageCreatedResponse>, Status> {
        self.takes_threads(request.get_ref().kind)?;
        self.call_scattered(
            &self.metrics.message_created,
            request,
            message_created::handle,
        )
        .await
    }

    async fn delete_read_states(
        &self,
        request: Request<DeleteReadStatesRequest>,
    ) -> Result<Response<DeleteReadStatesResponse>, Status> {
        self.call_routed(
            &self.metrics.delete_read_states,
            request,
            delete_read_states::handle,
        )
        .await
    }

    async fn get_badge_counts(
        &self,
        request: Request<GetBadgeCountsRequest>,
    ) -> Result<Response<GetBadgeCountsResponse>, Status> {
        self.call_scattered(
            &self.metrics.get_badge_counts,
            request,
            get_badge_counts::handle,
        )
        .await
    }

    async fn ack_all(
        &self,
        request: Request<AckAllRequest>,
    ) -> Result<Response<AckAllResponse>, Status> {
        self.call_routed(&self.metrics.ack_all, request, ack_all::handle)
            .await
    }

    async fn message_deleted(
        &self,
        request: Request<MessageDeletedRequest>,
    ) -> Result<Response<MessageDeletedResponse>, Status> {
        self.call_scattered(
            &self.metrics.message_deleted,
            request,
            message_deleted::handle,
        )
        .await
    }

    async fn set_muted(
        &self,
        request: Request<SetMutedRequest>,
    ) -> Result<Response<SetMutedResponse>, Status> {
        self.call_routed(&self.metrics.set_muted, request, set_muted::handle)
            .await
    }

    async fn follow_thread(
        &self,
        request: Request<FollowThreadRequest>,
    ) -> Result<Response<FollowThreadResponse>, Status> {
        // Leaving a thread makes nothing: taken with threads off too.
        if request.get_ref().follow {
            self.takes_threads(ReadStateKind::Thread as i32)?;
        }
        self.call_routed(&self.metrics.follow_thread, request, follow_thread::handle)
            .await
    }

    /// On a fleet, made by the channel's owner (forwarded there).
    async fn set_channel_counting(
        &self,
        request: Request<SetChannelCountingRequest>,
    ) -> Result<Response<SetChannelCountingResponse>, Status> {
        let copier = self.router.as_ref().map(|router| router.copier.clone());
        self.call_routed(&self.metrics.set_channel_counting, request, |cache, r| {
            set_channel_counting::handle(cache, copier.clone(), r)
        })
        .await
    }

    type WatchStream = watch::WatchStream;

    /// A stream is not a request in progress: it takes no permit and has no
    /// deadline; its status is recorded when it starts.
    async fn watch(
        &self,
        request: Request<Streaming<WatchRequest>>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let started = Instant::now();
        // A stream relayed from another node subscribes only here.
        let router = match self.hop_of(&request)? {
            route::Hop::First => self.router.clone(),
            _ => None,
        };
        let stream = watch::handle(
            self.cache.clone(),
            request.into_inner(),
            self.config.watch_buffer,
            self.stopping.clone(),
            router,
        );
        self.metrics
            .watch
            .record(tonic::Code::Ok, started.elapsed());
        Ok(Response::new(stream))
    }

    type ApplyStream = apply::ApplyStream;

    /// Like Watch, a stream takes no request permit of its own (each item
    /// does) and its status is recorded when it starts. The streams of
    /// other nodes (two a node, carrying what they forward) are not
    /// counted against `max_apply_streams`: clients filling it must not
    /// cut the fleet off from this node.
    async fn apply(
        &self,
        request: Request<Streaming<ApplyRequest>>,
    ) -> Result<Response<Self::ApplyStream>, Status> {
        let started = Instant::now();
        let hop = self.hop_of(&request)?;
        let permit = match hop {
            route::Hop::First => match self.apply_streams.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    let status = Status::resource_exhausted(format!(
                        "this node serves {} Apply streams, the most it takes; retry later or \
                         use fewer streams",
                        self.config.max_apply_streams
                    ));
                    self.metrics.apply.record(status.code(), started.elapsed());
                    return Err(status);
                }
            },
            _ => None,
        };
        let stream = apply::handle(self.clone(), request.into_inner(), hop, permit);
        self.metrics
            .apply
            .record(tonic::Code::Ok, started.elapsed());
        Ok(Response::new(stream))
    }

    async fn get_routing_table(
        &self,
        _request: Request<GetRoutingTableRequest>,
    ) -> Result<Response<GetRoutingTableResponse>, Status> {
        let started = Instant::now();
        let member = self.router.as_ref().map(|router| &router.member);
        let table = get_routing_table::handle(member);
        self.metrics
            .get_routing_table
            .record(tonic::Code::Ok, started.elapsed());
        Ok(Response::new(table))
    }
}
