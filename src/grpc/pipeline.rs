//! The path every call takes, by kind: a user's call is routed to the
//! user's owner (forwarded, or held while its slot moves here) and run
//! ([`ReadStatesService::call_routed`]); a call for many users is split by
//! owner and its parts gathered ([`ReadStatesService::call_scattered`]);
//! either way [`ReadStatesService::run`] bounds the requests in progress,
//! records the method's status and latency, and maps [`Error`] to a status.
//! A unary call's phases are timed ([`crate::timing`], [`super::timed`]).

use std::future::Future;
use std::sync::Arc;

use tokio::time::{Duration, Instant};
use tonic::{Request, Response, Status};

use super::forward::Forward;
use super::scatter::Scatter;
use super::timed::Timed;
use super::{Origin, ReadStatesService, by_channel, route, validate};
use crate::cache::Cache;
use crate::error::Error;
use crate::metrics::MethodMetrics;
use crate::ownership::SlotState;
use crate::proto::*;
use crate::read_state::{Key, Kind};
use crate::timing;

impl ReadStatesService {
    /// [`Self::run_routed`], for a unary call.
    pub(super) async fn call_routed<Req, F>(
        &self,
        metrics: &MethodMetrics,
        request: Request<Req>,
        handler: impl Fn(Arc<Cache>, Req) -> F,
    ) -> Result<Response<Req::Response>, Status>
    where
        Req: Forward,
        F: Future<Output = Result<Req::Response, Error>>,
    {
        let origin = Origin::of(request.metadata(), self.hop_of(&request)?);
        let timed = self.timed(metrics, request.metadata());
        let running = self.run_routed(metrics, origin, request.into_inner(), handler, true);
        let (result, breakdown) = timing::scope(running).await;
        timed.end(result.map(Response::new), breakdown)
    }

    /// How a unary request's end is timed (see [`Timed`]).
    fn timed(&self, metrics: &MethodMetrics, metadata: &tonic::metadata::MetadataMap) -> Timed {
        Timed {
            method: metrics.method(),
            slow: self.config.slow_request,
            asked: Timed::asked(metadata),
        }
    }

    /// Runs a request: bounds the requests in progress, enforces the
    /// deadline, records the method's status and latency, and maps
    /// [`Error`] to a gRPC status. On a fleet node, a request for a user
    /// whose slot is being acquired waits for it (see [`route::HOLD`]), and
    /// one for a user served elsewhere goes to its owner if it `forwards`,
    /// unless it was forwarded already.
    pub(super) async fn run_routed<Req, F>(
        &self,
        metrics: &MethodMetrics,
        origin: Origin,
        request: Req,
        handler: impl Fn(Arc<Cache>, Req) -> F,
        forwards: bool,
    ) -> Result<Req::Response, Status>
    where
        Req: Forward,
        F: Future<Output = Result<Req::Response, Error>>,
    {
        let Origin {
            started,
            until,
            hop,
            epoch,
        } = origin;
        self.catch_up(epoch, until).await;
        // Kept only where the request may have to be sent on.
        let goes_on = match hop {
            route::Hop::First => true,
            route::Hop::Forwarded(_) => forwards,
            route::Hop::PassedOn => false,
        };
        let again = (self.router.is_some() && goes_on).then(|| request.clone());
        let left = || until.map(|until| until.saturating_duration_since(Instant::now()));
        let mut result = match &again {
            // A request that may be sent on is not held here: where its
            // user is served (the previous owner, while this node acquires
            // the slot) is asked first.
            Some(_) => self.run(request, left(), &handler).await,
            None => self.run_held(request, until, &handler).await,
        };
        if let (Some(router), Some(request)) = (&self.router, again)
            && let Err(Error::NotServed { user_id, state }) = result
        {
            let passed_on = matches!(hop, route::Hop::Forwarded(_));
            if forwards
                && let Some(answer) = router
                    .forward(user_id, request.clone(), &hop, route::pass_on_budget(&hop, left()))
                    .await
                // The previous owner of a slot being acquired here refuses
                // once it is releasing it (or, passed on, does not answer
                // within the hold): then wait for it here instead.
                && !(state == SlotState::Acquiring
                    && matches!(&answer, Err(s) if route::not_applied(s, passed_on)))
            {
                let code = answer
                    .as_ref()
                    .map_or_else(Status::code, |_| tonic::Code::Ok);
                metrics.record(code, started.elapsed());
                return answer;
            }
            if state == SlotState::Acquiring && router.hold(user_id, until).await {
                result = self.run(request, left(), &handler).await;
            }
        }
        let code = result
            .as_ref()
            .map_or_else(Error::code, |_| tonic::Code::Ok);
        metrics.record(code, started.elapsed());
        result.map_err(|error| match (&self.router, &error) {
            (Some(router), Error::NotServed { user_id, .. }) => router.refusal(&error, *user_id),
            _ => Status::from(error),
        })
    }

    /// A request sent on by a node in a newer `epoch` (this one is behind
    /// by up to a ring poll) is routed once this node has caught up with
    /// it (at most [`route::HOLD`], and `until`), as the sender found it,
    /// rather than refused by an older ring.
    async fn catch_up(&self, epoch: u64, until: Option<Instant>) {
        if let Some(router) = &self.router
            && epoch > router.member.ring().ring.epoch()
        {
            let left = until.map_or(route::HOLD, |u| u.saturating_duration_since(Instant::now()));
            router.member.catch_up(epoch, left.min(route::HOLD)).await;
        }
    }

    /// [`Self::run_scattered`], for a unary call.
    pub(super) async fn call_scattered<Req, F>(
        &self,
        metrics: &MethodMetrics,
        request: Request<Req>,
        handler: impl Fn(Arc<Cache>, Req) -> F,
    ) -> Result<Response<Req::Response>, Status>
    where
        Req: Scatter,
        F: Future<Output = Result<Req::Response, Error>>,
    {
        let origin = Origin::of(request.metadata(), self.hop_of(&request)?);
        let timed = self.timed(metrics, request.metadata());
        let running = self.run_scattered(metrics, origin, request.into_inner(), handler);
        let (result, breakdown) = timing::scope(running).await;
        timed.end(result.map(Response::new), breakdown)
    }

    /// Splits a request touching many users by owner (on a fleet node, for
    /// a request not forwarded already; see [`scatter`]), or runs it here.
    pub(super) async fn run_scattered<Req, F>(
        &self,
        metrics: &MethodMetrics,
        origin: Origin,
        request: Req,
        handler: impl Fn(Arc<Cache>, Req) -> F,
    ) -> Result<Req::Response, Status>
    where
        Req: Scatter,
        F: Future<Output = Result<Req::Response, Error>>,
    {
        if origin.hop == route::Hop::First
            && let Err(error) = by_channel::from_client(request.channel_taken())
        {
            metrics.record(error.code(), origin.started.elapsed());
            return Err(error.into());
        }
        self.catch_up(origin.epoch, origin.until).await;
        let router = match (&self.router, &origin.hop) {
            (Some(router), route::Hop::First) => router,
            // A part forwarded here goes on only for users whose slot this
            // node is acquiring (see [`route::Router::next`]).
            (Some(router), hop @ route::Hop::Forwarded(_))
                if request
                    .users()
                    .is_ok_and(|users| users.iter().any(|&u| router.next(u, hop).is_some())) =>
            {
                router
            }
            _ => {
                return self
                    .run_routed(metrics, origin, request, handler, false)
                    .await;
            }
        };
        let Origin {
            started,
            until,
            hop,
            ..
        } = origin;
        let scattering = async {
            let (request, changed) = match hop {
                route::Hop::First => self.channel_first(router, request, until).await?,
                _ => (request, false),
            };
            let merged = router
                .scatter(request, &hop, until, |part| {
                    self.run_held(part, until, &handler)
                })
                .await?;
            Ok(match changed {
                true => Req::with_channel_change(merged),
                false => merged,
            })
        };
        let result = match until {
            Some(until) => tokio::time::timeout_at(until, scattering)
                .await
                .unwrap_or_else(|_| Err(Error::DeadlineExceeded.into())),
            None => scattering.await,
        };
        let code = result
            .as_ref()
            .map_or_else(Status::code, |_| tonic::Code::Ok);
        metrics.record(code, started.elapsed());
        result
    }

    /// Refuses what would make a thread read state (`kind`) on a node that
    /// does not take them (see `Config::threads`).
    pub(super) fn takes_threads(&self, kind: i32) -> Result<(), Error> {
        match kind == ReadStateKind::Thread as i32 && !self.config.threads {
            true => Err(Error::ThreadsOff),
            false => Ok(()),
        }
    }

    /// A message (or deletion) that names no members, on a node of a
    /// fleet: the channel's owner, which alone knows for sure whether the
    /// channel is counted by channel (this node's copy may lag, or, on a
    /// node that joined after a switch, be missing), makes the channel's
    /// change first (see [`change_channel`]), and the request becomes the
    /// users' parts, marked with its answer. Returns them, and whether the
    /// channel changed. Any other request, and a message from before the
    /// switch of a channel this node knows, is returned as it is.
    async fn channel_first<Req: Scatter>(
        &self,
        router: &route::Router,
        request: Req,
        until: Option<Instant>,
    ) -> Result<(Req, bool), Status> {
        let Some(change) = request.channel_change() else {
            return Ok((request, false));
        };
        // Refused whole, before its channel takes it.
        request.users().map_err(Status::from)?;
        validate::id("channel_id", change.channel_id)?;
        validate::id("message_id", change.message_id)?;
        let key = Key {
            channel_id: change.channel_id,
            kind: Kind::Channel,
        };
        let channels = self.cache.channels();
        if (channels.counted_from(key)).is_some_and(|from| change.message_id <= from) {
            return Ok((request, false));
        }
        let answer = router.change_channel(&self.cache, change, until).await?;
        Ok(match answer.counted {
            true => (
                request.taken(ChannelTaken {
                    holds: answer.holds,
                }),
                answer.changed,
            ),
            // Not counted by channel at its owner (a switch never written
            // before its owner was lost): counted per member.
            false => (request, false),
        })
    }

    /// [`Self::run`], and once more after waiting for the user's slot if it
    /// was being acquired here (see [`route::HOLD`]).
    async fn run_held<Req, Resp, F>(
        &self,
        request: Req,
        until: Option<Instant>,
        handler: &impl Fn(Arc<Cache>, Req) -> F,
    ) -> Result<Resp, Error>
    where
        Req: Clone,
        F: Future<Output = Result<Resp, Error>>,
    {
        let left = || until.map(|until| until.saturating_duration_since(Instant::now()));
        let again = self.router.as_ref().map(|_| request.clone());
        let result = self.run(request, left(), handler).await;
        if let (Some(router), Some(request)) = (&self.router, again)
            && let Err(Error::NotServed {
                user_id,
                state: SlotState::Acquiring,
            }) = result
            && router.hold(user_id, until).await
        {
            return self.run(request, left(), handler).await;
        }
        result
    }

    /// The handler within the request bound and the deadline.
    async fn run<Req, Resp, F>(
        &self,
        request: Req,
        budget: Option<Duration>,
        handler: &impl Fn(Arc<Cache>, Req) -> F,
    ) -> Result<Resp, Error>
    where
        F: Future<Output = Result<Resp, Error>>,
    {
        let Some(_entered) = self.in_progress.enter() else {
            return Err(Error::Overloaded {
                limit: self.config.max_in_progress,
            });
        };
        let handling = handler(self.cache.clone(), request);
        match budget {
            Some(budget) => tokio::time::timeout(budget, handling)
                .await
                .unwrap_or(Err(Error::DeadlineExceeded)),
            None => handling.await,
        }
    }
}
