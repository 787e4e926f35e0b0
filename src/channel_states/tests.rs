//! Write-behind of channel states, rule by rule on a paused clock, and a
//! seeded randomized run against the simplest model there is: what the node
//! holds must reach the store, whatever the store does meanwhile.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::*;
use crate::store::faulty::{Effect, Fault, FaultyStore, Operation};
use crate::store::memory::MemoryStore;

const DELAY: Duration = Duration::from_secs(30);

async fn start(store: &Arc<FaultyStore>) -> (Arc<ChannelStates>, CancellationToken) {
    let channels = ChannelStates::load(store.clone(), DELAY).await.unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(channels.clone().run(stop.clone()));
    (channels, stop)
}

/// Versions rise by one per change here: the clock passed in is 0.
fn message(channels: &ChannelStates, channel_id: u64, message_id: u64) {
    channels.update(channel_id, |c| c.message_created(message_id, 0));
}

async fn stored(store: &FaultyStore) -> HashMap<u64, ChannelState> {
    let loaded = store.load_channels().await.unwrap();
    loaded.into_iter().map(|c| (c.channel_id(), c)).collect()
}

async fn settle(duration: Duration) {
    tokio::time::sleep(duration).await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_windows_changes_are_written_once_after_the_delay() {
    let store = Arc::new(FaultyStore::memory());
    let (channels, _stop) = start(&store).await;
    assert_eq!(channels.switch(7, 100, 1), Ok(true));
    for id in 101..=110 {
        message(&channels, 7, id);
        settle(Duration::from_secs(1)).await;
    }
    settle(DELAY - Duration::from_secs(11)).await;
    assert_eq!(store.channel_writes().len(), 0, "nothing before the delay");
    settle(Duration::from_secs(2)).await;
    let writes = store.channel_writes();
    assert_eq!(writes.len(), 1, "one write for the window");
    assert_eq!(writes[0].last_message_id(), 110);
    assert_eq!(channels.unwritten(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_change_while_its_channel_is_written_is_written_in_the_next_window() {
    let store = Arc::new(FaultyStore::memory());
    let (channels, _stop) = start(&store).await;
    channels.switch(7, 100, 1).unwrap();
    store.inject(Fault::new(Operation::Write, Effect::Delay(Duration::from_secs(1))).times(1));
    settle(DELAY + Duration::from_millis(500)).await;
    message(&channels, 7, 101);
    settle(Duration::from_secs(1)).await;
    assert_eq!(store.channel_writes().len(), 1);
    assert_eq!(channels.unwritten(), 1, "101 came after the snapshot");
    settle(DELAY).await;
    assert_eq!(stored(&store).await[&7].last_message_id(), 101);
    assert_eq!(channels.unwritten(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_failing_store_keeps_changes_until_it_recovers() {
    let store = Arc::new(FaultyStore::memory());
    let (channels, _stop) = start(&store).await;
    store.fail_all();
    channels.switch(7, 100, 1).unwrap();
    message(&channels, 7, 101);
    settle(DELAY * 4).await;
    assert!(store.failed_writes() > 0);
    assert_eq!(channels.unwritten(), 1);
    store.clear();
    settle(RETRY_MAX * 2).await;
    assert_eq!(channels.unwritten(), 0);
    assert_eq!(stored(&store).await[&7].last_message_id(), 101);
}

#[tokio::test(start_paused = true)]
async fn flush_writes_everything_or_says_how_much_is_left() {
    let store = Arc::new(FaultyStore::memory());
    let (channels, stop) = start(&store).await;
    for id in 1..=3 {
        channels.switch(id, 0, 1).unwrap();
    }
    stop.cancel();
    store.fail_all();
    assert_eq!(channels.flush(Duration::from_secs(2)).await, 3);
    store.clear();
    assert_eq!(channels.flush(Duration::from_secs(2)).await, 0);
    assert_eq!(stored(&store).await.len(), 3);
}

#[tokio::test]
async fn a_switch_is_retry_safe_and_never_moves() {
    let store = Arc::new(FaultyStore::memory());
    let channels = ChannelStates::load(store, DELAY).await.unwrap();
    assert_eq!(channels.switch(7, 100, 1), Ok(true));
    assert_eq!(channels.switch(7, 100, 2), Ok(false), "a retry");
    assert_eq!(
        channels.switch(7, 90, 3),
        Err(SwitchedAlready { counted_from: 100 })
    );
    assert_eq!(channels.update(8, |c| c.version()), None, "not switched");
}

#[tokio::test]
async fn what_is_stored_is_loaded() {
    let store = Arc::new(FaultyStore::memory());
    let mut channel = ChannelState::switched(7, 100, 1);
    channel.message_created(101, 2);
    store.write_channel(&channel).await.unwrap();
    let channels = ChannelStates::load(store, DELAY).await.unwrap();
    assert_eq!(channels.read(|c| c.get(&7).cloned()), Some(channel));
    assert_eq!(channels.unwritten(), 0);
}

/// A channel switched at 100 and given `messages`, with the version
/// `version` (as another node's copy of it would be).
fn copy(channel_id: u64, messages: &[u64], version: u64) -> ChannelState {
    let last = messages.last().copied().unwrap_or(100);
    ChannelState::from_stored(channel_id, 100, last, 0, messages.to_vec(), version)
}

#[tokio::test]
async fn a_copy_replaces_only_an_older_state_and_never_the_owners() {
    let store = Arc::new(FaultyStore::memory());
    let channels = ChannelStates::new(store, DELAY);
    assert_eq!(channels.copy_in(vec![copy(7, &[101], 10)], |_| false), 1);
    let older = copy(7, &[], 5);
    let same = copy(7, &[101, 102], 10);
    assert_eq!(channels.copy_in(vec![older, same], |_| false), 0);
    assert_eq!(channels.get(7).unwrap().last_message_id(), 101);
    assert_eq!(
        channels.copy_in(vec![copy(7, &[101, 102], 11)], |_| false),
        1
    );
    assert_eq!(channels.get(7).unwrap().last_message_id(), 102);
    // The owner's own state is never replaced, and copies are not written.
    assert_eq!(
        channels.copy_in(vec![copy(7, &[101, 102, 103], 12)], |_| true),
        0
    );
    assert_eq!(channels.unwritten(), 0);
    assert_eq!(channels.take_recounted(), vec![7], "members' counts moved");
}

#[tokio::test]
async fn release_writes_the_channels_let_go_and_stops_writing_them() {
    let store = Arc::new(FaultyStore::memory());
    let channels = ChannelStates::new(store.clone(), DELAY);
    for id in [7, 8] {
        channels.switch(id, 100, 1).unwrap();
        message(&channels, id, 101);
    }
    assert_eq!(channels.release(|id| id == 7).await, 1);
    let stored = stored(&store).await;
    assert_eq!(stored[&7].last_message_id(), 101);
    assert!(!stored.contains_key(&8), "not let go: written when due");
    assert_eq!(channels.unwritten(), 1);
    assert_eq!(
        channels.get(7).unwrap().last_message_id(),
        101,
        "a copy stays"
    );
}

#[tokio::test]
async fn an_acquired_channel_is_the_newest_of_store_and_copy_and_outranks_every_copy() {
    let store = Arc::new(FaultyStore::memory());
    store.write_channel(&copy(7, &[101], 10)).await.unwrap();
    store.write_channel(&copy(8, &[101], 10)).await.unwrap();
    let channels = ChannelStates::new(store.clone(), DELAY);
    channels.keep_changed();
    // Held here: an older copy of 7; a newer one of 8, of a change its
    // previous owner made and lost (released by force).
    channels.copy_in(vec![copy(7, &[], 9), copy(8, &[101, 102], 20)], |_| false);
    assert_eq!(channels.acquire(|_| true, 0).await.unwrap(), 2);
    let (seven, eight) = (channels.get(7).unwrap(), channels.get(8).unwrap());
    assert_eq!(seven.last_message_id(), 101, "the store's");
    assert_eq!(eight.last_message_id(), 102, "the newer copy");
    assert!(
        seven.version() > 10 && eight.version() > 20,
        "above every copy"
    );
    assert_eq!(channels.unwritten(), 2, "written by the new owner");
    let mut changed: Vec<u64> = (channels.take_changed().iter())
        .map(ChannelState::channel_id)
        .collect();
    changed.sort_unstable();
    assert_eq!(changed, [7, 8], "sent to the other nodes");
}

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

/// Random switches, messages and deletions over random time, while the
/// store fails or is slow at random; then the store recovers. Whatever happened, the
/// store ends holding exactly what the node holds: after a quiet spell
/// through write-behind alone, and after a flush at any moment.
#[tokio::test(start_paused = true)]
async fn what_the_node_holds_reaches_the_store_whatever_it_does_meanwhile() {
    for seed in 0..40 {
        let mut random = fastrand::Rng::with_seed(seed);
        let store = Arc::new(FaultyStore::new(Arc::new(MemoryStore::new()), seed));
        let (channels, stop) = start(&store).await;
        let mut next_id = [0u64; 4];
        for _ in 0..random.usize(20..200) {
            let channel_id = random.u64(0..4);
            let now_us = 0;
            match random.u8(0..11) {
                0 => drop(channels.switch(channel_id, next_id[channel_id as usize], now_us)),
                1..=6 => {
                    next_id[channel_id as usize] += random.u64(1..3);
                    message(&channels, channel_id, next_id[channel_id as usize]);
                }
                7 => {
                    let id = random.u64(0..=next_id[channel_id as usize]);
                    channels.update(channel_id, |c| c.message_deleted(id, now_us));
                }
                8 => store.inject(
                    Fault::new(Operation::Write, Effect::Fail)
                        .chance(random.f64())
                        .lasting(Duration::from_secs(random.u64(1..120))),
                ),
                9 => store.inject(
                    Fault::new(Operation::Write, Effect::Delay(ms(random.u64(1..5_000))))
                        .chance(random.f64())
                        .lasting(Duration::from_secs(random.u64(1..120))),
                ),
                _ => store.clear(),
            }
            settle(ms(random.u64(0..20_000))).await;
        }
        let held: HashMap<u64, ChannelState> = channels.read(|c| c.clone().into_iter().collect());
        if random.bool() {
            store.clear();
            settle(DELAY + RETRY_MAX * 2).await;
            assert_eq!(channels.unwritten(), 0, "seed {seed}: written behind");
        } else {
            stop.cancel();
            store.clear();
            assert_eq!(channels.flush(DELAY).await, 0, "seed {seed}: flushed");
        }
        assert_eq!(stored(&store).await, held, "seed {seed}");
        stop.cancel();
    }
}
