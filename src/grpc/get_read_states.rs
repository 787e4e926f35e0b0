//! `GetReadStates`: what a gateway asks for when a client connects.

use std::sync::Arc;

use super::validate;
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{GetReadStatesRequest, GetReadStatesResponse, ParentThreadCounts};

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
            let answer = channels.read(|channels| user.answer(request.since_version, channels));
            GetReadStatesResponse {
                version: user.version(),
                partial: answer.partial,
                read_states: (answer.read_states.iter())
                    .filter(|s| wanted(s.state.channel_id))
                    .map(Into::into)
                    .collect(),
                deleted: (answer.deleted.into_iter())
                    .filter(|k| wanted(k.channel_id))
                    .map(Into::into)
                    .collect(),
                total_mention_count: answer.counts.total_mention_count,
                unread_channel_count: answer.counts.unread_channel_count,
                unread_thread_count: answer.counts.unread_thread_count,
                mentioned_thread_count: answer.counts.mentioned_thread_count,
                thread_counts: (user.thread_counts().1.into_iter())
                    .map(|(parent_id, counts)| ParentThreadCounts {
                        parent_id,
                        unread_thread_count: counts.unread_threads,
                        mentioned_thread_count: counts.mentioned_threads,
                    })
                    .collect(),
            }
        })
        .await
}
