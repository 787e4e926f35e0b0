//! GetReadStates of a user with 200 channels and 300 followed threads, side
//! by side with a user in 500 channels, through the service's handler (no
//! transport): what thread read states (their parents, and the totals
//! counted by parent) cost a read.
//!
//! cargo bench --bench threads

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use readstates::config::{Config, Settings};
use readstates::grpc::{ReadStatesService, ServiceConfig};
use readstates::proto::GetReadStatesRequest;
use readstates::proto::read_states_server::ReadStates;
use readstates::read_state::{Key, NoChannels};

use readstates::read_state::threads::Replied;
use readstates::store::memory::MemoryStore;
use readstates::test_support::{bench_cache, bench_runtime};
use tonic::Request;

const USERS: u64 = 1_000;
const READ_STATES: u64 = 500;
/// Of them, in the second node, threads (of the user's channels).
const THREADS: u64 = 300;

/// A node whose users each have `READ_STATES` read states, `threads` of
/// them followed threads, with a few unread and a mention here and there.
fn node(rt: &tokio::runtime::Runtime, threads: u64) -> ReadStatesService {
    let cache = bench_cache(
        (USERS * READ_STATES) as usize * 2,
        Arc::new(MemoryStore::new()),
    );
    let channels = READ_STATES - threads;
    rt.block_on(async {
        for user_id in 1..=USERS {
            cache
                .update(user_id, |user, now| {
                    for channel_id in 1..=channels {
                        let key = Key::channel(channel_id);
                        user.ack(key, 100, now);
                        let mentioned = channel_id % 10 == 0;
                        user.message_created(key, 101 + user_id % 3, mentioned, now, &NoChannels);
                    }
                    for thread in 1..=threads {
                        let (thread_id, parent) = (100_000 + thread, 1 + thread % channels);
                        user.follow(thread_id, parent, 100, now).unwrap();
                        let replied = match thread % 10 {
                            0 => Replied::Mentioned,
                            _ => Replied::Follower,
                        };
                        user.reply(thread_id, parent, 101 + user_id % 3, replied, now)
                            .unwrap();
                    }
                })
                .await
                .unwrap();
        }
    });
    ReadStatesService::new(
        cache,
        ServiceConfig::from(&Config::resolve(Settings::default())),
        tokio_util::sync::CancellationToken::new(),
    )
}

fn get_read_states(c: &mut Criterion) {
    let rt = bench_runtime();
    let nodes = [
        ("500_channels", node(&rt, 0)),
        ("200_channels_300_threads", node(&rt, THREADS)),
    ];
    // The same read states, and the same mentions.
    let answer = |service: &ReadStatesService| {
        let request = GetReadStatesRequest {
            user_id: 7,
            ..GetReadStatesRequest::default()
        };
        let answer = rt.block_on(service.get_read_states(Request::new(request)));
        answer.unwrap().into_inner()
    };
    let (channels, threads) = (answer(&nodes[0].1), answer(&nodes[1].1));
    assert_eq!(channels.read_states.len(), threads.read_states.len());
    assert_eq!(channels.total_mention_count, threads.total_mention_count);
    assert_eq!(threads.unread_thread_count, THREADS as u32);
    let mut group = c.benchmark_group("get_read_states");
    for (name, service) in &nodes {
        let mut next = 0u64;
        group.bench_function(*name, |b| {
            b.to_async(&rt).iter(|| {
                next = next % USERS + 1;
                let request = GetReadStatesRequest {
                    user_id: next,
                    ..GetReadStatesRequest::default()
                };
                async move {
                    let answer = service.get_read_states(Request::new(request)).await;
                    black_box(answer.unwrap().into_inner().unread_thread_count)
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, get_read_states);
criterion_main!(benches);
