//! `BulkAck`: normal acks of several channels of one user, as one change.

use std::sync::Arc;

use super::{convert, validate};
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{BulkAckRequest, BulkAckResponse};

pub async fn handle(cache: Arc<Cache>, request: BulkAckRequest) -> Result<BulkAckResponse, Error> {
    let user_id = validate::id("user_id", request.user_id)?;
    validate::at_most(
        "entries",
        request.entries.len(),
        validate::MAX_BULK_ACK_ENTRIES,
    )?;
    let acks = request
        .entries
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            let key = validate::key(format_args!("entries[{i}]"), entry.channel_id, entry.kind)?;
            let message_id =
                validate::id(format_args!("entries[{i}].message_id"), entry.message_id)?;
            Ok((key, message_id))
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let channels = cache.channels().clone();
    cache
        .update(user_id, |user, now_us| {
            user.bulk_ack(&acks, now_us);
            channels.read(|channels| BulkAckResponse {
                version: user.version(),
                read_states: acks
                    .iter()
                    .filter_map(|&(key, _)| convert::shown(user.view(), key, channels))
                    .collect(),
            })
        })
        .await
}
