//! Domain types to protobuf messages.

use crate::channel_state::{Channels, Shown};
use crate::proto;
use crate::read_state::{Key, ReadState};

/// `state` as a client sees it: in a channel counted by channel, its unread
/// count counted now.
pub fn shown(state: &ReadState, channels: &impl Channels) -> proto::ReadState {
    (&channels.shown(state)).into()
}

impl From<&Shown> for proto::ReadState {
    fn from(shown: &Shown) -> Self {
        proto::ReadState {
            unread_capped: shown.unread_capped,
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
