//! A shard's watchers: the Watch streams subscribed to its users. Every
//! change of a watched user is offered to its streams under the shard's
//! lock, so each sees its user's changes in order; a stream that falls
//! behind is dropped and resubscribes from its last version.

use std::sync::Arc;

use super::{Shard, Subscriber};
use crate::cache::users::{Flags, Slot};
use crate::read_state::Kind;
use crate::watch::{Change, Feed, Offer};

impl Shard {
    /// Subscribes `feed` to a held user: queues what changed since `since`,
    /// then every change. Again on a user it already watches: starts over
    /// from `since`. `None` if the user is not held.
    pub(crate) fn subscribe(&mut self, user_id: u64, feed: &Arc<Feed>, since: u64) -> Option<()> {
        let slot = self.hold(user_id)?;
        let view = self.view(slot);
        let change = (self.channels).read(|channels| Change::since(user_id, view, since, channels));
        let version = change.version;
        let subscribers = self.watchers.entry(user_id).or_default();
        subscribers.retain(|s| !Arc::ptr_eq(&s.feed, feed));
        if feed.subscribe(change, since) == Offer::Queued {
            subscribers.push(Subscriber {
                feed: feed.clone(),
                version,
            });
        }
        let watched = !subscribers.is_empty();
        if watched {
            // Built again now if a channel was counted since, while the
            // watched users may still be held (not at the next recount).
            self.fresh_watched_members();
            self.index_watched(user_id, slot);
        } else {
            self.remove_watchers(user_id);
        }
        self.users.get_mut(slot).flags.set(Flags::WATCHED, watched);
        Some(())
    }

    /// Unsubscribes `feed` from a user; whether it was subscribed.
    pub(crate) fn unsubscribe(&mut self, user_id: u64, feed: &Arc<Feed>) -> bool {
        let Some(subscribers) = self.watchers.get_mut(&user_id) else {
            return false;
        };
        let before = subscribers.len();
        subscribers.retain(|s| !Arc::ptr_eq(&s.feed, feed));
        let found = subscribers.len() != before;
        if subscribers.is_empty() {
            self.unwatch(user_id);
        }
        found
    }

    /// Sends a change to every stream watching its user; a full stream drops
    /// the user (with a resync), a closed one is forgotten.
    pub(super) fn publish(&mut self, change: Change) {
        let user_id = change.user_id;
        let Some(subscribers) = self.watchers.get_mut(&user_id) else {
            return;
        };
        let change = Arc::new(change);
        // A read state it may have just made in a channel counted by channel.
        let members = &mut self.watched_members;
        self.channels.read(|channels| {
            for shown in &change.read_states {
                if shown.state.kind == Kind::Channel {
                    members.add(user_id, shown.state.channel_id, channels);
                }
            }
        });
        subscribers.retain_mut(|s| match s.feed.offer(change.clone()) {
            Offer::Queued => {
                s.version = change.version;
                true
            }
            Offer::Full => {
                s.feed.resync(user_id, s.version);
                false
            }
            Offer::Closed => false,
        });
        if subscribers.is_empty() {
            self.unwatch(user_id);
        }
    }

    /// Publishes, to the streams watching a member of the `changed`
    /// channels counted by channel, the member's counts there (counted now)
    /// and totals. One look at each watched member held here (see
    /// [`super::watched_members`]); returns those not held (evicted), whom
    /// the caller loads.
    pub(crate) fn recount(&mut self, changed: &[u64]) -> Vec<u64> {
        self.fresh_watched_members();
        (self.watched_members.of(changed).into_iter())
            .filter(|&user_id| self.recount_one(user_id, changed).is_none())
            .collect()
    }

    /// [`Shard::recount`] of one watched user; `None` if it is not held.
    pub(crate) fn recount_one(&mut self, user_id: u64, changed: &[u64]) -> Option<()> {
        let slot = self.users.find(user_id)?;
        if self.watched_members.is_unknown(user_id) {
            self.index_watched(user_id, slot);
        }
        let view = self.view(slot);
        let channels = self.channels.clone();
        let change = channels.read(|channels| Change::recounted(user_id, view, changed, channels));
        if let Some(change) = change {
            self.publish(change);
        }
        Some(())
    }

    /// Builds the index of watched members again if a channel was counted
    /// by channel since it was built.
    fn fresh_watched_members(&mut self) {
        let counted = self.channels.len();
        if !self.watched_members.stale(counted) {
            return;
        }
        self.watched_members.clear(counted);
        let watched: Vec<u64> = self.watchers.keys().copied().collect();
        for user_id in watched {
            match self.users.find(user_id) {
                Some(slot) => self.index_watched(user_id, slot),
                None => self.watched_members.unknown(user_id),
            }
        }
    }

    /// Indexes held, watched `user_id` under its channels counted by
    /// channel.
    fn index_watched(&mut self, user_id: u64, slot: Slot) {
        let mut members = std::mem::take(&mut self.watched_members);
        let view = self.view(slot);
        (self.channels).read(|channels| members.index(user_id, view, channels));
        self.watched_members = members;
    }

    /// Forgets `user_id`'s streams; they are returned.
    pub(super) fn remove_watchers(&mut self, user_id: u64) -> Option<Vec<Subscriber>> {
        self.watched_members.forget(user_id);
        self.watchers.remove(&user_id)
    }

    pub(super) fn unwatch(&mut self, user_id: u64) {
        self.remove_watchers(user_id);
        if let Some(slot) = self.users.find(user_id) {
            self.users.get_mut(slot).flags.set(Flags::WATCHED, false);
        }
    }
}
