//! A handoff as it travels between nodes: what it hands over (slots of an
//! epoch, from a node), its parts (chunks of users, then `Done` with how
//! many), and their `Fleet.HandOver` messages, in either format: users as
//! protobuf messages (1), or [`packed`] as bytes (2, what a node reading it
//! is sent). The cache side, what is exported and installed, is
//! [`crate::cache::handoff`]; who hands what to whom is [`super::member`].

pub mod packed;

use futures::stream::BoxStream;
use readstates_routing::Slot;
use tokio::time::Duration;

use crate::cache::handoff::{Chunk, HandedDeletion, HandedUser};
use crate::clock;
use crate::proto;
use crate::read_state::{Header, Kind, Owned, ReadState, UserReadStates, saturated_count};
use crate::recent_deletions::Deletion;

/// What one handoff hands over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handoff {
    pub epoch: u64,
    pub slots: Vec<Slot>,
    /// The sending node.
    pub from: String,
}

/// One part of a handoff, in order: chunks, then `Done`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Chunk(Chunk),
    /// Every user was sent: this many.
    Done {
        users: usize,
    },
}

/// The parts as a receiver reads them: `Err` when the transfer broke.
pub type Parts = BoxStream<'static, Result<Part, String>>;

/// `HandOver` format 1: users as protobuf messages (`users`), what every
/// node reads.
pub const PROTOBUF: u32 = 1;
/// Format 2: users [`packed`] as bytes (`packed_users`).
pub const PACKED: u32 = 2;
/// The newest format this node reads (and sends, to a node that reads it).
pub const FORMAT: u32 = PACKED;

/// A part as a `HandOver` message in `format`; the first one of a stream
/// also names the handoff.
pub fn to_request(part: Part, handoff: Option<&Handoff>, format: u32) -> proto::HandOverRequest {
    let mut request = proto::HandOverRequest::default();
    if let Some(handoff) = handoff {
        request.epoch = handoff.epoch;
        request.slots = handoff.slots.iter().map(|&s| u32::from(s)).collect();
        request.node_id = handoff.from.clone();
    }
    match part {
        Part::Chunk(Chunk::Users(users)) if format >= PACKED => {
            let mut packed = Vec::with_capacity(users.iter().map(packed::len).sum());
            for user in &users {
                packed::pack(&mut packed, user);
            }
            request.packed_users = packed;
        }
        Part::Chunk(Chunk::Users(users)) => {
            request.users = users.iter().map(to_proto_user).collect();
        }
        Part::Chunk(Chunk::Deletions(deletions)) => {
            request.deletions = deletions.iter().map(to_proto_deletion).collect();
        }
        Part::Chunk(Chunk::Gone(ids)) => request.gone_user_ids = ids,
        Part::Done { users } => {
            request.done = true;
            request.users_sent = users as u64;
        }
    }
    request
}

/// The parts a `HandOver` message carries (a message may carry users,
/// deletions and `done` at once); `Err` naming what is malformed.
pub fn from_request(request: proto::HandOverRequest) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    if !request.users.is_empty() {
        let users = request.users.into_iter().map(from_proto_user);
        parts.push(Part::Chunk(Chunk::Users(users.collect::<Result<_, _>>()?)));
    }
    if !request.packed_users.is_empty() {
        let users = packed::unpack(&request.packed_users)?;
        parts.push(Part::Chunk(Chunk::Users(users)));
    }
    if !request.deletions.is_empty() {
        let deletions = request.deletions.into_iter().map(from_proto_deletion);
        parts.push(Part::Chunk(Chunk::Deletions(
            deletions.collect::<Result<_, _>>()?,
        )));
    }
    if !request.gone_user_ids.is_empty() {
        parts.push(Part::Chunk(Chunk::Gone(request.gone_user_ids)));
    }
    if request.done {
        parts.push(Part::Done {
            users: request.users_sent as usize,
        });
    }
    Ok(parts)
}

fn kind(value: i32) -> Result<Kind, String> {
    u8::try_from(value)
        .ok()
        .and_then(Kind::from_u8)
        .ok_or_else(|| format!("read state kind {value} is unknown"))
}

fn to_proto_user(user: &HandedUser) -> proto::HandedUser {
    let view = user.states.view();
    let header = view.header();
    proto::HandedUser {
        user_id: user.user_id,
        version: header.version,
        written_version: header.written_version,
        delta_floor: header.delta_floor,
        clear_pending: header.clear_pending,
        read_states: view
            .with_parents()
            .map(|(state, parent_id)| proto::HandedReadState {
                channel_id: state.channel_id,
                kind: state.kind as i32,
                last_acked_id: state.last_acked_id,
                last_message_id: state.last_message_id,
                version: state.version,
                mention_count: u32::from(state.mention_count),
                unread_count: u32::from(state.unread_count),
                deleted: state.deleted,
                muted: state.muted,
                parent_id,
            })
            .collect(),
        unwritten_for_ms: user.unwritten_for.map_or(0, |d| d.as_millis() as u64),
    }
}

fn from_proto_user(user: proto::HandedUser) -> Result<HandedUser, String> {
    let rows = user
        .read_states
        .into_iter()
        .map(|state| {
            let read_state = ReadState {
                channel_id: state.channel_id,
                last_acked_id: state.last_acked_id,
                last_message_id: state.last_message_id,
                version: state.version,
                mention_count: saturated_count(state.mention_count),
                unread_count: saturated_count(state.unread_count),
                kind: kind(state.kind)?,
                deleted: state.deleted,
                muted: state.muted,
            };
            Ok((read_state, state.parent_id))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let header = Header {
        version: user.version,
        written_version: user.written_version,
        delta_floor: user.delta_floor,
        clear_pending: user.clear_pending,
    };
    let unwritten_for = Duration::from_millis(user.unwritten_for_ms);
    handed_user(user.user_id, header, rows, unwritten_for)
}

/// A handed user from what a message says of it (in either format);
/// `Err` if a version is from after this node's clock.
fn handed_user(
    user_id: u64,
    header: Header,
    rows: Vec<(ReadState, u64)>,
    unwritten_for: Duration,
) -> Result<HandedUser, String> {
    let versions = [header.version, header.written_version, header.delta_floor];
    let versions = (versions.into_iter()).chain(rows.iter().map(|(state, _)| state.version));
    if let Some(version) = versions.max().filter(|&v| !clock::issued_by_now(v)) {
        return Err(format!(
            "user {user_id} has version {version}, from after this node's clock (more than {:?} \
             ahead): no node issued it",
            clock::MAX_AHEAD
        ));
    }
    let unwritten = header.version > header.written_version;
    Ok(HandedUser {
        user_id,
        states: UserReadStates::from_parts(header, Owned::from_rows(rows)),
        unwritten_for: unwritten.then_some(unwritten_for),
    })
}

fn to_proto_deletion(handed: &HandedDeletion) -> proto::HandedDeletion {
    proto::HandedDeletion {
        user_id: handed.user_id,
        channel_id: handed.deletion.channel_id,
        kind: handed.deletion.kind as i32,
        message_id: handed.deletion.message_id,
    }
}

fn from_proto_deletion(handed: proto::HandedDeletion) -> Result<HandedDeletion, String> {
    Ok(HandedDeletion {
        user_id: handed.user_id,
        deletion: Deletion {
            channel_id: handed.channel_id,
            message_id: handed.message_id,
            kind: kind(handed.kind)?,
        },
    })
}

#[cfg(test)]
mod tests;
