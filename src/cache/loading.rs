//! Loading a user the cache does not hold: one load per user, shared by
//! every request that waits for it meanwhile, read from the store outside
//! the shard's lock and inserted under it.

use std::sync::Arc;

use tokio::sync::watch;

use super::{Cache, LoadFailure, Loading, Shard, shard};
use crate::clock;
use crate::error::Error;
use crate::timing::{self, Phase};

impl Cache {
    /// Brings a user into the cache (a subscribe about to need it), if
    /// this node serves it; counts no lookup.
    pub async fn load(self: &Arc<Self>, user_id: u64) -> Result<(), Error> {
        self.with_user(user_id, false, |shard| shard.read(user_id, |_| ()))
            .await
    }

    pub(super) fn load_error(&self, user_id: u64, failure: LoadFailure) -> Error {
        match failure {
            LoadFailure::Store(reason) => Error::LoadFailed { user_id, reason },
            LoadFailure::NotServed => Error::NotServed {
                user_id,
                state: self.ownership.state_of(user_id),
            },
        }
    }

    /// Runs `attempt` under the user's shard lock until it finds the user
    /// held, loading the user from the store in between. With `count`, the
    /// first attempt counts as the request's cache hit or miss.
    pub(super) async fn with_user<R>(
        self: &Arc<Self>,
        user_id: u64,
        count: bool,
        mut attempt: impl FnMut(&mut Shard) -> Option<R>,
    ) -> Result<R, Error> {
        let index = self.shard_of(user_id);
        let mut first = count;
        loop {
            self.served(user_id)?;
            let found = self.with_shard(index, |shard| {
                let result = attempt(shard);
                if std::mem::take(&mut first) {
                    shard.count_lookup(result.is_some());
                }
                match result {
                    Some(result) => Ok(result),
                    None => Err(match shard.loading.get(&user_id) {
                        Some(loading) => loading.done.clone(),
                        None => self.start_load(shard, index, user_id, 0),
                    }),
                }
            });
            let mut load = match found {
                Ok(result) => return Ok(result),
                Err(load) => load,
            };
            // An error from `wait_for` means the loader is gone: try again.
            // A load discarded because the slot moved: the check says where.
            let loaded = timing::measure(Phase::Load, load.wait_for(Option::is_some)).await;
            if let Ok(result) = loaded
                && let Some(Err(LoadFailure::Store(reason))) = &*result
            {
                return Err(Error::LoadFailed {
                    user_id,
                    reason: reason.clone(),
                });
            }
        }
    }

    /// Spawns the load of `user_id` (a task, so that a cancelled request
    /// cannot strand the requests waiting on it) and registers it with
    /// `pins` pins already handed to it.
    pub(super) fn start_load(
        self: &Arc<Self>,
        shard: &mut Shard,
        index: usize,
        user_id: u64,
        pins: u32,
    ) -> watch::Receiver<shard::LoadResult> {
        let (done, load) = watch::channel(None);
        let ticket = self.ownership.ticket(user_id);
        shard.loading.insert(
            user_id,
            Loading {
                done: load.clone(),
                pins,
            },
        );
        // A replayed user's journaled changes go with the load, whatever
        // its write of them does meanwhile: the store may be read before
        // that write lands.
        let replayed = shard.take_replayed_for_load(user_id);
        let cache = self.clone();
        tokio::spawn(async move {
            let result = cache.store.load(user_id).await;
            cache.with_shard(index, |shard| {
                let pins = shard.loading.remove(&user_id).map_or(0, |l| l.pins);
                let shared = match result {
                    // Kept only if the slot was served all along: see
                    // `crate::ownership`.
                    Ok(_) if !cache.ownership.keeps(ticket) => Err(LoadFailure::NotServed),
                    Ok(mut stored) => {
                        let now_us = clock::now_micros();
                        let lowered = std::mem::take(&mut stored.lowered);
                        shard.deletions.restore(user_id, &lowered, now_us / 1000);
                        let user = match replayed.clone() {
                            Some(mut replayed) => {
                                let lowered = std::mem::take(&mut replayed.lowered);
                                shard.deletions.restore(user_id, &lowered, now_us / 1000);
                                stored.into_user_with(replayed, now_us)
                            }
                            None => stored.into_user(now_us),
                        };
                        shard.insert_loaded(user_id, user, pins);
                        Ok(())
                    }
                    Err(e) => {
                        tracing::warn!(user_id, error = %e, "load failed");
                        Err(LoadFailure::Store(e.to_string()))
                    }
                };
                shard.end_replayed_load(replayed, shared.is_ok());
                // Under the lock: a pin holder that finds the load gone
                // from `loading` finds its result here (see `Shard::unpin`).
                // Nobody waiting is fine.
                let _ = done.send(Some(shared));
            });
        });
        load
    }

    /// Asks the CPU to fetch these users' records and read states before
    /// they are changed one by one (a hint, see [`Shard::prefetch`]): a
    /// batch's misses overlap instead of each change waiting for its own.
    /// A shard another thread holds is passed over rather than waited for.
    pub fn prefetch(&self, user_ids: &mut [u64]) {
        user_ids.sort_unstable_by_key(|&user_id| self.shard_of(user_id));
        for users in user_ids.chunk_by(|a, b| self.shard_of(*a) == self.shard_of(*b)) {
            if let Ok(shard) = self.shards[self.shard_of(users[0])].try_lock() {
                for &user_id in users {
                    shard.prefetch(user_id);
                }
            }
        }
    }
}
