//! The embedded store across a graceful restart: nothing acknowledged is lost.

use readstates::config::StoreKind;
use readstates::proto::{MessageDeletedRequest, ReadState};
use readstates::test_support::ack;
use readstates::test_support::delete;
use readstates::test_support::message;

use crate::helpers::{spawn_app_with, test_config};

async fn everything(app: &mut crate::helpers::TestApp, user_id: u64) -> (u64, Vec<ReadState>) {
    let response = app.all_read_states(user_id).await;
    (response.version, response.read_states)
}

#[tokio::test]
async fn a_restart_of_the_embedded_store_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config();
    config.store = StoreKind::Embedded;
    config.data_dir = dir.path().to_owned();
    config.cache_capacity = 8; // some users are evicted along the way

    let mut app = spawn_app_with(config.clone()).await;
    for user_id in 1..=6 {
        app.client
            .message_created(message(10, 100, 0, &[user_id], &[]))
            .await
            .unwrap();
        app.client.ack(ack(user_id, 11, 100)).await.unwrap();
        app.client.ack(ack(user_id, 12, 100)).await.unwrap();
    }
    app.client
        .delete_read_states(delete(1, &[12], false))
        .await
        .unwrap();
    app.client
        .delete_read_states(delete(2, &[], true))
        .await
        .unwrap();
    let mut before = Vec::new();
    for user_id in 1..=6 {
        before.push(everything(&mut app, user_id).await);
    }
    // The write delay (30 s) has not passed: only shutdown writes these.
    assert_eq!(app.stop().await.unwritten, 0);

    let mut app = spawn_app_with(config).await;
    for user_id in 1..=6 {
        let (version, states) = everything(&mut app, user_id).await;
        let (old_version, old_states) = &before[user_id as usize - 1];
        assert_eq!(&states, old_states, "user {user_id}");
        assert!(version >= *old_version, "user {user_id}: version went back");
    }
    assert_eq!(before[0].1.len(), 2, "the deleted read state stays deleted");
    assert!(before[1].1.is_empty(), "the wiped user stays wiped");

    // And the next change still gets a higher version.
    let next = app.client.ack(ack(1, 13, 100)).await.unwrap().into_inner();
    assert!(next.version > before[0].0);
    app.stop().await;
}

/// Issue 35, item 5: what a user was lowered for by a deletion lived only
/// in memory, so a MessageDeleted retried after a restart, within the
/// window, lowered the user again (unread 1 -> 0 while a message was still
/// unread). It is written with the user and read back with it.
#[tokio::test]
async fn a_deletion_retried_after_a_restart_lowers_nobody_again() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config();
    config.store = StoreKind::Embedded;
    config.data_dir = dir.path().to_owned();
    let deleted = MessageDeletedRequest {
        channel_id: 10,
        message_id: 101,
        unread_user_ids: vec![7],
        ..MessageDeletedRequest::default()
    };
    let mut app = spawn_app_with(config.clone()).await;
    for id in [101, 102] {
        let created = message(10, id, 0, &[], &[7]);
        app.client.message_created(created).await.unwrap();
    }
    let lowered = app.client.message_deleted(deleted.clone()).await.unwrap();
    assert_eq!(lowered.into_inner().updated, 1);
    app.stop().await;

    let mut app = spawn_app_with(config).await;
    let retried = app.client.message_deleted(deleted).await.unwrap();
    assert_eq!(retried.into_inner().updated, 0, "lowered once already");
    let (_, states) = everything(&mut app, 7).await;
    assert_eq!(states[0].unread_count, 1, "message 102 is still unread");
    app.stop().await;
}
