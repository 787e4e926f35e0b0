//! Where the ring is kept: [`RingStore`], a small trait over one record
//! changed by compare-and-set on its epoch, each node's progress, and each
//! node's lease (see [`crate::cluster::lease`]).
//!
//! Implementations: [`cassandra`] (lightweight transactions, production) and
//! [`memory`] (one process: unit and in-process tests).

pub mod cassandra;
pub mod memory;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use async_trait::async_trait;
use readstates_routing::{Ring, SLOTS, Slot};

use crate::store::StoreError;

/// The ring as stored: the current epoch's, the one before (whom a new
/// owner asks to release a slot) and the releases forced by an operator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingRecord {
    pub ring: Ring,
    /// Epoch `ring.epoch() - 1` (the empty ring before epoch 1).
    pub previous: Ring,
    /// Nodes whose slots moving in this epoch count as released, whether or
    /// not they answered (`readstates ring release NODE --force`).
    pub released: BTreeSet<String>,
}

impl RingRecord {
    /// Before the first change: epoch 0, nobody owns anything.
    pub fn empty() -> RingRecord {
        RingRecord {
            ring: Ring::empty(),
            previous: Ring::empty(),
            released: BTreeSet::new(),
        }
    }

    /// The record of the next epoch, `next`, after this one.
    pub fn advance(&self, next: Ring) -> RingRecord {
        debug_assert_eq!(next.epoch(), self.ring.epoch() + 1);
        RingRecord {
            ring: next,
            previous: self.ring.clone(),
            released: BTreeSet::new(),
        }
    }

    /// The slots that change owner in this epoch, with the previous owner's
    /// id (`None`: unowned before).
    pub fn moving(&self) -> impl Iterator<Item = (Slot, Option<&str>)> + '_ {
        (0..SLOTS as Slot).filter_map(|slot| {
            let before = self.previous.owner(slot).map(|n| n.id.as_str());
            let now = self.ring.owner(slot).map(|n| n.id.as_str());
            (before != now).then_some((slot, before))
        })
    }

    /// Owners of the current epoch that do not serve all their slots yet,
    /// given each node's progress (see [`RingStore::progress`]).
    pub fn waiting_on(&self, progress: &BTreeMap<String, u64>) -> Vec<String> {
        let epoch = self.ring.epoch();
        self.ring
            .nodes()
            .iter()
            .filter(|n| self.ring.slots_of(&n.id).next().is_some())
            .filter(|n| progress.get(&n.id).is_none_or(|&e| e < epoch))
            .map(|n| n.id.clone())
            .collect()
    }
}

#[async_trait]
pub trait RingStore: Send + Sync + std::fmt::Debug {
    /// The current record ([`RingRecord::empty`] before the first change),
    /// as of the last compare-and-set that succeeded.
    async fn load(&self) -> Result<RingRecord, StoreError>;

    /// Stores `next` if the stored epoch is still the one before it; false
    /// if another change came first.
    async fn advance(&self, next: &RingRecord) -> Result<bool, StoreError>;

    /// Adds `node` to the forced releases of `epoch`; false if `epoch` is
    /// no longer the current one.
    async fn release(&self, epoch: u64, node: &str) -> Result<bool, StoreError>;

    /// Records that `node` serves every slot it owns in `epoch`.
    async fn report(&self, node: &str, epoch: u64) -> Result<(), StoreError>;

    /// The newest epoch each node reported.
    async fn progress(&self) -> Result<BTreeMap<String, u64>, StoreError>;

    /// The weight `node` had when it drained itself, until it takes it back.
    async fn drained_weight(&self, node: &str) -> Result<Option<u32>, StoreError>;

    /// Remembers (or, with `None`, forgets) the weight `node` drained from.
    async fn set_drained_weight(&self, node: &str, weight: Option<u32>) -> Result<(), StoreError>;

    /// `node`'s lease as last changed (`None`: it never took one).
    async fn lease(&self, node: &str) -> Result<Option<LeaseRecord>, StoreError>;

    /// Sets `node`'s lease to `next` if it is still `seen` (`None`: no
    /// record yet); false if it changed meanwhile. Renewing, taking,
    /// releasing and revoking a lease are all this one compare-and-set.
    async fn swap_lease(
        &self,
        node: &str,
        seen: Option<&LeaseRecord>,
        next: &LeaseRecord,
    ) -> Result<bool, StoreError>;
}

/// A node's lease on its slots as stored (see `cluster::lease`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRecord {
    /// The incarnation holding it; empty once released or revoked.
    pub holder: String,
    /// Raised by every change of the record: others time its changes.
    pub renewals: u64,
    /// Which copy of the node's unwritten changes a takeover may use: the
    /// token of the backup stream that holds every change it answered, or
    /// [`NO_BACKUP`] while it answers on its own journal alone. Empty in
    /// records of builds before it (a takeover then goes by the stream).
    pub backup: String,
    /// How long the holder serves past each renewal: whoever watches for
    /// a lapse waits at least this long (see
    /// `LeaseConfig::lapse_of`). `None` in records of builds before it,
    /// and in records nobody holds.
    pub lease: Option<Duration>,
}

/// How a lease taken by a takeover (`cluster::backup::takeover`, or an
/// operator's `ring remove --force`) names its holder, followed by who.
pub const TAKEOVER_BY: &str = "takeover by ";

/// The holder an operator's `ring remove --force` records: it has no copy
/// to write.
pub const OPERATOR_TAKEOVER: &str = "takeover by an operator";

/// [`LeaseRecord::backup`] of a node whose changes rest on its own
/// journal alone: no copy held elsewhere may take it over.
pub const NO_BACKUP: &str = "none";

impl LeaseRecord {
    /// Whether an incarnation holds it.
    pub fn held(&self) -> bool {
        !self.holder.is_empty()
    }

    /// Whether a backup's takeover holds it and has written every change
    /// the node answered (it then names no copy: see
    /// `cluster::backup::takeover`): the store is all there is of the node,
    /// and the node serves nothing. Not an operator's, which has no copy.
    pub fn copy_written_by_takeover(&self) -> bool {
        self.holder.starts_with(TAKEOVER_BY)
            && self.holder != OPERATOR_TAKEOVER
            && self.backup == NO_BACKUP
    }
}
