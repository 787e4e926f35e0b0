//! The command line: `serve`, `migrate` and `ring`, with the settings they
//! take (every setting is a flag of `serve`, see [`super::Settings`]).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use super::Settings;

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
    /// Creates the Cassandra keyspace and tables (safe to run again).
    Migrate(ServeArgs),
    /// Shows or changes the fleet's ring, kept in Cassandra (settings as for
    /// `serve`, before the action: `readstates ring --keyspace k show`).
    Ring(RingArgs),
}

#[derive(Debug, Args)]
pub struct RingArgs {
    #[command(subcommand)]
    pub action: RingAction,
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// One change at a time: each is refused until every owner of the current
/// epoch serves all its slots.
#[derive(Debug, Subcommand)]
pub enum RingAction {
    /// Prints the epoch, the nodes with their weights and slots, what moved
    /// in this epoch and which owners do not serve all their slots yet.
    Show,
    /// Adds a node (start it first, with `serve --node-id NODE --advertise ADDR`).
    Add {
        node: String,
        /// Where other nodes and gateways reach its gRPC port, `host:port`.
        address: String,
        /// Its share of the slots is weight / total weight; 0 (a canary
        /// before its ramp) owns none.
        #[arg(long, default_value_t = 100)]
        weight: u32,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Sets a node's weight: raising it moves slots only onto it, lowering
    /// it moves only its own slots away.
    SetWeight {
        node: String,
        weight: u32,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Removes a node: only its slots move. Stop it once the change is served.
    Remove {
        node: String,
        /// For a node dead for good that nothing took over (two nodes lost
        /// at once, one the other's backup): once its lease lapsed, its
        /// slots go to the others at once, served from the store; what it
        /// had not written is lost.
        #[arg(long)]
        force: bool,
        /// With `--force`: does not wait for its lease to lapse, nor leave
        /// it to a live backup holding its copy (only when the node is
        /// known dead and that copy is given up).
        #[arg(long, requires = "force")]
        ignore_lease: bool,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Declares a dead node's moving slots released, so that their new
    /// owners serve them from the store; what it had not written is lost.
    Release {
        node: String,
        /// Required: the node's unwritten changes are given up.
        #[arg(long)]
        force: bool,
        /// Releases them even while the node renews its lease (it may then
        /// serve them too, until it sees the lease revoked): only when the
        /// node is known dead and its lease record is not to be waited for.
        #[arg(long)]
        ignore_lease: bool,
    },
}

#[derive(Clone, Copy, Debug, Args)]
pub struct WaitArgs {
    /// After the change, waits until every slot is served by its new owner,
    /// at most this long (e.g. `30s`), and says how long it took.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub wait: Option<Duration>,
}

/// The settings of `serve` and `migrate` (which uses the Cassandra ones).
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
