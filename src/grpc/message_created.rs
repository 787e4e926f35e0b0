//! `MessageCreated`: a new message raises the counts of the users it reaches
//! and marks the channel read for its author.

use std::sync::Arc;

use super::validate;
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{MessageCreatedRequest, MessageCreatedResponse};
use crate::read_state::Key;

/// What the message does to one user. The order is precedence: a user who is
/// both author and mentioned is only the author.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Effect {
    Author,
    Mention,
    Unread,
}

pub async fn handle(
    cache: Arc<Cache>,
    request: MessageCreatedRequest,
) -> Result<MessageCreatedResponse, Error> {
    let key = Key {
        channel_id: validate::id("channel_id", request.channel_id)?,
        kind: validate::kind("kind", request.kind)?,
    };
    let message_id = validate::id("message_id", request.message_id)?;
    let users = request.mentioned_user_ids.len() + request.unread_user_ids.len();
    validate::at_most(
        "mentioned_user_ids + unread_user_ids",
        users,
        validate::MAX_MESSAGE_USERS,
    )?;
    validate::ids("mentioned_user_ids", &request.mentioned_user_ids)?;
    validate::ids("unread_user_ids", &request.unread_user_ids)?;

    let mut effects: Vec<(u64, Effect)> = Vec::with_capacity(users + 1);
    if request.author_id != 0 {
        effects.push((request.author_id, Effect::Author));
    }
    effects.extend(
        request
            .mentioned_user_ids
            .iter()
            .map(|&id| (id, Effect::Mention)),
    );
    effects.extend(
        request
            .unread_user_ids
            .iter()
            .map(|&id| (id, Effect::Unread)),
    );
    // One effect per user, the strongest.
    effects.sort_unstable();
    effects.dedup_by_key(|(id, _)| *id);

    let user_ids: Vec<u64> = effects.iter().map(|&(id, _)| id).collect();
    let changed = cache
        .update_many(&user_ids, |index, user, now_us| match effects[index].1 {
            Effect::Author => user.ack(key, message_id, now_us).is_some(),
            Effect::Mention => user.message_created(key, message_id, true, now_us),
            Effect::Unread => user.message_created(key, message_id, false, now_us),
        })
        .await?;
    Ok(MessageCreatedResponse {
        updated: changed.into_iter().filter(|&c| c).count() as u32,
    })
}
