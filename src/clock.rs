//! Wall-clock microseconds, the raw material of user versions.
//!
//! A version is `max(previous + 1, now_µs)` (see [`crate::read_state`]): it
//! rises on every change even if the clock stalls or steps back, and it stays
//! close to real time, so it can serve as a store write timestamp and a
//! version from before a restart is still below every version after it.

use std::time::{SystemTime, UNIX_EPOCH};

pub fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// How far ahead of this node's clock a version another node sends may be:
/// the clock skew a fleet tolerates. Versions stay near real time, so one
/// beyond it was never issued by a node, and taking it would put a user or
/// a channel above every real change for good.
pub const MAX_AHEAD: std::time::Duration = std::time::Duration::from_secs(60);

/// Whether `version`, from another node, can have been issued by now.
pub fn issued_by_now(version: u64) -> bool {
    version <= now_micros().saturating_add(MAX_AHEAD.as_micros() as u64)
}
