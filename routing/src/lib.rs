//! Where a readstates user lives, for the nodes of a fleet and the gateways
//! in front of them.
//!
//! # Layout
//! - [`slot`]: the fixed function from a user id to one of [`SLOTS`] slots;
//!   gateways in any language compute the same (see `routing/slots.csv`).
//! - [`address`]: what a node's `host:port` may be.
//! - [`ring`]: an epoch, the nodes with their weights, and the owner of every
//!   slot, assigned by weighted rendezvous hashing.
//! - [`proto`]: the `readstates.v1` API (client and server), with its
//!   [`codec`].
//! - [`client`]: a client for a fleet that sends each request to its
//!   user's owner, from the routing table, following redirects.
//! - [`status`]: the metadata on a node's answers, and which failed
//!   requests may be sent again.
//! - [`apply`]: one `Apply` stream to a node, shared by many callers, its
//!   changes sent in batches of what is queued.

#![forbid(unsafe_code)]

pub mod address;
pub mod apply;
pub mod client;
pub mod codec;
pub mod proto;
pub mod ring;
pub mod slot;
pub mod status;

pub use ring::{Node, Ring, RingError};
pub use slot::{SLOTS, Slot, slot_of};
