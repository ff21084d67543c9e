//! The integration-test binary: one binary, so that the Redis nodes of `common::shared()`
//! are started once and shared by every module's tests.

#[path = "../common/mod.rs"]
mod common;

#[cfg(feature = "cli")]
mod cli;
mod closes;
mod degraded;
mod events;
mod fence_workers;
mod fencing;
mod fencing_hostile;
mod harness;
mod hostile;
mod lock;
mod node_layer;
mod nodes;
#[cfg(feature = "tls-rustls")]
mod tls;
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
