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
