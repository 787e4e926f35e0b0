//! `Fleet.Mirror`, at a backup: a node's journal batches taken into what
//! this node holds for it ([`crate::cluster::backup::receive`]).

use std::sync::Arc;

use tonic::{Request, Response, Status, Streaming};

use crate::cluster::backup::held::Backups;
use crate::cluster::backup::receive;
use crate::proto::MirrorRequest;

pub use receive::Responses;

pub async fn handle(
    backups: Arc<Backups>,
    request: Request<Streaming<MirrorRequest>>,
) -> Result<Response<Responses>, Status> {
    receive::receive(backups, request.into_inner())
        .await
        .map(Response::new)
}
