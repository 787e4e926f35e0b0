//! The sharded, memory-first cache of read states, keyed by user.
//!
//! A user's read states live together in one shard, chosen by a hash of the
//! user id; each shard is a [`Shard`] behind its own mutex, never held across
//! an `.await`. A miss loads the user from the store outside the lock, and
//! every request for that user meanwhile waits on the same load. Changes are
//! applied under the lock and leave the user queued for write-behind (see
//! [`crate::write_behind`]), which drains the shards' queues; with a write
//! delay of zero (write-through), each request writes its own changes before
//! it answers, and write-behind only retries those that failed.

mod arena;
mod gate;
pub mod handoff;
mod pins;
pub mod recount;
pub(crate) mod shard;
mod users;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::time::Instant;

use crate::channel_states::ChannelStates;
use crate::clock;
use crate::error::Error;
use crate::journal::{Journal, Replayed, record};
use crate::ownership::{Ownership, SlotState};
use crate::read_state::{UserReadStates, UserView};
use crate::recent_deletions::{Deletion, RecentDeletions};
use crate::store::{Store, UserWrite};
use crate::watch::Feed;
pub use arena::Stored;
use gate::ChangeGate;
use pins::Pins;
pub(crate) use shard::{Due, LoadFailure, Loading, Shard, ShardGauges, ShardStats};

/// How often a release looks whether its users are all written.
const RELEASE_POLL: Duration = Duration::from_millis(5);

/// How many uncached users one request loads at once.
const LOADS_PER_REQUEST: usize = 64;
/// Evicted watched users a recount loads at once.
const RECOUNT_LOADS: usize = 16;

/// Write-through mode: how long after a change write-behind writes it if the
/// request's own write failed or never finished.
const WRITE_THROUGH_FALLBACK: Duration = Duration::from_secs(1);

tokio::task_local! {
    /// Set on a task whose changes are confirmed later, together (see
    /// [`Cache::confirming_later`]).
    static CONFIRMED_LATER: ();
}

/// The cache's settings. `Config::cache` builds them from the service's
/// configuration; their `Default` is the service's defaults.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Read states (not users) held in memory, over all shards.
    pub capacity: usize,
    pub shards: usize,
    /// How long after a user's first unwritten change its write starts.
    /// Zero means write-through: each change is written before its request
    /// answers.
    pub write_delay: Duration,
    /// Read states evicted before the store took them (held beyond
    /// `capacity`) beyond which changes are refused.
    pub max_evicted_unwritten: usize,
    /// Store writes under way at once, write-behind's and write-through's
    /// together.
    pub write_concurrency: usize,
    /// How long a user lowered for a deleted message is remembered (see
    /// [`RecentDeletions`]).
    pub deletion_window: Duration,
    /// Lowerings remembered at once, over all shards.
    pub deletion_capacity: usize,
    /// Users in one chunk of a handoff (see [`handoff`]).
    pub handoff_chunk: usize,
}

#[derive(Debug)]
pub struct Cache {
    shards: Box<[Mutex<Shard>]>,
    /// Wakes the writer of the shard with the same index.
    wakers: Box<[Notify]>,
    store: Arc<dyn Store>,
    config: CacheConfig,
    /// Read states of evicted-unwritten users (each shard adds its part).
    evicted_total: Arc<AtomicUsize>,
    /// Bounds the store writes under way (see `CacheConfig::write_concurrency`).
    write_permits: Arc<Semaphore>,
    /// Closed when shutdown begins: changes are refused from then on.
    /// Crossed by a barrier when slots are released.
    gate: ChangeGate,
    /// The slots this node serves (all of them when standalone).
    ownership: Arc<Ownership>,
    /// The channels counted by channel, which users' counts read (see
    /// [`crate::channel_states`]).
    channels: Arc<ChannelStates>,
    /// Where changes are journaled before they are answered (see
    /// [`crate::journal`]); unset: they are not.
    journal: OnceLock<Arc<Journal>>,
}

impl Cache {
    /// A standalone node's cache: every user is served here.
    pub fn new(config: CacheConfig, store: Arc<dyn Store>) -> Arc<Cache> {
        Cache::with_ownership(config, store, Arc::new(Ownership::standalone()))
    }

    /// A fleet node's cache: only users of slots `ownership` serves.
    pub fn with_ownership(
        config: CacheConfig,
        store: Arc<dyn Store>,
        ownership: Arc<Ownership>,
    ) -> Arc<Cache> {
        let shards = config.shards.max(1);
        let per_shard = config.capacity.div_ceil(shards).max(1);
        let deletions_per_shard = config.deletion_capacity.div_ceil(shards);
        let evicted_total = Arc::new(AtomicUsize::new(0));
        let channels = ChannelStates::new(store.clone(), config.write_delay);
        Arc::new(Cache {
            shards: (0..shards)
                .map(|_| {
                    let deletions =
                        RecentDeletions::new(config.deletion_window, deletions_per_shard);
                    Mutex::new(Shard::new(
                        per_shard,
                        evicted_total.clone(),
                        deletions,
                        channels.clone(),
                    ))
                })
                .collect(),
            wakers: (0..shards).map(|_| Notify::new()).collect(),
            store,
            write_permits: Arc::new(Semaphore::new(config.write_concurrency.max(1))),
            config,
            evicted_total,
            gate: ChangeGate::default(),
            ownership,
            channels,
            journal: OnceLock::new(),
        })
    }

    /// Journals every later change, users' and channels', before it is
    /// answered; set once, before serving.
    pub fn set_journal(&self, journal: Arc<Journal>) {
        self.channels.set_journal(journal.clone());
        let _ = self.journal.set(journal);
    }

    /// Takes in what the journal held at start, before serving: replayed
    /// users wait beside the cache to be written (or laid over the user
    /// when it is loaded), channels replace older ones held.
    pub fn replay(&self, replayed: Replayed) {
        let since = Instant::now();
        for (_, write) in replayed.users {
            self.with_shard(self.shard_of(write.user_id), |shard| {
                shard.add_replayed(write, since);
            });
        }
        self.channels.replay(replayed.channels);
    }

    /// Journals again every change the store may lack, users' and
    /// channels' (a fleet node's new backup attaches: see
    /// `crate::cluster::backup`); returns how many users and channels.
    pub fn rejournal(&self) -> usize {
        let Some(journal) = self.journal.get() else {
            return 0;
        };
        let now_ms = clock::now_micros() / 1000;
        let users: usize = (0..self.shards.len())
            .map(|index| self.with_shard(index, |shard| shard.rejournal(journal, now_ms)))
            .sum();
        users + self.channels.rejournal()
    }

    /// Runs `serving` with the changes it applies confirmed later, many at
    /// once, by [`Cache::confirm`] (an `Apply` stream, before it sends a
    /// response): one journal wait for a response's items, not one each.
    pub async fn confirming_later<F: Future>(serving: F) -> F::Output {
        CONFIRMED_LATER.scope((), serving).await
    }

    /// Whether every change applied so far may be answered OK: durable in
    /// the journal, and applied under a lease that still holds.
    pub async fn confirm(&self) -> Result<(), Error> {
        self.journaled().await?;
        self.still_leased()
    }

    /// [`Cache::confirm`], unless the caller confirms later.
    pub async fn confirmed(&self) -> Result<(), Error> {
        if CONFIRMED_LATER.try_with(|_| ()).is_ok() {
            return Ok(());
        }
        self.confirm().await
    }

    /// Waits until every change applied so far (the caller's among them) is
    /// durable in the journal, if there is one.
    pub async fn journaled(&self) -> Result<(), Error> {
        let Some(journal) = self.journal.get() else {
            return Ok(());
        };
        (journal.durable(journal.appended()).await).map_err(|e| Error::JournalFailed {
            reason: e.to_string(),
        })
    }

    /// When the oldest change the store does not hold was made (`None`:
    /// the store holds everything), for the journal's trimmer.
    pub fn oldest_unwritten(&self) -> Option<Instant> {
        let users =
            (0..self.shards.len()).filter_map(|index| self.lock(index).gauges().oldest_unwritten);
        users.chain(self.channels.oldest_unwritten()).min()
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The channels counted by channel (none until loaded, see
    /// [`ChannelStates::load_stored`], or switched).
    pub fn channels(&self) -> &Arc<ChannelStates> {
        &self.channels
    }

    /// Reads a user's read states.
    pub async fn read<R>(
        self: &Arc<Self>,
        user_id: u64,
        mut f: impl FnMut(&UserView) -> R,
    ) -> Result<R, Error> {
        self.with_user(user_id, true, |shard| shard.read(user_id, &mut f))
            .await
    }

    /// Changes a user's read states; `f` gets the clock for the version.
    pub async fn update<R>(
        self: &Arc<Self>,
        user_id: u64,
        mut f: impl FnMut(&mut UserReadStates<Stored<'_>>, u64) -> R,
    ) -> Result<R, Error> {
        self.check_unwritten()?;
        let applied = self
            .with_user(user_id, true, |shard| {
                let entry = match self.gate.enter() {
                    Ok(entry) => entry,
                    Err(refused) => return Some(Err(refused)),
                };
                // Checked inside the gate: see `crate::ownership`.
                if let Err(moved) = self.served(user_id) {
                    return Some(Err(moved));
                }
                let applied =
                    self.apply_change(shard, user_id, |user| f(user, clock::now_micros()));
                drop(entry);
                applied.map(Ok)
            })
            .await?;
        let (result, write) = applied?;
        self.write_through(write.into_iter().collect()).await?;
        self.confirmed().await?;
        Ok(result)
    }

    /// Runs `f` for each of `user_ids` (with its index; results in order),
    /// all or nothing: every user is loaded and pinned first, so a failed
    /// load or a dropped request changes nothing, and the changes are then
    /// applied without an `.await`, so once the first user is changed the
    /// last one is too.
    pub async fn update_many<R>(
        self: &Arc<Self>,
        user_ids: &[u64],
        f: impl FnMut(usize, &mut UserReadStates<Stored<'_>>, u64) -> R,
    ) -> Result<Vec<R>, Error> {
        let ((), results) = self.update_many_after(user_ids, |_| Ok(()), f).await?;
        Ok(results)
    }

    /// [`Cache::update_many`], with a change to a channel's state (`first`,
    /// given the clock) made before the users' in the same step: once every
    /// user is loaded and pinned, inside the gate, so that it is made only
    /// with the users' changes, and refused with them at shutdown. No
    /// channel is switched from `first` until the users are changed, so
    /// what `first` finds decides how they are; an error from it refuses
    /// the whole change.
    pub async fn update_many_after<T, R>(
        self: &Arc<Self>,
        user_ids: &[u64],
        first: impl FnOnce(u64) -> Result<T, Error>,
        mut f: impl FnMut(usize, &mut UserReadStates<Stored<'_>>, u64) -> R,
    ) -> Result<(T, Vec<R>), Error> {
        self.change_many(user_ids, first, |shard, index, user_id, now_us| {
            self.apply_change(shard, user_id, |user| f(index, user, now_us))
        })
        .await
    }

    /// A change to channel `channel_id` alone (a switch; on a fleet, also a
    /// message its owner takes for the other nodes), given the channel
    /// states and the clock: inside the gate like any change, so refused
    /// once shutdown begins (the final flush holds what was applied), and
    /// only while this node serves the slot of the channel's id (on a fleet
    /// its owner alone changes it; `NotServed` elsewhere, as for a user).
    pub fn change_channel<T>(
        &self,
        channel_id: u64,
        change: impl FnOnce(&ChannelStates, u64) -> T,
    ) -> Result<T, Error> {
        self.check_unwritten()?;
        let entry = self.gate.enter()?;
        self.served(channel_id)?;
        let changed = change(&self.channels, clock::now_micros());
        drop(entry);
        Ok(changed)
    }

    /// [`Cache::update_many_after`] for a deleted message, which lowers each
    /// user at most once: `f` runs only for users not lowered for `deletion`
    /// within the window (false for the others), and one it returns true
    /// for is remembered as lowered, in the same step.
    pub async fn update_many_once<T>(
        self: &Arc<Self>,
        user_ids: &[u64],
        deletion: Deletion,
        first: impl FnOnce(u64) -> Result<T, Error>,
        mut f: impl FnMut(usize, &mut UserReadStates<Stored<'_>>, u64) -> bool,
    ) -> Result<(T, Vec<bool>), Error> {
        self.change_many(user_ids, first, |shard, index, user_id, now_us| {
            if shard.deletions.lowered(user_id, deletion) {
                return Some((false, None));
            }
            let mut applied = self.apply_change(shard, user_id, |user| f(index, user, now_us));
            if let Some((true, write)) = &mut applied {
                shard.deletions.remember(user_id, deletion);
                if let Some(journal) = self.journal.get() {
                    let lowered = shard.deletions.of_user(user_id, clock::now_micros() / 1000);
                    journal.append(|out| record::append_lowered(out, user_id, &lowered));
                }
                // Written with the lowering it remembers (write-through).
                if let Some(write) = write {
                    write.lowered = shard.deletions.of_user(user_id, clock::now_micros() / 1000);
                }
            }
            applied
        })
        .await
    }

    /// The all-or-nothing frame of [`Cache::update_many_after`]: `first`
    /// runs once every user is pinned and served, then `change` for each
    /// pinned user under its shard's lock, with its index and the request's
    /// clock, all without an `.await`.
    async fn change_many<T, R>(
        self: &Arc<Self>,
        user_ids: &[u64],
        first: impl FnOnce(u64) -> Result<T, Error>,
        mut change: impl FnMut(&mut Shard, usize, u64, u64) -> Option<(R, Option<UserWrite>)>,
    ) -> Result<(T, Vec<R>), Error> {
        self.check_unwritten()?;
        let pins = self.pin_all(user_ids).await?;
        let entry = self.gate.enter()?;
        // Inside the gate, a release of these users' slots either waits for
        // this request or is seen here, before anything is applied. A pinned
        // user is held unless such a release let go of it (and the slot
        // came back since, in a new generation).
        for &user_id in user_ids {
            self.served(user_id)?;
        }
        if !pins.all_kept()
            && let Some(&user_id) = user_ids.first()
        {
            return Err(Error::NotServed {
                user_id,
                state: self.ownership.state_of(user_id),
            });
        }
        // One clock read for the whole request: each user's version still
        // rises strictly (max(previous + 1, now)).
        let now_us = clock::now_micros();
        let switches = self.channels.hold_switches();
        // One journal frame for the whole change: a crash keeps all of it
        // or none, as a cut request does.
        let group = self.journal.get().map(|journal| journal.group());
        let first = first(now_us)?;
        let mut results = Vec::with_capacity(user_ids.len());
        let mut writes = Vec::new();
        for (index, &user_id) in user_ids.iter().enumerate() {
            // Each user is let go under the lock that changes it: one lock
            // per user here, as before pins.
            let applied = self.with_shard(self.shard_of(user_id), |shard| {
                let applied = change(shard, index, user_id, now_us);
                shard.unpin(user_id, None);
                applied
            });
            match applied {
                Some((result, write)) => {
                    results.push(result);
                    writes.extend(write);
                }
                // Cannot happen: a pinned user is never evicted, and was
                // held when the gate was entered.
                None => tracing::error!(user_id, "a pinned user was not held; skipped"),
            }
        }
        drop(group);
        drop(switches);
        drop(entry);
        pins.let_go();
        self.write_through(writes).await?;
        self.confirmed().await?;
        Ok((first, results))
    }

    /// Applies a change to a held user; in write-through mode, also takes
    /// the write that carries it, if it changed anything.
    fn apply_change<R>(
        &self,
        shard: &mut Shard,
        user_id: u64,
        f: impl FnOnce(&mut UserReadStates<Stored<'_>>) -> R,
    ) -> Option<(R, Option<UserWrite>)> {
        let write_through = self.config.write_delay.is_zero();
        // In write-through mode the request writes its own change; the queue
        // entry only makes write-behind retry it if that write fails or the
        // request is dropped before it finishes.
        let delay = if write_through {
            WRITE_THROUGH_FALLBACK
        } else {
            self.config.write_delay
        };
        let journal = self.journal.get();
        shard.change(user_id, delay, |user| {
            let version = user.version();
            let result = f(user);
            if let Some(journal) = journal
                && user.version() != version
            {
                journal.append(|out| record::append_user(out, user_id, version, user.view()));
            }
            let write = (write_through && user.version() != version)
                .then(|| UserWrite::of(user_id, user.view()));
            (result, write)
        })
    }

    /// Write-through mode: writes each change before the request answers,
    /// within the store-write bound shared with write-behind. Each snapshot
    /// holds everything of its user unwritten up to its version, so on
    /// success all of that is written, whatever other requests' writes do
    /// meanwhile (the store keeps the newest row).
    async fn write_through(&self, writes: Vec<UserWrite>) -> Result<(), Error> {
        if writes.is_empty() {
            return Ok(());
        }
        let mut results = futures::stream::iter(writes)
            .map(|write| async move {
                // Never closed.
                let _permit = self.write_permits.acquire().await;
                let result = self.store.write(&write).await;
                (write, result)
            })
            .buffer_unordered(self.config.write_concurrency.max(1));
        let mut failure = None;
        while let Some((write, result)) = results.next().await {
            match result {
                Ok(()) => {
                    self.with_shard(self.shard_of(write.user_id), |shard| {
                        shard.finish_write_through(
                            write.user_id,
                            write.version,
                            clock::now_micros(),
                        );
                    });
                }
                Err(e) => {
                    failure.get_or_insert(Error::WriteFailed {
                        user_id: write.user_id,
                        reason: e.to_string(),
                    });
                }
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Reads each of `user_ids`, results in order. Reads need no
    /// all-or-nothing, so cached users are read at once and only the
    /// misses are loaded (several at a time) and read after.
    pub async fn read_many<R>(
        self: &Arc<Self>,
        user_ids: &[u64],
        mut f: impl FnMut(&UserView) -> R,
    ) -> Result<Vec<R>, Error> {
        for &user_id in user_ids {
            self.served(user_id)?;
        }
        let mut results: Vec<Option<R>> = user_ids
            .iter()
            .map(|&id| {
                self.with_shard(self.shard_of(id), |shard| {
                    let result = shard.read(id, &mut f);
                    shard.count_lookup(result.is_some());
                    result
                })
            })
            .collect();
        let missing: Vec<u64> = user_ids
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_none())
            .map(|(&id, _)| id)
            .collect();
        if !missing.is_empty() {
            let mut loads = futures::stream::iter(missing)
                .map(|id| self.with_user(id, false, move |shard| shard.read(id, |_| ())))
                .buffer_unordered(LOADS_PER_REQUEST);
            while let Some(result) = loads.next().await {
                result?;
            }
            for (slot, &user_id) in results.iter_mut().zip(user_ids) {
                if slot.is_none() {
                    *slot = Some(
                        self.with_user(user_id, false, |shard| shard.read(user_id, &mut f))
                            .await?,
                    );
                }
            }
        }
        Ok(results.into_iter().flatten().collect())
    }

    /// Subscribes `feed` to a user's changes, loading the user if needed:
    /// queues what changed after `since`, then every later change.
    pub async fn subscribe(
        self: &Arc<Self>,
        user_id: u64,
        feed: &Arc<Feed>,
        since: u64,
    ) -> Result<(), Error> {
        self.with_user(user_id, true, |shard| shard.subscribe(user_id, feed, since))
            .await
    }

    /// Brings a user into the cache (a subscribe about to need it), if
    /// this node serves it; counts no lookup.
    pub async fn load(self: &Arc<Self>, user_id: u64) -> Result<(), Error> {
        self.with_user(user_id, false, |shard| shard.read(user_id, |_| ()))
            .await
    }

    /// Tells the streams watching members of the `changed` channels counted
    /// by channel their new counts (see [`crate::cache::recount`]); a
    /// watched user evicted from the cache is loaded for it.
    pub async fn recount(self: &Arc<Self>, changed: &[u64]) {
        let evicted: Vec<u64> = (0..self.shards.len())
            .flat_map(|index| self.with_shard(index, |shard| shard.recount(changed)))
            .collect();
        let loads = evicted.into_iter().map(|user_id| {
            self.with_user(user_id, false, move |shard| {
                shard.recount_one(user_id, changed)
            })
        });
        // A user that cannot be loaded now (a store outage, its slot gone)
        // is told its counts with its next change or recount.
        let _ = futures::stream::iter(loads)
            .buffer_unordered(RECOUNT_LOADS)
            .collect::<Vec<_>>()
            .await;
    }

    /// Unsubscribes `feed` from a user; whether it was subscribed.
    pub fn unsubscribe(&self, user_id: u64, feed: &Arc<Feed>) -> bool {
        self.with_shard(self.shard_of(user_id), |shard| {
            shard.unsubscribe(user_id, feed)
        })
    }

    /// Loads every uncached user among `user_ids` (several at a time) and
    /// pins them all until the returned [`Pins`] is dropped.
    async fn pin_all(self: &Arc<Self>, user_ids: &[u64]) -> Result<Pins, Error> {
        let pins = Pins::new(self.clone(), user_ids.len());
        let mut missing = Vec::new();
        let mut held = Vec::with_capacity(user_ids.len());
        for &user_id in user_ids {
            let found = self.with_shard(self.shard_of(user_id), |shard| {
                let found = shard.pin(user_id);
                shard.count_lookup(found);
                found
            });
            if found {
                held.push(user_id);
            } else {
                missing.push(user_id);
            }
        }
        pins.add_held(&held);
        // The usual case, without building the machinery for concurrent loads.
        if missing.is_empty() {
            return Ok(pins);
        }
        {
            let mut loads = futures::stream::iter(missing)
                .map(|user_id| self.pin_loaded(user_id, &pins))
                .buffer_unordered(LOADS_PER_REQUEST);
            while let Some(result) = loads.next().await {
                result?;
            }
        }
        Ok(pins)
    }

    /// Pins `user_id`, loading it if needed; the pin is recorded in `pins`
    /// before any `.await`, so a dropped request gives it back.
    async fn pin_loaded(self: &Arc<Self>, user_id: u64, pins: &Pins) -> Result<(), Error> {
        let index = self.shard_of(user_id);
        loop {
            self.served(user_id)?;
            let found = self.with_shard(index, |shard| {
                if shard.pin(user_id) {
                    return None;
                }
                Some(match shard.pin_loading(user_id) {
                    Some(load) => load,
                    None => self.start_load(shard, index, user_id, 1),
                })
            });
            let Some(mut load) = found else {
                pins.add(user_id, None);
                return Ok(());
            };
            pins.add(user_id, Some(load.clone()));
            let outcome = load.wait_for(Option::is_some).await.map(|r| r.clone());
            match outcome {
                Ok(Some(Ok(()))) => return Ok(()),
                Ok(Some(Err(failure))) => {
                    pins.forget(user_id, &load);
                    return Err(self.load_error(user_id, failure));
                }
                // The loader is gone without an answer: give the pin back
                // and try again.
                _ => {
                    self.with_shard(index, |shard| shard.unpin(user_id, Some(&load)));
                    pins.forget(user_id, &load);
                }
            }
        }
    }

    /// Whether this node serves `user_id` (always, when standalone).
    fn served(&self, user_id: u64) -> Result<(), Error> {
        match self.ownership.state_of(user_id) {
            SlotState::Serving => Ok(()),
            state => Err(Error::NotServed { user_id, state }),
        }
    }

    /// Whether a change applied here may still be answered OK: the lease
    /// it was applied under has not lapsed since (see `crate::ownership`).
    pub fn still_leased(&self) -> Result<(), Error> {
        match self.ownership.leased() {
            true => Ok(()),
            false => Err(Error::LeaseLapsed),
        }
    }

    fn load_error(&self, user_id: u64, failure: LoadFailure) -> Error {
        match failure {
            LoadFailure::Store(reason) => Error::LoadFailed { user_id, reason },
            LoadFailure::NotServed => Error::NotServed {
                user_id,
                state: self.ownership.state_of(user_id),
            },
        }
    }

    /// Refuses a change before it is applied if it could not be kept: too
    /// much waits for the store, or the journal is failing.
    fn check_unwritten(&self) -> Result<(), Error> {
        if let Some(journal) = self.journal.get()
            && !journal.healthy()
        {
            return Err(Error::JournalFailed {
                reason: "the journal is failing on this node's disk; nothing was applied".into(),
            });
        }
        let evicted = self.evicted_unwritten();
        if evicted >= self.config.max_evicted_unwritten {
            return Err(Error::TooManyUnwritten {
                evicted,
                limit: self.config.max_evicted_unwritten,
            });
        }
        Ok(())
    }

    /// Runs `attempt` under the user's shard lock until it finds the user
    /// held, loading the user from the store in between. With `count`, the
    /// first attempt counts as the request's cache hit or miss.
    async fn with_user<R>(
        self: &Arc<Self>,
        user_id: u64,
        count: bool,
        mut attempt: impl FnMut(&mut Shard) -> Option<R>,
    ) -> Result<R, Error> {
        let index = self.shard_of(user_id);
        let mut first = count;
        loop {
            self.served(user_id)?;
            let found = self.with_shard(index, |shard| {
                let result = attempt(shard);
                if std::mem::take(&mut first) {
                    shard.count_lookup(result.is_some());
                }
                match result {
                    Some(result) => Ok(result),
                    None => Err(match shard.loading.get(&user_id) {
                        Some(loading) => loading.done.clone(),
                        None => self.start_load(shard, index, user_id, 0),
                    }),
                }
            });
            let mut load = match found {
                Ok(result) => return Ok(result),
                Err(load) => load,
            };
            // An error from `wait_for` means the loader is gone: try again.
            // A load discarded because the slot moved: the check says where.
            if let Ok(result) = load.wait_for(Option::is_some).await
                && let Some(Err(LoadFailure::Store(reason))) = &*result
            {
                return Err(Error::LoadFailed {
                    user_id,
                    reason: reason.clone(),
                });
            }
        }
    }

    /// Spawns the load of `user_id` (a task, so that a cancelled request
    /// cannot strand the requests waiting on it) and registers it with
    /// `pins` pins already handed to it.
    fn start_load(
        self: &Arc<Self>,
        shard: &mut Shard,
        index: usize,
        user_id: u64,
        pins: u32,
    ) -> watch::Receiver<shard::LoadResult> {
        let (done, load) = watch::channel(None);
        let ticket = self.ownership.ticket(user_id);
        shard.loading.insert(
            user_id,
            Loading {
                done: load.clone(),
                pins,
            },
        );
        // A replayed user's journaled changes go with the load, whatever
        // its write of them does meanwhile: the store may be read before
        // that write lands.
        let replayed = shard.take_replayed_for_load(user_id);
        let cache = self.clone();
        tokio::spawn(async move {
            let result = cache.store.load(user_id).await;
            cache.with_shard(index, |shard| {
                let pins = shard.loading.remove(&user_id).map_or(0, |l| l.pins);
                let shared = match result {
                    // Kept only if the slot was served all along: see
                    // `crate::ownership`.
                    Ok(_) if !cache.ownership.keeps(ticket) => Err(LoadFailure::NotServed),
                    Ok(mut stored) => {
                        let now_us = clock::now_micros();
                        let lowered = std::mem::take(&mut stored.lowered);
                        shard.deletions.restore(user_id, &lowered, now_us / 1000);
                        let user = match replayed.clone() {
                            Some(mut replayed) => {
                                let lowered = std::mem::take(&mut replayed.lowered);
                                shard.deletions.restore(user_id, &lowered, now_us / 1000);
                                stored.into_user_with(replayed, now_us)
                            }
                            None => stored.into_user(now_us),
                        };
                        shard.insert_loaded(user_id, user, pins);
                        Ok(())
                    }
                    Err(e) => {
                        tracing::warn!(user_id, error = %e, "load failed");
                        Err(LoadFailure::Store(e.to_string()))
                    }
                };
                shard.end_replayed_load(replayed, shared.is_ok());
                // Under the lock: a pin holder that finds the load gone
                // from `loading` finds its result here (see `Shard::unpin`).
                // Nobody waiting is fine.
                let _ = done.send(Some(shared));
            });
        });
        load
    }

    /// Asks the CPU to fetch these users' records and read states before
    /// they are changed one by one (a hint, see [`Shard::prefetch`]): a
    /// batch's misses overlap instead of each change waiting for its own.
    /// A shard another thread holds is passed over rather than waited for.
    pub fn prefetch(&self, user_ids: &mut [u64]) {
        user_ids.sort_unstable_by_key(|&user_id| self.shard_of(user_id));
        for users in user_ids.chunk_by(|a, b| self.shard_of(*a) == self.shard_of(*b)) {
            if let Ok(shard) = self.shards[self.shard_of(users[0])].try_lock() {
                for &user_id in users {
                    shard.prefetch(user_id);
                }
            }
        }
    }

    /// Locks shard `index`, runs `f`, unlocks, and wakes the shard's writer
    /// if `f` queued something for it: the one way into a shard.
    pub(crate) fn with_shard<R>(&self, index: usize, f: impl FnOnce(&mut Shard) -> R) -> R {
        let mut shard = self.lock(index);
        let result = f(&mut shard);
        let wake = shard.take_wake();
        drop(shard);
        if wake {
            self.wakers[index].notify_one();
        }
        result
    }

    pub fn ownership(&self) -> &Arc<Ownership> {
        &self.ownership
    }

    /// Per shard, its users (cached, evicted, watched) that `leaving` names,
    /// as they are now (changes may still be under way; see
    /// [`Cache::settled_users`]).
    pub fn users_leaving(&self, leaving: &impl Fn(u64) -> bool) -> Vec<Vec<u64>> {
        (0..self.shards.len())
            .map(|index| self.with_shard(index, |shard| shard.users_leaving(leaving)))
            .collect()
    }

    /// Queues each shard's `users` with unwritten changes for a write now.
    fn expedite(&self, users: &[Vec<u64>]) {
        for (index, ids) in users.iter().enumerate() {
            self.with_shard(index, |shard| shard.expedite(ids));
        }
    }

    /// How many of `users` are not written yet.
    fn unsettled(&self, users: &[Vec<u64>]) -> usize {
        users
            .iter()
            .enumerate()
            .map(|(index, ids)| self.with_shard(index, |shard| shard.unsettled(ids)))
            .sum()
    }

    /// Lets go of the users of slots no longer served (the caller moved
    /// them out of `Serving` already): waits for every change that may have
    /// seen them served, writes all their unwritten changes (retrying until
    /// the store takes them), then drops them from memory, clean ones too,
    /// and tells their Watch streams they moved. Returns the users let go.
    pub async fn release(&self, leaving: impl Fn(u64) -> bool) -> usize {
        let users = self.settled_users(leaving).await;
        // Queued for a write once: write-behind retries a failed write itself.
        self.expedite(&users);
        while self.unsettled(&users) > 0 {
            tokio::time::sleep(RELEASE_POLL).await;
        }
        for (index, ids) in users.iter().enumerate() {
            let kept = self.with_shard(index, |shard| shard.let_go(ids));
            // Cannot happen: nothing changes users of slots not served.
            if kept > 0 {
                tracing::error!(index, kept, "users changed while released; kept");
            }
        }
        users.iter().map(Vec::len).sum()
    }

    /// Lets go of the channels counted by channel of slots no longer served
    /// (as [`Cache::release`] for users): waits for every change that may
    /// have seen them served, then writes what is unwritten of them. Their
    /// copies stay. Returns the channels written.
    pub async fn release_channels(&self, leaving: impl Fn(u64) -> bool) -> usize {
        self.gate.barrier().await;
        self.channels.release(leaving).await
    }

    /// Refuses every later change (`UNAVAILABLE`, nothing applied) and
    /// returns once no change is being applied: the start of shutdown.
    pub async fn close(&self) {
        self.gate.close().await;
    }

    pub(crate) fn write_permits(&self) -> &Arc<Semaphore> {
        &self.write_permits
    }

    /// Write-behind: the next user of shard `index` due for a write.
    pub(crate) fn next_due(&self, index: usize, now: Instant) -> Due {
        self.with_shard(index, |shard| shard.next_due(now))
    }

    /// Write-behind: every user of shard `index` with unwritten changes and
    /// no write under way.
    pub(crate) fn unwritten_users(&self, index: usize) -> Vec<u64> {
        self.with_shard(index, |shard| shard.unwritten_users())
    }

    /// Write-behind: starts (or, with `retry`, continues) a write of
    /// `user_id`; see [`Shard::begin_write`].
    pub(crate) fn begin_write(&self, user_id: u64, retry: bool) -> Option<UserWrite> {
        self.with_shard(self.shard_of(user_id), |shard| {
            shard.begin_write(user_id, retry, clock::now_micros())
        })
    }

    /// Write-behind: a write of `user_id` up to `version` succeeded
    /// (`Some`) or was given up (`None`).
    pub(crate) fn finish_write(&self, user_id: u64, version: Option<u64>) {
        self.with_shard(self.shard_of(user_id), |shard| {
            shard.finish_write(user_id, version, clock::now_micros());
        });
    }

    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Snowflake ids carry a timestamp in the high bits and a counter in the
    /// low ones; a multiplicative hash spreads both over the shards.
    pub(crate) fn shard_of(&self, user_id: u64) -> usize {
        let mixed = user_id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((mixed >> 32) as usize) % self.shards.len()
    }

    fn lock(&self, index: usize) -> MutexGuard<'_, Shard> {
        // Shard code does not panic while it holds the lock with data half
        // changed; if something did, the counters are the worst of it.
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn waker(&self, index: usize) -> &Notify {
        &self.wakers[index]
    }

    /// Read states (and tombstones) held in memory over all shards.
    pub fn stats_read_states(&self) -> usize {
        self.stats().0.read_states
    }

    /// Read states evicted before the store took them, over all shards.
    pub fn evicted_unwritten(&self) -> usize {
        self.evicted_total.load(Ordering::Relaxed)
    }

    /// How many [`Cache::evicted_unwritten`] may reach before changes are
    /// refused (`max_evicted_unwritten`).
    pub fn evicted_unwritten_limit(&self) -> usize {
        self.config.max_evicted_unwritten
    }

    /// Unwritten read states (a pending "delete all" counts as one) over
    /// all shards.
    pub fn unwritten(&self) -> usize {
        (0..self.shards.len())
            .map(|index| self.lock(index).unwritten())
            .sum()
    }

    /// Users with a write-behind write under way, over all shards.
    pub fn writes_in_flight(&self) -> usize {
        (0..self.shards.len())
            .map(|index| self.lock(index).in_flight())
            .sum()
    }

    /// A snapshot of every shard's gauges and counters, summed.
    pub(crate) fn stats(&self) -> (ShardGauges, ShardStats) {
        let mut gauges = ShardGauges::default();
        let mut stats = ShardStats::default();
        for index in 0..self.shards.len() {
            let mut shard = self.lock(index);
            let g = shard.gauges();
            gauges.users += g.users;
            gauges.watched += g.watched;
            gauges.read_states += g.read_states;
            gauges.unwritten += g.unwritten;
            gauges.oldest_unwritten = gauges
                .oldest_unwritten
                .into_iter()
                .chain(g.oldest_unwritten)
                .min();
            stats.hits += shard.stats.hits;
            stats.misses += shard.stats.misses;
            stats.evictions += shard.stats.evictions;
            stats.evictions_unwritten += shard.stats.evictions_unwritten;
        }
        (gauges, stats)
    }
}

#[cfg(test)]
mod tests;
