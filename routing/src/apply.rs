//! One `Apply` stream to one node, shared by many callers: each sends a
//! change and waits for its outcome; a task takes whatever is queued (up
//! to a batch's worth, in count and in bytes) as one batch, without
//! waiting for more, so batches fill under load and stay small when it is
//! light.
//!
//! Every change sent is answered once:
//! - its item's result ([`Outcome`]), or its error as a [`Status`] with
//!   the owner and epoch of a refusal in its metadata, as a unary call's
//!   trailers carry them;
//! - UNAVAILABLE (not applied) if the stream never sent it (it could not
//!   be opened, or had ended), or if the node ended the stream saying it
//!   answered every item it read ([`ALL_ANSWERED`]: shutting down);
//! - the node's refusal of the stream itself if it could not be opened:
//!   UNIMPLEMENTED from a node that has no Apply (an older build),
//!   RESOURCE_EXHAUSTED from one at its limit of streams; not applied
//!   either ([`Applier::failed_to_open`]);
//! - CANCELLED if it was sent and the stream broke before its answer: it
//!   may or may not have been applied, and is safe to send again;
//! - DEADLINE_EXCEEDED past its timeout. The node is sent what is left of
//!   it, so that it begins nothing late, and a change whose caller gave up
//!   before it was sent is not sent at all.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use crate::proto::apply_item::Change;
use crate::proto::apply_result::Outcome;
use crate::proto::read_states_client::ReadStatesClient;
use crate::proto::{ApplyError, ApplyItem, ApplyRequest, ApplyResponse};
use crate::status::{ALL_ANSWERED, EPOCH, OWNER, SAFE_TO_RETRY, safe_to_retry};

/// The most items a node takes in one batch.
pub const MAX_BATCH: usize = 1_000;

/// The most a batch carries (encoded), well within what a node decodes (4
/// MiB): 1,000 messages to 10,000 users each would be twenty times that.
const MAX_BATCH_BYTES: usize = 1 << 20;

/// The largest response taken from a node: a node of this version answers
/// in responses of at most 1 MiB, an older one in one response per batch.
const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// Batches handed to the transport and not sent yet: the node reads a few
/// ahead of what it applies, and this keeps the pipe that full.
const BATCHES_QUEUED: usize = 4;

/// How long opening a stream may take before its changes are refused.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

type Answer = oneshot::Sender<Result<Outcome, Status>>;

struct Queued {
    change: Change,
    until: Option<Instant>,
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
/// [`OPEN`], and [`ENDED`] once nothing more is sent on it
/// ([`NOT_OPENED`] if it never opened).
const OPENING: u8 = 0;
const OPEN: u8 = 1;
const ENDED: u8 = 2;
const NOT_OPENED: u8 = 3;

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

    /// Whether the stream could not be opened: every change sent on it
    /// was answered with the node's refusal, and none was applied.
    pub fn failed_to_open(&self) -> bool {
        self.state.load(Ordering::Acquire) == NOT_OPENED
    }

    /// Whether the stream has ended: a new one is needed.
    pub fn is_ended(&self) -> bool {
        matches!(self.state.load(Ordering::Acquire), ENDED | NOT_OPENED) || self.queue.is_closed()
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
            until: timeout.map(|timeout| Instant::now() + timeout),
            answer,
        };
        let waiting = async {
            self.queue.send(queued).await.map_err(|_| not_sent())?;
            answered.await.unwrap_or_else(|_| Err(unanswered()))
        };
        match timeout {
            Some(timeout) => tokio::time::timeout(timeout, waiting)
                .await
                .unwrap_or_else(|_| Err(late())),
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
        let mut client =
            ReadStatesClient::new(channel).max_decoding_message_size(MAX_RESPONSE_BYTES);
        let opening = client.apply(call);
        let refusal = match tokio::time::timeout(OPEN_TIMEOUT, opening).await {
            Ok(Ok(results)) => {
                self.state.store(OPEN, Ordering::Release);
                self.serve(batches, results.into_inner()).await;
                return self.end(ENDED, not_sent()).await;
            }
            Ok(Err(status))
                if matches!(status.code(), Code::Unimplemented | Code::ResourceExhausted) =>
            {
                status
            }
            Ok(Err(status)) => {
                let message = format!("Apply stream not opened: {}", status.message());
                Status::unavailable(message)
            }
            Err(_) => Status::unavailable("Apply stream not opened in time"),
        };
        self.end(NOT_OPENED, refusal).await;
    }

    /// Sends what is queued and hands out results until the stream ends,
    /// then answers what was taken and not answered.
    async fn serve(
        &mut self,
        batches: mpsc::Sender<ApplyRequest>,
        mut results: tonic::Streaming<ApplyResponse>,
    ) {
        let mut waiting: HashMap<u64, Answer> = HashMap::new();
        let mut next_id = 0u64;
        let (queued, batch) = (&mut self.queued, self.batch);
        // Taken from the queue, not sent yet (what did not fit in a batch).
        let mut taken = VecDeque::with_capacity(batch);
        let mut received = Vec::with_capacity(batch);
        // `None` once every Applier is gone: the stream is half-closed.
        let mut batches = Some(batches);
        let ended = loop {
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
                    Ok(None) => break None,
                    Err(status) => break Some(status),
                },
                // Room in the transport first, then what is queued by then.
                Some(taken_now) = async {
                    let Ok(permit) = batches.clone()?.reserve_owned().await else {
                        return Some(None);
                    };
                    if taken.is_empty() {
                        if queued.recv_many(&mut received, batch).await == 0 {
                            return Some(Some((permit, false)));
                        }
                        taken.extend(received.drain(..));
                    }
                    Some(Some((permit, true)))
                }, if batches.is_some() => {
                    // The transport dropped the request stream: broken.
                    let Some((permit, more)) = taken_now else { break None };
                    if !more {
                        drop(permit);
                        batches = None;
                        continue;
                    }
                    let items = take_batch(&mut taken, batch, &mut waiting, &mut next_id);
                    if !items.is_empty() {
                        permit.send(ApplyRequest { items, timeout_ms: 0 });
                    }
                }
            }
        };
        // Whatever was sent and not answered: not applied if the node says
        // it answered every item it read, else it may have been.
        let all_answered = ended
            .as_ref()
            .is_some_and(|status| status.metadata().contains_key(ALL_ANSWERED));
        for (_, answer) in waiting.drain() {
            let _ = answer.send(Err(if all_answered {
                not_read()
            } else {
                unanswered()
            }));
        }
        for queued in taken {
            let _ = queued.answer.send(Err(not_sent()));
        }
    }

    /// Ends the stream in `state`: every change not sent is answered with
    /// `status`. Closing refuses new changes, but a caller that already
    /// had room may still send; `recv` returns `None` only once it has
    /// (`try_recv` would stop at an empty queue, leaving that change
    /// unanswered, kept alive by its caller's own `Applier`).
    async fn end(mut self, state: u8, status: Status) {
        self.state.store(state, Ordering::Release);
        self.queued.close();
        while let Some(queued) = self.queued.recv().await {
            let _ = queued.answer.send(Err(status.clone()));
        }
    }
}

/// The next batch from the front of `taken`: at most `batch` changes and
/// [`MAX_BATCH_BYTES`] (at least one change), each recorded in `waiting`
/// under the id it is sent with. A change whose caller has gone, or whose
/// time is up, is not sent.
fn take_batch(
    taken: &mut VecDeque<Queued>,
    batch: usize,
    waiting: &mut HashMap<u64, Answer>,
    next_id: &mut u64,
) -> Vec<ApplyItem> {
    let now = Instant::now();
    let mut items = Vec::with_capacity(taken.len().min(batch));
    let mut size = 0;
    while items.len() < batch
        && let Some(queued) = taken.pop_front()
    {
        if queued.answer.is_closed() {
            continue;
        }
        // The change, its id and timeout, and their framing.
        let len = queued.change.encoded_len() + 24;
        if size + len > MAX_BATCH_BYTES && !items.is_empty() {
            taken.push_front(queued);
            break;
        }
        let Queued {
            change,
            until,
            answer,
        } = queued;
        let left = until.map(|until| until.saturating_duration_since(now));
        if left == Some(Duration::ZERO) {
            let _ = answer.send(Err(late()));
            continue;
        }
        size += len;
        *next_id += 1;
        waiting.insert(*next_id, answer);
        items.push(ApplyItem {
            id: *next_id,
            change: Some(change),
            timeout_ms: left.map_or(0, timeout_ms),
        });
    }
    items
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

fn not_read() -> Status {
    Status::unavailable("the node ended the Apply stream before it read the change: not applied")
}

fn late() -> Status {
    Status::deadline_exceeded("no answer in time")
}

const UNANSWERED: &str = "the Apply stream ended before the change was answered: it may have \
                          been applied, and is safe to send again";

fn unanswered() -> Status {
    safe_to_retry(Status::cancelled(UNANSWERED))
}

/// Whether `status` is this client's own word that an item's stream broke
/// before its answer (its connection failed, most often).
pub fn is_unanswered(status: &Status) -> bool {
    status.code() == Code::Cancelled && status.message() == UNANSWERED
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
fn status(error: ApplyError) -> Status {
    let mut metadata = MetadataMap::new();
    if let Ok(owner) = MetadataValue::try_from(error.owner.as_str())
        && !error.owner.is_empty()
    {
        metadata.insert(OWNER, owner);
    }
    if error.epoch > 0 {
        metadata.insert(EPOCH, MetadataValue::from(error.epoch));
    }
    if error.safe_to_retry {
        metadata.insert(SAFE_TO_RETRY, MetadataValue::from_static("1"));
    }
    Status::with_metadata(Code::from_i32(error.code), error.message, metadata)
}

#[cfg(test)]
mod tests;
