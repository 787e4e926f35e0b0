//! A channel counted by channel on a fleet: its owner (the node serving the
//! slot of its id) alone changes it. A node taking a message (or deletion)
//! of such a channel has its owner make the channel's change first
//! ([`Router::change_channel`]: here if it is the owner, else `Fleet.
//! ChangeChannel`), then sends the users' parts to their owners marked
//! with the owner's answer (see [`super::by_channel::Counted`]). The other
//! nodes get the channel's new state from the owner's copier (see
//! [`crate::cluster::copier`]), and from the answer at once.

use std::time::Duration;

use tokio::time::Instant;
use tonic::{Code, Status};

use super::by_channel;
use super::route::{EPOCH, HOLD, PASSED_ON, Router};
use super::validate;
use crate::cache::Cache;
use crate::channel_state::ChannelState;
use crate::error::Error;
use crate::ownership::SlotState;
use crate::proto::fleet_client::FleetClient;
use crate::proto::{ChangeChannelRequest, ChangeChannelResponse};
use crate::timing::{self, Phase};

/// How long a call to a channel's owner may take without a deadline of the
/// request's own.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(5);

/// The owner's part: the channel takes (or lets go of) the message, if this
/// node serves its slot (`NotServed` otherwise), written through in
/// write-through mode, journaled otherwise.
pub async fn handle(
    cache: &Cache,
    request: &ChangeChannelRequest,
) -> Result<ChangeChannelResponse, Error> {
    let channel_id = validate::id("channel_id", request.channel_id)?;
    let message_id = validate::id("message_id", request.message_id)?;
    let changed = cache.change_channel(channel_id, |channels, now_us| {
        channels.update(channel_id, |channel| {
            let changed = match request.deleted {
                false => channel.message_created(message_id, now_us),
                true => channel.message_deleted(message_id, now_us),
            };
            (changed, channel.holds(message_id), channel.clone())
        })
    })?;
    let Some((changed, holds, state)) = changed else {
        return Ok(ChangeChannelResponse::default());
    };
    by_channel::write_through(cache.channels(), channel_id).await?;
    cache.confirmed().await?;
    Ok(ChangeChannelResponse {
        counted: true,
        changed,
        holds,
        state: Some((&state).into()),
    })
}

impl Router {
    /// Has the owner of `request`'s channel make its change: here, or at
    /// the owner as this node's ring says (a refusal names a newer ring:
    /// this node catches up and asks once more). The answer's state is
    /// taken in as this node's copy. UNAVAILABLE: the change was not made.
    pub async fn change_channel(
        &self,
        cache: &Cache,
        request: ChangeChannelRequest,
        until: Option<Instant>,
    ) -> Result<ChangeChannelResponse, Status> {
        let channel_id = request.channel_id;
        let mut refusal = None;
        for _ in 0..2 {
            let answer = match self.destination(channel_id) {
                None => self.change_here(cache, &request, until).await,
                Some(owner) => self.ask_owner(&owner, request, until, false).await,
            };
            match answer {
                Ok(answer) => {
                    if let Some(state) = answer.state.clone() {
                        let ownership = self.member.ownership();
                        cache
                            .channels()
                            .copy_in(vec![ChannelState::from(state)], |id| {
                                ownership.state_of(id) == SlotState::Serving
                            });
                    }
                    return Ok(answer);
                }
                Err(status) if status.code() == Code::Unavailable => {
                    let epoch = (status.metadata().get(EPOCH))
                        .and_then(|e| e.to_str().ok()?.parse().ok())
                        .unwrap_or(0);
                    refusal = Some(status);
                    self.member.catch_up(epoch, HOLD).await;
                    // The previous owner refused: it is releasing the slot
                    // to this node, which serves it once it has it.
                    self.hold(channel_id, until).await;
                }
                Err(status) => return Err(status),
            }
        }
        Err(refusal.unwrap_or_else(|| Status::unavailable("the channel's owner refused")))
    }

    /// `Fleet.ChangeChannel` at the owner its asker's ring names, this
    /// node: while it acquires the channel's slot, made at the previous
    /// owner, which serves the slot until it starts releasing it (unless
    /// the request was passed on already), and held here only if that one
    /// does not make it; else as [`Router::change_here`]. Channels are not
    /// handed over (the new owner loads them once the old one has written
    /// them): held here from the start, a message of a channel whose slot
    /// moves waited for the whole handoff of the slot's users, the longest
    /// requests of a move at 3,000/s (issue 54). Made again here after the
    /// previous owner made it (its answer lost), it counts nothing twice:
    /// the channel remembers the message.
    pub async fn change_as_owner(
        &self,
        cache: &Cache,
        request: ChangeChannelRequest,
        until: Option<Instant>,
        passed_on: bool,
    ) -> Result<ChangeChannelResponse, Status> {
        let channel_id = request.channel_id;
        let previous = self.destination(channel_id);
        let acquiring = self.member.ownership().state_of(channel_id) == SlotState::Acquiring;
        if let Some(previous) = previous.filter(|_| acquiring && !passed_on) {
            // At most a hold's time: a previous owner that does not answer
            // (frozen, cut off) leaves the request to wait here instead.
            let hold = Instant::now() + HOLD;
            let within = Some(until.map_or(hold, |until| until.min(hold)));
            match self.ask_owner(&previous, request, within, true).await {
                Ok(answer) => return Ok(answer),
                Err(status) if status.code() == Code::InvalidArgument => return Err(status),
                Err(_) => {}
            }
        }
        self.change_here(cache, &request, until).await
    }

    /// The owner's part, here: held while this node acquires the channel's
    /// slot, refused (UNAVAILABLE, with the owner) if it does not serve it.
    pub async fn change_here(
        &self,
        cache: &Cache,
        request: &ChangeChannelRequest,
        until: Option<Instant>,
    ) -> Result<ChangeChannelResponse, Status> {
        let result = match handle(cache, request).await {
            Err(Error::NotServed {
                state: SlotState::Acquiring,
                ..
            }) if self.hold(request.channel_id, until).await => handle(cache, request).await,
            other => other,
        };
        result.map_err(|error| match &error {
            Error::NotServed { user_id, .. } => self.refusal(&error, *user_id),
            _ => Status::from(error),
        })
    }

    /// `Fleet.ChangeChannel` at `owner`, within what is left until `until`;
    /// `passed_on` by this node, acquiring the slot, to its previous owner.
    async fn ask_owner(
        &self,
        owner: &str,
        request: ChangeChannelRequest,
        until: Option<Instant>,
        passed_on: bool,
    ) -> Result<ChangeChannelResponse, Status> {
        let record = self.member.ring();
        let node = (record.ring.node(owner)).or_else(|| record.previous.node(owner));
        let Some(node) = node else {
            return Err(Status::unavailable(format!("{owner} left the ring")));
        };
        let channel = self
            .peers
            .channel(&node.address)
            .map_err(Status::unavailable)?;
        let mut call = self.peers.request(request);
        if passed_on {
            call.metadata_mut()
                .insert(PASSED_ON, tonic::metadata::MetadataValue::from_static("1"));
        }
        call.set_timeout(until.map_or(CHANGE_TIMEOUT, |until| {
            until.saturating_duration_since(Instant::now())
        }));
        let mut owner = FleetClient::new(channel);
        match timing::measure(Phase::Forward, owner.change_channel(call)).await {
            Ok(answer) => Ok(answer.into_inner()),
            // Never processed there (a node going away refuses what it has
            // not taken): not applied.
            Err(status) if readstates_routing::client::refused_by_goaway(&status) => {
                Err(Status::unavailable(status.message().to_owned()))
            }
            Err(status) => Err(status),
        }
    }
}
