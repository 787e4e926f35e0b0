//! Logging through `tracing`: human-readable by default, JSON for log
//! pipelines. `RUST_LOG`, when set, overrides the configured level.

use tracing_subscriber::EnvFilter;

use crate::config::{Config, LogFormat};

/// rustls warns of every bad handshake it sees, one line per connection
/// that anyone can open; `tls::incoming` logs those, at most once a second.
const QUIET: &str = "rustls=error";

pub fn init(config: &Config) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(directives(&config.log_level)));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match config.log_format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    if let Err(e) = result {
        eprintln!("logging already initialised: {e}");
    }
}

/// The configured level, with rustls quietened unless it names rustls.
fn directives(level: &str) -> String {
    if level.contains("rustls") {
        level.to_owned()
    } else {
        format!("{level},{QUIET}")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rustls_is_quiet_unless_named() {
        assert_eq!(super::directives("info"), "info,rustls=error");
        assert_eq!(
            super::directives("debug,rustls=trace"),
            "debug,rustls=trace"
        );
    }
}
