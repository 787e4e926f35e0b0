//! Which copy may take a dead node over: only the one its lease record
//! names. A copy left from a stream the node gave up (it then answered on
//! its journal alone, or to another stream) lacks what it answered since.

use std::sync::Arc;
use std::time::Duration;

use readstates_routing::Node;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::cache::{Cache, CacheConfig};
use crate::cluster::admin::RingChange;
use crate::cluster::backup::held::tests::ack;
use crate::cluster::credential::FleetCredential;
use crate::cluster::member::MemberConfig;
use crate::cluster::peers::GrpcPeers;
use crate::cluster::ring_store::memory::MemoryRingStore;
use crate::ownership::Ownership;
use crate::store::memory::MemoryStore;

const LEASE: LeaseConfig = LeaseConfig {
    duration: Duration::from_secs(3),
    margin: Duration::from_secs(1),
};

/// x's lease as it last renewed it, naming `backup`.
fn lease_of_x(renewals: u64, backup: &str) -> LeaseRecord {
    LeaseRecord {
        holder: "x's incarnation".to_owned(),
        renewals,
        backup: backup.to_owned(),
        lease: None,
    }
}

/// A copy of x, complete, whose stream (named `token`) broke.
fn broken_copy(backups: &Backups, token: &str) -> u64 {
    let stream = backups.open("x", "i1", token);
    backups.complete_at("x", stream, 0);
    backups.broke("x", stream);
    stream
}

/// A complete copy of x from its start `incarnation`, named `token`,
/// holding an ack the store lacks (user 7 read channel 10 up to 5).
fn copy_with_an_ack(backups: &Backups, incarnation: &str, token: &str) -> u64 {
    let stream = backups.open("x", incarnation, token);
    (backups.batch("x", stream, ack(7, 10, 5, 100), 10)).unwrap();
    backups.complete_at("x", stream, 0);
    stream
}

/// The ack of [`copy_with_an_ack`] as the store has it.
async fn acked_in_store(store: &Arc<dyn Store>) -> Option<u64> {
    let user = store.load(7).await.unwrap();
    let acked = (user.read_states.iter()).find(|s| s.channel_id == 10);
    acked.map(|s| s.last_acked_id)
}

/// Waits until x is out of the ring (taken over), for three lapses at most.
async fn until_taken_over(ring_store: &MemoryRingStore) {
    let deadline = Instant::now() + LEASE.lapse() * 3;
    while ring_store.load().await.unwrap().ring.node("x").is_some() {
        assert!(Instant::now() < deadline, "not taken over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A ring of b and x, served; b's takeover of x (its backup), b holding
/// its own lease, with no copy yet; and what stops b.
async fn b_backs_up_x() -> (Arc<MemoryRingStore>, Takeover, CancellationToken) {
    let ring_store = Arc::new(MemoryRingStore::default());
    for (epoch, id) in [(1, "b"), (2, "x")] {
        let node = Node {
            id: id.to_owned(),
            address: format!("127.0.0.1:{}", 1 + epoch),
            weight: 100,
        };
        admin::change(&*ring_store, RingChange::Add(node))
            .await
            .unwrap();
        for id in ["b", "x"] {
            ring_store.report(id, epoch).await.unwrap();
        }
    }
    let store = Arc::new(MemoryStore::new());
    let cache = Cache::with_ownership(
        CacheConfig::default(),
        store.clone(),
        Arc::new(Ownership::member()),
    );
    let peers = GrpcPeers::new(
        None,
        FleetCredential::new("a secret of sixteen bytes", "readstates", "test"),
    );
    let member = Member::new(
        "b".to_owned(),
        ring_store.clone(),
        cache,
        Arc::new(peers),
        MemberConfig::default(),
    );
    let stop = CancellationToken::new();
    let _follower = member.start(stop.clone());
    // b holds its own lease (it takes over only then).
    member.ownership().lease(None);
    member.catch_up(2, Duration::from_secs(5)).await;
    assert_eq!(backup_of(&member.ring().ring, "x").unwrap().id, "b");
    let takeover = Takeover {
        member,
        backups: Backups::new(),
        ring_store: ring_store.clone(),
        store,
        lease: LEASE,
    };
    (ring_store, takeover, stop)
}

#[tokio::test(start_paused = true)]
async fn only_the_copy_the_lease_names_takes_a_dead_node_over() {
    let (ring_store, takeover, stop) = b_backs_up_x().await;
    let backups = takeover.backups.clone();
    let running = tokio::spawn(takeover.run(stop.clone()));

    // x gave up this stream and answered on its journal alone since.
    assert!(
        (ring_store.swap_lease("x", None, &lease_of_x(1, NO_BACKUP)))
            .await
            .unwrap()
    );
    broken_copy(&backups, "b/x1/0");
    tokio::time::sleep(LEASE.lapse() * 3).await;
    assert_eq!(
        ring_store.lease("x").await.unwrap(),
        Some(lease_of_x(1, NO_BACKUP)),
        "taken over with a copy the lease does not name"
    );
    assert!(backups.held_for("x").is_none(), "the useless copy is kept");
    assert!(ring_store.load().await.unwrap().ring.node("x").is_some());

    // The copy the lease names takes it over.
    let named = lease_of_x(2, "b/x1/1");
    let seen = Some(lease_of_x(1, NO_BACKUP));
    assert!(
        (ring_store.swap_lease("x", seen.as_ref(), &named))
            .await
            .unwrap()
    );
    broken_copy(&backups, "b/x1/1");
    until_taken_over(&ring_store).await;
    // Taken (then freed once done), not renewed by x.
    let lease = ring_store.lease("x").await.unwrap().unwrap();
    assert!(lease.renewals > named.renewals && lease.holder.is_empty());
    stop.cancel();
    running.await.unwrap();
}

/// Found in review: a broken copy of a node an operator gave up (its lease
/// revoked, then the node out of the ring: `ring remove --force
/// --ignore-lease`) was watched again at once, over and over, and written
/// ahead each time: a spin that wrote the whole copy to the store in a
/// loop. It is dropped, once the store says both. On the real clock: the
/// spin never lets a paused one advance.
#[tokio::test]
async fn a_copy_of_a_node_an_operator_gave_up_is_dropped() {
    let (ring_store, takeover, stop) = b_backs_up_x().await;
    let backups = takeover.backups.clone();
    let named = lease_of_x(1, "b/x1/0");
    assert!(ring_store.swap_lease("x", None, &named).await.unwrap());
    broken_copy(&backups, "b/x1/0");
    // An operator revoked it.
    let revoked = LeaseRecord {
        holder: String::new(),
        renewals: 2,
        backup: named.backup.clone(),
        lease: None,
    };
    assert!(
        ring_store
            .swap_lease("x", Some(&named), &revoked)
            .await
            .unwrap()
    );
    let running = tokio::spawn(takeover.run(stop.clone()));
    // Kept while the ring still names b x's backup.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        backups.held_for("x").is_some(),
        "dropped on the lease alone"
    );
    admin::change(&*ring_store, RingChange::Remove { node: "x".into() })
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while backups.held_for("x").is_some() {
        assert!(
            Instant::now() < deadline,
            "the copy is kept, watched over and over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ring_store.lease("x").await.unwrap(), Some(revoked));
    stop.cancel();
    running.await.unwrap();
}

/// Found by the failover simulation: x died (its machine lost) and started
/// again at once, empty, and streamed anew to b before b looked at the
/// broken stream. The new stream replaced the copy x's lease names, the
/// only one of what x had answered and not written, which was lost. A new
/// incarnation's stream keeps the dead one's copy, which takes x over.
#[tokio::test(start_paused = true)]
async fn a_new_incarnation_streaming_at_once_keeps_the_dead_ones_copy() {
    let (ring_store, takeover, stop) = b_backs_up_x().await;
    let (backups, store) = (takeover.backups.clone(), takeover.store.clone());
    // x answered an ack that b holds and the store lacks, under a lease
    // naming b's copy; then it died.
    let named = lease_of_x(1, "b/x1/0");
    assert!(ring_store.swap_lease("x", None, &named).await.unwrap());
    let old = copy_with_an_ack(&backups, "i1", "b/x1/0");
    backups.broke("x", old);
    // Started again, it streams at once (with nothing unwritten).
    let new = backups.open("x", "i2", "b/x2/0");
    backups.complete_at("x", new, 0);
    let running = tokio::spawn(takeover.run(stop.clone()));
    until_taken_over(&ring_store).await;
    assert_eq!(acked_in_store(&store).await, Some(5), "the ack is lost");
    stop.cancel();
    running.await.unwrap();
}

/// The same, but the new incarnation takes the lease first (its record
/// naming its own copy): the dead one's copy is written, then dropped.
#[tokio::test(start_paused = true)]
async fn a_dead_incarnations_copy_is_written_then_dropped_once_the_new_one_holds_the_lease() {
    let (ring_store, takeover, stop) = b_backs_up_x().await;
    let (backups, store) = (takeover.backups.clone(), takeover.store.clone());
    let named = lease_of_x(1, "b/x1/0");
    assert!(ring_store.swap_lease("x", None, &named).await.unwrap());
    let old = copy_with_an_ack(&backups, "i1", "b/x1/0");
    backups.broke("x", old);
    let new = backups.open("x", "i2", "b/x2/0");
    backups.complete_at("x", new, 0);
    let theirs = LeaseRecord {
        holder: "x's new incarnation".to_owned(),
        renewals: 2,
        backup: "b/x2/0".to_owned(),
        lease: None,
    };
    assert!(
        (ring_store.swap_lease("x", Some(&named), &theirs))
            .await
            .unwrap()
    );
    // The new incarnation lives: it renews its lease.
    let renewing = tokio::spawn({
        let ring_store = ring_store.clone();
        async move {
            let mut held = theirs;
            loop {
                tokio::time::sleep(LEASE.renew_every()).await;
                let next = LeaseRecord {
                    renewals: held.renewals + 1,
                    ..held.clone()
                };
                assert!(
                    ring_store
                        .swap_lease("x", Some(&held), &next)
                        .await
                        .unwrap()
                );
                held = next;
            }
        }
    });
    let running = tokio::spawn(takeover.run(stop.clone()));
    let deadline = Instant::now() + LEASE.lapse() * 3;
    while backups
        .complete()
        .iter()
        .any(|&(_, stream, _)| stream == old)
    {
        assert!(
            Instant::now() < deadline,
            "the dead incarnation's copy is kept"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(acked_in_store(&store).await, Some(5), "the ack is lost");
    assert!(
        backups
            .complete()
            .iter()
            .any(|&(_, stream, _)| stream == new)
    );
    assert!(ring_store.load().await.unwrap().ring.node("x").is_some());
    renewing.abort();
    stop.cancel();
    running.await.unwrap();
}

/// Found by the failover simulation: a node joined, so the ring named y,
/// not b, x's backup; x died before its stream moved to y, its lease still
/// naming b's copy. b let the copy be (not its to use, by the ring) and
/// nobody took x over: what x had answered was lost. The lease names the
/// copy that holds it all, whatever the ring says since.
#[tokio::test(start_paused = true)]
async fn the_copy_the_lease_names_takes_over_though_the_ring_names_another_backup() {
    let (ring_store, takeover, stop) = b_backs_up_x().await;
    let (backups, store) = (takeover.backups.clone(), takeover.store.clone());
    let y = Node {
        id: "y".to_owned(),
        address: "127.0.0.1:9".to_owned(),
        weight: 100,
    };
    let record = admin::change(&*ring_store, RingChange::Add(y))
        .await
        .unwrap();
    let epoch = record.ring.epoch();
    for id in ["b", "x", "y"] {
        ring_store.report(id, epoch).await.unwrap();
    }
    takeover
        .member
        .catch_up(epoch, Duration::from_secs(5))
        .await;
    assert_eq!(
        backup_of(&takeover.member.ring().ring, "x").unwrap().id,
        "y"
    );
    let named = lease_of_x(1, "b/x1/0");
    assert!(ring_store.swap_lease("x", None, &named).await.unwrap());
    let stream = copy_with_an_ack(&backups, "i1", "b/x1/0");
    backups.broke("x", stream);
    let running = tokio::spawn(takeover.run(stop.clone()));
    until_taken_over(&ring_store).await;
    assert_eq!(acked_in_store(&store).await, Some(5), "the ack is lost");
    stop.cancel();
    running.await.unwrap();
}

/// From a review: the lease was sighted naming no copy just before x named
/// its stream to b, and the stream broke at once (x killed). b dropped
/// the copy on that sighting and nobody took x over (only an operator
/// could). A copy is dropped only once the store, read now, names another.
#[tokio::test(start_paused = true)]
async fn a_copy_named_after_its_last_sighting_still_takes_over() {
    let (ring_store, takeover, stop) = b_backs_up_x().await;
    let (backups, store) = (takeover.backups.clone(), takeover.store.clone());
    let alone = lease_of_x(1, NO_BACKUP);
    assert!(ring_store.swap_lease("x", None, &alone).await.unwrap());
    let stream = copy_with_an_ack(&backups, "i1", "b/x1/0");
    let running = tokio::spawn(takeover.run(stop.clone()));
    // Sighted naming none; then named, and the stream breaks at once.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let named = lease_of_x(2, "b/x1/0");
    assert!(
        ring_store
            .swap_lease("x", Some(&alone), &named)
            .await
            .unwrap()
    );
    backups.broke("x", stream);
    until_taken_over(&ring_store).await;
    assert_eq!(acked_in_store(&store).await, Some(5));
    stop.cancel();
    running.await.unwrap();
}

/// A ring store on which every takeover's compare-and-set of a lease
/// fails (someone else's always came first), counting them, if `refuse`;
/// and whose first `advances_to_fail` epochs fail to be made.
#[derive(Debug, Default)]
struct Refusing {
    ring: Arc<MemoryRingStore>,
    refuse: bool,
    swaps: std::sync::atomic::AtomicUsize,
    advances_to_fail: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl RingStore for Refusing {
    async fn load(&self) -> Result<RingRecord, crate::store::StoreError> {
        self.ring.load().await
    }
    async fn advance(&self, next: &RingRecord) -> Result<bool, crate::store::StoreError> {
        let failing = &self.advances_to_fail;
        let ordering = std::sync::atomic::Ordering::SeqCst;
        if failing
            .fetch_update(ordering, ordering, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(crate::store::StoreError::new("ring", "unreachable"));
        }
        self.ring.advance(next).await
    }
    async fn release(&self, epoch: u64, node: &str) -> Result<bool, crate::store::StoreError> {
        self.ring.release(epoch, node).await
    }
    async fn report(&self, node: &str, epoch: u64) -> Result<(), crate::store::StoreError> {
        self.ring.report(node, epoch).await
    }
    async fn progress(
        &self,
    ) -> Result<std::collections::BTreeMap<String, u64>, crate::store::StoreError> {
        self.ring.progress().await
    }
    async fn drained_weight(&self, node: &str) -> Result<Option<u32>, crate::store::StoreError> {
        self.ring.drained_weight(node).await
    }
    async fn set_drained_weight(
        &self,
        node: &str,
        weight: Option<u32>,
    ) -> Result<(), crate::store::StoreError> {
        self.ring.set_drained_weight(node, weight).await
    }
    async fn lease(&self, node: &str) -> Result<Option<LeaseRecord>, crate::store::StoreError> {
        self.ring.lease(node).await
    }
    async fn swap_lease(
        &self,
        node: &str,
        seen: Option<&LeaseRecord>,
        next: &LeaseRecord,
    ) -> Result<bool, crate::store::StoreError> {
        if self.refuse && next.holder.starts_with(TAKEOVER_BY) {
            self.swaps.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            return Ok(false);
        }
        self.ring.swap_lease(node, seen, next).await
    }
}

/// From a review: a takeover whose compare-and-set failed was watched
/// again at once, over and over (each time decoding and writing the copy
/// again): a spin while the lease still read lapsed. On the real clock: a
/// spin never lets a paused one advance.
#[tokio::test]
async fn a_takeover_that_loses_the_lease_tries_again_a_poll_later() {
    let (ring_store, takeover, stop) = b_backs_up_x().await;
    let refusing = Arc::new(Refusing {
        ring: ring_store.clone(),
        refuse: true,
        ..Refusing::default()
    });
    let takeover = Takeover {
        ring_store: refusing.clone(),
        ..takeover
    };
    let named = lease_of_x(1, "b/x1/0");
    assert!(ring_store.swap_lease("x", None, &named).await.unwrap());
    broken_copy(&takeover.backups, "b/x1/0");
    let running = tokio::spawn(takeover.run(stop.clone()));
    tokio::time::sleep(LEASE.lapse() + Duration::from_secs(1)).await;
    let swaps = refusing.swaps.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (1..=20).contains(&swaps),
        "{swaps} tries in the second after the lapse"
    );
    stop.cancel();
    running.await.unwrap();
}

/// A takeover whose epoch cannot be made at first (the ring store fails
/// after the copy is written) tries again while it holds the lease: given
/// up, it freed the lease and left the node to an operator, and one backup
/// taking two nodes over at once waited for good (found in review).
#[tokio::test(start_paused = true)]
async fn a_takeover_whose_epoch_fails_at_first_tries_again() {
    let (ring_store, takeover, stop) = b_backs_up_x().await;
    let failing = Arc::new(Refusing {
        ring: ring_store.clone(),
        advances_to_fail: 3.into(),
        ..Refusing::default()
    });
    let takeover = Takeover {
        ring_store: failing.clone(),
        ..takeover
    };
    let named = lease_of_x(1, "b/x1/0");
    assert!(ring_store.swap_lease("x", None, &named).await.unwrap());
    let stream = copy_with_an_ack(&takeover.backups, "x1", "b/x1/0");
    takeover.backups.broke("x", stream);
    let store = takeover.store.clone();
    let running = tokio::spawn(takeover.run(stop.clone()));
    until_taken_over(&ring_store).await;
    assert_eq!(acked_in_store(&store).await, Some(5));
    stop.cancel();
    running.await.unwrap();
}

/// Found in review: a takeover that stalled once it held the dead node's
/// lease (frozen, its renewals failing) went on when it woke and made the
/// epoch without the node, though the node, started again in place, had
/// waited its hold out and taken the lease back: two owners, an
/// acknowledged change lost. A renewal that does not apply ends the
/// takeover, and its ring steps are refused from then on.
#[tokio::test(start_paused = true)]
async fn a_takeover_that_lost_its_hold_on_the_lease_makes_no_epoch() {
    let (ring_store, takeover, stop) = b_backs_up_x().await;
    let backups = takeover.backups.clone();
    let running = tokio::spawn(takeover.run(stop.clone()));
    let named = lease_of_x(1, "b/x1/0");
    assert!(ring_store.swap_lease("x", None, &named).await.unwrap());
    broken_copy(&backups, "b/x1/0");
    // b stalls in its ring steps once it holds x's lease.
    ring_store.hold_loads(true);
    let taken = loop {
        let lease = ring_store.lease("x").await.unwrap().unwrap();
        if lease.holder.starts_with(TAKEOVER_BY) {
            break lease;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // x, started again, waited the hold out and takes its lease back.
    let again = LeaseRecord {
        holder: "x again".to_owned(),
        renewals: taken.renewals + 1,
        backup: NO_BACKUP.to_owned(),
        lease: None,
    };
    assert!(
        (ring_store.swap_lease("x", Some(&taken), &again))
            .await
            .unwrap()
    );
    tokio::time::sleep(LEASE.renew_every() * 2).await;
    ring_store.hold_loads(false);
    tokio::time::sleep(LEASE.lapse() * 2).await;
    assert!(
        ring_store.load().await.unwrap().ring.node("x").is_some(),
        "the takeover made its epoch after it lost the lease"
    );
    assert_eq!(ring_store.lease("x").await.unwrap(), Some(again));
    stop.cancel();
    running.await.unwrap();
}
