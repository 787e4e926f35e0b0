//! Changes made over gRPC reach Cassandra after the write delay, not before.

use std::time::Duration;

use readstates::proto::{DeleteReadStatesRequest, ReadStateKey};
use readstates::store::Store;
use readstates::test_support::{ack, message};

use crate::helpers::{Server, eventually, fresh_users, nodes, store};

#[tokio::test]
async fn changes_reach_cassandra_after_the_write_delay() {
    let store = store().await;
    let server = Server::start(&nodes(), &["--write-delay", "2s"]);
    let mut client = server.client().await;
    let user = fresh_users(2);
    let other = user + 1;

    let request = ack(user, 10, 100);
    client.ack(request).await.unwrap();
    let request = message(11, 200, 0, &[user, other], &[]);
    client.message_created(request).await.unwrap();
    let delete = DeleteReadStatesRequest {
        user_id: other,
        keys: vec![ReadStateKey {
            channel_id: 11,
            kind: 0,
        }],
        all: false,
    };
    client.delete_read_states(delete).await.unwrap();

    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        store.load(user).await.unwrap().read_states.is_empty(),
        "written before the delay"
    );

    let written = eventually(Duration::from_secs(10), async || {
        store.load(user).await.unwrap().read_states.len() == 2
    })
    .await;
    assert!(written, "not written after the delay");
    let stored = store.load(user).await.unwrap();
    let acked = stored
        .read_states
        .iter()
        .find(|s| s.channel_id == 10)
        .unwrap();
    let mentioned = stored
        .read_states
        .iter()
        .find(|s| s.channel_id == 11)
        .unwrap();
    assert_eq!(acked.last_acked_id, 100);
    assert_eq!((mentioned.mention_count, mentioned.unread_count), (1, 1));

    let other_rows = store.load(other).await.unwrap().read_states;
    assert!(
        other_rows.iter().all(|s| s.deleted),
        "the deletion is stored as a tombstone: {other_rows:?}"
    );
    assert!(server.terminate().success());
}
