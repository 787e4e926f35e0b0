use readstates::test_support::{ack, delete};

use crate::helpers::spawn_app;

async fn channels(app: &mut crate::helpers::TestApp, user_id: u64) -> Vec<u64> {
    let response = app.all_read_states(user_id).await;
    response.read_states.iter().map(|s| s.channel_id).collect()
}

#[tokio::test]
async fn delete_some_then_all() {
    let mut app = spawn_app().await;
    for channel_id in [10, 11, 12] {
        app.client.ack(ack(1, channel_id, 100)).await.unwrap();
    }
    app.client.ack(ack(2, 10, 100)).await.unwrap();

    let some = app
        .client
        .delete_read_states(delete(1, &[10, 99], false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(some.deleted, 1);
    assert_eq!(channels(&mut app, 1).await, vec![11, 12]);

    let all = app
        .client
        .delete_read_states(delete(1, &[], true))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.deleted, 2);
    assert!(all.version > some.version);
    assert_eq!(channels(&mut app, 1).await, Vec::<u64>::new());
    assert_eq!(
        channels(&mut app, 2).await,
        vec![10],
        "other users untouched"
    );
}
