//! Users replayed from the journal (see `docs/journal.md`) and not loaded:
//! each waits beside the cache as the one write that holds all its
//! journaled changes. Write-behind writes it as it is (a user evicted with
//! unwritten changes is written the same way, at once); a request for the
//! user loads it from the store and lays the write over it first
//! ([`crate::store::StoredUser::into_user_with`]).

use tokio::time::Instant;

use super::Shard;
use crate::store::UserWrite;

impl Shard {
    /// Takes in a replayed user's write, queued for a write now; `since`
    /// is when the replay ran (its changes are older).
    pub(crate) fn add_replayed(&mut self, write: UserWrite, since: Instant) {
        let user_id = write.user_id;
        self.adjust_unwritten(rows(&write) as isize);
        if let Some(old) = self.replayed.insert(user_id, write) {
            self.adjust_unwritten(-(rows(&old) as isize));
        }
        self.replayed_since.get_or_insert(since);
        self.replayed_ready.push_back(user_id);
        self.wake = true;
    }

    fn take_replayed(&mut self, user_id: u64) -> Option<UserWrite> {
        let write = self.replayed.remove(&user_id)?;
        self.adjust_unwritten(-(rows(&write) as isize));
        Some(write)
    }

    /// A replayed user's write, taken by a load that starts: laid over
    /// what the load reads (from then on the user's own unwritten changes
    /// carry it), or given back by [`Shard::end_replayed_load`] if the load
    /// caches nothing. It counts as unwritten meanwhile, so that neither
    /// a shutdown's drain nor a handoff takes it for written.
    pub(crate) fn take_replayed_for_load(&mut self, user_id: u64) -> Option<UserWrite> {
        let write = self.replayed.remove(&user_id)?;
        self.replayed_loading.insert(user_id, write.clone());
        Some(write)
    }

    /// A load that took `replayed` ended, having cached the user (whose
    /// record now counts what is unwritten) or not.
    pub(crate) fn end_replayed_load(&mut self, replayed: Option<UserWrite>, cached: bool) {
        let Some(write) = replayed else {
            return;
        };
        let user_id = write.user_id;
        self.replayed_loading.remove(&user_id);
        if cached {
            self.adjust_unwritten(-(rows(&write) as isize));
        } else {
            self.replayed.insert(user_id, write);
            self.replayed_ready.push_back(user_id);
            self.wake = true;
        }
    }

    /// Whether write-behind should write replayed user `user_id` now.
    pub(super) fn replayed_due(&self, user_id: u64) -> bool {
        self.replayed.contains_key(&user_id) && !self.in_flight.contains_key(&user_id)
    }

    /// [`Shard::begin_write`] of a user held only as a replayed write.
    pub(super) fn begin_replayed_write(&mut self, user_id: u64, retry: bool) -> Option<UserWrite> {
        let Some(write) = self.replayed.get(&user_id) else {
            // Taken by a load since the last try, which lays it over the
            // user and queues it: this write ends.
            if retry {
                self.in_flight.remove(&user_id);
            }
            return None;
        };
        if self.in_flight.contains_key(&user_id) != retry {
            return None;
        }
        let write = write.clone();
        let now = self.ticks(Instant::now());
        self.in_flight.insert(user_id, now);
        Some(write)
    }

    /// [`Shard::finish_write`] of a user held only as a replayed write: a
    /// write that succeeded drops it.
    pub(super) fn finish_replayed_write(&mut self, user_id: u64, version: Option<u64>) {
        let written =
            version.is_some_and(|v| self.replayed.get(&user_id).is_some_and(|w| w.version <= v));
        if written {
            self.take_replayed(user_id);
        }
    }

    /// Drops every replayed write not taken by a load: a takeover wrote
    /// what they hold (see [`crate::cache::Cache::drop_replayed`]). Returns
    /// how many.
    pub(crate) fn drop_replayed(&mut self) -> usize {
        let ids: Vec<u64> = self.replayed.keys().copied().collect();
        for &user_id in &ids {
            self.take_replayed(user_id);
        }
        ids.len()
    }

    /// Queues those of `ids` replayed and not being written for a write now.
    pub(crate) fn expedite_replayed(&mut self, ids: &[u64]) {
        for &user_id in ids {
            if self.replayed_due(user_id) {
                self.replayed_ready.push_back(user_id);
                self.wake = true;
            }
        }
    }

    /// Replayed writes not made yet, beside the cache or with a load.
    pub(super) fn replayed_writes(&self) -> impl Iterator<Item = &UserWrite> + '_ {
        (self.replayed.values()).chain(self.replayed_loading.values())
    }

    /// Replayed users not written yet and beside the cache, for the final
    /// drain.
    pub(crate) fn replayed_users(&self) -> impl Iterator<Item = u64> + '_ {
        self.replayed.keys().copied()
    }

    /// Replayed users not written yet, beside the cache or with a load
    /// (which may give them back), for releases.
    pub(crate) fn replayed_pending(&self) -> impl Iterator<Item = u64> + '_ {
        (self.replayed.keys())
            .chain(self.replayed_loading.keys())
            .copied()
    }

    /// When the oldest replayed change may have been made, while any is
    /// left beside the cache (or with a load).
    pub(super) fn replayed_pending_since(&self) -> Option<Instant> {
        let pending = !self.replayed.is_empty() || !self.replayed_loading.is_empty();
        self.replayed_since.filter(|_| pending)
    }
}

/// What a replayed write counts as unwritten (as a user counts: each row,
/// and a "delete all").
fn rows(write: &UserWrite) -> usize {
    write.read_states.len() + usize::from(write.clear_below.is_some())
}
