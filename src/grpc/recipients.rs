//! The users a message reaches, as MessageCreated and MessageDeleted list
//! them: validated against the same limits, one entry per user.

use super::validate;
use crate::error::Error;

/// What a message is to one user. The order is precedence: a user listed
/// more than once takes the first of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Effect {
    Author,
    Mention,
    Unread,
}

/// The author (0: none), the mentioned and the unread users, checked and
/// sorted by user id, each user once with its strongest effect.
pub fn recipients(
    author_id: u64,
    mentioned_user_ids: &[u64],
    unread_user_ids: &[u64],
) -> Result<Vec<(u64, Effect)>, Error> {
    let users = mentioned_user_ids.len() + unread_user_ids.len();
    validate::at_most(
        "mentioned_user_ids + unread_user_ids",
        users,
        validate::MAX_MESSAGE_USERS,
    )?;
    validate::ids("mentioned_user_ids", mentioned_user_ids)?;
    validate::ids("unread_user_ids", unread_user_ids)?;

    let mut effects: Vec<(u64, Effect)> = Vec::with_capacity(users + 1);
    if author_id != 0 {
        effects.push((author_id, Effect::Author));
    }
    effects.extend(mentioned_user_ids.iter().map(|&id| (id, Effect::Mention)));
    effects.extend(unread_user_ids.iter().map(|&id| (id, Effect::Unread)));
    effects.sort_unstable();
    effects.dedup_by_key(|(id, _)| *id);
    Ok(effects)
}
