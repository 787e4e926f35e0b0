//! Write-behind on a paused clock: when writes happen, how they coalesce,
//! eviction, failures and shutdown; and write-through (a zero delay), where
//! write-behind only takes over the writes that failed.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::cache::CacheConfig;
use crate::error::Error;
use crate::read_state::Key;
use crate::read_state::NoChannels;
use crate::store::Store;
use crate::store::faulty::{Effect, Fault, FaultyStore, Operation};

const DELAY: Duration = Duration::from_secs(30);

fn start(store: Arc<FaultyStore>, capacity: usize) -> (Arc<Cache>, WriteBehind) {
    start_with_delay(store, capacity, DELAY)
}

fn start_with_delay(
    store: Arc<FaultyStore>,
    capacity: usize,
    write_delay: Duration,
) -> (Arc<Cache>, WriteBehind) {
    let cache = Cache::new(
        CacheConfig {
            capacity,
            shards: 2,
            write_delay,
            max_evicted_unwritten: 1_000,
            write_concurrency: 32,
            ..CacheConfig::default()
        },
        store,
    );
    let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    (cache, write_behind)
}

async fn message(
    cache: &Arc<Cache>,
    user_id: u64,
    channel_id: u64,
    message_id: u64,
) -> Result<bool, Error> {
    cache
        .update(user_id, |user, now| {
            user.message_created(
                Key::channel(channel_id),
                message_id,
                false,
                now,
                &NoChannels,
            )
        })
        .await
}

async fn unread(cache: &Arc<Cache>, user_id: u64, channel_id: u64) -> u32 {
    cache
        .read(user_id, |u| {
            u.get(Key::channel(channel_id))
                .map_or(0, |s| u32::from(s.unread_count))
        })
        .await
        .unwrap()
}

/// Lets spawned tasks run without moving the paused clock.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn nothing_is_written_before_the_delay() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, _write_behind) = start(store.clone(), 1_000);
    message(&cache, 1, 1, 10).await.unwrap();
    tokio::time::sleep(DELAY - Duration::from_millis(1)).await;
    settle().await;
    assert!(store.writes().is_empty());
    assert_eq!(cache.unwritten(), 1);
    tokio::time::sleep(Duration::from_millis(2)).await;
    settle().await;
    assert_eq!(store.writes().len(), 1);
    assert_eq!(cache.unwritten(), 0);
}

#[tokio::test(start_paused = true)]
async fn changes_within_the_window_coalesce_into_one_write() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, _write_behind) = start(store.clone(), 1_000);
    for message_id in 1..=100 {
        message(&cache, 1, message_id % 3 + 1, message_id)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(DELAY).await;
    settle().await;
    let writes = store.writes();
    assert_eq!(writes.len(), 1, "one write for 100 changes");
    assert_eq!(
        writes[0].read_states.len(),
        3,
        "one row per changed read state"
    );
    let stored = store.load(1).await.unwrap();
    let total: u32 = stored
        .read_states
        .iter()
        .map(|s| u32::from(s.unread_count))
        .sum();
    assert_eq!(total, 100);
}

#[tokio::test(start_paused = true)]
async fn a_change_during_a_write_is_written_after_it() {
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, Effect::Hang));
    let (cache, _write_behind) = start(store.clone(), 1_000);
    message(&cache, 1, 1, 10).await.unwrap();
    tokio::time::sleep(DELAY + Duration::from_millis(1)).await;
    settle().await; // the write is now waiting at the gate
    message(&cache, 1, 1, 11).await.unwrap();
    store.clear();
    settle().await;
    assert_eq!(store.writes().len(), 1);
    assert_eq!(cache.unwritten(), 1, "the later change is still unwritten");
    tokio::time::sleep(DELAY).await;
    settle().await;
    assert_eq!(store.writes().len(), 2);
    assert_eq!(cache.unwritten(), 0);
    assert_eq!(store.load(1).await.unwrap().read_states[0].unread_count, 2);
}

#[tokio::test(start_paused = true)]
async fn eviction_writes_at_once_and_the_user_stays_readable_meanwhile() {
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, Effect::Hang));
    let (cache, _write_behind) = start(store.clone(), 2); // one read state per shard
    // Find two users in the same shard so that the second evicts the first.
    let first = 1;
    let second = (2..)
        .find(|&u| cache.shard_of(u) == cache.shard_of(first))
        .unwrap();
    message(&cache, first, 1, 10).await.unwrap();
    message(&cache, first, 2, 10).await.unwrap();
    message(&cache, second, 1, 10).await.unwrap();
    settle().await; // the eviction write of `first` is at the gate, well before the delay
    assert_eq!(cache.stats().1.evictions_unwritten, 1);

    // While its write is in flight, a request sees the latest state, and may change it.
    assert_eq!(unread(&cache, first, 1).await, 1);
    message(&cache, first, 1, 11).await.unwrap();
    store.clear();
    settle().await;
    let writes = store.writes();
    assert!(
        writes.iter().any(|w| w.user_id == first),
        "written before the delay"
    );
    tokio::time::sleep(DELAY * 2).await;
    settle().await;
    assert_eq!(cache.unwritten(), 0);
    let stored = store.load(first).await.unwrap();
    let unread_one = stored
        .read_states
        .iter()
        .find(|s| s.channel_id == 1)
        .unwrap()
        .unread_count;
    assert_eq!(
        unread_one, 2,
        "the change made during the eviction write reached the store"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failing_store_keeps_changes_until_it_recovers() {
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, Effect::Fail));
    let (cache, _write_behind) = start(store.clone(), 1_000);
    message(&cache, 1, 1, 10).await.unwrap();
    tokio::time::sleep(DELAY + Duration::from_secs(10)).await;
    settle().await;
    assert!(store.failed_writes() >= 2, "retried");
    assert_eq!(cache.unwritten(), 1, "still unwritten");
    message(&cache, 1, 1, 11).await.unwrap(); // accepted while the store is down

    store.clear();
    tokio::time::sleep(Duration::from_secs(10)).await;
    settle().await;
    assert_eq!(cache.unwritten(), 0);
    assert_eq!(store.load(1).await.unwrap().read_states[0].unread_count, 2);
}

#[tokio::test(start_paused = true)]
async fn shutdown_writes_everything() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, write_behind) = start(store.clone(), 4);
    for user_id in 1..=20 {
        message(&cache, user_id, 1, 10).await.unwrap();
    }
    let report = write_behind.shutdown(Duration::from_secs(5)).await;
    assert_eq!(report, ShutdownReport { unwritten: 0 });
    for user_id in 1..=20 {
        assert_eq!(
            store.load(user_id).await.unwrap().read_states.len(),
            1,
            "user {user_id}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn shutdown_gives_up_at_its_deadline_and_says_how_much_is_lost() {
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, Effect::Fail));
    let (cache, write_behind) = start(store.clone(), 1_000);
    message(&cache, 1, 1, 10).await.unwrap();
    message(&cache, 2, 1, 10).await.unwrap();
    let report = write_behind.shutdown(Duration::from_secs(5)).await;
    assert_eq!(report, ShutdownReport { unwritten: 2 });
}

#[tokio::test(start_paused = true)]
async fn write_through_writes_each_change_before_answering() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, _write_behind) = start_with_delay(store.clone(), 1_000, Duration::ZERO);
    for message_id in 1..=5 {
        message(&cache, 1, 1, message_id).await.unwrap();
        assert_eq!(store.writes().len(), message_id as usize, "no coalescing");
        assert_eq!(cache.unwritten(), 0, "written when answered");
    }
    let users = [2, 3, 4];
    cache
        .update_many(&users, |_, user, now| {
            user.message_created(Key::channel(1), 10, false, now, &NoChannels)
        })
        .await
        .unwrap();
    assert_eq!(store.writes().len(), 8, "one write per changed user");
    let ack = |message_id| {
        cache.update(1, move |user, now| {
            user.ack(Key::channel(1), message_id, now).is_some()
        })
    };
    assert!(ack(5).await.unwrap());
    assert_eq!(store.writes().len(), 9);
    assert!(!ack(1).await.unwrap(), "acks never go backwards");
    assert_eq!(store.writes().len(), 9, "no change, no write");

    // The fallback queue entries find nothing left to write.
    tokio::time::sleep(Duration::from_secs(5)).await;
    settle().await;
    assert_eq!(store.writes().len(), 9);
    assert_eq!(store.load(1).await.unwrap().read_states[0].last_acked_id, 5);
}

#[tokio::test(start_paused = true)]
async fn write_through_fails_unavailable_and_write_behind_retries_the_change() {
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, Effect::Fail));
    let (cache, _write_behind) = start_with_delay(store.clone(), 1_000, Duration::ZERO);
    let error = message(&cache, 1, 1, 10).await.unwrap_err();
    assert!(matches!(error, Error::WriteFailed { user_id: 1, .. }));
    assert_eq!(error.code(), tonic::Code::Unavailable);
    assert_eq!(cache.unwritten(), 1, "kept for the retry");

    store.clear();
    tokio::time::sleep(Duration::from_secs(10)).await;
    settle().await;
    assert_eq!(cache.unwritten(), 0);
    assert_eq!(store.load(1).await.unwrap().read_states[0].unread_count, 1);
}

#[tokio::test(start_paused = true)]
async fn write_through_change_of_a_dropped_request_is_still_written() {
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, Effect::Hang));
    let (cache, _write_behind) = start_with_delay(store.clone(), 1_000, Duration::ZERO);
    let request = tokio::spawn({
        let cache = cache.clone();
        async move { message(&cache, 1, 1, 10).await }
    });
    settle().await; // its write is waiting at the gate
    request.abort();
    assert!(request.await.unwrap_err().is_cancelled());
    assert_eq!(cache.unwritten(), 1);

    store.clear();
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    assert_eq!(cache.unwritten(), 0);
    assert_eq!(store.writes().len(), 1, "written by write-behind");
}

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

/// A cache on one shard with its own write concurrency, and write-behind.
fn start_one_shard(
    store: Arc<FaultyStore>,
    capacity: usize,
    write_delay: Duration,
    write_concurrency: usize,
) -> (Arc<Cache>, WriteBehind) {
    let cache = Cache::new(
        CacheConfig {
            capacity,
            shards: 1,
            write_delay,
            max_evicted_unwritten: 1_000,
            write_concurrency,
            ..CacheConfig::default()
        },
        store,
    );
    let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    (cache, write_behind)
}

/// On a one-shard cache of capacity 2: user 1 changes two read states (due
/// at `DELAY`), and `wait` later user 2 changes one, which evicts user 1:
/// written at once, the store's first write.
async fn user_1_evicted_by_user_2_after(cache: &Arc<Cache>, store: &FaultyStore, wait: Duration) {
    message(cache, 1, 1, 10).await.unwrap();
    message(cache, 1, 2, 10).await.unwrap();
    tokio::time::sleep(wait).await;
    message(cache, 2, 1, 10).await.unwrap();
    settle().await;
    assert_eq!(store.writes().len(), 1);
}

/// Case 1 of "Lossless at every transition": the drain skipped users with a
/// write under way, and what changed during that write was never written.
#[tokio::test(start_paused = true)]
async fn shutdown_writes_a_change_made_while_its_user_was_being_written() {
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, Effect::Hang));
    let (cache, write_behind) = start(store.clone(), 1_000);
    message(&cache, 1, 1, 10).await.unwrap();
    tokio::time::sleep(DELAY + ms(1)).await;
    settle().await; // the first change's write hangs
    message(&cache, 1, 1, 11).await.unwrap();
    let shutdown = tokio::spawn(write_behind.shutdown(Duration::from_secs(20)));
    settle().await;
    store.clear();
    let report = shutdown.await.unwrap();
    assert_eq!(report, ShutdownReport { unwritten: 0 });
    assert_eq!(store.load(1).await.unwrap().read_states[0].unread_count, 2);
}

/// Case 2: a "delete all" waiting for a failing store was reported written.
#[tokio::test(start_paused = true)]
async fn shutdown_counts_a_pending_delete_all_as_unwritten() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, write_behind) = start(store.clone(), 1_000);
    message(&cache, 1, 1, 10).await.unwrap();
    message(&cache, 1, 2, 10).await.unwrap();
    tokio::time::sleep(DELAY * 2).await;
    settle().await;
    assert_eq!(store.load(1).await.unwrap().read_states.len(), 2);
    store.inject(Fault::new(Operation::Write, Effect::Fail));
    let deleted = cache.update(1, |user, now| user.delete_all(now)).await;
    assert_eq!(deleted, Ok(2));
    assert_eq!(cache.unwritten(), 1, "the wipe is unwritten");
    let report = write_behind.shutdown(Duration::from_secs(5)).await;
    assert_eq!(report, ShutdownReport { unwritten: 1 });
}

/// Case 5: a fallback write that found its user already written by
/// write-through kept the user marked in flight, so nothing wrote it again.
#[tokio::test(start_paused = true)]
async fn write_through_fallback_that_finds_its_user_written_lets_go_of_it() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, write_behind) = start_with_delay(store.clone(), 1_000, Duration::ZERO);
    store.inject(Fault::new(Operation::Write, Effect::Fail).user(1).times(2));
    assert!(
        message(&cache, 1, 1, 10).await.is_err(),
        "its own write fails"
    );
    tokio::time::sleep(Duration::from_secs(1) + ms(10)).await;
    settle().await;
    assert_eq!(
        store.failed_writes(),
        2,
        "the fallback failed too, backing off"
    );
    message(&cache, 1, 1, 11).await.unwrap(); // written by the request itself
    tokio::time::sleep(Duration::from_secs(1)).await;
    settle().await; // the fallback's retry finds nothing left to write

    store.inject(Fault::new(Operation::Write, Effect::Fail).user(1).times(1));
    assert!(message(&cache, 1, 1, 12).await.is_err());
    tokio::time::sleep(Duration::from_secs(5)).await;
    settle().await;
    assert_eq!(cache.unwritten(), 0, "the fallback wrote the last change");
    assert_eq!(store.load(1).await.unwrap().read_states[0].unread_count, 3);
    let report = write_behind.shutdown(Duration::from_secs(5)).await;
    assert_eq!(report, ShutdownReport { unwritten: 0 });
}

/// Case 7: a failing write held its write permit through every backoff, so
/// a few failing users stopped every healthy user's writes.
#[tokio::test(start_paused = true)]
async fn users_whose_writes_keep_failing_do_not_hold_up_the_others() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, _write_behind) = start_one_shard(store.clone(), 1_000, DELAY, 2);
    store.inject(Fault::new(Operation::Write, Effect::Fail).user(1));
    store.inject(Fault::new(Operation::Write, Effect::Fail).user(2));
    message(&cache, 1, 1, 10).await.unwrap();
    message(&cache, 2, 1, 10).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    message(&cache, 3, 1, 10).await.unwrap();
    tokio::time::sleep(DELAY + Duration::from_secs(5)).await;
    settle().await;
    assert_eq!(store.load(3).await.unwrap().read_states.len(), 1);
    assert_eq!(cache.unwritten(), 2, "only the failing users wait");
}

/// Case 6: once shutdown begins, a change is refused before it is applied,
/// so none can land after the final drain looked at its shard.
#[tokio::test(start_paused = true)]
async fn changes_after_shutdown_began_are_refused_unapplied() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, write_behind) = start(store.clone(), 1_000);
    message(&cache, 1, 1, 10).await.unwrap();
    let report = write_behind.shutdown(Duration::from_secs(5)).await;
    assert_eq!(report, ShutdownReport { unwritten: 0 });
    let refused = message(&cache, 1, 1, 11).await.unwrap_err();
    assert_eq!(refused, Error::ShuttingDown);
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    let many = cache
        .update_many(&[1, 2], |_, user, now| {
            user.message_created(Key::channel(1), 12, false, now, &NoChannels)
        })
        .await;
    assert_eq!(many, Err(Error::ShuttingDown));
    assert_eq!(unread(&cache, 1, 1).await, 1, "reads still answer");
    assert_eq!(cache.unwritten(), 0, "nothing applied");
}

/// Case 9: an evicted user found by a read went back into the LRU and
/// evicted another unwritten user, whose write then waited for its delay
/// because nobody woke the writer.
#[tokio::test(start_paused = true)]
async fn a_read_that_evicts_an_unwritten_user_wakes_the_writer() {
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, Effect::Hang));
    let (cache, _write_behind) = start_one_shard(store.clone(), 2, DELAY, 32);
    message(&cache, 1, 1, 10).await.unwrap();
    message(&cache, 1, 2, 10).await.unwrap();
    message(&cache, 2, 1, 10).await.unwrap(); // evicts user 1: its write hangs
    settle().await;
    let read = cache.read_many(&[1], |u| u.len()).await.unwrap();
    assert_eq!(read, [2]);
    store.clear();
    tokio::time::sleep(Duration::from_secs(1)).await;
    settle().await;
    let written: Vec<u64> = store.writes().iter().map(|w| w.user_id).collect();
    assert!(
        written.contains(&2),
        "user 2 written on eviction: {written:?}"
    );
}

/// Case 9: write-through sent every user's write of a request at once.
#[tokio::test(start_paused = true)]
async fn write_through_writes_at_most_the_write_concurrency_at_once() {
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, Effect::Delay(ms(10))));
    let (cache, _write_behind) = start_one_shard(store.clone(), 1_000, Duration::ZERO, 4);
    // Two requests at once: the bound is the node's, not each request's.
    let request = |first: u64| {
        let users: Vec<u64> = (first..first + 100).collect();
        let cache = cache.clone();
        async move {
            cache
                .update_many(&users, |_, user, now| {
                    user.message_created(Key::channel(1), 10, false, now, &NoChannels)
                })
                .await
        }
    };
    let (a, b) = tokio::join!(request(1), request(1_001));
    assert!(a.is_ok() && b.is_ok());
    assert_eq!(store.writes().len(), 200);
    assert_eq!(store.most_writes_under_way(), 4);
}

/// Case 9: the oldest-unwritten-change gauge looked only at the front of
/// the delay queue, which may hold a user written since (on eviction).
#[tokio::test(start_paused = true)]
async fn the_oldest_unwritten_change_is_found_behind_users_written_since() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, _write_behind) = start_one_shard(store.clone(), 2, DELAY, 32);
    user_1_evicted_by_user_2_after(&cache, &store, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let oldest = cache
        .stats()
        .0
        .oldest_unwritten
        .expect("user 2 is unwritten");
    // User 2's 3 seconds, kept in 4-second ticks (rounded up by at most
    // two), not user 1's 23.
    let age = Instant::now() - oldest;
    assert!(
        (Duration::from_secs(3)..Duration::from_secs(11)).contains(&age),
        "{age:?}"
    );
}

/// The delay queue names users by slab position (8 bytes an entry). A
/// position whose user is forgotten is not reused while an entry may name
/// it: the entry, when due, finds that user's id there and writes nobody
/// else.
#[tokio::test(start_paused = true)]
async fn a_queue_entry_outliving_its_user_writes_nobody_else() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, _write_behind) = start_one_shard(store.clone(), 2, DELAY, 32);
    user_1_evicted_by_user_2_after(&cache, &store, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    message(&cache, 3, 1, 10).await.unwrap(); // due at 55 s
    tokio::time::sleep(Duration::from_secs(5) + ms(1)).await;
    settle().await;
    let written =
        |store: &FaultyStore| -> Vec<u64> { store.writes().iter().map(|w| w.user_id).collect() };
    assert_eq!(
        written(&store),
        [1],
        "user 1's entry, at 30 s, wrote nobody"
    );
    tokio::time::sleep(Duration::from_secs(25)).await;
    settle().await;
    assert_eq!(written(&store), [1, 2, 3]);
    assert_eq!(cache.unwritten(), 0);
    for (user_id, channel_id) in [(1, 1), (1, 2), (2, 1), (3, 1)] {
        let stored = store.load(user_id).await.unwrap();
        let state = (stored.read_states.iter())
            .find(|s| s.channel_id == channel_id)
            .expect("written");
        assert_eq!(
            state.unread_count, 1,
            "user {user_id}, channel {channel_id}"
        );
    }
}

/// Found in review of the 8-byte queue entry: a position was reused while
/// an entry of its forgotten user still named it. The entry then wrote the
/// next user early and cleared its `QUEUED`, so that a user changing all
/// the time went on two write schedules, written twice per delay.
#[tokio::test(start_paused = true)]
async fn a_busy_user_in_a_forgotten_users_place_is_written_once_per_delay() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, _write_behind) = start_one_shard(store.clone(), 2, DELAY, 32);
    user_1_evicted_by_user_2_after(&cache, &store, Duration::from_secs(5)).await;
    message(&cache, 3, 1, 10).await.unwrap(); // due at 35 s
    for message_id in 11..126 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        message(&cache, 3, 1, message_id).await.unwrap();
    }
    settle().await;
    // Its first change at 5 s, then a change every second until 120 s:
    // written at 35, 66 and 97 s.
    let writes = store.writes().iter().filter(|w| w.user_id == 3).count();
    assert_eq!(writes, 3);
}

/// Found by the simulation (`tests/simulation.rs`): a user written by
/// write-through while in the eviction buffer was dropped from it although a
/// write-behind write of it was backing off; that write then ended without
/// letting go of the user, and shutdown waited for it until its deadline.
#[tokio::test(start_paused = true)]
async fn a_user_left_in_the_eviction_buffer_while_written_is_let_go() {
    let store = Arc::new(FaultyStore::memory());
    let (cache, write_behind) = start_one_shard(store.clone(), 1, Duration::ZERO, 32);
    store.inject(Fault::new(Operation::Write, Effect::Fail).user(1).times(2));
    assert!(
        message(&cache, 1, 1, 10).await.is_err(),
        "its own write fails"
    );
    tokio::time::sleep(Duration::from_secs(1) + ms(10)).await;
    settle().await; // the fallback write failed too and backs off
    store.inject(Fault::new(Operation::Write, Effect::Delay(ms(50))).user(1));
    let request = tokio::spawn({
        let cache = cache.clone();
        async move { message(&cache, 1, 1, 11).await }
    });
    settle().await; // applied; its write is under way
    message(&cache, 2, 1, 10).await.unwrap(); // evicts user 1
    request.await.unwrap().unwrap(); // user 1 written while evicted
    tokio::time::sleep(Duration::from_secs(1)).await;
    settle().await; // the fallback's retry finds nothing left to write
    assert_eq!(cache.writes_in_flight(), 0);
    let report = tokio::time::timeout(
        Duration::from_secs(10),
        write_behind.shutdown(Duration::from_secs(600)),
    )
    .await
    .expect("shutdown waits for no stuck write");
    assert_eq!(report, ShutdownReport { unwritten: 0 });
    assert_eq!(store.load(1).await.unwrap().read_states[0].unread_count, 2);
}
