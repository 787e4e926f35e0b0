//! The `readstates` binary: parse flags, set up logging, build the
//! application and run it until SIGTERM or Ctrl-C.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use readstates::app::Application;
use readstates::config::{Cli, Command, Config};
use readstates::{shutdown, telemetry};

#[tokio::main]
async fn main() -> ExitCode {
    let Command::Serve(args) = Cli::parse().command;
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
    let result = match Application::build(config).await {
        Ok(app) => app.run_until(shutdown::signal()).await,
        Err(e) => Err(e),
    };
    match result {
        Ok(report) if report.unwritten == 0 => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            tracing::error!(error = %e, "readstates failed");
            ExitCode::FAILURE
        }
    }
}
