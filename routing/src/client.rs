//! A client for a fleet: reads the routing table from any node, sends each
//! request straight to its user's owner (one HTTP/2 channel per node), and
//! retries what was not applied: an `UNAVAILABLE` naming a newer epoch in
//! its trailers (`x-readstates-epoch`) means "your table is old", so it
//! reads the table again and retries there at once; any other
//! `UNAVAILABLE` (a slot being moved, a node restarting or draining), a
//! request the transport cancelled before sending it (its connection went
//! away), and one a node going away refused unprocessed (GOAWAY), is
//! retried after a short backoff, the table read again, until the
//! retry budget ([`FleetClient::with_retry_budget`]) runs out. Neither was
//! applied. So is a request whose connection broke before its answer (a
//! node killed): it may have been applied, and applied again it counts
//! nothing twice.
//!
//! Channels are plaintext unless made by the caller
//! ([`FleetClient::connect_with`]: TLS, say).
//!
//! Requests that touch many users (MessageCreated, GetBadgeCounts, ...) may
//! go to any node, which splits them by owner; [`FleetClient::for_user`]
//! with one of their users saves a hop for that user's part.
//!
//! [`FleetClient::apply`] sends changes as items of one Apply stream per
//! node instead of a call each (see [`crate::apply`]), retried the same
//! way; an item whose stream ended before its answer is sent again too
//! (it may have been applied, and a change counts nothing twice).
//!
//! A frozen node answers nothing and keeps its sockets open. Its channel's
//! HTTP/2 PINGs fail the calls in flight within [`KEEPALIVE_EVERY`] +
//! [`KEEPALIVE_TIMEOUT`]; from then on, for [`SUSPECT_FOR`], the node is
//! *suspect* and each try sent to it is given [`SUSPECT_TRY`] to answer,
//! then sent again at once (to the owner the table names), so that a call
//! finds the node's slots served elsewhere a moment after its backup took
//! it over (about 1.5 s after the freeze), not a keepalive later. A node
//! that answers a try is cleared; one only slow, not frozen, is tried with
//! no bound again once the window has passed, so a false alarm costs a
//! dozen tries a call at most, not a storm.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tonic::metadata::MetadataMap;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Response, Status};

use crate::apply::{Applier, MAX_BATCH, is_unanswered};
use crate::proto::apply_item::Change;
use crate::proto::apply_result::Outcome;
use crate::proto::read_states_client::ReadStatesClient;
use crate::proto::{GetRoutingTableRequest, GetRoutingTableResponse};
use crate::ring::{NO_OWNER, Node, Ring};
pub use crate::status::{
    ALL_ANSWERED, EPOCH, FORWARDED, OWNER, SAFE_TO_RETRY, cut_in_flight, is_cut, not_applied,
    refused_by_goaway, safe_to_retry,
};

/// How long a call retries "not applied" answers by default: longer than a
/// slot takes to move, or a node to restart.
pub const RETRY_BUDGET: Duration = Duration::from_secs(10);
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// Retries read the table at most this often (see
/// [`FleetClient::refresh_for_retry`]).
const REFRESH_EVERY: Duration = Duration::from_millis(50);
/// How long a retry's read of the table may take.
const REFRESH_WITHIN: Duration = Duration::from_secs(1);
/// How long a try sent to a suspect node (its connection failed, and it
/// has not answered since) waits before it is sent again: a live node
/// mostly answers sooner, and a frozen one's slots are taken over within
/// about a second and a half of the freeze (`docs/failover.md`).
pub const SUSPECT_TRY: Duration = Duration::from_millis(250);
/// How long after its connection failed a node stays suspect: past a
/// frozen node's takeover.
pub const SUSPECT_FOR: Duration = Duration::from_secs(3);

#[derive(Clone, Debug)]
pub struct FleetClient {
    inner: Arc<Inner>,
    retry_budget: Duration,
}

#[derive(Debug)]
struct Inner {
    /// The node first connected to: asked for the table, and sent requests
    /// when the table names no owner (a standalone node).
    entry: Channel,
    ring: RwLock<Arc<Ring>>,
    /// By address.
    channels: Mutex<HashMap<String, Channel>>,
    /// Apply streams by address (the entry node's under "").
    streams: Mutex<HashMap<String, Applier>>,
    connect: Connect,
    /// When a retry last read the table: retries share reads (see
    /// [`FleetClient::refresh_for_retry`]).
    refreshed: tokio::sync::Mutex<Option<tokio::time::Instant>>,
    /// Which node of the table a retry's read asks next.
    asked: AtomicUsize,
    /// Nodes whose connection failed, and which have not answered since,
    /// by address (the entry node's under ""): when it failed (see the
    /// module doc).
    suspects: Mutex<HashMap<String, tokio::time::Instant>>,
}

/// Makes the channel to a node at `host:port`, as the caller wants it
/// (over TLS, with its timeouts); it may connect lazily.
#[derive(Clone)]
pub struct Connect(Arc<MakeChannel>);

type MakeChannel = dyn Fn(&str) -> Result<Channel, Status> + Send + Sync;

impl Connect {
    pub fn new(connect: impl Fn(&str) -> Result<Channel, Status> + Send + Sync + 'static) -> Self {
        Connect(Arc::new(connect))
    }

    /// Plaintext, connecting lazily.
    pub fn plaintext() -> Self {
        Connect::new(|address| Ok(endpoint(address)?.connect_lazy()))
    }
}

impl std::fmt::Debug for Connect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Connect")
    }
}

impl FleetClient {
    /// Connects to `entry` (`host:port` of any node) in plaintext and reads
    /// the table.
    pub async fn connect(entry: &str) -> Result<FleetClient, Status> {
        let channel = endpoint(entry)?
            .connect()
            .await
            .map_err(|e| Status::unavailable(format!("connect to {entry}: {e}")))?;
        FleetClient::start(channel, Connect::plaintext()).await
    }

    /// Reads the table from `entry`, every channel made by `connect`.
    pub async fn connect_with(entry: &str, connect: Connect) -> Result<FleetClient, Status> {
        FleetClient::start((connect.0)(entry)?, connect).await
    }

    async fn start(entry: Channel, connect: Connect) -> Result<FleetClient, Status> {
        let client = FleetClient {
            inner: Arc::new(Inner {
                entry,
                ring: RwLock::new(Arc::new(Ring::empty())),
                channels: Mutex::default(),
                streams: Mutex::default(),
                connect,
                refreshed: tokio::sync::Mutex::new(None),
                asked: AtomicUsize::new(0),
                suspects: Mutex::default(),
            }),
            retry_budget: RETRY_BUDGET,
        };
        client.refresh().await?;
        Ok(client)
    }

    /// Reads the table again, from the entry node or, if it does not
    /// answer (restarting, say), from the other nodes of the table in
    /// turn; returns its epoch.
    pub async fn refresh(&self) -> Result<u64, Status> {
        let mut table = read_table(self.inner.entry.clone()).await;
        if table.is_err() {
            for node in self.ring().nodes() {
                let answer = read_table(self.channel(node)).await;
                if answer.is_ok() {
                    table = answer;
                    break;
                }
            }
        }
        Ok(self.adopt(table?))
    }

    /// Takes `ring` unless the table held is newer; returns its epoch.
    fn adopt(&self, ring: Ring) -> u64 {
        let epoch = ring.epoch();
        let mut current = self.inner.ring.write().unwrap_or_else(|e| e.into_inner());
        if epoch >= current.epoch() {
            *current = Arc::new(ring);
        }
        epoch
    }

    /// Reads the table again for a retry, unless one was read less than
    /// [`REFRESH_EVERY`] ago: while a node is down, thousands of requests
    /// retry at once, and each reading the whole table was a storm on the
    /// entry node. Concurrent callers wait for the read under way, which
    /// is bounded ([`REFRESH_WITHIN`]: a frozen entry node holds no retry
    /// up). With no newer table from the entry node (frozen, or cut off
    /// from the ring store and fenced, it may hold an old one), the next
    /// node of the table is asked too, one per read, in turn.
    async fn refresh_for_retry(&self) {
        let mut refreshed = self.inner.refreshed.lock().await;
        if refreshed.is_some_and(|at| at.elapsed() < REFRESH_EVERY) {
            return;
        }
        let held = self.ring().epoch();
        let read = tokio::time::timeout(REFRESH_WITHIN, self.refresh()).await;
        if !matches!(read, Ok(Ok(epoch)) if epoch > held) {
            let ring = self.ring();
            let nodes = ring.nodes();
            if !nodes.is_empty() {
                let next = self.inner.asked.fetch_add(1, Ordering::Relaxed) % nodes.len();
                let read = read_table(self.channel(&nodes[next]));
                if let Ok(Ok(ring)) = tokio::time::timeout(REFRESH_WITHIN, read).await {
                    self.adopt(ring);
                }
            }
        }
        *refreshed = Some(tokio::time::Instant::now());
    }

    /// The table as last read.
    pub fn ring(&self) -> Arc<Ring> {
        self.inner
            .ring
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A client of `user_id`'s owner (the entry node if nobody owns it).
    pub fn for_user(&self, user_id: u64) -> ReadStatesClient<Channel> {
        ReadStatesClient::new(self.route(user_id).1)
    }

    /// The address of `user_id`'s owner and a channel to it ("" and the
    /// entry node's if nobody owns it).
    fn route(&self, user_id: u64) -> (String, Channel) {
        match self.ring().owner_of(user_id) {
            Some(node) => (node.address.clone(), self.channel(node)),
            None => (String::new(), self.inner.entry.clone()),
        }
    }

    /// This client, retrying "not applied" answers for at most `budget`
    /// (zero: never).
    pub fn with_retry_budget(mut self, budget: Duration) -> FleetClient {
        self.retry_budget = budget;
        self
    }

    /// Runs `call` at `user_id`'s owner, retrying "not applied" answers
    /// (see the module doc).
    pub async fn call<R, F, Fut>(&self, user_id: u64, call: F) -> Result<R, Status>
    where
        F: Fn(ReadStatesClient<Channel>) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
    {
        self.send(user_id, |client| {
            let answer = call(client);
            async move { answer.await.map(Response::into_inner) }
        })
        .await
    }

    /// [`FleetClient::call`] for a `send` that answers with anything.
    pub async fn send<T, F, Fut>(&self, user_id: u64, send: F) -> Result<T, Status>
    where
        F: Fn(ReadStatesClient<Channel>) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        self.retrying(|| {
            let (address, channel) = self.route(user_id);
            (address, send(ReadStatesClient::new(channel)))
        })
        .await
    }

    /// Applies `change` of `user_id` (of a change to many users, any one:
    /// its owner splits the rest off) as an item of the Apply stream to
    /// its owner, within `timeout` if given (each try gets what is left of
    /// it), retrying as [`FleetClient::call`] does; its outcome, or its
    /// error as the unary call's status.
    pub async fn apply(
        &self,
        user_id: u64,
        change: Change,
        timeout: Option<Duration>,
    ) -> Result<Outcome, Status> {
        let until = timeout.map(|timeout| tokio::time::Instant::now() + timeout);
        self.retrying(|| {
            let ((address, applier), change) = (self.applier(user_id), change.clone());
            let left =
                until.map(|until| until.saturating_duration_since(tokio::time::Instant::now()));
            (address, async move { applier.apply(change, left).await })
        })
        .await
    }

    /// The Apply stream to `user_id`'s owner (the entry node if nobody
    /// owns it), opened again once ended, and the owner's address.
    fn applier(&self, user_id: u64) -> (String, Applier) {
        let (address, channel) = self.route(user_id);
        let mut streams = self.inner.streams.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(applier) = streams.get(&address)
            && !applier.is_ended()
        {
            return (address, applier.clone());
        }
        let applier = Applier::open(channel, MetadataMap::new(), MAX_BATCH);
        streams.insert(address.clone(), applier.clone());
        (address, applier)
    }

    /// Runs `attempt` (the address it is sent to, and the try) until it
    /// is answered with anything but "not applied", or the retry budget
    /// runs out (see the module doc).
    async fn retrying<T, Fut>(&self, attempt: impl Fn() -> (String, Fut)) -> Result<T, Status>
    where
        Fut: Future<Output = Result<T, Status>>,
    {
        let deadline = tokio::time::Instant::now() + self.retry_budget;
        let mut backoff = FIRST_BACKOFF;
        loop {
            let (address, answer) = attempt();
            let status = match self.suspected(&address, answer).await {
                Ok(Ok(answer)) => return Ok(answer),
                Ok(Err(status)) if not_applied(&status) => status,
                Ok(Err(status)) => return Err(status),
                // Waited out already: sent again at once, to the owner the
                // table (read again) names; the suspicion's window bounds
                // how long a node is tried this often.
                Err(_) if tokio::time::Instant::now() < deadline => {
                    self.refresh_for_retry().await;
                    continue;
                }
                Err(unanswered) => return Err(unanswered),
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(status);
            }
            // A newer table: read it (or wait for the read under way), and
            // go there at once if it is read.
            if self.is_newer(&status) {
                self.refresh_for_retry().await;
                if !self.is_newer(&status) {
                    continue;
                }
            }
            if tokio::time::Instant::now() + backoff >= deadline {
                return Err(status);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
            self.refresh_for_retry().await;
        }
    }

    /// `answer` from the node at `address`, given [`SUSPECT_TRY`] if the
    /// node is suspect; past it, `Err` with an error that says the try is
    /// safe to send again (it may have been applied, and applied again it
    /// counts nothing twice). A failed connection (a call cut in flight,
    /// or an Apply stream broken before the item's answer) makes the node
    /// suspect for [`SUSPECT_FOR`]; an answer from it clears it.
    async fn suspected<T>(
        &self,
        address: &str,
        answer: impl Future<Output = Result<T, Status>>,
    ) -> Result<Result<T, Status>, Status> {
        let suspects = || {
            self.inner
                .suspects
                .lock()
                .unwrap_or_else(|e| e.into_inner())
        };
        let since = suspects().get(address).copied();
        let suspect = since.is_some_and(|since| since.elapsed() < SUSPECT_FOR);
        let answer = match suspect {
            true => tokio::time::timeout(SUSPECT_TRY, answer)
                .await
                .map_err(|_| {
                    safe_to_retry(Status::unavailable(format!(
                        "{address} did not answer within {SUSPECT_TRY:?} (its connection \
                         failed a moment ago)"
                    )))
                })?,
            false => answer.await,
        };
        match &answer {
            Ok(_) if since.is_some() => {
                suspects().remove(address);
            }
            Err(status) if cut_in_flight(status) || is_cut(status) || is_unanswered(status) => {
                let mut suspects = suspects();
                suspects.retain(|_, since| since.elapsed() < SUSPECT_FOR);
                suspects.insert(address.to_owned(), tokio::time::Instant::now());
            }
            _ => {}
        }
        Ok(answer)
    }

    /// A refusal from a node whose table is newer than ours.
    fn is_newer(&self, status: &Status) -> bool {
        status.code() == Code::Unavailable
            && status
                .metadata()
                .get(EPOCH)
                .and_then(|e| e.to_str().ok()?.parse::<u64>().ok())
                .is_some_and(|epoch| epoch > self.ring().epoch())
    }

    fn channel(&self, node: &Node) -> Channel {
        let mut channels = self
            .inner
            .channels
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(channel) = channels.get(&node.address) {
            return channel.clone();
        }
        let channel = match (self.inner.connect.0)(&node.address) {
            Ok(channel) => channel,
            // A table naming a bad address: the entry node forwards.
            Err(_) => self.inner.entry.clone(),
        };
        channels.insert(node.address.clone(), channel.clone());
        channel
    }
}

/// HTTP/2 PINGs on every channel to a node, once it has sent nothing for
/// this long, so that a frozen node (its socket open, nothing answered)
/// fails the calls sent to it within a second, and they are retried
/// elsewhere, instead of waiting for TCP. A PING costs a node one frame.
pub const KEEPALIVE_EVERY: Duration = Duration::from_millis(250);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_millis(500);

fn endpoint(address: &str) -> Result<Endpoint, Status> {
    Endpoint::from_shared(format!("http://{address}"))
        .map(|e| {
            e.tcp_nodelay(true)
                .http2_keep_alive_interval(KEEPALIVE_EVERY)
                .keep_alive_timeout(KEEPALIVE_TIMEOUT)
                .keep_alive_while_idle(true)
        })
        .map_err(|e| Status::invalid_argument(format!("address {address}: {e}")))
}

/// The table as the node behind `channel` holds it.
async fn read_table(channel: Channel) -> Result<Ring, Status> {
    let table = ReadStatesClient::new(channel)
        .get_routing_table(GetRoutingTableRequest {})
        .await?;
    to_ring(table.into_inner())
}

/// The table as a [`Ring`] (owners past the node list: nobody).
fn to_ring(table: GetRoutingTableResponse) -> Result<Ring, Status> {
    if table.epoch == 0 {
        return Ok(Ring::empty());
    }
    let nodes: Vec<Node> = table
        .nodes
        .into_iter()
        .map(|n| Node {
            id: n.id,
            address: n.address,
            weight: n.weight,
        })
        .collect();
    let owners = table
        .slot_owners
        .iter()
        .map(|&o| {
            u16::try_from(o)
                .ok()
                .filter(|&o| usize::from(o) < nodes.len())
                .unwrap_or(NO_OWNER)
        })
        .collect();
    Ring::from_parts(table.epoch, nodes, owners)
        .map_err(|e| Status::internal(format!("routing table: {e}")))
}
