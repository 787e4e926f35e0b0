//! `GetBadgeCounts`: the app-badge numbers of many users, for push services.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::scatter::{Scatter, keep};
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
    let channels = cache.channels().clone();
    let counts = cache
        .read_many(&request.user_ids, |user| {
            channels.read(|channels| user.counts(channels))
        })
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
                unread_thread_count: counts.unread_thread_count,
                mentioned_thread_count: counts.mentioned_thread_count,
            })
            .collect(),
    })
}

impl Scatter for GetBadgeCountsRequest {
    fn users(&self) -> Result<Vec<u64>, Error> {
        validate::at_most("user_ids", self.user_ids.len(), validate::MAX_BADGE_USERS)?;
        validate::ids("user_ids", &self.user_ids)?;
        let mut users = self.user_ids.clone();
        users.sort_unstable();
        users.dedup();
        Ok(users)
    }

    fn part(&self, users: &HashSet<u64>) -> Self {
        GetBadgeCountsRequest {
            user_ids: keep(&self.user_ids, users),
        }
    }

    /// In request order, as one node answers.
    fn merge(&self, parts: Vec<GetBadgeCountsResponse>) -> GetBadgeCountsResponse {
        let by_user: HashMap<u64, BadgeCount> = parts
            .into_iter()
            .flat_map(|p| p.counts)
            .map(|c| (c.user_id, c))
            .collect();
        GetBadgeCountsResponse {
            counts: self
                .user_ids
                .iter()
                .filter_map(|id| by_user.get(id).copied())
                .collect(),
        }
    }
}
