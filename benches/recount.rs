//! A Watch recount tick (issue 38): 10,000 watched users, each a member of
//! 5 of 50 channels counted by channel (1,000 members each) and of 20
//! channels counted per member, with one tick's marked channels: what
//! `Cache::recount` costs, events included (drained outside the timing).
//!
//! cargo bench --bench recount

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use futures::FutureExt;
use readstates::cache::Cache;
use readstates::read_state::Key;
use readstates::store::memory::MemoryStore;
use readstates::test_support::{bench_cache, bench_runtime};
use readstates::watch::Feed;

const USERS: u64 = 10_000;
/// Channels `COUNTED_FROM + 1 ..= COUNTED_FROM + COUNTED` are counted by
/// channel.
const COUNTED: u64 = 50;
const COUNTED_FROM: u64 = 1_000;
/// Of them, each user is a member of this many.
const MEMBER_OF: u64 = 5;
const PER_MEMBER: u64 = 20;
/// Users per Watch stream.
const PER_STREAM: u64 = 100;

fn node(rt: &tokio::runtime::Runtime) -> (Arc<Cache>, Vec<Arc<Feed>>) {
    let cache = bench_cache(
        (USERS * (MEMBER_OF + PER_MEMBER)) as usize * 2,
        Arc::new(MemoryStore::new()),
    );
    for channel_id in COUNTED_FROM + 1..=COUNTED_FROM + COUNTED {
        cache.channels().switch(channel_id, 100, 1).unwrap();
    }
    let feeds: Vec<Arc<Feed>> = (0..USERS / PER_STREAM)
        .map(|_| Feed::new(1 << 16))
        .collect();
    rt.block_on(async {
        for user_id in 1..=USERS {
            cache
                .update(user_id, |user, now| {
                    for channel_id in 1..=PER_MEMBER {
                        user.manual_ack(Key::channel(channel_id), 50, 0, 0, now);
                    }
                    // 5 distinct counted channels, spread evenly.
                    for k in 0..MEMBER_OF {
                        let channel_id = COUNTED_FROM + 1 + (user_id + k * 10) % COUNTED;
                        user.manual_ack(Key::channel(channel_id), 100, 0, 0, now);
                    }
                })
                .await
                .unwrap();
            let feed = &feeds[((user_id - 1) / PER_STREAM) as usize];
            cache.subscribe(user_id, feed, 0).await.unwrap();
        }
    });
    drain(&feeds);
    (cache, feeds)
}

/// Takes every event queued; how many.
fn drain(feeds: &[Arc<Feed>]) -> usize {
    let mut events = 0;
    for feed in feeds {
        while let Some(Ok(_)) = feed.next().now_or_never() {
            events += 1;
        }
    }
    events
}

fn recount(c: &mut Criterion) {
    let rt = bench_runtime();
    let (cache, feeds) = node(&rt);
    let mut group = c.benchmark_group("recount_tick");
    for marked in [1u64, 10, 50] {
        let changed: Vec<u64> = (COUNTED_FROM + 1..).take(marked as usize).collect();
        rt.block_on(cache.recount(&changed));
        let told = drain(&feeds);
        println!("recount of {marked} channels: {told} events");
        group.bench_function(format!("{marked}_of_{COUNTED}_channels"), |b| {
            b.iter_custom(|iters| {
                let mut took = Duration::ZERO;
                for _ in 0..iters {
                    let started = Instant::now();
                    rt.block_on(cache.recount(&changed));
                    took += started.elapsed();
                    drain(&feeds);
                }
                took
            })
        });
    }
    group.finish();
}

criterion_group!(benches, recount);
criterion_main!(benches);
