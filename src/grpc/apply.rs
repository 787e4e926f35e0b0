//! `Apply`: changes in batches on one long-lived stream. Each item is the
//! unary call of its kind, run by the same handler through the same
//! routing, so it means exactly what the call means; the stream saves the
//! per-call transport, which is most of what a small change costs.
//!
//! A task per stream reads batches a few ahead ([`READ_AHEAD`]) and
//! applies each batch's items in order for each user; an item that has to
//! wait (a load, an owner elsewhere) lets the items of other users go on
//! (see [`ReadStatesService::apply_batch`]). Its results go out as
//! one response per batch; a client that does not read them stops the task,
//! which then stops reading: memory per stream stays bounded, and the
//! client is slowed by flow control. Shutdown answers the items read but
//! not applied with UNAVAILABLE and ends the stream with UNAVAILABLE.

use std::collections::HashSet;
use std::pin::Pin;
use std::task::Poll;

use futures::stream::FuturesUnordered;
use futures::{FutureExt, Stream, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::time::{Duration, Instant};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::route::Hop;
use super::validate::{self, MAX_APPLY_ITEMS};
use super::{
    Origin, ReadStatesService, ack, ack_all, bulk_ack, delete_read_states, get_badge_counts,
    message_created, message_deleted, set_muted,
};
use crate::error::Error;
use crate::metrics::MethodMetrics;
use crate::proto::apply_item::Change;
use crate::proto::apply_result::Outcome;
use crate::proto::{ApplyError, ApplyItem, ApplyRequest, ApplyResponse, ApplyResult};

pub type ApplyStream = Pin<Box<dyn Stream<Item = Result<ApplyResponse, Status>> + Send>>;

/// Batches read ahead of the one being applied: the client's next batches
/// are on hand when one is done, and at most this many (of up to
/// [`MAX_APPLY_ITEMS`] items each) wait in memory.
const READ_AHEAD: usize = 4;

/// Responses the client has not read yet before the stream stops applying.
const UNREAD_RESPONSES: usize = 4;

/// Each item kind's metrics (method `Apply.<Kind>`), apart from the unary
/// calls'.
#[derive(Debug)]
pub struct ItemMetrics {
    ack: MethodMetrics,
    bulk_ack: MethodMetrics,
    message_created: MethodMetrics,
    message_deleted: MethodMetrics,
    ack_all: MethodMetrics,
    set_muted: MethodMetrics,
    delete_read_states: MethodMetrics,
    get_badge_counts: MethodMetrics,
}

impl ItemMetrics {
    pub fn new(node: &str) -> ItemMetrics {
        ItemMetrics {
            ack: MethodMetrics::new("Apply.Ack", node),
            bulk_ack: MethodMetrics::new("Apply.BulkAck", node),
            message_created: MethodMetrics::new("Apply.MessageCreated", node),
            message_deleted: MethodMetrics::new("Apply.MessageDeleted", node),
            ack_all: MethodMetrics::new("Apply.AckAll", node),
            set_muted: MethodMetrics::new("Apply.SetMuted", node),
            delete_read_states: MethodMetrics::new("Apply.DeleteReadStates", node),
            get_badge_counts: MethodMetrics::new("Apply.GetBadgeCounts", node),
        }
    }
}

/// Starts serving one stream, which came `hop`; `permit` is its place
/// among the node's Apply streams, held until it ends.
pub fn handle(
    service: ReadStatesService,
    requests: Streaming<ApplyRequest>,
    hop: Hop,
    permit: OwnedSemaphorePermit,
) -> ApplyStream {
    let (responses, sent) = mpsc::channel(UNREAD_RESPONSES);
    tokio::spawn(async move {
        serve(service, requests, hop, responses).await;
        drop(permit);
    });
    Box::pin(ReceiverStream::new(sent))
}

type Responses = mpsc::Sender<Result<ApplyResponse, Status>>;

/// Applies the stream's batches until it ends, the client goes away, or
/// shutdown begins.
async fn serve(
    service: ReadStatesService,
    requests: Streaming<ApplyRequest>,
    hop: Hop,
    responses: Responses,
) {
    let (read, mut pending) = mpsc::channel(READ_AHEAD);
    tokio::spawn(read_requests(requests, read));
    let stopping = service.stopping.clone();
    loop {
        let next = tokio::select! {
            biased;
            () = stopping.cancelled() => break,
            () = responses.closed() => return,
            next = pending.recv() => next,
        };
        let batch = match next {
            Some(Ok(batch)) => batch,
            // The client half-closed, and every item is answered.
            None => return,
            Some(Err(status)) => {
                let error = Error::BadStream(status.message().to_owned());
                let _ = responses.send(Err(error.into())).await;
                return;
            }
        };
        // Applied: answered even if shutdown begins meanwhile, as soon as
        // the client reads (one that never does is cut off when the
        // shutdown's grace for requests runs out).
        let results = service.apply_batch(batch, &hop).await;
        if responses.send(Ok(ApplyResponse { results })).await.is_err() {
            return;
        }
    }
    // Shutdown: what was read is answered, unapplied, and the stream ends.
    pending.close();
    while let Some(Ok(batch)) = pending.recv().await {
        let results = batch
            .items
            .iter()
            .map(|item| refused(item.id, &Error::ShuttingDown))
            .collect();
        if responses.send(Ok(ApplyResponse { results })).await.is_err() {
            return;
        }
    }
    let _ = responses.send(Err(Error::ShuttingDown.into())).await;
}

/// A batch read ahead, or why the request stream cannot be read (boxed: a
/// `Status` is several times a batch's size).
type Read = Result<ApplyRequest, Box<Status>>;

/// Reads batches until the stream ends (an undecodable one is passed on,
/// and ends it) or nobody takes them any more.
async fn read_requests(mut requests: Streaming<ApplyRequest>, read: mpsc::Sender<Read>) {
    loop {
        let message = tokio::select! {
            () = read.closed() => return,
            message = requests.message() => message,
        };
        let batch = match message {
            Ok(Some(batch)) => Ok(batch),
            Ok(None) => return,
            Err(status) => Err(Box::new(status)),
        };
        let ends = batch.is_err();
        if read.send(batch).await.is_err() || ends {
            return;
        }
    }
}

impl ReadStatesService {
    /// Every item of `batch`, answered, each within the batch's timeout;
    /// those left when shutdown begins are not applied. Items start in
    /// order, and an item that has to wait (a load, an owner elsewhere)
    /// waits while the items after it go on, unless they touch one of its
    /// users: those wait until every item under way is done, so each
    /// user's changes apply in the order sent. A batch of cached users
    /// runs one item after another with nothing to spare; one of cold or
    /// remote users waits for about one load or round trip, not one each.
    async fn apply_batch(&self, batch: ApplyRequest, hop: &Hop) -> Vec<ApplyResult> {
        let started = Instant::now();
        if let Err(error) = validate::at_most("items", batch.items.len(), MAX_APPLY_ITEMS) {
            return batch
                .items
                .iter()
                .map(|item| refused(item.id, &error))
                .collect();
        }
        let until = (batch.timeout_ms > 0)
            .then(|| started + Duration::from_millis(batch.timeout_ms.into()));
        let mut results: Vec<ApplyResult> = Vec::with_capacity(batch.items.len());
        let mut waiting = FuturesUnordered::new();
        // The users of the items in `waiting`.
        let mut busy: HashSet<u64> = HashSet::new();
        for item in batch.items {
            let users = touched(&item);
            if users.iter().any(|user| busy.contains(user)) {
                while let Some(answer) = waiting.next().await {
                    answered(&mut results, answer);
                }
                busy.clear();
            }
            let index = results.len();
            results.push(ApplyResult {
                id: item.id,
                outcome: None,
            });
            let outcome = if self.stopping.is_cancelled() {
                Outcome::Error(apply_error(&Error::ShuttingDown.into()))
            } else if until.is_some_and(|until| Instant::now() >= until) {
                Outcome::Error(apply_error(&Error::DeadlineExceeded.into()))
            } else {
                let origin = Origin {
                    started: Instant::now(),
                    until,
                    hop: hop.clone(),
                };
                let mut applying = Box::pin(self.apply_item(item.change, origin));
                match futures::poll!(applying.as_mut()) {
                    Poll::Ready(outcome) => outcome,
                    Poll::Pending => {
                        busy.extend(users);
                        waiting.push(applying.map(move |outcome| (index, outcome)));
                        continue;
                    }
                }
            };
            results[index].outcome = Some(outcome);
        }
        while let Some(answer) = waiting.next().await {
            answered(&mut results, answer);
        }
        results
    }

    /// One item, as its unary call would run it.
    async fn apply_item(&self, change: Option<Change>, origin: Origin) -> Outcome {
        let metrics = &self.item_metrics;
        let Some(change) = change else {
            let error = Error::invalid("change", "must be set");
            return Outcome::Error(apply_error(&error.into()));
        };
        let result = match change {
            Change::Ack(r) => self
                .run_routed(&metrics.ack, origin, r, ack::handle, Some(ack::forward))
                .await
                .map(Outcome::Ack),
            Change::BulkAck(r) => self
                .run_routed(
                    &metrics.bulk_ack,
                    origin,
                    r,
                    bulk_ack::handle,
                    Some(bulk_ack::forward),
                )
                .await
                .map(Outcome::BulkAck),
            Change::AckAll(r) => self
                .run_routed(
                    &metrics.ack_all,
                    origin,
                    r,
                    ack_all::handle,
                    Some(ack_all::forward),
                )
                .await
                .map(Outcome::AckAll),
            Change::SetMuted(r) => self
                .run_routed(
                    &metrics.set_muted,
                    origin,
                    r,
                    set_muted::handle,
                    Some(set_muted::forward),
                )
                .await
                .map(Outcome::SetMuted),
            Change::DeleteReadStates(r) => self
                .run_routed(
                    &metrics.delete_read_states,
                    origin,
                    r,
                    delete_read_states::handle,
                    Some(delete_read_states::forward),
                )
                .await
                .map(Outcome::DeleteReadStates),
            Change::MessageCreated(r) => self
                .run_scattered(
                    &metrics.message_created,
                    origin,
                    r,
                    message_created::handle,
                    message_created::forward,
                )
                .await
                .map(Outcome::MessageCreated),
            Change::MessageDeleted(r) => self
                .run_scattered(
                    &metrics.message_deleted,
                    origin,
                    r,
                    message_deleted::handle,
                    message_deleted::forward,
                )
                .await
                .map(Outcome::MessageDeleted),
            Change::GetBadgeCounts(r) => self
                .run_scattered(
                    &metrics.get_badge_counts,
                    origin,
                    r,
                    get_badge_counts::handle,
                    get_badge_counts::forward,
                )
                .await
                .map(Outcome::GetBadgeCounts),
        };
        result.unwrap_or_else(|status| Outcome::Error(apply_error(&status)))
    }
}

/// The users an item touches, as its request names them (the ids of an
/// invalid one too: it fails anyway).
fn touched(item: &ApplyItem) -> Vec<u64> {
    match &item.change {
        Some(Change::Ack(r)) => vec![r.user_id],
        Some(Change::BulkAck(r)) => vec![r.user_id],
        Some(Change::AckAll(r)) => vec![r.user_id],
        Some(Change::SetMuted(r)) => vec![r.user_id],
        Some(Change::DeleteReadStates(r)) => vec![r.user_id],
        Some(Change::MessageCreated(r)) => [r.author_id]
            .into_iter()
            .chain(r.mentioned_user_ids.iter().copied())
            .chain(r.unread_user_ids.iter().copied())
            .collect(),
        Some(Change::MessageDeleted(r)) => r
            .mentioned_user_ids
            .iter()
            .chain(&r.unread_user_ids)
            .copied()
            .collect(),
        Some(Change::GetBadgeCounts(r)) => r.user_ids.clone(),
        None => vec![],
    }
}

/// Puts the outcome of the item at `index` in its place.
fn answered(results: &mut [ApplyResult], (index, outcome): (usize, Outcome)) {
    results[index].outcome = Some(outcome);
}

/// An item answered with `error` and not applied.
fn refused(id: u64, error: &Error) -> ApplyResult {
    ApplyResult {
        id,
        outcome: Some(Outcome::Error(apply_error(&error.clone().into()))),
    }
}

fn apply_error(status: &Status) -> ApplyError {
    ApplyError {
        code: status.code() as i32,
        message: status.message().to_owned(),
    }
}
