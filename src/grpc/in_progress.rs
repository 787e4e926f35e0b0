//! The bound on requests (and stream items) under way on this node. One
//! past it is refused at once, never queued, so a counter is all it takes:
//! a semaphore's release takes a lock for waiters that never come, on
//! every request.

use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Debug)]
pub struct InProgress {
    count: AtomicUsize,
    limit: usize,
}

/// One request under way, until dropped.
#[derive(Debug)]
pub struct Entered<'a>(&'a AtomicUsize);

impl InProgress {
    pub fn new(limit: usize) -> InProgress {
        InProgress {
            count: AtomicUsize::new(0),
            limit,
        }
    }

    /// Counts one more request under way; none if `limit` already are.
    pub fn enter(&self) -> Option<Entered<'_>> {
        self.count
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |count| {
                (count < self.limit).then_some(count + 1)
            })
            .ok()
            .map(|_| Entered(&self.count))
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::InProgress;

    #[test]
    fn requests_past_the_limit_are_refused_until_one_ends() {
        let in_progress = InProgress::new(2);
        let first = in_progress.enter().expect("first");
        let _second = in_progress.enter().expect("second");
        assert!(in_progress.enter().is_none());
        drop(first);
        assert!(in_progress.enter().is_some());
    }
}
