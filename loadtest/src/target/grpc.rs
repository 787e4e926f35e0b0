//! A `readstates.v1.ReadStates` server over gRPC, on several HTTP/2
//! connections used in turn.

use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context;
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::proto::*;
use tonic::transport::{Channel, Endpoint};

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
}

impl GrpcTarget {
    pub async fn connect(address: &str, connections: usize) -> anyhow::Result<GrpcTarget> {
        let mut clients = Vec::with_capacity(connections);
        for _ in 0..connections.max(1) {
            clients.push(ReadStatesClient::new(connect(address).await?));
        }
        Ok(GrpcTarget {
            clients,
            next: AtomicUsize::new(0),
        })
    }

    pub async fn execute(&self, op: &Op) -> Result<(), String> {
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.clients.len();
        send(self.clients[index].clone(), op)
            .await
            .map_err(|status| format!("{:?}", status.code()))
    }
}

/// Sends one operation on `client`.
pub async fn send(mut client: ReadStatesClient<Channel>, op: &Op) -> Result<(), tonic::Status> {
    {
        match op.clone() {
            Op::GetReadStates { user_id } => {
                let request = GetReadStatesRequest {
                    user_id,
                    ..GetReadStatesRequest::default()
                };
                client.get_read_states(request).await.map(drop)
            }
            Op::Ack {
                user_id,
                channel_id,
                message_id,
            } => {
                let request = AckRequest {
                    user_id,
                    channel_id,
                    message_id,
                    ..AckRequest::default()
                };
                client.ack(request).await.map(drop)
            }
            Op::BulkAck { user_id, entries } => {
                let entries = entries
                    .into_iter()
                    .map(|(channel_id, message_id)| AckEntry {
                        channel_id,
                        kind: 0,
                        message_id,
                    })
                    .collect();
                client
                    .bulk_ack(BulkAckRequest { user_id, entries })
                    .await
                    .map(drop)
            }
            Op::MessageCreated {
                channel_id,
                message_id,
                author_id,
                mentioned,
                unread,
            } => {
                let request = MessageCreatedRequest {
                    channel_id,
                    message_id,
                    author_id,
                    mentioned_user_ids: mentioned,
                    unread_user_ids: unread,
                    kind: 0,
                };
                client.message_created(request).await.map(drop)
            }
            Op::GetBadgeCounts { user_ids } => client
                .get_badge_counts(GetBadgeCountsRequest { user_ids })
                .await
                .map(drop),
        }
    }
}
