//! What a backup has seen of the leases of the nodes it backs up, read all
//! along rather than from when a stream breaks: a node frozen or killed is
//! seen lapsed the lease plus its margin after its last renewal, not that
//! long after its backup noticed (a frozen sender is noticed only after
//! some silence).
//!
//! The arithmetic is [`crate::cluster::lease::watch`]'s: a record is timed
//! from the instant the read that first returned it *returned* (the
//! renewal may have applied while the read ran), and judged unchanged up to
//! the instant *before* the last read that still returned it.
//!
//! Only reads the store answered in time count: a read that fails, or
//! takes longer than a renewal may (the holder gives a renewal a quarter of
//! the lease), starts the record's timing again from the next read that
//! answers. A store outage silences every node alike, so it is never read
//! as the silence of one (issue 53: a backup took a live node over when
//! Cassandra came back from an 8 s reset, its last sighting from before the
//! outage).

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::held::Backups;
use crate::cluster::lease::LeaseConfig;
use crate::cluster::ring_store::{LeaseRecord, RingStore};

/// The leases of the nodes held for, as last read.
#[derive(Debug, Default)]
pub struct Sightings {
    by_node: Mutex<HashMap<String, Sighting>>,
}

#[derive(Clone, Debug)]
struct Sighting {
    record: Option<LeaseRecord>,
    /// When the read that first returned `record` returned.
    since: Instant,
    /// When the last read that still returned it was sent.
    confirmed: Instant,
    /// When it was read last.
    read: Instant,
    /// A read failed or was slow since `confirmed`: the next that answers
    /// starts the timing again.
    interrupted: bool,
}

impl Sightings {
    /// Reads the lease of every node `backups` holds for until `stop`:
    /// those whose stream broke every [`LeaseConfig::watch_every`], the
    /// others every [`LeaseConfig::renew_every`] (reads at `SERIAL`, which
    /// contend with the renewals; a frozen node's stream breaks after a
    /// second of silence, see `super::receive`).
    pub async fn track(
        &self,
        backups: &Backups,
        store: &dyn RingStore,
        lease: LeaseConfig,
        stop: CancellationToken,
    ) {
        loop {
            let broken: Vec<String> = backups.broken().into_iter().map(|(n, _)| n).collect();
            let nodes = backups.nodes();
            self.lock().retain(|node, _| nodes.contains(node));
            for node in nodes {
                let due = self.lock().get(&node).is_none_or(|s| {
                    let every = match broken.contains(&node) {
                        true => lease.watch_every(),
                        false => lease.renew_every(),
                    };
                    s.read.elapsed() >= every
                });
                if due {
                    self.read(store, &node, lease).await;
                }
            }
            tokio::select! {
                () = tokio::time::sleep(lease.watch_every()) => {}
                () = stop.cancelled() => return,
            }
        }
    }

    async fn read(&self, store: &dyn RingStore, node: &str, lease: LeaseConfig) {
        let before = Instant::now();
        let read = store.lease(node).await;
        let now = Instant::now();
        let mut sightings = self.lock();
        let record = match read {
            Ok(record) if now.duration_since(before) <= lease.renew_every() => record,
            Ok(_) | Err(_) => {
                if let Err(e) = read {
                    tracing::debug!(node, error = %e, "cannot read a lease");
                }
                // The holder could not renew through this either.
                if let Some(seen) = sightings.get_mut(node) {
                    seen.interrupted = true;
                    seen.read = now;
                }
                return;
            }
        };
        match sightings.get_mut(node) {
            Some(seen) if seen.record == record && !seen.interrupted => {
                seen.confirmed = before;
                seen.read = now;
            }
            _ => {
                let seen = Sighting {
                    record,
                    since: now,
                    confirmed: now,
                    read: now,
                    interrupted: false,
                };
                sightings.insert(node.to_owned(), seen);
            }
        }
    }

    /// `node`'s lease if it has been seen unrenewed for `lease`'s lapse:
    /// `Some(record)` (with `None` inside: released, revoked or never
    /// taken); `None` while it may be live, or was never read.
    pub fn lapsed(&self, node: &str, lease: LeaseConfig) -> Option<Option<LeaseRecord>> {
        let sightings = self.lock();
        let seen = sightings.get(node)?;
        let held = seen.record.as_ref().filter(|r| r.held());
        match held {
            None => Some(None),
            Some(record) => (seen.confirmed.saturating_duration_since(seen.since)
                >= lease.lapse_of(record))
            .then(|| Some(record.clone())),
        }
    }

    /// `node`'s lease record as last read (`None` if never read).
    pub fn record(&self, node: &str) -> Option<Option<LeaseRecord>> {
        Some(self.lock().get(node)?.record.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Sighting>> {
        self.by_node.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::cluster::ring_store::memory::MemoryRingStore;

    const LEASE: LeaseConfig = LeaseConfig {
        duration: Duration::from_secs(3),
        margin: Duration::from_secs(1),
    };

    /// Sightings tracking `backups`' nodes in `store`, and what stops them.
    fn tracked(
        store: &Arc<MemoryRingStore>,
        backups: &Arc<Backups>,
    ) -> (
        Arc<Sightings>,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let sightings = Arc::new(Sightings::default());
        let stop = CancellationToken::new();
        let tracking = tokio::spawn({
            let (sightings, backups, store, stop) = (
                sightings.clone(),
                backups.clone(),
                store.clone(),
                stop.clone(),
            );
            async move { sightings.track(&backups, &*store, LEASE, stop).await }
        });
        (sightings, stop, tracking)
    }

    /// x's lease record after `renewals` renewals, naming copy `t`.
    fn record(renewals: u64) -> LeaseRecord {
        LeaseRecord {
            holder: "x's incarnation".to_owned(),
            renewals,
            backup: "t".to_owned(),
            lease: Some(LEASE.duration),
        }
    }

    /// A lease renewed on time is never seen lapsed; once its renewals
    /// stop, it is seen lapsed no sooner than the lease plus its margin
    /// after the last one, and not much later.
    #[tokio::test(start_paused = true)]
    async fn a_lease_is_seen_lapsed_only_a_lapse_after_its_last_renewal() {
        let store = Arc::new(MemoryRingStore::default());
        let backups = Backups::new();
        let stream = backups.open("x", "i1", "t");
        let (sightings, stop, tracking) = tracked(&store, &backups);
        let mut seen = None;
        for renewals in 0..20 {
            let next = record(renewals);
            assert!(store.swap_lease("x", seen.as_ref(), &next).await.unwrap());
            seen = Some(next);
            tokio::time::sleep(LEASE.renew_every()).await;
            assert_eq!(sightings.lapsed("x", LEASE), None, "live, seen lapsed");
        }
        backups.broke("x", stream);
        let last = Instant::now() - LEASE.renew_every();
        while sightings.lapsed("x", LEASE).is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let after = last.elapsed();
        assert!(after >= LEASE.lapse(), "seen lapsed {after:?} after");
        assert!(
            after <= LEASE.lapse() + LEASE.renew_every(),
            "seen lapsed {after:?} after"
        );
        assert_eq!(sightings.lapsed("x", LEASE), Some(seen));
        stop.cancel();
        tracking.await.unwrap();
    }

    /// Issue 53: a store outage longer than the lapse, the node renewing
    /// as soon as the store answers again, was read as the node's silence:
    /// the first read after the outage confirmed the record seen before it.
    #[tokio::test(start_paused = true)]
    async fn a_store_outage_is_not_read_as_a_nodes_silence() {
        let store = Arc::new(MemoryRingStore::default());
        let backups = Backups::new();
        let stream = backups.open("x", "i1", "t");
        backups.broke("x", stream);
        let (sightings, stop, tracking) = tracked(&store, &backups);
        let mut seen = None;
        let mut renew = async |renewals| {
            let next = record(renewals);
            assert!(store.swap_lease("x", seen.as_ref(), &next).await.unwrap());
            seen = Some(next);
        };
        for renewals in 0..4 {
            renew(renewals).await;
            tokio::time::sleep(LEASE.renew_every()).await;
        }
        // Every lease call fails for 8 s, the holder's renewals too.
        store.cut_off("x", true);
        for _ in 0..80 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert_eq!(
                sightings.lapsed("x", LEASE),
                None,
                "seen lapsed in the outage"
            );
        }
        store.cut_off("x", false);
        // The holder's next renewal lands a renewal period later.
        for _ in 0..LEASE.renew_every().as_millis() / 10 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert_eq!(
                sightings.lapsed("x", LEASE),
                None,
                "a sighting from before the outage judged the lease lapsed"
            );
        }
        renew(4).await;
        tokio::time::sleep(LEASE.duration / 2).await;
        assert_eq!(sightings.lapsed("x", LEASE), None, "renewed, seen lapsed");
        stop.cancel();
        tracking.await.unwrap();
    }
}
