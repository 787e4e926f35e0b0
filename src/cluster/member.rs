//! This node as a member of the fleet: follows the ring and moves its slots
//! through their states, release before acquire.
//!
//! On a new epoch the node first writes what is unwritten of the users of
//! the slots it lost while still serving them (the new owners forward their
//! requests here meanwhile; `Cache::prewrite`), then stops serving them
//! (they go `Releasing`: new requests are forwarded to the new owners, which
//! hold them), lets the changes already applied finish, writes what changed
//! since and drops the users (`Cache::release`); only then does it answer
//! the new owners' `ReleaseSlots`. A slot is served nowhere only during that
//! last, short part. The slots it gained go `Acquiring`: it asks each previous
//! owner to release them and serves them (from the store) once it has, or
//! once an operator forced the release of a dead owner. No timeout lets it
//! start early. When it serves every slot it owns, it reports the epoch, and
//! `readstates ring` may make the next one.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use readstates_routing::{SLOTS, Slot, slot_of};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::ownership::{Ownership, SlotState};
use super::peers::Peers;
use super::ring_store::{RingRecord, RingStore};
use crate::cache::Cache;
use crate::error::Error;

#[derive(Clone, Debug)]
pub struct MemberConfig {
    /// How often the ring is read (also on a poke: a `ReleaseSlots` from a
    /// newer epoch).
    pub ring_poll: Duration,
    /// Between two asks of a previous owner that did not release yet.
    pub retry: Duration,
}

impl Default for MemberConfig {
    fn default() -> Self {
        MemberConfig {
            ring_poll: Duration::from_secs(1),
            retry: Duration::from_millis(200),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Member {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    id: String,
    ring_store: Arc<dyn RingStore>,
    cache: Arc<Cache>,
    peers: Arc<dyn Peers>,
    config: MemberConfig,
    /// The record adopted last: what requests are forwarded by.
    ring: watch::Sender<Arc<RingRecord>>,
    /// The newest epoch whose releases are done: `ReleaseSlots` waits on it.
    released: watch::Sender<u64>,
    /// Wakes the follower for an early look at the ring.
    poke: Notify,
}

impl Member {
    pub fn new(
        id: String,
        ring_store: Arc<dyn RingStore>,
        cache: Arc<Cache>,
        peers: Arc<dyn Peers>,
        config: MemberConfig,
    ) -> Member {
        Member {
            inner: Arc::new(Inner {
                id,
                ring_store,
                cache,
                peers,
                config,
                ring: watch::Sender::new(Arc::new(RingRecord::empty())),
                released: watch::Sender::new(0),
                poke: Notify::new(),
            }),
        }
    }

    pub fn id(&self) -> &str {
        &self.inner.id
    }

    pub fn ownership(&self) -> &Ownership {
        self.inner.cache.ownership()
    }

    /// The ring as this node last adopted it.
    pub fn ring(&self) -> Arc<RingRecord> {
        self.inner.ring.borrow().clone()
    }

    /// Looks at the ring now, and waits (at most `within`) until this node
    /// has adopted `epoch` or a later one.
    pub async fn catch_up(&self, epoch: u64, within: Duration) {
        self.inner.poke.notify_one();
        let mut ring = self.inner.ring.subscribe();
        let _ = tokio::time::timeout(within, ring.wait_for(|r| r.ring.epoch() >= epoch)).await;
    }

    /// Follows the ring until `stop`.
    pub fn start(&self, stop: CancellationToken) -> JoinHandle<()> {
        let member = self.clone();
        tokio::spawn(async move { member.follow(stop).await })
    }

    async fn follow(self, stop: CancellationToken) {
        let mut reported = 0;
        loop {
            match self.inner.ring_store.load().await {
                Ok(record) if record.ring.epoch() > self.ring().ring.epoch() => {
                    tokio::select! {
                        () = self.adopt(Arc::new(record)) => {}
                        () = stop.cancelled() => return,
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot read the ring"),
            }
            let epoch = self.ring().ring.epoch();
            if reported < epoch && self.serves_all() {
                match self.inner.ring_store.report(&self.inner.id, epoch).await {
                    Ok(()) => {
                        reported = epoch;
                        tracing::info!(epoch, "serving every slot of the epoch");
                    }
                    Err(e) => tracing::warn!(error = %e, epoch, "cannot report progress"),
                }
            }
            tokio::select! {
                () = tokio::time::sleep(self.inner.config.ring_poll) => {}
                () = self.inner.poke.notified() => {}
                () = stop.cancelled() => return,
            }
        }
    }

    /// Whether every slot this node owns in the adopted epoch is served.
    fn serves_all(&self) -> bool {
        let record = self.ring();
        record
            .ring
            .slots_of(&self.inner.id)
            .all(|slot| self.ownership().state(slot) == SlotState::Serving)
    }

    /// Moves to `record`: releases what it lost, then acquires what it
    /// gained.
    async fn adopt(&self, record: Arc<RingRecord>) {
        let me = self.inner.id.as_str();
        let epoch = record.ring.epoch();
        let ownership = self.ownership();
        let owned = |slot: Slot| record.ring.owner(slot).is_some_and(|n| n.id == me);
        let leaving: Vec<bool> = (0..SLOTS as Slot)
            .map(|slot| !owned(slot) && ownership.state(slot) != SlotState::NotOwner)
            .collect();
        let left = leaving.iter().filter(|&&l| l).count();
        // The new owners forward what they get for these slots here until
        // released (see `grpc::route`): meanwhile most of their unwritten
        // changes are written, so the release, when the slots are served
        // nowhere, is short.
        self.inner.ring.send_replace(record.clone());
        tracing::info!(epoch, releasing = left, "new epoch");
        let started = tokio::time::Instant::now();
        if left > 0 {
            self.inner
                .cache
                .prewrite(|user_id| leaving[usize::from(slot_of(user_id))])
                .await;
        }
        let paused = tokio::time::Instant::now();
        for slot in (0..SLOTS as Slot).filter(|&s| leaving[usize::from(s)]) {
            ownership.set(slot, SlotState::Releasing);
        }
        let users = self
            .inner
            .cache
            .release(|user_id| leaving[usize::from(slot_of(user_id))])
            .await;
        for slot in (0..SLOTS as Slot).filter(|&s| leaving[usize::from(s)]) {
            ownership.set(slot, SlotState::NotOwner);
        }
        self.inner.released.send_replace(epoch);
        if left > 0 {
            tracing::info!(
                epoch,
                slots = left,
                users,
                prewrite_ms = (paused - started).as_millis() as u64,
                paused_ms = paused.elapsed().as_millis() as u64,
                "released"
            );
        }

        // Gained slots, by whom they come from.
        let mut gaining: BTreeMap<Option<String>, Vec<Slot>> = BTreeMap::new();
        for slot in (0..SLOTS as Slot).filter(|&s| owned(s)) {
            if ownership.state(slot) == SlotState::Serving {
                continue;
            }
            let from = record.previous.owner(slot).map(|n| n.id.clone());
            // Nobody had it, or this node did before a restart (with
            // nothing of it cached): served from the store at once.
            if from.is_none() || from.as_deref() == Some(me) {
                ownership.set(slot, SlotState::Serving);
                continue;
            }
            ownership.set(slot, SlotState::Acquiring);
            gaining.entry(from).or_default().push(slot);
        }
        let acquisitions = gaining.into_iter().filter_map(|(from, slots)| {
            let node = record.previous.node(from.as_deref()?)?.clone();
            Some(self.acquire(record.clone(), node, slots))
        });
        futures::future::join_all(acquisitions).await;
    }

    /// Asks `from` to release `slots` until it has, or an operator forced
    /// it; then serves them. Gives up if a newer epoch appears (adopting it
    /// takes over).
    async fn acquire(
        &self,
        record: Arc<RingRecord>,
        from: readstates_routing::Node,
        slots: Vec<Slot>,
    ) {
        let epoch = record.ring.epoch();
        let started = tokio::time::Instant::now();
        let mut attempts = 0u32;
        loop {
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
        for &slot in &slots {
            self.ownership().set(slot, SlotState::Serving);
        }
        tracing::info!(
            epoch,
            from = %from.id,
            slots = slots.len(),
            waited_ms = started.elapsed().as_millis() as u64,
            "acquired"
        );
        self.inner.poke.notify_one();
    }

    /// `ReleaseSlots` from the new owner of `slots` in `epoch`: answers once
    /// this node has adopted that epoch and let go of them.
    pub async fn release_slots(&self, epoch: u64, slots: &[Slot]) -> Result<(), Error> {
        let mut released = self.inner.released.subscribe();
        if *released.borrow() < epoch {
            self.inner.poke.notify_one();
            // Never closed: the sender lives in `self`.
            let _ = released.wait_for(|&e| e >= epoch).await;
        }
        let adopted = self.ring().ring.epoch();
        for &slot in slots {
            let state = self.ownership().state(slot);
            if state != SlotState::NotOwner {
                return Err(Error::NotReleased {
                    slot,
                    epoch: adopted,
                    state,
                });
            }
        }
        Ok(())
    }
}
