//! Requests that touch many users (MessageCreated, MessageDeleted,
//! GetBadgeCounts) on a node of a fleet: split by owner, the parts sent to
//! their owners in parallel (this node's part applied here), the answers
//! merged. Users whose part could not be applied (their owner moved or did
//! not answer) are split again by the ring as it is then, once; if some
//! still fail, the call fails with UNAVAILABLE, and the client retries the
//! whole call: MessageCreated counts nothing twice (each read state's
//! watermark moves with its user), GetBadgeCounts only reads, and
//! MessageDeleted lowers no user twice (each user's memory of the deletions
//! it was lowered for moves with it; see the proto for a failed handoff).

use futures::future::join_all;
use readstates_routing::slot_of;
use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use tokio::time::Instant;
use tonic::Status;

use super::forward::Forward;
use super::route::{EPOCH, HOLD, Hop, Router, not_applied, pass_on_budget};
use crate::error::Error;
use crate::ownership::SlotState;
use crate::proto::{ChangeChannelRequest, ChannelTaken};
use crate::timing::{self, Phase};

/// How to split one kind of request and put its answers together.
pub trait Scatter: Forward {
    /// Every user the request touches, validated as the RPC validates them
    /// (a part, being smaller, then passes every limit).
    fn users(&self) -> Result<Vec<u64>, Error>;
    /// The request for `users` only.
    fn part(&self, users: &HashSet<u64>) -> Self;
    /// One answer from the answers of the parts.
    fn merge(&self, parts: Vec<Self::Response>) -> Self::Response;

    /// A message (or deletion) that names no members: what its channel
    /// takes if it is counted by channel, which the channel's owner makes
    /// before the users' parts go out (see [`super::change_channel`]).
    /// `None` for any other request, and for a part made so.
    fn channel_change(&self) -> Option<ChangeChannelRequest> {
        None
    }
    /// What only the nodes of a fleet set on a part: that its channel's
    /// owner made the channel's change.
    fn channel_taken(&self) -> Option<ChannelTaken> {
        None
    }
    /// This request as the parts of a message whose channel's owner made
    /// the channel's change and answered `taken`.
    fn taken(self, _taken: ChannelTaken) -> Self {
        self
    }
    /// `merged` (the users' answers) with the channel's change counted.
    fn with_channel_change(merged: Self::Response) -> Self::Response {
        merged
    }
}

/// What became of one part.
enum Outcome<Resp> {
    Done(Resp),
    /// Not applied: try its users again by a newer ring.
    Retry(Vec<u64>, Status, u64),
    Failed(Status),
}

impl Router {
    /// Splits `request`, which came `hop`, by owner and runs the parts:
    /// this node's with `local`, the others' at their owners.
    pub async fn scatter<Req, LocalFut>(
        &self,
        request: Req,
        hop: &Hop,
        until: Option<Instant>,
        local: impl Fn(Req) -> LocalFut,
    ) -> Result<Req::Response, Status>
    where
        Req: Scatter,
        LocalFut: Future<Output = Result<Req::Response, Error>>,
    {
        let mut pending = request.users().map_err(Status::from)?;
        let mut answers = Vec::new();
        for round in 0..2 {
            let parts = match hop {
                Hop::First => self.split(&pending, round == 1),
                _ => self.split_forwarded(&pending, round == 1, hop),
            };
            let outcomes = join_all(parts.into_iter().map(|(owner, users)| {
                let part = request.part(&users.iter().copied().collect());
                let local = &local;
                async move {
                    let left = until.map(|u| u.saturating_duration_since(Instant::now()));
                    match owner {
                        None => Outcome::Retry(users, Status::unavailable("no owner"), 0),
                        Some(owner) if owner == self.member.id() => match local(part).await {
                            Ok(answer) => Outcome::Done(answer),
                            Err(error @ Error::NotServed { user_id, .. }) => {
                                let refusal = self.refusal(&error, user_id);
                                Outcome::Retry(users, refusal, 0)
                            }
                            Err(error) => Outcome::Failed(error.into()),
                        },
                        Some(owner) => match timing::measure(
                            Phase::Forward,
                            self.send(&owner, part, hop, pass_on_budget(hop, left)),
                        )
                        .await
                        {
                            Ok(answer) => Outcome::Done(answer),
                            Err(status) if not_applied(&status, *hop != Hop::First) => {
                                let epoch = status
                                    .metadata()
                                    .get(EPOCH)
                                    .and_then(|e| e.to_str().ok()?.parse().ok())
                                    .unwrap_or(0);
                                Outcome::Retry(users, status, epoch)
                            }
                            Err(status) => Outcome::Failed(status),
                        },
                    }
                }
            }))
            .await;
            pending = Vec::new();
            let mut refusal = None;
            let mut newer = 0;
            for outcome in outcomes {
                match outcome {
                    Outcome::Done(answer) => answers.push(answer),
                    Outcome::Failed(status) => return Err(status),
                    Outcome::Retry(users, status, epoch) => {
                        pending.extend(users);
                        newer = newer.max(epoch);
                        refusal.get_or_insert(status);
                    }
                }
            }
            match refusal {
                None => return Ok(request.merge(answers)),
                Some(status) if round == 1 => return Err(status),
                Some(_) => {
                    self.member.catch_up(newer, HOLD).await;
                    // Users whose slot this node is acquiring are not sent
                    // to the previous owner again (it refused: it is
                    // releasing them); they wait to be served here.
                    for &user in &pending {
                        self.hold(user, until).await;
                    }
                }
            }
        }
        unreachable!("the second round returns")
    }

    /// `users` by the node that serves them: this node if it does (also a
    /// slot it is about to release, until it starts releasing it), else
    /// [`Router::destination`] (`None`: nobody owns their slot).
    /// `again`: after a refusal, a slot moving in this epoch goes to its
    /// previous owner, which serves it until it starts releasing it (its
    /// new owner, acquiring it, could only hold the part).
    fn split(&self, users: &[u64], again: bool) -> BTreeMap<Option<String>, Vec<u64>> {
        let me = self.member.id();
        let ownership = self.member.ownership();
        let record = self.member.ring();
        let mut parts: BTreeMap<Option<String>, Vec<u64>> = BTreeMap::new();
        for &user in users {
            let slot = slot_of(user);
            let previous = record.previous.owner(slot).map(|n| n.id.as_str());
            let moving = previous != record.ring.owner(slot).map(|n| n.id.as_str());
            let node = match ownership.state(slot) {
                SlotState::Serving => Some(me.to_owned()),
                // Held here if it is still being acquired after the refusal.
                SlotState::Acquiring => {
                    Some(self.destination(user).unwrap_or_else(|| me.to_owned()))
                }
                _ if again && moving && previous.is_some_and(|p| p != me) => {
                    previous.map(str::to_owned)
                }
                _ => self.destination(user),
            };
            parts.entry(node).or_default().push(user);
        }
        parts
    }

    /// `users` of a part forwarded here, which came `hop`: to the previous
    /// owner of a slot this node is acquiring (see [`Router::next`]), else
    /// here; `again` (after a refusal), all here.
    fn split_forwarded(
        &self,
        users: &[u64],
        again: bool,
        hop: &Hop,
    ) -> BTreeMap<Option<String>, Vec<u64>> {
        let me = self.member.id();
        let mut parts: BTreeMap<Option<String>, Vec<u64>> = BTreeMap::new();
        for &user in users {
            let node = if again { None } else { self.next(user, hop) };
            parts
                .entry(Some(node.unwrap_or_else(|| me.to_owned())))
                .or_default()
                .push(user);
        }
        parts
    }
}

/// The ids of `ids` that are in `users`, in their order.
pub fn keep(ids: &[u64], users: &HashSet<u64>) -> Vec<u64> {
    ids.iter()
        .copied()
        .filter(|id| users.contains(id))
        .collect()
}
