//! Never two owners, with leases: freezes, cuts and takeovers, randomized,
//! seeded, on a paused clock (issue 37, "Never two owners").
//!
//! Three nodes hold leases they renew ([`Holder`]) in a ring kept in
//! memory, follow the ring and hand users over through in-process peers.
//! Every call a node makes to the ring store takes a random while and may
//! apply after its caller stopped waiting. Now and then one node is:
//! - **frozen** (SIGSTOP): nothing it sends goes out, nothing sent to it is
//!   handled, answers to it wait; a call already on the wire (a renewal)
//!   still applies, late. Requests sent to it wait in its socket and are
//!   handled when it wakes, then judged on the clock of that instant;
//! - **cut off from the ring store** (its Cassandra): every call fails, but
//!   its peers and clients still reach it;
//! - **killed** (kill -9), also while slots move, and started again a
//!   while later as a new incarnation, empty.
//!
//! Usually the fleet heals before the next fault; one time in three the
//! next comes first (a backup frozen mid-takeover, two nodes down at once),
//! and at the end the fleet must heal by itself.
//!
//! Each node watches the lease of the node it backs up (the next by id) as
//! a backup does (`cluster::backup::takeover`: [`lease::watch`], then the
//! lease taken and renewed while [`admin::take_over`] runs, then freed)
//! and takes it over once it is seen unrenewed for the lease plus the
//! margin, while holding its own. A node taken over rejoins once it holds
//! its lease again, as `--join-weight` has it do.
//! Clients send acks to the owners by the ring as stored (a gateway's
//! table), forwarded to the previous owner while a slot is acquired.
//!
//! After every change applied (its slot) and every 100 ms of simulated time
//! (every slot), no slot is served by two nodes as a request would find
//! them, the lease counted: a node that lost its lease has stopped before
//! another starts. What the
//! dead node held is not checked here: a backup's copy is
//! (`cluster::backup::tests`, and the Cassandra fleet tests).
//!
//! It fails if a takeover comes a second early (watching for the lease
//! alone, no margin, minus a second), or if a slot past its node's lease is
//! still served.
//!
//! `FAILOVER_SEEDS=N` sets how many seeds run (default 12),
//! `FAILOVER_SEED=S` replays one, `FAILOVER_LOG=1` prints the nodes' logs;
//! a failing seed prints itself.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use readstates::cache::{Cache, CacheConfig};
use readstates::cluster::admin::{self, RingChange};
use readstates::cluster::backup::backup_of;
use readstates::cluster::handoff::{Handoff, Part};
use readstates::cluster::lease::{self, BackupName, Holder, LeaseConfig, Seen, TAKEOVER_BY};
use readstates::cluster::member::{Member, MemberConfig};
use readstates::cluster::peers::Peers;
use readstates::cluster::ring_store::memory::MemoryRingStore;
use readstates::cluster::ring_store::{LeaseRecord, NO_BACKUP, RingRecord, RingStore};
use readstates::error::Error;
use readstates::ownership::{Ownership, SlotState};
use readstates::read_state::Key;
use readstates::store::memory::MemoryStore;
use readstates::store::{Store, StoreError};
use readstates::test_support::{run_paused, seeds};
use readstates::write_behind::{WriteBehind, WriteBehindConfig};
use readstates_routing::{Node, SLOTS, Slot, slot_of};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const NODES: [&str; 3] = ["a", "b", "c"];
const USERS: u64 = 200;
const CLIENTS: u64 = 4;
const CHANNEL: u64 = 7;
/// How long the faults go on; then the fleet settles.
const CHAOS: Duration = Duration::from_secs(40);

fn address(id: &str) -> String {
    format!("{id}:1")
}

/// Whether a node runs, whether it reaches the ring store, and whether it
/// was killed.
#[derive(Debug)]
struct Reach {
    frozen: watch::Sender<bool>,
    cut: AtomicBool,
    killed: CancellationToken,
}

impl Reach {
    fn new() -> Arc<Reach> {
        Arc::new(Reach {
            frozen: watch::Sender::new(false),
            cut: AtomicBool::new(false),
            killed: CancellationToken::new(),
        })
    }

    /// `call` to this node, cut if it is killed meanwhile (its connections
    /// reset).
    async fn unless_killed<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, String>>,
    ) -> Result<T, String> {
        tokio::select! {
            biased;
            () = self.killed.cancelled() => Err("the node was killed".into()),
            result = call => result,
        }
    }

    /// Returns once the node runs.
    async fn running(&self) {
        let mut frozen = self.frozen.subscribe();
        let _ = frozen.wait_for(|frozen| !frozen).await;
    }
}

/// The ring store as one node reaches it: a call waits while the node is
/// frozen, fails while it is cut off, takes a while on the wire (up to 20
/// ms, or 300 ms one time in ten) and applies even if the node froze
/// meanwhile; its answer is seen only once the node runs, and is lost if
/// the node is cut off by then.
#[derive(Debug)]
struct Reached {
    ring: Arc<MemoryRingStore>,
    reach: Arc<Reach>,
    rng: Mutex<fastrand::Rng>,
}

impl Reached {
    async fn call<T, F>(&self, call: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        self.reach.running().await;
        if self.reach.cut.load(Ordering::SeqCst) {
            return Err(StoreError::new("ring", "cut off"));
        }
        // Mostly quick, one call in ten slow.
        let wire = {
            let mut rng = self.rng.lock().unwrap();
            Duration::from_millis(if rng.u8(..10) == 0 {
                rng.u64(..300)
            } else {
                rng.u64(..20)
            })
        };
        tokio::time::sleep(wire / 2).await;
        let answer = call.await;
        tokio::time::sleep(wire / 2).await;
        self.reach.running().await;
        if self.reach.cut.load(Ordering::SeqCst) {
            // Applied, its answer lost.
            return Err(StoreError::new("ring", "cut off"));
        }
        answer
    }
}

#[async_trait]
impl RingStore for Reached {
    async fn load(&self) -> Result<RingRecord, StoreError> {
        self.call(self.ring.load()).await
    }

    async fn advance(&self, next: &RingRecord) -> Result<bool, StoreError> {
        self.call(self.ring.advance(next)).await
    }

    async fn release(&self, epoch: u64, node: &str) -> Result<bool, StoreError> {
        self.call(self.ring.release(epoch, node)).await
    }

    async fn report(&self, node: &str, epoch: u64) -> Result<(), StoreError> {
        self.call(self.ring.report(node, epoch)).await
    }

    async fn progress(&self) -> Result<BTreeMap<String, u64>, StoreError> {
        self.call(self.ring.progress()).await
    }

    async fn drained_weight(&self, node: &str) -> Result<Option<u32>, StoreError> {
        self.call(self.ring.drained_weight(node)).await
    }

    async fn set_drained_weight(&self, node: &str, weight: Option<u32>) -> Result<(), StoreError> {
        self.call(self.ring.set_drained_weight(node, weight)).await
    }

    async fn lease(&self, node: &str) -> Result<Option<LeaseRecord>, StoreError> {
        self.call(self.ring.lease(node)).await
    }

    async fn swap_lease(
        &self,
        node: &str,
        seen: Option<&LeaseRecord>,
        next: &LeaseRecord,
    ) -> Result<bool, StoreError> {
        self.call(self.ring.swap_lease(node, seen, next)).await
    }
}

/// Nodes call each other in-process; a call to a frozen node waits until it
/// runs, and so does its answer to a frozen caller.
#[derive(Debug, Default)]
struct SimPeers {
    nodes: Mutex<HashMap<String, (Member, Arc<Reach>)>>,
}

impl SimPeers {
    fn at(&self, address: &str) -> Result<(Member, Arc<Reach>), String> {
        let nodes = self.nodes.lock().unwrap();
        nodes.get(address).cloned().ok_or("no such node".into())
    }

    fn reach_of(&self, id: &str) -> Option<Arc<Reach>> {
        let nodes = self.nodes.lock().unwrap();
        nodes.get(&address(id)).map(|(_, reach)| reach.clone())
    }
}

#[async_trait]
impl Peers for SimPeers {
    async fn release_slots(
        &self,
        address: &str,
        epoch: u64,
        slots: &[Slot],
        from: &str,
    ) -> Result<(), String> {
        let (member, reach) = self.at(address)?;
        let released = reach.unless_killed(async {
            reach.running().await;
            let released = member.release_slots(epoch, slots).await;
            reach.running().await;
            released.map_err(|e| e.to_string())
        });
        let released = released.await;
        if let Some(caller) = self.reach_of(from) {
            caller.running().await;
        }
        released
    }

    async fn hand_over(
        &self,
        address: &str,
        handoff: Handoff,
        parts: BoxStream<'static, Part>,
    ) -> Result<usize, String> {
        let (member, reach) = self.at(address)?;
        reach.running().await;
        // A slow link: a handoff takes a while, and faults come meanwhile.
        let parts = parts
            .then(|part| async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(part)
            })
            .boxed();
        // Served in a task of its own, as a server does: a sender killed
        // midway ends its stream, and the receiver sees it end.
        let receiving = tokio::spawn(async move { member.receive(handoff, parts).await });
        let received = reach.unless_killed(async {
            let received = receiving.await.map_err(|e| e.to_string())?;
            reach.running().await;
            received.map_err(|e| e.to_string())
        });
        received.await
    }
}

/// One node: its cache and write-behind, ring follower, lease, backup's
/// watch and reach.
struct SimNode {
    id: &'static str,
    cache: Arc<Cache>,
    _write_behind: WriteBehind,
    member: Member,
    reach: Arc<Reach>,
    ring: Arc<Reached>,
    /// Its ring follower, lease holder and watch: what a kill stops.
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

/// What every node shares: the stores, the peers, the takeovers counted,
/// and what ends the run.
struct World {
    store: Arc<MemoryStore>,
    ring: Arc<MemoryRingStore>,
    peers: Arc<SimPeers>,
    /// Takeovers done, and given up.
    taken: Arc<Mutex<(usize, usize)>>,
    stop: CancellationToken,
}

impl SimNode {
    /// A node that just started (a new incarnation, with an empty cache).
    fn start(id: &'static str, seed: u64, world: &World) -> Arc<SimNode> {
        let reach = Reach::new();
        let reached = Arc::new(Reached {
            ring: world.ring.clone(),
            reach: reach.clone(),
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
        });
        let config = CacheConfig {
            capacity: 1_000,
            shards: 2,
            write_delay: Duration::from_millis(500),
            // Handoffs of many parts.
            handoff_chunk: 4,
            ..CacheConfig::default()
        };
        let cache = Cache::with_ownership(
            config,
            world.store.clone() as Arc<dyn Store>,
            Arc::new(Ownership::member()),
        );
        let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
        let member = Member::new(
            id.to_owned(),
            reached.clone(),
            cache.clone(),
            world.peers.clone(),
            MemberConfig {
                ring_poll: Duration::from_millis(100),
                retry: Duration::from_millis(50),
            },
        );
        (world.peers.nodes.lock().unwrap()).insert(address(id), (member.clone(), reach.clone()));
        let holder = Holder::new(
            reached.clone(),
            member.clone(),
            LeaseConfig::default(),
            BackupName::new(),
        );
        let tasks = vec![
            member.start(world.stop.clone()),
            tokio::spawn(holder.run(world.stop.clone())),
        ];
        let node = Arc::new(SimNode {
            id,
            cache,
            _write_behind: write_behind,
            member,
            reach,
            ring: reached,
            tasks: Mutex::new(tasks),
        });
        let watching = watch_and_take_over(
            node.clone(),
            world.peers.clone(),
            world.taken.clone(),
            world.stop.clone(),
        );
        node.tasks.lock().unwrap().push(tokio::spawn(watching));
        node
    }

    /// kill -9: nothing of it runs any more, nothing reaches it, and it
    /// serves nothing (its lease is left to lapse).
    fn kill(&self, peers: &SimPeers) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
        self.reach.killed.cancel();
        let ownership = self.member.ownership();
        ownership.lease(Some(tokio::time::Instant::now()));
        for slot in 0..SLOTS as Slot {
            ownership.set(slot, SlotState::NotOwner);
        }
        let mut nodes = peers.nodes.lock().unwrap();
        if nodes
            .get(&address(self.id))
            .is_some_and(|(_, reach)| Arc::ptr_eq(reach, &self.reach))
        {
            nodes.remove(&address(self.id));
        }
    }
}

/// The three nodes, each replaced by a new incarnation when it restarts.
struct Fleet {
    nodes: Vec<Mutex<Arc<SimNode>>>,
}

impl Fleet {
    fn all(&self) -> Vec<Arc<SimNode>> {
        self.nodes
            .iter()
            .map(|n| n.lock().unwrap().clone())
            .collect()
    }

    fn get(&self, id: &str) -> Arc<SimNode> {
        let index = NODES.iter().position(|&n| n == id).expect("a node");
        self.nodes[index].lock().unwrap().clone()
    }
}

/// What happened in one seed.
#[derive(Debug, Default)]
struct Ran {
    applied: usize,
    /// Requests that waited in a frozen node's socket, and of those, the
    /// ones it refused on waking.
    queued: usize,
    refused_on_waking: usize,
    freezes: usize,
    cuts: usize,
    kills: usize,
    /// Kills while slots moved (a handoff under way).
    kills_mid_handoff: usize,
    takeovers: usize,
    takeovers_failed: usize,
    /// Faults that came before the fleet healed from the one before.
    overlapping: usize,
}

/// No slot is served by two nodes, as a request arriving now would find it.
fn check_one_owner(nodes: &[Arc<SimNode>]) {
    for slot in 0..SLOTS as Slot {
        check_slot(nodes, slot);
    }
}

fn check_slot(nodes: &[Arc<SimNode>], slot: Slot) {
    let serving: Vec<&str> = (nodes.iter())
        .filter(|n| n.member.ownership().state(slot) == SlotState::Serving)
        .map(|n| n.id)
        .collect();
    assert!(serving.len() <= 1, "slot {slot} served by {serving:?}");
}

/// Takes over the node `me` backs up once its lease lapses, as a backup
/// does (`cluster::backup::takeover`, without the copy: see the module's
/// doc), while `me` holds its own: takes the lapsed lease, renews it while
/// it gives the node's slots to the others, then frees it.
async fn watch_and_take_over(
    me: Arc<SimNode>,
    peers: Arc<SimPeers>,
    taken: Arc<Mutex<(usize, usize)>>,
    stop: CancellationToken,
) {
    let config = LeaseConfig::default();
    while !stop.is_cancelled() {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let Ok(record) = me.ring.load().await else {
            continue;
        };
        let watched = (record.ring.nodes().iter())
            .find(|n| backup_of(&record.ring, &n.id).is_some_and(|b| b.id == me.id))
            .map(|n| n.id.clone());
        let Some(watched) = watched else { continue };
        let Ok(Seen::Lapsed(seen)) = lease::watch(&*me.ring, &watched, config).await else {
            continue;
        };
        if !me.member.ownership().leased() {
            continue;
        }
        let mut held = LeaseRecord {
            holder: format!("{TAKEOVER_BY}{}", me.id),
            renewals: seen.renewals + 1,
            backup: seen.backup.clone(),
        };
        if !matches!(
            me.ring.swap_lease(&watched, Some(&seen), &held).await,
            Ok(true)
        ) {
            continue;
        }
        let renewing = async {
            loop {
                tokio::time::sleep(config.renew_every()).await;
                let next = LeaseRecord {
                    renewals: held.renewals + 1,
                    ..held.clone()
                };
                if let Ok(true) = me.ring.swap_lease(&watched, Some(&held), &next).await {
                    held = next;
                }
            }
        };
        let result = tokio::select! {
            result = admin::take_over(&*me.ring, &*peers, me.id, &watched) => result,
            () = renewing => unreachable!("renews until the takeover is done"),
        };
        match result {
            Ok(_) => taken.lock().unwrap().0 += 1,
            // The store failed: the node stays in the ring (an operator's).
            Err(_) => taken.lock().unwrap().1 += 1,
        }
        let free = LeaseRecord {
            holder: String::new(),
            renewals: held.renewals + 1,
            backup: NO_BACKUP.to_owned(),
        };
        let _ = me.ring.swap_lease(&watched, Some(&held), &free).await;
    }
}

/// Sends acks to the owners by the ring as stored until `stop`; a refused
/// one is not applied, and the next ack goes on.
async fn client(
    client: u64,
    seed: u64,
    fleet: Arc<Fleet>,
    ring: Arc<MemoryRingStore>,
    ran: Arc<Mutex<Ran>>,
    stop: CancellationToken,
) {
    let mut rng = fastrand::Rng::with_seed(seed * 31 + client);
    let mut message_id = 0;
    while !stop.is_cancelled() {
        tokio::time::sleep(Duration::from_millis(rng.u64(..40))).await;
        message_id += 1;
        let user = 1 + rng.u64(..USERS);
        let Ok(record) = ring.load().await else {
            continue;
        };
        let Some(owner) = record.ring.owner_of(user) else {
            continue;
        };
        let node = fleet.get(&owner.id);
        let queued = *node.reach.frozen.borrow();
        // Waits in the socket of a frozen node.
        node.reach.running().await;
        let mut result = ack(&node, user, message_id).await;
        if let Err(Error::NotServed {
            state: SlotState::Acquiring,
            ..
        }) = result
            && let Some(previous) = record.previous.owner_of(user)
        {
            // The new owner forwards to the previous one (`grpc::route`).
            let previous = fleet.get(&previous.id);
            previous.reach.running().await;
            result = ack(&previous, user, message_id).await;
        }
        let mut ran = ran.lock().unwrap();
        ran.queued += usize::from(queued);
        match result {
            Ok(()) => {
                ran.applied += 1;
                check_slot(&fleet.all(), slot_of(user));
            }
            Err(Error::NotServed { .. } | Error::LeaseLapsed) => {
                ran.refused_on_waking += usize::from(queued);
            }
            Err(Error::LoadFailed { .. } | Error::ShuttingDown) => {}
            Err(e) => panic!("unexpected {e}"),
        }
    }
}

/// One ack to `node`.
async fn ack(node: &SimNode, user: u64, message_id: u64) -> Result<(), Error> {
    node.cache
        .update_many(&[user], |_, state, now| {
            state.ack(Key::channel(CHANNEL), message_id, now);
        })
        .await
        .map(|_| ())
}

async fn simulate(seed: u64) -> Ran {
    let mut rng = fastrand::Rng::with_seed(seed);
    let world = World {
        store: Arc::new(MemoryStore::new()),
        ring: Arc::new(MemoryRingStore::default()),
        peers: Arc::new(SimPeers::default()),
        taken: Arc::new(Mutex::new((0, 0))),
        stop: CancellationToken::new(),
    };
    let ring = world.ring.clone();
    let mut incarnations = 0;
    let mut next_seed = || {
        incarnations += 1;
        seed * 101 + incarnations
    };
    let fleet = Arc::new(Fleet {
        nodes: (NODES.iter())
            .map(|id| Mutex::new(SimNode::start(id, next_seed(), &world)))
            .collect(),
    });
    for id in NODES {
        change(&ring, RingChange::Add(node(id))).await;
    }
    let epoch = ring.load().await.unwrap().ring.epoch();
    admin::wait_served(&*ring, epoch, Duration::from_secs(30))
        .await
        .expect("the fleet serves");

    let ran = Arc::new(Mutex::new(Ran::default()));
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        clients.push(tokio::spawn(client(
            c,
            seed,
            fleet.clone(),
            ring.clone(),
            ran.clone(),
            world.stop.clone(),
        )));
    }
    let checker = {
        let (fleet, stop) = (fleet.clone(), world.stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                check_one_owner(&fleet.all());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    // A freeze, a cut or a kill (and a restart a while later), past the
    // lease and margin half the time.
    let started = tokio::time::Instant::now();
    let (mut freezes, mut cuts, mut kills, mut kills_mid_handoff) = (0, 0, 0, 0);
    let mut overlapping = 0;
    while started.elapsed() < CHAOS {
        // Now and then while the last rejoin's handoffs are under way.
        tokio::time::sleep(Duration::from_millis(rng.u64(..2_500) >> rng.u32(..4))).await;
        let index = rng.usize(..NODES.len());
        let node = fleet.nodes[index].lock().unwrap().clone();
        let lasting = if rng.bool() {
            Duration::from_millis(5_000 + rng.u64(..4_000))
        } else {
            Duration::from_millis(rng.u64(..4_000))
        };
        match rng.u8(..3) {
            0 => {
                freezes += 1;
                node.reach.frozen.send_replace(true);
                tokio::time::sleep(lasting).await;
                node.reach.frozen.send_replace(false);
            }
            1 => {
                cuts += 1;
                node.reach.cut.store(true, Ordering::SeqCst);
                tokio::time::sleep(lasting).await;
                node.reach.cut.store(false, Ordering::SeqCst);
            }
            _ => {
                kills += 1;
                let moving = |n: &Arc<SimNode>| {
                    (0..SLOTS as Slot).any(|slot| {
                        let state = n.member.ownership().assigned(slot);
                        matches!(state, SlotState::Acquiring | SlotState::Releasing)
                    })
                };
                kills_mid_handoff += usize::from(fleet.all().iter().any(moving));
                node.kill(&world.peers);
                tokio::time::sleep(lasting).await;
                let restarted = SimNode::start(NODES[index], next_seed(), &world);
                *fleet.nodes[index].lock().unwrap() = restarted;
            }
        }
        // Now and then the next fault comes before the fleet healed: two
        // nodes may then be down at once, or a backup fail mid-takeover.
        if rng.u8(..3) > 0 {
            healed(&fleet, &ring, rng.bool()).await;
        } else {
            overlapping += 1;
        }
    }
    // Whatever came meanwhile, the fleet heals by itself.
    healed(&fleet, &ring, false).await;
    world.stop.cancel();
    for client in clients {
        client.await.expect("a client");
    }
    checker.await.expect("no slot served twice");
    let mut ran = std::mem::take(&mut *ran.lock().unwrap());
    (ran.freezes, ran.cuts, ran.kills) = (freezes, cuts, kills);
    ran.kills_mid_handoff = kills_mid_handoff;
    ran.overlapping = overlapping;
    (ran.takeovers, ran.takeovers_failed) = *world.taken.lock().unwrap();
    for node in fleet.all() {
        let tasks: Vec<_> = node.tasks.lock().unwrap().drain(..).collect();
        for task in tasks {
            task.await.expect("a node's task");
        }
    }
    ran
}

/// Waits until the fleet is whole again after a fault: the node taken
/// over (if it was) back in the ring once it holds its lease again (as
/// `--join-weight` has a node do), every node holding its lease, and,
/// unless `moving` (the next fault then comes while slots move), the epoch
/// served.
async fn healed(fleet: &Fleet, ring: &MemoryRingStore, moving: bool) {
    let started = tokio::time::Instant::now();
    loop {
        let record = ring.load().await.unwrap();
        let nodes = fleet.all();
        let leased: Vec<bool> = nodes
            .iter()
            .map(|n| n.member.ownership().leased())
            .collect();
        let progress = ring.progress().await.unwrap();
        let taking = nodes.iter().any(|n| record.ring.node(n.id).is_none());
        if !taking
            && leased.iter().all(|&l| l)
            && (moving || record.waiting_on(&progress).is_empty())
        {
            return;
        }
        for (node, &leased) in nodes.iter().zip(&leased) {
            if leased && record.ring.node(node.id).is_none() {
                change(ring, RingChange::Add(self::node(node.id))).await;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the fleet never healed: leases held {leased:?}, {record:?}, progress {progress:?}, \
             lease records {:?}",
            [
                ring.lease("a").await,
                ring.lease("b").await,
                ring.lease("c").await
            ],
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn node(id: &str) -> Node {
    Node {
        id: id.to_owned(),
        address: address(id),
        weight: 100,
    }
}

/// Makes `ring_change` once the previous epoch is served.
async fn change(ring: &MemoryRingStore, ring_change: RingChange) {
    let started = tokio::time::Instant::now();
    loop {
        match admin::change(ring, ring_change.clone()).await {
            Ok(_) => return,
            Err(admin::AdminError::HandoffUnderWay { .. }) => {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "the ring never served {ring_change:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn no_slot_is_served_twice_through_freezes_cuts_and_takeovers() {
    let seeds = seeds("FAILOVER_SEED", "FAILOVER_SEEDS", 12);
    if std::env::var("FAILOVER_LOG").is_ok() {
        tracing_subscriber::fmt().with_env_filter("info").init();
    }
    let started = std::time::Instant::now();
    let mut total = Ran::default();
    for &seed in &seeds {
        let ran = run_paused("failover simulation", "FAILOVER_SEED", seed, simulate);
        total.applied += ran.applied;
        total.queued += ran.queued;
        total.refused_on_waking += ran.refused_on_waking;
        total.freezes += ran.freezes;
        total.cuts += ran.cuts;
        total.kills += ran.kills;
        total.kills_mid_handoff += ran.kills_mid_handoff;
        total.takeovers += ran.takeovers;
        total.takeovers_failed += ran.takeovers_failed;
        total.overlapping += ran.overlapping;
    }
    let Ran {
        applied,
        queued,
        refused_on_waking,
        freezes,
        cuts,
        kills,
        kills_mid_handoff,
        takeovers,
        takeovers_failed,
        overlapping,
    } = total;
    println!(
        "failover simulation: {} seeds, {applied} acks applied, {freezes} freezes, {cuts} cuts, {kills} kills \
         ({kills_mid_handoff} while slots moved), {overlapping} before the fleet healed, \
         {takeovers} takeovers ({takeovers_failed} given up, the store failing), {queued} requests waited in a frozen node's socket \
         ({refused_on_waking} refused when it woke), in {:.1?}",
        seeds.len(),
        started.elapsed()
    );
    if seeds.len() > 5 {
        assert!(
            takeovers > 0
                && refused_on_waking > 0
                && kills_mid_handoff > 0
                && overlapping > 0
                && applied > 1000,
            "no takeover, no request refused by a node that woke, or no kill mid-handoff: the \
             simulation tests nothing of them"
        );
    }
}
