//! Cassandra or ScyllaDB, through the scylla driver: the production store.
//!
//! One partition per user (`schema/002_read_states.cql`, `004_*`); one row
//! per channel counted by channel (`007_*`). A load is one
//! partition read; a write is one single-partition unlogged batch (split in
//! chunks for very large users, never across partitions), every statement
//! prepared and idempotent, every row stamped `USING TIMESTAMP` with its
//! version, so retries are safe and a stale node's late write loses to a newer
//! one. Requests are routed token-aware (and to the local datacenter when one
//! is named), at a configurable consistency, with the driver's default retry
//! policy.

pub mod schema;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::TryStreamExt;
use scylla::client::execution_profile::ExecutionProfile;
use scylla::client::session::Session;
use scylla::client::session_builder::SessionBuilder;
use scylla::policies::load_balancing::DefaultPolicy;
use scylla::policies::retry::DefaultRetryPolicy;
use scylla::serialize::row::SerializeRow;
use scylla::statement::Consistency;
use scylla::statement::batch::{Batch, BatchType};
use scylla::statement::prepared::PreparedStatement;
use scylla::value::MaybeUnset;

use super::{Store, StoreError, StoredUser, UserWrite};
use crate::channel_state::ChannelState;
use crate::clock;
use crate::read_state::{Kind, ReadState, TOMBSTONE_RETENTION, saturated_count};

const NAME: &str = "cassandra";
/// Statements per batch: well under Cassandra's 5 KiB batch-size warning.
const MAX_BATCH_STATEMENTS: usize = 50;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Tombstone rows live this much past their retention: the delta floor is
/// taken 7 days back on the version clock (a hybrid clock that can run ahead
/// of the wall clock), while the TTL counts 7 days of a server's wall clock
/// from the write, in whole seconds. Without a margin a delta from just
/// before a deletion could miss it and still say `partial = true`.
pub const TOMBSTONE_TTL_MARGIN: Duration = Duration::from_secs(24 * 3600);

/// How to reach the cluster.
#[derive(Clone, Debug)]
pub struct CassandraConfig {
    /// `host:port` contact points.
    pub nodes: Vec<String>,
    pub keyspace: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub consistency: Consistency,
    /// Route to this datacenter's nodes only.
    pub datacenter: Option<String>,
    /// The keyspace's replication map, for `migrate`.
    pub replication: String,
}

#[derive(Debug)]
pub struct CassandraStore {
    session: Session,
    load: PreparedStatement,
    upsert: PreparedStatement,
    statics: PreparedStatement,
    wipe: PreparedStatement,
    /// A user's deletion memory (`schema/009_lowered.cql`).
    lowered: PreparedStatement,
    load_channels: PreparedStatement,
    write_channel: PreparedStatement,
}

impl CassandraStore {
    /// Connects and prepares the statements; the schema must exist (see
    /// [`schema::migrate`]).
    pub async fn connect(config: &CassandraConfig) -> Result<CassandraStore, StoreError> {
        let session = connect(config).await?;
        CassandraStore::with_session(session, &config.keyspace).await
    }

    pub async fn with_session(
        session: Session,
        keyspace: &str,
    ) -> Result<CassandraStore, StoreError> {
        let keyspace = schema::checked_keyspace(keyspace)?;
        let table = format!("{keyspace}.read_states");
        let prepare = |cql: String| {
            let session = &session;
            async move {
                let mut statement = session.prepare(cql).await.map_err(error)?;
                statement.set_is_idempotent(true);
                Ok::<_, StoreError>(statement)
            }
        };
        let load = prepare(format!(
            "SELECT kind, channel_id, last_acked_id, mention_count, unread_count, version, deleted, \
             user_version, delta_floor, last_message_id, muted, parent_id, lowered FROM {table} \
             WHERE user_id = ?"
        ))
        .await?;
        let upsert = prepare(format!(
            "INSERT INTO {table} (user_id, kind, channel_id, last_acked_id, mention_count, unread_count, \
             version, deleted, last_message_id, muted, parent_id) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ? AND TTL ?"
        ))
        .await?;
        let statics = prepare(format!(
            "UPDATE {table} USING TIMESTAMP ? SET user_version = ?, delta_floor = ? WHERE user_id = ?"
        ))
        .await?;
        let lowered = prepare(format!(
            "UPDATE {table} USING TIMESTAMP ? AND TTL ? SET lowered = ? WHERE user_id = ?"
        ))
        .await?;
        let wipe = prepare(format!(
            "DELETE FROM {table} USING TIMESTAMP ? WHERE user_id = ?"
        ))
        .await?;
        let channels = format!("{keyspace}.channel_states");
        let load_channels = prepare(format!(
            "SELECT channel_id, version, counted_from, last_message_id, dropped_up_to, recent \
             FROM {channels}"
        ))
        .await?;
        let write_channel = prepare(format!(
            "INSERT INTO {channels} (channel_id, version, counted_from, last_message_id, \
             dropped_up_to, recent) VALUES (?, ?, ?, ?, ?, ?) USING TIMESTAMP ?"
        ))
        .await?;
        Ok(CassandraStore {
            session,
            load,
            upsert,
            statics,
            wipe,
            lowered,
            load_channels,
            write_channel,
        })
    }
}

/// A session: token-aware, datacenter-aware when asked, idempotent retries.
pub async fn connect(config: &CassandraConfig) -> Result<Session, StoreError> {
    let mut routing = DefaultPolicy::builder().token_aware(true);
    if let Some(datacenter) = &config.datacenter {
        routing = routing
            .prefer_datacenter(datacenter.clone())
            .permit_dc_failover(false);
    }
    let profile = ExecutionProfile::builder()
        .consistency(config.consistency)
        .load_balancing_policy(routing.build())
        .retry_policy(Arc::new(DefaultRetryPolicy::new()))
        .request_timeout(Some(REQUEST_TIMEOUT))
        .build();
    let mut builder = SessionBuilder::new()
        .known_nodes(&config.nodes)
        .connection_timeout(REQUEST_TIMEOUT)
        .default_execution_profile_handle(profile.into_handle());
    if let Some(username) = &config.username {
        builder = builder.user(username, config.password.as_deref().unwrap_or_default());
    }
    builder
        .build()
        .await
        .map_err(|e| StoreError::new(NAME, format!("connect to {}: {e}", config.nodes.join(","))))
}

type Row = (
    Option<i32>,
    Option<i64>,
    Option<i64>,
    Option<i32>,
    Option<i32>,
    Option<i64>,
    Option<bool>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<bool>,
    Option<i64>,
    Option<Vec<u8>>,
);

#[async_trait]
impl Store for CassandraStore {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn load(&self, user_id: u64) -> Result<StoredUser, StoreError> {
        let result = self
            .session
            .execute_unpaged(&self.load, (user_id as i64,))
            .await
            .map_err(error)?;
        let rows = result.into_rows_result().map_err(error)?;
        let mut user = StoredUser::default();
        for row in rows.rows::<Row>().map_err(error)? {
            let (
                kind,
                channel_id,
                last_acked_id,
                mention_count,
                unread_count,
                version,
                deleted,
                user_version,
                floor,
                last_message_id,
                muted,
                parent_id,
                lowered,
            ) = row.map_err(error)?;
            if let Some(lowered) = lowered.filter(|_| user.lowered.is_empty()) {
                user.lowered = super::decode_lowered(&lowered);
            }
            // Static columns come with every row, and alone when the user
            // has no rows (after a wipe).
            user.version = user.version.max(user_version.unwrap_or(0) as u64);
            user.delta_floor = user.delta_floor.max(floor.unwrap_or(0) as u64);
            // Every writer writes `version`; a row without one is what a
            // node of the previous version left when its tombstone (which
            // does not write the columns added since) expired: gone.
            let (Some(kind), Some(channel_id), Some(version)) = (kind, channel_id, version) else {
                continue;
            };
            let kind = u8::try_from(kind)
                .ok()
                .and_then(Kind::from_u8)
                .ok_or_else(|| {
                    StoreError::new(NAME, format!("user {user_id}: unknown kind {kind}"))
                })?;
            // Columns added later (004) are null in older rows.
            let count = |c: Option<i32>| saturated_count(c.unwrap_or(0).max(0) as u32);
            if let Some(parent) = parent_id.filter(|_| kind == Kind::Thread) {
                user.parents.insert(channel_id as u64, parent as u64);
            }
            user.read_states.push(ReadState {
                channel_id: channel_id as u64,
                last_acked_id: last_acked_id.unwrap_or(0) as u64,
                last_message_id: last_message_id.unwrap_or(0) as u64,
                version: version as u64,
                mention_count: count(mention_count),
                unread_count: count(unread_count),
                kind,
                deleted: deleted.unwrap_or(false),
                muted: muted.unwrap_or(false),
            });
        }
        // Tombstones under the floor are as good as gone (their TTL will
        // remove them).
        let floor = user.delta_floor;
        user.read_states
            .retain(|s| !(s.deleted && s.version < floor));
        Ok(user)
    }

    async fn write(&self, write: &UserWrite) -> Result<(), StoreError> {
        self.write_batches(write, usize::MAX).await
    }

    async fn load_channels(&self) -> Result<Vec<ChannelState>, StoreError> {
        let pager = (self.session)
            .execute_iter(self.load_channels.clone(), ())
            .await
            .map_err(error)?;
        let rows = pager.rows_stream::<ChannelRow>().map_err(error)?;
        let rows: Vec<ChannelRow> = rows.try_collect().await.map_err(error)?;
        let id = |id: Option<i64>| id.unwrap_or(0) as u64;
        Ok(rows
            .into_iter()
            .map(
                |(channel_id, version, counted_from, last, dropped, recent)| {
                    let recent = recent.unwrap_or_default().into_iter().map(|i| i as u64);
                    ChannelState::from_stored(
                        channel_id as u64,
                        id(counted_from),
                        id(last),
                        id(dropped),
                        recent.collect(),
                        id(version),
                    )
                },
            )
            .collect())
    }

    async fn write_channel(&self, channel: &ChannelState) -> Result<(), StoreError> {
        let version = channel.version() as i64;
        let values = (
            channel.channel_id() as i64,
            version,
            channel.counted_from() as i64,
            channel.last_message_id() as i64,
            channel.dropped_up_to() as i64,
            channel.recent().map(|id| id as i64).collect::<Vec<_>>(),
            version,
        );
        (self.session)
            .execute_unpaged(&self.write_channel, values)
            .await
            .map_err(error)?;
        Ok(())
    }
}

/// channel_id, version, counted_from, last_message_id, dropped_up_to, recent.
type ChannelRow = (
    i64,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<Vec<i64>>,
);

impl CassandraStore {
    /// Writes the first `limit` batches of `write` (all of them in
    /// [`Store::write`]; tests stop early to see what a write cut between
    /// batches leaves behind).
    #[doc(hidden)]
    pub async fn write_batches(&self, write: &UserWrite, limit: usize) -> Result<(), StoreError> {
        let user_id = write.user_id as i64;
        let tombstone_ttl = (TOMBSTONE_RETENTION + TOMBSTONE_TTL_MARGIN).as_secs() as i32;
        let mut statements: Vec<(&PreparedStatement, Box<dyn SerializeRow + Send + Sync>)> =
            Vec::with_capacity(write.read_states.len() + 3);
        if let Some(below) = write.clear_below {
            // Everything written before the wipe, nothing written after it.
            let timestamp = below.saturating_sub(1) as i64;
            statements.push((&self.wipe, Box::new((timestamp, user_id))));
            // In the wipe's own batch, so that a write cut after it still
            // keeps the user's version and delta floor (the partition
            // deletion removes the static columns too): the user as of the
            // wipe, written at the wipe's version.
            let below = below as i64;
            let statics = (below, below, write.delta_floor as i64, user_id);
            statements.push((&self.statics, Box::new(statics)));
        }
        for state in &write.read_states {
            let ttl = if state.deleted { tombstone_ttl } else { 0 };
            let version = state.version as i64;
            let values = (
                user_id,
                i32::from(state.kind as u8),
                state.channel_id as i64,
                state.last_acked_id as i64,
                i32::from(state.mention_count),
                i32::from(state.unread_count),
                version,
                state.deleted,
                state.last_message_id as i64,
                state.muted,
                // Unset but on a thread row (a null would write a
                // tombstone into every row).
                match write.parents.get(&state.channel_id) {
                    Some(&parent) if state.kind == Kind::Thread => MaybeUnset::Set(parent as i64),
                    _ => MaybeUnset::Unset,
                },
                version,
                ttl,
            );
            statements.push((&self.upsert, Box::new(values)));
        }
        if let Some(until) = write.lowered.iter().map(|l| l.until_ms).max() {
            // Gone with the last window, as the memory forgets it.
            let left = until.saturating_sub(clock::now_micros() / 1000) / 1000 + 1;
            let ttl = i32::try_from(left).unwrap_or(i32::MAX);
            let lowered = (
                write.version as i64,
                ttl,
                super::encode_lowered(&write.lowered),
                user_id,
            );
            statements.push((&self.lowered, Box::new(lowered)));
        }
        // Last, so that a user version is never stored ahead of its rows.
        let version = write.version as i64;
        let statics = (version, version, write.delta_floor as i64, user_id);
        statements.push((&self.statics, Box::new(statics)));

        for chunk in statements.chunks(MAX_BATCH_STATEMENTS).take(limit) {
            let mut batch = Batch::new(BatchType::Unlogged);
            batch.set_is_idempotent(true);
            let mut values: Vec<&(dyn SerializeRow + Send + Sync)> =
                Vec::with_capacity(chunk.len());
            for (statement, row) in chunk {
                batch.append_statement((*statement).clone());
                values.push(row.as_ref());
            }
            self.session.batch(&batch, values).await.map_err(error)?;
        }
        Ok(())
    }

    /// The session, for tests that look at what CQL sees.
    #[doc(hidden)]
    pub fn session(&self) -> &Session {
        &self.session
    }
}

fn error(e: impl std::fmt::Display) -> StoreError {
    StoreError::new(NAME, e)
}
