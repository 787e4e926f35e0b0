//! Where a user's read states are kept: the [`Entries`] a
//! [`super::UserReadStates`] changes in place ([`Owned`] on their own, or the
//! cache's packed arena), and the [`Header`] of versions kept beside them.

use std::ops::DerefMut;

use super::{Kind, ReadState};

/// A user's versions without its read states: what the cache keeps beside
/// the read states, which it stores packed (see [`super::UserReadStates::from_parts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub version: u64,
    pub written_version: u64,
    pub delta_floor: u64,
    /// A "delete all" at `delta_floor` is not written yet.
    pub clear_pending: bool,
}

/// Where a user's read states live, sorted by key: [`Owned`] on their own;
/// the cache keeps them in its arena and changes them there. Beside them,
/// the parent ids of the thread read states (tombstones too): 8 bytes each,
/// kept only for threads, which sort last, so the `i`-th parent is that of
/// the `i`-th thread entry. Only [`super::UserReadStates`] keeps the two in step.
pub trait Entries: DerefMut<Target = [ReadState]> {
    /// Inserts `entry` at `index`, shifting the ones after it up.
    fn insert(&mut self, index: usize, entry: ReadState);
    /// Keeps only the entries `keep` says to, in order.
    fn retain(&mut self, keep: impl FnMut(&ReadState) -> bool);
    /// Removes every entry.
    fn clear(&mut self);
    /// The parent ids of the thread entries, in their order.
    fn parents(&self) -> &[u64];
    /// Replaces them (rare: only following a thread or dropping one moves
    /// them).
    fn set_parents(&mut self, parents: &[u64]);
}

/// A user's read states on their own (loaded, handed over, in tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owned {
    entries: Vec<ReadState>,
    parents: Vec<u64>,
}

impl Owned {
    /// `entries` sorted by key, with the parent ids of its thread entries.
    pub fn new(entries: Vec<ReadState>, parents: Vec<u64>) -> Owned {
        Owned { entries, parents }
    }

    /// Read states each with its parent id (0 but for a thread's), in any
    /// order: sorted, one per key, and a thread read state without a
    /// parent dropped (no build makes one).
    pub fn from_rows(mut rows: Vec<(ReadState, u64)>) -> Owned {
        rows.retain(|(e, parent)| e.kind != Kind::Thread || *parent != 0);
        rows.sort_unstable_by_key(|(e, _)| e.key());
        rows.dedup_by_key(|(e, _)| e.key());
        let first = rows.partition_point(|(e, _)| e.kind < Kind::Thread);
        let parents = rows[first..].iter().map(|&(_, parent)| parent).collect();
        let mut entries: Vec<ReadState> = rows.into_iter().map(|(e, _)| e).collect();
        entries.shrink_to_fit();
        Owned { entries, parents }
    }
}

impl std::ops::Deref for Owned {
    type Target = [ReadState];

    fn deref(&self) -> &[ReadState] {
        &self.entries
    }
}

impl DerefMut for Owned {
    fn deref_mut(&mut self) -> &mut [ReadState] {
        &mut self.entries
    }
}

impl Entries for Owned {
    fn insert(&mut self, index: usize, entry: ReadState) {
        // Exact growth: per-user vectors are small and many, and doubling
        // would waste a third of them on average.
        self.entries.reserve_exact(1);
        self.entries.insert(index, entry);
    }

    fn retain(&mut self, keep: impl FnMut(&ReadState) -> bool) {
        self.entries.retain(keep);
    }

    fn clear(&mut self) {
        *self = Owned::default();
    }

    fn parents(&self) -> &[u64] {
        &self.parents
    }

    fn set_parents(&mut self, parents: &[u64]) {
        self.parents = parents.to_vec();
    }
}

/// Where a user's thread entries start (they sort last).
pub fn first_thread(entries: &[ReadState]) -> usize {
    entries.partition_point(|e| e.kind < Kind::Thread)
}

/// How many of a user's entries are threads' (tombstones too): how many
/// parents they have.
pub fn thread_count(entries: &[ReadState]) -> usize {
    entries.len() - first_thread(entries)
}
