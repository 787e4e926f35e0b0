//! The journal's records: after-images, framed and checksummed.
//!
//! A frame is `[len u32][crc32 u32][body]`, little-endian, the checksum over
//! the body; the body is the entries of one request (a change of many users
//! is one frame, so a crash keeps all of it or none). An entry is
//! `[len u32][type u8][payload]`, the length over type and payload; by type:
//! - [`USER`]: user id, version, delta floor, "delete all" version (0: none),
//!   row count, then each row: kind, channel id, last acked id, last message
//!   id, version, mention count, unread count, flags, parent id (0 but for a
//!   thread's): the rows a change gave a new version;
//! - [`LOWERED`]: user id, then [`crate::store::encode_lowered`]'s bytes;
//! - [`CHANNEL`]: channel id, then [`ChannelState::encode`]'s bytes.
//!
//! Encoding writes straight into the journal's buffer (it runs under a shard
//! lock, on every change); decoding builds [`Record`]s for replay.

use crate::channel_state::ChannelState;
use crate::read_state::{Kind, ReadState, UserView, first_thread};
use crate::recent_deletions::Remembered;
use crate::store::{UserWrite, decode_lowered, encode_lowered};

pub const USER: u8 = 1;
pub const LOWERED: u8 = 2;
pub const CHANNEL: u8 = 3;

/// Frame header: length and checksum.
pub const HEADER: usize = 8;
/// Entry header: length.
const ENTRY: usize = 4;
/// No record is larger (a channel's image is about 8 KiB; a user's change
/// touches a few rows, a "delete all" none): a length beyond it is damage.
pub const MAX_BODY: usize = 16 << 20;

/// A row: kind, four ids and versions, two counts, flags, parent. A
/// handoff packs read states in the same layout
/// ([`crate::cluster::handoff::packed`]).
pub const ROW: usize = 1 + 8 * 4 + 2 + 2 + 1 + 8;
const DELETED: u8 = 1;
const MUTED: u8 = 2;

/// An entry read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    User(UserRecord),
    Lowered {
        user_id: u64,
        lowered: Vec<Remembered>,
    },
    Channel(ChannelState),
}

impl Record {
    /// The newest version it carries (none for a deletion's memory): what
    /// a bound on versions from another node checks.
    pub fn newest_version(&self) -> Option<u64> {
        match self {
            Record::User(user) => {
                let rows = user.rows.iter().map(|(state, _)| state.version);
                let own = [user.version, user.delta_floor, user.clear_below];
                own.into_iter().chain(rows).max()
            }
            Record::Lowered { .. } => None,
            Record::Channel(channel) => Some(channel.version()),
        }
    }
}

/// A user's change: what [`append_user`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserRecord {
    pub user_id: u64,
    pub version: u64,
    pub delta_floor: u64,
    /// A "delete all" at this version (0: none).
    pub clear_below: u64,
    /// Each row with its parent id (0 but for a thread's).
    pub rows: Vec<(ReadState, u64)>,
}

/// Appends a user entry to `out`: the rows of `user` with a version above
/// `since` (the user's version before the change; its written version for
/// all its unwritten ones).
pub fn append_user(out: &mut Vec<u8>, user_id: u64, since: u64, user: UserView<'_>) {
    let start = begin(out, USER);
    put(out, user_id);
    put(out, user.version());
    put(out, user.delta_floor());
    put(
        out,
        user.pending_clear().filter(|&c| c > since).unwrap_or(0),
    );
    let count_at = out.len();
    out.extend_from_slice(&0u32.to_le_bytes());
    let entries = user.entries();
    let threads = first_thread(entries);
    let mut count = 0u32;
    for (index, state) in entries.iter().enumerate() {
        if state.version <= since {
            continue;
        }
        let parent = index
            .checked_sub(threads)
            .and_then(|i| user.parents().get(i).copied())
            .unwrap_or(0);
        put_row(out, state, parent);
        count += 1;
    }
    out[count_at..count_at + 4].copy_from_slice(&count.to_le_bytes());
    end(out, start);
}

/// Appends the entries of a write not made yet (a user replayed and not
/// loaded): its rows, and what it is remembered lowered for.
pub fn append_write(out: &mut Vec<u8>, write: &UserWrite) {
    let start = begin(out, USER);
    put(out, write.user_id);
    put(out, write.version);
    put(out, write.delta_floor);
    put(out, write.clear_below.unwrap_or(0));
    out.extend_from_slice(&(write.read_states.len() as u32).to_le_bytes());
    for state in &write.read_states {
        let parent = match state.kind {
            Kind::Thread => write.parents.get(&state.channel_id).copied().unwrap_or(0),
            _ => 0,
        };
        put_row(out, state, parent);
    }
    end(out, start);
    if !write.lowered.is_empty() {
        append_lowered(out, write.user_id, &write.lowered);
    }
}

/// Appends an entry of what `user_id` is remembered lowered for.
pub fn append_lowered(out: &mut Vec<u8>, user_id: u64, lowered: &[Remembered]) {
    let start = begin(out, LOWERED);
    put(out, user_id);
    out.extend_from_slice(&encode_lowered(lowered));
    end(out, start);
}

/// Appends an entry of a channel's whole state.
pub fn append_channel(out: &mut Vec<u8>, channel: &ChannelState) {
    let start = begin(out, CHANNEL);
    put(out, channel.channel_id());
    out.extend_from_slice(&channel.encode());
    end(out, start);
}

/// Appends a frame of the entries `entries` writes.
pub fn frame(out: &mut Vec<u8>, entries: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0; HEADER]);
    entries(out);
    let body = &out[start + HEADER..];
    let (len, crc) = (body.len() as u32, crc32fast::hash(body));
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// The length of the frame starting `bytes`, from its header alone (to
/// split a batch at frame boundaries).
pub fn frame_len(bytes: &[u8]) -> Option<usize> {
    let len = u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?) as usize;
    Some(HEADER + len)
}

/// The length of the whole, intact frame at the start of `bytes` (its
/// checksum holds), without decoding its entries.
pub fn check(bytes: &[u8]) -> Option<usize> {
    let len = u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?) as usize;
    if len == 0 || len > MAX_BODY {
        return None;
    }
    let crc = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?);
    let body = bytes.get(HEADER..HEADER + len)?;
    (crc32fast::hash(body) == crc).then_some(HEADER + len)
}

/// Reads the frame at the start of `bytes`: its entries and the frame's
/// length, or `None` if no whole, intact frame of known entries starts
/// there.
pub fn read(bytes: &[u8]) -> Option<(Vec<Record>, usize)> {
    let len = u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?) as usize;
    if len == 0 || len > MAX_BODY {
        return None;
    }
    let crc = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?);
    let mut body = bytes.get(HEADER..HEADER + len)?;
    if crc32fast::hash(body) != crc {
        return None;
    }
    let mut records = Vec::new();
    while !body.is_empty() {
        let len = u32::from_le_bytes(body.get(0..ENTRY)?.try_into().ok()?) as usize;
        let entry = body.get(ENTRY..ENTRY + len).filter(|e| !e.is_empty())?;
        records.push(decode(entry)?);
        body = &body[ENTRY + len..];
    }
    Some((records, HEADER + len))
}

fn decode(body: &[u8]) -> Option<Record> {
    let mut at = Reader { bytes: body, at: 1 };
    match body[0] {
        USER => {
            let user_id = at.u64()?;
            let version = at.u64()?;
            let delta_floor = at.u64()?;
            let clear_below = at.u64()?;
            let count = at.u32()? as usize;
            let (rows, rest) = read_rows(&body[at.at..], count)?;
            if !rest.is_empty() {
                return None;
            }
            Some(Record::User(UserRecord {
                user_id,
                version,
                delta_floor,
                clear_below,
                rows,
            }))
        }
        LOWERED => {
            let user_id = at.u64()?;
            let lowered = decode_lowered(&body[at.at..]);
            Some(Record::Lowered { user_id, lowered })
        }
        CHANNEL => {
            let channel_id = at.u64()?;
            Some(Record::Channel(ChannelState::decode(
                channel_id,
                &body[at.at..],
            )?))
        }
        _ => None,
    }
}

fn begin(out: &mut Vec<u8>, kind: u8) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0; ENTRY]);
    out.push(kind);
    start
}

/// Fills in the length of the entry begun at `start`.
fn end(out: &mut [u8], start: usize) {
    let len = (out.len() - start - ENTRY) as u32;
    out[start..start + ENTRY].copy_from_slice(&len.to_le_bytes());
}

fn put(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.to_le_bytes());
}

/// A read state with its parent id (0 but for a thread's).
pub type Row = (ReadState, u64);

/// Appends a row: `state`, and its parent id (0 but for a thread's).
pub fn put_row(out: &mut Vec<u8>, state: &ReadState, parent: u64) {
    // Built on the stack and appended at once: one capacity check per row,
    // not one per field (it runs for every row of every change journaled).
    let mut row = [0u8; ROW];
    row[0] = state.kind as u8;
    for (at, value) in [
        state.channel_id,
        state.last_acked_id,
        state.last_message_id,
        state.version,
    ]
    .into_iter()
    .enumerate()
    {
        row[1 + at * 8..9 + at * 8].copy_from_slice(&value.to_le_bytes());
    }
    row[33..35].copy_from_slice(&state.mention_count.to_le_bytes());
    row[35..37].copy_from_slice(&state.unread_count.to_le_bytes());
    row[37] = if state.deleted { DELETED } else { 0 } | if state.muted { MUTED } else { 0 };
    row[38..46].copy_from_slice(&parent.to_le_bytes());
    out.extend_from_slice(&row);
}

/// The `count` rows at the start of `bytes` (see [`put_row`]), and the
/// bytes after them; `None` if they are cut short or a kind is unknown.
pub fn read_rows(bytes: &[u8], count: usize) -> Option<(Vec<Row>, &[u8])> {
    let (rows, rest) = bytes.split_at_checked(count.checked_mul(ROW)?)?;
    let (rows, _) = rows.as_chunks::<ROW>();
    let rows = rows.iter().map(read_row).collect::<Option<Vec<_>>>()?;
    Some((rows, rest))
}

/// One row (see [`put_row`]); `None` if its kind is unknown. Read at fixed
/// offsets of a whole row, so no field needs a bounds check of its own.
fn read_row(row: &[u8; ROW]) -> Option<Row> {
    let u64_at = |at: usize| u64::from_le_bytes(row[at..at + 8].try_into().expect("8 bytes"));
    let u16_at = |at: usize| u16::from_le_bytes(row[at..at + 2].try_into().expect("2 bytes"));
    let state = ReadState {
        kind: Kind::from_u8(row[0])?,
        channel_id: u64_at(1),
        last_acked_id: u64_at(9),
        last_message_id: u64_at(17),
        version: u64_at(25),
        mention_count: u16_at(33),
        unread_count: u16_at(35),
        deleted: row[37] & DELETED != 0,
        muted: row[37] & MUTED != 0,
    };
    Some((state, u64_at(38)))
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let taken = self.bytes.get(self.at..self.at + N)?.try_into().ok()?;
        self.at += N;
        Some(taken)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read_state::Key;

    /// A row's bytes, spelled out: the layout journal files and `HandOver`
    /// format 2 share with every build, which a round trip within one
    /// build would not catch changing.
    #[test]
    fn a_row_is_laid_out_as_every_build_reads_it() {
        let state = ReadState {
            last_acked_id: 0x1112_1314_1516_1718,
            last_message_id: 0x2122_2324_2526_2728,
            version: 0x3132_3334_3536_3738,
            mention_count: 0x4142,
            unread_count: 0x5152,
            deleted: true,
            muted: true,
            ..ReadState::new(Key {
                kind: Kind::Thread,
                channel_id: 0x0102_0304_0506_0708,
            })
        };
        let expected: [u8; ROW] = [
            6, // kind: thread
            0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // channel id
            0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11, // last acked id
            0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21, // last message id
            0x38, 0x37, 0x36, 0x35, 0x34, 0x33, 0x32, 0x31, // version
            0x42, 0x41, // mention count
            0x52, 0x51, // unread count
            3,    // flags: deleted, muted
            0x68, 0x67, 0x66, 0x65, 0x64, 0x63, 0x62, 0x61, // parent id
        ];
        let mut out = Vec::new();
        put_row(&mut out, &state, 0x6162_6364_6566_6768);
        assert_eq!(out, expected);
        let (rows, rest) = read_rows(&expected, 1).expect("a whole row");
        assert_eq!(
            (rows, rest.len()),
            (vec![(state, 0x6162_6364_6566_6768)], 0)
        );
    }

    fn state(channel_id: u64, version: u64) -> ReadState {
        ReadState {
            last_acked_id: 7,
            last_message_id: 9,
            version,
            mention_count: 2,
            unread_count: 3,
            muted: true,
            ..ReadState::new(Key {
                kind: Kind::Channel,
                channel_id,
            })
        }
    }

    #[test]
    fn a_user_record_holds_the_rows_changed_after_its_since_version() {
        let user = crate::read_state::UserReadStates::from_stored(
            20,
            0,
            vec![(state(1, 10), 0), (state(2, 20), 0), (state(3, 15), 0)],
        );
        let mut out = Vec::new();
        frame(&mut out, |out| append_user(out, 42, 12, user.view()));
        let (mut records, len) = read(&out).expect("reads back");
        assert_eq!((len, records.len()), (out.len(), 1));
        let Record::User(record) = records.remove(0) else {
            panic!("a user record")
        };
        assert_eq!(
            (record.user_id, record.version, record.clear_below),
            (42, 20, 0)
        );
        let channels: Vec<u64> = record.rows.iter().map(|(s, _)| s.channel_id).collect();
        assert_eq!(channels, [2, 3]);
        assert_eq!(record.rows[0].0, state(2, 20));
    }

    #[test]
    fn a_damaged_or_cut_frame_does_not_read() {
        let mut out = Vec::new();
        frame(&mut out, |out| {
            append_lowered(out, 5, &[]);
            append_lowered(out, 6, &[]);
        });
        assert_eq!(read(&out).map(|(records, _)| records.len()), Some(2));
        assert!(read(&out[..out.len() - 1]).is_none(), "cut");
        let last = out.len() - 1;
        out[last] ^= 1;
        assert!(read(&out).is_none(), "bit flipped");
        assert!(read(&[0; 16]).is_none(), "zeros");
    }
}
