//! Every bad input gets INVALID_ARGUMENT naming the field (and the limit).

use readstates::grpc::validate::{
    MAX_BADGE_USERS, MAX_BULK_ACK_ENTRIES, MAX_CHANNEL_IDS, MAX_DELETE_KEYS, MAX_MESSAGE_USERS,
};
use readstates::proto::*;
use readstates::test_support::{ack, delete, message};
use tonic::{Code, Response, Status};

use crate::helpers::spawn_app;

#[track_caller]
fn assert_invalid<T: std::fmt::Debug>(result: Result<Response<T>, Status>, needles: &[&str]) {
    let status = result.expect_err("must be refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    for needle in needles {
        assert!(
            status.message().contains(needle),
            "{:?} lacks {needle:?}",
            status.message()
        );
    }
}

#[tokio::test]
async fn get_read_states_refuses_bad_input() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    let get = |user_id, channel_ids: Vec<u64>| GetReadStatesRequest {
        user_id,
        since_version: 0,
        channel_ids,
    };
    assert_invalid(c.get_read_states(get(0, vec![])).await, &["user_id"]);
    assert_invalid(
        c.get_read_states(get(1, vec![1; MAX_CHANNEL_IDS + 1]))
            .await,
        &["channel_ids", &MAX_CHANNEL_IDS.to_string()],
    );
    assert_invalid(
        c.get_read_states(get(1, vec![1, 0])).await,
        &["channel_ids[1]"],
    );
}

#[tokio::test]
async fn ack_refuses_bad_input() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    assert_invalid(c.ack(ack(0, 1, 1)).await, &["user_id"]);
    assert_invalid(c.ack(ack(1, 0, 1)).await, &["channel_id"]);
    assert_invalid(c.ack(ack(1, 1, 0)).await, &["message_id"]);
    let unknown_kind = AckRequest {
        kind: 42,
        ..ack(1, 1, 1)
    };
    assert_invalid(c.ack(unknown_kind).await, &["kind", "42"]);
    let manual_to_zero = AckRequest {
        manual: true,
        ..ack(1, 1, 0)
    };
    assert!(
        c.ack(manual_to_zero).await.is_ok(),
        "a manual ack may rewind to nothing"
    );
}

#[tokio::test]
async fn bulk_ack_refuses_bad_input() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    let entry = |channel_id, message_id| AckEntry {
        channel_id,
        kind: 0,
        message_id,
    };
    let bulk = |user_id, entries| BulkAckRequest { user_id, entries };
    assert_invalid(c.bulk_ack(bulk(0, vec![])).await, &["user_id"]);
    assert_invalid(
        c.bulk_ack(bulk(1, vec![entry(1, 1); MAX_BULK_ACK_ENTRIES + 1]))
            .await,
        &["entries", &MAX_BULK_ACK_ENTRIES.to_string()],
    );
    assert_invalid(
        c.bulk_ack(bulk(1, vec![entry(1, 1), entry(0, 1)])).await,
        &["entries[1].channel_id"],
    );
    assert_invalid(
        c.bulk_ack(bulk(1, vec![entry(1, 0)])).await,
        &["entries[0].message_id"],
    );
}

#[tokio::test]
async fn message_created_refuses_bad_input() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    assert_invalid(
        c.message_created(message(0, 1, 0, &[1], &[])).await,
        &["channel_id"],
    );
    assert_invalid(
        c.message_created(message(1, 0, 0, &[1], &[])).await,
        &["message_id"],
    );
    // Over the limit only together.
    let half: Vec<u64> = (1..=(MAX_MESSAGE_USERS / 2 + 1) as u64).collect();
    assert_invalid(
        c.message_created(message(1, 1, 0, &half, &half)).await,
        &[&MAX_MESSAGE_USERS.to_string()],
    );
    assert_invalid(
        c.message_created(message(1, 1, 0, &[1], &[0])).await,
        &["unread_user_ids[0]"],
    );
    let unknown_kind = MessageCreatedRequest {
        kind: -1,
        ..message(1, 1, 0, &[1], &[])
    };
    assert_invalid(c.message_created(unknown_kind).await, &["kind"]);
}

#[tokio::test]
async fn delete_read_states_refuses_bad_input() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    assert_invalid(
        c.delete_read_states(delete(0, &[1], false)).await,
        &["user_id"],
    );
    assert_invalid(
        c.delete_read_states(delete(1, &[], false)).await,
        &["keys", "all"],
    );
    assert_invalid(
        c.delete_read_states(delete(1, &[1], true)).await,
        &["keys", "all"],
    );
    assert_invalid(
        c.delete_read_states(delete(1, &[1, 0], false)).await,
        &["keys[1].channel_id"],
    );
    let many: Vec<u64> = (1..=MAX_DELETE_KEYS as u64 + 1).collect();
    assert_invalid(
        c.delete_read_states(delete(1, &many, false)).await,
        &["keys", &MAX_DELETE_KEYS.to_string()],
    );
}

#[tokio::test]
async fn get_badge_counts_refuses_bad_input() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    let badges = |user_ids| GetBadgeCountsRequest { user_ids };
    assert_invalid(
        c.get_badge_counts(badges(vec![1; MAX_BADGE_USERS + 1]))
            .await,
        &["user_ids", &MAX_BADGE_USERS.to_string()],
    );
    assert_invalid(c.get_badge_counts(badges(vec![0])).await, &["user_ids[0]"]);
}

#[tokio::test]
async fn ack_all_refuses_bad_input() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    let ack_all = |user_id, kinds: Vec<i32>| AckAllRequest {
        user_id,
        kinds,
        parent_id: 0,
    };
    assert_invalid(c.ack_all(ack_all(0, vec![])).await, &["user_id"]);
    assert_invalid(
        c.ack_all(ack_all(1, vec![0, 42])).await,
        &["kinds[1]", "42"],
    );
    assert_invalid(c.ack_all(ack_all(1, vec![0; 8])).await, &["kinds", "7"]);
}

#[tokio::test]
async fn message_deleted_refuses_bad_input() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    let deleted = |channel_id, message_id, users: Vec<u64>, kind| MessageDeletedRequest {
        channel_id,
        message_id,
        mentioned_user_ids: vec![],
        unread_user_ids: users,
        kind,
        channel_taken: None,
    };
    assert_invalid(
        c.message_deleted(deleted(0, 1, vec![1], 0)).await,
        &["channel_id"],
    );
    assert_invalid(
        c.message_deleted(deleted(1, 0, vec![1], 0)).await,
        &["message_id"],
    );
    assert_invalid(
        c.message_deleted(deleted(1, 1, vec![1], 9)).await,
        &["kind", "9"],
    );
    assert_invalid(
        c.message_deleted(deleted(1, 1, vec![1, 0], 0)).await,
        &["unread_user_ids[1]"],
    );
    assert_invalid(
        c.message_deleted(deleted(1, 1, vec![1; MAX_MESSAGE_USERS + 1], 0))
            .await,
        &[
            "mentioned_user_ids + unread_user_ids",
            &MAX_MESSAGE_USERS.to_string(),
        ],
    );
}

#[tokio::test]
async fn set_muted_refuses_bad_input() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    let mute = |user_id, channel_id, kind| SetMutedRequest {
        user_id,
        channel_id,
        kind,
        muted: true,
    };
    assert_invalid(c.set_muted(mute(0, 1, 0)).await, &["user_id"]);
    assert_invalid(c.set_muted(mute(1, 0, 0)).await, &["channel_id"]);
    assert_invalid(c.set_muted(mute(1, 1, 42)).await, &["kind", "42"]);
}
