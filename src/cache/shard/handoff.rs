//! A shard's part of a warm handoff (see [`crate::cache::handoff`]): what it
//! hands over of users leaving, how it installs users handed to it, and how
//! it lets go of users without writing them once another node has them.

use std::cmp::Reverse;
use std::sync::atomic::Ordering;

use tokio::time::{Duration, Instant};

use super::Shard;
use crate::cache::handoff::{HandedDeletion, HandedUser, Sent};
use crate::cache::users::Flags;
use crate::read_state::{Owned, UserReadStates};

impl Shard {
    /// `ids` as they are held here, those whose versions differ from what
    /// was `sent` of them (users not held are skipped): read states,
    /// versions, and how long their unwritten changes have waited.
    pub(crate) fn export(&self, ids: &[u64], sent: &Sent) -> Vec<HandedUser> {
        let now = Instant::now();
        ids.iter()
            .filter_map(|&user_id| {
                let slot = self.users.find(user_id)?;
                let user = self.users.get(slot);
                let view = self.view(slot);
                let header = view.header();
                if sent.get(&user_id) == Some(&(header.version, header.written_version)) {
                    return None;
                }
                let unwritten_for = (user.has_unwritten() && user.is(Flags::UNWRITTEN_SINCE))
                    .then(|| self.age(user.since, now));
                Some(HandedUser {
                    user_id,
                    states: UserReadStates::from_parts(
                        view.header(),
                        Owned::new(view.entries().to_vec(), view.parents().to_vec()),
                    ),
                    unwritten_for,
                })
            })
            .collect()
    }

    /// Whether `user_id` is held here (evicted but unwritten included).
    pub(crate) fn holds(&self, user_id: u64) -> bool {
        self.users.find(user_id).is_some()
    }

    /// The deleted messages the users `which` names were lowered for.
    pub(crate) fn export_deletions(&self, which: &impl Fn(u64) -> bool) -> Vec<HandedDeletion> {
        self.deletions
            .of(which)
            .map(|(user_id, deletion)| HandedDeletion { user_id, deletion })
            .collect()
    }

    /// Caches a user handed over by its previous owner, in place of what is
    /// held of it (a transfer sent again); its unwritten changes are written
    /// when they were due there (`write_delay` after the oldest).
    pub(crate) fn install(&mut self, handed: HandedUser, write_delay: Duration) {
        let HandedUser {
            user_id,
            states,
            unwritten_for,
        } = handed;
        self.remove(user_id);
        let unwritten = states.unwritten_count();
        let mut user = self.record(user_id, states);
        if user.has_unwritten() {
            let now = Instant::now();
            let since = now
                .checked_sub(unwritten_for.unwrap_or_default())
                .unwrap_or(now);
            user.since = self.ticks(since);
            user.flags.set(Flags::UNWRITTEN_SINCE, true);
            user.flags.set(Flags::QUEUED, true);
            // Due earlier than what `delayed` holds last, maybe: kept apart
            // (see `Shard::handed`), in deadline order.
            self.handed.push(Reverse((since + write_delay, user_id)));
            self.wake = true;
        }
        self.adjust_unwritten(unwritten as isize);
        let slot = self.users.insert(user);
        self.evict_over_capacity(slot);
    }

    /// Remembers that `user_id` was lowered for a deletion, as its previous
    /// owner did.
    pub(crate) fn install_deletion(&mut self, handed: HandedDeletion) {
        if !self.deletions.lowered(handed.user_id, handed.deletion) {
            self.deletions.remember(handed.user_id, handed.deletion);
        }
    }

    /// Lets go of `ids`, written or not: another node holds them now. Their
    /// streams get a `moved` event. Returns how many were held.
    pub(crate) fn hand_off(&mut self, ids: &[u64]) -> usize {
        let mut held = 0;
        for &user_id in ids {
            if let Some(subscribers) = self.remove_watchers(user_id) {
                for subscriber in subscribers {
                    subscriber.feed.moved(user_id, subscriber.version);
                }
            }
            held += usize::from(self.remove(user_id));
        }
        held
    }

    /// Drops a held user, keeping the counters in step; a write of it under
    /// way finds it gone, and its queue entries are skipped.
    fn remove(&mut self, user_id: u64) -> bool {
        let Some(slot) = self.users.find(user_id) else {
            return false;
        };
        let user = self.users.get(slot);
        let (weight, evicted) = (user.weight(), user.is(Flags::EVICTED));
        let unwritten = self.view(slot).unwritten_count();
        if evicted {
            self.evicted.remove(&user_id);
            self.evicted_total.fetch_sub(weight, Ordering::Relaxed);
        } else {
            self.read_states -= weight;
        }
        // Only the user's own write: a replayed write beside it (see
        // `begin_write`) goes on, and must still find itself in flight.
        if user.is(Flags::IN_FLIGHT) {
            self.in_flight.remove(&user_id);
        }
        self.adjust_unwritten(-(unwritten as isize));
        self.forget(slot);
        true
    }
}

impl Shard {
    /// Users held here (cached, evicted unwritten, or watched) that `leaving`
    /// says are in slots being released.
    pub(crate) fn users_leaving(&self, leaving: impl Fn(u64) -> bool) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .users
            .iter()
            .map(|u| u.user_id)
            .chain(self.watchers.keys().copied())
            .filter(|&id| leaving(id))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Queues every one of `ids` that has unwritten changes (and no write
    /// under way) for a write now.
    pub(crate) fn expedite(&mut self, ids: &[u64]) {
        for &user_id in ids {
            let Some(slot) = self.users.find(user_id) else {
                continue;
            };
            let user = self.users.get_mut(slot);
            if !user.is(Flags::IN_FLIGHT) && user.has_unwritten() {
                // Maybe queued already for later: this entry comes first,
                // and next_due skips whichever is stale.
                user.flags.set(Flags::QUEUED, true);
                self.ready.push_back(user_id);
                self.wake = true;
            }
        }
    }

    /// How many of `ids` are not written yet, or have a write under way.
    pub(crate) fn unsettled(&self, ids: &[u64]) -> usize {
        ids.iter()
            .filter_map(|&id| self.users.find(id))
            .map(|slot| self.users.get(slot))
            .filter(|user| user.is(Flags::IN_FLIGHT) || user.has_unwritten())
            .count()
    }

    /// Lets go of `ids`, all written (see [`Shard::expedite`]): clean users
    /// leave the cache, and their streams get a `moved` event. Returns how
    /// many were not clean and stay.
    pub(crate) fn let_go(&mut self, ids: &[u64]) -> usize {
        let mut kept = 0;
        for &user_id in ids {
            if let Some(subscribers) = self.remove_watchers(user_id) {
                for subscriber in subscribers {
                    subscriber.feed.moved(user_id, subscriber.version);
                }
            }
            let Some(slot) = self.users.find(user_id) else {
                continue;
            };
            let user = self.users.get(slot);
            if user.has_unwritten() || user.is(Flags::IN_FLIGHT) {
                kept += 1;
                continue;
            }
            if user.is(Flags::EVICTED) {
                self.evicted.remove(&user_id);
                self.evicted_total
                    .fetch_sub(user.weight(), Ordering::Relaxed);
            } else {
                self.read_states -= user.weight();
            }
            self.forget(slot);
        }
        kept
    }
}
