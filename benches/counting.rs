//! GetReadStates of a user in 200 channels, all counted per member, side by
//! side with 50 of them counted by channel (each with its 1,024 recent
//! messages full), through the service's handler (no transport): what
//! counting a member's unread when it is read costs.
//!
//! cargo bench --bench counting

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use readstates::channel_state::RECENT_MESSAGES;
use readstates::config::{Config, Settings};
use readstates::grpc::{ReadStatesService, ServiceConfig};
use readstates::proto::GetReadStatesRequest;
use readstates::proto::read_states_server::ReadStates;
use readstates::read_state::{Key, NoChannels};

use readstates::store::memory::MemoryStore;
use readstates::test_support::{bench_cache, bench_runtime};
use tonic::Request;

const USERS: u64 = 2_000;
const CHANNELS: u64 = 200;
/// Of them, channels `CHANNELS - BY_CHANNEL + 1 ..= CHANNELS` are counted by
/// channel in the second node.
const BY_CHANNEL: u64 = 50;

/// A node whose users are each in every channel, with a few unread and a
/// mention here and there; `by_channel` of the channels counted by channel.
fn node(rt: &tokio::runtime::Runtime, by_channel: u64) -> ReadStatesService {
    let cache = bench_cache(
        (USERS * CHANNELS) as usize * 2,
        Arc::new(MemoryStore::new()),
    );
    let counted = CHANNELS - by_channel + 1..=CHANNELS;
    let newest = 1_000 + RECENT_MESSAGES as u64;
    for channel_id in counted.clone() {
        cache.channels().switch(channel_id, 1_000, 1).unwrap();
        for message_id in 1_001..=newest {
            cache
                .channels()
                .update(channel_id, |c| c.message_created(message_id, 1));
        }
    }
    rt.block_on(async {
        for user_id in 1..=USERS {
            cache
                .update(user_id, |user, now| {
                    for channel_id in 1..=CHANNELS {
                        let key = Key::channel(channel_id);
                        // Read to somewhere in the channel's recent messages.
                        let acked = newest - (user_id * 31 + channel_id) % 40;
                        let mentions = u16::from(channel_id % 10 == 0);
                        user.manual_ack(key, acked, mentions, 0, now);
                        if !counted.contains(&channel_id) {
                            for id in acked + 1..=newest {
                                user.message_created(key, id, false, now, &NoChannels);
                            }
                        }
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
        ("200_per_member", node(&rt, 0)),
        ("150_per_member_50_by_channel", node(&rt, BY_CHANNEL)),
    ];
    // Both count the same.
    let counts = |service: &ReadStatesService| {
        let request = GetReadStatesRequest {
            user_id: 7,
            ..GetReadStatesRequest::default()
        };
        let answer = rt.block_on(service.get_read_states(Request::new(request)));
        let answer = answer.unwrap().into_inner();
        let unread: Vec<u32> = answer.read_states.iter().map(|s| s.unread_count).collect();
        (
            unread,
            answer.total_mention_count,
            answer.unread_channel_count,
        )
    };
    assert_eq!(counts(&nodes[0].1), counts(&nodes[1].1));
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
                    black_box(answer.unwrap().into_inner().unread_channel_count)
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, get_read_states);
criterion_main!(benches);
