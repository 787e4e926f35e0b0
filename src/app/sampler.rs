//! The metrics sampler: once a second it copies the cache's counters and
//! gauges into the recorder (the shards keep them as plain integers, so a
//! request never pays for a registry lookup), and runs the recorder's
//! upkeep.

use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, gauge};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cache::Cache;
use crate::metrics::{
    CACHE_EVICTIONS, CACHE_EVICTIONS_UNWRITTEN, CACHE_HITS, CACHE_MISSES, CACHED_READ_STATES,
    CACHED_USERS, CHANNEL_STATES, EVICTED_UNWRITTEN, EVICTED_UNWRITTEN_LIMIT, OLDEST_UNWRITTEN,
    SLOTS, UNWRITTEN_CHANNEL_STATES, UNWRITTEN_READ_STATES, WATCHED_USERS, handle,
};

/// Every second: copies the cache's counters and gauges into the recorder,
/// and runs the recorder's upkeep, which folds recorded histogram samples
/// into their buckets (without it they pile up until the next scrape).
pub fn spawn(cache: Arc<Cache>, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
    let recorder = handle();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    // Off the runtime's workers: the gauges look at every
                    // cached user (milliseconds a second at millions of
                    // read states, which would stall the requests queued
                    // behind it).
                    let cache = cache.clone();
                    if let Err(error) = tokio::task::spawn_blocking(move || sample(&cache)).await {
                        tracing::error!(%error, "metrics: sampling the cache failed");
                    }
                    recorder.run_upkeep();
                }
                () = stop.cancelled() => return,
            }
        }
    })
}

fn sample(cache: &Cache) {
    let (gauges, stats) = cache.stats();
    counter!(CACHE_HITS).absolute(stats.hits);
    counter!(CACHE_MISSES).absolute(stats.misses);
    counter!(CACHE_EVICTIONS).absolute(stats.evictions);
    counter!(CACHE_EVICTIONS_UNWRITTEN).absolute(stats.evictions_unwritten);
    gauge!(CACHED_USERS).set(gauges.users as f64);
    gauge!(CACHED_READ_STATES).set(gauges.read_states as f64);
    gauge!(WATCHED_USERS).set(gauges.watched as f64);
    gauge!(UNWRITTEN_READ_STATES).set(gauges.unwritten as f64);
    gauge!(CHANNEL_STATES).set(cache.channels().len() as f64);
    gauge!(UNWRITTEN_CHANNEL_STATES).set(cache.channels().unwritten() as f64);
    // Evicted before written: memory that only the store can give back;
    // at the limit, changes are refused.
    gauge!(EVICTED_UNWRITTEN).set(cache.evicted_unwritten() as f64);
    gauge!(EVICTED_UNWRITTEN_LIMIT).set(cache.evicted_unwritten_limit() as f64);
    let oldest = gauges
        .oldest_unwritten
        .map_or(0.0, |since| (Instant::now() - since).as_secs_f64());
    gauge!(OLDEST_UNWRITTEN).set(oldest);
    let [not_owner, serving, releasing, acquiring] = cache.ownership().counts();
    for (state, count) in [
        ("not_owner", not_owner),
        ("serving", serving),
        ("releasing", releasing),
        ("acquiring", acquiring),
    ] {
        gauge!(SLOTS, "state" => state).set(count as f64);
    }
}
