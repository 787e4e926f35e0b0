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
//! `capacity` of them, oldest forgotten first.

use std::collections::VecDeque;
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

    fn hash(&self) -> u64 {
        let deletion = Deletion {
            channel_id: self.channel_id,
            message_id: self.message_id,
            kind: self.kind,
        };
        hash(self.user_id, deletion)
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
            window,
            capacity: capacity.max(1),
            epoch: Instant::now(),
        }
    }

    /// Whether `user_id` was lowered for `deletion` within the window.
    pub fn lowered(&mut self, user_id: u64, deletion: Deletion) -> bool {
        self.forget_expired();
        let (lowered, first) = (&self.lowered, self.first);
        self.index
            .find(hash(user_id, deletion), |&seq| {
                lowered[seq.wrapping_sub(first) as usize].is(user_id, deletion)
            })
            .is_some()
    }

    /// Remembers that `user_id` was lowered for `deletion` (not already
    /// remembered: see [`RecentDeletions::lowered`]).
    pub fn remember(&mut self, user_id: u64, deletion: Deletion) {
        if self.lowered.len() >= self.capacity {
            self.forget_oldest();
        }
        let seq = self.first.wrapping_add(self.lowered.len() as u32);
        self.lowered.push_back(Lowered {
            user_id,
            channel_id: deletion.channel_id,
            message_id: deletion.message_id,
            at_ms: self.now_ms(),
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
            .map(|l| {
                let deletion = Deletion {
                    channel_id: l.channel_id,
                    message_id: l.message_id,
                    kind: l.kind,
                };
                (l.user_id, deletion)
            })
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

    fn forget_expired(&mut self) {
        let Some(cutoff) = self.now_ms().checked_sub(self.window.as_millis() as u64) else {
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
}
