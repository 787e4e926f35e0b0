//! Which users a shard keeps: a user is inserted when its load ends, pinned
//! while a request works on it outside the lock, and past capacity the
//! CLOCK hand evicts users that are neither pinned nor marked used since it
//! last passed (a second chance); one with unwritten changes is kept aside
//! until the store has them.

use std::sync::atomic::Ordering;

use tokio::sync::watch;
use tokio::time::Instant;

use super::{LoadResult, Shard, weight};
use crate::cache::arena::Block;
use crate::cache::users::{CachedUser, Flags, Slot};
use crate::read_state::{Entries, UserReadStates};

impl Shard {
    /// Pins a held user (see [`CachedUser::pins`]); false if it is not held.
    pub(crate) fn pin(&mut self, user_id: u64) -> bool {
        // Not marked used: the change it is pinned for marks it.
        match self.held(user_id, false) {
            Some(slot) => {
                self.add_pins(slot, 1);
                // Its change comes after every other user's pin: by then
                // its read states are in the cache, and the misses of a
                // request's users overlap instead of coming one by one.
                let user = self.users.get(slot);
                self.arena.prefetch(user.block, user.len as usize);
                true
            }
            None => false,
        }
    }

    pub(super) fn add_pins(&mut self, slot: Slot, pins: u32) {
        let user = self.users.get_mut(slot);
        let total = u32::from(user.pins) + pins;
        user.pins = u8::try_from(total).unwrap_or(u8::MAX);
        if let Some(beyond) = total.checked_sub(u32::from(u8::MAX))
            && beyond > 0
        {
            *self.pins_beyond.entry(user.user_id).or_default() += beyond;
        }
    }

    /// Takes one pin off a user; whether it is pinned no more.
    pub(super) fn remove_pin(&mut self, slot: Slot) -> bool {
        let user = self.users.get_mut(slot);
        if user.pins == u8::MAX
            && let Some(beyond) = self.pins_beyond.get_mut(&user.user_id)
        {
            *beyond -= 1;
            if *beyond == 0 {
                self.pins_beyond.remove(&user.user_id);
            }
            return false;
        }
        user.pins = user.pins.saturating_sub(1);
        user.pins == 0
    }

    /// Pins a user that is being loaded: the load hands the pin to the user
    /// it caches. `None` if no load is under way.
    pub(crate) fn pin_loading(&mut self, user_id: u64) -> Option<watch::Receiver<LoadResult>> {
        let loading = self.loading.get_mut(&user_id)?;
        loading.pins += 1;
        Some(loading.done.clone())
    }

    /// Gives back a pin taken with [`Shard::pin`], or with
    /// [`Shard::pin_loading`] on the load `load`: still with the load if it
    /// is under way, with the user if it cached it, gone if it failed.
    pub(crate) fn unpin(&mut self, user_id: u64, load: Option<&watch::Receiver<LoadResult>>) {
        if let Some(load) = load {
            if let Some(loading) = self.loading.get_mut(&user_id)
                && loading.done.same_channel(load)
            {
                loading.pins -= 1;
                return;
            }
            if !matches!(*load.borrow(), Some(Ok(()))) {
                return;
            }
        }
        // A pinned user is never evicted: an evicted one was let go.
        let Some(slot) = self.users.find(user_id) else {
            return;
        };
        let user = self.users.get(slot);
        if user.is(Flags::EVICTED) {
            return;
        }
        if self.remove_pin(slot) {
            self.evict_over_capacity(slot);
        }
    }

    /// Caches a user just loaded from the store, with the pins of the
    /// requests that waited for it.
    pub(crate) fn insert_loaded(&mut self, user_id: u64, states: UserReadStates, pins: u32) {
        // Loads start only for users not held, one at a time; should one be
        // held anyway, what it holds is newer than the store.
        if let Some(slot) = self.hold(user_id) {
            tracing::error!(user_id, "a loaded user was held already; kept");
            self.add_pins(slot, pins);
            return;
        }
        // Changes the store lacks: a replayed user's (see [`replayed`]).
        let unwritten = states.unwritten_count();
        let user = self.record(user_id, states);
        let slot = self.users.insert(user);
        // A write of the replayed user under way goes on with it (and ends
        // at its next try if the store held it all already).
        let in_flight = self.in_flight.contains_key(&user_id);
        self.users
            .get_mut(slot)
            .flags
            .set(Flags::IN_FLIGHT, in_flight);
        if unwritten > 0 {
            self.adjust_unwritten(unwritten as isize);
            let since = self.ticks(self.replayed_since.unwrap_or_else(Instant::now));
            let user = self.users.get_mut(slot);
            user.since = since;
            user.flags.set(Flags::UNWRITTEN_SINCE, true);
            if !in_flight {
                user.flags.set(Flags::QUEUED, true);
                self.ready.push_back(user_id);
                self.wake = true;
            }
        }
        self.add_pins(slot, pins);
        self.evict_over_capacity(slot);
    }

    /// A record of `user_id` holding `states` (counted in the shard's read
    /// states; the caller inserts it).
    pub(super) fn record(&mut self, user_id: u64, states: UserReadStates) -> CachedUser {
        let mut user = CachedUser::new(user_id);
        let watched = !self.watchers.is_empty() && self.watchers.contains_key(&user_id);
        user.flags.set(Flags::WATCHED, watched);
        self.read_states += weight(&states);
        let (header, entries) = states.into_parts();
        user.set_header(header);
        user.block = self.arena.put(Block::EMPTY, 0, &entries);
        user.parents = self.parents.put(Block::EMPTY, 0, entries.parents());
        user.len = entries.len() as u32;
        user
    }

    /// Evicts users until the shard is within capacity, by CLOCK: the hand
    /// sweeps the cached users, unmarks a used one and evicts one that was
    /// not used since it last passed. Never `keep` (the user being served)
    /// nor a pinned user: if only they are left the shard overflows until
    /// they are let go. Unwritten users stay as evicted ones, queued to be
    /// written now.
    pub(super) fn evict_over_capacity(&mut self, keep: Slot) {
        // Spared in a row: once every cached user is, none can go.
        let mut spared = 0;
        while self.read_states > self.capacity {
            let Some(slot) = self.users.next_for_eviction() else {
                break;
            };
            let user = self.users.get(slot);
            if slot == keep || user.pins > 0 {
                spared += 1;
                if spared > self.users.cached() {
                    break;
                }
                continue;
            }
            spared = 0;
            if user.is(Flags::REFERENCED) {
                // Used since the hand last passed: unmarked (each user once,
                // so the loop ends).
                self.users.get_mut(slot).flags.set(Flags::REFERENCED, false);
                continue;
            }
            let (user_id, weight) = (user.user_id, user.weight());
            let in_flight = user.is(Flags::IN_FLIGHT);
            self.read_states -= weight;
            self.stats.evictions += 1;
            if !(user.has_unwritten() || in_flight) {
                self.forget(slot);
                continue;
            }
            self.stats.evictions_unwritten += 1;
            self.users.evict(slot);
            if !in_flight {
                self.users.get_mut(slot).flags.set(Flags::QUEUED, true);
                self.ready.push_back(user_id);
                self.wake = true;
            }
            self.evicted.insert(user_id);
            self.evicted_total.fetch_add(weight, Ordering::Relaxed);
        }
    }
}
