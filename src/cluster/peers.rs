//! The other nodes of the fleet, as this node calls them: a lazily
//! connected gRPC channel per address (over mTLS when this node serves
//! TLS), shared by `ReleaseSlots`, forwarded requests and the Apply
//! streams that carry them (`HandOver` has a connection of its own). Every
//! call carries the fleet's token ([`GrpcPeers::request`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use readstates_routing::Slot;
use readstates_routing::apply::{Applier, MAX_BATCH};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tonic::metadata::MetadataMap;
use tonic::transport::{Channel, Endpoint};

use super::credential::FleetCredential;
use super::handoff::{self, Handoff, Part};
use crate::proto::fleet_client::FleetClient;
use crate::proto::{
    HandOverFormatRequest, HandOverRequest, MirrorRequest, MirrorResponse, ReleaseSlotsRequest,
};
use crate::tls::{Tls, connector};

/// How long one `ReleaseSlots` call may take: the old owner answers once
/// its users are written, which a slow store can hold up.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 PINGs once a peer has sent nothing for this long: a frozen peer
/// fails what was sent to it within seconds. Slower than a client's
/// (`readstates_routing::client::KEEPALIVE_EVERY`): a false alarm here
/// breaks a backup stream, which then journals everything again.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(1);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a node that refused an Apply stream is sent unary calls
/// before a stream is tried again.
const NO_APPLY_RETRY: Duration = Duration::from_secs(60);

/// What a node asks of other nodes (a seam: simulations answer in-process).
#[async_trait]
pub trait Peers: Send + Sync + std::fmt::Debug {
    /// Asks the node at `address` to release `slots` of `epoch`; `Ok` once
    /// it has (see the `Fleet` service).
    async fn release_slots(
        &self,
        address: &str,
        epoch: u64,
        slots: &[Slot],
        from: &str,
    ) -> Result<(), String>;

    /// Hands the users of `handoff`'s slots to the node at `address`;
    /// `Ok` with the users it installed, once it has them all.
    async fn hand_over(
        &self,
        address: &str,
        handoff: Handoff,
        parts: BoxStream<'static, Part>,
    ) -> Result<usize, String>;

    /// Opens this node's backup stream (`Fleet.Mirror`) to the node at
    /// `address`: `requests` go to it (a queue: what tonic's streaming
    /// client takes from inside a `Send` future), how far it holds them
    /// comes back. A peer that holds no copies (an older build) refuses it.
    async fn mirror(
        &self,
        address: &str,
        requests: mpsc::Receiver<MirrorRequest>,
        from: &str,
    ) -> Result<Mirrored, Status> {
        let _ = (address, requests, from);
        Err(Status::unimplemented("this peer holds no backups"))
    }
}

/// What a backup answers on a `Mirror` stream.
pub type Mirrored = BoxStream<'static, Result<MirrorResponse, Status>>;

/// Peers over gRPC.
#[derive(Debug)]
pub struct GrpcPeers {
    channels: Mutex<HashMap<String, Channel>>,
    streams: Mutex<Streams>,
    /// With it, peers are called over mTLS (this node's own TLS settings).
    tls: Option<Arc<Tls>>,
    /// What shows the other nodes that a call is this node's.
    credential: FleetCredential,
}

/// The Apply streams to other nodes.
#[derive(Debug, Default)]
struct Streams {
    /// By address, and whether for requests passed on.
    open: HashMap<(String, bool), Applier>,
    /// Addresses of nodes that have no Apply, and since when.
    unary_only: HashMap<String, Instant>,
}

impl GrpcPeers {
    pub fn new(tls: Option<Arc<Tls>>, credential: FleetCredential) -> GrpcPeers {
        GrpcPeers {
            channels: Mutex::default(),
            streams: Mutex::default(),
            tls,
            credential,
        }
    }

    /// `message` as a call of this node on another: with the fleet's token.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        self.stamp(request.metadata_mut());
        request
    }

    /// Adds the fleet's token to the metadata of a call on another node.
    pub fn stamp(&self, metadata: &mut MetadataMap) {
        self.credential.stamp(metadata);
    }

    /// The Apply stream to `address` for requests this node forwards, or,
    /// `passed_on`, for those it passes on to a previous owner (each has
    /// its own `metadata`, which marks how its requests came), opened on
    /// first use and again once ended; `None` for a node that refused one
    /// (see [`GrpcPeers::lacks_apply`]).
    pub fn applier(
        &self,
        address: &str,
        passed_on: bool,
        metadata: impl FnOnce() -> MetadataMap,
    ) -> Result<Option<Applier>, String> {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(since) = streams.unary_only.get(address) {
            if since.elapsed() < NO_APPLY_RETRY {
                return Ok(None);
            }
            streams.unary_only.remove(address);
        }
        let key = (address.to_owned(), passed_on);
        if let Some(applier) = streams.open.get(&key)
            && !applier.is_ended()
        {
            return Ok(Some(applier.clone()));
        }
        let applier = Applier::open(self.channel(address)?, metadata(), MAX_BATCH);
        streams.open.insert(key, applier.clone());
        Ok(Some(applier))
    }

    /// The node at `address` refused an Apply stream (an older build has
    /// none; a node at its limit takes no more): it is sent unary calls
    /// for a while.
    pub fn lacks_apply(&self, address: &str) {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        streams
            .unary_only
            .insert(address.to_owned(), Instant::now());
        streams.open.retain(|(a, _), _| a != address);
    }

    /// The channel to `address`, made on first use (connecting lazily, and
    /// again after a failure).
    pub fn channel(&self, address: &str) -> Result<Channel, String> {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(channel) = channels.get(address) {
            return Ok(channel.clone());
        }
        let channel = self.connect(address)?;
        channels.insert(address.to_owned(), channel.clone());
        Ok(channel)
    }

    /// The newest `HandOver` format both this node and the node at
    /// `address` read: format 1 from a build before the question
    /// (UNIMPLEMENTED), and from one that does not answer it (every node
    /// reads format 1; the handoff then goes through or fails as it would).
    async fn hand_over_format(&self, channel: Channel, address: &str) -> u32 {
        let mut request = self.request(HandOverFormatRequest {});
        request.set_timeout(CONNECT_TIMEOUT);
        match FleetClient::new(channel).hand_over_format(request).await {
            Ok(answer) => answer
                .into_inner()
                .format
                .clamp(handoff::PROTOBUF, handoff::FORMAT),
            Err(status) => {
                if status.code() != tonic::Code::Unimplemented {
                    tracing::debug!(address, %status, "HandOverFormat not answered; sending format 1");
                }
                handoff::PROTOBUF
            }
        }
    }

    /// A channel to `address` of its own (connecting lazily).
    fn connect(&self, address: &str) -> Result<Channel, String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|e| format!("{address}: {e}"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            // A frozen peer is noticed in seconds, not when TCP gives up.
            .http2_keep_alive_interval(KEEPALIVE_EVERY)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true);
        Ok(match &self.tls {
            Some(tls) => connector::connect_lazy(&endpoint, tls.clone()),
            None => endpoint.connect_lazy(),
        })
    }
}

#[async_trait]
impl Peers for GrpcPeers {
    async fn release_slots(
        &self,
        address: &str,
        epoch: u64,
        slots: &[Slot],
        from: &str,
    ) -> Result<(), String> {
        let mut client = FleetClient::new(self.channel(address)?);
        let mut request = self.request(ReleaseSlotsRequest {
            epoch,
            slots: slots.iter().map(|&s| u32::from(s)).collect(),
            node_id: from.to_owned(),
        });
        request.set_timeout(RELEASE_TIMEOUT);
        client
            .release_slots(request)
            .await
            .map(|_| ())
            .map_err(|status| format!("{address}: {}: {}", status.code(), status.message()))
    }

    async fn hand_over(
        &self,
        address: &str,
        handoff: Handoff,
        parts: BoxStream<'static, Part>,
    ) -> Result<usize, String> {
        // A connection of its own: on the shared one, the requests this node
        // forwards to that node would queue behind the handoff's data.
        let channel = self.connect(address)?;
        let format = self.hand_over_format(channel.clone(), address).await;
        // Fed from a task: a channel's stream is what tonic's streaming
        // client is known to accept from inside a `Send` future.
        let (send, requests) = mpsc::channel(2);
        tokio::spawn(async move {
            let mut parts = parts;
            let mut first = Some(handoff);
            while let Some(part) = parts.next().await {
                let request = handoff::to_request(part, first.take().as_ref(), format);
                if send.send(request).await.is_err() {
                    return;
                }
            }
        });
        call_hand_over(channel, self.request(ReceiverStream::new(requests)))
            .await
            .map_err(|status| format!("{address}: {}: {}", status.code(), status.message()))
    }

    async fn mirror(
        &self,
        address: &str,
        requests: mpsc::Receiver<MirrorRequest>,
        _from: &str,
    ) -> Result<Mirrored, Status> {
        let channel = self.channel(address).map_err(Status::unavailable)?;
        call_mirror(channel, self.request(ReceiverStream::new(requests))).await
    }
}

/// One `HandOver` call.
async fn call_hand_over(
    channel: Channel,
    requests: tonic::Request<ReceiverStream<HandOverRequest>>,
) -> Result<usize, tonic::Status> {
    // No deadline: the sender bounds each step instead (see
    // `Member::hand_over`), since a large handoff takes a while.
    let response = FleetClient::new(channel).hand_over(requests).await?;
    Ok(response.into_inner().users_installed as usize)
}

/// One `Mirror` call.
async fn call_mirror(
    channel: Channel,
    requests: tonic::Request<ReceiverStream<MirrorRequest>>,
) -> Result<Mirrored, Status> {
    let responses = FleetClient::new(channel).mirror(requests).await?;
    Ok(responses.into_inner().boxed())
}
