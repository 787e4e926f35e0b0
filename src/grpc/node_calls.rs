//! Who may speak as a node of the fleet: every `Fleet` call (checked by an
//! interceptor, before its handler runs), and every `ReadStates` call that
//! carries a node's marker (forwarded or passed on, see [`super::route`]:
//! such a call skips the client limits and checks a node has already made;
//! checked where the service reads the marker, [`super::ReadStatesService`]'s
//! `hop_of`), must carry the fleet's token ([`FleetCredential`]). Anything
//! else gets PERMISSION_DENIED and is counted in
//! `readstates_node_calls_refused_total{reason}`. A client's own calls,
//! unmarked, pass untouched, at the cost of one header lookup.

use std::net::SocketAddr;
use std::sync::Arc;

use metrics::counter;
use tonic::metadata::MetadataMap;
use tonic::{Request, Status};

use super::route::{FORWARDED, Hop, PASSED_ON};
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
        self.check(
            request.metadata(),
            request.remote_addr(),
            "the Fleet service",
        )?;
        Ok(request)
    }

    /// For a node's call whose effect reaches the store without a node's
    /// further check (a backup stream): a token is required even while
    /// upgrading, since no build before tokens makes such a call.
    pub fn strict(
        &self,
        metadata: &MetadataMap,
        peer: Option<SocketAddr>,
        what: &str,
    ) -> Result<(), Status> {
        NodeCalls {
            take_missing: false,
            ..self.clone()
        }
        .check(metadata, peer, what)
    }

    /// For a `ReadStates` call that came `hop`: one marked as a node's
    /// must be a node's.
    pub fn read_states(
        &self,
        hop: &Hop,
        metadata: &MetadataMap,
        peer: Option<SocketAddr>,
    ) -> Result<(), Status> {
        match hop {
            Hop::First => Ok(()),
            Hop::Forwarded(_) => self.check(metadata, peer, FORWARDED),
            Hop::PassedOn => self.check(metadata, peer, PASSED_ON),
        }
    }

    fn check(
        &self,
        metadata: &MetadataMap,
        peer: Option<SocketAddr>,
        what: &str,
    ) -> Result<(), Status> {
        let verdict = match &self.credential {
            Some(credential) => credential.verify(metadata),
            None => Err(Refusal::NoFleet),
        };
        if verdict == Err(Refusal::Missing) && self.take_missing {
            counter!(NODE_CALLS_REFUSED, "reason" => "missing").increment(1);
            return Ok(());
        }
        verdict.map_err(|refusal| {
            counter!(NODE_CALLS_REFUSED, "reason" => refusal.name()).increment(1);
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
