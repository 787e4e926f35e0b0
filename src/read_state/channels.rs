//! How a read state is shown with the channels counted by channel: where
//! their states are found ([`Channels`]), and a read state as a client sees
//! it ([`Shown`]), its unread count counted now from its channel's recent
//! messages. The channel's side is [`crate::channel_state`].

use crate::channel_state::{ChannelMap, ChannelState};
use crate::read_state::{Key, Kind, ReadState};

/// Where the states of the channels counted by channel are found.
pub trait Channels {
    /// The state of `channel_id`, if that channel is counted by channel.
    fn get(&self, channel_id: u64) -> Option<&ChannelState>;

    /// The state `state` is counted by, if any.
    fn of(&self, state: &ReadState) -> Option<&ChannelState> {
        self.get_key(state.key())
    }

    /// The state the read states of `key` are counted by, if any: only
    /// channel read states are ever counted by channel.
    fn get_key(&self, key: Key) -> Option<&ChannelState> {
        match key.kind {
            Kind::Channel => self.get(key.channel_id),
            _ => None,
        }
    }

    /// Whether the read states of `key` are counted by channel.
    fn counts_key(&self, key: Key) -> bool {
        self.get_key(key).is_some()
    }

    /// `state` as a client sees it: in a channel counted by channel, its
    /// unread count is counted now.
    fn shown(&self, state: &ReadState) -> Shown {
        match self.of(state) {
            Some(channel) => {
                let unread = channel.unread(state.last_acked_id, state.unread_count);
                Shown {
                    state: ReadState {
                        unread_count: unread.count,
                        ..*state
                    },
                    unread_capped: unread.capped,
                    parent_id: 0,
                }
            }
            None => Shown {
                state: *state,
                unread_capped: false,
                parent_id: 0,
            },
        }
    }
}

/// A read state as a client sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shown {
    /// With its whole unread count, counted now in a channel counted by
    /// channel.
    pub state: ReadState,
    /// At least `state.unread_count` messages are unread (see
    /// [`crate::channel_state::Unread::capped`]).
    pub unread_capped: bool,
    /// A thread's parent channel (0 for every other read state, and until
    /// [`crate::read_state::UserView::shown`] fills it in).
    pub parent_id: u64,
}

/// No channel is counted by channel.
#[derive(Debug)]
pub struct NoChannels;

impl Channels for NoChannels {
    fn get(&self, _channel_id: u64) -> Option<&ChannelState> {
        None
    }
}

impl Channels for std::collections::HashMap<u64, ChannelState> {
    fn get(&self, channel_id: u64) -> Option<&ChannelState> {
        std::collections::HashMap::get(self, &channel_id)
    }
}

impl Channels for ChannelMap {
    fn get(&self, channel_id: u64) -> Option<&ChannelState> {
        ChannelMap::get(self, &channel_id)
    }
}
