//! The ring kept in one process: for unit tests and in-process fleets.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;

use super::{LeaseRecord, RingRecord, RingStore};
use crate::store::StoreError;

#[derive(Debug)]
pub struct MemoryRingStore {
    state: Mutex<(RingRecord, BTreeMap<String, u64>)>,
    drained: Mutex<BTreeMap<String, u32>>,
    leases: Mutex<BTreeMap<String, LeaseRecord>>,
    /// While renewals of a lease fail (a node cut off from the ring store).
    cut_off: Mutex<BTreeSet<String>>,
    /// While loads of the ring fail.
    failing_loads: AtomicBool,
    /// While true, loads wait (a ring store slow to answer, for tests).
    held: tokio::sync::watch::Sender<bool>,
    /// A lease record the next swap of that node's lease finds there first.
    swapped_first: Mutex<Option<(String, LeaseRecord)>>,
    /// How long each of the next swaps of a lease takes before it applies.
    slow_swaps: Mutex<std::collections::VecDeque<std::time::Duration>>,
}

impl Default for MemoryRingStore {
    fn default() -> Self {
        MemoryRingStore {
            state: Mutex::new((RingRecord::empty(), BTreeMap::new())),
            drained: Mutex::default(),
            leases: Mutex::default(),
            cut_off: Mutex::default(),
            failing_loads: AtomicBool::new(false),
            held: tokio::sync::watch::Sender::new(false),
            swapped_first: Mutex::default(),
            slow_swaps: Mutex::default(),
        }
    }
}

impl MemoryRingStore {
    /// Makes loads wait (`true`) until told otherwise.
    pub fn hold_loads(&self, held: bool) {
        self.held.send_replace(held);
    }

    /// Has the next swap of `node`'s lease find `record` there, as if
    /// another (a takeover) had swapped it in since it was read.
    pub fn swap_lease_first(&self, node: &str, record: LeaseRecord) {
        let mut first = self.swapped_first.lock().unwrap_or_else(|e| e.into_inner());
        *first = Some((node.to_owned(), record));
    }

    /// Has each of the next swaps of a lease wait the next of `delays`
    /// before it applies (one given up meanwhile never applies).
    pub fn slow_swaps(&self, delays: impl IntoIterator<Item = std::time::Duration>) {
        let mut slow = self.slow_swaps.lock().unwrap_or_else(|e| e.into_inner());
        slow.extend(delays);
    }

    /// Fails (`true`) or answers again the loads of the ring.
    pub fn fail_loads(&self, failing: bool) {
        (self.failing_loads).store(failing, Ordering::SeqCst);
    }

    /// Fails (`true`) or answers again the lease calls about `node`, as a
    /// node cut off from the ring store would see them.
    pub fn cut_off(&self, node: &str, cut: bool) {
        let mut cut_off = self.cut_off.lock().unwrap_or_else(|e| e.into_inner());
        if cut {
            cut_off.insert(node.to_owned());
        } else {
            cut_off.remove(node);
        }
    }

    fn leases(
        &self,
        node: &str,
    ) -> Result<std::sync::MutexGuard<'_, BTreeMap<String, LeaseRecord>>, StoreError> {
        if self
            .cut_off
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(node)
        {
            return Err(StoreError::new(
                "memory ring",
                "cut off from the ring store",
            ));
        }
        Ok(self.leases.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, (RingRecord, BTreeMap<String, u64>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait]
impl RingStore for MemoryRingStore {
    async fn load(&self) -> Result<RingRecord, StoreError> {
        // Never closed: the sender lives in `self`.
        let _ = self.held.subscribe().wait_for(|&held| !held).await;
        if self.failing_loads.load(Ordering::SeqCst) {
            return Err(StoreError::new("memory ring", "loads fail"));
        }
        Ok(self.state().0.clone())
    }

    async fn advance(&self, next: &RingRecord) -> Result<bool, StoreError> {
        let mut state = self.state();
        if state.0.ring.epoch() + 1 != next.ring.epoch() {
            return Ok(false);
        }
        state.0 = next.clone();
        Ok(true)
    }

    async fn release(&self, epoch: u64, node: &str) -> Result<bool, StoreError> {
        let mut state = self.state();
        if state.0.ring.epoch() != epoch {
            return Ok(false);
        }
        state.0.released.insert(node.to_owned());
        Ok(true)
    }

    async fn report(&self, node: &str, epoch: u64) -> Result<(), StoreError> {
        self.state().1.insert(node.to_owned(), epoch);
        Ok(())
    }

    async fn progress(&self) -> Result<BTreeMap<String, u64>, StoreError> {
        Ok(self.state().1.clone())
    }

    async fn drained_weight(&self, node: &str) -> Result<Option<u32>, StoreError> {
        let drained = self.drained.lock().unwrap_or_else(|e| e.into_inner());
        Ok(drained.get(node).copied())
    }

    async fn set_drained_weight(&self, node: &str, weight: Option<u32>) -> Result<(), StoreError> {
        let mut drained = self.drained.lock().unwrap_or_else(|e| e.into_inner());
        match weight {
            Some(weight) => drained.insert(node.to_owned(), weight),
            None => drained.remove(node),
        };
        Ok(())
    }

    async fn lease(&self, node: &str) -> Result<Option<LeaseRecord>, StoreError> {
        Ok(self.leases(node)?.get(node).cloned())
    }

    async fn swap_lease(
        &self,
        node: &str,
        seen: Option<&LeaseRecord>,
        next: &LeaseRecord,
    ) -> Result<bool, StoreError> {
        let delay = (self.slow_swaps.lock().unwrap_or_else(|e| e.into_inner())).pop_front();
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        let mut leases = self.leases(node)?;
        let mut first = self.swapped_first.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, record)) = first.take_if(|(of, _)| of == node) {
            leases.insert(node.to_owned(), record);
        }
        drop(first);
        if leases.get(node) != seen {
            return Ok(false);
        }
        leases.insert(node.to_owned(), next.clone());
        Ok(true)
    }
}
