//! A fleet of readstates nodes, each request sent straight to its user's
//! owner by the routing table (`readstates-routing`'s [`FleetClient`]), as a
//! gateway that routes would. Requests touching many users go to the owner
//! of their first user (the author, for MessageCreated), which splits them.
//! What was not applied (`UNAVAILABLE`: a slot moving, a node draining) is
//! sent again, as the client retries it (see its module doc).

use readstates_routing::client::FleetClient;

use super::grpc::send;
use crate::op::Op;

#[derive(Debug)]
pub struct ClusterTarget {
    fleet: FleetClient,
}

impl ClusterTarget {
    /// Reads the table from `entry` (any node, `host:port`).
    pub async fn connect(entry: &str) -> anyhow::Result<ClusterTarget> {
        let fleet = FleetClient::connect(entry)
            .await
            .map_err(|s| anyhow::anyhow!("{entry}: {}", s.message()))?;
        Ok(ClusterTarget { fleet })
    }

    pub async fn execute(&self, op: &Op) -> Result<(), String> {
        self.fleet
            .send(op.routing_user(), |client| send(client, op))
            .await
            .map_err(|status| format!("{:?}", status.code()))
    }
}
