//! Domain types to protobuf messages.

use crate::channel_state::ChannelState;
use crate::proto;
use crate::read_state::{Channels, Shown};
use crate::read_state::{Key, ReadState, UserView};

/// `user`'s read state of `key` as a client sees it: in a channel counted
/// by channel, its unread count counted now; a thread's, with its parent.
pub fn shown(user: UserView<'_>, key: Key, channels: &impl Channels) -> Option<proto::ReadState> {
    user.get(key)
        .map(|state| (&user.shown(state, channels)).into())
}

impl From<&Shown> for proto::ReadState {
    fn from(shown: &Shown) -> Self {
        proto::ReadState {
            unread_capped: shown.unread_capped,
            parent_id: shown.parent_id,
            ..proto::ReadState::from(&shown.state)
        }
    }
}

impl From<&ReadState> for proto::ReadState {
    fn from(state: &ReadState) -> Self {
        proto::ReadState {
            channel_id: state.channel_id,
            kind: state.kind as i32,
            last_acked_id: state.last_acked_id,
            mention_count: u32::from(state.mention_count),
            unread_count: u32::from(state.unread_count),
            version: state.version,
            last_message_id: state.last_message_id,
            muted: state.muted,
            unread_capped: false,
            parent_id: 0,
        }
    }
}

impl From<Key> for proto::ReadStateKey {
    fn from(key: Key) -> Self {
        proto::ReadStateKey {
            channel_id: key.channel_id,
            kind: key.kind as i32,
        }
    }
}

impl From<&ChannelState> for proto::ChannelStateCopy {
    fn from(channel: &ChannelState) -> Self {
        proto::ChannelStateCopy {
            channel_id: channel.channel_id(),
            counted_from: channel.counted_from(),
            last_message_id: channel.last_message_id(),
            dropped_up_to: channel.dropped_up_to(),
            recent: channel.recent().collect(),
            version: channel.version(),
        }
    }
}

impl From<proto::ChannelStateCopy> for ChannelState {
    /// Tolerant as a stored row is (see [`ChannelState::from_stored`]).
    fn from(copy: proto::ChannelStateCopy) -> Self {
        ChannelState::from_stored(
            copy.channel_id,
            copy.counted_from,
            copy.last_message_id,
            copy.dropped_up_to,
            copy.recent,
            copy.version,
        )
    }
}
