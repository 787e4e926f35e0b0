//! The receiving side of a backup: a node's `Fleet.Mirror` stream taken
//! into what this node holds for it ([`super::held`]), answered with how
//! far it holds the batches. Over any stream of requests, so that a
//! simulation can call it in-process (`grpc::mirror` serves it over gRPC).

use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::FORMAT;
use super::held::{Backups, Refused};
use crate::proto::mirror_request::Part;
use crate::proto::{MirrorRequest, MirrorResponse};

/// A sender heard from less often than this, once the copy is complete,
/// is taken for frozen or cut off, as a broken stream: it sends at least
/// every quarter second (a build before 2026-12-08, every half). Sooner
/// than its lease lapses (1.5 s), so that a frozen node's copy is written
/// ahead of the takeover, not during it; a false alarm costs a write ahead
/// and a stream opened again.
const SILENCE: Duration = Duration::from_secs(1);

/// The same before the copy is complete: the sender journals everything
/// unwritten again as it attaches, at once, sending nothing meanwhile (a
/// second or more on a node of millions of users: found in review, such a
/// stream broke on every attach with the 1 s limit). A stream broken then
/// is of no use to a takeover anyway.
const SILENCE_ATTACHING: Duration = Duration::from_secs(30);

/// The longest stream token taken (a sender's are about 60 bytes).
const MAX_TOKEN_LEN: usize = 256;

pub type Responses = ReceiverStream<Result<MirrorResponse, Status>>;

/// Takes `requests` (a `start`, then batches, trims and where the copy is
/// complete) into `backups` from a task of its own, until the stream ends
/// (the sender stopped streaming) or breaks (what it held is kept until the
/// sender streams again or its lease lapses: see [`super::takeover`]).
pub async fn receive<S>(backups: Arc<Backups>, mut requests: S) -> Result<Responses, Status>
where
    S: Stream<Item = Result<MirrorRequest, Status>> + Send + Unpin + 'static,
{
    let start = match requests.next().await.transpose()? {
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
    if start.token.len() > MAX_TOKEN_LEN || start.incarnation.len() > MAX_TOKEN_LEN {
        return Err(Status::invalid_argument(format!(
            "start.token and start.incarnation: at most {MAX_TOKEN_LEN} bytes each"
        )));
    }
    let node = start.node;
    let stream = backups.open(&node, &start.incarnation, &start.token);
    tracing::info!(%node, "holding a node's unwritten changes as its backup");
    let (answers, responses) = mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let silence = match backups.is_complete(&node, stream) {
                true => SILENCE,
                false => SILENCE_ATTACHING,
            };
            let message = tokio::time::timeout(silence, requests.next()).await;
            let part = match message {
                Ok(Some(Ok(MirrorRequest { part }))) => part,
                Ok(None) => {
                    backups.ended(&node, stream);
                    return;
                }
                Err(_) => {
                    tracing::warn!(%node, after = ?silence, "a node this one backs up went silent; what it held is kept until the node streams again or its lease lapses");
                    backups.broke(&node, stream);
                    return;
                }
                Ok(Some(Err(status))) => {
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
                        .map_err(|refused| match refused {
                            Refused::Budget { .. } => {
                                tracing::warn!(%node, error = %refused, "a backup batch refused");
                                Status::resource_exhausted(refused.to_string())
                            }
                            Refused::Batch(why) => Status::invalid_argument(why),
                        });
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
    Ok(ReceiverStream::new(responses))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::lease::LeaseConfig;
    use crate::proto::MirrorStart;

    /// Issue 54: a frozen sender's stream stays open, and was taken for
    /// broken only after 3 s of silence, so its copy was written during
    /// its takeover (1.5 s after the freeze), not ahead of it. It is now
    /// taken for broken before its lease runs out.
    #[tokio::test(start_paused = true)]
    async fn a_silent_sender_is_taken_for_broken_before_its_lease_runs_out() {
        let backups = Backups::new();
        let (sender, requests) = mpsc::channel(4);
        let part = |part| Ok(MirrorRequest { part: Some(part) });
        let start = MirrorStart {
            node: "x".into(),
            incarnation: "i1".into(),
            format: FORMAT,
            token: "t".into(),
        };
        sender.send(part(Part::Start(start))).await.unwrap();
        sender.send(part(Part::CompleteAt(0))).await.unwrap();
        let _responses = receive(backups.clone(), ReceiverStream::new(requests))
            .await
            .unwrap();
        tokio::time::sleep(LeaseConfig::default().duration).await;
        assert_eq!(backups.broken().len(), 1, "silent, still taken for live");
        drop(sender);
    }

    /// Found in review: a sender attaching journals everything unwritten
    /// again before it sends anything more, a second or more on a large
    /// node; a stream not complete yet is not taken for broken that soon.
    #[tokio::test(start_paused = true)]
    async fn a_sender_still_attaching_is_given_longer() {
        let backups = Backups::new();
        let (sender, requests) = mpsc::channel(4);
        let start = MirrorStart {
            node: "x".into(),
            incarnation: "i1".into(),
            format: FORMAT,
            token: "t".into(),
        };
        let start = MirrorRequest {
            part: Some(Part::Start(start)),
        };
        sender.send(Ok(start)).await.unwrap();
        let _responses = receive(backups.clone(), ReceiverStream::new(requests))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        sender
            .send(Ok(MirrorRequest {
                part: Some(Part::CompleteAt(0)),
            }))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(backups.complete(), [("x".to_owned(), 1, false)]);
    }
}
