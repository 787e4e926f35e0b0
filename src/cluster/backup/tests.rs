//! The sender and the backup together, under random changes, writes that
//! fail, journal trims, streams that break and attach again after a while,
//! lease renewals that record the name the sender asks for late, and the
//! node lost at a random moment (a stream open, or broken): if its lease
//! record then names the backup's stream, every change answered is in the
//! store or in that copy (what its takeover writes); if not (it names no
//! backup, or a stream gone), in the store or the node's own journal (what
//! a restart in place replays). Seeded: `BACKUP_SEEDS=N` runs N seeds
//! (default 12), `BACKUP_SEED=S` replays one; a failing seed prints itself.
//!
//! On a paused clock (write delays of seconds cost nothing); the journal's
//! writer is a thread and syncs for real, so a seed fixes the operations
//! and their timing, not every interleaving.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::held::Backups;
use super::mirror::Mirror;
use crate::cache::{Cache, CacheConfig};
use crate::cluster::lease::{BackupName, incarnation};
use crate::cluster::ring_store::NO_BACKUP;
use crate::journal::disk::Fs;
use crate::journal::{Journal, JournalConfig, JournalMode, Trimmer};
use crate::proto::MirrorRequest;
use crate::proto::mirror_request::Part;
use crate::read_state::Key;
use crate::store::faulty::{Effect, Fault, FaultyStore, Operation};
use crate::store::memory::MemoryStore;
use crate::store::{Store, UserWrite};
use crate::write_behind::{WriteBehind, WriteBehindConfig};

const USERS_PER_CLIENT: u64 = 100;
const CLIENTS: u64 = 4;
const CHANNELS: u64 = 3;

/// Acks answered OK: (user, channel) -> the highest message id.
type Answered = Arc<Mutex<HashMap<(u64, u64), u64>>>;

#[tokio::test(start_paused = true)]
async fn a_complete_backup_and_the_store_hold_every_change_answered() {
    let seeds: Vec<u64> = match std::env::var("BACKUP_SEED") {
        Ok(seed) => vec![seed.parse().expect("BACKUP_SEED")],
        Err(_) => {
            let count =
                std::env::var("BACKUP_SEEDS").map_or(12, |n| n.parse().expect("BACKUP_SEEDS"));
            (0..count).collect()
        }
    };
    let (mut taken_over, mut restarted, mut answered, mut trims) = (0, 0, 0, 0);
    for seed in seeds {
        let outcome = tokio::spawn(one_seed(seed)).await;
        match outcome {
            Ok(seen) => {
                if seen.taken_over {
                    taken_over += 1;
                } else {
                    restarted += 1;
                }
                answered += seen.answered;
                trims += seen.trims;
            }
            Err(e) => {
                eprintln!("backup seed {seed} failed; replay with BACKUP_SEED={seed}");
                std::panic::resume_unwind(e.into_panic());
            }
        }
    }
    eprintln!(
        "{taken_over} seeds taken over by their backup, {restarted} restarted in place, \
         {answered} acks answered and checked, {trims} trims taken"
    );
    assert!(taken_over > 0, "no seed ended with its backup named");
    assert!(trims > 0, "nothing was trimmed");
    assert!(answered > 100, "{answered} changes answered");
}

/// What one seed saw.
struct Seen {
    /// Its lease named the backup's stream when it was lost.
    taken_over: bool,
    answered: usize,
    trims: usize,
}

/// One seed, checked.
async fn one_seed(seed: u64) -> Seen {
    let mut rng = fastrand::Rng::with_seed(seed);
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    let config = JournalConfig {
        seal_after: Duration::from_millis(rng.u64(10..100)),
        ..JournalConfig::new(dir.path().to_owned(), JournalMode::Sync)
    };
    let (journal, _) = Journal::open(config.clone(), Arc::new(Fs)).expect("journal");
    let journal = Arc::new(journal);
    let memory = Arc::new(MemoryStore::new());
    let store = Arc::new(FaultyStore::new(memory.clone(), seed));
    store.inject(Fault::new(Operation::Write, Effect::Fail).chance(rng.f64() * 0.3));
    let cache = Cache::new(
        CacheConfig {
            capacity: rng.usize(4..40),
            shards: 2,
            write_delay: Duration::from_millis(rng.u64(200..3_000)),
            ..CacheConfig::default()
        },
        store,
    );
    cache.set_journal(journal.clone());
    let name = BackupName::new();
    let mirror = Mirror::new(journal.clone(), name.clone(), incarnation());
    let backups = Backups::new();
    let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    let stop = CancellationToken::new();
    let trimmer = tokio::spawn({
        let (journal, cache, stop) = (journal.clone(), cache.clone(), stop.clone());
        async move {
            let mut trimmer = Trimmer::new(journal);
            while !stop.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(10)).await;
                trimmer.trim(|| cache.oldest_unwritten());
            }
        }
    });
    let lost = CancellationToken::new();
    let record = Arc::new(Mutex::new(String::new()));
    let holder = tokio::spawn(holder(
        mirror.clone(),
        name,
        record.clone(),
        seed,
        lost.clone(),
    ));
    let trims = Arc::new(AtomicUsize::new(0));
    let link = tokio::spawn(link(
        Link {
            mirror: mirror.clone(),
            cache: cache.clone(),
            backups: backups.clone(),
            trims: trims.clone(),
        },
        seed,
        lost.clone(),
    ));
    let answered: Answered = Arc::default();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (cache, answered) = (cache.clone(), answered.clone());
            let mut rng = fastrand::Rng::with_seed(seed * 31 + client);
            tokio::spawn(async move {
                let mut next = HashMap::new();
                loop {
                    let user = 1 + client * 1_000 + rng.u64(..USERS_PER_CLIENT);
                    let channel = rng.u64(1..=CHANNELS);
                    let id = next.entry((user, channel)).or_insert(0u64);
                    *id += 1;
                    let message_id = *id;
                    let key = Key::channel(channel);
                    let acked = cache
                        .update(user, |states, now| states.ack(key, message_id, now))
                        .await;
                    if acked.is_ok() {
                        let mut answered = answered.lock().unwrap();
                        let held = answered.entry((user, channel)).or_default();
                        *held = (*held).max(message_id);
                    }
                    if rng.u32(..4) == 0 {
                        tokio::time::sleep(Duration::from_millis(rng.u64(..3))).await;
                    }
                }
            })
        })
        .collect();
    // Long enough for segments to be trimmed (the cache tells unwritten
    // changes' age in 4 s steps), on the paused clock.
    tokio::time::sleep(Duration::from_millis(rng.u64(2_000..12_000))).await;
    // A third of the time, lost just after a trim (what a wrong trim drops
    // is then still unwritten); a third, just after the lease came to name
    // a stream (what was answered before, on the journal alone, must be in
    // its copy by then).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    match rng.u32(..3) {
        0 => {
            let seen = trims.load(Ordering::SeqCst);
            while trims.load(Ordering::SeqCst) == seen && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(rng.u64(..300))).await;
        }
        1 => {
            let named = || {
                let record = record.lock().unwrap();
                !record.is_empty() && *record != NO_BACKUP
            };
            while named() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            while !named() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_micros(100)).await;
            }
        }
        _ => {}
    }

    // Lost: the backup takes in nothing more; what the store was sent
    // lands or fails; nothing more is answered (no backup answers).
    lost.cancel();
    let (stream, token) = link.await.unwrap();
    holder.await.unwrap();
    let record = record.lock().unwrap().clone();
    let trims = trims.load(Ordering::SeqCst);
    let answered = std::mem::take(&mut *answered.lock().unwrap());
    for client in clients {
        client.abort();
    }
    stop.cancel();
    let _ = trimmer.await;
    write_behind.crash().await;

    // Taken over by the copy the lease names (the takeover checks the
    // name, and a stream is named only once complete); otherwise the node
    // restarts in place and replays its journal.
    let taken_over = record == token;
    let held: Vec<UserWrite> = if taken_over {
        let complete = backups.held_for("n1").is_some_and(|(_, _, c)| c);
        assert!(complete, "seed {seed}: the lease names an incomplete copy");
        backups.take("n1", stream).expect("held").users
    } else {
        journal.close(false);
        let (_, replayed) = Journal::open(config, Arc::new(Fs)).expect("journal replays");
        replayed.users.into_values().collect()
    };
    let by = if taken_over { "backup" } else { "journal" };
    for (&(user, channel), &message_id) in &answered {
        let stored = memory.load(user).await.unwrap();
        let stored = (stored.read_states.iter())
            .find(|s| s.channel_id == channel)
            .map_or(0, |s| s.last_acked_id);
        let kept = acked(&held, user, channel);
        assert!(
            stored.max(kept) >= message_id,
            "seed {seed}: user {user}'s ack of channel {channel} to {message_id} answered, \
             but the store has {stored} and the {by} {kept} (the lease named {record:?})"
        );
    }
    journal.close(false);
    Seen {
        taken_over,
        answered: answered.len(),
        trims,
    }
}

fn acked(users: &[UserWrite], user_id: u64, channel_id: u64) -> u64 {
    let user = users.iter().find(|w| w.user_id == user_id);
    let state = user.and_then(|u| u.read_states.iter().find(|s| s.channel_id == channel_id));
    state.map_or(0, |s| s.last_acked_id)
}

struct Link {
    mirror: Arc<Mirror>,
    cache: Arc<Cache>,
    backups: Arc<Backups>,
    trims: Arc<AtomicUsize>,
}

/// The lease holder: records what the sender asks for with a renewal that
/// takes a while (now and then long: the store slow), in `record` the
/// instant it applies; the sender hears of it a moment later (the node may
/// be lost in between).
async fn holder(
    mirror: Arc<Mirror>,
    name: Arc<BackupName>,
    record: Arc<Mutex<String>>,
    seed: u64,
    lost: CancellationToken,
) {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x1ea5e);
    let mut wanted = name.wanted();
    loop {
        let (want, request) = wanted.borrow_and_update().clone();
        if *record.lock().unwrap() != want {
            let renewal = match rng.u32(..10) {
                0 => Duration::from_millis(rng.u64(100..1_000)),
                _ => Duration::from_millis(rng.u64(..20)),
            };
            tokio::select! {
                () = tokio::time::sleep(renewal) => {}
                () = lost.cancelled() => return,
            }
            *record.lock().unwrap() = want.clone();
            // Now and then its answer is lost: the holder learns of it at
            // a later renewal.
            let told = match rng.u32(..5) {
                0 => Duration::from_millis(rng.u64(200..1_500)),
                _ => Duration::from_millis(rng.u64(..3)),
            };
            tokio::select! {
                () = tokio::time::sleep(told) => {}
                () = lost.cancelled() => return,
            }
            mirror.recorded((want, request));
        }
        tokio::select! {
            _ = wanted.changed() => {}
            () = tokio::time::sleep(Duration::from_millis(750)) => {}
            () = lost.cancelled() => return,
        }
    }
}

/// The network between the node and its backup: delivers each stream's
/// queue with random delays, and now and then breaks it (the sender gives
/// the backup up, then attaches again). Returns the last stream's number
/// and token once the node is `lost` (counting the trims it delivers).
async fn link(link: Link, seed: u64, lost: CancellationToken) -> (u64, String) {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
    for count in 0.. {
        let token = format!("b/{count}");
        let stream = link.backups.open("n1", "i1", &token);
        let (outbox, mut queue) = super::mirror::queue();
        (link.mirror.attach(&link.cache, &token, outbox)).expect("attach");
        let until = tokio::time::Instant::now() + Duration::from_millis(rng.u64(20..400));
        loop {
            let message = tokio::select! {
                message = queue.recv() => message,
                () = tokio::time::sleep_until(until) => break,
                () = lost.cancelled() => return (stream, token),
            };
            let Some(MirrorRequest { part: Some(part) }) = message else {
                break;
            };
            if rng.u32(..8) == 0 {
                tokio::time::sleep(Duration::from_millis(rng.u64(..5))).await;
            }
            if lost.is_cancelled() {
                return (stream, token);
            }
            let backups = &link.backups;
            match part {
                Part::Batch(batch) => {
                    let held = (backups.batch("n1", stream, batch.frames, batch.end))
                        .expect("frames read");
                    link.mirror.acked(held);
                }
                Part::Trimmed(through) => {
                    link.trims.fetch_add(1, Ordering::SeqCst);
                    backups.trimmed("n1", stream, through)
                }
                Part::CompleteAt(at) => backups.complete_at("n1", stream, at),
                Part::Start(_) => {}
            }
        }
        // Broken: the backup keeps its copy, and the node may be lost
        // before the next stream (what it answered meanwhile must be in
        // that copy or the store).
        link.mirror.detach();
        link.backups.broke("n1", stream);
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(rng.u64(..200))) => {}
            () = lost.cancelled() => return (stream, token),
        }
    }
    unreachable!("streams until lost")
}

/// A batch far larger than a message (everything journaled again on
/// attaching, or a group commit after a stall) goes in messages of whole
/// frames, each saying where the journal ended after it.
#[tokio::test]
async fn a_large_batch_goes_in_messages_of_whole_frames() {
    let dir = tempfile::tempdir().unwrap();
    let config = JournalConfig::new(dir.path().to_owned(), JournalMode::Sync);
    let (journal, _) = Journal::open(config, Arc::new(Fs)).expect("journal");
    let journal = Arc::new(journal);
    let mirror = Mirror::new(journal.clone(), BackupName::new(), incarnation());
    let cache = Cache::new(CacheConfig::default(), Arc::new(MemoryStore::new()));
    let (outbox, mut queue) = super::mirror::queue();
    mirror.attach(&cache, "t", outbox).expect("attach");
    let mut frames = Vec::new();
    let mut user = crate::read_state::UserReadStates::default();
    for channel in 0..4_000 {
        user.ack(Key::channel(channel), 1, channel + 1);
    }
    for user_id in 0..30 {
        crate::journal::record::frame(&mut frames, |out| {
            crate::journal::record::append_user(out, user_id, 0, user.view());
        });
    }
    assert!(frames.len() > 3 << 20, "{} bytes", frames.len());
    let end = 10_000_000;
    crate::journal::Replica::batch(&*mirror, &frames, end);
    let backups = Backups::new();
    let stream = backups.open("n1", "i1", "t");
    let mut last = 0;
    while let Ok(MirrorRequest { part: Some(part) }) = queue.try_recv() {
        if let Part::Batch(batch) = part {
            assert!(
                batch.frames.len() <= 2 << 20,
                "{} bytes",
                batch.frames.len()
            );
            assert!(batch.end > last);
            last = batch.end;
            backups
                .batch("n1", stream, batch.frames, batch.end)
                .expect("whole frames");
        }
    }
    assert_eq!(last, end);
    journal.close(false);
}
