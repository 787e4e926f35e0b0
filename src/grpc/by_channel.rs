//! What the handlers share about channels counted by channel: which
//! messages they count, and writing a channel's change through.

use std::sync::OnceLock;

use crate::cache::Cache;
use crate::channel_state::ChannelState;
use crate::channel_states::ChannelStates;
use crate::error::Error;
use crate::ownership::SlotState;
use crate::proto::ChannelTaken;
use crate::read_state::Key;

/// Where a message past its channel's switch to counting by channel is
/// counted from (`None` for a message counted per member). Such a message
/// lists no members: the channel counts it for all of them.
fn counted_from(
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

/// How a message (or a deletion) is counted: per member, or by its channel.
/// Checked when the request arrives (a member list for a channel counted by
/// channel is refused before anyone is loaded), and decided again in the
/// step that changes the users ([`Counted::decide`], from the first part of
/// [`crate::cache::Cache::update_many_after`]), where no switch can overtake
/// it: a message that waited for a load while its channel was switched is
/// refused then, not counted per member past the switch.
///
/// On a fleet, the part of a message that a node sends to its users'
/// owners after the channel's owner took it ([`ChannelTaken`]) is decided
/// already: by channel, with the owner's word on whether the channel holds
/// the message, and it changes no channel here.
#[derive(Debug)]
pub struct Counted<'a> {
    cache: &'a Cache,
    key: Key,
    message_id: u64,
    unread_user_ids: &'a [u64],
    taken: Option<ChannelTaken>,
    decided: OnceLock<bool>,
}

impl<'a> Counted<'a> {
    pub fn new(
        cache: &'a Cache,
        key: Key,
        message_id: u64,
        unread_user_ids: &'a [u64],
        taken: Option<ChannelTaken>,
    ) -> Result<Counted<'a>, Error> {
        if taken.is_none() {
            counted_from(cache.channels(), key, message_id, unread_user_ids)?;
        }
        Ok(Counted {
            cache,
            key,
            message_id,
            unread_user_ids,
            taken,
            decided: OnceLock::new(),
        })
    }

    /// Decides, for good: whether the channel's state changes here (false
    /// for a part whose channel was changed at its owner). Only the node
    /// serving the channel's slot changes it (every node, standalone): a
    /// message counted by channel that reaches another node unmarked (split
    /// by a node that had not heard of the switch yet) is not applied.
    pub fn decide(&self) -> Result<bool, Error> {
        if self.taken.is_some() {
            return Ok(false);
        }
        let (channels, key) = (self.cache.channels(), self.key);
        let from = counted_from(channels, key, self.message_id, self.unread_user_ids)?;
        let owned = self.cache.ownership().state_of(key.channel_id) == SlotState::Serving;
        if from.is_some() && !owned {
            return Err(Error::ChannelNotOwned {
                channel_id: key.channel_id,
            });
        }
        Ok(*self.decided.get_or_init(|| from.is_some()))
    }

    /// Whether the message is counted by channel, as decided (per member,
    /// if [`Counted::decide`] has not run).
    pub fn by_channel(&self) -> bool {
        self.taken.is_some() || self.decided.get().copied().unwrap_or(false)
    }

    /// Whether the channel holds the message (what a mention counts by):
    /// as its owner said, or as `channel` holds it here.
    pub fn holds(&self, channel: Option<&ChannelState>) -> bool {
        match self.taken {
            Some(taken) => taken.holds,
            None => channel.is_some_and(|c| c.holds(self.message_id)),
        }
    }
}

/// That a request from a client does not carry what only the nodes of a
/// fleet send each other.
pub fn from_client(taken: Option<ChannelTaken>) -> Result<(), Error> {
    match taken {
        Some(_) => Err(Error::invalid(
            "channel_taken",
            "is set only between the nodes of a fleet",
        )),
        None => Ok(()),
    }
}

/// Write-through mode: writes what is unwritten of `channel_id` (the
/// change a request made, or the one its first try made) before it answers
/// (nothing otherwise). A failed write stays applied, as a user's does, and
/// is retried in the background.
pub async fn write_through(channels: &ChannelStates, channel_id: u64) -> Result<(), Error> {
    (channels.write_through(channel_id).await).map_err(|e| Error::ChannelWriteFailed {
        channel_id,
        reason: e.to_string(),
    })
}
