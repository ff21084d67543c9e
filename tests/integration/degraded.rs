//! Sick minorities, restarts and hot keys against real Redis nodes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quorumlock::{Error, Redlock};

use crate::common::{shared, unique_key, wait_until, Cluster};

const TTL: Duration = Duration::from_secs(5);
/// Node timeout where timeouts are not the subject (loaded CI machines).
const SLACK: Duration = Duration::from_millis(250);

#[test]
fn early_decision_does_not_wait_for_a_hung_node_and_leaves_no_key_behind() {
    let c = Cluster::start(3);
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    // Connections are open before the node hangs, so the SET reaches it.
    drop(locks.try_lock(&unique_key("warm"), TTL).unwrap());
    c.pause(2);
    let key = unique_key("early");
    let t = Instant::now();
    let g = locks
        .try_lock(&key, TTL)
        .expect("nodes 0 and 1 are a majority");
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(250),
        "waited {took:?} for a 1 s node timeout"
    );
    g.release().unwrap();
    // The hung node executes the SET when it resumes; the delete queued
    // behind it (or retried in the background) removes it again.
    c.unpause(2);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        wait_until(Duration::from_secs(3), || (0..3)
            .all(|i| c.get(i, &key).is_none())),
        "a key was left behind"
    );
}

#[test]
fn a_hung_node_is_skipped_after_one_timeout_and_rejoins_when_it_answers() {
    let c = Cluster::start(3);
    let timeout = Duration::from_millis(300);
    let locks = crate::client_with(c.urls(), timeout);
    drop(locks.lock(&unique_key("warm"), TTL).unwrap());
    c.pause(0);
    let t = Instant::now();
    drop(locks.try_lock(&unique_key("first"), TTL).expect("majority"));
    assert!(
        t.elapsed() < timeout * 3,
        "first attempt took {:?}",
        t.elapsed()
    );
    for n in 0..20 {
        let key = unique_key("skipped");
        let t = Instant::now();
        let g = locks.try_lock(&key, TTL).expect("majority");
        g.release().unwrap();
        let took = t.elapsed();
        assert!(
            took < timeout / 3,
            "cycle {n} took {took:?}: the hung node was not skipped"
        );
    }
    c.unpause(0);
    // A background probe lets it back in within its (growing) skip window.
    let key = unique_key("rejoined");
    let rejoined = wait_until(Duration::from_secs(8), || {
        let g = locks.try_lock(&key, TTL).expect("majority");
        let on_node0 = c.get(0, &key).as_deref() == Some(g.token());
        drop(g);
        on_node0
    });
    assert!(rejoined, "node 0 never rejoined");
}

#[test]
fn a_dead_node_costs_no_timeout() {
    let c = Cluster::start(3);
    c.stop(1);
    let timeout = Duration::from_millis(500);
    let locks = crate::client_with(c.urls(), timeout);
    for n in 0..20 {
        let key = unique_key("dead");
        let t = Instant::now();
        let g = locks.lock(&key, TTL).expect("majority");
        g.release().unwrap();
        let took = t.elapsed();
        assert!(
            took < timeout / 5,
            "cycle {n} took {took:?}: a refused node cost a wait"
        );
    }
}

/// Issue 9's fault suite, scenario 2: a node killed (-9) and started empty while a lock is
/// held. With restart protection no second holder is granted; without it one is. Clients
/// are fenced: even the control's second holder gets a larger token, since the restarted
/// node's counter starts again from its clock.
#[test]
fn a_restarted_node_votes_only_after_the_longest_ttl() {
    let c = Cluster::start(3);
    let ttl = Duration::from_secs(5);
    // Production defaults (no fresh_cluster): the cluster's lock history must
    // be older than the TTL first. A throwaway client writes it on every
    // node; then one TTL passes.
    let warm = crate::client_with(c.urls(), SLACK);
    assert!(c.write_history(&warm, ttl));
    // (+2 s: the age a node reports is also capped by its uptime, counted
    // in whole seconds less one.)
    std::thread::sleep(ttl + Duration::from_secs(2));
    let protected = || {
        Redlock::builder()
            .nodes(c.urls())
            .node_timeout(SLACK)
            .fencing(true)
            .build()
            .unwrap()
    };
    let a = protected();
    let b = protected();
    let unprotected = Redlock::builder()
        .nodes(c.urls())
        .node_timeout(SLACK)
        .restart_protection(false)
        .fencing(true)
        .build()
        .unwrap();
    // B and the unprotected client know the nodes and have used this TTL.
    for client in [&b, &unprotected] {
        client
            .lock(&unique_key("learn"), ttl)
            .unwrap()
            .release()
            .unwrap();
    }
    let key = unique_key("restart");
    c.stop(2);
    let held = a.lock(&key, ttl).expect("bare majority of nodes 0 and 1");
    assert!(c.get(1, &key).is_some());
    // Node 1 restarts without persistence and forgets A's lock; node 2
    // comes back empty too.
    c.stop(1);
    // Both nodes start after this instant, so neither may vote before
    // `restarted + ttl`.
    let restarted = Instant::now();
    c.restart(1);
    c.restart(2);
    assert_eq!(c.get(1, &key), None);

    // During the window B cannot win nodes 1 + 2.
    match b
        .request(&key, ttl)
        .acquire_for(Duration::from_millis(1200))
    {
        Err(e) => assert!(e.is_retryable(), "{e}"),
        Ok(_) => panic!("B locked while A still held it: the restarted nodes voted"),
    }
    assert!(held.is_held(), "A's lock is still valid");
    // Without the rule a client does win it: the hazard is real.
    let stolen = unprotected
        .request(&key, ttl)
        .acquire_for(Duration::from_millis(1500));
    let stolen = stolen.unwrap_or_else(|e| panic!("control client: {e}"));
    let (first, second) = (held.fencing_token(), stolen.fencing_token());
    assert!(
        second > first,
        "fencing orders the two holders: {second:?} after {first:?}"
    );
    drop(stolen);
    assert!(
        restarted.elapsed() < ttl,
        "test too slow to be inside the window"
    );

    // After the window (and A's expiry) B locks, with node 1's vote.
    let g = b
        .request(&key, ttl)
        .acquire_for(Duration::from_secs(8))
        .expect("normal operation resumes after the window");
    assert!(
        restarted.elapsed() >= ttl,
        "B locked {:?} after the restarts, inside the {ttl:?} window",
        restarted.elapsed()
    );
    assert!(wait_until(Duration::from_secs(1), || c
        .get(1, &key)
        .as_deref()
        == Some(g.token())));
}

#[test]
fn threads_of_one_process_take_turns_on_a_hot_key() {
    let c = shared();
    let key = unique_key("hot");
    let locks = crate::client_with(c.urls(), SLACK);
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let run_for = Duration::from_millis(1500);
    let counts: Vec<usize> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let (locks, key, inside, overlaps) =
                    (locks.clone(), key.clone(), inside.clone(), overlaps.clone());
                s.spawn(move || {
                    let started = Instant::now();
                    let mut n = 0;
                    while started.elapsed() < run_for {
                        let g = locks
                            .request(&key, TTL)
                            .acquire_for(Duration::from_secs(10))
                            .expect("turn within 10 s");
                        if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        inside.fetch_sub(1, Ordering::SeqCst);
                        g.release().expect("release");
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0)).collect()
    });
    assert_eq!(overlaps.load(Ordering::SeqCst), 0);
    let (min, max) = (
        *counts.iter().min().unwrap_or(&0),
        *counts.iter().max().unwrap_or(&0),
    );
    let total: usize = counts.iter().sum();
    // Without local hand-over, 8 threads polling with 0-200 ms pauses manage
    // a few dozen turns in 1.5 s; with it, hundreds.
    assert!(total >= 200, "only {total} acquisitions: {counts:?}");
    assert!(min * 3 >= max, "unfair spread {counts:?}");
}

#[test]
fn try_lock_does_not_queue_behind_local_holders() {
    let c = shared();
    let key = unique_key("try");
    let locks = crate::client_with(c.urls(), SLACK);
    let g = locks.lock(&key, TTL).unwrap();
    let t = Instant::now();
    assert!(matches!(
        locks.try_lock(&key, TTL),
        Err(Error::Taken { held, nodes: 3 }) if held >= 2
    ));
    assert!(t.elapsed() < Duration::from_millis(200));
    drop(g);
}

/// Issues 8 and 21: a lock handed to a local waiter is a new critical
/// section: numbered one more, under the same token and expiry on every
/// node (an unfenced hand-over sends nothing), and the old holder's loss
/// channel is disconnected (it can no longer fire for someone else's
/// section).
#[test]
fn a_lock_handed_to_a_local_waiter_is_the_next_section() {
    let c = shared();
    let key = unique_key("handover");
    let locks = crate::client_with(c.urls(), SLACK);
    let first = locks.lock(&key, TTL).unwrap();
    assert_eq!(first.section(), 1);
    let token = first.token().to_owned();
    let deadline = first.deadline();
    let old_lost = first.lost();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            locks
                .request(&key, TTL)
                .acquire_for(Duration::from_secs(5))
                .expect("handed over")
        });
        std::thread::sleep(Duration::from_millis(200)); // let it queue
        first.release().expect("hand over");
        let g = waiter.join().expect("waiter");
        assert_eq!(g.section(), 2, "the next section");
        assert_eq!(g.token(), token, "unfenced: the same token");
        assert_eq!(g.deadline(), deadline, "the same expiry");
        assert!(g.is_held() && g.validity() > TTL / 2, "{g:?}");
        let holding = (0..3)
            .filter(|&i| c.get(i, &key).as_deref() == Some(token.as_str()))
            .count();
        assert!(holding >= 2, "held on {holding} nodes");
        g.release().expect("release");
    });
    assert!(
        old_lost.wait_timeout(Duration::from_secs(5)).is_none() && old_lost.check().is_none(),
        "the old holder's loss signal ends without a loss"
    );
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(1)),
        "released at the end"
    );
}

#[test]
fn nodes_that_refuse_info_are_still_used() {
    // An ACL user without INFO (it is in @dangerous): restart detection
    // cannot work, but locking must.
    let c = Cluster::start(3);
    let mut urls = Vec::new();
    for i in 0..c.len() {
        let _: () = redis::cmd("ACL")
            .arg(&["SETUSER", "locker", "on", ">secret", "~*", "+@all", "-info"])
            .query(&mut c.conn(i))
            .expect("ACL SETUSER");
        urls.push(c.url(i).replace("redis://", "redis://locker:secret@"));
    }
    let locks = crate::client_with(urls, SLACK);
    let key = unique_key("no-info");
    let g = locks.lock(&key, TTL).expect("locks without INFO");
    assert!(c.holders(&key, g.token()) >= 2);
    g.release().expect("release");
}

/// Issue 8: `lock()` waited its whole budget in the local queue behind a thread of the
/// same process, and then made all its attempts on top (1.13 s instead of 750 ms with
/// the defaults). One deadline now bounds the whole call.
#[test]
fn lock_behind_a_local_holder_waits_no_longer_than_its_budget() {
    let c = shared();
    let key = unique_key("budget");
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .retry_delay(Duration::from_millis(300))
        .retry_jitter(Duration::ZERO)
        .build()
        .unwrap();
    // 3 × (300 + 0 + 50) ms.
    let budget = Duration::from_millis(1050);
    let held = locks.lock(&key, TTL).unwrap();
    let t = Instant::now();
    let waited = std::thread::scope(|s| {
        s.spawn(|| {
            assert!(locks.lock(&key, TTL).is_err(), "the key is held");
            t.elapsed()
        })
        .join()
        .unwrap()
    });
    drop(held);
    // The old code: the budget in the queue, then two 300 ms pauses and three rounds.
    assert!(
        waited < budget + Duration::from_millis(300),
        "lock() waited {waited:?} for a {budget:?} budget"
    );
}

/// Review of the hand-over swap: a baton received at the end of `lock()`'s
/// budget that cannot be used (another TTL) cost a release round and then
/// a full attempt on top: 862 ms for an 800 ms bound (budget + one node
/// timeout). A failed take-over with no time left now ends the call.
#[test]
fn an_unusable_baton_at_the_deadline_keeps_lock_within_its_bound() {
    use crate::common::faults::DelayProxy;
    let c = shared();
    let proxies: Vec<_> = c
        .urls()
        .iter()
        .map(|u| DelayProxy::start(u, Duration::from_millis(150)))
        .collect();
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(proxies.iter().map(|p| p.url()))
        .node_timeout(Duration::from_millis(200))
        .retry_count(2)
        .retry_delay(Duration::from_millis(100))
        .retry_jitter(Duration::ZERO)
        .build()
        .unwrap();
    // Budget 2 × (100 + 0 + 200) = 600 ms; bound 600 + 200 = 800 ms.
    let bound = Duration::from_millis(800);
    let key = unique_key("baton-bound");
    let held = locks.lock(&key, Duration::from_secs(10)).unwrap();
    let took = std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let t = Instant::now();
            let r = locks.lock(&key, Duration::from_secs(8));
            (t.elapsed(), r.is_ok())
        });
        std::thread::sleep(Duration::from_millis(560));
        drop(held); // hands over a 10 s lock to a waiter that wants 8 s
        waiter.join().unwrap().0
    });
    assert!(took <= bound, "lock() took {took:?}, bound {bound:?}");
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(2)),
        "nothing left"
    );
}

/// Review of the hand-over swap: a node skipped (paused, then failing) for
/// many hand-overs in a row kept the first section's token, which the last
/// section's release no longer named (it remembered 4 tokens): `release()`
/// said `Ok` and the key stayed there for the whole TTL. A token now names
/// its lineage, and release deletes any token of it.
#[test]
fn a_node_that_missed_many_hand_overs_is_cleaned_by_the_release() {
    let c = Cluster::start(3);
    // Fenced: only a fenced hand-over swaps tokens.
    let locks = fenced_client(c.urls(), Duration::from_millis(100));
    let ttl = Duration::from_secs(10);
    let key = unique_key("missed-swaps");
    // A new client's first lock lands only on the nodes connected by then.
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    let first = locks.lock(&key, ttl).unwrap();
    let t0 = first.token().to_owned();
    assert!(wait_until(Duration::from_secs(1), || c.holders(&key, &t0) == 3));
    c.pause(2);
    // A round that needs node 2's reply (node 0 refuses): it times out and
    // is then skipped as failing.
    let probe = unique_key("missed-swaps-probe");
    let _: () = redis::cmd("SET")
        .arg(&probe)
        .arg("x")
        .arg("PX")
        .arg(5000)
        .query(&mut c.conn(0))
        .unwrap();
    assert!(locks.try_lock(&probe, ttl).is_err());
    let mut g = first;
    for _ in 0..10 {
        g = std::thread::scope(|s| {
            let w = s.spawn(|| {
                locks
                    .request(&key, ttl)
                    .acquire_for(Duration::from_secs(2))
                    .expect("handed over")
            });
            std::thread::sleep(Duration::from_millis(3)); // let it queue
            g.release().expect("hand over");
            w.join().expect("waiter")
        });
    }
    c.unpause(2);
    g.release().expect("release");
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(2)),
        "left: {:?}",
        (0..3).map(|i| c.get(i, &key)).collect::<Vec<_>>()
    );
}

/// Hostile check of the fenced hand-over's swap: 2 of 3 nodes hang while
/// a lock is handed over. The swap cannot count, its undo is sent without
/// waiting, and the receiver's own attempts fail; once the nodes resume, no
/// key of the lineage (nor of the attempts) is left anywhere.
#[test]
fn a_fenced_hand_over_while_two_nodes_hang_leaves_nothing_after_they_resume() {
    let c = Cluster::start(3);
    let locks = fenced_client(c.urls(), Duration::from_millis(100));
    let key = unique_key("handover-hung");
    let first = locks.lock(&key, TTL).unwrap();
    let outcome = std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            locks
                .request(&key, TTL)
                .acquire_for(Duration::from_millis(1500))
                .map(|g| g.token().to_owned())
        });
        std::thread::sleep(Duration::from_millis(100)); // let it queue
        c.pause(1);
        c.pause(2);
        first.release().expect("handed over");
        waiter.join().expect("waiter")
    });
    c.unpause(1);
    c.unpause(2);
    assert!(outcome.is_err(), "one node cannot grant: {outcome:?}");
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(3)),
        "left: {:?}",
        (0..3).map(|i| c.get(i, &key)).collect::<Vec<_>>()
    );
}

/// Issue 21: an unfenced hand-over needs no node: 2 of 3 nodes hang while
/// it happens, and the receiver still holds the lock (its validity stands:
/// nothing was sent). Its release after they resume leaves nothing.
#[test]
fn an_unfenced_hand_over_while_two_nodes_hang_needs_no_node() {
    let c = Cluster::start(3);
    let locks = crate::client_with(c.urls(), Duration::from_millis(100));
    let key = unique_key("handover-hung-unfenced");
    let first = locks.lock(&key, TTL).unwrap();
    let token = first.token().to_owned();
    let g = std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            locks
                .request(&key, TTL)
                .acquire_for(Duration::from_millis(1500))
        });
        std::thread::sleep(Duration::from_millis(100)); // let it queue
        c.pause(1);
        c.pause(2);
        first.release().expect("handed over");
        waiter.join().expect("waiter")
    })
    .expect("handed over without a round trip");
    assert_eq!((g.section(), g.token()), (2, token.as_str()));
    assert!(g.is_held());
    c.unpause(1);
    c.unpause(2);
    g.release().expect("released");
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(3)),
        "left: {:?}",
        (0..3).map(|i| c.get(i, &key)).collect::<Vec<_>>()
    );
}

fn fenced_client(urls: Vec<String>, node_timeout: Duration) -> quorumlock::Redlock {
    quorumlock::Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .node_timeout(node_timeout)
        .fencing(true)
        .build()
        .expect("valid config")
}

/// Hostile check of the hand-over, fenced (swaps) and not: a node under
/// `CLIENT PAUSE WRITE` holds every swap (a write script) while rounds
/// settle on the other two;
/// the held swaps land late, after later swaps and even after the release.
/// Nothing of the lineage may be left once the pause ends.
#[test]
fn hand_overs_past_a_write_paused_node_leave_nothing_behind() {
    use crate::common::faults::WritePause;
    let c = Cluster::start(3);
    for fenced in [false, true] {
        let locks = if fenced {
            fenced_client(c.urls(), Duration::from_millis(100))
        } else {
            crate::client_with(c.urls(), Duration::from_millis(100))
        };
        let key = unique_key("handover-wp");
        let mut g = locks.lock(&key, TTL).unwrap();
        {
            let _paused = WritePause::start(&c, 2, Duration::from_secs(5));
            for _ in 0..5 {
                g = std::thread::scope(|s| {
                    let w = s.spawn(|| {
                        locks
                            .request(&key, TTL)
                            .acquire_for(Duration::from_secs(2))
                            .expect("handed over or locked anew")
                    });
                    std::thread::sleep(Duration::from_millis(3)); // let it queue
                    g.release().expect("hand over");
                    w.join().expect("waiter")
                });
            }
            g.release().expect("release");
        }
        assert!(
            c.gone_everywhere(&key, Duration::from_secs(3)),
            "fenced {fenced}: left: {:?}",
            (0..3).map(|i| c.get(i, &key)).collect::<Vec<_>>()
        );
    }
}
