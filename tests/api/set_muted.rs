//! A muted read state counts mentions, but its unread messages alone do not
//! make it an unread channel.

use readstates::proto::*;
use readstates::test_support::message;

use crate::helpers::spawn_app;

fn mute(user_id: u64, channel_id: u64, muted: bool) -> SetMutedRequest {
    SetMutedRequest {
        user_id,
        channel_id,
        kind: 0,
        muted,
    }
}

#[tokio::test]
async fn a_muted_channel_is_unread_only_when_mentioned() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    let muted = c.set_muted(mute(1, 10, true)).await.unwrap().into_inner();
    assert!(muted.applied);
    assert!(muted.read_state.unwrap().muted);
    assert!(
        !c.set_muted(mute(1, 10, true))
            .await
            .unwrap()
            .into_inner()
            .applied
    );

    c.message_created(message(10, 100, 0, &[], &[1]))
        .await
        .unwrap();
    c.message_created(message(11, 100, 0, &[], &[1]))
        .await
        .unwrap();
    let state = app.all_read_states(1).await;
    assert_eq!(state.unread_channel_count, 1, "only the unmuted channel");
    let badge = app
        .client
        .get_badge_counts(GetBadgeCountsRequest { user_ids: vec![1] })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(badge.counts[0].unread_channel_count, 1);

    app.client
        .message_created(message(10, 101, 0, &[1], &[]))
        .await
        .unwrap();
    let state = app.all_read_states(1).await;
    assert_eq!(
        (state.unread_channel_count, state.total_mention_count),
        (2, 1),
        "a mention counts, muted or not"
    );

    let unmuted = app
        .client
        .set_muted(mute(1, 10, false))
        .await
        .unwrap()
        .into_inner();
    assert!(unmuted.applied && !unmuted.read_state.unwrap().muted);
    let unknown = app
        .client
        .set_muted(mute(1, 99, false))
        .await
        .unwrap()
        .into_inner();
    assert!(!unknown.applied && unknown.read_state.is_none());
}
