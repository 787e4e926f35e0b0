//! The operations a workload sends, and the generator that draws them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rand::Rng;
use rand::seq::index::sample;

use crate::keys::KeySampler;
use crate::workload::Workload;

/// One request, target-independent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// A gateway connect: every read state of the user.
    GetReadStates {
        user_id: u64,
    },
    Ack {
        user_id: u64,
        channel_id: u64,
        message_id: u64,
    },
    BulkAck {
        user_id: u64,
        entries: Vec<(u64, u64)>,
    },
    MessageCreated {
        channel_id: u64,
        message_id: u64,
        author_id: u64,
        mentioned: Vec<u64>,
        unread: Vec<u64>,
    },
    GetBadgeCounts {
        user_ids: Vec<u64>,
    },
}

impl Op {
    /// The user whose owner a routing client sends it to: its user, or
    /// the first of its users (the author of a message, if any).
    pub fn routing_user(&self) -> u64 {
        match self {
            Op::GetReadStates { user_id }
            | Op::Ack { user_id, .. }
            | Op::BulkAck { user_id, .. } => *user_id,
            Op::MessageCreated {
                author_id,
                mentioned,
                unread,
                ..
            } => [*author_id]
                .into_iter()
                .chain(mentioned.iter().copied())
                .chain(unread.iter().copied())
                .find(|&id| id != 0)
                .unwrap_or(0),
            Op::GetBadgeCounts { user_ids } => user_ids.first().copied().unwrap_or(0),
        }
    }
}

/// What kind of RPC an operation is; the order is the report's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    GetReadStates,
    Ack,
    BulkAck,
    MessageCreated,
    GetBadgeCounts,
}

impl OpKind {
    pub const ALL: [OpKind; 5] = [
        OpKind::GetReadStates,
        OpKind::Ack,
        OpKind::BulkAck,
        OpKind::MessageCreated,
        OpKind::GetBadgeCounts,
    ];

    /// The RPC's name.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::GetReadStates => "GetReadStates",
            OpKind::Ack => "Ack",
            OpKind::BulkAck => "BulkAck",
            OpKind::MessageCreated => "MessageCreated",
            OpKind::GetBadgeCounts => "GetBadgeCounts",
        }
    }

    /// Its place in [`OpKind::ALL`], for per-kind tables.
    pub fn index(self) -> usize {
        self as usize
    }
}

impl Op {
    pub fn kind(&self) -> OpKind {
        match self {
            Op::GetReadStates { .. } => OpKind::GetReadStates,
            Op::Ack { .. } => OpKind::Ack,
            Op::BulkAck { .. } => OpKind::BulkAck,
            Op::MessageCreated { .. } => OpKind::MessageCreated,
            Op::GetBadgeCounts { .. } => OpKind::GetBadgeCounts,
        }
    }

    /// Read states this operation may change (for writes per change).
    pub fn changes(&self) -> u64 {
        match self {
            Op::GetReadStates { .. } | Op::GetBadgeCounts { .. } => 0,
            Op::Ack { .. } => 1,
            Op::BulkAck { entries, .. } => entries.len() as u64,
            Op::MessageCreated {
                mentioned, unread, ..
            } => (mentioned.len() + unread.len() + 1) as u64,
        }
    }
}

/// Message ids, rising across the whole run (as snowflakes do). Kept below
/// 2^53 so that Redis's Lua numbers hold them exactly.
#[derive(Debug, Clone)]
pub struct MessageIds(Arc<AtomicU64>);

impl MessageIds {
    pub fn new() -> MessageIds {
        // Rising across runs too, so that acks of a persistent store apply.
        let start = readstates::clock::now_micros() / 1_000 * 1_000;
        MessageIds(Arc::new(AtomicU64::new(start)))
    }

    pub fn next(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn current(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Default for MessageIds {
    fn default() -> Self {
        MessageIds::new()
    }
}

/// Draws operations as the workload says.
#[derive(Clone, Debug)]
pub struct Generator {
    workload: Arc<Workload>,
    keys: KeySampler,
    /// Cumulative mix weights, in [`OpKind::ALL`] order.
    cumulative: [u32; 5],
    message_ids: MessageIds,
}

impl Generator {
    pub fn new(workload: Arc<Workload>, message_ids: MessageIds) -> Generator {
        let m = &workload.mix;
        let weights = [
            m.get_read_states,
            m.ack,
            m.bulk_ack,
            m.message_created,
            m.get_badge_counts,
        ];
        let mut cumulative = [0; 5];
        let mut sum = 0;
        for (c, w) in cumulative.iter_mut().zip(weights) {
            sum += w;
            *c = sum;
        }
        let keys = KeySampler::new(workload.keyspace.users, workload.keyspace.distribution);
        Generator {
            workload,
            keys,
            cumulative,
            message_ids,
        }
    }

    pub fn next(&self, rng: &mut impl Rng) -> Op {
        let pick = rng.random_range(0..self.cumulative[4]);
        let kind = self.cumulative.iter().position(|&c| pick < c).unwrap_or(0);
        let user_id = self.keys.user(rng);
        match OpKind::ALL[kind] {
            OpKind::GetReadStates => Op::GetReadStates { user_id },
            OpKind::Ack => Op::Ack {
                user_id,
                channel_id: self.random_channel(user_id, rng),
                message_id: self.message_ids.current(),
            },
            OpKind::BulkAck => {
                let n = self
                    .workload
                    .bulk_ack
                    .entries
                    .min(self.workload.keyspace.channels_per_user);
                let message_id = self.message_ids.current();
                let entries = sample(
                    rng,
                    self.workload.keyspace.channels_per_user as usize,
                    n as usize,
                )
                .into_iter()
                .map(|k| (self.channel(user_id, k as u64), message_id))
                .collect();
                Op::BulkAck { user_id, entries }
            }
            OpKind::MessageCreated => self.message(user_id, rng),
            OpKind::GetBadgeCounts => Op::GetBadgeCounts {
                user_ids: (0..self.workload.badge_counts.users)
                    .map(|_| self.keys.user(rng))
                    .collect(),
            },
        }
    }

    /// The `k`-th channel of `user_id`'s guild.
    pub fn channel(&self, user_id: u64, k: u64) -> u64 {
        let k_per = self.workload.keyspace.channels_per_user;
        self.guild(user_id) * k_per + k + 1
    }

    /// Every channel of the user (for preloading).
    pub fn channels(&self, user_id: u64) -> impl Iterator<Item = u64> + '_ {
        (0..self.workload.keyspace.channels_per_user).map(move |k| self.channel(user_id, k))
    }

    pub fn message_ids(&self) -> &MessageIds {
        &self.message_ids
    }

    fn guild(&self, user_id: u64) -> u64 {
        (user_id - 1) / self.workload.keyspace.guild_size
    }

    fn random_channel(&self, user_id: u64, rng: &mut impl Rng) -> u64 {
        self.channel(
            user_id,
            rng.random_range(0..self.workload.keyspace.channels_per_user),
        )
    }

    /// A message by `author_id` in one of its guild's channels, reaching
    /// other members of the guild.
    fn message(&self, author_id: u64, rng: &mut impl Rng) -> Op {
        let keyspace = &self.workload.keyspace;
        let shape = &self.workload.message_created;
        let first = self.guild(author_id) * keyspace.guild_size + 1;
        let last = (first + keyspace.guild_size - 1).min(keyspace.users);
        let members = (last - first + 1) as usize;
        let wanted = ((shape.mentions + shape.unread_recipients) as usize).min(members);
        let recipients: Vec<u64> = sample(rng, members, wanted)
            .into_iter()
            .map(|i| first + i as u64)
            .filter(|&u| u != author_id)
            .collect();
        let mentions = (shape.mentions as usize).min(recipients.len());
        Op::MessageCreated {
            channel_id: self.random_channel(author_id, rng),
            message_id: self.message_ids.next(),
            author_id,
            mentioned: recipients[..mentions].to_vec(),
            unread: recipients[mentions..].to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    use super::*;
    use crate::workload::*;

    pub(crate) fn workload() -> Workload {
        Workload {
            keyspace: Keyspace {
                users: 1_000,
                channels_per_user: 5,
                guild_size: 50,
                distribution: Distribution::Uniform,
            },
            mix: Mix {
                get_read_states: 1,
                ack: 1,
                bulk_ack: 1,
                message_created: 1,
                get_badge_counts: 1,
            },
            message_created: MessageCreatedShape {
                mentions: 2,
                unread_recipients: 5,
            },
            bulk_ack: BulkAckShape { entries: 3 },
            badge_counts: BadgeCountsShape { users: 4 },
            load: Load {
                connections: 1,
                concurrency: 1,
                max_in_flight: 10,
                rate: 0,
                duration: std::time::Duration::from_secs(1),
                warmup: std::time::Duration::ZERO,
                preload: false,
            },
        }
    }

    #[test]
    fn operations_follow_the_mix_and_the_guilds() {
        let generator = Generator::new(Arc::new(workload()), MessageIds::new());
        let mut rng = SmallRng::seed_from_u64(3);
        let mut kinds = [0; 5];
        for _ in 0..5_000 {
            let op = generator.next(&mut rng);
            kinds[op.kind().index()] += 1;
            match &op {
                Op::MessageCreated {
                    channel_id,
                    author_id,
                    mentioned,
                    unread,
                    ..
                } => {
                    assert_eq!(mentioned.len(), 2);
                    assert!(unread.len() >= 4);
                    let guild = (author_id - 1) / 50;
                    assert!(
                        mentioned
                            .iter()
                            .chain(unread)
                            .all(|u| (u - 1) / 50 == guild && u != author_id)
                    );
                    assert!(generator.channels(*author_id).any(|c| c == *channel_id));
                    assert_eq!(op.changes(), (mentioned.len() + unread.len() + 1) as u64);
                }
                Op::BulkAck { user_id, entries } => {
                    assert_eq!(entries.len(), 3);
                    assert!(
                        entries
                            .iter()
                            .all(|(c, _)| generator.channels(*user_id).any(|x| x == *c))
                    );
                }
                Op::GetBadgeCounts { user_ids } => assert_eq!(user_ids.len(), 4),
                _ => {}
            }
        }
        assert!(kinds.iter().all(|&k| k > 800 && k < 1_200), "{kinds:?}");
    }

    #[test]
    fn message_ids_rise() {
        let ids = MessageIds::new();
        let a = ids.next();
        assert!(ids.next() > a);
        assert!(ids.current() < 1 << 53);
    }
}
