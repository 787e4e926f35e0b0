//! The journal's one writer: a thread that takes everything appended since
//! its last round, writes it to the current segment and syncs once (group
//! commit), then tells the waiting requests. A failed write or sync fails
//! the requests waiting on that batch, marks the journal unhealthy (changes
//! are refused) and is tried again on a new segment, batch included, until
//! the disk takes it.
//!
//! Replay takes damage anywhere but in the newest segment for corruption
//! (see [`super::replay`]), so a new segment is made only once every older
//! one is whole and synced: a segment is sealed after its last batch's sync,
//! and one whose write or sync failed is first cut back to its last sync.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::disk::SegmentFile;
use super::replay::{EXTENSION, MAGIC};
use super::{JournalMode, Sealed, Shared};

/// How often an idle writer looks whether its segment is old enough to seal.
const IDLE: Duration = Duration::from_millis(500);
/// Bulk bytes a batch takes at most (see [`super::Journal::append_bulk`]):
/// on a cloud disk a quarter of a megabyte adds about a millisecond to a
/// sync, and a handoff's 20 MB go in under a hundred batches.
pub(super) const BULK_SLICE: u64 = 256 << 10;
/// How often a writer holding bulk back for the replica looks again, if
/// the replica's acknowledgement does not wake it first.
const BULK_PACE: Duration = Duration::from_millis(5);
/// How long a failing disk rests between tries.
const RETRY: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Segment {
    file: Box<dyn SegmentFile>,
    path: PathBuf,
    opened: Instant,
    bytes: u64,
    /// Bytes made durable by its last sync (0: none yet).
    synced: u64,
    /// The end of what was appended when its last batch was taken.
    end: u64,
}

pub(super) fn run(shared: &Shared, first_number: u64) {
    let mut number = first_number;
    let mut current: Option<Segment> = None;
    // A batch that failed, written again before anything newer.
    let mut retained: Vec<u8> = Vec::new();
    loop {
        let (batch, records, end, stop) = next_batch(shared, !retained.is_empty());
        let started = Instant::now();
        // Sent on while this thread syncs (a batch retried here was sent).
        if let Some(replica) = shared.replica.get()
            && !batch.is_empty()
        {
            replica.batch(&batch, end);
        }
        let bytes = if retained.is_empty() {
            batch
        } else {
            let mut bytes = std::mem::take(&mut retained);
            bytes.extend_from_slice(&batch);
            bytes
        };
        if bytes.is_empty() {
            if current
                .as_ref()
                .is_some_and(|s| s.opened.elapsed() >= shared.config.seal_after)
                || stop
            {
                seal(shared, &mut current);
            }
            if stop {
                return;
            }
            continue;
        }
        match write(shared, &mut current, &mut number, &bytes, end) {
            Ok(()) => {
                shared.healthy.store(true, Ordering::Release);
                // Waiting changes wake only if they may be answered now
                // (not if they wait for the replica still).
                shared.durable.send_if_modified(|d| {
                    let before = d.answerable();
                    d.synced = d.synced.max(end);
                    d.answerable() > before
                });
                crate::metrics::journal_synced(bytes.len(), records, started.elapsed());
            }
            Err(error) => {
                tracing::error!(%error, "journal: a write or sync failed; changes are refused until the disk takes the journal again");
                shared.healthy.store(false, Ordering::Release);
                crate::metrics::journal_failed();
                shared.durable.send_modify(|d| {
                    d.failed = Some((d.synced, end, error.to_string()));
                });
                // What the failed file holds past its last sync is in
                // doubt: it is cut back to it and sealed, and the batch
                // goes to the next one whole.
                if let Some(segment) = &mut current {
                    segment.end = end;
                    cut_back(segment);
                }
                seal(shared, &mut current);
                retained = bytes;
                if stop {
                    return;
                }
                rest(shared, started + RETRY);
            }
        }
        // The next batch gathers what arrives until then: in sync mode at
        // most one sync starts per gap (a change arriving after a quiet
        // gap is synced at once).
        match shared.config.mode {
            JournalMode::Interval(every) => rest(shared, started + every),
            JournalMode::Sync if !shared.config.sync_gap.is_zero() => {
                rest(shared, started + shared.config.sync_gap)
            }
            _ => {}
        }
    }
}

/// Waits until `until`, or until the journal closes.
fn rest(shared: &Shared, until: Instant) {
    let mut appending = shared.lock_appending();
    while !appending.stop {
        let Some(left) = until.checked_duration_since(Instant::now()) else {
            return;
        };
        appending = (shared.appended_more.wait_timeout(appending, left))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Waits for something to write (or the idle period), then takes all of
/// it, and a slice of the bulk queue if there is room (see [`bulk_room`]):
/// the bytes, the records, where the journal ends with them, and whether
/// the journal is closing.
fn next_batch(shared: &Shared, retrying: bool) -> (Vec<u8>, u64, u64, bool) {
    let mut appending = shared.lock_appending();
    let mut room = bulk_room(shared, appending.stop || retrying);
    let idle = |a: &super::Appending, room: u64| {
        a.buffer.is_empty() && (a.bulk.is_empty() || room == 0) && !a.stop && !retrying
    };
    if idle(&appending, room) {
        appending = match shared.config.mode {
            JournalMode::Sync => {
                // Bulk held back for the replica is looked at again when it
                // acknowledges (see `Journal::replicated`), or soon.
                let held = !appending.bulk.is_empty();
                let wait = if held { BULK_PACE } else { IDLE };
                appending.writer_waiting = true;
                shared.bulk_held.store(held, Ordering::Release);
                let mut appending = (shared.appended_more.wait_timeout(appending, wait))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                shared.bulk_held.store(false, Ordering::Release);
                appending.writer_waiting = false;
                room = bulk_room(shared, appending.stop);
                appending
            }
            // The interval's sleep is the wait.
            _ => appending,
        };
    }
    let mut batch = std::mem::take(&mut appending.buffer);
    let mut records = std::mem::take(&mut appending.records);
    // After the changes: they take their places first. A bulk frame takes
    // its place (its sequence numbers) only now, under the same lock.
    let mut bulk = 0;
    while bulk < room {
        let Some(frame) = appending.bulk.pop_front() else {
            break;
        };
        bulk += frame.len() as u64;
        batch.extend_from_slice(&frame);
        records += 1;
    }
    let end = shared.appended.fetch_add(bulk, Ordering::AcqRel) + bulk;
    if bulk > 0 {
        shared.bulk_taken.send_modify(|(bytes, at)| {
            *bytes += bulk;
            *at = end;
        });
    }
    shared.taken.store(end, Ordering::Release);
    (batch, records, end, appending.stop)
}

/// How many bulk bytes the next batch may take: a slice, once the replica
/// (if any) holds the last batch that took bulk, so that bulk queues
/// neither at the disk nor at the replica in front of the changes appended
/// after it (paced on bulk's own batches, not on what the replica lags
/// behind the changes: bulk would starve under load, and a handoff with
/// it); everything when closing or retrying a failed batch (the disk is
/// the wait then), or when no change waits for a sync.
fn bulk_room(shared: &Shared, all: bool) -> u64 {
    if all || shared.config.mode != JournalMode::Sync {
        return u64::MAX;
    }
    let replicated = shared.durable.borrow().replicated;
    let last_bulk = shared.bulk_taken.borrow().1;
    if replicated < last_bulk {
        0
    } else {
        BULK_SLICE
    }
}

/// Writes and syncs `bytes` (appended up to `end`), opening a new segment
/// first if there is none or the current one is full or old.
fn write(
    shared: &Shared,
    current: &mut Option<Segment>,
    number: &mut u64,
    bytes: &[u8],
    end: u64,
) -> std::io::Result<()> {
    let config = &shared.config;
    if current
        .as_ref()
        .is_some_and(|s| s.bytes >= config.segment_bytes || s.opened.elapsed() >= config.seal_after)
    {
        seal(shared, current);
    }
    if current.is_none() {
        let path = config.dir.join(format!("{:020}.{EXTENSION}", *number));
        *number += 1;
        let file = shared.disk.create(&path)?;
        // Current before its first write, so that a failed one is cut too.
        *current = Some(Segment {
            file,
            path,
            opened: Instant::now(),
            bytes: 0,
            synced: 0,
            end,
        });
    }
    let segment = current.as_mut().expect("opened above");
    segment.end = end;
    if segment.bytes == 0 {
        segment.file.write_all(MAGIC)?;
        segment.bytes = MAGIC.len() as u64;
    }
    segment.file.write_all(bytes)?;
    segment.bytes += bytes.len() as u64;
    segment.file.sync()?;
    segment.synced = segment.bytes;
    Ok(())
}

/// Cuts a segment whose write or sync failed back to its last sync: past
/// it lies part of a batch (a full disk takes part of a write) or bytes a
/// failed sync left in doubt, and that batch goes whole to the next
/// segment. Left there, it would read as corruption once a newer segment
/// exists. Nothing synced yet: cut to nothing, which replay skips.
fn cut_back(segment: &mut Segment) {
    if let Err(error) = segment.file.truncate(segment.synced) {
        tracing::error!(
            file = %segment.path.display(),
            offset = segment.synced,
            %error,
            "journal: a segment whose write failed could not be cut back to its last sync; \
             a start before it is trimmed stops there as corrupt, and --journal-skip-corrupt \
             then loses nothing (what lies past it was written again to the next segment)"
        );
    }
}

/// Moves the current segment to the sealed ones, for the trimmer.
fn seal(shared: &Shared, current: &mut Option<Segment>) {
    if let Some(segment) = current.take() {
        shared.lock_sealed().push_back(Sealed {
            path: segment.path,
            end: segment.end,
        });
    }
}
