//! The `readstates` binary: parse flags, set up logging, and run the command:
//! `serve` until SIGTERM or Ctrl-C, `migrate`, or `ring`.

#![forbid(unsafe_code)]

use std::process::ExitCode;

/// Request handling allocates many small, short-lived buffers (protobuf,
/// HTTP/2 frames); mimalloc serves them faster than glibc's malloc and
/// fragments less under a long-lived cache.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use readstates::app::{self, Application};
use readstates::config::{Cli, Command, Config, ServeArgs};
use readstates::{ring_command, shutdown, telemetry};

#[tokio::main]
async fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Serve(args) => {
            let config = match configure(&args) {
                Ok(config) => config,
                Err(exit) => return exit,
            };
            // Listening before anything starts, so no SIGTERM goes unheard.
            let stop = shutdown::signal();
            let served = Application::build(config).await;
            match served {
                Ok(app) => match app.run_until(stop).await {
                    // The log already said what was not written.
                    Ok(report) if report.unwritten > 0 => ExitCode::FAILURE,
                    Ok(_) => ExitCode::SUCCESS,
                    Err(e) => failed(e),
                },
                Err(e) => failed(e),
            }
        }
        Command::Migrate(args) => {
            let config = match configure(&args) {
                Ok(config) => config,
                Err(exit) => return exit,
            };
            match app::migrate(&config.cassandra()).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => failed(e),
            }
        }
        Command::Ring(args) => {
            let config = match configure(&args.serve) {
                Ok(config) => config,
                Err(exit) => return exit,
            };
            match ring_command::run(&config, args.action).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// The configuration, with logging set up; or how to exit at once: it is
/// invalid (2), or was only to be printed (`--print-config`, 0).
fn configure(args: &ServeArgs) -> Result<Config, ExitCode> {
    let config = Config::load(args).map_err(|e| {
        eprintln!("{e}");
        ExitCode::from(2)
    })?;
    if args.print_config {
        print!("{}", config.to_toml());
        return Err(ExitCode::SUCCESS);
    }
    telemetry::init(&config);
    Ok(config)
}

fn failed(error: app::BoxError) -> ExitCode {
    tracing::error!(error = %error, "readstates failed");
    ExitCode::FAILURE
}
