//! Handed users packed as bytes: `HandOver` format 2 (the layout is in the
//! proto's `packed_users`). Each user is a fixed header and then its rows
//! in the journal's row layout ([`record::put_row`]): the sender copies
//! them out of the cache as they are, the receiver reads them back without
//! a protobuf message, varints and an allocation per read state.

use tokio::time::Duration;

use super::handed_user;
use crate::cache::handoff::HandedUser;
use crate::journal::record;
use crate::read_state::Header;

/// User id, version, written version, delta floor, unwritten-for; flags;
/// row count.
const USER: usize = 8 * 5 + 1 + 4;
const CLEAR_PENDING: u8 = 1;
// The sizes the proto's `packed_users` gives: the wire format between
// builds, so a change to the journal's row is a new format.
const _: () = assert!(USER == 45 && record::ROW == 46);

/// The bytes [`pack`] appends for `user`.
pub fn len(user: &HandedUser) -> usize {
    USER + user.states.view().entries().len() * record::ROW
}

/// Appends `user` to `out`.
pub fn pack(out: &mut Vec<u8>, user: &HandedUser) {
    let view = user.states.view();
    let header = view.header();
    let unwritten_for = user.unwritten_for.map_or(0, |d| d.as_millis() as u64);
    for value in [
        user.user_id,
        header.version,
        header.written_version,
        header.delta_floor,
        unwritten_for,
    ] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    out.push(if header.clear_pending {
        CLEAR_PENDING
    } else {
        0
    });
    // The rows written, not the entries held: the count always matches
    // the rows that follow (as the journal's `append_user` does).
    let count_at = out.len();
    out.extend_from_slice(&0u32.to_le_bytes());
    let mut count = 0u32;
    for (state, parent) in view.with_parents() {
        record::put_row(out, state, parent);
        count += 1;
    }
    out[count_at..count_at + 4].copy_from_slice(&count.to_le_bytes());
}

/// The users packed in `bytes`; `Err` naming what is malformed.
pub fn unpack(mut bytes: &[u8]) -> Result<Vec<HandedUser>, String> {
    let mut users = Vec::new();
    while !bytes.is_empty() {
        let (head, rest) = bytes
            .split_first_chunk::<USER>()
            .ok_or_else(|| format!("packed user {} is cut short", users.len()))?;
        let u64_at = |i: usize| u64::from_le_bytes(head[i * 8..i * 8 + 8].try_into().unwrap());
        let user_id = u64_at(0);
        let header = Header {
            version: u64_at(1),
            written_version: u64_at(2),
            delta_floor: u64_at(3),
            clear_pending: head[40] & CLEAR_PENDING != 0,
        };
        let unwritten_for = Duration::from_millis(u64_at(4));
        let count = u32::from_le_bytes(head[41..45].try_into().unwrap()) as usize;
        let (rows, rest) = record::read_rows(rest, count).ok_or_else(|| {
            format!("user {user_id}'s {count} packed rows are cut short or malformed")
        })?;
        users.push(handed_user(user_id, header, rows, unwritten_for)?);
        bytes = rest;
    }
    Ok(users)
}
