//! The users of one shard: packed records in a slab, found by user id
//! through an index of slab positions, and kept in eviction order by links
//! inside the records.
//!
//! Per user this costs its record and about two `u32` index buckets, with
//! no allocation of its own (an `lru::LruCache` costs a boxed node with two
//! pointers and a hash slot of a key and a pointer).

use hashbrown::HashTable;

use super::arena::Block;
use crate::read_state::Header;

/// No record: the end of the LRU list.
const NIL: u32 = u32::MAX;

/// A cached user: its versions and write-behind state, packed. Its read
/// states are in the shard's arena, at `block`.
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
    /// When its oldest unwritten change was made, in milliseconds of the
    /// shard's clock (see `Shard::millis`), if `UNWRITTEN_SINCE` is set.
    pub(crate) since_ms: u32,
    prev: u32,
    next: u32,
    /// Requests that hold it from their load to their change (see
    /// `Cache::update_many`): it is not evicted while pinned. At `u16::MAX`
    /// the shard counts the rest (see `Shard::pins_beyond`).
    pub(crate) pins: u16,
    pub(crate) flags: Flags,
}

/// A user's flags, one bit each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Flags(u8);

impl Flags {
    /// `since_ms` holds when its oldest unwritten change was made.
    pub(crate) const UNWRITTEN_SINCE: Flags = Flags(1);
    /// There is an entry for it in a write-behind queue (maybe a stale one).
    pub(crate) const QUEUED: Flags = Flags(1 << 1);
    /// A write of it is under way; no second one may start (an older
    /// snapshot must never land after a newer one).
    pub(crate) const IN_FLIGHT: Flags = Flags(1 << 2);
    /// Some stream watches it: the one check a change pays when nobody does.
    pub(crate) const WATCHED: Flags = Flags(1 << 3);
    /// Evicted with unwritten changes: out of the LRU order, kept until
    /// written so that a request for it sees its latest state.
    pub(crate) const EVICTED: Flags = Flags(1 << 4);
    /// A "delete all" at `delta_floor` is not written yet.
    pub(crate) const CLEAR_PENDING: Flags = Flags(1 << 5);
    /// Used since it last came to the front of the eviction order: it goes
    /// to the back instead of being evicted (a second chance).
    pub(crate) const REFERENCED: Flags = Flags(1 << 6);

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
    pub(crate) fn new(user_id: u64) -> CachedUser {
        CachedUser {
            user_id,
            version: 0,
            written_version: 0,
            delta_floor: 0,
            block: Block::EMPTY,
            len: 0,
            since_ms: 0,
            prev: NIL,
            next: NIL,
            pins: 0,
            flags: Flags::default(),
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
}

/// Where a user is in the slab.
pub(crate) type Slot = u32;

/// Records per slab chunk (56 KiB): the slab grows a chunk at a time, and
/// never copies more than a chunk.
const CHUNK: usize = 1024;

/// One shard's users, cached and evicted.
#[derive(Debug, Default)]
pub(crate) struct Users {
    /// Chunks of `CHUNK` records, the last one filling up.
    slab: Vec<Vec<CachedUser>>,
    /// Slab positions given back, reused first.
    vacant: Vec<Slot>,
    index: HashTable<Slot>,
    /// Least recently used first; evicted users are not linked.
    head: u32,
    tail: u32,
    linked: usize,
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
        Users {
            head: NIL,
            tail: NIL,
            ..Users::default()
        }
    }

    /// Users in the LRU order (cached, not evicted).
    pub(crate) fn linked(&self) -> usize {
        self.linked
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

    /// Adds a user not held yet, most recently used.
    pub(crate) fn insert(&mut self, user: CachedUser) -> Slot {
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
        self.link(slot);
        slot
    }

    /// Forgets a user (unlinking it first if linked); returns its record.
    pub(crate) fn remove(&mut self, slot: Slot) -> CachedUser {
        if !self.get(slot).is(Flags::EVICTED) {
            self.unlink(slot);
        }
        let user = self.get(slot).clone();
        let slab = &self.slab;
        let found = self.index.find_entry(hash(user.user_id), |&s| {
            let s = s as usize;
            slab[s / CHUNK][s % CHUNK].user_id == user.user_id
        });
        if let Ok(entry) = found {
            entry.remove();
        }
        self.vacant.push(slot);
        user
    }

    /// The least recently used linked user.
    pub(crate) fn lru(&self) -> Option<Slot> {
        (self.head != NIL).then_some(self.head)
    }

    /// Moves a linked user to the back of the eviction order.
    pub(crate) fn requeue(&mut self, slot: Slot) {
        if self.tail != slot {
            self.unlink(slot);
            self.link(slot);
        }
    }

    /// Takes a user out of the LRU order (evicted, still held).
    pub(crate) fn unlink(&mut self, slot: Slot) {
        let (prev, next) = {
            let user = self.get(slot);
            (user.prev, user.next)
        };
        match prev {
            NIL => self.head = next,
            prev => self.get_mut(prev).next = next,
        }
        match next {
            NIL => self.tail = prev,
            next => self.get_mut(next).prev = prev,
        }
        self.linked -= 1;
    }

    /// Puts an unlinked user in the LRU order, most recently used.
    pub(crate) fn link(&mut self, slot: Slot) {
        let tail = self.tail;
        {
            let user = self.get_mut(slot);
            user.prev = tail;
            user.next = NIL;
        }
        match tail {
            NIL => self.head = slot,
            tail => self.get_mut(tail).next = slot,
        }
        self.tail = slot;
        self.linked += 1;
    }

    /// Every user held, cached and evicted, in no order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &CachedUser> {
        self.index.iter().map(|&slot| self.get(slot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_56_bytes() {
        assert_eq!(size_of::<CachedUser>(), 56);
    }

    fn order(users: &Users) -> Vec<u64> {
        let mut ids = Vec::new();
        let mut slot = users.head;
        while slot != NIL {
            ids.push(users.get(slot).user_id);
            slot = users.get(slot).next;
        }
        ids
    }

    #[test]
    fn users_are_found_and_kept_in_lru_order() {
        let mut users = Users::new();
        let slots: Vec<Slot> = (1..=5u64)
            .map(|id| users.insert(CachedUser::new(id << 22)))
            .collect();
        assert_eq!(order(&users), [1, 2, 3, 4, 5].map(|id| id << 22));
        users.requeue(slots[1]);
        users.requeue(slots[4]);
        assert_eq!(order(&users), [1, 3, 4, 2, 5].map(|id| id << 22));
        users.unlink(slots[0]);
        assert_eq!(users.lru(), Some(slots[2]));
        assert_eq!((users.iter().count(), users.linked()), (5, 4));
        users.link(slots[0]);
        assert_eq!(order(&users), [3, 4, 2, 5, 1].map(|id| id << 22));

        let removed = users.remove(slots[3]);
        assert_eq!(removed.user_id, 4 << 22);
        assert_eq!(users.find(4 << 22), None);
        assert_eq!(order(&users), [3, 2, 5, 1].map(|id| id << 22));
        // The slot is reused, and found under its new user.
        let slot = users.insert(CachedUser::new(9));
        assert_eq!(slot, slots[3]);
        assert_eq!(users.find(9), Some(slot));
        assert_eq!(users.find(5 << 22), Some(slots[4]));
        assert_eq!(users.iter().count(), 5);
    }
}
