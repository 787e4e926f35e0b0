//! The embedded store against a disk that fails: a file backend that returns
//! I/O errors on command.

use std::io;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use redb::BackendError;

use super::*;
use crate::channel_state::ChannelState;
use crate::read_state::{Key, MAX_COUNT, UserReadStates};
use crate::store::UserWrite;

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

/// A file written by the version before the watermark (25-byte rows, made by
/// that version's `EmbeddedStore` at commit a922f91): this version reads it,
/// with watermark 0 and nothing muted, and writes beside it.
#[tokio::test]
async fn reads_a_file_written_before_the_watermark() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/embedded-before-watermark/readstates.redb"
    );
    std::fs::copy(fixture, dir.path().join(FILE_NAME)).unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();

    let mut user = store.load(42).await.unwrap();
    user.read_states.sort_by_key(ReadState::key);
    assert_eq!(
        (user.version, user.delta_floor),
        (1_700_000_000_000_300, 1_700_000_000_000_000)
    );
    let state = |channel_id, kind, acked, mentions, unread, version, deleted| ReadState {
        last_acked_id: acked,
        mention_count: mentions,
        unread_count: unread,
        version,
        deleted,
        ..ReadState::new(Key { kind, channel_id })
    };
    assert_eq!(
        user.read_states,
        vec![
            state(1001, Kind::Channel, 500, 2, 7, 1_700_000_000_000_100, false),
            state(1003, Kind::Channel, 0, 0, 0, 1_700_000_000_000_300, true),
            state(
                1002,
                Kind::GuildEvent,
                600,
                0,
                1,
                1_700_000_000_000_200,
                false
            ),
        ]
    );
    let other = store.load(43).await.unwrap();
    assert_eq!(
        other.read_states[0].mention_count, MAX_COUNT,
        "a count stored above 65,535 saturates"
    );

    // Rows of both formats side by side.
    let mut newer = user.read_states[0];
    newer.last_message_id = 510;
    newer.muted = true;
    newer.version += 1_000;
    let write = UserWrite {
        user_id: 42,
        version: newer.version,
        delta_floor: user.delta_floor,
        clear_below: None,
        read_states: vec![newer],
        parents: Default::default(),
        lowered: Vec::new(),
    };
    store.write(&write).await.unwrap();
    let mut again = store.load(42).await.unwrap();
    again.read_states.sort_by_key(ReadState::key);
    assert_eq!(again.read_states[0], newer);
    assert_eq!(again.read_states[2], user.read_states[2]);

    // A file from before channels counted by channel has none, and takes them.
    assert_eq!(store.load_channels().await.unwrap(), vec![]);
    let mut channel = ChannelState::switched(7, 100, 1);
    channel.message_created(101, 2);
    store.write_channel(&channel).await.unwrap();
    drop(store);
    let reopened = EmbeddedStore::open(dir.path()).unwrap();
    assert_eq!(reopened.load_channels().await.unwrap(), vec![channel]);
}

#[tokio::test]
async fn a_damaged_channel_row_is_skipped_on_load_and_replaced_by_a_write() {
    for damaged in [vec![1u8; 7], vec![0; 24], vec![0; 33]] {
        assert!(ChannelState::decode(7, &damaged).is_none(), "{damaged:?}");
    }
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let sound = ChannelState::switched(8, 0, 1);
    store.write_channel(&sound).await.unwrap();
    {
        let db = store.database().unwrap();
        let txn = db.begin_write().unwrap();
        let mut channels = txn.open_table(CHANNELS).unwrap();
        channels.insert(7, [1u8; 5].as_slice()).unwrap();
        drop(channels);
        txn.commit().unwrap();
    }
    assert_eq!(store.load_channels().await.unwrap(), vec![sound.clone()]);
    let replaced = ChannelState::switched(7, 0, 1);
    store.write_channel(&replaced).await.unwrap();
    let mut loaded = store.load_channels().await.unwrap();
    loaded.sort_by_key(ChannelState::channel_id);
    assert_eq!(loaded, vec![replaced, sound]);
}
