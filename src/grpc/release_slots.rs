//! The `Fleet` service, between the nodes of a fleet: `ReleaseSlots`, which
//! a new owner calls on the previous owner of its slots (see
//! [`crate::cluster::member`]), and `HandOver` (see [`super::hand_over`]).

use readstates_routing::{SLOTS, Slot};
use tonic::{Request, Response, Status, Streaming};

use crate::cluster::member::Member;
use crate::error::Error;
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
        let slots = request
            .slots
            .iter()
            .map(|&slot| {
                Slot::try_from(slot)
                    .ok()
                    .filter(|&s| usize::from(s) < SLOTS)
                    .ok_or_else(|| Error::invalid("slots", format!("{slot} is not below {SLOTS}")))
            })
            .collect::<Result<Vec<Slot>, Error>>()?;
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
