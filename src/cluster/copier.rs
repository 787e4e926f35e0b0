//! Copies of the channels counted by channel: every node holds every such
//! channel (a member's count is read from it wherever the member is
//! served), and its owner alone changes it. The owner sends what changed
//! to every other node of the ring, whole and coalesced, every
//! [`COPY_EVERY`] (one call per node per tick, whatever the members), and
//! every channel it owns every [`RESEND_EVERY`], for a node that missed a
//! copy. A copy replaces an older one by version (see
//! [`ChannelStates::copy_in`]), so one lost, late or repeated does no harm;
//! a node's counts then lag by a tick, and are never counted twice (a count
//! is a function of the state, never an increment).

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tokio_util::sync::CancellationToken;

use super::member::Member;
use super::peers::GrpcPeers;
use crate::channel_state::ChannelState;
use crate::channel_states::ChannelStates;
use crate::ownership::SlotState;
use crate::proto::CopyChannelsRequest;
use crate::proto::fleet_client::FleetClient;

/// How often the changed channels go out.
pub const COPY_EVERY: Duration = Duration::from_millis(100);
/// How often every channel owned here goes out again.
pub const RESEND_EVERY: Duration = Duration::from_secs(5);
/// How long one node may take to take copies.
const COPY_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub struct Copier {
    member: Member,
    peers: Arc<GrpcPeers>,
    channels: Arc<ChannelStates>,
}

impl Copier {
    pub fn new(member: Member, peers: Arc<GrpcPeers>) -> Arc<Copier> {
        let channels = member.cache().channels().clone();
        channels.keep_changed();
        Arc::new(Copier {
            member,
            peers,
            channels,
        })
    }

    /// Sends copies until `stop`.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(COPY_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let resend_ticks = (RESEND_EVERY.as_millis() / COPY_EVERY.as_millis()).max(1);
        let mut ticks = 0u128;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            ticks += 1;
            let mut copies = self.channels.take_changed();
            if ticks.is_multiple_of(resend_ticks) {
                let ownership = self.member.ownership();
                copies = self
                    .channels
                    .all_of(|id| ownership.state_of(id) == SlotState::Serving);
            }
            if !copies.is_empty()
                && let Err(e) = self.send_to_all(&copies).await
            {
                tracing::debug!(error = %e, "channel copies not taken everywhere; sent again later");
            }
        }
    }

    /// Sends `copies` to every other node that owns slots in the ring (or
    /// in the previous one, still serving while slots move): a node at
    /// weight 0 serves nobody (it may be drained and stopped), and loads
    /// every channel before it acquires a slot. `Ok` once all took them.
    pub async fn send_to_all(&self, copies: &[ChannelState]) -> Result<(), String> {
        let record = self.member.ring();
        let owns_slots =
            |ring: &readstates_routing::Ring, id: &str| ring.slots_of(id).next().is_some();
        let mut addresses: Vec<&str> = (record.ring.nodes().iter())
            .chain(record.previous.nodes())
            .filter(|node| node.id != self.member.id())
            .filter(|node| {
                owns_slots(&record.ring, &node.id) || owns_slots(&record.previous, &node.id)
            })
            .map(|node| node.address.as_str())
            .collect();
        addresses.sort_unstable();
        addresses.dedup();
        let request = CopyChannelsRequest {
            channels: copies.iter().map(Into::into).collect(),
        };
        let sends = addresses.into_iter().map(|address| {
            let request = request.clone();
            async move {
                let channel = self.peers.channel(address)?;
                let mut call = self.peers.request(request);
                call.set_timeout(COPY_TIMEOUT);
                (FleetClient::new(channel).copy_channels(call).await)
                    .map_err(|s| format!("{address}: {}: {}", s.code(), s.message()))
            }
        });
        let failures: Vec<String> = (join_all(sends).await.into_iter())
            .filter_map(Result::err)
            .collect();
        match failures.is_empty() {
            true => Ok(()),
            false => Err(failures.join("; ")),
        }
    }
}
