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
}

impl Sightings {
    /// Reads the lease of every node `backups` holds for until `stop`:
    /// those whose stream broke every [`LeaseConfig::watch_every`], the
    /// others every [`LeaseConfig::renew_every`].
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
                    self.read(store, &node).await;
                }
            }
            tokio::select! {
                () = tokio::time::sleep(lease.watch_every()) => {}
                () = stop.cancelled() => return,
            }
        }
    }

    async fn read(&self, store: &dyn RingStore, node: &str) {
        let before = Instant::now();
        let record = match store.lease(node).await {
            Ok(record) => record,
            Err(e) => {
                tracing::debug!(node, error = %e, "cannot read a lease");
                return;
            }
        };
        let now = Instant::now();
        let mut sightings = self.lock();
        match sightings.get_mut(node) {
            Some(seen) if seen.record == record => {
                seen.confirmed = before;
                seen.read = now;
            }
            _ => {
                let seen = Sighting {
                    record,
                    since: now,
                    confirmed: now,
                    read: now,
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
            Some(record) => (seen.confirmed.saturating_duration_since(seen.since) >= lease.lapse())
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

    /// A lease renewed on time is never seen lapsed; once its renewals
    /// stop, it is seen lapsed no sooner than the lease plus its margin
    /// after the last one, and not much later.
    #[tokio::test(start_paused = true)]
    async fn a_lease_is_seen_lapsed_only_a_lapse_after_its_last_renewal() {
        let store = Arc::new(MemoryRingStore::default());
        let backups = Backups::new();
        let stream = backups.open("x", "i1", "t");
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
        let record = |renewals| LeaseRecord {
            holder: "x's incarnation".to_owned(),
            renewals,
            backup: "t".to_owned(),
        };
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
}
