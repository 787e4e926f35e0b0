//! readstates: for every user and every channel, how far the user has read and
//! how many unread messages and @mentions wait there, served over gRPC.
//!
//! # Layout
//! - [`config`], [`telemetry`], [`shutdown`]: process plumbing.
//! - [`app`]: wires the parts together and runs them; `main.rs` only calls it
//!   ([`ring_command`] for `readstates ring`).
//! - [`read_state`]: the domain, its rules and per-user versions;
//!   [`channel_state`]: a channel counted by channel (`docs/counting.md`),
//!   held by a node and written behind in [`channel_states`].
//! - [`cache`]: sharded LRU of users, loading on miss; only the users of
//!   slots this node serves ([`ownership`]).
//! - [`write_behind`]: writes changed users to the store after a delay;
//!   [`journal`]: a local log of every change, synced before it is
//!   answered, replayed at start, so a crash loses nothing acknowledged.
//! - [`watch`]: live change streams, fed by the cache shards.
//! - [`store`]: the [`store::Store`] trait and its implementations.
//! - [`cluster`]: a fleet of nodes: the ring (where it is kept, how it
//!   changes), and the handoff of slots between nodes, which drives the
//!   cache.
//! - [`grpc`]: the tonic service, one file per RPC; [`error`] maps failures to
//!   gRPC statuses; [`proto`] is the generated code.
//! - [`metrics`]: metric names, the Prometheus recorder and `/metrics`;
//!   [`timing`]: where one request's time went, for the slow ones.
//! - [`tls`]: TLS and mTLS for the gRPC port and between nodes, with
//!   certificates reloaded when their files change.
//! - `test_support` (feature `test-support`): request builders for tests;
//!   the conformance suite and the fault-injecting store sit in [`store`].
//!
//! # Data flow
//! gRPC handler → validated domain call → cache shard (applied under its
//! lock, user queued) → write-behind → store. Nothing flows back except a
//! user loaded on a miss. On a node of a fleet, the handler first routes:
//! a user served elsewhere goes to its owner ([`grpc::route`]). No module
//! imports one that imports it back (`scripts/check-imports.py`, in CI).

#![forbid(unsafe_code)]

pub mod app;
pub mod cache;
pub mod channel_state;
pub mod channel_states;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod error;
pub mod grpc;
pub mod journal;
pub mod metrics;
pub mod ownership;
pub mod proto;
pub mod read_state;
pub mod recent_deletions;
pub mod ring_command;
pub mod shutdown;
pub mod store;
pub mod telemetry;
#[cfg(feature = "test-support")]
pub mod test_support;
pub mod timing;
pub mod tls;
pub mod watch;
pub mod write_behind;
