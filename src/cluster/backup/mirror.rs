//! The sending side of a backup: this node's journal batches, streamed to
//! its backup (`Fleet.Mirror`), and the wait that makes a change answered
//! only once the backup holds it.
//!
//! [`Mirror::run`] follows the ring: it opens a stream to the node's
//! backup, then journals everything unwritten again ([`Cache::rejournal`])
//! so that the backup is complete once it holds up to there. Batches go
//! through a bounded queue: a backup that falls that far behind, or whose
//! stream breaks, is dropped, and changes wait until a backup is complete
//! again (`readstates_backup_attached`): the one dropped may take this
//! node over with what it holds. Only with no backup possible (a fleet of
//! one, or a backup that refuses the stream) do changes rest on this
//! node's journal alone.
//!
//! [`Cache::rejournal`]: crate::cache::Cache::rejournal

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use metrics::{counter, gauge};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Code;

use super::{FORMAT, backup_of};
use crate::cache::Cache;
use crate::cluster::lease::incarnation;
use crate::cluster::member::Member;
use crate::cluster::peers::GrpcPeers;
use crate::journal::{Journal, Replica, record};
use crate::metrics::{BACKUP_ATTACHED, BACKUP_DETACHED};
use crate::proto::fleet_client::FleetClient;
use crate::proto::mirror_request::Part;
use crate::proto::{MirrorBatch, MirrorRequest, MirrorStart};

/// How long a node waits before trying a backup again.
const RETRY: Duration = Duration::from_secs(1);
/// How often the stream looks whether the ring names another backup, and
/// tells the backup it lives (see `grpc::mirror::SILENCE`).
const RING_CHECK: Duration = Duration::from_millis(500);
/// Messages queued for the backup: a batch is a group commit's worth, so
/// this is a second or more of load; a backup further behind is dropped.
const QUEUE: usize = 4096;
/// The most bytes of frames one message carries (a group commit after a
/// stall, or everything journaled again on attaching, can be far more); a
/// single larger frame goes alone (see [`super::MAX_MESSAGE`]).
const CHUNK: usize = 1 << 20;

/// This node's backup stream, as the journal sees it.
#[derive(Debug)]
pub struct Mirror {
    journal: Arc<Journal>,
    /// Where batches go while a stream is open.
    outbox: Mutex<Option<mpsc::Sender<MirrorRequest>>>,
    /// What the open stream's backup holds.
    attached: Mutex<Attached>,
    /// The last trim reported, sent again as a heartbeat.
    trimmed: AtomicU64,
}

/// What the open stream's backup holds.
#[derive(Clone, Copy, Debug, Default)]
struct Attached {
    /// It holds everything unwritten once it holds up to here.
    complete_at: u64,
    /// It holds every batch up to here.
    held: u64,
}

impl Attached {
    /// Up to where changes may be answered: nothing until it is complete.
    fn answerable(&self) -> u64 {
        if self.held >= self.complete_at {
            self.held
        } else {
            0
        }
    }
}

impl Mirror {
    /// The backup stream of `journal`'s node: the journal copies its
    /// batches to it from now on.
    pub fn new(journal: Arc<Journal>) -> Arc<Mirror> {
        gauge!(BACKUP_ATTACHED).set(0.0);
        let mirror = Arc::new(Mirror {
            journal: journal.clone(),
            outbox: Mutex::new(None),
            attached: Mutex::new(Attached::default()),
            trimmed: AtomicU64::new(0),
        });
        journal.set_replica(mirror.clone());
        // Nothing is answered until a backup holds it, or none can.
        journal.replicated(0);
        mirror
    }

    /// Streams to this node's backup, as the ring names it, until `stop`.
    pub async fn run(
        self: Arc<Self>,
        member: Member,
        peers: Arc<GrpcPeers>,
        stop: CancellationToken,
    ) {
        let incarnation = incarnation();
        loop {
            let ring = member.ring();
            match backup_of(&ring.ring, member.id()).cloned() {
                // A fleet of one: nobody to hold a copy, nobody to take over.
                None => self.unbacked(),
                Some(backup) => {
                    let to = Stream {
                        member: &member,
                        peers: &peers,
                        backup: &backup,
                        incarnation: &incarnation,
                    };
                    let streamed = tokio::select! {
                        result = self.stream(to) => result,
                        () = stop.cancelled() => Ok(()),
                    };
                    self.detach();
                    match streamed {
                        Ok(()) => counter!(BACKUP_DETACHED, "reason" => "ring").increment(1),
                        Err(Ended::Refused(e)) => {
                            // It has no copy that could take over: changes
                            // rest on the journal alone.
                            counter!(BACKUP_DETACHED, "reason" => "refused").increment(1);
                            tracing::warn!(backup = %backup.id, error = %e, "the backup refuses the stream (an older build?); changes rest on this node's journal alone");
                            self.unbacked();
                        }
                        Err(Ended::Broke(e)) => {
                            counter!(BACKUP_DETACHED, "reason" => "error").increment(1);
                            tracing::warn!(backup = %backup.id, error = %e, "backup stream ended; changes wait until a backup holds them again (the ring names another once this one is taken over)");
                        }
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(RETRY) => {}
                () = stop.cancelled() => {
                    self.unbacked();
                    return;
                }
            }
        }
    }

    /// One stream: `Ok` once the ring names another backup.
    async fn stream(&self, to: Stream<'_>) -> Result<(), Ended> {
        let channel = (to.peers.channel(&to.backup.address)).map_err(Ended::Broke)?;
        let start = MirrorRequest {
            part: Some(Part::Start(MirrorStart {
                node: to.member.id().to_owned(),
                incarnation: to.incarnation.to_owned(),
                format: FORMAT,
            })),
        };
        let queued = self.attach(to.member.cache()).map_err(Ended::Broke)?;
        let requests = tokio_stream::once(start).chain(ReceiverStream::new(queued));
        let mut responses = FleetClient::new(channel)
            .mirror(to.peers.request(requests))
            .await
            .map_err(|s| {
                let refused = matches!(s.code(), Code::Unimplemented | Code::FailedPrecondition);
                let why = format!("{}: {}", s.code(), s.message());
                if refused {
                    Ended::Refused(why)
                } else {
                    Ended::Broke(why)
                }
            })?
            .into_inner();
        tracing::info!(backup = %to.backup.id, "backup stream open");
        let mut check = tokio::time::interval(RING_CHECK);
        loop {
            tokio::select! {
                response = responses.next() => match response {
                    Some(Ok(response)) => self.acked(response.held),
                    Some(Err(status)) => {
                        return Err(Ended::Broke(format!("{}: {}", status.code(), status.message())));
                    }
                    None => return Err(Ended::Broke("the backup ended the stream".into())),
                },
                _ = check.tick() => {
                    let ring = to.member.ring();
                    let now = backup_of(&ring.ring, to.member.id());
                    if now != Some(to.backup) {
                        return Ok(());
                    }
                    if self.outbox().is_none() {
                        return Err(Ended::Broke("the backup fell behind".into()));
                    }
                    self.send(Part::Trimmed(self.trimmed.load(Ordering::Acquire)));
                }
            }
        }
    }

    /// Opens a stream's queue: batches taken from here on go to it; what
    /// the store lacks from before is journaled again after them, and the
    /// queue says from where the backup holds it all. Changes wait for it
    /// from here on.
    pub(crate) fn attach(&self, cache: &Cache) -> Result<mpsc::Receiver<MirrorRequest>, String> {
        let (outbox, queued) = mpsc::channel(QUEUE);
        // Read first: batches taken from here on may go to the stream.
        let taken = self.journal.taken();
        *self.outbox() = Some(outbox.clone());
        let rejournaled = cache.rejournal();
        // With nothing unwritten, the backup is complete from the start,
        // and what the writer took before it was written (no later batch
        // may come to say the backup holds that).
        let attached = match rejournaled {
            0 => Attached {
                complete_at: 0,
                held: taken,
            },
            _ => Attached {
                complete_at: self.journal.appended(),
                held: 0,
            },
        };
        (outbox.try_send(MirrorRequest {
            part: Some(Part::CompleteAt(attached.complete_at)),
        }))
        .map_err(|e| e.to_string())?;
        self.update(|held| *held = attached);
        Ok(queued)
    }

    /// The backup holds every batch up to `held`.
    pub(crate) fn acked(&self, held: u64) {
        self.update(|attached| attached.held = attached.held.max(held));
    }

    /// The stream is gone. Changes go on waiting: the backup may hold a
    /// complete copy and take over should this node die, so answering them
    /// from the journal alone could lose them. They are answered once a
    /// new stream is complete (or [`Mirror::unbacked`]).
    pub(crate) fn detach(&self) {
        *self.outbox() = None;
        gauge!(BACKUP_ATTACHED).set(0.0);
    }

    /// No backup can hold a copy (a fleet of one, or it refuses the
    /// stream), or this node stops: changes rest on the journal alone.
    fn unbacked(&self) {
        self.journal.replicated(u64::MAX);
        gauge!(BACKUP_ATTACHED).set(0.0);
    }

    /// Changes what the backup holds, and tells the journal how far
    /// changes may be answered.
    fn update(&self, change: impl FnOnce(&mut Attached)) {
        let mut attached = self.attached.lock().unwrap_or_else(|p| p.into_inner());
        change(&mut attached);
        // Under the lock: a later ack never tells the journal before this.
        self.journal.replicated(attached.answerable());
        let complete = attached.held >= attached.complete_at;
        gauge!(BACKUP_ATTACHED).set(if complete { 1.0 } else { 0.0 });
    }

    fn outbox(&self) -> MutexGuard<'_, Option<mpsc::Sender<MirrorRequest>>> {
        self.outbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `part` for the backup; one that cannot take it is dropped.
    fn send(&self, part: Part) {
        let mut outbox = self.outbox();
        let Some(sender) = outbox.as_ref() else {
            return;
        };
        if sender.try_send(MirrorRequest { part: Some(part) }).is_err() {
            // The stream notices and ends; changes wait for the next.
            *outbox = None;
        }
    }
}

/// Why a stream ended.
enum Ended {
    /// The backup refuses it: it holds no copy of this node.
    Refused(String),
    /// Cut, frozen, behind, or never opened.
    Broke(String),
}

/// What one stream needs.
#[derive(Clone, Copy)]
struct Stream<'a> {
    member: &'a Member,
    peers: &'a GrpcPeers,
    backup: &'a readstates_routing::Node,
    incarnation: &'a str,
}

impl Replica for Mirror {
    /// Sent in messages of at most [`CHUNK`] (but whole frames), each with
    /// where the journal ended after it.
    fn batch(&self, frames: &[u8], end: u64) {
        let start = end.saturating_sub(frames.len() as u64);
        let mut from = 0;
        while from < frames.len() {
            let mut to = from;
            while let Some(len) = record::frame_len(&frames[to..]) {
                if to > from && to + len - from > CHUNK {
                    break;
                }
                to = (to + len).min(frames.len());
                if to == frames.len() {
                    break;
                }
            }
            if to == from {
                to = frames.len();
            }
            self.send(Part::Batch(MirrorBatch {
                frames: frames[from..to].to_vec(),
                end: start + to as u64,
            }));
            from = to;
        }
    }

    fn trimmed(&self, through: u64) {
        self.trimmed.fetch_max(through, Ordering::AcqRel);
        self.send(Part::Trimmed(through));
    }
}
