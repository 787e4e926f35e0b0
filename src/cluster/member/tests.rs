//! A node's releases, on the paused clock.

use std::sync::Arc;
use std::time::Duration;

use readstates_routing::{Node, slot_of};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::cache::CacheConfig;
use crate::cluster::admin::{self, RingChange};
use crate::cluster::credential::FleetCredential;
use crate::cluster::lease::TAKEOVER_BY;
use crate::cluster::peers::GrpcPeers;
use crate::cluster::ring_store::memory::MemoryRingStore;
use crate::cluster::ring_store::{LeaseRecord, NO_BACKUP, OPERATOR_TAKEOVER, RingStore};
use crate::error::Error;
use crate::journal::Replayed;
use crate::read_state::{Key, UserReadStates};
use crate::store::faulty::{Effect, Fault, FaultyStore, Operation};
use crate::store::{Store, UserWrite};
use crate::write_behind::{WriteBehind, WriteBehindConfig};

/// Found by the failover simulation, with a slow store: a node started
/// again after kill -9 replays its journal and finds that the ring gave
/// its slots to others meanwhile. Owning nothing in this start, it answered
/// `ReleaseSlots` at once, before its replayed users were written; the new
/// owner loaded them from a store that lacked the replayed changes, and
/// its own newer writes beat them there once they landed. A release now
/// waits until the replayed users of its slots are written.
#[tokio::test(start_paused = true)]
async fn a_release_waits_for_the_replayed_users_of_its_slots() {
    let (ring_store, user) = ring_of_a_and_b().await;
    // Writes hang: the replayed user cannot reach the store yet.
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Write, Effect::Hang));
    let cache = member_cache(store.clone());
    let mut acked = UserReadStates::default();
    acked.ack(Key::channel(10), 5, 1);
    cache.replay(Replayed {
        users: [(user, UserWrite::of(user, &acked))].into(),
        ..Replayed::default()
    });
    let _write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
    let (member, stop) = node_a(ring_store, cache).await;
    member.ownership().lease(None);

    let slots = [slot_of(user)];
    let early = tokio::time::timeout(Duration::from_secs(1), member.release_slots(2, &slots));
    assert!(
        early.await.is_err(),
        "released before its replayed user was written"
    );
    store.clear();
    let released = tokio::time::timeout(Duration::from_secs(5), member.release_slots(2, &slots));
    released.await.expect("released once written").unwrap();
    let stored = store.load(user).await.unwrap();
    let state = (stored.read_states.iter()).find(|s| s.channel_id == 10);
    assert_eq!(state.map(|s| s.last_acked_id), Some(5));
    stop.cancel();
}

/// Found by a review of a loss the failover simulation saw once (two
/// messages of one user lost, with a slow store): a node started again on
/// a new machine, its disk lost, owned nothing and replayed nothing, and
/// answered `ReleaseSlots` at once, while its backup was still writing the
/// copy of what its dead incarnation had answered; the new owner loaded the
/// users from a store that lacked the copy, and its newer writes beat the
/// copy there. A release now waits for this start's lease, which it takes
/// only once that backup took the node over, the copy written (see
/// `cluster::lease`); until then it answers UNAVAILABLE.
#[tokio::test(start_paused = true)]
async fn a_release_waits_until_this_start_holds_its_lease() {
    let (ring_store, user) = ring_of_a_and_b().await;
    let cache = member_cache(Arc::new(FaultyStore::memory()));
    let (member, stop) = node_a(ring_store.clone(), cache).await;

    let slots = [slot_of(user)];
    let refused = member.release_slots(2, &slots).await;
    assert!(
        matches!(refused, Err(Error::LeaseLapsed)),
        "released without its lease: {refused:?}"
    );
    // A takeover holds the lease: refused while it still writes the copy,
    // answered once it says the copy is written (its epoch may wait for
    // this node: found by the failover simulation, two nodes taken over at
    // once by one backup waited for each other for good).
    let taking = lease_record(&format!("{TAKEOVER_BY}b"), 1, "b/1/1");
    assert!(ring_store.swap_lease("a", None, &taking).await.unwrap());
    let refused = member.release_slots(2, &slots).await;
    assert!(matches!(refused, Err(Error::LeaseLapsed)), "{refused:?}");
    let written = lease_record(&format!("{TAKEOVER_BY}b"), 2, NO_BACKUP);
    assert!(
        ring_store
            .swap_lease("a", Some(&taking), &written)
            .await
            .unwrap()
    );
    (member.release_slots(2, &slots).await).expect("released once the copy is written");
    let free = lease_record("", 3, NO_BACKUP);
    assert!(
        ring_store
            .swap_lease("a", Some(&written), &free)
            .await
            .unwrap()
    );
    let refused = member.release_slots(2, &slots).await;
    assert!(matches!(refused, Err(Error::LeaseLapsed)), "{refused:?}");
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    member.ownership().lease(Some(until));
    (member.release_slots(2, &slots).await).expect("released once leased");
    stop.cancel();
}

/// Found in review: a node that held its lease and lost it (cut from the
/// ring store) still answers releases: what it answered is in its own
/// memory, and it hands its users over as before. And an operator's
/// removal, which has no copy to write, never reads as a copy written.
#[tokio::test(start_paused = true)]
async fn a_start_that_held_its_lease_answers_releases_without_it() {
    let (ring_store, user) = ring_of_a_and_b().await;
    let cache = member_cache(Arc::new(FaultyStore::memory()));
    let (member, stop) = node_a(ring_store.clone(), cache).await;
    let slots = [slot_of(user)];
    let operator = lease_record(OPERATOR_TAKEOVER, 1, NO_BACKUP);
    assert!(ring_store.swap_lease("a", None, &operator).await.unwrap());
    let refused = member.release_slots(2, &slots).await;
    assert!(matches!(refused, Err(Error::LeaseLapsed)), "{refused:?}");
    let now = tokio::time::Instant::now();
    member.ownership().lease(Some(now + Duration::from_secs(3)));
    member.ownership().lease(Some(now));
    assert!(!member.ownership().leased());
    (member.release_slots(2, &slots).await).expect("released after the lease lapsed");
    stop.cancel();
}

/// A cache of a node of a fleet (serving nothing yet) over `store`.
fn member_cache(store: Arc<dyn Store>) -> Arc<Cache> {
    Cache::with_ownership(CacheConfig::default(), store, Arc::new(Ownership::member()))
}

/// Node a's lease record as `holder` made it.
fn lease_record(holder: &str, renewals: u64, backup: &str) -> LeaseRecord {
    LeaseRecord {
        holder: holder.to_owned(),
        renewals,
        backup: backup.to_owned(),
        lease: None,
    }
}

/// A ring of nodes a and b (epoch 2), and a user b owns.
async fn ring_of_a_and_b() -> (Arc<MemoryRingStore>, u64) {
    let ring_store = Arc::new(MemoryRingStore::default());
    for (epoch, id) in [(1, "a"), (2, "b")] {
        let node = Node {
            id: id.to_owned(),
            address: format!("127.0.0.1:{}", 1 + epoch),
            weight: 100,
        };
        admin::change(&*ring_store, RingChange::Add(node))
            .await
            .unwrap();
        for id in ["a", "b"] {
            ring_store.report(id, epoch).await.unwrap();
        }
    }
    let ring = ring_store.load().await.unwrap().ring;
    let user = (1..)
        .find(|&u| ring.owner_of(u).unwrap().id == "b")
        .unwrap();
    (ring_store, user)
}

/// Node a over `cache`, following the ring up to epoch 2 until the token
/// is cancelled.
async fn node_a(
    ring_store: Arc<MemoryRingStore>,
    cache: Arc<Cache>,
) -> (Member, CancellationToken) {
    let peers = GrpcPeers::new(
        None,
        FleetCredential::new("a secret of sixteen bytes", "readstates", "test"),
    );
    let member = Member::new(
        "a".to_owned(),
        ring_store,
        cache,
        Arc::new(peers),
        MemberConfig::default(),
    );
    let stop = CancellationToken::new();
    let _follower = member.start(stop.clone());
    member.catch_up(2, Duration::from_secs(5)).await;
    (member, stop)
}
