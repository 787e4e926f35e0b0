//! Where requests go: a `readstates.v1` gRPC server (readstates itself or
//! the baseline server; with a fleet, every request enters at that node), a
//! fleet routed by its table, or Redis running the same operations as
//! scripts. Chosen by the target's URL: `grpc://host:port`,
//! `cluster://host:port` (any node) or `redis://host:port`.

pub mod cluster;
pub mod grpc;
pub mod redis;
pub mod stream;

use crate::op::Op;

#[derive(Debug)]
pub enum Target {
    Grpc(grpc::GrpcTarget),
    Cluster(cluster::ClusterTarget),
    /// Boxed: it carries its scripts, and the enum is made once per run.
    Redis(Box<redis::RedisTarget>),
}

impl Target {
    /// Opens `connections` connections to `url`; with `stream` (gRPC
    /// only), changes go over Apply streams.
    pub async fn connect(
        url: &str,
        connections: usize,
        stream: Option<stream::StreamConfig>,
    ) -> anyhow::Result<Target> {
        if let Some(address) = url
            .strip_prefix("grpc://")
            .or_else(|| url.strip_prefix("http://"))
        {
            return Ok(Target::Grpc(
                grpc::GrpcTarget::connect(address, connections, stream).await?,
            ));
        }
        if stream.is_some() {
            anyhow::bail!("{url}: the stream mode is for grpc:// targets");
        }
        if let Some(entry) = url.strip_prefix("cluster://") {
            return Ok(Target::Cluster(
                cluster::ClusterTarget::connect(entry).await?,
            ));
        }
        if url.starts_with("redis://") {
            let target = redis::RedisTarget::connect(url, connections).await?;
            return Ok(Target::Redis(Box::new(target)));
        }
        anyhow::bail!("{url}: expected grpc://host:port, cluster://host:port or redis://host:port")
    }

    /// Sends one operation; an error is its status code's name.
    pub async fn execute(&self, op: &Op) -> Result<(), String> {
        match self {
            Target::Grpc(target) => target.execute(op).await,
            Target::Cluster(target) => target.execute(op).await,
            Target::Redis(target) => target.execute(op).await,
        }
    }
}
