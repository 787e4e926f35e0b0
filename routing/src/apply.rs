//! One `Apply` stream to one node, shared by many callers: each sends a
//! change and waits for its outcome; a task takes whatever is queued (up
//! to a batch's worth) as one batch, without waiting for more, so batches
//! fill under load and stay small when it is light.
//!
//! Every change sent is answered once:
//! - its item's result ([`Outcome`]), or its error as a [`Status`] with
//!   the owner and epoch of a refusal in its metadata, as a unary call's
//!   trailers carry them;
//! - UNAVAILABLE (not applied) if the stream never sent it: it could not
//!   be opened, or had ended (a node without `Apply` answers UNIMPLEMENTED,
//!   also not applied);
//! - CANCELLED if it was sent and the stream ended before its answer: it
//!   may or may not have been applied, and is safe to send again;
//! - DEADLINE_EXCEEDED past its timeout (sent with it, so that the node
//!   does not begin it later).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use crate::client::{EPOCH, OWNER};
use crate::proto::apply_item::Change;
use crate::proto::apply_result::Outcome;
use crate::proto::read_states_client::ReadStatesClient;
use crate::proto::{ApplyError, ApplyItem, ApplyRequest, ApplyResponse};

/// The most items a node takes in one batch.
pub const MAX_BATCH: usize = 1_000;

/// Batches handed to the transport and not sent yet: the node reads a few
/// ahead of what it applies, and this keeps the pipe that full.
const BATCHES_QUEUED: usize = 4;

/// How long opening a stream may take before its changes are refused.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

type Answer = oneshot::Sender<Result<Outcome, Status>>;

struct Queued {
    change: Change,
    timeout: Option<Duration>,
    answer: Answer,
}

/// A stream to one node; cheap to clone, and ends when the node ends it,
/// the connection breaks, or every clone is dropped (once its changes are
/// answered).
#[derive(Clone, Debug)]
pub struct Applier {
    queue: mpsc::Sender<Queued>,
    state: Arc<AtomicU8>,
}

/// Where a stream is: [`OPENING`] until the node answers the call, then
/// [`OPEN`], and [`ENDED`] once nothing more is sent on it.
const OPENING: u8 = 0;
const OPEN: u8 = 1;
const ENDED: u8 = 2;

impl Applier {
    /// Opens a stream over `channel` (with `metadata` on its call), whose
    /// batches hold at most `batch` changes. Changes can be sent at once;
    /// they wait while it opens.
    pub fn open(channel: Channel, metadata: MetadataMap, batch: usize) -> Applier {
        let batch = batch.clamp(1, MAX_BATCH);
        let (queue, queued) = mpsc::channel(batch * BATCHES_QUEUED);
        let state = Arc::new(AtomicU8::new(OPENING));
        let stream = Stream {
            queued,
            batch,
            state: state.clone(),
        };
        tokio::spawn(stream.run(channel, metadata));
        Applier { queue, state }
    }

    /// Whether the node has answered the call: it has `Apply`.
    pub fn is_open(&self) -> bool {
        self.state.load(Ordering::Acquire) == OPEN
    }

    /// Whether the stream has ended: a new one is needed.
    pub fn is_ended(&self) -> bool {
        self.state.load(Ordering::Acquire) == ENDED || self.queue.is_closed()
    }

    /// Sends `change` and waits for its outcome, at most `timeout` (which
    /// the node enforces too); see the module doc for the errors.
    pub async fn apply(
        &self,
        change: Change,
        timeout: Option<Duration>,
    ) -> Result<Outcome, Status> {
        let (answer, answered) = oneshot::channel();
        let queued = Queued {
            change,
            timeout,
            answer,
        };
        let waiting = async {
            self.queue.send(queued).await.map_err(|_| not_sent())?;
            answered.await.unwrap_or_else(|_| Err(unanswered()))
        };
        match timeout {
            Some(timeout) => tokio::time::timeout(timeout, waiting)
                .await
                .unwrap_or_else(|_| Err(Status::deadline_exceeded("no answer in time"))),
            None => waiting.await,
        }
    }
}

/// The task side of an [`Applier`].
struct Stream {
    queued: mpsc::Receiver<Queued>,
    batch: usize,
    state: Arc<AtomicU8>,
}

impl Stream {
    async fn run(mut self, channel: Channel, metadata: MetadataMap) {
        let (batches, outgoing) = mpsc::channel(BATCHES_QUEUED);
        let mut call = Request::new(ReceiverStream::new(outgoing));
        *call.metadata_mut() = metadata;
        let mut client = ReadStatesClient::new(channel);
        let opening = client.apply(call);
        let results = match tokio::time::timeout(OPEN_TIMEOUT, opening).await {
            Ok(Ok(results)) => results.into_inner(),
            Ok(Err(status)) if status.code() == Code::Unimplemented => return self.end(status),
            Ok(Err(status)) => {
                let message = format!("Apply stream not opened: {}", status.message());
                return self.end(Status::unavailable(message));
            }
            Err(_) => return self.end(Status::unavailable("Apply stream not opened in time")),
        };
        self.state.store(OPEN, Ordering::Release);
        self.serve(batches, results).await;
        self.end(not_sent());
    }

    /// Sends what is queued and hands out results until the stream ends.
    async fn serve(
        &mut self,
        batches: mpsc::Sender<ApplyRequest>,
        mut results: tonic::Streaming<ApplyResponse>,
    ) {
        let mut waiting: HashMap<u64, Answer> = HashMap::new();
        let mut next_id = 0u64;
        let (queued, batch) = (&mut self.queued, self.batch);
        let mut taken = Vec::with_capacity(batch);
        // `None` once every Applier is gone: the stream is half-closed.
        let mut batches = Some(batches);
        loop {
            if batches.is_none() && waiting.is_empty() {
                return;
            }
            tokio::select! {
                result = results.message() => match result {
                    Ok(Some(response)) => {
                        for result in response.results {
                            if let Some(answer) = waiting.remove(&result.id) {
                                let _ = answer.send(outcome(result.outcome));
                            }
                        }
                    }
                    // Ended (by the node, or broken): whatever was sent and
                    // not answered may have been applied.
                    Ok(None) | Err(_) => break,
                },
                // Room in the transport first, then what is queued by then.
                Some(taken_now) = async {
                    let Ok(permit) = batches.clone()?.reserve_owned().await else {
                        return Some(None);
                    };
                    let count = queued.recv_many(&mut taken, batch).await;
                    Some(Some((permit, count)))
                }, if batches.is_some() => {
                    // The transport dropped the request stream: broken.
                    let Some((permit, count)) = taken_now else { break };
                    if count == 0 {
                        drop(permit);
                        batches = None;
                        continue;
                    }
                    let mut items = Vec::with_capacity(count);
                    for Queued { change, timeout, answer } in taken.drain(..) {
                        next_id += 1;
                        waiting.insert(next_id, answer);
                        items.push(ApplyItem {
                            id: next_id,
                            change: Some(change),
                            timeout_ms: timeout.map_or(0, timeout_ms),
                        });
                    }
                    permit.send(ApplyRequest { items, timeout_ms: 0 });
                }
            }
        }
        for (_, answer) in waiting.drain() {
            let _ = answer.send(Err(unanswered()));
        }
    }

    /// Ends the stream: every change not sent is answered with `status`.
    fn end(mut self, status: Status) {
        self.state.store(ENDED, Ordering::Release);
        self.queued.close();
        while let Ok(queued) = self.queued.try_recv() {
            let _ = queued.answer.send(Err(status.clone()));
        }
    }
}

/// A timeout in whole milliseconds, at least 1 (0 would mean none).
fn timeout_ms(timeout: Duration) -> u32 {
    u32::try_from(timeout.as_millis())
        .unwrap_or(u32::MAX)
        .max(1)
}

fn not_sent() -> Status {
    Status::unavailable("the Apply stream ended before the change was sent: not applied")
}

fn unanswered() -> Status {
    Status::cancelled(
        "the Apply stream ended before the change was answered: it may have been applied, and \
         is safe to send again",
    )
}

/// An item's outcome, its error as a [`Status`].
fn outcome(outcome: Option<Outcome>) -> Result<Outcome, Status> {
    match outcome {
        Some(Outcome::Error(error)) => Err(status(error)),
        Some(outcome) => Ok(outcome),
        None => Err(Status::internal("an Apply result without an outcome")),
    }
}

/// An item's error as the unary call's status, with its trailers.
pub fn status(error: ApplyError) -> Status {
    let mut metadata = MetadataMap::new();
    if let Ok(owner) = MetadataValue::try_from(error.owner.as_str())
        && !error.owner.is_empty()
    {
        metadata.insert(OWNER, owner);
    }
    if error.epoch > 0 {
        metadata.insert(EPOCH, MetadataValue::from(error.epoch));
    }
    Status::with_metadata(Code::from_i32(error.code), error.message, metadata)
}
