//! The lease on the paused clock, over the in-memory ring store: a node
//! serves only while it holds it, a new start waits out an earlier one's,
//! and a live lease is never taken.

use std::sync::Arc;
use std::time::Duration;

use readstates_routing::Slot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::cache::{Cache, CacheConfig};
use crate::cluster::admin::{self, AdminError};
use crate::cluster::credential::FleetCredential;
use crate::cluster::member::MemberConfig;
use crate::cluster::peers::GrpcPeers;
use crate::cluster::ring_store::memory::MemoryRingStore;
use crate::ownership::{Ownership, SlotState};
use crate::store::memory::MemoryStore;

const NODE: &str = "a";
const SLOT: Slot = 7;
const CONFIG: LeaseConfig = LeaseConfig {
    duration: Duration::from_secs(3),
    margin: Duration::from_secs(1),
};

/// One start of node `a`, serving `SLOT` whenever it holds its lease.
struct Start {
    member: Member,
    stop: CancellationToken,
    holder: JoinHandle<()>,
    backup: Arc<BackupName>,
}

impl Start {
    fn new(store: &Arc<MemoryRingStore>) -> Start {
        Start::after(store, None)
    }

    /// A start on the journal directory `predecessor` held before it (see
    /// [`Holder::restarted_in_place`]).
    fn after(store: &Arc<MemoryRingStore>, predecessor: Option<String>) -> Start {
        let cache = Cache::with_ownership(
            CacheConfig::default(),
            Arc::new(MemoryStore::new()),
            Arc::new(Ownership::member()),
        );
        cache.ownership().set(SLOT, SlotState::Serving);
        let peers = GrpcPeers::new(
            None,
            FleetCredential::new("a secret of sixteen bytes", "readstates", "test"),
        );
        let member = Member::new(
            NODE.to_owned(),
            store.clone(),
            cache,
            Arc::new(peers),
            MemberConfig::default(),
        );
        let stop = CancellationToken::new();
        let backup = BackupName::new();
        let holder = Holder::new(store.clone(), member.clone(), CONFIG, backup.clone())
            .restarted_in_place(predecessor);
        let holder = tokio::spawn(holder.run(stop.clone()));
        Start {
            member,
            stop,
            holder,
            backup,
        }
    }

    fn serves(&self) -> bool {
        self.member.ownership().state(SLOT) == SlotState::Serving
    }

    /// Whether it served at every step of `within` (10 ms apart), or at
    /// none (`None`: it changed).
    async fn served_throughout(&self, within: Duration) -> Option<bool> {
        let first = self.serves();
        let end = Instant::now() + within;
        while Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(10)).await;
            if self.serves() != first {
                return None;
            }
        }
        Some(first)
    }

    /// Waits (at most a minute) until it serves, or (`false`) no longer
    /// does; how long that took.
    async fn until_serving(&self, serving: bool) -> Duration {
        let started = Instant::now();
        while self.serves() != serving {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "still serving: {}",
                !serving
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        started.elapsed()
    }

    /// kill -9: nothing released.
    fn crash(self) {
        self.holder.abort();
    }
}

#[tokio::test(start_paused = true)]
async fn a_node_serves_only_while_it_holds_its_lease() {
    let store = Arc::new(MemoryRingStore::default());
    let start = Start::new(&store);
    assert!(!start.serves(), "nothing served before the lease is taken");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        start.served_throughout(Duration::from_secs(20)).await,
        Some(true)
    );

    // Cut off from the ring store: served until the lease's end, measured
    // from before the last renewal was sent, then fenced.
    store.cut_off(NODE, true);
    let fenced_after = start.until_serving(false).await;
    assert!(
        fenced_after <= CONFIG.duration,
        "served {fenced_after:?} after the last renewal could be made"
    );
    assert!(fenced_after >= CONFIG.duration - CONFIG.renew_every() - Duration::from_millis(20));
    assert_eq!(start.member.ownership().state(SLOT), SlotState::Fenced);
    assert_eq!(
        start.served_throughout(Duration::from_secs(10)).await,
        Some(false)
    );

    // Back: served again at the next renewal.
    store.cut_off(NODE, false);
    tokio::time::sleep(CONFIG.renew_every() + Duration::from_millis(10)).await;
    assert!(start.serves());

    // A clean stop releases the lease: the next start takes it at once.
    start.stop.cancel();
    start.holder.await.unwrap();
    let record = store.lease(NODE).await.unwrap().unwrap();
    assert!(!record.held(), "{record:?}");
    let again = Start::new(&store);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(again.serves());
}

#[tokio::test(start_paused = true)]
async fn a_restart_after_a_crash_waits_out_the_earlier_lease() {
    let store = Arc::new(MemoryRingStore::default());
    let first = Start::new(&store);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(first.serves());
    first.crash();
    let crashed = Instant::now();

    let second = Start::new(&store);
    second.until_serving(true).await;
    let waited = crashed.elapsed();
    assert!(
        waited >= CONFIG.lapse(),
        "served {waited:?} after the crash: the earlier start may still serve until {:?}",
        CONFIG.duration
    );
    assert!(
        waited <= CONFIG.lapse() + 2 * CONFIG.renew_every(),
        "{waited:?}"
    );
}

/// Issue 53: a restart in place waited out its earlier lease, and a lease
/// naming a copy a lapse more, so its backup took it over and the node
/// lost its slots. A start that holds the journal directory its
/// predecessor held (whose lock the kernel let go: that process is gone)
/// takes the lease back at once, even one naming a copy; a start on
/// another directory still waits.
#[tokio::test(start_paused = true)]
async fn a_restart_in_place_takes_its_predecessors_lease_back_at_once() {
    let store = Arc::new(MemoryRingStore::default());
    let first = Start::new(&store);
    tokio::time::sleep(Duration::from_millis(10)).await;
    first.backup.want("b/copy");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let record = store.lease(NODE).await.unwrap().unwrap();
    assert_eq!(record.backup, "b/copy", "the lease names a copy");
    first.crash();

    let elsewhere = Start::after(&store, Some("another process".into()));
    let crashed = Instant::now();
    let in_place = Start::after(&store, Some(record.holder.clone()));
    let waited = in_place.until_serving(true).await;
    assert!(
        waited < CONFIG.renew_every(),
        "a restart in place waited {waited:?} for its own lease"
    );
    assert_eq!(
        elsewhere.served_throughout(Duration::from_secs(10)).await,
        Some(false),
        "a start on another directory took the lease"
    );
    assert!(crashed.elapsed() >= Duration::from_secs(10));
    assert!(in_place.serves());
}

#[tokio::test(start_paused = true)]
async fn a_live_lease_is_never_taken_and_a_forced_release_waits_for_it_to_lapse() {
    let store = Arc::new(MemoryRingStore::default());
    let first = Start::new(&store);
    tokio::time::sleep(Duration::from_millis(10)).await;
    // The same node id started twice (a frozen pod replaced, say): the
    // second never serves while the first renews.
    let second = Start::new(&store);
    assert_eq!(
        second.served_throughout(Duration::from_secs(30)).await,
        Some(false)
    );
    assert!(first.serves());
    second.stop.cancel();
    second.holder.await.unwrap();

    // The lease is what `ring release --force` checks (the ring has no
    // slot to release here, so it is checked directly).
    let live = admin::fence(&*store, NODE, Some(CONFIG)).await;
    assert!(
        matches!(live, Err(AdminError::LeaseLive { .. })),
        "{live:?}"
    );
    assert!(first.serves());

    // Frozen (its renewals stop), the lease lapses and is revoked; the
    // node, fenced meanwhile, learns it was revoked when it wakes.
    store.cut_off(NODE, true);
    let fence = tokio::spawn({
        let store = store.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            store.cut_off(NODE, false);
            let started = Instant::now();
            let revoked = admin::fence(&*store, NODE, Some(CONFIG)).await;
            (revoked, started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    first.holder.abort();
    let (revoked, took) = fence.await.unwrap();
    revoked.unwrap();
    assert!(took >= CONFIG.lapse(), "revoked after {took:?}");
    assert!(
        !first.serves(),
        "fenced by the time the lease could be revoked"
    );
}

#[tokio::test(start_paused = true)]
async fn a_revoked_lease_fences_its_holder_until_it_has_adopted_the_ring() {
    let store = Arc::new(MemoryRingStore::default());
    let start = Start::new(&store);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(start.serves());
    // Revoked without waiting (`--ignore-lease`): the holder's next
    // renewal fails, and it stops serving at once.
    admin::fence(&*store, NODE, None).await.unwrap();
    tokio::time::sleep(CONFIG.renew_every() + Duration::from_millis(10)).await;
    let record = store.lease(NODE).await.unwrap().unwrap();
    // The ring (epoch 0 here) gives it nothing to release: it takes a new
    // lease at the renewal after.
    assert!(record.held() || !start.serves(), "{record:?}");
    tokio::time::sleep(2 * CONFIG.renew_every()).await;
    assert!(start.serves());
}

/// Found in review: a revoked holder that could not read the ring took a
/// new lease at its next try, serving slots the ring may have given away.
/// It takes one only once it has read and adopted the ring.
#[tokio::test(start_paused = true)]
async fn a_revoked_holder_that_cannot_read_the_ring_takes_no_new_lease() {
    let store = Arc::new(MemoryRingStore::default());
    let start = Start::new(&store);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(start.serves());
    store.fail_loads(true);
    admin::fence(&*store, NODE, None).await.unwrap();
    start.until_serving(false).await;
    assert_eq!(
        start.served_throughout(Duration::from_secs(30)).await,
        Some(false),
        "served again without having read the ring"
    );
    let record = store.lease(NODE).await.unwrap().unwrap();
    assert!(!record.held(), "taken again without the ring: {record:?}");
    store.fail_loads(false);
    start.until_serving(true).await;
}

/// The backup stream asks for a name (a copy that may take the node over,
/// or none): it is recorded by a renewal made at once, not at the next
/// quarter of the lease, and the holder says so, with the request it was
/// made from, only once it applied.
#[tokio::test(start_paused = true)]
async fn a_backup_name_is_recorded_by_a_renewal_made_at_once() {
    let store = Arc::new(MemoryRingStore::default());
    let a = Start::new(&store);
    let mut recorded = a.backup.recorded();
    recorded
        .wait_for(|(name, request)| name == NO_BACKUP && *request == 1)
        .await
        .expect("the lease taken names no backup");
    assert_eq!(store.lease(NODE).await.unwrap().unwrap().backup, NO_BACKUP);
    // Just after a renewal: the next one is due a quarter lease later.
    tokio::time::sleep(CONFIG.renew_every() / 10).await;
    let asked = Instant::now();
    let request = a.backup.want("b/stream-1");
    recorded
        .wait_for(|r| *r == ("b/stream-1".to_owned(), request))
        .await
        .unwrap();
    assert!(
        asked.elapsed() < CONFIG.renew_every() / 2,
        "recorded {:?} after it was asked for",
        asked.elapsed()
    );
    let record = store.lease(NODE).await.unwrap().unwrap();
    assert_eq!(record.backup, "b/stream-1");
    // Cut off from the store: the renewal asking for no backup may apply
    // with its answer lost, so it is never said recorded from this request
    // (from a review: the sender answered on its journal alone while the
    // record could still come to name a stream whose backup could take it
    // over).
    store.cut_off(NODE, true);
    let request = a.backup.want(NO_BACKUP);
    tokio::time::sleep(CONFIG.duration * 2).await;
    assert_ne!(
        *recorded.borrow(),
        (NO_BACKUP.to_owned(), request),
        "said recorded, unanswered"
    );
    store.cut_off(NODE, false);
    recorded
        .wait_for(|r| *r == (NO_BACKUP.to_owned(), request))
        .await
        .unwrap();
    a.stop.cancel();
    a.holder.await.unwrap();
}

/// The lease of an earlier start of `NODE` (never renewed again: it was
/// killed), naming a copy of its unwritten changes held by b.
async fn an_earlier_start_naming_a_copy(store: &MemoryRingStore) -> LeaseRecord {
    let earlier = LeaseRecord {
        holder: "an earlier start".to_owned(),
        renewals: 5,
        backup: "b/earlier/0".to_owned(),
        lease: None,
    };
    assert!(store.swap_lease(NODE, None, &earlier).await.unwrap());
    earlier
}

/// From a review: a node that lost its disk and started again took its
/// lease the moment the earlier start's lapsed, ahead of the backup whose
/// copy that lease named. Its users then loaded from a store that lacked
/// the copy (written ahead slowly), and its own changes to them, newer,
/// beat the copy's when it landed: acknowledged acks lost. A lease naming
/// a copy is left to that copy's backup for a lapse more.
#[tokio::test(start_paused = true)]
async fn a_restart_leaves_a_lease_naming_a_copy_to_its_backup_first() {
    let store = Arc::new(MemoryRingStore::default());
    let earlier = an_earlier_start_naming_a_copy(&store).await;
    let restarted = Start::new(&store);
    // The backup sees it lapsed a while after the restart does (it polls).
    tokio::time::sleep(CONFIG.lapse() + Duration::from_millis(700)).await;
    let takeover = LeaseRecord {
        holder: format!("{TAKEOVER_BY}b"),
        renewals: earlier.renewals + 1,
        backup: earlier.backup.clone(),
        lease: None,
    };
    let taken = store.swap_lease(NODE, Some(&earlier), &takeover).await;
    assert!(
        taken.unwrap(),
        "the restart took the lease first: {:?}",
        store.lease(NODE).await
    );
    assert!(!restarted.serves());
    // Done, the backup frees it: the restart takes it.
    let freed = LeaseRecord {
        holder: String::new(),
        renewals: takeover.renewals + 1,
        backup: NO_BACKUP.to_owned(),
        lease: None,
    };
    assert!(
        store
            .swap_lease(NODE, Some(&takeover), &freed)
            .await
            .unwrap()
    );
    tokio::time::timeout(CONFIG.lapse() * 3, restarted.until_serving(true))
        .await
        .expect("the restart serves once the takeover is done");
}

/// And a lease naming a copy nobody acts on (its backup died too) is taken
/// after that lapse more.
#[tokio::test(start_paused = true)]
async fn a_restart_takes_a_lease_naming_a_copy_nobody_acts_on_a_lapse_later() {
    let store = Arc::new(MemoryRingStore::default());
    an_earlier_start_naming_a_copy(&store).await;
    let started = Instant::now();
    let restarted = Start::new(&store);
    restarted.until_serving(true).await;
    let waited = started.elapsed();
    assert!(
        waited >= CONFIG.lapse() * 2 && waited <= CONFIG.lapse() * 3,
        "{waited:?}"
    );
}

/// Issue 37: a node that comes back drops what it held without writing it.
/// Started again in place while its backup takes it over, it waits; once
/// the takeover's record says the copy is written, the users it replayed
/// from its journal are dropped (the store has every change it answered),
/// not before (the copy might yet be lost with the backup).
#[tokio::test(start_paused = true)]
async fn a_start_being_taken_over_drops_what_it_replayed_once_the_copy_is_written() {
    let store = Arc::new(MemoryRingStore::default());
    let taking = LeaseRecord {
        holder: format!("{TAKEOVER_BY}b"),
        renewals: 1,
        backup: "b/a1/0".to_owned(),
        lease: None,
    };
    assert!(store.swap_lease(NODE, None, &taking).await.unwrap());
    let start = Start::new(&store);
    let cache = start.member.cache().clone();
    let mut acked = crate::read_state::UserReadStates::default();
    acked.ack(crate::read_state::Key::channel(10), 5, 1);
    cache.replay(crate::journal::Replayed {
        users: [(1, crate::store::UserWrite::of(1, &acked))].into(),
        ..crate::journal::Replayed::default()
    });
    tokio::time::sleep(CONFIG.lapse()).await;
    assert_eq!(
        cache.unwritten(),
        1,
        "dropped while the copy may be unwritten"
    );
    let written = LeaseRecord {
        renewals: 2,
        backup: NO_BACKUP.to_owned(),
        ..taking.clone()
    };
    assert!(
        store
            .swap_lease(NODE, Some(&taking), &written)
            .await
            .unwrap()
    );
    tokio::time::sleep(CONFIG.lapse()).await;
    assert_eq!(
        cache.unwritten(),
        0,
        "the replayed user is kept to be written"
    );
    assert!(!start.serves(), "served while taken over");
    start.crash();
}

/// Found in review of issue 54's shorter lease: the lease's duration was
/// not stored, so in a rolling upgrade that shortened the default a node of
/// the new build (1.2 s) took the lease of a node of the old one (3 s)
/// 1.5 s after its last renewal, while it still served under it. A record
/// names its holder's lease now, and one that names none is taken for one
/// of 3 s: either is waited out, whatever this node's own.
#[tokio::test(start_paused = true)]
async fn a_lease_longer_than_the_watchers_own_is_waited_out() {
    let short = LeaseConfig::default();
    for lease in [Some(Duration::from_secs(3)), None] {
        let store = MemoryRingStore::default();
        let record = LeaseRecord {
            holder: "an incarnation of another build".to_owned(),
            renewals: 1,
            backup: NO_BACKUP.to_owned(),
            lease,
        };
        assert!(store.swap_lease(NODE, None, &record).await.unwrap());
        let started = Instant::now();
        let seen = watch(&store, NODE, short).await.unwrap();
        assert_eq!(seen, Seen::Lapsed(record));
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(3) + short.margin,
            "a {lease:?} lease taken {waited:?} after its last renewal"
        );
    }
}

/// Found by `loadtest/cluster.sh` once the lease was 1.2 s: a node waited
/// a quarter of the lease after each renewal ended, so one slow renewal
/// and one given up (no answer within a quarter of the lease) left its
/// lease to lapse before the next applied, and it refused everything for a
/// moment. Renewals now start a quarter of the lease apart.
#[tokio::test(start_paused = true)]
async fn a_slow_renewal_and_one_given_up_leave_no_gap() {
    let store = Arc::new(MemoryRingStore::default());
    let start = Start::new(&store);
    start.until_serving(true).await;
    // Slow but in time, given up, slow but in time.
    let slow = CONFIG.renew_every() - Duration::from_millis(50);
    store.slow_swaps([slow, CONFIG.renew_every() * 2, slow]);
    assert_eq!(
        start.served_throughout(CONFIG.duration * 2).await,
        Some(true),
        "a gap in the lease between two renewals that applied"
    );
}
