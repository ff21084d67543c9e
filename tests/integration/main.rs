//! The integration-test binary: one binary, so that the Redis nodes of `common::shared()`
//! are started once and shared by every module's tests.

#[path = "../common/mod.rs"]
mod common;
// (Apart from `common`, which crates without the feature include too.)
#[cfg(feature = "metrics")]
#[path = "../common/recorder.rs"]
mod recorder;

mod closes;
mod degraded;
mod election;
mod election_processes;
mod election_review;
mod events;
mod eviction;
mod fence_workers;
mod fencing;
mod fencing_hostile;
mod foreign;
mod harness;
mod hostile;
mod lock;
#[cfg(feature = "metrics")]
mod metrics_feature;
mod missed;
mod node_layer;
mod nodes;
mod rw;
mod rw_inspect;
mod scripting;
mod several;
mod sharing;
#[cfg(feature = "tracing")]
mod spans;
mod storms;
#[cfg(feature = "tls-rustls")]
mod tls;
mod wakeups;
mod watchdog;

use std::time::Duration;

/// A client over `urls` with this node timeout and the other defaults.
fn client_with(urls: Vec<String>, node_timeout: Duration) -> quorumlock::Redlock {
    quorumlock::Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .node_timeout(node_timeout)
        .build()
        .expect("valid config")
}

/// Warnings and errors the library logs in this test binary (a logger is set once), so
/// that a test can check that a scenario logged none about its own nodes.
pub(crate) mod logs {
    use std::sync::{Mutex, OnceLock};

    struct Loud(Mutex<Vec<String>>);

    impl log::Log for Loud {
        fn enabled(&self, m: &log::Metadata<'_>) -> bool {
            m.level() <= log::Level::Warn
        }
        fn log(&self, r: &log::Record<'_>) {
            if self.enabled(r.metadata()) && r.target().starts_with("quorumlock") {
                if let Ok(mut v) = self.0.lock() {
                    v.push(format!("{} {}", r.level(), r.args()));
                }
            }
        }
        fn flush(&self) {}
    }

    fn sink() -> &'static Loud {
        static SINK: OnceLock<&'static Loud> = OnceLock::new();
        SINK.get_or_init(|| {
            let loud: &'static Loud = Box::leak(Box::new(Loud(Mutex::new(Vec::new()))));
            if log::set_logger(loud).is_ok() {
                log::set_max_level(log::LevelFilter::Warn);
            }
            loud
        })
    }

    /// Starts capturing (idempotent).
    pub(crate) fn capture() {
        let _ = sink();
    }

    /// The warnings and errors so far that mention any of `names`.
    pub(crate) fn about(names: &[String]) -> Vec<String> {
        sink()
            .0
            .lock()
            .map(|v| {
                v.iter()
                    .filter(|m| names.iter().any(|n| m.contains(n.as_str())))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}
