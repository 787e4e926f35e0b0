//! Durability against a real Cassandra, started by `scripts/cassandra.sh`
//! (the README's test command, `scripts/test.sh`, does that). These tests fail,
//! loudly, when no Cassandra answers: they never pass without one.
//!
//! Each test starts the real `readstates` binary (so that it can be sent
//! SIGTERM and its metrics are its own) and uses user ids of its own, so tests
//! run side by side in one keyspace. The outage test stops Cassandra, so it
//! runs one of its own on another port.

mod channel_counting;
mod coalescing;
mod durability;
mod eviction;
mod fleet;
mod helpers;
mod outage;
mod proxy;
mod restart;
mod ring;
mod round_trip;
mod store;
mod upgrade;
