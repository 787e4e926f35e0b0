//! A first-in first-out queue in fixed chunks: the write-behind queue of a
//! shard holds one entry per user with unwritten changes, so it grows to
//! hundreds of thousands.
//!
//! A `VecDeque` doubles: it copies every entry under the shard lock when it
//! grows (a latency spike for every request on the shard) and leaves the
//! buffers it outgrew to the allocator, which keeps much of them resident.
//! Chunks are never copied and are given back as the queue drains.

use std::collections::VecDeque;

/// Entries per chunk.
const CHUNK: usize = 4096;

#[derive(Debug)]
pub(crate) struct Fifo<T> {
    /// Full chunks but the last; the front one read from `head` on.
    chunks: VecDeque<Vec<T>>,
    head: usize,
}

impl<T: Copy> Fifo<T> {
    pub(crate) fn new() -> Fifo<T> {
        Fifo {
            chunks: VecDeque::new(),
            head: 0,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.chunks
            .front()
            .is_none_or(|chunk| self.head == chunk.len())
    }

    pub(crate) fn front(&self) -> Option<&T> {
        self.chunks.front()?.get(self.head)
    }

    pub(crate) fn push_back(&mut self, entry: T) {
        match self.chunks.back_mut() {
            Some(chunk) if chunk.len() < CHUNK => chunk.push(entry),
            _ => {
                let mut chunk = Vec::with_capacity(CHUNK);
                chunk.push(entry);
                self.chunks.push_back(chunk);
            }
        }
    }

    pub(crate) fn pop_front(&mut self) -> Option<T> {
        let entry = *self.front()?;
        self.head += 1;
        let more = self.chunks.len() > 1;
        let front = self.chunks.front_mut().expect("an entry was read");
        if self.head == front.len() {
            self.head = 0;
            if front.len() == CHUNK || more {
                self.chunks.pop_front();
            } else {
                // The last chunk, partly filled: emptied and kept, so that a
                // queue holding a few entries allocates nothing.
                front.clear();
            }
        }
        Some(entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_come_out_in_the_order_they_went_in_across_chunks() {
        let mut fifo = Fifo::new();
        let mut model = VecDeque::new();
        let mut rng = fastrand::Rng::with_seed(7);
        let mut next = 0u32;
        for _ in 0..50_000 {
            // Pushes outnumber pops at first, then pops drain it.
            let push = if model.len() < 3 * CHUNK {
                rng.u8(..) < 160
            } else {
                rng.u8(..) < 90
            };
            if push {
                fifo.push_back(next);
                model.push_back(next);
                next += 1;
            } else {
                assert_eq!(fifo.pop_front(), model.pop_front());
            }
            assert_eq!(fifo.front(), model.front());
            assert_eq!(fifo.is_empty(), model.is_empty());
        }
        while let Some(entry) = model.pop_front() {
            assert_eq!(fifo.pop_front(), Some(entry));
        }
        assert_eq!((fifo.pop_front(), fifo.is_empty()), (None, true));
        assert!(fifo.chunks.len() <= 1, "drained chunks are given back");
    }
}
