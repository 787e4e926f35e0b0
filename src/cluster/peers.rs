//! The other nodes of the fleet, as this node calls them: a lazily
//! connected gRPC channel per address (over mTLS when this node serves
//! TLS), shared by `ReleaseSlots`, `HandOver` and forwarded requests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use readstates_routing::Slot;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use super::handoff::{self, Handoff, Part};
use crate::proto::fleet_client::FleetClient;
use crate::proto::{HandOverRequest, ReleaseSlotsRequest};
use crate::tls::{Tls, connector};

/// How long one `ReleaseSlots` call may take: the old owner answers once
/// its users are written, which a slow store can hold up.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

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
}

/// Peers over gRPC.
#[derive(Debug, Default)]
pub struct GrpcPeers {
    channels: Mutex<HashMap<String, Channel>>,
    /// With it, peers are called over mTLS (this node's own TLS settings).
    tls: Option<Arc<Tls>>,
}

impl GrpcPeers {
    pub fn new(tls: Option<Arc<Tls>>) -> GrpcPeers {
        GrpcPeers {
            channels: Mutex::default(),
            tls,
        }
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

    /// A channel to `address` of its own (connecting lazily).
    fn connect(&self, address: &str) -> Result<Channel, String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|e| format!("{address}: {e}"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
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
        let mut request = tonic::Request::new(ReleaseSlotsRequest {
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
        // Fed from a task: a channel's stream is what tonic's streaming
        // client is known to accept from inside a `Send` future.
        let (send, requests) = tokio::sync::mpsc::channel(2);
        tokio::spawn(async move {
            let mut parts = parts;
            let mut first = Some(handoff);
            while let Some(part) = parts.next().await {
                let request = handoff::to_request(part, first.take().as_ref());
                if send.send(request).await.is_err() {
                    return;
                }
            }
        });
        call_hand_over(channel, ReceiverStream::new(requests))
            .await
            .map_err(|status| format!("{address}: {}: {}", status.code(), status.message()))
    }
}

/// One `HandOver` call.
async fn call_hand_over(
    channel: Channel,
    requests: ReceiverStream<HandOverRequest>,
) -> Result<usize, tonic::Status> {
    // No deadline: the sender bounds each step instead (see
    // `Member::hand_over`), since a large handoff takes a while.
    let response = FleetClient::new(channel)
        .hand_over(tonic::Request::new(requests))
        .await?;
    Ok(response.into_inner().users_installed as usize)
}
