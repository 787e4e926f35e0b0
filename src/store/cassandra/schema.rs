//! Applies `schema/*.cql` in order: what `readstates migrate` and
//! `serve --init-schema` run. Every statement is `IF NOT EXISTS` or sets a
//! value, so running it again changes nothing.

use std::time::Duration;

use scylla::client::session::Session;
use scylla::statement::unprepared::Statement;

use crate::store::StoreError;

/// How long one schema statement may take: longer than a request's, since
/// a node applies a schema change to its system tables (and flushes them)
/// before it answers, which on a busy node takes seconds; the statements
/// can be run again, so a slow one is waited for rather than failed.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(60);

/// The files of `schema/`, in order, built into the binary.
const MIGRATIONS: [(&str, &str); 12] = [
    (
        "001_keyspace.cql",
        include_str!("../../../schema/001_keyspace.cql"),
    ),
    (
        "002_read_states.cql",
        include_str!("../../../schema/002_read_states.cql"),
    ),
    (
        "003_gc_grace.cql",
        include_str!("../../../schema/003_gc_grace.cql"),
    ),
    (
        "004_watermark_and_mute.cql",
        include_str!("../../../schema/004_watermark_and_mute.cql"),
    ),
    ("005_ring.cql", include_str!("../../../schema/005_ring.cql")),
    (
        "006_drained_weight.cql",
        include_str!("../../../schema/006_drained_weight.cql"),
    ),
    (
        "007_channel_states.cql",
        include_str!("../../../schema/007_channel_states.cql"),
    ),
    (
        "008_thread_parents.cql",
        include_str!("../../../schema/008_thread_parents.cql"),
    ),
    (
        "009_lowered.cql",
        include_str!("../../../schema/009_lowered.cql"),
    ),
    (
        "010_leases.cql",
        include_str!("../../../schema/010_leases.cql"),
    ),
    (
        "011_lease_backup.cql",
        include_str!("../../../schema/011_lease_backup.cql"),
    ),
    (
        "012_lease_duration.cql",
        include_str!("../../../schema/012_lease_duration.cql"),
    ),
];

/// Creates the keyspace (with `replication`, a CQL map) and the tables.
pub async fn migrate(
    session: &Session,
    keyspace: &str,
    replication: &str,
) -> Result<(), StoreError> {
    migrate_first(session, keyspace, replication, MIGRATIONS.len()).await
}

/// Applies only the first `files` files: the schema as an earlier version
/// left it, for upgrade tests.
#[doc(hidden)]
pub async fn migrate_first(
    session: &Session,
    keyspace: &str,
    replication: &str,
    files: usize,
) -> Result<(), StoreError> {
    let keyspace = checked_keyspace(keyspace)?;
    let replication = replication.trim();
    if !(replication.starts_with('{') && replication.ends_with('}')) {
        return Err(StoreError::new(
            "cassandra",
            format!(
                "replication must be a CQL map such as {{'class': 'SimpleStrategy', 'replication_factor': 1}}, not {replication:?}"
            ),
        ));
    }
    for (file, text) in MIGRATIONS.into_iter().take(files) {
        for statement in statements(text) {
            let mut cql = Statement::new(
                statement
                    .replace("${keyspace}", keyspace)
                    .replace("${replication}", replication),
            );
            cql.set_request_timeout(Some(STATEMENT_TIMEOUT));
            session
                .query_unpaged(cql, ())
                .await
                .map_err(|e| StoreError::new("cassandra", format!("schema/{file}: {e}")))?;
        }
        tracing::info!(file, keyspace, "schema applied");
    }
    session
        .await_schema_agreement()
        .await
        .map_err(|e| StoreError::new("cassandra", format!("schema agreement: {e}")))?;
    Ok(())
}

/// A keyspace name goes into CQL text, so only a plain identifier will do.
pub fn checked_keyspace(keyspace: &str) -> Result<&str, StoreError> {
    let mut chars = keyspace.chars();
    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && keyspace.len() <= 48;
    if valid {
        Ok(keyspace)
    } else {
        Err(StoreError::new(
            "cassandra",
            format!(
                "keyspace {keyspace:?}: letters, digits and _ only, starting with a letter, at most 48"
            ),
        ))
    }
}

/// The statements of a CQL file: `--` comments dropped, split on `;`.
fn statements(text: &str) -> impl Iterator<Item = String> {
    let code: String = text
        .lines()
        .map(|line| line.split("--").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    code.split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect::<Vec<_>>()
        .into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_files_split_into_statements() {
        let all: Vec<String> = MIGRATIONS
            .iter()
            .flat_map(|(_, text)| statements(text))
            .collect();
        assert_eq!(all.len(), 14);
        assert!(all[0].starts_with("CREATE KEYSPACE IF NOT EXISTS ${keyspace}"));
        assert!(all[1].contains("PRIMARY KEY ((user_id), kind, channel_id)"));
        assert!(all[2].starts_with("ALTER TABLE ${keyspace}.read_states WITH gc_grace_seconds"));
        assert!(all[3..5].iter().all(|s| s.contains(" ADD IF NOT EXISTS ")));
        assert!(all[5].starts_with("CREATE TABLE IF NOT EXISTS ${keyspace}.ring ("));
        assert!(all[6].starts_with("CREATE TABLE IF NOT EXISTS ${keyspace}.ring_progress ("));
        assert!(
            all[7].starts_with(
                "ALTER TABLE ${keyspace}.ring_progress ADD IF NOT EXISTS drained_weight"
            )
        );
        assert!(all[8].starts_with("CREATE TABLE IF NOT EXISTS ${keyspace}.channel_states ("));
        assert!(all[11].starts_with("CREATE TABLE IF NOT EXISTS ${keyspace}.ring_leases ("));
        assert!(
            all[12].starts_with("ALTER TABLE ${keyspace}.ring_leases ADD IF NOT EXISTS backup")
        );
        assert!(
            all[13].starts_with("ALTER TABLE ${keyspace}.ring_leases ADD IF NOT EXISTS lease_ms")
        );
        assert!(all.iter().all(|s| !s.contains("--")));
    }

    #[test]
    fn keyspace_names_are_identifiers() {
        assert!(checked_keyspace("readstates_test1").is_ok());
        for bad in ["", "1abc", "a-b", "a; DROP TABLE x", &"a".repeat(49)] {
            assert!(checked_keyspace(bad).is_err(), "{bad:?}");
        }
    }
}
