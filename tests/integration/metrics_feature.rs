//! The `metrics` feature against real nodes: what `quorumlock::metrics::Metrics`
//! records under a recorder of the test's (tests/common/recorder.rs), which
//! is the process's global one: these tests take turns.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use quorumlock::metrics::{self as m, Metrics};
use quorumlock::{AcquireEvent, EventHandler, Redlock};

use crate::common::{shared, unique_key, wait_until};
use crate::recorder::{installed, Recorded};

/// The recorder, cleared, for one test at a time.
fn recorder() -> (MutexGuard<'static, ()>, &'static Recorded) {
    static TURN: Mutex<()> = Mutex::new(());
    let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let rec = installed();
    rec.clear();
    (turn, rec)
}

fn client(urls: Vec<String>, metrics: Metrics) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .node_timeout(Duration::from_millis(250))
        .events(Arc::new(metrics))
        .build()
        .expect("client")
}

/// Counts the calls it is passed.
#[derive(Default)]
struct Calls(AtomicU32);

impl EventHandler for Calls {
    fn on_acquire(&self, _: &AcquireEvent<'_>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_contended_acquire_records_its_wait_by_outcome_and_no_resource_by_default() {
    let (_turn, rec) = recorder();
    let c = shared();
    let key = unique_key("metrics-contended");
    let calls = Arc::new(Calls::default());
    let mine = client(c.urls(), Metrics::new().forward_to(calls.clone()));
    let other = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .build()
        .expect("client");
    let held = other.lock(&key, Duration::from_secs(10)).expect("lock");

    // Gives up while another client holds the key: contention.
    let err = mine
        .request(&key, Duration::from_secs(10))
        .acquire_for(Duration::from_millis(300))
        .expect_err("held by the other client");
    assert!(matches!(err, quorumlock::Error::Taken { .. }), "{err:?}");
    let waits = rec.histogram(m::ACQUIRE_WAIT, &[("outcome", "taken")]);
    assert_eq!(waits.len(), 1, "{:?}", rec.histograms());
    assert!(waits[0] >= 0.3, "waited {}s", waits[0]);
    let tries = rec.histogram(m::ACQUIRE_ATTEMPTS, &[("outcome", "taken")]);
    assert_eq!(tries.len(), 1, "{:?}", rec.histograms());
    let taken = rec.counter(m::ATTEMPTS, &[("outcome", "taken")]);
    assert!(
        taken >= 1 && taken as f64 == tries[0],
        "{taken} vs {tries:?}"
    );

    // Waits for the other's release, then holds and releases.
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        held.release()
    });
    let g = mine
        .request(&key, Duration::from_secs(10))
        .acquire_for(Duration::from_secs(10))
        .expect("acquired after the release");
    releaser.join().expect("releaser").expect("released");
    std::thread::sleep(Duration::from_millis(50));
    g.release().expect("released");
    let waits = rec.histogram(m::ACQUIRE_WAIT, &[("outcome", "acquired")]);
    assert_eq!(waits.len(), 1, "{:?}", rec.histograms());
    assert!(waits[0] >= 0.2, "waited {}s for a 300 ms holder", waits[0]);
    let holds = rec.histogram(m::HOLD, &[("outcome", "released")]);
    assert_eq!(holds.len(), 1, "{:?}", rec.histograms());
    assert!(holds[0] >= 0.05, "held {}s", holds[0]);
    assert_eq!(rec.counter(m::ATTEMPTS, &[("outcome", "acquired")]), 1);

    // No resource label anywhere; the user's own handler got both calls.
    let series = rec.series();
    assert!(
        series
            .iter()
            .all(|(_, labels)| labels.iter().all(|(k, _)| k != "resource")),
        "{series:?}"
    );
    assert_eq!(calls.0.load(Ordering::SeqCst), 2);
    // Described once, with units.
    let (unit, _) = rec.described(m::ACQUIRE_WAIT).expect("described");
    assert_eq!(unit, Some(metrics::Unit::Seconds));
}

#[test]
fn the_resource_label_follows_the_users_pattern_never_the_key() {
    let (_turn, rec) = recorder();
    let c = shared();
    let (orders, other) = (unique_key("orders"), unique_key("misc"));
    // "test:orders:…" → "orders"; the rest → "other".
    let locks = client(
        c.urls(),
        Metrics::new().resource_label(|r: &str| {
            r.split(':')
                .nth(1)
                .filter(|k| *k == "orders")
                .map(str::to_owned)
        }),
    );
    drop(locks.lock(&orders, Duration::from_secs(5)).expect("lock"));
    drop(locks.lock(&other, Duration::from_secs(5)).expect("lock"));
    let by_orders = [("outcome", "acquired"), ("resource", "orders")];
    let by_other = [("outcome", "acquired"), ("resource", "other")];
    assert_eq!(rec.counter(m::ATTEMPTS, &by_orders), 1);
    assert_eq!(rec.counter(m::ATTEMPTS, &by_other), 1);
    assert_eq!(rec.histogram(m::ACQUIRE_WAIT, &by_orders).len(), 1);
    let released = [("outcome", "released"), ("resource", "orders")];
    assert_eq!(rec.histogram(m::HOLD, &released).len(), 1);
    let series = rec.series();
    assert!(
        series
            .iter()
            .all(|(_, labels)| labels.iter().all(|(_, v)| *v != orders && *v != other)),
        "{series:?}"
    );

    // By prefixes: the longest that matches.
    rec.clear();
    let locks = client(
        c.urls(),
        Metrics::new().resource_prefixes(["test:", "test:orders:"]),
    );
    drop(locks.lock(&orders, Duration::from_secs(5)).expect("lock"));
    let by_prefix = [("outcome", "acquired"), ("resource", "test:orders:")];
    assert_eq!(
        rec.counter(m::ATTEMPTS, &by_prefix),
        1,
        "{:?}",
        rec.counters()
    );
}

#[test]
fn a_lost_lock_is_counted_and_renewals_record_their_margin() {
    let (_turn, rec) = recorder();
    let c = shared();
    let key = unique_key("metrics-lost");
    let ttl = Duration::from_millis(600);
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(150))
        .auto_renew(true)
        .events(Arc::new(Metrics::new()))
        .build()
        .expect("client");
    let g = locks.lock(&key, ttl).expect("lock");
    assert!(
        wait_until(Duration::from_secs(5), || {
            rec.counter(m::RENEWALS, &[("outcome", "renewed")]) >= 1
                && c.holders(&key, g.token()) == 3
        }),
        "never renewed on every node: {:?}",
        rec.counters()
    );
    let margins = rec.histogram(m::RENEWAL_MARGIN, &[]);
    assert!(!margins.is_empty(), "{:?}", rec.histograms());
    assert!(
        margins.iter().all(|s| *s > 0.0 && *s <= ttl.as_secs_f64()),
        "{margins:?}"
    );
    assert_eq!(rec.counter(m::LOSSES, &[("outcome", "expired")]), 0);
    c.del(0, &key);
    c.del(1, &key);
    let why = g
        .lost()
        .wait_timeout(ttl * 2)
        .expect("lost at its next renewal");
    assert!(matches!(why, quorumlock::Error::Expired), "{why:?}");
    // (The guard learns of the loss before the handler does.)
    assert!(
        wait_until(Duration::from_secs(2), || rec
            .counter(m::LOSSES, &[("outcome", "expired")])
            == 1),
        "{:?}",
        rec.counters()
    );
    assert!(rec.counter(m::RENEWALS, &[("outcome", "expired")]) >= 1);
}

#[test]
fn node_errors_are_counted_by_node_and_kind_without_credentials() {
    let (_turn, rec) = recorder();
    let c = shared();
    // A fourth node nobody listens on, named with a password.
    let port = crate::common::pick_port().expect("a free port");
    let mut urls = c.urls();
    urls.push(format!("redis://user:s3cret@127.0.0.1:{port}"));
    let locks = client(urls, Metrics::new());
    drop(
        locks
            .lock(&unique_key("metrics-nodes"), Duration::from_secs(5))
            .expect("3 of 4"),
    );
    crate::common::release_port(port);
    let node = format!("127.0.0.1:{port}");
    let errors: Vec<_> = rec
        .counters()
        .into_iter()
        .filter(|((name, _), _)| name == m::NODE_ERRORS)
        .collect();
    assert!(
        errors.iter().any(|((_, labels), n)| *n >= 1
            && labels.contains(&("node".to_owned(), node.clone()))
            && labels
                .iter()
                .any(|(k, v)| k == "kind"
                    && ["unavailable", "skipped", "timeout"].contains(&v.as_str()))),
        "{errors:?}"
    );
    let series = rec.series();
    assert!(
        series
            .iter()
            .all(|(_, labels)| labels.iter().all(|(_, v)| !v.contains("s3cret"))),
        "{series:?}"
    );
}
