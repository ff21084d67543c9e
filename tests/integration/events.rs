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

/// Counts sections: +1 per acquired attempt, −1 per release, never below 0.
#[derive(Default)]
struct Gauge {
    held: std::sync::atomic::AtomicI64,
    low: std::sync::atomic::AtomicI64,
    acquired: std::sync::atomic::AtomicU64,
}

impl EventHandler for Gauge {
    fn on_attempt(&self, e: &AttemptEvent<'_>) {
        if e.acquired() {
            self.acquired
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.held.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    fn on_release(&self, _: &ReleaseEvent<'_>) {
        let now = self.held.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) - 1;
        self.low.fetch_min(now, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A lock handed between threads of one process ends one section and
/// starts another: a "held" gauge built from the events returns to zero.
#[test]
fn hand_overs_keep_a_held_gauge_balanced() {
    use std::sync::atomic::Ordering;
    let c = crate::common::shared();
    let gauge = Arc::new(Gauge::default());
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(250))
        .events(gauge.clone())
        .build()
        .expect("client");
    let key = unique_key("events-gauge");
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (locks, key) = (locks.clone(), key.clone());
            std::thread::spawn(move || {
                for _ in 0..25 {
                    let g = locks
                        .request(&key, Duration::from_secs(5))
                        .acquire_for(Duration::from_secs(30))
                        .expect("lock");
                    std::thread::sleep(Duration::from_micros(200));
                    drop(g);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker");
    }
    assert_eq!(gauge.acquired.load(Ordering::SeqCst), 100);
    assert_eq!(
        gauge.held.load(Ordering::SeqCst),
        0,
        "acquired minus released"
    );
    assert!(
        gauge.low.load(Ordering::SeqCst) >= 0,
        "released before acquired"
    );
}

/// A handler may call back into the client: `on_release` runs after the
/// releasing thread gave up its turn in the local queue.
#[test]
fn a_release_handler_may_lock_the_same_resource_at_once() {
    struct Relock {
        locks: std::sync::OnceLock<Redlock>,
        took: Mutex<Option<Duration>>,
        busy: std::sync::atomic::AtomicBool,
    }
    impl EventHandler for Relock {
        fn on_release(&self, e: &ReleaseEvent<'_>) {
            let (Some(locks), false) = (
                self.locks.get(),
                self.busy.swap(true, std::sync::atomic::Ordering::SeqCst),
            ) else {
                return;
            };
            let t = std::time::Instant::now();
            let g = locks
                .request(e.resource(), Duration::from_secs(5))
                .acquire_for(Duration::from_secs(5));
            *self.took.lock() = Some(t.elapsed());
            assert!(g.is_ok(), "{g:?}");
        }
    }
    let c = crate::common::shared();
    let h = Arc::new(Relock {
        locks: std::sync::OnceLock::new(),
        took: Mutex::new(None),
        busy: false.into(),
    });
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(250))
        .events(h.clone())
        .build()
        .expect("client");
    let _ = h.locks.set(locks.clone());
    let key = unique_key("events-relock");
    locks
        .lock(&key, Duration::from_secs(5))
        .expect("lock")
        .release()
        .expect("release");
    let took = h.took.lock().expect("handler ran");
    assert!(took < Duration::from_secs(1), "the handler waited {took:?}");
    assert!(c.gone_everywhere(&key, Duration::from_secs(2)));
}
