//! The journal on its own and under a cache: group commit, failing disks,
//! and truncation against what the store holds.

use std::sync::Arc;
use std::time::Duration;

use super::disk::faulty::FaultyDisk;
use super::disk::{Disk, Fs};
use super::*;
use crate::cache::{Cache, CacheConfig};
use crate::read_state::Key;
use crate::store::faulty::{Effect, Fault, FaultyStore, Operation, SlowFirstLoad};
use crate::store::{Store, UserWrite};
use crate::write_behind::{WriteBehind, WriteBehindConfig};

fn config(dir: &Path) -> JournalConfig {
    JournalConfig::new(dir.to_owned(), JournalMode::Sync)
}

fn open(config: JournalConfig, disk: Arc<dyn Disk>) -> (Arc<Journal>, Replayed) {
    let (journal, replayed) = Journal::open(config, disk).expect("opens");
    (Arc::new(journal), replayed)
}

/// Appends a lowering record: the smallest record to journal.
fn append_one(journal: &Journal, user_id: u64) {
    journal.append(|out| record::append_lowered(out, user_id, &[]));
}

#[tokio::test]
async fn a_change_is_durable_only_once_its_sync_returns() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(FaultyDisk::default());
    let faults = disk.faults();
    faults.hold();
    let (journal, _) = open(config(dir.path()), disk);
    append_one(&journal, 1);
    let upto = journal.appended();
    let waiting = tokio::spawn({
        let journal = journal.clone();
        async move { journal.durable(upto).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "answered while its sync had not returned"
    );
    faults.release();
    waiting.await.unwrap().expect("durable once synced");
    assert!(faults.syncs.load(Ordering::SeqCst) >= 1);
    journal.close(false);
}

#[tokio::test]
async fn one_sync_covers_every_change_appended_while_the_last_ran() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(FaultyDisk::default());
    let faults = disk.faults();
    let (journal, _) = open(config(dir.path()), disk);
    faults.hold();
    append_one(&journal, 1);
    // The writer takes the first and waits in its sync; these pile up.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waits: Vec<_> = (2..=200)
        .map(|user_id| {
            append_one(&journal, user_id);
            let (journal, upto) = (journal.clone(), journal.appended());
            tokio::spawn(async move { journal.durable(upto).await })
        })
        .collect();
    faults.release();
    for wait in waits {
        wait.await.unwrap().expect("durable");
    }
    let syncs = faults.syncs.load(Ordering::SeqCst);
    assert!(syncs <= 3, "{syncs} syncs for 200 changes in two rounds");
    journal.close(false);
}

#[tokio::test]
async fn with_a_sync_gap_syncs_start_that_far_apart_and_a_change_after_a_quiet_one_syncs_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(FaultyDisk::default());
    let faults = disk.faults();
    let gap = Duration::from_secs(1);
    let (journal, _) = open(
        JournalConfig {
            sync_gap: gap,
            ..config(dir.path())
        },
        disk,
    );
    // Quiet so far: the first change does not wait for a gap.
    let began = std::time::Instant::now();
    append_one(&journal, 1);
    journal.durable(journal.appended()).await.expect("durable");
    let first = began.elapsed();
    assert!(first < gap / 2, "the first change waited {first:?}");
    let syncs_before = faults.syncs.load(Ordering::SeqCst);
    // A change every 10 ms for 2.5 s: three gaps' worth of syncs, not 250.
    let began = std::time::Instant::now();
    let mut waits = Vec::new();
    for user_id in 2..252 {
        append_one(&journal, user_id);
        let (journal, upto) = (journal.clone(), journal.appended());
        waits.push(tokio::spawn(async move { journal.durable(upto).await }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for wait in waits {
        wait.await.unwrap().expect("durable");
    }
    let elapsed = began.elapsed();
    let syncs = faults.syncs.load(Ordering::SeqCst) - syncs_before;
    let most = elapsed.as_secs_f64() / gap.as_secs_f64() + 1.0;
    assert!(
        (1..=most.ceil() as usize).contains(&syncs),
        "{syncs} syncs for 250 changes in {elapsed:?} with a gap of {gap:?}"
    );
    journal.close(false);
}

/// A journal in `dir` on a disk that fails on command, holding user 1's
/// change, durable; and the disk's faults.
async fn one_change_on_a_faulty_disk(
    dir: &std::path::Path,
) -> (Arc<Journal>, Arc<super::disk::faulty::Faults>) {
    let disk = Arc::new(FaultyDisk::default());
    let faults = disk.faults();
    let (journal, _) = open(config(dir), disk);
    append_one(&journal, 1);
    journal
        .durable(journal.appended())
        .await
        .expect("a good disk");
    (journal, faults)
}

/// A full disk and a failing sync alike: the waiting changes fail, the
/// journal refuses until the disk takes it again, and then what failed is
/// written again whole, with nothing journaled before it lost.
async fn a_failing_disk(fail: impl Fn(&super::disk::faulty::Faults, bool)) {
    let dir = tempfile::tempdir().unwrap();
    let (journal, faults) = one_change_on_a_faulty_disk(dir.path()).await;

    fail(&faults, true);
    append_one(&journal, 2);
    let failed = journal.durable(journal.appended()).await;
    assert!(
        matches!(failed, Err(JournalError::Failing(_))),
        "{failed:?}"
    );
    assert!(!journal.healthy(), "refuses changes while the disk fails");

    fail(&faults, false);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !journal.healthy() {
        assert!(std::time::Instant::now() < deadline, "never recovered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    append_one(&journal, 3);
    journal
        .durable(journal.appended())
        .await
        .expect("recovered");
    journal.close(false);

    let (_, replayed) = Journal::open(config(dir.path()), Arc::new(Fs)).expect("reads back");
    let mut users: Vec<u64> = replayed.users.keys().copied().collect();
    users.sort_unstable();
    assert_eq!(users, [1, 2, 3], "the failed batch was written again");
}

#[tokio::test]
async fn a_full_disk_fails_the_waiting_changes_and_loses_nothing_journaled() {
    a_failing_disk(|faults, on| faults.full.store(on, Ordering::SeqCst)).await;
}

#[tokio::test]
async fn a_failing_sync_fails_the_waiting_changes_and_loses_nothing_journaled() {
    a_failing_disk(|faults, on| faults.failing_syncs.store(on, Ordering::SeqCst)).await;
}

/// Issue 53: replay takes damage at the end of any segment but the newest
/// for corruption, so a write that failed (a full disk takes half of it)
/// must not leave its half in the segment it seals: that segment is cut
/// back to its last sync, and the batch goes whole to the next one.
#[tokio::test]
async fn a_segment_whose_write_failed_is_cut_back_to_its_last_sync() {
    let dir = tempfile::tempdir().unwrap();
    let (journal, faults) = one_change_on_a_faulty_disk(dir.path()).await;
    let [first] = &segment_paths(dir.path())[..] else {
        panic!("one segment");
    };
    let synced = std::fs::metadata(first).unwrap().len();

    faults.full.store(true, Ordering::SeqCst);
    append_one(&journal, 2);
    let failed = journal.durable(journal.appended()).await;
    assert!(failed.is_err(), "{failed:?}");
    faults.full.store(false, Ordering::SeqCst);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !journal.healthy() {
        assert!(std::time::Instant::now() < deadline, "never recovered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    journal.close(false);

    assert_eq!(
        std::fs::metadata(first).unwrap().len(),
        synced,
        "the failed write's half left in the sealed segment"
    );
    let replayed = replay::read_dir(dir.path(), false).expect("reads back");
    assert_eq!((replayed.torn_bytes, replayed.skipped_bytes), (0, 0));
    let mut users: Vec<u64> = replayed.users.keys().copied().collect();
    users.sort_unstable();
    assert_eq!(users, [1, 2], "the failed batch written again");
}

#[tokio::test]
async fn interval_mode_answers_at_once_and_syncs_within_the_interval() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(FaultyDisk::default());
    let faults = disk.faults();
    faults.hold();
    let mode = JournalMode::Interval(Duration::from_millis(10));
    let (journal, _) = open(JournalConfig::new(dir.path().to_owned(), mode), disk);
    append_one(&journal, 1);
    let answered = tokio::time::timeout(
        Duration::from_millis(100),
        journal.durable(journal.appended()),
    )
    .await;
    assert!(matches!(answered, Ok(Ok(()))), "answered at once");
    faults.release();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(faults.syncs.load(Ordering::SeqCst) >= 1);
    journal.close(false);
}

/// Issue 53: a second process on a live node's journal replayed, wrote and
/// deleted the live one's segments. Two opens in one process conflict as
/// two processes do (the lock is the open file's, not the process's).
#[test]
fn a_second_open_of_a_journal_directory_fails_naming_the_holder_until_the_first_closes() {
    let dir = tempfile::tempdir().unwrap();
    let (first, _) = open(config(dir.path()), Arc::new(Fs));
    append_one(&first, 1);

    let error = Journal::open(config(dir.path()), Arc::new(Fs))
        .map(|_| ())
        .expect_err("a second open of a held directory");
    let message = error.to_string();
    let holder = format!("pid {} on host ", std::process::id());
    assert!(
        message.contains(&format!(
            "journal directory {} is locked by another process",
            dir.path().display()
        )) && message.contains(&holder)
            && message.contains(", started ")
            && message.ends_with("is this node running twice?"),
        "{message}"
    );

    // Closed (the end of a shutdown, or a crash in the simulations): the
    // directory is free at once, and what the first journaled is there.
    first.close(false);
    let (second, replayed) = open(config(dir.path()), Arc::new(Fs));
    assert_eq!(replayed.records, 1);
    drop(second);
    // Dropped (a process's end) frees it too.
    let (third, _) = open(config(dir.path()), Arc::new(Fs));
    third.close(false);
}

#[test]
fn modes_read_as_written() {
    for (text, mode) in [
        ("sync", JournalMode::Sync),
        ("off", JournalMode::Off),
        (
            "interval:10ms",
            JournalMode::Interval(Duration::from_millis(10)),
        ),
    ] {
        assert_eq!(text.parse::<JournalMode>(), Ok(mode));
        assert_eq!(String::from(mode), text);
    }
    for bad in ["always", "interval:", "interval:0s", "interval:soon"] {
        assert!(bad.parse::<JournalMode>().is_err(), "{bad}");
    }
}

async fn ack(cache: &Arc<Cache>, user_id: u64, channel_id: u64, message_id: u64) {
    cache
        .update(user_id, |user, now| {
            user.ack(Key::channel(channel_id), message_id, now)
        })
        .await
        .expect("acked");
}

async fn last_acked(cache: &Arc<Cache>, user_id: u64, channel_id: u64) -> Option<u64> {
    (cache
        .read(user_id, |user| {
            user.get(Key::channel(channel_id)).map(|s| s.last_acked_id)
        })
        .await)
        .unwrap()
}

/// What the store holds as `user_id`'s last ack of `channel_id`.
async fn stored_ack(store: &Arc<dyn Store>, user_id: u64, channel_id: u64) -> Option<u64> {
    let user = store.load(user_id).await.unwrap();
    let user = user.into_user(crate::clock::now_micros());
    user.get(Key::channel(channel_id)).map(|s| s.last_acked_id)
}

fn cache_config() -> CacheConfig {
    CacheConfig {
        shards: 2,
        write_delay: Duration::from_millis(100),
        ..CacheConfig::default()
    }
}

/// A cache journaling into `dir`, over `store`, with what the journal held
/// replayed.
fn journaled_cache(dir: &Path, store: Arc<dyn Store>) -> (Arc<Cache>, Arc<Journal>) {
    let config = JournalConfig {
        seal_after: Duration::from_millis(50),
        ..config(dir)
    };
    let (journal, replayed) = open(config, Arc::new(Fs));
    let cache = Cache::new(cache_config(), store);
    cache.replay(replayed);
    cache.set_journal(journal.clone());
    (cache, journal)
}

/// A store in memory, and in `dir` a journal left by a node that acked
/// user 1's channel 10 to 100 and crashed before writing it.
async fn crashed_after_one_ack(dir: &Path) -> Arc<dyn Store> {
    let memory: Arc<dyn Store> = Arc::new(crate::store::memory::MemoryStore::new());
    let (cache, journal) = journaled_cache(dir, memory.clone());
    ack(&cache, 1, 10, 100).await;
    drop(cache);
    drop(journal);
    memory
}

/// The segment files in `dir`, oldest first (not the lock file).
fn segment_paths(dir: &Path) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = (std::fs::read_dir(dir).unwrap())
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == replay::EXTENSION))
        .collect();
    paths.sort_unstable();
    paths
}

fn segment_files(dir: &Path) -> usize {
    segment_paths(dir).len()
}

#[tokio::test]
async fn segments_stay_while_their_changes_are_unwritten_and_go_once_written() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, Effect::Fail));
    let (cache, journal) = journaled_cache(dir.path(), store.clone());
    let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    ack(&cache, 1, 10, 100).await;
    let mut trimmer = Trimmer::new(journal.clone());
    // Sealed, and write-behind failing past the write delay.
    tokio::time::sleep(Duration::from_millis(400)).await;
    ack(&cache, 2, 10, 100).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(journal.segments() >= 1, "sealed");
    assert_eq!(
        trimmer.trim(|| cache.oldest_unwritten()),
        0,
        "deleted unwritten changes"
    );
    assert!(segment_files(dir.path()) >= 2);

    store.clear();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cache.unwritten() > 0 {
        assert!(std::time::Instant::now() < deadline, "never written");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The open segment seals once idle, then goes too.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let removed = trimmer.trim(|| cache.oldest_unwritten());
    assert!(removed >= 2, "removed {removed}");
    assert_eq!(segment_files(dir.path()), 0);
    write_behind.shutdown(Duration::from_secs(5)).await;
    journal.close(true);
}

#[tokio::test]
async fn a_crash_loses_no_journaled_change_and_the_replay_is_written_behind() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(crate::store::memory::MemoryStore::new());
    // The store holds an older ack of user 1 and a newer one of channel 11.
    let mut stored = crate::read_state::UserReadStates::default();
    stored.ack(Key::channel(10), 50, 1);
    store.write(&UserWrite::of(1, &stored)).await.unwrap();
    {
        let (cache, journal) = journaled_cache(dir.path(), store.clone());
        ack(&cache, 1, 10, 100).await;
        ack(&cache, 1, 11, 7).await;
        ack(&cache, 2, 10, 300).await;
        // A crash: nothing written, the writer just stops.
        drop(cache);
        drop(journal);
    }
    let (cache, journal) = journaled_cache(dir.path(), store.clone());
    assert_eq!(cache.unwritten(), 3, "replayed, unwritten");
    // Read before it is written: laid over what the store holds.
    assert_eq!(last_acked(&cache, 1, 10).await, Some(100));
    assert_eq!(last_acked(&cache, 1, 11).await, Some(7));
    let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    let report = write_behind.shutdown(Duration::from_secs(5)).await;
    assert_eq!(report.unwritten, 0);
    journal.close(true);
    assert_eq!(stored_ack(&store, 2, 10).await, Some(300));
    assert_eq!(stored_ack(&store, 1, 10).await, Some(100));
    assert_eq!(segment_files(dir.path()), 0, "emptied once all is written");
}

/// A node restarted after [`crashed_after_one_ack`]: its cache replayed the
/// journal, and a read of user 1 is loading it, the load (which holds the
/// replayed write) let go only by `go`.
struct HeldLoad {
    memory: Arc<dyn Store>,
    cache: Arc<Cache>,
    journal: Arc<Journal>,
    go: tokio::sync::oneshot::Sender<()>,
    /// What the read finds of channel 10.
    read: tokio::task::JoinHandle<Option<u64>>,
}

async fn held_load(dir: &Path) -> HeldLoad {
    let memory = crashed_after_one_ack(dir).await;
    let (store, go) = SlowFirstLoad::of(memory.clone(), 1);
    let (cache, journal) = journaled_cache(dir, store);
    let read = tokio::spawn({
        let cache = cache.clone();
        async move { last_acked(&cache, 1, 10).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    HeldLoad {
        memory,
        cache,
        journal,
        go,
        read,
    }
}

#[tokio::test]
async fn a_load_that_read_the_store_before_a_replayed_write_landed_keeps_the_replayed_changes() {
    // Found by `loadtest crash`: the replayed write of a user landed and
    // was dropped while a load of the user, which had read the store
    // before, was under way; the load then cached the older stored state.
    let dir = tempfile::tempdir().unwrap();
    let HeldLoad {
        cache,
        journal,
        go,
        read,
        ..
    } = held_load(dir.path()).await;
    let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    // Write-behind may write the replayed user meanwhile (the load holds
    // its changes now, so it waits for the load).
    tokio::time::sleep(Duration::from_millis(500)).await;
    go.send(()).unwrap();
    assert_eq!(read.await.unwrap(), Some(100));
    write_behind.shutdown(Duration::from_secs(5)).await;
    journal.close(true);
}

#[tokio::test]
async fn a_shutdown_waits_for_a_load_that_holds_a_replayed_write_and_writes_it() {
    // Found by the simulation (seed 1139, "stored user 2002 (report: all
    // written)"): a load held the replayed changes when shutdown came; the
    // drain counted nothing unwritten, reported all written and ended, and
    // the load then cached changes nothing would write.
    let dir = tempfile::tempdir().unwrap();
    let HeldLoad {
        memory,
        cache,
        journal,
        go,
        read,
    } = held_load(dir.path()).await;
    assert_eq!(
        cache.unwritten(),
        1,
        "a load's replayed change is unwritten"
    );
    let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    let shutdown = tokio::spawn(write_behind.shutdown(Duration::from_secs(5)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    go.send(()).unwrap();
    assert_eq!(read.await.unwrap(), Some(100));
    let report = shutdown.await.unwrap();
    assert_eq!(report.unwritten, 0);
    assert_eq!(
        stored_ack(&memory, 1, 10).await,
        Some(100),
        "reported written"
    );
    journal.close(true);
}

#[tokio::test]
async fn a_release_waits_for_a_load_that_holds_a_replayed_write_until_the_store_has_it() {
    // As the shutdown above, for a slot that leaves: the new owner reads
    // the store once the release is done, so the replayed changes a load
    // held meanwhile must be there by then.
    let dir = tempfile::tempdir().unwrap();
    let memory = crashed_after_one_ack(dir.path()).await;
    let (store, go) = SlowFirstLoad::of(memory.clone(), 1);
    let (journal, replayed) = open(config(dir.path()), Arc::new(Fs));
    let ownership = Arc::new(crate::ownership::Ownership::member());
    let slot = readstates_routing::slot_of(1);
    ownership.set(slot, crate::ownership::SlotState::Serving);
    ownership.lease(None);
    let cache = Cache::with_ownership(cache_config(), store, ownership.clone());
    cache.replay(replayed);
    cache.set_journal(journal.clone());
    let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    let read = tokio::spawn({
        let cache = cache.clone();
        async move { cache.read(1, |_| ()).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    ownership.set(slot, crate::ownership::SlotState::Releasing);
    let released = tokio::spawn({
        let (cache, memory) = (cache.clone(), memory.clone());
        async move {
            cache
                .release(|id| readstates_routing::slot_of(id) == slot)
                .await;
            stored_ack(&memory, 1, 10).await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    go.send(()).unwrap();
    let _ = read.await.unwrap();
    assert_eq!(
        released.await.unwrap(),
        Some(100),
        "released before written"
    );
    write_behind.shutdown(Duration::from_secs(5)).await;
    journal.close(true);
}

#[test]
fn the_entries_of_a_group_are_one_frame_kept_or_cut_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (journal, _) = open(config(dir.path()), Arc::new(Fs));
    {
        let _group = journal.group();
        append_one(&journal, 1);
        let _inner = journal.group();
        append_one(&journal, 2);
        append_one(&journal, 3);
    }
    append_one(&journal, 4);
    journal.close(false);
    let [segment] = &segment_paths(dir.path())[..] else {
        panic!("one segment");
    };
    let bytes = std::fs::read(segment).unwrap();
    let (group, len) = record::read(&bytes[replay::MAGIC.len()..]).expect("a frame");
    assert_eq!(group.len(), 3, "one frame for the group");
    let (alone, _) = record::read(&bytes[replay::MAGIC.len() + len..]).expect("a frame");
    assert_eq!(alone.len(), 1);
    // Cut inside the group's frame: none of it is replayed.
    std::fs::write(segment, &bytes[..replay::MAGIC.len() + len - 1]).unwrap();
    let (_, replayed) = Journal::open(config(dir.path()), Arc::new(Fs)).unwrap();
    assert_eq!(replayed.records, 0, "a part of a group was kept");
}

#[tokio::test]
async fn a_replayed_write_retried_after_a_load_found_it_all_stored_ends() {
    // Found by the simulation ("a write left in flight"): the load took
    // the replayed changes while their write was backing off, found the
    // store holding them all, and cached the user without the write's
    // in-flight mark; the retry was then refused for good.
    let dir = tempfile::tempdir().unwrap();
    let memory = crashed_after_one_ack(dir.path()).await;
    // The store holds it already, newer.
    let mut stored = crate::read_state::UserReadStates::default();
    stored.ack(
        Key::channel(10),
        100,
        crate::clock::now_micros() + 1_000_000,
    );
    memory.write(&UserWrite::of(1, &stored)).await.unwrap();
    let store = Arc::new(FaultyStore::new(memory.clone(), 1));
    store.inject(Fault::new(Operation::Write, Effect::Fail).user(1).times(1));
    let (cache, journal) = journaled_cache(dir.path(), store.clone());
    let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    while store.failed_writes() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Backing off: the load takes the replayed changes.
    assert_eq!(last_acked(&cache, 1, 10).await, Some(100));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while cache.writes_in_flight() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the retry never ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    write_behind.shutdown(Duration::from_secs(5)).await;
    journal.close(true);
}

/// Issue 37: a fleet node frozen between applying a change and answering
/// it may find its lease lapsed, and its users taken, when it wakes. The
/// change is then not answered OK (UNAVAILABLE: retry), though it was
/// applied here under a lease that held.
#[tokio::test]
async fn a_change_applied_under_the_lease_but_synced_after_it_lapsed_is_not_answered_ok() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(FaultyDisk::default());
    let faults = disk.faults();
    let (journal, _) = open(config(dir.path()), disk);
    let ownership = Arc::new(crate::ownership::Ownership::member());
    ownership.set(
        readstates_routing::slot_of(1),
        crate::ownership::SlotState::Serving,
    );
    let lease = tokio::time::Instant::now() + Duration::from_millis(300);
    ownership.lease(Some(lease));
    let cache = Cache::with_ownership(cache_config(), Arc::new(FaultyStore::memory()), ownership);
    cache.set_journal(journal.clone());
    ack(&cache, 1, 10, 100).await;

    faults.hold();
    let change = tokio::spawn({
        let cache = cache.clone();
        async move {
            (cache.update(1, |user, now| user.ack(Key::channel(10), 101, now)))
                .await
                .map(drop)
        }
    });
    tokio::time::sleep_until(lease + Duration::from_millis(50)).await;
    faults.release();
    let answer = change.await.unwrap();
    assert!(
        matches!(answer, Err(crate::error::Error::LeaseLapsed)),
        "{answer:?}"
    );
    journal.close(false);
}

/// A handed-in user is journaled under its shard's lock, as every other
/// change is: a backup that attaches re-journals each shard under its lock
/// (`Cache::rejournal`), so a user installed meanwhile is either in the
/// shard by then or journaled after the stream attached, never neither
/// (the backup would lack its changes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_in_user_is_journaled_under_its_shards_lock() {
    use crate::cache::handoff::{Chunk, HandedUser};
    use crate::read_state::UserReadStates;

    let dir = tempfile::tempdir().unwrap();
    let (cache, journal) = journaled_cache(
        dir.path(),
        Arc::new(crate::store::memory::MemoryStore::new()),
    );
    let mut states = UserReadStates::default();
    states.ack(Key::channel(10), 100, crate::clock::now_micros());
    let handed = HandedUser {
        user_id: 7,
        states,
        unwritten_for: None,
    };
    let before = journal.bulk_appended();
    let (installer, journaled_while_locked) = cache.with_shard(cache.shard_of(7), |_| {
        let installer = std::thread::spawn({
            let cache = cache.clone();
            move || cache.install(Chunk::Users(vec![handed]))
        });
        std::thread::sleep(Duration::from_millis(200));
        (installer, journal.bulk_appended() - before)
    });
    assert_eq!(
        journaled_while_locked, 0,
        "journaled outside the shard's lock"
    );
    assert_eq!(installer.join().unwrap(), 1);
    assert!(
        journal.bulk_appended() > before,
        "a handed-in change is journaled"
    );
}

/// `count` users from `first` on, each with `rows` channels acked and
/// none of it written: what a handoff brings.
fn handed_users(first: u64, count: u64, rows: u64) -> Vec<crate::cache::handoff::HandedUser> {
    (first..first + count)
        .map(|user_id| {
            let mut states = crate::read_state::UserReadStates::default();
            for channel_id in 1..=rows {
                states.ack(Key::channel(channel_id), 100, crate::clock::now_micros());
            }
            crate::cache::handoff::HandedUser {
                user_id,
                states,
                unwritten_for: Some(Duration::from_secs(1)),
            }
        })
        .collect()
}

/// Found at half load (issue 54): a handoff's users were journaled in line
/// with the changes being answered, so a change made on the receiver while
/// it installed tens of megabytes waited for all of them to be synced (and
/// held by its backup), seconds at half load. Now a change waits for at
/// most a slice of them. Fails with the handed-in users journaled by
/// `Journal::append`: the sync that answers the ack takes all 4 MB.
#[tokio::test]
async fn a_change_made_while_a_handoff_is_installed_waits_for_a_slice_of_it_not_all() {
    use crate::cache::handoff::Chunk;

    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(FaultyDisk::default());
    let faults = disk.faults();
    // Rounds 300 ms apart: what the first one took is still all that is
    // taken when the ack is answered.
    let gapped = JournalConfig {
        sync_gap: Duration::from_millis(300),
        ..config(dir.path())
    };
    let (journal, replayed) = open(gapped, disk);
    let cache = Cache::new(
        cache_config(),
        Arc::new(crate::store::memory::MemoryStore::new()),
    );
    cache.replay(replayed);
    cache.set_journal(journal.clone());
    // The writer waits in a sync while the handoff and the ack arrive.
    faults.hold();
    append_one(&journal, 1);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let taken = journal.taken();
    for chunk in 0..16 {
        cache.install(Chunk::Users(handed_users(1_000 + chunk * 100, 100, 60)));
    }
    let handed = journal.bulk_appended();
    assert!(handed > 4 << 20, "the handoff journaled {handed} bytes");
    // Answered once durable (`Cache::update` waits for it).
    let answered = tokio::spawn({
        let cache = cache.clone();
        async move { ack(&cache, 1, 10, 100).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    faults.release();
    answered.await.unwrap();
    let with_the_ack = journal.taken() - taken;
    assert!(
        with_the_ack < 1 << 20,
        "the ack waited for {with_the_ack} bytes of a {handed}-byte handoff"
    );
    // The handoff completes once all of it is durable.
    cache.handed_in_journaled().await.expect("durable");
    assert!(journal.taken() - taken >= handed);
    journal.close(false);
    let (_, replayed) = Journal::open(config(dir.path()), Arc::new(Fs)).unwrap();
    assert_eq!(
        replayed.users.len(),
        1 + 1_600,
        "every handed-in user replays"
    );
}

/// A replica that holds what it is told to (see [`Journal::replicated`]).
#[derive(Debug, Default)]
struct SilentReplica;

impl Replica for SilentReplica {
    fn batch(&self, _frames: &[u8], _end: u64) {}
    fn trimmed(&self, _through: u64) {}
}

/// Bulk goes to the replica no faster than it holds it: queued at the
/// replica, it would delay the changes appended after it as surely as at
/// the disk.
#[tokio::test]
async fn bulk_is_taken_only_as_fast_as_the_replica_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let (journal, _) = open(config(dir.path()), Arc::new(Fs));
    journal.set_replica(Arc::new(SilentReplica));
    journal.replicated(journal.taken());
    for user in handed_users(1, 2_000, 30) {
        let view = user.states.view();
        journal.append_bulk(|out| record::append_user(out, user.user_id, 0, view));
    }
    let handed = journal.bulk_appended();
    assert!(handed > 1 << 20, "{handed} bytes");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let taken = journal.shared.bulk_taken.borrow().0;
    assert!(
        (1..=2 * writer::BULK_SLICE).contains(&taken),
        "{taken} bulk bytes taken while the replica held none of them"
    );
    // A change appended now still takes its place at once.
    append_one(&journal, 1);
    let upto = journal.appended();
    assert!(journal.shared.bulk_taken.borrow().0 <= 2 * writer::BULK_SLICE);
    journal.replicated(u64::MAX);
    journal.durable(upto).await.expect("durable");
    let end = journal.bulk_end().await;
    journal.durable(end).await.expect("durable");
    assert_eq!(journal.shared.bulk_taken.borrow().0, handed);
    journal.close(false);
}

/// Found by the failover simulation, with a slow store: a node started
/// again after kill -9 replayed a user, then was handed the same user (its
/// slot came back) before the replayed write reached the store. The
/// handed-in user took the replayed write's place in the cache without
/// it: write-behind found the cached user and never wrote the replayed
/// write, and a shutdown's drain spun on it (forever on a paused clock).
/// The replayed write is written, as it is, before the cached user's.
#[test]
fn a_replayed_user_handed_in_again_still_has_its_replayed_write_written() {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = Arc::new(FaultyStore::memory());
            // Writes wait: the replayed write is not in the store yet when
            // the user is handed in.
            store.inject(Fault::new(Operation::Write, Effect::Hang));
            let cache = Cache::new(CacheConfig::default(), store.clone());
            replay_user_7(&cache);
            let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
            tokio::time::sleep(Duration::from_millis(10)).await;
            hand_in_user_7(&cache, Duration::ZERO);
            store.clear();
            let report = write_behind.shutdown(Duration::from_secs(10)).await;
            let (replayed, handed) = stored_user_7(&store).await;
            let _ = done.send((report.unwritten, replayed, handed));
        });
    });
    let (unwritten, replayed, handed) = finished
        .recv_timeout(Duration::from_secs(20))
        .expect("the shutdown's drain spins");
    assert_eq!(unwritten, 0);
    assert_eq!(replayed, Some(5), "the replayed write is lost");
    assert_eq!(handed, Some(9));
}

/// User 7 replayed into `cache`, channel 10 acked at 5.
fn replay_user_7(cache: &Cache) {
    let mut replayed = crate::read_state::UserReadStates::default();
    replayed.ack(Key::channel(10), 5, 1);
    cache.replay(Replayed {
        users: [(7, UserWrite::of(7, &replayed))].into(),
        ..Replayed::default()
    });
}

/// User 7 handed in to `cache`, channel 11 acked at 9, a change unwritten
/// for `unwritten_for` at its previous owner.
fn hand_in_user_7(cache: &Cache, unwritten_for: Duration) {
    use crate::cache::handoff::{Chunk, HandedUser};

    let mut handed = crate::read_state::UserReadStates::default();
    handed.ack(Key::channel(11), 9, crate::clock::now_micros());
    cache.install(Chunk::Users(vec![HandedUser {
        user_id: 7,
        states: handed,
        unwritten_for: Some(unwritten_for),
    }]));
}

/// What the store holds of user 7: the last acked of channels 10 and 11.
async fn stored_user_7(store: &FaultyStore) -> (Option<u64>, Option<u64>) {
    let stored = store.load(7).await.unwrap();
    let acked = |channel| {
        (stored.read_states.iter())
            .find(|s| s.channel_id == channel)
            .map(|s| s.last_acked_id)
    };
    (acked(10), acked(11))
}

/// User 7 replayed and its replayed write begun, `effect` in the store
/// (it hangs there, or fails and backs off for at least 75 ms); then user
/// 7 handed in, unwritten for a whole delay at its previous owner: due at
/// once, while the replayed write is still under way.
async fn user_7_handed_in_during_its_replayed_write(
    effect: Effect,
) -> (Arc<FaultyStore>, Arc<Cache>, WriteBehind) {
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, effect));
    let cache = Cache::new(CacheConfig::default(), store.clone());
    replay_user_7(&cache);
    let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    tokio::time::sleep(Duration::from_millis(10)).await;
    hand_in_user_7(&cache, CacheConfig::default().write_delay);
    tokio::time::sleep(Duration::from_millis(10)).await;
    (store, cache, write_behind)
}

/// Found in review (stop 50): a replayed user handed in while its replayed
/// write is under way. The handed-in user's queue entry came due during
/// that write and was spent on it (`begin_write` found a write of the user
/// under way), and the replayed write's end queued nothing: the handed-in
/// changes waited for the user's next change, an eviction or a shutdown,
/// however long, and the journal could not be trimmed past them.
#[tokio::test(start_paused = true)]
async fn a_user_handed_in_during_its_replayed_write_is_written_after_it() {
    let (store, cache, _write_behind) =
        user_7_handed_in_during_its_replayed_write(Effect::Hang).await;
    let write_delay = CacheConfig::default().write_delay;
    store.clear();
    tokio::time::sleep(write_delay * 3).await;
    let (replayed, handed) = stored_user_7(&store).await;
    assert_eq!(replayed, Some(5), "the replayed write");
    assert_eq!(
        handed,
        Some(9),
        "the handed-in change, unwritten three delays on"
    );
    assert_eq!(cache.unwritten(), 0);
}

/// Found in review (stop 51): the same, with the replayed write failing
/// and dropped (its node's takeover wrote it) while it backed off. Its
/// retry found no replayed write and ended without letting go of the
/// user: the user's own changes, their entry spent meanwhile, waited in no
/// queue, and the user counted as being written for good.
#[tokio::test(start_paused = true)]
async fn a_user_beside_a_replayed_write_dropped_while_it_backed_off_is_written() {
    let (store, cache, _write_behind) =
        user_7_handed_in_during_its_replayed_write(Effect::Fail).await;
    let write_delay = CacheConfig::default().write_delay;
    assert_eq!(cache.drop_replayed(), 1);
    store.clear();
    tokio::time::sleep(write_delay * 3).await;
    assert_eq!(stored_user_7(&store).await, (None, Some(9)));
    assert_eq!(cache.unwritten(), 0);
    assert_eq!(cache.writes_in_flight(), 0);
}

/// Found in review (stop 51): the same, with the user handed in and then
/// let go of (its slot moved on) while the replayed write backed off.
/// Letting go of the user also forgot that the replayed write was in
/// flight: its retry then found itself not under way and ended, and the
/// replayed write waited in no queue until a shutdown or a release.
#[tokio::test(start_paused = true)]
async fn a_replayed_write_beside_a_user_let_go_of_while_it_backed_off_is_written() {
    use crate::cache::handoff::Chunk;

    let (store, cache, _write_behind) =
        user_7_handed_in_during_its_replayed_write(Effect::Fail).await;
    let write_delay = CacheConfig::default().write_delay;
    cache.install(Chunk::Gone(vec![7]));
    store.clear();
    tokio::time::sleep(write_delay * 3).await;
    assert_eq!(stored_user_7(&store).await, (Some(5), None));
    assert_eq!(cache.unwritten(), 0);
    assert_eq!(cache.writes_in_flight(), 0);
}

/// Found in review (stop 51): a replayed write's queue entry, popped after
/// the same user was handed in, took `QUEUED` from the user while the
/// user's own entry was still to come. The user's next change queued a
/// second entry, and a busy user went on two write schedules for good: 8
/// writes in 120 s where 4 are due.
#[tokio::test(start_paused = true)]
async fn a_busy_user_handed_in_beside_its_replayed_write_is_written_once_per_delay() {
    let store = Arc::new(FaultyStore::memory());
    let config = CacheConfig::default();
    assert_eq!(config.write_delay, Duration::from_secs(30));
    let cache = Cache::new(config, store.clone());
    replay_user_7(&cache);
    hand_in_user_7(&cache, Duration::ZERO);
    let _write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    for second in 1..=120 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        ack(&cache, 7, 11, 10 + second).await;
    }
    let writes = (store.writes().iter())
        .filter(|write| write.user_id == 7)
        .count();
    // The replayed write at once, then the user's own at 30, 61 and 92 s.
    assert_eq!(writes, 4);
    assert_eq!(stored_user_7(&store).await.0, Some(5));
}
