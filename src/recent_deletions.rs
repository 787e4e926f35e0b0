//! The deleted messages each user was lowered for recently, so that a
//! retried MessageDeleted lowers no user twice.
//!
//! A deletion lowers the counts of every read state that counted its message,
//! and nothing in the read state tells a first delivery from a retry (the
//! watermark stays where it was). So each lowering is remembered by (user,
//! channel, kind, message), whatever request it came in: a retry, a retry
//! that lists the users differently (a refreshed member list, another split
//! in batches) and a deletion split over several requests all lower each
//! user at most once. The memory is kept in the user's cache shard and
//! checked and written under the shard's lock, in the step that lowers the
//! user, so two deliveries at once cannot both lower it; it outlives the
//! user's eviction. Lowerings are remembered for a window and at most
//! `capacity` of them, oldest forgotten first. They are written with their
//! user ([`RecentDeletions::of_user`], in the write that holds the lowering
//! itself) and taken back when it is loaded ([`RecentDeletions::restore`]),
//! so a retry after a restart lowers nobody twice either.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use hashbrown::HashTable;
use tokio::time::Instant;

use crate::read_state::Kind;

/// Which message was deleted: one message of one channel, counted in one
/// kind of read state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Deletion {
    pub channel_id: u64,
    pub message_id: u64,
    pub kind: Kind,
}

/// A lowering as it is stored with its user: what was deleted, and until
/// when (Unix milliseconds) it is remembered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remembered {
    pub deletion: Deletion,
    pub until_ms: u64,
}

/// One user's lowering, flat so that it packs in 40 bytes.
#[derive(Clone, Copy, Debug)]
struct Lowered {
    user_id: u64,
    channel_id: u64,
    message_id: u64,
    /// Milliseconds since the memory's epoch.
    at_ms: u64,
    kind: Kind,
}

impl Lowered {
    fn is(&self, user_id: u64, deletion: Deletion) -> bool {
        self.user_id == user_id
            && self.channel_id == deletion.channel_id
            && self.message_id == deletion.message_id
            && self.kind == deletion.kind
    }

    fn deletion(&self) -> Deletion {
        Deletion {
            channel_id: self.channel_id,
            message_id: self.message_id,
            kind: self.kind,
        }
    }

    fn hash(&self) -> u64 {
        hash(self.user_id, self.deletion())
    }
}

/// The lowerings of one shard's users.
#[derive(Debug)]
pub struct RecentDeletions {
    /// Oldest first; `lowered[i]` has the sequence number `first + i`.
    lowered: VecDeque<Lowered>,
    /// Sequence numbers of `lowered`, by the hash of what they hold.
    index: HashTable<u32>,
    first: u32,
    /// How many of `lowered` each user has: most users have none, and
    /// their writes need not look.
    per_user: HashMap<u64, u32>,
    window: Duration,
    capacity: usize,
    epoch: Instant,
}

impl RecentDeletions {
    pub fn new(window: Duration, capacity: usize) -> RecentDeletions {
        RecentDeletions {
            lowered: VecDeque::new(),
            index: HashTable::new(),
            first: 0,
            per_user: HashMap::new(),
            window,
            capacity: capacity.max(1),
            // A window back, so that a lowering taken back from the store
            // keeps its age (see `restore`).
            epoch: Instant::now()
                .checked_sub(window)
                .unwrap_or_else(Instant::now),
        }
    }

    /// Whether `user_id` was lowered for `deletion` within the window.
    pub fn lowered(&mut self, user_id: u64, deletion: Deletion) -> bool {
        self.forget_expired();
        let cutoff = self.cutoff_ms();
        let (lowered, first) = (&self.lowered, self.first);
        self.index
            .find(hash(user_id, deletion), |&seq| {
                let entry = &lowered[seq.wrapping_sub(first) as usize];
                // One taken back from the store may sit behind newer ones.
                entry.is(user_id, deletion) && cutoff.is_none_or(|cutoff| entry.at_ms > cutoff)
            })
            .is_some()
    }

    /// Remembers that `user_id` was lowered for `deletion` (not already
    /// remembered: see [`RecentDeletions::lowered`]).
    pub fn remember(&mut self, user_id: u64, deletion: Deletion) {
        let now_ms = self.now_ms();
        self.remember_at(user_id, deletion, now_ms);
    }

    /// [`RecentDeletions::remember`], as of `at_ms` on the memory's clock.
    fn remember_at(&mut self, user_id: u64, deletion: Deletion, at_ms: u64) {
        if self.lowered.len() >= self.capacity {
            self.forget_oldest();
        }
        *self.per_user.entry(user_id).or_default() += 1;
        let seq = self.first.wrapping_add(self.lowered.len() as u32);
        self.lowered.push_back(Lowered {
            user_id,
            channel_id: deletion.channel_id,
            message_id: deletion.message_id,
            at_ms,
            kind: deletion.kind,
        });
        let (lowered, first) = (&self.lowered, self.first);
        self.index
            .insert_unique(hash(user_id, deletion), seq, |&seq| {
                lowered[seq.wrapping_sub(first) as usize].hash()
            });
    }

    /// The lowerings of the users `which` names (to hand them over with
    /// their users, see `cache::handoff`).
    pub fn of(&self, which: impl Fn(u64) -> bool) -> impl Iterator<Item = (u64, Deletion)> {
        self.lowered
            .iter()
            .filter(move |l| which(l.user_id))
            .map(|l| (l.user_id, l.deletion()))
    }

    /// What `user_id` is remembered lowered for, as it is stored with the
    /// user (`now_unix_ms` is the wall clock, which outlives the process).
    pub fn of_user(&self, user_id: u64, now_unix_ms: u64) -> Vec<Remembered> {
        if !self.per_user.contains_key(&user_id) {
            return Vec::new();
        }
        let (now_ms, window_ms) = (self.now_ms(), self.window.as_millis() as u64);
        (self.lowered.iter())
            .filter(|l| l.user_id == user_id)
            .filter_map(|l| {
                let left = (l.at_ms + window_ms)
                    .checked_sub(now_ms)
                    .filter(|&left| left > 0)?;
                Some(Remembered {
                    deletion: l.deletion(),
                    until_ms: now_unix_ms + left,
                })
            })
            .collect()
    }

    /// Takes back what `user_id` was remembered lowered for when it was
    /// written, for what is left of each window.
    pub fn restore(&mut self, user_id: u64, remembered: &[Remembered], now_unix_ms: u64) {
        let (now_ms, window_ms) = (self.now_ms(), self.window.as_millis() as u64);
        for stored in remembered {
            let Some(left) = stored.until_ms.checked_sub(now_unix_ms) else {
                continue;
            };
            let left = left.min(window_ms);
            if left == 0 || self.lowered(user_id, stored.deletion) {
                continue;
            }
            // As old as it was (the memory's clock starts a window back).
            let at_ms = (now_ms + left).saturating_sub(window_ms);
            self.remember_at(user_id, stored.deletion, at_ms);
        }
    }

    /// Lowerings remembered.
    pub fn len(&self) -> usize {
        self.lowered.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lowered.is_empty()
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Lowerings at or before this (on the memory's clock) are past the
    /// window.
    fn cutoff_ms(&self) -> Option<u64> {
        self.now_ms().checked_sub(self.window.as_millis() as u64)
    }

    fn forget_expired(&mut self) {
        let Some(cutoff) = self.cutoff_ms() else {
            return;
        };
        while self.lowered.front().is_some_and(|l| l.at_ms <= cutoff) {
            self.forget_oldest();
        }
    }

    fn forget_oldest(&mut self) {
        let Some(oldest) = self.lowered.pop_front() else {
            return;
        };
        if let Some(count) = self.per_user.get_mut(&oldest.user_id) {
            *count -= 1;
            if *count == 0 {
                self.per_user.remove(&oldest.user_id);
            }
        }
        let first = self.first;
        if let Ok(entry) = self.index.find_entry(oldest.hash(), |&seq| seq == first) {
            entry.remove();
        }
        self.first = self.first.wrapping_add(1);
    }
}

/// The splitmix64 finalizer over the key's fields.
fn hash(user_id: u64, deletion: Deletion) -> u64 {
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let key = mix(user_id)
        ^ mix(deletion.channel_id).rotate_left(17)
        ^ mix(deletion.message_id).rotate_left(31)
        ^ deletion.kind as u64;
    mix(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Deletion = Deletion {
        channel_id: 1,
        message_id: 2,
        kind: Kind::Channel,
    };

    #[tokio::test(start_paused = true)]
    async fn a_lowering_is_remembered_for_the_window() {
        let mut recent = RecentDeletions::new(Duration::from_secs(600), 10);
        assert!(!recent.lowered(7, D));
        recent.remember(7, D);
        assert!(recent.lowered(7, D));
        assert!(!recent.lowered(8, D), "another user");
        assert!(!recent.lowered(7, Deletion { message_id: 3, ..D }));
        assert!(!recent.lowered(7, Deletion { channel_id: 3, ..D }));
        tokio::time::advance(Duration::from_secs(599)).await;
        assert!(recent.lowered(7, D));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!recent.lowered(7, D), "past the window");
        assert!(recent.is_empty(), "forgotten");
    }

    #[tokio::test(start_paused = true)]
    async fn beyond_the_capacity_the_oldest_are_forgotten() {
        let mut recent = RecentDeletions::new(Duration::from_secs(600), 3);
        for user_id in 1..=5 {
            recent.remember(user_id, D);
        }
        assert_eq!(recent.len(), 3);
        assert!(!recent.lowered(1, D));
        assert!(!recent.lowered(2, D));
        assert!((3..=5).all(|user_id| recent.lowered(user_id, D)));
    }

    /// The index holds sequence numbers that wrap: a long-lived memory keeps
    /// finding what it holds past `u32::MAX` lowerings.
    #[tokio::test(start_paused = true)]
    async fn sequence_numbers_wrap() {
        let mut recent = RecentDeletions::new(Duration::from_secs(600), 4);
        recent.first = u32::MAX - 2;
        for user_id in 1..=10 {
            recent.remember(user_id, D);
            assert!(recent.lowered(user_id, D), "user {user_id}");
        }
        assert_eq!(recent.len(), 4);
        assert!((7..=10).all(|user_id| recent.lowered(user_id, D)));
        assert!(!recent.lowered(6, D));
    }

    /// Issue 35, item 5: what a user was lowered for goes with its writes
    /// and comes back with its load, for what is left of its window.
    #[tokio::test(start_paused = true)]
    async fn a_lowering_written_with_its_user_comes_back_for_the_rest_of_its_window() {
        let mut before = RecentDeletions::new(Duration::from_secs(600), 10);
        before.remember(7, D);
        assert!(before.of_user(8, 1_000_000).is_empty(), "another user");
        tokio::time::advance(Duration::from_secs(100)).await;
        let stored = before.of_user(7, 1_000_000);
        assert_eq!(
            stored,
            [Remembered {
                deletion: D,
                until_ms: 1_000_000 + 500_000
            }]
        );
        // A new process, 200 s later by the wall clock.
        let mut after = RecentDeletions::new(Duration::from_secs(600), 10);
        after.restore(7, &stored, 1_200_000);
        assert!(after.lowered(7, D));
        assert!(!after.lowered(8, D));
        tokio::time::advance(Duration::from_secs(299)).await;
        assert!(after.lowered(7, D), "299 of the 300 s left");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!after.lowered(7, D), "past its window");
        // One whose window ended meanwhile is not taken back.
        let mut late = RecentDeletions::new(Duration::from_secs(600), 10);
        late.restore(7, &stored, 1_500_001);
        assert!(!late.lowered(7, D));
        assert!(late.is_empty());
    }
}
