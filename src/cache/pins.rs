//! The users a multi-user change holds from their loads to its apply, so
//! that none is evicted in between (by the change's own loads or anyone
//! else's) and the apply never has to load again: it runs without an
//! `.await`, so once it starts it finishes, whatever the client does.

use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::Cache;
use super::shard::LoadResult;

/// Pins taken by one request, given back on drop (also when the request is
/// dropped half-way through its loads).
#[derive(Debug)]
pub(crate) struct Pins {
    cache: Arc<Cache>,
    /// Each pinned user, with the load it waits for when its pin was handed
    /// to a load under way (`Shard::pin_loading`).
    held: Mutex<Vec<(u64, Option<watch::Receiver<LoadResult>>)>>,
}

impl Pins {
    pub(crate) fn new(cache: Arc<Cache>, capacity: usize) -> Pins {
        Pins {
            cache,
            held: Mutex::new(Vec::with_capacity(capacity)),
        }
    }

    pub(crate) fn add(&self, user_id: u64, load: Option<watch::Receiver<LoadResult>>) {
        self.lock().push((user_id, load));
    }

    /// Forgets every pin: the caller gave each back itself (every load
    /// succeeded, so each is held by its user).
    pub(crate) fn let_go(self) {
        self.lock().clear();
    }

    /// Forgets the pin handed to `load`, which failed: it went nowhere.
    pub(crate) fn forget(&self, user_id: u64, load: &watch::Receiver<LoadResult>) {
        self.lock().retain(|(id, l)| {
            !(*id == user_id && l.as_ref().is_some_and(|l| l.same_channel(load)))
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Option<watch::Receiver<LoadResult>>)>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let held = std::mem::take(&mut *self.lock());
        for (user_id, load) in held {
            let index = self.cache.shard_of(user_id);
            self.cache
                .with_shard(index, |shard| shard.unpin(user_id, load.as_ref()));
        }
    }
}
