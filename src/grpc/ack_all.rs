//! `AckAll`: "mark all read", every read state of a user (of some kinds,
//! or the threads of one channel) read up to its watermark, as one change.

use std::sync::Arc;

use super::validate;
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{AckAllRequest, AckAllResponse};
use crate::read_state::Kind;

pub async fn handle(cache: Arc<Cache>, request: AckAllRequest) -> Result<AckAllResponse, Error> {
    let user_id = validate::id("user_id", request.user_id)?;
    validate::at_most("kinds", request.kinds.len(), Kind::ALL.len())?;
    let kinds = request
        .kinds
        .iter()
        .enumerate()
        .map(|(i, &kind)| validate::kind(format_args!("kinds[{i}]"), kind))
        .collect::<Result<Vec<Kind>, Error>>()?;
    // [THREAD] with a parent: a build without threads refuses that kind,
    // where it would take a request of no kinds for "mark everything read".
    if request.parent_id != 0 && kinds != [Kind::Thread] {
        return Err(Error::invalid(
            "kinds",
            "must be [THREAD] with parent_id: a parent's threads are of kind THREAD",
        ));
    }
    let channels = cache.channels().clone();
    cache
        .update(user_id, |user, now_us| {
            let updated = match request.parent_id {
                0 => channels.read(|channels| user.ack_all(&kinds, now_us, channels)),
                parent_id => user.ack_threads_of(parent_id, now_us),
            };
            AckAllResponse {
                version: user.version(),
                updated,
            }
        })
        .await
}
