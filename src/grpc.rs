//! The `readstates.v1.ReadStates` gRPC service: one file per RPC, each
//! turning a request into validated domain calls on the cache.
//!
//! Every call passes through [`ReadStatesService::call`], which bounds the
//! requests in progress, records the method's status and latency, and maps
//! [`Error`] to a gRPC status.

mod ack;
mod bulk_ack;
mod convert;
mod delete_read_states;
mod get_badge_counts;
mod get_read_states;
mod message_created;
pub mod validate;

use std::future::Future;
use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use crate::cache::Cache;
use crate::error::Error;
use crate::metrics;
use crate::proto::read_states_server::ReadStates;
use crate::proto::*;

#[derive(Debug, Clone)]
pub struct ReadStatesService {
    cache: Arc<Cache>,
    in_progress: Arc<Semaphore>,
    max_in_progress: usize,
}

impl ReadStatesService {
    pub fn new(cache: Arc<Cache>, max_in_progress: usize) -> ReadStatesService {
        ReadStatesService {
            cache,
            in_progress: Arc::new(Semaphore::new(max_in_progress)),
            max_in_progress,
        }
    }

    async fn call<Req, Resp, F>(
        &self,
        method: &'static str,
        request: Request<Req>,
        handler: impl FnOnce(Arc<Cache>, Req) -> F,
    ) -> Result<Response<Resp>, Status>
    where
        F: Future<Output = Result<Resp, Error>>,
    {
        let started = Instant::now();
        let result = match self.in_progress.try_acquire() {
            Ok(_permit) => handler(self.cache.clone(), request.into_inner()).await,
            Err(_) => Err(Error::Overloaded {
                limit: self.max_in_progress,
            }),
        };
        let code = result
            .as_ref()
            .map_or_else(Error::code, |_| tonic::Code::Ok);
        metrics::request(method, code, started.elapsed());
        result.map(Response::new).map_err(Status::from)
    }
}

#[tonic::async_trait]
impl ReadStates for ReadStatesService {
    async fn get_read_states(
        &self,
        request: Request<GetReadStatesRequest>,
    ) -> Result<Response<GetReadStatesResponse>, Status> {
        self.call("GetReadStates", request, get_read_states::handle)
            .await
    }

    async fn ack(&self, request: Request<AckRequest>) -> Result<Response<AckResponse>, Status> {
        self.call("Ack", request, ack::handle).await
    }

    async fn bulk_ack(
        &self,
        request: Request<BulkAckRequest>,
    ) -> Result<Response<BulkAckResponse>, Status> {
        self.call("BulkAck", request, bulk_ack::handle).await
    }

    async fn message_created(
        &self,
        request: Request<MessageCreatedRequest>,
    ) -> Result<Response<MessageCreatedResponse>, Status> {
        self.call("MessageCreated", request, message_created::handle)
            .await
    }

    async fn delete_read_states(
        &self,
        request: Request<DeleteReadStatesRequest>,
    ) -> Result<Response<DeleteReadStatesResponse>, Status> {
        self.call("DeleteReadStates", request, delete_read_states::handle)
            .await
    }

    async fn get_badge_counts(
        &self,
        request: Request<GetBadgeCountsRequest>,
    ) -> Result<Response<GetBadgeCountsResponse>, Status> {
        self.call("GetBadgeCounts", request, get_badge_counts::handle)
            .await
    }
}
