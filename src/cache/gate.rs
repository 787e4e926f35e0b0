//! The gate every change passes through: closed once when shutdown begins,
//! so that nothing is applied after the final drain has looked at a shard;
//! and crossed by a barrier when slots stop being served, so that a release
//! starts only once every change that could still see them served is done.
//!
//! A change enters before it checks that its users are served and leaves
//! when it is applied (for a multi-user change, after its last user): an
//! entry is never held across an `.await`, so waiting for entries takes
//! microseconds.
//!
//! One word holds the closed bit, a phase bit and two counts of entries,
//! one per phase, so entering is one compare-and-swap. A barrier flips the
//! phase and waits only for the entries counted in the phase it left: those
//! that entered before it. Entries made after count in the new phase, so a
//! steady stream of changes cannot hold a barrier up.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Error;

const CLOSED: u64 = 1 << 63;
const PHASE: u64 = 1 << 62;
/// Each phase's count takes 31 bits: far more entries than requests.
const COUNT_BITS: u32 = 31;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

#[derive(Debug, Default)]
pub(crate) struct ChangeGate {
    /// `CLOSED`, `PHASE`, the entries of phase 1 (bits 31..62) and of
    /// phase 0 (bits 0..31).
    state: AtomicU64,
    /// One barrier at a time: two interleaved would wait on each other's
    /// new entries.
    barrier: tokio::sync::Mutex<()>,
}

/// A change being applied; leaving the gate on drop.
#[derive(Debug)]
pub(crate) struct Entry<'a> {
    gate: &'a ChangeGate,
    /// What it added to the state: one in its phase's count.
    unit: u64,
}

fn unit_of(state: u64) -> u64 {
    if state & PHASE == 0 {
        1
    } else {
        1 << COUNT_BITS
    }
}

/// The entries counted in the phase whose unit is `unit`.
fn entries(state: u64, unit: u64) -> u64 {
    (state / unit) & COUNT_MASK
}

impl ChangeGate {
    /// Lets one change in, or refuses it once the gate is closed.
    pub(crate) fn enter(&self) -> Result<Entry<'_>, Error> {
        let mut state = self.state.load(Ordering::SeqCst);
        loop {
            if state & CLOSED != 0 {
                return Err(Error::ShuttingDown);
            }
            let unit = unit_of(state);
            match self.state.compare_exchange_weak(
                state,
                state + unit,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return Ok(Entry { gate: self, unit }),
                Err(now) => state = now,
            }
        }
    }

    /// Refuses every later change, and returns once none is being applied.
    pub(crate) async fn close(&self) {
        self.state.fetch_or(CLOSED, Ordering::SeqCst);
        while {
            let state = self.state.load(Ordering::SeqCst);
            entries(state, 1) + entries(state, 1 << COUNT_BITS) != 0
        } {
            tokio::task::yield_now().await;
        }
    }

    /// Returns once every change that entered before the call has left.
    pub(crate) async fn barrier(&self) {
        let _one = self.barrier.lock().await;
        let before = self.state.fetch_xor(PHASE, Ordering::SeqCst);
        let unit = unit_of(before);
        while entries(self.state.load(Ordering::SeqCst), unit) != 0 {
            tokio::task::yield_now().await;
        }
    }
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        self.gate.state.fetch_sub(self.unit, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_barrier_waits_for_earlier_entries_only() {
        let gate = std::sync::Arc::new(ChangeGate::default());
        let early = gate.enter().unwrap();
        let barrier = tokio::spawn({
            let gate = gate.clone();
            async move { gate.barrier().await }
        });
        tokio::task::yield_now().await;
        // Entries after the barrier began neither wait nor hold it up.
        let late = gate.enter().unwrap();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!barrier.is_finished(), "an earlier entry is still inside");
        drop(early);
        barrier.await.unwrap();
        // The next barrier waits for `late`.
        let next = tokio::spawn({
            let gate = gate.clone();
            async move { gate.barrier().await }
        });
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!next.is_finished());
        drop(late);
        next.await.unwrap();
    }

    #[tokio::test]
    async fn close_waits_for_both_phases_and_refuses_after() {
        let gate = std::sync::Arc::new(ChangeGate::default());
        let first = gate.enter().unwrap();
        gate.state.fetch_xor(PHASE, Ordering::SeqCst);
        let second = gate.enter().unwrap();
        let close = tokio::spawn({
            let gate = gate.clone();
            async move { gate.close().await }
        });
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(matches!(gate.enter(), Err(Error::ShuttingDown)));
        drop(first);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!close.is_finished());
        drop(second);
        close.await.unwrap();
    }
}
