//! Changes sent over `Apply` streams in batches, as a message pipeline's
//! consumer would: each change waits in its stream's queue, and the
//! stream's sender takes what is queued (up to the batch size) as one
//! batch, without waiting for more, so batches fill under load and stay
//! small when it is light. A change's latency runs from its queueing to
//! its result.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use readstates::proto::apply_item::Change;
use readstates::proto::apply_result::Outcome;
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::proto::{ApplyItem, ApplyRequest, ApplyResponse};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

/// Batches sent and not yet answered, per stream: the server reads a few
/// ahead of what it applies, and this keeps that many in the pipe.
const BATCHES_IN_FLIGHT: usize = 8;

/// How the changes of a run are sent: `batch` items per batch at most,
/// over `streams` streams.
#[derive(Clone, Copy, Debug)]
pub struct StreamConfig {
    pub batch: usize,
    pub streams: usize,
}

type Answer = oneshot::Sender<Result<(), String>>;

struct Queued {
    change: Change,
    answer: Answer,
}

#[derive(Debug)]
pub struct Streams {
    queues: Vec<mpsc::Sender<Queued>>,
    next: AtomicUsize,
}

impl Streams {
    /// Opens `config.streams` streams, over `clients` in turn.
    pub async fn open(
        clients: &[ReadStatesClient<Channel>],
        config: StreamConfig,
    ) -> anyhow::Result<Streams> {
        let mut queues = Vec::with_capacity(config.streams);
        for i in 0..config.streams.max(1) {
            let (batches, outgoing) = mpsc::channel(BATCHES_IN_FLIGHT);
            let results = clients[i % clients.len()]
                .clone()
                .apply(ReceiverStream::new(outgoing))
                .await
                .map_err(|s| anyhow::anyhow!("Apply: {s}"))?
                .into_inner();
            let (queue, queued) = mpsc::channel(config.batch.max(1) * BATCHES_IN_FLIGHT);
            let waiting = Arc::new(Mutex::new(HashMap::new()));
            tokio::spawn(send_batches(
                queued,
                batches,
                config.batch.max(1),
                waiting.clone(),
            ));
            tokio::spawn(answer(results, waiting));
            queues.push(queue);
        }
        Ok(Streams {
            queues,
            next: AtomicUsize::new(0),
        })
    }

    /// Sends `change` on the next stream; its result's code name if not OK.
    pub async fn execute(&self, change: Change) -> Result<(), String> {
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.queues.len();
        let (answer, answered) = oneshot::channel();
        self.queues[index]
            .send(Queued { change, answer })
            .await
            .map_err(|_| "stream ended".to_owned())?;
        answered
            .await
            .unwrap_or_else(|_| Err("stream ended".to_owned()))
    }
}

type Waiting = Arc<Mutex<HashMap<u64, Answer>>>;

/// Takes what is queued, up to `batch` changes, as one batch, until the
/// run ends (every queue sender dropped) or the stream breaks.
async fn send_batches(
    mut queued: mpsc::Receiver<Queued>,
    batches: mpsc::Sender<ApplyRequest>,
    batch: usize,
    waiting: Waiting,
) {
    static IDS: AtomicU64 = AtomicU64::new(1);
    let mut taken = Vec::with_capacity(batch);
    while queued.recv_many(&mut taken, batch).await > 0 {
        let mut items = Vec::with_capacity(taken.len());
        {
            let Ok(mut waiting) = waiting.lock() else {
                return;
            };
            for Queued { change, answer } in taken.drain(..) {
                let id = IDS.fetch_add(1, Ordering::Relaxed);
                waiting.insert(id, answer);
                items.push(ApplyItem {
                    id,
                    change: Some(change),
                });
            }
        }
        let request = ApplyRequest {
            items,
            timeout_ms: 0,
        };
        if batches.send(request).await.is_err() {
            return;
        }
    }
}

/// Hands each result to the change waiting for it; when the stream ends,
/// the changes still waiting fail with its status.
async fn answer(mut results: Streaming<ApplyResponse>, waiting: Waiting) {
    let ended = loop {
        match results.message().await {
            Ok(Some(response)) => {
                let Ok(mut waiting) = waiting.lock() else {
                    return;
                };
                for result in response.results {
                    let outcome = match result.outcome {
                        Some(Outcome::Error(e)) => Err(format!("{:?}", Code::from_i32(e.code))),
                        Some(_) => Ok(()),
                        None => Err("no outcome".to_owned()),
                    };
                    if let Some(answer) = waiting.remove(&result.id) {
                        let _ = answer.send(outcome);
                    }
                }
            }
            Ok(None) => break "stream ended".to_owned(),
            Err(status) => break format!("{:?}", status.code()),
        }
    };
    if let Ok(mut waiting) = waiting.lock() {
        for (_, answer) in waiting.drain() {
            let _ = answer.send(Err(ended.clone()));
        }
    }
}
