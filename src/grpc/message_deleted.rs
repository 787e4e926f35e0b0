//! `MessageDeleted`: a deleted message lowers the counts it raised, once
//! per user: each user's lowering is remembered in its cache shard (see
//! [`crate::recent_deletions`]), so a retry within the window, however it
//! lists the users, lowers nobody twice. In a channel counted by channel the
//! message leaves the channel (a retry finds nothing to remove), which
//! lowers every member who had not read it, and only the mentioned users'
//! mention counts are lowered one by one.

use std::collections::HashSet;
use std::sync::Arc;

use super::by_channel::{self, Counted};
use super::recipients::{Effect, recipients};
use super::scatter::{Scatter, keep};
use super::validate;
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{
    ChangeChannelRequest, ChannelTaken, MessageDeletedRequest, MessageDeletedResponse,
    ReadStateKind,
};
use crate::read_state::Key;
use crate::recent_deletions::Deletion;

pub async fn handle(
    cache: Arc<Cache>,
    request: MessageDeletedRequest,
) -> Result<MessageDeletedResponse, Error> {
    let key = Key {
        channel_id: validate::id("channel_id", request.channel_id)?,
        kind: validate::kind("kind", request.kind)?,
    };
    let message_id = validate::id("message_id", request.message_id)?;
    let effects = recipients(0, &request.mentioned_user_ids, &request.unread_user_ids)?;
    let deletion = Deletion {
        channel_id: key.channel_id,
        message_id,
        kind: key.kind,
    };
    let user_ids: Vec<u64> = effects.iter().map(|&(id, _)| id).collect();
    let channels = cache.channels().clone();
    let counted = Counted::new(
        &cache,
        key,
        message_id,
        &request.unread_user_ids,
        request.channel_taken,
    )?;
    let (left, lowered) = cache
        .update_many_once(
            &user_ids,
            deletion,
            |now_us| {
                Ok(counted.decide()?
                    && channels
                        .update(key.channel_id, |c| c.message_deleted(message_id, now_us))
                        .unwrap_or(false))
            },
            |index, user, now_us| match counted.by_channel() {
                true => user.mention_deleted(key, message_id, now_us),
                false => {
                    let mentioned = effects[index].1 == Effect::Mention;
                    user.message_deleted(key, message_id, mentioned, now_us)
                }
            },
        )
        .await?;
    if counted.by_channel() {
        by_channel::write_through(&channels, key.channel_id).await?;
    }
    let users = lowered.into_iter().filter(|&l| l).count() as u32;
    Ok(MessageDeletedResponse {
        updated: users + u32::from(left),
    })
}

impl Scatter for MessageDeletedRequest {
    fn users(&self) -> Result<Vec<u64>, Error> {
        let effects = recipients(0, &self.mentioned_user_ids, &self.unread_user_ids)?;
        Ok(effects.into_iter().map(|(id, _)| id).collect())
    }

    fn part(&self, users: &HashSet<u64>) -> Self {
        MessageDeletedRequest {
            mentioned_user_ids: keep(&self.mentioned_user_ids, users),
            unread_user_ids: keep(&self.unread_user_ids, users),
            ..self.clone()
        }
    }

    fn merge(&self, parts: Vec<MessageDeletedResponse>) -> MessageDeletedResponse {
        MessageDeletedResponse {
            updated: parts.iter().map(|p| p.updated).sum(),
        }
    }

    fn channel_change(&self) -> Option<ChangeChannelRequest> {
        let by_channel = self.kind == ReadStateKind::Channel as i32
            && self.channel_taken.is_none()
            && self.unread_user_ids.is_empty();
        by_channel.then_some(ChangeChannelRequest {
            channel_id: self.channel_id,
            message_id: self.message_id,
            deleted: true,
        })
    }

    fn channel_taken(&self) -> Option<ChannelTaken> {
        self.channel_taken
    }

    fn taken(self, taken: ChannelTaken) -> Self {
        MessageDeletedRequest {
            channel_taken: Some(taken),
            ..self
        }
    }

    fn with_channel_change(merged: MessageDeletedResponse) -> MessageDeletedResponse {
        MessageDeletedResponse {
            updated: merged.updated + 1,
        }
    }
}
