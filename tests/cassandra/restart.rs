//! SIGTERM and start again: every read state and every deletion is as it was,
//! and versions never go backwards.

use readstates::proto::read_states_client::ReadStatesClient;
use readstates::proto::{DeleteReadStatesRequest, GetReadStatesRequest, ReadState, ReadStateKey};
use readstates::test_support::{ack, message};
use tonic::transport::Channel;

use crate::helpers::{Server, fresh_users, nodes, store};

const USERS: u64 = 10;

async fn everything(client: &mut ReadStatesClient<Channel>, user_id: u64) -> (u64, Vec<ReadState>) {
    let request = GetReadStatesRequest {
        user_id,
        ..GetReadStatesRequest::default()
    };
    let response = client.get_read_states(request).await.unwrap().into_inner();
    (response.version, response.read_states)
}

#[tokio::test]
async fn a_restart_loses_nothing() {
    let _schema = store().await;
    let first = fresh_users(USERS);
    let args = [
        "--write-delay",
        "1h",
        "--cache-capacity",
        "12",
        "--shards",
        "2",
    ];
    let server = Server::start(&nodes(), &args);
    let mut client = server.client().await;
    for user_id in first..first + USERS {
        for channel_id in [10, 11, 12] {
            let request = ack(user_id, channel_id, channel_id * 100);
            client.ack(request).await.unwrap();
        }
    }
    let users: Vec<u64> = (first..first + USERS).collect();
    let request = message(10, 5_000, 0, &users, &[]);
    client.message_created(request).await.unwrap();
    let delete_one = DeleteReadStatesRequest {
        user_id: first,
        keys: vec![ReadStateKey {
            channel_id: 12,
            kind: 0,
        }],
        all: false,
    };
    client.delete_read_states(delete_one).await.unwrap();
    let delete_all = DeleteReadStatesRequest {
        user_id: first + 1,
        keys: vec![],
        all: true,
    };
    client.delete_read_states(delete_all).await.unwrap();

    let mut before = Vec::new();
    for user_id in first..first + USERS {
        before.push(everything(&mut client, user_id).await);
    }
    drop(client);
    assert!(
        server.terminate().success(),
        "exit 0 after writing everything"
    );

    let server = Server::start(&nodes(), &args);
    let mut client = server.client().await;
    for (i, user_id) in (first..first + USERS).enumerate() {
        let (version, states) = everything(&mut client, user_id).await;
        assert_eq!(states, before[i].1, "user {user_id}");
        assert!(version >= before[i].0, "user {user_id}: version went back");
    }
    assert_eq!(before[0].1.len(), 2, "the deleted read state stays deleted");
    assert!(before[1].1.is_empty(), "the wiped user stays wiped");
    let request = ack(first + 1, 99, 1);
    let next = client.ack(request).await.unwrap().into_inner();
    assert!(
        next.version > before[1].0,
        "a new change gets a higher version"
    );
    drop(client);
    assert!(server.terminate().success());
}
