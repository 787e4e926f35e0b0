//! The sending side of a backup: this node's journal batches, streamed to
//! its backup (`Fleet.Mirror`), and the wait that makes a change answered
//! only once the backup holds it.
//!
//! [`Mirror::run`] follows the ring: it opens a stream to the node's
//! backup, then journals everything unwritten again ([`Cache::rejournal`])
//! so that the backup is complete once it holds up to there. Batches go
//! through a bounded queue: a backup that falls that far behind, or whose
//! stream breaks, is dropped.
//!
//! Which copy may take this node over is what its lease record names
//! ([`BackupName`]; `docs/failover.md`, "Which copy may take over"), and
//! changes are answered accordingly:
//! - the record names the open stream: changes wait until its backup holds
//!   them;
//! - the record names no backup ([`NO_BACKUP`]): they rest on this node's
//!   journal alone, as on a single node;
//! - the record names a stream that is gone: none is answered until it
//!   names no backup (asked for at once when a stream ends), or a new
//!   stream, once complete, holds every change answered and is named.
//!
//! [`Cache::rejournal`]: crate::cache::Cache::rejournal

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use metrics::{counter, gauge};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::Code;

use super::{FORMAT, backup_of};
use crate::cache::Cache;
use crate::cluster::lease::BackupName;
use crate::cluster::member::Member;
use crate::cluster::peers::Peers;
use crate::cluster::ring_store::NO_BACKUP;
use crate::journal::{Journal, Replica, record};
use crate::metrics::{BACKUP_ATTACHED, BACKUP_DETACHED};
use crate::proto::mirror_request::Part;
use crate::proto::{MirrorBatch, MirrorRequest, MirrorStart};

/// How long a node waits before trying a backup again.
const RETRY: Duration = Duration::from_secs(1);
/// How long a stopping node waits for its lease to name no backup.
const STOPPING: Duration = Duration::from_secs(5);
/// How often the stream looks whether the ring names another backup, and
/// tells the backup it lives (see `super::receive::SILENCE`).
const RING_CHECK: Duration = Duration::from_millis(250);
/// How long a backup may leave batches unanswered before it is given up
/// (taken for frozen): changes wait for it meanwhile.
const UNANSWERED: Duration = Duration::from_secs(1);
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
    /// What the open stream's backup holds, and what the lease names.
    state: Mutex<State>,
    /// Asks the lease holder to name a stream, or none.
    name: Arc<BackupName>,
    /// This process, as its lease record names it.
    incarnation: String,
    /// Numbers this process's streams (their tokens).
    streams: AtomicU64,
    /// The last trim reported, sent again as a heartbeat.
    trimmed: AtomicU64,
}

#[derive(Clone, Debug, Default)]
struct State {
    /// The open stream, if any.
    attached: Option<Attached>,
    /// What the lease record names, as last renewed ("": not known yet),
    /// with the number of the request the renewal was made from.
    recorded: (String, u64),
    /// The number of this node's latest request for a name: a name
    /// recorded from an older one may be overtaken by a renewal in flight.
    asked: u64,
    /// What the journal was last told may be answered.
    answerable: u64,
    /// No backup can hold a copy (a fleet of one, or one that refuses the
    /// stream): changes rest on the journal alone.
    unbacked: bool,
}

/// What the open stream's backup holds.
#[derive(Clone, Debug, Default)]
struct Attached {
    /// Its name in the lease record once named.
    token: String,
    /// It holds everything unwritten once it holds up to here.
    complete_at: u64,
    /// It holds every batch up to here.
    held: u64,
    /// Once complete and not named, from here on changes wait for it; it
    /// is named once it holds up to here (everything answered before).
    naming_from: Option<u64>,
}

impl Attached {
    fn complete(&self) -> bool {
        self.held >= self.complete_at
    }
}

impl State {
    /// Up to where changes may be answered (0: none from now on).
    fn answerable(&self) -> u64 {
        let (recorded, _) = &self.recorded;
        let alone = self.alone();
        match &self.attached {
            // Named, or being named while the record names no copy at all.
            Some(a)
                if a.complete() && (a.token == *recorded || (a.naming_from.is_some() && alone)) =>
            {
                a.held
            }
            // Not known, or naming a stream gone: nothing.
            Some(a) if a.naming_from.is_some() => 0,
            _ if self.unbacked || alone => u64::MAX,
            _ => 0,
        }
    }

    /// The record names no copy, as renewed after this node's latest
    /// request for a name.
    fn alone(&self) -> bool {
        self.recorded.0 == NO_BACKUP && self.recorded.1 == self.asked
    }
}

impl Mirror {
    /// The backup stream of `journal`'s node: the journal copies its
    /// batches to it from now on.
    /// batches to it from now on. `name` is shared with the lease holder,
    /// and so is `incarnation`: a backup takes a stream only from the
    /// incarnation holding the node's lease (`grpc::mirror`).
    pub fn new(journal: Arc<Journal>, name: Arc<BackupName>, incarnation: String) -> Arc<Mirror> {
        gauge!(BACKUP_ATTACHED).set(0.0);
        let mirror = Arc::new(Mirror {
            journal: journal.clone(),
            outbox: Mutex::new(None),
            state: Mutex::new(State::default()),
            name,
            incarnation,
            streams: AtomicU64::new(0),
            trimmed: AtomicU64::new(0),
        });
        journal.set_replica(mirror.clone());
        // Nothing is answered until the lease says which copy holds it.
        journal.replicated(0);
        mirror
    }

    /// Follows what the lease record names; with `until_alone`, only until
    /// changes rest on the journal alone.
    async fn follow_record(&self, until_alone: bool) {
        let mut recorded = self.name.recorded();
        loop {
            let now = recorded.borrow_and_update().clone();
            if self.recorded(now) == u64::MAX && until_alone {
                return;
            }
            if recorded.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Streams to this node's backup, as the ring names it, until `stop`.
    pub async fn run(
        self: Arc<Self>,
        member: Member,
        peers: Arc<dyn Peers>,
        stop: CancellationToken,
    ) {
        tokio::select! {
            () = self.follow_record(false) => {}
            () = self.streams(member, peers, stop) => {}
        }
        // Stopping: the stream ended and the lease was asked to name no
        // backup; changes answered while the stop drains rest on the
        // journal alone once it does (those waiting meanwhile are cut off
        // by the stop's grace if it never does).
        let _ = tokio::time::timeout(STOPPING, self.follow_record(true)).await;
    }

    /// Opens streams to the backup as the ring names it, one after the
    /// other, until `stop`.
    async fn streams(&self, member: Member, peers: Arc<dyn Peers>, stop: CancellationToken) {
        let incarnation = &self.incarnation;
        loop {
            let ring = member.ring();
            match backup_of(&ring.ring, member.id()).cloned() {
                // A fleet of one: nobody to hold a copy, nobody to take over.
                None => self.unbacked(),
                Some(backup) => {
                    let to = Stream {
                        member: &member,
                        peers: &*peers,
                        backup: &backup,
                        incarnation,
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
                            tracing::warn!(backup = %backup.id, error = %e, "backup stream ended; changes rest on this node's journal alone once its lease names no backup, until a stream is open again");
                        }
                    }
                }
            }
            // Again after a while, or at once if the ring names another
            // backup (the one gone was taken over, say).
            let mut ring_changes = member.ring_changes();
            ring_changes.mark_unchanged();
            let named = backup_of(&ring.ring, member.id()).cloned();
            let renamed = async {
                while ring_changes.changed().await.is_ok() {
                    let ring = ring_changes.borrow_and_update().clone();
                    if backup_of(&ring.ring, member.id()).cloned() != named {
                        return;
                    }
                }
                std::future::pending().await
            };
            // Stopping: the stream is ended and its lease asked to name no
            // backup, so changes answered while the stop drains rest on the
            // journal alone once it does.
            tokio::select! {
                () = tokio::time::sleep(RETRY) => {}
                () = renamed => {}
                () = stop.cancelled() => return,
            }
        }
    }

    /// One stream: `Ok` once the ring names another backup.
    async fn stream(&self, to: Stream<'_>) -> Result<(), Ended> {
        let token = format!(
            "{}/{}/{}",
            to.backup.id,
            to.incarnation,
            self.streams.fetch_add(1, Ordering::Relaxed)
        );
        let start = MirrorRequest {
            part: Some(Part::Start(MirrorStart {
                node: to.member.id().to_owned(),
                incarnation: to.incarnation.to_owned(),
                format: FORMAT,
                token: token.clone(),
            })),
        };
        let (outbox, requests) = queue();
        (outbox.try_send(start)).map_err(|e| Ended::Broke(e.to_string()))?;
        // Open before anything is journaled again for it: a backup that
        // cannot be reached costs nothing.
        let mut responses = (to.peers)
            .mirror(&to.backup.address, requests, to.member.id())
            .await
            .map_err(|s| {
                let refused = matches!(s.code(), Code::Unimplemented | Code::FailedPrecondition);
                let why = format!("{}: {}", s.code(), s.message());
                if refused {
                    Ended::Refused(why)
                } else {
                    Ended::Broke(why)
                }
            })?;
        self.attach(to.member.cache(), &token, outbox)
            .map_err(Ended::Broke)?;
        tracing::info!(backup = %to.backup.id, "backup stream open");
        let mut check = tokio::time::interval(RING_CHECK);
        // Since when batches sent have gone unanswered.
        let mut unanswered: Option<Instant> = None;
        loop {
            tokio::select! {
                response = responses.next() => match response {
                    Some(Ok(response)) => {
                        unanswered = None;
                        self.acked(response.held);
                    }
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
                    // A frozen backup is given up sooner than the
                    // connection's keepalive would: changes wait meanwhile.
                    if self.held() < self.journal.taken() {
                        let since = *unanswered.get_or_insert_with(Instant::now);
                        if since.elapsed() >= UNANSWERED {
                            return Err(Ended::Broke(format!("the backup answered nothing for {UNANSWERED:?}")));
                        }
                    } else {
                        unanswered = None;
                    }
                    self.send(Part::Trimmed(self.trimmed.load(Ordering::Acquire)));
                }
            }
        }
    }

    /// Makes `outbox` (a [`queue`]) the stream named `token`'s: batches
    /// taken from here on go to it; what the store lacks from before is
    /// journaled again after them, and the queue says from where the
    /// backup holds it all.
    pub(crate) fn attach(
        &self,
        cache: &Cache,
        token: &str,
        outbox: mpsc::Sender<MirrorRequest>,
    ) -> Result<(), String> {
        // Read first: batches taken from here on may go to the stream.
        let taken = self.journal.taken();
        *self.outbox() = Some(outbox.clone());
        let rejournaled = cache.rejournal();
        // With nothing unwritten, the backup is complete from the start,
        // and what the writer took before it was written (no later batch
        // may come to say the backup holds that).
        let (complete_at, held) = match rejournaled {
            0 => (0, taken),
            _ => (self.journal.appended(), 0),
        };
        (outbox.try_send(MirrorRequest {
            part: Some(Part::CompleteAt(complete_at)),
        }))
        .map_err(|e| e.to_string())?;
        self.update(|state| {
            state.unbacked = false;
            state.attached = Some(Attached {
                token: token.to_owned(),
                complete_at,
                held,
                naming_from: None,
            });
        });
        Ok(())
    }

    /// Up to where the open stream's backup holds the batches.
    fn held(&self) -> u64 {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.attached.as_ref().map_or(0, |a| a.held)
    }

    /// The backup holds every batch up to `held`.
    pub(crate) fn acked(&self, held: u64) {
        self.update(|state| {
            if let Some(attached) = &mut state.attached {
                attached.held = attached.held.max(held);
            }
        });
    }

    /// The stream is gone. The lease is asked to name no backup: until it
    /// does, changes wait (the backup may hold a complete copy and take
    /// this node over should it die, so answering them from the journal
    /// alone could lose them).
    pub(crate) fn detach(&self) {
        *self.outbox() = None;
        self.update(|state| state.attached = None);
    }

    /// The lease record names `recorded.0`, renewed from request
    /// `recorded.1` (the holder's word); returns how far changes may now
    /// be answered.
    pub(crate) fn recorded(&self, recorded: (String, u64)) -> u64 {
        self.update(|state| state.recorded = recorded)
    }

    /// No backup can hold a copy (a fleet of one, or it refuses the
    /// stream): changes rest on the journal alone.
    fn unbacked(&self) {
        self.update(|state| {
            state.attached = None;
            state.unbacked = true;
        });
    }

    /// Changes the state, asks the lease for the name it calls for, and
    /// tells the journal how far changes may be answered.
    fn update(&self, change: impl FnOnce(&mut State)) -> u64 {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        change(&mut state);
        let recorded = state.recorded.0.clone();
        let before = state.answerable;
        let wanted = match &mut state.attached {
            Some(a) if a.token == recorded => {
                a.naming_from = None;
                None
            }
            // Complete: from here on changes wait for it, and it is named
            // once it holds everything answered before (on the journal
            // alone, or by a stream gone since), all taken by now: read
            // once nothing more may be answered alone.
            Some(a) if a.complete() => {
                let from = match a.naming_from {
                    Some(from) => from,
                    None => {
                        self.journal.replicated(a.held.min(before));
                        *a.naming_from.insert(self.journal.taken())
                    }
                };
                (a.held >= from).then(|| a.token.clone())
            }
            // Catching up while the record names no backup: answered alone.
            Some(_) if recorded == NO_BACKUP => None,
            Some(_) | None => Some(NO_BACKUP.to_owned()),
        };
        if let Some(wanted) = wanted {
            state.asked = self.name.want(&wanted);
        }
        // Under the lock: a later ack never tells the journal before this.
        state.answerable = state.answerable();
        self.journal.replicated(state.answerable);
        let attached = state.attached.as_ref();
        let named = attached.is_some_and(|a| a.complete() && a.token == recorded);
        gauge!(BACKUP_ATTACHED).set(if named { 1.0 } else { 0.0 });
        state.answerable
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

/// A stream's queue of messages (see [`QUEUE`]).
pub(crate) fn queue() -> (mpsc::Sender<MirrorRequest>, mpsc::Receiver<MirrorRequest>) {
    mpsc::channel(QUEUE)
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
    peers: &'a dyn Peers,
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
