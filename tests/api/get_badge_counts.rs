use readstates::proto::GetBadgeCountsRequest;
use readstates::test_support::message;

use crate::helpers::spawn_app;

#[tokio::test]
async fn badge_counts_in_request_order() {
    let mut app = spawn_app().await;
    app.client
        .message_created(message(10, 100, 0, &[1], &[2]))
        .await
        .unwrap();
    app.client
        .message_created(message(11, 100, 0, &[1], &[]))
        .await
        .unwrap();
    let request = GetBadgeCountsRequest {
        user_ids: vec![2, 1, 3],
    };
    let counts = app
        .client
        .get_badge_counts(request)
        .await
        .unwrap()
        .into_inner()
        .counts;
    let got: Vec<(u64, u64, u32)> = counts
        .iter()
        .map(|c| (c.user_id, c.total_mention_count, c.unread_channel_count))
        .collect();
    assert_eq!(got, vec![(2, 0, 1), (1, 2, 2), (3, 0, 0)]);
}
