//! Who may speak as a node of the fleet: every `Fleet` call (checked by an
//! interceptor, before its handler runs), and every `ReadStates` call that
//! carries a node's marker (forwarded or passed on, see [`super::route`]:
//! such a call skips the client limits and checks a node has already made;
//! checked where the service reads the marker, [`super::ReadStatesService`]'s
//! `hop_of`), must carry the fleet's token ([`FleetCredential`]). Anything
//! else gets PERMISSION_DENIED and is counted in
//! `readstates_node_calls_refused_total{reason}`. What a call says of its
//! sender (a forwarded marker, a `Mirror` start, a `HandOver`) must be the
//! node its token names. A client's own calls, unmarked, pass untouched, at
//! the cost of one header lookup.

use std::net::SocketAddr;
use std::sync::Arc;

use metrics::counter;
use tonic::metadata::MetadataMap;
use tonic::{Request, Status};

use super::route::{FORWARDED, Hop, PASSED_ON};
use crate::cluster::credential::{FleetCredential, Refusal, Speaker};
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
    /// `credential` takes the static token of the builds before only if
    /// made [`FleetCredential::upgrading`].
    pub fn new(credential: Option<FleetCredential>, auth: FleetAuth) -> NodeCalls {
        NodeCalls {
            credential: credential.map(Arc::new),
            take_missing: auth == FleetAuth::Upgrading,
        }
    }

    /// For the `Fleet` service: every call is a node's. The node its token
    /// names goes into the request's extensions ([`Speaker`]), for a
    /// handler to check what the call says of its sender.
    pub fn fleet(&self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let speaker = self.check(
            request.metadata(),
            request.remote_addr(),
            "the Fleet service",
        )?;
        if let Some(speaker) = speaker {
            request.extensions_mut().insert(speaker);
        }
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
    ) -> Result<Speaker, Status> {
        let strict = NodeCalls {
            take_missing: false,
            ..self.clone()
        };
        let speaker = strict.check(metadata, peer, what)?;
        Ok(speaker.expect("a token is required"))
    }

    /// For a `ReadStates` call that came `hop`: one marked as a node's
    /// must be a node's, and one marked forwarded by a node must carry
    /// that node's token.
    pub fn read_states(
        &self,
        hop: &Hop,
        metadata: &MetadataMap,
        peer: Option<SocketAddr>,
    ) -> Result<(), Status> {
        match hop {
            Hop::First => Ok(()),
            Hop::Forwarded(from) => {
                let speaker = self.check(metadata, peer, FORWARDED)?;
                match speaker {
                    Some(speaker) => speaker_is(&speaker, from, FORWARDED),
                    None => Ok(()),
                }
            }
            Hop::PassedOn => self.check(metadata, peer, PASSED_ON).map(|_| ()),
        }
    }

    /// Who the call's token names; `None` for a call without one, taken
    /// while upgrading.
    fn check(
        &self,
        metadata: &MetadataMap,
        peer: Option<SocketAddr>,
        what: &str,
    ) -> Result<Option<Speaker>, Status> {
        let verdict = match &self.credential {
            Some(credential) => credential.verify(metadata),
            None => Err(Refusal::NoFleet),
        };
        let refusal = match verdict {
            Ok(speaker) => return Ok(Some(speaker)),
            Err(Refusal::Missing) if self.take_missing => {
                counter!(NODE_CALLS_REFUSED, "reason" => "missing").increment(1);
                return Ok(None);
            }
            Err(refusal) => refusal,
        };
        counter!(NODE_CALLS_REFUSED, "reason" => refusal.name()).increment(1);
        tracing::debug!(
            what,
            reason = refusal.name(),
            ?peer,
            "a node's call refused"
        );
        Err(Status::permission_denied(format!(
            "{what} is for the fleet's own nodes: this call carries no valid fleet token ({})",
            refusal.name()
        )))
    }
}

/// Whether a call from `speaker` may say it comes from `node` (in `what`):
/// PERMISSION_DENIED, counted as `impersonated`, otherwise.
pub fn speaker_is(speaker: &Speaker, node: &str, what: &str) -> Result<(), Status> {
    if speaker.may_be(node) {
        return Ok(());
    }
    counter!(NODE_CALLS_REFUSED, "reason" => "impersonated").increment(1);
    Err(Status::permission_denied(format!(
        "{what} names node {node}, but the call's token is another node's"
    )))
}
