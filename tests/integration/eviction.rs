//! Nodes whose memory policy can evict lock keys (`maxmemory` with any `maxmemory-policy`
//! but `noeviction`), against real servers: they do not vote by default, and a policy
//! changed at runtime is seen at the next `INFO` a connection reads.

use std::time::Duration;

use quorumlock::{Error, NodeErrorKind, Redlock};

use crate::common::{summary, unique_key, wait_until, Cluster};

const TTL: Duration = Duration::from_secs(5);
const SLACK: Duration = Duration::from_millis(250);
/// Well beyond the 10 s after which a pooled connection reads `INFO` again.
const REREAD: Duration = Duration::from_secs(60);

/// `CONFIG SET maxmemory <max>` and `maxmemory-policy <policy>` on node `i`.
fn set_policy(c: &Cluster, i: usize, max: &str, policy: &str) {
    let mut conn = c.conn(i);
    for (k, v) in [("maxmemory", max), ("maxmemory-policy", policy)] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(k)
            .arg(v)
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("CONFIG SET {k} {v} on node {i}: {e}"));
    }
}

/// Puts nodes `nodes` back to the servers' defaults: no limit, `noeviction`.
fn restore(c: &Cluster, nodes: std::ops::Range<usize>) {
    for i in nodes {
        set_policy(c, i, "0", "noeviction");
    }
}

/// The `Unsuitable` failures of a `NoQuorum`, as text.
fn unsuitable(e: &Error) -> Vec<String> {
    match e {
        Error::NoQuorum { failures, .. } => failures
            .iter()
            .filter(|f| f.kind() == NodeErrorKind::Unsuitable)
            .map(|f| f.to_string())
            .collect(),
        _ => Vec::new(),
    }
}

/// With 2 of 3 nodes on `maxmemory 100mb` + `allkeys-lru`, a lock rests on nodes that can
/// evict its key: under memory pressure on those two a held lock's key was evicted and a
/// second client was granted the lock while the first still believed it held it. By
/// default the two do not vote: the lock is refused, the failure names the policy and what
/// to set, and the log says the node does not vote.
#[test]
fn two_evicting_nodes_of_three_refuse_a_lock_by_default() {
    crate::logs::capture();
    let c = Cluster::start(3);
    for i in 0..2 {
        set_policy(&c, i, "100mb", "allkeys-lru");
    }
    let key = unique_key("evicting-default");
    let x = crate::client_with(c.urls(), SLACK);
    x.wait_connected(Duration::from_secs(5)).expect("connected");
    match x.try_lock(&key, TTL) {
        Err(e) => {
            let refused = unsuitable(&e);
            assert_eq!(refused.len(), 2, "{}: {e}", summary(&e));
            for r in &refused {
                assert!(r.contains("allkeys-lru") && r.contains("noeviction"), "{r}");
            }
        }
        Ok(_) => panic!("granted by nodes that evict lock keys"),
    }
    assert_eq!(c.get(2, &key), None, "the failed attempt was undone");
    let name = c.url(0).trim_start_matches("redis://").to_owned();
    let warned = crate::logs::about(std::slice::from_ref(&name));
    assert!(
        warned
            .iter()
            .any(|w| w.contains(&format!("node {name} ")) && w.contains("does not vote")),
        "{warned:?}"
    );
    // The loudly named opt-in counts them.
    let allowed = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(SLACK)
        .allow_evicting_nodes(true)
        .build()
        .expect("valid config");
    allowed
        .wait_connected(Duration::from_secs(5))
        .expect("connected");
    let g = allowed.try_lock(&key, TTL).expect("counted when allowed");
    assert!(g.is_held());
    drop(g);
    restore(&c, 0..2);
}

/// A client that runs while a node's policy is changed: switched to an evicting policy,
/// the node stops voting once its connections read `INFO` again (every 10 s); switched
/// back to `noeviction`, it votes again.
#[test]
fn a_node_switched_to_an_evicting_policy_stops_voting_after_info_is_read_again() {
    let c = Cluster::start(3);
    let x = crate::client_with(c.urls(), SLACK);
    x.wait_connected(Duration::from_secs(5)).expect("connected");
    let attempt = |what: &str| {
        let key = unique_key(what);
        x.try_lock(&key, TTL).map(drop)
    };
    attempt("evicting-before").expect("three nodes that keep their keys");
    for i in 0..2 {
        set_policy(&c, i, "100mb", "allkeys-lru");
    }
    let mut last = Ok(());
    assert!(
        wait_until(REREAD, || {
            last = attempt("evicting-switched");
            matches!(&last, Err(e) if unsuitable(e).len() == 2)
        }),
        "still counted: {last:?}"
    );
    restore(&c, 0..2);
    assert!(
        wait_until(REREAD, || {
            last = attempt("evicting-restored");
            last.is_ok()
        }),
        "not counted again: {last:?}"
    );
}
