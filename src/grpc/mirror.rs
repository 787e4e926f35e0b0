//! `Fleet.Mirror`, at a backup: takes a node's journal batches into what
//! it holds for that node ([`crate::cluster::backup::held`]) and answers
//! how far it holds them.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::cluster::backup::FORMAT;
use crate::cluster::backup::held::Backups;
use crate::proto::mirror_request::Part;
use crate::proto::{MirrorRequest, MirrorResponse};

/// A sender heard from less often than this is taken for frozen or cut
/// off, as a broken stream: it sends at least every half second.
const SILENCE: Duration = Duration::from_secs(3);

/// The longest stream token taken (a sender's are about 60 bytes).
const MAX_TOKEN_LEN: usize = 256;

pub type Responses = ReceiverStream<Result<MirrorResponse, Status>>;

pub async fn handle(
    backups: Arc<Backups>,
    request: Request<Streaming<MirrorRequest>>,
) -> Result<Response<Responses>, Status> {
    let mut requests = request.into_inner();
    let start = match requests.message().await? {
        Some(MirrorRequest {
            part: Some(Part::Start(start)),
        }) => start,
        _ => {
            return Err(Status::invalid_argument(
                "a Mirror stream starts with `start`",
            ));
        }
    };
    if start.format != FORMAT {
        return Err(Status::failed_precondition(format!(
            "journal format {} is not {FORMAT}, the one this node reads",
            start.format
        )));
    }
    if start.node.is_empty() || start.node.len() > readstates_routing::ring::MAX_NODE_ID_LEN {
        return Err(Status::invalid_argument(format!(
            "start.node: 1 to {} bytes",
            readstates_routing::ring::MAX_NODE_ID_LEN
        )));
    }
    if start.token.len() > MAX_TOKEN_LEN {
        return Err(Status::invalid_argument(format!(
            "start.token: at most {MAX_TOKEN_LEN} bytes"
        )));
    }
    let node = start.node;
    let stream = backups.open(&node, &start.token);
    tracing::info!(%node, "holding a node's unwritten changes as its backup");
    let (answers, responses) = mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let message = tokio::time::timeout(SILENCE, requests.message()).await;
            let part = match message {
                Ok(Ok(Some(MirrorRequest { part }))) => part,
                Ok(Ok(None)) => {
                    backups.ended(&node, stream);
                    return;
                }
                Err(_) => {
                    tracing::warn!(%node, after = ?SILENCE, "a node this one backs up went silent; what it held is kept until the node streams again or its lease lapses");
                    backups.broke(&node, stream);
                    return;
                }
                Ok(Err(status)) => {
                    tracing::warn!(%node, error = %status, "a backup stream broke; what it held is kept until the node streams again or its lease lapses");
                    backups.broke(&node, stream);
                    return;
                }
            };
            match part {
                Some(Part::Batch(batch)) => {
                    let answer = backups
                        .batch(&node, stream, batch.frames, batch.end)
                        .map(|held| MirrorResponse { held })
                        .map_err(Status::invalid_argument);
                    let refused = answer.is_err();
                    if answers.send(answer).await.is_err() || refused {
                        backups.broke(&node, stream);
                        return;
                    }
                }
                Some(Part::Trimmed(through)) => backups.trimmed(&node, stream, through),
                Some(Part::CompleteAt(at)) => backups.complete_at(&node, stream, at),
                Some(Part::Start(_)) | None => {
                    let _ = answers
                        .send(Err(Status::invalid_argument(
                            "a Mirror stream has one `start`, first",
                        )))
                        .await;
                    backups.broke(&node, stream);
                    return;
                }
            }
        }
    });
    Ok(Response::new(ReceiverStream::new(responses)))
}
