//! Which slots this node serves, slot by slot: the state every change and
//! every load checks, in the same critical section that applies it.
//!
//! A slot is `Serving` (this node owns it and has it), `Releasing` (owned
//! until this epoch, unwritten changes being written), `Acquiring` (owned
//! from this epoch, waiting for the previous owner's release) or
//! `NotOwner`. Only `Serving` slots are read or changed here; requests for
//! the others are forwarded, or held while acquiring.
//!
//! Every slot also has a generation, raised each time it starts being
//! served: a load that began in one generation is not kept in another, so a
//! slot that moved away and back while a load was under way never caches
//! what the store held before the move.
//!
//! A fleet node serves its slots only while it holds its lease (see
//! `cluster::lease`): past the lease's deadline, on the clock at the
//! instant of the check, a `Serving` slot reads as `Fenced`. So a node that
//! wakes from a freeze refuses even the requests already in its socket
//! before any task of its own has run.
//!
//! The states are atomics, read without a lock by every request. What makes
//! a check and its change one critical section is the change gate of the
//! cache (see `cache::gate`): the node flips slots, then waits on the gate's
//! barrier for every change that might have seen them served.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};

use readstates_routing::{SLOTS, Slot, slot_of};
use tokio::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum SlotState {
    NotOwner = 0,
    Serving = 1,
    Releasing = 2,
    Acquiring = 3,
    /// Serving, but the lease lapsed: refused, naming no owner. Never
    /// stored: what `Serving` reads as past the lease.
    Fenced = 4,
}

impl SlotState {
    fn from_u8(value: u8) -> SlotState {
        match value {
            1 => SlotState::Serving,
            2 => SlotState::Releasing,
            3 => SlotState::Acquiring,
            _ => SlotState::NotOwner,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SlotState::NotOwner => "not_owner",
            SlotState::Serving => "serving",
            SlotState::Releasing => "releasing",
            SlotState::Acquiring => "acquiring",
            SlotState::Fenced => "fenced",
        }
    }
}

#[derive(Debug)]
pub struct Ownership {
    states: Box<[AtomicU8]>,
    generations: Box<[AtomicU32]>,
    /// Until when `Serving` slots are served: nanoseconds since `base`
    /// (`u64::MAX`: for good).
    lease_until: AtomicU64,
    /// Whether the lease was ever held (see `Member::release_slots`).
    leased_once: AtomicBool,
    base: Instant,
}

/// A user's slot as a load saw it when it began.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadTicket {
    slot: Slot,
    generation: u32,
}

impl Ownership {
    /// A standalone node: every slot served, for good.
    pub fn standalone() -> Ownership {
        Ownership::with(SlotState::Serving, u64::MAX)
    }

    /// A node of a fleet before it has read the ring and taken its lease:
    /// nothing served.
    pub fn member() -> Ownership {
        Ownership::with(SlotState::NotOwner, 0)
    }

    fn with(state: SlotState, lease_until: u64) -> Ownership {
        Ownership {
            states: (0..SLOTS).map(|_| AtomicU8::new(state as u8)).collect(),
            generations: (0..SLOTS).map(|_| AtomicU32::new(0)).collect(),
            lease_until: AtomicU64::new(lease_until),
            leased_once: AtomicBool::new(lease_until > 0),
            base: Instant::now(),
        }
    }

    /// Serves the `Serving` slots until `until` (`None`: for good, as a
    /// fleet simulated without leases).
    pub fn lease(&self, until: Option<Instant>) {
        if until.is_none_or(|until| until > Instant::now()) {
            self.leased_once.store(true, Ordering::SeqCst);
        }
        let until = until.map_or(u64::MAX, |until| {
            let nanos = until.saturating_duration_since(self.base).as_nanos();
            u64::try_from(nanos).unwrap_or(u64::MAX - 1)
        });
        self.lease_until.store(until, Ordering::SeqCst);
    }

    /// Whether this start has held its lease at all.
    pub fn leased_once(&self) -> bool {
        self.leased_once.load(Ordering::SeqCst)
    }

    /// Whether the lease is held now.
    pub fn leased(&self) -> bool {
        let until = self.lease_until.load(Ordering::SeqCst);
        until == u64::MAX || (self.base.elapsed().as_nanos() as u64) < until
    }

    /// The state of `slot` as requests see it: `Fenced` when served but
    /// past the lease.
    pub fn state(&self, slot: Slot) -> SlotState {
        match self.assigned(slot) {
            SlotState::Serving if !self.leased() => SlotState::Fenced,
            state => state,
        }
    }

    /// The state of `slot` as the ring's follower set it, lease or not.
    pub fn assigned(&self, slot: Slot) -> SlotState {
        SlotState::from_u8(self.states[usize::from(slot)].load(Ordering::SeqCst))
    }

    /// The state of `user_id`'s slot.
    pub fn state_of(&self, user_id: u64) -> SlotState {
        self.state(slot_of(user_id))
    }

    /// Moves `slot` to `state`; to `Serving` in a new generation.
    pub fn set(&self, slot: Slot, state: SlotState) {
        let index = usize::from(slot);
        debug_assert_ne!(state, SlotState::Fenced, "never stored");
        if state == SlotState::Serving && self.assigned(slot) != SlotState::Serving {
            self.generations[index].fetch_add(1, Ordering::SeqCst);
        }
        self.states[index].store(state as u8, Ordering::SeqCst);
    }

    /// Taken when a load of `user_id` begins.
    pub fn ticket(&self, user_id: u64) -> LoadTicket {
        let slot = slot_of(user_id);
        LoadTicket {
            slot,
            generation: self.generations[usize::from(slot)].load(Ordering::SeqCst),
        }
    }

    /// Whether what a load read may be kept: its slot is served, and has
    /// been all along since the load began.
    pub fn keeps(&self, ticket: LoadTicket) -> bool {
        self.state(ticket.slot) == SlotState::Serving
            && self.generations[usize::from(ticket.slot)].load(Ordering::SeqCst)
                == ticket.generation
    }

    /// How many slots are in each state: not owned, serving, releasing,
    /// acquiring.
    pub fn counts(&self) -> [usize; 4] {
        let mut counts = [0; 4];
        for state in self.states.iter() {
            counts[usize::from(state.load(Ordering::Relaxed)) & 3] += 1;
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_load_is_kept_only_in_the_generation_it_began() {
        let ownership = Ownership::member();
        ownership.lease(None);
        let user = 42;
        let slot = slot_of(user);
        ownership.set(slot, SlotState::Serving);
        let ticket = ownership.ticket(user);
        assert!(ownership.keeps(ticket));
        ownership.set(slot, SlotState::Releasing);
        assert!(!ownership.keeps(ticket));
        ownership.set(slot, SlotState::NotOwner);
        ownership.set(slot, SlotState::Acquiring);
        ownership.set(slot, SlotState::Serving);
        assert_eq!(ownership.state_of(user), SlotState::Serving);
        assert!(!ownership.keeps(ticket), "moved away and back meanwhile");
        assert!(ownership.keeps(ownership.ticket(user)));
        assert_eq!(ownership.counts(), [SLOTS - 1, 1, 0, 0]);
    }
}
