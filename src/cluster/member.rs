//! This node as a member of the fleet: follows the ring and moves its slots
//! through their states, release before acquire.
//!
//! On a new epoch the node marks the slots it gained `Acquiring` (requests
//! for them are forwarded to their previous owners, or held here once those
//! refuse them). For the slots it lost, it hands their users to their new
//! owners from memory (`HandOver`, see [`super::handoff`]): a copy ahead
//! (in rounds) while it still serves them, then it stops serving them
//! (`Releasing`: their requests are forwarded to the new owners, which hold
//! them), lets the changes already applied finish, and sends what changed
//! since.
//! Unwritten changes, due times and deletion memory travel with the users,
//! and the new owner writes them. Only once a new owner has them all are
//! they dropped here unwritten; if a handoff fails, they are written to the
//! store and dropped (`Cache::release`), as a cold move. Then, and only
//! then, does the node answer the new owners' `ReleaseSlots`. A slot is
//! served nowhere only during that short part. The slots it gained are
//! served once their previous owner has released them, or once an operator
//! forced the release of a dead owner. No timeout lets it start early. When
//! it serves every slot it owns, it reports the epoch, and `readstates
//! ring` may make the next one.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use readstates_routing::{SLOTS, Slot, slot_of};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use futures::{Stream, StreamExt};
use metrics::counter;

use super::handoff::{Handoff, Part, Parts};
use super::peers::Peers;
use super::ring_store::{RingRecord, RingStore};
use crate::cache::Cache;
use crate::cache::handoff::{Chunk, Sent, Versions};
use crate::clock;
use crate::error::Error;
use crate::metrics::{HANDED_IN_USERS, MOVED_USERS};
use crate::ownership::{Ownership, SlotState};

/// How long a `HandOver` waits for this node to adopt its epoch.
const RECEIVE_WAIT: Duration = Duration::from_secs(2);
/// At most how many times a handoff copies its users while still serving
/// them: once, then again those that changed meanwhile, until at most a
/// chunk of them did.
const COPY_AHEAD_ROUNDS: usize = 4;
/// How long a handoff may go without its receiver taking a part, or
/// answering once it has them all.
const HAND_OVER_IDLE: Duration = Duration::from_secs(10);

/// Drops what a handoff installed, unless disarmed once it completed, if
/// the slots are still being acquired from its sender (which, never told
/// the handoff arrived, writes the users itself); and gives up the
/// handoff's claim on its slots.
struct Undo<'a> {
    member: &'a Member,
    handoff: &'a Handoff,
    /// The handoff's slots, by slot.
    these: &'a [bool],
    /// The handoff's claim on its slots (see [`HandedIn::claimed`]).
    claim: u64,
    armed: bool,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        let mut handed_in = self.member.handed_in();
        let claim = self.claim;
        handed_in.claimed.retain(|_, (_, by)| *by != claim);
        if self.armed && self.member.receiving(self.handoff).is_ok() {
            let these = self.these;
            let dropped = self
                .member
                .inner
                .cache
                .discard(|user_id| these[usize::from(slot_of(user_id))]);
            tracing::warn!(from = %self.handoff.from, users = dropped, "handoff not completed; what it brought is dropped");
        }
    }
}

/// The sending end of a handoff's parts, telling each one taken.
struct Outbox<'a> {
    send: tokio::sync::mpsc::Sender<Part>,
    progress: &'a watch::Sender<()>,
}

impl Outbox<'_> {
    async fn send(&self, part: Part) -> Result<(), ()> {
        self.send.send(part).await.map_err(|_| ())?;
        self.progress.send_replace(());
        Ok(())
    }

    /// Sends every chunk of `chunks`; returns what it sent of each user.
    async fn users(&self, chunks: impl Stream<Item = Chunk>) -> Result<Vec<(u64, Versions)>, ()> {
        let mut chunks = std::pin::pin!(chunks);
        let mut sent = Vec::new();
        while let Some(chunk) = chunks.next().await {
            if let Chunk::Users(users) = &chunk {
                sent.extend(users.iter().map(|u| (u.user_id, u.versions())));
            }
            self.send(Part::Chunk(chunk)).await?;
        }
        Ok(sent)
    }
}

/// What a handoff handed, for the log.
struct Handed {
    /// The users held at the end, by shard.
    users: Vec<Vec<u64>>,
    /// Users sent, counting those sent again.
    sent: usize,
    /// When the slots stopped being served here.
    paused: tokio::time::Instant,
}

/// `slots` as a set: whether each slot is one of them.
fn slot_set(slots: &[Slot]) -> Vec<bool> {
    let mut set = vec![false; SLOTS];
    for &slot in slots {
        set[usize::from(slot)] = true;
    }
    set
}

/// Whether every user of `chunk` is one `of_these` names.
fn chunk_within(chunk: &Chunk, of_these: &impl Fn(u64) -> bool) -> bool {
    match chunk {
        Chunk::Users(users) => users.iter().all(|u| of_these(u.user_id)),
        Chunk::Deletions(deletions) => deletions.iter().all(|d| of_these(d.user_id)),
        Chunk::Gone(ids) => ids.iter().all(|&id| of_these(id)),
    }
}

#[derive(Clone, Debug)]
pub struct MemberConfig {
    /// How often the ring is read (also on a poke: a `ReleaseSlots` from a
    /// newer epoch).
    pub ring_poll: Duration,
    /// Between two asks of a previous owner that did not release yet.
    pub retry: Duration,
}

impl Default for MemberConfig {
    fn default() -> Self {
        MemberConfig {
            ring_poll: Duration::from_secs(1),
            retry: Duration::from_millis(200),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Member {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    id: String,
    ring_store: Arc<dyn RingStore>,
    cache: Arc<Cache>,
    peers: Arc<dyn Peers>,
    config: MemberConfig,
    /// The record adopted last: what requests are forwarded by.
    ring: watch::Sender<Arc<RingRecord>>,
    /// The newest epoch whose releases are done: `ReleaseSlots` waits on it.
    released: watch::Sender<u64>,
    /// Bumped each time slots are let go within an epoch's releases, so
    /// that `ReleaseSlots` for them answers without waiting for the rest.
    let_go: watch::Sender<u64>,
    /// Wakes the follower for an early look at the ring.
    poke: Notify,
    /// Set once the ring has been read and adopted: requests can be routed.
    routing: watch::Sender<bool>,
    /// The handoffs of slots being acquired. Its lock also makes a
    /// handoff's check and install of a chunk one step against the slots
    /// starting to be served (see [`Member::serve`]).
    handed_in: std::sync::Mutex<HandedIn>,
}

/// The handoffs of slots being acquired, by slot.
#[derive(Debug, Default)]
struct HandedIn {
    /// Those whose handoff completed, with its epoch.
    complete: HashMap<Slot, u64>,
    /// Those a handoff under way installs into, with its epoch and claim:
    /// one handoff a slot, so that one cut cannot undo what another
    /// installed, nor another's completion vouch for it.
    claimed: HashMap<Slot, (u64, u64)>,
    /// The last claim made.
    claims: u64,
}

impl HandedIn {
    /// Claims `handoff`'s slots for it, unless a handoff of one of them in
    /// its epoch is under way or completed.
    fn claim(&mut self, handoff: &Handoff) -> Result<u64, String> {
        let epoch = handoff.epoch;
        for slot in &handoff.slots {
            if self.complete.get(slot) == Some(&epoch)
                || self.claimed.get(slot).is_some_and(|(e, _)| *e == epoch)
            {
                return Err(format!("slot {slot} is handed over here already"));
            }
        }
        self.claims += 1;
        for &slot in &handoff.slots {
            self.claimed.insert(slot, (epoch, self.claims));
        }
        Ok(self.claims)
    }
}

impl Member {
    pub fn new(
        id: String,
        ring_store: Arc<dyn RingStore>,
        cache: Arc<Cache>,
        peers: Arc<dyn Peers>,
        config: MemberConfig,
    ) -> Member {
        Member {
            inner: Arc::new(Inner {
                id,
                ring_store,
                cache,
                peers,
                config,
                ring: watch::Sender::new(Arc::new(RingRecord::empty())),
                released: watch::Sender::new(0),
                let_go: watch::Sender::new(0),
                poke: Notify::new(),
                routing: watch::Sender::new(false),
                handed_in: std::sync::Mutex::default(),
            }),
        }
    }

    pub fn id(&self) -> &str {
        &self.inner.id
    }

    pub fn ownership(&self) -> &Ownership {
        self.inner.cache.ownership()
    }

    pub fn cache(&self) -> &Arc<Cache> {
        &self.inner.cache
    }

    fn handed_in(&self) -> std::sync::MutexGuard<'_, HandedIn> {
        self.inner
            .handed_in
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The ring as this node last adopted it.
    pub fn ring(&self) -> Arc<RingRecord> {
        self.inner.ring.borrow().clone()
    }

    /// Looks at the ring now, and waits (at most `within`) until this node
    /// has adopted `epoch` or a later one.
    pub async fn catch_up(&self, epoch: u64, within: Duration) {
        self.inner.poke.notify_one();
        let mut ring = self.inner.ring.subscribe();
        let _ = tokio::time::timeout(within, ring.wait_for(|r| r.ring.epoch() >= epoch)).await;
    }

    /// Waits until this node's releases of `epoch` (or a later one) are
    /// done: the slots it lost there are no longer its own.
    pub async fn releases_done(&self, epoch: u64) {
        // Never closed: the sender lives in `self`.
        let _ = (self.inner.released.subscribe())
            .wait_for(|&done| done >= epoch)
            .await;
    }

    /// Waits until this node has read the ring and adopted it, so that it
    /// routes every request (before, it would refuse them all as not its
    /// own): what its readiness waits for.
    pub async fn routing(&self) {
        // Never closed: the sender lives in `self`.
        let _ = self
            .inner
            .routing
            .subscribe()
            .wait_for(|&routing| routing)
            .await;
    }

    /// Follows the ring until `stop`.
    pub fn start(&self, stop: CancellationToken) -> JoinHandle<()> {
        let member = self.clone();
        tokio::spawn(async move { member.follow(stop).await })
    }

    async fn follow(self, stop: CancellationToken) {
        let mut reported = 0;
        loop {
            match self.inner.ring_store.load().await {
                Ok(record) if record.ring.epoch() > self.ring().ring.epoch() => {
                    tokio::select! {
                        () = self.adopt(Arc::new(record)) => {}
                        () = stop.cancelled() => return,
                    }
                }
                Ok(_) => {
                    self.inner.routing.send_replace(true);
                }
                Err(e) => tracing::warn!(error = %e, "cannot read the ring"),
            }
            let epoch = self.ring().ring.epoch();
            if reported < epoch && self.serves_all() {
                match self.inner.ring_store.report(&self.inner.id, epoch).await {
                    Ok(()) => {
                        reported = epoch;
                        tracing::info!(epoch, "serving every slot of the epoch");
                    }
                    Err(e) => tracing::warn!(error = %e, epoch, "cannot report progress"),
                }
            }
            tokio::select! {
                () = tokio::time::sleep(self.inner.config.ring_poll) => {}
                () = self.inner.poke.notified() => {}
                () = stop.cancelled() => return,
            }
        }
    }

    /// Whether every slot this node owns in the adopted epoch is served.
    fn serves_all(&self) -> bool {
        let record = self.ring();
        record
            .ring
            .slots_of(&self.inner.id)
            .all(|slot| self.ownership().state(slot) == SlotState::Serving)
    }

    /// Moves to `record`: marks what it gained as being acquired, releases
    /// what it lost (handing its users over), then acquires.
    async fn adopt(&self, record: Arc<RingRecord>) {
        let me = self.inner.id.as_str();
        let epoch = record.ring.epoch();
        let ownership = self.ownership();
        let owned = |slot: Slot| record.ring.owner(slot).is_some_and(|n| n.id == me);
        let leaving: Vec<bool> = (0..SLOTS as Slot)
            .map(|slot| !owned(slot) && ownership.state(slot) != SlotState::NotOwner)
            .collect();
        let left = leaving.iter().filter(|&&l| l).count();
        // Gained slots, by whom they come from; marked first (before the
        // epoch is adopted, which a `HandOver` waits for), so that a node
        // handing slots to this one while this one hands others to it finds
        // them being acquired here.
        let mut gaining: BTreeMap<Option<String>, Vec<Slot>> = BTreeMap::new();
        for slot in (0..SLOTS as Slot).filter(|&s| owned(s)) {
            if ownership.assigned(slot) == SlotState::Serving {
                continue;
            }
            let from = record.previous.owner(slot).map(|n| n.id.clone());
            // Nobody had it, or this node did before a restart (with
            // nothing of it cached): served from the store at once.
            if from.is_none() || from.as_deref() == Some(me) {
                ownership.set(slot, SlotState::Serving);
                continue;
            }
            ownership.set(slot, SlotState::Acquiring);
            gaining.entry(from).or_default().push(slot);
        }

        self.inner.ring.send_replace(record.clone());
        self.inner.routing.send_replace(true);
        tracing::info!(epoch, releasing = left, "new epoch");

        // Lost slots, by whom they go to: their users handed over (copied
        // ahead while still served here, then no longer served: requests
        // for them are forwarded to the new owners, which hold them), or
        // else written; then released.
        let started = tokio::time::Instant::now();
        let mut losing: BTreeMap<Option<String>, Vec<Slot>> = BTreeMap::new();
        for slot in (0..SLOTS as Slot).filter(|&s| leaving[usize::from(s)]) {
            let to = record.ring.owner(slot).map(|n| n.id.clone());
            losing.entry(to).or_default().push(slot);
        }
        let current = &*record;
        let releases = losing.into_iter().map(|(to, slots)| async move {
            let users = self.release(current, to, &slots).await;
            // Let go: their new owner need not wait for the other groups.
            for &slot in &slots {
                ownership.set(slot, SlotState::NotOwner);
            }
            self.inner.let_go.send_modify(|n| *n += 1);
            users
        });
        let users: usize = futures::future::join_all(releases).await.into_iter().sum();
        self.inner.released.send_replace(epoch);
        if left > 0 {
            tracing::info!(
                epoch,
                slots = left,
                users,
                took_ms = started.elapsed().as_millis() as u64,
                "released"
            );
        }

        let acquisitions = gaining.into_iter().filter_map(|(from, slots)| {
            let node = record.previous.node(from.as_deref()?)?.clone();
            Some(self.acquire(record.clone(), node, slots))
        });
        futures::future::join_all(acquisitions).await;
    }

    /// Lets go of `slots`, which go `to` their new owner: their users and
    /// their channels counted by channel (see [`Member::release_users`]),
    /// before the new owner is told (`ReleaseSlots`). The channels are
    /// written, never handed over: the new owner loads them from the store
    /// before it serves them ([`Member::acquire`]). Returns the users let go.
    async fn release(&self, record: &RingRecord, to: Option<String>, slots: &[Slot]) -> usize {
        let users = self.release_users(record, to, slots).await;
        let these = slot_set(slots);
        let channels = (self.inner.cache)
            .release_channels(|id| these[usize::from(slot_of(id))])
            .await;
        if channels > 0 {
            tracing::info!(epoch = record.ring.epoch(), channels, "channels written");
        }
        users
    }

    /// Lets go of the users of `slots`: hands them over (see
    /// [`Member::hand_over`]), or, if that fails, stops serving them and
    /// writes what is unwritten of them first. Returns the users let go.
    async fn release_users(
        &self,
        record: &RingRecord,
        to: Option<String>,
        slots: &[Slot],
    ) -> usize {
        let cache = &self.inner.cache;
        let these = slot_set(slots);
        let of_these = |user_id: u64| these[usize::from(slot_of(user_id))];
        if let Some(node) = to.as_deref().and_then(|id| record.ring.node(id)) {
            let started = tokio::time::Instant::now();
            match self.hand_over(record, node, slots, &of_these).await {
                Ok(handed) => {
                    let held = cache.hand_off(&handed.users);
                    counter!(MOVED_USERS, "how" => "handed").increment(held as u64);
                    tracing::info!(
                        epoch = record.ring.epoch(),
                        to = %node.id,
                        users = held,
                        sent = handed.sent,
                        took_ms = started.elapsed().as_millis() as u64,
                        unserved_ms = handed.paused.elapsed().as_millis() as u64,
                        "handed over"
                    );
                    return held;
                }
                Err(e) => {
                    tracing::warn!(epoch = record.ring.epoch(), to = %node.id, error = %e, "handoff failed; writing the users instead");
                }
            }
        }
        self.stop_serving(slots);
        let written = cache.release(of_these).await;
        counter!(MOVED_USERS, "how" => "written").increment(written as u64);
        written
    }

    fn stop_serving(&self, slots: &[Slot]) {
        for &slot in slots {
            self.ownership().set(slot, SlotState::Releasing);
        }
    }

    /// Hands the users of `slots` to `node`, in one `HandOver`: first a copy
    /// of them while they are still served here, so that little is left
    /// for the part during which they are served nowhere; then it stops
    /// serving them, lets the changes already applied finish, and sends
    /// those that changed since, those no longer held, and their deletion
    /// memory. Once `node` has them all, says what was handed.
    async fn hand_over(
        &self,
        record: &RingRecord,
        node: &readstates_routing::Node,
        slots: &[Slot],
        of_these: &(impl Fn(u64) -> bool + Sync),
    ) -> Result<Handed, String> {
        let cache = &self.inner.cache;
        let handoff = Handoff {
            epoch: record.ring.epoch(),
            slots: slots.to_vec(),
            from: self.inner.id.clone(),
        };
        let progress = watch::Sender::new(());
        let (send, parts) = tokio::sync::mpsc::channel(2);
        let parts = tokio_stream::wrappers::ReceiverStream::new(parts).boxed();
        let handing = self.inner.peers.hand_over(&node.address, handoff, parts);
        let progress = &progress;
        let send = Outbox { send, progress };
        let feeding = async move {
            let mut sent = Sent::new();
            let mut count = 0;
            // While the users are still served here: all of them, then
            // those that changed meanwhile, until few do.
            for _ in 0..COPY_AHEAD_ROUNDS {
                let round = send
                    .users(cache.export(cache.users_leaving(of_these), &sent))
                    .await?;
                count += round.len();
                let few = round.len() <= cache.handoff_chunk();
                sent.extend(round);
                if few {
                    break;
                }
            }
            let paused = tokio::time::Instant::now();
            self.stop_serving(slots);
            let users = cache.settled_users(of_these).await;
            count += send.users(cache.export(users.clone(), &sent)).await?.len();
            // Sent earlier, written and evicted since: what was sent is stale.
            let gone = cache.not_held(sent.into_keys());
            if !gone.is_empty() {
                send.send(Part::Chunk(Chunk::Gone(gone))).await?;
            }
            // By slot, not by user held: the memory outlives eviction.
            for chunk in cache.export_deletions(of_these) {
                send.send(Part::Chunk(chunk)).await?;
            }
            send.send(Part::Done { users: count }).await?;
            Ok::<_, ()>(Handed {
                users,
                sent: count,
                paused,
            })
        };
        // No deadline for the whole handoff (a large one takes a while,
        // mostly while the users are still served), but one for each step:
        // a receiver that takes no part, or does not answer, for
        // HAND_OVER_IDLE fails it (dropping the call, which drops what the
        // receiver installed).
        let stalled = async {
            let mut progress = progress.subscribe();
            while let Ok(Ok(())) = tokio::time::timeout(HAND_OVER_IDLE, progress.changed()).await {}
        };
        tokio::select! {
            (handed, fed) = async { tokio::join!(handing, feeding) } => match (handed, fed) {
                (Ok(_), Ok(done)) => Ok(done),
                (Err(e), _) => Err(e),
                (Ok(_), Err(())) => Err("the receiver stopped taking parts".into()),
            },
            () = stalled => Err(format!("no progress for {HAND_OVER_IDLE:?}")),
        }
    }

    /// `HandOver` from the previous owner of `handoff.slots`: installs the
    /// users it sends, once this node has adopted that epoch and while it
    /// is acquiring those slots from that node. Anything else refuses it;
    /// a transfer that breaks drops what it installed (the sender, never
    /// told it arrived, writes the users itself).
    pub async fn receive(&self, handoff: Handoff, mut parts: Parts) -> Result<usize, Error> {
        self.catch_up(handoff.epoch, RECEIVE_WAIT).await;
        let claim = {
            let mut handed_in = self.handed_in();
            self.receiving(&handoff)?;
            (handed_in.claim(&handoff)).map_err(|reason| Error::HandoffRefused {
                epoch: handoff.epoch,
                reason,
            })?
        };
        let these = slot_set(&handoff.slots);
        let of_these = |user_id: u64| these[usize::from(slot_of(user_id))];
        // Drops what was installed unless the handoff completes, also when
        // this future is dropped midway (a deadline, a reset stream).
        let mut undo = Undo {
            member: self,
            handoff: &handoff,
            these: &these,
            claim,
            armed: true,
        };
        let mut installed = 0;
        let result = loop {
            let part = match parts.next().await {
                Some(Ok(part)) => part,
                Some(Err(e)) => break Err(Error::HandoffBroken(e)),
                None => break Err(Error::HandoffBroken("cut before it was done".into())),
            };
            match part {
                Part::Chunk(chunk) => {
                    if !chunk_within(&chunk, &of_these) {
                        break Err(Error::HandoffBroken("a user of another slot".into()));
                    }
                    let _installing = self.handed_in();
                    if let Err(e) = self.receiving(&handoff) {
                        break Err(e);
                    }
                    installed += self.inner.cache.install(chunk);
                }
                Part::Done { users } if users == installed => {
                    // What it holds unwritten is this node's to keep.
                    if let Err(e) = self.inner.cache.journaled().await {
                        break Err(Error::HandoffBroken(e.to_string()));
                    }
                    let mut handed_in = self.handed_in();
                    if let Err(e) = self.receiving(&handoff) {
                        break Err(e);
                    }
                    for &slot in &handoff.slots {
                        handed_in.complete.insert(slot, handoff.epoch);
                    }
                    counter!(HANDED_IN_USERS).increment(installed as u64);
                    undo.armed = false;
                    break Ok(installed);
                }
                Part::Done { users } => {
                    break Err(Error::HandoffBroken(format!(
                        "{users} users sent, {installed} received"
                    )));
                }
            }
        };
        drop(undo);
        result
    }

    /// Whether this node takes `handoff` now: it has adopted its epoch, and
    /// is acquiring each of its slots from its sender.
    fn receiving(&self, handoff: &Handoff) -> Result<(), Error> {
        let record = self.ring();
        let epoch = record.ring.epoch();
        let refused = |reason: String| Err(Error::HandoffRefused { epoch, reason });
        if epoch != handoff.epoch {
            return refused(format!("handoff of epoch {}", handoff.epoch));
        }
        for &slot in &handoff.slots {
            let from = record.previous.owner(slot).map(|n| n.id.as_str());
            let to = record.ring.owner(slot).map(|n| n.id.as_str());
            let state = self.ownership().state(slot);
            if from != Some(handoff.from.as_str())
                || to != Some(self.id())
                || state != SlotState::Acquiring
            {
                return refused(format!("slot {slot} is {} here", state.name()));
            }
        }
        Ok(())
    }

    /// Asks `from` to release `slots` until it has, or an operator forced
    /// it; then serves them. Gives up if a newer epoch appears (adopting it
    /// takes over).
    async fn acquire(
        &self,
        record: Arc<RingRecord>,
        from: readstates_routing::Node,
        slots: Vec<Slot>,
    ) {
        let epoch = record.ring.epoch();
        let started = tokio::time::Instant::now();
        let mut attempts = 0u32;
        loop {
            let asked = self
                .inner
                .peers
                .release_slots(&from.address, epoch, &slots, &self.inner.id)
                .await;
            match asked {
                Ok(()) => break,
                Err(e) => {
                    attempts += 1;
                    if attempts == 1 || attempts.is_power_of_two() {
                        tracing::warn!(epoch, from = %from.id, error = %e, slots = slots.len(), "waiting for a release");
                    }
                }
            }
            match self.inner.ring_store.load().await {
                Ok(now) if now.ring.epoch() != epoch => return,
                Ok(now) if now.released.contains(&from.id) => {
                    tracing::warn!(epoch, from = %from.id, "release forced by an operator");
                    break;
                }
                _ => {}
            }
            tokio::time::sleep(self.inner.config.retry).await;
        }
        self.load_channels(&slots).await;
        self.serve(epoch, &slots);
        tracing::info!(
            epoch,
            from = %from.id,
            slots = slots.len(),
            waited_ms = started.elapsed().as_millis() as u64,
            "acquired"
        );
        self.inner.poke.notify_one();
    }

    /// Takes in the channels counted by channel of `slots` as their previous
    /// owner wrote them (see [`ChannelStates::acquire`]), retrying until the
    /// store answers: a copy held here may lag or be missing (a node that
    /// joined after a switch was sent no copy of it), and serving it would
    /// fork the channel or lose it.
    ///
    /// [`ChannelStates::acquire`]: crate::channel_states::ChannelStates::acquire
    async fn load_channels(&self, slots: &[Slot]) {
        let channels = self.inner.cache.channels();
        let these = slot_set(slots);
        let mut attempts = 0u32;
        let now_us = clock::now_micros();
        while let Err(e) = channels
            .acquire(|id| these[usize::from(slot_of(id))], now_us)
            .await
        {
            attempts += 1;
            if attempts == 1 || attempts.is_power_of_two() {
                tracing::warn!(error = %e, "cannot load the channels counted by channel; retrying");
            }
            tokio::time::sleep(self.inner.config.retry).await;
        }
    }

    /// Serves `slots`, released to this node in `epoch`. What a handoff of
    /// them installed stays only if that handoff completed: one still open
    /// (the sender gave up on it and wrote the users, or died and was
    /// released by force) may have brought copies older than the store's.
    fn serve(&self, epoch: u64, slots: &[Slot]) {
        let mut handed_in = self.handed_in();
        let incomplete: Vec<Slot> = slots
            .iter()
            .copied()
            .filter(|slot| handed_in.complete.get(slot) != Some(&epoch))
            .collect();
        if !incomplete.is_empty() {
            let these = slot_set(&incomplete);
            let dropped = self
                .inner
                .cache
                .discard(|user_id| these[usize::from(slot_of(user_id))]);
            if dropped > 0 {
                tracing::warn!(
                    epoch,
                    users = dropped,
                    "released before its handoff completed; what it brought is dropped"
                );
            }
        }
        for &slot in slots {
            handed_in.complete.remove(&slot);
            self.ownership().set(slot, SlotState::Serving);
        }
    }

    /// `ReleaseSlots` from the new owner of `slots` in `epoch`: answers once
    /// this node has adopted that epoch and let go of them (or of all it
    /// lost in it).
    pub async fn release_slots(&self, epoch: u64, slots: &[Slot]) -> Result<(), Error> {
        let mut released = self.inner.released.subscribe();
        let mut let_go = self.inner.let_go.subscribe();
        if *released.borrow() < epoch {
            self.inner.poke.notify_one();
        }
        loop {
            if *released.borrow_and_update() >= epoch {
                break;
            }
            let_go.borrow_and_update();
            let all_let_go = slots
                .iter()
                .all(|&slot| self.ownership().state(slot) == SlotState::NotOwner);
            if self.ring().ring.epoch() == epoch && all_let_go {
                return Ok(());
            }
            // Never closed: the senders live in `self`.
            tokio::select! {
                _ = released.changed() => {}
                _ = let_go.changed() => {}
            }
        }
        let adopted = self.ring().ring.epoch();
        for &slot in slots {
            let state = self.ownership().state(slot);
            if state != SlotState::NotOwner {
                return Err(Error::NotReleased {
                    slot,
                    epoch: adopted,
                    state,
                });
            }
        }
        Ok(())
    }
}
