//! Backups: a fleet node's unwritten changes held by a second node, so that
//! its death (a lost machine, not only kill -9) loses nothing acknowledged.
//!
//! Each node streams its journal's batches to its backup, the next node of
//! the ring by id ([`backup_of`]), and answers a change only once the
//! backup holds it ([`mirror`], the sending side, a
//! [`crate::journal::Replica`]). The backup collapses what it receives per
//! user and per channel, newest version wins, and drops what the sender
//! reports written ([`receive`], [`held`]); its memory is the sender's write-behind
//! queue, not its cache. When a backup attaches, the sender journals all
//! it has unwritten again, so the backup is complete once it holds up to
//! there. Should the stream break and the sender's lease lapse, the backup
//! takes over ([`takeover`]). The design: `docs/failover.md`.

pub mod held;
pub mod mirror;
pub mod receive;
pub mod sightings;
pub mod takeover;

use readstates_routing::{Node, Ring};

/// The journal's record format the stream carries (see
/// [`crate::journal::record`]).
pub const FORMAT: u32 = 1;

/// The largest `Fleet` message a node takes: a `Mirror` message carries up
/// to a megabyte of frames, or one frame alone, which may be up to
/// [`crate::journal::record::MAX_BODY`].
pub const MAX_MESSAGE: usize = crate::journal::record::MAX_BODY + (1 << 20);

/// `node`'s backup in `ring`: the next node by id (wrapping around) that
/// owns slots, other than `node`; `None` in a fleet of one.
pub fn backup_of<'a>(ring: &'a Ring, node: &str) -> Option<&'a Node> {
    let candidates = || ring.nodes().iter().filter(|n| n.id != node && n.weight > 0);
    candidates()
        .find(|n| n.id.as_str() > node)
        .or_else(|| candidates().next())
}

#[cfg(test)]
mod tests;
