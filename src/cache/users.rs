//! The users of one shard: packed records in a slab, found by user id
//! through an index of slab positions, and evicted by a CLOCK hand that
//! sweeps the slab.
//!
//! Per user this costs its 48-byte record and about two `u32` index
//! buckets, with no allocation of its own (an `lru::LruCache` costs a boxed
//! node with two pointers and a hash slot of a key and a pointer). The hand
//! needs no links between records: a used user is marked in its own record
//! (`REFERENCED`), and the hand gives a marked user a second chance.

use std::collections::VecDeque;

use hashbrown::HashTable;

use super::arena::Block;
use crate::read_state::Header;

/// A cached user: its versions and write-behind state, packed. Its read
/// states are in the shard's arena, at `block`, and the parent ids of its
/// thread read states in the shard's parents arena, at `parents`.
#[derive(Clone, Debug)]
pub(crate) struct CachedUser {
    pub(crate) user_id: u64,
    pub(crate) version: u64,
    /// The store holds every change up to this version.
    pub(crate) written_version: u64,
    pub(crate) delta_floor: u64,
    pub(crate) block: Block,
    /// Read states and tombstones in `block`.
    pub(crate) len: u32,
    /// One per thread read state in `block`, in their order (`EMPTY` for a
    /// user who follows no thread).
    pub(crate) parents: Block,
    /// When its oldest unwritten change was made, in ticks of the shard's
    /// coarse clock (see `Shard::ticks`), if `UNWRITTEN_SINCE` is set.
    /// Ticks keep the record at 48 bytes; it only tells how long a user
    /// has waited (a gauge, and a handoff's deadline), to a tick.
    pub(crate) since: u16,
    /// Requests that hold it from their load to their change (see
    /// `Cache::update_many`): it is not evicted while pinned. At `u8::MAX`
    /// the shard counts the rest (see `Shard::pins_beyond`).
    pub(crate) pins: u8,
    pub(crate) flags: Flags,
}

/// A user's flags, one bit each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Flags(u8);

impl Flags {
    /// `since` holds when its oldest unwritten change was made.
    pub(crate) const UNWRITTEN_SINCE: Flags = Flags(1);
    /// There is an entry for it in a write-behind queue (maybe a stale one).
    pub(crate) const QUEUED: Flags = Flags(1 << 1);
    /// A write of it is under way; no second one may start (an older
    /// snapshot must never land after a newer one).
    pub(crate) const IN_FLIGHT: Flags = Flags(1 << 2);
    /// Some stream watches it: the one check a change pays when nobody does.
    pub(crate) const WATCHED: Flags = Flags(1 << 3);
    /// Evicted with unwritten changes: passed over by the hand, kept until
    /// written so that a request for it sees its latest state.
    pub(crate) const EVICTED: Flags = Flags(1 << 4);
    /// A "delete all" at `delta_floor` is not written yet.
    pub(crate) const CLEAR_PENDING: Flags = Flags(1 << 5);
    /// Used since the hand last passed it: the hand unmarks it instead of
    /// evicting it (a second chance).
    pub(crate) const REFERENCED: Flags = Flags(1 << 6);
    /// No user: a slab position given back, waiting for reuse.
    const VACANT: Flags = Flags(1 << 7);

    pub(crate) fn has(self, flag: Flags) -> bool {
        self.0 & flag.0 != 0
    }

    pub(crate) fn set(&mut self, flag: Flags, on: bool) {
        if on {
            self.0 |= flag.0;
        } else {
            self.0 &= !flag.0;
        }
    }
}

impl CachedUser {
    /// A user just cached: marked used, so that the hand does not take it
    /// on its first pass, as a list would have it last.
    pub(crate) fn new(user_id: u64) -> CachedUser {
        CachedUser {
            user_id,
            version: 0,
            written_version: 0,
            delta_floor: 0,
            block: Block::EMPTY,
            len: 0,
            parents: Block::EMPTY,
            since: 0,
            pins: 0,
            flags: Flags::REFERENCED,
        }
    }

    pub(crate) fn is(&self, flag: Flags) -> bool {
        self.flags.has(flag)
    }

    pub(crate) fn header(&self) -> Header {
        Header {
            version: self.version,
            written_version: self.written_version,
            delta_floor: self.delta_floor,
            clear_pending: self.is(Flags::CLEAR_PENDING),
        }
    }

    pub(crate) fn set_header(&mut self, header: Header) {
        self.version = header.version;
        self.written_version = header.written_version;
        self.delta_floor = header.delta_floor;
        self.flags.set(Flags::CLEAR_PENDING, header.clear_pending);
    }

    /// Has changes the store does not hold yet.
    pub(crate) fn has_unwritten(&self) -> bool {
        self.version > self.written_version
    }

    /// What it counts against capacity: its read states and tombstones, and
    /// at least 1, so that users with none (lookups of unknown users) are
    /// evicted too.
    pub(crate) fn weight(&self) -> usize {
        (self.len as usize).max(1)
    }

    /// In the hand's sweep: neither evicted nor a vacant position.
    fn is_cached(&self) -> bool {
        !self.is(Flags::EVICTED) && !self.is(Flags::VACANT)
    }
}

/// Where a user is in the slab.
pub(crate) type Slot = u32;

/// Records per slab chunk (48 KiB): the slab grows a chunk at a time, and
/// never copies more than a chunk.
const CHUNK: usize = 1024;

/// One shard's users, cached and evicted.
#[derive(Debug, Default)]
pub(crate) struct Users {
    /// Chunks of `CHUNK` records, the last one filling up.
    slab: Vec<Vec<CachedUser>>,
    /// Slab positions given back (flagged `VACANT`), reused first.
    vacant: Vec<Slot>,
    /// Slab positions given back that the shard's delay queue may still
    /// name, each with how many entries the queue must have let go of
    /// before it is reused (see [`Users::remove`]), in that order.
    cooling: VecDeque<(u64, Slot)>,
    index: HashTable<Slot>,
    /// The slab position the eviction hand looks at next.
    hand: Slot,
    /// Users the hand sweeps: cached, not evicted.
    cached: usize,
}

/// Spreads snowflake ids (timestamp high, counters low) over the whole
/// hash (the splitmix64 finalizer).
fn hash(user_id: u64) -> u64 {
    let mut z = user_id;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Users {
    pub(crate) fn new() -> Users {
        Users::default()
    }

    /// Users the hand sweeps (cached, not evicted).
    pub(crate) fn cached(&self) -> usize {
        self.cached
    }

    pub(crate) fn find(&self, user_id: u64) -> Option<Slot> {
        self.index
            .find(hash(user_id), |&slot| self.get(slot).user_id == user_id)
            .copied()
    }

    pub(crate) fn get(&self, slot: Slot) -> &CachedUser {
        let slot = slot as usize;
        &self.slab[slot / CHUNK][slot % CHUNK]
    }

    pub(crate) fn get_mut(&mut self, slot: Slot) -> &mut CachedUser {
        let slot = slot as usize;
        &mut self.slab[slot / CHUNK][slot % CHUNK]
    }

    /// Slab positions, vacant ones included.
    fn positions(&self) -> usize {
        self.slab
            .last()
            .map_or(0, |chunk| (self.slab.len() - 1) * CHUNK + chunk.len())
    }

    /// Adds a user not held yet, cached.
    pub(crate) fn insert(&mut self, user: CachedUser) -> Slot {
        debug_assert!(!user.is(Flags::EVICTED) && !user.is(Flags::VACANT));
        let user_id = user.user_id;
        let slot = match self.vacant.pop() {
            Some(slot) => {
                *self.get_mut(slot) = user;
                slot
            }
            None => {
                if self.slab.last().is_none_or(|chunk| chunk.len() == CHUNK) {
                    // Grown by doubling to `CHUNK` (a power of two): the
                    // allocator may make a whole allocation resident.
                    self.slab.push(Vec::new());
                }
                let chunks = self.slab.len();
                let chunk = self.slab.last_mut().expect("pushed above");
                chunk.push(user);
                ((chunks - 1) * CHUNK + chunk.len() - 1) as Slot
            }
        };
        let slab = &self.slab;
        self.index.insert_unique(hash(user_id), slot, |&s| {
            let s = s as usize;
            hash(slab[s / CHUNK][s % CHUNK].user_id)
        });
        self.cached += 1;
        slot
    }

    /// Forgets a user, cached or evicted; returns its record. Its position
    /// keeps its id and is reused at once, or, with `cool_until`, once the
    /// shard's delay queue has let go of that many entries: until then an
    /// entry may name the position, and must find this user's id there
    /// (another user's would be written early, and a busy one would be on
    /// two write schedules from then on).
    pub(crate) fn remove(&mut self, slot: Slot, cool_until: Option<u64>) -> CachedUser {
        let user = self.get(slot).clone();
        if user.is_cached() {
            self.cached -= 1;
        }
        let slab = &self.slab;
        let found = self.index.find_entry(hash(user.user_id), |&s| {
            let s = s as usize;
            slab[s / CHUNK][s % CHUNK].user_id == user.user_id
        });
        if let Ok(entry) = found {
            entry.remove();
        }
        self.get_mut(slot).flags = Flags::VACANT;
        match cool_until {
            Some(until) => self.cooling.push_back((until, slot)),
            None => self.vacant.push(slot),
        }
        user
    }

    /// The shard's delay queue has let go of `popped` entries in all:
    /// positions it can no longer name are reused.
    pub(crate) fn cooled(&mut self, popped: u64) {
        while let Some(&(until, slot)) = self.cooling.front()
            && until <= popped
        {
            self.cooling.pop_front();
            self.vacant.push(slot);
        }
    }

    /// Moves the hand to the next cached user and returns it; `None` if
    /// no user is cached.
    pub(crate) fn next_for_eviction(&mut self) -> Option<Slot> {
        if self.cached == 0 {
            return None;
        }
        let positions = self.positions() as Slot;
        // A cached user is met within one sweep of the slab.
        loop {
            let slot = if self.hand >= positions { 0 } else { self.hand };
            self.hand = slot + 1;
            if self.get(slot).is_cached() {
                return Some(slot);
            }
        }
    }

    /// Takes a cached user out of the hand's sweep (evicted, still held).
    pub(crate) fn evict(&mut self, slot: Slot) {
        debug_assert!(self.get(slot).is_cached());
        self.get_mut(slot).flags.set(Flags::EVICTED, true);
        self.cached -= 1;
    }

    /// Caches an evicted user again, marked used.
    pub(crate) fn restore(&mut self, slot: Slot) {
        let user = self.get_mut(slot);
        debug_assert!(user.is(Flags::EVICTED));
        user.flags.set(Flags::EVICTED, false);
        user.flags.set(Flags::REFERENCED, true);
        self.cached += 1;
    }

    /// Every user held, cached and evicted, in no order (the slab's: read
    /// in sequence, where the index's order would read every record at a
    /// random place, each a cache miss).
    pub(crate) fn iter(&self) -> impl Iterator<Item = &CachedUser> {
        (self.slab.iter().flatten()).filter(|user| !user.is(Flags::VACANT))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_48_bytes() {
        assert_eq!(size_of::<CachedUser>(), 48);
    }

    /// The hand's next `n` picks, as user ids.
    fn picks(users: &mut Users, n: usize) -> Vec<u64> {
        (0..n)
            .map(|_| {
                let slot = users.next_for_eviction().expect("a cached user");
                users.get(slot).user_id
            })
            .collect()
    }

    #[test]
    fn users_are_found_and_swept_in_slab_order_skipping_evicted_and_vacant_ones() {
        let mut users = Users::new();
        assert_eq!(users.next_for_eviction(), None);
        let slots: Vec<Slot> = (1..=5u64)
            .map(|id| users.insert(CachedUser::new(id << 22)))
            .collect();
        assert_eq!(
            picks(&mut users, 7),
            [1, 2, 3, 4, 5, 1, 2].map(|id| id << 22)
        );
        users.evict(slots[3]);
        assert_eq!(picks(&mut users, 4), [3, 5, 1, 2].map(|id| id << 22));
        assert_eq!((users.iter().count(), users.cached()), (5, 4));
        users.restore(slots[3]);
        assert!(users.get(slots[3]).is(Flags::REFERENCED));
        assert_eq!(picks(&mut users, 3), [3, 4, 5].map(|id| id << 22));

        let removed = users.remove(slots[1], None);
        assert_eq!(removed.user_id, 2 << 22);
        assert_eq!(users.find(2 << 22), None);
        // A vacant position is no user.
        let mut held: Vec<u64> = users.iter().map(|u| u.user_id).collect();
        held.sort_unstable();
        assert_eq!(held, [1, 3, 4, 5].map(|id| id << 22));
        assert_eq!(picks(&mut users, 4), [1, 3, 4, 5].map(|id| id << 22));
        // The slot is reused, and found under its new user.
        let slot = users.insert(CachedUser::new(9));
        assert_eq!(slot, slots[1]);
        assert_eq!(users.find(9), Some(slot));
        assert_eq!(users.find(5 << 22), Some(slots[4]));
        assert_eq!((users.iter().count(), users.cached()), (5, 5));
        assert_eq!(picks(&mut users, 2), [1 << 22, 9]);

        // Evicted users and vacant positions only: nothing to pick.
        for slot in [slots[0], slots[1], slots[2], slots[3]] {
            users.remove(slot, None);
        }
        users.evict(slots[4]);
        assert_eq!(users.next_for_eviction(), None);
    }
}
