//! What the handlers share about channels counted by channel: which
//! messages they count, and writing a channel's change through.

use crate::channel_states::ChannelStates;
use crate::error::Error;
use crate::read_state::Key;

/// Where a message past its channel's switch to counting by channel is
/// counted from (`None` for a message counted per member). Such a message
/// lists no members: the channel counts it for all of them.
pub fn counted_from(
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

/// Write-through mode: writes the change a request made to `channel_id`
/// before it answers (nothing otherwise). A failed write stays applied, as
/// a user's does, and is retried in the background.
pub async fn write_through(channels: &ChannelStates, channel_id: u64) -> Result<(), Error> {
    (channels.write_through(channel_id).await).map_err(|e| Error::ChannelWriteFailed {
        channel_id,
        reason: e.to_string(),
    })
}
