//! The `readstates.v1.ReadStates` gRPC service: one file per RPC, each
//! turning a request into validated domain calls on the cache.
//!
//! Every call passes through [`ReadStatesService::call`], which bounds the
//! requests in progress, records the method's status and latency, and maps
//! [`Error`] to a gRPC status.

mod ack;
mod bulk_ack;
mod convert;
mod deadline;
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
use crate::metrics::MethodMetrics;
use crate::proto::read_states_server::ReadStates;
use crate::proto::*;

#[derive(Debug, Clone)]
pub struct ReadStatesService {
    cache: Arc<Cache>,
    in_progress: Arc<Semaphore>,
    max_in_progress: usize,
    metrics: Arc<Methods>,
}

/// Each method's request metrics.
#[derive(Debug)]
struct Methods {
    get_read_states: MethodMetrics,
    ack: MethodMetrics,
    bulk_ack: MethodMetrics,
    message_created: MethodMetrics,
    delete_read_states: MethodMetrics,
    get_badge_counts: MethodMetrics,
}

impl ReadStatesService {
    pub fn new(cache: Arc<Cache>, max_in_progress: usize) -> ReadStatesService {
        ReadStatesService {
            cache,
            in_progress: Arc::new(Semaphore::new(max_in_progress)),
            max_in_progress,
            metrics: Arc::new(Methods {
                get_read_states: MethodMetrics::new("GetReadStates"),
                ack: MethodMetrics::new("Ack"),
                bulk_ack: MethodMetrics::new("BulkAck"),
                message_created: MethodMetrics::new("MessageCreated"),
                delete_read_states: MethodMetrics::new("DeleteReadStates"),
                get_badge_counts: MethodMetrics::new("GetBadgeCounts"),
            }),
        }
    }

    async fn call<Req, Resp, F>(
        &self,
        metrics: &MethodMetrics,
        request: Request<Req>,
        handler: impl FnOnce(Arc<Cache>, Req) -> F,
    ) -> Result<Response<Resp>, Status>
    where
        F: Future<Output = Result<Resp, Error>>,
    {
        let started = Instant::now();
        let budget = deadline::budget(request.metadata());
        let result = match self.in_progress.try_acquire() {
            Ok(_permit) => {
                let handling = handler(self.cache.clone(), request.into_inner());
                match budget {
                    Some(budget) => tokio::time::timeout(budget, handling)
                        .await
                        .unwrap_or(Err(Error::DeadlineExceeded)),
                    None => handling.await,
                }
            }
            Err(_) => Err(Error::Overloaded {
                limit: self.max_in_progress,
            }),
        };
        let code = result
            .as_ref()
            .map_or_else(Error::code, |_| tonic::Code::Ok);
        metrics.record(code, started.elapsed());
        result.map(Response::new).map_err(Status::from)
    }
}

#[tonic::async_trait]
impl ReadStates for ReadStatesService {
    async fn get_read_states(
        &self,
        request: Request<GetReadStatesRequest>,
    ) -> Result<Response<GetReadStatesResponse>, Status> {
        self.call(
            &self.metrics.get_read_states,
            request,
            get_read_states::handle,
        )
        .await
    }

    async fn ack(&self, request: Request<AckRequest>) -> Result<Response<AckResponse>, Status> {
        self.call(&self.metrics.ack, request, ack::handle).await
    }

    async fn bulk_ack(
        &self,
        request: Request<BulkAckRequest>,
    ) -> Result<Response<BulkAckResponse>, Status> {
        self.call(&self.metrics.bulk_ack, request, bulk_ack::handle)
            .await
    }

    async fn message_created(
        &self,
        request: Request<MessageCreatedRequest>,
    ) -> Result<Response<MessageCreatedResponse>, Status> {
        self.call(
            &self.metrics.message_created,
            request,
            message_created::handle,
        )
        .await
    }

    async fn delete_read_states(
        &self,
        request: Request<DeleteReadStatesRequest>,
    ) -> Result<Response<DeleteReadStatesResponse>, Status> {
        self.call(
            &self.metrics.delete_read_states,
            request,
            delete_read_states::handle,
        )
        .await
    }

    async fn get_badge_counts(
        &self,
        request: Request<GetBadgeCountsRequest>,
    ) -> Result<Response<GetBadgeCountsResponse>, Status> {
        self.call(
            &self.metrics.get_badge_counts,
            request,
            get_badge_counts::handle,
        )
        .await
    }
}
