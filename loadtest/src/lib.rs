//! loadtest: measures readstates against the transport ceiling (a no-work
//! server speaking the same protocol), write-through, and Redis.
//!
//! # Layout
//! - [`workload`]: the workload as data (TOML); [`keys`] draws users
//!   (uniform or Zipf); [`op`] draws operations.
//! - [`schedule`]: open-loop due times; [`runner`] drives open and closed
//!   loops against a [`target`] and records into [`stats`] (HDR histograms).
//! - [`report`]: table and JSON; [`chart`]: SVG charts; [`sweep`]: rate steps.
//! - [`baseline`]: the no-work server.
//! - [`watchers`]: Watch streams held open during a run.
//! - [`crash`]: kill -9 of a server under load, checked against a ledger.
//! - [`failover`]: a fleet node killed or frozen under load, the ledger
//!   checked against Cassandra.

#![forbid(unsafe_code)]

pub mod baseline;
pub mod chart;
pub mod commands;
pub mod crash;
pub mod failover;
pub mod keys;
pub mod op;
pub mod report;
pub mod runner;
pub mod schedule;
pub mod stats;
pub mod sweep;
pub mod target;
pub mod watchers;
pub mod workload;
