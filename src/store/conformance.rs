//! The behaviour every store must have, as one check run against each: the
//! in-process stores by the unit tests below, Cassandra by `tests/cassandra`.
//! It writes users `first` and `first + 1`, and channels of those ids, which
//! must not exist yet.

use super::{Store, StoredUser, UserWrite};
use crate::channel_state::ChannelState;
use crate::read_state::{Kind, ReadState};
use crate::recent_deletions::{Deletion, Remembered};

/// A read state with every field set (a live one muted or not by kind), so
/// that a round trip that loses a field fails.
fn state(channel_id: u64, kind: Kind, version: u64, deleted: bool) -> ReadState {
    ReadState {
        channel_id,
        last_acked_id: if deleted { 0 } else { channel_id * 10 },
        last_message_id: if deleted { 0 } else { channel_id * 10 + 7 },
        version,
        mention_count: if deleted { 0 } else { 2 },
        unread_count: if deleted { 0 } else { 3 },
        kind,
        deleted,
        muted: !deleted && kind == Kind::GuildEvent,
    }
}

fn sorted(mut user: StoredUser) -> StoredUser {
    user.read_states.sort_by_key(ReadState::key);
    user
}

/// Panics, naming the broken rule, if `store` misbehaves.
pub async fn check(store: &dyn Store, first: u64) {
    let (one, two) = (first, first + 1);
    assert_eq!(
        store.load(one).await.unwrap(),
        StoredUser::default(),
        "unknown user is empty"
    );

    let a = state(10, Kind::Channel, 5, false);
    let b = state(10, Kind::GuildEvent, 5, false);
    let other = state(99, Kind::Channel, 5, false);
    let write = |user_id, version, delta_floor, clear: bool, read_states| UserWrite {
        user_id,
        version,
        delta_floor,
        clear_below: clear.then_some(version),
        read_states,
        parents: Default::default(),
        lowered: Vec::new(),
    };
    store
        .write(&write(one, 5, 0, false, vec![a, b]))
        .await
        .unwrap();
    store
        .write(&write(two, 5, 0, false, vec![other]))
        .await
        .unwrap();
    let loaded = sorted(store.load(one).await.unwrap());
    assert_eq!(loaded.version, 5);
    assert_eq!(
        loaded.read_states,
        vec![a, b],
        "same channel, two kinds: two rows"
    );

    // Overwrite one, tombstone the other; retrying the same write is harmless.
    let a2 = ReadState {
        last_acked_id: 500,
        version: 7,
        ..a
    };
    let b_gone = state(10, Kind::GuildEvent, 7, true);
    let second = write(one, 7, 0, false, vec![a2, b_gone]);
    store.write(&second).await.unwrap();
    store.write(&second).await.unwrap();
    assert_eq!(
        sorted(store.load(one).await.unwrap()).read_states,
        vec![a2, b_gone]
    );

    // A raised floor purges the tombstones under it.
    store.write(&write(one, 9, 8, false, vec![])).await.unwrap();
    let loaded = store.load(one).await.unwrap();
    assert_eq!((loaded.version, loaded.delta_floor), (9, 8));
    assert_eq!(loaded.read_states, vec![a2]);

    // A wipe removes everything before the write's own rows, and only this user's.
    let c = state(11, Kind::Channel, 12, false);
    store
        .write(&write(one, 12, 12, true, vec![c]))
        .await
        .unwrap();
    assert_eq!(store.load(one).await.unwrap().read_states, vec![c]);
    assert_eq!(store.load(two).await.unwrap().read_states, vec![other]);

    // The stored version never goes backwards.
    store.write(&write(one, 3, 0, false, vec![])).await.unwrap();
    assert_eq!(store.load(one).await.unwrap().version, 12);

    // Writes may land out of order: an older version of a row never
    // replaces a newer one, and a wipe holds against rows from before it.
    let newer = ReadState {
        last_acked_id: 2000,
        version: 20,
        ..other
    };
    let older = ReadState {
        last_acked_id: 1500,
        version: 15,
        ..other
    };
    store
        .write(&write(two, 20, 0, false, vec![newer]))
        .await
        .unwrap();
    store
        .write(&write(two, 15, 0, false, vec![older]))
        .await
        .unwrap();
    let loaded = store.load(two).await.unwrap();
    assert_eq!(loaded.read_states, vec![newer], "the newer row wins");
    assert_eq!(loaded.version, 20);
    store
        .write(&write(two, 30, 30, true, vec![]))
        .await
        .unwrap();
    let late = state(98, Kind::Channel, 25, false);
    store
        .write(&write(two, 25, 0, false, vec![late]))
        .await
        .unwrap();
    assert_eq!(
        store.load(two).await.unwrap().read_states,
        vec![],
        "a row from before a wipe stays wiped when it lands after it"
    );

    check_channels(store, first).await;
    check_threads(store, first).await;
    check_lowered(store, first + 2).await;
}

/// A channel with every field set: recent ids that have dropped one, and its
/// newest message deleted.
fn channel(channel_id: u64, version: u64, messages: u64) -> ChannelState {
    let mut channel = ChannelState::with_capacity(channel_id, 100, version, 3);
    for id in 101..=100 + messages {
        channel.message_created(id, version);
    }
    channel.message_deleted(100 + messages, version);
    channel
}

async fn check_channels(store: &dyn Store, first: u64) {
    let (one, two) = (first, first + 1);
    let ours = |channels: Vec<ChannelState>| {
        let mut ours: Vec<ChannelState> = (channels.into_iter())
            .filter(|c| [one, two].contains(&c.channel_id()))
            .collect();
        ours.sort_by_key(ChannelState::channel_id);
        ours
    };
    assert_eq!(
        ours(store.load_channels().await.unwrap()),
        vec![],
        "none yet"
    );

    let first_state = channel(one, 5, 4);
    assert_eq!(first_state.dropped_up_to(), 101);
    store.write_channel(&first_state).await.unwrap();
    store.write_channel(&channel(two, 5, 1)).await.unwrap();
    let loaded = ours(store.load_channels().await.unwrap());
    assert_eq!(loaded.len(), 2);
    let field_by_field = |c: &ChannelState| {
        let ids = c.recent().collect::<Vec<_>>();
        let ends = (c.counted_from(), c.last_message_id(), c.dropped_up_to());
        (c.channel_id(), c.version(), ends, ids)
    };
    assert_eq!(field_by_field(&loaded[0]), field_by_field(&first_state));
    assert_eq!(loaded[1].recent().len(), 0, "its one message deleted");
    assert_eq!(loaded[1].last_message_id(), 101);

    // Writes may land out of order: an older state never replaces a newer one.
    let newer = channel(one, 9, 6);
    store.write_channel(&newer).await.unwrap();
    store.write_channel(&channel(one, 7, 5)).await.unwrap();
    let loaded = ours(store.load_channels().await.unwrap());
    assert_eq!(field_by_field(&loaded[0]), field_by_field(&newer));
}

/// A thread row keeps its parent, written with it; other rows have none.
async fn check_threads(store: &dyn Store, first: u64) {
    let (thread, other_thread, parent) = (700, 701, 70);
    let written = vec![
        state(thread, Kind::Thread, 100, false),
        state(other_thread, Kind::Thread, 100, true),
        state(parent, Kind::Channel, 100, false),
    ];
    let write = UserWrite {
        user_id: first,
        version: 100,
        delta_floor: 0,
        clear_below: None,
        read_states: written.clone(),
        parents: [(thread, parent), (other_thread, parent)].into(),
        lowered: Vec::new(),
    };
    store.write(&write).await.unwrap();
    let loaded = store.load(first).await.unwrap();
    assert_eq!(
        loaded.parents,
        [(thread, parent), (other_thread, parent)].into(),
        "a thread's parent, a tombstone's too, and none for a channel"
    );
    for state in &written {
        assert!(loaded.read_states.contains(state), "{state:?}");
    }
    let user = loaded.into_user(100);
    assert_eq!(user.view().parent_of(thread), Some(parent));
}

/// What a user was lowered for (the deletion memory) comes back with it;
/// a write without any leaves it, and an older write does not replace it.
async fn check_lowered(store: &dyn Store, first: u64) {
    let until_ms = crate::clock::now_micros() / 1000 + 600_000;
    let remembered = |message_id| Remembered {
        deletion: Deletion {
            channel_id: 10,
            message_id,
            kind: Kind::Channel,
        },
        until_ms,
    };
    let write = |version, lowered| UserWrite {
        user_id: first,
        version,
        delta_floor: 0,
        clear_below: None,
        read_states: vec![state(10, Kind::Channel, version, false)],
        parents: Default::default(),
        lowered,
    };
    let lowered = vec![remembered(5), remembered(6)];
    store.write(&write(200, lowered.clone())).await.unwrap();
    assert_eq!(store.load(first).await.unwrap().lowered, lowered);
    store.write(&write(201, Vec::new())).await.unwrap();
    assert_eq!(store.load(first).await.unwrap().lowered, lowered, "kept");
    store.write(&write(199, vec![remembered(7)])).await.unwrap();
    assert_eq!(store.load(first).await.unwrap().lowered, lowered, "older");
}

#[cfg(test)]
#[tokio::test]
async fn memory_store_conforms() {
    check(&super::memory::MemoryStore::new(), 1).await;
}

#[cfg(test)]
#[tokio::test]
async fn embedded_store_conforms_and_survives_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let store = super::embedded::EmbeddedStore::open(dir.path()).unwrap();
    check(&store, 1).await;
    let before = store.load(1).await.unwrap();
    drop(store);
    let reopened = super::embedded::EmbeddedStore::open(dir.path()).unwrap();
    assert_eq!(reopened.load(1).await.unwrap(), before);
}
