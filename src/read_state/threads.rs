//! Thread read states: how far a user has read each thread they follow.
//!
//! A thread read state is a read state of kind [`Kind::Thread`] keyed by the
//! thread's id, with its parent channel's id kept beside it (see
//! [`Entries::parents`]). Only followers have one: the backend names who
//! follows (a reply's author and mentioned users follow by replying or
//! being mentioned; anyone else by [`UserReadStates::follow`]). A reply
//! counts in the followers' thread read states exactly as a message counts
//! in a channel's, and never in the parent channel's.
//!
//! Thread totals are counted from the thread read states whenever they are
//! read ([`ThreadCounts`]), never kept: they cannot drift, go negative, or
//! stay up once every thread is read (the phantom and negative unread
//! thread counts of other services come from totals kept in step by hand).

use super::{Entries, Key, Kind, ReadState, UserReadStates, UserView, first_thread};

/// The most threads one user follows at once.
pub const MAX_THREADS: usize = 10_000;

/// Why a thread change was refused (nothing changed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadRefusal {
    /// The thread belongs to another parent than the one named: a thread
    /// never moves.
    ParentChanged { thread_id: u64, parent_id: u64 },
    /// The user follows [`MAX_THREADS`] threads already.
    TooManyThreads { limit: usize },
}

/// What a reply is to one user.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replied {
    /// Wrote it: follows the thread, read up to the reply.
    Author,
    /// Mentioned in it: follows the thread (from just below the reply if
    /// not following yet), and the reply counts with its mention.
    Mentioned,
    /// Named as a follower: the reply counts if the user follows the
    /// thread, and does nothing otherwise.
    Follower,
}

/// The thread badge numbers of one user, or of one parent's threads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadCounts {
    /// Followed threads with unread replies (a muted one only when it has
    /// a mention).
    pub unread_threads: u32,
    /// Followed threads with unread mentions.
    pub mentioned_threads: u32,
}

impl ThreadCounts {
    fn add(&mut self, state: &ReadState) {
        self.unread_threads += u32::from(state.is_unread());
        self.mentioned_threads += u32::from(!state.deleted && state.mention_count > 0);
    }
}

fn thread(thread_id: u64) -> Key {
    Key {
        kind: Kind::Thread,
        channel_id: thread_id,
    }
}

impl<E: Entries> UserReadStates<E> {
    /// The user follows `thread_id`, of `parent_id`, having read it up to
    /// `read_up_to` (its last reply when they start following, so that
    /// earlier replies do not count). Following a thread followed already
    /// changes nothing. Returns whether it changed.
    pub fn follow(
        &mut self,
        thread_id: u64,
        parent_id: u64,
        read_up_to: u64,
        now_us: u64,
    ) -> Result<bool, ThreadRefusal> {
        if parent_id == 0 || self.following(thread_id, parent_id)? {
            return Ok(false);
        }
        self.room_for_a_thread()?;
        let version = self.next_version(now_us);
        self.start_following(thread_id, parent_id, version, |e| e.read_up_to(read_up_to));
        Ok(true)
    }

    /// The user stops following `thread_id`: its read state goes (a
    /// tombstone, so that deltas report it), and its counts with it.
    /// Returns whether it was followed.
    pub fn unfollow(&mut self, thread_id: u64, now_us: u64) -> bool {
        self.delete(&[thread(thread_id)], now_us) > 0
    }

    /// A reply `message_id` in `thread_id`, of `parent_id`, as it is to
    /// this user (see [`Replied`]). A redelivered or late reply counts
    /// nothing, as a message does. Returns whether it changed.
    pub fn reply(
        &mut self,
        thread_id: u64,
        parent_id: u64,
        message_id: u64,
        replied: Replied,
        now_us: u64,
    ) -> Result<bool, ThreadRefusal> {
        let key = thread(thread_id);
        if parent_id == 0 {
            // No thread read state without its parent.
            return Ok(false);
        }
        let following = self.following(thread_id, parent_id)?;
        if !following && self.left_after(thread_id, message_id) {
            return Ok(false);
        }
        match (replied, following) {
            (Replied::Follower, false) => Ok(false),
            (Replied::Follower, true) => Ok(self.message_created(
                key,
                message_id,
                false,
                now_us,
                &crate::read_state::NoChannels,
            )),
            (Replied::Author, true) => Ok(self.ack(key, message_id, now_us).is_some()),
            (Replied::Mentioned, true) => Ok(self.message_created(
                key,
                message_id,
                true,
                now_us,
                &crate::read_state::NoChannels,
            )),
            (Replied::Author, false) => {
                self.room_for_a_thread()?;
                let version = self.next_version(now_us);
                self.start_following(thread_id, parent_id, version, |e| e.read_up_to(message_id));
                Ok(true)
            }
            (Replied::Mentioned, false) => {
                self.room_for_a_thread()?;
                let version = self.next_version(now_us);
                self.start_following(thread_id, parent_id, version, |e| {
                    e.last_acked_id = message_id.saturating_sub(1);
                    e.last_message_id = message_id;
                    e.unread_count = 1;
                    e.mention_count = 1;
                });
                Ok(true)
            }
        }
    }

    /// Marks every followed thread of `parent_id` read up to its watermark
    /// ("mark all read" in one channel's threads), one change. Returns how
    /// many changed.
    pub fn ack_threads_of(&mut self, parent_id: u64, now_us: u64) -> u32 {
        let acks: Vec<(Key, u64)> = (self.view().threads())
            .filter(|&(e, parent)| parent == parent_id && !e.deleted)
            .filter(|(e, _)| e.unread_up_to(e.counted_up_to()))
            .map(|(e, _)| (e.key(), e.counted_up_to()))
            .collect();
        self.read_each(&acks, now_us)
    }

    /// Whether the user follows `thread_id`; refused if it is known with
    /// another parent than `parent_id` (followed or not: a thread never
    /// moves).
    fn following(&self, thread_id: u64, parent_id: u64) -> Result<bool, ThreadRefusal> {
        let view = self.view();
        if let Some(parent) = view.parent_of(thread_id)
            && parent != parent_id
        {
            return Err(ThreadRefusal::ParentChanged {
                thread_id,
                parent_id: parent,
            });
        }
        Ok(view.get(thread(thread_id)).is_some())
    }

    /// Whether the user left `thread_id` after it was counted up to
    /// `message_id`: a reply at or below that (redelivered, or late) does
    /// not make them follow it again.
    fn left_after(&self, thread_id: u64, message_id: u64) -> bool {
        let position = self.position(thread(thread_id));
        position.is_ok_and(|i| {
            let tombstone = &self.entries[i];
            tombstone.deleted && message_id <= tombstone.counted_up_to()
        })
    }

    /// Refused if the user follows as many threads as one may.
    fn room_for_a_thread(&self) -> Result<(), ThreadRefusal> {
        let followed = self.view().threads().filter(|(e, _)| !e.deleted).count();
        match followed < MAX_THREADS {
            true => Ok(()),
            false => Err(ThreadRefusal::TooManyThreads { limit: MAX_THREADS }),
        }
    }

    /// Creates (or revives from its tombstone) the read state of
    /// `thread_id`, of `parent_id`, as `update` makes it, at `version`.
    fn start_following(
        &mut self,
        thread_id: u64,
        parent_id: u64,
        version: u64,
        update: impl FnOnce(&mut ReadState),
    ) {
        let key = thread(thread_id);
        let index = match self.position(key) {
            Ok(index) => index,
            Err(index) => {
                self.insert_entry(index, ReadState::new(key));
                index
            }
        };
        let at = index - first_thread(&self.entries);
        if self.entries.parents()[at] != parent_id {
            let mut parents = self.entries.parents().to_vec();
            parents[at] = parent_id;
            self.entries.set_parents(&parents);
        }
        self.change_at(Ok(index), key, version, update);
    }

    /// The live thread read states of `parent_id`'s threads.
    pub fn threads_of(&self, parent_id: u64) -> Vec<Key> {
        (self.view().threads())
            .filter(|&(e, parent)| parent == parent_id && !e.deleted)
            .map(|(e, _)| e.key())
            .collect()
    }
}

impl<'a> UserView<'a> {
    /// The thread entries (tombstones too), each with its parent.
    pub fn threads(self) -> impl Iterator<Item = (&'a ReadState, u64)> {
        let first = first_thread(self.entries);
        self.entries[first..]
            .iter()
            .zip(self.parents.iter().copied())
    }

    /// The user's thread totals, overall and by parent (ascending; parents
    /// with no unread thread left out), counted now.
    pub fn thread_counts(self) -> (ThreadCounts, Vec<(u64, ThreadCounts)>) {
        let mut total = ThreadCounts::default();
        // Sorted once rather than a map entry per thread: this runs on every
        // GetReadStates.
        let mut counted: Vec<(u64, &ReadState)> = (self.threads())
            .filter(|(s, _)| !s.deleted && (s.is_unread() || s.mention_count > 0))
            .map(|(s, parent)| (parent, s))
            .collect();
        counted.sort_unstable_by_key(|&(parent, _)| parent);
        let mut by_parent = Vec::new();
        for group in counted.chunk_by(|a, b| a.0 == b.0) {
            let mut counts = ThreadCounts::default();
            for &(_, state) in group {
                counts.add(state);
                total.add(state);
            }
            by_parent.push((group[0].0, counts));
        }
        (total, by_parent)
    }
}

#[cfg(test)]
mod tests;
