//! The deletions a node applied recently, so that a retried MessageDeleted
//! lowers no count twice.
//!
//! A deletion lowers the counts of every read state that counted its message,
//! and nothing in the read state tells a first delivery from a retry (the
//! watermark stays where it was). So a deletion is claimed here, by (channel,
//! kind, message, recipients), before it is applied: a second delivery while the first
//! is under way is told to retry, one after it was applied does nothing, and
//! one whose first delivery was cut before it applied goes ahead. Applied
//! deletions are remembered for a window and at most `capacity` of them,
//! oldest forgotten first.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::read_state::Kind;

/// Which deletion: one message of one channel, counted in one kind, for
/// one set of users. The users are part of it because a message reaching
/// more users than one request may list is deleted in several requests, each
/// a deletion of its own; a retry lists the same users again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Deletion {
    pub channel_id: u64,
    pub message_id: u64,
    pub kind: Kind,
    /// A hash of the users and what the message was to each.
    pub recipients: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    /// A delivery is being applied.
    Claimed,
    /// Applied at this instant.
    Applied(Instant),
}

/// What [`RecentDeletions::claim`] found.
#[derive(Debug)]
pub enum Claim<'a> {
    /// Apply it; call [`Claimed::applied`] in the same step that applies it.
    New(Claimed<'a>),
    /// Applied within the window: do nothing.
    Applied,
    /// Another delivery is being applied right now.
    UnderWay,
}

#[derive(Debug)]
pub struct RecentDeletions {
    inner: Mutex<Inner>,
    window: Duration,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Inner {
    seen: HashMap<Deletion, Seen>,
    /// Applied deletions, oldest first.
    applied: VecDeque<(Instant, Deletion)>,
}

impl RecentDeletions {
    pub fn new(window: Duration, capacity: usize) -> RecentDeletions {
        RecentDeletions {
            inner: Mutex::default(),
            window,
            capacity: capacity.max(1),
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn claim(&self, deletion: Deletion) -> Claim<'_> {
        let mut inner = self.inner();
        inner.forget_before(Instant::now().checked_sub(self.window));
        match inner.seen.get(&deletion) {
            Some(Seen::Applied(_)) => Claim::Applied,
            Some(Seen::Claimed) => Claim::UnderWay,
            None => {
                inner.seen.insert(deletion, Seen::Claimed);
                Claim::New(Claimed {
                    deletions: self,
                    deletion,
                    applied: AtomicBool::new(false),
                })
            }
        }
    }

    /// Deletions remembered (applied or under way).
    pub fn len(&self) -> usize {
        self.inner().seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn settle(&self, deletion: Deletion, applied: bool) {
        let mut inner = self.inner();
        if !applied {
            inner.seen.remove(&deletion);
            return;
        }
        let now = Instant::now();
        inner.seen.insert(deletion, Seen::Applied(now));
        inner.applied.push_back((now, deletion));
        while inner.applied.len() > self.capacity {
            inner.forget_oldest();
        }
    }
}

impl Inner {
    fn forget_before(&mut self, cutoff: Option<Instant>) {
        let Some(cutoff) = cutoff else { return };
        while self.applied.front().is_some_and(|&(at, _)| at <= cutoff) {
            self.forget_oldest();
        }
    }

    fn forget_oldest(&mut self) {
        if let Some((at, deletion)) = self.applied.pop_front()
            // Only if it was not claimed again since (after an earlier forget).
            && self.seen.get(&deletion) == Some(&Seen::Applied(at))
        {
            self.seen.remove(&deletion);
        }
    }
}

/// A claimed deletion: remembered as applied when dropped after
/// [`Claimed::applied`], forgotten otherwise (a delivery cut before it
/// applied, so that its retry applies it).
#[derive(Debug)]
pub struct Claimed<'a> {
    deletions: &'a RecentDeletions,
    deletion: Deletion,
    applied: AtomicBool,
}

impl Claimed<'_> {
    /// The deletion is applied (called where it is, without an `.await`
    /// between, so a dropped request cannot lose this).
    pub fn applied(&self) {
        self.applied.store(true, Ordering::Relaxed);
    }
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        self.deletions
            .settle(self.deletion, self.applied.load(Ordering::Relaxed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Deletion = Deletion {
        channel_id: 1,
        message_id: 2,
        kind: Kind::Channel,
        recipients: 3,
    };

    #[tokio::test(start_paused = true)]
    async fn an_applied_deletion_is_remembered_for_the_window() {
        let recent = RecentDeletions::new(Duration::from_secs(600), 10);
        let Claim::New(claimed) = recent.claim(D) else {
            panic!("first delivery")
        };
        assert!(matches!(recent.claim(D), Claim::UnderWay));
        claimed.applied();
        drop(claimed);
        assert!(matches!(recent.claim(D), Claim::Applied));
        tokio::time::advance(Duration::from_secs(599)).await;
        assert!(matches!(recent.claim(D), Claim::Applied));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(matches!(recent.claim(D), Claim::New(_)), "past the window");
        assert!(recent.is_empty(), "the unapplied claim is forgotten");
    }

    #[tokio::test(start_paused = true)]
    async fn a_delivery_cut_before_it_applied_leaves_nothing_behind() {
        let recent = RecentDeletions::new(Duration::from_secs(600), 10);
        drop(recent.claim(D));
        assert!(matches!(recent.claim(D), Claim::New(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn another_batch_of_the_same_message_is_another_deletion() {
        let recent = RecentDeletions::new(Duration::from_secs(600), 10);
        let Claim::New(claimed) = recent.claim(D) else {
            panic!("first batch")
        };
        claimed.applied();
        drop(claimed);
        let second_batch = Deletion { recipients: 4, ..D };
        assert!(matches!(recent.claim(second_batch), Claim::New(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn beyond_the_capacity_the_oldest_are_forgotten() {
        let recent = RecentDeletions::new(Duration::from_secs(600), 3);
        for message_id in 1..=5 {
            let deletion = Deletion { message_id, ..D };
            let Claim::New(claimed) = recent.claim(deletion) else {
                panic!("new")
            };
            claimed.applied();
        }
        assert_eq!(recent.len(), 3);
        assert!(matches!(
            recent.claim(Deletion { message_id: 1, ..D }),
            Claim::New(_)
        ));
        assert!(matches!(
            recent.claim(Deletion { message_id: 5, ..D }),
            Claim::Applied
        ));
    }
}
