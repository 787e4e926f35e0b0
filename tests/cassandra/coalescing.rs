//! Many changes to one user within the window: one write per changed read
//! state; and with no window (write-through), one write per change.

use std::time::Duration;

use readstates::store::Store;
use readstates::test_support::message;

use crate::helpers::{Server, eventually, fresh_users, nodes, store};

const WRITES: &str =
    "readstates_store_operations_total{store=\"cassandra\",operation=\"write\",result=\"ok\"}";
const WRITTEN: &str = "readstates_store_written_read_states_total";

#[tokio::test]
async fn changes_within_the_window_coalesce() {
    let store = store().await;
    let server = Server::start(&nodes(), &["--write-delay", "3s"]);
    let mut client = server.client().await;
    let user = fresh_users(1);
    for message_id in 1..=60u64 {
        let request = message(message_id % 3 + 1, message_id, 0, &[], &[user]);
        client.message_created(request).await.unwrap();
    }
    assert_eq!(server.metric(WRITES).await, 0.0, "nothing before the delay");
    let written = eventually(Duration::from_secs(15), async || {
        server.metric(WRITES).await >= 1.0
    })
    .await;
    assert!(written);
    // Let any stray second write show up before counting.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(server.metric(WRITES).await, 1.0, "one write for 60 changes");
    assert_eq!(
        server.metric(WRITTEN).await,
        3.0,
        "one row per changed read state"
    );
    let unread: u32 = store
        .load(user)
        .await
        .unwrap()
        .read_states
        .iter()
        .map(|s| u32::from(s.unread_count))
        .sum();
    assert_eq!(unread, 60);
    assert!(server.terminate().success());
}

#[tokio::test]
async fn with_no_write_delay_each_change_is_in_cassandra_when_answered() {
    let store = store().await;
    let server = Server::start(&nodes(), &["--write-delay", "0s"]);
    let mut client = server.client().await;
    let user = fresh_users(1);

    for message_id in [100, 101, 102] {
        let request = message(10, message_id, 0, &[user], &[]);
        client.message_created(request).await.unwrap();
        // No waiting: write-through answers after Cassandra took the change.
        let stored = store.load(user).await.unwrap().read_states;
        assert_eq!(stored.len(), 1);
        assert_eq!(stored[0].mention_count as u64, message_id - 99);
    }
    let writes = server.metric(WRITES).await;
    assert_eq!(writes, 3.0, "one write per change");
    assert!(server.terminate().success());
}
