//! This node as a member of the fleet: follows the ring and moves its slots
//! through their states, release before acquire.
//!
//! On a new epoch the node marks the slots it gained `Acquiring` (requests
//! for them are forwarded to their previous owners, or held here once those
//! refuse them). For the slots it lost, it hands their users to their new
//! owners from memory (`HandOver`, see [`super::handoff`]): a copy ahead
//! (in rounds) while it still serves them, then it stops serving them
//! (`Releasing`: their requests are forwarded to the new owners, which hold
//! them), lets the changes already applied finish, and sends what changed
//! since.
//! Unwritten changes, due times and deletion memory travel with the users,
//! and the new owner writes them. Only once a new owner has them all are
//! they dropped here unwritten; if a handoff fails, they are written to the
//! store and dropped (`Cache::release`), as a cold move. Then, and only
//! then, does the node answer the new owners' `ReleaseSlots`. A slot is
//! served nowhere only during that short part. The slots it gained are
//! served once their previous owner has released them, or once an operator
//! forced the release of a dead owner. No timeout lets it start early. When
//! it serves every slot it owns, it reports the epoch, and `readstates
//! ring` may make the next one.
//!
//! Here: following the ring and adopting each epoch. The slot moves:
//! [`release`] (giving slots up), [`receive`] (a handoff coming in) and
//! [`acquire`] (taking slots up).

mod acquire;
mod receive;
mod release;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use metrics::gauge;
use readstates_routing::{SLOTS, Slot};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::peers::Peers;
use super::ring_store::{RingRecord, RingStore};
use crate::cache::Cache;
use crate::metrics::IN_RING;
use crate::ownership::{Ownership, SlotState};
use receive::HandedIn;

/// `slots` as a set: whether each slot is one of them.
fn slot_set(slots: &[Slot]) -> Vec<bool> {
    let mut set = vec![false; SLOTS];
    for &slot in slots {
        set[usize::from(slot)] = true;
    }
    set
}

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
    /// Bumped each time slots are let go within an epoch's releases, so
    /// that `ReleaseSlots` for them answers without waiting for the rest.
    let_go: watch::Sender<u64>,
    /// Wakes the follower for an early look at the ring.
    poke: Notify,
    /// Set once the ring has been read and adopted: requests can be routed.
    routing: watch::Sender<bool>,
    /// The handoffs of slots being acquired. Its lock also makes a
    /// handoff's check and install of a chunk one step against the slots
    /// starting to be served (see [`Member::serve`]).
    handed_in: std::sync::Mutex<HandedIn>,
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
                let_go: watch::Sender::new(0),
                poke: Notify::new(),
                routing: watch::Sender::new(false),
                handed_in: std::sync::Mutex::default(),
            }),
        }
    }

    pub fn id(&self) -> &str {
        &self.inner.id
    }

    pub fn ownership(&self) -> &Ownership {
        self.inner.cache.ownership()
    }

    /// Where the ring and the leases are kept.
    pub fn ring_store(&self) -> &Arc<dyn RingStore> {
        &self.inner.ring_store
    }

    /// How this node calls the others.
    pub fn peers(&self) -> &Arc<dyn Peers> {
        &self.inner.peers
    }

    pub fn cache(&self) -> &Arc<Cache> {
        &self.inner.cache
    }

    fn handed_in(&self) -> std::sync::MutexGuard<'_, HandedIn> {
        self.inner
            .handed_in
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The ring as this node last adopted it.
    pub fn ring(&self) -> Arc<RingRecord> {
        self.inner.ring.borrow().clone()
    }

    /// The ring as this node adopts it, epoch after epoch.
    pub fn ring_changes(&self) -> watch::Receiver<Arc<RingRecord>> {
        self.inner.ring.subscribe()
    }

    /// Looks at the ring now, and waits (at most `within`) until this node
    /// has adopted `epoch` or a later one.
    pub async fn catch_up(&self, epoch: u64, within: Duration) {
        self.inner.poke.notify_one();
        let mut ring = self.inner.ring.subscribe();
        let _ = tokio::time::timeout(within, ring.wait_for(|r| r.ring.epoch() >= epoch)).await;
    }

    /// Waits until this node's releases of `epoch` (or a later one) are
    /// done: the slots it lost there are no longer its own.
    pub async fn releases_done(&self, epoch: u64) {
        // Never closed: the sender lives in `self`.
        let _ = (self.inner.released.subscribe())
            .wait_for(|&done| done >= epoch)
            .await;
    }

    /// Waits until this node has read the ring and adopted it, so that it
    /// routes every request (before, it would refuse them all as not its
    /// own): what its readiness waits for.
    pub async fn routing(&self) {
        // Never closed: the sender lives in `self`.
        let _ = self
            .inner
            .routing
            .subscribe()
            .wait_for(|&routing| routing)
            .await;
    }

    /// Follows the ring until `stop`.
    pub fn start(&self, stop: CancellationToken) -> JoinHandle<()> {
        let member = self.clone();
        tokio::spawn(async move { member.follow(stop).await })
    }

    async fn follow(self, stop: CancellationToken) {
        let mut reported = 0;
        let mut in_ring = None;
        loop {
            match self.inner.ring_store.load().await {
                Ok(record) if record.ring.epoch() > self.ring().ring.epoch() => {
                    tokio::select! {
                        () = self.adopt(Arc::new(record)) => {}
                        () = stop.cancelled() => return,
                    }
                }
                Ok(_) => {
                    self.inner.routing.send_replace(true);
                }
                Err(e) => tracing::warn!(error = %e, "cannot read the ring"),
            }
            self.say_whether_in_ring(&mut in_ring);
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

    /// Says (a gauge, and a warning when it starts) whether the ring
    /// adopted names this node: out of it, the node only forwards.
    fn say_whether_in_ring(&self, said: &mut Option<bool>) {
        let record = self.ring();
        if record.ring.epoch() == 0 {
            return;
        }
        let in_ring = record.ring.node(&self.inner.id).is_some();
        if *said == Some(in_ring) {
            return;
        }
        gauge!(IN_RING).set(if in_ring { 1.0 } else { 0.0 });
        let epoch = record.ring.epoch();
        match (*said, in_ring) {
            (Some(true), false) => tracing::warn!(
                epoch,
                "this node was taken out of the ring: it owns no slot and only forwards; \
                 with --join-weight it adds itself back once it holds its lease, \
                 otherwise `readstates ring add` it"
            ),
            // A new node before it joins, or one started again after it
            // was taken over (`readstates_in_ring` says so if it stays out).
            (None, false) => tracing::info!(epoch, "this node is not in the ring yet"),
            _ => {}
        }
        *said = Some(in_ring);
    }

    /// Whether every slot this node owns in the adopted epoch is served.
    fn serves_all(&self) -> bool {
        let record = self.ring();
        record
            .ring
            .slots_of(&self.inner.id)
            .all(|slot| self.ownership().state(slot) == SlotState::Serving)
    }

    /// Moves to `record`: marks what it gained as being acquired, releases
    /// what it lost (handing its users over), then acquires.
    async fn adopt(&self, record: Arc<RingRecord>) {
        let me = self.inner.id.as_str();
        let epoch = record.ring.epoch();
        let ownership = self.ownership();
        let owned = |slot: Slot| record.ring.owner(slot).is_some_and(|n| n.id == me);
        let leaving: Vec<bool> = (0..SLOTS as Slot)
            .map(|slot| !owned(slot) && ownership.state(slot) != SlotState::NotOwner)
            .collect();
        let left = leaving.iter().filter(|&&l| l).count();
        // Gained slots, by whom they come from; marked first (before the
        // epoch is adopted, which a `HandOver` waits for), so that a node
        // handing slots to this one while this one hands others to it finds
        // them being acquired here.
        let mut gaining: BTreeMap<Option<String>, Vec<Slot>> = BTreeMap::new();
        for slot in (0..SLOTS as Slot).filter(|&s| owned(s)) {
            if ownership.assigned(slot) == SlotState::Serving {
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

        self.inner.ring.send_replace(record.clone());
        self.inner.routing.send_replace(true);
        tracing::info!(epoch, releasing = left, "new epoch");

        // Lost slots, by whom they go to: their users handed over (copied
        // ahead while still served here, then no longer served: requests
        // for them are forwarded to the new owners, which hold them), or
        // else written; then released.
        let started = tokio::time::Instant::now();
        let mut losing: BTreeMap<Option<String>, Vec<Slot>> = BTreeMap::new();
        for slot in (0..SLOTS as Slot).filter(|&s| leaving[usize::from(s)]) {
            let to = record.ring.owner(slot).map(|n| n.id.clone());
            losing.entry(to).or_default().push(slot);
        }
        let current = &*record;
        let releases = losing.into_iter().map(|(to, slots)| async move {
            let users = self.release(current, to, &slots).await;
            // Let go: their new owner need not wait for the other groups.
            for &slot in &slots {
                ownership.set(slot, SlotState::NotOwner);
            }
            self.inner.let_go.send_modify(|n| *n += 1);
            users
        });
        let users: usize = futures::future::join_all(releases).await.into_iter().sum();
        self.inner.released.send_replace(epoch);
        if left > 0 {
            tracing::info!(
                epoch,
                slots = left,
                users,
                took_ms = started.elapsed().as_millis() as u64,
                "released"
            );
        }

        let acquisitions = gaining.into_iter().filter_map(|(from, slots)| {
            let node = record.previous.node(from.as_deref()?)?.clone();
            Some(self.acquire(record.clone(), node, slots))
        });
        futures::future::join_all(acquisitions).await;
    }
}
