//! Taking slots up: once their previous owners released them (or a handoff
//! completed), their channels counted by channel are loaded and the slots
//! are served.

use std::sync::Arc;

use readstates_routing::{Slot, slot_of};

use super::{Member, slot_set};
use crate::clock;
use crate::cluster::ring_store::RingRecord;
use crate::ownership::SlotState;

impl Member {
    /// Asks `from` to release `slots` until it has, or an operator forced
    /// it; then serves them. Gives up if a newer epoch appears (adopting it
    /// takes over).
    pub(super) async fn acquire(
        &self,
        record: Arc<RingRecord>,
        from: readstates_routing::Node,
        slots: Vec<Slot>,
    ) {
        let epoch = record.ring.epoch();
        let started = tokio::time::Instant::now();
        let mut attempts = 0u32;
        // Counted released when the epoch was made (a takeover of a dead
        // node): not asked, as it may be frozen and answer nothing.
        let forced = record.released.contains(&from.id);
        loop {
            if forced {
                break;
            }
            let asked = self
                .inner
                .peers
                .release_slots(&from.address, epoch, &slots, &self.inner.id)
                .await;
            match asked {
                Ok(()) => break,
                Err(e) => {
                    attempts += 1;
                    if attempts == 1 || attempts.is_power_of_two() {
                        tracing::warn!(epoch, from = %from.id, error = %e, slots = slots.len(), "waiting for a release");
                    }
                }
            }
            match self.inner.ring_store.load().await {
                Ok(now) if now.ring.epoch() != epoch => return,
                Ok(now) if now.released.contains(&from.id) => {
                    tracing::warn!(epoch, from = %from.id, "release forced by an operator");
                    break;
                }
                _ => {}
            }
            tokio::time::sleep(self.inner.config.retry).await;
        }
        self.load_channels(&slots).await;
        self.serve(epoch, &slots);
        tracing::info!(
            epoch,
            from = %from.id,
            slots = slots.len(),
            waited_ms = started.elapsed().as_millis() as u64,
            "acquired"
        );
        self.inner.poke.notify_one();
    }

    /// Takes in the channels counted by channel of `slots` as their previous
    /// owner wrote them (see [`ChannelStates::acquire`]), retrying until the
    /// store answers: a copy held here may lag or be missing (a node that
    /// joined after a switch was sent no copy of it), and serving it would
    /// fork the channel or lose it.
    ///
    /// [`ChannelStates::acquire`]: crate::channel_states::ChannelStates::acquire
    async fn load_channels(&self, slots: &[Slot]) {
        let channels = self.inner.cache.channels();
        let these = slot_set(slots);
        let mut attempts = 0u32;
        let now_us = clock::now_micros();
        while let Err(e) = channels
            .acquire(|id| these[usize::from(slot_of(id))], now_us)
            .await
        {
            attempts += 1;
            if attempts == 1 || attempts.is_power_of_two() {
                tracing::warn!(error = %e, "cannot load the channels counted by channel; retrying");
            }
            tokio::time::sleep(self.inner.config.retry).await;
        }
    }

    /// Serves `slots`, released to this node in `epoch`. What a handoff of
    /// them installed stays only if that handoff completed: one still open
    /// (the sender gave up on it and wrote the users, or died and was
    /// released by force) may have brought copies older than the store's.
    fn serve(&self, epoch: u64, slots: &[Slot]) {
        let mut handed_in = self.handed_in();
        let incomplete: Vec<Slot> = slots
            .iter()
            .copied()
            .filter(|slot| handed_in.complete.get(slot) != Some(&epoch))
            .collect();
        if !incomplete.is_empty() {
            let these = slot_set(&incomplete);
            let dropped = self
                .inner
                .cache
                .discard(|user_id| these[usize::from(slot_of(user_id))]);
            if dropped > 0 {
                tracing::warn!(
                    epoch,
                    users = dropped,
                    "released before its handoff completed; what it brought is dropped"
                );
            }
        }
        for &slot in slots {
            handed_in.complete.remove(&slot);
            self.ownership().set(slot, SlotState::Serving);
        }
    }
}
