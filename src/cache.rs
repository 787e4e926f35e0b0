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

pub(crate) mod shard;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::clock;
use crate::error::Error;
use crate::metrics;
use crate::read_state::UserReadStates;
use crate::store::{Store, UserWrite};
pub(crate) use shard::{Due, Shard, ShardGauges, ShardStats};

/// How many uncached users one request loads at once.
const LOADS_PER_REQUEST: usize = 64;

/// Write-through mode: how long after a change write-behind writes it if the
/// request's own write failed or never finished.
const WRITE_THROUGH_FALLBACK: Duration = Duration::from_secs(1);

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
}

#[derive(Debug)]
pub struct Cache {
    shards: Box<[Mutex<Shard>]>,
    /// Wakes the flusher of the shard with the same index.
    wakers: Box<[Notify]>,
    store: Arc<dyn Store>,
    config: CacheConfig,
    /// Read states in the shards' eviction buffers (each shard adds its part).
    evicted_total: Arc<AtomicUsize>,
}

impl Cache {
    pub fn new(config: CacheConfig, store: Arc<dyn Store>) -> Arc<Cache> {
        let shards = config.shards.max(1);
        let per_shard = config.capacity.div_ceil(shards).max(1);
        let evicted_total = Arc::new(AtomicUsize::new(0));
        Arc::new(Cache {
            shards: (0..shards)
                .map(|_| Mutex::new(Shard::new(per_shard, evicted_total.clone())))
                .collect(),
            wakers: (0..shards).map(|_| Notify::new()).collect(),
            store,
            config,
            evicted_total,
        })
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Reads a user's read states.
    pub async fn read<R>(
        self: &Arc<Self>,
        user_id: u64,
        mut f: impl FnMut(&UserReadStates) -> R,
    ) -> Result<R, Error> {
        self.with_user(user_id, |shard| {
            shard.apply(user_id, self.config.write_delay, |user| f(user))
        })
        .await
    }

    /// Changes a user's read states; `f` gets the clock for the version.
    pub async fn update<R>(
        self: &Arc<Self>,
        user_id: u64,
        mut f: impl FnMut(&mut UserReadStates, u64) -> R,
    ) -> Result<R, Error> {
        self.check_unwritten()?;
        let (result, write) = self
            .with_user(user_id, |shard| {
                self.apply_change(shard, user_id, |user| f(user, clock::now_micros()))
            })
            .await?;
        self.write_through(write.into_iter().collect()).await?;
        Ok(result)
    }

    /// Runs `f` for each of `user_ids` (with its index; results in order),
    /// after loading every uncached one, so that a failed load fails the
    /// request before anything is changed.
    pub async fn update_many<R>(
        self: &Arc<Self>,
        user_ids: &[u64],
        mut f: impl FnMut(usize, &mut UserReadStates, u64) -> R,
    ) -> Result<Vec<R>, Error> {
        self.check_unwritten()?;
        self.load_all(user_ids).await?;
        // One clock read for the whole request: each user's version still
        // rises strictly (max(previous + 1, now)).
        let now_us = clock::now_micros();
        let mut results = Vec::with_capacity(user_ids.len());
        let mut writes = Vec::new();
        for (index, &user_id) in user_ids.iter().enumerate() {
            let (result, write) = self
                .with_user(user_id, |shard| {
                    self.apply_change(shard, user_id, |user| f(index, user, now_us))
                })
                .await?;
            results.push(result);
            writes.extend(write);
        }
        self.write_through(writes).await?;
        Ok(results)
    }

    /// Applies a change to a held user; in write-through mode, also takes
    /// the write that carries it, if it changed anything.
    fn apply_change<R>(
        &self,
        shard: &mut Shard,
        user_id: u64,
        f: impl FnOnce(&mut UserReadStates) -> R,
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
        shard.apply(user_id, delay, |user| {
            let version = user.version();
            let result = f(user);
            let write =
                (write_through && user.version() != version).then(|| UserWrite::of(user_id, user));
            (result, write)
        })
    }

    /// Write-through mode: writes each change before the request answers.
    /// Each snapshot holds everything of its user unwritten up to its
    /// version, so on success all of that is written, whatever other
    /// requests' writes do meanwhile (the store keeps the newest row).
    async fn write_through(&self, writes: Vec<UserWrite>) -> Result<(), Error> {
        if writes.is_empty() {
            return Ok(());
        }
        let store = self.store.clone();
        let results = futures::future::join_all(writes.iter().map(|write| async {
            let started = Instant::now();
            let result = store.write(write).await;
            metrics::store_operation(store.name(), "write", started.elapsed(), result.is_ok());
            result
        }))
        .await;
        let mut failure = None;
        for (write, result) in writes.iter().zip(results) {
            match result {
                Ok(()) => {
                    metrics::store_written(write.read_states.len());
                    let index = self.shard_of(write.user_id);
                    self.lock(index).finish_write_through(
                        write.user_id,
                        write.version,
                        clock::now_micros(),
                    );
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
        mut f: impl FnMut(&UserReadStates) -> R,
    ) -> Result<Vec<R>, Error> {
        let mut results: Vec<Option<R>> = user_ids
            .iter()
            .map(|&id| {
                let mut shard = self.lock(self.shard_of(id));
                shard.apply(id, self.config.write_delay, |user| f(user))
            })
            .collect();
        let missing: Vec<u64> = user_ids
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_none())
            .map(|(&id, _)| id)
            .collect();
        if !missing.is_empty() {
            self.load_all(&missing).await?;
            for (slot, &user_id) in results.iter_mut().zip(user_ids) {
                if slot.is_none() {
                    *slot = Some(self.read(user_id, &mut f).await?);
                }
            }
        }
        Ok(results.into_iter().flatten().collect())
    }

    /// Loads every uncached user among `user_ids`, several at a time.
    async fn load_all(self: &Arc<Self>, user_ids: &[u64]) -> Result<(), Error> {
        let missing: Vec<u64> = user_ids
            .iter()
            .copied()
            .filter(|&id| !self.lock(self.shard_of(id)).contains(id))
            .collect();
        // The usual case, without building the machinery for concurrent loads.
        if missing.is_empty() {
            return Ok(());
        }
        let mut loads = futures::stream::iter(missing)
            .map(|id| self.with_user(id, move |shard| shard.contains(id).then_some(())))
            .buffer_unordered(LOADS_PER_REQUEST);
        while let Some(result) = loads.next().await {
            result?;
        }
        Ok(())
    }

    fn check_unwritten(&self) -> Result<(), Error> {
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
    /// held, loading the user from the store in between.
    async fn with_user<R>(
        self: &Arc<Self>,
        user_id: u64,
        mut attempt: impl FnMut(&mut Shard) -> Option<R>,
    ) -> Result<R, Error> {
        let index = self.shard_of(user_id);
        loop {
            let mut load = {
                let mut shard = self.lock(index);
                if let Some(result) = attempt(&mut shard) {
                    let wake = shard.take_wake();
                    drop(shard);
                    if wake {
                        self.wakers[index].notify_one();
                    }
                    return Ok(result);
                }
                match shard.loading.get(&user_id) {
                    Some(load) => load.clone(),
                    None => self.start_load(&mut shard, index, user_id),
                }
            };
            // An error from `wait_for` means the loader is gone: try again.
            if let Ok(result) = load.wait_for(Option::is_some).await
                && let Some(Err(reason)) = &*result
            {
                return Err(Error::LoadFailed {
                    user_id,
                    reason: reason.clone(),
                });
            }
        }
    }

    /// Spawns the load of `user_id` (a task, so that a cancelled request
    /// cannot strand the requests waiting on it) and registers it.
    fn start_load(
        self: &Arc<Self>,
        shard: &mut Shard,
        index: usize,
        user_id: u64,
    ) -> watch::Receiver<shard::LoadResult> {
        let (done, load) = watch::channel(None);
        shard.loading.insert(user_id, load.clone());
        let cache = self.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let result = cache.store.load(user_id).await;
            metrics::store_operation(
                cache.store.name(),
                "load",
                started.elapsed(),
                result.is_ok(),
            );
            let mut shard = cache.lock(index);
            shard.loading.remove(&user_id);
            let shared = match result {
                Ok(stored) => {
                    if !shard.contains(user_id) {
                        shard.insert_loaded(user_id, stored.into_user(clock::now_micros()));
                    }
                    Ok(())
                }
                Err(e) => {
                    tracing::warn!(user_id, error = %e, "load failed");
                    Err(e.to_string())
                }
            };
            let wake = shard.take_wake();
            drop(shard);
            if wake {
                cache.wakers[index].notify_one();
            }
            // Nobody waiting is fine.
            let _ = done.send(Some(shared));
        });
        load
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

    pub(crate) fn lock(&self, index: usize) -> MutexGuard<'_, Shard> {
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

    /// Unwritten read states over all shards.
    pub fn unwritten(&self) -> usize {
        (0..self.shards.len())
            .map(|index| self.lock(index).dirty())
            .sum()
    }

    /// A snapshot of every shard's gauges and counters, summed.
    pub(crate) fn stats(&self) -> (ShardGauges, ShardStats) {
        let mut gauges = ShardGauges::default();
        let mut stats = ShardStats::default();
        for index in 0..self.shards.len() {
            let shard = self.lock(index);
            let g = shard.gauges();
            gauges.users += g.users;
            gauges.read_states += g.read_states;
            gauges.dirty += g.dirty;
            gauges.oldest_dirty = gauges.oldest_dirty.into_iter().chain(g.oldest_dirty).min();
            stats.hits += shard.stats.hits;
            stats.misses += shard.stats.misses;
            stats.evictions += shard.stats.evictions;
            stats.evictions_dirty += shard.stats.evictions_dirty;
        }
        (gauges, stats)
    }
}

#[cfg(test)]
mod tests;
