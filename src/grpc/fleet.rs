//! The `Fleet` service, between the nodes of a fleet: `ReleaseSlots`, which
//! a new owner calls on the previous owner of its slots (see
//! [`crate::cluster::member`]); `HandOver` (see [`super::hand_over`]) and
//! `HandOverFormat`, which a sender asks first; and
//! for channels counted by channel, `ChangeChannel` at a channel's owner
//! (see [`super::change_channel`]) and `CopyChannels` from it; `Mirror`,
//! from a node this one backs up (see [`super::mirror`]).

use std::sync::Arc;

use tonic::{Request, Response, Status, Streaming};

use super::node_calls::NodeCalls;
use super::route::{Hop, Router};
use super::validate;
use crate::channel_state::ChannelState;
use crate::clock;
use crate::cluster::backup::held::Backups;
use crate::cluster::handoff;
use crate::error::Error;
use crate::ownership::SlotState;
use crate::proto::fleet_server::Fleet;
use crate::proto::{
    ChangeChannelRequest, ChangeChannelResponse, CopyChannelsRequest, CopyChannelsResponse,
    HandOverFormatRequest, HandOverFormatResponse, HandOverRequest, HandOverResponse,
    MirrorRequest, ReleaseSlotsRequest, ReleaseSlotsResponse,
};

#[derive(Clone, Debug)]
pub struct FleetService {
    router: Router,
    backups: Arc<Backups>,
    /// Checked again, strictly, by the calls whose effect reaches the store
    /// (the interceptor takes a missing token while upgrading).
    node_calls: NodeCalls,
}

impl FleetService {
    pub fn new(router: Router, backups: Arc<Backups>, node_calls: NodeCalls) -> FleetService {
        FleetService {
            router,
            backups,
            node_calls,
        }
    }
}

#[tonic::async_trait]
impl Fleet for FleetService {
    type MirrorStream = super::mirror::Responses;

    async fn mirror(
        &self,
        request: Request<Streaming<MirrorRequest>>,
    ) -> Result<Response<Self::MirrorStream>, Status> {
        let (member, backups) = (&self.router.member, self.backups.clone());
        super::mirror::handle(member, backups, &self.node_calls, request).await
    }

    async fn release_slots(
        &self,
        request: Request<ReleaseSlotsRequest>,
    ) -> Result<Response<ReleaseSlotsResponse>, Status> {
        let request = request.into_inner();
        let slots = validate::slots("slots", &request.slots)?;
        let member = &self.router.member;
        member.release_slots(request.epoch, &slots).await?;
        tracing::debug!(epoch = request.epoch, from = %request.node_id, slots = slots.len(), "released to");
        Ok(Response::new(ReleaseSlotsResponse {}))
    }

    async fn hand_over(
        &self,
        request: Request<Streaming<HandOverRequest>>,
    ) -> Result<Response<HandOverResponse>, Status> {
        super::hand_over::handle(&self.router.member, request).await
    }

    async fn hand_over_format(
        &self,
        _: Request<HandOverFormatRequest>,
    ) -> Result<Response<HandOverFormatResponse>, Status> {
        Ok(Response::new(HandOverFormatResponse {
            format: handoff::FORMAT,
        }))
    }

    /// Applied here if this node serves the channel's slot; while it
    /// acquires it, made at the previous owner, or held here (see
    /// [`Router::change_as_owner`]); refused (UNAVAILABLE, with the owner)
    /// otherwise.
    async fn change_channel(
        &self,
        request: Request<ChangeChannelRequest>,
    ) -> Result<Response<ChangeChannelResponse>, Status> {
        let until = super::deadline::budget(request.metadata())
            .map(|budget| tokio::time::Instant::now() + budget);
        let passed_on = Hop::of(request.metadata()) == Hop::PassedOn;
        let request = request.into_inner();
        let cache = self.router.member.cache();
        let answer = self
            .router
            .change_as_owner(cache, request, until, passed_on);
        answer.await.map(Response::new)
    }

    async fn copy_channels(
        &self,
        request: Request<CopyChannelsRequest>,
    ) -> Result<Response<CopyChannelsResponse>, Status> {
        let copies = request.into_inner().channels;
        // Kept for good once taken (only a newer copy replaces it): a copy
        // from after the owner's clock could never be replaced.
        if let Some(copy) = copies.iter().find(|c| !clock::issued_by_now(c.version)) {
            return Err(Error::invalid(
                "channels.version",
                format!(
                    "channel {}'s copy has version {}, more than {:?} after this node's \
                     clock: no owner issued it",
                    copy.channel_id,
                    copy.version,
                    clock::MAX_AHEAD
                ),
            )
            .into());
        }
        let copies: Vec<ChannelState> = (copies.into_iter())
            .filter(|copy| copy.channel_id != 0)
            .map(ChannelState::from)
            .collect();
        let ownership = self.router.member.ownership();
        let cache = self.router.member.cache();
        cache.channels().copy_in(copies, |channel_id| {
            ownership.state_of(channel_id) == SlotState::Serving
        });
        Ok(Response::new(CopyChannelsResponse {}))
    }
}
