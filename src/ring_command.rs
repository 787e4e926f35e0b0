//! `readstates ring ...`: shows the ring in Cassandra and changes it (see
//! [`crate::cluster::admin`]), printing what it did.

use crate::app::BoxError;
use crate::cluster::admin::{
    RingChange, describe, operator_change, release, remove_dead, wait_served,
};
use crate::cluster::peers::GrpcPeers;
use crate::cluster::ring_store::RingStore;
use crate::cluster::ring_store::cassandra::CassandraRingStore;
use crate::config::{Config, RingAction, WaitArgs};
use crate::tls::Tls;
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
        RingAction::Remove {
            node,
            force: false,
            wait,
            ..
        } => (RingChange::Remove { node }, wait),
        RingAction::Remove {
            node,
            force: true,
            ignore_lease,
            wait,
        } => {
            // Nodes handing slots to it are asked to let them go, as a node.
            let credential = config.fleet_credential().ok_or(
                "ring remove --force needs the fleet's fleet_secret: it asks the nodes handing \
                 slots to the removed node to let them go",
            )?;
            let tls = config.tls_files().map(Tls::load).transpose()?;
            let peers = GrpcPeers::new(tls, credential);
            let lease = (!ignore_lease).then(|| config.lease());
            let started = tokio::time::Instant::now();
            let record = remove_dead(&store, &peers, &node, lease).await?;
            let epoch = record.ring.epoch();
            println!(
                "epoch {epoch}: {node} removed by force; its slots are served by the others from \
                 the store"
            );
            return wait_for(&store, epoch, wait, started).await;
        }
    };
    let started = tokio::time::Instant::now();
    let record = operator_change(&store, ring_change).await?;
    let epoch = record.ring.epoch();
    println!("epoch {epoch}: {} slots move", record.moving().count());
    wait_for(&store, epoch, wait, started).await
}

/// With `--wait`, waits until `epoch` is served, saying how long it took.
async fn wait_for(
    store: &CassandraRingStore,
    epoch: u64,
    wait: WaitArgs,
    started: tokio::time::Instant,
) -> Result<(), BoxError> {
    if let WaitArgs {
        wait: Some(timeout),
    } = wait
    {
        wait_served(store, epoch, timeout).await?;
        println!(
            "epoch {epoch}: every slot served by its owner after {} ms",
            started.elapsed().as_millis()
        );
    }
    Ok(())
}
