//! Taking a handoff in: the users a previous owner hands over are
//! installed while their slots are acquired, one handoff a slot, and
//! dropped again if the handoff does not complete.

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use metrics::counter;
use readstates_routing::{Slot, slot_of};

use super::{Member, slot_set};
use crate::cache::handoff::Chunk;
use crate::cluster::handoff::{Handoff, Part, Parts};
use crate::error::Error;
use crate::metrics::HANDED_IN_USERS;
use crate::ownership::SlotState;

/// How long a `HandOver` waits for this node to adopt its epoch.
const RECEIVE_WAIT: Duration = Duration::from_secs(2);

/// Drops what a handoff installed, unless disarmed once it completed, if
/// the slots are still being acquired from its sender (which, never told
/// the handoff arrived, writes the users itself); and gives up the
/// handoff's claim on its slots.
struct Undo<'a> {
    member: &'a Member,
    handoff: &'a Handoff,
    /// The handoff's slots, by slot.
    these: &'a [bool],
    /// The handoff's claim on its slots (see [`HandedIn::claimed`]).
    claim: u64,
    armed: bool,
}

/// The handoffs of slots being acquired, by slot.
#[derive(Debug, Default)]
pub(super) struct HandedIn {
    /// Those whose handoff completed, with its epoch.
    pub(super) complete: HashMap<Slot, u64>,
    /// Those a handoff under way installs into, with its epoch and claim:
    /// one handoff a slot, so that one cut cannot undo what another
    /// installed, nor another's completion vouch for it.
    claimed: HashMap<Slot, (u64, u64)>,
    /// The last claim made.
    claims: u64,
}

impl HandedIn {
    /// Claims `handoff`'s slots for it, unless a handoff of one of them in
    /// its epoch is under way or completed.
    pub(super) fn claim(&mut self, handoff: &Handoff) -> Result<u64, String> {
        let epoch = handoff.epoch;
        for slot in &handoff.slots {
            if self.complete.get(slot) == Some(&epoch)
                || self.claimed.get(slot).is_some_and(|(e, _)| *e == epoch)
            {
                return Err(format!("slot {slot} is handed over here already"));
            }
        }
        self.claims += 1;
        for &slot in &handoff.slots {
            self.claimed.insert(slot, (epoch, self.claims));
        }
        Ok(self.claims)
    }
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        let mut handed_in = self.member.handed_in();
        let claim = self.claim;
        handed_in.claimed.retain(|_, (_, by)| *by != claim);
        if self.armed && self.member.receiving(self.handoff).is_ok() {
            let these = self.these;
            let dropped = self
                .member
                .inner
                .cache
                .discard(|user_id| these[usize::from(slot_of(user_id))]);
            tracing::warn!(from = %self.handoff.from, users = dropped, "handoff not completed; what it brought is dropped");
        }
    }
}

/// The slots of the users of `chunk`, each once.
fn chunk_slots(chunk: &Chunk) -> Vec<Slot> {
    let mut slots: Vec<Slot> = match chunk {
        Chunk::Users(users) => users.iter().map(|u| slot_of(u.user_id)).collect(),
        Chunk::Deletions(deletions) => deletions.iter().map(|d| slot_of(d.user_id)).collect(),
        Chunk::Gone(ids) => ids.iter().map(|&id| slot_of(id)).collect(),
    };
    slots.sort_unstable();
    slots.dedup();
    slots
}

impl Member {
    /// `HandOver` from the previous owner of `handoff.slots`: installs the
    /// users it sends, once this node has adopted that epoch and while it
    /// is acquiring those slots from that node. Anything else refuses it;
    /// a transfer that breaks drops what it installed (the sender, never
    /// told it arrived, writes the users itself).
    pub async fn receive(&self, handoff: Handoff, mut parts: Parts) -> Result<usize, Error> {
        self.catch_up(handoff.epoch, RECEIVE_WAIT).await;
        let claim = {
            let mut handed_in = self.handed_in();
            self.receiving(&handoff)?;
            (handed_in.claim(&handoff)).map_err(|reason| Error::HandoffRefused {
                epoch: handoff.epoch,
                reason,
            })?
        };
        let these = slot_set(&handoff.slots);
        // Drops what was installed unless the handoff completes, also when
        // this future is dropped midway (a deadline, a reset stream).
        let mut undo = Undo {
            member: self,
            handoff: &handoff,
            these: &these,
            claim,
            armed: true,
        };
        let mut installed = 0;
        let started = tokio::time::Instant::now();
        let result = loop {
            let part = match parts.next().await {
                Some(Ok(part)) => part,
                Some(Err(e)) => break Err(Error::HandoffBroken(e)),
                None => break Err(Error::HandoffBroken("cut before it was done".into())),
            };
            match part {
                Part::Chunk(chunk) => {
                    let slots = chunk_slots(&chunk);
                    if !slots.iter().all(|&slot| these[usize::from(slot)]) {
                        break Err(Error::HandoffBroken("a user of another slot".into()));
                    }
                    // Only the slots this chunk's users are of: looking at
                    // all of the handoff's for each chunk was a tenth of
                    // the receiver's CPU in a handoff of 16,000 slots.
                    let _installing = self.handed_in();
                    if let Err(e) = self.receiving_in(&handoff, &slots) {
                        break Err(e);
                    }
                    installed += self.inner.cache.install(chunk);
                }
                Part::Done { users } if users == installed => {
                    // What it holds unwritten is this node's to keep.
                    let done = tokio::time::Instant::now();
                    if let Err(e) = self.inner.cache.handed_in_journaled().await {
                        break Err(Error::HandoffBroken(e.to_string()));
                    }
                    tracing::info!(
                        epoch = handoff.epoch,
                        from = %handoff.from,
                        users = installed,
                        took_ms = started.elapsed().as_millis() as u64,
                        journaled_ms = done.elapsed().as_millis() as u64,
                        "handed in"
                    );
                    let mut handed_in = self.handed_in();
                    if let Err(e) = self.receiving(&handoff) {
                        break Err(e);
                    }
                    for &slot in &handoff.slots {
                        handed_in.complete.insert(slot, handoff.epoch);
                    }
                    counter!(HANDED_IN_USERS).increment(installed as u64);
                    undo.armed = false;
                    break Ok(installed);
                }
                Part::Done { users } => {
                    break Err(Error::HandoffBroken(format!(
                        "{users} users sent, {installed} received"
                    )));
                }
            }
        };
        drop(undo);
        result
    }

    /// Whether this node takes `handoff` now: it has adopted its epoch, and
    /// is acquiring each of its slots from its sender.
    fn receiving(&self, handoff: &Handoff) -> Result<(), Error> {
        self.receiving_in(handoff, &handoff.slots)
    }

    /// Whether this node takes what `handoff` sends of `slots` (some of
    /// its slots) now: as [`Member::receiving`], for those slots.
    fn receiving_in(&self, handoff: &Handoff, slots: &[Slot]) -> Result<(), Error> {
        let record = self.ring();
        let epoch = record.ring.epoch();
        let refused = |reason: String| Err(Error::HandoffRefused { epoch, reason });
        if epoch != handoff.epoch {
            return refused(format!("handoff of epoch {}", handoff.epoch));
        }
        for &slot in slots {
            let from = record.previous.owner(slot).map(|n| n.id.as_str());
            let to = record.ring.owner(slot).map(|n| n.id.as_str());
            let state = self.ownership().state(slot);
            if from != Some(handoff.from.as_str())
                || to != Some(self.id())
                || state != SlotState::Acquiring
            {
                return refused(format!("slot {slot} is {} here", state.name()));
            }
        }
        Ok(())
    }
}
