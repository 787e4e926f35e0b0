//! Warm handoff: the users of slots moving to another node travel there
//! from memory, unwritten changes and all, instead of being written to the
//! store and loaded again cold (see [`crate::cluster::member`]).
//!
//! The sender exports the users of the slots it hands over chunk by chunk,
//! so neither end holds more than a chunk beyond its cache: first while it
//! still serves them (a copy ahead, then those that changed meanwhile, in a
//! few rounds), then, once it has stopped and nothing changes them any
//! more, those that changed since and those it no longer holds (`Gone`).
//! Only users whose versions differ from what was sent of them are read
//! out, so that the last part, while the slots are served nowhere, is
//! short. The receiver installs each user with the time its unwritten
//! changes were due to be written, and takes over their writing.
//! Only once the receiver has them all does the sender let go of them
//! without writing; if anything fails, the sender writes them as a release
//! does, and the receiver drops what it installed.

use std::collections::HashMap;

use futures::{Stream, StreamExt};
use tokio::time::Duration;

use super::Cache;
use crate::journal::record;
use crate::read_state::UserReadStates;
use crate::recent_deletions::Deletion;

/// Users sent in one chunk by default (`CacheConfig::handoff_chunk`): a few
/// hundred kilobytes of read states at most for typical users.
pub const CHUNK_USERS: usize = 256;

/// A user as its previous owner held it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandedUser {
    pub user_id: u64,
    pub states: UserReadStates,
    /// How long its oldest unwritten change has waited; `None` when it has
    /// none.
    pub unwritten_for: Option<Duration>,
}

impl HandedUser {
    /// What this copy is of: the user's version, and how much of it the
    /// store held.
    pub fn versions(&self) -> Versions {
        let header = self.states.view().header();
        (header.version, header.written_version)
    }
}

/// A user's version and written version: what a copy of it is of.
pub type Versions = (u64, u64);

/// What was sent of each user so far.
pub type Sent = HashMap<u64, Versions>;

/// A deleted message a handed-over user was lowered for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandedDeletion {
    pub user_id: u64,
    pub deletion: Deletion,
}

/// One part of a handoff.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Chunk {
    Users(Vec<HandedUser>),
    Deletions(Vec<HandedDeletion>),
    /// Users sent earlier that the sender no longer holds (written and
    /// evicted since): what was sent of them is stale.
    Gone(Vec<u64>),
}

impl Cache {
    /// The users `leaving` names, by shard (cached, evicted unwritten, or
    /// watched), once every change that may have seen their slots served
    /// is applied: the caller moved those slots out of `Serving`.
    pub async fn settled_users(&self, leaving: impl Fn(u64) -> bool) -> Vec<Vec<u64>> {
        self.gate.barrier().await;
        self.write_replayed(&leaving).await;
        self.users_leaving(&leaving)
    }

    /// Writes the users `leaving` names that a journal's replay holds
    /// beside the cache (see [`Cache::replay`]), retrying until the store
    /// takes them: they travel through the store, not in a handoff.
    pub(crate) async fn write_replayed(&self, leaving: &impl Fn(u64) -> bool) {
        let replayed = |cache: &Cache| -> Vec<Vec<u64>> {
            (0..cache.shard_count())
                .map(|index| {
                    cache.with_shard(index, |shard| {
                        shard.replayed_pending().filter(|&id| leaving(id)).collect()
                    })
                })
                .collect()
        };
        // Queued once: write-behind retries a failed write itself.
        for (index, ids) in replayed(self).iter().enumerate() {
            self.with_shard(index, |shard| shard.expedite_replayed(ids));
        }
        while replayed(self).iter().any(|ids| !ids.is_empty()) {
            tokio::time::sleep(RELEASE_POLL).await;
        }
    }

    /// Users sent in one chunk.
    pub fn handoff_chunk(&self) -> usize {
        self.config.handoff_chunk.max(1)
    }

    /// `users` (by shard, see [`Cache::settled_users`]) that changed since
    /// what was `sent` of them (all, the first time), as chunks, read from
    /// the shards as the stream is polled.
    pub fn export<'a>(
        &'a self,
        users: Vec<Vec<u64>>,
        sent: &'a Sent,
    ) -> impl Stream<Item = Chunk> + 'a {
        let chunk = self.handoff_chunk();
        let parts = users.into_iter().enumerate().flat_map(move |(index, ids)| {
            let chunks: Vec<Vec<u64>> = ids.chunks(chunk).map(<[u64]>::to_vec).collect();
            chunks.into_iter().map(move |ids| (index, ids))
        });
        futures::stream::iter(parts).filter_map(move |(index, ids)| {
            let users = self.with_shard(index, |shard| shard.export(&ids, sent));
            std::future::ready((!users.is_empty()).then_some(Chunk::Users(users)))
        })
    }

    /// Those of `ids` not held here (any more).
    pub fn not_held(&self, ids: impl IntoIterator<Item = u64>) -> Vec<u64> {
        ids.into_iter()
            .filter(|&id| !self.with_shard(self.shard_of(id), |shard| shard.holds(id)))
            .collect()
    }

    /// What the users `leaving` names were lowered for, cached or not (the
    /// memory outlives their eviction), in chunks.
    pub fn export_deletions(&self, leaving: impl Fn(u64) -> bool) -> Vec<Chunk> {
        let chunk = self.handoff_chunk() * 16;
        (0..self.shard_count())
            .flat_map(|index| {
                let deletions = self.with_shard(index, |shard| shard.export_deletions(&leaving));
                let chunks: Vec<Chunk> = deletions
                    .chunks(chunk)
                    .map(|part| Chunk::Deletions(part.to_vec()))
                    .collect();
                chunks
            })
            .collect()
    }

    /// Installs a chunk handed over by the previous owner of its users'
    /// slots (which this node must not serve yet); returns the users in it.
    pub fn install(&self, chunk: Chunk) -> usize {
        let write_delay = self.config.write_delay;
        match chunk {
            Chunk::Users(users) => {
                let count = users.len();
                for user in users {
                    self.with_shard(self.shard_of(user.user_id), |shard| {
                        // Its unwritten changes are this node's to keep now:
                        // journaled as bulk, behind the changes being
                        // answered (the handoff completes once they are
                        // durable, see `Cache::handed_in_journaled`), under
                        // the lock, so a re-journal for a new backup either
                        // finds the user installed or runs before this
                        // entry takes its place.
                        if let Some(journal) = self.journal.get()
                            && user.states.version() > user.states.written_version()
                        {
                            let states = &user.states;
                            let (since, view) = (states.written_version(), states.view());
                            journal.append_bulk(|out| {
                                record::append_user(out, user.user_id, since, view);
                            });
                        }
                        shard.install(user, write_delay);
                    });
                }
                count
            }
            Chunk::Deletions(deletions) => {
                for handed in deletions {
                    self.with_shard(self.shard_of(handed.user_id), |shard| {
                        shard.install_deletion(handed);
                    });
                }
                0
            }
            Chunk::Gone(ids) => {
                for user_id in ids {
                    self.with_shard(self.shard_of(user_id), |shard| {
                        shard.hand_off(&[user_id]);
                    });
                }
                0
            }
        }
    }

    /// Lets go of `users` (by shard) without writing them: another node
    /// holds them now. Their Watch streams are told they moved. Returns how
    /// many were held.
    pub fn hand_off(&self, users: &[Vec<u64>]) -> usize {
        users
            .iter()
            .enumerate()
            .map(|(index, ids)| self.with_shard(index, |shard| shard.hand_off(ids)))
            .sum()
    }

    /// Drops, unwritten, what a handoff that failed installed of the users
    /// `leaving` names (slots this node does not serve: their previous owner
    /// still holds them, and writes them).
    pub fn discard(&self, leaving: impl Fn(u64) -> bool) -> usize {
        self.hand_off(&self.users_leaving(&leaving))
    }
}

/// How often a release looks whether its users are all written.
const RELEASE_POLL: Duration = Duration::from_millis(5);

impl Cache {
    /// Per shard, its users (cached, evicted, watched) that `leaving` names,
    /// as they are now (changes may still be under way; see
    /// [`Cache::settled_users`]).
    pub fn users_leaving(&self, leaving: &impl Fn(u64) -> bool) -> Vec<Vec<u64>> {
        (0..self.shards.len())
            .map(|index| self.with_shard(index, |shard| shard.users_leaving(leaving)))
            .collect()
    }

    /// Queues each shard's `users` with unwritten changes for a write now.
    fn expedite(&self, users: &[Vec<u64>]) {
        for (index, ids) in users.iter().enumerate() {
            self.with_shard(index, |shard| shard.expedite(ids));
        }
    }

    /// How many of `users` are not written yet.
    fn unsettled(&self, users: &[Vec<u64>]) -> usize {
        users
            .iter()
            .enumerate()
            .map(|(index, ids)| self.with_shard(index, |shard| shard.unsettled(ids)))
            .sum()
    }

    /// Lets go of the users of slots no longer served (the caller moved
    /// them out of `Serving` already): waits for every change that may have
    /// seen them served, writes all their unwritten changes (retrying until
    /// the store takes them), then drops them from memory, clean ones too,
    /// and tells their Watch streams they moved. Returns the users let go.
    pub async fn release(&self, leaving: impl Fn(u64) -> bool) -> usize {
        let users = self.settled_users(leaving).await;
        // Queued for a write once: write-behind retries a failed write itself.
        self.expedite(&users);
        while self.unsettled(&users) > 0 {
            tokio::time::sleep(RELEASE_POLL).await;
        }
        for (index, ids) in users.iter().enumerate() {
            let kept = self.with_shard(index, |shard| shard.let_go(ids));
            // Cannot happen: nothing changes users of slots not served.
            if kept > 0 {
                tracing::error!(index, kept, "users changed while released; kept");
            }
        }
        users.iter().map(Vec::len).sum()
    }

    /// Lets go of the channels counted by channel of slots no longer served
    /// (as [`Cache::release`] for users): waits for every change that may
    /// have seen them served, then writes what is unwritten of them. Their
    /// copies stay. Returns the channels written.
    pub async fn release_channels(&self, leaving: impl Fn(u64) -> bool) -> usize {
        self.gate.barrier().await;
        self.channels.release(leaving).await
    }
}
