//! The `log` crate's records, and panics, in Envoy's log (`[dynamic_modules]`).

use crate::abi::{self, LogLevel};

struct EnvoyLog;

static LOG: EnvoyLog = EnvoyLog;

fn level(level: log::Level) -> LogLevel {
    match level {
        log::Level::Error => LogLevel::Error,
        log::Level::Warn => LogLevel::Warn,
        log::Level::Info => LogLevel::Info,
        log::Level::Debug => LogLevel::Debug,
        log::Level::Trace => LogLevel::Trace,
    }
}

impl log::Log for EnvoyLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        abi::log_enabled(level(metadata.level()))
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            let message = record.args().to_string();
            abi::log(level(record.level()), &message, record.file().unwrap_or_default(), record.line().unwrap_or(0));
        }
    }

    fn flush(&self) {}
}

/// Sends `log` records to Envoy (Envoy's log level decides what is
/// written), and logs a panic at critical level: every event hook catches
/// a panic so that it never unwinds into Envoy, and this says where it was.
pub fn install() {
    // Set once per process; a second load of the module keeps the first.
    if log::set_logger(&LOG).is_ok() {
        log::set_max_level(log::LevelFilter::Trace);
    }
    std::panic::set_hook(Box::new(|info| {
        let (file, line) = info.location().map_or(("", 0), |l| (l.file(), l.line()));
        abi::log(LogLevel::Critical, &format!("floodgate: panic caught before it reached Envoy: {info}"), file, line);
    }));
}
