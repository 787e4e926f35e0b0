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
//!
//! Here: the shard's state, and reading and changing a held user. Its other
//! parts: [`eviction`] (insert, pin, evict), [`writes`] (write-behind
//! bookkeeping), [`watchers`] (Watch streams), [`handoff`], [`replayed`]
//! (the journal's replayed writes) and [`rejournal`].

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::watch;
use tokio::time::{Duration, Instant};

use super::arena::{Arena, Stored, threads_in};
use super::users::{Flags, Slot, Users};
use crate::channel_states::ChannelStates;
use crate::read_state::{Entries, UserReadStates, UserView};
use crate::recent_deletions::RecentDeletions;
use crate::store::UserWrite;
use crate::watch::{Change, Feed};

mod eviction;
mod handoff;
mod rejournal;
mod replayed;
mod watched_members;
mod watchers;
mod writes;

/// A stream watching a user, and the last version queued to it.
#[derive(Debug)]
struct Subscriber {
    feed: Arc<Feed>,
    version: u64,
}

/// The user at `slot` to write at `due_ms` (the shard's millisecond clock):
/// 8 bytes, one per user with unwritten changes. By slab position, not user
/// id (4 bytes less): a position is not reused while an entry may name it
/// (see [`Shard::forget`]), so an entry finds its user's id there, held
/// still or forgotten since, as if it named the user.
#[derive(Clone, Copy, Debug)]
struct Delayed {
    due_ms: u32,
    slot: Slot,
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
    /// Entries `delayed` has let go of, in all.
    delayed_popped: u64,
    /// Users handed over by another node, to write when they were due
    /// there, soonest first: their deadlines fall anywhere within
    /// `delayed`'s.
    handed: BinaryHeap<Reverse<(Instant, u64)>>,
    /// Users to write as soon as possible (evicted, or changed while written).
    ready: VecDeque<u64>,
    /// Replayed users' writes to make as soon as possible: a queue of their
    /// own, so that popping one never takes `QUEUED` from the same user
    /// cached since (handed in), whose own entry is still to come.
    replayed_ready: VecDeque<u64>,
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
    /// The watched users by the channels counted by channel they are
    /// members of, for recounts.
    watched_members: watched_members::WatchedMembers,
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
            delayed_popped: 0,
            handed: BinaryHeap::new(),
            ready: VecDeque::new(),
            replayed_ready: VecDeque::new(),
            in_flight: HashMap::new(),
            replayed: HashMap::new(),
            replayed_since: None,
            replayed_loading: HashMap::new(),
            unwritten: 0,
            evicted_total,
            stats: ShardStats::default(),
            wake: false,
            watchers: HashMap::new(),
            watched_members: watched_members::WatchedMembers::default(),
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
        // An entry of `delayed` may name the position: it is reused once
        // every entry queued so far is let go of.
        let cool_until =
            (!self.delayed.is_empty()).then(|| self.delayed_popped + self.delayed.len() as u64);
        let user = self.users.remove(slot, cool_until);
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
            self.delayed.push_back(Delayed { due_ms, slot });
        }
        if let Some(change) = change {
            self.publish(change);
        }
        self.evict_over_capacity(slot);
        Some(result)
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
