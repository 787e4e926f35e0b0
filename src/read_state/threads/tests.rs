//! Thread read states, rule by rule.

use super::*;
use crate::read_state::{MAX_TOMBSTONES_PER_USER, TOMBSTONE_RETENTION};

const PARENT: u64 = 10;
const OTHER_PARENT: u64 = 11;
const T1: u64 = 100;
const T2: u64 = 200;

fn key(thread_id: u64) -> Key {
    thread(thread_id)
}

fn counts(user: &UserReadStates) -> ThreadCounts {
    user.view().thread_counts().0
}

#[test]
fn a_thread_read_state_keeps_its_parent_and_only_followers_have_one() {
    let mut user = UserReadStates::default();
    // A reply to a thread the user does not follow counts nothing.
    assert_eq!(user.reply(T1, PARENT, 5, Replied::Follower, 1), Ok(false));
    assert!(user.get(key(T1)).is_none());
    assert_eq!(user.follow(T1, PARENT, 4, 2), Ok(true));
    assert_eq!(user.follow(T1, PARENT, 4, 3), Ok(false), "followed already");
    assert_eq!(user.view().parent_of(T1), Some(PARENT));
    assert_eq!(user.reply(T1, PARENT, 5, Replied::Follower, 4), Ok(true));
    assert_eq!(
        user.reply(T1, PARENT, 5, Replied::Follower, 5),
        Ok(false),
        "a retry"
    );
    assert_eq!(user.get(key(T1)).unwrap().unread_count, 1);
    // Never in the parent channel, nor made by another change.
    assert!(user.get(Key::channel(PARENT)).is_none());
    assert_eq!(user.ack(key(T2), 9, 6), None);
    let created = user.message_created(key(T2), 9, true, 7, &crate::read_state::NoChannels);
    assert!(!created);
    assert!(user.get(key(T2)).is_none());
}

#[test]
fn a_thread_never_moves_to_another_parent() {
    let mut user = UserReadStates::default();
    user.follow(T1, PARENT, 4, 1).unwrap();
    let moved = ThreadRefusal::ParentChanged {
        thread_id: T1,
        parent_id: PARENT,
    };
    assert_eq!(user.follow(T1, OTHER_PARENT, 4, 2), Err(moved));
    assert_eq!(
        user.reply(T1, OTHER_PARENT, 5, Replied::Mentioned, 3),
        Err(moved)
    );
    // Unfollowed, it is still known by its parent.
    assert!(user.unfollow(T1, 4));
    assert_eq!(user.follow(T1, OTHER_PARENT, 4, 5), Err(moved));
    assert_eq!(user.version(), 4, "nothing refused changed anything");
}

#[test]
fn authors_and_mentioned_users_follow_by_replying() {
    let mut user = UserReadStates::default();
    assert_eq!(user.reply(T1, PARENT, 7, Replied::Mentioned, 1), Ok(true));
    let state = *user.get(key(T1)).unwrap();
    assert_eq!((state.mention_count, state.unread_count), (1, 1));
    assert_eq!(
        state.last_acked_id, 6,
        "counts from the reply that made it follow"
    );
    assert_eq!(
        user.reply(T1, PARENT, 7, Replied::Mentioned, 2),
        Ok(false),
        "a retry"
    );
    assert_eq!(user.reply(T2, PARENT, 8, Replied::Author, 3), Ok(true));
    let state = *user.get(key(T2)).unwrap();
    assert_eq!((state.last_acked_id, state.unread_count), (8, 0));
    assert_eq!(user.view().parent_of(T2), Some(PARENT));
}

#[test]
fn totals_count_threads_overall_and_by_parent_and_clear_when_read() {
    let mut user = UserReadStates::default();
    user.follow(T1, PARENT, 1, 1).unwrap();
    user.follow(T2, OTHER_PARENT, 1, 2).unwrap();
    user.reply(T1, PARENT, 5, Replied::Mentioned, 3).unwrap();
    user.reply(T1, PARENT, 6, Replied::Follower, 4).unwrap();
    user.reply(T2, OTHER_PARENT, 7, Replied::Follower, 5)
        .unwrap();
    let (total, by_parent) = user.view().thread_counts();
    assert_eq!(
        total,
        ThreadCounts {
            unread_threads: 2,
            mentioned_threads: 1
        }
    );
    let of = |parent| by_parent.iter().find(|&&(p, _)| p == parent).unwrap().1;
    assert_eq!(of(PARENT).mentioned_threads, 1);
    assert_eq!(of(OTHER_PARENT).unread_threads, 1);
    // Thread mentions count toward the user's mentions; unread threads make
    // no channel unread.
    let badges = user.counts(&crate::read_state::NoChannels);
    assert_eq!(badges.total_mention_count, 1);
    assert_eq!(badges.unread_channel_count, 0);

    // Mattermost #22060 (a phantom unread thread that never clears): every
    // thread read, nothing is left.
    user.ack(key(T1), 6, 6).unwrap();
    user.ack_threads_of(OTHER_PARENT, 7);
    assert_eq!(
        user.view().thread_counts(),
        (ThreadCounts::default(), vec![])
    );
}

#[test]
fn thread_totals_never_go_negative_however_replies_are_deleted_and_threads_left() {
    // Mattermost #25724 (a negative unread thread count): deleting replies
    // twice, and leaving a thread with unread replies, lowers nothing below
    // zero, since totals are counted, never kept.
    let mut user = UserReadStates::default();
    user.follow(T1, PARENT, 1, 1).unwrap();
    user.reply(T1, PARENT, 5, Replied::Mentioned, 2).unwrap();
    for now in 3..6 {
        user.message_deleted(key(T1), 5, true, now);
    }
    assert_eq!(counts(&user), ThreadCounts::default());
    user.reply(T1, PARENT, 6, Replied::Follower, 7).unwrap();
    assert_eq!(counts(&user).unread_threads, 1);
    assert!(user.unfollow(T1, 8));
    assert_eq!(counts(&user), ThreadCounts::default());
    assert!(!user.unfollow(T1, 9), "left already");
}

#[test]
fn a_muted_thread_counts_only_with_a_mention() {
    let mut user = UserReadStates::default();
    user.follow(T1, PARENT, 1, 1).unwrap();
    let channels = crate::read_state::NoChannels;
    assert!(user.set_muted(key(T1), true, 2, &channels));
    user.reply(T1, PARENT, 5, Replied::Follower, 3).unwrap();
    assert_eq!(counts(&user), ThreadCounts::default());
    user.reply(T1, PARENT, 6, Replied::Mentioned, 4).unwrap();
    assert_eq!(
        counts(&user),
        ThreadCounts {
            unread_threads: 1,
            mentioned_threads: 1
        }
    );
}

#[test]
fn ack_all_covers_threads_or_one_parents_only() {
    let mut user = UserReadStates::default();
    let channels = crate::read_state::NoChannels;
    user.follow(T1, PARENT, 1, 1).unwrap();
    user.follow(T2, OTHER_PARENT, 1, 2).unwrap();
    user.reply(T1, PARENT, 5, Replied::Follower, 3).unwrap();
    user.reply(T2, OTHER_PARENT, 6, Replied::Follower, 4)
        .unwrap();
    assert_eq!(user.ack_threads_of(PARENT, 5), 1);
    assert_eq!(
        user.get(key(T2)).unwrap().unread_count,
        1,
        "another parent's"
    );
    assert_eq!(user.ack_all(&[], 6, &channels), 1);
    assert_eq!(counts(&user), ThreadCounts::default());
}

#[test]
fn deleting_a_parent_deletes_its_threads() {
    let mut user = UserReadStates::default();
    user.ack(Key::channel(PARENT), 1, 1).unwrap();
    user.follow(T1, PARENT, 1, 2).unwrap();
    user.follow(T2, OTHER_PARENT, 1, 3).unwrap();
    assert_eq!(user.delete(&[Key::channel(PARENT)], 4), 2);
    assert!(user.get(key(T1)).is_none());
    assert!(user.get(key(T2)).is_some(), "another parent's");
    let delta = user.view().delta(3, &crate::read_state::NoChannels);
    assert!(delta.deleted.contains(&key(T1)), "reported in deltas");
}

#[test]
fn a_user_follows_a_bounded_number_of_threads() {
    let mut user = UserReadStates::default();
    for thread_id in 1..=MAX_THREADS as u64 {
        user.follow(thread_id, PARENT, 1, thread_id).unwrap();
    }
    let full = ThreadRefusal::TooManyThreads { limit: MAX_THREADS };
    let next = MAX_THREADS as u64 + 1;
    assert_eq!(user.follow(next, PARENT, 1, next), Err(full));
    assert_eq!(
        user.reply(next, PARENT, 5, Replied::Mentioned, next),
        Err(full)
    );
    // Following one already followed, or a reply in it, still works.
    assert_eq!(user.reply(1, PARENT, 5, Replied::Follower, next), Ok(true));
    assert!(user.unfollow(2, next + 1));
    assert_eq!(user.follow(next, PARENT, 1, next + 2), Ok(true));
}

#[test]
fn a_redelivered_reply_does_not_make_a_user_follow_a_thread_they_left() {
    let mut user = UserReadStates::default();
    user.reply(T1, PARENT, 5, Replied::Mentioned, 1).unwrap();
    user.ack(key(T1), 5, 2).unwrap();
    assert!(user.unfollow(T1, 3));
    assert_eq!(
        user.reply(T1, PARENT, 5, Replied::Mentioned, 4),
        Ok(false),
        "redelivered"
    );
    assert_eq!(
        user.reply(T1, PARENT, 4, Replied::Author, 5),
        Ok(false),
        "late"
    );
    assert!(user.get(key(T1)).is_none());
    // A newer reply mentioning them, or following again, does.
    assert_eq!(user.reply(T1, PARENT, 6, Replied::Mentioned, 6), Ok(true));
    assert_eq!(counts(&user).mentioned_threads, 1);
    // So does a channel's deletion, for its threads.
    user.delete(&[Key::channel(PARENT)], 7);
    assert_eq!(user.reply(T1, PARENT, 6, Replied::Mentioned, 8), Ok(false));
    assert_eq!(user.follow(T1, PARENT, 6, 9), Ok(true));
}

#[test]
fn ids_the_wire_never_sends_make_no_thread_and_no_panic() {
    let mut user = UserReadStates::default();
    // A parent of 0: no thread read state without its parent.
    assert_eq!(user.follow(T1, 0, 1, 1), Ok(false));
    assert_eq!(user.reply(T1, 0, 5, Replied::Mentioned, 2), Ok(false));
    assert!(user.get(key(T1)).is_none());
    // A mention in message 0 follows from 0, not from below it.
    assert_eq!(user.reply(T1, PARENT, 0, Replied::Mentioned, 3), Ok(true));
    assert_eq!(user.get(key(T1)).unwrap().last_acked_id, 0);
}

/// Issue 35, item 9: with a parent, AckAll read only threads that had
/// counts, so a thread whose reply was deleted (no counts, acked below its
/// watermark) was left unread up to it, unlike AckAll of kind THREAD.
#[test]
fn acking_a_parent_s_threads_reads_each_up_to_its_watermark() {
    let mut user = UserReadStates::default();
    user.reply(T1, PARENT, 3, Replied::Mentioned, 1).unwrap();
    assert!(user.message_deleted(key(T1), 3, true, 2));
    let thread = user.get(key(T1)).unwrap();
    assert_eq!(
        (
            thread.last_acked_id,
            thread.mention_count,
            thread.unread_count
        ),
        (2, 0, 0)
    );
    assert_eq!(user.ack_threads_of(PARENT, 3), 1);
    let thread = user.get(key(T1)).unwrap();
    assert_eq!((thread.last_acked_id, thread.last_message_id), (3, 3));
    assert_eq!(user.ack_threads_of(PARENT, 4), 0, "read already");
}

/// Issue 35, item 8: tombstones were capped at 256 a user and dropped by
/// version, so deleting a parent of 257 threads (one version for all)
/// dropped every tombstone once written: a redelivered reply brought a
/// phantom unread thread back (Mattermost #22060), and a thread could
/// change parent. A thread's tombstone goes only with age, or past as
/// many as a user may follow, and a parent's deletion keeps them all.
#[test]
fn a_parent_s_deletion_keeps_every_thread_s_tombstone() {
    let mut user = UserReadStates::default();
    let threads = MAX_TOMBSTONES_PER_USER as u64 + 1;
    for i in 0..threads {
        user.follow(2000 + i, 200, 5, 1 + i).unwrap();
    }
    let now = 1000;
    user.reply(2000, 200, 10, Replied::Mentioned, now).unwrap();
    assert_eq!(user.delete(&[Key::channel(200)], now + 1), threads as u32);
    user.mark_written(user.version());
    assert_eq!(user.prune_tombstones(now + 2), 0);
    assert_eq!(
        user.reply(2000, 200, 10, Replied::Mentioned, now + 3),
        Ok(false)
    );
    assert!(user.get(key(2000)).is_none());
    assert!(matches!(
        user.follow(2001, 999, 5, now + 4),
        Err(ThreadRefusal::ParentChanged { .. })
    ));
    // Gone with age, as the docs say.
    let week_later = user.version() + TOMBSTONE_RETENTION.as_micros() as u64 + 1;
    assert_eq!(user.prune_tombstones(week_later), threads as usize);
}

/// Channels' tombstones still stop at 256, oldest first, without taking a
/// thread's with them.
#[test]
fn the_cap_on_channel_tombstones_spares_the_threads() {
    let mut user = UserReadStates::default();
    user.follow(T1, PARENT, 5, 1).unwrap();
    assert!(user.unfollow(T1, 2));
    let channels = MAX_TOMBSTONES_PER_USER as u64 + 10;
    for channel_id in 1..=channels {
        user.ack(Key::channel(channel_id), 1, 2 + channel_id);
    }
    for channel_id in 1..=channels {
        user.delete(&[Key::channel(channel_id)], 1000 + channel_id);
    }
    user.mark_written(user.version());
    assert_eq!(user.prune_tombstones(2000), 10);
    assert!(matches!(
        user.follow(T1, OTHER_PARENT, 5, 3000),
        Err(ThreadRefusal::ParentChanged { .. })
    ));
    assert!(!user.delta(1, &crate::read_state::NoChannels).partial);
}

/// Found in review of issue 35, item 8: the cap dropped every tombstone of
/// the version it cut at, so one more tombstone past the cap dropped a
/// whole change's (a parent's 10,000 threads, or 300 channels deleted in
/// one call). A change's tombstones now stay together past the cap, until
/// they expire or an older change's go first.
#[test]
fn one_more_tombstone_past_the_cap_drops_no_change_s_tombstones() {
    let mut user = UserReadStates::default();
    let channels = MAX_TOMBSTONES_PER_USER as u64 + 44;
    let keys: Vec<Key> = (1..=channels).map(Key::channel).collect();
    for (now, &key) in keys.iter().enumerate() {
        user.ack(key, 1, now as u64 + 1);
    }
    assert_eq!(user.delete(&keys, 1_000), channels as u32);
    user.ack(Key::channel(5_000), 1, 1_001);
    user.delete(&[Key::channel(5_000)], 1_002);
    user.mark_written(user.version());
    assert_eq!(user.prune_tombstones(2_000), 0);
    assert!(user.get(Key::channel(1)).is_none());
    assert_eq!(user.len(), channels as usize + 1, "every tombstone kept");
}
