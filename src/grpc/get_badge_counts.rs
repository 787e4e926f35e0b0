//! `GetBadgeCounts`: the app-badge numbers of many users, for push services.

use std::sync::Arc;

use super::validate;
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{BadgeCount, GetBadgeCountsRequest, GetBadgeCountsResponse};

pub async fn handle(
    cache: Arc<Cache>,
    request: GetBadgeCountsRequest,
) -> Result<GetBadgeCountsResponse, Error> {
    validate::at_most(
        "user_ids",
        request.user_ids.len(),
        validate::MAX_BADGE_USERS,
    )?;
    validate::ids("user_ids", &request.user_ids)?;
    let counts = cache
        .read_many(&request.user_ids, |user| user.counts())
        .await?;
    Ok(GetBadgeCountsResponse {
        counts: request
            .user_ids
            .iter()
            .zip(counts)
            .map(|(&user_id, counts)| BadgeCount {
                user_id,
                total_mention_count: counts.total_mention_count,
                unread_channel_count: counts.unread_channel_count,
            })
            .collect(),
    })
}
