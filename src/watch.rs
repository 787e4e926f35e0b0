//! Live change streams: what a `Watch` stream is sent, and the bounded queue
//! that holds it until the client reads it.
//!
//! A [`Feed`] is one stream's queue. The cache shard that holds a watched user
//! publishes each of its changes to the user's feeds under the shard lock, in
//! the same critical section as the change, so events are in version order
//! with no gap. Publishing never waits: a feed that is full drops the user
//! instead and queues a resync event with the last version it did queue, and
//! the client subscribes again from there. A slow reader therefore costs
//! writers nothing and holds at most `capacity` events (plus one resync per
//! user it watched).

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::read_state::{Channels, Shown};
use crate::read_state::{Counts, Key, UserView};

/// One change of one user (or, on subscribe, what changed since the
/// subscriber's version), with the user's totals after it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub user_id: u64,
    /// The user's version after the change.
    pub version: u64,
    /// False: `read_states` is the full set and replaces what the client holds.
    pub partial: bool,
    /// As clients see them: counted now in a channel counted by channel.
    pub read_states: Vec<Shown>,
    pub deleted: Vec<Key>,
    pub counts: Counts,
    /// Counts that moved with channels counted by channel, the user
    /// unchanged (see [`crate::cache::recount`]).
    pub recounted: bool,
}

impl Change {
    /// What changed in `user` after version `since`: its delta, as
    /// GetReadStates answers it.
    pub fn since<'a>(
        user_id: u64,
        user: impl Into<UserView<'a>>,
        since: u64,
        channels: &impl Channels,
    ) -> Change {
        let user = user.into();
        let answer = user.answer(since, channels);
        Change {
            user_id,
            version: user.version(),
            partial: answer.partial,
            read_states: answer.read_states,
            deleted: answer.deleted,
            counts: answer.counts,
            recounted: false,
        }
    }

    /// The user's read states of the `changed` channels counted by channel,
    /// counted now, with the user's totals; `None` if it has none of them.
    pub fn recounted<'a>(
        user_id: u64,
        user: impl Into<UserView<'a>>,
        changed: &[u64],
        channels: &impl Channels,
    ) -> Option<Change> {
        let user = user.into();
        let read_states: Vec<Shown> = (changed.iter())
            .filter_map(|&channel_id| user.get(Key::channel(channel_id)))
            .map(|state| channels.shown(state))
            .collect();
        if read_states.is_empty() {
            return None;
        }
        Some(Change {
            user_id,
            version: user.version(),
            partial: true,
            read_states,
            deleted: Vec::new(),
            counts: user.counts(channels),
            recounted: true,
        })
    }
}

/// What a stream sends.
#[derive(Clone, Debug)]
pub enum Event {
    Changed(Arc<Change>),
    /// The feed was full: the user was dropped from it after `version`.
    Resync {
        user_id: u64,
        version: u64,
    },
    /// The user's slot moved to another node: it was dropped from this
    /// stream after `version`, to be subscribed at its new owner.
    Moved {
        user_id: u64,
        version: u64,
    },
    /// An event of a user served by another node of the fleet, relayed as
    /// that node sent it (see `grpc::watch::relay`).
    Relayed(Box<crate::proto::WatchEvent>),
    /// A subscribe or unsubscribe of `user_id` was refused.
    Rejected {
        user_id: u64,
        error: Error,
    },
}

/// What became of an offered change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    Queued,
    /// No room: the user was dropped and a resync queued.
    Full,
    /// The stream is gone: drop the subscription.
    Closed,
}

/// One stream's bounded event queue and the users it watches.
#[derive(Debug)]
pub struct Feed {
    queue: Mutex<Queue>,
    /// Woken when an event is queued, when room frees up, and on close.
    changed: Notify,
    /// Cancelled when the stream ends, from either side.
    closed: CancellationToken,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Queue {
    events: VecDeque<Event>,
    /// Users subscribed on this stream (kept here so that a resync, which
    /// the shard decides, drops its user in the same step).
    users: HashSet<u64>,
    /// Why the stream ends, sent after the queued events.
    ending: Option<Error>,
}

impl Feed {
    pub fn new(capacity: usize) -> Arc<Feed> {
        Arc::new(Feed {
            queue: Mutex::default(),
            changed: Notify::new(),
            closed: CancellationToken::new(),
            capacity: capacity.max(1),
        })
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues the first event of a subscription of `change.user_id` and
    /// records the subscription; on a full feed, queues a resync from
    /// `since` instead.
    pub fn subscribe(&self, change: Change, since: u64) -> Offer {
        let user_id = change.user_id;
        let offer = self.offer(Arc::new(change));
        match offer {
            Offer::Queued => {
                self.queue().users.insert(user_id);
            }
            Offer::Full => self.resync(user_id, since),
            Offer::Closed => {}
        }
        offer
    }

    /// Queues a change if there is room; never waits.
    pub fn offer(&self, change: Arc<Change>) -> Offer {
        if self.closed.is_cancelled() {
            return Offer::Closed;
        }
        let mut queue = self.queue();
        if queue.events.len() >= self.capacity {
            return Offer::Full;
        }
        queue.events.push_back(Event::Changed(change));
        drop(queue);
        self.changed.notify_one();
        Offer::Queued
    }

    /// Queues an event relayed from another node if there is room; never
    /// waits. One that ends the user's subscription there (moved, resync,
    /// rejected) is queued past the capacity, as at most one per user.
    pub fn relay(&self, event: crate::proto::WatchEvent) -> Offer {
        if self.closed.is_cancelled() {
            return Offer::Closed;
        }
        use crate::proto::watch_event::Event as Kind;
        let ends = !matches!(event.event, Some(Kind::Changed(_) | Kind::Recounted(_)));
        let mut queue = self.queue();
        if !ends && queue.events.len() >= self.capacity {
            return Offer::Full;
        }
        queue.events.push_back(Event::Relayed(Box::new(event)));
        drop(queue);
        self.changed.notify_one();
        Offer::Queued
    }

    /// Drops `user_id` from this feed and tells the client to subscribe again
    /// after `version`. Queued past the capacity: at most one per user.
    pub fn resync(&self, user_id: u64, version: u64) {
        self.drop_user(user_id, Event::Resync { user_id, version });
    }

    /// Drops `user_id` from this feed, its slot having moved to another
    /// node, where the client subscribes again after `version`. Queued past
    /// the capacity: at most one per user.
    pub fn moved(&self, user_id: u64, version: u64) {
        self.drop_user(user_id, Event::Moved { user_id, version });
    }

    fn drop_user(&self, user_id: u64, event: Event) {
        let mut queue = self.queue();
        queue.users.remove(&user_id);
        queue.events.push_back(event);
        drop(queue);
        self.changed.notify_one();
    }

    /// The user was unsubscribed; whether it was subscribed.
    pub fn forget(&self, user_id: u64) -> bool {
        self.queue().users.remove(&user_id)
    }

    /// Queues a refusal (callers wait for [`Feed::room`] first, so these
    /// stay within the capacity).
    pub fn reject(&self, user_id: u64, error: Error) {
        self.queue()
            .events
            .push_back(Event::Rejected { user_id, error });
        self.changed.notify_one();
    }

    /// Users subscribed on this feed.
    pub fn users(&self) -> Vec<u64> {
        self.queue().users.iter().copied().collect()
    }

    /// Whether `user_id` is subscribed on this feed.
    pub fn watches(&self, user_id: u64) -> bool {
        self.queue().users.contains(&user_id)
    }

    pub fn subscribed(&self) -> usize {
        self.queue().users.len()
    }

    /// Waits until the queue has room (or the feed is closed): the stream
    /// reads no more requests from a client that does not read its events.
    pub async fn room(&self) {
        loop {
            let changed = self.changed.notified();
            if self.closed.is_cancelled() || self.queue().events.len() < self.capacity {
                return;
            }
            changed.await;
        }
    }

    /// Ends the stream: queued events are still sent, then `ending` (if any)
    /// as its status.
    pub fn close(&self, ending: Option<Error>) {
        let mut queue = self.queue();
        if queue.ending.is_none() {
            queue.ending = ending;
        }
        drop(queue);
        self.closed.cancel();
        self.changed.notify_waiters();
        self.changed.notify_one();
    }

    /// Resolves when the feed is closed.
    pub async fn closed(&self) {
        self.closed.cancelled().await
    }

    /// The next event; `Err` with the ending once a closed feed is drained
    /// (`Err(None)`: it ended without an error).
    pub async fn next(&self) -> Result<Event, Option<Error>> {
        loop {
            let changed = self.changed.notified();
            {
                let mut queue = self.queue();
                if let Some(event) = queue.events.pop_front() {
                    let was_full = queue.events.len() + 1 >= self.capacity;
                    drop(queue);
                    if was_full {
                        // A request reader may be waiting for room.
                        self.changed.notify_waiters();
                    }
                    return Ok(event);
                }
                if self.closed.is_cancelled() {
                    return Err(queue.ending.take());
                }
            }
            changed.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(user_id: u64, version: u64) -> Arc<Change> {
        Arc::new(Change {
            user_id,
            version,
            partial: true,
            read_states: Vec::new(),
            deleted: Vec::new(),
            counts: Counts::default(),
            recounted: false,
        })
    }

    #[tokio::test]
    async fn a_full_feed_refuses_changes_and_resyncs_past_its_capacity() {
        let feed = Feed::new(2);
        assert_eq!(feed.subscribe((*change(1, 5)).clone(), 0), Offer::Queued);
        assert_eq!(feed.offer(change(1, 6)), Offer::Queued);
        assert_eq!(feed.offer(change(1, 7)), Offer::Full);
        feed.resync(1, 6);
        assert_eq!(feed.subscribed(), 0, "a resync drops the user");
        let mut versions = Vec::new();
        for _ in 0..3 {
            versions.push(match feed.next().await {
                Ok(Event::Changed(c)) => format!("changed {}", c.version),
                Ok(Event::Resync { version, .. }) => format!("resync {version}"),
                other => format!("{other:?}"),
            });
        }
        assert_eq!(versions, ["changed 5", "changed 6", "resync 6"]);
    }

    #[tokio::test]
    async fn a_closed_feed_drains_then_ends_with_its_error() {
        let feed = Feed::new(4);
        feed.offer(change(1, 5));
        feed.close(Some(Error::ShuttingDown));
        assert_eq!(feed.offer(change(1, 6)), Offer::Closed);
        assert!(matches!(feed.next().await, Ok(Event::Changed(_))));
        assert_eq!(feed.next().await.unwrap_err(), Some(Error::ShuttingDown));
    }

    #[tokio::test]
    async fn room_waits_for_the_reader() {
        let feed = Feed::new(1);
        feed.offer(change(1, 5));
        let waiting = tokio::spawn({
            let feed = feed.clone();
            async move { feed.room().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        feed.next().await.unwrap();
        waiting.await.unwrap();
    }
}
