//! A handoff's own work beside the transport and the journal (issue 38):
//! - its codec: one chunk of 256 users of 10 read states packed as
//!   `HandOver` format 2 bytes and read back;
//! - finding the users leaving: a quarter of the slots of a cache of
//!   1 M users, as each round of the copy ahead does (the metrics'
//!   oldest-unwritten gauge reads every user the same way).
//!
//! cargo bench --bench handoff

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use readstates::cache::handoff::HandedUser;
use readstates::cluster::handoff::packed;
use readstates::read_state::{Header, Key, NoChannels, Owned, ReadState, UserReadStates};
use readstates::store::memory::MemoryStore;
use readstates::test_support::{bench_cache, bench_runtime};
use tokio::time::Duration;

const USERS: u64 = 256;
const PER_USER: u64 = 10;

fn chunk() -> Vec<HandedUser> {
    (1..=USERS)
        .map(|user| {
            let rows = (1..=PER_USER)
                .map(|channel| {
                    let state = ReadState {
                        last_acked_id: channel << 22,
                        last_message_id: (channel << 22) + 5,
                        version: user * 100 + channel,
                        mention_count: 1,
                        unread_count: 3,
                        ..ReadState::new(Key::channel(channel << 22))
                    };
                    (state, 0)
                })
                .collect();
            let header = Header {
                version: user * 100 + PER_USER,
                written_version: user * 100,
                delta_floor: 0,
                clear_pending: false,
            };
            HandedUser {
                user_id: user << 22,
                states: UserReadStates::from_parts(header, Owned::from_rows(rows)),
                unwritten_for: Some(Duration::from_secs(3)),
            }
        })
        .collect()
}

/// `users` packed, as a `HandOver` chunk carries them.
fn pack_all(users: &[HandedUser]) -> Vec<u8> {
    let mut out = Vec::with_capacity(users.iter().map(packed::len).sum());
    for user in users {
        packed::pack(&mut out, user);
    }
    out
}

fn codec(c: &mut Criterion) {
    let users = chunk();
    let mut group = c.benchmark_group("handoff");
    group.bench_function("pack_256_users", |b| b.iter(|| pack_all(&users)));
    let bytes = pack_all(&users);
    group.bench_function("unpack_256_users", |b| {
        b.iter(|| packed::unpack(&bytes).expect("packed above"))
    });
    group.finish();
}

/// Users in the cache `users_leaving` looks through, of one read state
/// each: their records (48 MB) are what is read.
const CACHED: u64 = 1_000_000;

fn users_leaving(c: &mut Criterion) {
    let rt = bench_runtime();
    let cache = bench_cache(CACHED as usize * 2, Arc::new(MemoryStore::new()));
    rt.block_on(async {
        for user_id in 1..=CACHED {
            let user_id = user_id << 22;
            (cache.update(user_id, |user, now| {
                user.message_created(Key::channel(7 << 22), 8 << 22, false, now, &NoChannels);
            }))
            .await
            .unwrap();
        }
    });
    let slots = readstates_routing::SLOTS;
    let leaving = |user_id: u64| usize::from(readstates_routing::slot_of(user_id)) < slots / 4;
    c.bench_function("handoff/users_leaving_of_1m", |b| {
        b.iter(|| cache.users_leaving(&leaving))
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = codec, users_leaving
}
criterion_main!(benches);
