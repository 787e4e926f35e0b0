//! Write-behind: drains the cache shards' queues into the store.
//!
//! One scheduler task per shard waits for the shard's next due user (its
//! first unwritten change plus `write_delay`, or at once for a user evicted
//! with unwritten changes) and spawns a flush for it; a semaphore bounds the
//! flushes under way, so a burst of evictions cannot flood the store. A flush
//! takes a snapshot of the user's unwritten read states under the shard lock,
//! writes it outside the lock, and on success marks exactly that version
//! written; changes made meanwhile stay dirty and are queued again. A failed
//! write is retried with backoff, and the data stays dirty until it succeeds.
//!
//! [`WriteBehind::shutdown`] stops the schedulers and writes every dirty user,
//! giving up only at its deadline.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cache::{Cache, Due};
use crate::{clock, metrics};

#[derive(Clone, Debug)]
pub struct WriteBehindConfig {
    /// Flushes under way at once, over all shards.
    pub concurrency: usize,
    /// The first retry of a failed write waits this long, doubling up to
    /// `retry_max`.
    pub retry_min: Duration,
    pub retry_max: Duration,
}

impl Default for WriteBehindConfig {
    fn default() -> Self {
        WriteBehindConfig {
            concurrency: 32,
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(5),
        }
    }
}

/// What [`WriteBehind::shutdown`] achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Read states still unwritten when the deadline passed (0: all written).
    pub unwritten: usize,
}

#[derive(Debug)]
pub struct WriteBehind {
    flusher: Arc<Flusher>,
    schedulers: Vec<JoinHandle<()>>,
    /// Stops the schedulers (not the flushes).
    stop: CancellationToken,
}

#[derive(Debug)]
struct Flusher {
    cache: Arc<Cache>,
    config: WriteBehindConfig,
    permits: Arc<Semaphore>,
    flushes: TaskTracker,
    /// Makes failing flushes stop retrying (the shutdown deadline passed).
    give_up: CancellationToken,
}

impl WriteBehind {
    /// Starts one scheduler per cache shard.
    pub fn start(cache: Arc<Cache>, config: WriteBehindConfig) -> WriteBehind {
        let flusher = Arc::new(Flusher {
            permits: Arc::new(Semaphore::new(config.concurrency.max(1))),
            cache,
            config,
            flushes: TaskTracker::new(),
            give_up: CancellationToken::new(),
        });
        let stop = CancellationToken::new();
        let schedulers = (0..flusher.cache.shard_count())
            .map(|index| tokio::spawn(flusher.clone().schedule(index, stop.clone())))
            .collect();
        WriteBehind {
            flusher,
            schedulers,
            stop,
        }
    }

    /// Writes every unwritten change, retrying failures until `timeout`.
    /// The caller must have stopped taking requests.
    pub async fn shutdown(self, timeout: Duration) -> ShutdownReport {
        self.stop.cancel();
        for scheduler in self.schedulers {
            let _ = scheduler.await;
        }
        let flusher = self.flusher;
        let drain = async {
            for index in 0..flusher.cache.shard_count() {
                let users = flusher.cache.lock(index).all_dirty();
                for user_id in users {
                    flusher.clone().spawn_flush(index, user_id).await;
                }
            }
            flusher.flushes.close();
            flusher.flushes.wait().await;
        };
        if tokio::time::timeout(timeout, drain).await.is_err() {
            flusher.give_up.cancel();
            flusher.flushes.close();
            flusher.flushes.wait().await;
        }
        ShutdownReport {
            unwritten: flusher.cache.unwritten(),
        }
    }
}

impl Flusher {
    /// Feeds one shard's due users to flushes until stopped.
    async fn schedule(self: Arc<Self>, index: usize, stop: CancellationToken) {
        loop {
            let due = self.cache.lock(index).next_due(Instant::now());
            match due {
                Due::User(user_id) => {
                    tokio::select! {
                        () = self.clone().spawn_flush(index, user_id) => {}
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

    /// Waits for a free flush slot, then flushes `user_id` in a task.
    async fn spawn_flush(self: Arc<Self>, index: usize, user_id: u64) {
        let Ok(permit) = self.permits.clone().acquire_owned().await else {
            return;
        };
        self.flushes
            .spawn(self.clone().flush(index, user_id, permit));
    }

    /// Writes one user until it succeeds or shutdown gives up.
    async fn flush(self: Arc<Self>, index: usize, user_id: u64, _permit: OwnedSemaphorePermit) {
        let store = self.cache.store().clone();
        let mut backoff = self.config.retry_min;
        let mut retry = false;
        loop {
            // A retry takes a fresh snapshot, so it also carries what changed
            // while the store was failing.
            let Some(write) = self.cache.lock(index).begin_flush(user_id, retry) else {
                return;
            };
            let started = Instant::now();
            let result = store.write(&write).await;
            metrics::store_operation(store.name(), "write", started.elapsed(), result.is_ok());
            match result {
                Ok(()) => {
                    metrics::store_written(write.read_states.len());
                    self.finish(index, user_id, Some(write.version));
                    return;
                }
                Err(error) => {
                    if !retry {
                        tracing::warn!(user_id, %error, "write failed; retrying with backoff");
                    }
                    tokio::select! {
                        () = tokio::time::sleep(jitter(backoff)) => {}
                        () = self.give_up.cancelled() => {
                            self.finish(index, user_id, None);
                            return;
                        }
                    }
                    backoff = (backoff * 2).min(self.config.retry_max);
                    retry = true;
                }
            }
        }
    }

    fn finish(&self, index: usize, user_id: u64, written: Option<u64>) {
        let mut shard = self.cache.lock(index);
        shard.finish_flush(user_id, written, clock::now_micros());
        let wake = shard.take_wake();
        drop(shard);
        if wake {
            self.cache.waker(index).notify_one();
        }
    }
}

/// 75% to 125% of `delay`, so that writes failing together do not all retry
/// together.
fn jitter(delay: Duration) -> Duration {
    let spread = clock::now_micros() % 500; // 0..500 per mille of a half
    delay.mul_f64(0.75 + spread as f64 / 1000.0)
}

#[cfg(test)]
mod tests;
