//! A fleet of readstates nodes, each request sent straight to its user's
//! owner by the routing table (`readstates-routing`'s [`FleetClient`]), as a
//! gateway that routes would. Requests touching many users go to the owner
//! of their first user (the author, for MessageCreated), which splits them.
//! A refusal from a node with a newer table makes it read the table again
//! and send the request once more.

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
        let user_id = op.routing_user();
        match send(self.fleet.for_user(user_id), op).await {
            Ok(()) => Ok(()),
            Err(status) if status.code() == tonic::Code::Unavailable => {
                // Maybe a newer table: read it, and try once more.
                let _ = self.fleet.refresh().await;
                send(self.fleet.for_user(user_id), op)
                    .await
                    .map_err(|status| format!("{:?}", status.code()))
            }
            Err(status) => Err(format!("{:?}", status.code())),
        }
    }
}
