//! The rules, one by one, and a property test of the whole against a model.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::read_state::NoChannels;
use threads::{Replied, ThreadCounts};

const C1: Key = Key {
    kind: Kind::Channel,
    channel_id: 1,
};
const C2: Key = Key {
    kind: Kind::Channel,
    channel_id: 2,
};
const E1: Key = Key {
    kind: Kind::GuildEvent,
    channel_id: 1,
};

#[test]
fn ack_moves_forward_only_and_resets_counters() {
    let mut user = UserReadStates::default();
    assert!(user.message_created(C1, 10, true, 0, &NoChannels));
    assert!(user.message_created(C1, 11, false, 0, &NoChannels));
    let state = user.get(C1).unwrap();
    assert_eq!((state.mention_count, state.unread_count), (1, 2));

    let acked = user.ack(C1, 11, 0).unwrap();
    assert_eq!(
        (acked.last_acked_id, acked.mention_count, acked.unread_count),
        (11, 0, 0)
    );
    let version = user.version();
    assert_eq!(user.ack(C1, 11, 0), None, "same id: nothing");
    assert_eq!(user.ack(C1, 5, 0), None, "older id: nothing");
    assert_eq!(user.version(), version, "no change, no new version");
}

#[test]
fn messages_at_or_before_the_last_ack_do_not_count() {
    let mut user = UserReadStates::default();
    user.ack(C1, 100, 0);
    assert!(!user.message_created(C1, 100, true, 0, &NoChannels));
    assert!(!user.message_created(C1, 99, true, 0, &NoChannels));
    assert!(user.message_created(C1, 101, true, 0, &NoChannels));
    assert_eq!(user.get(C1).unwrap().mention_count, 1);
}

#[test]
fn manual_ack_rewinds_and_sets_counts() {
    let mut user = UserReadStates::default();
    user.ack(C1, 100, 0);
    let state = user.manual_ack(C1, 40, 3, 7, 0).unwrap();
    assert_eq!(
        (state.last_acked_id, state.mention_count, state.unread_count),
        (40, 3, 7)
    );
    // Messages between the rewound ack and the watermark are what the given
    // counts describe; only newer ones count on top.
    assert!(!user.message_created(C1, 50, false, 0, &NoChannels));
    assert!(user.message_created(C1, 101, false, 0, &NoChannels));
    assert_eq!(user.get(C1).unwrap().unread_count, 8);
}

#[test]
fn kinds_of_the_same_channel_are_separate() {
    let mut user = UserReadStates::default();
    user.message_created(C1, 10, true, 0, &NoChannels);
    user.message_created(E1, 10, false, 0, &NoChannels);
    user.ack(C1, 10, 0);
    assert_eq!(user.get(E1).unwrap().unread_count, 1);
    assert_eq!(user.get(C1).unwrap().unread_count, 0);
}

#[test]
fn counters_saturate() {
    let mut user = UserReadStates::default();
    user.manual_ack(C1, 1, MAX_COUNT, MAX_COUNT, 0);
    user.message_created(C1, 2, true, 0, &NoChannels);
    let state = user.get(C1).unwrap();
    assert_eq!(
        (state.mention_count, state.unread_count),
        (MAX_COUNT, MAX_COUNT)
    );
    assert_eq!(saturated_count(70_000), MAX_COUNT);
    assert_eq!(saturated_count(7), 7);
}

#[test]
fn a_redelivered_message_counts_once() {
    let mut user = UserReadStates::default();
    assert!(user.message_created(C1, 10, true, 0, &NoChannels));
    let version = user.version();
    assert!(
        !user.message_created(C1, 10, true, 0, &NoChannels),
        "redelivered"
    );
    assert!(
        !user.message_created(C1, 10, false, 0, &NoChannels),
        "redelivered, other list"
    );
    assert_eq!(user.version(), version, "nothing changed");
    let state = user.get(C1).unwrap();
    assert_eq!(
        (
            state.last_message_id,
            state.mention_count,
            state.unread_count
        ),
        (10, 1, 1)
    );
}

#[test]
fn a_late_older_message_does_not_count() {
    let mut user = UserReadStates::default();
    user.message_created(C1, 10, false, 0, &NoChannels);
    assert!(!user.message_created(C1, 9, false, 0, &NoChannels));
    assert!(user.message_created(C1, 11, false, 0, &NoChannels));
    assert_eq!(user.get(C1).unwrap().unread_count, 2);
}

#[test]
fn acks_raise_the_watermark_and_a_manual_ack_keeps_it() {
    let mut user = UserReadStates::default();
    user.message_created(C1, 10, false, 0, &NoChannels);
    user.ack(C1, 20, 0);
    assert_eq!(user.get(C1).unwrap().last_message_id, 20);
    user.message_created(C1, 30, false, 0, &NoChannels);
    let state = user.manual_ack(C1, 15, 0, 2, 0).unwrap();
    assert_eq!((state.last_acked_id, state.last_message_id), (15, 30));
    assert!(
        !user.message_created(C1, 30, false, 0, &NoChannels),
        "a redelivery after \"mark unread\" counts nothing"
    );
    assert_eq!(user.get(C1).unwrap().unread_count, 2);
}

#[test]
fn ack_all_reads_every_read_state_up_to_its_watermark_as_one_change() {
    let mut user = UserReadStates::default();
    user.message_created(C1, 10, true, 0, &NoChannels);
    user.message_created(C2, 20, false, 0, &NoChannels);
    user.message_created(E1, 30, false, 0, &NoChannels);
    user.ack(Key::channel(3), 5, 0);
    let before = user.version();
    assert_eq!(
        user.ack_all(&[Kind::Channel], 0, &NoChannels),
        2,
        "only unread channels"
    );
    assert_eq!(user.version(), before + 1, "one version");
    for (key, read_to) in [(C1, 10), (C2, 20)] {
        let state = user.get(key).unwrap();
        assert_eq!(
            (state.last_acked_id, state.mention_count, state.unread_count),
            (read_to, 0, 0)
        );
    }
    assert_eq!(
        user.get(E1).unwrap().unread_count,
        1,
        "other kinds untouched"
    );
    assert_eq!(
        user.ack_all(&[Kind::Channel], 0, &NoChannels),
        0,
        "nothing left unread"
    );
    assert_eq!(user.ack_all(&[], 0, &NoChannels), 1, "empty: every kind");
    assert_eq!(user.counts(&NoChannels), Counts::default());
}

#[test]
fn a_deleted_message_uncounts_only_what_it_counted() {
    let mut user = UserReadStates::default();
    user.message_created(C1, 10, true, 0, &NoChannels);
    user.message_created(C1, 11, false, 0, &NoChannels);
    assert!(!user.message_deleted(C1, 12, false, 0), "never counted");
    assert!(!user.message_deleted(C2, 10, false, 0), "no read state");
    assert!(user.message_deleted(C1, 10, true, 0));
    let state = user.get(C1).unwrap();
    assert_eq!((state.mention_count, state.unread_count), (0, 1));
    user.ack(C1, 11, 0);
    assert!(!user.message_deleted(C1, 11, false, 0), "already read");
    assert!(
        !user.message_deleted(C1, 10, true, 0),
        "read, and never below zero"
    );
}

#[test]
fn a_muted_read_state_counts_mentions_but_is_not_an_unread_channel() {
    let mut user = UserReadStates::default();
    assert!(
        !user.set_muted(C1, false, 0, &NoChannels),
        "unmuting nothing changes nothing"
    );
    assert!(
        user.set_muted(C1, true, 0, &NoChannels),
        "muting creates the read state"
    );
    assert!(!user.set_muted(C1, true, 0, &NoChannels));
    user.message_created(C1, 10, false, 0, &NoChannels);
    assert_eq!(user.counts(&NoChannels).unread_channel_count, 0);
    user.message_created(C1, 11, true, 0, &NoChannels);
    assert_eq!(
        user.counts(&NoChannels),
        Counts {
            total_mention_count: 1,
            unread_channel_count: 1,
            ..Counts::default()
        }
    );
    user.ack(C1, 11, 0);
    assert!(user.get(C1).unwrap().muted, "an ack keeps the mute");
}

#[test]
fn version_follows_the_clock_and_never_goes_back() {
    let mut user = UserReadStates::default();
    user.ack(C1, 1, 1_000);
    assert_eq!(user.version(), 1_000);
    user.ack(C1, 2, 500); // the clock stepped back
    assert_eq!(user.version(), 1_001);
    user.ack(C1, 3, 5_000);
    assert_eq!(user.version(), 5_000);
    assert_eq!(user.get(C1).unwrap().version, 5_000);
}

#[test]
fn counts_cover_live_read_states() {
    let mut user = UserReadStates::default();
    user.message_created(C1, 10, true, 0, &NoChannels);
    user.message_created(C1, 11, true, 0, &NoChannels);
    user.message_created(C2, 10, false, 0, &NoChannels);
    user.ack(E1, 10, 0);
    assert_eq!(
        user.counts(&NoChannels),
        Counts {
            total_mention_count: 2,
            unread_channel_count: 2,
            ..Counts::default()
        }
    );
    user.delete(&[C1], 0);
    assert_eq!(
        user.counts(&NoChannels),
        Counts {
            total_mention_count: 0,
            unread_channel_count: 1,
            ..Counts::default()
        }
    );
}

#[test]
fn delete_leaves_a_tombstone_that_deltas_report() {
    let mut user = UserReadStates::default();
    user.ack(C1, 10, 0);
    user.ack(C2, 10, 0);
    let since = user.version();
    assert_eq!(
        user.delete(&[C1, Key::channel(99)], 0),
        1,
        "only existing ones count"
    );
    assert_eq!(user.get(C1), None);
    let delta = user.delta(since, &NoChannels);
    assert!(delta.partial);
    assert_eq!(delta.deleted, vec![C1]);
    assert!(delta.read_states.is_empty());
    assert_eq!(user.delete(&[C1], 0), 0, "deleting twice changes nothing");

    // A new message revives it as a fresh read state.
    assert!(user.message_created(C1, 5, false, 0, &NoChannels));
    let state = user.get(C1).unwrap();
    assert_eq!((state.last_acked_id, state.unread_count), (0, 1));
}

#[test]
fn delete_all_wipes_and_forces_a_full_resync() {
    let mut user = UserReadStates::default();
    user.ack(C1, 10, 0);
    user.ack(C2, 10, 0);
    let since = user.version();
    assert_eq!(user.delete_all(0), 2);
    assert!(user.is_empty());
    assert_eq!(user.pending_clear(), Some(user.version()));
    let delta = user.delta(since, &NoChannels);
    assert!(!delta.partial, "older clients must drop what they hold");
    assert!(delta.read_states.is_empty());
    assert_eq!(UserReadStates::default().delete_all(0), 0);
}

#[test]
fn delta_is_full_for_zero_and_for_unknown_versions() {
    let mut user = UserReadStates::default();
    user.ack(C1, 10, 0);
    assert!(!user.delta(0, &NoChannels).partial);
    assert!(
        !user.delta(user.version() + 1, &NoChannels).partial,
        "a version from the future"
    );
    let current = user.delta(user.version(), &NoChannels);
    assert!(current.partial && current.read_states.is_empty());
}

#[test]
fn unwritten_tracking_follows_versions() {
    let mut user = UserReadStates::default();
    user.ack(C1, 10, 0);
    user.ack(C2, 10, 0);
    assert_eq!(user.unwritten_count(), 2);
    let written = user.version();
    user.ack(C1, 11, 0); // changed while the write was under way
    user.mark_written(written);
    assert!(user.has_unwritten());
    assert_eq!(user.unwritten_count(), 1);
    assert_eq!(
        user.unwritten_entries()
            .map(|e| e.key())
            .collect::<Vec<_>>(),
        vec![C1]
    );
    user.mark_written(user.version());
    assert!(!user.has_unwritten());
    assert_eq!(user.unwritten_count(), 0);
}

/// Case 2 of "Lossless at every transition": a pending "delete all" left
/// nothing counted as unwritten, so shutdown reported it written.
#[test]
fn a_pending_delete_all_counts_as_unwritten() {
    let mut user = UserReadStates::default();
    user.ack(C1, 10, 0);
    user.mark_written(user.version());
    user.delete_all(1);
    assert!(user.has_unwritten());
    assert_eq!(user.unwritten_count(), 1, "the wipe waits for the store");
    user.mark_written(user.version());
    assert_eq!(user.unwritten_count(), 0);
}

#[test]
fn only_written_tombstones_are_pruned_and_the_floor_rises() {
    let mut user = UserReadStates::default();
    let keys: Vec<Key> = (1..=(MAX_TOMBSTONES_PER_USER as u64 + 10))
        .map(Key::channel)
        .collect();
    for &key in &keys {
        user.ack(key, 1, 0);
    }
    for &key in &keys {
        user.delete(&[key], 0);
    }
    assert_eq!(
        user.prune_tombstones(0),
        0,
        "unwritten tombstones must stay"
    );
    user.mark_written(user.version());
    assert_eq!(user.prune_tombstones(0), 10);
    assert_eq!(user.len(), MAX_TOMBSTONES_PER_USER);
    assert!(
        !user.delta(1, &NoChannels).partial,
        "a delta from before the pruned ones is full"
    );

    let week_later = user.version() + TOMBSTONE_RETENTION.as_micros() as u64 + 1;
    assert_eq!(user.prune_tombstones(week_later), MAX_TOMBSTONES_PER_USER);
    assert!(user.is_empty());
}

#[test]
fn from_stored_is_clean_and_sorted() {
    let states = vec![
        ReadState {
            version: 7,
            ..ReadState::new(C2)
        },
        ReadState {
            version: 9,
            ..ReadState::new(C1)
        },
    ];
    let rows = states.into_iter().map(|e| (e, 0)).collect();
    let user = UserReadStates::from_stored(3, 0, rows);
    assert_eq!(user.version(), 9, "never below a stored row's version");
    assert!(!user.has_unwritten());
    assert_eq!(
        user.live().map(|e| e.key()).collect::<Vec<_>>(),
        vec![C1, C2]
    );
}

/// The model: what a read state is, without any of the bookkeeping (also
/// the per-member part of the model of counting by channel).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ModelState {
    pub last_acked_id: u64,
    pub last_message_id: u64,
    pub mention_count: u16,
    pub unread_count: u16,
    pub muted: bool,
}

impl ModelState {
    pub fn of(e: &ReadState) -> ModelState {
        ModelState {
            last_acked_id: e.last_acked_id,
            last_message_id: e.last_message_id,
            mention_count: e.mention_count,
            unread_count: e.unread_count,
            muted: e.muted,
        }
    }

    pub fn read_up_to(&mut self, id: u64) {
        self.last_acked_id = id;
        self.last_message_id = self.last_message_id.max(id);
        self.mention_count = 0;
        self.unread_count = 0;
    }

    pub fn counted_up_to(&self) -> u64 {
        self.last_acked_id.max(self.last_message_id)
    }
}

/// The model: each live read state, and the parent of each thread the
/// user ever followed since their last "delete all".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Model {
    states: BTreeMap<Key, ModelState>,
    parents: BTreeMap<u64, u64>,
    /// Threads left (unfollowed or deleted), and how far they were counted
    /// then: a reply up to there does not make the user follow again.
    left: BTreeMap<u64, u64>,
}

/// Where a thread belongs in the generated operations (a reply or follow
/// naming another parent is refused).
fn parent_of(thread_id: u64) -> u64 {
    1 + thread_id % 2
}

fn thread_key(thread_id: u64) -> Key {
    Key {
        kind: Kind::Thread,
        channel_id: thread_id,
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Follow `thread`, naming its parent or (false) another one, read up
    /// to the id.
    Follow(u64, bool, u64),
    Unfollow(u64),
    /// A reply in `thread`, naming its parent or not.
    Reply(u64, bool, u64, Replied),
    AckThreadsOf(u64),
    Ack(Key, u64),
    Manual(Key, u64, u16, u16),
    Message(Key, u64, bool),
    MessageDeleted(Key, u64, bool),
    AckAll(Vec<Kind>),
    Mute(Key, bool),
    Delete(Vec<Key>),
    DeleteAll,
    /// The store caught up to the current version.
    Write,
}

fn key() -> impl Strategy<Value = Key> {
    (1u64..5, prop_oneof![Just(0u8), Just(1u8), Just(6u8)]).prop_map(|(channel_id, kind)| Key {
        channel_id,
        kind: Kind::from_u8(kind).unwrap(),
    })
}

fn replied() -> impl Strategy<Value = Replied> {
    prop_oneof![
        Just(Replied::Author),
        Just(Replied::Mentioned),
        Just(Replied::Follower),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let kind = prop_oneof![Just(0u8), Just(1u8), Just(6u8)].prop_map(|k| Kind::from_u8(k).unwrap());
    let kinds = prop::collection::vec(kind, 0..2);
    let parent_named = prop::bool::weighted(0.9);
    prop_oneof![
        2 => (1u64..5, parent_named, 0u64..30).prop_map(|(t, p, id)| Op::Follow(t, p, id)),
        1 => (1u64..5).prop_map(Op::Unfollow),
        4 => (1u64..5, parent_named, 1u64..30, replied())
            .prop_map(|(t, p, id, r)| Op::Reply(t, p, id, r)),
        1 => (1u64..3).prop_map(Op::AckThreadsOf),
        4 => (key(), 1u64..30).prop_map(|(k, id)| Op::Ack(k, id)),
        1 => (key(), 0u64..30, 0u16..4, 0u16..4).prop_map(|(k, id, m, u)| Op::Manual(k, id, m, u)),
        6 => (key(), 1u64..30, any::<bool>()).prop_map(|(k, id, m)| Op::Message(k, id, m)),
        3 => (key(), 1u64..30, any::<bool>()).prop_map(|(k, id, m)| Op::MessageDeleted(k, id, m)),
        1 => kinds.prop_map(Op::AckAll),
        1 => (key(), any::<bool>()).prop_map(|(k, m)| Op::Mute(k, m)),
        1 => prop::collection::vec(key(), 1..3).prop_map(Op::Delete),
        1 => Just(Op::DeleteAll),
        2 => Just(Op::Write),
    ]
}

/// Applies `op` to the model; returns whether anything changed.
fn apply_model(whole: &mut Model, op: &Op) -> bool {
    let existing_whole = whole.clone();
    let named = |thread: u64, parent_named: bool| match parent_named {
        true => parent_of(thread),
        false => parent_of(thread) + 10,
    };
    // A thread read state is made only by following (or a reply that
    // follows); other changes apply to it only while it is followed.
    let followed = |whole: &Model, k: &Key| k.kind != Kind::Thread || whole.states.contains_key(k);
    match *op {
        Op::Follow(thread, parent_named, id) => {
            let parent = named(thread, parent_named);
            let key = thread_key(thread);
            let moved = whole.parents.get(&thread).is_some_and(|&p| p != parent);
            let full = whole
                .states
                .keys()
                .filter(|k| k.kind == Kind::Thread)
                .count()
                >= threads::MAX_THREADS;
            if !moved && !full && !whole.states.contains_key(&key) {
                whole.parents.insert(thread, parent);
                let mut state = ModelState::default();
                state.read_up_to(id);
                whole.states.insert(key, state);
                return true;
            }
            return false;
        }
        Op::Unfollow(thread) => {
            let Some(state) = whole.states.remove(&thread_key(thread)) else {
                return false;
            };
            whole.left.insert(thread, state.counted_up_to());
            return true;
        }
        Op::Reply(thread, parent_named, id, replied) => {
            let parent = named(thread, parent_named);
            let key = thread_key(thread);
            if whole.parents.get(&thread).is_some_and(|&p| p != parent) {
                return false;
            }
            let left_after = whole.left.get(&thread).is_some_and(|&up_to| id <= up_to);
            if !whole.states.contains_key(&key) && left_after {
                return false;
            }
            let before = whole.states.get(&key).copied();
            match (replied, whole.states.get_mut(&key)) {
                (Replied::Follower, None) => {}
                (Replied::Author, None) => {
                    whole.parents.insert(thread, parent);
                    let mut state = ModelState::default();
                    state.read_up_to(id);
                    whole.states.insert(key, state);
                    return true;
                }
                (Replied::Mentioned, None) => {
                    whole.parents.insert(thread, parent);
                    let state = ModelState {
                        last_acked_id: id - 1,
                        last_message_id: id,
                        mention_count: 1,
                        unread_count: 1,
                        muted: false,
                    };
                    whole.states.insert(key, state);
                    return true;
                }
                (Replied::Author, Some(state)) => {
                    if id > state.last_acked_id {
                        state.read_up_to(id);
                    }
                }
                (mentioned, Some(state)) => {
                    if id > state.counted_up_to() {
                        state.last_message_id = id;
                        state.unread_count = state.unread_count.saturating_add(1);
                        let mention = u16::from(mentioned == Replied::Mentioned);
                        state.mention_count = state.mention_count.saturating_add(mention);
                    }
                }
            }
            return whole.states.get(&key).copied() != before;
        }
        Op::AckThreadsOf(parent) => {
            let mut changed = false;
            for (key, state) in whole.states.iter_mut() {
                let of_parent =
                    key.kind == Kind::Thread && whole.parents.get(&key.channel_id) == Some(&parent);
                // As "mark all read": every one reading up to its
                // watermark changes (issue 35, item 9).
                let before = *state;
                if of_parent {
                    state.read_up_to(state.counted_up_to());
                    changed |= *state != before;
                }
            }
            return changed;
        }
        Op::Delete(ref keys) => {
            let mut changed = false;
            for key in keys {
                if let Some(state) = whole.states.remove(key) {
                    changed = true;
                    if key.kind == Kind::Thread {
                        whole.left.insert(key.channel_id, state.counted_up_to());
                    }
                }
                if key.kind == Kind::Channel {
                    let parents = whole.parents.clone();
                    let mut left = Vec::new();
                    whole.states.retain(|k, s| {
                        let gone = k.kind == Kind::Thread
                            && parents.get(&k.channel_id) == Some(&key.channel_id);
                        if gone {
                            left.push((k.channel_id, s.counted_up_to()));
                        }
                        changed |= gone;
                        !gone
                    });
                    whole.left.extend(left);
                }
            }
            return changed;
        }
        Op::DeleteAll => {
            whole.parents.clear();
            whole.left.clear();
            let changed = !whole.states.is_empty();
            whole.states.clear();
            return changed;
        }
        Op::Ack(k, _) | Op::Manual(k, ..) | Op::Message(k, ..) | Op::Mute(k, _)
            if !followed(whole, &k) =>
        {
            return false;
        }
        _ => {}
    }
    let model = &mut whole.states;
    let existing = existing_whole.states;
    match *op {
        Op::Ack(k, id) => {
            let state = model.entry(k).or_default();
            if id > state.last_acked_id {
                state.read_up_to(id);
            }
        }
        Op::Manual(k, id, m, u) => {
            let state = model.entry(k).or_default();
            state.last_acked_id = id;
            state.last_message_id = state.last_message_id.max(id);
            state.mention_count = m;
            state.unread_count = u;
            return true;
        }
        Op::Message(k, id, mentioned) => {
            let state = model.entry(k).or_default();
            if id > state.last_acked_id.max(state.last_message_id) {
                state.last_message_id = id;
                state.unread_count = state.unread_count.saturating_add(1);
                state.mention_count = state.mention_count.saturating_add(u16::from(mentioned));
            }
        }
        Op::MessageDeleted(k, id, mentioned) => {
            if let Some(state) = model.get_mut(&k)
                && state.last_acked_id < id
                && id <= state.last_message_id
            {
                state.unread_count = state.unread_count.saturating_sub(1);
                if mentioned {
                    state.mention_count = state.mention_count.saturating_sub(1);
                }
            }
        }
        Op::AckAll(ref kinds) => {
            for (key, state) in model.iter_mut() {
                if kinds.is_empty() || kinds.contains(&key.kind) {
                    state.read_up_to(state.last_acked_id.max(state.last_message_id));
                }
            }
        }
        Op::Mute(k, muted) => model.entry(k).or_default().muted = muted,
        Op::Write => {}
        _ => unreachable!("applied above"),
    }
    // An untouched fresh read state is not created.
    model.retain(|k, s| existing.contains_key(k) || *s != ModelState::default());
    *model != existing
}

fn apply_real(user: &mut UserReadStates, op: &Op, now_us: u64) {
    let named = |thread: u64, parent_named: bool| match parent_named {
        true => parent_of(thread),
        false => parent_of(thread) + 10,
    };
    match *op {
        Op::Follow(thread, parent_named, id) => {
            let _ = user.follow(thread, named(thread, parent_named), id, now_us);
        }
        Op::Unfollow(thread) => {
            user.unfollow(thread, now_us);
        }
        Op::Reply(thread, parent_named, id, replied) => {
            let _ = user.reply(thread, named(thread, parent_named), id, replied, now_us);
        }
        Op::AckThreadsOf(parent) => {
            user.ack_threads_of(parent, now_us);
        }
        Op::Ack(k, id) => {
            user.ack(k, id, now_us);
        }
        Op::Manual(k, id, m, u) => {
            user.manual_ack(k, id, m, u, now_us);
        }
        Op::Message(k, id, mentioned) => {
            user.message_created(k, id, mentioned, now_us, &NoChannels);
        }
        Op::MessageDeleted(k, id, mentioned) => {
            user.message_deleted(k, id, mentioned, now_us);
        }
        Op::AckAll(ref kinds) => {
            user.ack_all(kinds, now_us, &NoChannels);
        }
        Op::Mute(k, muted) => {
            user.set_muted(k, muted, now_us, &NoChannels);
        }
        Op::Delete(ref keys) => {
            user.delete(keys, now_us);
        }
        Op::DeleteAll => {
            user.delete_all(now_us);
        }
        Op::Write => user.mark_written(user.version()),
    }
}

fn as_model(user: &UserReadStates) -> BTreeMap<Key, ModelState> {
    user.live().map(|e| (e.key(), ModelState::of(e))).collect()
}

fn model_counts(model: &Model) -> Counts {
    let (threads, _) = model_thread_counts(model);
    let counts = (model.states.iter()).fold(Counts::default(), |mut counts, (k, s)| {
        counts.total_mention_count += u64::from(s.mention_count);
        counts.unread_channel_count += u32::from(
            k.kind != Kind::Thread && (s.mention_count > 0 || (s.unread_count > 0 && !s.muted)),
        );
        counts
    });
    Counts {
        unread_thread_count: threads.unread_threads,
        mentioned_thread_count: threads.mentioned_threads,
        ..counts
    }
}

/// The thread totals, counted from the model, overall and by parent.
fn model_thread_counts(model: &Model) -> (ThreadCounts, Vec<(u64, ThreadCounts)>) {
    let mut total = ThreadCounts::default();
    let mut by_parent: BTreeMap<u64, ThreadCounts> = BTreeMap::new();
    for (key, s) in model.states.iter().filter(|(k, _)| k.kind == Kind::Thread) {
        let unread = s.mention_count > 0 || (s.unread_count > 0 && !s.muted);
        let mentioned = s.mention_count > 0;
        if !(unread || mentioned) {
            continue;
        }
        for counts in [
            &mut total,
            by_parent.entry(model.parents[&key.channel_id]).or_default(),
        ] {
            counts.unread_threads += u32::from(unread);
            counts.mentioned_threads += u32::from(mentioned);
        }
    }
    (total, by_parent.into_iter().collect())
}

proptest! {
    #[test]
    fn matches_the_model(ops in prop::collection::vec((op(), 0u64..50), 1..60), checkpoint in 0usize..60) {
        let mut user = UserReadStates::default();
        let mut model = Model::default();
        let mut saved: Option<(u64, BTreeMap<Key, ModelState>)> = None;
        for (i, (op, now_us)) in ops.iter().enumerate() {
            let version = user.version();
            let changed = apply_model(&mut model, op);
            apply_real(&mut user, op, *now_us);
            prop_assert_eq!(as_model(&user), model.states.clone(), "after {:?}", op);
            prop_assert_eq!(user.counts(&NoChannels), model_counts(&model));
            prop_assert_eq!(user.view().thread_counts(), model_thread_counts(&model));
            for key in model.states.keys().filter(|k| k.kind == Kind::Thread) {
                let parent = model.parents[&key.channel_id];
                prop_assert_eq!(user.view().parent_of(key.channel_id), Some(parent));
            }
            if changed {
                prop_assert!(user.version() > version, "a change raises the version");
            } else if !matches!(op, Op::Manual(..) | Op::DeleteAll) {
                prop_assert_eq!(user.version(), version, "no change, same version: {:?}", op);
            }
            let pending_wipe = usize::from(user.pending_clear().is_some());
            prop_assert_eq!(user.unwritten_count(), user.unwritten_entries().count() + pending_wipe);
            prop_assert!(user.live().all(|e| e.version <= user.version()));
            if i == checkpoint {
                saved = Some((user.version(), model.states.clone()));
            }
        }
        // A delta from the checkpoint, applied to what the client held then,
        // gives what the user holds now.
        if let Some((since, mut held)) = saved.filter(|(v, _)| *v > 0) {
            let delta = user.delta(since, &NoChannels);
            if !delta.partial {
                held.clear();
            }
            for key in &delta.deleted {
                held.remove(key);
            }
            for state in &delta.read_states {
                held.insert(state.key(), ModelState::of(state));
            }
            prop_assert_eq!(held, model.states);
        }
    }
}

#[test]
fn a_user_put_together_from_its_parts_tracks_how_its_unwritten_count_changes() {
    let mut rng = fastrand::Rng::with_seed(11);
    let mut user = UserReadStates::default();
    for channel_id in 1..=30 {
        user.message_created(
            Key::channel(channel_id),
            100,
            false,
            channel_id,
            &NoChannels,
        );
    }
    user.mark_written(15);
    let (header, entries) = user.clone().into_parts();
    let mut parts = UserReadStates::from_parts(header, entries);
    let start = user.unwritten_count();
    assert_eq!(parts.unwritten_count(), start, "counted when asked");
    for step in 0..500u64 {
        let key = Key::channel(rng.u64(1..=40));
        let now = 1_000 + step;
        match rng.u8(..6) {
            0 => drop(parts.ack(key, 200 + step, now)),
            1 => drop(parts.message_created(key, 300 + step, true, now, &NoChannels)),
            2 => drop(parts.delete(&[key], now)),
            3 if rng.u8(..20) == 0 => drop(parts.delete_all(now)),
            4 => parts.mark_written(parts.version() - rng.u64(0..3).min(parts.version())),
            _ => drop(parts.set_muted(key, rng.bool(), now, &NoChannels)),
        }
        let counted =
            UserReadStates::from_parts(parts.view().header(), parts.clone().into_parts().1);
        assert_eq!(
            start as isize + parts.unwritten_change(),
            counted.unwritten_count() as isize,
            "step {step}"
        );
    }
}

proptest! {
    /// The search of a user's read states finds what a binary search
    /// finds, on either side of the length where it stops scanning.
    #[test]
    fn search_finds_what_a_binary_search_finds(
        channels in prop::collection::btree_set(1u64..400, 0..(2 * LINEAR_SEARCH)),
        wanted in 0u64..401,
    ) {
        let entries: Vec<ReadState> = channels
            .iter()
            .map(|&channel_id| ReadState::new(Key::channel(channel_id)))
            .collect();
        let key = Key::channel(wanted);
        prop_assert_eq!(
            search(&entries, key),
            entries.binary_search_by_key(&key, ReadState::key)
        );
    }
}
