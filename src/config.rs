//! Configuration, layered: built-in defaults, then a TOML file (`--config`),
//! then environment variables (`READSTATES_<FLAG>`), then flags.
//!
//! One struct, [`Settings`], is both the command-line flags and the file's
//! keys, every field optional; [`Config`] is the result with every field
//! resolved. `config/readstates.toml` documents every key.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};

#[derive(Debug, Parser)]
#[command(
    name = "readstates",
    version,
    about = "Read states (last read message, unread and mention counts) over gRPC"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Runs the gRPC server until SIGTERM or Ctrl-C.
    Serve(ServeArgs),
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A TOML file of settings; flags and environment variables override it.
    #[arg(long, env = "READSTATES_CONFIG")]
    pub config: Option<PathBuf>,
    /// Prints the resolved configuration as TOML and exits.
    #[arg(long)]
    pub print_config: bool,
    #[command(flatten)]
    pub settings: Settings,
}

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

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Every setting, each optional: flags, environment and file alike.
#[derive(Clone, Debug, Default, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// gRPC listen address.
    #[arg(long, env = "READSTATES_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Prometheus `/metrics` listen address.
    #[arg(long, env = "READSTATES_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    #[arg(long, env = "READSTATES_STORE")]
    pub store: Option<StoreKind>,
    /// Where the embedded store keeps its file.
    #[arg(long, env = "READSTATES_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// How long after a change its write starts; changes within it coalesce.
    #[arg(long, env = "READSTATES_WRITE_DELAY", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    pub write_delay: Option<Duration>,
    /// Read states held in memory, over all shards.
    #[arg(long, env = "READSTATES_CACHE_CAPACITY")]
    pub cache_capacity: Option<usize>,
    /// Cache shards, each behind its own lock.
    #[arg(long, env = "READSTATES_SHARDS")]
    pub shards: Option<usize>,
    /// Store writes under way at once.
    #[arg(long, env = "READSTATES_FLUSH_CONCURRENCY")]
    pub flush_concurrency: Option<usize>,
    /// Unwritten read states beyond which changes get UNAVAILABLE.
    #[arg(long, env = "READSTATES_MAX_UNWRITTEN")]
    pub max_unwritten: Option<usize>,
    /// Requests in progress beyond which new ones get RESOURCE_EXHAUSTED.
    #[arg(long, env = "READSTATES_MAX_CONCURRENT_REQUESTS")]
    pub max_concurrent_requests: Option<usize>,
    /// How long shutdown keeps trying to write unwritten changes.
    #[arg(long, env = "READSTATES_SHUTDOWN_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    pub shutdown_timeout: Option<Duration>,
    #[arg(long, env = "READSTATES_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// A tracing filter, e.g. `info` or `readstates=debug` (RUST_LOG wins).
    #[arg(long, env = "READSTATES_LOG_LEVEL")]
    pub log_level: Option<String>,
}

/// The resolved configuration.
#[derive(Clone, Debug, Serialize)]
pub struct Config {
    pub listen: SocketAddr,
    pub metrics_listen: SocketAddr,
    pub store: StoreKind,
    pub data_dir: PathBuf,
    #[serde(with = "humantime_serde")]
    pub write_delay: Duration,
    pub cache_capacity: usize,
    pub shards: usize,
    pub flush_concurrency: usize,
    pub max_unwritten: usize,
    pub max_concurrent_requests: usize,
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    pub log_format: LogFormat,
    pub log_level: String,
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
        Ok(Config::resolve(args.settings.clone().or(file)))
    }

    pub fn resolve(s: Settings) -> Config {
        Config {
            listen: s
                .listen
                .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 50051))),
            metrics_listen: s
                .metrics_listen
                .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 9090))),
            store: s.store.unwrap_or(StoreKind::Embedded),
            data_dir: s.data_dir.unwrap_or_else(|| PathBuf::from("./data")),
            write_delay: s.write_delay.unwrap_or(Duration::from_secs(30)),
            cache_capacity: s.cache_capacity.unwrap_or(10_000_000),
            shards: s.shards.unwrap_or(64),
            flush_concurrency: s.flush_concurrency.unwrap_or(32),
            max_unwritten: s.max_unwritten.unwrap_or(2_000_000),
            max_concurrent_requests: s.max_concurrent_requests.unwrap_or(10_000),
            shutdown_timeout: s.shutdown_timeout.unwrap_or(Duration::from_secs(30)),
            log_format: s.log_format.unwrap_or(LogFormat::Text),
            log_level: s.log_level.unwrap_or_else(|| "info".to_owned()),
        }
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self)
            .unwrap_or_else(|e| format!("# cannot print the configuration: {e}\n"))
    }
}

impl Settings {
    pub fn from_file(path: &Path) -> Result<Settings, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| ConfigError(format!("{}: {e}", path.display())))
    }

    /// Each setting of `self`, or else of `other`.
    fn or(self, other: Settings) -> Settings {
        Settings {
            listen: self.listen.or(other.listen),
            metrics_listen: self.metrics_listen.or(other.metrics_listen),
            store: self.store.or(other.store),
            data_dir: self.data_dir.or(other.data_dir),
            write_delay: self.write_delay.or(other.write_delay),
            cache_capacity: self.cache_capacity.or(other.cache_capacity),
            shards: self.shards.or(other.shards),
            flush_concurrency: self.flush_concurrency.or(other.flush_concurrency),
            max_unwritten: self.max_unwritten.or(other.max_unwritten),
            max_concurrent_requests: self
                .max_concurrent_requests
                .or(other.max_concurrent_requests),
            shutdown_timeout: self.shutdown_timeout.or(other.shutdown_timeout),
            log_format: self.log_format.or(other.log_format),
            log_level: self.log_level.or(other.log_level),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_config_parses_and_matches_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/readstates.toml");
        let sample = Config::resolve(Settings::from_file(&path).unwrap());
        assert_eq!(sample.to_toml(), Config::default().to_toml());
    }

    #[test]
    fn flags_override_the_file() {
        let cli = Cli::try_parse_from([
            "readstates",
            "serve",
            "--write-delay",
            "2s",
            "--shards",
            "4",
        ])
        .unwrap();
        let Command::Serve(args) = cli.command;
        let file: Settings = toml::from_str("write_delay = \"10s\"\ncache_capacity = 5").unwrap();
        let config = Config::resolve(args.settings.or(file));
        assert_eq!(config.write_delay, Duration::from_secs(2));
        assert_eq!(config.cache_capacity, 5);
        assert_eq!(config.shards, 4);
    }

    #[test]
    fn unknown_keys_are_refused() {
        assert!(toml::from_str::<Settings>("write_dealy = \"1s\"").is_err());
    }
}
