//! The `loadtest` binary: parses the command line and runs a subcommand.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

/// The same allocator as readstates, so that the baseline server's ceiling
/// and readstates are measured on equal terms.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use loadtest::commands::{self, NamedTarget};
use loadtest::{baseline, sweep, workload::Workload};

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
        /// `[name=]grpc://host:port[,metrics=host:port]` or `redis://host:port`.
        #[arg(long)]
        target: NamedTarget,
        /// Open-loop requests per second; 0 for a closed loop (default: the workload's).
        #[arg(long)]
        rate: Option<u64>,
        #[arg(long, value_parser = humantime::parse_duration)]
        duration: Option<Duration>,
        /// Write the JSON report here.
        #[arg(long)]
        report: Option<PathBuf>,
        /// Write the p99.9-per-second chart (SVG) here.
        #[arg(long)]
        chart: Option<PathBuf>,
        /// Skip the workload's preload (the target already holds the data).
        #[arg(long)]
        skip_preload: bool,
    },
    /// Steps the rate up to saturation for each target; one chart for all.
    Sweep {
        #[arg(long)]
        workload: PathBuf,
        #[arg(long = "target", required = true)]
        targets: Vec<NamedTarget>,
        #[arg(long, default_value_t = 1_000)]
        start: u64,
        #[arg(long, default_value_t = 1.5)]
        factor: f64,
        #[arg(long, default_value_t = 200_000)]
        max: u64,
        /// How long each rate runs.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
        step: Duration,
        #[arg(long)]
        report: Option<PathBuf>,
        #[arg(long)]
        chart: Option<PathBuf>,
    },
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
            target,
            rate,
            duration,
            report,
            chart,
            skip_preload,
        } => match Workload::from_file(&workload) {
            Ok(mut workload) => {
                workload.load.preload &= !skip_preload;
                commands::run(workload, target, rate, duration, report, chart)
                    .await
                    .map(drop)
            }
            Err(e) => Err(e),
        },
        Command::Sweep {
            workload,
            targets,
            start,
            factor,
            max,
            step,
            report,
            chart,
        } => match Workload::from_file(&workload) {
            Ok(workload) => {
                let rates = sweep::rates(start, factor, max);
                commands::sweep(workload, targets, rates, step, report, chart)
                    .await
                    .map(drop)
            }
            Err(e) => Err(e),
        },
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
            eprintln!("loadtest: {e}");
            ExitCode::FAILURE
        }
    }
}
