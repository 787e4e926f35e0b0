//! The fleet: many nodes behind the gateways, each serving the users of the
//! slots the ring gives it (see `readstates_routing`).
//!
//! - [`ring_store`]: where the ring is kept (Cassandra in production),
//!   changed only by compare-and-set on its epoch.
//! - [`admin`]: `readstates ring ...`, one change at a time.
//! - [`ownership`]: the state of every slot on this node, checked by every
//!   change under the cache's change gate.
//! - [`member`]: follows the ring; releases lost slots, then acquires
//!   gained ones from their previous owners ([`peers`]).

pub mod admin;
pub mod handoff;
pub mod member;
pub mod ownership;
pub mod peers;
pub mod ring_store;

pub use ring_store::{RingRecord, RingStore};
