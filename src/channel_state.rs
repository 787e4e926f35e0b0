//! The domain of a channel counted by channel: a message costs one change
//! here, whatever the channel's member count, and a member's unread count is
//! counted when it is read, from the channel's recent messages and the
//! member's last ack. The design, and why: `docs/counting.md`.
//!
//! Like [`crate::read_state`], everything here is synchronous and pure (the
//! caller passes the clock in). Every rule is retry-safe by construction: a
//! message is appended only above the newest one, a deletion removes its id
//! (a retry finds nothing), and a member's count is a function of this state
//! and their read state, never an increment, so it cannot be taken twice.

use std::collections::VecDeque;

/// How many recent messages a channel keeps: a member's count is exact while
/// their last ack is within them (8 KiB of ids), and says it is capped past.
pub const RECENT_MESSAGES: usize = 1024;

/// The state of one channel counted by channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelState {
    channel_id: u64,
    /// The channel's last message when it was switched: messages at or below
    /// it were counted per member, those above it are counted here. The
    /// split is by id, so a message is counted one way, never both.
    counted_from: u64,
    /// The newest message taken: one at or below it is a redelivery or
    /// late, and counts nothing.
    last_message_id: u64,
    /// The newest id that fell out of `recent` (0 if none): a member acked
    /// below it cannot be counted exactly any more.
    dropped_up_to: u64,
    /// The ids of the last messages above `counted_from` that are not
    /// deleted, ascending. A deleted one leaves, so the window holds
    /// [`RECENT_MESSAGES`] live messages whatever was deleted.
    recent: VecDeque<u64>,
    /// Rises on every change: `max(previous + 1, now_µs)`, as a user's.
    version: u64,
    /// At most this many ids in `recent` ([`RECENT_MESSAGES`] but in tests).
    capacity: usize,
}

/// A member's unread count in a channel counted by channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unread {
    pub count: u16,
    /// The member's last ack is older than the channel's recent messages: at
    /// least `count` messages are unread.
    pub capped: bool,
}

/// Where a node holds its channels counted by channel: every read state of
/// one is looked up here when its user's counts are read, so it hashes
/// fast (foldhash) rather than with SipHash, which is proof against
/// flooding by untrusted keys: these are channels the backend switched.
pub type ChannelMap = hashbrown::HashMap<u64, ChannelState>;

impl ChannelState {
    /// A channel switched to counting by channel, with `counted_from` its
    /// last message so far.
    pub fn switched(channel_id: u64, counted_from: u64, now_us: u64) -> ChannelState {
        ChannelState::with_capacity(channel_id, counted_from, now_us, RECENT_MESSAGES)
    }

    /// [`Self::switched`], keeping `capacity` recent messages.
    pub fn with_capacity(
        channel_id: u64,
        counted_from: u64,
        now_us: u64,
        capacity: usize,
    ) -> ChannelState {
        ChannelState {
            channel_id,
            counted_from,
            last_message_id: counted_from,
            dropped_up_to: 0,
            recent: VecDeque::new(),
            version: now_us.max(1),
            capacity: capacity.max(1),
        }
    }

    /// A channel as the store holds it. Tolerates what a damaged row could
    /// hold: ids are sorted and deduplicated, those outside
    /// (`counted_from`, `last_message_id`] are dropped, and the oldest beyond
    /// [`RECENT_MESSAGES`] fall out as they would have.
    pub fn from_stored(
        channel_id: u64,
        counted_from: u64,
        last_message_id: u64,
        dropped_up_to: u64,
        mut recent: Vec<u64>,
        version: u64,
    ) -> ChannelState {
        let last_message_id = last_message_id.max(counted_from).max(dropped_up_to);
        recent.retain(|&id| counted_from < id && id <= last_message_id);
        recent.sort_unstable();
        recent.dedup();
        let mut state = ChannelState {
            last_message_id,
            dropped_up_to,
            version,
            ..ChannelState::switched(channel_id, counted_from, version)
        };
        let excess = recent.len().saturating_sub(state.capacity);
        if excess > 0 {
            state.dropped_up_to = state.dropped_up_to.max(recent[excess - 1]);
        }
        state.recent = recent.split_off(excess).into();
        state
    }

    /// The stored form: version, counted_from, last_message_id,
    /// dropped_up_to, then the recent ids to the end; little-endian u64s
    /// (the embedded store's value, the journal's channel record).
    pub fn encode(&self) -> Vec<u8> {
        let head = [
            self.version,
            self.counted_from,
            self.last_message_id,
            self.dropped_up_to,
        ];
        (head.into_iter())
            .chain(self.recent.iter().copied())
            .flat_map(u64::to_le_bytes)
            .collect()
    }

    /// What [`Self::encode`] wrote, or `None` if it is not that.
    pub fn decode(channel_id: u64, bytes: &[u8]) -> Option<ChannelState> {
        if !bytes.len().is_multiple_of(8) || bytes.len() < 32 {
            return None;
        }
        let words: Vec<u64> = (bytes.chunks_exact(8))
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
            .collect();
        Some(ChannelState::from_stored(
            channel_id,
            words[1],
            words[2],
            words[3],
            words[4..].to_vec(),
            words[0],
        ))
    }

    pub fn channel_id(&self) -> u64 {
        self.channel_id
    }

    pub fn counted_from(&self) -> u64 {
        self.counted_from
    }

    pub fn dropped_up_to(&self) -> u64 {
        self.dropped_up_to
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// The recent messages not deleted, ascending.
    pub fn recent(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.recent.iter().copied()
    }

    /// The newest message the channel has taken: a message at or below it is
    /// a redelivery or late, and counts nothing.
    pub fn last_message_id(&self) -> u64 {
        self.last_message_id
    }

    /// Whether `message_id` is a recent message, taken and not deleted: what
    /// a mention of it may count for (a retry of it too, a late one not).
    pub fn holds(&self, message_id: u64) -> bool {
        self.recent.binary_search(&message_id).is_ok()
    }

    /// Whether `message_id` is counted here rather than per member.
    pub fn counts(&self, message_id: u64) -> bool {
        message_id > self.counted_from
    }

    /// A new message: appended if above the newest one (the oldest drops out
    /// past the capacity). Returns whether it changed anything.
    pub fn message_created(&mut self, message_id: u64, now_us: u64) -> bool {
        if message_id <= self.last_message_id {
            return false;
        }
        if self.recent.len() == self.capacity
            && let Some(oldest) = self.recent.pop_front()
        {
            self.dropped_up_to = oldest;
        }
        self.recent.push_back(message_id);
        self.last_message_id = message_id;
        self.next_version(now_us);
        true
    }

    /// A deleted message: if it is a recent one, it leaves, and every member
    /// who had not read it counts one less. Returns whether it changed
    /// anything (a retry does not).
    pub fn message_deleted(&mut self, message_id: u64, now_us: u64) -> bool {
        let Ok(position) = self.recent.binary_search(&message_id) else {
            return false;
        };
        self.recent.remove(position);
        self.next_version(now_us);
        true
    }

    /// The messages counted here that are unread after an ack of
    /// `last_acked_id`: recent ones above it, not deleted.
    pub fn unread_after(&self, last_acked_id: u64) -> Unread {
        let after = self.recent.len() - self.recent.partition_point(|&id| id <= last_acked_id);
        Unread {
            count: u16::try_from(after).unwrap_or(u16::MAX),
            capped: last_acked_id < self.dropped_up_to,
        }
    }

    /// A member's whole unread count: what their read state counted per
    /// member (`per_member`), plus what is unread here after their last ack.
    pub fn unread(&self, last_acked_id: u64, per_member: u16) -> Unread {
        let here = self.unread_after(last_acked_id);
        Unread {
            count: here.count.saturating_add(per_member),
            capped: here.capped,
        }
    }

    /// Of a manual ack's ("mark unread") unread count at `message_id`, the
    /// part the member's read state keeps. At or above `counted_from` it is
    /// none: the channel counts every message after the ack exactly. Below,
    /// the messages before the switch are the member's, so the given count
    /// stands for now, less what the channel already counts after the ack.
    pub fn per_member_part(&self, message_id: u64, unread_count: u16) -> u16 {
        if message_id >= self.counted_from {
            return 0;
        }
        unread_count.saturating_sub(self.unread_after(message_id).count)
    }

    /// Raises the version alone: a new owner's state (see
    /// [`crate::channel_states::ChannelStates::acquire`]) then replaces
    /// every copy the other nodes hold, even one of a change its previous
    /// owner made and lost.
    pub fn claim(&mut self, now_us: u64) {
        self.next_version(now_us);
    }

    fn next_version(&mut self, now_us: u64) {
        self.version = (self.version + 1).max(now_us);
    }
}

#[cfg(test)]
mod tests;
