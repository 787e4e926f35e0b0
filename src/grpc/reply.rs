//! A reply: `MessageCreated` of kind THREAD, naming the thread's parent. It
//! counts in its users' thread read states (see
//! `crate::read_state::threads`), never in the parent channel: the author
//! follows and has read it, a mentioned user follows and counts it, a
//! listed follower counts it only while following. A thread's parent is
//! checked for every user of this node before any is changed, so here a
//! reply naming another parent is refused whole (the parts of a reply split
//! over a fleet are checked each at its node).

use std::sync::Arc;

use super::follow_thread::{self, refused};
use super::recipients::Effect;
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{MessageCreatedRequest, MessageCreatedResponse};
use crate::read_state::threads::{Replied, ThreadRefusal};

/// `request`, a reply in thread `thread_id`, of message `message_id`, to
/// `effects` (its users, validated).
pub async fn handle(
    cache: Arc<Cache>,
    request: &MessageCreatedRequest,
    thread_id: u64,
    message_id: u64,
    effects: &[(u64, Effect)],
) -> Result<MessageCreatedResponse, Error> {
    let parent_id = follow_thread::parent("parent_id", thread_id, request.parent_id)?;
    let user_ids: Vec<u64> = effects.iter().map(|&(id, _)| id).collect();
    let parents = cache
        .read_many(&user_ids, |user| user.parent_of(thread_id))
        .await?;
    if let Some(&other) = parents.iter().flatten().find(|&&p| p != parent_id) {
        return Err(refused(ThreadRefusal::ParentChanged {
            thread_id,
            parent_id: other,
        }));
    }
    let changed = cache
        .update_many(&user_ids, |index, user, now_us| {
            let replied = match effects[index].1 {
                Effect::Author => Replied::Author,
                Effect::Mention => Replied::Mentioned,
                Effect::Unread => Replied::Follower,
            };
            // A user at the most threads does not follow one more by a
            // reply; a parent changed since the check above (two requests
            // naming two parents at once) leaves that user as it was.
            (user.reply(thread_id, parent_id, message_id, replied, now_us)).unwrap_or(false)
        })
        .await?;
    Ok(MessageCreatedResponse {
        updated: changed.into_iter().filter(|&c| c).count() as u32,
    })
}
