//! A store in a hash map: not durable. For tests and benchmarks, where the
//! cost or the state of a real store would get in the way.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use async_trait::async_trait;

use super::{Store, StoreError, StoredUser, UserWrite};
use crate::channel_state::ChannelState;
use crate::read_state::{Key, Kind, ReadState};
use crate::recent_deletions::Remembered;

#[derive(Debug, Default)]
pub struct MemoryStore {
    users: Mutex<HashMap<u64, MemoryUser>>,
    channels: Mutex<HashMap<u64, ChannelState>>,
}

#[derive(Debug, Default)]
struct MemoryUser {
    version: u64,
    delta_floor: u64,
    /// Rows older than this were wiped ("delete all"), also those that land
    /// after the wipe.
    cleared_below: u64,
    rows: BTreeMap<Key, ReadState>,
    /// Of the thread rows.
    parents: BTreeMap<u64, u64>,
    lowered: Vec<Remembered>,
}

impl MemoryStore {
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    fn users(&self) -> std::sync::MutexGuard<'_, HashMap<u64, MemoryUser>> {
        // A panic elsewhere while holding the lock leaves plain data behind.
        self.users
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn load(&self, user_id: u64) -> Result<StoredUser, StoreError> {
        Ok(self
            .users()
            .get(&user_id)
            .map_or_else(StoredUser::default, |user| StoredUser {
                version: user.version,
                delta_floor: user.delta_floor,
                read_states: user.rows.values().copied().collect(),
                parents: user.parents.clone(),
                lowered: user.lowered.clone(),
            }))
    }

    async fn write(&self, write: &UserWrite) -> Result<(), StoreError> {
        let mut users = self.users();
        let user = users.entry(write.user_id).or_default();
        // The newer write's memory wins, as its rows do.
        if !write.lowered.is_empty() && write.version >= user.version {
            user.lowered = write.lowered.clone();
        }
        user.version = user.version.max(write.version);
        user.delta_floor = user.delta_floor.max(write.delta_floor);
        user.cleared_below = user.cleared_below.max(write.clear_below.unwrap_or(0));
        // Writes of one user may land out of order: the newer row wins.
        for state in &write.read_states {
            let newer = user
                .rows
                .get(&state.key())
                .is_none_or(|old| old.version < state.version);
            if newer {
                user.rows.insert(state.key(), *state);
                if let Some(&parent) = write.parents.get(&state.channel_id)
                    && state.kind == Kind::Thread
                {
                    user.parents.insert(state.channel_id, parent);
                }
            }
        }
        let (cleared, floor) = (user.cleared_below, user.delta_floor);
        user.rows
            .retain(|_, s| s.version >= cleared && !(s.deleted && s.version < floor));
        let rows = &user.rows;
        user.parents.retain(|&thread, _| {
            rows.contains_key(&Key {
                kind: Kind::Thread,
                channel_id: thread,
            })
        });
        Ok(())
    }

    async fn load_channels(&self) -> Result<Vec<ChannelState>, StoreError> {
        let channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        Ok(channels.values().cloned().collect())
    }

    async fn write_channel(&self, channel: &ChannelState) -> Result<(), StoreError> {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        let stored = channels.entry(channel.channel_id());
        // Writes may land out of order: the newer state wins.
        match stored {
            std::collections::hash_map::Entry::Occupied(mut old) => {
                if old.get().version() < channel.version() {
                    old.insert(channel.clone());
                }
            }
            std::collections::hash_map::Entry::Vacant(new) => {
                new.insert(channel.clone());
            }
        }
        Ok(())
    }
}
