//! The ring in Cassandra (`schema/005_ring.cql`): one row changed only by
//! lightweight transactions on its epoch, read at SERIAL consistency, so
//! every node and every `readstates ring` sees the last change that won,
//! across datacenters too.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use readstates_routing::ring::NO_OWNER;
use readstates_routing::{Node, Ring, SLOTS};
use scylla::client::session::Session;
use scylla::statement::prepared::PreparedStatement;
use scylla::statement::{Consistency, SerialConsistency};
use scylla::value::{CqlValue, Row};

use super::{LeaseRecord, RingRecord, RingStore};
use crate::store::StoreError;
use crate::store::cassandra::{CassandraConfig, connect, schema};

const NAME: &str = "cassandra ring";

/// How a node list is stored: (id, address, weight), sorted by id.
type StoredNodes = Vec<(String, String, i32)>;

#[derive(Debug)]
pub struct CassandraRingStore {
    session: Session,
    load: PreparedStatement,
    create: PreparedStatement,
    advance: PreparedStatement,
    release: PreparedStatement,
    report: PreparedStatement,
    progress: PreparedStatement,
    drained: PreparedStatement,
    set_drained: PreparedStatement,
    lease: PreparedStatement,
    create_lease: PreparedStatement,
    swap_lease: PreparedStatement,
}

impl CassandraRingStore {
    /// Connects and prepares the statements; the schema must exist.
    pub async fn connect(config: &CassandraConfig) -> Result<CassandraRingStore, StoreError> {
        let session = connect(config).await?;
        CassandraRingStore::with_session(session, &config.keyspace).await
    }

    pub async fn with_session(
        session: Session,
        keyspace: &str,
    ) -> Result<CassandraRingStore, StoreError> {
        let keyspace = schema::checked_keyspace(keyspace)?;
        let prepare = |cql: String, serial: bool| {
            let session = &session;
            async move {
                let mut statement = session.prepare(cql).await.map_err(error)?;
                if serial {
                    statement.set_serial_consistency(Some(SerialConsistency::Serial));
                }
                Ok::<_, StoreError>(statement)
            }
        };
        let columns = "epoch, nodes, owners, previous_nodes, previous_owners, released";
        let mut load = prepare(
            format!("SELECT {columns} FROM {keyspace}.ring WHERE name = 'ring'"),
            false,
        )
        .await?;
        // A read of what lightweight transactions wrote must take part in
        // them: at SERIAL it completes any change still in progress.
        load.set_consistency(Consistency::Serial);
        load.set_is_idempotent(true);
        let create = prepare(
            format!(
                "INSERT INTO {keyspace}.ring (name, {columns}) VALUES ('ring', ?, ?, ?, ?, ?, ?) \
                 IF NOT EXISTS"
            ),
            true,
        )
        .await?;
        let advance = prepare(
            format!(
                "UPDATE {keyspace}.ring SET epoch = ?, nodes = ?, owners = ?, previous_nodes = ?, \
                 previous_owners = ?, released = ? WHERE name = 'ring' IF epoch = ?"
            ),
            true,
        )
        .await?;
        let release = prepare(
            format!(
                "UPDATE {keyspace}.ring SET released = released + ? WHERE name = 'ring' IF epoch = ?"
            ),
            true,
        )
        .await?;
        let mut report = prepare(
            format!("UPDATE {keyspace}.ring_progress SET epoch = ? WHERE node = ?"),
            false,
        )
        .await?;
        report.set_is_idempotent(true);
        let mut progress = prepare(
            format!("SELECT node, epoch FROM {keyspace}.ring_progress"),
            false,
        )
        .await?;
        progress.set_is_idempotent(true);
        let mut drained = prepare(
            format!("SELECT drained_weight FROM {keyspace}.ring_progress WHERE node = ?"),
            false,
        )
        .await?;
        drained.set_is_idempotent(true);
        let mut set_drained = prepare(
            format!("UPDATE {keyspace}.ring_progress SET drained_weight = ? WHERE node = ?"),
            false,
        )
        .await?;
        set_drained.set_is_idempotent(true);
        let mut lease = prepare(
            format!(
                "SELECT holder, renewals, backup, lease_ms FROM {keyspace}.ring_leases WHERE node = ?"
            ),
            false,
        )
        .await?;
        lease.set_consistency(Consistency::Serial);
        lease.set_is_idempotent(true);
        let create_lease = prepare(
            format!(
                "INSERT INTO {keyspace}.ring_leases (node, holder, renewals, backup, lease_ms) \
                 VALUES (?, ?, ?, ?, ?) IF NOT EXISTS"
            ),
            true,
        )
        .await?;
        let swap_lease = prepare(
            format!(
                "UPDATE {keyspace}.ring_leases SET holder = ?, renewals = ?, backup = ?, \
                 lease_ms = ? WHERE node = ? IF holder = ? AND renewals = ?"
            ),
            true,
        )
        .await?;
        Ok(CassandraRingStore {
            session,
            load,
            create,
            advance,
            release,
            report,
            progress,
            drained,
            set_drained,
            lease,
            create_lease,
            swap_lease,
        })
    }

    /// Runs a lightweight transaction; whether it applied.
    async fn transact(
        &self,
        statement: &PreparedStatement,
        values: impl scylla::serialize::row::SerializeRow,
    ) -> Result<bool, StoreError> {
        let result = self
            .session
            .execute_unpaged(statement, values)
            .await
            .map_err(error)?;
        let rows = result.into_rows_result().map_err(error)?;
        // `[applied]` first; when not applied, the row as it is follows.
        let row: Row = rows.first_row().map_err(error)?;
        match row.columns.first() {
            Some(Some(CqlValue::Boolean(applied))) => Ok(*applied),
            other => Err(error(format!("no [applied] column: {other:?}"))),
        }
    }
}

type RecordRow = (
    Option<i64>,
    Option<StoredNodes>,
    Option<Vec<u8>>,
    Option<StoredNodes>,
    Option<Vec<u8>>,
    Option<Vec<String>>,
);

#[async_trait]
impl RingStore for CassandraRingStore {
    async fn load(&self) -> Result<RingRecord, StoreError> {
        let result = self
            .session
            .execute_unpaged(&self.load, ())
            .await
            .map_err(error)?;
        let rows = result.into_rows_result().map_err(error)?;
        let Some(row) = rows.maybe_first_row::<RecordRow>().map_err(error)? else {
            return Ok(RingRecord::empty());
        };
        let (epoch, nodes, owners, previous_nodes, previous_owners, released) = row;
        let epoch = epoch.unwrap_or(0) as u64;
        let ring = decode(epoch, nodes, owners)?;
        let previous = decode(epoch.saturating_sub(1), previous_nodes, previous_owners)?;
        Ok(RingRecord {
            ring,
            previous,
            released: released.unwrap_or_default().into_iter().collect(),
        })
    }

    async fn advance(&self, next: &RingRecord) -> Result<bool, StoreError> {
        let epoch = next.ring.epoch() as i64;
        let (nodes, owners) = (encode_nodes(&next.ring), encode_owners(&next.ring));
        let (previous_nodes, previous_owners) =
            (encode_nodes(&next.previous), encode_owners(&next.previous));
        let released: Vec<String> = next.released.iter().cloned().collect();
        if epoch == 1 {
            let row = (
                epoch,
                nodes,
                owners,
                previous_nodes,
                previous_owners,
                released,
            );
            self.transact(&self.create, row).await
        } else {
            let expected = epoch - 1;
            let row = (
                epoch,
                nodes,
                owners,
                previous_nodes,
                previous_owners,
                released,
                expected,
            );
            self.transact(&self.advance, row).await
        }
    }

    async fn release(&self, epoch: u64, node: &str) -> Result<bool, StoreError> {
        self.transact(&self.release, (vec![node.to_owned()], epoch as i64))
            .await
    }

    async fn report(&self, node: &str, epoch: u64) -> Result<(), StoreError> {
        self.session
            .execute_unpaged(&self.report, (epoch as i64, node))
            .await
            .map_err(error)?;
        Ok(())
    }

    async fn progress(&self) -> Result<BTreeMap<String, u64>, StoreError> {
        let result = self
            .session
            .execute_unpaged(&self.progress, ())
            .await
            .map_err(error)?;
        let rows = result.into_rows_result().map_err(error)?;
        let mut progress = BTreeMap::new();
        for row in rows.rows::<(String, Option<i64>)>().map_err(error)? {
            let (node, epoch) = row.map_err(error)?;
            progress.insert(node, epoch.unwrap_or(0) as u64);
        }
        Ok(progress)
    }

    async fn drained_weight(&self, node: &str) -> Result<Option<u32>, StoreError> {
        let result = self
            .session
            .execute_unpaged(&self.drained, (node,))
            .await
            .map_err(error)?;
        let rows = result.into_rows_result().map_err(error)?;
        let row: Option<(Option<i32>,)> = rows.maybe_first_row().map_err(error)?;
        Ok(row
            .and_then(|(weight,)| weight)
            .map(|w| u32::try_from(w).unwrap_or(0)))
    }

    async fn set_drained_weight(&self, node: &str, weight: Option<u32>) -> Result<(), StoreError> {
        let weight = weight.map(|w| i32::try_from(w).unwrap_or(i32::MAX));
        self.session
            .execute_unpaged(&self.set_drained, (weight, node))
            .await
            .map_err(error)?;
        Ok(())
    }
    async fn lease(&self, node: &str) -> Result<Option<LeaseRecord>, StoreError> {
        let result = self
            .session
            .execute_unpaged(&self.lease, (node,))
            .await
            .map_err(error)?;
        let rows = result.into_rows_result().map_err(error)?;
        type Columns = (Option<String>, Option<i64>, Option<String>, Option<i32>);
        let row: Option<Columns> = rows.maybe_first_row().map_err(error)?;
        Ok(row.map(|(holder, renewals, backup, lease_ms)| LeaseRecord {
            holder: holder.unwrap_or_default(),
            renewals: renewals.unwrap_or(0) as u64,
            backup: backup.unwrap_or_default(),
            lease: lease_ms.map(|ms| Duration::from_millis(ms.max(0) as u64)),
        }))
    }

    async fn swap_lease(
        &self,
        node: &str,
        seen: Option<&LeaseRecord>,
        next: &LeaseRecord,
    ) -> Result<bool, StoreError> {
        let renewals = next.renewals as i64;
        let lease_ms =
            (next.lease).map(|lease| i32::try_from(lease.as_millis()).unwrap_or(i32::MAX));
        match seen {
            None => {
                let values = (node, &next.holder, renewals, &next.backup, lease_ms);
                self.transact(&self.create_lease, values).await
            }
            Some(seen) => {
                let values = (
                    &next.holder,
                    renewals,
                    &next.backup,
                    lease_ms,
                    node,
                    &seen.holder,
                    seen.renewals as i64,
                );
                self.transact(&self.swap_lease, values).await
            }
        }
    }
}

fn encode_nodes(ring: &Ring) -> StoredNodes {
    ring.nodes()
        .iter()
        .map(|n| (n.id.clone(), n.address.clone(), n.weight as i32))
        .collect()
}

/// Big-endian, two bytes a slot.
fn encode_owners(ring: &Ring) -> Vec<u8> {
    ring.owners().iter().flat_map(|o| o.to_be_bytes()).collect()
}

fn decode(
    epoch: u64,
    nodes: Option<StoredNodes>,
    owners: Option<Vec<u8>>,
) -> Result<Ring, StoreError> {
    let nodes: Vec<Node> = nodes
        .unwrap_or_default()
        .into_iter()
        .map(|(id, address, weight)| Node {
            id,
            address,
            weight: weight.max(0) as u32,
        })
        .collect();
    let owners: Vec<u16> = match owners {
        Some(bytes) if !bytes.is_empty() => bytes
            .chunks(2)
            .map(|pair| u16::from_be_bytes([pair[0], pair.get(1).copied().unwrap_or(0)]))
            .collect(),
        // Epoch 0, or the previous ring of epoch 1: nobody owned anything.
        _ => vec![NO_OWNER; SLOTS],
    };
    Ring::from_parts(epoch, nodes, owners).map_err(error)
}

fn error(e: impl std::fmt::Display) -> StoreError {
    StoreError::new(NAME, e)
}
