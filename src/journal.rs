//! The journal: every change's effect, group-committed to a local log
//! before the change is answered, so that a crash (kill -9, OOM, power)
//! loses no acknowledged change the write-behind had not written yet.
//! The design and what it promises: `docs/journal.md`.
//!
//! Changes append after-images under their shard's lock ([`Journal::append`],
//! [`record`]); one writer thread ([`writer`]) writes and syncs whatever was
//! appended since its last round; a request then waits until the journal is
//! durable up to where it was when its change was made
//! ([`Journal::durable`]). Bulk (a handoff's users, [`Journal::append_bulk`])
//! waits in a queue of its own and goes a slice a batch, so that a change
//! never waits for more than a slice of it. The trimmer ([`Trimmer`])
//! deletes the sealed segments whose every change the store holds. At start, [`replay`] reads
//! what a crash left, once [`lock`] has the directory to itself. A fleet
//! node also hands each batch to a [`Replica`] on another node (its backup,
//! see `docs/failover.md`), and a change waits for both.

pub mod disk;
pub mod lock;
pub mod record;
pub mod replay;
mod writer;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use disk::Disk;
pub use lock::DirLock;
pub use replay::Replayed;

/// When a change is answered relative to its sync.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum JournalMode {
    /// After the sync that holds it: a crash loses nothing answered.
    Sync,
    /// At once; the writer syncs this often: a crash loses at most this.
    Interval(Duration),
    /// No journal: a crash loses up to a write delay.
    Off,
}

impl FromStr for JournalMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sync" => Ok(JournalMode::Sync),
            "off" => Ok(JournalMode::Off),
            _ => match s.strip_prefix("interval:") {
                Some(every) => match humantime::parse_duration(every) {
                    Ok(every) if !every.is_zero() => Ok(JournalMode::Interval(every)),
                    _ => Err(format!(
                        "journal interval {every:?} is not a duration above 0 (e.g. 10ms)"
                    )),
                },
                None => Err(format!(
                    "journal mode {s:?} is not sync, interval:<duration> (e.g. interval:10ms) or off"
                )),
            },
        }
    }
}

impl TryFrom<String> for JournalMode {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<JournalMode> for String {
    fn from(mode: JournalMode) -> String {
        match mode {
            JournalMode::Sync => "sync".into(),
            JournalMode::Interval(every) => {
                format!("interval:{}", humantime::format_duration(every))
            }
            JournalMode::Off => "off".into(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct JournalConfig {
    pub dir: PathBuf,
    pub mode: JournalMode,
    /// A segment is sealed at this size...
    pub segment_bytes: u64,
    /// ...or this age, so that the trimmer can delete it.
    pub seal_after: Duration,
    /// Start even if a segment is corrupt, losing what cannot be read.
    pub skip_corrupt: bool,
    /// Sync mode: the least time from one sync's start to the next's. The
    /// changes made meanwhile share the next sync (group commit), so a sync
    /// (a device flush, tens of microseconds of CPU on a VM) is paid per
    /// batch, not per change; a change after a quiet gap syncs at once.
    pub sync_gap: Duration,
}

impl JournalConfig {
    pub fn new(dir: PathBuf, mode: JournalMode) -> JournalConfig {
        JournalConfig {
            dir,
            mode,
            segment_bytes: 64 << 20,
            seal_after: Duration::from_secs(5),
            skip_corrupt: false,
            sync_gap: Duration::ZERO,
        }
    }
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum JournalError {
    #[error("journal {}: {message}", .path.display())]
    Io { path: PathBuf, message: String },
    #[error(
        "journal file {} is corrupt at offset {offset} ({why}); start with --journal-skip-corrupt to skip what cannot be read (its changes are lost)",
        .file.display()
    )]
    Corrupt {
        file: PathBuf,
        offset: u64,
        why: String,
    },
    /// Another process (or another open in this one) journals into the
    /// directory: see [`lock`].
    #[error(
        "journal directory {} is locked by another process ({holder}): is this node running twice?",
        .dir.display()
    )]
    Locked { dir: PathBuf, holder: String },
    /// The change could not be made durable: a write or sync failed, or
    /// the journal is failing.
    #[error("the journal on this node's disk is failing ({0})")]
    Failing(String),
}

impl JournalError {
    pub fn io(path: &Path, error: &std::io::Error) -> JournalError {
        JournalError::Io {
            path: path.to_owned(),
            message: error.to_string(),
        }
    }
}

/// A copy of the journal kept elsewhere (another node: see
/// `crate::cluster::backup`). The writer gives it each batch before its
/// sync, so that the two overlap; the replica says how far it holds them
/// ([`Journal::replicated`]), and a change is durable once both hold it.
pub trait Replica: Send + Sync + std::fmt::Debug {
    /// A batch of whole frames, appended up to `end`. Called on the
    /// writer's thread: must not block.
    fn batch(&self, frames: &[u8], end: u64);
    /// What was appended up to `through` is in the store.
    fn trimmed(&self, through: u64);
}

/// How far the journal is durable, and its latest failure.
#[derive(Clone, Debug)]
struct Durable {
    /// Everything appended up to here is synced.
    synced: u64,
    /// The replica holds everything appended up to here (`u64::MAX`: there
    /// is none to wait for).
    replicated: u64,
    /// The latest failed batch: what was appended in (from, to].
    failed: Option<(u64, u64, String)>,
}

impl Durable {
    /// Where changes may be answered up to: both the sync and the replica.
    fn answerable(&self) -> u64 {
        self.synced.min(self.replicated)
    }
}

#[derive(Debug)]
pub struct Journal {
    mode: JournalMode,
    shared: Arc<Shared>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The directory's lock, from open until closed or dropped.
    lock: Mutex<Option<DirLock>>,
}

/// What the appenders, the writer and the trimmer share.
#[derive(Debug)]
struct Shared {
    config: JournalConfig,
    disk: Arc<dyn Disk>,
    appending: Mutex<Appending>,
    /// Wakes the writer when something is appended (sync mode).
    appended_more: Condvar,
    /// How much was ever appended: the log sequence number of the end.
    appended: AtomicU64,
    /// The end of the last batch the writer took.
    taken: AtomicU64,
    durable: watch::Sender<Durable>,
    healthy: AtomicBool,
    /// Sealed segments, oldest first, with the end of what they hold.
    sealed: Mutex<VecDeque<Sealed>>,
    /// Where batches are copied, once set.
    replica: OnceLock<Arc<dyn Replica>>,
    /// Bulk bytes the writer took so far, and where the journal ended once
    /// it had (see [`Journal::bulk_end`]).
    bulk_taken: watch::Sender<(u64, u64)>,
    /// The writer waits with bulk held back for the replica.
    bulk_held: AtomicBool,
}

#[derive(Debug, Default)]
struct Appending {
    buffer: Vec<u8>,
    records: u64,
    stop: bool,
    /// The writer waits for appends: the next one wakes it (a wake is a
    /// system call, not paid on every append).
    writer_waiting: bool,
    /// Bulk frames not taken yet, oldest first: they have no place in the
    /// journal until the writer takes them (see [`Journal::append_bulk`]).
    bulk: VecDeque<Vec<u8>>,
    /// Bulk bytes ever appended.
    bulk_appended: u64,
}

#[derive(Clone, Debug)]
struct Sealed {
    path: PathBuf,
    /// Every record in it was appended at or before this sequence number.
    end: u64,
}

impl Journal {
    /// Locks `config.dir` ([`DirLock`]: it fails if another process has
    /// it), reads what it holds ([`replay::read_dir`]), then starts the
    /// writer on a new segment after them. The segments read stay until the
    /// trimmer finds their changes written.
    pub fn open(
        config: JournalConfig,
        disk: Arc<dyn Disk>,
    ) -> Result<(Journal, Replayed), JournalError> {
        // Before reading: the segments of a live process are not ours.
        let lock = DirLock::acquire(&config.dir)?;
        let replayed = replay::read_dir(&config.dir, config.skip_corrupt)?;
        // Start at 1: the segments replayed hold what was appended up to 0.
        let start = 1;
        let shared = Arc::new(Shared {
            sealed: Mutex::new(
                (replayed.segments.iter())
                    .map(|path| Sealed {
                        path: path.clone(),
                        end: 0,
                    })
                    .collect(),
            ),
            config,
            disk,
            appending: Mutex::default(),
            appended_more: Condvar::new(),
            appended: AtomicU64::new(start),
            taken: AtomicU64::new(start),
            durable: watch::Sender::new(Durable {
                synced: start,
                replicated: u64::MAX,
                failed: None,
            }),
            healthy: AtomicBool::new(true),
            replica: OnceLock::new(),
            bulk_taken: watch::Sender::new((0, start)),
            bulk_held: AtomicBool::new(false),
        });
        let writer = {
            let (shared, dir) = (shared.clone(), shared.config.dir.clone());
            let first = replayed.next_segment;
            std::thread::Builder::new()
                .name("journal-writer".into())
                .spawn(move || writer::run(&shared, first))
                .map_err(|e| JournalError::io(&dir, &e))?
        };
        crate::metrics::journal_healthy(true);
        Ok((
            Journal {
                mode: shared.config.mode,
                shared,
                writer: Mutex::new(Some(writer)),
                lock: Mutex::new(Some(lock)),
            },
            replayed,
        ))
    }

    /// Appends one entry, written by `encode` (see [`record`]): in a frame
    /// of its own, or in the frame of the [`Journal::group`] open on this
    /// thread. Called under the lock that applies the change.
    pub fn append(&self, encode: impl FnOnce(&mut Vec<u8>)) {
        let grouped = GROUP.with_borrow_mut(|group| match group {
            Some((journal, entries)) if *journal == self.id() => {
                encode(entries);
                None
            }
            _ => Some(encode),
        });
        if let Some(encode) = grouped {
            self.append_frame(|out| record::frame(out, encode));
        }
    }

    /// Opens a group on this thread until the guard drops: the entries
    /// appended meanwhile go in one frame, which a crash keeps whole or
    /// drops whole (a change of many users, all or none). The guard is not
    /// `Send`: it cannot be held across an `.await`.
    pub fn group(&self) -> Group<'_> {
        let opened = GROUP.with_borrow_mut(|group| {
            group
                .is_none()
                .then(|| *group = Some((self.id(), Vec::new())))
                .is_some()
        });
        Group {
            journal: opened.then_some(self),
            not_send: std::marker::PhantomData,
        }
    }

    /// Appends one entry that may wait (a user a handoff brings, see
    /// `crate::cache::handoff`): it waits in a queue of its own, and the
    /// writer adds at most a slice of that queue to each batch, after the
    /// changes appended meanwhile, so that a change made after a handoff's
    /// tens of megabytes is answered after a slice of them, not all. A bulk
    /// entry has no place in the journal (no sequence number) until taken:
    /// wait for it with [`Journal::bulk_end`]. Replay takes records in any
    /// order (the higher version wins), so the order between the queues
    /// does not matter.
    pub fn append_bulk(&self, encode: impl FnOnce(&mut Vec<u8>)) {
        let mut frame = Vec::new();
        record::frame(&mut frame, encode);
        let mut appending = self.shared.lock_appending();
        appending.bulk_appended += frame.len() as u64;
        appending.bulk.push_back(frame);
        let wake = std::mem::take(&mut appending.writer_waiting);
        drop(appending);
        if wake {
            self.shared.appended_more.notify_one();
        }
    }

    /// Where the journal ends once the writer has taken every bulk entry
    /// appended before this call (and every other entry: at least
    /// [`Journal::appended`]): wait for [`Journal::durable`] of it.
    pub async fn bulk_end(&self) -> u64 {
        let appended = self.shared.lock_appending().bulk_appended;
        let mut taken = self.shared.bulk_taken.subscribe();
        // Never closed: the sender lives in `self.shared`.
        let end = match taken.wait_for(|(bytes, _)| *bytes >= appended).await {
            Ok(taken) => taken.1,
            Err(_) => u64::MAX,
        };
        end.max(self.appended())
    }

    /// Bulk bytes appended so far (taken or not).
    pub fn bulk_appended(&self) -> u64 {
        self.shared.lock_appending().bulk_appended
    }

    fn id(&self) -> usize {
        Arc::as_ptr(&self.shared) as usize
    }

    fn append_frame(&self, write: impl FnOnce(&mut Vec<u8>)) {
        let mut appending = self.shared.lock_appending();
        let before = appending.buffer.len();
        write(&mut appending.buffer);
        appending.records += 1;
        let added = (appending.buffer.len() - before) as u64;
        self.shared.appended.fetch_add(added, Ordering::Release);
        let wake = std::mem::take(&mut appending.writer_waiting);
        drop(appending);
        if wake {
            self.shared.appended_more.notify_one();
        }
    }

    /// Where the journal ends now: everything appended before this call is
    /// at or below it, but bulk not taken yet (see [`Journal::bulk_end`]).
    pub fn appended(&self) -> u64 {
        self.shared.appended.load(Ordering::Acquire)
    }

    /// Whether a change waits for its sync (`--journal sync`).
    pub fn syncs(&self) -> bool {
        self.mode == JournalMode::Sync
    }

    /// The end of the last batch the writer took (and gave the replica).
    pub fn taken(&self) -> u64 {
        self.shared.taken.load(Ordering::Acquire)
    }

    /// Waits until everything appended up to `upto` is synced, and held by
    /// the replica if one is attached (sync mode; the other modes answer at
    /// once). An error: the batch that held it failed (the change stays
    /// applied, unjournaled).
    pub async fn durable(&self, upto: u64) -> Result<(), JournalError> {
        if self.mode != JournalMode::Sync {
            return Ok(());
        }
        // A failure counts only while the retry has not synced it since.
        let covered = |d: &Durable| {
            d.answerable() >= upto
                || (d.synced < upto
                    && (d.failed.as_ref()).is_some_and(|(from, to, _)| *from < upto && upto <= *to))
        };
        if self.shared.durable.borrow().answerable() >= upto {
            return Ok(());
        }
        let mut durable = self.shared.durable.subscribe();
        let state = durable
            .wait_for(covered)
            .await
            .map_err(|_| JournalError::Failing("the journal's writer stopped".into()))?;
        match &state.failed {
            Some((_, _, reason)) if state.synced < upto => {
                Err(JournalError::Failing(reason.clone()))
            }
            _ => Ok(()),
        }
    }

    /// The replica holds everything appended up to `held` (`u64::MAX`:
    /// there is none; changes wait for the sync alone). Wakes the waiting
    /// changes only if that lets more of them be answered.
    pub fn replicated(&self, held: u64) {
        self.shared.durable.send_if_modified(|d| {
            let before = d.answerable();
            d.replicated = held;
            d.answerable() > before
        });
        // Bulk held back until the replica had the last of it goes on now.
        if self.shared.bulk_held.load(Ordering::Acquire)
            && held >= self.shared.bulk_taken.borrow().1
        {
            self.shared.appended_more.notify_one();
        }
    }

    /// Copies every batch taken from now on to `replica` too; set once.
    pub fn set_replica(&self, replica: Arc<dyn Replica>) {
        let _ = self.shared.replica.set(replica);
    }

    /// Whether the last write and sync succeeded: while not, changes are
    /// refused before they are applied.
    pub fn healthy(&self) -> bool {
        self.shared.healthy.load(Ordering::Acquire)
    }

    /// Whether this journal still holds its directory's lock: from open
    /// until [`Journal::close`]. While it does, no other process has the
    /// directory, so none that had it before (an earlier start of this
    /// node on this machine) still journals there.
    pub fn holds_lock(&self) -> bool {
        self.lock_dir().is_some()
    }

    /// Names this fleet node's `incarnation` in the directory's lock, for
    /// the next start to find (see [`DirLock::predecessor`]). Only with
    /// `sync`: a start trusts that its predecessor answered nothing its
    /// journal lacks.
    pub fn record_incarnation(&self, incarnation: &str) -> Result<(), JournalError> {
        match self.lock_dir().as_mut() {
            Some(lock) if self.syncs() => lock.record_incarnation(incarnation),
            _ => Ok(()),
        }
    }

    /// The incarnation the last process on this directory recorded, if it
    /// locked this very lock file under this kernel: that process is gone
    /// (this one holds the lock; see [`DirLock::gone_predecessor`]).
    pub fn predecessor(&self) -> Option<String> {
        let held = self.lock_dir();
        held.as_ref()?.gone_predecessor().map(str::to_owned)
    }

    fn lock_dir(&self) -> MutexGuard<'_, Option<DirLock>> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Deletes the sealed segments that hold nothing appended after
    /// `through`. Returns how many.
    fn remove_through(&self, through: u64) -> usize {
        // Held throughout: once closed, the directory may be another's
        // (the next start's), whose replay these segments are.
        let held = self.lock_dir();
        if held.is_none() {
            return 0;
        }
        let removable: Vec<Sealed> = {
            let sealed = self.shared.lock_sealed();
            sealed
                .iter()
                .take_while(|s| s.end <= through)
                .cloned()
                .collect()
        };
        let mut removed = 0;
        for segment in removable {
            match self.shared.disk.remove(&segment.path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(file = %segment.path.display(), error = %e, "journal: a written segment could not be deleted; tried again later");
                    break;
                }
            }
            self.shared.lock_sealed().pop_front();
            removed += 1;
            if let Some(replica) = self.shared.replica.get() {
                replica.trimmed(segment.end);
            }
        }
        removed
    }

    /// Stops the writer once it has written what was appended. With
    /// `written` (the store holds every change), deletes every segment:
    /// the next start has nothing to replay. Then lets go of the directory.
    pub fn close(&self, written: bool) {
        self.shared.lock_appending().stop = true;
        self.shared.appended_more.notify_one();
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(writer) = writer {
            let _ = writer.join();
        }
        if written {
            self.remove_through(u64::MAX);
        }
        // Last: nothing touches the directory from here on.
        self.lock_dir().take();
    }

    /// Sealed segments (for the metrics and tests).
    pub fn segments(&self) -> usize {
        self.shared.lock_sealed().len()
    }
}

thread_local! {
    /// The group open on this thread: its journal, and its entries so far.
    static GROUP: std::cell::RefCell<Option<(usize, Vec<u8>)>> = const { std::cell::RefCell::new(None) };
}

/// See [`Journal::group`].
#[derive(Debug)]
pub struct Group<'a> {
    /// The journal, if this guard opened the group (an inner one did not).
    journal: Option<&'a Journal>,
    not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for Group<'_> {
    fn drop(&mut self) {
        let Some(journal) = self.journal else {
            return;
        };
        let entries = GROUP
            .with_borrow_mut(Option::take)
            .map(|(_, entries)| entries);
        if let Some(entries) = entries.filter(|e| !e.is_empty()) {
            journal.append_frame(|out| record::frame(out, |out| out.extend_from_slice(&entries)));
        }
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        // Stops the thread; deletes nothing.
        self.shared.lock_appending().stop = true;
        self.shared.appended_more.notify_one();
    }
}

impl Shared {
    fn lock_appending(&self) -> MutexGuard<'_, Appending> {
        self.appending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_sealed(&self) -> MutexGuard<'_, VecDeque<Sealed>> {
        self.sealed.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Deletes what the store holds, once a `period`: the sealed segments
/// appended before the oldest unwritten change.
///
/// Times are the cache's clock (tokio's, paused in tests), so the trimmer
/// keeps samples of (when, how much was appended): a segment that ends at
/// or before a sample taken before the oldest unwritten change holds only
/// changes made before it, all written.
#[derive(Debug)]
pub struct Trimmer {
    journal: Arc<Journal>,
    samples: VecDeque<(Instant, u64)>,
}

impl Trimmer {
    pub fn new(journal: Arc<Journal>) -> Trimmer {
        Trimmer {
            journal,
            samples: VecDeque::new(),
        }
    }

    /// One round: `oldest_unwritten` is when the oldest change the store
    /// does not hold was made (`None`: there is none). Returns the
    /// segments deleted.
    pub fn trim(&mut self, oldest_unwritten: impl FnOnce() -> Option<Instant>) -> usize {
        // The end first, then the time: whatever is at or below it was
        // changed before `now`.
        let appended = self.journal.appended();
        self.samples.push_back((Instant::now(), appended));
        let oldest = oldest_unwritten();
        let written = |at: &Instant| oldest.is_none_or(|oldest| *at < oldest);
        let Some(through) = (self.samples.iter().rev())
            .find(|(at, _)| written(at))
            .map(|s| s.1)
        else {
            return 0;
        };
        // Samples below the one used are not needed again.
        while self.samples.len() > 1 && self.samples[1].1 <= through && written(&self.samples[1].0)
        {
            self.samples.pop_front();
        }
        // Bounded while nothing is written (a store outage): one a round.
        while self.samples.len() > 100_000 {
            self.samples.pop_front();
        }
        self.journal.remove_through(through)
    }
}

#[cfg(test)]
mod tests;
