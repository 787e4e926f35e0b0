//! Giving slots up: their users handed to their new owners from memory (a
//! copy ahead while still served, then what changed since), or written to
//! the store if the handoff fails; and the answer to the new owners'
//! `ReleaseSlots` once that is done.

use std::time::Duration;

use futures::{Stream, StreamExt};
use metrics::counter;
use readstates_routing::{Slot, slot_of};
use tokio::sync::watch;

use super::{Member, slot_set};
use crate::cache::handoff::{Chunk, Sent, Versions};
use crate::cluster::handoff::{Handoff, Part};
use crate::cluster::ring_store::RingRecord;
use crate::error::Error;
use crate::metrics::MOVED_USERS;
use crate::ownership::SlotState;

/// At most how many times a handoff copies its users while still serving
/// them: once, then again those that changed meanwhile, until at most a
/// chunk of them did.
const COPY_AHEAD_ROUNDS: usize = 4;

/// How long a handoff may go without its receiver taking a part, or
/// answering once it has them all.
const HAND_OVER_IDLE: Duration = Duration::from_secs(10);
/// How often a release looks whether this start has held its lease yet.
const LEASE_POLL: Duration = Duration::from_millis(20);
/// How long a release waits for that before it answers UNAVAILABLE.
const LEASE_WAIT: Duration = Duration::from_secs(1);

/// The sending end of a handoff's parts, telling each one taken.
struct Outbox<'a> {
    send: tokio::sync::mpsc::Sender<Part>,
    progress: &'a watch::Sender<()>,
}

impl Outbox<'_> {
    pub(super) async fn send(&self, part: Part) -> Result<(), ()> {
        self.send.send(part).await.map_err(|_| ())?;
        self.progress.send_replace(());
        Ok(())
    }

    /// Sends every chunk of `chunks`; returns what it sent of each user.
    pub(super) async fn users(
        &self,
        chunks: impl Stream<Item = Chunk>,
    ) -> Result<Vec<(u64, Versions)>, ()> {
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

impl Member {
    /// Lets go of `slots`, which go `to` their new owner: their users and
    /// their channels counted by channel (see [`Member::release_users`]),
    /// before the new owner is told (`ReleaseSlots`). The channels are
    /// written, never handed over: the new owner loads them from the store
    /// before it serves them ([`Member::acquire`]). Returns the users let go.
    pub(super) async fn release(
        &self,
        record: &RingRecord,
        to: Option<String>,
        slots: &[Slot],
    ) -> usize {
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

    /// `ReleaseSlots` from the new owner of `slots` in `epoch`: answers once
    /// this start has held its lease (or a takeover that wrote its copy
    /// holds it), has adopted that epoch and let go of them (or of all it
    /// lost in it), and the users of them it replayed from its journal are
    /// in the store (see [`Member::replayed_written`]).
    ///
    /// The lease first: a node started again on a new machine (its disk
    /// lost) owns nothing and replayed nothing, but what its dead
    /// incarnation answered may still be only in the copy its backup is
    /// writing; this start takes the lease only once that backup took the
    /// node over, or left it (see `cluster::lease`). Answered at once, the
    /// new owner loaded the users from a store that lacked the copy, and
    /// its newer writes beat the copy there (found by a review of a loss
    /// the failover simulation saw once). Once held, losing the lease does
    /// not stop releases: what this start answered is in its own memory (a
    /// node cut from the ring store hands its users over as before). A
    /// takeover that has written the copy says so in the lease record it
    /// holds (naming no copy): then this start answers, since a takeover of
    /// another node may wait for it (found by the simulation: two nodes
    /// taken over at once waited for each other for good).
    pub async fn release_slots(&self, epoch: u64, slots: &[Slot]) -> Result<(), Error> {
        // Not waited for long: the asker looks at the ring between tries
        // (a takeover's epoch ends its wait).
        let deadline = tokio::time::Instant::now() + LEASE_WAIT;
        while !self.ownership().leased_once() && !self.copy_written_by_takeover().await {
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::LeaseLapsed);
            }
            tokio::time::sleep(LEASE_POLL).await;
        }
        self.let_go_of(epoch, slots).await?;
        self.replayed_written(slots).await;
        Ok(())
    }

    /// Whether a takeover holds this node's lease and has written every
    /// change its copy held (see `cluster::backup::takeover`).
    async fn copy_written_by_takeover(&self) -> bool {
        let lease = self.inner.ring_store.lease(self.id()).await;
        lease.is_ok_and(|r| r.is_some_and(|r| r.copy_written_by_takeover()))
    }

    /// Waits until the users of `slots` this node replayed from its journal
    /// are written. Found by the failover simulation, with a slow store: a
    /// node started again after kill -9 whose slots the ring had given to
    /// others meanwhile owned nothing in this start and released at once;
    /// the new owner loaded the users from a store that lacked the replayed
    /// changes, and its own newer writes beat them once they landed.
    async fn replayed_written(&self, slots: &[Slot]) {
        let these = slot_set(slots);
        let of_these = |user_id| these[usize::from(slot_of(user_id))];
        self.inner.cache.write_replayed(&of_these).await;
    }

    /// Returns once this node has adopted `epoch` and let go of `slots`
    /// (or of all it lost in it).
    async fn let_go_of(&self, epoch: u64, slots: &[Slot]) -> Result<(), Error> {
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
