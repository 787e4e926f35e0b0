//! A dead node's users served elsewhere, with nothing acknowledged lost and
//! no operator: its backup takes over.
//!
//! The backup reads the leases of the nodes it holds copies for all along
//! ([`Sightings`]). When a stream from a node breaks after the backup held
//! all the node had unwritten ([`Backups::broken`]), the backup writes that
//! copy to the store ahead (newest version wins there, so nothing of it can
//! undo a later change, should the node live) and watches the lease.
//! Renewed: the node lives (it will stream again). Lapsed for the lease
//! plus its margin, and naming this copy (a node that gave the stream up
//! has its lease name no backup, or another stream, before it answers
//! anything that copy lacks: [`super::mirror`]): the backup takes the
//! lease (by compare-and-set, and renews it until done), so the node,
//! should it wake, serves nothing, and a new incarnation of it waits
//! ([`crate::cluster::lease`]); then makes the epoch that gives the node's
//! slots to the others, released at once ([`admin::take_over`]), tells
//! them so, and frees the lease. They load the users from the store, which
//! now holds every change the node answered.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use metrics::counter;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::backup_of;
use super::held::{Backups, Taken};
use super::sightings::Sightings;
use crate::cluster::admin::{self, AdminError};
use crate::cluster::lease::hold::{Fenced, Hold};
use crate::cluster::lease::{LeaseConfig, TAKEOVER_BY};
use crate::cluster::member::Member;
use crate::cluster::ring_store::{LeaseRecord, NO_BACKUP, RingRecord, RingStore};
use crate::metrics::TAKEOVERS;
use crate::store::Store;

/// How long a watch rests before it looks at a node again (a copy not
/// this node's to take over yet, a lease that did not swap).
const POLL: Duration = Duration::from_millis(200);
/// Writes of a dead node's users at once.
const WRITES: usize = 32;
/// How long the nodes are given to read the takeover's epoch when told.
const ANNOUNCE: Duration = Duration::from_secs(5);
/// How long a failed write rests before it is tried again.
const RETRY: Duration = Duration::from_millis(200);
/// How long a takeover rests when its epoch could not be made (the ring
/// store failed) before it tries again.
const RETRY_EPOCH: Duration = Duration::from_secs(1);

#[derive(Clone, Debug)]
pub struct Takeover {
    /// This node: it takes over only while it holds its own lease, and only
    /// nodes the ring names it the backup of.
    pub member: Member,
    pub backups: Arc<Backups>,
    pub ring_store: Arc<dyn RingStore>,
    pub store: Arc<dyn Store>,
    pub lease: LeaseConfig,
}

impl Takeover {
    /// Watches the nodes this node backs up until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        let sightings = Arc::new(Sightings::default());
        let tracking = tokio::spawn({
            let (sightings, takeover, stop) = (sightings.clone(), self.clone(), stop.clone());
            async move {
                let (backups, store) = (&takeover.backups, &*takeover.ring_store);
                sightings.track(backups, store, takeover.lease, stop).await;
            }
        });
        let mut watching: HashSet<(String, u64)> = HashSet::new();
        let (done, mut finished) = tokio::sync::mpsc::unbounded_channel();
        loop {
            // A stream that broke, or one still open from a node whose
            // lease lapsed (cut off from the store, not from this node: it
            // answers nothing more, fenced).
            for (node, stream, broken) in self.backups.complete() {
                let lapsed = || matches!(sightings.lapsed(&node, self.lease), Some(Some(_)));
                let key = (node.clone(), stream);
                if (broken || lapsed()) && watching.insert(key.clone()) {
                    let (takeover, done, stop) = (self.clone(), done.clone(), stop.clone());
                    let sightings = sightings.clone();
                    tokio::spawn(async move {
                        tokio::select! {
                            () = takeover.watch(&key.0, key.1, &sightings) => {}
                            () = stop.cancelled() => {}
                        }
                        let _ = done.send(key);
                    });
                }
            }
            // As often as the sightings are read: a lapse seen waits for
            // no poll of its own.
            tokio::select! {
                () = tokio::time::sleep(self.lease.watch_every()) => {}
                Some(ended) = finished.recv() => {
                    watching.remove(&ended);
                }
                () = stop.cancelled() => {
                    let _ = tracking.await;
                    return;
                }
            }
        }
    }

    /// Watches `node`, whose stream `stream` broke (or whose lease lapsed),
    /// until it streams again (it lives) or its lease lapses (taken over).
    /// Meanwhile writes what a broken stream brought (it takes in nothing
    /// more): the node may well be dead, and the writes lose to any newer
    /// version in the store should it not be.
    async fn watch(&self, node: &str, stream: u64, sightings: &Sightings) {
        let started = Instant::now();
        let Some(token) = self.backups.token(node, stream) else {
            return;
        };
        // A broken stream's copy is written ahead, whichever backup the
        // ring names now: the lease, not the ring, says which copy holds
        // all the node answered, and a write loses to any newer version.
        let broke = self.backups.broken().contains(&(node.to_owned(), stream));
        let ahead = broke.then(|| self.backups.copy(node, stream)).flatten();
        let write_ahead = ahead.is_some();
        let mut writing = std::pin::pin!(async {
            if let Some(copy) = ahead {
                self.write(copy).await;
            }
        });
        let mut written_ahead = false;
        let mut lapsed = std::pin::pin!(self.lapsed(node, stream, &token, sightings));
        let seen = loop {
            tokio::select! {
                seen = &mut lapsed => break seen,
                () = &mut writing, if !written_ahead => written_ahead = true,
            }
        };
        let Some(seen) = seen else {
            if !named_elsewhere(sightings, node, &token) {
                self.given_up(node, stream).await;
            } else if broke && self.named_elsewhere_now(node, &token).await {
                // Never to be named again: the node, live, named another
                // copy (or none), or a new incarnation of it holds the
                // lease (see `Backups::open`). In the store first: it may
                // be all there is of what a dead incarnation answered.
                if !written_ahead {
                    writing.await;
                }
                self.backups.ended(node, stream);
            } else {
                // An open stream (its sender may be naming it just now),
                // or a sighting older than the name: looked at again later.
                tokio::time::sleep(POLL).await;
            }
            return;
        };
        let written_ahead = written_ahead && write_ahead;
        // Only the copy the record names holds every change the node
        // answered: it names another stream, or none (it answered on its
        // journal alone since). Empty: a sender before names were recorded.
        if !seen.backup.is_empty() && seen.backup != token {
            if !broke && self.holds(node, &seen.backup) {
                // A new incarnation's open stream, while the dead one's
                // copy, held here too, takes the node over.
                tokio::time::sleep(POLL).await;
                return;
            }
            // A broken copy is in the store first, as above.
            if write_ahead && !written_ahead {
                writing.await;
            }
            self.backups.ended(node, stream);
            counter!(TAKEOVERS, "result" => "not_named").increment(1);
            tracing::error!(
                node,
                named = %seen.backup,
                "a node this one backed up is dead, but its lease names no copy this node holds: \
                 what it had unwritten is on its own disk; restart it in place (or `readstates ring \
                 remove NODE --force` it, losing that)"
            );
            return;
        }
        // Taken, not emptied: a new incarnation of the node waits until
        // the takeover is done (it then finds itself out of the ring).
        let mut held = LeaseRecord {
            holder: format!("{TAKEOVER_BY}{}", self.member.id()),
            renewals: seen.renewals + 1,
            backup: seen.backup.clone(),
            lease: Some(self.lease.duration),
        };
        // Not taken: looked at again a poll later (not at once, over and
        // over, each time decoding the copy again: found in review).
        let sent = Instant::now();
        match self.ring_store.swap_lease(node, Some(&seen), &held).await {
            Ok(true) => {}
            Ok(false) => {
                tokio::time::sleep(POLL).await;
                return;
            }
            Err(e) => {
                tracing::warn!(node, error = %e, "cannot take a lapsed lease");
                tokio::time::sleep(POLL).await;
                return;
            }
        }
        let Some(taken) = self.backups.take(node, stream) else {
            // It streams again after all: its lease is freed at once, not
            // left to lapse.
            let free = LeaseRecord {
                holder: String::new(),
                renewals: held.renewals + 1,
                backup: NO_BACKUP.to_owned(),
                lease: None,
            };
            let _ = self.ring_store.swap_lease(node, Some(&held), &free).await;
            return;
        };
        let (users, channels) = (taken.users.len(), taken.channels.len());
        tracing::warn!(
            node,
            users,
            channels,
            written_ahead,
            "a node this one backs up is dead (its lease lapsed): writing what it had unwritten, then taking it out of the ring"
        );
        // Once the copy is written, the record held names none: the store
        // has every change the node answered, so a new incarnation of it
        // may answer `ReleaseSlots` (see `Member::release_slots`; this
        // takeover's epoch may wait for it).
        let copy_written = Notify::new();
        // Renewed until done; lost (a renewal that does not apply, or none
        // applied for the lease's duration: this node stalled), the
        // takeover stops, and its ring steps are refused meanwhile.
        let hold = Hold::new(sent, self.lease.duration);
        let renewing = async {
            let mut written = false;
            while hold.holds() {
                tokio::select! {
                    () = tokio::time::sleep(self.lease.renew_every()) => {}
                    () = copy_written.notified(), if !written => written = true,
                }
                let next = LeaseRecord {
                    renewals: held.renewals + 1,
                    backup: if written {
                        NO_BACKUP.to_owned()
                    } else {
                        held.backup.clone()
                    },
                    ..held.clone()
                };
                let sent = Instant::now();
                match self.ring_store.swap_lease(node, Some(&held), &next).await {
                    Ok(true) => {
                        held = next;
                        hold.renewed(sent);
                    }
                    Ok(false) => hold.lost(),
                    Err(_) => {}
                }
            }
        };
        let taking = async {
            // The copy is what was written ahead, if it was: the stream
            // broke, so it took in nothing since.
            match write_ahead {
                true if !written_ahead => writing.await,
                true => {}
                false => self.write(taken).await,
            }
            copy_written.notify_one();
            let written = started.elapsed();
            let peers = &**self.member.peers();
            // Tried again while the lease is held: given up, the node
            // would wait for an operator (found in review).
            let taken = loop {
                let store = Fenced {
                    store: &*self.ring_store,
                    hold: &hold,
                };
                match admin::take_over(&store, peers, self.member.id(), node, true).await {
                    Err(AdminError::Store(e)) if hold.holds() => {
                        tracing::warn!(node, error = %e, "cannot make the takeover's epoch yet; trying again");
                        tokio::time::sleep(RETRY_EPOCH).await;
                    }
                    taken => break taken,
                }
            };
            (taken, written)
        };
        let (result, written) = tokio::select! {
            done = taking => done,
            () = renewing => {
                counter!(TAKEOVERS, "result" => "lost").increment(1);
                tracing::warn!(
                    node,
                    "this takeover lost its hold on the node's lease (a renewal did not apply, or \
                     none did for the lease's duration): given up; whoever holds the lease now \
                     serves or takes the node"
                );
                return;
            }
        };
        match result {
            Ok(record) => {
                self.announce(&record);
                counter!(TAKEOVERS, "result" => "done").increment(1);
                tracing::warn!(
                    node,
                    users,
                    epoch = record.ring.epoch(),
                    written_ms = written.as_millis() as u64,
                    took_ms = started.elapsed().as_millis() as u64,
                    "taken over: its slots go to the other nodes"
                );
            }
            Err(e) => {
                counter!(TAKEOVERS, "result" => "failed").increment(1);
                tracing::error!(node, error = %e, "what it had unwritten is written, but its slots could not be given to others; `readstates ring remove NODE --force` it");
            }
        }
        let free = LeaseRecord {
            holder: String::new(),
            renewals: held.renewals + 1,
            backup: NO_BACKUP.to_owned(),
            lease: None,
        };
        let _ = self.ring_store.swap_lease(node, Some(&held), &free).await;
    }

    /// `lapsed` said `node` is not this node's to take over: dropped once
    /// the store says so too, nobody holding its lease and the ring not
    /// naming this node its backup (an operator gave it up). Kept, such a
    /// copy was watched again at once, over and over, and written ahead
    /// each time (found in review); but a sighting or a ring view may be
    /// stale (a node just started again holds its lease, a ring just made
    /// names this node), and dropping a copy still needed loses what it
    /// holds. So it is looked at again a poll later.
    async fn given_up(&self, node: &str, stream: u64) {
        let (lease, ring) = (self.ring_store.lease(node), self.ring_store.load());
        if let (Ok(lease), Ok(ring)) = tokio::join!(lease, ring)
            && !lease.is_some_and(|lease| lease.held())
            && (ring.ring.node(node).is_none()
                || backup_of(&ring.ring, node).is_none_or(|b| b.id != self.member.id()))
        {
            self.backups.ended(node, stream);
            return;
        }
        tokio::time::sleep(POLL).await;
    }

    /// [`named_elsewhere`] by a read of the store now: a sighting may be
    /// older than the name (read up to `lease / 4` before a stream broke),
    /// and a copy dropped on it while named leaves the node to an operator
    /// (found in review).
    async fn named_elsewhere_now(&self, node: &str, token: &str) -> bool {
        match self.ring_store.lease(node).await {
            Ok(record) => record.is_some_and(|r| names_another(&r, token)),
            Err(_) => false,
        }
    }

    /// Whether this node holds a complete copy of `node` named `token`.
    fn holds(&self, node: &str, token: &str) -> bool {
        (self.backups.complete().iter())
            .any(|(n, s, _)| n == node && self.backups.token(n, *s).as_deref() == Some(token))
    }

    /// Tells every node of `record`'s ring to read it now, not at its next
    /// poll, so that the dead node's slots are served a poll sooner: a
    /// `ReleaseSlots` of no slot from a newer epoch is such a poke.
    fn announce(&self, record: &RingRecord) {
        let epoch = record.ring.epoch();
        for node in record.ring.nodes() {
            let (member, node) = (self.member.clone(), node.clone());
            tokio::spawn(async move {
                let poked = async {
                    if node.id == member.id() {
                        member.release_slots(epoch, &[]).await.is_ok()
                    } else {
                        let peers = member.peers();
                        (peers.release_slots(&node.address, epoch, &[], member.id()))
                            .await
                            .is_ok()
                    }
                };
                if !matches!(tokio::time::timeout(ANNOUNCE, poked).await, Ok(true)) {
                    tracing::debug!(node = %node.id, epoch, "not told of the takeover's epoch; it reads it at its next poll");
                }
            });
        }
    }

    /// Watches `node`'s lease until it lapses (the record as seen then), or
    /// until the node streams again, its lease names another copy than
    /// `token` ([`named_elsewhere`]) or this node is no longer one to take
    /// it over (`None`).
    async fn lapsed(
        &self,
        node: &str,
        stream: u64,
        token: &str,
        sightings: &Sightings,
    ) -> Option<LeaseRecord> {
        loop {
            let still_held = || {
                let held = self.backups.complete();
                held.iter().any(|(n, s, _)| n == node && *s == stream)
            };
            if !still_held() {
                return None;
            }
            // Only while this node holds its own lease.
            if !self.member.ownership().leased() {
                tokio::time::sleep(POLL).await;
                continue;
            }
            // A record of a build before names names no copy: only the
            // backup the ring names takes over, as then.
            let unnamed = sightings
                .record(node)
                .flatten()
                .is_some_and(|r| r.backup.is_empty());
            let ring = self.member.ring();
            if unnamed && backup_of(&ring.ring, node).is_none_or(|b| b.id != self.member.id()) {
                return None;
            }
            match sightings.lapsed(node, self.lease) {
                Some(Some(seen)) if still_held() => return Some(seen),
                // Released or revoked: not this node's to take over.
                Some(None) => return None,
                _ if named_elsewhere(sightings, node, token) => return None,
                _ => {}
            }
            tokio::time::sleep(self.lease.watch_every()).await;
        }
    }

    /// Writes every user and channel of `taken`, retrying each until the
    /// store takes it.
    async fn write(&self, taken: Taken) {
        let store = &self.store;
        futures::stream::iter(taken.users)
            .for_each_concurrent(WRITES, |write| async move {
                while let Err(e) = store.write(&write).await {
                    tracing::warn!(user_id = write.user_id, error = %e, "cannot write a dead node's user; retrying");
                    tokio::time::sleep(RETRY).await;
                }
            })
            .await;
        for channel in taken.channels {
            while let Err(e) = store.write_channel(&channel).await {
                tracing::warn!(channel_id = channel.channel_id(), error = %e, "cannot write a dead node's channel; retrying");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

/// Whether `node`'s lease, as last seen held, names another copy than
/// `token` (or none): that copy lacks what the node answered since, and is
/// never named again (tokens are not reused). An empty name is a sender's
/// from before names were recorded.
fn named_elsewhere(sightings: &Sightings, node: &str, token: &str) -> bool {
    let record = sightings.record(node).flatten();
    record.is_some_and(|r| names_another(&r, token))
}

fn names_another(record: &LeaseRecord, token: &str) -> bool {
    record.held() && !record.backup.is_empty() && record.backup != token
}

#[cfg(test)]
mod tests;
