//! A channel counted by channel against the real Cassandra: its state is
//! written behind with the users and flushed by a SIGTERM, written before
//! the answer with write-through so that a `kill -9` loses none of it, and
//! loaded whole by the next process, which counts every member as before.

use readstates::proto::read_states_client::ReadStatesClient;
use readstates::proto::*;
use readstates::test_support::{ack, message};
use tonic::transport::Channel;

use crate::helpers::{Server, fresh_users, nodes, store};

const MEMBERS: u64 = 5;
const SWITCHED_AT: u64 = 100;

/// A fresh channel counted by channel from [`SWITCHED_AT`], its members
/// joined there, then messages 101..=120 (user `first` mentioned in every
/// fifth) and 110 deleted. Returns the channel and the first member.
async fn counted_channel(client: &mut ReadStatesClient<Channel>) -> (u64, u64) {
    let channel = fresh_users(1);
    let first = fresh_users(MEMBERS);
    let switch = SetChannelCountingRequest {
        channel_id: channel,
        counted_from: SWITCHED_AT,
    };
    assert!(
        client
            .set_channel_counting(switch)
            .await
            .unwrap()
            .into_inner()
            .applied
    );
    for user in first..first + MEMBERS {
        let join = AckRequest {
            manual: true,
            ..ack(user, channel, SWITCHED_AT)
        };
        client.ack(join).await.unwrap();
    }
    for id in 101..=120 {
        let mentioned = if id % 5 == 0 { vec![first] } else { vec![] };
        let request = message(channel, id, 0, &mentioned, &[]);
        client.message_created(request).await.unwrap();
    }
    let deleted = MessageDeletedRequest {
        channel_id: channel,
        message_id: 110,
        mentioned_user_ids: vec![first],
        ..MessageDeletedRequest::default()
    };
    client.message_deleted(deleted).await.unwrap();
    client.ack(ack(first + 1, channel, 115)).await.unwrap();
    (channel, first)
}

/// (mentions, unread) of each member.
async fn counts(
    client: &mut ReadStatesClient<Channel>,
    channel: u64,
    first: u64,
) -> Vec<(u32, u32)> {
    let mut counts = Vec::new();
    for user_id in first..first + MEMBERS {
        let request = GetReadStatesRequest {
            user_id,
            channel_ids: vec![channel],
            ..GetReadStatesRequest::default()
        };
        let answer = client.get_read_states(request).await.unwrap().into_inner();
        let state = &answer.read_states[0];
        counts.push((state.mention_count, state.unread_count));
    }
    counts
}

/// 20 messages, one deleted: 19 unread; the first member mentioned in 4
/// (one of them deleted), the second read to 115.
const EXPECTED: [(u32, u32); MEMBERS as usize] = [(3, 19), (0, 5), (0, 19), (0, 19), (0, 19)];

/// The next process counts as the last did, and takes no message twice.
async fn counted_as_before(server: &Server, channel: u64, first: u64) {
    let mut client = server.client().await;
    assert_eq!(counts(&mut client, channel, first).await, EXPECTED);
    let redelivered = message(channel, 120, 0, &[first], &[]);
    let answer = client.message_created(redelivered).await.unwrap();
    assert_eq!(answer.into_inner().updated, 0, "120 was taken already");
    let next = client.message_created(message(channel, 121, 0, &[], &[]));
    assert_eq!(next.await.unwrap().into_inner().updated, 1);
    assert_eq!(counts(&mut client, channel, first).await[2], (0, 20));
}

#[tokio::test]
async fn a_sigterm_writes_the_channel_and_the_next_process_counts_as_before() {
    let _schema = store().await;
    let args = ["--write-delay", "1h"];
    let server = Server::start(&nodes(), &args);
    let mut client = server.client().await;
    let (channel, first) = counted_channel(&mut client).await;
    assert_eq!(counts(&mut client, channel, first).await, EXPECTED);
    drop(client);
    assert!(
        server.terminate().success(),
        "exit 0 after writing everything"
    );

    let server = Server::start(&nodes(), &args);
    counted_as_before(&server, channel, first).await;
}

#[tokio::test]
async fn with_write_through_a_kill_loses_nothing_of_the_channel() {
    let _schema = store().await;
    let args = ["--write-delay", "0s"];
    let server = Server::start(&nodes(), &args);
    let mut client = server.client().await;
    let (channel, first) = counted_channel(&mut client).await;
    // At once: only what was written before each answer survives.
    server.crash();
    drop(server);

    let server = Server::start(&nodes(), &args);
    counted_as_before(&server, channel, first).await;
}
