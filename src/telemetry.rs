//! Logging: `tracing` to stderr, as text for people or JSON for log pipelines.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber. `RUST_LOG` overrides the default `info` level.
pub fn init(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,ort=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour for a person at a terminal; none in a file, a pipe or a log collector.
        .with_ansi(std::io::stderr().is_terminal());
    // `try_init`: a second call (tests start many apps in one process) is harmless.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
