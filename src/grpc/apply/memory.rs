//! What the Apply streams hold in memory, in bytes, node-wide: batches
//! read ahead and not begun, and answers not sent yet. Past
//! [`NODE_BYTES`] every stream stops reading until the others' clients
//! read their answers (flow control then slows the senders), so that no
//! mix of streams, valid or not, can take the node's memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// What all Apply streams together may hold before they stop reading.
pub const NODE_BYTES: usize = 256 << 20;

/// The bytes held by every Apply stream of the node.
#[derive(Clone, Debug, Default)]
pub struct Memory {
    held: Arc<AtomicUsize>,
}

impl Memory {
    /// Whether the streams may read more.
    pub fn has_room(&self) -> bool {
        self.held.load(Ordering::Relaxed) < NODE_BYTES
    }

    pub fn take(&self, bytes: usize) {
        self.held.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn give_back(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// `value`, counted as `bytes` until it is taken out or dropped.
    pub fn charge<T>(&self, value: T, bytes: usize) -> Charged<T> {
        self.take(bytes);
        self.counted(value, bytes)
    }

    /// `value`, whose `bytes` are counted already, given back with it.
    pub fn counted<T>(&self, value: T, bytes: usize) -> Charged<T> {
        Charged {
            value: Some(value),
            bytes,
            memory: self.clone(),
        }
    }
}

/// A value counted in [`Memory`] while it is held.
#[derive(Debug)]
pub struct Charged<T> {
    value: Option<T>,
    bytes: usize,
    memory: Memory,
}

impl<T> Charged<T> {
    /// The value, no longer counted.
    pub fn into_inner(mut self) -> T {
        self.value.take().expect("taken once")
    }
}

impl<T> Drop for Charged<T> {
    fn drop(&mut self) {
        self.memory.give_back(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_charged_is_given_back_however_it_goes() {
        let memory = Memory::default();
        let kept = memory.charge(1, NODE_BYTES);
        assert!(!memory.has_room());
        assert_eq!(kept.into_inner(), 1);
        assert!(memory.has_room());
        drop(memory.charge(2, NODE_BYTES));
        assert_eq!(memory.held.load(Ordering::Relaxed), 0);
    }
}
