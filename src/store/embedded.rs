//! The default store: redb, an embedded, crash-safe B-tree database in one
//! file under `--data-dir`, so that `readstates serve` needs nothing else.
//!
//! Four tables: `read_states` keyed by `(user_id, kind, channel_id)`, so a
//! user's rows are one contiguous range, `users` holding each user's version
//! and delta floor, `wipes` holding its latest wipe, and `channel_states`
//! (added later: a file without it gets it on open) holding the channels
//! counted by channel. redb is synchronous; calls run on the blocking pool.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::path::Path;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use redb::backends::FileBackend;
use redb::{Database, ReadableDatabase, ReadableTable, StorageBackend, TableDefinition};

use super::{Store, StoreError, StoredUser, UserWrite};
use crate::channel_state::ChannelState;
use crate::read_state::{Kind, ReadState, saturated_count};

type RowKey = (u64, u8, u64);
const READ_STATES: TableDefinition<RowKey, &[u8]> = TableDefinition::new("read_states");
/// user_id -> (version, delta_floor)
const USERS: TableDefinition<u64, (u64, u64)> = TableDefinition::new("users");
/// user_id -> the `clear_below` of its latest wipe, for rows landing after it.
const WIPES: TableDefinition<u64, u64> = TableDefinition::new("wipes");
/// channel_id -> the channel's state, see [`ChannelState::encode`].
const CHANNELS: TableDefinition<u64, &[u8]> = TableDefinition::new("channel_states");
/// user_id -> what the user was lowered for, see [`super::encode_lowered`]
/// (a table older files gain when opened).
const LOWERED: TableDefinition<u64, &[u8]> = TableDefinition::new("lowered");

const FILE_NAME: &str = "readstates.redb";
const NAME: &str = "embedded";

/// Opens the database file (a seam for tests, which wrap the file backend).
type Opener = dyn Fn() -> Result<Database, StoreError> + Send + Sync;

/// After an I/O error redb refuses every later write (`PreviousIo`) until
/// the database is opened again, so the store drops a database that failed
/// that way and opens it again on the next call: redb's recovery on open
/// brings it back to its last commit, and write-behind retries what failed.
#[derive(Clone)]
pub struct EmbeddedStore {
    open: Arc<Opener>,
    /// `None` after an I/O error, until a call opens it again.
    db: Arc<Mutex<Option<Arc<Database>>>>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore").finish_non_exhaustive()
    }
}

/// What a call ran into: redb's errors are kept apart to tell I/O errors.
enum Failure {
    Redb(redb::Error),
    Corrupt(String),
}

impl<E: Into<redb::Error>> From<E> for Failure {
    fn from(e: E) -> Failure {
        Failure::Redb(e.into())
    }
}

impl EmbeddedStore {
    /// Opens (or creates) the database in `data_dir`.
    pub fn open(data_dir: &Path) -> Result<EmbeddedStore, StoreError> {
        EmbeddedStore::open_with(data_dir, |file| file)
    }

    /// [`EmbeddedStore::open`], with the file backend wrapped by `wrap`
    /// (tests inject I/O errors this way).
    pub fn open_with<B: StorageBackend>(
        data_dir: &Path,
        wrap: impl Fn(FileBackend) -> B + Send + Sync + 'static,
    ) -> Result<EmbeddedStore, StoreError> {
        std::fs::create_dir_all(data_dir)
            .map_err(|e| StoreError::new(NAME, format!("create {}: {e}", data_dir.display())))?;
        let path = data_dir.join(FILE_NAME);
        let open = move || {
            let failed = |e: &dyn std::fmt::Display| {
                StoreError::new(NAME, format!("open {}: {e}", path.display()))
            };
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(|e| failed(&e))?;
            let backend = FileBackend::new(file).map_err(|e| failed(&e))?;
            let db = (redb::Builder::new().create_with_backend(wrap(backend))).map_err(|e| match e {
                // redb's lock on the file: a second node on this data
                // directory, or (briefly) this store's own earlier open.
                redb::DatabaseError::DatabaseAlreadyOpen => failed(
                    &"it is open in another process (or another open in this one): is this node running twice?",
                ),
                e => failed(&e),
            })?;
            // Create the tables up front so that reads never find them missing.
            let created = (|| -> Result<(), Failure> {
                let txn = db.begin_write()?;
                txn.open_table(READ_STATES)?;
                txn.open_table(USERS)?;
                txn.open_table(WIPES)?;
                txn.open_table(CHANNELS)?;
                txn.open_table(LOWERED)?;
                txn.commit()?;
                Ok(())
            })();
            created.map_err(|e| failed(&describe(e)))?;
            Ok(db)
        };
        let db = open()?;
        Ok(EmbeddedStore {
            open: Arc::new(open),
            db: Arc::new(Mutex::new(Some(Arc::new(db)))),
        })
    }

    /// Runs `f` on the blocking pool against the open database, opening it
    /// again first if an I/O error closed it; an I/O error closes it.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Database) -> Result<T, Failure> + Send + 'static,
    ) -> Result<T, StoreError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || {
            let db = store.database()?;
            match f(&db) {
                Ok(value) => Ok(value),
                Err(Failure::Redb(e)) => {
                    if matches!(e, redb::Error::Io(_) | redb::Error::PreviousIo) {
                        store.close(&db);
                    }
                    Err(StoreError::new(NAME, e))
                }
                Err(Failure::Corrupt(message)) => Err(StoreError::new(NAME, message)),
            }
        })
        .await
        .map_err(|e| StoreError::new(NAME, format!("task: {e}")))?
    }

    /// The open database, opened again if an I/O error closed it. Opening
    /// fails while a call still holds the old one (the file is locked); the
    /// caller's retry comes back later.
    fn database(&self) -> Result<Arc<Database>, StoreError> {
        let mut db = self.db.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(db) = &*db {
            return Ok(db.clone());
        }
        let reopened = Arc::new((self.open)()?);
        tracing::info!("embedded store opened again after an I/O error");
        *db = Some(reopened.clone());
        Ok(reopened)
    }

    /// Drops `failed` (if it is still the open database) so that the next
    /// call opens the file again.
    fn close(&self, failed: &Arc<Database>) {
        let mut db = self.db.lock().unwrap_or_else(|p| p.into_inner());
        if db.as_ref().is_some_and(|open| Arc::ptr_eq(open, failed)) {
            tracing::warn!("embedded store: I/O error; it is opened again on the next call");
            *db = None;
        }
    }
}

#[async_trait]
impl Store for EmbeddedStore {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn load(&self, user_id: u64) -> Result<StoredUser, StoreError> {
        self.blocking(move |db| {
            let txn = db.begin_read()?;
            let (version, delta_floor) = txn
                .open_table(USERS)?
                .get(user_id)?
                .map_or((0, 0), |v| v.value());
            let rows = txn.open_table(READ_STATES)?;
            let mut read_states = Vec::new();
            let mut parents = BTreeMap::new();
            for row in rows.range(user_range(user_id))? {
                let (key, value) = row?;
                let (state, parent) = decode(key.value(), value.value())?;
                if parent != 0 {
                    parents.insert(state.channel_id, parent);
                }
                read_states.push(state);
            }
            let lowered = (txn.open_table(LOWERED)?.get(user_id)?)
                .map_or_else(Vec::new, |bytes| super::decode_lowered(bytes.value()));
            Ok(StoredUser {
                version,
                delta_floor,
                read_states,
                parents,
                lowered,
            })
        })
        .await
    }

    async fn write(&self, write: &UserWrite) -> Result<(), StoreError> {
        let write = write.clone();
        self.blocking(move |db| {
            let txn = db.begin_write()?;
            {
                let user_id = write.user_id;
                let mut users = txn.open_table(USERS)?;
                let mut wipes = txn.open_table(WIPES)?;
                let mut rows = txn.open_table(READ_STATES)?;
                let (version, floor) = users.get(user_id)?.map_or((0, 0), |v| v.value());
                let cleared = wipes.get(user_id)?.map_or(0, |v| v.value());
                let new_floor = floor.max(write.delta_floor);
                let new_cleared = cleared.max(write.clear_below.unwrap_or(0));
                let stale =
                    |s: &ReadState| s.version < new_cleared || (s.deleted && s.version < new_floor);
                if new_cleared > cleared || new_floor > floor {
                    // Drop what the wipe or the raised floor removes.
                    let doomed: Vec<RowKey> = rows
                        .range(user_range(user_id))?
                        .filter_map(Result::ok)
                        .filter_map(|(k, v)| {
                            let (state, _) = decode(k.value(), v.value()).ok()?;
                            stale(&state).then(|| k.value())
                        })
                        .collect();
                    for key in doomed {
                        rows.remove(key)?;
                    }
                }
                for state in write.read_states.iter().filter(|s| !stale(s)) {
                    let key = (user_id, state.kind as u8, state.channel_id);
                    // Writes may land out of order: the newer row wins.
                    let newer = match rows.get(key)? {
                        Some(old) => decode(key, old.value())?.0.version < state.version,
                        None => true,
                    };
                    if newer {
                        let parent = write.parents.get(&state.channel_id).copied();
                        let parent = parent.filter(|_| state.kind == Kind::Thread);
                        rows.insert(key, encode(state, parent.unwrap_or(0)).as_slice())?;
                    }
                }
                users.insert(user_id, (version.max(write.version), new_floor))?;
                if new_cleared > cleared {
                    wipes.insert(user_id, new_cleared)?;
                }
                // The newer write's memory wins, as its rows do.
                if !write.lowered.is_empty() && write.version >= version {
                    let lowered = super::encode_lowered(&write.lowered);
                    txn.open_table(LOWERED)?
                        .insert(user_id, lowered.as_slice())?;
                }
            }
            Ok(txn.commit()?)
        })
        .await
    }

    async fn load_channels(&self) -> Result<Vec<ChannelState>, StoreError> {
        self.blocking(|db| {
            let txn = db.begin_read()?;
            let mut channels = Vec::new();
            for row in txn.open_table(CHANNELS)?.iter()? {
                let (key, value) = row?;
                // One damaged row must not keep every channel from loading.
                match ChannelState::decode(key.value(), value.value()) {
                    Some(channel) => channels.push(channel),
                    None => tracing::error!("skipped: corrupt state of channel {}", key.value()),
                }
            }
            Ok(channels)
        })
        .await
    }

    async fn write_channel(&self, channel: &ChannelState) -> Result<(), StoreError> {
        let channel = channel.clone();
        self.blocking(move |db| {
            let txn = db.begin_write()?;
            {
                let mut channels = txn.open_table(CHANNELS)?;
                let id = channel.channel_id();
                // Writes may land out of order: the newer state wins (over a
                // damaged row too).
                let newer = match channels.get(id)? {
                    Some(old) => ChannelState::decode(id, old.value())
                        .is_none_or(|old| old.version() < channel.version()),
                    None => true,
                };
                if newer {
                    channels.insert(id, channel.encode().as_slice())?;
                }
            }
            Ok(txn.commit()?)
        })
        .await
    }
}

fn user_range(user_id: u64) -> std::ops::RangeInclusive<RowKey> {
    (user_id, 0, 0)..=(user_id, u8::MAX, u64::MAX)
}

/// A row's value: last_acked_id, version, mention_count (u32),
/// unread_count (u32), flags, then last_message_id, and for a thread its
/// parent id; little-endian. The first 25 bytes are the whole row of files
/// written before the watermark (whose flags byte was 0 or 1 for
/// `deleted`), and such rows still decode, with a watermark of 0; the
/// parent is only on thread rows, which files before threads do not have.
const VALUE_LEN: usize = 8 + 8 + 4 + 4 + 1 + 8;
const VALUE_LEN_BEFORE_WATERMARK: usize = 8 + 8 + 4 + 4 + 1;
const VALUE_LEN_THREAD: usize = VALUE_LEN + 8;
const DELETED: u8 = 1;
const MUTED: u8 = 2;

/// `state`'s row, with `parent` (0: not a thread, nothing written).
fn encode(state: &ReadState, parent: u64) -> Vec<u8> {
    let mut out = vec![
        0;
        if parent == 0 {
            VALUE_LEN
        } else {
            VALUE_LEN_THREAD
        }
    ];
    if parent != 0 {
        out[VALUE_LEN..].copy_from_slice(&parent.to_le_bytes());
    }
    out[0..8].copy_from_slice(&state.last_acked_id.to_le_bytes());
    out[8..16].copy_from_slice(&state.version.to_le_bytes());
    out[16..20].copy_from_slice(&u32::from(state.mention_count).to_le_bytes());
    out[20..24].copy_from_slice(&u32::from(state.unread_count).to_le_bytes());
    out[24] = if state.deleted { DELETED } else { 0 } | if state.muted { MUTED } else { 0 };
    out[25..33].copy_from_slice(&state.last_message_id.to_le_bytes());
    out
}

/// A row and its parent id (0 but for a thread's).
fn decode((_, kind, channel_id): RowKey, value: &[u8]) -> Result<(ReadState, u64), Failure> {
    let corrupt = || Failure::Corrupt(format!("corrupt row for channel {channel_id}"));
    let lengths = [VALUE_LEN, VALUE_LEN_BEFORE_WATERMARK, VALUE_LEN_THREAD];
    if !lengths.contains(&value.len()) {
        return Err(corrupt());
    }
    let u64_at = |i: usize| {
        value
            .get(i..i + 8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    };
    let u32_at = |i: usize| u32::from_le_bytes(value[i..i + 4].try_into().unwrap_or_default());
    let flags = value[24];
    let state = ReadState {
        channel_id,
        last_acked_id: u64_at(0),
        last_message_id: u64_at(25),
        version: u64_at(8),
        mention_count: saturated_count(u32_at(16)),
        unread_count: saturated_count(u32_at(20)),
        kind: Kind::from_u8(kind).ok_or_else(corrupt)?,
        deleted: flags & DELETED != 0,
        muted: flags & MUTED != 0,
    };
    Ok((state, u64_at(VALUE_LEN)))
}

fn describe(failure: Failure) -> String {
    match failure {
        Failure::Redb(e) => e.to_string(),
        Failure::Corrupt(message) => message,
    }
}

#[cfg(test)]
mod tests;
