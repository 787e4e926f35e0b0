//! Cache operations on cached users, side by side with the obvious
//! alternative (one `Mutex<LruCache<(user, channel), state>>`), on random
//! users of many (each a CPU cache miss), plus the miss path: load, insert
//! and evict.
//!
//! cargo bench --bench cache

use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use readstates::cache::Cache;

use readstates::read_state::{Key, NoChannels, ReadState};
use readstates::store::memory::MemoryStore;
use readstates::store::{Store, UserWrite};
use readstates::test_support::{bench_cache, bench_runtime};

const USERS: u64 = 10_000;
const CHANNELS: u64 = 20;

fn cache(capacity: usize) -> Arc<Cache> {
    bench_cache(capacity, Arc::new(MemoryStore::new()))
}

/// A cache holding USERS users of CHANNELS read states each.
fn filled(rt: &tokio::runtime::Runtime) -> Arc<Cache> {
    let cache = cache((USERS * CHANNELS) as usize * 2);
    rt.block_on(async {
        for user_id in 1..=USERS {
            cache
                .update(user_id, |user, now| {
                    for channel_id in 1..=CHANNELS {
                        user.message_created(
                            Key::channel(channel_id),
                            10,
                            channel_id % 2 == 0,
                            now,
                            &NoChannels,
                        );
                    }
                })
                .await
                .unwrap();
        }
    });
    cache
}

fn cached_operations(c: &mut Criterion) {
    let rt = bench_runtime();
    let cache = filled(&rt);
    let mut group = c.benchmark_group("cached");
    let mut next = 0u64;
    let mut user = move || {
        next = next % USERS + 1;
        next
    };

    group.bench_function("get_read_states_all", |b| {
        b.to_async(&rt).iter(|| {
            let (cache, user_id) = (cache.clone(), user());
            async move {
                let n = cache
                    .read(user_id, |u| {
                        (
                            u.delta(0, &NoChannels).read_states.len(),
                            u.counts(&NoChannels),
                        )
                    })
                    .await
                    .unwrap();
                black_box(n)
            }
        })
    });
    let mut message_id = 100u64;
    group.bench_function("ack", |b| {
        b.to_async(&rt).iter(|| {
            message_id += 1;
            let (cache, user_id, id) = (cache.clone(), user(), message_id);
            async move {
                let acked = cache
                    .update(user_id, |u, now| {
                        u.ack(Key::channel(id % CHANNELS + 1), id, now)
                    })
                    .await
                    .unwrap();
                black_box(acked)
            }
        })
    });
    let users: Vec<u64> = (1..=100).collect();
    group.bench_function("message_created_100_users", |b| {
        b.to_async(&rt).iter(|| {
            message_id += 1;
            let (cache, users, id) = (cache.clone(), &users, message_id);
            async move {
                let changed = cache
                    .update_many(users, |i, u, now| {
                        u.message_created(Key::channel(1), id, i % 10 == 0, now, &NoChannels)
                    })
                    .await
                    .unwrap();
                black_box(changed)
            }
        })
    });
    group.finish();

    // The same ack on one global per-read-state LRU, for scale.
    let naive = Mutex::new(lru::LruCache::<(u64, u64), ReadState>::unbounded());
    for user_id in 1..=USERS {
        for channel_id in 1..=CHANNELS {
            let state = ReadState {
                mention_count: 1,
                unread_count: 1,
                ..ReadState::new(Key::channel(channel_id))
            };
            naive.lock().unwrap().put((user_id, channel_id), state);
        }
    }
    // Same harness, so that the ratio is the cache's own cost.
    let naive = &naive;
    c.bench_function("naive_lru/ack", |b| {
        b.to_async(&rt).iter(|| {
            message_id += 1;
            let (key, id) = ((user(), message_id % CHANNELS + 1), message_id);
            async move {
                let mut lru = naive.lock().unwrap();
                if let Some(state) = lru.get_mut(&key)
                    && id > state.last_acked_id
                {
                    state.last_acked_id = id;
                    state.mention_count = 0;
                    state.unread_count = 0;
                }
                black_box(lru.len())
            }
        })
    });
}

/// Random users of 100,000 (2 M read states, far more than the CPU's
/// caches), as the loadtest's workloads draw them: what a request costs
/// when each user it touches is a cache miss.
fn cold_operations(c: &mut Criterion) {
    const COLD_USERS: u64 = 100_000;
    let rt = bench_runtime();
    let cache = cache((COLD_USERS * CHANNELS) as usize * 2);
    rt.block_on(async {
        for user_id in 1..=COLD_USERS {
            cache
                .update(user_id, |user, now| {
                    for channel_id in 1..=CHANNELS {
                        user.ack(Key::channel(channel_id), 10, now);
                    }
                })
                .await
                .unwrap();
        }
    });
    let mut group = c.benchmark_group("cold");
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = move || {
        // xorshift: no dependency, and the same draws every run.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut message_id = 100u64;
    group.bench_function("ack", |b| {
        b.to_async(&rt).iter(|| {
            message_id += 1;
            let (cache, user_id, id) = (cache.clone(), random() % COLD_USERS + 1, message_id);
            async move {
                let acked = cache
                    .update(user_id, |u, now| {
                        u.ack(Key::channel(id % CHANNELS + 1), id, now)
                    })
                    .await
                    .unwrap();
                black_box(acked)
            }
        })
    });
    group.bench_function("message_created_12_users", |b| {
        b.to_async(&rt).iter(|| {
            message_id += 1;
            let users: Vec<u64> = (0..12).map(|_| random() % COLD_USERS + 1).collect();
            let (cache, id) = (cache.clone(), message_id);
            async move {
                let changed = cache
                    .update_many(&users, |i, u, now| {
                        u.message_created(
                            Key::channel(id % CHANNELS + 1),
                            id,
                            i == 0,
                            now,
                            &NoChannels,
                        )
                    })
                    .await
                    .unwrap();
                black_box(changed)
            }
        })
    });
    group.finish();
}

fn miss_path(c: &mut Criterion) {
    let rt = bench_runtime();
    // The store holds 10,000 users of CHANNELS read states; the cache has
    // room for 1,000, so nearly every read misses, loads and evicts.
    let store = Arc::new(MemoryStore::new());
    rt.block_on(async {
        for user_id in 1..=USERS {
            let mut user = readstates::read_state::UserReadStates::default();
            for channel_id in 1..=CHANNELS {
                user.ack(Key::channel(channel_id), 10, 1);
            }
            store.write(&UserWrite::of(user_id, &user)).await.unwrap();
        }
    });
    let cache = bench_cache(1_000 * CHANNELS as usize, store);
    let mut next = 0u64;
    c.bench_function("miss/load_insert_evict", |b| {
        b.to_async(&rt).iter(|| {
            next = next % USERS + 1;
            let (cache, user_id) = (cache.clone(), next);
            async move { black_box(cache.read(user_id, |u| u.len()).await.unwrap()) }
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = cached_operations, cold_operations, miss_path
}
criterion_main!(benches);
