//! The fleet's handoff, randomized, seeded, on a paused clock.
//!
//! Three nodes share one store (which fails and slows down at random) and a
//! ring kept in memory; nodes ask each other to release slots through
//! in-process peers that fail and stall at random too, and hand users over
//! through them, slowly, cut, duplicated, late or unanswered. Clients route
//! each operation to the owner in the ring as stored (a gateway with a fresh
//! table), which passes it to the previous owner while it acquires the slot
//! (as nodes forward), and retry a refusal a few times. Meanwhile an operator changes
//! the ring over and over: a canary joins at weight 0, ramps to 1% and to
//! half, goes back to 0; a node drains and returns; slots move back and
//! forth; and now and then a node restarts (gracefully, as on SIGTERM
//! without a drain: it stops serving, writes everything, and comes back
//! empty), often while it sends or receives a handoff.
//!
//! The operations count: each MessageCreated raises the unread count of each
//! of its users by exactly one, all of a part's users or none (the parts of
//! a message are split by owner, as the service splits them), and each Ack
//! moves a read state forward. Each client owns its users, so a user's
//! operations have one order, and the model applies every acknowledged one
//! in it.
//! After every step no slot is served by two nodes; at the end, after every
//! node has shut down, the store equals the model: nothing lost, nothing
//! counted twice, whatever moved in between.
//!
//! One channel is counted by channel (see `docs/counting.md`): a message to
//! it is taken by the channel's owner (the owner of its slot, which moves
//! with the ring like a user's), then mentions its users by the owner's
//! answer. The owners' copies of the channel reach the other nodes late,
//! twice or not at all. The store must hold every message an owner
//! answered it took, and each mention as the model counts it; every copy
//! must end equal to the owner's.
//!
//! Users also follow a thread by being mentioned in its replies: their
//! thread read states, and the thread's parent, must move with them.
//!
//! `FLEET_SEEDS=N` sets how many seeds run (default 60), `FLEET_SEED=S`
//! replays one; a failing seed prints itself.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use readstates::cache::handoff::Chunk;
use readstates::cache::{Cache, CacheConfig};
use readstates::cluster::admin::{self, RingChange};
use readstates::cluster::handoff::{Handoff, Part};
use readstates::cluster::member::{Member, MemberConfig};
use readstates::cluster::peers::Peers;
use readstates::cluster::ring_store::RingStore;
use readstates::cluster::ring_store::memory::MemoryRingStore;
use readstates::error::Error;
use readstates::ownership::{Ownership, SlotState};
use readstates::read_state::threads::Replied;
use readstates::read_state::{Key, Kind, NoChannels};
use readstates::store::Store;
use readstates::store::faulty::{Effect, Fault, FaultyStore, Operation};
use readstates::test_support::{run_paused, seeds};
use readstates::write_behind::{WriteBehind, WriteBehindConfig};
use readstates_routing::{Node, SLOTS, Slot};
use tokio_util::sync::CancellationToken;

const NODES: [&str; 3] = ["a", "b", "canary"];
const USERS: u64 = 40;
const CLIENTS: usize = 3;
const OPS_PER_CLIENT: usize = 40;
const CHANNEL: u64 = 7;
/// A thread of [`CHANNEL`] that users follow by being mentioned in its
/// replies: its read states, and their parent, move with their users.
const THREAD: u64 = 29;
/// The channel counted by channel, from its first message: its slot moves
/// with most of the plan's ring changes.
const BY_CHANNEL: u64 = 28;
/// Tries of one operation (a refusal waits a little and tries again).
const TRIES: usize = 8;

fn address(id: &str) -> String {
    format!("{id}:1")
}

/// One node: its cache, write-behind and ring follower.
struct SimNode {
    cache: Arc<Cache>,
    member: Member,
    write_behind: Option<WriteBehind>,
    stop: CancellationToken,
}

impl SimNode {
    /// A node that just started: empty, following the ring, called by
    /// the others through `peers`.
    fn start(
        id: &str,
        config: CacheConfig,
        store: &Arc<FaultyStore>,
        ring: &Arc<MemoryRingStore>,
        peers: &Arc<SimPeers>,
    ) -> SimNode {
        let node = SimNode::build(id, config, store, ring, peers);
        node.member.start(node.stop.clone());
        node
    }

    /// [`SimNode::start`] after a restart: first the channels counted by
    /// channel as the store holds them (as the service loads them before
    /// it serves), retried while the store fails.
    async fn restart(
        id: &str,
        config: CacheConfig,
        store: &Arc<FaultyStore>,
        ring: &Arc<MemoryRingStore>,
        peers: &Arc<SimPeers>,
    ) -> SimNode {
        let node = SimNode::build(id, config, store, ring, peers);
        while node.cache.channels().load_stored().await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        node.member.start(node.stop.clone());
        node
    }

    /// A node, not following the ring yet.
    fn build(
        id: &str,
        config: CacheConfig,
        store: &Arc<FaultyStore>,
        ring: &Arc<MemoryRingStore>,
        peers: &Arc<SimPeers>,
    ) -> SimNode {
        let cache =
            Cache::with_ownership(config, store.clone() as Arc<dyn Store>, unleased_member());
        let write_behind = WriteBehind::start(cache.clone(), WriteBehindConfig::default());
        let member = Member::new(
            id.to_owned(),
            ring.clone(),
            cache.clone(),
            peers.clone(),
            MemberConfig {
                ring_poll: Duration::from_millis(100),
                retry: Duration::from_millis(50),
            },
        );
        let stop = CancellationToken::new();
        peers
            .members
            .lock()
            .unwrap()
            .insert(address(id), (member.clone(), stop.clone()));
        cache.channels().keep_changed();
        SimNode {
            cache,
            member,
            write_behind: Some(write_behind),
            stop,
        }
    }

    /// Stops `node` as on SIGTERM without a drain: its calls are cut, it
    /// serves nothing more once the changes under way are applied, and it
    /// writes everything.
    async fn stop(node: &Mutex<SimNode>) {
        let (cache, write_behind) = {
            let mut node = node.lock().unwrap();
            node.stop.cancel();
            for slot in 0..SLOTS as Slot {
                node.member.ownership().set(slot, SlotState::NotOwner);
            }
            (node.cache.clone(), node.write_behind.take())
        };
        cache.settled_users(|_| false).await;
        let report = write_behind
            .expect("running")
            .shutdown(Duration::from_secs(60))
            .await;
        assert_eq!(report.unwritten, 0, "a node could not write everything");
    }
}

/// What the copier of each node sends the others, every 100 ms (and all it
/// owns every 5 s), lost, late or twice at random, until `stop`.
async fn copy_channels(nodes: Arc<Vec<Mutex<SimNode>>>, seed: u64, stop: CancellationToken) {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0xc0b1);
    let mut ticks = 0u64;
    while !stop.is_cancelled() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        ticks += 1;
        for from in 0..nodes.len() {
            let (channels, ownership) = {
                let node = nodes[from].lock().unwrap();
                (
                    node.cache.channels().clone(),
                    node.cache.ownership().clone(),
                )
            };
            let mut copies = channels.take_changed();
            if ticks.is_multiple_of(50) {
                copies = channels.all_of(|id| ownership.state_of(id) == SlotState::Serving);
            }
            if copies.is_empty() {
                continue;
            }
            for to in (0..nodes.len()).filter(|&to| to != from) {
                let roll = rng.f64();
                let times = match roll {
                    r if r < 0.2 => 0,
                    r if r < 0.3 => 2,
                    _ => 1,
                };
                let late = (roll > 0.8).then(|| Duration::from_millis(rng.u64(..1_000)));
                let (nodes, copies) = (nodes.clone(), copies.clone());
                let deliver = async move {
                    if let Some(late) = late {
                        tokio::time::sleep(late).await;
                    }
                    for _ in 0..times {
                        let cache = nodes[to].lock().unwrap().cache.clone();
                        let ownership = cache.ownership().clone();
                        cache.channels().copy_in(copies.clone(), |id| {
                            ownership.state_of(id) == SlotState::Serving
                        });
                    }
                };
                tokio::spawn(deliver);
            }
        }
    }
}

/// What the store must hold of a user's read state of [`BY_CHANNEL`], which
/// only mentions change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Mentioned {
    last_acked_id: u64,
    last_message_id: u64,
    mention_count: u16,
}

/// Nodes call each other's `ReleaseSlots` and `HandOver` directly; a call
/// fails or stalls at random (a partition that heals), and a handoff breaks
/// in every way it can (see [`SimPeers::hand_over`]).
#[derive(Debug, Default)]
struct SimPeers {
    /// Each node's member, and the token that stops it (its calls cut).
    members: Members,
    rng: Mutex<Option<fastrand::Rng>>,
    /// Users installed by handoffs whose sender was told so.
    handed: std::sync::atomic::AtomicUsize,
    /// Users a handoff sent again, having changed since their copy.
    again: Arc<std::sync::atomic::AtomicUsize>,
    /// Handoffs cut by their sender or receiver stopping.
    cut: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl Peers for SimPeers {
    async fn release_slots(
        &self,
        address: &str,
        epoch: u64,
        slots: &[Slot],
        _from: &str,
    ) -> Result<(), String> {
        let roll = self.roll();
        if roll < 0.2 {
            return Err("partitioned".into());
        }
        if roll < 0.3 {
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
        release_at(&self.members, address, epoch, slots).await
    }

    /// A handoff fails before anything arrives, is cut at a random part,
    /// arrives but its answer is lost, arrives twice, or late; otherwise
    /// its parts arrive as they are sent (the receiver holds the copy
    /// ahead while the sender still serves the users).
    async fn hand_over(
        &self,
        address: &str,
        handoff: Handoff,
        parts: BoxStream<'static, Part>,
    ) -> Result<usize, String> {
        // Dropped midway: its sender stopped.
        let mut cut = Cut {
            count: &self.cut,
            armed: true,
        };
        let received = self.deliver(address, handoff, parts).await;
        cut.armed = matches!(&received, Err(e) if e.contains(STOPPED));
        received
    }
}

/// Counts a handoff cut by a node stopping, unless disarmed.
struct Cut<'a> {
    count: &'a std::sync::atomic::AtomicUsize,
    armed: bool,
}

impl Drop for Cut<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.count
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl SimPeers {
    /// What becomes of a handoff (see [`SimPeers::hand_over`]).
    async fn deliver(
        &self,
        address: &str,
        handoff: Handoff,
        parts: BoxStream<'static, Part>,
    ) -> Result<usize, String> {
        let roll = self.roll();
        if roll < 0.1 {
            return Err("partitioned".into());
        }
        let (member, stopped) = member_at(&self.members, address)?;
        // A slow link: each part takes up to 400 ms, so the users change
        // while the copy ahead is under way.
        let pace = self
            .rng
            .lock()
            .unwrap()
            .as_mut()
            .map_or(0, |r| r.u64(..400));
        let parts = parts
            .then(move |part| async move {
                tokio::time::sleep(Duration::from_millis(pace)).await;
                part
            })
            .boxed();
        if roll < 0.2 {
            // Cut after a few parts; a handoff with fewer arrives whole.
            let cut = self.rng.lock().unwrap().as_mut().unwrap().usize(..6);
            let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let seen = done.clone();
            let parts = parts
                .take(cut)
                .inspect(move |part| {
                    if matches!(part, Part::Done { .. }) {
                        seen.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                })
                .map(Ok)
                .boxed();
            let received = until_stopped(&stopped, member.receive(handoff, parts)).await;
            assert!(
                received.is_err() || done.load(std::sync::atomic::Ordering::Relaxed),
                "a cut handoff was taken: {received:?}"
            );
            return received.map_err(|e| e.to_string());
        }
        if roll < 0.3 {
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
        let received = if roll < 0.35 {
            let parts: Vec<Part> = parts.collect().await;
            let again = futures::stream::iter(parts.clone().into_iter().map(Ok)).boxed();
            let _ = until_stopped(&stopped, member.receive(handoff.clone(), again)).await;
            let parts = futures::stream::iter(parts.into_iter().map(Ok)).boxed();
            until_stopped(&stopped, member.receive(handoff, parts)).await
        } else {
            let mut seen = std::collections::HashSet::new();
            let again = self.again.clone();
            let parts = parts.inspect(move |part| {
                if let Part::Chunk(Chunk::Users(users)) = part {
                    let repeated = users.iter().filter(|u| !seen.insert(u.user_id)).count();
                    again.fetch_add(repeated, std::sync::atomic::Ordering::Relaxed);
                }
            });
            until_stopped(&stopped, member.receive(handoff, parts.map(Ok).boxed())).await
        };
        let received = received.map_err(|e| e.to_string());
        if (0.35..0.45).contains(&roll) {
            return Err("the answer was lost".into());
        }
        if let Ok(users) = received {
            self.handed
                .fetch_add(users, std::sync::atomic::Ordering::Relaxed);
        }
        received
    }
}

/// Why a call to a node that stopped failed.
const STOPPED: &str = "the node stopped";

type Members = Mutex<HashMap<String, (Member, CancellationToken)>>;

/// The node at `address`, called in-process, and what stops it.
fn member_at(members: &Members, address: &str) -> Result<(Member, CancellationToken), String> {
    let member = members.lock().unwrap().get(address).cloned();
    member.ok_or_else(|| "no such node".to_owned())
}

/// `call` to a node, cut if the node stops meanwhile (its process gone).
/// A stopping node answers nothing, even what would be ready at once (its
/// slots, set to `NotOwner` while it writes everything, would let it answer
/// `ReleaseSlots` before its changes are written; a process stops answering
/// first). Biased, so that a seed replays the same way.
async fn until_stopped<T>(
    stopped: &CancellationToken,
    call: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::select! {
        biased;
        () = stopped.cancelled() => Err(Error::HandoffBroken(STOPPED.into())),
        result = call => result,
    }
}

/// `ReleaseSlots` of the node at `address`.
async fn release_at(
    members: &Members,
    address: &str,
    epoch: u64,
    slots: &[Slot],
) -> Result<(), String> {
    let (member, stopped) = member_at(members, address)?;
    until_stopped(&stopped, member.release_slots(epoch, slots))
        .await
        .map_err(|e| e.to_string())
}

impl SimPeers {
    fn roll(&self) -> f64 {
        self.rng.lock().unwrap().as_mut().map_or(1.0, |r| r.f64())
    }
}

/// What the store must hold of a user's read state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct State {
    last_acked_id: u64,
    /// The watermark: a message at or below it counts nothing.
    last_message_id: u64,
    unread_count: u32,
}

type Model = BTreeMap<u64, State>;

/// What the store must hold of [`BY_CHANNEL`] and its mentions.
#[derive(Debug, Default)]
struct ByChannel {
    /// The messages its owners answered they took.
    taken: std::collections::BTreeSet<u64>,
    users: BTreeMap<u64, Mentioned>,
}

impl ByChannel {
    /// `user` was mentioned in `message_id`, which the channel holds (see
    /// `UserReadStates::mentioned`): counted past the watermark, and a new
    /// read state is acked just below the message.
    fn mentioned(&mut self, user: u64, message_id: u64) {
        match self.users.get_mut(&user) {
            None => {
                let state = Mentioned {
                    last_acked_id: message_id - 1,
                    last_message_id: message_id,
                    mention_count: 1,
                };
                self.users.insert(user, state);
            }
            Some(state) if message_id > state.last_acked_id.max(state.last_message_id) => {
                state.last_message_id = message_id;
                state.mention_count += 1;
            }
            Some(_) => {}
        }
    }
}

/// What the store must hold of a user's read state of [`THREAD`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Followed {
    last_acked_id: u64,
    last_message_id: u64,
    unread_count: u16,
    mention_count: u16,
}

impl Followed {
    /// Mentioned in reply `message_id` (see `UserReadStates::reply`): a
    /// user not following yet follows from just below it; a reply at or
    /// below the watermark counts nothing.
    fn mentioned(state: Option<Followed>, message_id: u64) -> Followed {
        match state {
            None => Followed {
                last_acked_id: message_id - 1,
                last_message_id: message_id,
                unread_count: 1,
                mention_count: 1,
            },
            Some(s) if message_id > s.last_acked_id.max(s.last_message_id) => Followed {
                last_message_id: message_id,
                unread_count: s.unread_count + 1,
                mention_count: s.mention_count + 1,
                ..s
            },
            Some(s) => s,
        }
    }
}

/// What one seed did.
#[derive(Default)]
struct Ran {
    operations: usize,
    /// Moves of the channel counted by channel, and messages it took.
    channel_moves: usize,
    taken: usize,
    /// Users following the thread at the end.
    followers: usize,
    /// Users handed over warm.
    handed: usize,
    /// Users sent again within a handoff.
    again: usize,
    restarts: usize,
    /// Handoffs cut by their sender or receiver restarting.
    cut: usize,
}

async fn simulate(seed: u64) -> Ran {
    let mut rng = fastrand::Rng::with_seed(seed);
    let store = Arc::new(FaultyStore::memory());
    let ring = Arc::new(MemoryRingStore::default());
    let peers = Arc::new(SimPeers::default());
    *peers.rng.lock().unwrap() = Some(fastrand::Rng::with_seed(seed ^ 0x5eed));
    let configs: Vec<CacheConfig> = NODES
        .iter()
        .map(|_| CacheConfig {
            capacity: 16 + rng.usize(..32),
            shards: 2,
            write_delay: Duration::from_millis(200 + rng.u64(..2_000)),
            max_evicted_unwritten: 10_000,
            write_concurrency: 4,
            // Handoffs of many parts: the copy ahead takes a while.
            handoff_chunk: 1,
            ..CacheConfig::default()
        })
        .collect();
    let start =
        |index: usize| SimNode::start(NODES[index], configs[index].clone(), &store, &ring, &peers);
    let nodes: Arc<Vec<Mutex<SimNode>>> =
        Arc::new((0..NODES.len()).map(|i| Mutex::new(start(i))).collect());

    // The ring starts with a and b, served.
    for id in ["a", "b"] {
        change(&ring, RingChange::Add(node(id, 100))).await;
    }
    admin::wait_served(&*ring, 2, Duration::from_secs(30))
        .await
        .unwrap();
    // BY_CHANNEL is switched by its owner, written, and copied to every
    // node before any message (as SetChannelCounting answers).
    let switched = route_one(&nodes, &ring, BY_CHANNEL, |cache| async move {
        cache.change_channel(BY_CHANNEL, |channels, now| {
            channels.switch(BY_CHANNEL, 0, now).expect("switched once")
        })?;
        while cache.channels().write_now(BY_CHANNEL).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(cache.channels().get(BY_CHANNEL).expect("switched"))
    })
    .await;
    let switched = switched.expect("the switch");
    for node in nodes.iter() {
        let channels = node.lock().unwrap().cache.channels().clone();
        channels.copy_in(vec![switched.clone()], |_| false);
    }
    let copying = CancellationToken::new();
    let copier = tokio::spawn(copy_channels(nodes.clone(), seed, copying.clone()));

    // Faults in the store, now and then, for a while.
    if rng.bool() {
        store.inject(
            Fault::new(Operation::Write, Effect::Fail)
                .chance(0.3)
                .lasting(Duration::from_secs(3)),
        );
    }
    store.inject(Fault::new(Operation::Load, Effect::Delay(Duration::from_millis(30))).chance(0.2));

    let model = Arc::new(Mutex::new(Model::new()));
    let by_channel = Arc::new(Mutex::new(ByChannel::default()));
    let threads: Arc<Mutex<BTreeMap<u64, Followed>>> = Arc::default();
    let next_message = Arc::new(Mutex::new(1u64));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (nodes, ring, model, by_channel, threads, next_message) = (
                nodes.clone(),
                ring.clone(),
                model.clone(),
                by_channel.clone(),
                threads.clone(),
                next_message.clone(),
            );
            let mut rng = fastrand::Rng::with_seed(seed * 31 + client as u64);
            tokio::spawn(async move {
                let mut done = 0;
                for _ in 0..OPS_PER_CLIENT {
                    tokio::time::sleep(Duration::from_millis(rng.u64(..300))).await;
                    if rng.u8(..3) == 0 {
                        // Ack: one user, forward to the latest message.
                        let user = own(&mut rng, client);
                        let to = *next_message.lock().unwrap();
                        let applied = route(&nodes, &ring, &[user], |cache, users| {
                            let users = users.to_vec();
                            async move {
                                cache
                                    .update_many(&users, |_, s, now| {
                                        s.ack(Key::channel(CHANNEL), to, now);
                                    })
                                    .await
                                    .map(|_| ())
                            }
                        })
                        .await;
                        if applied.contains(&user) {
                            let mut model = model.lock().unwrap();
                            let state = model.entry(user).or_default();
                            if to > state.last_acked_id {
                                state.last_acked_id = to;
                                state.last_message_id = state.last_message_id.max(to);
                                state.unread_count = 0;
                            }
                        }
                    } else if rng.u8(..4) == 0 {
                        // A reply in THREAD mentioning a few users, who
                        // follow it by that (split by owner, as a message).
                        let message_id = next_id(&next_message);
                        let users = own_some(&mut rng, client, 1, 3);
                        let applied = route(&nodes, &ring, &users, |cache, part| {
                            let part = part.to_vec();
                            async move {
                                cache
                                    .update_many(&part, |_, s, now| {
                                        let replied = Replied::Mentioned;
                                        s.reply(THREAD, CHANNEL, message_id, replied, now)
                                            .expect("a thread of one parent, few threads");
                                    })
                                    .await
                                    .map(|_| ())
                            }
                        })
                        .await;
                        let mut threads = threads.lock().unwrap();
                        for user in applied {
                            let state = threads.get(&user).copied();
                            threads.insert(user, Followed::mentioned(state, message_id));
                        }
                    } else if rng.u8(..3) == 0 {
                        // A message to BY_CHANNEL: its owner takes it, then
                        // its mentions go to theirs, marked with whether the
                        // channel holds it (as a node of a fleet sends them).
                        let message_id = next_id(&next_message);
                        let taken = route_one(&nodes, &ring, BY_CHANNEL, |cache| async move {
                            cache.change_channel(BY_CHANNEL, |channels, now| {
                                let taken = channels.update(BY_CHANNEL, |c| {
                                    (c.message_created(message_id, now), c.holds(message_id))
                                });
                                taken.expect("the owner counts the channel")
                            })
                        })
                        .await;
                        let Some((took, holds)) = taken else {
                            done += 1;
                            continue;
                        };
                        if took {
                            by_channel.lock().unwrap().taken.insert(message_id);
                        }
                        let users = own_some(&mut rng, client, 0, 3);
                        let applied = route(&nodes, &ring, &users, |cache, part| {
                            let part = part.to_vec();
                            async move {
                                cache
                                    .update_many(&part, |_, s, now| {
                                        s.mentioned(
                                            Key::channel(BY_CHANNEL),
                                            message_id,
                                            now,
                                            holds,
                                        );
                                    })
                                    .await
                                    .map(|_| ())
                            }
                        })
                        .await;
                        let mut by_channel = by_channel.lock().unwrap();
                        for user in applied.into_iter().filter(|_| holds) {
                            by_channel.mentioned(user, message_id);
                        }
                    } else {
                        // A message to a few users, split by owner.
                        let message_id = next_id(&next_message);
                        let users = own_some(&mut rng, client, 1, 5);
                        let applied = route(&nodes, &ring, &users, |cache, part| {
                            let part = part.to_vec();
                            async move {
                                cache
                                    .update_many(&part, |_, s, now| {
                                        s.message_created(
                                            Key::channel(CHANNEL),
                                            message_id,
                                            false,
                                            now,
                                            &NoChannels,
                                        );
                                    })
                                    .await
                                    .map(|_| ())
                            }
                        })
                        .await;
                        let mut model = model.lock().unwrap();
                        for user in applied {
                            let state = model.entry(user).or_default();
                            if message_id > state.last_acked_id.max(state.last_message_id) {
                                state.last_message_id = message_id;
                                state.unread_count += 1;
                            }
                        }
                    }
                    done += 1;
                    check_one_owner(&nodes);
                }
                done
            })
        })
        .collect();

    // The operator.
    let mut plan: Vec<RingChange> = vec![
        RingChange::Add(node("canary", 0)),
        RingChange::SetWeight {
            node: "canary".into(),
            weight: 2,
        },
        RingChange::SetWeight {
            node: "canary".into(),
            weight: 100,
        },
        RingChange::SetWeight {
            node: "canary".into(),
            weight: 0,
        },
        RingChange::SetWeight {
            node: "b".into(),
            weight: 0,
        },
        RingChange::SetWeight {
            node: "b".into(),
            weight: 100,
        },
        RingChange::SetWeight {
            node: "a".into(),
            weight: 30,
        },
        RingChange::SetWeight {
            node: "a".into(),
            weight: 100,
        },
    ];
    if rng.bool() {
        plan.truncate(2 + rng.usize(..plan.len() - 2));
    }
    let mut restarts = 0;
    let mut channel_moves = 0;
    for ring_change in plan {
        tokio::time::sleep(Duration::from_millis(rng.u64(..800))).await;
        change(&ring, ring_change).await;
        check_one_owner(&nodes);
        let record = ring.load().await.unwrap();
        let owner_id = |r: &readstates_routing::Ring| r.owner_of(BY_CHANNEL).map(|n| n.id.clone());
        channel_moves += usize::from(owner_id(&record.ring) != owner_id(&record.previous));
        // A restart, likely while slots move to or from that node.
        if rng.u8(..4) == 0 {
            tokio::time::sleep(Duration::from_millis(rng.u64(..600))).await;
            let index = rng.usize(..NODES.len());
            SimNode::stop(&nodes[index]).await;
            let config = configs[index].clone();
            let fresh = SimNode::restart(NODES[index], config, &store, &ring, &peers).await;
            *nodes[index].lock().unwrap() = fresh;
            restarts += 1;
        }
    }

    let mut operations = 0;
    for client in clients {
        operations += client.await.expect("client");
    }
    // Every copy ends equal to the owner's (the owner sends all it owns
    // every 5 s, each send lost one time in five), however copies were
    // lost, late or repeated.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let copies: Vec<_> = (nodes.iter())
        .map(|node| {
            let cache = node.lock().unwrap().cache.clone();
            let owned = cache.ownership().state_of(BY_CHANNEL) == SlotState::Serving;
            (owned, cache.channels().get(BY_CHANNEL))
        })
        .collect();
    let owners: Vec<_> = copies.iter().filter(|(owned, _)| *owned).collect();
    assert_eq!(owners.len(), 1, "one owner of the channel");
    for (_, copy) in &copies {
        assert_eq!(
            copy, &owners[0].1,
            "a copy of the channel against its owner's"
        );
    }
    copying.cancel();
    copier.await.unwrap();
    store.clear();
    // Every node shuts down and writes everything.
    for node in nodes.iter() {
        SimNode::stop(node).await;
    }

    let model = model.lock().unwrap().clone();
    for user in 1..=USERS {
        let stored = store.load(user).await.unwrap();
        let got = stored
            .read_states
            .iter()
            .find(|s| s.channel_id == CHANNEL && !s.deleted)
            .map(|s| State {
                last_acked_id: s.last_acked_id,
                last_message_id: s.last_message_id,
                unread_count: u32::from(s.unread_count),
            });
        let expected = model.get(&user).copied();
        assert_eq!(
            got.unwrap_or_default(),
            expected.unwrap_or_default(),
            "user {user}: the store against the model"
        );
    }
    let by_channel = std::mem::take(&mut *by_channel.lock().unwrap());
    let stored = store.load_channels().await.unwrap();
    let channel = stored.iter().find(|c| c.channel_id() == BY_CHANNEL);
    let channel = channel.expect("the channel is stored");
    let recent: Vec<u64> = channel.recent().collect();
    let taken: Vec<u64> = by_channel.taken.iter().copied().collect();
    assert_eq!(recent, taken, "the channel's messages against the model");
    for user in 1..=USERS {
        let stored = store.load(user).await.unwrap();
        let got = (stored.read_states.iter())
            .find(|s| s.channel_id == BY_CHANNEL && !s.deleted)
            .map(|s| {
                assert_eq!(s.unread_count, 0, "user {user}: counted by the channel");
                Mentioned {
                    last_acked_id: s.last_acked_id,
                    last_message_id: s.last_message_id,
                    mention_count: s.mention_count,
                }
            });
        assert_eq!(
            got.unwrap_or_default(),
            by_channel.users.get(&user).copied().unwrap_or_default(),
            "user {user}: mentions in the channel counted by channel"
        );
    }
    let threads = std::mem::take(&mut *threads.lock().unwrap());
    for user in 1..=USERS {
        let stored = store.load(user).await.unwrap();
        let got = (stored.read_states.iter())
            .find(|s| s.kind == Kind::Thread && s.channel_id == THREAD && !s.deleted)
            .map(|s| {
                let parent = stored.parents.get(&THREAD).copied();
                assert_eq!(parent, Some(CHANNEL), "user {user}: the thread's parent");
                Followed {
                    last_acked_id: s.last_acked_id,
                    last_message_id: s.last_message_id,
                    unread_count: s.unread_count,
                    mention_count: s.mention_count,
                }
            });
        assert_eq!(
            got,
            threads.get(&user).copied(),
            "user {user}: the thread read state against the model"
        );
    }
    let handed = peers.handed.load(std::sync::atomic::Ordering::Relaxed);
    let again = peers.again.load(std::sync::atomic::Ordering::Relaxed);
    Ran {
        operations,
        channel_moves,
        taken: taken.len(),
        followers: threads.len(),
        handed,
        again,
        restarts,
        cut: peers.cut.load(std::sync::atomic::Ordering::Relaxed),
    }
}

/// The next message's id (ids rise across clients).
fn next_id(next: &Mutex<u64>) -> u64 {
    let mut next = next.lock().unwrap();
    *next += 1;
    *next
}

/// `least` and up to `more - 1` more draws of client `client`'s users,
/// sorted, each once.
fn own_some(rng: &mut fastrand::Rng, client: usize, least: usize, more: usize) -> Vec<u64> {
    let draws = least + rng.usize(..more);
    let mut users: Vec<u64> = (0..draws).map(|_| own(rng, client)).collect();
    users.sort_unstable();
    users.dedup();
    users
}

/// One of client `client`'s users.
fn own(rng: &mut fastrand::Rng, client: usize) -> u64 {
    let per_client = USERS / CLIENTS as u64;
    1 + client as u64 + CLIENTS as u64 * rng.u64(..per_client)
}

fn node(id: &str, weight: u32) -> Node {
    Node {
        id: id.to_owned(),
        address: address(id),
        weight,
    }
}

/// Makes `ring_change`, waiting for the previous epoch to be served first.
async fn change(ring: &MemoryRingStore, ring_change: RingChange) {
    loop {
        match admin::change(ring, ring_change.clone()).await {
            Ok(_) => return,
            Err(admin::AdminError::HandoffUnderWay { .. }) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// Sends the parts of an operation (its users split by owner, in the ring
/// as stored) to their owners; a part refused (not served there, the store
/// failing) is tried again a little later. Returns the users applied.
async fn route<F, Fut>(
    nodes: &[Mutex<SimNode>],
    ring: &MemoryRingStore,
    users: &[u64],
    apply: F,
) -> Vec<u64>
where
    F: Fn(Arc<Cache>, &[u64]) -> Fut,
    Fut: std::future::Future<Output = Result<(), Error>>,
{
    let mut pending = users.to_vec();
    let mut applied = Vec::new();
    for _ in 0..TRIES {
        if pending.is_empty() {
            break;
        }
        let record = ring.load().await.unwrap();
        let mut parts: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for &user in &pending {
            let owner = record.ring.owner_of(user).expect("an owner");
            parts.entry(owner.id.clone()).or_default().push(user);
        }
        pending.clear();
        for (owner, part) in parts {
            let index = NODES.iter().position(|&n| n == owner).unwrap();
            let cache = nodes[index].lock().unwrap().cache.clone();
            let mut result = apply(cache, &part).await;
            // An owner acquiring the slot forwards to the previous owner,
            // which serves it until it stops (as `grpc::route` does).
            if let Err(Error::NotServed {
                state: SlotState::Acquiring,
                ..
            }) = result
                && let Some(previous) = record.previous.owner_of(part[0])
                && part
                    .iter()
                    .all(|&u| record.previous.owner_of(u) == Some(previous))
            {
                let index = NODES.iter().position(|&n| n == previous.id).unwrap();
                let cache = nodes[index].lock().unwrap().cache.clone();
                result = apply(cache, &part).await;
            }
            match result {
                Ok(()) => applied.extend(part),
                // Not applied: refused, the store failing, or a node
                // restarting.
                Err(Error::NotServed { .. } | Error::LoadFailed { .. } | Error::ShuttingDown) => {
                    pending.extend(part)
                }
                Err(e) => panic!("unexpected {e}"),
            }
        }
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    applied
}

/// [`route`] for one id (a channel's, routed by its slot as a user's):
/// what `apply` returned where it was applied, if it was.
async fn route_one<T, F, Fut>(
    nodes: &[Mutex<SimNode>],
    ring: &MemoryRingStore,
    id: u64,
    apply: F,
) -> Option<T>
where
    F: Fn(Arc<Cache>) -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let answer = Mutex::new(None);
    route(nodes, ring, &[id], |cache, _| {
        let applying = apply(cache);
        let answer = &answer;
        async move {
            let applied = applying.await?;
            *answer.lock().unwrap() = Some(applied);
            Ok(())
        }
    })
    .await;
    answer.into_inner().unwrap()
}

/// No slot is served by two nodes.
fn check_one_owner(nodes: &[Mutex<SimNode>]) {
    for slot in 0..SLOTS as Slot {
        let serving = nodes
            .iter()
            .filter(|n| n.lock().unwrap().member.ownership().state(slot) == SlotState::Serving)
            .count();
        assert!(serving <= 1, "slot {slot} served by {serving} nodes");
    }
}

#[test]
fn ring_changes_under_load_and_faults_lose_nothing_and_serve_each_user_once() {
    let seeds = seeds("FLEET_SEED", "FLEET_SEEDS", 60);
    let started = std::time::Instant::now();
    let mut total = Ran::default();
    for &seed in &seeds {
        let ran = run_paused("fleet simulation", "FLEET_SEED", seed, simulate);
        total.operations += ran.operations;
        total.channel_moves += ran.channel_moves;
        total.taken += ran.taken;
        total.followers += ran.followers;
        total.handed += ran.handed;
        total.again += ran.again;
        total.restarts += ran.restarts;
        total.cut += ran.cut;
    }
    let Ran {
        operations,
        channel_moves,
        taken,
        followers,
        handed,
        again,
        restarts,
        cut,
    } = total;
    println!(
        "fleet simulation: {} seeds, {operations} operations, {handed} users handed over ({again} sent again), {restarts} restarts ({cut} handoffs cut by one), {taken} messages taken by the channel counted by channel, which moved {channel_moves} times, {followers} users following a thread, in {:.1?}",
        seeds.len(),
        started.elapsed()
    );
    if seeds.len() > 10 {
        assert!(
            handed > 0 && again > 0 && cut > 0 && channel_moves > 0 && taken > 0 && followers > 0,
            "no handoff went through, none sent a user again, or none was cut by a restart: the simulation tests nothing of it"
        );
    }
}

/// Peers whose handoffs stop after their first part until the gate opens.
#[derive(Debug)]
struct GatedPeers {
    members: Members,
    gate: Arc<tokio::sync::Semaphore>,
}

#[async_trait]
impl Peers for GatedPeers {
    async fn release_slots(
        &self,
        address: &str,
        epoch: u64,
        slots: &[Slot],
        _from: &str,
    ) -> Result<(), String> {
        release_at(&self.members, address, epoch, slots).await
    }

    async fn hand_over(
        &self,
        address: &str,
        handoff: Handoff,
        parts: BoxStream<'static, Part>,
    ) -> Result<usize, String> {
        let (member, _) = member_at(&self.members, address)?;
        let gate = self.gate.clone();
        let parts = parts
            .enumerate()
            .then(move |(index, part)| {
                let gate = gate.clone();
                async move {
                    if index > 0 {
                        gate.acquire().await.unwrap().forget();
                    }
                    Ok(part)
                }
            })
            .boxed();
        member
            .receive(handoff, parts)
            .await
            .map_err(|e| e.to_string())
    }
}

/// The new owner of a slot serves it only once its handoff is complete: a
/// handoff held after its first part leaves every moving slot acquiring
/// there (its users not readable), and once it goes on, the new owner
/// serves the users as they were, without loading them.
#[tokio::test(start_paused = true)]
async fn a_slot_is_served_by_its_new_owner_only_once_its_handoff_is_complete() {
    let store = Arc::new(FaultyStore::memory());
    let ring = Arc::new(MemoryRingStore::default());
    let peers = Arc::new(GatedPeers {
        members: Mutex::default(),
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
    });
    let stop = CancellationToken::new();
    let mut caches = HashMap::new();
    for id in ["a", "b"] {
        let cache = Cache::with_ownership(
            CacheConfig {
                handoff_chunk: 1,
                ..CacheConfig::default()
            },
            store.clone() as Arc<dyn Store>,
            unleased_member(),
        );
        let member = Member::new(
            id.to_owned(),
            ring.clone(),
            cache.clone(),
            peers.clone(),
            MemberConfig {
                ring_poll: Duration::from_millis(100),
                retry: Duration::from_millis(50),
            },
        );
        member.start(stop.clone());
        peers
            .members
            .lock()
            .unwrap()
            .insert(address(id), (member, stop.clone()));
        caches.insert(id, cache);
    }
    change(&ring, RingChange::Add(node("a", 100))).await;
    admin::wait_served(&*ring, 1, Duration::from_secs(5))
        .await
        .unwrap();
    let users: Vec<u64> = (1..=40).collect();
    caches["a"]
        .update_many(&users, |_, user, now| {
            user.ack(Key::channel(CHANNEL), 99, now);
        })
        .await
        .unwrap();

    change(&ring, RingChange::Add(node("b", 100))).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let record = ring.load().await.unwrap();
    let moving: Vec<u64> = users
        .iter()
        .copied()
        .filter(|&u| record.ring.owner_of(u).is_some_and(|n| n.id == "b"))
        .collect();
    assert!(!moving.is_empty());
    let b = &caches["b"];
    for &user in &moving {
        assert_eq!(b.ownership().state_of(user), SlotState::Acquiring);
        let read = b.read(user, |_| ()).await;
        assert!(matches!(read, Err(Error::NotServed { .. })), "{read:?}");
    }

    let loads = store.loads();
    peers.gate.add_permits(10_000);
    admin::wait_served(&*ring, 2, Duration::from_secs(10))
        .await
        .unwrap();
    for &user in &moving {
        assert_eq!(b.ownership().state_of(user), SlotState::Serving);
        let acked = b
            .read(user, |s| {
                s.get(Key::channel(CHANNEL)).map(|r| r.last_acked_id)
            })
            .await
            .unwrap();
        assert_eq!(acked, Some(99), "user {user}");
    }
    assert_eq!(store.loads(), loads, "served from what was handed over");
    stop.cancel();
}

/// A fleet node's slots, served without a lease: leases are not simulated
/// here (their tests are in `cluster::lease` and the API tests).
fn unleased_member() -> Arc<Ownership> {
    let ownership = Arc::new(Ownership::member());
    ownership.lease(None);
    ownership
}
