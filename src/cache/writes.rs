//! What the write-behind writer asks of the cache: the next user due in a
//! shard, a snapshot to write, and the settling of that write.

use std::sync::Arc;

use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;

use super::{Cache, Due};
use crate::clock;
use crate::store::UserWrite;

impl Cache {
    pub(crate) fn write_permits(&self) -> &Arc<Semaphore> {
        &self.write_permits
    }

    /// Write-behind: the next user of shard `index` due for a write.
    pub(crate) fn next_due(&self, index: usize, now: Instant) -> Due {
        self.with_shard(index, |shard| shard.next_due(now))
    }

    /// Write-behind: every user of shard `index` with unwritten changes and
    /// no write under way.
    pub(crate) fn unwritten_users(&self, index: usize) -> Vec<u64> {
        self.with_shard(index, |shard| shard.unwritten_users())
    }

    /// Write-behind: starts (or, with `retry`, continues) a write of
    /// `user_id`; see [`Shard::begin_write`].
    pub(crate) fn begin_write(&self, user_id: u64, retry: bool) -> Option<UserWrite> {
        self.with_shard(self.shard_of(user_id), |shard| {
            shard.begin_write(user_id, retry, clock::now_micros())
        })
    }

    /// Write-behind: a write of `user_id` up to `version` succeeded
    /// (`Some`) or was given up (`None`).
    pub(crate) fn finish_write(&self, user_id: u64, version: Option<u64>) {
        self.with_shard(self.shard_of(user_id), |shard| {
            shard.finish_write(user_id, version, clock::now_micros());
        });
    }

    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Snowflake ids carry a timestamp in the high bits and a counter in the
    /// low ones; a multiplicative hash spreads both over the shards.
    pub(crate) fn shard_of(&self, user_id: u64) -> usize {
        let mixed = user_id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((mixed >> 32) as usize) % self.shards.len()
    }

    pub(crate) fn waker(&self, index: usize) -> &Notify {
        &self.wakers[index]
    }
}
