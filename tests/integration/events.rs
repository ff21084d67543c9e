//! Event hooks against real nodes: node state changes come from the node
//! layer's health machine, and the lock cycle reports every step.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use quorumlock::{AttemptEvent, EventHandler, NodeChange, NodeEvent, Redlock, ReleaseEvent};

use crate::common::{unique_key, wait_until, Cluster};

#[derive(Default)]
struct Log(Mutex<Vec<String>>);

impl EventHandler for Log {
    fn on_attempt(&self, e: &AttemptEvent<'_>) {
        self.0
            .lock()
            .push(format!("attempt acquired={}", e.acquired()));
    }
    fn on_release(&self, e: &ReleaseEvent<'_>) {
        self.0
            .lock()
            .push(format!("release ok={}", e.error().is_none()));
    }
    fn on_node(&self, e: &NodeEvent<'_>) {
        self.0
            .lock()
            .push(format!("node {} {:?}", e.node(), e.change()));
    }
}

#[test]
fn a_hung_node_is_reported_skipped_then_rejoined() {
    let c = Cluster::start(3);
    let log = Arc::new(Log::default());
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(100))
        .events(log.clone())
        .build()
        .expect("client");
    let key = unique_key("events-hung");
    // Connected and healthy first.
    assert!(wait_until(Duration::from_secs(10), || locks
        .try_lock(&key, Duration::from_secs(5))
        .is_ok()));
    let hung = c.url(2).trim_start_matches("redis://").to_owned();
    // Rounds go on (each may change the node's health) until `line` is logged.
    let until_logged = |line: &str| {
        let logged = wait_until(Duration::from_secs(10), || {
            let _ = locks.try_lock(&unique_key("events-hung"), Duration::from_secs(5));
            log.0.lock().iter().any(|l| l == line)
        });
        assert!(logged, "no {line:?} in {:?}", log.0.lock());
    };
    let skipped = format!("node {hung} {:?}", NodeChange::Skipped { refused: false });
    c.pause(2);
    until_logged(&skipped);
    let rejoined = format!("node {hung} {:?}", NodeChange::Rejoined);
    c.unpause(2);
    until_logged(&rejoined);
    let seen = log.0.lock().clone();
    assert!(
        seen.iter().any(|e| e == "attempt acquired=true"),
        "{seen:?}"
    );
    assert!(seen.iter().any(|e| e == "release ok=true"), "{seen:?}");
    // Skipped comes before rejoined, and each once per flip.
    let s = seen.iter().position(|e| *e == skipped);
    let r = seen.iter().position(|e| *e == rejoined);
    assert!(s < r, "{seen:?}");
}
