//! A shard's write-behind bookkeeping: the queue of users due to be
//! written (by the shard's millisecond clock), the write a writer takes
//! (a snapshot at a version) and settles (written up to that version, or
//! failed and queued again), and the count of unwritten read states.

use std::cmp::Reverse;
use std::sync::atomic::Ordering;

use tokio::time::{Duration, Instant};

use super::{Delayed, Due, Shard, weight};
use crate::cache::users::Flags;
use crate::store::UserWrite;

impl Shard {
    /// Pops the next user due for a write at `now`, skipping stale entries.
    pub(crate) fn next_due(&mut self, now: Instant) -> Due {
        loop {
            if let Some(user_id) = self.replayed_ready.pop_front() {
                if self.replayed_due(user_id) {
                    return Due::User(user_id);
                }
                continue;
            }
            let handed = self.handed.peek().map(|&Reverse((due, _))| due);
            let user_id = if let Some(user_id) = self.ready.pop_front() {
                user_id
            } else if handed.is_some_and(|due| due <= now) {
                let Some(Reverse((_, user_id))) = self.handed.pop() else {
                    unreachable!("peeked");
                };
                user_id
            } else {
                match self.delayed.front().copied() {
                    Some(Delayed { due_ms, slot }) => {
                        let wait = due_ms.wrapping_sub(self.millis(now)) as i32;
                        if wait > 0 {
                            let due = now + Duration::from_millis(wait as u64);
                            return Due::Wait(Some(handed.map_or(due, |h| h.min(due))));
                        }
                        let user_id = self.users.get(slot).user_id;
                        self.pop_delayed();
                        user_id
                    }
                    None => return Due::Wait(handed),
                }
            };
            if let Some(slot) = self.users.find(user_id) {
                let user = self.users.get_mut(slot);
                user.flags.set(Flags::QUEUED, false);
                if user.has_unwritten() && !user.is(Flags::IN_FLIGHT) {
                    return Due::User(user_id);
                }
            } else if self.replayed_due(user_id) {
                return Due::User(user_id);
            }
        }
    }

    /// Drops the entries at the front of the delay queue whose user has
    /// nothing left to write (written on eviction, or by write-through), so
    /// that the front is the oldest unwritten change.
    pub(super) fn drop_stale_delayed(&mut self) {
        while let Some(&Delayed { slot, .. }) = self.delayed.front() {
            if let Some(slot) = self.users.find(self.users.get(slot).user_id) {
                let user = self.users.get_mut(slot);
                if user.has_unwritten() || user.is(Flags::IN_FLIGHT) {
                    return;
                }
                user.flags.set(Flags::QUEUED, false);
            }
            self.pop_delayed();
        }
    }

    /// Lets go of the front entry of `delayed`: positions no entry can name
    /// any more may be reused.
    fn pop_delayed(&mut self) {
        self.delayed.pop_front();
        self.delayed_popped += 1;
        self.users.cooled(self.delayed_popped);
    }

    /// Every unwritten user not already being written, for the final drain.
    pub(crate) fn unwritten_users(&self) -> Vec<u64> {
        (self.users.iter())
            .filter(|u| u.has_unwritten() && !u.is(Flags::IN_FLIGHT))
            .map(|u| u.user_id)
            .chain(
                self.replayed_users()
                    .filter(|id| !self.in_flight.contains_key(id)),
            )
            .collect()
    }

    /// Starts (or, with `retry`, continues) a write of `user_id`: marks it in
    /// flight and returns what to write, or `None` if there is nothing to
    /// write or another write of it is under way.
    pub(crate) fn begin_write(
        &mut self,
        user_id: u64,
        retry: bool,
        now_us: u64,
    ) -> Option<UserWrite> {
        let Some(slot) = self.users.find(user_id) else {
            return self.begin_replayed_write(user_id, retry);
        };
        let user = self.users.get(slot);
        // A replayed write left beside a user handed in since (its slot
        // came back before the write was made) is written first, as it is
        // (newest version wins in the store). Found by the failover
        // simulation: it was never written, and a shutdown's drain spun.
        if !user.is(Flags::IN_FLIGHT) && self.replayed.contains_key(&user_id) {
            return self.begin_replayed_write(user_id, retry);
        }
        if user.is(Flags::IN_FLIGHT) != retry {
            if retry {
                // The retry of a replayed write beside the user, dropped
                // meanwhile (`drop_replayed`): that write ends here, and the
                // user's own entry may have been spent while it backed off.
                self.in_flight.remove(&user_id);
                self.queue_now(user_id);
            }
            return None;
        }
        if !user.has_unwritten() {
            // Written meanwhile (write-through) while this write waited to
            // retry: it ends here, and must let go of the user.
            if retry {
                self.finish_write(user_id, None, now_us);
            }
            return None;
        }
        self.users.get_mut(slot).flags.set(Flags::IN_FLIGHT, true);
        let mut write = UserWrite::of(user_id, self.view(slot));
        // With the lowerings its changes may hold (see `RecentDeletions`).
        write.lowered = self.deletions.of_user(user_id, now_us / 1000);
        let began = self.ticks(Instant::now());
        self.in_flight.insert(user_id, began);
        Some(write)
    }

    /// A write of `user_id` up to `version` succeeded (`Some`) or was given up
    /// (`None`). Clears what it wrote and queues what changed meanwhile.
    pub(crate) fn finish_write(&mut self, user_id: u64, version: Option<u64>, now_us: u64) {
        let began = self.in_flight.remove(&user_id);
        let Some(slot) = self.users.find(user_id) else {
            self.finish_replayed_write(user_id, version);
            return;
        };
        if !self.users.get(slot).is(Flags::IN_FLIGHT) {
            // The replayed write beside it (see `begin_write`). The user's
            // own changes are queued next: their queue entry may have come
            // due, and been spent, while this write was under way.
            self.finish_replayed_write(user_id, version);
            self.settle(user_id, None, now_us, began);
            if version.is_some() {
                self.queue_now(user_id);
            }
            return;
        }
        self.users.get_mut(slot).flags.set(Flags::IN_FLIGHT, false);
        self.settle(user_id, version, now_us, began);
    }

    /// Queues `user_id` for a write now if it has changes that no queue
    /// entry or write under way will take.
    fn queue_now(&mut self, user_id: u64) {
        let Some(slot) = self.users.find(user_id) else {
            return;
        };
        let user = self.users.get_mut(slot);
        if user.has_unwritten() && !user.is(Flags::QUEUED) && !user.is(Flags::IN_FLIGHT) {
            user.flags.set(Flags::QUEUED, true);
            self.ready.push_back(user_id);
            self.wake = true;
        }
    }

    /// A request's own write of `user_id` up to `version` succeeded
    /// (write-through). What changed meanwhile has its own writes under way,
    /// so nothing is queued.
    pub(crate) fn finish_write_through(&mut self, user_id: u64, version: u64, now_us: u64) {
        self.settle(user_id, Some(version), now_us, None);
    }

    /// Clears what a write up to `version` wrote (if it succeeded), keeps the
    /// counters in step, lets an evicted user go once it is clean and, for
    /// a write-behind write that `began` (ticks), queues what is still
    /// unwritten.
    pub(super) fn settle(
        &mut self,
        user_id: u64,
        version: Option<u64>,
        now_us: u64,
        began: Option<u16>,
    ) {
        let requeue = began.is_some();
        let Some(slot) = self.users.find(user_id) else {
            return;
        };
        let evicted = self.users.get(slot).is(Flags::EVICTED);
        let (len, new_len, unwritten_change) = self.with_states(slot, |states| {
            let len = weight(states);
            if let Some(version) = version {
                states.mark_written(version);
                // An evicted user keeps its weight until it leaves.
                if !evicted {
                    states.prune_tombstones(now_us);
                }
            }
            (len, weight(states), states.unwritten_change())
        });
        let still_unwritten = self.users.get(slot).has_unwritten();
        // What is left was changed after the write began (its snapshot):
        // not earlier, which the journal's trimmer relies on.
        let now_s = (still_unwritten && version.is_some())
            .then(|| began.unwrap_or_else(|| self.ticks(Instant::now())));
        let user = self.users.get_mut(slot);
        // An evicted user stays while a write-behind write of it is under
        // way (also one backing off): that write still has to find it.
        let in_flight = user.is(Flags::IN_FLIGHT);
        if !still_unwritten {
            user.flags.set(Flags::UNWRITTEN_SINCE, false);
        } else if let Some(now_s) = now_s {
            user.since = now_s;
            user.flags.set(Flags::UNWRITTEN_SINCE, true);
        }
        let requeue = requeue && still_unwritten && !user.is(Flags::QUEUED) && version.is_some();
        if requeue {
            user.flags.set(Flags::QUEUED, true);
        }
        self.adjust_unwritten(unwritten_change);
        if evicted {
            if !still_unwritten && !in_flight {
                self.evicted.remove(&user_id);
                self.evicted_total.fetch_sub(len, Ordering::Relaxed);
                self.forget(slot);
            }
        } else {
            self.read_states = self.read_states + new_len - len;
        }
        if requeue {
            self.ready.push_back(user_id);
            self.wake = true;
        }
    }

    /// When the oldest change the store does not hold was made, never
    /// later than it was (the journal's trimmer deletes what is older).
    /// Every user is looked at, not the queues' heads: a user on its way
    /// to a write (waiting for a permit) is in no queue, and one whose
    /// write left changes behind is queued later than they were made.
    pub(super) fn oldest_unwritten(&self) -> Option<Instant> {
        let now = Instant::now();
        let oldest = (self.users.iter())
            .filter(|user| user.is(Flags::UNWRITTEN_SINCE))
            .map(|user| self.age(user.since, now))
            .max()
            .and_then(|age| now.checked_sub(age));
        oldest
            .into_iter()
            .chain(self.replayed_pending_since())
            .min()
    }

    /// Unwritten read states in this shard.
    pub(crate) fn unwritten(&self) -> usize {
        self.unwritten
    }

    /// Users with a write under way.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether the writer must be woken for what was queued since last asked.
    pub(crate) fn take_wake(&mut self) -> bool {
        std::mem::take(&mut self.wake)
    }

    pub(super) fn adjust_unwritten(&mut self, change: isize) {
        debug_assert!(
            self.unwritten as isize + change >= 0,
            "unwritten miscounted"
        );
        self.unwritten = self.unwritten.saturating_add_signed(change);
    }
}
