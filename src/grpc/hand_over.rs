//! `Fleet.HandOver`: the previous owner of some slots hands their users to
//! this node, their new owner (see [`crate::cluster::member::Member::receive`]).

use futures::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use super::node_calls;
use super::validate;
use crate::cluster::credential::Speaker;
use crate::cluster::handoff::{self, Handoff, Part};
use crate::cluster::member::Member;
use crate::error::Error;
use crate::proto::{HandOverRequest, HandOverResponse};

pub async fn handle(
    member: &Member,
    request: Request<Streaming<HandOverRequest>>,
) -> Result<Response<HandOverResponse>, Status> {
    // Taken (by the interceptor) with the token of the node it names.
    let speaker = request.extensions().get::<Speaker>().cloned();
    let mut requests = request.into_inner();
    let first = requests
        .message()
        .await?
        .ok_or_else(|| Error::invalid("hand_over", "no message"))?;
    if let Some(speaker) = speaker {
        node_calls::speaker_is(&speaker, &first.node_id, "HandOver's node_id")?;
    }
    let slots = validate::slots("slots", &first.slots)?;
    let handoff = Handoff {
        epoch: first.epoch,
        slots,
        from: first.node_id.clone(),
    };
    let rest = requests.map(|request| request.map_err(|status| status.message().to_owned()));
    let parts = futures::stream::once(async move { Ok(first) })
        .chain(rest)
        .flat_map(|request| {
            let parts: Vec<Result<Part, String>> = match request.and_then(handoff::from_request) {
                Ok(parts) => parts.into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e)],
            };
            futures::stream::iter(parts)
        })
        .boxed();
    let from = handoff.from.clone();
    let installed = member.receive(handoff, parts).await?;
    tracing::debug!(%from, users = installed, "handed over to this node");
    Ok(Response::new(HandOverResponse {
        users_installed: installed as u64,
    }))
}
