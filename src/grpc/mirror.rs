//! `Fleet.Mirror`, at a backup: a node's journal batches taken into what
//! this node holds for it ([`crate::cluster::backup::receive`]).
//!
//! What a stream brings is written to the store should it break (the
//! write ahead of a takeover), so it is taken only from the process that
//! holds the node's lease (whose token it carries), only by the node the
//! ring names its backup, and
//! never on a missing token, even while `--fleet-auth upgrading` takes
//! other calls without one: no build before tokens streams a backup
//! (issue 53: a forged start naming a live node with a made-up incarnation
//! was written, and displaced the node's real stream).

use std::sync::Arc;

use futures::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use super::node_calls::{self, NodeCalls};
use crate::cluster::backup::backup_of;
use crate::cluster::backup::held::Backups;
use crate::cluster::backup::receive;
use crate::cluster::member::Member;
use crate::proto::mirror_request::Part;
use crate::proto::{MirrorRequest, MirrorStart};

pub use receive::Responses;

pub async fn handle(
    member: &Member,
    backups: Arc<Backups>,
    node_calls: &NodeCalls,
    request: Request<Streaming<MirrorRequest>>,
) -> Result<Response<Responses>, Status> {
    let speaker = node_calls.strict(request.metadata(), request.remote_addr(), "Fleet.Mirror")?;
    let mut requests = request.into_inner();
    let first = requests.message().await?;
    if let Some(MirrorRequest {
        part: Some(Part::Start(start)),
    }) = &first
    {
        node_calls::speaker_is(&speaker, &start.node, "Mirror's start.node")?;
        admit(member, start).await?;
    }
    // `receive` checks the start's form itself.
    let requests = futures::stream::iter(first.map(Ok)).chain(requests);
    receive::receive(backups, requests.boxed())
        .await
        .map(Response::new)
}

/// Whether this node takes a copy of `start.node`'s unwritten changes:
/// the ring as the store has it now names this node its backup (a ring
/// adopted here may lag the sender's), and the node's lease is held by the
/// incarnation streaming. UNAVAILABLE otherwise: the sender tries again,
/// and a start that does not hold its lease yet will.
async fn admit(member: &Member, start: &MirrorStart) -> Result<(), Status> {
    let store = member.ring_store();
    let unavailable = |e: crate::store::StoreError| Status::unavailable(e.to_string());
    let (ring, lease) =
        tokio::try_join!(async { store.load().await.map_err(unavailable) }, async {
            store.lease(&start.node).await.map_err(unavailable)
        },)?;
    if backup_of(&ring.ring, &start.node).is_none_or(|b| b.id != member.id()) {
        return Err(Status::unavailable(format!(
            "the ring (epoch {}) does not name this node {}'s backup",
            ring.ring.epoch(),
            start.node
        )));
    }
    if !lease.is_some_and(|lease| lease.held() && lease.holder == start.incarnation) {
        return Err(Status::unavailable(format!(
            "{}'s lease is not held by the incarnation that streams: a copy is taken only from \
             the process that holds it",
            start.node
        )));
    }
    Ok(())
}
