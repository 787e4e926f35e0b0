//! The cache's figures for the metrics sampler and the write-behind report:
//! what it holds, what is unwritten, what was evicted unwritten.

use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::{Cache, ShardGauges, ShardStats};

impl Cache {
    /// When the oldest change the store does not hold was made (`None`:
    /// the store holds everything), for the journal's trimmer.
    pub fn oldest_unwritten(&self) -> Option<Instant> {
        let users =
            (0..self.shards.len()).filter_map(|index| self.lock(index).gauges().oldest_unwritten);
        users.chain(self.channels.oldest_unwritten()).min()
    }

    /// Read states (and tombstones) held in memory over all shards.
    pub fn stats_read_states(&self) -> usize {
        self.stats().0.read_states
    }

    /// Read states evicted before the store took them, over all shards.
    pub fn evicted_unwritten(&self) -> usize {
        self.evicted_total.load(Ordering::Relaxed)
    }

    /// How many [`Cache::evicted_unwritten`] may reach before changes are
    /// refused (`max_evicted_unwritten`).
    pub fn evicted_unwritten_limit(&self) -> usize {
        self.config.max_evicted_unwritten
    }

    /// Unwritten read states (a pending "delete all" counts as one) over
    /// all shards.
    pub fn unwritten(&self) -> usize {
        (0..self.shards.len())
            .map(|index| self.lock(index).unwritten())
            .sum()
    }

    /// Users with a write-behind write under way, over all shards.
    pub fn writes_in_flight(&self) -> usize {
        (0..self.shards.len())
            .map(|index| self.lock(index).in_flight())
            .sum()
    }

    /// A snapshot of every shard's gauges and counters, summed.
    pub(crate) fn stats(&self) -> (ShardGauges, ShardStats) {
        let mut gauges = ShardGauges::default();
        let mut stats = ShardStats::default();
        for index in 0..self.shards.len() {
            let mut shard = self.lock(index);
            let g = shard.gauges();
            gauges.users += g.users;
            gauges.watched += g.watched;
            gauges.read_states += g.read_states;
            gauges.unwritten += g.unwritten;
            gauges.oldest_unwritten = gauges
                .oldest_unwritten
                .into_iter()
                .chain(g.oldest_unwritten)
                .min();
            stats.hits += shard.stats.hits;
            stats.misses += shard.stats.misses;
            stats.evictions += shard.stats.evictions;
            stats.evictions_unwritten += shard.stats.evictions_unwritten;
        }
        (gauges, stats)
    }
}
