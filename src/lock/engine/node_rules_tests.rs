//! The node list's rules: one vote per server, nodes that cannot keep
//! locks, and copies restored on every node the lock can be on.

use super::*;
use crate::algorithm::round::ServerKind;
use crate::error::Error;
use crate::testing::fake::{client, client_over, client_with, Mode};

const TTL: Duration = Duration::from_secs(10);

/// One server listed under two names gets one vote: with the third node
/// down it cannot grant a lock alone, and a key it loses cannot let a
/// second client in while the first holds.
#[test]
fn one_server_listed_twice_votes_once() {
    let (x, nodes, _) = client(3);
    nodes.alias(1, 0); // entries 0 and 1: one server
    nodes.set_mode(2, Mode::Down);
    match x.try_lock("r", TTL) {
        Err(Error::NoQuorum { failures, .. }) => {
            let kinds: Vec<_> = failures.iter().map(|f| f.kind()).collect();
            assert!(
                kinds.contains(&crate::NodeErrorKind::SameServer),
                "{failures:?}"
            );
        }
        other => panic!("one server granted a lock alone: {other:?}"),
    }
    assert!(nodes.get(0, "r").is_none(), "the failed attempt was undone");
    nodes.set_mode(2, Mode::Up);
    let g = x.try_lock("r", TTL).expect("servers 0 and 2");
    // The doubled server loses the key (eviction, a failover).
    nodes.del(0, "r");
    let y = client_over(&nodes, crate::testing::fake::settings());
    assert!(
        y.try_lock("r", TTL).is_err(),
        "a second holder from one server's two names"
    );
    assert!(g.is_held());
}

/// Without the rule (what the library did before), the same schedule
/// gives two holders: the rule is what prevents it.
#[test]
fn counted_twice_one_server_lets_two_hold() {
    let settings = Settings {
        one_vote_per_server: false,
        ..crate::testing::fake::settings()
    };
    let (x, nodes, _) = client_with(3, settings.clone());
    nodes.alias(1, 0);
    nodes.set_mode(2, Mode::Down);
    let g = x.try_lock("r", TTL).expect("granted by one server");
    nodes.set_mode(2, Mode::Up);
    nodes.del(0, "r");
    let y = client_over(&nodes, settings);
    let h = y.try_lock("r", TTL).expect("a second holder");
    assert!(g.is_held() && h.is_held());
    std::mem::forget((g, h));
}

/// A replica, a cluster node or (by default) an evicting node never votes.
#[test]
fn nodes_that_cannot_keep_locks_do_not_vote() {
    for kind in [ServerKind::Replica, ServerKind::Cluster] {
        let (x, nodes, _) = client(3);
        nodes.set_kind(0, kind);
        nodes.set_mode(2, Mode::Down);
        match x.try_lock("r", TTL) {
            Err(Error::NoQuorum { failures, .. }) => assert!(
                failures
                    .iter()
                    .any(|f| f.kind() == crate::NodeErrorKind::Unsuitable),
                "{kind:?}: {failures:?}"
            ),
            other => panic!("{kind:?} voted: {other:?}"),
        }
    }
}

/// An evicting node does not vote by default: with two of three nodes
/// evicting a held lock's key under memory pressure, a second client was
/// granted the lock while the first still held it.
#[test]
fn an_evicting_node_does_not_vote_by_default() {
    let (x, nodes, _) = client(3);
    nodes.set_kind(0, ServerKind::Evicting("allkeys-lru"));
    nodes.set_kind(1, ServerKind::Evicting("volatile-lru"));
    match x.try_lock("r", TTL) {
        Err(Error::NoQuorum { failures, .. }) => {
            assert_eq!(failures.len(), 2, "{failures:?}");
            for (f, policy) in failures.iter().zip(["allkeys-lru", "volatile-lru"]) {
                assert_eq!(f.kind(), crate::NodeErrorKind::Unsuitable, "{f}");
                assert!(f.to_string().contains(policy), "{f}");
            }
        }
        other => panic!("evicting nodes voted by default: {other:?}"),
    }
    assert!(nodes.get(2, "r").is_none(), "the failed attempt was undone");
    // The evicting nodes drop the key: still no two holders.
    nodes.set_kind(1, ServerKind::Fit);
    let g = x.try_lock("r", TTL).expect("nodes 1 and 2 keep their keys");
    nodes.del(0, "r");
    let y = client_over(&nodes, crate::testing::fake::settings());
    assert!(y.try_lock("r", TTL).is_err(), "a second holder");
    assert!(g.is_held());
}

/// With `allow_evicting_nodes(true)` an evicting node votes, and the
/// eviction the default guards against gives two holders.
#[test]
fn allowed_evicting_nodes_vote_and_an_eviction_lets_two_hold() {
    let allowed = Settings {
        allow_evicting: true,
        ..crate::testing::fake::settings()
    };
    let (x, nodes, _) = client_with(3, allowed.clone());
    nodes.set_kind(0, ServerKind::Evicting("allkeys-lru"));
    nodes.set_kind(1, ServerKind::Evicting("volatile-lru"));
    nodes.set_mode(2, Mode::Down);
    let g = x.try_lock("r", TTL).expect("counted when allowed");
    nodes.set_mode(2, Mode::Up);
    // Memory pressure evicts the key on both evicting nodes.
    nodes.del(0, "r");
    nodes.del(1, "r");
    let y = client_over(&nodes, allowed);
    let h = y.try_lock("r", TTL).expect("a second holder");
    assert!(g.is_held() && h.is_held());
    std::mem::forget((g, h));
}

/// A lock lives on every node it can: an extension restores the key
/// where it went missing (a node restarted empty, an eviction), and the
/// guard says on how many nodes the lock is.
#[test]
fn extensions_restore_missing_copies() {
    let (x, nodes, _) = client(3);
    let g = x.try_lock("r", TTL).unwrap();
    assert_eq!(g.nodes_held(), 3);
    nodes.wipe(2); // restarted empty
    g.extend(TTL).expect("nodes 0 and 1 still hold it");
    assert_eq!(g.nodes_held(), 3, "restored on node 2");
    assert_eq!(nodes.get(2, "r").as_deref(), Some(g.token()));
    // One node failing now does not lose the lock.
    nodes.set_mode(0, Mode::Down);
    g.extend(TTL).expect("nodes 1 and 2 hold it");
    nodes.set_mode(0, Mode::Up);
    // A lock whose copies are gone from a majority is lost: nothing is
    // restored, and its release deletes what is left.
    nodes.del(1, "r");
    nodes.del(2, "r");
    assert!(matches!(g.extend(TTL), Err(Error::Expired)));
    assert!(g.is_lost());
    assert!(nodes.get(1, "r").is_none() && nodes.get(2, "r").is_none());
    drop(g);
    assert!(nodes.get(0, "r").is_none(), "cleaned up");
    // A key someone else holds is never overwritten.
    let g = x.try_lock("s", TTL).unwrap();
    nodes.del(0, "s");
    nodes.set_mode(1, Mode::Down);
    nodes.set_mode(2, Mode::Down);
    let other = client_over(&nodes, crate::testing::fake::settings());
    let theirs = other.try_lock("s", TTL);
    assert!(theirs.is_err(), "one node of three");
    nodes.set_mode(1, Mode::Up);
    nodes.set_mode(2, Mode::Up);
    crate::testing::fake::plant(&nodes, 0, "s", "someone-else", TTL);
    g.extend(TTL).expect("nodes 1 and 2");
    assert_eq!(nodes.get(0, "s").as_deref(), Some("someone-else"));
    assert_eq!(g.nodes_held(), 2);
    std::mem::forget(g);
}

/// An extension that fails without losing the lock (too few answers in
/// time) says nothing about the copies: a held lock still reports the
/// nodes of its last confirmed round, never fewer than a majority.
#[test]
fn a_failed_extension_leaves_nodes_held_as_last_confirmed() {
    let (x, nodes, _) = client(3);
    let g = x.try_lock("r", TTL).unwrap();
    nodes.set_mode(1, Mode::Down);
    nodes.set_mode(2, Mode::Down);
    assert!(matches!(g.extend(TTL), Err(Error::NoQuorum { .. })));
    assert!(g.is_held() && !g.is_lost());
    assert_eq!(g.nodes_held(), 3, "the copies were not found missing");
    nodes.set_mode(1, Mode::Up);
    nodes.set_mode(2, Mode::Up);
}
