//! The fleet: many nodes behind the gateways, each serving the users of the
//! slots the ring gives it (see `readstates_routing`).
//!
//! - [`ring_store`]: where the ring is kept (Cassandra in production),
//!   changed only by compare-and-set on its epoch.
//! - [`admin`]: changes to the ring, one at a time.
//! - [`presence`]: a node joins, drains and rejoins the ring by itself.
//! - [`member`]: follows the ring; releases lost slots, handing their users
//!   over ([`handoff`]), then acquires gained ones from their previous
//!   owners ([`peers`]). It drives the cache and the slots' states
//!   ([`crate::ownership`]), which sit below it.
//! - [`lease`]: a node serves only while it holds a lease it renews; one
//!   frozen or cut off stops serving before anyone may take its slots.
//! - [`backup`]: each node's unwritten changes held by the next node, which
//!   takes over should the node die.
//! - [`credential`]: how the nodes prove to each other that they are.
//! - [`copier`]: a channel counted by channel's owner sends its state to
//!   every node.

pub mod admin;
pub mod backup;
pub mod copier;
pub mod credential;
pub mod handoff;
pub mod lease;
pub mod member;
pub mod peers;
pub mod presence;
pub mod ring_store;

pub use ring_store::{RingRecord, RingStore};
