//! Cassandra goes down and comes back: changes to cached users are still
//! accepted, uncached users get UNAVAILABLE, and once Cassandra is back every
//! accepted change is written.
//!
//! This test stops Cassandra, so it starts one of its own (its own port and
//! directory, through `scripts/cassandra.sh`) rather than disturb the one the
//! other tests share.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use readstates::proto::GetReadStatesRequest;
use readstates::store::Store;
use readstates::store::cassandra::CassandraStore;
use readstates::test_support::{ack, message};
use tonic::Code;

use crate::helpers::{Server, config, eventually, fresh_users, store_at};

const PORT: &str = "19142";
const NODES: &str = "127.0.0.1:19142";

/// A Cassandra of this test's own, stopped when dropped.
struct OwnCassandra;

impl OwnCassandra {
    fn run(action: &str) {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
        let status = Command::new(repo.join("scripts/cassandra.sh"))
            .arg(action)
            .env("CASSANDRA_PORT", PORT)
            .env("CASSANDRA_DIR", repo.join("target/cassandra-outage"))
            .status()
            .expect("run scripts/cassandra.sh");
        assert!(status.success(), "scripts/cassandra.sh {action} failed");
    }
}

impl Drop for OwnCassandra {
    fn drop(&mut self) {
        OwnCassandra::run("stop");
    }
}

#[tokio::test]
async fn an_outage_delays_writes_and_loses_nothing() {
    OwnCassandra::run("start");
    let _cassandra = OwnCassandra;
    let store = store_at(NODES).await;
    let server = Server::start(NODES, &["--write-delay", "1s"]);
    let mut client = server.client().await;
    let (cached, uncached) = (fresh_users(2), 0);
    let uncached = cached + 1 + uncached;

    client.ack(ack(cached, 10, 100)).await.unwrap();
    let first_write = eventually(Duration::from_secs(10), async || {
        !store.load(cached).await.unwrap().read_states.is_empty()
    })
    .await;
    assert!(first_write);
    drop(store);

    OwnCassandra::run("stop");
    // Accepted while Cassandra is down: the user is in memory.
    client.ack(ack(cached, 10, 200)).await.unwrap();
    let request = message(11, 300, 0, &[cached], &[]);
    client.message_created(request).await.unwrap();
    // Not in memory, cannot be loaded: UNAVAILABLE, not an empty answer.
    let request = GetReadStatesRequest {
        user_id: uncached,
        ..GetReadStatesRequest::default()
    };
    let status = client.get_read_states(request).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let failed = eventually(Duration::from_secs(15), async || {
        server
            .metric("readstates_store_operations_total{store=\"cassandra\",operation=\"write\",result=\"error\"}")
            .await
            >= 1.0
    })
    .await;
    assert!(failed, "writes were tried and failed during the outage");

    OwnCassandra::run("start");
    let store = CassandraStore::connect(&config(NODES))
        .await
        .expect("reconnect");
    let caught_up = eventually(Duration::from_secs(60), async || {
        let Ok(stored) = store.load(cached).await else {
            return false;
        };
        let acked = stored
            .read_states
            .iter()
            .any(|s| s.channel_id == 10 && s.last_acked_id == 200);
        let mentioned = stored
            .read_states
            .iter()
            .any(|s| s.channel_id == 11 && s.mention_count == 1);
        acked && mentioned
    })
    .await;
    assert!(
        caught_up,
        "changes accepted during the outage reached Cassandra"
    );
    drop(client);
    assert!(server.terminate().success());
}
