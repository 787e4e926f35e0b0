//! The embedded store against a disk that fails: a file backend that returns
//! I/O errors on command.

use std::io;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use redb::BackendError;

use super::*;
use crate::read_state::UserReadStates;

/// A file backend whose next `failures` writes fail with "file too large".
#[derive(Debug)]
struct FailingDisk {
    inner: FileBackend,
    failures: Arc<AtomicUsize>,
}

impl FailingDisk {
    fn fail(&self) -> Result<(), io::Error> {
        let take = |n: usize| n.checked_sub(1);
        match self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, take)
        {
            Ok(_) => Err(io::Error::from_raw_os_error(27)), // EFBIG
            Err(_) => Ok(()),
        }
    }
}

impl StorageBackend for FailingDisk {
    fn len(&self) -> Result<u64, io::Error> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.fail()?;
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> Result<(), io::Error> {
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        self.fail()?;
        self.inner.write(offset, data)
    }
    fn close(&self) -> Result<(), io::Error> {
        self.inner.close()
    }
    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.try_lock_range(start, end)
    }
    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.inner.try_lock_shared_range(start, end)
    }
    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_range(start, end)
    }
    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_shared_range(start, end)
    }
    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.unlock_range(start, end)
    }
    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.query_lock_range(start, end)
    }
}

fn acked(user_id: u64, channel_id: u64, message_id: u64) -> UserWrite {
    let mut user = UserReadStates::default();
    user.ack(crate::read_state::Key::channel(channel_id), message_id, 1);
    UserWrite::of(user_id, &user)
}

/// Case 3 of "Lossless at every transition": after one transient I/O error
/// redb refused every later write until the database was opened again.
#[tokio::test]
async fn a_transient_io_error_does_not_break_later_writes() {
    let dir = tempfile::tempdir().unwrap();
    let failures = Arc::new(AtomicUsize::new(0));
    let store = EmbeddedStore::open_with(dir.path(), {
        let failures = failures.clone();
        move |inner| FailingDisk {
            inner,
            failures: failures.clone(),
        }
    })
    .unwrap();
    store.write(&acked(1, 10, 100)).await.unwrap();

    failures.store(1, Ordering::SeqCst);
    assert!(
        store.write(&acked(2, 10, 200)).await.is_err(),
        "the disk failed"
    );
    assert_eq!(failures.load(Ordering::SeqCst), 0, "once");

    store.write(&acked(3, 10, 300)).await.unwrap();
    store.write(&acked(2, 10, 200)).await.unwrap();
    for (user_id, message_id) in [(1, 100), (2, 200), (3, 300)] {
        let stored = store.load(user_id).await.unwrap();
        assert_eq!(
            stored.read_states[0].last_acked_id, message_id,
            "user {user_id}"
        );
    }
    drop(store);
    let reopened = EmbeddedStore::open(dir.path()).unwrap();
    assert_eq!(reopened.load(2).await.unwrap().read_states.len(), 1);
}
