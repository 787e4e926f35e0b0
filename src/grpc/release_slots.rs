//! The `Fleet` service, between the nodes of a fleet: `ReleaseSlots`, which
//! a new owner calls on the previous owner of its slots (see
//! [`crate::cluster::member`]), and `HandOver` (see [`super::hand_over`]).

use tonic::{Request, Response, Status, Streaming};

use super::validate;
use crate::cluster::member::Member;
use crate::proto::fleet_server::Fleet;
use crate::proto::{HandOverRequest, HandOverResponse, ReleaseSlotsRequest, ReleaseSlotsResponse};

#[derive(Clone, Debug)]
pub struct FleetService {
    member: Member,
}

impl FleetService {
    pub fn new(member: Member) -> FleetService {
        FleetService { member }
    }
}

#[tonic::async_trait]
impl Fleet for FleetService {
    async fn release_slots(
        &self,
        request: Request<ReleaseSlotsRequest>,
    ) -> Result<Response<ReleaseSlotsResponse>, Status> {
        let request = request.into_inner();
        let slots = validate::slots("slots", &request.slots)?;
        self.member.release_slots(request.epoch, &slots).await?;
        tracing::debug!(epoch = request.epoch, from = %request.node_id, slots = slots.len(), "released to");
        Ok(Response::new(ReleaseSlotsResponse {}))
    }

    async fn hand_over(
        &self,
        request: Request<Streaming<HandOverRequest>>,
    ) -> Result<Response<HandOverResponse>, Status> {
        super::hand_over::handle(&self.member, request).await
    }
}
