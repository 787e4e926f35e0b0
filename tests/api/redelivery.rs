//! Exact, retry-safe counts: every MessageCreated delivered twice, and once
//! more after a client deadline cut it, counts as one delivery; AckAll marks
//! everything read up to each watermark.

use std::sync::Arc;
use std::time::Duration;

use readstates::proto::*;
use readstates::store::faulty::{Effect, Fault, FaultyStore, Operation};
use readstates::test_support::message;
use tonic::{Code, Request};

use crate::helpers::{TestApp, spawn_app, spawn_app_on, test_config};

const USERS: u64 = 40;

/// Messages in 3 channels, each reaching a different mix of users, some
/// with an author who reads it.
fn messages() -> Vec<MessageCreatedRequest> {
    (1..=30u64)
        .map(|i| {
            let channel_id = 100 + i % 3;
            let mentioned: Vec<u64> = (1..=USERS).filter(|u| (u + i) % 7 == 0).collect();
            let unread: Vec<u64> = (1..=USERS).filter(|u| (u * i) % 3 != 0).collect();
            let author = if i % 4 == 0 { i % USERS + 1 } else { 0 };
            message(channel_id, 1_000 + i, author, &mentioned, &unread)
        })
        .collect()
}

/// Every user's read states, as the service answers them.
async fn everything(app: &mut TestApp) -> Vec<Vec<ReadState>> {
    let mut all = Vec::new();
    for user_id in 1..=USERS {
        let mut states = app.all_read_states(user_id).await.read_states;
        for state in &mut states {
            state.version = 0; // versions follow the clock, not the count
        }
        all.push(states);
    }
    all
}

#[tokio::test]
async fn a_message_delivered_twice_and_once_more_after_a_cut_counts_once() {
    let mut reference = spawn_app().await;
    for m in messages() {
        reference.client.message_created(m).await.unwrap();
    }

    // Write-through, with slow writes: a cut lands after the change was
    // applied, while its write is under way (the worst case for a retry).
    let store = Arc::new(FaultyStore::memory());
    let mut config = test_config();
    config.write_delay = Duration::ZERO;
    let mut app = spawn_app_on(config, store.clone()).await;
    let slow_writes = Effect::Delay(Duration::from_millis(100));
    store.inject(Fault::new(Operation::Write, slow_writes));
    let mut cuts = 0;
    for (i, m) in messages().into_iter().enumerate() {
        if i % 2 == 0 {
            let mut cut = Request::new(m.clone());
            cut.set_timeout(Duration::from_millis(30));
            match app.client.message_created(cut).await {
                Err(status) => {
                    let code = status.code();
                    assert!(
                        matches!(code, Code::DeadlineExceeded | Code::Cancelled),
                        "{status:?}"
                    );
                    cuts += 1;
                }
                Ok(_) => panic!("message {} was not cut", m.message_id),
            }
        }
        let first = app.client.message_created(m.clone()).await.unwrap();
        let again = app.client.message_created(m.clone()).await.unwrap();
        assert_eq!(
            again.into_inner().updated,
            0,
            "a redelivery changes nothing"
        );
        if i % 2 == 1 {
            assert!(first.into_inner().updated > 0);
        }
    }
    assert_eq!(cuts, 15);
    assert_eq!(everything(&mut app).await, everything(&mut reference).await);
    let states = app.all_read_states(1).await.read_states;
    assert!(states.iter().all(|s| s.last_message_id >= s.last_acked_id));
    assert!(states.iter().any(|s| s.unread_count > 0), "{states:?}");
}

#[tokio::test]
async fn a_late_older_message_is_not_counted() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    c.message_created(message(10, 200, 0, &[], &[1]))
        .await
        .unwrap();
    let late = c
        .message_created(message(10, 150, 0, &[1], &[]))
        .await
        .unwrap();
    assert_eq!(late.into_inner().updated, 0);
    let state = &app.all_read_states(1).await.read_states[0];
    assert_eq!(
        (
            state.last_message_id,
            state.mention_count,
            state.unread_count
        ),
        (200, 0, 1)
    );
}

#[tokio::test]
async fn ack_all_marks_everything_read_up_to_each_watermark_in_one_version() {
    let mut app = spawn_app().await;
    let c = &mut app.client;
    c.message_created(message(10, 100, 0, &[1], &[]))
        .await
        .unwrap();
    c.message_created(message(11, 200, 0, &[], &[1]))
        .await
        .unwrap();
    let event = MessageCreatedRequest {
        kind: ReadStateKind::GuildEvent as i32,
        ..message(12, 300, 0, &[], &[1])
    };
    c.message_created(event).await.unwrap();
    let before = app.all_read_states(1).await.version;

    let channels_only = AckAllRequest {
        user_id: 1,
        kinds: vec![ReadStateKind::Channel as i32],
        parent_id: 0,
    };
    let answer = app
        .client
        .ack_all(channels_only.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.updated, 2);
    let after = app.all_read_states(1).await;
    assert_eq!(after.version, answer.version);
    let changed: Vec<_> = after
        .read_states
        .iter()
        .filter(|s| s.version > before)
        .collect();
    assert_eq!(changed.len(), 2, "{changed:?}");
    assert!(
        changed.iter().all(|s| s.version == answer.version),
        "one version"
    );
    for state in &changed {
        assert_eq!(state.last_acked_id, state.last_message_id);
        assert_eq!((state.mention_count, state.unread_count), (0, 0));
    }
    assert_eq!(
        after.unread_channel_count, 1,
        "the guild event is still unread"
    );

    let again = app
        .client
        .ack_all(channels_only)
        .await
        .unwrap()
        .into_inner();
    assert_eq!((again.updated, again.version), (0, answer.version));
    let all = AckAllRequest {
        user_id: 1,
        kinds: vec![],
        parent_id: 0,
    };
    assert_eq!(
        app.client.ack_all(all).await.unwrap().into_inner().updated,
        1
    );
    assert_eq!(app.all_read_states(1).await.unread_channel_count, 0);
}
