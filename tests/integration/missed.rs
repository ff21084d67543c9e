//! Review of the wake-up rule (a waiter stops listening after three woken tries in a row
//! that met the same owners): real releases it must not miss, and message storms it must
//! not turn into back-to-back rounds. Clients use `fresh_cluster(true)` on the shared
//! throwaway nodes.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use quorumlock::Redlock;

use crate::common::{shared, unique_key};
use crate::storms::{counted, forge};

/// A plain client on `urls`.
fn plain(urls: Vec<String>) -> Redlock {
    let locks = crate::client_with(urls, Duration::from_millis(250));
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    locks
}

/// A set `[a, b, c]` waits (`acquire_for`, retry pause 3 s: fallback 1 s) while
/// three clients hold one key each, `a` for 30 s, `b` for 20 s, `c` for 10 s. They release
/// `a`, `b`, then `c`, 150 ms apart: each release wakes the set, whose first two woken
/// tries meet owners with less time left than before (a node's answer is its longest over
/// the keys). The last release is real: the set must get in at once, not at its fallback.
#[test]
fn a_set_hears_the_last_release_after_two_others() {
    let c = shared();
    let keys: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|k| unique_key(&format!("missed-set-{k}")))
        .collect();
    let holders: Vec<Redlock> = (0..3).map(|_| plain(c.urls())).collect();
    let guards: Vec<_> = holders
        .iter()
        .zip(&keys)
        .zip([30, 20, 10])
        .map(|((h, k), s)| h.try_lock(k, Duration::from_secs(s)).expect("a holder"))
        .collect();
    let (set, _) = counted(c.urls(), Duration::from_secs(3));
    let w = std::thread::spawn({
        let keys = keys.clone();
        move || {
            let g = crate::common::request_all(&set, &keys, Duration::from_secs(10))
                .acquire_for(Duration::from_secs(8));
            let at = Instant::now();
            (g.map(|g| g.release()), at)
        }
    });
    // The set fails, subscribes and waits.
    std::thread::sleep(Duration::from_millis(300));
    let mut released = Instant::now();
    for g in guards {
        std::thread::sleep(Duration::from_millis(150));
        g.release().expect("a holder's release");
        released = Instant::now();
    }
    let (got, at) = w.join().expect("the set");
    assert!(matches!(got, Ok(Ok(()))), "the set: {got:?}");
    let late = at.saturating_duration_since(released);
    assert!(
        late < Duration::from_millis(500),
        "the set got the lock {late:?} after the last release"
    );
}

/// A holder keeps `key` with a 30 s TTL and releases it; a second client takes it at once
/// with a 10 s TTL and releases it; a third takes it at once with a 5 s TTL and releases
/// it 150 ms later. A waiter (retry pause 3 s: fallback 1 s) is woken by each release;
/// its first two woken tries meet owners with less time left than the one before (a
/// shorter TTL each). The last release is real: it must get the lock at once, not at its
/// fallback (it came ~850 ms late, seen in about half of the chains).
#[test]
fn a_waiter_hears_a_release_after_two_hand_overs_to_shorter_ttls() {
    let c = shared();
    let (a, b, d) = (plain(c.urls()), plain(c.urls()), plain(c.urls()));
    // The waiter may win a race meant for `b` or `d`, or try between a release and the
    // next owner's SET (it then sees a change): three chains that formed, of eight at most.
    let mut formed = 0;
    for _ in 0..8 {
        let key = unique_key("missed-chain");
        let g = a
            .try_lock(&key, Duration::from_secs(30))
            .expect("the first holder");
        let (waiter, _) = counted(c.urls(), Duration::from_secs(3));
        let w = std::thread::spawn({
            let key = key.clone();
            move || {
                let g = waiter
                    .request(&key, Duration::from_secs(10))
                    .acquire_for(Duration::from_secs(8));
                let at = Instant::now();
                (g.map(|g| g.release()), at)
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        let chain = || -> Option<Instant> {
            g.release().ok()?;
            let g2 = b.try_lock(&key, Duration::from_secs(10)).ok()?;
            std::thread::sleep(Duration::from_millis(150));
            g2.release().ok()?;
            let g3 = d.try_lock(&key, Duration::from_secs(5)).ok()?;
            std::thread::sleep(Duration::from_millis(150));
            g3.release().ok()?;
            Some(Instant::now())
        };
        let released = chain();
        let (got, at) = w.join().expect("waiter");
        assert!(matches!(got, Ok(Ok(()))), "the waiter: {got:?}");
        let Some(released) = released else {
            continue;
        };
        let late = at.saturating_duration_since(released);
        assert!(
            late < Duration::from_millis(500),
            "the waiter got the lock {late:?} after the last release"
        );
        formed += 1;
        if formed == 3 {
            return;
        }
    }
    panic!("the waiter won the races meant for the chain: {formed} chains formed");
}

/// A holder keeps `key` on two nodes of three (its copy on the third is gone: a node
/// restarted, or its SET there failed). A storm of forged messages for 1.2 s must cost a
/// `acquire_for` waiter (retry pause 100 ms) at most three extra rounds per pause, as
/// where the holder is on every node: each woken try sets the free node and undoes it.
#[test]
fn a_storm_against_a_holder_on_a_bare_majority_costs_few_rounds() {
    let c = shared();
    let key = unique_key("missed-storm-bare");
    let holder = plain(c.urls());
    let g = holder
        .try_lock(&key, Duration::from_secs(30))
        .expect("the holder");
    c.del(2, &key);
    let (timed, rounds) = counted(c.urls(), Duration::from_millis(100));
    let timed = std::thread::spawn({
        let key = key.clone();
        move || {
            timed
                .request(&key, Duration::from_secs(5))
                .acquire_for(Duration::from_secs(10))
                .map(|g| g.release())
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let r0 = rounds.0.load(Ordering::SeqCst);
    let (sent, during) = forge(&c, &key, Duration::from_millis(1_200));
    let r1 = rounds.0.load(Ordering::SeqCst);
    assert!(sent > 100, "the storm sent {sent} messages");
    let bound = 4 * (during.as_millis() / 100) as usize + 6;
    g.release().expect("release");
    let got = timed.join().expect("waiter");
    assert!(
        r1 - r0 <= bound,
        "acquire_for ran {} rounds in a {during:?} storm of {sent} messages",
        r1 - r0
    );
    assert!(matches!(got, Ok(Ok(()))), "the waiter: {got:?}");
}
