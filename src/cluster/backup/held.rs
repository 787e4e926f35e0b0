//! The holding side of a backup: what this node holds for the nodes it
//! backs up, their journal batches as their streams bring them (checked,
//! not decoded: decoding and collapsing them, newest version wins as in a
//! replay, waits for a takeover), dropped once the sender reports them
//! written. A stream its sender ends lets go of what it held
//! (the sender chose another backup, or stopped having written
//! everything); a stream that breaks keeps it, for a takeover should the
//! sender be dead ([`super::takeover`]). So does one whose sender started
//! again: the new incarnation's stream does not replace it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use metrics::gauge;

use crate::channel_state::ChannelState;
use crate::clock;
use crate::journal::record;
use crate::journal::replay::Collapsing;
use crate::metrics::{BACKUP_BUDGET_BYTES, BACKUP_HELD_BYTES, BACKUP_STREAMS};
use crate::store::UserWrite;

/// What this node holds for others, by stream.
#[derive(Debug)]
pub struct Backups {
    nodes: Mutex<Nodes>,
    /// The most bytes held for all senders together (`backup_budget_mib`).
    budget: usize,
}

/// `backup_budget_mib`'s default, 1 GiB: at 183 bytes per unwritten read
/// state (`docs/failover.md`), about 5.8 million of them.
pub const DEFAULT_BUDGET: usize = 1 << 30;

impl Default for Backups {
    fn default() -> Backups {
        Backups::with_budget(DEFAULT_BUDGET)
    }
}

/// Why a batch was not taken.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// Its frames do not read, or the copy it is for takes no more.
    #[error("{0}")]
    Batch(String),
    /// It would take what this node holds past its budget.
    #[error(
        "this node holds {held} bytes as the backup of others, and {more} more would pass its \
         budget of {budget} (backup_budget_mib): answer on the journal alone until the store \
         takes what is held"
    )]
    Budget {
        held: usize,
        more: usize,
        budget: usize,
    },
}

#[derive(Debug, Default)]
struct Nodes {
    /// By the number of the stream that brought it.
    copies: HashMap<u64, Held>,
    /// Numbers the streams, so that a stream replaced by a newer one from
    /// the same node changes nothing.
    streams: u64,
}

impl Nodes {
    fn get(&self, node: &str, stream: u64) -> Option<&Held> {
        self.copies.get(&stream).filter(|h| h.node == node)
    }

    fn get_mut(&mut self, node: &str, stream: u64) -> Option<&mut Held> {
        self.copies.get_mut(&stream).filter(|h| h.node == node)
    }
}

#[derive(Debug, Default)]
struct Held {
    /// The sending node, and which start of it.
    node: String,
    incarnation: String,
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

    /// Holding at most `budget` bytes for all senders together.
    pub fn with_budget(budget: usize) -> Backups {
        gauge!(BACKUP_BUDGET_BYTES).set(budget as f64);
        Backups {
            nodes: Mutex::default(),
            budget,
        }
    }

    /// A stream from `node`'s `incarnation`, named `token` by it, opens.
    /// It replaces what an earlier stream of that incarnation held (the
    /// sender journals all it has unwritten again). An earlier
    /// incarnation's complete copy stays, broken: its sender is dead (the
    /// node started again), and that copy may be all there is of what it
    /// answered (found by the failover simulation: a node that lost its
    /// disk and started at once had its new stream empty the copy its
    /// lease named). Returns the stream's number.
    pub fn open(&self, node: &str, incarnation: &str, token: &str) -> u64 {
        let mut nodes = self.lock();
        (nodes.copies)
            .retain(|_, h| h.node != node || (h.incarnation != incarnation && h.complete()));
        for held in nodes.copies.values_mut().filter(|h| h.node == node) {
            held.broken = true;
        }
        nodes.streams += 1;
        let stream = nodes.streams;
        nodes.copies.insert(
            stream,
            Held {
                node: node.to_owned(),
                incarnation: incarnation.to_owned(),
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
    pub fn batch(
        &self,
        node: &str,
        stream: u64,
        frames: Vec<u8>,
        end: u64,
    ) -> Result<u64, Refused> {
        let mut at = 0;
        while at < frames.len() {
            let Some(len) = record::check(&frames[at..]) else {
                let why = format!("a frame at offset {at} of a batch does not read");
                return Err(Refused::Batch(why));
            };
            at += len;
        }
        let mut nodes = self.lock();
        // Bounded: a sender whose store cannot take its writes would
        // otherwise grow this node's memory without end. The sender, its
        // stream broken, answers on its journal alone (`super::mirror`).
        let held: usize = nodes.copies.values().map(|h| h.bytes).sum();
        if held + frames.len() > self.budget {
            return Err(Refused::Budget {
                held,
                more: frames.len(),
                budget: self.budget,
            });
        }
        let Some(held) = nodes.get_mut(node, stream) else {
            let why = "replaced by a newer stream from the same node";
            return Err(Refused::Batch(why.into()));
        };
        // An earlier incarnation's copy, kept broken for its takeover (see
        // `open`), takes in nothing more: its takeover may write it ahead
        // and then say so (found in review: a sender still inside its lease
        // went on answering changes the copy written lacked).
        if held.broken {
            let why = "a newer start of the node streams: this copy takes no more";
            return Err(Refused::Batch(why.into()));
        }
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
        let Some(held) = nodes.get_mut(node, stream) else {
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
        if let Some(held) = nodes.get_mut(node, stream) {
            held.complete_at = Some(at);
        }
    }

    /// The sender ended the stream: it needs nothing held any more.
    pub fn ended(&self, node: &str, stream: u64) {
        let mut nodes = self.lock();
        if nodes.get(node, stream).is_some() {
            nodes.copies.remove(&stream);
        }
        drop(nodes);
        self.report();
    }

    /// The stream broke: what it brought is kept, in case `node` is dead.
    pub fn broke(&self, node: &str, stream: u64) {
        let mut nodes = self.lock();
        if let Some(held) = nodes.get_mut(node, stream) {
            held.broken = true;
        }
    }

    /// Nodes whose stream broke after this node held all they had
    /// unwritten, with the number of the stream: each may be dead.
    pub fn broken(&self) -> Vec<(String, u64)> {
        (self.lock().copies.iter())
            .filter(|(_, held)| held.broken && held.complete())
            .map(|(&stream, held)| (held.node.clone(), stream))
            .collect()
    }

    /// Whether stream `stream` of `node` holds all its node had unwritten.
    pub fn is_complete(&self, node: &str, stream: u64) -> bool {
        (self.lock().get(node, stream)).is_some_and(|held| held.complete())
    }

    /// Every copy that holds all its node had unwritten, with the number
    /// of its stream and whether that broke.
    pub fn complete(&self) -> Vec<(String, u64, bool)> {
        (self.lock().copies.iter())
            .filter(|(_, held)| held.complete())
            .map(|(&stream, held)| (held.node.clone(), stream, held.broken))
            .collect()
    }

    /// The nodes held for.
    pub fn nodes(&self) -> Vec<String> {
        let nodes = self.lock();
        let ids: std::collections::BTreeSet<&String> =
            nodes.copies.values().map(|h| &h.node).collect();
        ids.into_iter().cloned().collect()
    }

    /// The sender's name for stream `stream` of `node`, while held.
    pub fn token(&self, node: &str, stream: u64) -> Option<String> {
        let nodes = self.lock();
        Some(nodes.get(node, stream)?.token.clone())
    }

    /// Takes what stream `stream` of `node` brought, unless a newer stream
    /// replaced it: the node is dead, and this node writes it.
    pub fn take(&self, node: &str, stream: u64) -> Option<Taken> {
        let mut nodes = self.lock();
        nodes.get(node, stream)?;
        let held = nodes.copies.remove(&stream)?;
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
            nodes.get(node, stream)?.batches.clone()
        };
        Some(decode(node, &batches))
    }

    /// The batches and bytes held for `node` by its latest stream, and
    /// whether all it had unwritten (for tests and the log).
    pub fn held_for(&self, node: &str) -> Option<(usize, usize, bool)> {
        let nodes = self.lock();
        let (_, held) = (nodes.copies.iter())
            .filter(|(_, h)| h.node == node)
            .max_by_key(|(stream, _)| **stream)?;
        Some((held.batches.len(), held.bytes, held.complete()))
    }

    fn report(&self) {
        let nodes = self.lock();
        let bytes: usize = nodes.copies.values().map(|h| h.bytes).sum();
        gauge!(BACKUP_HELD_BYTES).set(bytes as f64);
        gauge!(BACKUP_STREAMS).set(nodes.copies.len() as f64);
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
            // What another node sends is refused past the clock's bound,
            // as in a handoff: written, such a version would beat every
            // real change of the user for good (issue 53: a forged stream).
            for record in records {
                match record
                    .newest_version()
                    .filter(|&v| !clock::issued_by_now(v))
                {
                    None => collapsing.add(record),
                    Some(version) => tracing::error!(
                        node,
                        version,
                        ahead = ?clock::MAX_AHEAD,
                        "a held record's version is after this node's clock by more than the \
                         fleet's skew: no node issued it; it is not written"
                    ),
                }
            }
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
pub(crate) mod tests;
