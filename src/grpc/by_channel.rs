//! What the handlers share about channels counted by channel: which
//! messages they count, and writing a channel's change through.

use std::sync::OnceLock;

use crate::channel_states::ChannelStates;
use crate::error::Error;
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
#[derive(Debug)]
pub struct Counted<'a> {
    channels: &'a ChannelStates,
    key: Key,
    message_id: u64,
    unread_user_ids: &'a [u64],
    decided: OnceLock<bool>,
}

impl<'a> Counted<'a> {
    pub fn new(
        channels: &'a ChannelStates,
        key: Key,
        message_id: u64,
        unread_user_ids: &'a [u64],
    ) -> Result<Counted<'a>, Error> {
        counted_from(channels, key, message_id, unread_user_ids)?;
        Ok(Counted {
            channels,
            key,
            message_id,
            unread_user_ids,
            decided: OnceLock::new(),
        })
    }

    /// Decides, for good: whether the channel counts the message.
    pub fn decide(&self) -> Result<bool, Error> {
        let (channels, key) = (self.channels, self.key);
        let from = counted_from(channels, key, self.message_id, self.unread_user_ids)?;
        Ok(*self.decided.get_or_init(|| from.is_some()))
    }

    /// What [`Counted::decide`] decided (per member, if it has not).
    pub fn by_channel(&self) -> bool {
        self.decided.get().copied().unwrap_or(false)
    }
}

/// Write-through mode: writes the change a request made to `channel_id`
/// before it answers (nothing otherwise). A failed write stays applied, as
/// a user's does, and is retried in the background.
pub async fn write_through(channels: &ChannelStates, channel_id: u64) -> Result<(), Error> {
    (channels.write_through(channel_id).await).map_err(|e| Error::ChannelWriteFailed {
        channel_id,
        reason: e.to_string(),
    })
}
