//! The transport ceiling: a `readstates.v1` server that does no work at all
//! and answers with canned responses of realistic size. What readstates
//! reaches divided by what this reaches, same load and machine, is the
//! measure of readstates' own overhead.

use std::net::SocketAddr;

use anyhow::Context;
use readstates::proto::read_states_server::{ReadStates, ReadStatesServer};
use readstates::proto::*;
use tokio::net::TcpListener;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

#[derive(Debug, Clone)]
pub struct BaselineService {
    read_states: GetReadStatesResponse,
    one: ReadState,
}

impl BaselineService {
    /// Answers `GetReadStates` with `read_states` read states.
    pub fn new(read_states: u64) -> BaselineService {
        let state = |channel_id| ReadState {
            channel_id,
            kind: 0,
            last_acked_id: 1_234_567_890_123,
            mention_count: 1,
            unread_count: 2,
            version: 1_700_000_000_000_000,
            last_message_id: 1_234_567_890_123,
            muted: false,
            unread_capped: false,
            parent_id: 0,
        };
        BaselineService {
            read_states: GetReadStatesResponse {
                version: 1_700_000_000_000_000,
                partial: false,
                read_states: (1..=read_states).map(state).collect(),
                deleted: vec![],
                total_mention_count: read_states,
                unread_channel_count: read_states as u32,
                ..GetReadStatesResponse::default()
            },
            one: state(1),
        }
    }
}

#[tonic::async_trait]
impl ReadStates for BaselineService {
    async fn get_read_states(
        &self,
        _: Request<GetReadStatesRequest>,
    ) -> Result<Response<GetReadStatesResponse>, Status> {
        Ok(Response::new(self.read_states.clone()))
    }

    async fn ack(&self, _: Request<AckRequest>) -> Result<Response<AckResponse>, Status> {
        Ok(Response::new(AckResponse {
            applied: true,
            version: self.one.version,
            read_state: Some(self.one),
        }))
    }

    async fn set_channel_counting(
        &self,
        _: Request<SetChannelCountingRequest>,
    ) -> Result<Response<SetChannelCountingResponse>, Status> {
        Ok(Response::new(SetChannelCountingResponse { applied: true }))
    }

    async fn follow_thread(
        &self,
        _: Request<FollowThreadRequest>,
    ) -> Result<Response<FollowThreadResponse>, Status> {
        Ok(Response::new(FollowThreadResponse {
            applied: true,
            version: 1,
            read_state: Some(self.one),
        }))
    }

    async fn bulk_ack(
        &self,
        request: Request<BulkAckRequest>,
    ) -> Result<Response<BulkAckResponse>, Status> {
        let entries = request.get_ref().entries.len();
        Ok(Response::new(BulkAckResponse {
            version: self.one.version,
            read_states: vec![self.one; entries],
        }))
    }

    async fn message_created(
        &self,
        request: Request<MessageCreatedRequest>,
    ) -> Result<Response<MessageCreatedResponse>, Status> {
        let r = request.get_ref();
        Ok(Response::new(MessageCreatedResponse {
            updated: (r.mentioned_user_ids.len() + r.unread_user_ids.len()) as u32,
        }))
    }

    async fn delete_read_states(
        &self,
        _: Request<DeleteReadStatesRequest>,
    ) -> Result<Response<DeleteReadStatesResponse>, Status> {
        Ok(Response::new(DeleteReadStatesResponse {
            version: self.one.version,
            deleted: 1,
        }))
    }

    async fn get_badge_counts(
        &self,
        request: Request<GetBadgeCountsRequest>,
    ) -> Result<Response<GetBadgeCountsResponse>, Status> {
        Ok(Response::new(badge_counts(&request.get_ref().user_ids)))
    }

    async fn ack_all(&self, _: Request<AckAllRequest>) -> Result<Response<AckAllResponse>, Status> {
        Ok(Response::new(AckAllResponse {
            version: self.one.version,
            updated: 1,
        }))
    }

    async fn message_deleted(
        &self,
        request: Request<MessageDeletedRequest>,
    ) -> Result<Response<MessageDeletedResponse>, Status> {
        let r = request.get_ref();
        Ok(Response::new(MessageDeletedResponse {
            updated: (r.mentioned_user_ids.len() + r.unread_user_ids.len()) as u32,
        }))
    }

    async fn set_muted(
        &self,
        _: Request<SetMutedRequest>,
    ) -> Result<Response<SetMutedResponse>, Status> {
        Ok(Response::new(SetMutedResponse {
            applied: true,
            version: self.one.version,
            read_state: Some(self.one),
        }))
    }

    type WatchStream = tokio_stream::Pending<Result<WatchEvent, Status>>;

    /// Sends nothing: the baseline has no changes to send.
    async fn watch(
        &self,
        _: Request<tonic::Streaming<WatchRequest>>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Ok(Response::new(tokio_stream::pending()))
    }

    type ApplyStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<ApplyResponse, Status>> + Send>>;

    /// Each batch answered at once, every item with its canned answer.
    async fn apply(
        &self,
        request: Request<tonic::Streaming<ApplyRequest>>,
    ) -> Result<Response<Self::ApplyStream>, Status> {
        let service = self.clone();
        let answers = request.into_inner().map(move |batch| {
            let results = batch?
                .items
                .into_iter()
                .map(|item| ApplyResult {
                    id: item.id,
                    outcome: item.change.map(|change| service.outcome(change)),
                })
                .collect();
            Ok(ApplyResponse { results })
        });
        Ok(Response::new(Box::pin(answers)))
    }

    /// Standalone, as a readstates node without `--node-id` answers.
    async fn get_routing_table(
        &self,
        _: Request<GetRoutingTableRequest>,
    ) -> Result<Response<GetRoutingTableResponse>, Status> {
        Ok(Response::new(GetRoutingTableResponse::default()))
    }
}

impl BaselineService {
    /// The canned answer to one Apply item, as its unary call's.
    fn outcome(&self, change: apply_item::Change) -> apply_result::Outcome {
        use apply_item::Change as C;
        use apply_result::Outcome as O;
        let one = self.one;
        match change {
            C::Ack(_) => O::Ack(AckResponse {
                applied: true,
                version: one.version,
                read_state: Some(one),
            }),
            C::BulkAck(r) => O::BulkAck(BulkAckResponse {
                version: one.version,
                read_states: vec![one; r.entries.len()],
            }),
            C::MessageCreated(r) => O::MessageCreated(MessageCreatedResponse {
                updated: (r.mentioned_user_ids.len() + r.unread_user_ids.len()) as u32,
            }),
            C::MessageDeleted(r) => O::MessageDeleted(MessageDeletedResponse {
                updated: (r.mentioned_user_ids.len() + r.unread_user_ids.len()) as u32,
            }),
            C::AckAll(_) => O::AckAll(AckAllResponse {
                version: one.version,
                updated: 1,
            }),
            C::SetMuted(_) => O::SetMuted(SetMutedResponse {
                applied: true,
                version: one.version,
                read_state: Some(one),
            }),
            C::DeleteReadStates(_) => O::DeleteReadStates(DeleteReadStatesResponse {
                version: one.version,
                deleted: 1,
            }),
            C::GetBadgeCounts(r) => O::GetBadgeCounts(badge_counts(&r.user_ids)),
        }
    }
}

fn badge_counts(user_ids: &[u64]) -> GetBadgeCountsResponse {
    let counts = user_ids
        .iter()
        .map(|&user_id| BadgeCount {
            user_id,
            total_mention_count: 1,
            unread_channel_count: 1,
            ..BadgeCount::default()
        })
        .collect();
    GetBadgeCountsResponse { counts }
}

/// Serves the baseline on `listener` until the process ends, with the same
/// transport settings as readstates.
pub async fn serve(listener: TcpListener, read_states: u64) -> anyhow::Result<()> {
    tonic::transport::Server::builder()
        .add_service(ReadStatesServer::new(BaselineService::new(read_states)))
        .serve_with_incoming(readstates::app::incoming(listener))
        .await
        .context("baseline server")
}

pub async fn bind(address: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(address)
        .await
        .with_context(|| format!("bind {address}"))
}
