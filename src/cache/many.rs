//! A change of many users at once (a message to a channel's members), all
//! or nothing. Its phases, in [`Cache::change_many`] top to bottom: pin the
//! held users and load and pin the others ([`Cache::pin_all`]), enter the
//! gate and check every user is still served here, apply the change to each
//! under its shard's lock without an `.await` (unpinning it there), then
//! write through if asked and wait for the journal. The shard offers each
//! step (`pin`, `pin_loading`, `unpin`); [`super::pins::Pins`] gives back
//! what a dropped request pinned. Reading many users ([`Cache::read_many`])
//! needs no pins and comes last.

use std::sync::Arc;

use futures::StreamExt;

use super::pins::Pins;
use super::{Cache, Shard, Stored};
use crate::clock;
use crate::error::Error;
use crate::journal::record;
use crate::read_state::{UserReadStates, UserView};
use crate::recent_deletions::Deletion;
use crate::store::UserWrite;
use crate::timing::{self, Phase};

/// How many uncached users one request loads at once.
const LOADS_PER_REQUEST: usize = 64;

impl Cache {
    /// Runs `f` for each of `user_ids` (with its index; results in order),
    /// all or nothing: every user is loaded and pinned first, so a failed
    /// load or a dropped request changes nothing, and the changes are then
    /// applied without an `.await`, so once the first user is changed the
    /// last one is too.
    pub async fn update_many<R>(
        self: &Arc<Self>,
        user_ids: &[u64],
        f: impl FnMut(usize, &mut UserReadStates<Stored<'_>>, u64) -> R,
    ) -> Result<Vec<R>, Error> {
        let ((), results) = self.update_many_after(user_ids, |_| Ok(()), f).await?;
        Ok(results)
    }

    /// [`Cache::update_many`], with a change to a channel's state (`first`,
    /// given the clock) made before the users' in the same step: once every
    /// user is loaded and pinned, inside the gate, so that it is made only
    /// with the users' changes, and refused with them at shutdown. No
    /// channel is switched from `first` until the users are changed, so
    /// what `first` finds decides how they are; an error from it refuses
    /// the whole change.
    pub async fn update_many_after<T, R>(
        self: &Arc<Self>,
        user_ids: &[u64],
        first: impl FnOnce(u64) -> Result<T, Error>,
        mut f: impl FnMut(usize, &mut UserReadStates<Stored<'_>>, u64) -> R,
    ) -> Result<(T, Vec<R>), Error> {
        self.change_many(user_ids, first, |shard, index, user_id, now_us| {
            self.apply_change(shard, user_id, |user| f(index, user, now_us))
        })
        .await
    }

    /// [`Cache::update_many_after`] for a deleted message, which lowers each
    /// user at most once: `f` runs only for users not lowered for `deletion`
    /// within the window (false for the others), and one it returns true
    /// for is remembered as lowered, in the same step.
    pub async fn update_many_once<T>(
        self: &Arc<Self>,
        user_ids: &[u64],
        deletion: Deletion,
        first: impl FnOnce(u64) -> Result<T, Error>,
        mut f: impl FnMut(usize, &mut UserReadStates<Stored<'_>>, u64) -> bool,
    ) -> Result<(T, Vec<bool>), Error> {
        self.change_many(user_ids, first, |shard, index, user_id, now_us| {
            if shard.deletions.lowered(user_id, deletion) {
                return Some((false, None));
            }
            let mut applied = self.apply_change(shard, user_id, |user| f(index, user, now_us));
            if let Some((true, write)) = &mut applied {
                shard.deletions.remember(user_id, deletion);
                if let Some(journal) = self.journal.get() {
                    let lowered = shard.deletions.of_user(user_id, clock::now_micros() / 1000);
                    journal.append(|out| record::append_lowered(out, user_id, &lowered));
                }
                // Written with the lowering it remembers (write-through).
                if let Some(write) = write {
                    write.lowered = shard.deletions.of_user(user_id, clock::now_micros() / 1000);
                }
            }
            applied
        })
        .await
    }

    /// The all-or-nothing frame of [`Cache::update_many_after`]: `first`
    /// runs once every user is pinned and served, then `change` for each
    /// pinned user under its shard's lock, with its index and the request's
    /// clock, all without an `.await`.
    pub(super) async fn change_many<T, R>(
        self: &Arc<Self>,
        user_ids: &[u64],
        first: impl FnOnce(u64) -> Result<T, Error>,
        mut change: impl FnMut(&mut Shard, usize, u64, u64) -> Option<(R, Option<UserWrite>)>,
    ) -> Result<(T, Vec<R>), Error> {
        self.check_unwritten()?;
        let pins = self.pin_all(user_ids).await?;
        let entry = self.gate.enter()?;
        // Inside the gate, a release of these users' slots either waits for
        // this request or is seen here, before anything is applied. A pinned
        // user is held unless such a release let go of it (and the slot
        // came back since, in a new generation).
        for &user_id in user_ids {
            self.served(user_id)?;
        }
        if !pins.all_kept()
            && let Some(&user_id) = user_ids.first()
        {
            return Err(Error::NotServed {
                user_id,
                state: self.ownership.state_of(user_id),
            });
        }
        // One clock read for the whole request: each user's version still
        // rises strictly (max(previous + 1, now)).
        let now_us = clock::now_micros();
        let switches = self.channels.hold_switches();
        // One journal frame for the whole change: a crash keeps all of it
        // or none, as a cut request does.
        let group = self.journal.get().map(|journal| journal.group());
        let first = first(now_us)?;
        let mut results = Vec::with_capacity(user_ids.len());
        let mut writes = Vec::new();
        for (index, &user_id) in user_ids.iter().enumerate() {
            // Each user is let go under the lock that changes it: one lock
            // per user here, as before pins.
            let applied = self.with_shard(self.shard_of(user_id), |shard| {
                let applied = change(shard, index, user_id, now_us);
                shard.unpin(user_id, None);
                applied
            });
            match applied {
                Some((result, write)) => {
                    results.push(result);
                    writes.extend(write);
                }
                // Cannot happen: a pinned user is never evicted, and was
                // held when the gate was entered.
                None => tracing::error!(user_id, "a pinned user was not held; skipped"),
            }
        }
        drop(group);
        drop(switches);
        drop(entry);
        pins.let_go();
        self.write_through(writes).await?;
        self.confirmed().await?;
        Ok((first, results))
    }

    /// Loads every uncached user among `user_ids` (several at a time) and
    /// pins them all until the returned [`Pins`] is dropped.
    pub(super) async fn pin_all(self: &Arc<Self>, user_ids: &[u64]) -> Result<Pins, Error> {
        let pins = Pins::new(self.clone(), user_ids.len());
        let mut missing = Vec::new();
        let mut held = Vec::with_capacity(user_ids.len());
        for &user_id in user_ids {
            let found = self.with_shard(self.shard_of(user_id), |shard| {
                let found = shard.pin(user_id);
                shard.count_lookup(found);
                found
            });
            if found {
                held.push(user_id);
            } else {
                missing.push(user_id);
            }
        }
        pins.add_held(&held);
        // The usual case, without building the machinery for concurrent loads.
        if missing.is_empty() {
            return Ok(pins);
        }
        {
            let mut loads = futures::stream::iter(missing)
                .map(|user_id| self.pin_loaded(user_id, &pins))
                .buffer_unordered(LOADS_PER_REQUEST);
            while let Some(result) = loads.next().await {
                result?;
            }
        }
        Ok(pins)
    }

    /// Pins `user_id`, loading it if needed; the pin is recorded in `pins`
    /// before any `.await`, so a dropped request gives it back.
    pub(super) async fn pin_loaded(
        self: &Arc<Self>,
        user_id: u64,
        pins: &Pins,
    ) -> Result<(), Error> {
        let index = self.shard_of(user_id);
        loop {
            self.served(user_id)?;
            let found = self.with_shard(index, |shard| {
                if shard.pin(user_id) {
                    return None;
                }
                Some(match shard.pin_loading(user_id) {
                    Some(load) => load,
                    None => self.start_load(shard, index, user_id, 1),
                })
            });
            let Some(mut load) = found else {
                pins.add(user_id, None);
                return Ok(());
            };
            pins.add(user_id, Some(load.clone()));
            let loaded = timing::measure(Phase::Load, load.wait_for(Option::is_some));
            let outcome = loaded.await.map(|r| r.clone());
            match outcome {
                Ok(Some(Ok(()))) => return Ok(()),
                Ok(Some(Err(failure))) => {
                    pins.forget(user_id, &load);
                    return Err(self.load_error(user_id, failure));
                }
                // The loader is gone without an answer: give the pin back
                // and try again.
                _ => {
                    self.with_shard(index, |shard| shard.unpin(user_id, Some(&load)));
                    pins.forget(user_id, &load);
                }
            }
        }
    }

    /// Reads each of `user_ids`, results in order. Reads need no
    /// all-or-nothing, so cached users are read at once and only the
    /// misses are loaded (several at a time) and read after.
    pub async fn read_many<R>(
        self: &Arc<Self>,
        user_ids: &[u64],
        mut f: impl FnMut(&UserView) -> R,
    ) -> Result<Vec<R>, Error> {
        for &user_id in user_ids {
            self.served(user_id)?;
        }
        let mut results: Vec<Option<R>> = user_ids
            .iter()
            .map(|&id| {
                self.with_shard(self.shard_of(id), |shard| {
                    let result = shard.read(id, &mut f);
                    shard.count_lookup(result.is_some());
                    result
                })
            })
            .collect();
        let missing: Vec<u64> = user_ids
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_none())
            .map(|(&id, _)| id)
            .collect();
        if !missing.is_empty() {
            let mut loads = futures::stream::iter(missing)
                .map(|id| self.with_user(id, false, move |shard| shard.read(id, |_| ())))
                .buffer_unordered(LOADS_PER_REQUEST);
            while let Some(result) = loads.next().await {
                result?;
            }
            for (slot, &user_id) in results.iter_mut().zip(user_ids) {
                if slot.is_none() {
                    *slot = Some(
                        self.with_user(user_id, false, |shard| shard.read(user_id, &mut f))
                            .await?,
                    );
                }
            }
        }
        Ok(results.into_iter().flatten().collect())
    }
}
