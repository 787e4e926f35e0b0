//! The channels counted by channel that this node holds, and their
//! write-behind.
//!
//! Every such channel is held (they are few: only channels the backend
//! switched, about 8 KiB each), all loaded at start. A change runs under one
//! lock and never across an `.await`; a reader (a user's counts, under the
//! user's shard lock) takes it shared, never twice on one thread (a second
//! read would wait behind a waiting writer), and a writer never takes a
//! shard lock while holding it, so the two cannot deadlock. Switches are
//! kept apart from the changes that decide how a message is counted by a
//! lock of their own ([`ChannelStates::hold_switches`]).
//!
//! Write-behind as for users: a changed channel is written `write_delay`
//! after its first unwritten change, so a busy channel's messages coalesce
//! into one write per window. A write stores a snapshot and marks exactly
//! that version written; a change made meanwhile is written in the next
//! window. A failed write is retried with backoff and the change stays
//! unwritten until it succeeds. [`ChannelStates::flush`] (at shutdown)
//! writes everything still unwritten.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::channel_state::{ChannelMap, ChannelState};
use crate::journal::{Journal, record};
use crate::read_state::Channels;
use crate::read_state::Key;
use crate::store::{Store, StoreError};

/// The first retry of a failed write waits this long, doubling up to
/// [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What a node with no channel counted by channel reads, without a lock.
static NONE: LazyLock<ChannelMap> = LazyLock::new(ChannelMap::new);

#[derive(Debug)]
pub struct ChannelStates {
    store: Arc<dyn Store>,
    write_delay: Duration,
    held: RwLock<Held>,
    /// Some channel is counted by channel: until one is, a read takes no
    /// lock (every request reads, and few nodes ever hold one).
    any: AtomicBool,
    /// Wakes the writer when a channel has its first unwritten change.
    changed: Notify,
    /// Taken by a switch (write), and by every change of many users from
    /// its decision (counted per member or by channel) until its users are
    /// changed (read), so that no message decided per member is applied
    /// past a switch it did not see. Taken before `held` and before any
    /// shard lock, never while holding either, so the order switches →
    /// shard → held has no cycle.
    switches: RwLock<()>,
    /// A node of a fleet: changes are kept in `Held::changed` for the
    /// copier (a standalone node keeps none).
    copied: AtomicBool,
    /// Where each change is journaled (see [`crate::journal`]), if set.
    journal: OnceLock<Arc<Journal>>,
}

#[derive(Debug, Default)]
struct Held {
    channels: ChannelMap,
    unwritten: HashMap<u64, Unwritten>,
    /// Channels whose members' counts moved since Watch streams were last
    /// told (see [`crate::cache::recount`]).
    recounted: HashSet<u64>,
    /// On a node of a fleet, channels changed here since the copier last
    /// sent them to the other nodes (see [`ChannelStates::take_changed`]).
    changed: HashSet<u64>,
}

/// A channel with changes the store does not hold yet.
#[derive(Clone, Copy, Debug)]
struct Unwritten {
    /// When its oldest unwritten change was made (or, after a write that
    /// missed changes made meanwhile, when that write's snapshot was
    /// taken), for the journal's trimmer.
    since: Instant,
    /// When the next write of it is due.
    due: Instant,
    /// Writes of it that failed in a row, for the backoff.
    failures: u32,
}

/// A switch that was not applied: the channel is counted by channel
/// already, from another message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwitchedAlready {
    pub counted_from: u64,
}

impl ChannelStates {
    /// None yet: [`Self::load_stored`] loads what `store` holds.
    pub fn new(store: Arc<dyn Store>, write_delay: Duration) -> Arc<ChannelStates> {
        Arc::new(ChannelStates {
            store,
            write_delay,
            held: RwLock::default(),
            any: AtomicBool::new(false),
            changed: Notify::new(),
            switches: RwLock::default(),
            copied: AtomicBool::new(false),
            journal: OnceLock::new(),
        })
    }

    /// Loads every channel counted by channel from `store`.
    pub async fn load(
        store: Arc<dyn Store>,
        write_delay: Duration,
    ) -> Result<Arc<ChannelStates>, StoreError> {
        let channels = ChannelStates::new(store, write_delay);
        channels.load_stored().await?;
        Ok(channels)
    }

    /// Takes in what the store holds: a stored channel replaces the one
    /// held only if it is newer.
    pub async fn load_stored(&self) -> Result<usize, StoreError> {
        let stored = self.store.load_channels().await?;
        let count = stored.len();
        let mut held = self.held_mut();
        for channel in stored {
            let id = channel.channel_id();
            if held
                .channels
                .get(&id)
                .is_none_or(|c| c.version() < channel.version())
            {
                held.channels.insert(id, channel);
            }
        }
        self.any.store(!held.channels.is_empty(), Ordering::Release);
        Ok(count)
    }

    /// Runs `read` over every channel counted by channel.
    pub fn read<R>(&self, read: impl FnOnce(&ChannelMap) -> R) -> R {
        if !self.any.load(Ordering::Acquire) {
            return read(&NONE);
        }
        read(&self.held().channels)
    }

    /// Where the read states of `key` are counted by channel from, if they
    /// are (see [`ChannelState::counted_from`]).
    pub fn counted_from(&self, key: Key) -> Option<u64> {
        self.read(|channels| channels.get_key(key).map(ChannelState::counted_from))
    }

    /// Channels counted by channel.
    pub fn len(&self) -> usize {
        self.held().channels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Switches `channel_id` to counting by channel from `counted_from`.
    /// Returns whether it changed anything: a retry of the same switch does
    /// not; a switch from another message is refused.
    pub fn switch(
        &self,
        channel_id: u64,
        counted_from: u64,
        now_us: u64,
    ) -> Result<bool, SwitchedAlready> {
        // Waits for the changes deciding without this switch.
        let _switches = self.switches.write().unwrap_or_else(|p| p.into_inner());
        let mut held = self.held_mut();
        if let Some(channel) = held.channels.get(&channel_id) {
            return match channel.counted_from() {
                from if from == counted_from => Ok(false),
                from => Err(SwitchedAlready { counted_from: from }),
            };
        }
        let channel = ChannelState::switched(channel_id, counted_from, now_us);
        held.channels.insert(channel_id, channel);
        self.any.store(true, Ordering::Release);
        self.mark_unwritten(&mut held, channel_id);
        self.mark_changed(&mut held, channel_id);
        Ok(true)
    }

    /// Runs `change` on `channel_id`'s state, if the channel is counted by
    /// channel; a change that raised its version is written behind.
    pub fn update<R>(
        &self,
        channel_id: u64,
        change: impl FnOnce(&mut ChannelState) -> R,
    ) -> Option<R> {
        let mut held = self.held_mut();
        let channel = held.channels.get_mut(&channel_id)?;
        let before = channel.version();
        let result = change(channel);
        if channel.version() != before {
            self.mark_unwritten(&mut held, channel_id);
            self.mark_changed(&mut held, channel_id);
            held.recounted.insert(channel_id);
        }
        Some(result)
    }

    /// `channel_id`'s state as it is now.
    pub fn get(&self, channel_id: u64) -> Option<ChannelState> {
        self.read(|channels| channels.get(&channel_id).cloned())
    }

    /// The channels `these` names, as they are now.
    pub fn all_of(&self, these: impl Fn(u64) -> bool) -> Vec<ChannelState> {
        self.read(|channels| {
            (channels.values())
                .filter(|c| these(c.channel_id()))
                .cloned()
                .collect()
        })
    }

    /// From now on, keeps the channels changed here for
    /// [`ChannelStates::take_changed`] (a node of a fleet).
    pub fn keep_changed(&self) {
        self.copied.store(true, Ordering::Release);
    }

    /// The channels changed here since the last call, as they are now.
    pub fn take_changed(&self) -> Vec<ChannelState> {
        let mut held = self.held_mut();
        let changed: Vec<u64> = held.changed.drain().collect();
        (changed.iter())
            .filter_map(|id| held.channels.get(id).cloned())
            .collect()
    }

    /// Takes in copies of channels made by their owner: a copy replaces the
    /// channel held only if it is newer, so a copy lost, late or repeated
    /// does no harm; a channel `owned` here (this node serves its slot, and
    /// alone changes it) is never replaced. Members' counts move with a
    /// copy taken, for Watch streams. Returns how many were taken.
    pub fn copy_in(&self, copies: Vec<ChannelState>, owned: impl Fn(u64) -> bool) -> usize {
        let mut held = self.held_mut();
        let mut taken = 0;
        for copy in copies {
            let id = copy.channel_id();
            let newer = (held.channels.get(&id)).is_none_or(|c| c.version() < copy.version());
            if newer && !owned(id) {
                held.channels.insert(id, copy);
                held.recounted.insert(id);
                taken += 1;
            }
        }
        if taken > 0 {
            self.any.store(true, Ordering::Release);
        }
        taken
    }

    /// Once this node no longer serves the slots of the channels `leaving`
    /// names (every change that saw them served is done): writes those it
    /// has not written, retrying until the store takes them, and stops
    /// writing them (only a channel's owner writes it; it keeps a copy).
    /// Returns how many it wrote.
    pub async fn release(&self, leaving: impl Fn(u64) -> bool) -> usize {
        let mut retry = RETRY_MIN;
        let mut written = 0;
        loop {
            let taken = Instant::now();
            let unwritten: Vec<ChannelState> = {
                let held = self.held();
                (held.unwritten.keys())
                    .filter(|&&id| leaving(id))
                    .filter_map(|id| held.channels.get(id).cloned())
                    .collect()
            };
            if unwritten.is_empty() {
                return written;
            }
            for channel in unwritten {
                written += usize::from(self.write(channel, taken).await.is_ok());
            }
            if self.held().unwritten.keys().any(|&id| leaving(id)) {
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(RETRY_MAX);
            }
        }
    }

    /// Before this node serves the slots of the channels `acquiring` names:
    /// takes in what the store holds (their previous owner wrote them
    /// before it let go; a copy held here may lag or be missing), keeping a
    /// copy held here if it is newer (a change a previous owner released
    /// by force had not written). Each of them then gets a new version,
    /// written behind and sent to the other nodes, so that it replaces any
    /// copy they hold, older or not. Returns how many were loaded.
    pub async fn acquire(
        &self,
        acquiring: impl Fn(u64) -> bool,
        now_us: u64,
    ) -> Result<usize, StoreError> {
        let stored = self.store.load_channels().await?;
        let count = stored.len();
        let mut held = self.held_mut();
        for channel in stored {
            let id = channel.channel_id();
            if (held.channels.get(&id)).is_none_or(|c| c.version() < channel.version()) {
                held.channels.insert(id, channel);
                held.recounted.insert(id);
            }
        }
        let acquired: Vec<u64> = (held.channels.keys().copied())
            .filter(|&id| acquiring(id))
            .collect();
        for id in acquired {
            if let Some(channel) = held.channels.get_mut(&id) {
                channel.claim(now_us);
            }
            self.mark_unwritten(&mut held, id);
            self.mark_changed(&mut held, id);
        }
        self.any.store(!held.channels.is_empty(), Ordering::Release);
        Ok(count)
    }

    /// The channels whose members' counts moved since the last call.
    pub fn take_recounted(&self) -> Vec<u64> {
        if !self.any.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut held = self.held_mut();
        if held.recounted.is_empty() {
            return Vec::new();
        }
        held.recounted.drain().collect()
    }

    /// Holds off switches while a change decides how a message is counted
    /// and applies it (see [`ChannelStates::switch`]).
    pub fn hold_switches(&self) -> RwLockReadGuard<'_, ()> {
        self.switches.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Channels with changes the store does not hold yet.
    pub fn unwritten(&self) -> usize {
        self.held().unwritten.len()
    }

    /// Writes channels as they fall due until `stop`.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        loop {
            let next = self.held().unwritten.values().map(|u| u.due).min();
            let wait = async {
                match next {
                    Some(due) => tokio::time::sleep_until(due).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.changed.notified() => continue,
                () = wait => {}
            }
            let now = Instant::now();
            let due: Vec<ChannelState> = {
                let held = self.held();
                (held.unwritten.iter())
                    .filter(|(_, u)| u.due <= now)
                    .filter_map(|(id, _)| held.channels.get(id).cloned())
                    .collect()
            };
            for channel in due {
                let _ = self.write(channel, now).await;
            }
        }
    }

    /// Writes every unwritten channel, retrying failed writes until none is
    /// left or `timeout` passes. Returns how many are left unwritten.
    pub async fn flush(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut retry = RETRY_MIN;
        loop {
            let taken = Instant::now();
            let unwritten: Vec<ChannelState> = {
                let held = self.held();
                (held.unwritten.keys())
                    .filter_map(|id| held.channels.get(id).cloned())
                    .collect()
            };
            if unwritten.is_empty() {
                return 0;
            }
            let mut failed = false;
            for channel in unwritten {
                failed |= self.write(channel, taken).await.is_err();
            }
            if failed {
                if Instant::now() + retry > deadline {
                    return self.unwritten();
                }
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(RETRY_MAX);
            }
        }
    }

    /// Write-through (a write delay of zero): writes `channel_id`, if it has
    /// unwritten changes, before a request that may have changed it answers
    /// (a retry too: what its first try changed may still be unwritten). A
    /// failed write leaves the change applied and unwritten, for the writer
    /// to retry.
    pub async fn write_through(&self, channel_id: u64) -> Result<(), StoreError> {
        if !self.write_delay.is_zero() {
            return Ok(());
        }
        let taken = Instant::now();
        let snapshot = {
            let held = self.held();
            (held.unwritten.contains_key(&channel_id))
                .then(|| held.channels.get(&channel_id).cloned())
                .flatten()
        };
        match snapshot {
            Some(snapshot) => self.write(snapshot, taken).await,
            None => Ok(()),
        }
    }

    /// Writes `channel_id` now, whatever the write delay (a switch on a
    /// fleet is answered only once written).
    pub async fn write_now(&self, channel_id: u64) -> Result<(), StoreError> {
        let taken = Instant::now();
        match self.get(channel_id) {
            Some(snapshot) => self.write(snapshot, taken).await,
            None => Ok(()),
        }
    }

    /// Writes one snapshot, `taken` at or before it was, and marks what it
    /// held written.
    async fn write(&self, snapshot: ChannelState, taken: Instant) -> Result<(), StoreError> {
        let result = self.store.write_channel(&snapshot).await;
        let id = snapshot.channel_id();
        let mut held = self.held_mut();
        let now = Instant::now();
        let current = held.channels.get(&id).map_or(0, ChannelState::version);
        let Some(unwritten) = held.unwritten.get_mut(&id) else {
            return result;
        };
        match &result {
            Ok(()) if current == snapshot.version() => {
                held.unwritten.remove(&id);
            }
            Ok(()) => {
                // Changed while being written: the rest in the next window.
                *unwritten = Unwritten {
                    since: taken,
                    due: now + self.write_delay,
                    failures: 0,
                };
            }
            Err(e) => {
                unwritten.failures += 1;
                let backoff = RETRY_MIN * 2u32.saturating_pow(unwritten.failures - 1);
                unwritten.due = now + backoff.min(RETRY_MAX);
                tracing::warn!(channel_id = id, error = %e, "channel write failed; retrying");
            }
        }
        result
    }

    /// A change made here: journaled, and written behind.
    fn mark_unwritten(&self, held: &mut Held, channel_id: u64) {
        if let (Some(journal), Some(channel)) = (self.journal.get(), held.channels.get(&channel_id))
        {
            journal.append(|out| record::append_channel(out, channel));
        }
        if held.unwritten.contains_key(&channel_id) {
            return;
        }
        let now = Instant::now();
        let unwritten = Unwritten {
            since: now,
            due: now + self.write_delay,
            failures: 0,
        };
        held.unwritten.insert(channel_id, unwritten);
        self.changed.notify_one();
    }

    /// Journals every later change (see [`crate::cache::Cache::set_journal`]).
    pub fn set_journal(&self, journal: Arc<Journal>) {
        let _ = self.journal.set(journal);
    }

    /// Journals again every channel with changes the store lacks (see
    /// [`crate::cache::Cache::rejournal`]); returns how many.
    pub fn rejournal(&self) -> usize {
        let Some(journal) = self.journal.get() else {
            return 0;
        };
        let held = self.held();
        for id in held.unwritten.keys() {
            if let Some(channel) = held.channels.get(id) {
                journal.append(|out| record::append_channel(out, channel));
            }
        }
        held.unwritten.len()
    }

    /// Takes in the channels a journal held at start: each replaces the one
    /// held if newer, and is written behind at once.
    pub fn replay(&self, channels: Vec<ChannelState>) {
        let mut held = self.held_mut();
        let now = Instant::now();
        for channel in channels {
            let id = channel.channel_id();
            if (held.channels.get(&id)).is_some_and(|c| c.version() >= channel.version()) {
                continue;
            }
            held.channels.insert(id, channel);
            let unwritten = Unwritten {
                since: now,
                due: now,
                failures: 0,
            };
            held.unwritten.insert(id, unwritten);
        }
        self.any.store(!held.channels.is_empty(), Ordering::Release);
        self.changed.notify_one();
    }

    /// When the oldest change the store does not hold was made.
    pub fn oldest_unwritten(&self) -> Option<Instant> {
        self.held().unwritten.values().map(|u| u.since).min()
    }

    fn mark_changed(&self, held: &mut Held, channel_id: u64) {
        if self.copied.load(Ordering::Acquire) {
            held.changed.insert(channel_id);
        }
    }

    fn held(&self) -> RwLockReadGuard<'_, Held> {
        // A panic elsewhere while holding the lock leaves plain data behind.
        self.held.read().unwrap_or_else(|p| p.into_inner())
    }

    fn held_mut(&self) -> RwLockWriteGuard<'_, Held> {
        self.held.write().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests;
