//! Requests for users this node does not serve (a node of a fleet): held
//! while their slot is being acquired, forwarded once to the owner, or
//! refused with UNAVAILABLE ("not applied; retry there") naming the owner
//! and the epoch in the trailers.
//!
//! A forwarded request carries `x-readstates-forwarded`, so it is not
//! forwarded again: two nodes that disagree about an owner (one behind by an
//! epoch) answer the client instead of passing the request back and forth.
//! One exception, so that a move holds few requests: a node acquiring a
//! slot passes a request forwarded to it for that slot on to the slot's
//! previous owner, which serves it until it starts releasing it; marked
//! `x-readstates-passed-on`, that request goes nowhere else.

use std::time::Duration;

use readstates_routing::client::{is_cut, refused_by_goaway, safe_to_retry};
use readstates_routing::slot_of;
use tokio::time::Instant;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Request, Response, Status};

use super::forward::Forward;
use crate::cluster::copier::Copier;
use crate::cluster::member::Member;
use crate::cluster::peers::GrpcPeers;
use crate::error::Error;
use crate::ownership::SlotState;
use crate::proto::read_states_client::ReadStatesClient;
use crate::timing::{self, Phase};

/// Set on a forwarded request; on a refusal, the owner (`id@host:port`)
/// and the epoch of that answer. Defined with the client that reads them.
pub use readstates_routing::client::{ALL_ANSWERED, EPOCH, FORWARDED, OWNER, SAFE_TO_RETRY};

/// Set, with [`FORWARDED`], on a request passed on to the previous owner
/// of a slot by the node acquiring it: it goes no further.
pub const PASSED_ON: &str = "x-readstates-passed-on";

/// How far a request has come, which bounds where it may go next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hop {
    /// From a client: goes to wherever its user is served.
    First,
    /// Forwarded by the node named: passed on only to the previous owner of
    /// a slot being acquired here.
    Forwarded(String),
    /// Passed on by a node acquiring its slot: served here or refused.
    PassedOn,
}

impl Hop {
    pub fn of(metadata: &MetadataMap) -> Hop {
        if metadata.contains_key(PASSED_ON) {
            return Hop::PassedOn;
        }
        match metadata.get(FORWARDED) {
            Some(from) => Hop::Forwarded(from.to_str().unwrap_or_default().to_owned()),
            None => Hop::First,
        }
    }
}

/// The epoch in `metadata` (a refusal's trailer, or what a node sending a
/// request on says it is in); 0 without one.
pub fn epoch_of(metadata: &MetadataMap) -> u64 {
    (metadata.get(EPOCH))
        .and_then(|epoch| epoch.to_str().ok()?.parse().ok())
        .unwrap_or(0)
}

/// What is left of a request's `budget` for sending it on after it came
/// `hop`: all of it from a client; at most [`HOLD`] when passed on to a
/// previous owner, which may not answer at all (frozen, cut off), as the
/// request would have been held here that long instead.
pub fn pass_on_budget(hop: &Hop, budget: Option<Duration>) -> Option<Duration> {
    match hop {
        Hop::First => budget,
        _ => Some(budget.map_or(HOLD, |budget| budget.min(HOLD))),
    }
}

/// Whether `status`, the answer to a request sent on, says it was not
/// applied there (so that it may wait for the slot here): UNAVAILABLE; or,
/// for one `passed_on` to a previous owner, also no answer in time (the
/// change may have been applied there, and is then handed over with its
/// user; applying it again counts nothing, as a client's retry).
pub fn not_applied(status: &Status, passed_on: bool) -> bool {
    match status.code() {
        tonic::Code::Unavailable => true,
        tonic::Code::Cancelled | tonic::Code::DeadlineExceeded => passed_on,
        _ => false,
    }
}

/// How long a request waits for a slot being acquired.
pub const HOLD: Duration = Duration::from_secs(2);
const HOLD_POLL: Duration = Duration::from_millis(5);

/// What a fleet node needs to route: its view of the ring, channels to
/// the other nodes, and what sends them copies of the channels counted by
/// channel it owns.
#[derive(Clone, Debug)]
pub struct Router {
    pub member: Member,
    pub peers: std::sync::Arc<GrpcPeers>,
    pub copier: std::sync::Arc<Copier>,
}

impl Router {
    /// Waits up to [`HOLD`] (and the request's deadline) for `user_id`'s
    /// slot to be served here; whether it is.
    pub async fn hold(&self, user_id: u64, until: Option<Instant>) -> bool {
        timing::measure(Phase::Hold, self.held(user_id, until)).await
    }

    async fn held(&self, user_id: u64, until: Option<Instant>) -> bool {
        let deadline = Instant::now() + HOLD;
        let deadline = until.map_or(deadline, |until| until.min(deadline));
        let ownership = self.member.ownership();
        loop {
            match ownership.state_of(user_id) {
                SlotState::Serving => return true,
                SlotState::Acquiring if Instant::now() < deadline => {
                    tokio::time::sleep(HOLD_POLL).await;
                }
                _ => return false,
            }
        }
    }

    /// The refusal of a request for `user_id`: UNAVAILABLE, with the owner
    /// and epoch as this node knows them; no owner from a node past its
    /// lease, which cannot know who serves the user now.
    pub fn refusal(&self, error: &Error, user_id: u64) -> Status {
        let record = self.member.ring();
        let mut metadata = MetadataMap::new();
        let fenced = matches!(
            error,
            Error::LeaseLapsed
                | Error::NotServed {
                    state: SlotState::Fenced,
                    ..
                }
        );
        if !fenced
            && let Some(owner) = record.ring.owner(slot_of(user_id))
            && let Ok(value) = MetadataValue::try_from(format!("{}@{}", owner.id, owner.address))
        {
            metadata.insert(OWNER, value);
        }
        metadata.insert(EPOCH, MetadataValue::from(record.ring.epoch()));
        Status::with_metadata(error.code(), error.to_string(), metadata)
    }

    /// Where a request for `user_id` that this node does not serve goes:
    /// its owner; or, while this node is acquiring its slot, the previous
    /// owner, which serves it until it starts releasing it. `None`: this
    /// node or nobody.
    pub fn destination(&self, user_id: u64) -> Option<String> {
        let record = self.member.ring();
        let slot = slot_of(user_id);
        let mut owner = record.ring.owner(slot)?;
        if owner.id == self.member.id()
            && self.member.ownership().state(slot) == SlotState::Acquiring
        {
            owner = record.previous.owner(slot)?;
        }
        (owner.id != self.member.id()).then(|| owner.id.clone())
    }

    /// Where a request for `user_id` that came `hop` goes from here: for a
    /// request from a client, [`Router::destination`]; for a forwarded one,
    /// the previous owner of a slot this node is acquiring, unless that is
    /// where it came from; else nowhere.
    pub fn next(&self, user_id: u64, hop: &Hop) -> Option<String> {
        match hop {
            Hop::First => self.destination(user_id),
            Hop::Forwarded(from) => {
                let slot = slot_of(user_id);
                if self.member.ownership().state(slot) != SlotState::Acquiring {
                    return None;
                }
                let previous = self.member.ring().previous.owner(slot)?.id.clone();
                (previous != *from && previous != self.member.id()).then_some(previous)
            }
            Hop::PassedOn => None,
        }
    }

    /// Sends `request`, which came `hop`, on to where `user_id` is served
    /// (see [`Router::next`]), within what is left of the caller's
    /// deadline; `None` if it goes nowhere.
    pub async fn forward<Req: Forward>(
        &self,
        user_id: u64,
        request: Req,
        hop: &Hop,
        budget: Option<Duration>,
    ) -> Option<Result<Req::Response, Status>> {
        let destination = self.next(user_id, hop)?;
        let sent = self.send(&destination, request, hop, budget);
        Some(timing::measure(Phase::Forward, sent).await)
    }

    /// Sends a request that came `hop` to `owner`, marked forwarded (and
    /// passed on, unless it came from a client), within `budget`: as an
    /// item of the Apply stream to it, or as its unary call (see
    /// [`Forward`]). Refused by an owner in an older epoch (the nodes adopt
    /// a new one up to a ring poll apart), it is sent again as a call that
    /// says this node's epoch, which the owner catches up with first.
    pub(super) async fn send<Req: Forward>(
        &self,
        owner: &str,
        request: Req,
        hop: &Hop,
        budget: Option<Duration>,
    ) -> Result<Req::Response, Status> {
        let until = budget.map(|budget| Instant::now() + budget);
        let epoch = self.member.ring().ring.epoch();
        let answer = self
            .send_once(owner, request.clone(), hop, budget, None)
            .await;
        match answer {
            Err(status)
                if status.code() == Code::Unavailable
                    && (1..epoch).contains(&epoch_of(status.metadata())) =>
            {
                let left = until.map(|until| until.saturating_duration_since(Instant::now()));
                self.send_once(owner, request, hop, left, Some(epoch)).await
            }
            answer => answer,
        }
    }

    /// One [`Router::send`]: as a unary call saying `epoch`, if given.
    async fn send_once<Req: Forward>(
        &self,
        owner: &str,
        request: Req,
        hop: &Hop,
        budget: Option<Duration>,
        epoch: Option<u64>,
    ) -> Result<Req::Response, Status> {
        let record = self.member.ring();
        let node = record
            .ring
            .node(owner)
            .or_else(|| record.previous.node(owner));
        let Some(node) = node else {
            return Err(Status::unavailable(format!("{owner} left the ring")));
        };
        let passed_on = *hop != Hop::First;
        let until = budget.map(|budget| Instant::now() + budget);
        let mut request = request;
        if Req::ITEM
            && epoch.is_none()
            && let Some(applier) = self
                .peers
                .applier(&node.address, passed_on, || self.marks(passed_on))
                .map_err(Status::unavailable)?
        {
            // A new stream may be refused (a node of an older build has no
            // Apply; one at its limit of streams takes no more): then the
            // request, not applied there, goes as a call.
            let fallback = (!applier.is_open()).then(|| request.clone());
            request = match request.item() {
                Ok(change) => match (applier.apply(change, budget).await, fallback) {
                    (Err(status), Some(request))
                        if applier.failed_to_open()
                            && matches!(
                                status.code(),
                                Code::Unimplemented | Code::ResourceExhausted
                            ) =>
                    {
                        self.peers.lacks_apply(&node.address);
                        request
                    }
                    (answer, _) => {
                        return answer.and_then(|outcome| {
                            Req::response(outcome)
                                .ok_or_else(|| Status::internal("an Apply result of another kind"))
                        });
                    }
                },
                Err(request) => request,
            };
        }
        let channel = self
            .peers
            .channel(&node.address)
            .map_err(Status::unavailable)?;
        let mut request = Request::new(request);
        *request.metadata_mut() = self.marks(passed_on);
        if let Some(epoch) = epoch {
            request
                .metadata_mut()
                .insert(EPOCH, MetadataValue::from(epoch));
        }
        if let Some(until) = until {
            request.set_timeout(until.saturating_duration_since(Instant::now()));
        }
        Req::call(ReadStatesClient::new(channel), request)
            .await
            .map(Response::into_inner)
            .map_err(|status| match refused_by_goaway(&status) {
                // Told to the caller as what it is: not applied, retry.
                true => Status::unavailable(format!(
                    "{owner} went away before taking the request: not applied"
                )),
                // Cut on its way there or back (the owner died): the
                // caller is told it may send it again.
                false if is_cut(&status) => safe_to_retry(Status::cancelled(format!(
                    "the call to {owner} was cut before its answer: it may have been applied, \
                     and is safe to send again"
                ))),
                false => status,
            })
    }

    /// What marks a request this node sends on: forwarded from here, and
    /// `passed_on` to a previous owner, with the fleet's token that lets
    /// it be taken as such.
    fn marks(&self, passed_on: bool) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        self.peers.stamp(&mut metadata);
        if let Ok(value) = MetadataValue::try_from(self.member.id()) {
            metadata.insert(FORWARDED, value);
        }
        if passed_on {
            metadata.insert(PASSED_ON, MetadataValue::from_static("1"));
        }
        metadata
    }
}
