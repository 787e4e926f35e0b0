//! `GetRoutingTable`: the ring as this node last adopted it, for gateways
//! that route straight to owners.

use readstates_routing::ring::NO_OWNER;

use crate::cluster::member::Member;
use crate::proto::{FleetNode, GetRoutingTableResponse};

/// Epoch 0 and no nodes from a standalone node.
pub fn handle(member: Option<&Member>) -> GetRoutingTableResponse {
    let Some(member) = member else {
        return GetRoutingTableResponse::default();
    };
    let record = member.ring();
    let ring = &record.ring;
    let none = ring.nodes().len() as u32;
    GetRoutingTableResponse {
        epoch: ring.epoch(),
        nodes: ring
            .nodes()
            .iter()
            .map(|n| FleetNode {
                id: n.id.clone(),
                address: n.address.clone(),
                weight: n.weight,
            })
            .collect(),
        slot_owners: ring
            .owners()
            .iter()
            .map(|&o| if o == NO_OWNER { none } else { u32::from(o) })
            .collect(),
    }
}
