//! What one message costs in a channel of N members, counted per member and
//! counted by channel, through the service's own handlers (no transport).
//!
//! For each member count, a node (memory store, write-behind far off) holds
//! N members of a channel counted per member and N of one counted by
//! channel. Each message then mentions 3 members (and, by channel, none):
//! per member, the backend
//! lists every member (in calls of at most 10,000, as the API allows); by
//! channel, it lists only the mentions. Printed per message: the thread's
//! CPU time, and the read states and channel states it changed (each one a
//! store write per write-behind window).
//!
//! cargo run --release --example huge_channel -- [MEMBERS...]

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use readstates::cache::{Cache, CacheConfig};
use readstates::config::{Config, Settings};
use readstates::grpc::{ReadStatesService, ServiceConfig};
use readstates::proto::read_states_server::ReadStates;
use readstates::proto::{MessageCreatedRequest, SetChannelCountingRequest};
use readstates::read_state::Key;
use readstates::store::memory::MemoryStore;
use tonic::Request;

const PER_MEMBER: u64 = 1;
const BY_CHANNEL: u64 = 2;
/// The most users one MessageCreated lists.
const USERS_PER_CALL: usize = 10_000;

/// CPU time this thread has run, in nanoseconds.
fn cpu_ns() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

struct Node {
    service: ReadStatesService,
}

impl Node {
    /// A node whose `members` users are members of both channels, joined at
    /// message 100; `BY_CHANNEL` is counted by channel from there.
    async fn with_members(members: u64) -> Node {
        let cache = Cache::new(
            CacheConfig {
                capacity: members as usize * 4,
                shards: 64,
                write_delay: Duration::from_secs(3600),
                max_evicted_unwritten: usize::MAX,
                ..CacheConfig::default()
            },
            Arc::new(MemoryStore::new()),
        );
        let service = ReadStatesService::new(
            cache.clone(),
            ServiceConfig::from(&Config::resolve(Settings::default())),
            tokio_util::sync::CancellationToken::new(),
        );
        let switch = SetChannelCountingRequest {
            channel_id: BY_CHANNEL,
            counted_from: 100,
        };
        service
            .set_channel_counting(Request::new(switch))
            .await
            .unwrap();
        let users: Vec<u64> = (1..=members).collect();
        for chunk in users.chunks(USERS_PER_CALL) {
            cache
                .update_many(chunk, |_, user, now| {
                    for channel in [PER_MEMBER, BY_CHANNEL] {
                        user.manual_ack(Key::channel(channel), 100, 0, 0, now);
                    }
                })
                .await
                .unwrap();
        }
        Node { service }
    }

    /// Sends `messages` messages to `channel`, each mentioning `mentions`
    /// members; CPU nanoseconds and states changed (read states and channel
    /// states) per message.
    async fn messages(
        &self,
        channel: u64,
        members: u64,
        ids: Range<u64>,
        mentions: u64,
    ) -> (u64, u64) {
        let messages = ids.end - ids.start;
        let mut changed = 0;
        let started = cpu_ns();
        for message_id in ids {
            let i = message_id;
            let mentioned: Vec<u64> = (0..mentions).map(|m| 1 + (i * 7 + m) % members).collect();
            let listed: Vec<u64> = match channel {
                PER_MEMBER => (1..=members).filter(|u| !mentioned.contains(u)).collect(),
                _ => Vec::new(),
            };
            let mut parts = listed.chunks(USERS_PER_CALL - mentioned.len()).peekable();
            let mut first = true;
            while first || parts.peek().is_some() {
                let unread = parts.next().unwrap_or_default().to_vec();
                let request = MessageCreatedRequest {
                    channel_id: channel,
                    message_id,
                    mentioned_user_ids: if first { mentioned.clone() } else { vec![] },
                    unread_user_ids: unread,
                    ..MessageCreatedRequest::default()
                };
                first = false;
                let answer = self.service.message_created(Request::new(request)).await;
                changed += u64::from(answer.unwrap().into_inner().updated);
            }
        }
        ((cpu_ns() - started) / messages, changed / messages)
    }
}

fn main() {
    let members: Vec<u64> = match std::env::args().skip(1).collect::<Vec<_>>() {
        args if args.is_empty() => vec![1_000, 100_000, 1_000_000],
        args => args
            .iter()
            .map(|a| a.parse().expect("a member count"))
            .collect(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    println!("| members | counted | messages | CPU per message | states changed per message |");
    println!("| ---: | --- | ---: | ---: | ---: |");
    for &n in &members {
        runtime.block_on(async {
            let node = Node::with_members(n).await;
            // Enough messages for a steady figure, fewer when each is big.
            let per_member = (2_000_000 / n).clamp(3, 2_000);
            // Each run's messages are newer than the last run's.
            for (name, channel, ids, mentions) in [
                ("per member", PER_MEMBER, 1_000..1_000 + per_member, 3),
                ("by channel", BY_CHANNEL, 1_000..21_000, 3),
                // The channel alone: what the mentioned users' cache
                // misses add grows with the cache, not the channel.
                ("by channel, no mention", BY_CHANNEL, 21_000..41_000, 0),
            ] {
                let messages = ids.end - ids.start;
                let (ns, changed) = node.messages(channel, n, ids, mentions).await;
                println!(
                    "| {n} | {name} | {messages} | {:.2} µs | {changed} |",
                    ns as f64 / 1_000.0
                );
            }
        });
    }
}
