//! Hot reload of the limits files: polled, so it works the same on every
//! filesystem (bind mounts and ConfigMap symlink swaps included).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::config::Watched;
use crate::service::Service;

/// Checks `paths` every `interval`; new valid limits replace the old ones
/// (counters are kept: they live in the store), a bad file is logged and
/// counted in `floodgate_quota_config_reloads_total{result="error"}` while
/// the previous limits keep serving.
pub fn spawn_reloader(service: Arc<Service>, paths: Vec<PathBuf>, interval: Duration) -> tokio::task::JoinHandle<()> {
    let mut watched = Watched::new(paths);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match watched.poll() {
                None => {}
                Some(Ok(domains)) => {
                    tracing::info!(domains = domains.len(), "limits reloaded");
                    service.set_domains(domains);
                    service.metrics().reloads.with_label_values(&["ok"]).inc();
                }
                Some(Err(e)) => {
                    tracing::error!(error = %e, "limits file refused; the previous limits keep serving");
                    service.metrics().reloads.with_label_values(&["error"]).inc();
                }
            }
        }
    })
}
