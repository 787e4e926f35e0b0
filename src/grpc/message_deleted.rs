//! `MessageDeleted`: a deleted message lowers the counts it raised, once: the
//! node remembers the deletions it applied (see [`RecentDeletions`]), so a
//! retry within the window changes nothing.

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::recipients::{Effect, recipients};
use super::scatter::{Scatter, keep};
use super::validate;
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{MessageDeletedRequest, MessageDeletedResponse};
use crate::read_state::Key;
use crate::recent_deletions::{Claim, Deletion, RecentDeletions};

pub async fn handle(
    cache: Arc<Cache>,
    recent: Arc<RecentDeletions>,
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
        recipients: hash(&effects),
    };
    let claimed = match recent.claim(deletion) {
        Claim::New(claimed) => claimed,
        Claim::Applied => return Ok(MessageDeletedResponse { updated: 0 }),
        Claim::UnderWay => return Err(Error::DeletionUnderWay { message_id }),
    };
    let user_ids: Vec<u64> = effects.iter().map(|&(id, _)| id).collect();
    let last = user_ids.len().saturating_sub(1);
    let changed = cache
        .update_many(&user_ids, |index, user, now_us| {
            let mentioned = effects[index].1 == Effect::Mention;
            let changed = user.message_deleted(key, message_id, mentioned, now_us);
            // The last user is changed in the same step as the first (no
            // `.await` between): from here the deletion is applied, even if
            // the request is dropped before it answers.
            if index == last {
                claimed.applied();
            }
            changed
        })
        .await?;
    Ok(MessageDeletedResponse {
        updated: changed.into_iter().filter(|&c| c).count() as u32,
    })
}

/// Identifies the request's recipients (sorted and deduplicated already), so
/// that another batch of the same message is another deletion.
fn hash(effects: &[(u64, Effect)]) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    effects.hash(&mut hasher);
    hasher.finish()
}

impl Scatter for MessageDeletedRequest {
    type Response = MessageDeletedResponse;

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
