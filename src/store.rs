//! Where read states live durably, behind one small trait.
//!
//! The cache talks to a [`Store`] only in whole users: it loads a user's read
//! states on a miss and writes a user's changed read states when write-behind
//! writes them. Channels counted by channel ([`ChannelState`]) are stored
//! whole too, one row each, and loaded all at once: they are few. Deletions travel in the same write (tombstones, or
//! `clear_below` for "delete all"), so a deletion can never overtake or be overtaken by an
//! earlier change to the same user.
//!
//! Implementations: [`memory`] (not durable; tests and benchmarks),
//! [`embedded`] (redb, crash-safe, one file) and [`cassandra`] (Cassandra or
//! ScyllaDB, for production). Decorators of the same trait: [`instrumented`]
//! measures every call (the service always runs behind it), [`faulty`]
//! injects failures, delays and hangs for tests.

pub mod cassandra;
pub mod embedded;
#[cfg(any(test, feature = "test-support"))]
pub mod faulty;
pub mod instrumented;
pub mod memory;

use async_trait::async_trait;

use crate::channel_state::ChannelState;
use std::collections::BTreeMap;

use crate::read_state::{Kind, ReadState, TOMBSTONE_RETENTION, UserReadStates, UserView};
use crate::recent_deletions::{Deletion, Remembered};

/// A user as the store holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredUser {
    /// The user's version at the last write; 0 for a user never written.
    pub version: u64,
    /// See [`UserReadStates::delta_floor`].
    pub delta_floor: u64,
    /// Live read states and tombstones, in any order.
    pub read_states: Vec<ReadState>,
    /// The parent of each thread among them, by thread id.
    pub parents: BTreeMap<u64, u64>,
    /// What the user was remembered lowered for when last written with any
    /// (see [`crate::recent_deletions`]); some may have expired since.
    pub lowered: Vec<Remembered>,
}

impl StoredUser {
    /// The user as the cache holds it. Tombstones past their retention are
    /// dropped, and since a store may have expired some already (Cassandra's
    /// TTL), no delta from before the retention window is taken as exact.
    pub fn into_user(self, now_us: u64) -> UserReadStates {
        self.into_user_written_to(None, now_us)
    }

    /// The user as the cache holds it, with `unwritten` (a journal's replay,
    /// changes the store may lack) laid over it: a row of it replaces the
    /// stored one if newer, and stays unwritten if newer than what the
    /// store holds, to be written behind.
    pub fn into_user_with(mut self, unwritten: UserWrite, now_us: u64) -> UserReadStates {
        let written = self.version;
        // As the store does with the write: whatever the store's version,
        // no row older than a "delete all" stays (one written since it,
        // or with a version of another row's, may still be there).
        if let Some(clear) = unwritten.clear_below {
            self.read_states.retain(|s| s.version >= clear);
        }
        let clear = unwritten.clear_below.filter(|&c| c > written);
        self.parents.extend(unwritten.parents);
        for state in unwritten.read_states {
            match self.read_states.iter_mut().find(|s| s.key() == state.key()) {
                Some(held) if held.version >= state.version => {}
                Some(held) => *held = state,
                None => self.read_states.push(state),
            }
        }
        self.version = written.max(unwritten.version);
        self.delta_floor = self.delta_floor.max(unwritten.delta_floor);
        self.into_user_written_to(Some((written, clear.is_some())), now_us)
    }

    /// [`Self::into_user`], with the store holding only up to a version
    /// (and a pending "delete all") when `written` says so.
    fn into_user_written_to(self, written: Option<(u64, bool)>, now_us: u64) -> UserReadStates {
        let retention_start = now_us.saturating_sub(TOMBSTONE_RETENTION.as_micros() as u64);
        let delta_floor = self.delta_floor.max(retention_start);
        let parents = self.parents;
        let rows = (self.read_states.into_iter())
            .map(|e| {
                let parent = match e.kind {
                    Kind::Thread => parents.get(&e.channel_id).copied().unwrap_or(0),
                    _ => 0,
                };
                (e, parent)
            })
            .collect();
        let mut user = UserReadStates::from_stored(self.version, delta_floor, rows);
        if let Some((version, clear_pending)) = written {
            user = user.written_only_to(version, clear_pending);
        }
        user.prune_tombstones(now_us);
        user
    }
}

/// The changes of one user that a write carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserWrite {
    pub user_id: u64,
    /// The user's version when the write was taken; every change up to it is
    /// in this write. Also the write's timestamp where the store has them.
    pub version: u64,
    pub delta_floor: u64,
    /// Remove every stored read state of the user older than this version
    /// (a "delete all") before writing these.
    pub clear_below: Option<u64>,
    /// Changed read states and tombstones (`deleted`).
    pub read_states: Vec<ReadState>,
    /// The parent of each thread among them, by thread id.
    pub parents: BTreeMap<u64, u64>,
    /// What the user is remembered lowered for (see
    /// [`crate::recent_deletions`]); none: what is stored stays (it
    /// expires by itself).
    pub lowered: Vec<Remembered>,
}

impl UserWrite {
    /// The write that makes the store hold everything `user` holds.
    pub fn of<'a>(user_id: u64, user: impl Into<UserView<'a>>) -> UserWrite {
        let user = user.into();
        UserWrite {
            user_id,
            version: user.version(),
            delta_floor: user.delta_floor(),
            clear_below: user.pending_clear(),
            read_states: user.unwritten_entries().copied().collect(),
            parents: (user.threads())
                .filter(|(e, _)| e.version > user.written_version())
                .map(|(e, parent)| (e.channel_id, parent))
                .collect(),
            lowered: Vec::new(),
        }
    }
}

/// The stored form of a user's lowerings: a version byte, then 25 bytes
/// each (channel id, kind, message id, until, little-endian).
pub fn encode_lowered(lowered: &[Remembered]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(1 + lowered.len() * LOWERED_BYTES);
    bytes.push(LOWERED_FORMAT);
    for l in lowered {
        bytes.extend_from_slice(&l.deletion.channel_id.to_le_bytes());
        bytes.push(l.deletion.kind as u8);
        bytes.extend_from_slice(&l.deletion.message_id.to_le_bytes());
        bytes.extend_from_slice(&l.until_ms.to_le_bytes());
    }
    bytes
}

/// What [`encode_lowered`] wrote; a record that does not read (another
/// format, a kind unknown here) is skipped: the memory is an aid, never
/// what counts.
pub fn decode_lowered(bytes: &[u8]) -> Vec<Remembered> {
    let Some((&LOWERED_FORMAT, records)) = bytes.split_first() else {
        return Vec::new();
    };
    let u64_at = |record: &[u8], at: usize| {
        u64::from_le_bytes(record[at..at + 8].try_into().expect("8 bytes"))
    };
    (records.chunks_exact(LOWERED_BYTES))
        .filter_map(|record| {
            Some(Remembered {
                deletion: Deletion {
                    channel_id: u64_at(record, 0),
                    kind: Kind::from_u8(record[8])?,
                    message_id: u64_at(record, 9),
                },
                until_ms: u64_at(record, 17),
            })
        })
        .collect()
}

const LOWERED_FORMAT: u8 = 1;
const LOWERED_BYTES: usize = 25;

#[derive(Clone, Debug, thiserror::Error)]
#[error("{store} store: {message}")]
pub struct StoreError {
    pub store: &'static str,
    pub message: String,
}

impl StoreError {
    pub fn new(store: &'static str, message: impl std::fmt::Display) -> StoreError {
        StoreError {
            store,
            message: message.to_string(),
        }
    }
}

/// Durable storage of read states, one user at a time.
#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug + 'static {
    /// Short name for logs and metrics.
    fn name(&self) -> &'static str;

    /// The user's read states; an empty [`StoredUser`] if it has none. An
    /// error means the user could not be read, never that it has no data.
    async fn load(&self, user_id: u64) -> Result<StoredUser, StoreError>;

    /// Applies one user's changes atomically. Safe to retry: it sets absolute
    /// values. Writes of one user may land out of order (write-through runs
    /// them concurrently), so a row is only replaced by a newer version of
    /// it, and a wipe also removes older rows that land after it.
    async fn write(&self, write: &UserWrite) -> Result<(), StoreError>;

    /// Every channel counted by channel. An error means they could not be
    /// read, never that there are none.
    async fn load_channels(&self) -> Result<Vec<ChannelState>, StoreError>;

    /// Writes one channel's state whole. Safe to retry; a write of an older
    /// version never replaces a newer one.
    async fn write_channel(&self, channel: &ChannelState) -> Result<(), StoreError>;
}

#[cfg(any(test, feature = "test-support"))]
pub mod conformance;
