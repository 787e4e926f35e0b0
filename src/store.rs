//! Where read states live durably, behind one small trait.
//!
//! The cache talks to a [`Store`] only in whole users: it loads a user's read
//! states on a miss and writes a user's changed read states when write-behind
//! flushes them. Deletions travel in the same write (tombstones, or `clear`
//! for "delete all"), so a deletion can never overtake or be overtaken by an
//! earlier change to the same user.
//!
//! Implementations: [`memory`] (not durable; tests and benchmarks) and
//! [`embedded`] (redb, crash-safe, one file).

pub mod embedded;
pub mod memory;

use async_trait::async_trait;

use crate::read_state::{ReadState, UserReadStates};

/// A user as the store holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredUser {
    /// The user's version at the last write; 0 for a user never written.
    pub version: u64,
    /// See [`UserReadStates::delta_floor`].
    pub delta_floor: u64,
    /// Live read states and tombstones, in any order.
    pub read_states: Vec<ReadState>,
}

impl StoredUser {
    pub fn into_user(self) -> UserReadStates {
        UserReadStates::from_stored(self.version, self.delta_floor, self.read_states)
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
    /// Remove every stored read state of the user before writing these.
    pub clear: bool,
    /// Changed read states and tombstones (`deleted`).
    pub read_states: Vec<ReadState>,
}

impl UserWrite {
    /// The write that makes the store hold everything `user` holds.
    pub fn of(user_id: u64, user: &UserReadStates) -> UserWrite {
        UserWrite {
            user_id,
            version: user.version(),
            delta_floor: user.delta_floor(),
            clear: user.clear_pending(),
            read_states: user.dirty_entries().copied().collect(),
        }
    }
}

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
    /// values.
    async fn write(&self, write: &UserWrite) -> Result<(), StoreError>;
}

#[cfg(test)]
pub(crate) mod conformance;
#[cfg(test)]
pub(crate) mod scripted;
