//! Reading a journal back at start: every segment, in order, collapsed to
//! one write per user and one state per channel (the higher version wins,
//! row by row), with a torn tail dropped and corruption named.
//!
//! Only the newest segment (by number) can end torn: the crash came while
//! it was written. The writer makes a segment only once every older one is
//! synced whole (it seals one after its last batch's sync, and cuts one
//! whose write failed back to its last sync), so an older one that ends in
//! a record that does not read was damaged after it was written: corrupt,
//! as a bad record anywhere else is (issue 53: a flipped bit there was
//! dropped as a torn tail, with the acknowledged change in it). A newest
//! segment left empty by a crash during a rotation does not change that:
//! the one before it was sealed whole.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use super::JournalError;
use super::record::{self, Record, UserRecord};
use crate::channel_state::ChannelState;
use crate::read_state::{Kind, ReadState};
use crate::recent_deletions::Remembered;
use crate::store::UserWrite;

/// Every segment file starts with it (the format's version is its last
/// byte).
pub const MAGIC: &[u8; 8] = b"RSJRNL01";
pub const EXTENSION: &str = "journal";

/// What a journal held.
#[derive(Debug, Default)]
pub struct Replayed {
    /// One write per user: every journaled row, the newest of each.
    pub users: HashMap<u64, UserWrite>,
    /// The newest state of each channel counted by channel.
    pub channels: Vec<ChannelState>,
    /// Records read.
    pub records: usize,
    /// The segment files read, oldest first, and the next segment's number.
    pub segments: Vec<PathBuf>,
    pub next_segment: u64,
    /// Bytes of torn tails dropped (never answered).
    pub torn_bytes: u64,
    /// Bytes skipped as corrupt (`--journal-skip-corrupt`): lost.
    pub skipped_bytes: u64,
}

/// Reads every segment of `dir` (made if missing). Corruption stops it
/// with the file and offset, unless `skip_corrupt`.
pub fn read_dir(dir: &Path, skip_corrupt: bool) -> Result<Replayed, JournalError> {
    std::fs::create_dir_all(dir).map_err(|e| JournalError::io(dir, &e))?;
    let mut numbered: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .map_err(|e| JournalError::io(dir, &e))?
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            if path.extension()? != EXTENSION {
                return None;
            }
            let number = path.file_stem()?.to_str()?.parse().ok()?;
            Some((number, path))
        })
        .collect();
    numbered.sort_unstable();
    let mut collapsing = Collapsing::default();
    let mut replayed = Replayed {
        next_segment: numbered.last().map_or(1, |(n, _)| n + 1),
        ..Replayed::default()
    };
    for (i, (_, path)) in numbered.iter().enumerate() {
        let newest = i + 1 == numbered.len();
        read_segment(path, newest, skip_corrupt, &mut collapsing, &mut replayed)?;
    }
    replayed.segments = numbered.into_iter().map(|(_, path)| path).collect();
    (replayed.users, replayed.channels) = collapsing.into_parts();
    Ok(replayed)
}

fn read_segment(
    path: &Path,
    newest: bool,
    skip_corrupt: bool,
    into: &mut Collapsing,
    replayed: &mut Replayed,
) -> Result<(), JournalError> {
    let bytes = std::fs::read(path).map_err(|e| JournalError::io(path, &e))?;
    if bytes.len() < MAGIC.len() {
        // Made, but the crash (or a failed write, cut back) came before
        // its first sync: nothing in it was answered, wherever it is.
        replayed.torn_bytes += bytes.len() as u64;
        return Ok(());
    }
    if &bytes[..MAGIC.len()] != MAGIC {
        return Err(JournalError::Corrupt {
            file: path.to_owned(),
            offset: 0,
            why: "not a journal segment of this format".into(),
        });
    }
    let mut at = MAGIC.len();
    while at < bytes.len() {
        if let Some((records, len)) = record::read(&bytes[at..]) {
            replayed.records += records.len();
            records.into_iter().for_each(|record| into.add(record));
            at += len;
            continue;
        }
        match next_record(&bytes, at) {
            None if newest => {
                // A torn tail: the crash came while it was written, and it
                // was answered only once synced whole. Cut it off (durably),
                // so that the segment is whole when it is no longer the
                // newest.
                let torn = (bytes.len() - at) as u64;
                tracing::warn!(file = %path.display(), offset = at, bytes = torn, "journal: torn tail dropped");
                replayed.torn_bytes += torn;
                return cut(path, at as u64);
            }
            None if skip_corrupt => {
                let lost = (bytes.len() - at) as u64;
                tracing::error!(file = %path.display(), offset = at, bytes = lost, "journal: corrupt bytes at the end of a segment that is not the newest skipped (--journal-skip-corrupt): the changes in them are lost");
                replayed.skipped_bytes += lost;
                return Ok(());
            }
            None => {
                return Err(JournalError::Corrupt {
                    file: path.to_owned(),
                    offset: at as u64,
                    why: "a record that does not read at the end of a segment that is not the newest, \
                          which no crash tears"
                        .into(),
                });
            }
            Some(next) if skip_corrupt => {
                let lost = (next - at) as u64;
                tracing::error!(file = %path.display(), offset = at, bytes = lost, "journal: corrupt bytes skipped (--journal-skip-corrupt): the changes in them are lost");
                replayed.skipped_bytes += lost;
                at = next;
            }
            Some(_) => {
                return Err(JournalError::Corrupt {
                    file: path.to_owned(),
                    offset: at as u64,
                    why: "a record that does not read, with good records after it".into(),
                });
            }
        }
    }
    if newest {
        // What the crashed process wrote and never synced is read back
        // whole from the page cache; synced before this start makes a
        // newer segment, lest a power cut tear it once it is not the
        // newest.
        sync(path)?;
    }
    Ok(())
}

/// Where the next intact record after the damaged one at `at` starts.
fn next_record(bytes: &[u8], at: usize) -> Option<usize> {
    (at + 1..bytes.len()).find(|&next| record::read(&bytes[next..]).is_some())
}

fn cut(path: &Path, len: u64) -> Result<(), JournalError> {
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| JournalError::io(path, &e))?;
    file.set_len(len)
        .and_then(|()| file.sync_all())
        .map_err(|e| JournalError::io(path, &e))
}

fn sync(path: &Path) -> Result<(), JournalError> {
    (OpenOptions::new().write(true).open(path))
        .and_then(|file| file.sync_data())
        .map_err(|e| JournalError::io(path, &e))
}

/// Journal records collapsed as they are read: per user the newest row of
/// each key, per channel its newest state. Replay collapses a directory;
/// a backup's takeover (`crate::cluster::backup`) what a node streamed it.
#[derive(Debug, Default)]
pub struct Collapsing {
    users: HashMap<u64, User>,
    channels: HashMap<u64, ChannelState>,
}

#[derive(Debug, Default)]
struct User {
    version: u64,
    delta_floor: u64,
    clear_below: u64,
    rows: HashMap<(Kind, u64), (ReadState, u64)>,
    lowered: Vec<Remembered>,
}

impl Collapsing {
    /// Takes in one record: the higher version wins, whatever the order.
    pub fn add(&mut self, record: Record) {
        match record {
            Record::User(record) => self.users.entry(record.user_id).or_default().add(record),
            Record::Lowered { user_id, lowered } => {
                let user = self.users.entry(user_id).or_default();
                for l in lowered {
                    match user.lowered.iter_mut().find(|o| o.deletion == l.deletion) {
                        Some(old) => old.until_ms = old.until_ms.max(l.until_ms),
                        None => user.lowered.push(l),
                    }
                }
            }
            Record::Channel(channel) => {
                let id = channel.channel_id();
                if (self.channels.get(&id)).is_none_or(|held| held.version() < channel.version()) {
                    self.channels.insert(id, channel);
                }
            }
        }
    }
}

impl Collapsing {
    /// What was collected: one write per user, each channel's state.
    pub fn into_parts(self) -> (HashMap<u64, UserWrite>, Vec<ChannelState>) {
        let users = (self.users.into_iter())
            .map(|(user_id, user)| (user_id, user.into_write(user_id)))
            .collect();
        (users, self.channels.into_values().collect())
    }
}

impl User {
    /// The higher version wins, row by row, whatever order records come in.
    fn add(&mut self, record: UserRecord) {
        self.version = self.version.max(record.version);
        self.delta_floor = self.delta_floor.max(record.delta_floor);
        self.clear_below = self.clear_below.max(record.clear_below);
        for (state, parent) in record.rows {
            let key = (state.kind, state.channel_id);
            if (self.rows.get(&key)).is_none_or(|(held, _)| held.version < state.version) {
                self.rows.insert(key, (state, parent));
            }
        }
    }

    fn into_write(self, user_id: u64) -> UserWrite {
        let clear_below = self.clear_below;
        let rows: Vec<(ReadState, u64)> = (self.rows.into_values())
            .filter(|(state, _)| state.version >= clear_below)
            .collect();
        UserWrite {
            user_id,
            version: self.version,
            delta_floor: self.delta_floor,
            clear_below: (clear_below > 0).then_some(clear_below),
            parents: (rows.iter())
                .filter(|(state, _)| state.kind == Kind::Thread)
                .map(|(state, parent)| (state.channel_id, *parent))
                .collect(),
            read_states: rows.into_iter().map(|(state, _)| state).collect(),
            lowered: self.lowered,
        }
    }
}

#[cfg(test)]
mod tests;
