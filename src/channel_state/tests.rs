//! The rules of counting by channel one by one, and property tests against
//! models: one of a user whose channels are counted both ways, one of the
//! recent messages' cap.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use super::*;
// A member's read state in the model: its unread count is what was counted
// per member (all of it in a channel counted per member, what came before
// the switch in one counted by channel).
use crate::read_state::tests::ModelState as Member;
use crate::read_state::{Channels, Counts, Key, Kind, NoChannels, UserReadStates};

const C: Key = Key::channel(7);

fn channels(state: ChannelState) -> HashMap<u64, ChannelState> {
    HashMap::from([(state.channel_id(), state)])
}

/// The unread count `user` sees in `key`'s channel.
fn unread(user: &UserReadStates, key: Key, channels: &impl Channels) -> Unread {
    let state = user.get(key).expect("a read state");
    match channels.of(state) {
        Some(channel) => channel.unread(state.last_acked_id, state.unread_count),
        None => Unread {
            count: state.unread_count,
            capped: false,
        },
    }
}

#[test]
fn a_message_is_unread_for_every_member_acked_before_it() {
    let mut channel = ChannelState::switched(7, 100, 1);
    let (mut early, mut late) = (UserReadStates::default(), UserReadStates::default());
    early.ack(C, 100, 1);
    for id in [101, 102, 103] {
        assert!(channel.message_created(id, 2));
    }
    late.ack(C, 102, 3);
    let channels = channels(channel);
    assert_eq!(unread(&early, C, &channels).count, 3);
    assert_eq!(unread(&late, C, &channels).count, 1, "an ack in the middle");
    assert_eq!(late.counts(&channels).unread_channel_count, 1);
}

#[test]
fn a_redelivered_or_late_message_changes_nothing() {
    let mut channel = ChannelState::switched(7, 100, 1);
    assert!(channel.message_created(105, 2));
    let before = channel.clone();
    assert!(!channel.message_created(105, 3), "a redelivery");
    assert!(!channel.message_created(103, 3), "a late older message");
    assert!(!channel.message_created(100, 3), "counted per member");
    assert_eq!(channel, before, "not even the version moves");
    assert_eq!(channel.last_message_id(), 105);
}

#[test]
fn a_deleted_message_is_uncounted_once_for_those_who_had_not_read_it() {
    let mut channel = ChannelState::switched(7, 0, 1);
    for id in 1..=4 {
        channel.message_created(id, 1);
    }
    assert!(channel.message_deleted(2, 2));
    assert!(!channel.message_deleted(2, 3), "a retry");
    assert!(
        !channel.message_deleted(9, 3),
        "a message the channel never had"
    );
    assert_eq!(channel.unread_after(0).count, 3);
    assert_eq!(channel.unread_after(1).count, 2);
    assert_eq!(
        channel.unread_after(2).count,
        2,
        "read before it was deleted"
    );
    assert_eq!(channel.recent().collect::<Vec<_>>(), vec![1, 3, 4]);
    assert!(
        !channel.message_created(4, 4),
        "the newest, deleted, is still taken"
    );
}

#[test]
fn past_the_recent_messages_the_count_is_capped_and_says_so() {
    let mut channel = ChannelState::with_capacity(7, 0, 1, 3);
    for id in 1..=5 {
        channel.message_created(id, 1);
    }
    assert_eq!(channel.recent().collect::<Vec<_>>(), vec![3, 4, 5]);
    assert_eq!(channel.dropped_up_to(), 2);
    assert_eq!(
        channel.unread_after(0),
        Unread {
            count: 3,
            capped: true
        }
    );
    assert_eq!(
        channel.unread_after(2),
        Unread {
            count: 3,
            capped: false
        },
        "acked at the newest dropped message: exact"
    );
    // A deleted message leaves the window: it keeps as many live messages.
    channel.message_deleted(4, 2);
    channel.message_created(6, 3);
    assert_eq!(channel.recent().collect::<Vec<_>>(), vec![3, 5, 6]);
    assert_eq!(channel.dropped_up_to(), 2);
    assert_eq!(channel.unread_after(2).count, 3);
}

#[test]
fn deletions_do_not_shorten_the_exact_window() {
    // 1,025 messages, 1,000 of them deleted, the first one dropped: the 25
    // left are within the window and counted exactly.
    let mut channel = ChannelState::switched(7, 10, 1);
    for id in 11..=1_034 {
        channel.message_created(id, 1);
    }
    for id in 12..=1_011 {
        channel.message_deleted(id, 2);
    }
    channel.message_created(1_035, 3);
    let unread = channel.unread_after(10);
    assert_eq!((unread.count, unread.capped), (25, false));
}

#[test]
fn the_default_keeps_over_a_thousand_messages_exact() {
    let mut channel = ChannelState::switched(7, 0, 1);
    for id in 1..=2_000 {
        channel.message_created(id, 1);
    }
    assert_eq!(channel.recent().len(), RECENT_MESSAGES);
    let exact = channel.unread_after(2_000 - RECENT_MESSAGES as u64);
    assert_eq!((exact.count, exact.capped), (1_024, false));
    assert!(channel.unread_after(0).capped);
}

#[test]
fn a_switch_keeps_what_each_member_counted() {
    let mut user = UserReadStates::default();
    user.ack(C, 10, 1);
    for id in 11..=13 {
        user.message_created(C, id, id == 12, 1, &NoChannels);
    }
    let mut channel = ChannelState::switched(7, 13, 2);
    let state = user.get(C).unwrap();
    assert_eq!(
        channel
            .unread(state.last_acked_id, state.unread_count)
            .count,
        3
    );
    channel.message_created(14, 3);
    let channels = channels(channel);
    assert_eq!(unread(&user, C, &channels).count, 4);
    assert_eq!(
        user.counts(&channels),
        Counts {
            total_mention_count: 1,
            unread_channel_count: 1,
            ..Counts::default()
        }
    );
    user.ack(C, 14, 4);
    assert_eq!(unread(&user, C, &channels).count, 0);
}

#[test]
fn a_member_counts_from_their_ack_at_joining_or_their_first_mention() {
    let mut channel = ChannelState::switched(7, 0, 1);
    for id in 1..=5 {
        channel.message_created(id, 1);
    }
    let (mut joined, mut mentioned) = (UserReadStates::default(), UserReadStates::default());
    joined.ack(C, channel.last_message_id(), 2);
    channel.message_created(6, 3);
    assert!(mentioned.mentioned(C, 6, 3, channel.holds(6)));
    assert!(!mentioned.mentioned(C, 6, 4, channel.holds(6)), "a retry");
    let channels = channels(channel);
    assert_eq!(unread(&joined, C, &channels).count, 1);
    assert_eq!(unread(&mentioned, C, &channels).count, 1);
    assert_eq!(mentioned.get(C).unwrap().mention_count, 1);
    assert_eq!(mentioned.get(C).unwrap().last_acked_id, 5);
}

#[test]
fn a_deleted_mention_lowers_the_mention_only_where_it_counted() {
    let mut channel = ChannelState::switched(7, 1, 1);
    channel.message_created(5, 1);
    let mut user = UserReadStates::default();
    user.ack(C, 1, 1);
    user.mentioned(C, 5, 2, channel.holds(5));
    assert!(!user.mention_deleted(C, 6, 3), "after it: not counted");
    assert!(!user.mention_deleted(C, 1, 3), "read: not counted");
    assert!(user.mention_deleted(C, 5, 3));
    assert!(!user.mention_deleted(C, 5, 4), "nothing left to lower");
    assert_eq!(user.get(C).unwrap().mention_count, 0);
    assert_eq!(
        user.get(C).unwrap().unread_count,
        0,
        "the channel's to count"
    );
}

#[test]
fn ack_all_reads_up_to_the_channels_newest_message() {
    let mut channel = ChannelState::switched(7, 0, 1);
    let mut user = UserReadStates::default();
    user.ack(C, 1, 1);
    for id in 2..=4 {
        channel.message_created(id, 1);
    }
    let channels = channels(channel);
    assert_eq!(user.ack_all(&[], 2, &channels), 1);
    assert_eq!(user.get(C).unwrap().last_acked_id, 4);
    assert_eq!(unread(&user, C, &channels).count, 0);
    assert_eq!(user.ack_all(&[], 3, &channels), 0, "nothing left");
}

#[test]
fn a_manual_ack_counts_from_the_channel_and_keeps_what_came_before_the_switch() {
    let mut channel = ChannelState::switched(7, 10, 1);
    for id in 11..=13 {
        channel.message_created(id, 1);
    }
    assert_eq!(
        channel.per_member_part(12, 40),
        0,
        "the channel counts exactly"
    );
    assert_eq!(channel.per_member_part(10, 40), 0, "at the switch too");
    assert_eq!(
        channel.per_member_part(8, 5),
        2,
        "5 unread after 8: 3 of them counted by the channel"
    );
    assert_eq!(channel.per_member_part(8, 1), 0, "never below none");
}

#[test]
fn a_partial_delta_carries_every_read_state_counted_by_channel() {
    let mut user = UserReadStates::default();
    user.ack(C, 1, 1);
    user.ack(Key::channel(8), 1, 2);
    let since = user.version();
    let channels = channels(ChannelState::switched(7, 0, 3));
    let delta = user.delta(since, &channels);
    assert!(delta.partial);
    let keys: Vec<Key> = delta.read_states.iter().map(|e| e.key()).collect();
    assert_eq!(keys, vec![C], "its count may have moved");
    assert_eq!(user.delta(since, &NoChannels).read_states.len(), 0);
}

#[test]
fn only_channel_read_states_are_counted_by_channel() {
    let event = Key {
        kind: Kind::GuildEvent,
        channel_id: 7,
    };
    let mut user = UserReadStates::default();
    user.message_created(event, 5, false, 1, &NoChannels);
    let mut channel = ChannelState::switched(7, 0, 1);
    channel.message_created(9, 1);
    let channels = channels(channel);
    assert!(channels.of(user.get(event).unwrap()).is_none());
    assert_eq!(unread(&user, event, &channels).count, 1);
}

#[test]
fn a_muted_member_with_unread_messages_is_not_an_unread_channel() {
    let mut user = UserReadStates::default();
    user.ack(C, 1, 1);
    user.set_muted(C, true, 1, &NoChannels);
    let mut channel = ChannelState::switched(7, 1, 1);
    channel.message_created(2, 1);
    let channels = channels(channel);
    assert_eq!(unread(&user, C, &channels).count, 1);
    assert_eq!(user.counts(&channels).unread_channel_count, 0);
}

#[test]
fn a_stored_channel_reads_back_as_it_was_and_a_damaged_one_is_made_sound() {
    let mut channel = ChannelState::with_capacity(7, 10, 1, 4);
    for id in 11..=16 {
        channel.message_created(id, 1);
    }
    channel.message_deleted(16, 2);
    let stored = ChannelState::from_stored(
        7,
        channel.counted_from(),
        channel.last_message_id(),
        channel.dropped_up_to(),
        channel.recent().collect(),
        channel.version(),
    );
    let fields = |c: &ChannelState| {
        let ends = (c.counted_from(), c.last_message_id(), c.dropped_up_to());
        (
            c.channel_id(),
            ends,
            c.recent().collect::<Vec<_>>(),
            c.version(),
        )
    };
    assert_eq!(fields(&stored), fields(&channel));
    assert_eq!(stored.recent().collect::<Vec<_>>(), vec![13, 14, 15]);
    assert!(
        !stored.clone().message_created(16, 3),
        "deleted, still taken"
    );

    let damaged = ChannelState::from_stored(7, 10, 12, 0, vec![12, 9, 11, 12, 40], 5);
    assert_eq!(damaged.recent().collect::<Vec<_>>(), vec![11, 12]);
    assert_eq!(damaged.last_message_id(), 12);
}

#[test]
fn a_read_state_made_without_an_ack_counts_from_the_channels_newest_message() {
    let mut channel = ChannelState::switched(7, 100, 1);
    let mut user = UserReadStates::default();
    user.ack(C, 100, 1);
    for id in 101..=110 {
        channel.message_created(id, 1);
    }
    let channels = channels(channel);
    user.delete(&[C], 2);
    assert!(
        !user.message_created(C, 95, false, 3, &channels),
        "a late message from before the switch makes no one a member"
    );
    assert!(user.get(C).is_none());
    assert!(user.set_muted(C, true, 4, &channels));
    assert_eq!(user.get(C).unwrap().last_acked_id, 110);
    assert_eq!(unread(&user, C, &channels).count, 0);
    assert!(
        !user.message_created(C, 96, false, 5, &channels),
        "joined after it: read"
    );
    assert_eq!(unread(&user, C, &channels).count, 0);
}

#[test]
fn a_mention_of_a_message_the_channel_did_not_take_counts_nothing() {
    let mut channel = ChannelState::switched(7, 100, 1);
    channel.message_created(101, 1);
    channel.message_created(103, 1);
    assert!(!channel.message_created(102, 2), "late");
    let mut user = UserReadStates::default();
    user.ack(C, 100, 1);
    assert!(!user.mentioned(C, 102, 2, channel.holds(102)));
    channel.message_deleted(103, 3);
    assert!(
        !user.mentioned(C, 103, 3, channel.holds(103)),
        "deleted first"
    );
    assert_eq!(user.get(C).unwrap().mention_count, 0);
}

// The model of a user whose channels are counted both ways.

const USERS: usize = 2;
const SWITCHABLE: [u64; 2] = [1, 2];

/// A channel counted by channel in the model: every message it ever took
/// (deleted or not), with no cap.
#[derive(Clone, Debug, Default)]
struct ModelChannel {
    counted_from: u64,
    messages: BTreeMap<u64, bool>,
}

impl ModelChannel {
    fn newest(&self) -> u64 {
        self.messages
            .keys()
            .next_back()
            .copied()
            .unwrap_or(0)
            .max(self.counted_from)
    }

    fn unread_after(&self, id: u64) -> u16 {
        let live = self.messages.range(id + 1..).filter(|&(_, &d)| !d).count();
        u16::try_from(live).unwrap()
    }
}

#[derive(Clone, Debug, Default)]
struct Model {
    members: BTreeMap<(usize, Key), Member>,
    channels: BTreeMap<u64, ModelChannel>,
    /// The newest message sent to each channel, either way.
    newest: BTreeMap<u64, u64>,
}

impl Model {
    /// The channel counting `key`'s message `id` by channel, if one does.
    fn by_channel(&mut self, key: Key, id: u64) -> Option<&mut ModelChannel> {
        let channel = self.channels.get_mut(&key.channel_id)?;
        (key.kind == Kind::Channel && id > channel.counted_from).then_some(channel)
    }

    fn channel_of(&self, key: Key) -> Option<&ModelChannel> {
        (key.kind == Kind::Channel)
            .then(|| self.channels.get(&key.channel_id))
            .flatten()
    }

    /// What a client shows: a member's state with its whole unread count.
    fn seen(&self, user: usize) -> BTreeMap<Key, Member> {
        (self
            .members
            .range((user, Key::channel(0))..(user + 1, Key::channel(0))))
        .map(|(&(_, key), member)| {
            let channel = self.channel_of(key);
            let extra = channel.map_or(0, |c| c.unread_after(member.last_acked_id));
            let unread_count = member.unread_count + extra;
            (
                key,
                Member {
                    unread_count,
                    ..*member
                },
            )
        })
        .collect()
    }

    fn counts(&self, user: usize) -> Counts {
        self.seen(user)
            .values()
            .fold(Counts::default(), |mut counts, m| {
                counts.total_mention_count += u64::from(m.mention_count);
                counts.unread_channel_count +=
                    u32::from(m.mention_count > 0 || (m.unread_count > 0 && !m.muted));
                counts
            })
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// A message; each user is mentioned or not.
    Message(Key, u64, [bool; USERS]),
    MessageDeleted(Key, u64, [bool; USERS]),
    Ack(usize, Key, u64),
    Manual(usize, Key, u64, u16, u16),
    AckAll(usize),
    Mute(usize, Key, bool),
    Delete(usize, Key),
    /// The channel is switched to counting by channel at its newest message.
    Switch(u64),
}

fn key() -> impl Strategy<Value = Key> {
    (1u64..4, 0u8..2).prop_map(|(channel_id, kind)| Key {
        channel_id,
        kind: Kind::from_u8(kind).unwrap(),
    })
}

fn op() -> impl Strategy<Value = Op> {
    let user = 0..USERS;
    let mentions = any::<[bool; USERS]>();
    prop_oneof![
        8 => (key(), 1u64..40, mentions).prop_map(|(k, id, m)| Op::Message(k, id, m)),
        3 => (key(), 1u64..40, mentions).prop_map(|(k, id, m)| Op::MessageDeleted(k, id, m)),
        4 => (user.clone(), key(), 1u64..40).prop_map(|(u, k, id)| Op::Ack(u, k, id)),
        1 => (user.clone(), key(), 0u64..40, 0u16..4, 0u16..8)
            .prop_map(|(u, k, id, m, n)| Op::Manual(u, k, id, m, n)),
        1 => user.clone().prop_map(Op::AckAll),
        1 => (user.clone(), key(), any::<bool>()).prop_map(|(u, k, m)| Op::Mute(u, k, m)),
        1 => (user, key()).prop_map(|(u, k)| Op::Delete(u, k)),
        1 => prop::sample::select(SWITCHABLE.to_vec()).prop_map(Op::Switch),
    ]
}

/// Every user is a member of every channel: a message counted per member
/// reaches them all.
fn apply_model(model: &mut Model, op: &Op) {
    let existing = model.members.clone();
    match *op {
        Op::Message(key, id, mentioned) => {
            let newest = model.newest.entry(key.channel_id).or_default();
            *newest = (*newest).max(id);
            if let Some(channel) = model.by_channel(key, id) {
                if id > channel.newest() {
                    channel.messages.insert(id, false);
                }
                // A mention counts for a message the channel holds.
                if channel.messages.get(&id) != Some(&false) {
                    return;
                }
                for (user, _) in mentioned.iter().enumerate().filter(|(_, m)| **m) {
                    let existing = model.members.get(&(user, key)).copied();
                    if id > existing.map_or(0, |m| m.counted_up_to()) {
                        let member = model.members.entry((user, key)).or_insert(Member {
                            last_acked_id: id - 1,
                            ..Member::default()
                        });
                        member.last_message_id = id;
                        member.mention_count = member.mention_count.saturating_add(1);
                    }
                }
                return;
            }
            // Counted by channel, only members count a message from before
            // the switch.
            let members_only = model.channel_of(key).is_some();
            for (user, &mentioned) in mentioned.iter().enumerate() {
                if members_only && !model.members.contains_key(&(user, key)) {
                    continue;
                }
                let member = model.members.entry((user, key)).or_default();
                if id > member.counted_up_to() {
                    member.last_message_id = id;
                    member.unread_count = member.unread_count.saturating_add(1);
                    member.mention_count =
                        member.mention_count.saturating_add(u16::from(mentioned));
                }
            }
        }
        Op::MessageDeleted(key, id, mentioned) => {
            let by_channel = model.by_channel(key, id).map(|channel| {
                if let Some(deleted) = channel.messages.get_mut(&id) {
                    *deleted = true;
                }
            });
            for (user, &mentioned) in mentioned.iter().enumerate() {
                let Some(member) = model.members.get_mut(&(user, key)) else {
                    continue;
                };
                if !(member.last_acked_id < id && id <= member.last_message_id) {
                    continue;
                }
                if by_channel.is_none() {
                    member.unread_count = member.unread_count.saturating_sub(1);
                }
                if mentioned {
                    member.mention_count = member.mention_count.saturating_sub(1);
                }
            }
        }
        Op::Ack(user, key, id) => {
            let member = model.members.entry((user, key)).or_default();
            if id > member.last_acked_id {
                member.read_up_to(id);
            }
        }
        Op::Manual(user, key, id, mentions, unread) => {
            let channel = model.channel_of(key).cloned();
            let member = model.members.entry((user, key)).or_default();
            member.last_acked_id = id;
            member.last_message_id = member.last_message_id.max(id);
            member.mention_count = mentions;
            // Counted by channel: the whole count after the ack is the
            // given one before the switch, the channel's from it on.
            member.unread_count = match channel {
                Some(c) if id >= c.counted_from => 0,
                Some(c) => unread.saturating_sub(c.unread_after(id)),
                None => unread,
            };
        }
        Op::AckAll(user) => {
            let keys: Vec<Key> = (model.members.keys())
                .filter(|(u, _)| *u == user)
                .map(|&(_, k)| k)
                .collect();
            for key in keys {
                let newest = model.channel_of(key).map_or(0, ModelChannel::newest);
                let member = model.members.get_mut(&(user, key)).unwrap();
                member.read_up_to(member.counted_up_to().max(newest));
            }
        }
        Op::Mute(user, key, false) if !model.members.contains_key(&(user, key)) => {}
        Op::Mute(user, key, muted) => {
            // Counted by channel, a read state made by a mute joins at the
            // channel's newest message.
            let newest = model.channel_of(key).map_or(0, ModelChannel::newest);
            let member = model.members.entry((user, key)).or_insert(Member {
                last_acked_id: newest,
                last_message_id: newest,
                ..Member::default()
            });
            member.muted = muted;
        }
        Op::Delete(user, key) => {
            model.members.remove(&(user, key));
        }
        Op::Switch(channel_id) => {
            let counted_from = model.newest.get(&channel_id).copied().unwrap_or(0);
            model
                .channels
                .entry(channel_id)
                .or_insert_with(|| ModelChannel {
                    counted_from,
                    messages: BTreeMap::new(),
                });
        }
    }
    // An untouched fresh read state is not created; a manual ack always is.
    if !matches!(op, Op::Manual(..)) {
        (model.members).retain(|k, m| existing.contains_key(k) || *m != Member::default());
    }
}

/// What the service does for `op`: the handlers' choices between the two
/// ways, over the domain.
fn apply_real(
    users: &mut [UserReadStates],
    channels: &mut HashMap<u64, ChannelState>,
    op: &Op,
    now_us: u64,
) {
    let by_channel = |channels: &HashMap<u64, ChannelState>, key: Key, id: u64| {
        (key.kind == Kind::Channel) && channels.get(&key.channel_id).is_some_and(|c| c.counts(id))
    };
    match *op {
        Op::Message(key, id, mentioned) => {
            if by_channel(channels, key, id) {
                channels
                    .get_mut(&key.channel_id)
                    .unwrap()
                    .message_created(id, now_us);
                let channel = &channels[&key.channel_id];
                for (user, _) in mentioned.iter().enumerate().filter(|(_, m)| **m) {
                    users[user].mentioned(key, id, now_us, channel.holds(id));
                }
            } else {
                for (user, &mentioned) in mentioned.iter().enumerate() {
                    users[user].message_created(key, id, mentioned, now_us, &*channels);
                }
            }
        }
        Op::MessageDeleted(key, id, mentioned) => {
            if by_channel(channels, key, id) {
                let channel = channels.get_mut(&key.channel_id).unwrap();
                channel.message_deleted(id, now_us);
                for (user, _) in mentioned.iter().enumerate().filter(|(_, m)| **m) {
                    users[user].mention_deleted(key, id, now_us);
                }
            } else {
                for (user, &mentioned) in mentioned.iter().enumerate() {
                    users[user].message_deleted(key, id, mentioned, now_us);
                }
            }
        }
        Op::Ack(user, key, id) => {
            users[user].ack(key, id, now_us);
        }
        Op::Manual(user, key, id, mentions, unread) => {
            let kept = match (key.kind, channels.get(&key.channel_id)) {
                (Kind::Channel, Some(channel)) => channel.per_member_part(id, unread),
                _ => unread,
            };
            users[user].manual_ack(key, id, mentions, kept, now_us);
        }
        Op::AckAll(user) => {
            users[user].ack_all(&[], now_us, &*channels);
        }
        Op::Mute(user, key, muted) => {
            users[user].set_muted(key, muted, now_us, &*channels);
        }
        Op::Delete(user, key) => {
            users[user].delete(&[key], now_us);
        }
        // The backend names the switch's message: the test takes it from
        // the model.
        Op::Switch(_) => {}
    }
}

proptest! {
    /// Both ways of counting, mixed in one user, give what the model says,
    /// and a client that applies deltas stays in step.
    #[test]
    fn counting_both_ways_matches_the_model(
        ops in prop::collection::vec((op(), 0u64..50), 1..80),
        checkpoint in 0usize..80,
    ) {
        let mut users = vec![UserReadStates::default(); USERS];
        let mut channels = HashMap::new();
        let mut model = Model::default();
        let mut saved = None;
        for (i, (op, now_us)) in ops.iter().enumerate() {
            let versions: Vec<u64> = users.iter().map(|u| u.version()).collect();
            apply_model(&mut model, op);
            if let Op::Switch(channel_id) = *op {
                let counted_from = model.channels[&channel_id].counted_from;
                channels
                    .entry(channel_id)
                    .or_insert_with(|| ChannelState::switched(channel_id, counted_from, *now_us));
            }
            apply_real(&mut users, &mut channels, op, *now_us);
            for (u, user) in users.iter().enumerate() {
                let seen: BTreeMap<Key, Member> = user
                    .live()
                    .map(|e| {
                        let count = channels.of(e).map_or(e.unread_count, |c| c.unread(e.last_acked_id, e.unread_count).count);
                        (e.key(), Member { unread_count: count, ..Member::of(e) })
                    })
                    .collect();
                prop_assert_eq!(&seen, &model.seen(u), "user {} after {:?}", u, op);
                prop_assert_eq!(user.counts(&channels), model.counts(u));
                prop_assert!(user.version() >= versions[u]);
            }
            if let Op::Message(..) | Op::MessageDeleted(..) | Op::Switch(_) = op {
                // A change counted by channel costs the members nothing.
                let by_channel = match *op {
                    Op::Message(k, id, m) | Op::MessageDeleted(k, id, m) =>
                        k.kind == Kind::Channel
                            && channels.get(&k.channel_id).is_some_and(|c| c.counts(id))
                            && !m.contains(&true),
                    _ => true,
                };
                if by_channel {
                    let now: Vec<u64> = users.iter().map(|u| u.version()).collect();
                    prop_assert_eq!(now, versions.clone(), "{:?}", op);
                }
            }
            if i == checkpoint {
                saved = Some((users[0].version(), model.seen(0)));
            }
        }
        // A client of user 0 that held what it saw at the checkpoint and
        // applies a delta from there sees what the user sees now.
        if let Some((since, mut held)) = saved.filter(|(v, _)| *v > 0) {
            let delta = users[0].delta(since, &channels);
            if !delta.partial {
                held.clear();
            }
            for key in &delta.deleted {
                held.remove(key);
            }
            for e in &delta.read_states {
                let count = channels.of(e).map_or(e.unread_count, |c| c.unread(e.last_acked_id, e.unread_count).count);
                held.insert(e.key(), Member { unread_count: count, ..Member::of(e) });
            }
            prop_assert_eq!(held, model.seen(0));
        }
    }

    /// With a small cap, a count is exact while the ack is within the recent
    /// messages, and says it is capped exactly when it is not. The model
    /// keeps every message; the window is the live ones above the newest
    /// that fell out, which a new message pushes out when the window is full.
    #[test]
    fn the_cap_is_exact_within_and_said_past(
        ops in prop::collection::vec((any::<bool>(), 1u64..60), 1..80),
        acks in prop::collection::vec(0u64..60, 1..10),
    ) {
        const CAPACITY: usize = 5;
        let mut channel = ChannelState::with_capacity(7, 0, 1, CAPACITY);
        let mut model = ModelChannel::default();
        let mut dropped_up_to = 0;
        for &(create, id) in &ops {
            let window: Vec<u64> = (model.messages.iter())
                .filter(|&(&id, &deleted)| !deleted && id > dropped_up_to)
                .map(|(&id, _)| id)
                .collect();
            if create {
                channel.message_created(id, 1);
                if id > model.newest() {
                    if window.len() == CAPACITY {
                        dropped_up_to = window[0];
                    }
                    model.messages.insert(id, false);
                }
            } else {
                channel.message_deleted(id, 1);
                if window.contains(&id) {
                    model.messages.insert(id, true);
                }
            }
        }
        prop_assert_eq!(channel.dropped_up_to(), dropped_up_to);
        for ack in acks {
            let unread = channel.unread_after(ack);
            prop_assert_eq!(unread.capped, ack < dropped_up_to);
            if !unread.capped {
                prop_assert_eq!(unread.count, model.unread_after(ack));
            }
        }
    }
}
