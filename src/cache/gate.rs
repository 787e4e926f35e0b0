//! The gate every change passes through, closed once when shutdown begins,
//! so that nothing is applied after the final drain has looked at a shard.
//!
//! A change enters under its shard lock and leaves when it is applied (for a
//! multi-user change, after its last user): an entry is never held across an
//! `.await`. [`ChangeGate::close`] refuses new entries, then waits for the
//! ones inside, which takes microseconds. One word holds both the closed bit
//! and the count, so entering is one atomic add.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Error;

const CLOSED: u64 = 1 << 63;

#[derive(Debug, Default)]
pub(crate) struct ChangeGate {
    /// `CLOSED`, plus the changes being applied.
    state: AtomicU64,
}

/// A change being applied; leaving the gate on drop.
#[derive(Debug)]
pub(crate) struct Entry<'a>(&'a ChangeGate);

impl ChangeGate {
    /// Lets one change in, or refuses it once the gate is closed.
    pub(crate) fn enter(&self) -> Result<Entry<'_>, Error> {
        let previous = self.state.fetch_add(1, Ordering::SeqCst);
        if previous & CLOSED != 0 {
            self.state.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::ShuttingDown);
        }
        Ok(Entry(self))
    }

    /// Refuses every later change, and returns once none is being applied.
    pub(crate) async fn close(&self) {
        self.state.fetch_or(CLOSED, Ordering::SeqCst);
        while self.state.load(Ordering::SeqCst) & !CLOSED != 0 {
            tokio::task::yield_now().await;
        }
    }
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        self.0.state.fetch_sub(1, Ordering::SeqCst);
    }
}
