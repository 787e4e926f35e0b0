use readstates::proto::{AckRequest, ReadStateKind};
use readstates::test_support::ack;

use crate::helpers::spawn_app;

#[tokio::test]
async fn ack_moves_forward_only() {
    let mut app = spawn_app().await;
    let first = app.client.ack(ack(1, 10, 100)).await.unwrap().into_inner();
    assert!(first.applied);
    let state = first.read_state.unwrap();
    assert_eq!((state.channel_id, state.last_acked_id), (10, 100));
    assert_eq!(state.version, first.version);

    let older = app.client.ack(ack(1, 10, 90)).await.unwrap().into_inner();
    assert!(!older.applied);
    assert_eq!(older.version, first.version, "nothing changed");
    assert_eq!(older.read_state.unwrap().last_acked_id, 100);

    let newer = app.client.ack(ack(1, 10, 101)).await.unwrap().into_inner();
    assert!(newer.applied && newer.version > first.version);
}

#[tokio::test]
async fn manual_ack_rewinds_and_sets_counts() {
    let mut app = spawn_app().await;
    app.client.ack(ack(1, 10, 100)).await.unwrap();
    let manual = AckRequest {
        manual: true,
        mention_count: 2,
        unread_count: 5,
        ..ack(1, 10, 40)
    };
    let response = app.client.ack(manual).await.unwrap().into_inner();
    assert!(response.applied);
    let state = response.read_state.unwrap();
    assert_eq!(
        (state.last_acked_id, state.mention_count, state.unread_count),
        (40, 2, 5)
    );
}

#[tokio::test]
async fn kinds_are_separate_read_states() {
    let mut app = spawn_app().await;
    let event = AckRequest {
        kind: ReadStateKind::GuildEvent as i32,
        ..ack(1, 10, 100)
    };
    app.client.ack(event).await.unwrap();
    let channel = app.client.ack(ack(1, 10, 50)).await.unwrap().into_inner();
    assert!(channel.applied, "the channel's own read state starts at 0");
}
