//! Changes to the ring, one at a time (`readstates ring ...` makes them, see
//! [`crate::ring_command`]).
//! A change is refused while the previous one is still being handed over
//! (some owner of the current epoch does not serve all its slots yet), so
//! at most two epochs are ever live: the one being left and the current.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use readstates_routing::ring::NO_OWNER;
use readstates_routing::{Node, RingError, Slot};

use super::lease::TAKEOVER_BY;
use super::lease::hold::{Fenced, Hold};
use super::lease::{self, LeaseConfig, Seen};
use super::peers::Peers;
use super::ring_store::{LeaseRecord, NO_BACKUP, OPERATOR_TAKEOVER, RingRecord, RingStore};
use crate::store::StoreError;

/// A change to the ring, each making a new epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RingChange {
    Add(Node),
    SetWeight { node: String, weight: u32 },
    Remove { node: String },
}

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error(
        "epoch {epoch} is still being handed over: {waiting} not serving all their slots yet. \
         Try again once `readstates ring show` shows nobody waiting; if a node it waits on is dead \
         for good, `readstates ring remove NODE --force` (or, if it left the ring already, \
         `readstates ring release NODE --force`)",
        waiting = .waiting.join(", ")
    )]
    HandoffUnderWay { epoch: u64, waiting: Vec<String> },
    #[error(
        "this change leaves every weight at 0, so no node would own the slots; keep at least one \
         node's weight above 0 (to replace the last node, add the new one first)"
    )]
    NoOwnerLeft,
    #[error("another change made epoch {0} first; look again with `readstates ring show`")]
    Conflict(u64),
    #[error("{node} has no slot to release in epoch {epoch}")]
    NothingToRelease { node: String, epoch: u64 },
    #[error(
        "{node} is to release {slots} slots in epoch {epoch}. Releasing them by force lets their \
         new owners serve them from the store at once: whatever {node} has not written yet is \
         lost, and if it is still running it may go on changing them. Only for a node that is \
         dead; pass --force to do it"
    )]
    ForceRequired {
        node: String,
        slots: usize,
        epoch: u64,
    },
    #[error(
        "{node} renewed its lease within the last {within:?}: it is running and serves its \
         slots. Stop it, or drain it; `--ignore-lease` releases them anyway (two nodes may then \
         serve them until it sees its lease revoked)"
    )]
    LeaseLive { node: String, within: Duration },
    #[error(
        "{by} is taking {node} over (it holds {node}'s lease): wait for it (`readstates ring show`)"
    )]
    TakeoverUnderWay { node: String, by: String },
    #[error(
        "{node}'s lease names a copy of its unwritten changes held by {backup}, which renews its \
         own lease: {backup} takes {node} over by itself, losing nothing. Wait for it \
         (`readstates ring show`); `--ignore-lease` removes {node} anyway, losing that copy"
    )]
    CopyHeld { node: String, backup: String },
    #[error("epoch {epoch} not served after {after:?}: waiting on {waiting}", waiting = .waiting.join(", "))]
    StillWaiting {
        epoch: u64,
        after: Duration,
        waiting: Vec<String>,
    },
}

/// Makes the next epoch, if the current one is fully served.
pub async fn change(store: &dyn RingStore, change: RingChange) -> Result<RingRecord, AdminError> {
    let record = store.load().await?;
    let waiting = record.waiting_on(&store.progress().await?);
    if !waiting.is_empty() {
        return Err(AdminError::HandoffUnderWay {
            epoch: record.ring.epoch(),
            waiting,
        });
    }
    let ring = &record.ring;
    let next = match change {
        RingChange::Add(node) => ring.with_node(node)?,
        RingChange::SetWeight { node, weight } => ring.with_weight(&node, weight)?,
        RingChange::Remove { node } => ring.without(&node)?,
    };
    // Found in review: slots that go from owned to no owner would be served
    // by the next node added at once, whatever their last owner still had
    // unwritten (nobody is asked to release an unowned slot).
    let owned = |ring: &readstates_routing::Ring| ring.owners().iter().any(|&o| o != NO_OWNER);
    if owned(&record.ring) && !owned(&next) {
        return Err(AdminError::NoOwnerLeft);
    }
    let next = record.advance(next);
    if !store.advance(&next).await? {
        return Err(AdminError::Conflict(next.ring.epoch()));
    }
    Ok(next)
}

/// [`change`], made by an operator (`readstates ring`): a weight an
/// operator sets, or a node removed, is a choice that stands, so a weight
/// the node drained from is forgotten and not taken back at its next start.
pub async fn operator_change(
    store: &dyn RingStore,
    ring_change: RingChange,
) -> Result<RingRecord, AdminError> {
    let node = match &ring_change {
        RingChange::SetWeight { node, .. } | RingChange::Remove { node } => Some(node.clone()),
        RingChange::Add(_) => None,
    };
    let record = change(store, ring_change).await?;
    if let Some(node) = node {
        store.set_drained_weight(&node, None).await?;
    }
    Ok(record)
}

/// Declares `node`'s moving slots of the current epoch released, so their
/// new owners stop waiting for it; only with `force`, and only once its
/// lease is seen lapsed and is revoked (`lease`; `None`: revoked without
/// waiting, whatever it is). Returns how many.
pub async fn release(
    store: &dyn RingStore,
    node: &str,
    force: bool,
    lease: Option<LeaseConfig>,
) -> Result<usize, AdminError> {
    let record = store.load().await?;
    let epoch = record.ring.epoch();
    let slots = record
        .moving()
        .filter(|&(_, from)| from == Some(node))
        .count();
    if slots == 0 {
        return Err(AdminError::NothingToRelease {
            node: node.to_owned(),
            epoch,
        });
    }
    if !force {
        return Err(AdminError::ForceRequired {
            node: node.to_owned(),
            slots,
            epoch,
        });
    }
    fence(store, node, lease).await?;
    if !record.released.contains(node) && !store.release(epoch, node).await? {
        return Err(AdminError::Conflict(epoch + 1));
    }
    Ok(slots)
}

/// Makes sure `node` serves nothing: its lease seen lapsed, then revoked
/// (see [`lease::watch`]); with no `lease` settings, revoked at once.
pub async fn fence(
    store: &dyn RingStore,
    node: &str,
    lease: Option<LeaseConfig>,
) -> Result<(), AdminError> {
    let Some(seen) = lapsed(store, node, lease).await? else {
        return Ok(());
    };
    if lease::revoke(store, node, &seen).await? {
        return Ok(());
    }
    // Swapped since it was seen: by a takeover that saw it lapse too (found
    // by the Cassandra test of a frozen node released by force, which was
    // told the lease was live), or renewed: live after all.
    let now = store.lease(node).await?;
    Err(now
        .as_ref()
        .and_then(|r| taking(node, r))
        .unwrap_or_else(|| AdminError::LeaseLive {
            node: node.to_owned(),
            within: lease.map_or(Duration::ZERO, |config| config.lapse()),
        }))
}

/// The refusal to fence `node` while `record`, its lease, is a takeover's.
fn taking(node: &str, record: &LeaseRecord) -> Option<AdminError> {
    (record.holder.strip_prefix(TAKEOVER_BY)).map(|by| AdminError::TakeoverUnderWay {
        node: node.to_owned(),
        by: by.to_owned(),
    })
}

/// `node`'s lease record once it may be taken: seen unrenewed for the
/// lease and margin (with no `lease` settings, as it is now); `None` if
/// nobody holds it. Refused while a takeover holds it, even with no
/// `lease` settings: the takeover is writing the node's copy.
async fn lapsed(
    store: &dyn RingStore,
    node: &str,
    lease: Option<LeaseConfig>,
) -> Result<Option<LeaseRecord>, AdminError> {
    let taking = |record: &LeaseRecord| taking(node, record);
    match lease {
        Some(config) => match lease::watch(store, node, config).await? {
            Seen::Free(_) => Ok(None),
            Seen::Lapsed(seen) => Ok(Some(seen)),
            Seen::Live => match store.lease(node).await?.as_ref().and_then(taking) {
                Some(taking) => Err(taking),
                None => Err(AdminError::LeaseLive {
                    node: node.to_owned(),
                    within: config.lapse(),
                }),
            },
        },
        None => match store.lease(node).await? {
            Some(seen) if seen.held() => match taking(&seen) {
                Some(taking) => Err(taking),
                None => Ok(Some(seen)),
            },
            _ => Ok(None),
        },
    }
}

/// Takes `node` out of the ring for good when nothing can take it over
/// (`readstates ring remove NODE --force`): two nodes lost at once, one the
/// other's backup, whose takeover gave slots to the other; a node whose
/// lease named no backup; `--backup false`. A plain [`change`] would wait
/// for it forever. Whatever it had not written is lost.
///
/// As a takeover does (`cluster::backup::takeover`): once its lease is
/// seen lapsed, takes it (so that the node, or a new start of it, serves
/// nothing until this is done, then finds itself out of the ring), renews
/// it while [`take_over`] gives its slots to the others, then frees it.
/// Refused while the record names a copy held by a backup that renews its
/// own lease (that backup takes the node over by itself, losing nothing),
/// unless `lease` is `None` (`--ignore-lease`).
pub async fn remove_dead(
    store: &dyn RingStore,
    peers: &dyn Peers,
    node: &str,
    lease: Option<LeaseConfig>,
) -> Result<RingRecord, AdminError> {
    let next = store.load().await?.ring.without(node)?;
    if !next.owners().iter().any(|&o| o != NO_OWNER) {
        return Err(AdminError::NoOwnerLeft);
    }
    let seen = lapsed(store, node, lease).await?;
    let copy = (seen.as_ref()).and_then(|seen| seen.backup.split_once('/'));
    if let (Some(config), Some((backup, _))) = (lease, copy)
        && next.node(backup).is_some()
        && let Seen::Live = lease::watch(store, backup, config).await?
        // Not a takeover of the backup itself: it died too.
        && !(store.lease(backup).await?).is_some_and(|b| b.holder.starts_with(TAKEOVER_BY))
    {
        return Err(AdminError::CopyHeld {
            node: node.to_owned(),
            backup: backup.to_owned(),
        });
    }
    let config = lease.unwrap_or_default();
    let mut held = LeaseRecord {
        holder: OPERATOR_TAKEOVER.to_owned(),
        renewals: seen.as_ref().map_or(0, |seen| seen.renewals + 1),
        backup: NO_BACKUP.to_owned(),
        lease: Some(config.duration),
    };
    let sent = tokio::time::Instant::now();
    if !store.swap_lease(node, seen.as_ref(), &held).await? {
        return Err(AdminError::LeaseLive {
            node: node.to_owned(),
            within: lease.map_or(Duration::ZERO, |config| config.lapse()),
        });
    }
    // Renewed until done; lost (this command stalled past it, or a
    // renewal did not apply), the removal stops (see `lease::hold`).
    let hold = Hold::new(sent, config.duration);
    let renewing = async {
        while hold.holds() {
            tokio::time::sleep(config.renew_every()).await;
            let next = LeaseRecord {
                renewals: held.renewals + 1,
                ..held.clone()
            };
            let sent = tokio::time::Instant::now();
            match store.swap_lease(node, Some(&held), &next).await {
                Ok(true) => {
                    held = next;
                    hold.renewed(sent);
                }
                Ok(false) => hold.lost(),
                Err(_) => {}
            }
        }
    };
    let fenced = Fenced { store, hold: &hold };
    let taken = tokio::select! {
        taken = take_over(&fenced, peers, "operator", node, false) => taken,
        () = renewing => return Err(AdminError::Store(StoreError::new(
            "ring",
            format!("the hold on {node}'s lease lapsed before it was removed (this command stalled?): nothing more was done; look with `readstates ring show`"),
        ))),
    };
    let free = LeaseRecord {
        holder: String::new(),
        renewals: held.renewals + 1,
        backup: NO_BACKUP.to_owned(),
        lease: None,
    };
    let _ = store.swap_lease(node, Some(&held), &free).await;
    taken
}

/// Takes `dead` out of the ring without its release (its backup does, see
/// [`super::backup::takeover`]): one epoch gives its slots to the others
/// and counts them released, so they serve them at once. Its lease must be
/// revoked already ([`fence`]). Slots it was still to release in the
/// current epoch are released first (as `ring release --force` does); a
/// handoff under way among the others is then waited for, and so is every
/// node that was handing slots to `dead` and has not reported the epoch
/// (it does once its releases are done), asked through `peers` as `me`
/// (a node taken over too, its copy written, is not waited for; the slots
/// handed to it are settled the same way):
/// one whose handoff failed writes those users to the store before it lets
/// them go, and their next owners must find them there. Such a sender that
/// died too, and is out of the ring (so nothing takes it over), holds the
/// takeover until an operator forces its release. Returns the record made
/// (or found, if `dead` is out of the ring already). With `rejoins`, the
/// node's weight is remembered as the one it drained from, so that it adds
/// itself back once it holds its lease again (a backup's takeover of a node
/// that lived, or starts again in place); an operator's `ring remove
/// --force` removes it for good.
pub async fn take_over(
    store: &dyn RingStore,
    peers: &dyn Peers,
    me: &str,
    dead: &str,
    rejoins: bool,
) -> Result<RingRecord, AdminError> {
    // Senders known to have let their slots go, with the epoch.
    let mut let_go: BTreeMap<String, u64> = BTreeMap::new();
    loop {
        let record = store.load().await?;
        if record.ring.node(dead).is_none() {
            return Ok(record);
        }
        let epoch = record.ring.epoch();
        let progress = store.progress().await?;
        // A sender reports the epoch only once its releases are done.
        let done = |id: &str| {
            let_go.get(id) == Some(&epoch) || progress.get(id).is_some_and(|&e| e >= epoch)
        };
        // The nodes yet to report the epoch are waited for, but not one
        // taken over too, its copy written (two nodes dead at once): it
        // reports no epoch until it is out of the ring, and the store holds
        // all it answered (found by the failover simulation: two takeovers
        // by one backup waited for each other). The slots handed to it are
        // settled as the dead one's are (found in review: else their sender
        // might still serve them).
        let mut waiting = record.waiting_on(&progress);
        waiting.retain(|node| node != dead);
        let (mut skipped, mut still) = (Vec::new(), Vec::new());
        for node in waiting {
            let lease = store.lease(&node).await?;
            if lease.is_some_and(|l| l.copy_written_by_takeover()) {
                skipped.push(node);
            } else {
                still.push(node);
            }
        }
        let dead_too = |id: &str| id == dead || skipped.iter().any(|s| s == id);
        // Each sender asked once for all it owes them: its answer counts
        // for the epoch.
        let mut owed: BTreeMap<String, (Node, Vec<Slot>)> = BTreeMap::new();
        let to_them = std::iter::once(dead).chain(skipped.iter().map(String::as_str));
        for (sender, slots) in to_them.flat_map(|to| owed_to(&record, to)) {
            if !dead_too(&sender.id) {
                let entry = owed
                    .entry(sender.id.clone())
                    .or_insert((sender, Vec::new()));
                entry.1.extend(slots);
            }
        }
        if let Some((sender, slots)) = owed.into_values().find(|(sender, _)| !done(&sender.id)) {
            // Until it answers, or is forced or taken over itself (then in
            // `released`), or the epoch moves on.
            match peers
                .release_slots(&sender.address, epoch, &slots, me)
                .await
            {
                Ok(()) => {
                    let_go.insert(sender.id, epoch);
                }
                Err(error) => {
                    tracing::warn!(epoch, sender = %sender.id, %error, "a takeover waits for a release to the dead node");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            continue;
        }
        // Slots it was handing over in this epoch: their new owners wait
        // for a release that will never come.
        let owes = record.moving().any(|(_, from)| from == Some(dead));
        if owes && !record.released.contains(dead) {
            store.release(record.ring.epoch(), dead).await?;
            continue;
        }
        if !still.is_empty() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let next = record.ring.without(dead)?;
        if !next.owners().iter().any(|&o| o != NO_OWNER) {
            return Err(AdminError::NoOwnerLeft);
        }
        let weight = record.ring.node(dead).map_or(0, |n| n.weight);
        let mut next = record.advance(next);
        next.released.insert(dead.to_owned());
        if store.advance(&next).await? {
            // After the epoch: a weight remembered for a node still in the
            // ring would outlive it (`Presence::join` takes it back).
            if rejoins
                && weight > 0
                && let Err(e) = store.set_drained_weight(dead, Some(weight)).await
            {
                tracing::warn!(node = dead, error = %e, "taken over, but its weight is not remembered: it does not add itself back (`readstates ring add` it)");
            }
            return Ok(next);
        }
    }
}

/// The nodes of `record` (other than `dead`, and not released by force)
/// that were handing slots to `dead` in its epoch, with those slots.
fn owed_to(record: &RingRecord, dead: &str) -> Vec<(Node, Vec<Slot>)> {
    let mut owed: BTreeMap<&str, Vec<Slot>> = BTreeMap::new();
    for (slot, from) in record.moving() {
        let to_dead = record.ring.owner(slot).is_some_and(|n| n.id == dead);
        if let Some(from) = from.filter(|&from| to_dead && from != dead)
            && !record.released.contains(from)
        {
            owed.entry(from).or_default().push(slot);
        }
    }
    (owed.into_iter())
        .filter_map(|(id, slots)| Some((record.previous.node(id)?.clone(), slots)))
        .collect()
}

/// Waits until every owner of `epoch` serves all its slots.
pub async fn wait_served(
    store: &dyn RingStore,
    epoch: u64,
    timeout: Duration,
) -> Result<(), AdminError> {
    let started = tokio::time::Instant::now();
    loop {
        let record = store.load().await?;
        if record.ring.epoch() != epoch {
            return Err(AdminError::Conflict(record.ring.epoch()));
        }
        let waiting = record.waiting_on(&store.progress().await?);
        if waiting.is_empty() {
            return Ok(());
        }
        if started.elapsed() >= timeout {
            return Err(AdminError::StillWaiting {
                epoch,
                after: timeout,
                waiting,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The ring as `readstates ring show` prints it.
pub fn describe(record: &RingRecord, progress: &BTreeMap<String, u64>) -> String {
    let ring = &record.ring;
    let mut out = format!("epoch {}\n", ring.epoch());
    let _ = writeln!(
        out,
        "{:<24} {:<28} {:>8} {:>6} {:>7}",
        "node", "address", "weight", "slots", "serving"
    );
    for node in ring.nodes() {
        let serving = progress
            .get(&node.id)
            .map_or_else(|| "-".to_owned(), u64::to_string);
        let _ = writeln!(
            out,
            "{:<24} {:<28} {:>8} {:>6} {:>7}",
            node.id,
            node.address,
            node.weight,
            ring.slots_of(&node.id).count(),
            serving
        );
    }
    let mut moves: BTreeMap<(String, String), usize> = BTreeMap::new();
    for (slot, from) in record.moving() {
        let to = ring.owner(slot).map_or("nobody", |n| n.id.as_str());
        *moves
            .entry((from.unwrap_or("nobody").to_owned(), to.to_owned()))
            .or_default() += 1;
    }
    if moves.is_empty() {
        out.push_str("no slot moved in this epoch\n");
    } else {
        let moves: Vec<String> = moves
            .iter()
            .map(|((from, to), n)| format!("{from} -> {to}: {n}"))
            .collect();
        let _ = writeln!(out, "moved in this epoch: {}", moves.join(", "));
    }
    if !record.released.is_empty() {
        let released: Vec<&str> = record.released.iter().map(String::as_str).collect();
        let _ = writeln!(out, "released by force: {}", released.join(", "));
    }
    let waiting = record.waiting_on(progress);
    if waiting.is_empty() {
        out.push_str("every slot served by its owner\n");
    } else {
        let _ = writeln!(out, "waiting on: {}", waiting.join(", "));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::cluster::ring_store::memory::MemoryRingStore;

    fn node(id: &str, weight: u32) -> Node {
        Node {
            id: id.to_owned(),
            address: format!("{id}:50051"),
            weight,
        }
    }

    #[tokio::test]
    async fn one_change_at_a_time() {
        let store = MemoryRingStore::default();
        let first = change(&store, RingChange::Add(node("a", 100)))
            .await
            .unwrap();
        assert_eq!(first.ring.epoch(), 1);
        assert_eq!(first.moving().count(), readstates_routing::SLOTS);
        // a has not said it serves epoch 1.
        let refused = change(&store, RingChange::Add(node("b", 100))).await;
        assert!(
            matches!(&refused, Err(AdminError::HandoffUnderWay { epoch: 1, waiting }) if waiting == &["a"]),
            "{refused:?}"
        );
        store.report("a", 1).await.unwrap();
        let second = change(&store, RingChange::Add(node("b", 100)))
            .await
            .unwrap();
        assert_eq!(second.previous, first.ring);
        // b gains slots; a keeps the rest and has served epoch 1 only.
        store.report("b", 2).await.unwrap();
        let refused = change(&store, RingChange::Remove { node: "b".into() }).await;
        assert!(
            matches!(&refused, Err(AdminError::HandoffUnderWay { waiting, .. }) if waiting == &["a"])
        );
        store.report("a", 2).await.unwrap();
        let third = change(
            &store,
            RingChange::SetWeight {
                node: "b".into(),
                weight: 0,
            },
        )
        .await
        .unwrap();
        assert!(third.moving().all(|(_, from)| from == Some("b")));
        assert_eq!(third.waiting_on(&store.progress().await.unwrap()), ["a"]);
    }

    #[tokio::test]
    async fn the_last_weight_never_drops_to_zero() {
        let store = MemoryRingStore::default();
        // A canary may join at weight 0 before anyone owns anything.
        change(&store, RingChange::Add(node("a", 0))).await.unwrap();
        store.report("a", 1).await.unwrap();
        change(
            &store,
            RingChange::SetWeight {
                node: "a".into(),
                weight: 10,
            },
        )
        .await
        .unwrap();
        store.report("a", 2).await.unwrap();
        for refused in [
            RingChange::SetWeight {
                node: "a".into(),
                weight: 0,
            },
            RingChange::Remove { node: "a".into() },
        ] {
            let result = change(&store, refused).await;
            assert!(matches!(result, Err(AdminError::NoOwnerLeft)), "{result:?}");
        }
        assert_eq!(store.load().await.unwrap().ring.epoch(), 2);
    }

    #[tokio::test]
    async fn a_concurrent_change_loses() {
        let store = MemoryRingStore::default();
        let record = RingRecord::empty();
        let one = record.advance(record.ring.with_node(node("a", 1)).unwrap());
        let other = record.advance(record.ring.with_node(node("b", 1)).unwrap());
        assert!(store.advance(&one).await.unwrap());
        assert!(!store.advance(&other).await.unwrap());
        assert_eq!(store.load().await.unwrap(), one);
    }

    #[tokio::test]
    async fn release_by_force_only() {
        let store = MemoryRingStore::default();
        change(&store, RingChange::Add(node("a", 100)))
            .await
            .unwrap();
        store.report("a", 1).await.unwrap();
        change(&store, RingChange::Add(node("b", 100)))
            .await
            .unwrap();
        assert!(matches!(
            release(&store, "b", true, None).await,
            Err(AdminError::NothingToRelease { .. })
        ));
        let refused = release(&store, "a", false, None).await;
        assert!(
            matches!(refused, Err(AdminError::ForceRequired { epoch: 2, .. })),
            "{refused:?}"
        );
        assert!(store.load().await.unwrap().released.is_empty());
        let slots = release(&store, "a", true, Some(LeaseConfig::default()))
            .await
            .unwrap();
        assert!(slots > 7000, "{slots}");
        assert_eq!(
            release(&store, "a", true, Some(LeaseConfig::default()))
                .await
                .unwrap(),
            slots
        );
        let record = store.load().await.unwrap();
        assert!(record.released.contains("a"));
        let shown = describe(&record, &store.progress().await.unwrap());
        assert!(shown.contains("released by force: a"), "{shown}");
        assert!(shown.contains("waiting on: a, b"), "{shown}");
    }

    /// Peers of which `a` lets its slots go only once told to (a node
    /// still writing the users it failed to hand over).
    #[derive(Debug)]
    struct Letting {
        asked: std::sync::Mutex<Vec<(String, u64, usize)>>,
        let_go: tokio::sync::watch::Sender<bool>,
    }

    #[async_trait::async_trait]
    impl Peers for Letting {
        async fn release_slots(
            &self,
            address: &str,
            epoch: u64,
            slots: &[readstates_routing::Slot],
            _from: &str,
        ) -> Result<(), String> {
            (self.asked.lock().unwrap()).push((address.to_owned(), epoch, slots.len()));
            let mut let_go = self.let_go.subscribe();
            let_go
                .wait_for(|&done| done)
                .await
                .map_err(|e| e.to_string())?;
            Ok(())
        }

        async fn hand_over(
            &self,
            _address: &str,
            _handoff: crate::cluster::handoff::Handoff,
            _parts: futures::stream::BoxStream<'static, crate::cluster::handoff::Part>,
        ) -> Result<usize, String> {
            Err("no handoffs here".to_owned())
        }
    }

    /// A ring of a, x and d in which x, set to weight 0, hands its slots
    /// to a and d; a serves its share (and says so), d dies before it
    /// serves its own. Returns the store and how many slots x owes d.
    async fn x_draining_to_a_dead_d() -> (Arc<MemoryRingStore>, usize) {
        let store = served_ring(&[("a", 100), ("x", 100), ("d", 100)]).await;
        let to_d = x_drains(&store).await;
        (store, to_d)
    }

    /// A ring of `nodes` (id, weight), each added in an epoch of its own
    /// that every node served.
    async fn served_ring(nodes: &[(&str, u32)]) -> Arc<MemoryRingStore> {
        let store = Arc::new(MemoryRingStore::default());
        for (epoch, &(id, weight)) in (1..).zip(nodes) {
            change(&*store, RingChange::Add(node(id, weight)))
                .await
                .unwrap();
            for &(id, _) in nodes {
                store.report(id, epoch).await.unwrap();
            }
        }
        store
    }

    /// x set to weight 0, its slots going to the others; a serves its
    /// share (and says so). Returns how many slots x owes d.
    async fn x_drains(store: &MemoryRingStore) -> usize {
        let drain = RingChange::SetWeight {
            node: "x".into(),
            weight: 0,
        };
        let draining = change(store, drain).await.unwrap();
        let to_d = (draining.moving())
            .filter(|&(slot, from)| {
                from == Some("x") && draining.ring.owner(slot).is_some_and(|n| n.id == "d")
            })
            .count();
        assert!(to_d > 0);
        store.report("a", draining.ring.epoch()).await.unwrap();
        to_d
    }

    fn letting() -> Arc<Letting> {
        Arc::new(Letting {
            asked: std::sync::Mutex::default(),
            let_go: tokio::sync::watch::Sender::new(false),
        })
    }

    /// A takeover of a node others were handing slots to waits until they
    /// let them go: one whose handoff to the dead node failed writes those
    /// users to the store first, and the epoch the takeover makes gives
    /// the slots to owners that serve them at once, from the store. x owns
    /// nothing in the epoch, so no one waits for its progress otherwise.
    #[tokio::test(start_paused = true)]
    async fn a_takeover_waits_for_the_nodes_handing_slots_to_the_dead_one() {
        let (store, to_d) = x_draining_to_a_dead_d().await;
        let peers = letting();
        let taking = tokio::spawn({
            let (store, peers) = (store.clone(), peers.clone());
            async move { take_over(&*store, &*peers, "b", "d", false).await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        let epoch = store.load().await.unwrap().ring.epoch();
        assert_eq!(epoch, 4, "taken over before x let go");
        assert_eq!(
            *peers.asked.lock().unwrap(),
            [("x:50051".to_owned(), 4, to_d)]
        );
        peers.let_go.send_replace(true);
        let taken = taking.await.unwrap().unwrap();
        assert_eq!(taken.ring.epoch(), 5);
        assert!(taken.ring.node("d").is_none() && taken.released.contains("d"));
    }

    /// A sender that reported the epoch finished its releases (it reports
    /// only after them), so it is not asked again: one the takeover node
    /// cannot reach does not hold the takeover up.
    #[tokio::test(start_paused = true)]
    async fn a_takeover_does_not_ask_a_sender_that_reported_the_epoch() {
        let (store, _) = x_draining_to_a_dead_d().await;
        store.report("x", 4).await.unwrap();
        let peers = letting();
        let taking = take_over(&*store, &*peers, "b", "d", false);
        let taken = tokio::time::timeout(Duration::from_secs(60), taking).await;
        assert!(peers.asked.lock().unwrap().is_empty());
        assert_eq!(taken.expect("not held up").unwrap().ring.epoch(), 5);
    }

    /// Found by the failover simulation: one backup taking two dead nodes
    /// over at once waited, in each takeover, for the other dead node to
    /// report the epoch, for good. A node a takeover holds, its copy
    /// written, is not waited for: the store holds all it answered.
    #[tokio::test(start_paused = true)]
    async fn a_takeover_does_not_wait_for_a_node_taken_over_too() {
        let store = served_ring(&[("a", 100), ("x", 100), ("d", 100)]).await;
        // x and d hand slots to a, and die; only a reports the epoch.
        let grow = RingChange::SetWeight {
            node: "a".into(),
            weight: 300,
        };
        change(&*store, grow).await.unwrap();
        store.report("a", 4).await.unwrap();
        let x_taken = lease_of(&format!("{TAKEOVER_BY}b"), "b/x's stream");
        assert!(store.swap_lease("x", None, &x_taken).await.unwrap());
        let peers = letting();
        let taking = tokio::spawn({
            let (store, peers) = (store.clone(), peers.clone());
            async move { take_over(&*store, &*peers, "b", "d", false).await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(
            store.load().await.unwrap().ring.epoch(),
            4,
            "x may still hold what it answered: waited for"
        );
        let x_written = LeaseRecord {
            renewals: 1,
            ..lease_of(&format!("{TAKEOVER_BY}b"), NO_BACKUP)
        };
        assert!(
            store
                .swap_lease("x", Some(&x_taken), &x_written)
                .await
                .unwrap()
        );
        let taken = tokio::time::timeout(Duration::from_secs(60), taking).await;
        let taken = taken.expect("not held up by x").unwrap().unwrap();
        assert_eq!(taken.ring.epoch(), 5);
        assert!(taken.ring.node("d").is_none() && taken.released.contains("d"));
        assert!(peers.asked.lock().unwrap().is_empty());
    }

    /// Found in review: a node taken over too is not waited for, but the
    /// slots others hand it are: here x drains to a and d, d dies and is
    /// taken over (its copy written), and e (weight 0) dies; the takeover of
    /// e asks x to let d's slots go before it makes its epoch (else x could
    /// still serve them beside their next owner).
    #[tokio::test(start_paused = true)]
    async fn a_takeover_settles_the_slots_handed_to_a_node_taken_over_too() {
        let store = served_ring(&[("a", 100), ("x", 100), ("d", 100), ("e", 0)]).await;
        let to_d = x_drains(&store).await;
        let d_written = lease_of(&format!("{TAKEOVER_BY}b"), NO_BACKUP);
        assert!(store.swap_lease("d", None, &d_written).await.unwrap());
        let peers = letting();
        let taking = tokio::spawn({
            let (store, peers) = (store.clone(), peers.clone());
            async move { take_over(&*store, &*peers, "b", "e", false).await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(store.load().await.unwrap().ring.epoch(), 5, "x not asked");
        assert_eq!(
            *peers.asked.lock().unwrap(),
            [("x:50051".to_owned(), 5, to_d)]
        );
        peers.let_go.send_replace(true);
        let taken = taking.await.unwrap().unwrap();
        assert!(taken.ring.node("e").is_none() && taken.released.contains("e"));
    }

    fn lease_of(holder: &str, backup: &str) -> LeaseRecord {
        LeaseRecord {
            holder: holder.to_owned(),
            renewals: 0,
            backup: backup.to_owned(),
            lease: None,
        }
    }

    /// Renews `node`'s lease record every quarter second until dropped.
    fn renewing(store: &Arc<MemoryRingStore>, node: &str) -> tokio::task::JoinHandle<()> {
        let (store, node) = (store.clone(), node.to_owned());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let seen = store.lease(&node).await.unwrap().unwrap();
                let next = LeaseRecord {
                    renewals: seen.renewals + 1,
                    ..seen.clone()
                };
                store.swap_lease(&node, Some(&seen), &next).await.unwrap();
            }
        })
    }

    /// Found in review: `ring remove --force` revoked the dead node's lease,
    /// then left it free while the takeover waited (here for x to let its
    /// slots to d go), so that the node, waking or started again, could
    /// take it and serve its slots beside their new owners. The lease is
    /// held, and renewed, until the node is out of the ring.
    #[tokio::test(start_paused = true)]
    async fn removing_a_dead_node_holds_its_lease_until_it_is_out_of_the_ring() {
        let (store, _) = x_draining_to_a_dead_d().await;
        let record = lease_of("d's last start", NO_BACKUP);
        assert!(store.swap_lease("d", None, &record).await.unwrap());
        let peers = letting();
        let removing = tokio::spawn({
            let (store, peers) = (store.clone(), peers.clone());
            async move { remove_dead(&*store, &*peers, "d", Some(LeaseConfig::default())).await }
        });
        tokio::time::sleep(Duration::from_secs(6)).await;
        let held = store.lease("d").await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_secs(6)).await;
        let later = store.lease("d").await.unwrap().unwrap();
        assert_eq!(held.holder, "takeover by an operator", "{held:?}");
        assert!(later.renewals > held.renewals && later.held(), "{later:?}");
        assert!(store.load().await.unwrap().ring.node("d").is_some());

        peers.let_go.send_replace(true);
        let removed = removing.await.unwrap().unwrap();
        assert!(removed.ring.node("d").is_none() && removed.released.contains("d"));
        assert!(!store.lease("d").await.unwrap().unwrap().held(), "freed");
    }

    /// Found in review: the operator could beat the backup holding a dead
    /// node's copy to it, and that copy was never written. A record naming
    /// a copy whose holder renews its own lease is left to that backup
    /// (unless told to ignore leases).
    #[tokio::test(start_paused = true)]
    async fn removing_a_dead_node_leaves_it_to_the_live_backup_holding_its_copy() {
        let (store, _) = x_draining_to_a_dead_d().await;
        let dead = lease_of("d's last start", "a/its stream");
        assert!(store.swap_lease("d", None, &dead).await.unwrap());
        assert!(
            store
                .swap_lease("a", None, &lease_of("a", NO_BACKUP))
                .await
                .unwrap()
        );
        let _a_lives = renewing(&store, "a");
        let peers = letting();
        let refusing = remove_dead(&*store, &*peers, "d", Some(LeaseConfig::default()));
        let refused = tokio::time::timeout(Duration::from_secs(30), refusing).await;
        assert!(
            matches!(&refused, Ok(Err(AdminError::CopyHeld { backup, .. })) if backup == "a"),
            "{refused:?}"
        );
        assert!(store.load().await.unwrap().ring.node("d").is_some());
        peers.let_go.send_replace(true);
        let removed = remove_dead(&*store, &*peers, "d", None).await.unwrap();
        assert!(removed.ring.node("d").is_none());
    }

    /// Found by the Cassandra test of a frozen node released by force: a
    /// takeover that took the lease between the operator's watch (which
    /// saw it lapse) and its revoke was reported as a live lease, which the
    /// operator is not to retry; it is a takeover under way.
    #[tokio::test(start_paused = true)]
    async fn a_takeover_that_took_the_lease_since_it_was_seen_lapsed_is_named() {
        let (store, _) = x_draining_to_a_dead_d().await;
        let dead = lease_of("d's last start", "a/its stream");
        assert!(store.swap_lease("d", None, &dead).await.unwrap());
        store.swap_lease_first("d", lease_of("takeover by a", NO_BACKUP));
        let fenced = fence(&*store, "d", Some(LeaseConfig::default())).await;
        assert!(
            matches!(&fenced, Err(AdminError::TakeoverUnderWay { by, .. }) if by == "a"),
            "{fenced:?}"
        );
    }

    /// Found in review: `--ignore-lease` revoked a takeover's hold on the
    /// lease, so the operator's epoch could come before the takeover wrote
    /// the dead node's copy. A takeover's hold is never revoked.
    #[tokio::test(start_paused = true)]
    async fn a_takeover_under_way_is_never_fenced() {
        let (store, _) = x_draining_to_a_dead_d().await;
        let taking = lease_of("takeover by a", NO_BACKUP);
        assert!(store.swap_lease("d", None, &taking).await.unwrap());
        let _renewing = renewing(&store, "d");
        for lease in [Some(LeaseConfig::default()), None] {
            let fenced = fence(&*store, "d", lease).await;
            assert!(
                matches!(&fenced, Err(AdminError::TakeoverUnderWay { by, .. }) if by == "a"),
                "{fenced:?}"
            );
        }
        assert!(store.lease("d").await.unwrap().unwrap().held());
    }
}
