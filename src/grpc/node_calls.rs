//! Who may speak as a node of the fleet, checked on the gRPC port before
//! any handler runs: every `Fleet` call, and every `ReadStates` call that
//! carries a node's marker (forwarded or passed on, see [`super::route`]:
//! such a call skips the client limits and checks a node has already
//! made), must carry the fleet's token ([`FleetCredential`]). Anything else
//! gets PERMISSION_DENIED and is counted in
//! `readstates_node_calls_refused_total{reason}`. A client's own calls,
//! unmarked, pass untouched.

use std::sync::Arc;

use metrics::counter;
use tonic::{Request, Status};

use super::route::{FORWARDED, PASSED_ON};
use crate::cluster::credential::{FleetCredential, Refusal};
use crate::config::FleetAuth;
use crate::metrics::NODE_CALLS_REFUSED;

/// The check, as the servers' interceptors run it.
#[derive(Clone, Debug)]
pub struct NodeCalls {
    /// `None` on a standalone node: no call is a node's.
    credential: Option<Arc<FleetCredential>>,
    /// A call with no token is taken (counted), in a rolling upgrade from
    /// a build before tokens (`FleetAuth::Upgrading`).
    take_missing: bool,
}

impl NodeCalls {
    pub fn new(credential: Option<FleetCredential>, auth: FleetAuth) -> NodeCalls {
        NodeCalls {
            credential: credential.map(Arc::new),
            take_missing: auth == FleetAuth::Upgrading,
        }
    }

    /// For the `Fleet` service: every call is a node's.
    pub fn fleet(&self, request: Request<()>) -> Result<Request<()>, Status> {
        self.check(&request, "the Fleet service")?;
        Ok(request)
    }

    /// For the `ReadStates` service: a call marked as a node's.
    pub fn read_states(&self, request: Request<()>) -> Result<Request<()>, Status> {
        for marker in [FORWARDED, PASSED_ON] {
            if request.metadata().contains_key(marker) {
                self.check(&request, marker)?;
            }
        }
        Ok(request)
    }

    fn check(&self, request: &Request<()>, what: &str) -> Result<(), Status> {
        let verdict = match &self.credential {
            Some(credential) => credential.verify(request.metadata()),
            None => Err(Refusal::NoFleet),
        };
        if verdict == Err(Refusal::Missing) && self.take_missing {
            counter!(NODE_CALLS_REFUSED, "reason" => "missing").increment(1);
            return Ok(());
        }
        verdict.map_err(|refusal| {
            counter!(NODE_CALLS_REFUSED, "reason" => refusal.name()).increment(1);
            let peer = request.remote_addr();
            tracing::debug!(
                what,
                reason = refusal.name(),
                ?peer,
                "a node's call refused"
            );
            Status::permission_denied(format!(
                "{what} is for the fleet's own nodes: this call carries no valid fleet token ({})",
                refusal.name()
            ))
        })
    }
}
