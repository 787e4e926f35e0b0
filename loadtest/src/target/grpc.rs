//! A `readstates.v1.ReadStates` server over gRPC, on several HTTP/2
//! connections used in turn; changes optionally over Apply streams.

use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context;
use readstates::proto::apply_item::Change;
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::proto::*;
use tonic::transport::{Channel, Endpoint};

use super::stream::{StreamConfig, Streams};
use crate::op::Op;

/// One HTTP/2 connection to `address`, Nagle off as the server's.
pub async fn connect(address: &str) -> anyhow::Result<Channel> {
    Endpoint::from_shared(format!("http://{address}"))
        .with_context(|| format!("address {address}"))?
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("connect to {address}"))
}

#[derive(Debug)]
pub struct GrpcTarget {
    clients: Vec<ReadStatesClient<Channel>>,
    next: AtomicUsize,
    /// With a stream mode, changes go over Apply streams (reads stay unary).
    streams: Option<Streams>,
}

impl GrpcTarget {
    pub async fn connect(
        address: &str,
        connections: usize,
        stream: Option<StreamConfig>,
    ) -> anyhow::Result<GrpcTarget> {
        let mut channels = Vec::with_capacity(connections);
        for _ in 0..connections.max(1) {
            channels.push(connect(address).await?);
        }
        let streams = stream.map(|config| Streams::open(&channels, config));
        let clients = channels.into_iter().map(ReadStatesClient::new).collect();
        Ok(GrpcTarget {
            clients,
            next: AtomicUsize::new(0),
            streams,
        })
    }

    pub async fn execute(&self, op: &Op) -> Result<(), String> {
        if let Some(streams) = &self.streams
            && let Some(change) = change(op)
        {
            return streams.execute(change).await;
        }
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.clients.len();
        send(self.clients[index].clone(), op)
            .await
            .map_err(|status| format!("{:?}", status.code()))
    }
}

/// The change an operation makes, as a request; `None` for a read.
pub fn change(op: &Op) -> Option<Change> {
    Some(match op.clone() {
        Op::Ack {
            user_id,
            channel_id,
            message_id,
        } => Change::Ack(AckRequest {
            user_id,
            channel_id,
            message_id,
            ..AckRequest::default()
        }),
        Op::BulkAck { user_id, entries } => {
            let entries = entries
                .into_iter()
                .map(|(channel_id, message_id)| AckEntry {
                    channel_id,
                    kind: 0,
                    message_id,
                })
                .collect();
            Change::BulkAck(BulkAckRequest { user_id, entries })
        }
        Op::MessageCreated {
            channel_id,
            message_id,
            author_id,
            mentioned,
            unread,
        } => Change::MessageCreated(MessageCreatedRequest {
            channel_id,
            message_id,
            author_id,
            mentioned_user_ids: mentioned,
            unread_user_ids: unread,
            kind: 0,
            channel_taken: None,
            parent_id: 0,
        }),
        Op::GetReadStates { .. } | Op::GetBadgeCounts { .. } => return None,
    })
}

/// Sends one operation on `client`.
pub async fn send(mut client: ReadStatesClient<Channel>, op: &Op) -> Result<(), tonic::Status> {
    match (op, change(op)) {
        (Op::GetReadStates { user_id }, _) => {
            let request = GetReadStatesRequest {
                user_id: *user_id,
                ..GetReadStatesRequest::default()
            };
            client.get_read_states(request).await.map(drop)
        }
        (Op::GetBadgeCounts { user_ids }, _) => {
            let request = GetBadgeCountsRequest {
                user_ids: user_ids.clone(),
            };
            client.get_badge_counts(request).await.map(drop)
        }
        (_, Some(Change::Ack(r))) => client.ack(r).await.map(drop),
        (_, Some(Change::BulkAck(r))) => client.bulk_ack(r).await.map(drop),
        (_, Some(Change::MessageCreated(r))) => client.message_created(r).await.map(drop),
        (op, change) => unreachable!("{op:?} makes no change the workload sends: {change:?}"),
    }
}
