//! The other nodes of the fleet, as this node calls them: a lazily
//! connected gRPC channel per address (over mTLS when this node serves
//! TLS), shared by `ReleaseSlots` and by forwarded requests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use readstates_routing::Slot;
use tonic::transport::{Channel, Endpoint};

use crate::proto::ReleaseSlotsRequest;
use crate::proto::fleet_client::FleetClient;
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
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|e| format!("{address}: {e}"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        let channel = match &self.tls {
            Some(tls) => connector::connect_lazy(&endpoint, tls.clone()),
            None => endpoint.connect_lazy(),
        };
        channels.insert(address.to_owned(), channel.clone());
        Ok(channel)
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
}
