//! The domain: one user's read states and the rules that change them.
//!
//! Everything here is synchronous and pure (the caller passes the clock in), so
//! the rules are tested without a runtime: a normal ack only moves forward and
//! resets the counters, a manual ack rewinds, a new message counts only past
//! the read state's watermark (so a redelivered one counts once), a deleted
//! message uncounts only what it counted, and every applied change raises the
//! user's version.
//!
//! Write-behind bookkeeping lives here too, as versions: a read state is
//! unwritten when its version is above `written_version`, the version up to
//! which the store is known to hold this user. No per-entry flag is needed, and a write
//! that raced with newer changes leaves exactly those newer changes unwritten.

use std::time::Duration;

use crate::channel_state::ChannelState;
pub use channels::{Channels, NoChannels, Shown};
pub use entries::{Entries, Header, Owned, first_thread, thread_count};
pub use view::UserView;

/// What a read state tracks. `Channel` is almost everything; `Thread` is a
/// thread the user follows, which belongs to a parent channel (its id is kept
/// beside the read state, see [`Entries::parents`]); the others are
/// non-message badges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Kind {
    Channel = 0,
    GuildEvent = 1,
    NotificationCenter = 2,
    GuildHome = 3,
    GuildOnboardingQuestion = 4,
    MessageRequests = 5,
    /// Sorts last, so a user's thread read states are the last entries.
    Thread = 6,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::Channel,
        Kind::GuildEvent,
        Kind::NotificationCenter,
        Kind::GuildHome,
        Kind::GuildOnboardingQuestion,
        Kind::MessageRequests,
        Kind::Thread,
    ];

    /// The kind with this wire number, if there is one.
    pub fn from_u8(value: u8) -> Option<Kind> {
        Kind::ALL.get(usize::from(value)).copied()
    }
}

/// Identifies a read state within one user.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    pub kind: Kind,
    pub channel_id: u64,
}

impl Key {
    pub const fn channel(channel_id: u64) -> Key {
        Key {
            kind: Kind::Channel,
            channel_id,
        }
    }
}

/// The most a counter holds: counts saturate here (clients show "99+" long
/// before), which keeps a read state at 40 bytes with its watermark.
pub const MAX_COUNT: u16 = u16::MAX;

/// A count from the wire or a store, saturated to [`MAX_COUNT`].
pub fn saturated_count(count: u32) -> u16 {
    u16::try_from(count).unwrap_or(MAX_COUNT)
}

/// One read state, or the tombstone of a deleted one (kept so that deltas can
/// report the deletion). 40 bytes; field order keeps it so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadState {
    pub channel_id: u64,
    /// The last message the user has read; 0 if none.
    pub last_acked_id: u64,
    /// The watermark: the newest message that counted here or was acked. A
    /// message at or below it (or the last ack) never counts again.
    pub last_message_id: u64,
    /// The user's version when this read state last changed.
    pub version: u64,
    pub mention_count: u16,
    pub unread_count: u16,
    pub kind: Kind,
    pub deleted: bool,
    /// Unread messages do not make it an unread channel; mentions still do.
    pub muted: bool,
}

impl ReadState {
    /// A fresh read state: nothing read, nothing counted.
    pub const fn new(key: Key) -> ReadState {
        ReadState {
            channel_id: key.channel_id,
            last_acked_id: 0,
            last_message_id: 0,
            version: 0,
            mention_count: 0,
            unread_count: 0,
            kind: key.kind,
            deleted: false,
            muted: false,
        }
    }

    pub fn key(&self) -> Key {
        Key {
            kind: self.kind,
            channel_id: self.channel_id,
        }
    }

    /// Counts towards the unread-channel badge: a mention always does, unread
    /// messages only when not muted.
    pub fn is_unread(&self) -> bool {
        !self.deleted && (self.mention_count > 0 || (self.unread_count > 0 && !self.muted))
    }

    /// Messages up to here have been counted or read: the larger of the last
    /// ack and the watermark (rows stored before the watermark existed have
    /// only the ack).
    fn counted_up_to(&self) -> u64 {
        self.last_acked_id.max(self.last_message_id)
    }

    /// Whether reading up to `message_id` changes it: an ack that moves,
    /// or counts to clear ("mark all read" skips the rest).
    fn unread_up_to(&self, message_id: u64) -> bool {
        message_id > self.last_acked_id || self.mention_count > 0 || self.unread_count > 0
    }

    /// A normal ack to `message_id`: read up to it, nothing left to count.
    fn read_up_to(&mut self, message_id: u64) {
        self.last_acked_id = message_id;
        self.last_message_id = self.last_message_id.max(message_id);
        self.mention_count = 0;
        self.unread_count = 0;
    }
}

/// Tombstones older than this are dropped; a delta from before the oldest one
/// dropped is answered with the full set.
pub const TOMBSTONE_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// At most this many tombstones of channels (not threads) are kept per
/// user, for the same reason.
pub const MAX_TOMBSTONES_PER_USER: usize = 256;
/// At most this many tombstones of threads are kept per user, as many as a
/// user may follow: a thread's tombstone keeps its parent and how far it
/// was read (see [`threads`]), so it goes only with age, or, past these,
/// oldest first.
pub const MAX_THREAD_TOMBSTONES: usize = threads::MAX_THREADS;

/// The answer to "what changed since version N".
#[derive(Debug, PartialEq, Eq)]
pub struct Delta<'a> {
    /// False: `read_states` is the full set and replaces what the client holds.
    pub partial: bool,
    pub read_states: Vec<&'a ReadState>,
    pub deleted: Vec<Key>,
}

/// [`UserView::answer`]: a delta as a client sees it, with the totals.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    /// False: `read_states` is the full set and replaces what the client holds.
    pub partial: bool,
    /// Counted now in a channel counted by channel.
    pub read_states: Vec<Shown>,
    pub deleted: Vec<Key>,
    pub counts: Counts,
}

/// The badge numbers of one user: mentions in threads too, unread
/// channels without threads, and unread and mentioned threads (by parent:
/// [`UserView::thread_counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub total_mention_count: u64,
    pub unread_channel_count: u32,
    pub unread_thread_count: u32,
    pub mentioned_thread_count: u32,
}

impl Counts {
    /// The badge numbers of live read states with their whole unread
    /// counts (see [`Channels::shown`]).
    pub fn of(states: impl IntoIterator<Item = ReadState>) -> Counts {
        states.into_iter().fold(Counts::default(), |mut counts, e| {
            counts.total_mention_count += u64::from(e.mention_count);
            match e.kind {
                // An unread thread makes no channel unread (see `threads`).
                Kind::Thread => {
                    counts.unread_thread_count += u32::from(e.is_unread());
                    counts.mentioned_thread_count += u32::from(e.mention_count > 0);
                }
                _ => counts.unread_channel_count += u32::from(e.is_unread()),
            }
            counts
        })
    }
}

/// All read states of one user, sorted by key, with the user's version.
#[derive(Clone, Debug)]
pub struct UserReadStates<E = Owned> {
    /// Rises on every applied change: `max(previous + 1, now_µs)`.
    version: u64,
    /// The store holds every change up to this version.
    written_version: u64,
    /// A delta since a version below this cannot be exact.
    delta_floor: u64,
    /// A "delete all" is not written yet: the store must drop the user's
    /// rows older than it before the next write. Its version is
    /// `delta_floor`, which nothing raises until it is written (tombstones
    /// are pruned only up to `written_version`).
    clear_pending: bool,
    /// Entries with `version > written_version`, once counted: a user put
    /// together from its parts is counted only if asked (a change needs only
    /// `unwritten_change`, and counting would read every entry).
    unwritten: Option<u32>,
    /// How much [`Self::unwritten_count`] changed since the user was put
    /// together.
    unwritten_change: isize,
    /// Live read states and tombstones, sorted by key.
    entries: E,
}

/// Users are equal when they hold the same: how their unwritten changes
/// were counted does not matter.
impl<E: Entries> PartialEq for UserReadStates<E> {
    fn eq(&self, other: &Self) -> bool {
        self.view().header() == other.view().header()
            && *self.entries == *other.entries
            && self.entries.parents() == other.entries.parents()
    }
}

impl<E: Entries> Eq for UserReadStates<E> {}

impl Default for UserReadStates {
    /// A user with no read states, nothing written.
    fn default() -> Self {
        UserReadStates::from_stored(0, 0, Vec::new())
    }
}

impl UserReadStates {
    /// A user as the store holds it: everything in it is already written.
    /// Each read state comes with its parent id (0 but for a thread's); a
    /// thread read state without one is dropped (a row no build writes).
    pub fn from_stored(version: u64, delta_floor: u64, rows: Vec<(ReadState, u64)>) -> Self {
        let entries = Owned::from_rows(rows);
        let version = entries.iter().map(|e| e.version).fold(version, u64::max);
        UserReadStates {
            version,
            written_version: version,
            delta_floor,
            clear_pending: false,
            unwritten: Some(0),
            unwritten_change: 0,
            entries,
        }
    }
}

impl UserReadStates {
    /// A user put together from the store's rows and rows it lacks (a
    /// journal's replay): the store holds only what is at or below
    /// `written_version`, and a "delete all" at `delta_floor` too unless
    /// `clear_pending`.
    pub fn written_only_to(mut self, written_version: u64, clear_pending: bool) -> Self {
        self.written_version = written_version.min(self.version);
        self.clear_pending = clear_pending;
        self.unwritten = Some(self.unwritten_entries().count() as u32);
        self.unwritten_change = 0;
        self
    }
}

impl<E: Entries> UserReadStates<E> {
    /// Puts a user back together from what [`Self::into_parts`] gave.
    pub fn from_parts(header: Header, entries: E) -> Self {
        let written = header.written_version;
        UserReadStates {
            version: header.version,
            written_version: written,
            delta_floor: header.delta_floor,
            clear_pending: header.clear_pending,
            unwritten: None,
            unwritten_change: 0,
            entries,
        }
    }

    /// Takes a user apart into its versions and its entries (sorted by key).
    pub fn into_parts(self) -> (Header, E) {
        let header = Header {
            version: self.version,
            written_version: self.written_version,
            delta_floor: self.delta_floor,
            clear_pending: self.clear_pending,
        };
        (header, self.entries)
    }

    /// The user, read-only: every read goes through it.
    pub fn view(&self) -> UserView<'_> {
        UserView {
            header: Header {
                version: self.version,
                written_version: self.written_version,
                delta_floor: self.delta_floor,
                clear_pending: self.clear_pending,
            },
            entries: &self.entries,
            parents: self.entries.parents(),
        }
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn written_version(&self) -> u64 {
        self.written_version
    }

    pub fn delta_floor(&self) -> u64 {
        self.delta_floor
    }

    /// See [`UserView::len`].
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// See [`UserView::has_unwritten`].
    pub fn has_unwritten(&self) -> bool {
        self.version > self.written_version
    }

    /// Changes not yet written: entries (read states and tombstones), and a
    /// pending "delete all" as one more, so that a wipe waiting for the
    /// store counts as unwritten like any other change.
    pub fn unwritten_count(&self) -> usize {
        let entries = match self.unwritten {
            Some(count) => count as usize,
            None => self.unwritten_entries().count(),
        };
        entries + usize::from(self.clear_pending)
    }

    /// How much [`Self::unwritten_count`] changed since the user was put
    /// together (from the store or from its parts).
    pub fn unwritten_change(&self) -> isize {
        self.unwritten_change
    }

    /// See [`UserView::get`].
    pub fn get(&self, key: Key) -> Option<&ReadState> {
        self.view().get(key)
    }

    /// See [`UserView::live`].
    pub fn live(&self) -> impl Iterator<Item = &ReadState> {
        self.view().live()
    }

    /// See [`UserView::counts`].
    pub fn counts(&self, channels: &impl Channels) -> Counts {
        self.view().counts(channels)
    }

    /// See [`UserView::delta`].
    pub fn delta(&self, since: u64, channels: &impl Channels) -> Delta<'_> {
        self.view().delta(since, channels)
    }

    /// A normal ack: moves `last_acked_id` forward to `message_id` and resets
    /// both counters. Returns the new read state, or `None` when `message_id`
    /// is not past the last ack and nothing changed.
    pub fn ack(&mut self, key: Key, message_id: u64, now_us: u64) -> Option<ReadState> {
        // One search serves both the check and the change.
        let position = self.position(key);
        if message_id <= self.last_acked_at(position) || !self.may_make(key, position) {
            return None;
        }
        let version = self.next_version(now_us);
        Some(*self.change_at(position, key, version, |e| e.read_up_to(message_id)))
    }

    /// A manual ack ("mark unread"): sets the last ack and the counts
    /// exactly, even backwards. The watermark stays (or rises to
    /// `message_id`): the messages after the new ack are those the given
    /// counts describe, so a redelivered one must not count again.
    pub fn manual_ack(
        &mut self,
        key: Key,
        message_id: u64,
        mention_count: u16,
        unread_count: u16,
        now_us: u64,
    ) -> Option<ReadState> {
        let position = self.position(key);
        if !self.may_make(key, position) {
            return None;
        }
        let version = self.next_version(now_us);
        Some(*self.change_at(position, key, version, |e| {
            e.last_acked_id = message_id;
            e.last_message_id = e.last_message_id.max(message_id);
            e.mention_count = mention_count;
            e.unread_count = unread_count;
        }))
    }

    /// Several normal acks as one change (one version). Returns whether any
    /// applied.
    pub fn bulk_ack(&mut self, acks: &[(Key, u64)], now_us: u64) -> bool {
        let forward = |user: &Self, &(key, id): &(Key, u64)| {
            let position = user.position(key);
            id > user.last_acked_at(position) && user.may_make(key, position)
        };
        if !acks.iter().any(|ack| forward(self, ack)) {
            return false;
        }
        let version = self.next_version(now_us);
        for ack in acks {
            if forward(self, ack) {
                self.change(ack.0, version, |e| e.read_up_to(ack.1));
            }
        }
        true
    }

    /// Marks every live read state (of `kinds`; all if empty) read up to its
    /// watermark, or in a channel counted by channel up to the channel's
    /// newest message: "mark all read", one change. Returns how many changed.
    pub fn ack_all(&mut self, kinds: &[Kind], now_us: u64, channels: &impl Channels) -> u32 {
        let read_up_to = |e: &ReadState| {
            let newest = channels.of(e).map_or(0, |c| c.last_message_id());
            e.counted_up_to().max(newest)
        };
        let acks: Vec<(Key, u64)> = self
            .entries
            .iter()
            .filter(|e| !e.deleted && (kinds.is_empty() || kinds.contains(&e.kind)))
            .filter(|e| e.unread_up_to(read_up_to(e)))
            .map(|e| (e.key(), read_up_to(e)))
            .collect();
        self.read_each(&acks, now_us)
    }

    /// Marks each of `acks` read up to its message id, as one change.
    /// Returns how many.
    fn read_each(&mut self, acks: &[(Key, u64)], now_us: u64) -> u32 {
        if acks.is_empty() {
            return 0;
        }
        let version = self.next_version(now_us);
        for &(key, message_id) in acks {
            self.change(key, version, |e| e.read_up_to(message_id));
        }
        acks.len() as u32
    }

    /// A new message in `key`'s channel: the unread count (and the mention
    /// count if `mentioned`) rises, unless the message is at or below what
    /// was already counted or read (a redelivery, or a late older message).
    /// Creates the read state if the user had none, but in a channel counted
    /// by channel, where only members have one (this is then a late message
    /// from before the switch). Returns whether it changed.
    pub fn message_created(
        &mut self,
        key: Key,
        message_id: u64,
        mentioned: bool,
        now_us: u64,
        channels: &impl Channels,
    ) -> bool {
        let position = self.position(key);
        let existing = self.live_at(position);
        if existing.is_none() && (channels.counts_key(key) || key.kind == Kind::Thread) {
            return false;
        }
        if message_id <= existing.map_or(0, ReadState::counted_up_to) {
            return false;
        }
        let version = self.next_version(now_us);
        self.change_at(position, key, version, |e| {
            e.last_message_id = message_id;
            e.unread_count = e.unread_count.saturating_add(1);
            if mentioned {
                e.mention_count = e.mention_count.saturating_add(1);
            }
        });
        true
    }

    /// A deleted message in `key`'s channel: if this read state counted it
    /// (after the last ack, at or below the watermark), the unread count
    /// (and the mention count if `mentioned`) drops by one, never below
    /// zero. Returns whether it changed. Not idempotent on its own: the
    /// caller keeps a retry from lowering twice.
    pub fn message_deleted(
        &mut self,
        key: Key,
        message_id: u64,
        mentioned: bool,
        now_us: u64,
    ) -> bool {
        let position = self.position(key);
        let Some(state) = self.live_at(position) else {
            return false;
        };
        let counted = state.last_acked_id < message_id && message_id <= state.last_message_id;
        let lowers = state.unread_count > 0 || (mentioned && state.mention_count > 0);
        if !(counted && lowers) {
            return false;
        }
        let version = self.next_version(now_us);
        self.change_at(position, key, version, |e| {
            e.unread_count = e.unread_count.saturating_sub(1);
            if mentioned {
                e.mention_count = e.mention_count.saturating_sub(1);
            }
        });
        true
    }

    /// A mention in a channel counted by channel, whose unread count the
    /// channel keeps: the mention count rises past the watermark, as in
    /// [`Self::message_created`], if the channel `holds` the message (took
    /// it, and it is not deleted: a late message counts nothing, a retry of
    /// one it took counts once; see [`ChannelState::holds`], asked of the
    /// channel's owner on a fleet, since a copy may lag). A read state
    /// created by it is acked just below the message, so a member counts
    /// from their first mention and not from the channel's start. Returns
    /// whether it changed.
    pub fn mentioned(&mut self, key: Key, message_id: u64, now_us: u64, holds: bool) -> bool {
        let position = self.position(key);
        if !holds || !self.may_make(key, position) {
            return false;
        }
        let existing = self.live_at(position).copied();
        if message_id <= existing.map_or(0, |e| e.counted_up_to()) {
            return false;
        }
        let version = self.next_version(now_us);
        self.change_at(position, key, version, |e| {
            if existing.is_none() {
                e.last_acked_id = message_id - 1;
            }
            e.last_message_id = message_id;
            e.mention_count = e.mention_count.saturating_add(1);
        });
        true
    }

    /// A deleted mention in a channel counted by channel (the channel
    /// uncounts the message itself): the mention count drops by one if this
    /// read state counted it, as in [`Self::message_deleted`], and as there
    /// the caller keeps a retry from lowering twice.
    pub fn mention_deleted(&mut self, key: Key, message_id: u64, now_us: u64) -> bool {
        let position = self.position(key);
        let Some(state) = self.live_at(position) else {
            return false;
        };
        let counted = state.last_acked_id < message_id && message_id <= state.last_message_id;
        if !(counted && state.mention_count > 0) {
            return false;
        }
        let version = self.next_version(now_us);
        self.change_at(position, key, version, |e| {
            e.mention_count -= 1;
        });
        true
    }

    /// Mutes or unmutes a read state, creating it if needed to hold a mute;
    /// in a channel counted by channel a read state created so is read up to
    /// the channel's newest message (a member from now on). Returns whether
    /// it changed.
    pub fn set_muted(
        &mut self,
        key: Key,
        muted: bool,
        now_us: u64,
        channels: &impl Channels,
    ) -> bool {
        let position = self.position(key);
        let existing = self.live_at(position);
        if existing.is_some_and(|e| e.muted) == muted || !self.may_make(key, position) {
            return false;
        }
        let joins_at = match existing {
            None => channels.get_key(key).map(ChannelState::last_message_id),
            Some(_) => None,
        };
        let version = self.next_version(now_us);
        self.change_at(position, key, version, |e| {
            if let Some(newest) = joins_at {
                e.read_up_to(newest);
            }
            e.muted = muted;
        });
        true
    }

    /// Deletes the live read states among `keys`, and the threads of each
    /// channel among them, leaving tombstones. Returns how many existed.
    pub fn delete(&mut self, keys: &[Key], now_us: u64) -> u32 {
        // A channel's threads go with it.
        let threads: Vec<Key> = (keys.iter())
            .filter(|k| k.kind == Kind::Channel)
            .flat_map(|k| self.threads_of(k.channel_id))
            .collect();
        let keys: Vec<Key> = keys.iter().copied().chain(threads).collect();
        if !keys.iter().any(|&k| self.get(k).is_some()) {
            return 0;
        }
        let version = self.next_version(now_us);
        let mut deleted = 0;
        for key in keys {
            if self.get(key).is_some() {
                self.change(key, version, |e| {
                    // A thread's tombstone keeps how far it was counted, so
                    // that a redelivered reply does not make its user follow
                    // it again.
                    let counted_up_to = match key.kind {
                        Kind::Thread => e.counted_up_to(),
                        _ => 0,
                    };
                    *e = ReadState {
                        deleted: true,
                        last_message_id: counted_up_to,
                        ..ReadState::new(key)
                    };
                });
                deleted += 1;
            }
        }
        deleted
    }

    /// Deletes every read state of the user. No tombstones: the delta floor
    /// moves up instead, so any client older than this gets the (empty) full
    /// set. Returns how many live read states there were.
    pub fn delete_all(&mut self, now_us: u64) -> u32 {
        let live = self.live().count() as u32;
        if self.entries.is_empty() {
            return 0;
        }
        let before = self.unwritten_count();
        let version = self.next_version(now_us);
        self.entries.clear();
        self.unwritten = Some(0);
        self.delta_floor = version;
        self.clear_pending = true;
        self.unwritten_change += 1 - before as isize;
        live
    }

    /// See [`UserView::pending_clear`].
    pub fn pending_clear(&self) -> Option<u64> {
        self.view().pending_clear()
    }

    /// See [`UserView::unwritten_entries`].
    pub fn unwritten_entries(&self) -> impl Iterator<Item = &ReadState> {
        self.view().unwritten_entries()
    }

    /// The store now holds everything up to `version`.
    pub fn mark_written(&mut self, version: u64) {
        if version <= self.written_version {
            return;
        }
        let before = self.unwritten_count();
        self.written_version = version;
        self.clear_pending &= self.delta_floor > version;
        self.unwritten = Some(self.unwritten_entries().count() as u32);
        self.unwritten_change += self.unwritten_count() as isize - before as isize;
    }

    /// Drops written tombstones that are too old or too many (channels'
    /// and threads' each against their own cap), raising the delta floor
    /// past them. Returns how many were dropped.
    pub fn prune_tombstones(&mut self, now_us: u64) -> usize {
        let expired_before = now_us.saturating_sub(TOMBSTONE_RETENTION.as_micros() as u64);
        let channels = self.tombstone_cutoff(false, MAX_TOMBSTONES_PER_USER, expired_before);
        let threads = self.tombstone_cutoff(true, MAX_THREAD_TOMBSTONES, expired_before);
        if channels.is_none() && threads.is_none() {
            return 0;
        }
        let before = self.entries.len();
        // A thread's tombstone below a floor raised for channels stays: a
        // delta never reaches below the floor, so it only keeps its rules.
        self.retain_entries(|e| {
            let cutoff = match e.kind == Kind::Thread {
                true => threads,
                false => channels,
            };
            !(e.deleted && cutoff.is_some_and(|cutoff| e.version <= cutoff))
        });
        self.delta_floor = (self.delta_floor).max(channels.max(threads).unwrap_or(0));
        before - self.entries.len()
    }

    /// The version up to which the written tombstones of threads (or of
    /// everything else) go: every expired one, and the oldest past `cap`;
    /// `None` if none goes.
    fn tombstone_cutoff(&self, threads: bool, cap: usize, expired_before: u64) -> Option<u64> {
        let of_kind = |e: &&ReadState| e.deleted && (e.kind == Kind::Thread) == threads;
        let mut written: Vec<u64> = (self.entries.iter())
            .filter(of_kind)
            .filter(|e| e.version <= self.written_version)
            .map(|e| e.version)
            .collect();
        let excess = (self.entries.iter().filter(of_kind).count()).saturating_sub(cap);
        written.sort_unstable();
        let expired = written.partition_point(|&v| v < expired_before);
        // The cap takes the oldest, but never part of one change's
        // tombstones (one version: a floor cannot fall between them), which
        // go, or stay past the cap, together.
        let mut capped = excess.min(written.len());
        while capped > 0 && capped < written.len() && written[capped - 1] == written[capped] {
            capped -= 1;
        }
        let drop = expired.max(capped);
        (drop > 0).then(|| written[drop - 1])
    }

    /// Whether a change may apply to `key` at `position`: a thread read
    /// state is made only by following the thread (see [`threads`]), so
    /// every other change applies to it only while it is followed.
    fn may_make(&self, key: Key, position: Result<usize, usize>) -> bool {
        key.kind != Kind::Thread || self.live_at(position).is_some()
    }

    /// Inserts `entry` at `index`; a thread entry with parent 0 until its
    /// parent is set, so that the parents stay in step with the threads.
    fn insert_entry(&mut self, index: usize, entry: ReadState) {
        if entry.kind == Kind::Thread {
            let at = index - first_thread(&self.entries);
            let mut parents = self.entries.parents().to_vec();
            parents.insert(at, 0);
            self.entries.set_parents(&parents);
        }
        self.entries.insert(index, entry);
        self.debug_check_parents();
    }

    /// Keeps only the entries `keep` says to, and their parents.
    fn retain_entries(&mut self, mut keep: impl FnMut(&ReadState) -> bool) {
        let first = first_thread(&self.entries);
        let parents: Vec<u64> = (self.entries[first..].iter())
            .zip(self.entries.parents())
            .filter(|(e, _)| keep(e))
            .map(|(_, &parent)| parent)
            .collect();
        if parents.len() != self.entries.parents().len() {
            self.entries.set_parents(&parents);
        }
        self.entries.retain(keep);
        self.debug_check_parents();
    }

    /// One parent per thread entry (what every read of them relies on).
    fn debug_check_parents(&self) {
        let threads = thread_count(&self.entries);
        debug_assert_eq!(self.entries.parents().len(), threads, "a parent per thread");
    }

    fn next_version(&mut self, now_us: u64) -> u64 {
        self.version = (self.version + 1).max(now_us);
        self.version
    }

    fn position(&self, key: Key) -> Result<usize, usize> {
        search(&self.entries, key)
    }

    /// The live read state at `position`, if there is one.
    fn live_at(&self, position: Result<usize, usize>) -> Option<&ReadState> {
        position
            .ok()
            .map(|i| &self.entries[i])
            .filter(|e| !e.deleted)
    }

    /// The last acked id of the live read state at `position` (0 if none).
    fn last_acked_at(&self, position: Result<usize, usize>) -> u64 {
        self.live_at(position).map_or(0, |e| e.last_acked_id)
    }

    /// Applies `update` to the entry for `key` (created, or revived from a
    /// tombstone, as a fresh read state) and stamps it with `version`.
    fn change(
        &mut self,
        key: Key,
        version: u64,
        update: impl FnOnce(&mut ReadState),
    ) -> &ReadState {
        self.change_at(self.position(key), key, version, update)
    }

    /// [`Self::change`], with `position` (from [`Self::position`] for `key`,
    /// nothing changed since) already found.
    fn change_at(
        &mut self,
        position: Result<usize, usize>,
        key: Key,
        version: u64,
        update: impl FnOnce(&mut ReadState),
    ) -> &ReadState {
        let (index, was_unwritten) = match position {
            Ok(i) => {
                let was_unwritten = self.entries[i].version > self.written_version;
                if self.entries[i].deleted {
                    self.entries[i] = ReadState::new(key);
                }
                (i, was_unwritten)
            }
            Err(i) => {
                self.insert_entry(i, ReadState::new(key));
                (i, false)
            }
        };
        if !was_unwritten {
            if let Some(count) = &mut self.unwritten {
                *count += 1;
            }
            self.unwritten_change += 1;
        }
        let entry = &mut self.entries[index];
        update(entry);
        entry.version = version;
        entry
    }
}

/// Where `key` is in `entries` (sorted by key), or where it would go.
/// A user's read states are a cache miss away: up to [`LINEAR_SEARCH`] of
/// them are scanned in order, whose loads the CPU and its prefetcher run
/// ahead of the comparisons, rather than binary searched, whose every probe
/// waits for the one before.
fn search(entries: &[ReadState], key: Key) -> Result<usize, usize> {
    if entries.len() > LINEAR_SEARCH {
        return entries.binary_search_by_key(&key, ReadState::key);
    }
    match entries.iter().position(|entry| entry.key() >= key) {
        Some(i) if entries[i].key() == key => Ok(i),
        Some(i) => Err(i),
        None => Err(entries.len()),
    }
}

/// See [`search`]: 64 read states of 40 bytes are 40 cache lines.
const LINEAR_SEARCH: usize = 64;

mod channels;
mod entries;
pub mod threads;
mod view;

#[cfg(test)]
pub(crate) mod tests;
