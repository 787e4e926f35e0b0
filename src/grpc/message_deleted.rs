//! `MessageDeleted`: a deleted message lowers the counts it raised, once
//! per user: each user's lowering is remembered in its cache shard (see
//! [`crate::recent_deletions`]), so a retry within the window, however it
//! lists the users, lowers nobody twice.

use std::collections::HashSet;
use std::sync::Arc;

use super::recipients::{Effect, recipients};
use super::scatter::{Scatter, keep};
use super::validate;
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{MessageDeletedRequest, MessageDeletedResponse};
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
    let lowered = cache
        .update_many_once(&user_ids, deletion, |index, user, now_us| {
            let mentioned = effects[index].1 == Effect::Mention;
            user.message_deleted(key, message_id, mentioned, now_us)
        })
        .await?;
    Ok(MessageDeletedResponse {
        updated: lowered.into_iter().filter(|&l| l).count() as u32,
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
}
