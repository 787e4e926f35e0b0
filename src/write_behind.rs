//! Write-behind: drains the cache shards' queues into the store.
//!
//! One scheduler task per shard waits for the shard's next due user (its
//! first unwritten change plus `write_delay`, or at once for a user evicted
//! with unwritten changes) and spawns a write for it. A write takes a
//! snapshot of the user's unwritten read states under the shard lock, writes
//! it outside the lock, and on success marks exactly that version written;
//! changes made meanwhile stay unwritten and are queued again. A failed write
//! is retried with backoff, and the data stays unwritten until it succeeds.
//!
//! The cache's write permits bound the store writes under way (write-through
//! writes take them too), so a burst of evictions cannot flood the store. A
//! write holds a permit only while the store call is under way, never while
//! it backs off, so users whose writes keep failing never hold up the others.
//!
//! [`WriteBehind::shutdown`] closes the cache to changes, then writes until
//! nothing is unwritten and no write is under way, giving up only at its
//! deadline. The channels counted by channel are written behind by their
//! own task ([`crate::channel_states`]), started and flushed here too.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cache::{Cache, Due};

#[derive(Clone, Debug)]
pub struct WriteBehindConfig {
    /// The first retry of a failed write waits this long, doubling up to
    /// `retry_max`.
    pub retry_min: Duration,
    pub retry_max: Duration,
}

impl Default for WriteBehindConfig {
    fn default() -> Self {
        WriteBehindConfig {
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(5),
        }
    }
}

/// What [`WriteBehind::shutdown`] achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Changes still unwritten when the deadline passed (0: all written),
    /// counted as [`Cache::unwritten`] counts them, plus channels counted
    /// by channel.
    pub unwritten: usize,
}

#[derive(Debug)]
pub struct WriteBehind {
    writer: Arc<Writer>,
    schedulers: Vec<JoinHandle<()>>,
    /// Stops the schedulers (not the writes_under_way).
    stop: CancellationToken,
}

#[derive(Debug)]
struct Writer {
    cache: Arc<Cache>,
    config: WriteBehindConfig,
    writes_under_way: TaskTracker,
    /// Makes failing writes_under_way stop retrying (the shutdown deadline passed).
    give_up: CancellationToken,
}

impl WriteBehind {
    /// Starts one scheduler per cache shard.
    pub fn start(cache: Arc<Cache>, config: WriteBehindConfig) -> WriteBehind {
        let writer = Arc::new(Writer {
            cache,
            config,
            writes_under_way: TaskTracker::new(),
            give_up: CancellationToken::new(),
        });
        let stop = CancellationToken::new();
        let mut schedulers: Vec<JoinHandle<()>> = (0..writer.cache.shard_count())
            .map(|index| tokio::spawn(writer.clone().schedule(index, stop.clone())))
            .collect();
        let channels = writer.cache.channels().clone();
        schedulers.push(tokio::spawn(channels.run(stop.clone())));
        WriteBehind {
            writer,
            schedulers,
            stop,
        }
    }

    /// Closes the cache to changes, then writes every unwritten change,
    /// retrying failures, until nothing is unwritten and no write is under
    /// way, or `timeout` passes.
    pub async fn shutdown(self, timeout: Duration) -> ShutdownReport {
        let writer = self.writer;
        let cache = writer.cache.clone();
        cache.close().await;
        self.stop.cancel();
        for scheduler in self.schedulers {
            let _ = scheduler.await;
        }
        let drain = async {
            loop {
                // A change made while its user's write was under way is
                // found on the next round, once that write is done.
                let mut started = 0;
                for index in 0..cache.shard_count() {
                    for user_id in cache.unwritten_users(index) {
                        writer.clone().spawn_write(user_id).await;
                        started += 1;
                    }
                }
                writer.writes_under_way.close();
                writer.writes_under_way.wait().await;
                writer.writes_under_way.reopen();
                if cache.unwritten() == 0 && cache.writes_in_flight() == 0 {
                    return;
                }
                if started == 0 {
                    // Only write-through writes of requests are under way.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        let deadline = Instant::now() + timeout;
        if tokio::time::timeout(timeout, drain).await.is_err() {
            writer.give_up.cancel();
            writer.writes_under_way.close();
            writer.writes_under_way.wait().await;
        }
        // Channels counted by channel, in what is left of the time.
        let left = deadline.saturating_duration_since(Instant::now());
        let channels = cache.channels().flush(left).await;
        ShutdownReport {
            unwritten: cache.unwritten() + channels,
        }
    }
}

impl WriteBehind {
    /// Stops, writing nothing more, as a kill does (the simulation's
    /// crashes); returns once the store calls under way have landed or
    /// failed, as they would before a restarted node reads the store.
    pub async fn crash(self) {
        self.stop.cancel();
        self.writer.give_up.cancel();
        for scheduler in self.schedulers {
            scheduler.abort();
        }
        self.writer.writes_under_way.close();
        self.writer.writes_under_way.wait().await;
    }
}

impl Writer {
    /// Feeds one shard's due users to writes_under_way until stopped.
    async fn schedule(self: Arc<Self>, index: usize, stop: CancellationToken) {
        loop {
            match self.cache.next_due(index, Instant::now()) {
                Due::User(user_id) => {
                    tokio::select! {
                        () = self.clone().spawn_write(user_id) => {}
                        () = stop.cancelled() => return,
                    }
                }
                Due::Wait(deadline) => {
                    let until = async {
                        match deadline {
                            Some(deadline) => tokio::time::sleep_until(deadline).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        () = self.cache.waker(index).notified() => {}
                        () = until => {}
                        () = stop.cancelled() => return,
                    }
                }
            }
        }
    }

    /// Waits for a write permit, then writes_under_way `user_id` in a task.
    async fn spawn_write(self: Arc<Self>, user_id: u64) {
        let Some(permit) = self.permit().await else {
            return;
        };
        self.writes_under_way
            .spawn(self.clone().write_user(user_id, permit));
    }

    /// A write permit, or `None` once shutdown gives up.
    async fn permit(&self) -> Option<OwnedSemaphorePermit> {
        tokio::select! {
            permit = self.cache.write_permits().clone().acquire_owned() => permit.ok(),
            () = self.give_up.cancelled() => None,
        }
    }

    /// Writes one user until it succeeds or shutdown gives up.
    async fn write_user(self: Arc<Self>, user_id: u64, permit: OwnedSemaphorePermit) {
        let store = self.cache.store().clone();
        let mut backoff = self.config.retry_min;
        let mut permit = Some(permit);
        let mut attempt = 0_u32;
        loop {
            let held = match permit.take() {
                Some(permit) => permit,
                None => match self.permit().await {
                    Some(permit) => permit,
                    None => {
                        self.cache.finish_write(user_id, None);
                        return;
                    }
                },
            };
            // A retry takes a fresh snapshot, so it also carries what changed
            // while the store was failing.
            let Some(write) = self.cache.begin_write(user_id, attempt > 0) else {
                return;
            };
            let result = store.write(&write).await;
            drop(held);
            match result {
                Ok(()) => {
                    self.cache.finish_write(user_id, Some(write.version));
                    return;
                }
                Err(error) => {
                    if attempt == 0 {
                        tracing::warn!(user_id, %error, "write failed; retrying with backoff");
                    }
                    tokio::select! {
                        () = tokio::time::sleep(jitter(backoff, user_id, attempt)) => {}
                        () = self.give_up.cancelled() => {
                            self.cache.finish_write(user_id, None);
                            return;
                        }
                    }
                    backoff = (backoff * 2).min(self.config.retry_max);
                    attempt += 1;
                }
            }
        }
    }
}

/// 75% to 125% of `delay`, so that writes failing together do not all retry
/// together; derived from the user and the attempt, so a run on a paused
/// clock replays exactly.
fn jitter(delay: Duration, user_id: u64, attempt: u32) -> Duration {
    let mut mixed = user_id ^ (u64::from(attempt) << 32);
    mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    mixed ^= mixed >> 31;
    let spread = mixed % 500; // 0..500 per mille of a half
    delay.mul_f64(0.75 + spread as f64 / 1000.0)
}

#[cfg(test)]
mod tests;
