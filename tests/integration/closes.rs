//! Connections closed under a command: the command may have run, its reply is lost. The
//! round sends it again on another connection (a close is not the node's answer), so the
//! repeat must mean what the first would have: our own SET, swap or delete that did run is
//! counted as done, and whatever may have run is undone when the attempt fails.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use quorumlock::{EventHandler, NodeEvent, Redlock};

use crate::common::faults::{
    Cut, CutProxy, DelayProxy, ACQUIRE_1, ACQUIRE_LEAN, RELEASE_1, SWAP_1,
};
use crate::common::{summary, unique_key, Cluster};

/// Records the nodes' health changes.
#[derive(Default)]
struct Changes(Mutex<Vec<String>>);

impl EventHandler for Changes {
    fn on_node(&self, e: &NodeEvent<'_>) {
        self.0.lock().push(format!("{} {:?}", e.node(), e.change()));
    }
}

fn client(urls: Vec<String>, changes: &Arc<Changes>) -> Redlock {
    client_pooled(urls, changes, 32)
}

/// A client with `pool_size` connections per node, connected.
fn client_pooled(urls: Vec<String>, changes: &Arc<Changes>, pool_size: u32) -> Redlock {
    connected(urls, changes, |b| b.pool_size(pool_size))
}

/// A client of `urls` reporting to `changes`, set up further by `more`,
/// connected to all three nodes.
fn connected(
    urls: Vec<String>,
    changes: &Arc<Changes>,
    more: impl FnOnce(quorumlock::Builder) -> quorumlock::Builder,
) -> Redlock {
    let builder = Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .node_timeout(Duration::from_millis(250))
        .events(changes.clone());
    let locks = more(builder).build().expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    locks
}

/// Asserts `key` leaves node `i` within `limit`.
fn leaves_node(c: &Cluster, i: usize, key: &str, limit: Duration, what: &str) {
    assert!(
        crate::common::wait_until(limit, || c.get(i, key).is_none()),
        "{what} stayed on node {i} (pttl {} ms)",
        c.pttl(i, key)
    );
}

/// Waits until every node holds `token` (a round ends at a majority; the last SET may
/// still be on its way).
fn landed_everywhere(c: &Cluster, key: &str, token: &str) {
    assert!(
        crate::common::wait_until(Duration::from_secs(2), || c.holders(key, token) == 3),
        "the lock reached {} of 3 nodes",
        c.holders(key, token)
    );
}

fn hold_elsewhere(c: &Cluster, i: usize, key: &str) {
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg("someone-else")
        .arg("PX")
        .arg(20_000)
        .query(&mut c.conn(i))
        .expect("SET");
}

/// A free resource whose SET ran on 2 of 3 nodes, their replies lost with the connections:
/// the SET sent again finds our own token and counts it as set.
#[test]
fn an_acquire_sent_again_after_a_close_counts_its_own_set() {
    let c = Cluster::start(3);
    let p0 = CutProxy::start(&c.url(0), Cut::after_running(ACQUIRE_1, 1));
    let p1 = CutProxy::start(&c.url(1), Cut::after_running(ACQUIRE_1, 1));
    let changes = Arc::new(Changes::default());
    // A generous timeout: the new connection through the proxy may take long
    // on a loaded machine, and a connect that times out is the node's failure
    // (seen once: "Skipped { refused: true }, Rejoined").
    let locks = connected(vec![p0.url(), p1.url(), c.url(2)], &changes, |b| {
        b.pool_size(32).node_timeout(Duration::from_secs(1))
    });
    let key = unique_key("resent-acquire");
    let g = locks
        .try_lock(&key, Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("a free resource: {}", summary(&e)));
    assert_eq!((p0.cuts(), p1.cuts()), (1, 1), "the proxies cut the SETs");
    landed_everywhere(&c, &key, g.token());
    g.release().expect("release");
    assert!(c.gone_everywhere(&key, Duration::from_secs(2)));
    let changes = changes.0.lock().clone();
    assert!(changes.is_empty(), "health changed: {changes:?}");
}

/// As above, for a client whose acquires are lean (plain `SET NX PX`, which cannot tell
/// our key from another owner's): sent again after the close, the acquire goes as the
/// script, which finds our own token and counts it as set.
#[test]
fn a_lean_acquire_sent_again_after_a_close_counts_its_own_set() {
    let c = Cluster::start(3);
    let p0 = CutProxy::start(&c.url(0), Cut::after_running(ACQUIRE_LEAN, 1));
    let p1 = CutProxy::start(&c.url(1), Cut::after_running(ACQUIRE_LEAN, 1));
    let changes = Arc::new(Changes::default());
    // A generous timeout: the new connection through the proxy may take long
    // on a loaded machine, and a connect that times out is the node's failure
    // (seen once: "Skipped { refused: true }, Rejoined").
    let locks = connected(vec![p0.url(), p1.url(), c.url(2)], &changes, |b| {
        b.pool_size(32).node_timeout(Duration::from_secs(1))
    });
    // Script acquires until every node's history is read, then the first lean one is cut.
    for _ in 0..50 {
        let key = unique_key("resent-lean");
        let g = locks
            .try_lock(&key, Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("a free resource: {}", summary(&e)));
        if p0.cuts() + p1.cuts() > 0 {
            assert_eq!((p0.cuts(), p1.cuts()), (1, 1), "one attempt's SETs cut");
            landed_everywhere(&c, &key, g.token());
            g.release().expect("release");
            assert!(c.gone_everywhere(&key, Duration::from_secs(2)));
            return;
        }
        g.release().expect("release");
    }
    panic!("no acquire was lean");
}

/// An attempt that fails (the others hold the resource) after its SET ran on a node whose
/// only connection then closed, and whose repeat found no connection before the round
/// settled (the node takes 100 ms to take a new one): the attempt's undo still deletes it
/// there (it was skipped as "never reached", and the key stayed for its TTL).
#[test]
fn a_failed_attempt_undoes_a_set_lost_with_its_connection() {
    let c = Cluster::start(3);
    let p0 = CutProxy::start(
        &c.url(0),
        Cut {
            slow_accept: Duration::from_millis(100),
            ..Cut::after_running(ACQUIRE_1, 1)
        },
    );
    let d1 = DelayProxy::start(&c.url(1), Duration::from_millis(30));
    let d2 = DelayProxy::start(&c.url(2), Duration::from_millis(30));
    let changes = Arc::new(Changes::default());
    let locks = client_pooled(vec![p0.url(), d1.url(), d2.url()], &changes, 1);
    let key = unique_key("lost-set-undone");
    hold_elsewhere(&c, 1, &key);
    hold_elsewhere(&c, 2, &key);
    let r = locks.try_lock(&key, Duration::from_secs(20));
    assert!(r.is_err(), "the others hold it");
    assert_eq!(p0.cuts(), 1, "the proxy cut the SET");
    leaves_node(
        &c,
        0,
        &key,
        Duration::from_secs(2),
        "the failed attempt's key",
    );
}

/// A fenced hand-over whose swap ran on 2 of 3 nodes, their replies lost with the
/// connections: the swap sent again finds the new token and counts it as swapped, so the
/// waiter gets the lock handed over (a token of the same lineage), not a fresh one. (An
/// unfenced hand-over sends nothing.)
#[test]
fn a_swap_sent_again_after_a_close_counts_as_swapped() {
    let c = Cluster::start(3);
    let p0 = CutProxy::start(&c.url(0), Cut::after_running(SWAP_1, 1));
    let p1 = CutProxy::start(&c.url(1), Cut::after_running(SWAP_1, 1));
    let changes = Arc::new(Changes::default());
    let urls = vec![p0.url(), p1.url(), c.url(2)];
    let locks = Arc::new(connected(urls, &changes, |b| b.fencing(true)));
    let key = unique_key("resent-swap");
    let g = locks.lock(&key, Duration::from_secs(20)).expect("lock");
    landed_everywhere(&c, &key, g.token());
    let first = g.token().to_owned();
    let waiter = {
        let (locks, key) = (locks.clone(), key.clone());
        std::thread::spawn(move || {
            locks
                .request(&key, Duration::from_secs(20))
                .acquire_for(Duration::from_secs(5))
                .map(|g| {
                    let token = g.token().to_owned();
                    let _ = g.release();
                    token
                })
                .map_err(|e| summary(&e))
        })
    };
    // Let the waiter queue behind the holder.
    std::thread::sleep(Duration::from_millis(200));
    g.release().expect("release");
    let got = waiter.join().expect("waiter").expect("the waiter's lock");
    assert_eq!((p0.cuts(), p1.cuts()), (1, 1), "the proxies cut the swaps");
    let lineage = first.split('.').next().unwrap_or(&first);
    assert!(
        got.starts_with(&format!("{lineage}.")),
        "the hand-over fell back to a fresh lock: {first} then {got}"
    );
    assert!(c.gone_everywhere(&key, Duration::from_secs(2)));
}

/// A release whose delete ran on 2 of 3 nodes, their replies lost with the connections:
/// the delete sent again finds the key absent, which cannot tell our delete from a key that
/// expired or never reached the node. The release says so (an I/O error that the first
/// delete may have run), not `Expired` (it did) nor `Ok`; the keys are gone and no node's
/// health changed.
#[test]
fn a_release_sent_again_after_a_close_says_what_it_cannot_tell() {
    let c = Cluster::start(3);
    let p0 = CutProxy::start(&c.url(0), Cut::after_running(RELEASE_1, 1));
    let p1 = CutProxy::start(&c.url(1), Cut::after_running(RELEASE_1, 1));
    // Nodes 0 and 1 answer first, so the lock round reads their SETs' replies (a reply
    // read later, during the release, queues an undo whose delete counts as ours, and
    // the release is then rightly Ok). Node 2 is 200 ms late, within a 1 s node
    // timeout: a loaded machine once let it answer the lock round before node 1 with
    // 30 ms.
    let d2 = DelayProxy::start(&c.url(2), Duration::from_millis(200));
    let changes = Arc::new(Changes::default());
    let locks = connected(vec![p0.url(), p1.url(), d2.url()], &changes, |b| {
        b.pool_size(32).node_timeout(Duration::from_secs(1))
    });
    let key = unique_key("resent-release");
    let g = locks.lock(&key, Duration::from_secs(20)).expect("lock");
    landed_everywhere(&c, &key, g.token());
    let r = g.release();
    assert_eq!(
        (p0.cuts(), p1.cuts()),
        (1, 1),
        "the proxies cut the deletes"
    );
    match r {
        Err(quorumlock::Error::NoQuorum { failures, .. }) => {
            // Nodes 0 and 1 cannot tell; node 2's delete is not waited for once the
            // outcome is settled.
            let io: Vec<_> = failures
                .iter()
                .filter(|f| f.kind() == quorumlock::NodeErrorKind::Io)
                .collect();
            assert_eq!(io.len(), 2, "{failures:?}");
            assert!(io.iter().all(|f| f.to_string().contains("may have run")));
            assert!(
                failures.iter().all(|f| matches!(
                    f.kind(),
                    quorumlock::NodeErrorKind::Io | quorumlock::NodeErrorKind::NotAwaited
                )),
                "{failures:?}"
            );
        }
        other => panic!("expected an I/O NoQuorum, got {other:?}"),
    }
    assert!(c.gone_everywhere(&key, Duration::from_secs(2)));
    let changes = changes.0.lock().clone();
    assert!(changes.is_empty(), "health changed: {changes:?}");
}

/// The same with a key that had vanished from node 0 while the lock was valid (a node
/// restarted without its data), node 1 hung, node 2 deleting: one delete is no majority,
/// and the repeat's "absent" on node 0 must not make it one.
#[test]
fn a_release_sent_again_does_not_count_a_node_that_lost_the_key() {
    let c = Cluster::start(3);
    let cut = Cut {
        forward: false,
        ..Cut::after_running(RELEASE_1, 1)
    };
    let p0 = CutProxy::start(&c.url(0), cut);
    // Node 0 answers first, so the lock round reads its SET's reply (a reply read later,
    // during the release, queues an undo whose delete counts as ours). 200 ms late
    // within a 1 s node timeout, as above: 30 ms is not "first" on a loaded machine.
    let d1 = DelayProxy::start(&c.url(1), Duration::from_millis(200));
    let d2 = DelayProxy::start(&c.url(2), Duration::from_millis(200));
    let changes = Arc::new(Changes::default());
    let locks = connected(vec![p0.url(), d1.url(), d2.url()], &changes, |b| {
        b.pool_size(32).node_timeout(Duration::from_secs(1))
    });
    let key = unique_key("resent-lost-key");
    let g = locks.lock(&key, Duration::from_secs(20)).expect("lock");
    landed_everywhere(&c, &key, g.token());
    c.del(0, &key);
    c.pause(1);
    let r = g.release();
    c.unpause(1);
    assert_eq!(p0.cuts(), 1, "the proxy cut the delete");
    assert!(
        r.is_err(),
        "released on 1 of 3 nodes, yet release() said Ok"
    );
}

/// A lock whose SET to node 0 a proxy holds past the round (it ends on nodes 1 and 2) and
/// passes on only after it closed our connection (an idle cut): the release cannot delete
/// it yet, so it keeps deleting until the SET has landed, and nothing stays on node 0.
#[test]
fn a_set_passed_on_late_after_a_close_is_deleted_after_the_release() {
    let c = Cluster::start(3);
    let cut = Cut {
        close_after: Duration::from_millis(300),
        forward_late: Some(Duration::from_millis(1500)),
        ..Cut::after_running(ACQUIRE_1, 1)
    };
    let p0 = CutProxy::start(&c.url(0), cut);
    let changes = Arc::new(Changes::default());
    let locks = client(vec![p0.url(), c.url(1), c.url(2)], &changes);
    let key = unique_key("late-set");
    let start = std::time::Instant::now();
    let g = locks.lock(&key, Duration::from_secs(30)).expect("lock");
    std::thread::sleep(Duration::from_millis(500));
    g.release().expect("released on nodes 1 and 2");
    assert_eq!(p0.cuts(), 1, "the proxy held the SET");
    // The SET lands on node 0 about 1.5 s after it was sent.
    std::thread::sleep(Duration::from_millis(2200).saturating_sub(start.elapsed()));
    leaves_node(&c, 0, &key, Duration::from_secs(1), "the late SET");
}

/// An expired lock's release whose first delete never reached 2 of 3 nodes (cut before it
/// was passed on): the repeat finds the keys absent, expired, which says nothing about our
/// delete. The release must not report success (a lost lock would pass for a protected
/// section).
#[test]
fn a_release_sent_again_does_not_hide_an_expired_lock() {
    let c = Cluster::start(3);
    let cut = Cut {
        forward: false,
        ..Cut::after_running(RELEASE_1, 1)
    };
    let p0 = CutProxy::start(&c.url(0), cut);
    let p1 = CutProxy::start(&c.url(1), cut);
    let changes = Arc::new(Changes::default());
    let locks = client(vec![p0.url(), p1.url(), c.url(2)], &changes);
    let key = unique_key("resent-expired");
    let g = locks
        .try_lock(&key, Duration::from_millis(300))
        .expect("lock");
    std::thread::sleep(Duration::from_millis(600));
    assert!(
        (0..3).all(|i| c.get(i, &key).is_none()),
        "expired everywhere"
    );
    let r = g.release();
    // A round that is decided without node 0 (node 2 absent, node 1 cut) leaves its delete
    // to the retry thread, which sends it soon after.
    assert!(
        crate::common::wait_until(Duration::from_secs(2), || (p0.cuts(), p1.cuts()) == (1, 1)),
        "the proxies cut the deletes: {:?}",
        (p0.cuts(), p1.cuts())
    );
    assert!(r.is_err(), "the lock had expired, yet release() said Ok");
}

/// A release whose delete ran on every node (on 2 of them the connection then closed, and
/// the node is slow to take a new one) while another client takes the freed resource: the
/// repeat finds the other's token, which does not make our release `NotOwner`; and the other
/// client's lock is left alone.
#[test]
fn a_release_sent_again_that_finds_a_new_owner_is_not_not_owner() {
    let c = Cluster::start(3);
    let cut = Cut {
        slow_accept: Duration::from_millis(150),
        ..Cut::after_running(RELEASE_1, 1)
    };
    let p0 = CutProxy::start(&c.url(0), cut);
    let p1 = CutProxy::start(&c.url(1), cut);
    let locks = client_pooled(vec![p0.url(), p1.url(), c.url(2)], &Arc::default(), 1);
    let other = crate::client_with(c.urls(), Duration::from_millis(250));
    assert_eq!(other.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    let key = unique_key("resent-new-owner");
    let g = locks.try_lock(&key, Duration::from_secs(20)).expect("lock");
    landed_everywhere(&c, &key, g.token());
    let theirs = std::thread::scope(|s| {
        let contender = s.spawn(|| {
            let start = std::time::Instant::now();
            while start.elapsed() < Duration::from_secs(2) {
                if let Ok(g) = other.try_lock(&key, Duration::from_secs(20)) {
                    return Some(g);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            None
        });
        std::thread::sleep(Duration::from_millis(100));
        let r = g.release();
        assert!(
            !matches!(r, Err(quorumlock::Error::NotOwner { .. })),
            "our delete ran everywhere, yet: {:?}",
            r.err()
        );
        contender.join().expect("contender")
    });
    assert_eq!(
        (p0.cuts(), p1.cuts()),
        (1, 1),
        "the proxies cut the deletes"
    );
    let theirs = theirs.expect("the other client took the freed resource");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        c.holders(&key, theirs.token()) >= 2,
        "their lock was touched: on {} of 3 nodes",
        c.holders(&key, theirs.token())
    );
    theirs.release().expect("their release");
}

/// A release still in flight on one node when its round ended (the others answered), then
/// lost with its connection (a kill discards what the node had not read): it is sent again
/// in the background, and the key does not stay on that node for its TTL.
#[test]
fn a_release_in_flight_lost_with_its_connection_is_sent_again() {
    let c = Cluster::start(3);
    let cut = Cut {
        forward: false,
        close_after: Duration::from_millis(150),
        ..Cut::after_running(RELEASE_1, 1)
    };
    let p0 = CutProxy::start(&c.url(0), cut);
    let changes = Arc::new(Changes::default());
    let locks = client(vec![p0.url(), c.url(1), c.url(2)], &changes);
    let key = unique_key("in-flight-lost");
    let g = locks.lock(&key, Duration::from_secs(20)).expect("lock");
    landed_everywhere(&c, &key, g.token());
    g.release().expect("released on 2 of 3");
    // (Sent by the round, or by the background retry if node 0 was skipped.)
    assert!(
        crate::common::wait_until(Duration::from_secs(2), || p0.cuts() == 1),
        "the delete was cut {} times",
        p0.cuts()
    );
    leaves_node(&c, 0, &key, Duration::from_secs(2), "the key");
}
