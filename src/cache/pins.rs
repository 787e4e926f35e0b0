//! The users a multi-user change holds from their loads to its apply, so
//! that none is evicted in between (by the change's own loads or anyone
//! else's) and the apply never has to load again: it runs without an
//! `.await`, so once it starts it finishes, whatever the client does.
//!
//! A release (a fleet node giving up a slot) drops pinned users too. Each
//! pin remembers the slot's generation when it was taken, so a pin on a
//! copy that was dropped is never given back to a copy loaded later.

use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::Cache;
use super::shard::LoadResult;
use crate::ownership::LoadTicket;

type Pin = (u64, Option<watch::Receiver<LoadResult>>, LoadTicket);

/// Pins taken by one request, given back on drop (also when the request is
/// dropped half-way through its loads).
#[derive(Debug)]
pub(crate) struct Pins {
    cache: Arc<Cache>,
    /// Each pinned user, with the load it waits for when its pin was handed
    /// to a load under way (`Shard::pin_loading`), and its slot's
    /// generation when it was pinned.
    held: Mutex<Vec<Pin>>,
}

impl Pins {
    pub(crate) fn new(cache: Arc<Cache>, capacity: usize) -> Pins {
        Pins {
            cache,
            held: Mutex::new(Vec::with_capacity(capacity)),
        }
    }

    /// Records a pin just taken (with no `.await` since the user was found
    /// served, so the generation is the pinned copy's).
    pub(crate) fn add(&self, user_id: u64, load: Option<watch::Receiver<LoadResult>>) {
        let ticket = self.cache.ownership().ticket(user_id);
        self.lock().push((user_id, load, ticket));
    }

    /// Records pins just taken of cached users, as [`Pins::add`] does
    /// each, under one lock.
    pub(crate) fn add_held(&self, user_ids: &[u64]) {
        let ownership = self.cache.ownership();
        let pins = user_ids
            .iter()
            .map(|&user_id| (user_id, None, ownership.ticket(user_id)));
        self.lock().extend(pins);
    }

    /// Whether every pinned copy is still the one cached: no release let go
    /// of it since it was pinned.
    pub(crate) fn all_kept(&self) -> bool {
        let ownership = self.cache.ownership();
        self.lock()
            .iter()
            .all(|&(_, _, ticket)| ownership.keeps(ticket))
    }

    /// Forgets every pin: the caller gave each back itself (every load
    /// succeeded, so each is held by its user).
    pub(crate) fn let_go(self) {
        self.lock().clear();
    }

    /// Forgets the pin handed to `load`, which failed: it went nowhere.
    pub(crate) fn forget(&self, user_id: u64, load: &watch::Receiver<LoadResult>) {
        self.lock().retain(|(id, l, _)| {
            !(*id == user_id && l.as_ref().is_some_and(|l| l.same_channel(load)))
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Pin>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let held = std::mem::take(&mut *self.lock());
        let ownership = self.cache.ownership();
        for (user_id, load, ticket) in held {
            let index = self.cache.shard_of(user_id);
            self.cache.with_shard(index, |shard| {
                // Under the shard lock: a release lets go under it too.
                if ownership.keeps(ticket) {
                    shard.unpin(user_id, load.as_ref());
                }
            });
        }
    }
}
