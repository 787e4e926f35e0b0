//! The `readstates` binary: parse flags, set up logging, build the
//! application and run it until SIGTERM or Ctrl-C.

#![forbid(unsafe_code)]

use std::process::ExitCode;

/// Request handling allocates many small, short-lived buffers (protobuf,
/// HTTP/2 frames); mimalloc serves them faster than glibc's malloc and
/// fragments less under a long-lived cache.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use readstates::app::{self, Application};
use readstates::config::{Cli, Command, Config};
use readstates::{shutdown, telemetry};

#[tokio::main]
async fn main() -> ExitCode {
    let (args, migrate) = match Cli::parse().command {
        Command::Serve(args) => (args, false),
        Command::Migrate(args) => (args, true),
    };
    let config = match Config::load(&args) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if args.print_config {
        print!("{}", config.to_toml());
        return ExitCode::SUCCESS;
    }
    telemetry::init(&config);
    let result = if migrate {
        app::migrate(&config).await.map(|()| true)
    } else {
        serve(config).await
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            tracing::error!(error = %e, "readstates failed");
            ExitCode::FAILURE
        }
    }
}

/// Serves until a signal; `Ok(false)` if some changes could not be written.
async fn serve(config: Config) -> Result<bool, app::BoxError> {
    let report = Application::build(config)
        .await?
        .run_until(shutdown::signal())
        .await?;
    Ok(report.unwritten == 0)
}
