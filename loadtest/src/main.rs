//! The `loadtest` binary: parses the command line and runs a subcommand.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

/// The same allocator as readstates, so that the baseline server's ceiling
/// and readstates are measured on equal terms.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};
use loadtest::commands::{self, RunArgs, SweepArgs};
use loadtest::{baseline, workload::Workload};

#[derive(Debug, Parser)]
#[command(
    name = "loadtest",
    about = "Load generator for readstates, the baseline server and Redis"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// One measured run against one target.
    Run {
        #[arg(long)]
        workload: PathBuf,
        /// Skip the workload's preload (the target already holds the data).
        #[arg(long)]
        skip_preload: bool,
        #[command(flatten)]
        args: RunArgs,
    },
    /// Steps the rate up to saturation for each target; one chart for all.
    Sweep {
        #[arg(long)]
        workload: PathBuf,
        #[command(flatten)]
        args: SweepArgs,
    },
    /// kill -9 of a readstates server at random moments under open-loop
    /// acks, each acknowledged one checked after every restart.
    Crash(loadtest::crash::CrashArgs),
    /// Open-loop acks through the fleet client while the calling script
    /// kills or freezes a node, each acknowledged one then read from
    /// Cassandra.
    Failover(loadtest::failover::FailoverArgs),
    /// A Markdown table of the run reports (`*.json`) in a directory.
    Summary { dir: PathBuf },
    /// Serves readstates.v1 with canned responses and no work: the transport ceiling.
    BaselineServer {
        #[arg(long, default_value = "127.0.0.1:50061")]
        listen: SocketAddr,
        /// Read states in each GetReadStates response.
        #[arg(long, default_value_t = 20)]
        read_states: u64,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Run {
            workload,
            skip_preload,
            args,
        } => match Workload::from_file(&workload) {
            Ok(mut workload) => {
                workload.load.preload &= !skip_preload;
                commands::run(workload, args).await.map(drop)
            }
            Err(e) => Err(e),
        },
        Command::Sweep { workload, args } => match Workload::from_file(&workload) {
            Ok(workload) => commands::sweep(workload, args).await.map(drop),
            Err(e) => Err(e),
        },
        Command::Crash(args) => loadtest::crash::run(args).await,
        Command::Failover(args) => loadtest::failover::run(args).await,
        Command::Summary { dir } => commands::summary(&dir).map(|table| print!("{table}")),
        Command::BaselineServer {
            listen,
            read_states,
        } => match baseline::bind(listen).await {
            Ok(listener) => {
                eprintln!(
                    "baseline server on {}",
                    listener.local_addr().map_or(listen, |a| a)
                );
                baseline::serve(listener, read_states).await
            }
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("loadtest: {e:#}");
            ExitCode::FAILURE
        }
    }
}
