//! Request builders, the seeded tests' replay and the benchmarks' cache,
//! shared by every test binary (end-to-end, Cassandra, simulation), the
//! benchmarks and the load generator's tests: one home, so no test file imports another's. Compiled only with the `test-support` feature.

use std::sync::Arc;
use std::time::Duration;

use crate::cache::{Cache, CacheConfig};
use crate::proto::{
    AckRequest, DeleteReadStatesRequest, MessageCreatedRequest, MessageDeletedRequest,
    ReadStateKey, SetChannelCountingRequest,
};
use crate::store::Store;

/// A normal ack of a channel read state.
pub fn ack(user_id: u64, channel_id: u64, message_id: u64) -> AckRequest {
    AckRequest {
        user_id,
        channel_id,
        message_id,
        ..AckRequest::default()
    }
}

/// A new message in a channel: `author_id` 0 for none.
pub fn message(
    channel_id: u64,
    message_id: u64,
    author_id: u64,
    mentioned: &[u64],
    unread: &[u64],
) -> MessageCreatedRequest {
    MessageCreatedRequest {
        channel_id,
        message_id,
        author_id,
        mentioned_user_ids: mentioned.to_vec(),
        unread_user_ids: unread.to_vec(),
        ..MessageCreatedRequest::default()
    }
}

/// Deletes channel read states of a user, or all of them with `all`.
pub fn delete(user_id: u64, channel_ids: &[u64], all: bool) -> DeleteReadStatesRequest {
    DeleteReadStatesRequest {
        user_id,
        keys: channel_ids
            .iter()
            .map(|&channel_id| ReadStateKey {
                channel_id,
                kind: 0,
            })
            .collect(),
        all,
    }
}

/// A deleted message: the users it mentioned, and those it counted unread.
pub fn deleted(
    channel_id: u64,
    message_id: u64,
    mentioned: &[u64],
    unread: &[u64],
) -> MessageDeletedRequest {
    MessageDeletedRequest {
        channel_id,
        message_id,
        mentioned_user_ids: mentioned.to_vec(),
        unread_user_ids: unread.to_vec(),
        ..MessageDeletedRequest::default()
    }
}

/// Switches a channel to counting by channel from `counted_from`.
pub fn switch(channel_id: u64, counted_from: u64) -> SetChannelCountingRequest {
    SetChannelCountingRequest {
        channel_id,
        counted_from,
    }
}

/// The seeds a seeded test runs: the one the environment variable `one`
/// names (a replay), or else `0..N`, N from `many` (default `count`).
pub fn seeds(one: &str, many: &str, count: u64) -> Vec<u64> {
    match std::env::var(one) {
        Ok(seed) => vec![seed.parse().expect(one)],
        Err(_) => {
            let count = std::env::var(many).map_or(count, |n| n.parse().expect(many));
            (0..count).collect()
        }
    }
}

/// Runs `simulate(seed)` on a current-thread runtime whose clock is paused
/// (it advances whenever every task waits), under [`replayable`].
#[cfg(feature = "simulation")]
pub fn run_paused<F: std::future::Future>(
    what: &str,
    replay: &str,
    seed: u64,
    simulate: impl FnOnce(u64) -> F,
) -> F::Output {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    replayable(what, replay, seed, || runtime.block_on(simulate(seed)))
}

/// Runs one seed of a seeded test: on a panic, says which seed failed and
/// how to replay it (`replay`, an environment variable), then panics on.
pub fn replayable<T>(what: &str, replay: &str, seed: u64, run: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(ran) => ran,
        Err(panic) => {
            eprintln!("{what} failed at seed {seed}; replay with {replay}={seed}");
            std::panic::resume_unwind(panic);
        }
    }
}

/// A cache of up to `capacity` read states on `store` that writes nothing
/// for an hour: a benchmark of it measures the cache alone.
pub fn bench_cache(capacity: usize, store: Arc<dyn Store>) -> Arc<Cache> {
    let config = CacheConfig {
        capacity,
        shards: 64,
        write_delay: Duration::from_secs(3600),
        max_evicted_unwritten: usize::MAX,
        ..CacheConfig::default()
    };
    Cache::new(config, store)
}

/// The runtime a benchmark drives its futures on.
pub fn bench_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}
