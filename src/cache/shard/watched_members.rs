//! Which watched users of a shard are members of which channels counted by
//! channel: a recount ([`crate::cache::recount`]) looks only at the
//! members of the channels whose counts moved, not at every watched user
//! (issue 38: its cost follows the users told, not watched users times
//! channels).
//!
//! Kept in step under the shard's lock: a user is indexed when its stream
//! subscribes and with every change published to it, and forgotten when
//! its last stream goes. Channels are only ever added to those counted by
//! channel, so a count that grew means a channel the index may lack: it is
//! built again, and watched users not held then (evicted) are looked at by
//! every recount until one finds them held. An entry may outlive the
//! membership (a read state deleted): a recount then finds nothing to say.

use std::collections::{HashMap, HashSet};

use crate::channel_state::ChannelMap;
use crate::read_state::{Kind, UserView};

#[derive(Debug, Default)]
pub(crate) struct WatchedMembers {
    /// Channel counted by channel -> its watched members.
    members: HashMap<u64, HashSet<u64>>,
    /// Watched user -> the channels it is indexed under.
    channels_of: HashMap<u64, Vec<u64>>,
    /// Watched users whose memberships are not known (evicted when the
    /// index was built).
    unindexed: HashSet<u64>,
    /// How many channels were counted by channel when it was built.
    built_with: usize,
}

impl WatchedMembers {
    /// Whether `counted` (how many channels are counted by channel now)
    /// says the index must be built again.
    pub(crate) fn stale(&self, counted: usize) -> bool {
        counted != self.built_with
    }

    /// Starts again for `counted` channels: the caller indexes the watched
    /// users it holds and marks the others [`WatchedMembers::unknown`].
    pub(crate) fn clear(&mut self, counted: usize) {
        self.members.clear();
        self.channels_of.clear();
        self.unindexed.clear();
        self.built_with = counted;
    }

    /// Indexes `user_id` under every channel of `user` counted by channel.
    pub(crate) fn index(&mut self, user_id: u64, user: UserView<'_>, channels: &ChannelMap) {
        self.unindexed.remove(&user_id);
        let member_of = (user.live())
            .filter(|state| state.kind == Kind::Channel)
            .map(|state| state.channel_id);
        for channel_id in member_of {
            self.add(user_id, channel_id, channels);
        }
    }

    /// Indexes `user_id` under `channel_id`, if it is counted by channel.
    pub(crate) fn add(&mut self, user_id: u64, channel_id: u64, channels: &ChannelMap) {
        if !channels.contains_key(&channel_id) {
            return;
        }
        if self.members.entry(channel_id).or_default().insert(user_id) {
            self.channels_of
                .entry(user_id)
                .or_default()
                .push(channel_id);
        }
    }

    /// A watched user whose memberships are not known (not held).
    pub(crate) fn unknown(&mut self, user_id: u64) {
        self.unindexed.insert(user_id);
    }

    /// Whether `user_id`'s memberships are not known.
    pub(crate) fn is_unknown(&self, user_id: u64) -> bool {
        self.unindexed.contains(&user_id)
    }

    /// `user_id` is watched no more.
    pub(crate) fn forget(&mut self, user_id: u64) {
        self.unindexed.remove(&user_id);
        for channel_id in self.channels_of.remove(&user_id).unwrap_or_default() {
            if let Some(members) = self.members.get_mut(&channel_id) {
                members.remove(&user_id);
                if members.is_empty() {
                    self.members.remove(&channel_id);
                }
            }
        }
    }

    /// The watched users a recount of `changed` looks at: their members,
    /// and those whose memberships are not known; each once, in order.
    pub(crate) fn of(&self, changed: &[u64]) -> Vec<u64> {
        let mut users: Vec<u64> = (changed.iter())
            .filter_map(|channel_id| self.members.get(channel_id))
            .flatten()
            .chain(&self.unindexed)
            .copied()
            .collect();
        users.sort_unstable();
        users.dedup();
        users
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel_state::ChannelState;

    fn counted(ids: &[u64]) -> ChannelMap {
        (ids.iter())
            .map(|&id| (id, ChannelState::switched(id, 1, 1)))
            .collect()
    }

    #[test]
    fn a_recount_looks_at_the_members_of_the_changed_channels_only() {
        let channels = counted(&[7, 8]);
        let mut index = WatchedMembers::default();
        index.add(1, 7, &channels);
        index.add(2, 8, &channels);
        index.add(3, 9, &channels); // not counted by channel
        index.add(4, 7, &channels);
        index.add(4, 8, &channels);
        assert_eq!(index.of(&[7]), vec![1, 4]);
        assert_eq!(index.of(&[7, 8]), vec![1, 2, 4]);
        assert_eq!(index.of(&[9]), Vec::<u64>::new());
        index.forget(4);
        assert_eq!(index.of(&[7, 8]), vec![1, 2]);
        index.unknown(5);
        assert_eq!(index.of(&[8]), vec![2, 5], "not known: looked at");
        assert!(index.is_unknown(5));
        index.forget(5);
        assert!(!index.is_unknown(5));
    }
}
