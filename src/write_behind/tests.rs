//! Write-behind on a paused clock: when writes happen, how they coalesce,
//! eviction, failures and shutdown; and write-through (a zero delay), where
//! write-behind only takes over the writes that failed.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::*;
use crate::cache::CacheConfig;
use crate::error::Error;
use crate::read_state::Key;
use crate::store::Store;
use crate::store::scripted::ScriptedStore;

const DELAY: Duration = Duration::from_secs(30);

fn start(store: Arc<ScriptedStore>, capacity: usize) -> (Arc<Cache>, WriteBehind) {
    start_with_delay(store, capacity, DELAY)
}

fn start_with_delay(
    store: Arc<ScriptedStore>,
    capacity: usize,
    write_delay: Duration,
) -> (Arc<Cache>, WriteBehind) {
    let cache = Cache::new(
        CacheConfig {
            capacity,
            shards: 2,
            write_delay,
            max_evicted_unwritten: 1_000,
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
            user.message_created(Key::channel(channel_id), message_id, false, now)
        })
        .await
}

async fn unread(cache: &Arc<Cache>, user_id: u64, channel_id: u64) -> u32 {
    cache
        .read(user_id, |u| {
            u.get(Key::channel(channel_id))
                .map_or(0, |s| s.unread_count)
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
    let store = Arc::new(ScriptedStore::default());
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
    let store = Arc::new(ScriptedStore::default());
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
    let total: u32 = stored.read_states.iter().map(|s| s.unread_count).sum();
    assert_eq!(total, 100);
}

#[tokio::test(start_paused = true)]
async fn a_change_during_a_write_is_written_after_it() {
    let store = Arc::new(ScriptedStore::gated());
    let (cache, _write_behind) = start(store.clone(), 1_000);
    message(&cache, 1, 1, 10).await.unwrap();
    tokio::time::sleep(DELAY + Duration::from_millis(1)).await;
    settle().await; // the write is now waiting at the gate
    message(&cache, 1, 1, 11).await.unwrap();
    store.gate.as_ref().unwrap().add_permits(10);
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
    let store = Arc::new(ScriptedStore::gated());
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
    assert_eq!(cache.stats().1.evictions_dirty, 1);

    // While its write is in flight, a request sees the latest state, and may change it.
    assert_eq!(unread(&cache, first, 1).await, 1);
    message(&cache, first, 1, 11).await.unwrap();
    store.gate.as_ref().unwrap().add_permits(100);
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
    let store = Arc::new(ScriptedStore::default());
    ScriptedStore::set(&store.fail_writes, true);
    let (cache, _write_behind) = start(store.clone(), 1_000);
    message(&cache, 1, 1, 10).await.unwrap();
    tokio::time::sleep(DELAY + Duration::from_secs(10)).await;
    settle().await;
    assert!(store.failed_writes.load(Ordering::SeqCst) >= 2, "retried");
    assert_eq!(cache.unwritten(), 1, "still dirty");
    message(&cache, 1, 1, 11).await.unwrap(); // accepted while the store is down

    ScriptedStore::set(&store.fail_writes, false);
    tokio::time::sleep(Duration::from_secs(10)).await;
    settle().await;
    assert_eq!(cache.unwritten(), 0);
    assert_eq!(store.load(1).await.unwrap().read_states[0].unread_count, 2);
}

#[tokio::test(start_paused = true)]
async fn shutdown_writes_everything() {
    let store = Arc::new(ScriptedStore::default());
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
    let store = Arc::new(ScriptedStore::default());
    ScriptedStore::set(&store.fail_writes, true);
    let (cache, write_behind) = start(store.clone(), 1_000);
    message(&cache, 1, 1, 10).await.unwrap();
    message(&cache, 2, 1, 10).await.unwrap();
    let report = write_behind.shutdown(Duration::from_secs(5)).await;
    assert_eq!(report, ShutdownReport { unwritten: 2 });
}

#[tokio::test(start_paused = true)]
async fn write_through_writes_each_change_before_answering() {
    let store = Arc::new(ScriptedStore::default());
    let (cache, _write_behind) = start_with_delay(store.clone(), 1_000, Duration::ZERO);
    for message_id in 1..=5 {
        message(&cache, 1, 1, message_id).await.unwrap();
        assert_eq!(store.writes().len(), message_id as usize, "no coalescing");
        assert_eq!(cache.unwritten(), 0, "written when answered");
    }
    let users = [2, 3, 4];
    cache
        .update_many(&users, |_, user, now| {
            user.message_created(Key::channel(1), 10, false, now)
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
    let store = Arc::new(ScriptedStore::default());
    ScriptedStore::set(&store.fail_writes, true);
    let (cache, _write_behind) = start_with_delay(store.clone(), 1_000, Duration::ZERO);
    let error = message(&cache, 1, 1, 10).await.unwrap_err();
    assert!(matches!(error, Error::WriteFailed { user_id: 1, .. }));
    assert_eq!(error.code(), tonic::Code::Unavailable);
    assert_eq!(cache.unwritten(), 1, "kept for the retry");

    ScriptedStore::set(&store.fail_writes, false);
    tokio::time::sleep(Duration::from_secs(10)).await;
    settle().await;
    assert_eq!(cache.unwritten(), 0);
    assert_eq!(store.load(1).await.unwrap().read_states[0].unread_count, 1);
}

#[tokio::test(start_paused = true)]
async fn write_through_change_of_a_dropped_request_is_still_written() {
    let store = Arc::new(ScriptedStore::gated());
    let (cache, _write_behind) = start_with_delay(store.clone(), 1_000, Duration::ZERO);
    let request = tokio::spawn({
        let cache = cache.clone();
        async move { message(&cache, 1, 1, 10).await }
    });
    settle().await; // its write is waiting at the gate
    request.abort();
    assert!(request.await.unwrap_err().is_cancelled());
    assert_eq!(cache.unwritten(), 1);

    store.gate.as_ref().unwrap().add_permits(10);
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    assert_eq!(cache.unwritten(), 0);
    assert_eq!(store.writes().len(), 1, "written by write-behind");
}
