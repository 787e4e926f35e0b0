//! This node's lease on its slots (`docs/failover.md`, "Leases"): a fleet
//! node serves only while it holds a lease it renews in the ring store, so
//! that a node frozen or cut off from the store stops serving by itself
//! before anyone may take its slots.
//!
//! - [`Holder`] takes this node's lease at start (waiting out an earlier
//!   incarnation's), renews it every quarter of its duration, and tells the
//!   slots' [`Ownership`] until when they may be served: the monotonic clock
//!   read *before* the renewal was sent, plus the lease's duration.
//! - [`watch`] is the other side: whoever takes a node's slots without its
//!   release first sees its lease unrenewed for the duration plus the
//!   margin, on its own clock, then revokes it with [`revoke`], naming the
//!   record it saw, so that a renewal in between wins.
//! - [`BackupName`]: the record also names which copy of this node's
//!   unwritten changes a takeover may use; the backup stream asks, the
//!   holder records it with a renewal made at once.

pub mod hold;

use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, gauge};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::member::Member;
use super::ring_store::{LeaseRecord, NO_BACKUP, RingStore};
use crate::metrics::{LEASE_HELD, LEASE_RENEWALS};
use crate::store::StoreError;

pub use crate::cluster::ring_store::TAKEOVER_BY;

/// How long a lease lasts, and the margin others add before they take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    pub duration: Duration,
    /// Covers the clocks' rate drift, a change's last check and the
    /// observers' poll (see the arithmetic in `docs/failover.md`).
    pub margin: Duration,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            duration: Duration::from_millis(1_200),
            margin: Duration::from_millis(300),
        }
    }
}

impl LeaseConfig {
    /// Between two renewals: a quarter of the lease, so that three may fail
    /// before it lapses.
    pub fn renew_every(&self) -> Duration {
        self.duration / 4
    }

    /// Between two reads of a watched lease: its lapse is seen at most
    /// this late.
    pub fn watch_every(&self) -> Duration {
        self.renew_every() / 3
    }

    /// How long a lease of this node's must be seen unrenewed before it
    /// may be taken.
    pub fn lapse(&self) -> Duration {
        self.duration + self.margin
    }

    /// How long `record` must be seen unrenewed before it may be taken:
    /// its holder's lease (an unrecorded one is [`UNRECORDED_LEASE`]) or
    /// this node's, the longer, plus this node's margin. So a fleet whose
    /// nodes run with other `lease` settings, as in a rolling upgrade that
    /// changes the default, never takes a lease its holder still serves
    /// under (found in review of the change from 3 s to 1.2 s).
    pub fn lapse_of(&self, record: &LeaseRecord) -> Duration {
        record.lease.unwrap_or(UNRECORDED_LEASE).max(self.duration) + self.margin
    }
}

/// The lease of a record that names none: the builds before records named
/// theirs served 3 s past each renewal by default.
pub const UNRECORDED_LEASE: Duration = Duration::from_secs(3);

/// What [`watch`] saw of a node's lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Nobody holds it (never taken, released or revoked).
    Free(Option<LeaseRecord>),
    /// Unrenewed for [`LeaseConfig::lapse`]: it may be revoked.
    Lapsed(LeaseRecord),
    /// Renewed while watched.
    Live,
}

/// Watches `node`'s lease for at most [`LeaseConfig::lapse_of`] it
/// (returning as soon as it is renewed).
pub async fn watch(
    store: &dyn RingStore,
    node: &str,
    config: LeaseConfig,
) -> Result<Seen, StoreError> {
    let first = match store.lease(node).await? {
        Some(first) if first.held() => first,
        free => return Ok(Seen::Free(free)),
    };
    // From when the read returned: the renewal it saw may have been made
    // while it ran, not before it began.
    let mut since = Instant::now();
    loop {
        // Read first, then judge by the time before the read: a renewal
        // the read missed happened after it began.
        let before = Instant::now();
        let now = store.lease(node).await?;
        if now.as_ref() != Some(&first) {
            return Ok(Seen::Live);
        }
        // A read slower than a renewal may take: the holder could not
        // renew through it either, so the time counts from here (a store
        // outage is not a node's silence; a failed read ends the watch).
        if before.elapsed() > config.renew_every() {
            since = Instant::now();
        }
        if before.duration_since(since) >= config.lapse_of(&first) {
            return Ok(Seen::Lapsed(first));
        }
        tokio::time::sleep(config.watch_every()).await;
    }
}

/// Revokes a lease [`watch`] saw lapse; false if it changed since.
pub async fn revoke(
    store: &dyn RingStore,
    node: &str,
    lapsed: &LeaseRecord,
) -> Result<bool, StoreError> {
    let revoked = LeaseRecord {
        holder: String::new(),
        renewals: lapsed.renewals + 1,
        backup: lapsed.backup.clone(),
        lease: None,
    };
    store.swap_lease(node, Some(lapsed), &revoked).await
}

/// What this node's lease record names as the copy a takeover may use
/// ([`LeaseRecord::backup`]; `docs/failover.md`, "Which copy may take
/// over"): the backup stream says what it wants named, and the holder
/// records it with a renewal made at once, then says what the record names.
///
/// Each request gets a number. What the holder says is recorded carries
/// the number of the request its renewal was made from, so the sender
/// knows a name is the record's only once a renewal made after its latest
/// request applied: an older one may be overtaken by a renewal in flight
/// (found by a review: the sender answered on its journal alone while a
/// renewal naming a stream was about to apply).
#[derive(Debug)]
pub struct BackupName {
    /// The name asked for, and its request's number.
    wanted: watch::Sender<(String, u64)>,
    /// What the last renewal seen applied recorded, and the number of the
    /// request it was made from (0: not known).
    recorded: watch::Sender<(String, u64)>,
}

impl BackupName {
    /// Wants [`NO_BACKUP`] (request 1), and knows of no record yet.
    pub fn new() -> Arc<BackupName> {
        Arc::new(BackupName {
            wanted: watch::Sender::new((NO_BACKUP.to_owned(), 1)),
            recorded: watch::Sender::new((String::new(), 0)),
        })
    }

    /// Asks for `name` to be recorded; returns the number of the request
    /// (the same as before if it was asked for already).
    pub fn want(&self, name: &str) -> u64 {
        self.wanted.send_if_modified(|(wanted, number)| {
            let changed = wanted != name;
            if changed {
                name.clone_into(wanted);
                *number += 1;
            }
            changed
        });
        self.wanted.borrow().1
    }

    /// What is asked for (the holder's side; tests play it too).
    pub fn wanted(&self) -> watch::Receiver<(String, u64)> {
        self.wanted.subscribe()
    }

    /// What the record names, with the number of the request the renewal
    /// that recorded it was made from.
    pub fn recorded(&self) -> watch::Receiver<(String, u64)> {
        self.recorded.subscribe()
    }

    /// The holder's side: `record` applied, made from request `number`.
    fn applied(&self, record: &LeaseRecord, number: u64) {
        let now = (record.backup.clone(), number);
        self.recorded.send_if_modified(|recorded| {
            let changed = *recorded != now;
            if changed {
                *recorded = now;
            }
            changed
        });
    }
}

/// Holds this node's lease until stopped (see the module's doc).
#[derive(Debug)]
pub struct Holder {
    store: Arc<dyn RingStore>,
    member: Member,
    /// This process: a lease held by another incarnation of the node is
    /// waited out, never taken over while it may be live.
    incarnation: String,
    config: LeaseConfig,
    backup: Arc<BackupName>,
    /// The copy an earlier start's lapsed lease named, left a lapse to its
    /// backup already (not again, should the taking be tried again).
    left_to: std::sync::Mutex<String>,
    /// The incarnation that last held this node's journal directory, which
    /// this process now holds locked: that process is gone, so a lease it
    /// holds is taken back at once (see [`Holder::restarted_in_place`]).
    predecessor: Option<String>,
    /// Counts the times this process took the lease (not renewals): at
    /// start, and again after it was revoked.
    taken: watch::Sender<u64>,
}

impl Holder {
    pub fn new(
        store: Arc<dyn RingStore>,
        member: Member,
        config: LeaseConfig,
        backup: Arc<BackupName>,
    ) -> Holder {
        Holder {
            store,
            member,
            incarnation: incarnation(),
            config,
            backup,
            left_to: std::sync::Mutex::default(),
            predecessor: None,
            taken: watch::Sender::new(0),
        }
    }

    /// This process, as its lease record names it (the backup stream names
    /// it too).
    pub fn incarnation(&self) -> &str {
        &self.incarnation
    }

    /// `predecessor` held this node's journal directory before this
    /// process, which now holds it locked: the kernel let go of that
    /// process's lock, so it is gone, and a lease it still holds is taken
    /// back at once, rather than waited out and left to the backup's
    /// takeover, which would cost a move out and a rejoin. Safe only while
    /// the journal is synced before every answer (its replay then holds all
    /// that process answered) and the lock reaches every machine that
    /// mounts the directory (`docs/failover.md`, "Restarted in place").
    pub fn restarted_in_place(mut self, predecessor: Option<String>) -> Holder {
        self.predecessor = predecessor.filter(|p| !p.is_empty());
        self
    }

    /// Bumped each time this process takes the lease (at start, and again
    /// after a revocation): [`super::presence::Presence::keep`] rejoins then.
    pub fn takes(&self) -> watch::Receiver<u64> {
        self.taken.subscribe()
    }

    fn node(&self) -> &str {
        self.member.id()
    }

    /// Takes the lease and renews it until `stop`, which is to come once
    /// nothing is served any more (at the end of a stop); then releases
    /// it, so that the next start need not wait it out.
    pub async fn run(self, stop: CancellationToken) {
        let mut held: Option<LeaseRecord> = None;
        let mut wanted = self.backup.wanted.subscribe();
        loop {
            // A renewal that hangs must not outlast the lease: the next one
            // is tried instead (a taking may wait out an earlier lease, and
            // a lapse more for a copy it names, then adopt the ring).
            let within = match held {
                Some(_) => self.config.renew_every(),
                None => self.config.lapse() * 3,
            };
            // Seen before the record is made: a later want renews again.
            let (backup, request) = wanted.borrow_and_update().clone();
            let started = Instant::now();
            let renewing = self.renew_or_take(held.as_ref(), &backup, &stop);
            let attempt = tokio::time::timeout(within, renewing);
            let outcome = tokio::select! {
                outcome = attempt => outcome.unwrap_or_else(|_| {
                    Err(StoreError::new("ring", format!("no answer within {within:?}")))
                }),
                () = stop.cancelled() => break,
            };
            match outcome {
                Ok(Some((record, sent))) => {
                    self.member
                        .ownership()
                        .lease(Some(sent + self.config.duration));
                    if held.is_none() {
                        tracing::info!(renewals = record.renewals, "lease taken");
                        self.taken.send_modify(|taken| *taken += 1);
                    }
                    counter!(LEASE_RENEWALS, "result" => "applied").increment(1);
                    self.backup.applied(&record, request);
                    held = Some(record);
                }
                // Not taken: the record changed since it was read (a
                // takeover took it first, say); looked at again.
                Ok(None) if held.is_none() => {}
                Ok(None) => {
                    counter!(LEASE_RENEWALS, "result" => "lost").increment(1);
                    held = tokio::select! {
                        held = self.lost() => held,
                        () = stop.cancelled() => break,
                    };
                    // Read back: which request it was made from is not
                    // known (an earlier renewal's answer may have been lost).
                    if let Some(record) = &held {
                        self.backup.applied(record, 0);
                    }
                }
                Err(e) => {
                    // The deadline passes by itself if this goes on.
                    counter!(LEASE_RENEWALS, "result" => "failed").increment(1);
                    tracing::warn!(error = %e, "cannot renew the lease");
                }
            }
            gauge!(LEASE_HELD).set(if self.member.ownership().leased() {
                1.0
            } else {
                0.0
            });
            // Renewals start a quarter of the lease apart, however long
            // each took: waiting that long after a slow one, and again after
            // one given up, left the lease to lapse between two renewals
            // that applied (found by `loadtest/cluster.sh` with the 1.2 s
            // lease: the entry node fenced itself for a moment under load).
            // A backup to name (or to name no more) is renewed at once.
            tokio::select! {
                () = tokio::time::sleep_until(started + self.config.renew_every()) => {}
                _ = wanted.changed(), if held.is_some() => {}
                () = stop.cancelled() => break,
            }
        }
        // Nothing served from here on, before the next start may take it.
        self.member.ownership().lease(Some(Instant::now()));
        if let Some(record) = held {
            let released = LeaseRecord {
                holder: String::new(),
                renewals: record.renewals + 1,
                backup: NO_BACKUP.to_owned(),
                lease: None,
            };
            match self
                .store
                .swap_lease(self.node(), Some(&record), &released)
                .await
            {
                Ok(true) => tracing::info!("lease released"),
                Ok(false) => tracing::warn!("the lease was revoked before it was released"),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot release the lease; the next start waits it out")
                }
            }
        }
        gauge!(LEASE_HELD).set(0.0);
    }

    /// Renews `held`, or takes the lease; `None`: it was revoked or taken.
    /// With the record, the instant before the compare-and-set that made
    /// it was sent: the lease runs from there.
    async fn renew_or_take(
        &self,
        held: Option<&LeaseRecord>,
        backup: &str,
        stop: &CancellationToken,
    ) -> Result<Option<(LeaseRecord, Instant)>, StoreError> {
        let store = &*self.store;
        let seen = match held {
            Some(held) => Some(held.clone()),
            None => match store.lease(self.node()).await? {
                None => None,
                Some(seen) if !seen.held() || seen.holder == self.incarnation => Some(seen),
                Some(seen) if self.predecessor.as_deref() == Some(seen.holder.as_str()) => {
                    tracing::info!(
                        "the lease is held by the earlier start of this node, whose journal this one \
                         holds locked: that process is gone, so the lease is taken back at once"
                    );
                    Some(seen)
                }
                Some(_) => {
                    loop {
                        tracing::info!(within = ?self.config.lapse(), "the lease is held by an earlier start of this node; waiting it out");
                        match watch(store, self.node(), self.config).await? {
                            // It names a copy of that start's unwritten changes:
                            // the backup holding it takes this node over with it
                            // (writing it first). Taken now, this start would
                            // serve users from a store that lacks the copy, and
                            // its own newer changes would beat it there. Left a
                            // lapse more; then taken (nobody acted: that backup
                            // is gone too).
                            Seen::Lapsed(seen)
                                if names_a_copy(&seen) && self.leave_to(&seen.backup) =>
                            {
                                tracing::info!(copy = %seen.backup, "the earlier start's lease names a copy of its unwritten changes: leaving its backup a lapse to take over");
                            }
                            Seen::Lapsed(seen) | Seen::Free(Some(seen)) => break Some(seen),
                            Seen::Free(None) => break None,
                            Seen::Live if stop.is_cancelled() => return Ok(None),
                            Seen::Live => match store.lease(self.node()).await? {
                                Some(r) if r.holder.starts_with(TAKEOVER_BY) => {
                                    tracing::info!(holder = %r.holder, "this node is being taken over; waiting for it");
                                    // Its journal's replay holds nothing the
                                    // store will lack: dropped, not written.
                                    if r.copy_written_by_takeover() {
                                        let dropped = self.member.cache().drop_replayed();
                                        if dropped > 0 {
                                            tracing::info!(
                                                users = dropped,
                                                "taken over, the copy written: the users replayed from the journal are dropped, not written"
                                            );
                                        }
                                    }
                                }
                                Some(r) if r.held() => tracing::error!(
                                    holder = %r.holder,
                                    "another process renews this node's lease: is this node id running twice?"
                                ),
                                // Revoked by a takeover about to hold it.
                                _ => tracing::debug!("the earlier start's lease was revoked"),
                            },
                        }
                    }
                }
            },
        };
        if held.is_none() {
            self.adopt_the_ring().await?;
        }
        let mine = self.record(seen.as_ref().map_or(0, |seen| seen.renewals + 1), backup);
        let sent = Instant::now();
        let applied = store.swap_lease(self.node(), seen.as_ref(), &mine).await?;
        Ok(applied.then_some((mine, sent)))
    }

    /// Before the lease is taken (at start, or again after a revocation):
    /// this node adopts the ring as it is now and lets go of the slots it
    /// lost there, so that it serves nothing a takeover gave away while it
    /// was down, once the lease is its own. Found by
    /// `tests/failover_simulation.rs`: a node restarted after kill -9 took
    /// back slots of the ring as it was, then its lease freed by the
    /// takeover that had just given them to others, and served them beside
    /// their new owners until its next read of the ring. The ring is read
    /// after the lease record the take is made from: a takeover since
    /// changed that record, and the take fails.
    async fn adopt_the_ring(&self) -> Result<(), StoreError> {
        let epoch = self.store.load().await?.ring.epoch();
        self.member.catch_up(epoch, self.config.lapse()).await;
        let adopted = self.member.ring().ring.epoch();
        if adopted < epoch {
            return Err(StoreError::new(
                "ring",
                format!("epoch {epoch} not adopted yet (at {adopted})"),
            ));
        }
        self.member.releases_done(epoch).await;
        Ok(())
    }

    /// Whether `copy` is yet to be left a lapse to its backup (then it is).
    fn leave_to(&self, copy: &str) -> bool {
        let mut left_to = self.left_to.lock().unwrap_or_else(|p| p.into_inner());
        let first = *left_to != copy;
        copy.clone_into(&mut left_to);
        first
    }

    fn record(&self, renewals: u64, backup: &str) -> LeaseRecord {
        LeaseRecord {
            holder: self.incarnation.clone(),
            renewals,
            backup: backup.to_owned(),
            lease: Some(self.config.duration),
        }
    }

    /// A renewal did not apply: stops serving now, unless the record is
    /// this incarnation's after all (an earlier call applied, its answer
    /// lost). A revoked lease is taken again only once this node has
    /// adopted the ring as it is now: whoever revoked it gave its slots
    /// away first. Returns the lease still held, if it is.
    async fn lost(&self) -> Option<LeaseRecord> {
        match self.store.lease(self.node()).await {
            Ok(Some(record)) if record.holder == self.incarnation => return Some(record),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot read the lease"),
        }
        self.member.ownership().lease(Some(Instant::now()));
        tracing::warn!(
            "the lease was revoked (a takeover, or an operator's --force): serving nothing until \
             this node has adopted the ring as it is now; with --join-weight it then rejoins"
        );
        // Never taken again before the ring as it is now is adopted, and
        // its releases done: until then the slots it lost read as its own.
        let epoch = loop {
            match self.store.load().await {
                Ok(record) => break record.ring.epoch(),
                Err(e) => tracing::warn!(error = %e, "cannot read the ring"),
            }
            tokio::time::sleep(self.config.renew_every()).await;
        };
        self.member.catch_up(epoch, self.config.lapse()).await;
        self.member.releases_done(epoch).await;
        None
    }
}

/// Whether `record` names a copy of its holder's unwritten changes held by
/// a backup (not none, nor empty: a build before names).
fn names_a_copy(record: &LeaseRecord) -> bool {
    !record.backup.is_empty() && record.backup != NO_BACKUP
}

/// A random id for this process (a lease names the incarnation holding it).
pub fn incarnation() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    if let Ok(since) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(since.as_nanos());
    }
    format!("{:016x}", hasher.finish())
}

#[cfg(test)]
mod tests;
