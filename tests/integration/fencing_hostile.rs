//! Attacks on the fencing tokens against real Redis nodes. The first two were defects
//! (counters past 2^53, where Lua's doubles round `+ 1` away, tied and went backwards);
//! the rest held.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use quorumlock::Redlock;

use crate::common::faults::{Blackhole, HoldProxy, WritePause};
use crate::common::{shared, unique_key, wait_until, ClockOffset, Cluster};
use crate::fencing::{fenced, hand_over};

const TTL: Duration = Duration::from_secs(5);
const TWO_53: u64 = 1 << 53;

/// `HSET quorumlock:meta fence:<key> <value>` on node `i`.
fn set_counter(c: &Cluster, i: usize, key: &str, value: u64) {
    let _: i64 = redis::cmd("HSET")
        .arg("quorumlock:meta")
        .arg(format!("fence:{key}"))
        .arg(value.to_string())
        .query(&mut c.conn(i))
        .expect("HSET");
}

/// Runs the same schedule on `key` and returns every token in the order the sections
/// held the lock: three fresh locks alternating between two clients, one hand-over, and a
/// fresh lock by the other client after it.
fn schedule(a: &Redlock, b: &Redlock, key: &str) -> Vec<(&'static str, u64)> {
    let mut tokens = Vec::new();
    for i in 0..4 {
        let (who, l) = if i % 2 == 0 { ("A", a) } else { ("B", b) };
        let g = l
            .request(key, TTL)
            .acquire_for(Duration::from_secs(5))
            .expect("free key");
        tokens.push((who, g.fencing_token().expect("fenced")));
        g.release().expect("release");
    }
    let (held, next) = hand_over(a, key);
    tokens.push(("A holds", held));
    tokens.push(("A hands over", next));
    let g = b
        .request(key, TTL)
        .acquire_for(Duration::from_secs(5))
        .expect("free key");
    tokens.push(("B after", g.fencing_token().expect("fenced")));
    g.release().expect("release");
    tokens
}

/// Every pair of consecutive sections whose token did not grow.
fn not_increasing(tokens: &[(&'static str, u64)]) -> Vec<String> {
    tokens
        .windows(2)
        .filter(|w| w[1].1 <= w[0].1)
        .map(|w| format!("{} {} then {} {}", w[0].0, w[0].1, w[1].0, w[1].1))
        .collect()
}

// ---------------------------------------------------------------------------------------
// Counters at the limit of exact Lua numbers

/// Counters are Lua doubles. Planted just past 2^53, `counter + 1` rounded back to
/// `counter`: two sections got one token (the README's `<=` check then lets the stale one
/// write) and a hand-over's `T + 1` was not recorded. Now a fenced acquire meeting a
/// counter at the limit fails with an error that says so, and never ties.
#[test]
fn a_counter_at_the_limit_of_exact_numbers_refuses_instead_of_tying() {
    let c = shared();
    let key = unique_key("fence-2p53");
    for i in 0..c.len() {
        set_counter(&c, i, &key, TWO_53 + 4);
    }
    match fenced(&c.urls()).try_lock(&key, TTL) {
        Err(quorumlock::Error::NoQuorum { failures, .. }) => {
            // A majority said why (the round settles without the last node).
            let said = failures
                .iter()
                .filter(|f| {
                    f.kind() == quorumlock::NodeErrorKind::Server
                        && f.to_string().contains("at its limit")
                })
                .count();
            assert!(said >= 2, "{failures:?}");
        }
        other => panic!("a token past 2^53 cannot be exact: {other:?}"),
    }
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(1)),
        "no SET ran"
    );
}

/// The same, reached through the API: node 0's wall clock runs ~230 years ahead (the
/// clock shim of the fault suite's scenario 4) while fenced locks are taken, then steps
/// back. Node 0 refuses fenced acquires while its clock is past the year 2255 (its counter
/// would pass 2^53), nodes 1 and 2 grant them, and tokens keep growing once the clock is
/// right again.
#[test]
fn a_node_clock_past_2255_is_refused_and_tokens_keep_growing() {
    let offset = ClockOffset::new();
    let c = Cluster::start_processes(3, |i| if i == 0 { offset.env() } else { Vec::new() })
        .unwrap_or_else(|e| panic!("{e}"));
    let now_us = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64;
    // Node 0's clock: 2^53 µs + ~12 days (mid-2255).
    offset.step_micros(&c, 0, (TWO_53 as i64) + (1 << 40) - now_us);
    let (a, b) = (fenced(&c.urls()), fenced(&c.urls()));
    let key = unique_key("fence-2255");
    let g = a.lock(&key, TTL).expect("nodes 1 and 2 grant it");
    let t0 = g.fencing_token().unwrap();
    assert!(t0 < TWO_53, "{t0}");
    assert_eq!(c.get(0, &key), None, "node 0 refused before its SET");
    g.release().unwrap();
    // NTP fixes node 0's clock.
    offset.step(&c, 0, 0);
    let mut tokens = vec![("A (node 0's clock ahead)", t0)];
    tokens.extend(schedule(&a, &b, &key));
    let bad = not_increasing(&tokens);
    assert!(
        bad.is_empty(),
        "tokens in holding order {tokens:?}: not increasing: {bad:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Attacks that held up

/// 2 clients × 16 threads on one hot key: hand-overs inside each client, fresh locks
/// across them. Each section checks, while it still holds the lock, that its token is
/// above the previous section's (a mutex taken inside the section: sections do not
/// overlap, so the mutex order is the holding order), and no token repeats.
#[test]
fn thirty_two_threads_on_one_hot_key_get_tokens_in_holding_order() {
    let c = shared();
    let key = unique_key("fence-hot32");
    let clients: Vec<Redlock> = (0..2).map(|_| fenced(&c.urls())).collect();
    // (largest token so far, violations, every token)
    type Seen = (u64, Vec<String>, Vec<u64>);
    let last: Arc<Mutex<Seen>> = Arc::default();
    let ttl = Duration::from_secs(3);
    std::thread::scope(|s| {
        for t in 0..32 {
            let (l, key, last) = (clients[t % 2].clone(), key.clone(), last.clone());
            s.spawn(move || {
                for _ in 0..6 {
                    let g = l
                        .request(&key, ttl)
                        .acquire_for(Duration::from_secs(60))
                        .expect("a turn within 60 s");
                    let tok = g.fencing_token().unwrap();
                    {
                        let mut st = last.lock().unwrap();
                        assert!(g.is_held(), "still held at the check");
                        if tok <= st.0 {
                            let msg = format!("thread {t}: {tok} after {}", st.0);
                            st.1.push(msg);
                        }
                        st.0 = st.0.max(tok);
                        st.2.push(tok);
                    }
                    std::thread::sleep(Duration::from_micros(300));
                    g.release().expect("release");
                }
            });
        }
    });
    let (_, bad, mut all) = std::mem::take(&mut *last.lock().unwrap());
    assert!(bad.is_empty(), "tokens out of holding order: {bad:?}");
    let n = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), n, "a token was given to two sections");
    assert_eq!(n, 32 * 6);
}

/// A node under `CLIENT PAUSE … WRITE` from before the client starts: every fenced lock
/// is granted without waiting for it, tokens grow, and once writes resume no key is left.
#[test]
fn a_write_paused_node_from_client_start_costs_fenced_locks_nothing() {
    let c = Cluster::start(3);
    let pause = WritePause::start(&c, 2, Duration::from_secs(30));
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(200))
        .fencing(true)
        .build()
        .unwrap();
    let key = unique_key("fence-wpause");
    let mut last = 0;
    for i in 0..20 {
        let t = Instant::now();
        let g = locks.lock(&key, TTL).expect("nodes 0 and 1");
        let took = t.elapsed();
        let tok = g.fencing_token().unwrap();
        assert!(tok > last, "{tok} after {last}");
        last = tok;
        if i > 0 {
            assert!(took < Duration::from_millis(150), "lock {i} took {took:?}");
        }
        g.release().unwrap();
    }
    drop(pause);
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(3)),
        "left on node 2: {:?}",
        c.get(2, &key)
    );
    let g = fenced(&c.urls()).lock(&key, TTL).unwrap();
    assert!(g.fencing_token().unwrap() > last);
}

/// A node that accepts TCP and never answers, from client start: locks are granted at
/// the pace of the two good nodes, with growing tokens.
#[test]
fn a_hung_node_from_client_start_costs_fenced_locks_nothing() {
    let c = shared();
    let hole = Blackhole::start();
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes([c.url(0), c.url(1), hole.url()])
        .node_timeout(Duration::from_millis(200))
        .fencing(true)
        .build()
        .unwrap();
    let key = unique_key("fence-hole");
    let mut last = 0;
    let t = Instant::now();
    for _ in 0..20 {
        let g = locks.lock(&key, TTL).expect("nodes 0 and 1");
        let tok = g.fencing_token().unwrap();
        assert!(tok > last, "{tok} after {last}");
        last = tok;
        g.release().unwrap();
    }
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

/// SCRIPT FLUSH on every node between the acquire and the hand-over, and between the
/// hand-over and a fresh lock: tokens still grow.
#[test]
fn tokens_grow_across_script_flushes() {
    let c = Cluster::start(3);
    let flush = || {
        for i in 0..3 {
            let _: () = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query(&mut c.conn(i))
                .unwrap();
        }
    };
    let (a, b) = (fenced(&c.urls()), fenced(&c.urls()));
    let key = unique_key("fence-flush");
    flush();
    let (t, next) = {
        let first = a.lock(&key, TTL).unwrap();
        let t = first.fencing_token().unwrap();
        flush();
        let waiter = {
            let (a, key) = (a.clone(), key.clone());
            std::thread::spawn(move || {
                let g = a
                    .request(&key, TTL)
                    .acquire_for(Duration::from_secs(5))
                    .unwrap();
                g.fencing_token().unwrap()
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        first.release().unwrap();
        (t, waiter.join().unwrap())
    };
    assert_eq!(next, t + 1);
    flush();
    let g = b
        .request(&key, TTL)
        .acquire_for(Duration::from_secs(5))
        .unwrap();
    assert!(g.fencing_token().unwrap() > next);
}

/// Node 2 is frozen (SIGSTOP) through four hand-overs, resumes, then node 0 dies: the
/// next holder is granted by node 1 and node 2 (which missed every swap), and its token is
/// above the last hand-over's.
#[test]
fn a_node_that_missed_several_swaps_still_orders_the_next_token() {
    let c = Cluster::start(3);
    let locks = fenced(&c.urls());
    let key = unique_key("fence-missed");
    drop(locks.lock(&unique_key("warm"), TTL).unwrap());
    c.pause(2);
    let holder = locks.lock(&key, TTL).expect("nodes 0 and 1");
    let mut last = holder.fencing_token().unwrap();
    let mut holder = Some(holder);
    for _ in 0..4 {
        let (l, k) = (locks.clone(), key.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let w = std::thread::spawn(move || {
            let g = l
                .request(&k, TTL)
                .acquire_for(Duration::from_secs(5))
                .unwrap();
            let t = g.fencing_token().unwrap();
            tx.send(()).unwrap();
            // Keep it until the main thread hands it on.
            (g, t)
        });
        std::thread::sleep(Duration::from_millis(100));
        holder.take().unwrap().release().unwrap();
        rx.recv().unwrap();
        let (g, t) = w.join().unwrap();
        assert_eq!(t, last + 1);
        last = t;
        holder = Some(g);
    }
    c.unpause(2);
    drop(holder);
    c.stop(0);
    let b = fenced(&[c.url(0), c.url(1), c.url(2)]);
    let g = b
        .request(&key, TTL)
        .acquire_for(Duration::from_secs(10))
        .expect("nodes 1 and 2");
    assert!(
        g.fencing_token().unwrap() > last,
        "{:?} after {last}",
        g.fencing_token()
    );
}

/// Production settings (restart protection, no fresh-cluster trust), equal clocks: a
/// node restarted empty while a lock is held on a bare majority; the next holder, granted
/// by it and a node that never saw the lock once the hold is over, gets a larger token.
#[test]
fn a_node_restarted_empty_gives_a_larger_token_after_its_hold() {
    let c = Cluster::start(3);
    let ttl = Duration::from_secs(1);
    let client = || {
        Redlock::builder()
            .nodes(c.urls())
            .node_timeout(Duration::from_millis(250))
            .max_ttl(Duration::from_secs(2))
            .fencing(true)
            .build()
            .unwrap()
    };
    let a = client();
    let key = unique_key("fence-restart");
    c.stop(2);
    let g = a
        .request(&key, ttl)
        .acquire_for(Duration::from_secs(10))
        .expect("nodes 0 and 1 once their history is old enough");
    let t = g.fencing_token().unwrap();
    c.restart(1);
    c.stop(0);
    c.restart(2);
    let b = client();
    match b.try_lock(&key, ttl) {
        Err(e) => assert!(e.is_retryable(), "{e}"),
        Ok(_) => panic!("two young nodes granted at once"),
    }
    let gb = b
        .request(&key, ttl)
        .acquire_for(Duration::from_secs(10))
        .expect("after the hold");
    assert!(gb.fencing_token().unwrap() > t);
    std::mem::forget(g);
}

/// Renewal keeps the token and does not move the counters; extending by hand too.
#[test]
fn renewal_keeps_the_token_and_the_counters() {
    let c = shared();
    let key = unique_key("fence-renew");
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .auto_renew(true)
        .fencing(true)
        .build()
        .unwrap();
    let ttl = Duration::from_millis(400);
    let g = locks.lock(&key, ttl).unwrap();
    let t = g.fencing_token().unwrap();
    // A node whose SET came in after the round settled may hold a larger counter of its
    // own (its clock read later): only renewal's effect is checked.
    std::thread::sleep(Duration::from_millis(50));
    let before: Vec<Option<u64>> = (0..3).map(|i| c.fence(i, &key)).collect();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(g.is_held() && !g.is_lost());
    g.extend(ttl).unwrap();
    assert_eq!(g.fencing_token(), Some(t));
    let after: Vec<Option<u64>> = (0..3).map(|i| c.fence(i, &key)).collect();
    assert_eq!(before, after, "renewals moved the counters");
    g.release().unwrap();
    let g = fenced(&c.urls()).lock(&key, TTL).unwrap();
    assert!(g.fencing_token().unwrap() > t);
}

/// Validity runs out during the write-back: node 2 is down, node 1 answers 50 ms late (a
/// delaying proxy), the TTL is 100 ms. The acquire round leaves 47 ms of validity, the
/// write-back needs 50: no guard, a retryable error from every attempt of lock(), and the
/// key is gone from the nodes afterwards.
#[test]
fn validity_running_out_during_the_write_back_grants_nothing() {
    let c = Cluster::start(3);
    let slow = crate::common::faults::DelayProxy::start(&c.url(1), Duration::from_millis(50));
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes([c.url(0), slow.url(), c.url(2)])
        .node_timeout(Duration::from_millis(200))
        .fencing(true)
        .build()
        .unwrap();
    drop(locks.lock(&unique_key("warm"), TTL).unwrap());
    c.stop(2);
    let key = unique_key("fence-late-wb");
    match locks.lock(&key, Duration::from_millis(100)) {
        Ok(g) => panic!(
            "granted with {:?} of validity left, token {:?}",
            g.validity(),
            g.fencing_token()
        ),
        Err(e) => assert!(e.is_retryable(), "{e:?}"),
    }
    assert!(
        wait_until(Duration::from_secs(1), || (0..2)
            .all(|i| c.get(i, &key).is_none())),
        "key left behind: {:?} {:?}",
        c.get(0, &key),
        c.get(1, &key)
    );
}

/// Extreme inputs with fencing: the longest TTL, an unbounded wait.
#[test]
fn extreme_inputs_with_fencing() {
    let c = shared();
    let locks = fenced(&c.urls());
    let key = unique_key("fence-huge");
    let g = locks
        .request(&key, quorumlock::MAX_TTL)
        .acquire_for(Duration::MAX)
        .unwrap();
    let t = g.fencing_token().unwrap();
    assert!(t < TWO_53);
    g.release().unwrap();
    assert!(locks.lock(&key, Duration::MAX).is_err());
    assert!(c.gone_everywhere(&key, Duration::from_secs(1)));
    // The longest resource name is also the longest counter field; one more is refused.
    let longest = format!(
        "{key}:{}",
        "x".repeat(quorumlock::MAX_RESOURCE_LEN - key.len() - 1)
    );
    let g = locks.lock(&longest, TTL).expect("the longest name");
    assert!(g.fencing_token().unwrap() < TWO_53);
    g.release().unwrap();
    assert!(locks.lock(&format!("{longest}x"), TTL).is_err());
}

/// 2 of 3 nodes paused (SIGSTOP) during a fenced attempt: it fails, and once they resume
/// no key is left (the SETs they ran late are deleted behind them), and the next lock's
/// token is above every counter those late SETs moved.
#[test]
fn two_nodes_paused_during_a_fenced_attempt_leave_no_key() {
    let c = Cluster::start(3);
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(300))
        .fencing(true)
        .build()
        .unwrap();
    drop(locks.lock(&unique_key("warm"), TTL).unwrap());
    let key = unique_key("fence-two-paused");
    c.pause(1);
    c.pause(2);
    let attempt = locks.try_lock(&key, Duration::from_secs(20));
    c.unpause(1);
    c.unpause(2);
    assert!(attempt.is_err(), "one node of three granted: {attempt:?}");
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(3)),
        "left after the nodes resumed: {:?}",
        (0..3).map(|i| c.get(i, &key)).collect::<Vec<_>>()
    );
    // The late SETs moved the counters where they ran; the next token is above them all.
    let counters: Vec<Option<u64>> = (0..3).map(|i| c.fence(i, &key)).collect();
    let g = fenced(&c.urls()).lock(&key, TTL).expect("nobody holds it");
    let t = g.fencing_token().unwrap();
    assert!(
        counters.iter().flatten().all(|&f| t > f),
        "{t} vs {counters:?}"
    );
}

/// A fenced client over `urls` (review of issue 42).
fn fenced_client(urls: Vec<String>) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .fencing(true)
        .node_timeout(Duration::from_millis(100))
        .retry_delay(Duration::from_millis(20))
        .build()
        .expect("valid config")
}

/// A write-back that SET the counter where the key holds our token (tried
/// in issue 42, for an election's term) breaks fencing. A
/// holder's SET can land late on a node (delayed in the network: the round
/// did not wait for it), after later holders were granted there and wrote
/// their tokens back; its write-back, delayed behind it, then finds its key
/// and lowers the counter below a token already handed out. The docs say a
/// node whose clock stepped back while keeping its data is harmless; after
/// such a step the counters run ahead of the nodes' clocks, so nothing but
/// the counters orders the tokens, and the next holder gets a token no
/// larger than an earlier one. Plain fenced locks, no election involved.
///
/// Nodes n0, n1, n2. H reaches n2 through a proxy that holds its commands
/// on the key for 1.5 s; C cannot reach n0; D cannot reach n1.
#[test]
fn a_late_write_back_lowers_a_counter_and_a_later_fenced_lock_gets_no_larger_token() {
    let clock = ClockOffset::new();
    let env = clock.env();
    let cluster = Cluster::start_processes(3, |i| if i == 1 { env.clone() } else { Vec::new() })
        .expect("3 redis-server processes");
    let r = unique_key("fence-lowered");
    // n1's clock was an hour ahead, and is stepped back (it keeps its data):
    // every counter of `r` is now an hour ahead of the nodes' clocks.
    clock.step(&cluster, 1, 3600);
    let p = fenced_client(cluster.urls());
    assert_eq!(p.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    // p's token must come from n1's clock, an hour ahead. On a loaded machine n1 can
    // answer after the round settled on n0 and n2 (a token from their clocks), and even
    // run p's SET after its clock is stepped back: until n1 is in p's round, and every
    // counter holds p's token, before the step back.
    let now_us = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
    };
    let mut t_p = 0;
    for _ in 0..5 {
        let g = p.lock(&r, Duration::from_secs(2)).expect("p locks");
        t_p = g.fencing_token().expect("fenced");
        g.release().expect("released");
        if t_p > now_us() + 1_800_000_000 {
            break;
        }
    }
    assert!(
        t_p > now_us() + 1_800_000_000,
        "n1 never in p's round: {t_p}"
    );
    let mut fences = Vec::new();
    assert!(
        wait_until(Duration::from_secs(5), || {
            fences = (0..3).map(|i| cluster.fence(i, &r)).collect::<Vec<_>>();
            fences.iter().all(|f| *f == Some(t_p))
        }),
        "written back everywhere: {fences:?}, t_p {t_p}"
    );
    clock.step(&cluster, 1, 0);

    // H: its commands on `r` to n2 are held 1.5 s in the network.
    let hold = HoldProxy::start(
        &cluster.url(2),
        r.as_bytes().to_vec(),
        Duration::from_millis(1500),
    );
    let h = fenced_client(vec![cluster.url(0), cluster.url(1), hold.url()]);
    let _ = h.wait_connected(Duration::from_secs(5));
    let g = h
        .try_lock(&r, Duration::from_secs(1))
        .expect("h: n0 and n1");
    let t_h = g.fencing_token().expect("fenced");
    let _ = g.release();

    // C (n0 unreachable) is granted by n1 and n2 and writes back t_c there.
    let hole0 = Blackhole::start();
    let c = fenced_client(vec![hole0.url(), cluster.url(1), cluster.url(2)]);
    let _ = c.wait_connected(Duration::from_secs(5));
    let g = c
        .try_lock(&r, Duration::from_secs(1))
        .expect("c: n1 and n2");
    let t_c = g.fencing_token().expect("fenced");
    assert!(t_c > t_h);
    g.release().expect("released");
    assert!(cluster.fence(2, &r).expect("n2's counter") >= t_c);

    // H's held SET lands on n2 (free), then its write-back: n2's counter
    // becomes t_h again. (Wait for the key to go: H's release or its TTL.)
    assert!(wait_until(Duration::from_secs(6), || {
        cluster.get(2, &r).is_none() && hold_landed(&cluster, &r, t_c)
    }));
    let n2 = cluster.fence(2, &r).expect("n2's counter");

    // D (n1 unreachable) is granted by n0 and n2.
    let hole1 = Blackhole::start();
    let d = fenced_client(vec![cluster.url(0), hole1.url(), cluster.url(2)]);
    let _ = d.wait_connected(Duration::from_secs(5));
    let g = d
        .try_lock(&r, Duration::from_secs(1))
        .expect("d: n0 and n2");
    let t_d = g.fencing_token().expect("fenced");
    let _ = g.release();
    assert!(
        t_d > t_c,
        "fencing order broken: D (after C) got {t_d}, C had {t_c} (H {t_h}; n2's counter \
         was lowered from >= {t_c} to {n2} by H's late write-back)"
    );
}

/// Whether H's held commands have reached n2: its counter moved since C's
/// write-back (raised by H's late SET, or set by H's late write-back).
fn hold_landed(cluster: &Cluster, r: &str, t_c: u64) -> bool {
    cluster.fence(2, r) != Some(t_c)
}
