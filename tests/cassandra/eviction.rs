//! A cache far smaller than the data: every change still reaches Cassandra,
//! and users evicted and loaded again see every change.

use std::time::Duration;

use readstates::proto::GetReadStatesRequest;
use readstates::store::Store;
use readstates::test_support::{ack, message};

use crate::helpers::{Server, eventually, fresh_users, nodes, store};

const USERS: u64 = 40;

#[tokio::test]
async fn evicted_users_are_written_and_reload_with_every_change() {
    let store = store().await;
    // Room for 4 read states; the write delay is long, so only eviction
    // (and shutdown) write.
    let args = [
        "--cache-capacity",
        "4",
        "--shards",
        "1",
        "--write-delay",
        "1h",
    ];
    let server = Server::start(&nodes(), &args);
    let mut client = server.client().await;
    let first = fresh_users(USERS);
    for round in 1..=3u64 {
        for user_id in first..first + USERS {
            let request = ack(user_id, 10, round * 100);
            client.ack(request).await.unwrap();
            let request = message(11, round * 100 + 1, 0, &[user_id], &[]);
            client.message_created(request).await.unwrap();
        }
    }
    // Every user was evicted at least once: reading them back loads them
    // from Cassandra (or from the eviction buffer while their write is under way).
    for user_id in first..first + USERS {
        let request = GetReadStatesRequest {
            user_id,
            ..GetReadStatesRequest::default()
        };
        let states = client.get_read_states(request).await.unwrap().into_inner();
        let acked = states
            .read_states
            .iter()
            .find(|s| s.channel_id == 10)
            .unwrap();
        let mentioned = states
            .read_states
            .iter()
            .find(|s| s.channel_id == 11)
            .unwrap();
        assert_eq!(acked.last_acked_id, 300, "user {user_id}");
        assert_eq!(mentioned.mention_count, 3, "user {user_id}");
    }
    // All but the few users still cached are in Cassandra already.
    let all_but_cached = eventually(Duration::from_secs(15), async || {
        let mut stored = 0;
        for user_id in first..first + USERS {
            stored += u64::from(store.load(user_id).await.unwrap().read_states.len() == 2);
        }
        stored >= USERS - 2
    })
    .await;
    assert!(all_but_cached);
    assert!(server.terminate().success());
    for user_id in first..first + USERS {
        let stored = store.load(user_id).await.unwrap();
        let mentioned = stored
            .read_states
            .iter()
            .find(|s| s.channel_id == 11)
            .unwrap();
        assert_eq!(mentioned.mention_count, 3, "user {user_id}");
    }
}
