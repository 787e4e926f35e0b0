//! One user's read states as a read sees them ([`UserView`]): borrowed and
//! read-only, from a [`UserReadStates`] or from where a cache stores them
//! packed; the counts, deltas and answers a read gives are made here.

use super::{
    Answer, Channels, Counts, Delta, Entries, Header, Key, Kind, ReadState, Shown, UserReadStates,
    first_thread, search,
};

/// One user's read states, read-only and borrowed: what a read sees, also
/// where a cache stores them packed.
#[derive(Clone, Copy, Debug)]
pub struct UserView<'a> {
    pub(super) header: Header,
    /// Sorted by key.
    pub(super) entries: &'a [ReadState],
    /// The parent ids of the thread entries (see [`Entries::parents`]).
    pub(super) parents: &'a [u64],
}

impl<'a, E: Entries> From<&'a UserReadStates<E>> for UserView<'a> {
    fn from(user: &'a UserReadStates<E>) -> UserView<'a> {
        user.view()
    }
}

impl<'a> UserView<'a> {
    /// `entries` must be sorted by key, as [`UserReadStates::into_parts`]
    /// gives them.
    pub fn new(header: Header, entries: &'a [ReadState], parents: &'a [u64]) -> UserView<'a> {
        UserView {
            header,
            entries,
            parents,
        }
    }

    /// The parent ids of the thread entries, in their order.
    pub fn parents(self) -> &'a [u64] {
        self.parents
    }

    /// Each read state and tombstone with its parent id (0 but for a
    /// thread's): as the store keeps them.
    pub fn with_parents(self) -> impl Iterator<Item = (&'a ReadState, u64)> {
        let first = first_thread(self.entries);
        let parents = std::iter::repeat_n(0, first).chain(self.parents.iter().copied());
        self.entries.iter().zip(parents)
    }

    /// The parent of the thread read state (or tombstone) of `thread_id`.
    pub fn parent_of(self, thread_id: u64) -> Option<u64> {
        let key = Key {
            kind: Kind::Thread,
            channel_id: thread_id,
        };
        let index = search(self.entries, key).ok()?;
        self.parents
            .get(index - first_thread(self.entries))
            .copied()
    }

    pub fn header(self) -> Header {
        self.header
    }

    /// Read states and tombstones, sorted by key.
    pub fn entries(self) -> &'a [ReadState] {
        self.entries
    }

    pub fn version(self) -> u64 {
        self.header.version
    }

    pub fn written_version(self) -> u64 {
        self.header.written_version
    }

    pub fn delta_floor(self) -> u64 {
        self.header.delta_floor
    }

    /// Read states and tombstones held, the unit of cache capacity.
    pub fn len(self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(self) -> bool {
        self.entries.is_empty()
    }

    /// Has changes the store does not hold yet.
    pub fn has_unwritten(self) -> bool {
        self.header.version > self.header.written_version
    }

    /// The live read state for `key`.
    pub fn get(self, key: Key) -> Option<&'a ReadState> {
        let entries = self.entries;
        search(entries, key)
            .ok()
            .map(|i| &entries[i])
            .filter(|e| !e.deleted)
    }

    /// Every live read state, sorted by key.
    pub fn live(self) -> impl Iterator<Item = &'a ReadState> {
        self.entries.iter().filter(|e| !e.deleted)
    }

    /// The badge numbers, with the unread counts of channels counted by
    /// channel counted now.
    pub fn counts(self, channels: &impl Channels) -> Counts {
        Counts::of(self.live().map(|e| channels.shown(e).state))
    }

    /// What a client is sent of this user (GetReadStates, a Watch change):
    /// [`Self::delta`] with each read state as shown, and the totals. The
    /// full set is every live read state, so its totals are counted from
    /// what is sent: each read state is counted once.
    /// `state`, one of this user's, as a client sees it: counted now in a
    /// channel counted by channel, with its parent if it is a thread's.
    pub fn shown(self, state: &ReadState, channels: &impl Channels) -> Shown {
        let parent_id = match state.kind {
            Kind::Thread => self.parent_of(state.channel_id).unwrap_or(0),
            _ => 0,
        };
        Shown {
            parent_id,
            ..channels.shown(state)
        }
    }

    pub fn answer(self, since: u64, channels: &impl Channels) -> Answer {
        let delta = self.delta(since, channels);
        // Both sorted by key: each thread's parent is found walking along.
        let mut threads = self.threads().peekable();
        let read_states: Vec<Shown> = (delta.read_states.into_iter())
            .map(|state| {
                let shown = channels.shown(state);
                if state.kind != Kind::Thread {
                    return shown;
                }
                while threads.next_if(|(t, _)| t.key() < state.key()).is_some() {}
                Shown {
                    parent_id: threads.peek().map_or(0, |&(_, parent)| parent),
                    ..shown
                }
            })
            .collect();
        let counts = match delta.partial {
            false => Counts::of(read_states.iter().map(|s| s.state)),
            true => self.counts(channels),
        };
        Answer {
            partial: delta.partial,
            read_states,
            deleted: delta.deleted,
            counts,
        }
    }

    /// What changed after `since`, or the full set when `since` is 0 or no
    /// exact delta can be given (tombstones dropped, a wipe, a version from
    /// the future). A read state counted by channel changes count without a
    /// change of version, so a partial delta carries all of them.
    pub fn delta(self, since: u64, channels: &impl Channels) -> Delta<'a> {
        let Header {
            version,
            delta_floor,
            ..
        } = self.header;
        if since == 0 || since < delta_floor || since > version {
            return Delta {
                partial: false,
                read_states: self.live().collect(),
                deleted: Vec::new(),
            };
        }
        let changed = (self.entries.iter())
            .filter(|e| e.version > since || (!e.deleted && channels.of(e).is_some()));
        let (deleted, live): (Vec<&ReadState>, Vec<&ReadState>) = changed.partition(|e| e.deleted);
        Delta {
            partial: true,
            read_states: live,
            deleted: deleted.iter().map(|e| e.key()).collect(),
        }
    }

    /// The version of a "delete all" the store has not seen yet: the next
    /// write must first remove every stored row older than it.
    pub fn pending_clear(self) -> Option<u64> {
        self.header.clear_pending.then_some(self.header.delta_floor)
    }

    /// See [`UserReadStates::unwritten_count`].
    pub fn unwritten_count(self) -> usize {
        self.unwritten_entries().count() + usize::from(self.header.clear_pending)
    }

    /// The entries a write must carry: those changed after `written_version`.
    pub fn unwritten_entries(self) -> impl Iterator<Item = &'a ReadState> {
        let written = self.header.written_version;
        self.entries.iter().filter(move |e| e.version > written)
    }
}
