//! Thread read states over gRPC: following, replies, totals overall and by
//! parent, acks, unfollowing, cascades, mutes, deletions, bad input, a
//! restart of the embedded store and a move to another node.

use readstates::config::StoreKind;
use readstates::proto::*;
use readstates::test_support::{ack, delete, message};
use tonic::Code;

use crate::fleet::{add, member, set_weight, shared};
use crate::helpers::{TestApp, spawn_app, spawn_app_with, test_config};
use crate::watch::Watcher;

const THREAD: i32 = ReadStateKind::Thread as i32;
const PARENT: u64 = 10;
const OTHER_PARENT: u64 = 11;

fn follow(user_id: u64, thread_id: u64, parent_id: u64, at: u64) -> FollowThreadRequest {
    FollowThreadRequest {
        user_id,
        thread_id,
        parent_id,
        last_message_id: at,
        follow: true,
    }
}

fn unfollow(user_id: u64, thread_id: u64) -> FollowThreadRequest {
    FollowThreadRequest {
        user_id,
        thread_id,
        ..FollowThreadRequest::default()
    }
}

/// A reply `id` in `thread` of `parent`.
fn reply(
    thread: u64,
    parent: u64,
    id: u64,
    author: u64,
    mentioned: &[u64],
    followers: &[u64],
) -> MessageCreatedRequest {
    MessageCreatedRequest {
        kind: THREAD,
        parent_id: parent,
        ..message(thread, id, author, mentioned, followers)
    }
}

async fn read_states(app: &mut TestApp, user_id: u64) -> GetReadStatesResponse {
    let request = GetReadStatesRequest {
        user_id,
        ..GetReadStatesRequest::default()
    };
    app.client
        .get_read_states(request)
        .await
        .unwrap()
        .into_inner()
}

/// (unread threads, mentioned threads) of the user's totals.
async fn thread_totals(app: &mut TestApp, user_id: u64) -> (u32, u32) {
    let answer = read_states(app, user_id).await;
    (answer.unread_thread_count, answer.mentioned_thread_count)
}

/// The user's thread read state of `thread`, if followed.
async fn thread_state(app: &mut TestApp, user_id: u64, thread: u64) -> Option<ReadState> {
    (read_states(app, user_id).await.read_states.into_iter())
        .find(|s| s.kind == THREAD && s.channel_id == thread)
}

#[tokio::test]
async fn a_reply_counts_for_followers_in_the_thread_and_never_in_the_parent() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    // 1 follows; 2 is listed as a follower but follows nothing; 3 writes; 4
    // is mentioned.
    c.ack(ack(1, PARENT, 50)).await.unwrap();
    let followed = c.follow_thread(follow(1, 100, PARENT, 60)).await.unwrap();
    let state = followed.into_inner().read_state.unwrap();
    assert_eq!((state.parent_id, state.last_acked_id), (PARENT, 60));
    let sent = reply(100, PARENT, 61, 3, &[4], &[1, 2]);
    assert_eq!(
        c.message_created(sent.clone())
            .await
            .unwrap()
            .into_inner()
            .updated,
        3
    );
    assert_eq!(
        c.message_created(sent).await.unwrap().into_inner().updated,
        0,
        "a retry"
    );

    let one = thread_state(&mut app, 1, 100).await.unwrap();
    assert_eq!(
        (one.unread_count, one.mention_count, one.parent_id),
        (1, 0, PARENT)
    );
    assert!(
        thread_state(&mut app, 2, 100).await.is_none(),
        "not a follower"
    );
    let author = thread_state(&mut app, 3, 100).await.unwrap();
    assert_eq!((author.last_acked_id, author.unread_count), (61, 0));
    let mentioned = thread_state(&mut app, 4, 100).await.unwrap();
    assert_eq!((mentioned.unread_count, mentioned.mention_count), (1, 1));
    // The parent channel did not move; its unread count is not the thread's.
    let answer = read_states(&mut app, 1).await;
    let parent = (answer.read_states.iter()).find(|s| s.kind == 0 && s.channel_id == PARENT);
    assert_eq!(parent.unwrap().unread_count, 0);
    assert_eq!(
        (answer.unread_channel_count, answer.unread_thread_count),
        (0, 1)
    );
    // A thread mention counts toward the user's mentions and badges.
    let answer = read_states(&mut app, 4).await;
    assert_eq!(answer.total_mention_count, 1);
    let badges = app
        .client
        .get_badge_counts(GetBadgeCountsRequest { user_ids: vec![4] });
    let badge = badges.await.unwrap().into_inner().counts[0];
    assert_eq!(badge.total_mention_count, 1);
    assert_eq!(
        (badge.unread_thread_count, badge.mentioned_thread_count),
        (1, 1)
    );
    assert_eq!(badge.unread_channel_count, 0);
}

#[tokio::test]
async fn totals_by_parent_clear_when_every_thread_is_read_and_never_go_negative() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    for (thread, parent) in [(100, PARENT), (101, PARENT), (200, OTHER_PARENT)] {
        c.follow_thread(follow(1, thread, parent, 1)).await.unwrap();
        c.message_created(reply(thread, parent, 5, 0, &[], &[1]))
            .await
            .unwrap();
    }
    c.message_created(reply(101, PARENT, 6, 0, &[1], &[]))
        .await
        .unwrap();
    let answer = read_states(&mut app, 1).await;
    assert_eq!(
        (answer.unread_thread_count, answer.mentioned_thread_count),
        (3, 1)
    );
    let by_parent: Vec<(u64, u32, u32)> = (answer.thread_counts.iter())
        .map(|c| (c.parent_id, c.unread_thread_count, c.mentioned_thread_count))
        .collect();
    assert_eq!(by_parent, [(PARENT, 2, 1), (OTHER_PARENT, 1, 0)]);

    // Mattermost #25724: deleting a reply twice, and a reply deleted after
    // its thread was read, lower nothing below zero.
    let c = &mut app.client;
    let deleted = MessageDeletedRequest {
        channel_id: 101,
        message_id: 6,
        mentioned_user_ids: vec![1],
        kind: THREAD,
        ..MessageDeletedRequest::default()
    };
    for _ in 0..2 {
        c.message_deleted(deleted.clone()).await.unwrap();
    }
    assert_eq!(thread_totals(&mut app, 1).await, (3, 0));
    // Mattermost #22060: once every thread is read (one by its ack, one
    // parent's at once, the rest by AckAll), nothing is left.
    let c = &mut app.client;
    let read = AckRequest {
        kind: THREAD,
        ..ack(1, 100, 5)
    };
    assert!(c.ack(read).await.unwrap().into_inner().applied);
    let parent_only = AckAllRequest {
        user_id: 1,
        kinds: vec![THREAD],
        parent_id: OTHER_PARENT,
    };
    assert_eq!(
        c.ack_all(parent_only).await.unwrap().into_inner().updated,
        1
    );
    assert_eq!(thread_totals(&mut app, 1).await, (1, 0));
    let c = &mut app.client;
    let all = AckAllRequest {
        user_id: 1,
        ..AckAllRequest::default()
    };
    assert_eq!(c.ack_all(all).await.unwrap().into_inner().updated, 1);
    assert_eq!(thread_totals(&mut app, 1).await, (0, 0));
    app.client.message_deleted(deleted).await.unwrap();
    assert_eq!(thread_totals(&mut app, 1).await, (0, 0));
    assert!(read_states(&mut app, 1).await.thread_counts.is_empty());
}

#[tokio::test]
async fn unfollowing_a_thread_or_deleting_its_parent_takes_it_and_its_counts_away() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    c.ack(ack(1, PARENT, 1)).await.unwrap();
    for thread in [100, 101] {
        c.follow_thread(follow(1, thread, PARENT, 1)).await.unwrap();
        c.message_created(reply(thread, PARENT, 5, 0, &[1], &[]))
            .await
            .unwrap();
    }
    c.follow_thread(follow(1, 200, OTHER_PARENT, 1))
        .await
        .unwrap();
    let version = read_states(&mut app, 1).await.version;
    let c = &mut app.client;
    let left = c
        .follow_thread(unfollow(1, 100))
        .await
        .unwrap()
        .into_inner();
    assert!(left.applied && left.read_state.is_none());
    assert!(
        !c.follow_thread(unfollow(1, 100))
            .await
            .unwrap()
            .into_inner()
            .applied
    );
    assert_eq!(thread_totals(&mut app, 1).await, (1, 1));
    // The parent's read state goes, and its threads with it.
    let c = &mut app.client;
    c.delete_read_states(delete(1, &[PARENT], false))
        .await
        .unwrap();
    assert_eq!(thread_totals(&mut app, 1).await, (0, 0));
    assert!(
        thread_state(&mut app, 1, 200).await.is_some(),
        "another parent's"
    );
    let delta = GetReadStatesRequest {
        user_id: 1,
        since_version: version,
        ..GetReadStatesRequest::default()
    };
    let delta = app
        .client
        .get_read_states(delta)
        .await
        .unwrap()
        .into_inner();
    let gone: Vec<u64> = (delta.deleted.iter())
        .filter(|k| k.kind == THREAD)
        .map(|k| k.channel_id)
        .collect();
    assert_eq!(gone, [100, 101], "reported in deltas");
}

#[tokio::test]
async fn a_muted_thread_counts_only_its_mentions() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    c.follow_thread(follow(1, 100, PARENT, 1)).await.unwrap();
    let mute = SetMutedRequest {
        user_id: 1,
        channel_id: 100,
        kind: THREAD,
        muted: true,
    };
    assert!(c.set_muted(mute).await.unwrap().into_inner().applied);
    c.message_created(reply(100, PARENT, 5, 0, &[], &[1]))
        .await
        .unwrap();
    assert_eq!(thread_totals(&mut app, 1).await, (0, 0));
    let c = &mut app.client;
    c.message_created(reply(100, PARENT, 6, 0, &[1], &[]))
        .await
        .unwrap();
    assert_eq!(thread_totals(&mut app, 1).await, (1, 1));
}

#[tokio::test]
async fn bad_thread_requests_get_clear_statuses_and_change_nothing() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    c.follow_thread(follow(1, 100, PARENT, 1)).await.unwrap();
    let version = read_states(&mut app, 1).await.version;
    let c = &mut app.client;
    let cases: Vec<(&str, tonic::Status)> = vec![
        // A thread whose parent changes: refused whole, for every user.
        (
            "parent_id",
            c.message_created(reply(100, OTHER_PARENT, 5, 2, &[], &[1]))
                .await
                .unwrap_err(),
        ),
        (
            "parent_id",
            c.follow_thread(follow(1, 100, OTHER_PARENT, 1))
                .await
                .unwrap_err(),
        ),
        // A reply naming no parent, a parent on another kind, a thread
        // that would be its own parent.
        (
            "parent_id",
            c.message_created(reply(100, 0, 5, 0, &[], &[1]))
                .await
                .unwrap_err(),
        ),
        (
            "parent_id",
            c.message_created(MessageCreatedRequest {
                parent_id: PARENT,
                ..message(PARENT, 5, 0, &[], &[1])
            })
            .await
            .unwrap_err(),
        ),
        (
            "parent_id",
            c.follow_thread(follow(1, 300, 300, 1)).await.unwrap_err(),
        ),
        (
            "parent_id",
            c.follow_thread(follow(1, 300, 0, 1)).await.unwrap_err(),
        ),
        (
            "kinds",
            // A parent's threads with no kind: what a build without threads
            // would take for "mark everything read".
            c.ack_all(AckAllRequest {
                user_id: 1,
                kinds: vec![],
                parent_id: PARENT,
            })
            .await
            .unwrap_err(),
        ),
    ];
    for (field, status) in cases {
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(field), "{status:?}");
    }
    assert_eq!(
        read_states(&mut app, 1).await.version,
        version,
        "nothing changed"
    );
    assert!(
        thread_state(&mut app, 2, 100).await.is_none(),
        "nor for the author"
    );
    // Other changes do not make a thread read state (no parent to give it).
    let c = &mut app.client;
    let acked = AckRequest {
        kind: THREAD,
        ..ack(1, 999, 5)
    };
    assert!(!c.ack(acked).await.unwrap().into_inner().applied);
    assert!(thread_state(&mut app, 1, 999).await.is_none());
}

#[tokio::test]
async fn a_user_follows_at_most_ten_thousand_threads() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    for thread in 1..=10_000u64 {
        c.follow_thread(follow(1, thread + 1_000, PARENT, 1))
            .await
            .unwrap();
    }
    let full = c
        .follow_thread(follow(1, 99_999, PARENT, 1))
        .await
        .unwrap_err();
    assert_eq!(full.code(), Code::ResourceExhausted, "{full:?}");
    // A reply does not make the user follow one more, and still counts for
    // the others.
    let sent = reply(99_999, PARENT, 5, 0, &[1, 2], &[]);
    assert_eq!(
        c.message_created(sent).await.unwrap().into_inner().updated,
        1
    );
    assert!(thread_state(&mut app, 1, 99_999).await.is_none());
    let c = &mut app.client;
    c.follow_thread(unfollow(1, 1_001)).await.unwrap();
    c.follow_thread(follow(1, 99_999, PARENT, 1)).await.unwrap();
}

#[tokio::test]
async fn a_watched_follower_is_told_each_reply_with_its_thread_totals() {
    let mut app = spawn_app().await;
    let mut watcher = Watcher::open(&app).await;
    watcher.subscribe(1, 0).await;
    watcher.changed().await;
    let c = &mut app.client;
    c.follow_thread(follow(1, 100, PARENT, 1)).await.unwrap();
    let (_, followed) = watcher.changed().await;
    assert_eq!(followed.read_states[0].parent_id, PARENT);
    c.message_created(reply(100, PARENT, 5, 0, &[1], &[]))
        .await
        .unwrap();
    let (_, replied) = watcher.changed().await;
    assert_eq!(replied.read_states[0].mention_count, 1);
    assert_eq!(
        (replied.unread_thread_count, replied.mentioned_thread_count),
        (1, 1)
    );
    assert_eq!(replied.unread_channel_count, 0);
}

#[tokio::test]
async fn thread_read_states_and_their_parents_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config();
    config.store = StoreKind::Embedded;
    config.data_dir = dir.path().to_owned();
    let mut app = spawn_app_with(config.clone()).await;
    app.client
        .follow_thread(follow(1, 100, PARENT, 1))
        .await
        .unwrap();
    app.client
        .message_created(reply(100, PARENT, 5, 0, &[1], &[]))
        .await
        .unwrap();
    let before = read_states(&mut app, 1).await;
    assert_eq!(app.stop().await.unwritten, 0);
    let mut app = spawn_app_with(config).await;
    let after = read_states(&mut app, 1).await;
    assert_eq!(after.read_states, before.read_states);
    assert_eq!(after.thread_counts, before.thread_counts);
    // The parent is known again: another one is refused.
    let moved = app
        .client
        .follow_thread(follow(1, 100, OTHER_PARENT, 1))
        .await;
    assert_eq!(moved.unwrap_err().code(), Code::InvalidArgument);
}

#[tokio::test]
async fn a_user_moved_to_another_node_keeps_their_threads_and_parents() {
    let (store, ring) = shared();
    let mut a = member("a", &store, &ring).await;
    let mut b = member("b", &store, &ring).await;
    add(&ring, "a", &a, 100).await;
    add(&ring, "b", &b, 0).await;
    let users: Vec<u64> = (1..=40).collect();
    for &user in &users {
        a.client
            .follow_thread(follow(user, 100, PARENT, 1))
            .await
            .unwrap();
        a.client
            .message_created(reply(100, PARENT, 5, 0, &[user], &[]))
            .await
            .unwrap();
    }
    // Handed over warm (the write delay is 30 s: nothing is in the store).
    set_weight(&ring, "b", 100).await;
    for &user in &users {
        let state = thread_state(&mut b, user, 100).await.unwrap();
        assert_eq!(
            (state.parent_id, state.mention_count),
            (PARENT, 1),
            "user {user}"
        );
        let moved = b
            .client
            .follow_thread(follow(user, 100, OTHER_PARENT, 1))
            .await;
        assert_eq!(
            moved.unwrap_err().code(),
            Code::InvalidArgument,
            "user {user}"
        );
    }
    let _ = &mut a;
}

/// Off by default, until every node of a fleet runs a build that reads
/// thread read states: nothing makes one, everything else works.
#[tokio::test]
async fn a_node_without_threads_refuses_what_would_make_a_thread_read_state() {
    let mut config = test_config();
    config.threads = false;
    let mut app = spawn_app_with(config).await;
    let c = &mut app.client;
    let refused = c
        .follow_thread(follow(1, 100, PARENT, 1))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("--threads"), "{refused:?}");
    let reply = c.message_created(reply(100, PARENT, 5, 1, &[2], &[])).await;
    assert_eq!(reply.unwrap_err().code(), Code::FailedPrecondition);
    assert!(read_states(&mut app, 1).await.read_states.is_empty());
    let c = &mut app.client;
    c.message_created(message(PARENT, 5, 1, &[2], &[]))
        .await
        .unwrap();
    // Leaving a thread makes nothing, and is taken.
    let left = c.follow_thread(unfollow(1, 100)).await.unwrap();
    assert!(!left.into_inner().applied);
}
