//! The Cassandra store on its own.

use readstates::read_state::{Key, ReadState, UserReadStates};
use readstates::store::{Store, UserWrite, conformance};

use crate::helpers::{fresh_users, store};

#[tokio::test]
async fn cassandra_store_conforms() {
    let store = store().await;
    conformance::check(&store, fresh_users(2)).await;
}

#[tokio::test]
async fn a_stale_owner_cannot_overwrite_a_newer_row() {
    let store = store().await;
    let user_id = fresh_users(1);
    let key = Key::channel(10);
    let now = readstates::clock::now_micros();

    // The node that owns the user now writes version `now + 100`.
    let mut current = UserReadStates::default();
    current.ack(key, 500, now + 100);
    store
        .write(&UserWrite::of(user_id, &current))
        .await
        .unwrap();

    // A node that owned it before writes late, with its older version.
    let mut stale = UserReadStates::default();
    stale.manual_ack(key, 100, 7, 7, now);
    store.write(&UserWrite::of(user_id, &stale)).await.unwrap();

    let loaded = store.load(user_id).await.unwrap();
    let row: &ReadState = &loaded.read_states[0];
    assert_eq!(
        (row.last_acked_id, row.mention_count, row.version),
        (500, 0, now + 100)
    );
    assert_eq!(
        loaded.version,
        now + 100,
        "the user version is not set back either"
    );
}

#[tokio::test]
async fn a_large_user_is_written_in_single_partition_chunks() {
    let store = store().await;
    let user_id = fresh_users(1);
    let mut user = UserReadStates::default();
    let now = readstates::clock::now_micros();
    for channel_id in 1..=260 {
        user.ack(Key::channel(channel_id), channel_id * 10, now);
    }
    store.write(&UserWrite::of(user_id, &user)).await.unwrap();
    let loaded = store.load(user_id).await.unwrap();
    assert_eq!(loaded.read_states.len(), 260);
    assert_eq!(loaded.version, user.version());
}
