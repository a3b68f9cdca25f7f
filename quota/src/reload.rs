//! Hot reload of the limits files: polled, so it works the same on every
//! filesystem (bind mounts and ConfigMap symlink swaps included).
//!
//! What an operator expects of a reload: a file is loaded once it has
//! settled (the same contents at two polls in a row: a file written in two
//! steps is not loaded half-written); a bad file is refused and the
//! previous limits keep serving; and a file that would leave a limited
//! descriptor without any rule (unlimited, though no file says
//! `unlimited: true`) is refused too, loudly, naming the descriptors, until
//! the operator says so: by marking them `unlimited: true`, by restarting,
//! or by `SIGHUP` (see [`Reloader::apply_as_is`]), which applies the files
//! as they are.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::config::{Domains, Watched};
use crate::service::Service;

/// Most dropped descriptors a log line names.
const NAMED: usize = 20;

/// The reloader's task, and the operator's word that the files apply as
/// they are.
#[derive(Debug)]
pub struct Reloader {
    task: tokio::task::JoinHandle<()>,
    as_is: Arc<Notify>,
}

impl Reloader {
    /// Applies the files as they are now, at once, even if they leave
    /// limited descriptors without a rule (`SIGHUP`); a bad file is still
    /// refused.
    pub fn apply_as_is(&self) {
        self.as_is.notify_one();
    }

    /// Stops reloading.
    pub fn abort(&self) {
        self.task.abort();
    }
}

/// Checks `paths` every `interval`; new valid limits replace the old ones
/// (counters are kept: they live in the store), a bad file is logged and
/// counted in `floodgate_quota_config_reloads_total{result="error"}`, and
/// one that drops limits in `…{result="refused"}`, while the previous
/// limits keep serving.
pub fn spawn_reloader(service: Arc<Service>, paths: Vec<PathBuf>, interval: Duration) -> Reloader {
    let mut watched = Watched::new(paths);
    let as_is = Arc::new(Notify::new());
    let told = Arc::clone(&as_is);
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if let Some(loaded) = watched.poll() {
                        reload(&service, loaded, false);
                    }
                }
                () = told.notified() => reload(&service, watched.load_now(), true),
            }
        }
    });
    Reloader { task, as_is }
}

/// Applies `loaded` unless it is bad, or drops limits and `as_is` is not set.
fn reload(service: &Service, loaded: Result<Domains, crate::config::LimitsError>, as_is: bool) {
    let count = |result: &str| service.metrics().reloads.with_label_values(&[result]).inc();
    let domains = match loaded {
        Ok(domains) => domains,
        Err(e) => {
            tracing::error!(error = %e, "limits file refused; the previous limits keep serving");
            count("error");
            return;
        }
    };
    let dropped = service.domains().dropped_limits(&domains);
    let named = dropped.iter().take(NAMED).cloned().collect::<Vec<_>>().join("; ");
    if !dropped.is_empty() && !as_is {
        tracing::error!(
            dropped = dropped.len(),
            descriptors = %named,
            "limits reload refused: it would leave limited descriptors without any rule (unlimited); the previous \
             limits keep serving. Mark them `unlimited: true`, or send SIGHUP (or restart) to apply the files as \
             they are"
        );
        count("refused");
        return;
    }
    if !dropped.is_empty() {
        tracing::warn!(dropped = dropped.len(), descriptors = %named, "limits applied as they are (SIGHUP): these descriptors are unlimited now");
    }
    tracing::info!(domains = domains.len(), "limits reloaded");
    service.set_domains(domains);
    count("ok");
}
