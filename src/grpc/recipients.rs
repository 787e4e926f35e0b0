//! The users a message reaches, as MessageCreated and MessageDeleted list
//! them: validated against the same limits, one entry per user.

use super::validate;
use crate::channel_states::ChannelStates;
use crate::error::Error;
use crate::read_state::Key;

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

/// Where a message past its channel's switch to counting by channel is
/// counted from (`None` for a message counted per member). Such a message
/// lists no members: the channel counts it for all of them.
pub fn counted_by_channel(
    channels: &ChannelStates,
    key: Key,
    message_id: u64,
    unread_user_ids: &[u64],
) -> Result<Option<u64>, Error> {
    let by_channel = channels
        .counted_from(key)
        .filter(|&counted_from| message_id > counted_from);
    match by_channel {
        Some(counted_from) if !unread_user_ids.is_empty() => Err(Error::invalid(
            "unread_user_ids",
            format!(
                "must be empty: channel {} is counted by channel after message {counted_from}, \
                 so its members are not listed",
                key.channel_id
            ),
        )),
        _ => Ok(by_channel),
    }
}
