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
mod durability;
mod gate;
pub mod handoff;
mod loading;
mod many;
mod pins;
pub mod recount;
pub(crate) mod shard;
mod stats;
mod users;
mod writes;

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{Notify, Semaphore};

use crate::channel_states::ChannelStates;
use crate::clock;
use crate::error::Error;
use crate::journal::{Journal, record};
use crate::ownership::{Ownership, SlotState};
use crate::read_state::{UserReadStates, UserView};
use crate::recent_deletions::RecentDeletions;
use crate::store::{Store, UserWrite};
use crate::watch::Feed;
pub use arena::Stored;
use gate::ChangeGate;
pub(crate) use shard::{Due, LoadFailure, Loading, Shard, ShardGauges, ShardStats};

/// Evicted watched users a recount loads at once.
const RECOUNT_LOADS: usize = 16;

/// Write-through mode: how long after a change write-behind writes it if the
/// request's own write failed or never finished.
const WRITE_THROUGH_FALLBACK: Duration = Duration::from_secs(1);

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

    /// Refuses every later change (`UNAVAILABLE`, nothing applied) and
    /// returns once no change is being applied: the start of shutdown.
    pub async fn close(&self) {
        self.gate.close().await;
    }

    fn lock(&self, index: usize) -> MutexGuard<'_, Shard> {
        // Shard code does not panic while it holds the lock with data half
        // changed; if something did, the counters are the worst of it.
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests;
