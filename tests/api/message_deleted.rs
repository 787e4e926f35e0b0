//! MessageDeleted lowers what the message counted, once per deletion.

use std::sync::Arc;
use std::time::Duration;

use readstates::proto::*;
use readstates::store::faulty::{Effect, Fault, FaultyStore, Operation};
use readstates::test_support::{deleted, message};
use tonic::Request;

use crate::helpers::{spawn_app, spawn_app_on, spawn_app_with, test_config};

#[tokio::test]
async fn a_deletion_lowers_only_the_counts_it_raised_and_a_retry_lowers_nothing() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    // Users 1 and 2 were mentioned; user 2 then read past it; user 3 has no
    // read state of the channel.
    c.message_created(message(10, 100, 0, &[1, 2], &[]))
        .await
        .unwrap();
    c.ack(readstates::test_support::ack(2, 10, 100))
        .await
        .unwrap();
    c.message_created(message(10, 101, 0, &[], &[1, 2]))
        .await
        .unwrap();

    let answer = c
        .message_deleted(deleted(10, 100, &[1, 2, 3], &[]))
        .await
        .unwrap();
    assert_eq!(answer.into_inner().updated, 1, "only user 1 counted it");
    let retry = c
        .message_deleted(deleted(10, 100, &[1, 2, 3], &[]))
        .await
        .unwrap();
    assert_eq!(retry.into_inner().updated, 0, "a retry lowers nothing");

    let counts = |s: &ReadState| (s.mention_count, s.unread_count);
    assert_eq!(counts(&app.all_read_states(1).await.read_states[0]), (0, 1));
    assert_eq!(counts(&app.all_read_states(2).await.read_states[0]), (0, 1));
    assert!(
        app.all_read_states(3).await.read_states.is_empty(),
        "none created"
    );

    // Another message's deletion is its own.
    let other = app
        .client
        .message_deleted(deleted(10, 101, &[], &[1, 2]))
        .await
        .unwrap();
    assert_eq!(other.into_inner().updated, 2);
    assert_eq!(counts(&app.all_read_states(1).await.read_states[0]), (0, 0));
    // Counted but already at zero (marked unread with 0): never below zero.
    let manual = AckRequest {
        manual: true,
        ..readstates::test_support::ack(1, 10, 99)
    };
    app.client.ack(manual).await.unwrap();
    let floor = app
        .client
        .message_deleted(deleted(10, 100, &[], &[1]))
        .await;
    assert_eq!(floor.unwrap().into_inner().updated, 0, "remembered anyway");
    let zero = app
        .client
        .message_deleted(deleted(10, 101, &[1], &[]))
        .await;
    assert_eq!(zero.unwrap().into_inner().updated, 0);
    assert_eq!(counts(&app.all_read_states(1).await.read_states[0]), (0, 0));
}

#[tokio::test]
async fn a_retry_after_the_window_may_lower_again() {
    let mut config = test_config();
    config.deletion_dedup_window = Duration::from_millis(200);
    let mut app = spawn_app_with(config).await;
    let c = &mut app.client;
    for id in [100, 101] {
        c.message_created(message(10, id, 0, &[], &[1]))
            .await
            .unwrap();
    }
    c.message_deleted(deleted(10, 100, &[], &[1]))
        .await
        .unwrap();
    let within = c
        .message_deleted(deleted(10, 100, &[], &[1]))
        .await
        .unwrap();
    assert_eq!(within.into_inner().updated, 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = c
        .message_deleted(deleted(10, 100, &[], &[1]))
        .await
        .unwrap();
    assert_eq!(after.into_inner().updated, 1, "as the proto says");
    assert_eq!(app.all_read_states(1).await.read_states[0].unread_count, 0);
}

/// A deletion cut before it applied is applied by its retry; one cut after
/// it applied (during its write) is not applied again.
#[tokio::test]
async fn a_deletion_cut_by_its_deadline_and_retried_lowers_once() {
    let store = Arc::new(FaultyStore::memory());
    let mut config = test_config();
    config.write_delay = Duration::ZERO;
    config.cache_capacity = 1;
    config.shards = 1;
    let mut app = spawn_app_on(config, store.clone()).await;
    for id in [100, 101, 102] {
        let created = message(10, id, 0, &[], &[1, 2]);
        app.client.message_created(created).await.unwrap();
    }
    let cut = |request: MessageDeletedRequest| {
        let mut request = Request::new(request);
        request.set_timeout(Duration::from_millis(30));
        request
    };
    // Users are evicted (capacity 1), so loads come first: cut there.
    store.inject(Fault::new(
        Operation::Load,
        Effect::Delay(Duration::from_millis(200)),
    ));
    let before_apply = app
        .client
        .message_deleted(cut(deleted(10, 100, &[], &[1, 2])))
        .await;
    assert!(before_apply.is_err());
    store.clear();
    let retry = app
        .client
        .message_deleted(deleted(10, 100, &[], &[1, 2]))
        .await;
    assert_eq!(
        retry.unwrap().into_inner().updated,
        2,
        "the retry applies it"
    );

    // Cut while its write is under way: applied already.
    store.inject(Fault::new(
        Operation::Write,
        Effect::Delay(Duration::from_millis(200)),
    ));
    let during_write = app
        .client
        .message_deleted(cut(deleted(10, 101, &[], &[1, 2])))
        .await;
    assert!(during_write.is_err());
    store.clear();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let retry = app
        .client
        .message_deleted(deleted(10, 101, &[], &[1, 2]))
        .await;
    assert_eq!(retry.unwrap().into_inner().updated, 0, "not again");
    for user_id in [1, 2] {
        let state = &app.all_read_states(user_id).await.read_states[0];
        assert_eq!(
            state.unread_count, 1,
            "user {user_id}: lowered twice in all"
        );
    }
}

/// Found in review: the dedup key was (channel, kind, message) alone, so
/// the second request of a deletion split in batches (a message reaching
/// more users than one request may list) was taken for a retry of the
/// first, and its users kept counting the deleted message.
#[tokio::test]
async fn a_deletion_split_in_batches_applies_every_batch_once() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    c.message_created(message(10, 100, 0, &[], &[1, 2, 3, 4]))
        .await
        .unwrap();
    for batch in [[1, 2], [3, 4]] {
        let first = c.message_deleted(deleted(10, 100, &[], &batch)).await;
        assert_eq!(first.unwrap().into_inner().updated, 2, "batch {batch:?}");
        let retry = c.message_deleted(deleted(10, 100, &[], &batch)).await;
        assert_eq!(retry.unwrap().into_inner().updated, 0, "batch {batch:?}");
    }
    for user_id in 1..=4 {
        let state = &app.all_read_states(user_id).await.read_states[0];
        assert_eq!(state.unread_count, 0, "user {user_id}");
    }
}

/// Issue 24, item 3: the dedup key held a hash of the request's user list,
/// so a retry listing other users (a refreshed member list, another split)
/// was a new deletion, and lowered its users a second time. Each user is
/// lowered at most once per deleted message, whatever the batching.
#[tokio::test]
async fn a_retry_with_another_user_list_lowers_each_user_at_most_once() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    for id in [1, 2] {
        c.message_created(message(10, id, 0, &[], &[1]))
            .await
            .unwrap();
    }
    c.message_created(message(10, 1, 0, &[], &[2]))
        .await
        .unwrap();
    let first = c.message_deleted(deleted(10, 1, &[], &[1])).await;
    assert_eq!(first.unwrap().into_inner().updated, 1);
    let retry = c.message_deleted(deleted(10, 1, &[], &[1])).await;
    assert_eq!(retry.unwrap().into_inner().updated, 0);
    let refreshed = c.message_deleted(deleted(10, 1, &[], &[1, 2])).await;
    assert_eq!(
        refreshed.unwrap().into_inner().updated,
        1,
        "user 2 only: user 1 was lowered already"
    );
    // Split the other way, and with user 1 named as mentioned this time.
    let split = c.message_deleted(deleted(10, 1, &[1], &[2])).await;
    assert_eq!(split.unwrap().into_inner().updated, 0);
    let unread = |r: GetReadStatesResponse| r.read_states[0].unread_count;
    assert_eq!(
        unread(app.all_read_states(1).await),
        1,
        "message 2 is unread"
    );
    assert_eq!(unread(app.all_read_states(2).await), 0);
}
