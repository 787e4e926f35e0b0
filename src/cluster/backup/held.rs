//! The holding side of a backup: what this node holds for the nodes it
//! backs up, their journal batches as their streams bring them (checked,
//! not decoded: decoding and collapsing them, newest version wins as in a
//! replay, waits for a takeover), dropped once the sender reports them
//! written. A stream its sender ends lets go of what it held
//! (the sender chose another backup, or stopped having written
//! everything); a stream that breaks keeps it, for a takeover should the
//! sender be dead ([`super::takeover`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use metrics::gauge;

use crate::channel_state::ChannelState;
use crate::journal::record;
use crate::journal::replay::Collapsing;
use crate::metrics::{BACKUP_HELD_BYTES, BACKUP_STREAMS};
use crate::store::UserWrite;

/// What this node holds for others, by sending node.
#[derive(Debug, Default)]
pub struct Backups {
    nodes: Mutex<Nodes>,
}

#[derive(Debug, Default)]
struct Nodes {
    by_id: HashMap<String, Held>,
    /// Numbers the streams, so that a stream replaced by a newer one from
    /// the same node changes nothing.
    streams: u64,
}

#[derive(Debug, Default)]
struct Held {
    stream: u64,
    /// The sender's name for the stream: a takeover with this copy needs
    /// the sender's lease record to name it.
    token: String,
    /// The batches not reported written, oldest first, with where the
    /// sender's journal ended after each.
    batches: VecDeque<(u64, Vec<u8>)>,
    bytes: usize,
    /// Every batch up to here is held.
    held: u64,
    /// Everything the sender had unwritten is held once `held` reaches it.
    complete_at: Option<u64>,
    /// The stream broke without its sender ending it.
    broken: bool,
}

/// What a node that died had unwritten, as its backup held it.
#[derive(Debug, Default)]
pub struct Taken {
    pub users: Vec<UserWrite>,
    pub channels: Vec<ChannelState>,
}

impl Held {
    fn complete(&self) -> bool {
        self.complete_at.is_some_and(|at| self.held >= at)
    }
}

impl Backups {
    pub fn new() -> Arc<Backups> {
        Arc::new(Backups::default())
    }

    /// A stream from `node`, named `token` by it, opens: it replaces what
    /// an earlier one held (the sender journals all it has unwritten
    /// again). Returns its number.
    pub fn open(&self, node: &str, token: &str) -> u64 {
        let mut nodes = self.lock();
        nodes.streams += 1;
        let stream = nodes.streams;
        nodes.by_id.insert(
            node.to_owned(),
            Held {
                stream,
                token: token.to_owned(),
                ..Held::default()
            },
        );
        drop(nodes);
        self.report();
        stream
    }

    /// A batch of journal frames, appended by the sender up to `end`.
    /// Returns how far this node holds the sender's batches, or why the
    /// frames do not read.
    pub fn batch(&self, node: &str, stream: u64, frames: Vec<u8>, end: u64) -> Result<u64, String> {
        let mut at = 0;
        while at < frames.len() {
            let Some(len) = record::check(&frames[at..]) else {
                return Err(format!("a frame at offset {at} of a batch does not read"));
            };
            at += len;
        }
        let mut nodes = self.lock();
        let Some(held) = nodes.by_id.get_mut(node).filter(|h| h.stream == stream) else {
            return Err("replaced by a newer stream from the same node".into());
        };
        held.bytes += frames.len();
        held.batches.push_back((end, frames));
        held.held = held.held.max(end);
        let reached = held.held;
        drop(nodes);
        self.report();
        Ok(reached)
    }

    /// What `node` appended up to `through` is in its store: dropped here.
    pub fn trimmed(&self, node: &str, stream: u64, through: u64) {
        let mut nodes = self.lock();
        let Some(held) = nodes.by_id.get_mut(node).filter(|h| h.stream == stream) else {
            return;
        };
        while let Some((end, frames)) = held.batches.front() {
            if *end > through {
                break;
            }
            held.bytes -= frames.len();
            held.batches.pop_front();
        }
        drop(nodes);
        self.report();
    }

    /// `node` holds everything unwritten once this node holds up to `at`.
    pub fn complete_at(&self, node: &str, stream: u64, at: u64) {
        let mut nodes = self.lock();
        if let Some(held) = nodes.by_id.get_mut(node).filter(|h| h.stream == stream) {
            held.complete_at = Some(at);
        }
    }

    /// The sender ended the stream: it needs nothing held any more.
    pub fn ended(&self, node: &str, stream: u64) {
        let mut nodes = self.lock();
        if nodes.by_id.get(node).is_some_and(|h| h.stream == stream) {
            nodes.by_id.remove(node);
        }
        drop(nodes);
        self.report();
    }

    /// The stream broke: what it brought is kept, in case `node` is dead.
    pub fn broke(&self, node: &str, stream: u64) {
        let mut nodes = self.lock();
        if let Some(held) = nodes.by_id.get_mut(node).filter(|h| h.stream == stream) {
            held.broken = true;
        }
    }

    /// Nodes whose stream broke after this node held all they had
    /// unwritten, with the number of the stream: each may be dead.
    pub fn broken(&self) -> Vec<(String, u64)> {
        (self.lock().by_id.iter())
            .filter(|(_, held)| held.broken && held.complete())
            .map(|(node, held)| (node.clone(), held.stream))
            .collect()
    }

    /// Every copy that holds all its node had unwritten, with the number
    /// of its stream and whether that broke.
    pub fn complete(&self) -> Vec<(String, u64, bool)> {
        (self.lock().by_id.iter())
            .filter(|(_, held)| held.complete())
            .map(|(node, held)| (node.clone(), held.stream, held.broken))
            .collect()
    }

    /// The nodes held for.
    pub fn nodes(&self) -> Vec<String> {
        self.lock().by_id.keys().cloned().collect()
    }

    /// The sender's name for stream `stream` of `node`, while held.
    pub fn token(&self, node: &str, stream: u64) -> Option<String> {
        let nodes = self.lock();
        let held = nodes.by_id.get(node).filter(|h| h.stream == stream)?;
        Some(held.token.clone())
    }

    /// Takes what stream `stream` of `node` brought, unless a newer stream
    /// replaced it: the node is dead, and this node writes it.
    pub fn take(&self, node: &str, stream: u64) -> Option<Taken> {
        let mut nodes = self.lock();
        if nodes.by_id.get(node).is_none_or(|h| h.stream != stream) {
            return None;
        }
        let held = nodes.by_id.remove(node)?;
        drop(nodes);
        self.report();
        Some(decode(node, &held.batches))
    }

    /// What stream `stream` of `node` brought, decoded, kept held: a broken
    /// stream's copy is written ahead while its sender's lease is watched
    /// (a stream that broke takes in nothing more).
    pub fn copy(&self, node: &str, stream: u64) -> Option<Taken> {
        let batches = {
            let nodes = self.lock();
            let held = nodes.by_id.get(node).filter(|h| h.stream == stream)?;
            held.batches.clone()
        };
        Some(decode(node, &batches))
    }

    /// The batches and bytes held for `node`, and whether all it had
    /// unwritten (for tests and the log).
    pub fn held_for(&self, node: &str) -> Option<(usize, usize, bool)> {
        let nodes = self.lock();
        let held = nodes.by_id.get(node)?;
        Some((held.batches.len(), held.bytes, held.complete()))
    }

    fn report(&self) {
        let nodes = self.lock();
        let bytes: usize = nodes.by_id.values().map(|h| h.bytes).sum();
        gauge!(BACKUP_HELD_BYTES).set(bytes as f64);
        gauge!(BACKUP_STREAMS).set(nodes.by_id.len() as f64);
    }

    fn lock(&self) -> MutexGuard<'_, Nodes> {
        self.nodes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Batches of journal frames, decoded and collapsed (newest version wins).
fn decode(node: &str, batches: &VecDeque<(u64, Vec<u8>)>) -> Taken {
    let mut collapsing = Collapsing::default();
    for (_, frames) in batches {
        let mut at = 0;
        while at < frames.len() {
            // Checked when it came: only an entry of a kind this build
            // does not know fails here.
            let Some((records, len)) = record::read(&frames[at..]) else {
                tracing::error!(
                    node,
                    offset = at,
                    bytes = frames.len() - at,
                    "a held batch does not decode; what it holds is not written"
                );
                break;
            };
            records.into_iter().for_each(|r| collapsing.add(r));
            at += len;
        }
    }
    let (users, channels) = collapsing.into_parts();
    Taken {
        users: users.into_values().collect(),
        channels,
    }
}

#[cfg(test)]
mod tests;
