//! The ring: an epoch, the nodes of the fleet (id, gRPC address, weight) and
//! the owner of every slot.
//!
//! Owners are assigned by weighted rendezvous hashing: every node draws, for
//! every slot, an exponential "arrival time" `-ln(u) / weight` (with `u` a
//! uniform hash of the node's id and the slot), and the earliest one owns the
//! slot. Since a node's draws depend on nothing but its own id and weight:
//! - raising one node's weight moves slots only onto that node (its arrivals
//!   get earlier, nobody else's change), and adding a node is raising its
//!   weight from 0;
//! - removing a node (or lowering its weight) moves only its own slots;
//! - a node's share of the slots is its share of the total weight.
//!
//! The owners are computed once, when the ring changes, and stored with it
//! (see `readstates ring`): nodes and gateways read them and never compute
//! them, so floating-point differences between builds or languages cannot
//! make two nodes disagree about an owner.

use std::collections::HashSet;
use std::fmt;

use crate::slot::{SLOTS, Slot, mix, slot_of};

/// `owners[slot]` of a slot that nobody owns (every weight is 0).
pub const NO_OWNER: u16 = u16::MAX;

/// The longest node id taken.
pub const MAX_NODE_ID_LEN: usize = 64;

/// A node of the fleet.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Node {
    /// Stable across restarts (a pod name, a host name); letters, digits,
    /// `.`, `_` and `-`.
    pub id: String,
    /// Where other nodes and gateways reach its gRPC port: `host:port`.
    pub address: String,
    /// Its share of the slots is `weight / total weight`; 0 owns none.
    pub weight: u32,
}

#[derive(Clone, PartialEq, Eq)]
pub struct Ring {
    epoch: u64,
    /// Sorted by id.
    nodes: Vec<Node>,
    /// Per slot, the index in `nodes` of its owner, or [`NO_OWNER`].
    owners: Box<[u16]>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    #[error(
        "node id {0:?}: 1 to {MAX_NODE_ID_LEN} letters, digits, '.', '_' or '-' (a pod or host name)"
    )]
    BadNodeId(String),
    #[error(
        "node {id}: address {address:?} is not host:port (a DNS name, an IPv4 address or \
         [an IPv6 address], and a port from 1 to 65535)"
    )]
    BadAddress { id: String, address: String },
    #[error("node {0} is in the ring already")]
    DuplicateNode(String),
    #[error("node {0} is not in the ring")]
    UnknownNode(String),
    #[error("a ring holds at most {} nodes", NO_OWNER)]
    TooManyNodes,
    #[error("stored owners: {0}")]
    BadOwners(String),
}

impl Ring {
    /// Epoch 0: no nodes, no owners.
    pub fn empty() -> Ring {
        Ring {
            epoch: 0,
            nodes: Vec::new(),
            owners: vec![NO_OWNER; SLOTS].into_boxed_slice(),
        }
    }

    /// The ring of `nodes` at `epoch`, with the owners assigned.
    pub fn new(epoch: u64, mut nodes: Vec<Node>) -> Result<Ring, RingError> {
        nodes.sort_by(|a, b| a.id.cmp(&b.id));
        check_nodes(&nodes)?;
        if let Some(bad) = nodes.iter().find(|n| !crate::address::is_valid(&n.address)) {
            return Err(RingError::BadAddress {
                id: bad.id.clone(),
                address: bad.address.clone(),
            });
        }
        let owners = assign(&nodes);
        Ok(Ring {
            epoch,
            nodes,
            owners,
        })
    }

    /// A ring as stored: owners as assigned when it was made, not computed
    /// again (see the module doc).
    pub fn from_parts(
        epoch: u64,
        mut nodes: Vec<Node>,
        owners: Vec<u16>,
    ) -> Result<Ring, RingError> {
        if owners.len() != SLOTS {
            return Err(RingError::BadOwners(format!(
                "{} slots, not {SLOTS}",
                owners.len()
            )));
        }
        // Owners index the nodes in the order stored: sorting must not
        // reorder them.
        let stored = nodes.clone();
        nodes.sort_by(|a, b| a.id.cmp(&b.id));
        if nodes != stored {
            return Err(RingError::BadOwners("nodes not sorted by id".to_owned()));
        }
        check_nodes(&nodes)?;
        if let Some(bad) = owners
            .iter()
            .find(|&&o| o != NO_OWNER && usize::from(o) >= nodes.len())
        {
            return Err(RingError::BadOwners(format!(
                "owner {bad} of {} nodes",
                nodes.len()
            )));
        }
        Ok(Ring {
            epoch,
            nodes,
            owners: owners.into_boxed_slice(),
        })
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Sorted by id.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: &str) -> Option<&Node> {
        self.index_of(id).map(|i| &self.nodes[i])
    }

    /// Per slot, the index in [`Ring::nodes`] of its owner, or [`NO_OWNER`].
    pub fn owners(&self) -> &[u16] {
        &self.owners
    }

    pub fn owner(&self, slot: Slot) -> Option<&Node> {
        self.nodes.get(usize::from(self.owners[usize::from(slot)]))
    }

    pub fn owner_of(&self, user_id: u64) -> Option<&Node> {
        self.owner(slot_of(user_id))
    }

    /// The slots `id` owns.
    pub fn slots_of<'a>(&'a self, id: &str) -> impl Iterator<Item = Slot> + 'a {
        let index = self.index_of(id).map(|i| i as u16);
        (0..SLOTS as u16).filter(move |&s| Some(self.owners[usize::from(s)]) == index)
    }

    /// The next epoch's ring, with `node` added.
    pub fn with_node(&self, node: Node) -> Result<Ring, RingError> {
        if self.index_of(&node.id).is_some() {
            return Err(RingError::DuplicateNode(node.id));
        }
        let mut nodes = self.nodes.clone();
        nodes.push(node);
        Ring::new(self.epoch + 1, nodes)
    }

    /// The next epoch's ring, with `id`'s weight set to `weight`.
    pub fn with_weight(&self, id: &str, weight: u32) -> Result<Ring, RingError> {
        let index = self
            .index_of(id)
            .ok_or_else(|| RingError::UnknownNode(id.to_owned()))?;
        let mut nodes = self.nodes.clone();
        nodes[index].weight = weight;
        Ring::new(self.epoch + 1, nodes)
    }

    /// The next epoch's ring, without `id`.
    pub fn without(&self, id: &str) -> Result<Ring, RingError> {
        let index = self
            .index_of(id)
            .ok_or_else(|| RingError::UnknownNode(id.to_owned()))?;
        let mut nodes = self.nodes.clone();
        nodes.remove(index);
        Ring::new(self.epoch + 1, nodes)
    }

    fn index_of(&self, id: &str) -> Option<usize> {
        self.nodes.binary_search_by(|n| n.id.as_str().cmp(id)).ok()
    }
}

impl fmt::Debug for Ring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let slots: Vec<usize> = (0..self.nodes.len())
            .map(|i| self.owners.iter().filter(|&&o| usize::from(o) == i).count())
            .collect();
        f.debug_struct("Ring")
            .field("epoch", &self.epoch)
            .field("nodes", &self.nodes)
            .field("slots", &slots)
            .finish()
    }
}

/// Ids and their number. Addresses are checked only when a ring is made
/// ([`Ring::new`]): a stored ring that an older version let take a bad one
/// still reads, so that the node can be removed.
fn check_nodes(nodes: &[Node]) -> Result<(), RingError> {
    if nodes.len() >= usize::from(NO_OWNER) {
        return Err(RingError::TooManyNodes);
    }
    let mut seen = HashSet::new();
    for node in nodes {
        let id_ok = !node.id.is_empty()
            && node.id.len() <= MAX_NODE_ID_LEN
            && node
                .id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !id_ok {
            return Err(RingError::BadNodeId(node.id.clone()));
        }
        if !seen.insert(node.id.as_str()) {
            return Err(RingError::DuplicateNode(node.id.clone()));
        }
    }
    Ok(())
}

/// Weighted rendezvous: each slot goes to the node with the earliest
/// arrival; ties (never seen in practice) to the lower id.
fn assign(nodes: &[Node]) -> Box<[u16]> {
    let keys: Vec<u64> = nodes.iter().map(|n| fnv1a(n.id.as_bytes())).collect();
    (0..SLOTS as u16)
        .map(|slot| {
            let mut best = (f64::INFINITY, NO_OWNER);
            for (index, (node, &key)) in nodes.iter().zip(&keys).enumerate() {
                if node.weight == 0 {
                    continue;
                }
                let arrival = arrival(key, slot, node.weight);
                if arrival < best.0 {
                    best = (arrival, index as u16);
                }
            }
            best.1
        })
        .collect()
}

/// An exponential draw of rate `weight`, from a hash of the node and slot.
fn arrival(node_key: u64, slot: Slot, weight: u32) -> f64 {
    const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
    let hash = mix(node_key.wrapping_add(u64::from(slot).wrapping_mul(GAMMA)));
    // 53 bits, strictly inside (0, 1): ln never sees 0 or 1.
    let uniform = ((hash >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -uniform.ln() / f64::from(weight)
}

/// FNV-1a, 64-bit: turns a node id into the key its draws start from.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
