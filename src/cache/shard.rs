//! One shard of the cache: users in LRU order, counted in read states, and the
//! shard's write-behind queues, all behind the shard's one lock.
//!
//! Everything here is synchronous and runs under that lock, so it never awaits
//! and never does I/O: it only moves users between the LRU, the eviction
//! buffer and the queues, and hands out snapshots for the writer to write.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use lru::LruCache;
use tokio::sync::watch;
use tokio::time::{Duration, Instant};

use crate::read_state::UserReadStates;
use crate::store::UserWrite;
use crate::watch::{Change, Feed, Offer};

/// A stream watching a user, and the last version queued to it.
#[derive(Debug)]
struct Subscriber {
    feed: Arc<Feed>,
    version: u64,
}

/// A cached user and its write-behind state.
#[derive(Debug)]
pub(crate) struct CachedUser {
    pub(crate) states: UserReadStates,
    /// When its oldest unwritten change was made; `None` when clean.
    unwritten_since: Option<Instant>,
    /// There is an entry for it in a queue (maybe a stale one).
    queued: bool,
    /// A write of it is under way; no second one may start (an older
    /// snapshot must never land after a newer one).
    in_flight: bool,
    /// Requests that hold it from their load to their change (see
    /// `Cache::update_many`): it is not evicted while pinned.
    pins: u32,
    /// Some stream watches it (it has an entry in `Shard::watchers`): the one
    /// check a change pays when nobody watches.
    watched: bool,
}

impl CachedUser {
    fn new(states: UserReadStates) -> CachedUser {
        CachedUser {
            states,
            unwritten_since: None,
            queued: false,
            in_flight: false,
            pins: 0,
            watched: false,
        }
    }
}

/// The result of a load shared by every request that waited for it.
pub(crate) type LoadResult = Option<Result<(), LoadFailure>>;

/// Why a load cached nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LoadFailure {
    /// The store failed.
    Store(String),
    /// The user's slot stopped being served while it loaded (see
    /// [`crate::cluster::ownership`]): what was read is not kept.
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
    /// Cached users, least recently used first out.
    users: LruCache<u64, CachedUser>,
    /// Read states (and tombstones) held by `users`, see [`weight`].
    read_states: usize,
    /// The most read states `users` may hold.
    capacity: usize,
    /// Users evicted with unwritten changes, kept until they are written so
    /// that a request for one sees its latest state.
    evicted: HashMap<u64, CachedUser>,
    /// Users being loaded from the store; late requests wait on the same load.
    pub(crate) loading: HashMap<u64, Loading>,
    /// Users to write `write_delay` after their first change, in time order
    /// (the delay is constant, so FIFO is deadline order).
    delayed: VecDeque<(Instant, u64)>,
    /// Users to write as soon as possible (evicted, or changed while written).
    ready: VecDeque<u64>,
    /// Users with a write under way.
    in_flight: HashSet<u64>,
    /// Unwritten read states in this shard, cached or evicted. Per shard
    /// only: a total kept in step would be an atomic shared by every core,
    /// written on every change.
    unwritten: usize,
    /// Read states in `evicted` (see [`weight`]), summed over all shards:
    /// the memory held beyond capacity, which the memory bound limits.
    evicted_total: Arc<AtomicUsize>,
    pub(crate) stats: ShardStats,
    /// Something was queued since the writer was last woken.
    wake: bool,
    /// The streams watching each watched user, cached or not: a watched user
    /// that is evicted and loaded again is still watched.
    watchers: HashMap<u64, Vec<Subscriber>>,
}

impl Shard {
    pub(crate) fn new(capacity: usize, evicted_total: Arc<AtomicUsize>) -> Shard {
        Shard {
            users: LruCache::unbounded(),
            read_states: 0,
            capacity,
            evicted: HashMap::new(),
            loading: HashMap::new(),
            delayed: VecDeque::new(),
            ready: VecDeque::new(),
            in_flight: HashSet::new(),
            unwritten: 0,
            evicted_total,
            stats: ShardStats::default(),
            wake: false,
            watchers: HashMap::new(),
        }
    }

    /// Moves a user from the eviction buffer back into the LRU, if it is
    /// there (the buffer is nearly always empty, so this is cheap).
    fn revive(&mut self, user_id: u64) {
        if self.evicted.is_empty() {
            return;
        }
        if let Some(user) = self.evicted.remove(&user_id) {
            self.evicted_total
                .fetch_sub(weight(&user.states), Ordering::Relaxed);
            self.insert(user_id, user);
            self.evict_over_capacity(user_id);
        }
    }

    /// Runs `f` on a held user (promoting it in the LRU); `None` if the user
    /// is not held.
    pub(crate) fn read<R>(
        &mut self,
        user_id: u64,
        f: impl FnOnce(&UserReadStates) -> R,
    ) -> Option<R> {
        self.revive(user_id);
        self.users.get(&user_id).map(|user| f(&user.states))
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
        f: impl FnOnce(&mut UserReadStates) -> R,
    ) -> Option<R> {
        self.revive(user_id);
        let user = self.users.get_mut(&user_id)?;
        let (len, unwritten, version) = (
            weight(&user.states),
            user.states.unwritten_count(),
            user.states.version(),
        );
        let result = f(&mut user.states);
        if user.states.version() == version {
            return Some(result);
        }
        let change = user
            .watched
            .then(|| Change::since(user_id, &user.states, version));
        let (new_len, new_unwritten) = (weight(&user.states), user.states.unwritten_count());
        // Also while a write is in flight: the change waits its own delay
        // rather than riding straight after, or a hot user would be written
        // back to back.
        let schedule = !user.queued;
        // The clock is read only when a user starts a write window, not on
        // every change to a user already waiting.
        let now = (schedule || user.unwritten_since.is_none()).then(Instant::now);
        if let Some(now) = now {
            user.unwritten_since.get_or_insert(now);
        }
        user.queued = true;
        self.read_states = self.read_states + new_len - len;
        self.adjust_unwritten(unwritten, new_unwritten);
        if let (true, Some(now)) = (schedule, now) {
            self.wake |= self.delayed.is_empty();
            self.delayed.push_back((now + write_delay, user_id));
        }
        if let Some(change) = change {
            self.publish(change);
        }
        self.evict_over_capacity(user_id);
        Some(result)
    }

    /// Subscribes `feed` to a held user: queues what changed since `since`,
    /// then every change. Again on a user it already watches: starts over
    /// from `since`. `None` if the user is not held.
    pub(crate) fn subscribe(&mut self, user_id: u64, feed: &Arc<Feed>, since: u64) -> Option<()> {
        self.revive(user_id);
        let user = self.users.get_mut(&user_id)?;
        let change = Change::since(user_id, &user.states, since);
        let version = change.version;
        let subscribers = self.watchers.entry(user_id).or_default();
        subscribers.retain(|s| !Arc::ptr_eq(&s.feed, feed));
        if feed.subscribe(change, since) == Offer::Queued {
            subscribers.push(Subscriber {
                feed: feed.clone(),
                version,
            });
        }
        user.watched = !subscribers.is_empty();
        if subscribers.is_empty() {
            self.watchers.remove(&user_id);
        }
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

    fn unwatch(&mut self, user_id: u64) {
        self.watchers.remove(&user_id);
        if let Some(user) = self.user_mut(user_id) {
            user.watched = false;
        }
    }

    /// Pins a held user (see [`CachedUser::pins`]); false if it is not held.
    pub(crate) fn pin(&mut self, user_id: u64) -> bool {
        self.revive(user_id);
        match self.users.get_mut(&user_id) {
            Some(user) => {
                user.pins += 1;
                true
            }
            None => false,
        }
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
        let Some(user) = self.users.peek_mut(&user_id) else {
            return;
        };
        user.pins = user.pins.saturating_sub(1);
        if user.pins == 0 {
            self.evict_over_capacity(user_id);
        }
    }

    /// Caches a user just loaded from the store, with the pins of the
    /// requests that waited for it.
    pub(crate) fn insert_loaded(&mut self, user_id: u64, states: UserReadStates, pins: u32) {
        let mut user = CachedUser::new(states);
        user.pins = pins;
        self.insert(user_id, user);
        self.evict_over_capacity(user_id);
    }

    fn insert(&mut self, user_id: u64, mut user: CachedUser) {
        user.watched = !self.watchers.is_empty() && self.watchers.contains_key(&user_id);
        self.read_states += weight(&user.states);
        if let Some(old) = self.users.put(user_id, user) {
            self.read_states -= weight(&old.states);
        }
    }

    /// Evicts least recently used users until the shard is within capacity,
    /// never `keep` (the user being served) nor a pinned user: those are
    /// moved to the front, and if only they are left the shard overflows
    /// until they are let go. Unwritten users go to the eviction buffer and the
    /// ready queue.
    fn evict_over_capacity(&mut self, keep: u64) {
        let mut spared = 0;
        while self.read_states > self.capacity {
            let Some((&oldest, user)) = self.users.peek_lru() else {
                break;
            };
            if oldest == keep || user.pins > 0 {
                spared += 1;
                if spared >= self.users.len() {
                    break;
                }
                self.users.promote(&oldest);
                continue;
            }
            let Some((user_id, mut user)) = self.users.pop_lru() else {
                break;
            };
            self.read_states -= weight(&user.states);
            self.stats.evictions += 1;
            if user.states.has_unwritten() || user.in_flight {
                self.stats.evictions_unwritten += 1;
                if !user.in_flight {
                    user.queued = true;
                    self.ready.push_back(user_id);
                    self.wake = true;
                }
                self.evicted_total
                    .fetch_add(weight(&user.states), Ordering::Relaxed);
                self.evicted.insert(user_id, user);
            }
        }
    }

    /// Pops the next user due for a write at `now`, skipping stale entries.
    pub(crate) fn next_due(&mut self, now: Instant) -> Due {
        loop {
            let user_id = if let Some(user_id) = self.ready.pop_front() {
                user_id
            } else {
                match self.delayed.front() {
                    Some(&(deadline, user_id)) if deadline <= now => {
                        self.delayed.pop_front();
                        user_id
                    }
                    Some(&(deadline, _)) => return Due::Wait(Some(deadline)),
                    None => return Due::Wait(None),
                }
            };
            if let Some(user) = self.user_mut(user_id) {
                user.queued = false;
                if user.states.has_unwritten() && !user.in_flight {
                    return Due::User(user_id);
                }
            }
        }
    }

    /// Drops the entries at the front of the delay queue whose user has
    /// nothing left to write (written on eviction, or by write-through), so
    /// that the front is the oldest unwritten change.
    fn drop_stale_delayed(&mut self) {
        while let Some(&(_, user_id)) = self.delayed.front() {
            match self.user_mut(user_id) {
                Some(user) if user.states.has_unwritten() || user.in_flight => return,
                Some(user) => user.queued = false,
                None => {}
            }
            self.delayed.pop_front();
        }
    }

    /// Every unwritten user not already being written, for the final drain.
    pub(crate) fn unwritten_users(&self) -> Vec<u64> {
        let cached = self.users.iter().map(|(&id, u)| (id, u));
        cached
            .chain(self.evicted.iter().map(|(&id, u)| (id, u)))
            .filter(|(_, u)| u.states.has_unwritten() && !u.in_flight)
            .map(|(id, _)| id)
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
        let user = self.user_mut(user_id)?;
        if user.in_flight != retry {
            return None;
        }
        if !user.states.has_unwritten() {
            // Written meanwhile (write-through) while this write waited to
            // retry: it ends here, and must let go of the user.
            if retry {
                self.finish_write(user_id, None, now_us);
            }
            return None;
        }
        user.in_flight = true;
        let write = UserWrite::of(user_id, &user.states);
        self.in_flight.insert(user_id);
        Some(write)
    }

    /// A write of `user_id` up to `version` succeeded (`Some`) or was given up
    /// (`None`). Clears what it wrote and queues what changed meanwhile.
    pub(crate) fn finish_write(&mut self, user_id: u64, version: Option<u64>, now_us: u64) {
        self.in_flight.remove(&user_id);
        if let Some(user) = self.user_mut(user_id) {
            user.in_flight = false;
        }
        self.settle(user_id, version, now_us, true);
    }

    /// A request's own write of `user_id` up to `version` succeeded
    /// (write-through). What changed meanwhile has its own writes under way,
    /// so nothing is queued.
    pub(crate) fn finish_write_through(&mut self, user_id: u64, version: u64, now_us: u64) {
        self.settle(user_id, Some(version), now_us, false);
    }

    /// Clears what a write up to `version` wrote (if it succeeded), keeps the
    /// counters in step, lets an evicted user go once it is clean and, with
    /// `requeue`, queues what is still unwritten.
    fn settle(&mut self, user_id: u64, version: Option<u64>, now_us: u64, requeue: bool) {
        let evicted = self.evicted.contains_key(&user_id);
        let Some(user) = self.user_mut(user_id) else {
            return;
        };
        let (len, unwritten) = (weight(&user.states), user.states.unwritten_count());
        if let Some(version) = version {
            user.states.mark_written(version);
            // An evicted user keeps its weight until it leaves the buffer.
            if !evicted {
                user.states.prune_tombstones(now_us);
            }
        }
        let (new_len, new_unwritten) = (weight(&user.states), user.states.unwritten_count());
        let still_unwritten = user.states.has_unwritten();
        // An evicted user stays while a write-behind write of it is under
        // way (also one backing off): that write still has to find it.
        let in_flight = user.in_flight;
        if !still_unwritten {
            user.unwritten_since = None;
        } else if version.is_some() {
            // What is left was changed while the write was under way.
            user.unwritten_since = Some(Instant::now());
        }
        let requeue = requeue && still_unwritten && !user.queued && version.is_some();
        if requeue {
            user.queued = true;
        }
        self.adjust_unwritten(unwritten, new_unwritten);
        if evicted {
            if !still_unwritten
                && !in_flight
                && let Some(user) = self.evicted.remove(&user_id)
            {
                self.evicted_total
                    .fetch_sub(weight(&user.states), Ordering::Relaxed);
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
            .map(|(&id, _)| id)
            .chain(self.evicted.keys().copied())
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
            let Some(user) = self.user_mut(user_id) else {
                continue;
            };
            if !user.in_flight && user.states.has_unwritten() {
                // Maybe queued already for later: this entry comes first,
                // and next_due skips whichever is stale.
                user.queued = true;
                self.ready.push_back(user_id);
                self.wake = true;
            }
        }
    }

    /// How many of `ids` are not written yet, or have a write under way.
    pub(crate) fn unsettled(&self, ids: &[u64]) -> usize {
        ids.iter()
            .filter_map(|id| self.users.peek(id).or_else(|| self.evicted.get(id)))
            .filter(|user| user.in_flight || user.states.has_unwritten())
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
            match self.user_mut(user_id) {
                Some(user) if user.states.has_unwritten() || user.in_flight => kept += 1,
                Some(_) => {
                    if let Some(user) = self.users.pop(&user_id) {
                        self.read_states -= weight(&user.states);
                    } else if let Some(user) = self.evicted.remove(&user_id) {
                        self.evicted_total
                            .fetch_sub(weight(&user.states), Ordering::Relaxed);
                    }
                }
                None => {}
            }
        }
        kept
    }

    pub(crate) fn gauges(&mut self) -> ShardGauges {
        self.drop_stale_delayed();
        let since = |id: &u64| {
            self.users
                .peek(id)
                .or_else(|| self.evicted.get(id))?
                .unwritten_since
        };
        let oldest_unwritten = self
            .delayed
            .front()
            .map(|(_, id)| id)
            .into_iter()
            .chain(self.ready.iter())
            .chain(self.in_flight.iter())
            .chain(self.evicted.keys())
            .filter_map(since)
            .min();
        ShardGauges {
            users: self.users.len(),
            watched: self.watchers.len(),
            read_states: self.read_states,
            unwritten: self.unwritten,
            oldest_unwritten,
        }
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

    fn adjust_unwritten(&mut self, before: usize, after: usize) {
        self.unwritten = self.unwritten + after - before;
    }

    fn user_mut(&mut self, user_id: u64) -> Option<&mut CachedUser> {
        match self.users.peek_mut(&user_id) {
            Some(user) => Some(user),
            None => self.evicted.get_mut(&user_id),
        }
    }
}

/// What a user counts against capacity: its read states and tombstones, and
/// at least 1, so that users with none (lookups of unknown users) are evicted
/// too.
fn weight(states: &UserReadStates) -> usize {
    states.len().max(1)
}
