//! `FollowThread`: a user follows a thread (its read state is made, read up
//! to the thread's newest reply) or stops following it (the read state goes,
//! and its counts leave the totals). See `crate::read_state::threads`.

use std::sync::Arc;

use super::{convert, validate};
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{FollowThreadRequest, FollowThreadResponse};
use crate::read_state::threads::ThreadRefusal;
use crate::read_state::{Key, Kind};

pub async fn handle(
    cache: Arc<Cache>,
    request: FollowThreadRequest,
) -> Result<FollowThreadResponse, Error> {
    let user_id = validate::id("user_id", request.user_id)?;
    let thread_id = validate::id("thread_id", request.thread_id)?;
    if request.follow {
        parent("parent_id", thread_id, request.parent_id)?;
    }
    let key = Key {
        kind: Kind::Thread,
        channel_id: thread_id,
    };
    let channels = cache.channels().clone();
    cache
        .update(user_id, |user, now_us| {
            let applied = match request.follow {
                true => user.follow(
                    thread_id,
                    request.parent_id,
                    request.last_message_id,
                    now_us,
                )?,
                false => user.unfollow(thread_id, now_us),
            };
            Ok(FollowThreadResponse {
                applied,
                version: user.version(),
                read_state: channels.read(|channels| convert::shown(user.view(), key, channels)),
            })
        })
        .await?
        .map_err(refused)
}

/// A reply's or a follow's parent channel, named `field`: required, and
/// not the thread itself.
pub fn parent(field: &str, thread_id: u64, parent_id: u64) -> Result<u64, Error> {
    let parent_id = validate::id(field, parent_id)?;
    if parent_id == thread_id {
        return Err(Error::invalid(
            field,
            "a thread's parent is another channel",
        ));
    }
    Ok(parent_id)
}

/// What the domain refused, as the error the client gets.
pub fn refused(refusal: ThreadRefusal) -> Error {
    match refusal {
        ThreadRefusal::ParentChanged {
            thread_id,
            parent_id,
        } => Error::invalid(
            "parent_id",
            format!("thread {thread_id} belongs to channel {parent_id}; a thread never moves"),
        ),
        ThreadRefusal::TooManyThreads { limit } => Error::TooManyThreads { limit },
    }
}
