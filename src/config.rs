//! Configuration, layered: built-in defaults, then a TOML file (`--config`),
//! then environment variables (`READSTATES_<FLAG>`), then flags.
//!
//! Each setting is listed once, in the `settings!` block below: its doc,
//! flag, environment variable, type and default. From it come [`Settings`]
//! (the flags and the file's keys, every field optional) and [`Config`] (every
//! field resolved). `config/readstates.toml` and the table in `docs/operations.md` document
//! every key, and a test checks that they name them all.
//!
//! Beside it: [`cli`] (the commands and their arguments) and [`check`]
//! (settings that cannot work together).

mod check;
mod cli;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::cache::{CacheConfig, handoff};
use crate::cluster::credential::FleetCredential;
use crate::cluster::lease::LeaseConfig;
use crate::journal::{JournalConfig, JournalMode};
use crate::store::cassandra::CassandraConfig;
use crate::tls::TlsFiles;
pub use cli::{Cli, Command, RingAction, RingArgs, ServeArgs, WaitArgs};

/// The longest write delay taken: a change may wait this long in memory.
pub const MAX_WRITE_DELAY: Duration = Duration::from_secs(24 * 3600);

/// The node id the `ring` command's fleet tokens name (it asks nodes to let
/// slots go as a node would).
pub const RING_COMMAND: &str = "readstates-ring";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// redb in `data_dir`: durable, nothing else to run.
    Embedded,
    /// A hash map: not durable, for tests and benchmarks.
    Memory,
    /// Cassandra or ScyllaDB.
    Cassandra,
}

/// Cassandra consistency levels that make sense for this service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
#[value(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Consistency {
    One,
    LocalOne,
    Quorum,
    LocalQuorum,
    EachQuorum,
    All,
}

impl From<Consistency> for scylla::statement::Consistency {
    fn from(c: Consistency) -> Self {
        use scylla::statement::Consistency as C;
        match c {
            Consistency::One => C::One,
            Consistency::LocalOne => C::LocalOne,
            Consistency::Quorum => C::Quorum,
            Consistency::LocalQuorum => C::LocalQuorum,
            Consistency::EachQuorum => C::EachQuorum,
            Consistency::All => C::All,
        }
    }
}

/// A value never shown: not in logs, not by `--print-config`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("<redacted>")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

/// What a fleet node asks of the calls other nodes make (see
/// `fleet_secret`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FleetAuth {
    /// The fleet's token on every call a node makes.
    Required,
    /// Also a call with no token, as a node of a build before tokens makes
    /// it: only while such nodes remain in a rolling upgrade (counted in
    /// `readstates_node_calls_refused_total{reason="missing"}`, allowed).
    /// A wrong token is refused still.
    Upgrading,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Declares every setting once: its flag, environment variable and file
/// key (through the attributes, on [`Settings`]), its type and its default.
/// From that list come [`Settings`] (each setting optional: flags,
/// environment and file alike), [`Config`] (each one resolved), the layering
/// and the printing of the configuration.
macro_rules! settings {
    ($(
        $(#[$attribute:meta])*
        $name:ident: $type:ty = $default:expr;
    )*) => {
        /// Every setting, each optional: flags, environment and file alike.
        #[derive(Clone, Debug, Default, Args, Deserialize, Serialize)]
        #[serde(deny_unknown_fields)]
        pub struct Settings {
            $(
                $(#[$attribute])*
                #[serde(skip_serializing_if = "Option::is_none")]
                pub $name: Option<$type>,
            )*
        }

        /// The resolved configuration: every setting given or defaulted.
        #[derive(Clone, Debug)]
        pub struct Config {
            $(pub $name: $type,)*
        }

        impl Settings {
            /// Each setting of `self`, or else of `other`.
            fn or(self, other: Settings) -> Settings {
                Settings {
                    $($name: self.$name.or(other.$name),)*
                }
            }
        }

        impl Config {
            /// Each setting of `s`, or else its default.
            pub fn resolve(s: Settings) -> Config {
                Config {
                    $($name: s.$name.unwrap_or_else(|| $default),)*
                }
            }

            /// Every setting given, for printing.
            fn to_settings(&self) -> Settings {
                Settings {
                    $($name: Some(self.$name.clone()),)*
                }
            }
        }
    };
}

settings! {
    /// gRPC listen address.
    #[arg(long, env = "READSTATES_LISTEN")]
    listen: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 50051));
    /// Prometheus `/metrics` listen address.
    #[arg(long, env = "READSTATES_METRICS_LISTEN")]
    metrics_listen: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 9090));
    #[arg(long, env = "READSTATES_STORE")]
    store: StoreKind = StoreKind::Embedded;
    /// Where the embedded store keeps its file.
    #[arg(long, env = "READSTATES_DATA_DIR")]
    data_dir: PathBuf = PathBuf::from("./data");
    /// How long after a change its write starts; changes within it coalesce.
    /// `0s` is write-through: each change is written before it is answered.
    #[arg(long, env = "READSTATES_WRITE_DELAY", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    write_delay: Duration = Duration::from_secs(30);
    /// When a change is answered relative to its journal sync
    /// (`docs/journal.md`): `sync` (after it: a crash loses nothing
    /// answered), `interval:10ms` (at once, synced that often: a crash
    /// loses at most that) or `off` (a crash loses up to a write delay).
    /// No journal in write-through or with the memory store.
    #[arg(long, env = "READSTATES_JOURNAL")]
    journal: JournalMode = JournalMode::Sync;
    /// The journal's directory; by default `journal` in `data_dir`. On a
    /// volume that outlives the process (a pod's volume claim).
    #[arg(long, env = "READSTATES_JOURNAL_DIR")]
    journal_dir: Option<PathBuf> = None;
    /// Starts even if the journal is corrupt, skipping what cannot be read:
    /// the changes in it are lost (the log says how many bytes).
    #[arg(long, env = "READSTATES_JOURNAL_SKIP_CORRUPT", num_args = 0..=1, default_missing_value = "true")]
    journal_skip_corrupt: bool = false;
    /// `journal = "sync"`: the least time between the starts of two syncs.
    /// Changes made meanwhile share the next sync (each waits at most this
    /// long more); a change after a quiet gap syncs at once. `0s`: a sync
    /// as soon as the last one ends.
    #[arg(long, env = "READSTATES_JOURNAL_SYNC_GAP", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    journal_sync_gap: Duration = Duration::from_millis(1);
    /// Read states held in memory, over all shards.
    #[arg(long, env = "READSTATES_CACHE_CAPACITY")]
    cache_capacity: usize = 10_000_000;
    /// Cache shards, each behind its own lock.
    #[arg(long, env = "READSTATES_SHARDS")]
    shards: usize = 64;
    /// Store writes under way at once (write-behind's and write-through's).
    /// Formerly `flush_concurrency`, still accepted.
    #[arg(
        long,
        alias = "flush-concurrency",
        env = "READSTATES_WRITE_CONCURRENCY"
    )]
    #[serde(alias = "flush_concurrency")]
    write_concurrency: usize = 32;
    /// Read states evicted from the cache before the store took them, beyond
    /// which changes get UNAVAILABLE (memory bound for a failing store).
    #[arg(long, env = "READSTATES_MAX_UNWRITTEN")]
    max_evicted_unwritten: usize = 2_000_000;
    /// Requests in progress beyond which new ones get RESOURCE_EXHAUSTED.
    #[arg(long, env = "READSTATES_MAX_CONCURRENT_REQUESTS")]
    max_concurrent_requests: usize = 10_000;
    /// A request slower than this is logged with where its time went (a
    /// store load, the journal and backup, a forward hop, a hold while its
    /// slot moves here), a few a second at most, and counted in
    /// `readstates_slow_requests_total`. 0: none is.
    #[arg(long, env = "READSTATES_SLOW_REQUEST", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    slow_request: Duration = Duration::from_millis(100);
    /// How long a node remembers each user it lowered for a deleted
    /// message, so that a retry within it lowers nobody twice.
    #[arg(long, env = "READSTATES_DELETION_DEDUP_WINDOW", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    deletion_dedup_window: Duration = Duration::from_secs(600);
    /// The most lowered users remembered at once, over all deleted messages
    /// (memory bound, about 50 bytes each); beyond it the oldest are
    /// forgotten before their window ends.
    #[arg(long, env = "READSTATES_DELETION_DEDUP_CAPACITY")]
    deletion_dedup_capacity: usize = 1_000_000;
    /// Events a Watch stream holds for a client that reads slowly; a user
    /// whose event would not fit gets a resync event instead.
    #[arg(long, env = "READSTATES_WATCH_BUFFER")]
    watch_buffer: usize = 1_024;
    /// Apply streams a node serves at once; one more gets RESOURCE_EXHAUSTED.
    /// Each holds at most a few batches of up to 1,000 items.
    #[arg(long, env = "READSTATES_MAX_APPLY_STREAMS")]
    max_apply_streams: usize = 1_024;
    /// Take thread read states (FollowThread, replies of kind THREAD). Off
    /// until every node of the fleet runs a build that reads them: an older
    /// node cannot load a user who follows a thread.
    #[arg(long, env = "READSTATES_THREADS", num_args = 0..=1, default_missing_value = "true")]
    threads: bool = false;
    /// How long shutdown keeps trying to write unwritten changes.
    #[arg(long, env = "READSTATES_SHUTDOWN_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    shutdown_timeout: Duration = Duration::from_secs(30);
    #[arg(long, env = "READSTATES_LOG_FORMAT")]
    log_format: LogFormat = LogFormat::Text;
    /// A tracing filter, e.g. `info` or `readstates=debug` (RUST_LOG wins).
    #[arg(long, env = "READSTATES_LOG_LEVEL")]
    log_level: String = "info".to_owned();
    /// Cassandra/ScyllaDB contact points, comma-separated `host:port`.
    #[arg(long, env = "READSTATES_CASSANDRA_NODES", value_delimiter = ',')]
    cassandra_nodes: Vec<String> = vec!["127.0.0.1:9042".to_owned()];
    #[arg(long, env = "READSTATES_KEYSPACE")]
    keyspace: String = "readstates".to_owned();
    #[arg(long, env = "READSTATES_CASSANDRA_USERNAME")]
    cassandra_username: Option<String> = None;
    #[arg(long, env = "READSTATES_CASSANDRA_PASSWORD", hide_env_values = true)]
    cassandra_password: Option<Secret> = None;
    #[arg(long, env = "READSTATES_CONSISTENCY")]
    consistency: Consistency = Consistency::LocalQuorum;
    /// Send requests to this datacenter's nodes only.
    #[arg(long, env = "READSTATES_CASSANDRA_DATACENTER")]
    cassandra_datacenter: Option<String> = None;
    /// The keyspace's replication, as a CQL map (used by `migrate`).
    #[arg(long, env = "READSTATES_CASSANDRA_REPLICATION")]
    cassandra_replication: String = "{'class': 'SimpleStrategy', 'replication_factor': 1}".to_owned();
    /// Apply the schema at startup, as `readstates migrate` does.
    #[arg(long, env = "READSTATES_INIT_SCHEMA", num_args = 0..=1, default_missing_value = "true")]
    init_schema: bool = false;
    /// Runs this node as a member of the fleet's ring (kept in Cassandra),
    /// under this id: stable across restarts (a pod or host name). Without
    /// it the node is standalone and serves every user.
    #[arg(long, env = "READSTATES_NODE_ID")]
    node_id: Option<String> = None;
    /// Where the other nodes and the gateways reach this node's gRPC port,
    /// `host:port` (as given to `readstates ring add`); required with
    /// `node_id`.
    #[arg(long, env = "READSTATES_ADVERTISE")]
    advertise: Option<String> = None;
    /// The fleet's shared secret (at least 16 bytes; from a Kubernetes
    /// Secret, say): the nodes prove with it that they are nodes, and only
    /// calls that do may use the Fleet service or speak as a node.
    /// Required with `node_id`; never logged or printed.
    #[arg(long, env = "READSTATES_FLEET_SECRET", hide_env_values = true)]
    fleet_secret: Option<Secret> = None;
    /// `required`: every call a node makes carries its node token (bound
    /// to the fleet, the node and a few minutes). `upgrading`: a call with
    /// the static token of the builds before, or none, is taken too (and
    /// this node sends both tokens), only while nodes of such a build
    /// remain in a rolling upgrade or a canary.
    #[arg(long, env = "READSTATES_FLEET_AUTH")]
    fleet_auth: FleetAuth = FleetAuth::Required;
    /// How often a fleet node reads the ring.
    #[arg(long, env = "READSTATES_RING_POLL", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    ring_poll: Duration = Duration::from_secs(1);
    /// A fleet node serves only while it holds a lease this long, renewed
    /// in the ring store every quarter of it: one frozen or cut off from
    /// the store stops serving within it (see docs/failover.md).
    #[arg(long, env = "READSTATES_LEASE", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    lease: Duration = Duration::from_millis(1_200);
    /// What others add to `lease` before they may take an unrenewed lease
    /// (`readstates ring release --force` waits `lease + lease_margin`):
    /// covers clock-rate drift and a change's last check. Every node and
    /// the `ring` command must use the same values.
    #[arg(long, env = "READSTATES_LEASE_MARGIN", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    lease_margin: Duration = Duration::from_millis(300);
    /// A fleet node streams its journal to the next node of the ring, its
    /// backup, and answers a change once both hold it; should it die, the
    /// backup writes what it held and gives its slots to the others (see
    /// docs/failover.md). Needs `journal = "sync"`. `false`: a node lost
    /// for good loses its last write delay, and its slots wait for it or
    /// for `readstates ring release --force`.
    #[arg(long, env = "READSTATES_BACKUP", num_args = 0..=1, default_missing_value = "true")]
    backup: bool = true;
    /// The most a node holds, in MiB, of the unwritten changes of the
    /// nodes it backs up (their journal batches, until their store takes
    /// them). Past it, a batch is refused: that node answers on its own
    /// journal alone until its store catches up. Alert
    /// `ReadstatesBackupNearBudget` at 80 %.
    #[arg(long, env = "READSTATES_BACKUP_BUDGET_MIB")]
    backup_budget_mib: u64 = 1024;
    /// A fleet node adds itself to the ring at this weight when it is not
    /// in it, and takes back the weight it had when it drained itself (see
    /// `drain_timeout`). Unset: only `readstates ring` changes the ring.
    #[arg(long, env = "READSTATES_JOIN_WEIGHT")]
    join_weight: Option<u32> = None;
    /// On SIGTERM, a fleet node first hands its slots to the others (its
    /// weight set to 0, remembered for `join_weight`) and waits up to this
    /// long for them to serve them, then shuts down. 0: no drain, the
    /// node's slots wait for it to come back.
    #[arg(long, env = "READSTATES_DRAIN_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    drain_timeout: Duration = Duration::ZERO;
    /// Serves gRPC over TLS with this PEM certificate chain (leaf first);
    /// needs `tls_key`. Without it the port is plaintext.
    #[arg(long, env = "READSTATES_TLS_CERT")]
    tls_cert: Option<PathBuf> = None;
    /// The certificate's PEM private key.
    #[arg(long, env = "READSTATES_TLS_KEY")]
    tls_key: Option<PathBuf> = None;
    /// Requires client certificates signed by a CA in this PEM file (mTLS).
    /// A fleet node also verifies the other nodes against it, and presents
    /// its own certificate to them.
    #[arg(long, env = "READSTATES_TLS_CLIENT_CA")]
    tls_client_ca: Option<PathBuf> = None;
    /// How long a client has to finish its TLS handshake before the
    /// connection is closed (half-open handshakes cannot pile up).
    #[arg(long, env = "READSTATES_TLS_HANDSHAKE_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    tls_handshake_timeout: Duration = Duration::from_secs(10);
    /// How often the TLS files are read again: a changed certificate is
    /// served to new connections without a restart.
    #[arg(long, env = "READSTATES_TLS_POLL", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    tls_poll: Duration = Duration::from_secs(10);
}

impl Default for Config {
    fn default() -> Config {
        Config::resolve(Settings::default())
    }
}

impl Config {
    /// Flags and environment over the file (if any) over the defaults.
    pub fn load(args: &ServeArgs) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => Settings::from_file(path)?,
            None => Settings::default(),
        };
        let config = Config::resolve(args.settings.clone().or(file));
        config.check()?;
        Ok(config)
    }

    /// The cache's settings.
    pub fn cache(&self) -> CacheConfig {
        CacheConfig {
            capacity: self.cache_capacity,
            shards: self.shards,
            write_delay: self.write_delay,
            max_evicted_unwritten: self.max_evicted_unwritten,
            write_concurrency: self.write_concurrency,
            deletion_window: self.deletion_dedup_window,
            deletion_capacity: self.deletion_dedup_capacity,
            handoff_chunk: handoff::CHUNK_USERS,
        }
    }

    /// The fleet's lease settings.
    pub fn lease(&self) -> LeaseConfig {
        LeaseConfig {
            duration: self.lease,
            margin: self.lease_margin,
        }
    }

    /// The journal's settings, if changes are journaled: not in
    /// write-through (each change is in the store before it is answered)
    /// nor with the memory store (nothing survives a restart).
    pub fn journal(&self) -> Option<JournalConfig> {
        let kept = !self.write_delay.is_zero() && self.store != StoreKind::Memory;
        if !kept || self.journal == JournalMode::Off {
            return None;
        }
        Some(JournalConfig {
            skip_corrupt: self.journal_skip_corrupt,
            sync_gap: self.journal_sync_gap,
            ..JournalConfig::new(self.journal_dir(), self.journal)
        })
    }

    /// The most bytes this node holds as the backup of others.
    pub fn backup_budget(&self) -> usize {
        usize::try_from(self.backup_budget_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX)
    }

    /// Where the journal is (or would be).
    pub fn journal_dir(&self) -> PathBuf {
        (self.journal_dir.clone()).unwrap_or_else(|| self.data_dir.join("journal"))
    }

    /// The TLS files, if the gRPC port serves TLS.
    pub fn tls_files(&self) -> Option<TlsFiles> {
        Some(TlsFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            client_ca: self.tls_client_ca.clone(),
        })
    }

    /// What this node proves to the fleet's other nodes with, and checks
    /// their calls against (see `fleet_auth`); `None` without a secret (a
    /// standalone node). Its tokens name this node (the `ring` command, which has no node id,
    /// as `readstates-ring`) and this fleet (its keyspace).
    pub fn fleet_credential(&self) -> Option<FleetCredential> {
        let node = self.node_id.as_deref().unwrap_or(RING_COMMAND);
        (self.fleet_secret.as_ref()).map(|secret| {
            FleetCredential::new(secret.expose(), &self.keyspace, node)
                .upgrading(self.fleet_auth == FleetAuth::Upgrading)
        })
    }

    /// The Cassandra part, as the store takes it.
    pub fn cassandra(&self) -> CassandraConfig {
        CassandraConfig {
            nodes: self.cassandra_nodes.clone(),
            keyspace: self.keyspace.clone(),
            username: self.cassandra_username.clone(),
            password: self
                .cassandra_password
                .as_ref()
                .map(|p| p.expose().to_owned()),
            consistency: self.consistency.into(),
            datacenter: self.cassandra_datacenter.clone(),
            replication: self.cassandra_replication.clone(),
        }
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(&self.to_settings())
            .unwrap_or_else(|e| format!("# cannot print the configuration: {e}\n"))
    }
}

/// The service's defaults (here rather than beside the cache, which knows
/// nothing of the service's configuration).
impl Default for CacheConfig {
    fn default() -> CacheConfig {
        Config::default().cache()
    }
}

impl Settings {
    pub fn from_file(path: &Path) -> Result<Settings, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| ConfigError(format!("{}: {e}", path.display())))
    }
}

#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(String);

#[cfg(test)]
mod tests;
