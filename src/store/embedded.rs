//! The default store: redb, an embedded, crash-safe B-tree database in one
//! file under `--data-dir`, so that `readstates serve` needs nothing else.
//!
//! Three tables: `read_states` keyed by `(user_id, kind, channel_id)`, so a
//! user's rows are one contiguous range, `users` holding each user's version
//! and delta floor, and `wipes` holding its latest wipe. redb is synchronous;
//! calls run on the blocking pool.

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::{Store, StoreError, StoredUser, UserWrite};
use crate::read_state::{Kind, ReadState};

type RowKey = (u64, u8, u64);
const READ_STATES: TableDefinition<RowKey, &[u8]> = TableDefinition::new("read_states");
/// user_id -> (version, delta_floor)
const USERS: TableDefinition<u64, (u64, u64)> = TableDefinition::new("users");
/// user_id -> the `clear_below` of its latest wipe, for rows landing after it.
const WIPES: TableDefinition<u64, u64> = TableDefinition::new("wipes");

const FILE_NAME: &str = "readstates.redb";
const NAME: &str = "embedded";

#[derive(Debug, Clone)]
pub struct EmbeddedStore {
    db: Arc<Database>,
}

impl EmbeddedStore {
    /// Opens (or creates) the database in `data_dir`.
    pub fn open(data_dir: &Path) -> Result<EmbeddedStore, StoreError> {
        std::fs::create_dir_all(data_dir)
            .map_err(|e| StoreError::new(NAME, format!("create {}: {e}", data_dir.display())))?;
        let path = data_dir.join(FILE_NAME);
        let db = Database::create(&path)
            .map_err(|e| StoreError::new(NAME, format!("open {}: {e}", path.display())))?;
        // Create the tables up front so that reads never find them missing.
        let txn = db.begin_write().map_err(error)?;
        txn.open_table(READ_STATES).map_err(error)?;
        txn.open_table(USERS).map_err(error)?;
        txn.open_table(WIPES).map_err(error)?;
        txn.commit().map_err(error)?;
        Ok(EmbeddedStore { db: Arc::new(db) })
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Database) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let db = self.db.clone();
        tokio::task::spawn_blocking(move || f(&db))
            .await
            .map_err(|e| StoreError::new(NAME, format!("task: {e}")))?
    }
}

#[async_trait]
impl Store for EmbeddedStore {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn load(&self, user_id: u64) -> Result<StoredUser, StoreError> {
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(error)?;
            let (version, delta_floor) = txn
                .open_table(USERS)
                .map_err(error)?
                .get(user_id)
                .map_err(error)?
                .map_or((0, 0), |v| v.value());
            let rows = txn.open_table(READ_STATES).map_err(error)?;
            let mut read_states = Vec::new();
            for row in rows.range(user_range(user_id)).map_err(error)? {
                let (key, value) = row.map_err(error)?;
                read_states.push(decode(key.value(), value.value())?);
            }
            Ok(StoredUser {
                version,
                delta_floor,
                read_states,
            })
        })
        .await
    }

    async fn write(&self, write: &UserWrite) -> Result<(), StoreError> {
        let write = write.clone();
        self.blocking(move |db| {
            let txn = db.begin_write().map_err(error)?;
            {
                let user_id = write.user_id;
                let mut users = txn.open_table(USERS).map_err(error)?;
                let mut wipes = txn.open_table(WIPES).map_err(error)?;
                let mut rows = txn.open_table(READ_STATES).map_err(error)?;
                let (version, floor) = users
                    .get(user_id)
                    .map_err(error)?
                    .map_or((0, 0), |v| v.value());
                let cleared = wipes.get(user_id).map_err(error)?.map_or(0, |v| v.value());
                let new_floor = floor.max(write.delta_floor);
                let new_cleared = cleared.max(write.clear_below.unwrap_or(0));
                let stale =
                    |s: &ReadState| s.version < new_cleared || (s.deleted && s.version < new_floor);
                if new_cleared > cleared || new_floor > floor {
                    // Drop what the wipe or the raised floor removes.
                    let doomed: Vec<RowKey> = rows
                        .range(user_range(user_id))
                        .map_err(error)?
                        .filter_map(Result::ok)
                        .filter_map(|(k, v)| {
                            let state = decode(k.value(), v.value()).ok()?;
                            stale(&state).then(|| k.value())
                        })
                        .collect();
                    for key in doomed {
                        rows.remove(key).map_err(error)?;
                    }
                }
                for state in write.read_states.iter().filter(|s| !stale(s)) {
                    let key = (user_id, state.kind as u8, state.channel_id);
                    // Writes may land out of order: the newer row wins.
                    let newer = match rows.get(key).map_err(error)? {
                        Some(old) => decode(key, old.value())?.version < state.version,
                        None => true,
                    };
                    if newer {
                        rows.insert(key, encode(state).as_slice()).map_err(error)?;
                    }
                }
                users
                    .insert(user_id, (version.max(write.version), new_floor))
                    .map_err(error)?;
                if new_cleared > cleared {
                    wipes.insert(user_id, new_cleared).map_err(error)?;
                }
            }
            txn.commit().map_err(error)
        })
        .await
    }
}

fn user_range(user_id: u64) -> std::ops::RangeInclusive<RowKey> {
    (user_id, 0, 0)..=(user_id, u8::MAX, u64::MAX)
}

const VALUE_LEN: usize = 8 + 8 + 4 + 4 + 1;

fn encode(state: &ReadState) -> [u8; VALUE_LEN] {
    let mut out = [0; VALUE_LEN];
    out[0..8].copy_from_slice(&state.last_acked_id.to_le_bytes());
    out[8..16].copy_from_slice(&state.version.to_le_bytes());
    out[16..20].copy_from_slice(&state.mention_count.to_le_bytes());
    out[20..24].copy_from_slice(&state.unread_count.to_le_bytes());
    out[24] = u8::from(state.deleted);
    out
}

fn decode((_, kind, channel_id): RowKey, value: &[u8]) -> Result<ReadState, StoreError> {
    let corrupt = || StoreError::new(NAME, format!("corrupt row for channel {channel_id}"));
    let value: &[u8; VALUE_LEN] = value.try_into().map_err(|_| corrupt())?;
    let u64_at = |i: usize| u64::from_le_bytes(value[i..i + 8].try_into().unwrap_or_default());
    let u32_at = |i: usize| u32::from_le_bytes(value[i..i + 4].try_into().unwrap_or_default());
    Ok(ReadState {
        channel_id,
        last_acked_id: u64_at(0),
        version: u64_at(8),
        mention_count: u32_at(16),
        unread_count: u32_at(20),
        kind: Kind::from_u8(kind).ok_or_else(corrupt)?,
        deleted: value[24] != 0,
    })
}

fn error(e: impl Into<redb::Error>) -> StoreError {
    StoreError::new(NAME, e.into())
}
