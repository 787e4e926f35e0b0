//! End-to-end tests: the real server on port 0, called over gRPC.

mod ack;
mod apply;
mod bad_input;
mod bulk_ack;
mod channel_counting;
mod channel_fleet;
mod delete_read_states;
mod faults;
mod fleet;
mod get_badge_counts;
mod get_read_states;
mod handoff;
mod helpers;
mod journal;
mod message_created;
mod message_deleted;
mod operations;
mod peer_streams;
mod raw_h2;
mod redelivery;
mod restart;
mod set_muted;
mod threads;
mod tls;
mod trust;
mod watch;
