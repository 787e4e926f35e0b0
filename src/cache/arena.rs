//! Where a shard keeps its users' read states: one block per user, in chunks
//! of equal blocks per size class.
//!
//! A `Vec` per user costs its 24-byte header and the allocator's rounding
//! (ten read states, 400 bytes, take a 448-byte bin). Here a user with up to
//! 16 read states gets a block of exactly that many, larger users one at
//! most an eighth too large, and a block is found from the user's length
//! alone, so a user carries only a `u32` index. The arena grows a chunk at
//! a time and never copies what it holds.
//!
//! Freed blocks are reused by the next user of their class; chunks are kept
//! (a shard refills what it evicted).

use crate::read_state::{Key, ReadState};

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
    CAPACITIES.partition_point(|&cap| (cap as usize) < len)
}

/// What fills a block's unused tail.
const FILLER: ReadState = ReadState::new(Key::channel(0));

/// The blocks of one capacity.
#[derive(Debug)]
struct Class {
    capacity: usize,
    /// Blocks per full chunk.
    per_chunk: usize,
    /// Full chunks, then the one filling up.
    chunks: Vec<Vec<ReadState>>,
    /// Blocks handed out and given back.
    free: Vec<u32>,
    /// Blocks ever made.
    made: u32,
}

impl Class {
    fn new(capacity: usize) -> Class {
        let size = capacity * size_of::<ReadState>();
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
            // Only the blocks written become resident.
            self.chunks.push(Vec::with_capacity(full));
        }
        let chunk = self.chunks.last_mut().expect("pushed above");
        chunk.resize(chunk.len() + self.capacity, FILLER);
        self.made += 1;
        Block(self.made - 1)
    }
}

/// One shard's blocks, by class.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    classes: Vec<Class>,
}

impl Arena {
    /// The `len` read states in `block`.
    pub(crate) fn get(&self, block: Block, len: usize) -> &[ReadState] {
        if len == 0 {
            return &[];
        }
        let class = &self.classes[class_of(len)];
        let (chunk, range) = class.range(block);
        &class.chunks[chunk][range][..len]
    }

    /// Stores `entries` for a user whose block was `block`, holding `len`:
    /// in the same block if their class is the same, else in a new one (the
    /// old one is freed). Returns the user's block.
    pub(crate) fn put(&mut self, block: Block, len: usize, entries: &[ReadState]) -> Block {
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

    /// Gives back the block of a user holding `len` read states.
    pub(crate) fn free(&mut self, block: Block, len: usize) {
        if len > 0 {
            self.classes[class_of(len)].free.push(block.0);
        }
    }

    fn class(&mut self, class: usize) -> &mut Class {
        while self.classes.len() <= class {
            let capacity = CAPACITIES[self.classes.len()] as usize;
            self.classes.push(Class::new(capacity));
        }
        &mut self.classes[class]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
