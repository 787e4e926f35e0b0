//! The cache on its own: loading, sharing loads, eviction, the memory bound.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::read_state::{Key, NoChannels};
use crate::recent_deletions::Deletion;
use crate::store::faulty::{Effect, Fault, FaultyStore, Operation};
use crate::store::memory::MemoryStore;
use crate::store::{Store, UserWrite};

pub(crate) fn config(capacity: usize) -> CacheConfig {
    CacheConfig {
        capacity,
        shards: 1,
        write_delay: Duration::from_secs(30),
        max_evicted_unwritten: 1_000,
        write_concurrency: 32,
        ..CacheConfig::default()
    }
}

async fn ack(
    cache: &Arc<Cache>,
    user_id: u64,
    channel_id: u64,
    message_id: u64,
) -> Result<bool, Error> {
    cache
        .update(user_id, |user, now| {
            user.ack(Key::channel(channel_id), message_id, now)
                .is_some()
        })
        .await
}

async fn last_acked(cache: &Arc<Cache>, user_id: u64, channel_id: u64) -> Option<u64> {
    cache
        .read(user_id, |user| {
            user.get(Key::channel(channel_id)).map(|s| s.last_acked_id)
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn a_miss_loads_from_the_store() {
    let store = Arc::new(MemoryStore::new());
    let mut user = UserReadStates::default();
    user.ack(Key::channel(5), 50, 1);
    store.write(&UserWrite::of(1, &user)).await.unwrap();

    let cache = Cache::new(config(100), store);
    assert_eq!(last_acked(&cache, 1, 5).await, Some(50));
    assert_eq!(last_acked(&cache, 2, 5).await, None, "unknown user: empty");
    let (gauges, stats) = cache.stats();
    assert_eq!(
        (gauges.users, gauges.read_states),
        (2, 2),
        "an empty user weighs 1"
    );
    // Case 9 of "Lossless at every transition": a cold request counted a
    // miss and then a hit.
    assert_eq!(stats.hits, 0, "a cold request is one miss, not a hit too");
    assert_eq!(stats.misses, 2);
    assert_eq!(last_acked(&cache, 1, 5).await, Some(50));
    assert_eq!(cache.stats().1.hits, 1);
}

#[tokio::test]
async fn concurrent_requests_share_one_load() {
    let store = Arc::new(FaultyStore::memory());
    let cache = Cache::new(config(100), store.clone());
    let reads = (0..20).map(|_| last_acked(&cache, 7, 1));
    futures::future::join_all(reads).await;
    assert_eq!(store.loads(), 1);
}

#[tokio::test]
async fn a_failed_load_is_unavailable_and_not_cached_as_empty() {
    let store = Arc::new(FaultyStore::memory());
    let mut user = UserReadStates::default();
    user.ack(Key::channel(1), 10, 1);
    store.write(&UserWrite::of(1, &user)).await.unwrap();
    let cache = Cache::new(config(100), store.clone());

    store.inject(Fault::new(Operation::Load, Effect::Fail));
    let error = cache.read(1, |u| u.len()).await.unwrap_err();
    assert!(
        matches!(error, Error::LoadFailed { user_id: 1, .. }),
        "{error:?}"
    );
    assert_eq!(error.code(), tonic::Code::Unavailable);
    assert_eq!(cache.stats().0.users, 0);

    store.clear();
    assert_eq!(last_acked(&cache, 1, 1).await, Some(10));
}

#[tokio::test]
async fn capacity_is_counted_in_read_states() {
    let cache = Cache::new(config(10), Arc::new(MemoryStore::new()));
    for user_id in 1..=5 {
        for channel_id in 1..=4 {
            ack(&cache, user_id, channel_id, 1).await.unwrap();
        }
    }
    let (gauges, stats) = cache.stats();
    assert!(gauges.read_states <= 10, "{gauges:?}");
    assert_eq!(
        gauges.users, 2,
        "the two most recent users of 4 read states each fit"
    );
    assert_eq!(stats.evictions, 3);
}

#[tokio::test]
async fn users_without_read_states_count_against_capacity() {
    let cache = Cache::new(config(10), Arc::new(MemoryStore::new()));
    for user_id in 1..=100 {
        cache.read(user_id, |u| u.len()).await.unwrap();
    }
    assert_eq!(cache.stats().0.users, 10);
}

#[tokio::test]
async fn one_user_larger_than_the_cache_is_still_served() {
    let cache = Cache::new(config(3), Arc::new(MemoryStore::new()));
    for channel_id in 1..=10 {
        ack(&cache, 1, channel_id, 1).await.unwrap();
    }
    assert_eq!(cache.read(1, |u| u.len()).await.unwrap(), 10);
}

#[tokio::test]
async fn an_evicted_user_keeps_its_unwritten_changes() {
    // No write-behind runs here: evicted changes wait in the eviction buffer.
    let store = Arc::new(FaultyStore::memory());
    let cache = Cache::new(config(1), store.clone());
    ack(&cache, 1, 1, 10).await.unwrap();
    ack(&cache, 2, 1, 20).await.unwrap(); // evicts user 1
    assert_eq!(cache.stats().1.evictions_unwritten, 1);
    assert_eq!(cache.unwritten(), 2);
    assert_eq!(
        last_acked(&cache, 1, 1).await,
        Some(10),
        "served from the buffer"
    );
    assert_eq!(store.loads(), 2, "users 1 and 2, once each");
}

#[tokio::test]
async fn changes_are_refused_when_evicted_changes_pile_up() {
    // No write-behind runs, as if the store were down: evicted users stay
    // in the eviction buffer.
    let cache = Cache::new(
        CacheConfig {
            max_evicted_unwritten: 2,
            write_concurrency: 32,
            ..config(2)
        },
        Arc::new(MemoryStore::new()),
    );
    for channel_id in 1..=2 {
        ack(&cache, 1, channel_id, 1).await.unwrap();
    }
    ack(&cache, 2, 1, 1).await.unwrap(); // evicts user 1: 2 read states wait
    assert_eq!(
        cache.unwritten(),
        3,
        "unwritten cached changes alone are not refused"
    );
    let error = ack(&cache, 3, 1, 1).await.unwrap_err();
    assert_eq!(
        error,
        Error::TooManyUnwritten {
            evicted: 2,
            limit: 2
        }
    );
    assert_eq!(error.code(), tonic::Code::Unavailable);
    assert_eq!(last_acked(&cache, 2, 1).await, Some(1), "reads still work");
    // Reading user 1 takes it back into the cache (evicting user 2 into the
    // buffer in its place): the bound follows what is held beyond capacity.
    assert_eq!(last_acked(&cache, 1, 2).await, Some(1));
    assert_eq!(cache.evicted_unwritten(), 1);
}

#[tokio::test]
async fn update_many_changes_nothing_when_a_load_fails() {
    let store = Arc::new(FaultyStore::memory());
    let cache = Cache::new(config(100), store.clone());
    ack(&cache, 1, 1, 10).await.unwrap();
    store.inject(Fault::new(Operation::Load, Effect::Fail));
    let result = cache
        .update_many(&[1, 2], |_, user, now| {
            user.message_created(Key::channel(1), 11, false, now, &NoChannels)
        })
        .await;
    assert!(matches!(result, Err(Error::LoadFailed { user_id: 2, .. })));
    let unread = cache
        .read(1, |u| u.get(Key::channel(1)).unwrap().unread_count)
        .await
        .unwrap();
    assert_eq!(unread, 0, "user 1 must not be counted when the call failed");
}

/// Case 4 of "Lossless at every transition": users loaded up front were
/// evicted before their turn (here by the request's own loads) and loaded
/// again inside the apply loop.
#[tokio::test]
async fn a_multi_user_change_loads_each_user_once_even_when_they_do_not_fit() {
    let store = Arc::new(FaultyStore::memory());
    let cache = Cache::new(config(200), store.clone());
    let users: Vec<u64> = (1..=1_000).collect();
    let changed = cache
        .update_many(&users, |_, user, now| {
            user.message_created(Key::channel(1), 10, false, now, &NoChannels)
        })
        .await
        .unwrap();
    assert_eq!(changed, vec![true; 1_000]);
    assert_eq!(store.loads(), 1_000, "one load per user");
    let counted = cache
        .read_many(&users, |u| {
            u.get(Key::channel(1)).map_or(0, |s| s.unread_count)
        })
        .await
        .unwrap();
    assert_eq!(counted, vec![1; 1_000]);
    assert!(
        cache.stats().0.read_states <= 200,
        "back within capacity once the request let go"
    );
}

/// Case 4: a multi-user change cut by a client deadline changed some users
/// and not others, so a retry counted them twice.
#[tokio::test(start_paused = true)]
async fn a_multi_user_change_cut_by_a_deadline_changes_all_or_nothing() {
    let users: Vec<u64> = (1..=1_000).collect();
    for cut_ms in [1, 3, 8, 12, 16, 20, 30, 50, 80, 120] {
        let store = Arc::new(FaultyStore::memory());
        store.inject(Fault::new(
            Operation::Load,
            Effect::Delay(Duration::from_millis(1)),
        ));
        let cache = Cache::new(config(200), store.clone());
        let cut = tokio::time::timeout(
            Duration::from_millis(cut_ms),
            cache.update_many(&users, |_, user, now| {
                user.message_created(Key::channel(1), 10, false, now, &NoChannels)
            }),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await; // loads under way land
        let counted = cache
            .read_many(&users, |u| {
                u.get(Key::channel(1)).map_or(0, |s| s.unread_count)
            })
            .await
            .unwrap();
        let changed = counted.iter().filter(|&&c| c == 1).count();
        match cut {
            Ok(result) => {
                assert_eq!(result.unwrap().len(), 1_000, "cut at {cut_ms} ms");
                assert_eq!(changed, 1_000, "cut at {cut_ms} ms");
            }
            Err(_) => assert_eq!(changed, 0, "cut at {cut_ms} ms"),
        }
        assert!(
            cache.stats().0.read_states <= 200,
            "cut at {cut_ms} ms: every pin given back"
        );
    }
}

/// Case 6: once closed, changes are refused before anything is applied.
#[tokio::test]
async fn a_closed_cache_refuses_changes_and_still_reads() {
    let cache = Cache::new(config(100), Arc::new(MemoryStore::new()));
    ack(&cache, 1, 1, 10).await.unwrap();
    cache.close().await;
    assert_eq!(ack(&cache, 1, 1, 11).await, Err(Error::ShuttingDown));
    assert_eq!(ack(&cache, 2, 1, 11).await, Err(Error::ShuttingDown));
    assert_eq!(last_acked(&cache, 1, 1).await, Some(10));
    assert_eq!(cache.unwritten(), 1);
}

// A node of a fleet: users of slots it does not serve, and releases.

mod release {
    use super::*;
    use crate::ownership::{Ownership, SlotState};
    use crate::read_state::NoChannels;
    use crate::store::faulty::SlowFirstLoad;
    use crate::watch::{Event, Feed};
    use crate::write_behind::{WriteBehind, WriteBehindConfig};
    use readstates_routing::slot_of;

    /// A member cache serving the slots of `served` only.
    fn member(store: Arc<dyn Store>, served: &[u64]) -> Arc<Cache> {
        let ownership = Arc::new(Ownership::member());
        ownership.lease(None);
        for &user_id in served {
            ownership.set(slot_of(user_id), SlotState::Serving);
        }
        Cache::with_ownership(config(100), store, ownership)
    }

    fn not_served(result: Result<impl std::fmt::Debug, Error>, user: u64) {
        assert!(
            matches!(result, Err(Error::NotServed { user_id, .. }) if user_id == user),
            "{result:?}"
        );
    }

    #[tokio::test]
    async fn a_user_not_served_is_neither_read_nor_changed() {
        let store = Arc::new(FaultyStore::memory());
        let cache = member(store.clone(), &[1]);
        assert_ne!(slot_of(1), slot_of(2));
        not_served(ack(&cache, 2, 5, 50).await, 2);
        not_served(cache.read(2, |_| ()).await, 2);
        not_served(cache.read_many(&[1, 2], |_| ()).await, 2);
        // All or nothing: user 1 is served, but user 2 is not.
        let result = cache
            .update_many(&[1, 2], |_, user, now| user.ack(Key::channel(5), 50, now))
            .await;
        not_served(result, 2);
        assert_eq!(last_acked(&cache, 1, 5).await, None);
        assert_eq!(store.loads(), 1, "only the served user was loaded");
        assert!(ack(&cache, 1, 5, 50).await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_writes_every_change_then_lets_go() {
        let store = Arc::new(FaultyStore::memory());
        let cache = member(store.clone(), &[1, 2]);
        let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
        let feed = Feed::new(16);
        cache.subscribe(1, &feed, 0).await.unwrap();
        assert!(matches!(feed.next().await, Ok(Event::Changed(_))));
        assert!(ack(&cache, 1, 5, 50).await.unwrap());
        assert!(ack(&cache, 2, 5, 60).await.unwrap());
        // The store fails for a while: the release waits for it.
        store.inject(Fault::new(Operation::Write, Effect::Fail).lasting(Duration::from_secs(3)));
        let slot = slot_of(1);
        cache.ownership().set(slot, SlotState::Releasing);
        not_served(ack(&cache, 1, 5, 51).await, 1);
        let started = tokio::time::Instant::now();
        let released = cache.release(|id| slot_of(id) == slot).await;
        assert_eq!(released, 1);
        assert!(
            started.elapsed() >= Duration::from_secs(3),
            "waited for the store"
        );
        assert_eq!(store.writes().iter().filter(|w| w.user_id == 1).count(), 1);
        let stored = store.load(1).await.unwrap();
        assert_eq!(stored.read_states[0].last_acked_id, 50);
        assert_eq!(cache.stats().0.users, 1, "user 1 let go, user 2 kept");
        assert!(matches!(feed.next().await, Ok(Event::Changed(c)) if c.version == stored.version));
        match feed.next().await {
            Ok(Event::Moved {
                user_id: 1,
                version,
            }) => {
                assert_eq!(version, stored.version);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(feed.subscribed(), 0);
        assert_eq!(
            store.writes().iter().filter(|w| w.user_id == 2).count(),
            0,
            "user 2 waits for its write delay"
        );
        write_behind.shutdown(Duration::from_secs(1)).await;
    }

    #[tokio::test]
    async fn a_load_across_a_move_away_and_back_is_not_kept() {
        let (store, go) = SlowFirstLoad::of(Arc::new(MemoryStore::new()), 1);
        let cache = member(store.clone(), &[1]);
        let read = tokio::spawn({
            let cache = cache.clone();
            async move { last_acked(&cache, 1, 5).await }
        });
        tokio::task::yield_now().await;
        // The slot moves away, another node changes the user, and it moves
        // back, all while the first load is under way.
        let slot = slot_of(1);
        cache.ownership().set(slot, SlotState::Releasing);
        assert_eq!(cache.release(|id| slot_of(id) == slot).await, 0);
        cache.ownership().set(slot, SlotState::NotOwner);
        let mut elsewhere = UserReadStates::default();
        elsewhere.ack(Key::channel(5), 77, 10);
        store.write(&UserWrite::of(1, &elsewhere)).await.unwrap();
        cache.ownership().set(slot, SlotState::Acquiring);
        cache.ownership().set(slot, SlotState::Serving);
        go.send(()).unwrap();
        assert_eq!(
            read.await.unwrap(),
            Some(77),
            "not what the first load read"
        );
    }

    /// Found in review: a multi-user change pinned user 1, user 1's slot
    /// moved away and back while the change waited for user 2's load, and
    /// the change then applied to (and unpinned) a copy it never pinned.
    #[tokio::test]
    async fn a_change_whose_pinned_user_was_let_go_meanwhile_applies_nothing() {
        let (store, go) = SlowFirstLoad::of(Arc::new(MemoryStore::new()), 2);
        let cache = member(store.clone(), &[1, 2]);
        assert_eq!(last_acked(&cache, 1, 5).await, None);
        let change = tokio::spawn({
            let cache = cache.clone();
            async move {
                cache
                    .update_many(&[1, 2], |_, user, now| user.ack(Key::channel(5), 50, now))
                    .await
            }
        });
        tokio::task::yield_now().await;
        let slot = slot_of(1);
        cache.ownership().set(slot, SlotState::Releasing);
        assert_eq!(cache.release(|id| slot_of(id) == slot).await, 1);
        cache.ownership().set(slot, SlotState::NotOwner);
        cache.ownership().set(slot, SlotState::Acquiring);
        cache.ownership().set(slot, SlotState::Serving);
        assert!(ack(&cache, 1, 5, 40).await.unwrap());
        go.send(()).unwrap();
        not_served(change.await.unwrap(), 1);
        assert_eq!(last_acked(&cache, 1, 5).await, Some(40));
        assert_eq!(last_acked(&cache, 2, 5).await, None, "all or nothing");
    }

    /// The warm handoff, end to end between two caches on one store: the
    /// receiver gets the user as the sender held it without loading it,
    /// writes its unwritten change when it was due at the sender (not a
    /// write delay after the move), and remembers what it was lowered for;
    /// the sender lets go of it without writing.
    #[tokio::test(start_paused = true)]
    async fn a_handoff_moves_users_with_their_unwritten_changes_due_times_and_deletions() {
        let store = Arc::new(FaultyStore::memory());
        let sender = member(store.clone(), &[1]);
        let receiver = member(store.clone(), &[]);
        let sender_writer = WriteBehind::start(sender.clone(), WriteBehindConfig::default());
        let receiver_writer = WriteBehind::start(receiver.clone(), WriteBehindConfig::default());
        let deletion = Deletion {
            channel_id: 5,
            message_id: 61,
            kind: crate::read_state::Kind::Channel,
        };
        let created = |user: &mut UserReadStates<Stored<'_>>, id, now| {
            user.message_created(Key::channel(5), id, false, now, &NoChannels)
        };
        sender
            .update_many(&[1], |_, user, now| {
                created(user, 61, now) && created(user, 62, now)
            })
            .await
            .unwrap();
        let lower = |cache: Arc<Cache>| async move {
            cache
                .update_many_once(
                    &[1],
                    deletion,
                    |_| Ok(()),
                    |_, user, now| user.message_deleted(Key::channel(5), 61, false, now),
                )
                .await
                .unwrap()
                .1
        };
        assert_eq!(lower(sender.clone()).await, [true]);
        let before = sender
            .read(1, |user| user.entries().to_vec())
            .await
            .unwrap();
        tokio::time::advance(Duration::from_secs(20)).await;

        let slot = slot_of(1);
        sender.ownership().set(slot, SlotState::Releasing);
        receiver.ownership().set(slot, SlotState::Acquiring);
        let users = sender.settled_users(|id| slot_of(id) == slot).await;
        let mut chunks: Vec<handoff::Chunk> = sender
            .export(users.clone(), &handoff::Sent::new())
            .collect()
            .await;
        chunks.extend(sender.export_deletions(|id| slot_of(id) == slot));
        assert_eq!(chunks.len(), 2, "the user, then its deletions: {chunks:?}");
        let installed: usize = chunks.into_iter().map(|c| receiver.install(c)).sum();
        assert_eq!(installed, 1);
        assert_eq!(sender.hand_off(&users), 1);
        sender.ownership().set(slot, SlotState::NotOwner);
        receiver.ownership().set(slot, SlotState::Serving);

        let loads = store.loads();
        let after = receiver
            .read(1, |user| user.entries().to_vec())
            .await
            .unwrap();
        assert_eq!(after, before);
        assert_eq!(store.loads(), loads, "served from what was handed over");
        assert_eq!(
            lower(receiver.clone()).await,
            [false],
            "lowered once already"
        );
        assert_eq!(receiver.unwritten(), 1);
        assert_eq!(sender.unwritten(), 0);

        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(store.writes().is_empty(), "not due yet");
        tokio::time::sleep(Duration::from_secs(2)).await;
        let writes = store.writes();
        assert_eq!(
            writes.len(),
            1,
            "due 30 s after the change, at the receiver"
        );
        assert_eq!(store.load(1).await.unwrap().read_states[0].unread_count, 1);
        assert_eq!(receiver.unwritten(), 0);
        sender_writer.shutdown(Duration::from_secs(1)).await;
        receiver_writer.shutdown(Duration::from_secs(1)).await;
        assert_eq!(store.writes().len(), 1, "the sender wrote nothing");
    }

    /// A handoff's later rounds read out only the users that changed since
    /// what was sent of them, and tell which were let go meanwhile.
    #[tokio::test(start_paused = true)]
    async fn a_handoff_sends_again_only_the_users_that_changed() {
        let store = Arc::new(FaultyStore::memory());
        let sender = member(store.clone(), &[1, 2, 3]);
        for user in [1, 2, 3] {
            assert!(ack(&sender, user, 5, 10).await.unwrap());
        }
        let users = sender.users_leaving(&|_| true);
        let versions = |chunks: Vec<handoff::Chunk>| -> handoff::Sent {
            chunks
                .into_iter()
                .flat_map(|chunk| match chunk {
                    handoff::Chunk::Users(users) => users,
                    other => panic!("{other:?}"),
                })
                .map(|user| (user.user_id, user.versions()))
                .collect()
        };
        let mut sent = versions(
            sender
                .export(users.clone(), &handoff::Sent::new())
                .collect()
                .await,
        );
        assert_eq!(sent.len(), 3);
        let again = versions(sender.export(users.clone(), &sent).collect().await);
        assert!(again.is_empty(), "nothing changed: {again:?}");

        assert!(ack(&sender, 2, 5, 20).await.unwrap());
        let again = versions(sender.export(users.clone(), &sent).collect().await);
        assert_eq!(again.keys().copied().collect::<Vec<_>>(), [2]);
        assert_ne!(again[&2], sent[&2]);
        sent.extend(again);

        assert_eq!(sender.hand_off(&sender.users_leaving(&|id| id == 3)), 1);
        let mut gone = sender.not_held(sent.into_keys());
        gone.sort_unstable();
        assert_eq!(gone, [3]);
    }
}

/// Eviction approximates LRU by CLOCK: a user used since eviction last
/// passed over it is spared once, and one that was not is evicted first.
#[tokio::test]
async fn a_user_used_since_the_last_eviction_pass_outlives_one_that_was_not() {
    let store = Arc::new(FaultyStore::memory());
    let cache = Cache::new(config(3), store.clone());
    for user_id in 1..=4 {
        // Users of one read state: the fourth evicts one of the first three.
        assert_eq!(last_acked(&cache, user_id, 1).await, None);
    }
    assert_eq!(store.loads(), 4);
    // Users 2, 3 and 4 are cached, none used since the pass; 2 is used.
    assert_eq!(last_acked(&cache, 2, 1).await, None);
    let loads = store.loads();
    assert_eq!(loads, 4, "user 2 was still cached");
    assert_eq!(last_acked(&cache, 5, 1).await, None);
    // User 5 evicted user 3 (not used since the last pass), not user 2.
    assert_eq!(last_acked(&cache, 2, 1).await, None);
    assert_eq!(store.loads(), loads + 1, "user 2 stayed cached");
    assert_eq!(last_acked(&cache, 3, 1).await, None);
    assert_eq!(store.loads(), loads + 2, "user 3 was evicted");
}
