//! `GetReadStates`: what a gateway asks for when a client connects.

use std::sync::Arc;

use super::validate;
use crate::cache::Cache;
use crate::channel_state::{Channels, Shown};
use crate::error::Error;
use crate::proto::{GetReadStatesRequest, GetReadStatesResponse};
use crate::read_state::Counts;

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
    let mut wanted_ids = request.channel_ids;
    wanted_ids.sort_unstable();
    let wanted =
        |channel_id: u64| wanted_ids.is_empty() || wanted_ids.binary_search(&channel_id).is_ok();
    let channels = cache.channels().clone();
    cache
        .read(user_id, |user| {
            channels.read(|channels| {
                let delta = user.delta(request.since_version, channels);
                // Each read state is counted once: the full set (what a
                // client gets on connect) is every live one, so the totals
                // come from what is sent.
                let shown: Vec<Shown> = (delta.read_states.iter())
                    .map(|&state| channels.shown(state))
                    .collect();
                let counts = match delta.partial {
                    false => Counts::of(shown.iter().map(|s| s.state)),
                    true => user.counts(channels),
                };
                GetReadStatesResponse {
                    version: user.version(),
                    partial: delta.partial,
                    read_states: (shown.iter())
                        .filter(|s| wanted(s.state.channel_id))
                        .map(Into::into)
                        .collect(),
                    deleted: (delta.deleted.into_iter())
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
