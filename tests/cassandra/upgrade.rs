//! Upgrading to the watermark: `schema/004` run on a keyspace made by the
//! previous schema, rows written the way the previous version writes them
//! read by this one, and both versions writing side by side (a canary).

use readstates::read_state::{Key, Kind, ReadState};
use readstates::store::cassandra::{self, CassandraStore};
use readstates::store::{Store, UserWrite};
use scylla::client::session::Session;

use crate::helpers::{config, nodes};

/// The previous version's write of one row, statement for statement
/// (`src/store/cassandra.rs` at commit a922f91).
async fn write_as_before(session: &Session, keyspace: &str, user_id: i64, row: &ReadState) {
    write_as_before_with_ttl(session, keyspace, user_id, row, 0).await
}

/// [`write_as_before`] with a TTL of `ttl` seconds (the previous version
/// gave tombstone rows 8 days).
async fn write_as_before_with_ttl(
    session: &Session,
    keyspace: &str,
    user_id: i64,
    row: &ReadState,
    ttl: i32,
) {
    let cql = format!(
        "INSERT INTO {keyspace}.read_states (user_id, kind, channel_id, last_acked_id, \
         mention_count, unread_count, version, deleted) VALUES (?, ?, ?, ?, ?, ?, ?, ?) \
         USING TIMESTAMP ? AND TTL ?"
    );
    let version = row.version as i64;
    let values = (
        user_id,
        i32::from(row.kind as u8),
        row.channel_id as i64,
        row.last_acked_id as i64,
        i32::from(row.mention_count),
        i32::from(row.unread_count),
        version,
        row.deleted,
        version,
        ttl,
    );
    session
        .query_unpaged(cql, values)
        .await
        .expect("old insert");
    let statics = format!(
        "UPDATE {keyspace}.read_states USING TIMESTAMP ? SET user_version = ?, delta_floor = ? \
         WHERE user_id = ?"
    );
    session
        .query_unpaged(statics, (version, version, 0i64, user_id))
        .await
        .expect("old statics");
}

#[tokio::test]
async fn the_previous_schema_and_its_rows_upgrade_in_place() {
    let keyspace = format!("readstates_upgrade_{}", readstates::clock::now_micros());
    let mut config = config(&nodes());
    config.keyspace = keyspace.clone();
    let session = cassandra::connect(&config)
        .await
        .unwrap_or_else(|e| panic!("no Cassandra at {}: {e}", nodes()));
    // The keyspace as the previous version made it (schema 001 to 003).
    cassandra::schema::migrate_first(&session, &keyspace, &config.replication, 3)
        .await
        .expect("previous schema");
    let before = ReadState {
        last_acked_id: 500,
        mention_count: 2,
        unread_count: 7,
        version: 1_700_000_000_000_100,
        ..ReadState::new(Key::channel(1001))
    };
    write_as_before(&session, &keyspace, 42, &before).await;

    // The upgrade, twice: idempotent.
    for _ in 0..2 {
        cassandra::schema::migrate(&session, &keyspace, &config.replication)
            .await
            .expect("migrate");
    }
    let store = CassandraStore::with_session(session, &keyspace)
        .await
        .expect("this version's statements prepare on the upgraded table");
    let loaded = store.load(42).await.unwrap();
    assert_eq!(loaded.read_states, vec![before], "watermark 0, not muted");

    // This version writes the new columns...
    let newer = ReadState {
        last_message_id: 520,
        muted: true,
        version: before.version + 100,
        ..ReadState::new(Key {
            kind: Kind::GuildEvent,
            channel_id: 1002,
        })
    };
    let write = UserWrite {
        user_id: 42,
        version: newer.version,
        delta_floor: 0,
        clear_below: None,
        read_states: vec![newer],
        parents: Default::default(),
        lowered: Vec::new(),
    };
    store.write(&write).await.unwrap();
    let mut loaded = store.load(42).await.unwrap().read_states;
    loaded.sort_by_key(ReadState::key);
    assert_eq!(loaded, vec![before, newer]);

    // ...and a node of the previous version, still in the fleet during a
    // canary, writes the same row without them: its columns win by
    // timestamp, the new ones keep what this version wrote.
    let old_node = ReadState {
        last_acked_id: 530,
        version: newer.version + 100,
        ..newer
    };
    write_as_before(store.session(), &keyspace, 42, &old_node).await;
    let row = store.load(42).await.unwrap().read_states;
    let row = row.iter().find(|s| s.kind == Kind::GuildEvent).unwrap();
    assert_eq!(
        (
            row.last_acked_id,
            row.last_message_id,
            row.muted,
            row.version
        ),
        (530, 520, true, old_node.version)
    );

    // Found in review: the previous version's tombstone expires with its
    // TTL, but not the columns it does not write; the row left (watermark
    // and mute only) must not come back as a live read state.
    let tombstone = ReadState {
        deleted: true,
        last_acked_id: 0,
        version: old_node.version + 100,
        ..old_node
    };
    write_as_before_with_ttl(store.session(), &keyspace, 42, &tombstone, 1).await;
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let left = store.load(42).await.unwrap().read_states;
    assert_eq!(left, vec![before], "the expired tombstone's row is gone");
    store
        .session()
        .query_unpaged(format!("DROP KEYSPACE {keyspace}"), ())
        .await
        .expect("drop");
}
