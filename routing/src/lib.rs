//! Where a readstates user lives, for the nodes of a fleet and the gateways
//! in front of them.
//!
//! # Layout
//! - [`slot`]: the fixed function from a user id to one of [`SLOTS`] slots;
//!   gateways in any language compute the same (see `routing/slots.csv`).
//! - [`ring`]: an epoch, the nodes with their weights, and the owner of every
//!   slot, assigned by weighted rendezvous hashing.

#![forbid(unsafe_code)]

pub mod ring;
pub mod slot;

pub use ring::{Node, Ring, RingError};
pub use slot::{SLOTS, Slot, slot_of};
