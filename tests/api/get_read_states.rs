use readstates::proto::{DeleteReadStatesRequest, GetReadStatesRequest, ReadStateKey};
use readstates::test_support::ack;
use readstates::test_support::message;

use crate::helpers::spawn_app;

fn get(user_id: u64, since_version: u64, channel_ids: &[u64]) -> GetReadStatesRequest {
    GetReadStatesRequest {
        user_id,
        since_version,
        channel_ids: channel_ids.to_vec(),
    }
}

#[tokio::test]
async fn full_set_with_counts() {
    let mut app = spawn_app().await;
    app.client
        .message_created(message(10, 100, 0, &[1], &[]))
        .await
        .unwrap();
    app.client
        .message_created(message(10, 101, 0, &[1], &[]))
        .await
        .unwrap();
    app.client
        .message_created(message(11, 100, 0, &[], &[1]))
        .await
        .unwrap();
    app.client.ack(ack(1, 12, 100)).await.unwrap();

    let response = app
        .client
        .get_read_states(get(1, 0, &[]))
        .await
        .unwrap()
        .into_inner();
    assert!(!response.partial);
    assert_eq!(response.read_states.len(), 3);
    assert_eq!(response.total_mention_count, 2);
    assert_eq!(response.unread_channel_count, 2);
    assert!(response.version > 0);

    let some = app
        .client
        .get_read_states(get(1, 0, &[11, 99]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(some.read_states.len(), 1);
    assert_eq!(some.read_states[0].channel_id, 11);
    assert_eq!(some.total_mention_count, 2, "counts cover every read state");

    let nobody = app
        .client
        .get_read_states(get(2, 0, &[]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((nobody.version, nobody.read_states.len()), (0, 0));
}

#[tokio::test]
async fn delta_since_a_version() {
    let mut app = spawn_app().await;
    app.client.ack(ack(1, 10, 100)).await.unwrap();
    app.client.ack(ack(1, 11, 100)).await.unwrap();
    let seen = app
        .client
        .get_read_states(get(1, 0, &[]))
        .await
        .unwrap()
        .into_inner()
        .version;

    app.client.ack(ack(1, 12, 100)).await.unwrap();
    let delete = DeleteReadStatesRequest {
        user_id: 1,
        keys: vec![ReadStateKey {
            channel_id: 10,
            kind: 0,
        }],
        all: false,
    };
    app.client.delete_read_states(delete).await.unwrap();

    let delta = app
        .client
        .get_read_states(get(1, seen, &[]))
        .await
        .unwrap()
        .into_inner();
    assert!(delta.partial);
    assert_eq!(
        delta
            .read_states
            .iter()
            .map(|s| s.channel_id)
            .collect::<Vec<_>>(),
        vec![12]
    );
    assert_eq!(
        delta
            .deleted
            .iter()
            .map(|k| k.channel_id)
            .collect::<Vec<_>>(),
        vec![10]
    );

    let from_the_future = app
        .client
        .get_read_states(get(1, u64::MAX, &[]))
        .await
        .unwrap()
        .into_inner();
    assert!(!from_the_future.partial, "no exact delta: the full set");
    assert_eq!(from_the_future.read_states.len(), 2);
}
