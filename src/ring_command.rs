//! `readstates ring ...`: shows the ring in Cassandra and changes it (see
//! [`crate::cluster::admin`]), printing what it did.

use crate::app::BoxError;
use crate::cluster::admin::{RingChange, describe, operator_change, release, wait_served};
use crate::cluster::ring_store::RingStore;
use crate::cluster::ring_store::cassandra::CassandraRingStore;
use crate::config::{Config, RingAction, WaitArgs};
use readstates_routing::Node;

/// Runs `readstates ring ACTION` against the ring in Cassandra, printing
/// what it did.
pub async fn run(config: &Config, action: RingAction) -> Result<(), BoxError> {
    let store = CassandraRingStore::connect(&config.cassandra()).await?;
    let (ring_change, wait) = match action {
        RingAction::Show => {
            let record = store.load().await?;
            print!("{}", describe(&record, &store.progress().await?));
            return Ok(());
        }
        RingAction::Release {
            node,
            force,
            ignore_lease,
        } => {
            let lease = (!ignore_lease).then(|| config.lease());
            let slots = release(&store, &node, force, lease).await?;
            println!("{node}: {slots} slots released; their new owners serve them from the store");
            return Ok(());
        }
        RingAction::Add {
            node,
            address,
            weight,
            wait,
        } => (
            RingChange::Add(Node {
                id: node,
                address,
                weight,
            }),
            wait,
        ),
        RingAction::SetWeight { node, weight, wait } => {
            (RingChange::SetWeight { node, weight }, wait)
        }
        RingAction::Remove { node, wait } => (RingChange::Remove { node }, wait),
    };
    let started = tokio::time::Instant::now();
    let record = operator_change(&store, ring_change).await?;
    let epoch = record.ring.epoch();
    println!("epoch {epoch}: {} slots move", record.moving().count());
    if let WaitArgs {
        wait: Some(timeout),
    } = wait
    {
        wait_served(&store, epoch, timeout).await?;
        println!(
            "epoch {epoch}: every slot served by its owner after {} ms",
            started.elapsed().as_millis()
        );
    }
    Ok(())
}
