//! Watch events for counts that move without a change of their user: a
//! message to (or deleted from) a channel counted by channel changes every
//! member's unread count, and no member's read state.
//!
//! A message only marks its channel (see
//! [`crate::channel_states::ChannelStates::take_recounted`]); every
//! [`RECOUNT_EVERY`] this task takes the channels marked since and sends each
//! watched member of them one `recounted` event with their counts then. So a
//! watched member gets at most four such events a second, whatever the
//! message rate, and a message costs no event per member. A tick with marks
//! looks once at each watched member of the marked channels (each shard
//! indexes its watched users by channel: `shard/watched_members.rs`),
//! loading those the cache evicted; a tick without costs nothing.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::cache::Cache;

/// How often members are told their counts moved.
pub const RECOUNT_EVERY: Duration = Duration::from_millis(250);

/// Sends the `recounted` events of `cache`'s channels every `every`, until
/// `stop`.
pub async fn run(cache: Arc<Cache>, every: Duration, stop: CancellationToken) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        // A node past its lease tells nobody counts from what it holds
        // (another node may serve its users now); they wait for the lease.
        if !cache.ownership().leased() {
            continue;
        }
        let changed = cache.channels().take_recounted();
        if !changed.is_empty() {
            // Loads of evicted users may wait on the store: not shutdown.
            tokio::select! {
                () = stop.cancelled() => return,
                () = cache.recount(&changed) => {}
            }
        }
    }
}
