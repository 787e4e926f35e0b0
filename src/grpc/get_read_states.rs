//! `GetReadStates`: what a gateway asks for when a client connects.

use std::sync::Arc;

use super::{convert, validate};
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{GetReadStatesRequest, GetReadStatesResponse};

pub async fn handle(
    cache: Arc<Cache>,
    request: GetReadStatesRequest,
) -> Result<GetReadStatesResponse, Error> {
    let user_id = validate::id("user_id", request.user_id)?;
    validate::at_most(
        "channel_ids",
        request.channel_ids.len(),
        validate::MAX_CHANNEL_IDS,
    )?;
    validate::ids("channel_ids", &request.channel_ids)?;
    let mut channels = request.channel_ids;
    channels.sort_unstable();
    let wanted =
        |channel_id: u64| channels.is_empty() || channels.binary_search(&channel_id).is_ok();
    let channels = cache.channels().clone();
    cache
        .read(user_id, |user| {
            channels.read(|channels| {
                let delta = user.delta(request.since_version, channels);
                let counts = user.counts(channels);
                GetReadStatesResponse {
                    version: user.version(),
                    partial: delta.partial,
                    read_states: delta
                        .read_states
                        .into_iter()
                        .filter(|s| wanted(s.channel_id))
                        .map(|s| convert::shown(s, channels))
                        .collect(),
                    deleted: delta
                        .deleted
                        .into_iter()
                        .filter(|k| wanted(k.channel_id))
                        .map(Into::into)
                        .collect(),
                    total_mention_count: counts.total_mention_count,
                    unread_channel_count: counts.unread_channel_count,
                }
            })
        })
        .await
}
