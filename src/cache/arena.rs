//! Where a shard keeps its users' read states: one block per user, in chunks
//! of equal blocks per size class. (Generic over what a block holds: the
//! parent ids of a user's thread read states are kept the same way.)
//!
//! A `Vec` per user costs its 24-byte header and the allocator's rounding
//! (ten read states, 400 bytes, take a 448-byte bin). Here a user with up to
//! 16 read states gets a block of exactly that many, larger users one at
//! most an eighth too large, and a block is found from the user's length
//! alone, so a user carries only a `u32` index. Chunks hold at most
//! [`CHUNK_BYTES`], so growing one never copies much under the shard lock.
//!
//! Freed blocks are reused by the next user of their class; chunks are kept
//! (a shard refills what it evicted).

use std::ops::{Deref, DerefMut};

use crate::read_state::{Entries, Key, ReadState, thread_count};

/// The most bytes of read states in one chunk (a larger block has a chunk
/// of its own).
const CHUNK_BYTES: usize = 64 * 1024;

/// Block capacities, by class: every length up to 16, then steps of an
/// eighth, to the largest `u32`.
static CAPACITIES: [u32; CLASSES] = capacities();
const CLASSES: usize = 183;

const fn capacities() -> [u32; CLASSES] {
    let mut caps = [0u32; CLASSES];
    let mut class = 0;
    let mut cap: u64 = 1;
    while class < CLASSES {
        caps[class] = if cap > u32::MAX as u64 {
            u32::MAX
        } else {
            cap as u32
        };
        cap += if cap < 16 { 1 } else { cap / 8 };
        class += 1;
    }
    caps
}

/// A user's block: an index within the class of its length. `EMPTY` for a
/// user with no read states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block(u32);

impl Block {
    pub(crate) const EMPTY: Block = Block(u32::MAX);
}

/// The class that holds `len` (at least 1) read states.
fn class_of(len: usize) -> usize {
    match SMALL_CLASSES.get(len) {
        Some(&class) => usize::from(class),
        None => CAPACITIES.partition_point(|&cap| (cap as usize) < len),
    }
}

/// `class_of` for lengths below 1024, looked up (it is on every access).
static SMALL_CLASSES: [u8; 1024] = small_classes();

const fn small_classes() -> [u8; 1024] {
    let mut classes = [0u8; 1024];
    let (mut len, mut class) = (1, 0);
    while len < 1024 {
        while (CAPACITIES[class] as usize) < len {
            class += 1;
        }
        classes[len] = class as u8;
        len += 1;
    }
    classes
}

/// What an arena's blocks hold.
pub(crate) trait Slot: Copy + std::fmt::Debug {
    /// What fills a block's unused tail.
    const FILLER: Self;
}

impl Slot for ReadState {
    const FILLER: ReadState = ReadState::new(Key::channel(0));
}

impl Slot for u64 {
    const FILLER: u64 = 0;
}

/// The blocks of one capacity.
#[derive(Debug)]
struct Class<T> {
    capacity: usize,
    /// Blocks per full chunk.
    per_chunk: usize,
    /// Full chunks, then the one filling up.
    chunks: Vec<Vec<T>>,
    /// Blocks handed out and given back.
    free: Vec<u32>,
    /// Blocks ever made.
    made: u32,
}

impl<T: Slot> Class<T> {
    fn new(capacity: usize) -> Class<T> {
        let size = capacity * size_of::<T>();
        Class {
            capacity,
            per_chunk: (CHUNK_BYTES / size).max(1),
            chunks: Vec::new(),
            free: Vec::new(),
            made: 0,
        }
    }

    fn range(&self, block: Block) -> (usize, std::ops::Range<usize>) {
        let index = block.0 as usize;
        let start = (index % self.per_chunk) * self.capacity;
        (index / self.per_chunk, start..start + self.capacity)
    }

    fn take(&mut self) -> Block {
        if let Some(index) = self.free.pop() {
            return Block(index);
        }
        let full = self.per_chunk * self.capacity;
        if self.chunks.last().is_none_or(|chunk| chunk.len() == full) {
            // The allocator may make a whole allocation resident, used or
            // not: a class's first chunk grows as it fills (many classes
            // hold a few users, or only users passing through on their way
            // to a larger class); a class that filled one chunk is busy.
            let capacity = if self.chunks.is_empty() { 0 } else { full };
            self.chunks.push(Vec::with_capacity(capacity));
        }
        let chunk = self.chunks.last_mut().expect("pushed above");
        if chunk.len() == chunk.capacity() {
            let grown = (chunk.capacity() * 2).clamp(self.capacity, full);
            chunk.reserve_exact(grown - chunk.len());
        }
        chunk.resize(chunk.len() + self.capacity, T::FILLER);
        self.made += 1;
        Block(self.made - 1)
    }
}

/// One shard's blocks, by class.
#[derive(Debug)]
pub(crate) struct Arena<T = ReadState> {
    classes: Vec<Class<T>>,
}

impl<T> Default for Arena<T> {
    fn default() -> Self {
        Arena {
            classes: Vec::new(),
        }
    }
}

impl<T: Slot> Arena<T> {
    /// The `len` read states in `block`.
    pub(crate) fn get(&self, block: Block, len: usize) -> &[T] {
        if len == 0 {
            return &[];
        }
        let class = &self.classes[class_of(len)];
        let (chunk, range) = class.range(block);
        &class.chunks[chunk][range][..len]
    }

    /// Asks the CPU to fetch the first cache lines of a block (a hint: a
    /// search scans from the start, and the hardware follows on).
    pub(crate) fn prefetch(&self, block: Block, len: usize) {
        #[cfg(target_feature = "sse")]
        for entry in self.get(block, len).iter().step_by(2).take(4) {
            safe_arch::prefetch_t0(entry);
        }
        #[cfg(not(target_feature = "sse"))]
        let _ = (block, len);
    }

    /// Stores `entries` for a user whose block was `block`, holding `len`:
    /// in the same block if their class is the same, else in a new one (the
    /// old one is freed). Returns the user's block.
    pub(crate) fn put(&mut self, block: Block, len: usize, entries: &[T]) -> Block {
        if entries.is_empty() {
            self.free(block, len);
            return Block::EMPTY;
        }
        let class = class_of(entries.len());
        let block = if len > 0 && class_of(len) == class {
            block
        } else {
            self.free(block, len);
            self.class(class).take()
        };
        let class = &mut self.classes[class];
        let (chunk, range) = class.range(block);
        class.chunks[chunk][range][..entries.len()].copy_from_slice(entries);
        block
    }

    fn locate(&self, block: Block, len: usize) -> Option<Location> {
        if len == 0 {
            return None;
        }
        let class = class_of(len);
        let (chunk, range) = self.classes[class].range(block);
        Some(Location {
            class,
            chunk,
            start: range.start,
        })
    }

    /// The whole block of a user holding `len` (at least 1) read states.
    fn block_mut(&mut self, block: Block, len: usize) -> &mut [T] {
        let class = &mut self.classes[class_of(len)];
        let (chunk, range) = class.range(block);
        &mut class.chunks[chunk][range]
    }

    /// Moves a user holding `len` read states to a block for `new_len` (of
    /// another class), filled by `fill` from the old ones.
    fn relocate(
        &mut self,
        block: Block,
        len: usize,
        new_len: usize,
        fill: impl FnOnce(&[T], &mut [T]),
    ) -> Block {
        let (from, to) = (class_of(len), class_of(new_len));
        let new = self.class(to).take();
        let [from, to] = self
            .classes
            .get_disjoint_mut([from, to])
            .expect("a relocation changes class");
        let (old_chunk, old_range) = from.range(block);
        let (new_chunk, new_range) = to.range(new);
        fill(
            &from.chunks[old_chunk][old_range][..len],
            &mut to.chunks[new_chunk][new_range][..new_len],
        );
        from.free.push(block.0);
        new
    }

    /// Gives back the block of a user holding `len` read states.
    pub(crate) fn free(&mut self, block: Block, len: usize) {
        if len > 0 {
            self.classes[class_of(len)].free.push(block.0);
        }
    }

    fn class(&mut self, class: usize) -> &mut Class<T> {
        while self.classes.len() <= class {
            let capacity = CAPACITIES[self.classes.len()] as usize;
            self.classes.push(Class::new(capacity));
        }
        &mut self.classes[class]
    }
}

/// A user's read states where the arena keeps them, for the domain to
/// change in place (see [`Entries`]). The user's record takes back the
/// block and length afterwards ([`Stored::place`]).
#[derive(Debug)]
pub struct Stored<'a> {
    arena: &'a mut Arena,
    block: Block,
    len: usize,
    /// Where `block` is (`None` when empty), found once rather than on
    /// every access the domain makes.
    at: Option<Location>,
    /// The parent ids of the user's thread read states, in an arena of
    /// their own (a user without threads has none: [`Block::EMPTY`]).
    parents: &'a mut Arena<u64>,
    parents_block: Block,
    threads: usize,
}

/// Where a block is in the arena.
#[derive(Clone, Copy, Debug)]
struct Location {
    class: usize,
    chunk: usize,
    start: usize,
}

/// How many of a user's `entries` are threads', its parents being at
/// `parents`: none without a parents' block, told without searching (the
/// search is a cold miss or two on every change and read).
pub(crate) fn threads_in(parents: Block, entries: &[ReadState]) -> usize {
    if parents == Block::EMPTY {
        debug_assert_eq!(thread_count(entries), 0, "threads without parents");
        0
    } else {
        thread_count(entries)
    }
}

impl<'a> Stored<'a> {
    pub(crate) fn new(
        arena: &'a mut Arena,
        block: Block,
        len: usize,
        parents: &'a mut Arena<u64>,
        parents_block: Block,
    ) -> Stored<'a> {
        let at = arena.locate(block, len);
        let mut stored = Stored {
            arena,
            block,
            len,
            at,
            parents,
            parents_block,
            threads: 0,
        };
        stored.threads = threads_in(parents_block, &stored);
        stored
    }

    /// Where the read states are now and how many, and where their
    /// parents are.
    pub(crate) fn place(&self) -> (Block, usize, Block) {
        (self.block, self.len, self.parents_block)
    }

    fn moved(&mut self, block: Block, len: usize) {
        (self.block, self.len) = (block, len);
        self.at = self.arena.locate(block, len);
    }
}

impl Deref for Stored<'_> {
    type Target = [ReadState];

    fn deref(&self) -> &[ReadState] {
        match self.at {
            Some(at) => {
                &self.arena.classes[at.class].chunks[at.chunk][at.start..at.start + self.len]
            }
            None => &[],
        }
    }
}

impl DerefMut for Stored<'_> {
    fn deref_mut(&mut self) -> &mut [ReadState] {
        match self.at {
            Some(at) => {
                &mut self.arena.classes[at.class].chunks[at.chunk][at.start..at.start + self.len]
            }
            None => &mut [],
        }
    }
}

impl Entries for Stored<'_> {
    fn insert(&mut self, index: usize, entry: ReadState) {
        let len = self.len;
        let block = if len == 0 {
            self.arena.put(Block::EMPTY, 0, &[entry])
        } else if class_of(len + 1) == class_of(len) {
            let block = self.arena.block_mut(self.block, len);
            block.copy_within(index..len, index + 1);
            block[index] = entry;
            self.block
        } else {
            self.arena.relocate(self.block, len, len + 1, |old, new| {
                new[..index].copy_from_slice(&old[..index]);
                new[index] = entry;
                new[index + 1..].copy_from_slice(&old[index..]);
            })
        };
        self.moved(block, len + 1);
    }

    fn retain(&mut self, mut keep: impl FnMut(&ReadState) -> bool) {
        let entries = self.deref_mut();
        let mut kept = 0;
        for read in 0..entries.len() {
            if keep(&entries[read]) {
                entries[kept] = entries[read];
                kept += 1;
            }
        }
        let len = self.len;
        if kept == 0 {
            self.clear();
        } else if class_of(kept) != class_of(len) {
            let block = self.arena.relocate(self.block, len, kept, |old, new| {
                new.copy_from_slice(&old[..kept]);
            });
            self.moved(block, kept);
        } else {
            self.len = kept;
        }
    }

    fn clear(&mut self) {
        self.arena.free(self.block, self.len);
        self.moved(Block::EMPTY, 0);
        self.set_parents(&[]);
    }

    fn parents(&self) -> &[u64] {
        self.parents.get(self.parents_block, self.threads)
    }

    fn set_parents(&mut self, parents: &[u64]) {
        self.parents_block = self.parents.put(self.parents_block, self.threads, parents);
        self.threads = parents.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read_state::{Kind, Owned};

    fn states(len: usize, seed: u64) -> Vec<ReadState> {
        (0..len as u64)
            .map(|i| ReadState {
                last_acked_id: seed * 1000 + i,
                ..ReadState::new(Key::channel(i))
            })
            .collect()
    }

    #[test]
    fn capacities_are_exact_to_16_then_an_eighth_apart() {
        assert_eq!(
            &CAPACITIES[..17],
            &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18]
        );
        for pair in CAPACITIES[16..].windows(2) {
            assert!(pair[1] > pair[0] || pair[1] == u32::MAX, "{pair:?}");
            assert!(pair[1] as u64 <= pair[0] as u64 * 9 / 8 + 1, "{pair:?}");
        }
        assert_eq!(*CAPACITIES.last().unwrap(), u32::MAX);
        assert_eq!(class_of(1), 0);
        assert_eq!(class_of(16), 15);
        assert_eq!(CAPACITIES[class_of(19)], 20);
        assert_eq!(class_of(u32::MAX as usize), CLASSES - 1);
        for len in 1..3000 {
            let searched = CAPACITIES.partition_point(|&cap| (cap as usize) < len);
            assert_eq!(class_of(len), searched, "{len}");
        }
    }

    #[test]
    fn blocks_keep_their_users_apart_through_growth_and_reuse() {
        let mut arena = Arena::default();
        // Enough users that classes span several chunks.
        let mut users: Vec<(Block, Vec<ReadState>)> = (0..3_000)
            .map(|i| {
                let entries = states(i % 40, i as u64);
                (arena.put(Block::EMPTY, 0, &entries), entries)
            })
            .collect();
        for (i, (block, entries)) in users.iter_mut().enumerate() {
            // Grow some, shrink some, empty some.
            let len = match i % 3 {
                0 => entries.len() + 7,
                1 => entries.len() / 2,
                _ => 0,
            };
            let new = states(len, i as u64 + 10_000);
            *block = arena.put(*block, entries.len(), &new);
            *entries = new;
        }
        for (block, entries) in &users {
            assert_eq!(arena.get(*block, entries.len()), &entries[..]);
        }
        // Freed blocks are reused before new ones are made.
        let made: u32 = arena.classes.iter().map(|c| c.made).sum();
        let lens: Vec<usize> = users.iter().map(|(_, e)| e.len()).collect();
        for (block, entries) in users.drain(..) {
            arena.free(block, entries.len());
        }
        for len in lens {
            arena.put(Block::EMPTY, 0, &states(len, 0));
        }
        assert_eq!(arena.classes.iter().map(|c| c.made).sum::<u32>(), made);
    }

    #[test]
    fn stored_read_states_and_parents_change_in_place_like_a_vec() {
        let mut arena = Arena::default();
        let mut parents = Arena::default();
        let mut rng = fastrand::Rng::with_seed(7);
        let mut model = Owned::default();
        let (mut block, mut len, mut parents_block) = (Block::EMPTY, 0, Block::EMPTY);
        // Another user between, so that a relocation is visible if wrong.
        let other = arena.put(Block::EMPTY, 0, &states(17, 99));
        let other_parents = parents.put(Block::EMPTY, 0, &[5, 6, 7]);
        for step in 0..2_000u64 {
            let mut stored = Stored::new(&mut arena, block, len, &mut parents, parents_block);
            match rng.u8(..10) {
                0..=6 => {
                    let kind = if rng.bool() {
                        Kind::Thread
                    } else {
                        Kind::Channel
                    };
                    let key = Key {
                        kind,
                        channel_id: rng.u64(..500),
                    };
                    let entry = ReadState {
                        last_acked_id: step,
                        ..ReadState::new(key)
                    };
                    if let Err(index) = model.binary_search_by_key(&key, ReadState::key) {
                        Entries::insert(&mut model, index, entry);
                        stored.insert(index, entry);
                    }
                }
                7..=8 => {
                    let modulus = rng.u64(2..5);
                    Entries::retain(&mut model, |e| e.last_acked_id % modulus != 0);
                    stored.retain(|e| e.last_acked_id % modulus != 0);
                }
                _ => {
                    if let Some(entry) = stored.first_mut() {
                        entry.unread_count += 1;
                        model[0].unread_count += 1;
                    }
                }
            }
            // Parents are stored whole, one per thread entry (the last ones).
            let threads = thread_count(&model);
            let kept: Vec<u64> = (0..threads).map(|i| step * 1_000 + i as u64).collect();
            model.set_parents(&kept);
            stored.set_parents(&kept);
            assert_eq!(&stored[..], &model[..], "step {step}");
            assert_eq!(stored.parents(), model.parents(), "step {step}");
            (block, len, parents_block) = stored.place();
        }
        Stored::new(&mut arena, block, len, &mut parents, parents_block).clear();
        assert_eq!(arena.get(other, 17), &states(17, 99)[..]);
        assert_eq!(parents.get(other_parents, 3), &[5, 6, 7]);
    }
}
