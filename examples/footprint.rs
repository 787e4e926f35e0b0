//! Resident memory per cached read state.
//!
//! Fills a cache with `USERS x CHANNELS` read states the way a running node
//! fills it, by loading users on misses (from a store that makes them up), and
//! divides the growth of the resident set by the number of read states. With
//! `naive` it measures the obvious alternative instead: one
//! `lru::LruCache<(user, channel), state>` entry per read state.
//!
//! With `grown` the users are loaded empty and get their read states from
//! one change each (as a BulkAck of every channel makes them over gRPC).
//!
//! With `deletions` it measures instead the MessageDeleted dedup memory
//! holding COUNT lowered users (its memory bound is a count of them): 10
//! users for each deleted message.
//!
//! With `channel-states` it measures COUNT channels counted by channel, each
//! with its recent messages full.
//!
//! With `threads` every read state is a thread read state (a followed
//! thread, with its parent channel's id beside it): compare with the same
//! counts without it.
//!
//! cargo run --release --example footprint -- [USERS] [CHANNELS] [naive|grown|threads]
//! cargo run --release --example footprint -- [COUNT] deletions
//! cargo run --release --example footprint -- [COUNT] channel-states

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use readstates::cache::{Cache, CacheConfig};
use readstates::channel_state::{ChannelState, RECENT_MESSAGES};
use readstates::read_state::{Key, Kind, ReadState};
use readstates::recent_deletions::{Deletion, RecentDeletions};
use readstates::store::{Store, StoreError, StoredUser, UserWrite};

/// Makes up `channels` read states for every user it loads and keeps
/// nothing, so only the cache is measured.
#[derive(Debug)]
struct MadeUpStore {
    channels: u64,
    /// Thread read states rather than channels'.
    threads: bool,
}

#[async_trait]
impl Store for MadeUpStore {
    fn name(&self) -> &'static str {
        "made-up"
    }
    async fn load(&self, _: u64) -> Result<StoredUser, StoreError> {
        let read_states = (1..=self.channels)
            .map(|channel_id| ReadState {
                last_acked_id: channel_id << 22,
                last_message_id: (channel_id << 22) + 1,
                version: 1,
                kind: if self.threads {
                    Kind::Thread
                } else {
                    Kind::Channel
                },
                ..ReadState::new(Key::channel(channel_id << 22))
            })
            .collect();
        // Threads of 50 parents.
        let parents = (1..=self.channels)
            .filter(|_| self.threads)
            .map(|thread| (thread << 22, ((thread % 50) + 1) << 22 | 1))
            .collect();
        Ok(StoredUser {
            version: 1,
            delta_floor: 0,
            read_states,
            parents,
            lowered: Vec::new(),
        })
    }
    async fn write(&self, _: &UserWrite) -> Result<(), StoreError> {
        Ok(())
    }
    async fn load_channels(&self) -> Result<Vec<ChannelState>, StoreError> {
        Ok(Vec::new())
    }
    async fn write_channel(&self, _: &ChannelState) -> Result<(), StoreError> {
        Ok(())
    }
}

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("statm");
    pages * 4096
}

fn naive(users: u64, channels: u64) -> usize {
    let mut lru = lru::LruCache::<(u64, u64), ReadState>::unbounded();
    for user_id in 1..=users {
        for channel_id in 1..=channels {
            let state = ReadState {
                last_acked_id: channel_id,
                version: 1,
                ..ReadState::new(Key::channel(channel_id))
            };
            lru.put((user_id, channel_id), state);
        }
    }
    let len = lru.len();
    std::mem::forget(lru); // measured, not freed
    len
}

async fn ours(users: u64, channels: u64, grown: bool, threads: bool) -> usize {
    let cache = Cache::new(
        CacheConfig {
            // Headroom, so that uneven shards evict nobody.
            capacity: (users * channels) as usize * 11 / 10,
            shards: 64,
            write_delay: Duration::from_secs(30),
            max_evicted_unwritten: usize::MAX,
            write_concurrency: 32,
            ..CacheConfig::default()
        },
        Arc::new(MadeUpStore {
            channels: if grown { 0 } else { channels },
            threads,
        }),
    );
    for user_id in 1..=users {
        // Snowflake-like ids, as in production.
        let user_id = (user_id << 22) | 7;
        if grown {
            cache
                .update(user_id, |user, now| {
                    for channel_id in 1..=channels {
                        user.ack(Key::channel(channel_id << 22), channel_id << 22, now);
                    }
                })
                .await
                .expect("change");
        } else {
            cache.read(user_id, |user| user.len()).await.expect("load");
        }
    }
    let held = cache.stats_read_states();
    std::mem::forget(cache); // measured, not freed
    held
}

/// Fills the dedup memory with `count` lowered users, 10 per deletion.
fn deletions(count: u64) -> usize {
    let mut recent = RecentDeletions::new(Duration::from_secs(3600), count as usize);
    for lowered in 0..count {
        let message_id = lowered / 10;
        let deletion = Deletion {
            channel_id: (message_id % 1_000) << 22,
            message_id: (message_id << 22) | 3,
            kind: Kind::Channel,
        };
        recent.remember(lowered.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 1, deletion);
    }
    let held = recent.len();
    std::mem::forget(recent); // measured, not freed
    held
}

/// `count` channels counted by channel, each with its recent messages full,
/// held as a node holds them.
fn channel_states(count: u64) -> usize {
    let mut channels = HashMap::new();
    for channel_id in 1..=count {
        let channel_id = channel_id << 22;
        let mut channel = ChannelState::switched(channel_id, channel_id, 1);
        for message in 1..=RECENT_MESSAGES as u64 + 1 {
            channel.message_created(channel_id + (message << 8), 1);
        }
        channels.insert(channel_id, channel);
    }
    let held = channels.len();
    std::mem::forget(channels); // measured, not freed
    held
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let users: u64 = args.first().and_then(|a| a.parse().ok()).unwrap_or(500_000);
    if args.iter().any(|a| a == "deletions") {
        let before = resident_bytes();
        let held = deletions(users);
        let grown = resident_bytes().saturating_sub(before);
        println!(
            "deletion dedup memory: {held} lowered users, resident +{:.1} MiB, {:.1} bytes each",
            grown as f64 / (1 << 20) as f64,
            grown as f64 / held as f64
        );
        return;
    }
    if args.iter().any(|a| a == "channel-states") {
        let before = resident_bytes();
        let held = channel_states(users);
        let grown = resident_bytes().saturating_sub(before);
        println!(
            "channels counted by channel: {held} with {RECENT_MESSAGES} recent messages each, \
             resident +{:.1} MiB, {:.0} bytes each (a member's read state is unchanged)",
            grown as f64 / (1 << 20) as f64,
            grown as f64 / held as f64
        );
        return;
    }
    let channels: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20);
    let is_naive = args.iter().any(|a| a == "naive");
    let grown = args.iter().any(|a| a == "grown");
    let threads = args.iter().any(|a| a == "threads");

    let before = resident_bytes();
    let held = if is_naive {
        naive(users, channels)
    } else {
        ours(users, channels, grown, threads).await
    };
    let grown = resident_bytes().saturating_sub(before);
    println!(
        "{}: {users} users x {channels} channels = {held} read states, resident +{:.1} MiB, {:.1} bytes per read state",
        match (is_naive, threads) {
            (true, _) => "naive lru<(user, channel), state>",
            (false, true) => "readstates cache, thread read states",
            (false, false) => "readstates cache",
        },
        grown as f64 / (1 << 20) as f64,
        grown as f64 / held as f64
    );
}
