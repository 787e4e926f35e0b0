//! This node's place in the ring, kept by the node itself: it joins at a
//! weight when it is not in the ring, drains itself on stop (its weight to
//! 0, its slots handed to the others warm), and takes back the weight it
//! drained from when it starts again, or when it was taken out of the ring
//! while it lived ([`Presence::keep`]). Changes go through [`admin::change`]
//! like an operator's, so they stay one at a time: a node whose change is
//! refused because another is still being handed over waits its turn
//! (logged, and counted in `readstates_ring_change_waits_total`).

use std::sync::Arc;
use std::time::Duration;

use metrics::counter;
use readstates_routing::Node;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::admin::{self, AdminError, RingChange};
use super::ring_store::RingStore;
use crate::metrics::RING_CHANGE_WAITS;

/// Between two tries of a change that had to wait its turn.
const TURN_POLL: Duration = Duration::from_millis(500);

#[derive(Clone, Debug)]
pub struct Presence {
    pub ring_store: Arc<dyn RingStore>,
    /// This node, at the weight it joins with.
    pub node: Node,
}

impl Presence {
    /// Adds this node at its weight if the ring does not have it, or gives
    /// it back the weight it drained from; waits its turn until `stop`.
    /// Returns the change made, if any.
    pub async fn join(&self, stop: &CancellationToken) -> Result<Option<u64>, AdminError> {
        self.join_as(false, stop).await
    }

    /// [`Presence::join`]; `again` (the lease taken again after it was
    /// revoked): added back only at a weight a takeover remembered, so that
    /// a node an operator removed (`ring remove`) is not.
    async fn join_as(
        &self,
        again: bool,
        stop: &CancellationToken,
    ) -> Result<Option<u64>, AdminError> {
        let id = self.node.id.as_str();
        loop {
            let record = self.ring_store.load().await?;
            let change = match record.ring.node(id) {
                None if again => match self.ring_store.drained_weight(id).await? {
                    Some(weight) => RingChange::Add(Node {
                        weight,
                        ..self.node.clone()
                    }),
                    None => return Ok(None),
                },
                None => RingChange::Add(self.node.clone()),
                Some(node) if node.weight == 0 => match self.ring_store.drained_weight(id).await? {
                    Some(weight) => RingChange::SetWeight {
                        node: id.to_owned(),
                        weight,
                    },
                    // At 0 by an operator's choice (a canary not ramped yet).
                    None => return Ok(None),
                },
                Some(node) => {
                    if node.address != self.node.address {
                        tracing::warn!(ring = %node.address, advertise = %self.node.address, "the ring has this node at another address");
                    }
                    return Ok(None);
                }
            };
            let made = tokio::select! {
                made = self.in_turn(change, None) => made?,
                () = stop.cancelled() => return Ok(None),
            };
            if let Some(epoch) = made {
                self.ring_store.set_drained_weight(id, None).await?;
                tracing::info!(epoch, "joined the ring");
                return Ok(Some(epoch));
            }
        }
    }

    /// Joins each time this process takes its lease (`takes` counts them):
    /// at start, and again after a takeover revoked it, whether the node
    /// lived through it (its store cut off, or frozen) or was started again
    /// while it was taken over. Either way the takeover's epoch removed
    /// the node and remembered its weight (`admin::take_over`), and the
    /// lease is taken only once that ring is adopted, so the join finds it
    /// out and adds it back at that weight, warm like any join. A node an
    /// operator removed (`ring remove`, or `--force`) has no weight
    /// remembered, and is not added back, even if a takeover revokes its
    /// lease later (found in review: one frozen after a plain removal was
    /// added back). Until `stop`.
    pub async fn keep(&self, mut takes: watch::Receiver<u64>, stop: &CancellationToken) {
        let mut again = false;
        loop {
            tokio::select! {
                changed = takes.changed() => if changed.is_err() { return },
                () = stop.cancelled() => return,
            }
            // A ring store that fails now is tried again, not given up.
            loop {
                match self.join_as(again, stop).await {
                    Ok(_) => break,
                    Err(AdminError::Store(e)) => {
                        tracing::warn!(error = %e, "cannot join the ring yet; trying again");
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "cannot join the ring; `readstates ring add` it");
                        break;
                    }
                }
                tokio::select! {
                    () = tokio::time::sleep(TURN_POLL * 2) => {}
                    () = stop.cancelled() => return,
                }
            }
            again = true;
        }
    }

    /// Sets this node's weight to 0, remembering the weight it had, and
    /// waits until the others serve its slots; all within `within`.
    pub async fn drain(&self, within: Duration) -> Result<(), AdminError> {
        let deadline = Instant::now() + within;
        let id = self.node.id.as_str();
        loop {
            let record = self.ring_store.load().await?;
            let weight = match record.ring.node(id) {
                Some(node) if node.weight > 0 => node.weight,
                _ => return Ok(()),
            };
            // First, so that a node that dies while draining still gets its
            // weight back when it starts again.
            self.ring_store.set_drained_weight(id, Some(weight)).await?;
            let change = RingChange::SetWeight {
                node: id.to_owned(),
                weight: 0,
            };
            let made = self.in_turn(change, Some(deadline)).await;
            if made.is_err() {
                // Not drained: the weight stays, and is no drained one.
                self.ring_store.set_drained_weight(id, None).await?;
            }
            if let Some(epoch) = made? {
                tracing::info!(epoch, weight, "draining: slots handed to the other nodes");
                let left = deadline.saturating_duration_since(Instant::now());
                return admin::wait_served(&*self.ring_store, epoch, left).await;
            }
        }
    }

    /// Makes `change` once no other is being handed over (by `deadline`,
    /// if any); the epoch it made, or `None` if another change made the ring
    /// move first (the caller looks again).
    async fn in_turn(
        &self,
        change: RingChange,
        deadline: Option<Instant>,
    ) -> Result<Option<u64>, AdminError> {
        let mut waited = false;
        loop {
            match admin::change(&*self.ring_store, change.clone()).await {
                Ok(record) => return Ok(Some(record.ring.epoch())),
                Err(AdminError::Conflict(_)) => return Ok(None),
                Err(AdminError::HandoffUnderWay { epoch, waiting })
                    if deadline.is_none_or(|d| Instant::now() + TURN_POLL < d) =>
                {
                    if !waited {
                        tracing::info!(epoch, waiting = %waiting.join(", "), ?change, "waiting for the ring change under way");
                        waited = true;
                    }
                    counter!(RING_CHANGE_WAITS).increment(1);
                    tokio::time::sleep(TURN_POLL).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ring_store::memory::MemoryRingStore;

    fn presence(ring: &Arc<MemoryRingStore>, id: &str, weight: u32) -> Presence {
        Presence {
            ring_store: ring.clone(),
            node: Node {
                id: id.to_owned(),
                address: format!("{id}:50051"),
                weight,
            },
        }
    }

    /// Every owner of the current epoch reports it served (the nodes' part).
    async fn serve(ring: &MemoryRingStore) {
        let record = ring.load().await.unwrap();
        for node in record.ring.nodes() {
            ring.report(&node.id, record.ring.epoch()).await.unwrap();
        }
    }

    fn weight(record: &crate::cluster::RingRecord, id: &str) -> Option<u32> {
        record.ring.node(id).map(|n| n.weight)
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_joins_drains_and_takes_its_weight_back() {
        let ring = Arc::new(MemoryRingStore::default());
        let stop = CancellationToken::new();
        let (a, b) = (presence(&ring, "a", 100), presence(&ring, "b", 50));
        assert_eq!(a.join(&stop).await.unwrap(), Some(1));
        serve(&ring).await;
        assert_eq!(b.join(&stop).await.unwrap(), Some(2));
        serve(&ring).await;
        assert_eq!(a.join(&stop).await.unwrap(), None, "in the ring already");

        // An operator's weight stays what it is across a drain and rejoin.
        admin::change(
            &*ring,
            RingChange::SetWeight {
                node: "b".into(),
                weight: 70,
            },
        )
        .await
        .unwrap();
        serve(&ring).await;
        let draining = tokio::spawn({
            let b = b.clone();
            async move { b.drain(Duration::from_secs(5)).await }
        });
        // The drain waits until the other node serves b's slots.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!draining.is_finished());
        let record = ring.load().await.unwrap();
        assert_eq!(weight(&record, "b"), Some(0));
        serve(&ring).await;
        draining.await.unwrap().unwrap();
        assert_eq!(ring.drained_weight("b").await.unwrap(), Some(70));

        assert_eq!(b.join(&stop).await.unwrap(), Some(5));
        assert_eq!(weight(&ring.load().await.unwrap(), "b"), Some(70));
        assert_eq!(ring.drained_weight("b").await.unwrap(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_waits_for_the_one_under_way_and_a_canary_at_0_stays_there() {
        let ring = Arc::new(MemoryRingStore::default());
        let stop = CancellationToken::new();
        presence(&ring, "a", 100).join(&stop).await.unwrap();
        // Epoch 1 not served yet: b waits its turn.
        let b = presence(&ring, "b", 100);
        let joining = tokio::spawn(async move { b.join(&CancellationToken::new()).await });
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!joining.is_finished());
        assert_eq!(ring.load().await.unwrap().ring.epoch(), 1);
        serve(&ring).await;
        assert_eq!(joining.await.unwrap().unwrap(), Some(2));
        serve(&ring).await;

        let canary = presence(&ring, "canary", 0);
        assert_eq!(canary.join(&stop).await.unwrap(), Some(3));
        serve(&ring).await;
        assert_eq!(canary.join(&stop).await.unwrap(), None, "at 0 by choice");
        canary.drain(Duration::from_secs(1)).await.unwrap();
        assert_eq!(
            ring.load().await.unwrap().ring.epoch(),
            3,
            "nothing to drain"
        );

        // A drain that cannot get its turn in time gives up.
        admin::change(
            &*ring,
            RingChange::SetWeight {
                node: "canary".into(),
                weight: 10,
            },
        )
        .await
        .unwrap();
        let refused = presence(&ring, "a", 100)
            .drain(Duration::from_secs(2))
            .await;
        assert!(
            matches!(refused, Err(AdminError::HandoffUnderWay { .. })),
            "{refused:?}"
        );
    }

    /// Issue 35, item 10: a drain refused (the last node with a weight)
    /// left its weight remembered as drained, so a node an operator parked
    /// at 0 afterwards put itself back at that weight on its next start.
    #[tokio::test(start_paused = true)]
    async fn a_weight_is_taken_back_only_from_a_drain_that_was_made() {
        let ring = Arc::new(MemoryRingStore::default());
        let stop = CancellationToken::new();
        let alone = presence(&ring, "n1", 100);
        alone.join(&stop).await.unwrap();
        serve(&ring).await;
        let refused = alone.drain(Duration::from_secs(1)).await;
        assert!(
            matches!(refused, Err(AdminError::NoOwnerLeft)),
            "{refused:?}"
        );
        assert_eq!(ring.drained_weight("n1").await.unwrap(), None);
        // An operator's weight stands, even over a drain that was made.
        let b = presence(&ring, "b", 100);
        b.join(&stop).await.unwrap();
        serve(&ring).await;
        let draining = tokio::spawn({
            let alone = alone.clone();
            async move { alone.drain(Duration::from_secs(5)).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        serve(&ring).await;
        draining.await.unwrap().unwrap();
        assert_eq!(ring.drained_weight("n1").await.unwrap(), Some(100));
        let parked = RingChange::SetWeight {
            node: "n1".into(),
            weight: 0,
        };
        admin::operator_change(&*ring, parked).await.unwrap();
        serve(&ring).await;
        assert_eq!(alone.join(&stop).await.unwrap(), None, "at 0 by choice");
        assert_eq!(weight(&ring.load().await.unwrap(), "n1"), Some(0));
    }

    /// Issue 53: `--join-weight` joined once, at start. A node its backup
    /// took over (alive through a store outage, or started again during
    /// the takeover) then held its lease out of the ring for good. Now it
    /// joins each time it takes its lease, at the weight the takeover
    /// remembered; an operator's removal is not undone.
    #[tokio::test(start_paused = true)]
    async fn a_node_taken_out_of_the_ring_joins_again_when_it_takes_its_lease() {
        let ring = Arc::new(MemoryRingStore::default());
        let stop = CancellationToken::new();
        presence(&ring, "b", 100).join(&stop).await.unwrap();
        serve(&ring).await;
        let a = presence(&ring, "a", 100);
        let (taken, takes) = watch::channel(0);
        let keeping = tokio::spawn({
            let (a, stop) = (a.clone(), stop.clone());
            async move { a.keep(takes, &stop).await }
        });
        taken.send_modify(|n| *n += 1);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(weight(&ring.load().await.unwrap(), "a"), Some(100));
        serve(&ring).await;

        // A takeover's epoch removes it and remembers its weight
        // (`admin::take_over`); its lease is taken again once that ring is
        // adopted.
        let remove = RingChange::Remove { node: "a".into() };
        admin::change(&*ring, remove.clone()).await.unwrap();
        ring.set_drained_weight("a", Some(100)).await.unwrap();
        serve(&ring).await;
        taken.send_modify(|n| *n += 1);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            weight(&ring.load().await.unwrap(), "a"),
            Some(100),
            "taken over, it did not join again"
        );
        serve(&ring).await;

        assert_eq!(ring.drained_weight("a").await.unwrap(), None);

        // An operator's removal remembers no weight: not added back, even
        // should a takeover revoke its lease later (found in review).
        admin::change(&*ring, remove).await.unwrap();
        serve(&ring).await;
        taken.send_modify(|n| *n += 1);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(weight(&ring.load().await.unwrap(), "a"), None);
        stop.cancel();
        keeping.await.unwrap();
    }
}
