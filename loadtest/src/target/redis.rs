//! Redis, as most teams would build this service instead: one hash per user
//! (`rs:{user_id}`, fields `{channel}:a` last acked id, `{channel}:m`
//! mentions, `{channel}:u` unreads, `v` version), and every operation a
//! server-side Lua script, so that the semantics match readstates: acks only
//! move forward, counts rise only past the last ack, the author is acked,
//! counts are computed by the server.
//!
//! Lua numbers are doubles, so ids must stay below 2^53 (the load generator's
//! do); real snowflakes would need string comparison in the scripts.

use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context;
use redis::Script;
use redis::aio::MultiplexedConnection;

use crate::op::Op;

#[derive(Debug)]
pub struct RedisTarget {
    connections: Vec<MultiplexedConnection>,
    next: AtomicUsize,
    scripts: Scripts,
}

#[derive(Debug)]
struct Scripts {
    get_read_states: Script,
    ack: Script,
    bulk_ack: Script,
    message_created: Script,
    badge_counts: Script,
}

fn key(user_id: u64) -> String {
    format!("rs:{user_id}")
}

impl RedisTarget {
    pub async fn connect(url: &str, connections: usize) -> anyhow::Result<RedisTarget> {
        let client = redis::Client::open(url).with_context(|| format!("redis URL {url}"))?;
        let mut opened = Vec::with_capacity(connections);
        for _ in 0..connections.max(1) {
            let connection = client
                .get_multiplexed_async_connection()
                .await
                .with_context(|| format!("connect to {url}"))?;
            opened.push(connection);
        }
        Ok(RedisTarget {
            connections: opened,
            next: AtomicUsize::new(0),
            scripts: Scripts {
                get_read_states: Script::new(include_str!("redis/get_read_states.lua")),
                ack: Script::new(include_str!("redis/ack.lua")),
                bulk_ack: Script::new(include_str!("redis/bulk_ack.lua")),
                message_created: Script::new(include_str!("redis/message_created.lua")),
                badge_counts: Script::new(include_str!("redis/badge_counts.lua")),
            },
        })
    }

    pub async fn execute(&self, op: &Op) -> Result<(), String> {
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        let mut connection = self.connections[index].clone();
        let now = readstates::clock::now_micros();
        let s = &self.scripts;
        let result: redis::RedisResult<redis::Value> = match op {
            Op::GetReadStates { user_id } => {
                s.get_read_states
                    .key(key(*user_id))
                    .invoke_async(&mut connection)
                    .await
            }
            Op::Ack {
                user_id,
                channel_id,
                message_id,
            } => {
                let mut call = s.ack.key(key(*user_id));
                call.arg(now).arg(channel_id).arg(message_id);
                call.invoke_async(&mut connection).await
            }
            Op::BulkAck { user_id, entries } => {
                let mut call = s.bulk_ack.key(key(*user_id));
                call.arg(now);
                for (channel_id, message_id) in entries {
                    call.arg(channel_id).arg(message_id);
                }
                call.invoke_async(&mut connection).await
            }
            Op::MessageCreated {
                channel_id,
                message_id,
                author_id,
                mentioned,
                unread,
            } => {
                let mut call = s.message_created.prepare_invoke();
                for user_id in mentioned.iter().chain(unread) {
                    call.key(key(*user_id));
                }
                call.key(key(*author_id));
                call.arg(now)
                    .arg(channel_id)
                    .arg(message_id)
                    .arg(mentioned.len());
                call.invoke_async(&mut connection).await
            }
            Op::GetBadgeCounts { user_ids } => {
                let mut call = s.badge_counts.prepare_invoke();
                for user_id in user_ids {
                    call.key(key(*user_id));
                }
                call.invoke_async(&mut connection).await
            }
        };
        result
            .map(drop)
            .map_err(|e| format!("redis {:?}", e.kind()))
    }
}
