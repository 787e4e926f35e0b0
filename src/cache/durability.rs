//! How a change becomes durable before it is answered: the journal it is
//! recorded in, the replay of that journal after a crash, and the
//! confirmations a request (or a batch of them) waits for.

use std::sync::Arc;

use tokio::time::Instant;

use super::Cache;
use super::shard::Shard;
use crate::clock;
use crate::error::Error;
use crate::journal::{Journal, Replayed};
use crate::timing::{self, Phase};

tokio::task_local! {
    /// Set on a task whose changes are confirmed later, together (see
    /// [`Cache::confirming_later`]).
    static CONFIRMED_LATER: ();
}

impl Cache {
    /// Journals every later change, users' and channels', before it is
    /// answered; set once, before serving.
    pub fn set_journal(&self, journal: Arc<Journal>) {
        self.channels.set_journal(journal.clone());
        let _ = self.journal.set(journal);
    }

    /// Takes in what the journal held at start, before serving: replayed
    /// users wait beside the cache to be written (or laid over the user
    /// when it is loaded), channels replace older ones held.
    pub fn replay(&self, replayed: Replayed) {
        let since = Instant::now();
        for (_, write) in replayed.users {
            self.with_shard(self.shard_of(write.user_id), |shard| {
                shard.add_replayed(write, since);
            });
        }
        self.channels.replay(replayed.channels);
    }

    /// Drops the users replayed at start and not written yet, without
    /// writing them: this node was taken over, and its takeover wrote every
    /// change it answered (what else the journal held was never answered).
    /// Written, they would only lose to the newer versions in the store.
    /// Returns how many.
    pub fn drop_replayed(&self) -> usize {
        (0..self.shards.len())
            .map(|index| self.with_shard(index, Shard::drop_replayed))
            .sum()
    }

    /// Journals again every change the store may lack, users' and
    /// channels' (a fleet node's new backup attaches: see
    /// `crate::cluster::backup`); returns how many users and channels.
    pub fn rejournal(&self) -> usize {
        let Some(journal) = self.journal.get() else {
            return 0;
        };
        let now_ms = clock::now_micros() / 1000;
        let users: usize = (0..self.shards.len())
            .map(|index| self.with_shard(index, |shard| shard.rejournal(journal, now_ms)))
            .sum();
        users + self.channels.rejournal()
    }

    /// Runs `serving` with the changes it applies confirmed later, many at
    /// once, by [`Cache::confirm`] (an `Apply` stream, before it sends a
    /// response): one journal wait for a response's items, not one each.
    pub async fn confirming_later<F: Future>(serving: F) -> F::Output {
        CONFIRMED_LATER.scope((), serving).await
    }

    /// Whether every change applied so far may be answered OK: durable in
    /// the journal, and applied under a lease that still holds.
    pub async fn confirm(&self) -> Result<(), Error> {
        self.journaled().await?;
        self.still_leased()
    }

    /// [`Cache::confirm`], unless the caller confirms later.
    pub async fn confirmed(&self) -> Result<(), Error> {
        if CONFIRMED_LATER.try_with(|_| ()).is_ok() {
            return Ok(());
        }
        self.confirm().await
    }

    /// Waits until every change applied so far (the caller's among them) is
    /// durable in the journal, if there is one: not the users a handoff
    /// under way installed (see [`Cache::handed_in_journaled`]), which are
    /// neither served nor changed here until it completes.
    pub async fn journaled(&self) -> Result<(), Error> {
        let Some(journal) = self.journal.get() else {
            return Ok(());
        };
        let durable = journal.durable(journal.appended());
        (timing::measure(Phase::Durable, durable).await).map_err(|e| Error::JournalFailed {
            reason: e.to_string(),
        })
    }

    /// [`Cache::journaled`], and every user a handoff installed so far too
    /// (journaled as bulk, see [`Journal::append_bulk`]): what a handoff
    /// waits for before it completes.
    pub async fn handed_in_journaled(&self) -> Result<(), Error> {
        let Some(journal) = self.journal.get() else {
            return Ok(());
        };
        let end = journal.bulk_end().await;
        (journal.durable(end).await).map_err(|e| Error::JournalFailed {
            reason: e.to_string(),
        })
    }
}
