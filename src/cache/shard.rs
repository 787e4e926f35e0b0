//! One shard of the cache: its users, counted in read states, and the
//! shard's write-behind queues, all behind the shard's one lock. Eviction
//! approximates LRU by CLOCK: a user used is marked in its record, and the
//! hand that sweeps the users passes a marked one over once (a second
//! chance).
//!
//! Everything here is synchronous and runs under that lock, so it never awaits
//! and never does I/O: it only moves users between the cached, the evicted
//! ones and the queues, and hands out snapshots for the writer to write.
//!
//! Users are stored packed (see [`super::users`] and [`super::arena`]); the
//! domain reads and changes their read states where they are stored.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::watch;
use tokio::time::{Duration, Instant};

use super::arena::{Arena, Block, Stored, threads_in};
use super::users::{CachedUser, Flags, Slot, Users};
use crate::channel_states::ChannelStates;
use crate::read_state::{Entries, UserReadStates, UserView};
use crate::recent_deletions::RecentDeletions;
use crate::store::UserWrite;
use crate::watch::{Change, Feed, Offer};

mod handoff;
mod rejournal;
mod replayed;

/// A stream watching a user, and the last version queued to it.
#[derive(Debug)]
struct Subscriber {
    feed: Arc<Feed>,
    version: u64,
}

/// A user to write at `due_ms` (the shard's millisecond clock): 12 bytes,
/// one per user with unwritten changes.
#[derive(Clone, Copy, Debug)]
#[repr(C, packed(4))]
struct Delayed {
    due_ms: u32,
    user_id: u64,
}

/// The unit of [`CachedUser::since`]: fine enough for a gauge and for a
/// handoff's deadline (at most two ticks early, never late), coarse enough
/// that 16 bits last 72 hours, longer than any outage a node rides out.
const SINCE_TICK: Duration = Duration::from_secs(4);

/// The result of a load shared by every request that waited for it.
pub(crate) type LoadResult = Option<Result<(), LoadFailure>>;

/// Why a load cached nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LoadFailure {
    /// The store failed.
    Store(String),
    /// The user's slot stopped being served while it loaded (see
    /// [`crate::ownership`]): what was read is not kept.
    NotServed,
}

/// A load under way.
#[derive(Debug)]
pub(crate) struct Loading {
    /// Sent under the shard lock, in the same critical section that caches
    /// the user, so a pin holder can tell under the lock where its pin went.
    pub(crate) done: watch::Receiver<LoadResult>,
    /// Pins of requests waiting for it; the loaded user starts with them.
    pub(crate) pins: u32,
}

/// What the writer should do next for this shard.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Due {
    /// Write this user now.
    User(u64),
    /// Nothing is due before this instant (`None`: nothing is queued).
    Wait(Option<Instant>),
}

/// Counters a shard keeps for the metrics sampler (plain integers: they are
/// only touched under the lock).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ShardStats {
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) evictions: u64,
    pub(crate) evictions_unwritten: u64,
}

/// A snapshot of one shard, for the metrics sampler.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ShardGauges {
    pub(crate) users: usize,
    pub(crate) read_states: usize,
    pub(crate) unwritten: usize,
    pub(crate) oldest_unwritten: Option<Instant>,
    /// Users some Watch stream watches.
    pub(crate) watched: usize,
}

#[derive(Debug)]
pub(crate) struct Shard {
    /// Cached users, and users evicted with unwritten changes.
    users: Users,
    /// The users' read states.
    arena: Arena,
    /// The parent ids of the users' thread read states.
    parents: Arena<u64>,
    /// Read states (and tombstones) of cached users, see
    /// [`CachedUser::weight`].
    read_states: usize,
    /// The most read states cached users may hold.
    capacity: usize,
    /// Users evicted with unwritten changes (flagged `EVICTED`), kept until
    /// they are written so that a request for one sees its latest state.
    evicted: HashSet<u64>,
    /// Users being loaded from the store; late requests wait on the same load.
    pub(crate) loading: HashMap<u64, Loading>,
    /// Pins of users beyond the `u8::MAX` their record counts (see
    /// [`CachedUser::pins`]): an entry only while that is full.
    pins_beyond: HashMap<u64, u32>,
    /// Users to write `write_delay` after their first change, in time order
    /// (the delay is constant, so FIFO is deadline order).
    delayed: VecDeque<Delayed>,
    /// Users handed over by another node, to write when they were due
    /// there, soonest first: their deadlines fall anywhere within
    /// `delayed`'s.
    handed: BinaryHeap<Reverse<(Instant, u64)>>,
    /// Users to write as soon as possible (evicted, or changed while written).
    ready: VecDeque<u64>,
    /// Users with a write under way.
    in_flight: HashMap<u64, u16>,
    /// Users replayed from the journal and not loaded (see [`replayed`]).
    replayed: HashMap<u64, UserWrite>,
    /// When they were replayed (the journal held their changes before).
    replayed_since: Option<Instant>,
    /// Replayed users' writes taken by loads under way.
    replayed_loading: HashMap<u64, UserWrite>,
    /// Unwritten read states in this shard, cached or evicted. Per shard
    /// only: a total kept in step would be an atomic shared by every core,
    /// written on every change.
    unwritten: usize,
    /// Read states of evicted users, summed over all shards: the memory held
    /// beyond capacity, which the memory bound limits.
    evicted_total: Arc<AtomicUsize>,
    pub(crate) stats: ShardStats,
    /// Something was queued since the writer was last woken.
    wake: bool,
    /// The streams watching each watched user, cached or not: a watched user
    /// that is evicted and loaded again is still watched.
    watchers: HashMap<u64, Vec<Subscriber>>,
    /// Zero of the shard's clocks: milliseconds for write deadlines, ticks
    /// for [`CachedUser::since`].
    epoch: Instant,
    /// The deleted messages this shard's users were lowered for (kept apart
    /// from the users: it outlives their eviction).
    pub(crate) deletions: RecentDeletions,
    /// The channels counted by channel, whose counts a change published to
    /// a Watch stream carries (read under this shard's lock; see
    /// [`crate::channel_states`] for why that cannot deadlock).
    channels: Arc<ChannelStates>,
}

impl Shard {
    pub(crate) fn new(
        capacity: usize,
        evicted_total: Arc<AtomicUsize>,
        deletions: RecentDeletions,
        channels: Arc<ChannelStates>,
    ) -> Shard {
        Shard {
            users: Users::new(),
            arena: Arena::default(),
            parents: Arena::default(),
            read_states: 0,
            capacity,
            evicted: HashSet::new(),
            loading: HashMap::new(),
            pins_beyond: HashMap::new(),
            delayed: VecDeque::new(),
            handed: BinaryHeap::new(),
            ready: VecDeque::new(),
            in_flight: HashMap::new(),
            replayed: HashMap::new(),
            replayed_since: None,
            replayed_loading: HashMap::new(),
            unwritten: 0,
            evicted_total,
            stats: ShardStats::default(),
            wake: false,
            watchers: HashMap::new(),
            epoch: Instant::now(),
            deletions,
            channels,
        }
    }

    /// Finds a held user and marks it used, moving it back from the evicted
    /// ones if it is one.
    fn hold(&mut self, user_id: u64) -> Option<Slot> {
        self.held(user_id, true)
    }

    /// [`Shard::hold`], marked used only if `touch`.
    fn held(&mut self, user_id: u64, touch: bool) -> Option<Slot> {
        let slot = self.users.find(user_id)?;
        if self.users.get(slot).is(Flags::EVICTED) {
            let weight = self.users.get(slot).weight();
            self.evicted.remove(&user_id);
            self.evicted_total.fetch_sub(weight, Ordering::Relaxed);
            self.users.restore(slot);
            self.read_states += weight;
            self.evict_over_capacity(slot);
        } else if touch {
            // Marked in its own record, the one cache line a request
            // touches anyway: the hand gives it a second chance.
            self.users.get_mut(slot).flags.set(Flags::REFERENCED, true);
        }
        Some(slot)
    }

    /// A user's read states, where they are.
    fn view(&self, slot: Slot) -> UserView<'_> {
        let user = self.users.get(slot);
        let entries = self.arena.get(user.block, user.len as usize);
        let parents = self
            .parents
            .get(user.parents, threads_in(user.parents, entries));
        UserView::new(user.header(), entries, parents)
    }

    /// Runs `f` on a user's read states where they are stored, then keeps
    /// the user's record in step with what it changed.
    fn with_states<R>(
        &mut self,
        slot: Slot,
        f: impl FnOnce(&mut UserReadStates<Stored<'_>>) -> R,
    ) -> R {
        let user = self.users.get(slot);
        let (header, block, len) = (user.header(), user.block, user.len as usize);
        let parents = user.parents;
        let stored = Stored::new(&mut self.arena, block, len, &mut self.parents, parents);
        let mut states = UserReadStates::from_parts(header, stored);
        let result = f(&mut states);
        let (header, stored) = states.into_parts();
        let (block, len, parents) = stored.place();
        let user = self.users.get_mut(slot);
        user.set_header(header);
        (user.block, user.len, user.parents) = (block, len as u32, parents);
        result
    }

    /// Drops a user and its read states.
    fn forget(&mut self, slot: Slot) {
        let user = self.users.remove(slot);
        if user.pins == u8::MAX {
            // Let go while pinned (a release): the pins' holders see that
            // by the slot's generation.
            self.pins_beyond.remove(&user.user_id);
        }
        let entries = self.arena.get(user.block, user.len as usize);
        let threads = threads_in(user.parents, entries);
        self.arena.free(user.block, user.len as usize);
        self.parents.free(user.parents, threads);
    }

    /// The shard's millisecond clock at `now`; it wraps after 49 days, so
    /// only ages below that are told apart.
    fn millis(&self, now: Instant) -> u32 {
        now.saturating_duration_since(self.epoch).as_millis() as u32
    }

    /// The shard's coarse clock at `now`, in ticks of [`SINCE_TICK`],
    /// rounded down; it wraps after 72 hours, so only ages below that are
    /// told apart.
    fn ticks(&self, now: Instant) -> u16 {
        (now.saturating_duration_since(self.epoch).as_secs() / SINCE_TICK.as_secs()) as u16
    }

    /// How long ago `since` (of [`Shard::ticks`]) was at `now`, rounded
    /// up: a deadline taken from it is never late.
    fn age(&self, since: u16, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.epoch).as_nanos();
        let now = elapsed.div_ceil(SINCE_TICK.as_nanos()) as u16;
        SINCE_TICK * u32::from(now.wrapping_sub(since))
    }

    /// [`Shard::millis`], rounded up: a deadline is never early.
    fn millis_ceil(&self, at: Instant) -> u32 {
        let since = at.saturating_duration_since(self.epoch);
        (since.as_millis() as u32)
            .wrapping_add(u32::from(!since.subsec_nanos().is_multiple_of(1_000_000)))
    }

    /// Runs `f` on a held user (marked used); `None` if the user is not
    /// held.
    pub(crate) fn read<R>(&mut self, user_id: u64, f: impl FnOnce(&UserView) -> R) -> Option<R> {
        let slot = self.hold(user_id)?;
        Some(f(&self.view(slot)))
    }

    /// Counts one request's first look at a user.
    pub(crate) fn count_lookup(&mut self, hit: bool) {
        if hit {
            self.stats.hits += 1;
        } else {
            self.stats.misses += 1;
        }
    }

    /// Runs `f` on a held user, keeping the counters and queues in step with
    /// what it changed: a changed user is queued for a write `write_delay`
    /// after its first unwritten change. `None` if the user is not held.
    pub(crate) fn change<R>(
        &mut self,
        user_id: u64,
        write_delay: Duration,
        f: impl FnOnce(&mut UserReadStates<Stored<'_>>) -> R,
    ) -> Option<R> {
        let slot = self.hold(user_id)?;
        let watched = self.users.get(slot).is(Flags::WATCHED);
        let channels = watched.then(|| self.channels.clone());
        let (result, changed) = self.with_states(slot, |states| {
            let (len, version) = (weight(states), states.version());
            let result = f(states);
            if states.version() == version {
                return (result, None);
            }
            let change = channels.map(|channels| {
                channels.read(|channels| Change::since(user_id, &*states, version, channels))
            });
            let after = (weight(states), states.unwritten_change());
            (result, Some((len, after, change)))
        });
        let Some((len, (new_len, unwritten_change), change)) = changed else {
            return Some(result);
        };
        let user = self.users.get(slot);
        // Also while a write is in flight: the change waits its own delay
        // rather than riding straight after, or a hot user would be written
        // back to back.
        let schedule = !user.is(Flags::QUEUED);
        // The clock is read only when a user starts a write window, not on
        // every change to a user already waiting.
        let starts = !user.is(Flags::UNWRITTEN_SINCE);
        let now = (schedule || starts).then(Instant::now);
        let since = now.map(|now| self.ticks(now));
        let user = self.users.get_mut(slot);
        if let (true, Some(since)) = (starts, since) {
            user.since = since;
            user.flags.set(Flags::UNWRITTEN_SINCE, true);
        }
        user.flags.set(Flags::QUEUED, true);
        self.read_states = self.read_states + new_len - len;
        self.adjust_unwritten(unwritten_change);
        if let (true, Some(now)) = (schedule, now) {
            self.wake |= self.delayed.is_empty();
            let due_ms = self.millis_ceil(now + write_delay);
            self.delayed.push_back(Delayed { due_ms, user_id });
        }
        if let Some(change) = change {
            self.publish(change);
        }
        self.evict_over_capacity(slot);
        Some(result)
    }

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
        if !watched {
            self.watchers.remove(&user_id);
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
    fn publish(&mut self, change: Change) {
        let user_id = change.user_id;
        let Some(subscribers) = self.watchers.get_mut(&user_id) else {
            return;
        };
        let change = Arc::new(change);
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
    /// and totals. One look at each watched user held here; returns the
    /// watched users not held (evicted), whom the caller loads.
    pub(crate) fn recount(&mut self, changed: &[u64]) -> Vec<u64> {
        let watched: Vec<u64> = self.watchers.keys().copied().collect();
        (watched.into_iter())
            .filter(|&user_id| self.recount_one(user_id, changed).is_none())
            .collect()
    }

    /// [`Shard::recount`] of one watched user; `None` if it is not held.
    pub(crate) fn recount_one(&mut self, user_id: u64, changed: &[u64]) -> Option<()> {
        let slot = self.users.find(user_id)?;
        let view = self.view(slot);
        let channels = self.channels.clone();
        let change = channels.read(|channels| Change::recounted(user_id, view, changed, channels));
        if let Some(change) = change {
            self.publish(change);
        }
        Some(())
    }

    fn unwatch(&mut self, user_id: u64) {
        self.watchers.remove(&user_id);
        if let Some(slot) = self.users.find(user_id) {
            self.users.get_mut(slot).flags.set(Flags::WATCHED, false);
        }
    }

    /// Asks the CPU to fetch a cached user's read states (a hint: nothing
    /// changes, and a user not cached is passed over). Finding it takes the
    /// misses of its index entry and record, here, one user after another
    /// with nothing in between, so that the CPU overlaps them.
    pub(crate) fn prefetch(&self, user_id: u64) {
        if let Some(slot) = self.users.find(user_id) {
            let user = self.users.get(slot);
            self.arena.prefetch(user.block, user.len as usize);
        }
    }

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

    fn add_pins(&mut self, slot: Slot, pins: u32) {
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
    fn remove_pin(&mut self, slot: Slot) -> bool {
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
    fn record(&mut self, user_id: u64, states: UserReadStates) -> CachedUser {
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
    fn evict_over_capacity(&mut self, keep: Slot) {
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

    /// Pops the next user due for a write at `now`, skipping stale entries.
    pub(crate) fn next_due(&mut self, now: Instant) -> Due {
        loop {
            let handed = self.handed.peek().map(|&Reverse((due, _))| due);
            let user_id = if let Some(user_id) = self.ready.pop_front() {
                user_id
            } else if handed.is_some_and(|due| due <= now) {
                let Some(Reverse((_, user_id))) = self.handed.pop() else {
                    unreachable!("peeked");
                };
                user_id
            } else {
                match self.delayed.front().copied() {
                    Some(Delayed { due_ms, user_id }) => {
                        let wait = due_ms.wrapping_sub(self.millis(now)) as i32;
                        if wait > 0 {
                            let due = now + Duration::from_millis(wait as u64);
                            return Due::Wait(Some(handed.map_or(due, |h| h.min(due))));
                        }
                        self.delayed.pop_front();
                        user_id
                    }
                    None => return Due::Wait(handed),
                }
            };
            if let Some(slot) = self.users.find(user_id) {
                let user = self.users.get_mut(slot);
                user.flags.set(Flags::QUEUED, false);
                if user.has_unwritten() && !user.is(Flags::IN_FLIGHT) {
                    return Due::User(user_id);
                }
            } else if self.replayed_due(user_id) {
                return Due::User(user_id);
            }
        }
    }

    /// Drops the entries at the front of the delay queue whose user has
    /// nothing left to write (written on eviction, or by write-through), so
    /// that the front is the oldest unwritten change.
    fn drop_stale_delayed(&mut self) {
        while let Some(&Delayed { user_id, .. }) = self.delayed.front() {
            if let Some(slot) = self.users.find(user_id) {
                let user = self.users.get_mut(slot);
                if user.has_unwritten() || user.is(Flags::IN_FLIGHT) {
                    return;
                }
                user.flags.set(Flags::QUEUED, false);
            }
            self.delayed.pop_front();
        }
    }

    /// Every unwritten user not already being written, for the final drain.
    pub(crate) fn unwritten_users(&self) -> Vec<u64> {
        (self.users.iter())
            .filter(|u| u.has_unwritten() && !u.is(Flags::IN_FLIGHT))
            .map(|u| u.user_id)
            .chain(
                self.replayed_users()
                    .filter(|id| !self.in_flight.contains_key(id)),
            )
            .collect()
    }

    /// Starts (or, with `retry`, continues) a write of `user_id`: marks it in
    /// flight and returns what to write, or `None` if there is nothing to
    /// write or another write of it is under way.
    pub(crate) fn begin_write(
        &mut self,
        user_id: u64,
        retry: bool,
        now_us: u64,
    ) -> Option<UserWrite> {
        let Some(slot) = self.users.find(user_id) else {
            return self.begin_replayed_write(user_id, retry);
        };
        let user = self.users.get(slot);
        if user.is(Flags::IN_FLIGHT) != retry {
            return None;
        }
        if !user.has_unwritten() {
            // Written meanwhile (write-through) while this write waited to
            // retry: it ends here, and must let go of the user.
            if retry {
                self.finish_write(user_id, None, now_us);
            }
            return None;
        }
        self.users.get_mut(slot).flags.set(Flags::IN_FLIGHT, true);
        let mut write = UserWrite::of(user_id, self.view(slot));
        // With the lowerings its changes may hold (see `RecentDeletions`).
        write.lowered = self.deletions.of_user(user_id, now_us / 1000);
        let began = self.ticks(Instant::now());
        self.in_flight.insert(user_id, began);
        Some(write)
    }

    /// A write of `user_id` up to `version` succeeded (`Some`) or was given up
    /// (`None`). Clears what it wrote and queues what changed meanwhile.
    pub(crate) fn finish_write(&mut self, user_id: u64, version: Option<u64>, now_us: u64) {
        let began = self.in_flight.remove(&user_id);
        let Some(slot) = self.users.find(user_id) else {
            self.finish_replayed_write(user_id, version);
            return;
        };
        self.users.get_mut(slot).flags.set(Flags::IN_FLIGHT, false);
        self.settle(user_id, version, now_us, began);
    }

    /// A request's own write of `user_id` up to `version` succeeded
    /// (write-through). What changed meanwhile has its own writes under way,
    /// so nothing is queued.
    pub(crate) fn finish_write_through(&mut self, user_id: u64, version: u64, now_us: u64) {
        self.settle(user_id, Some(version), now_us, None);
    }

    /// Clears what a write up to `version` wrote (if it succeeded), keeps the
    /// counters in step, lets an evicted user go once it is clean and, for
    /// a write-behind write that `began` (ticks), queues what is still
    /// unwritten.
    fn settle(&mut self, user_id: u64, version: Option<u64>, now_us: u64, began: Option<u16>) {
        let requeue = began.is_some();
        let Some(slot) = self.users.find(user_id) else {
            return;
        };
        let evicted = self.users.get(slot).is(Flags::EVICTED);
        let (len, new_len, unwritten_change) = self.with_states(slot, |states| {
            let len = weight(states);
            if let Some(version) = version {
                states.mark_written(version);
                // An evicted user keeps its weight until it leaves.
                if !evicted {
                    states.prune_tombstones(now_us);
                }
            }
            (len, weight(states), states.unwritten_change())
        });
        let still_unwritten = self.users.get(slot).has_unwritten();
        // What is left was changed after the write began (its snapshot):
        // not earlier, which the journal's trimmer relies on.
        let now_s = (still_unwritten && version.is_some())
            .then(|| began.unwrap_or_else(|| self.ticks(Instant::now())));
        let user = self.users.get_mut(slot);
        // An evicted user stays while a write-behind write of it is under
        // way (also one backing off): that write still has to find it.
        let in_flight = user.is(Flags::IN_FLIGHT);
        if !still_unwritten {
            user.flags.set(Flags::UNWRITTEN_SINCE, false);
        } else if let Some(now_s) = now_s {
            user.since = now_s;
            user.flags.set(Flags::UNWRITTEN_SINCE, true);
        }
        let requeue = requeue && still_unwritten && !user.is(Flags::QUEUED) && version.is_some();
        if requeue {
            user.flags.set(Flags::QUEUED, true);
        }
        self.adjust_unwritten(unwritten_change);
        if evicted {
            if !still_unwritten && !in_flight {
                self.evicted.remove(&user_id);
                self.evicted_total.fetch_sub(len, Ordering::Relaxed);
                self.forget(slot);
            }
        } else {
            self.read_states = self.read_states + new_len - len;
        }
        if requeue {
            self.ready.push_back(user_id);
            self.wake = true;
        }
    }

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
            if let Some(subscribers) = self.watchers.remove(&user_id) {
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

    pub(crate) fn gauges(&mut self) -> ShardGauges {
        self.drop_stale_delayed();
        ShardGauges {
            users: self.users.cached(),
            watched: self.watchers.len(),
            read_states: self.read_states,
            unwritten: self.unwritten,
            oldest_unwritten: self.oldest_unwritten(),
        }
    }

    /// When the oldest change the store does not hold was made, never
    /// later than it was (the journal's trimmer deletes what is older).
    /// Every user is looked at, not the queues' heads: a user on its way
    /// to a write (waiting for a permit) is in no queue, and one whose
    /// write left changes behind is queued later than they were made.
    fn oldest_unwritten(&self) -> Option<Instant> {
        let now = Instant::now();
        let oldest = (self.users.iter())
            .filter(|user| user.is(Flags::UNWRITTEN_SINCE))
            .map(|user| self.age(user.since, now))
            .max()
            .and_then(|age| now.checked_sub(age));
        oldest
            .into_iter()
            .chain(self.replayed_pending_since())
            .min()
    }

    /// Unwritten read states in this shard.
    pub(crate) fn unwritten(&self) -> usize {
        self.unwritten
    }

    /// Users with a write under way.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether the writer must be woken for what was queued since last asked.
    pub(crate) fn take_wake(&mut self) -> bool {
        std::mem::take(&mut self.wake)
    }

    fn adjust_unwritten(&mut self, change: isize) {
        debug_assert!(
            self.unwritten as isize + change >= 0,
            "unwritten miscounted"
        );
        self.unwritten = self.unwritten.saturating_add_signed(change);
    }
}

/// What a user counts against capacity (see [`CachedUser::weight`]).
fn weight<E: Entries>(states: &UserReadStates<E>) -> usize {
    states.len().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read_state::Key;

    fn user_with(channels: u64) -> UserReadStates {
        let mut user = UserReadStates::default();
        for channel_id in 1..=channels {
            user.ack(Key::channel(channel_id), 10, 1);
        }
        user.mark_written(user.version());
        user
    }

    #[test]
    fn a_user_pinned_more_than_its_record_counts_stays_until_the_last_pin() {
        let deletions = RecentDeletions::new(Duration::from_secs(1), 1);
        let store = Arc::new(crate::store::memory::MemoryStore::new());
        let channels = ChannelStates::new(store, Duration::ZERO);
        let mut shard = Shard::new(10, Arc::new(AtomicUsize::new(0)), deletions, channels);
        let pins = u32::from(u8::MAX) + 5;
        shard.insert_loaded(1, user_with(10), pins);
        for _ in 1..pins {
            shard.unpin(1, None);
        }
        // Another user pushes the shard over capacity: the pinned one stays.
        shard.insert_loaded(2, user_with(10), 0);
        assert!(shard.read(1, |_| ()).is_some(), "still pinned");
        shard.unpin(1, None);
        shard.insert_loaded(3, user_with(10), 0);
        assert!(
            shard.read(1, |_| ()).is_none(),
            "evicted after the last pin"
        );
        assert!(shard.pins_beyond.is_empty());
    }

    /// How long a user has waited is kept in 16 bits: in ticks, they last
    /// through an outage of a few days (seconds wrapped after 18 hours).
    #[test]
    fn an_unwritten_change_a_day_old_is_told_a_day_old_rounded_up() {
        let deletions = RecentDeletions::new(Duration::from_secs(1), 1);
        let store = Arc::new(crate::store::memory::MemoryStore::new());
        let channels = ChannelStates::new(store, Duration::ZERO);
        let shard = Shard::new(10, Arc::new(AtomicUsize::new(0)), deletions, channels);
        let since = shard.epoch + Duration::from_millis(1_500);
        let day = Duration::from_secs(24 * 3600);
        let age = shard.age(shard.ticks(since), since + day);
        assert!(age >= day && age < day + 2 * SINCE_TICK, "{age:?}");
    }
}
