use readstates::proto::GetReadStatesRequest;
use readstates::test_support::{ack, message};

use crate::helpers::spawn_app;

#[tokio::test]
async fn mentions_and_unreads_count_and_the_author_is_acked() {
    let mut app = spawn_app().await;
    // User 3 has already read past the message: not counted.
    app.client.ack(ack(3, 10, 500)).await.unwrap();
    let request = message(10, 200, 1, &[2, 3, 1], &[2, 4, 3]);
    let response = app
        .client
        .message_created(request)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        response.updated, 3,
        "author 1 acked, 2 mentioned, 4 unread; 3 already read"
    );

    let mut counts = Vec::new();
    for user_id in 1..=4 {
        let request = GetReadStatesRequest {
            user_id,
            ..GetReadStatesRequest::default()
        };
        let states = app
            .client
            .get_read_states(request)
            .await
            .unwrap()
            .into_inner();
        let s = &states.read_states[0];
        counts.push((s.last_acked_id, s.mention_count, s.unread_count));
    }
    assert_eq!(counts, vec![(200, 0, 0), (0, 1, 1), (500, 0, 0), (0, 0, 1)]);
}

#[tokio::test]
async fn many_users_in_one_message() {
    let mut app = spawn_app().await;
    let users: Vec<u64> = (1..=10_000).collect();
    let response = app
        .client
        .message_created(message(10, 200, 0, &[], &users))
        .await
        .unwrap();
    assert_eq!(response.into_inner().updated, 10_000);
}
