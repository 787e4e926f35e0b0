use readstates::proto::{AckEntry, BulkAckRequest, ReadStateKind};
use readstates::test_support::ack;

use crate::helpers::spawn_app;

#[tokio::test]
async fn bulk_ack_applies_forward_acks_as_one_version() {
    let mut app = spawn_app().await;
    app.client.ack(ack(1, 10, 100)).await.unwrap();
    let entry = |channel_id, message_id| AckEntry {
        channel_id,
        kind: ReadStateKind::Channel as i32,
        message_id,
    };
    let request = BulkAckRequest {
        user_id: 1,
        entries: vec![entry(10, 50), entry(11, 60), entry(12, 70)],
    };
    let response = app.client.bulk_ack(request).await.unwrap().into_inner();
    let acked: Vec<(u64, u64)> = response
        .read_states
        .iter()
        .map(|s| (s.channel_id, s.last_acked_id))
        .collect();
    assert_eq!(
        acked,
        vec![(10, 100), (11, 60), (12, 70)],
        "10 does not go back"
    );
    assert!(
        response.read_states[1..]
            .iter()
            .all(|s| s.version == response.version)
    );
}
