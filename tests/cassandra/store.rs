//! The Cassandra store on its own.

use readstates::read_state::NoChannels;
use readstates::read_state::{Key, ReadState, TOMBSTONE_RETENTION, UserReadStates};
use readstates::store::cassandra;
use readstates::store::{Store, UserWrite, conformance};

use crate::helpers::{KEYSPACE, fresh_users, store};

#[tokio::test]
async fn cassandra_store_conforms() {
    let store = store().await;
    conformance::check(&store, fresh_users(3)).await;
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

/// Case 8 of "Lossless at every transition": tombstone rows expired exactly
/// at the retention, with no margin against the delta floor.
#[tokio::test]
async fn tombstones_outlive_the_retention_by_a_margin() {
    let store = store().await;
    let user_id = fresh_users(1);
    let now = readstates::clock::now_micros();
    let mut user = UserReadStates::default();
    user.ack(Key::channel(10), 100, now);
    user.delete(&[Key::channel(10)], now + 1);
    store.write(&UserWrite::of(user_id, &user)).await.unwrap();

    let cql = format!("SELECT TTL(deleted) FROM {KEYSPACE}.read_states WHERE user_id = ?");
    let rows = store
        .session()
        .query_unpaged(cql, (user_id as i64,))
        .await
        .unwrap()
        .into_rows_result()
        .unwrap();
    let (ttl,): (Option<i32>,) = rows.first_row().unwrap();
    let retention = TOMBSTONE_RETENTION.as_secs() as i32;
    let margin = cassandra::TOMBSTONE_TTL_MARGIN.as_secs() as i32;
    let ttl = ttl.expect("a tombstone has a TTL");
    assert!(ttl > retention + margin - 60, "TTL {ttl} s");
}

/// Case 8: a wipe written in several batches lost the user's version and
/// delta floor when it stopped after the first (the partition deletion
/// removes the static columns, which were written in the last batch).
#[tokio::test]
async fn a_wipe_cut_after_its_first_batch_keeps_the_version_and_floor() {
    let store = store().await;
    let user_id = fresh_users(1);
    let now = readstates::clock::now_micros();
    let mut user = UserReadStates::default();
    for channel_id in 1..=5 {
        user.ack(Key::channel(channel_id), 100, now);
    }
    store.write(&UserWrite::of(user_id, &user)).await.unwrap();

    user.mark_written(user.version());
    user.delete_all(now + 10);
    let wiped_at = user.version();
    for channel_id in 100..220 {
        user.ack(Key::channel(channel_id), 100, now + 20);
    }
    let write = UserWrite::of(user_id, &user);
    assert_eq!(write.clear_below, Some(wiped_at));
    store.write_batches(&write, 1).await.unwrap();

    let loaded = store.load(user_id).await.unwrap();
    assert!(loaded.version >= wiped_at, "version went back: {loaded:?}");
    assert!(loaded.delta_floor >= wiped_at, "the floor was lost");
    assert!(
        loaded.read_states.iter().all(|s| s.channel_id >= 100),
        "the wipe removed the older rows"
    );
    let after = loaded.into_user(now + 30);
    assert!(
        !after.delta(now, &NoChannels).partial,
        "a delta from before the wipe is the full set"
    );
}

/// Case 9: wipes are partition tombstones, kept for `gc_grace_seconds`,
/// which was 3 days: shorter than a weekly repair.
#[tokio::test]
async fn tombstones_outlast_a_weekly_repair() {
    let store = store().await;
    let cql = "SELECT gc_grace_seconds FROM system_schema.tables \
               WHERE keyspace_name = ? AND table_name = 'read_states'";
    let rows = store
        .session()
        .query_unpaged(cql, (KEYSPACE,))
        .await
        .unwrap()
        .into_rows_result()
        .unwrap();
    let (gc_grace,): (i32,) = rows.first_row().unwrap();
    assert!(gc_grace >= 7 * 24 * 3600 + 2 * 24 * 3600, "{gc_grace} s");
}
