//! Fencing tokens against real Redis nodes: the scripts' counters, the write-back,
//! hand-overs, and the fault suite's scenarios.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use quorumlock::Redlock;

use crate::common::{shared, unique_key, ClockOffset, Cluster};

const TTL: Duration = Duration::from_secs(5);
const SLACK: Duration = Duration::from_millis(250);

/// A fenced client over `urls` (fresh cluster, generous node timeout).
pub(crate) fn fenced(urls: &[String]) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls.iter().cloned())
        .node_timeout(SLACK)
        .fencing(true)
        .build()
        .expect("valid config")
}

#[test]
fn tokens_grow_across_clients_and_are_written_back() {
    let c = shared();
    let key = unique_key("fence-grow");
    let (a, b) = (fenced(&c.urls()), fenced(&c.urls()));
    let mut last = 0;
    for i in 0..30 {
        let locks = if i % 2 == 0 { &a } else { &b };
        let g = locks.lock(&key, TTL).expect("free key");
        let t = g.fencing_token().expect("fencing on");
        assert!(t > last, "token {t} after {last}");
        // Below 2^53, from the nodes' µs clocks.
        assert!(t > 1_600_000_000_000_000 && t < 1 << 53, "{t}");
        let written = (0..c.len())
            .filter(|&n| c.fence(n, &key) == Some(t))
            .count();
        assert!(written >= 2, "token on {written} nodes' counters");
        g.extend(TTL).expect("extend");
        assert_eq!(g.fencing_token(), Some(t), "renewal keeps the token");
        last = t;
        g.release().expect("release");
    }
    // Every fenced round's writes have landed (a late one may still raise a
    // node's counter above the granted token: compare before and after).
    std::thread::sleep(Duration::from_millis(200));
    let counters = |c: &Cluster| (0..c.len()).map(|n| c.fence(n, &key)).collect::<Vec<_>>();
    let before = counters(&c);
    assert!(before.iter().flatten().count() >= 2, "{before:?}");
    let plain = crate::client_with(c.urls(), SLACK);
    let g = plain.lock(&key, TTL).unwrap();
    assert_eq!(g.fencing_token(), None);
    assert_eq!(
        counters(&c),
        before,
        "an unfenced lock leaves counters alone"
    );
}

/// A hand-over: `locks` takes `key`, a second thread of the same client queues for it,
/// the holder releases (which hands the lock over). Returns (holder's token, receiver's).
pub(crate) fn hand_over(locks: &Redlock, key: &str) -> (u64, u64) {
    let first = locks.lock(key, TTL).expect("holder locks");
    let t = first.fencing_token().expect("fenced");
    let ready = Arc::new(Barrier::new(2));
    let waiter = {
        let (locks, key, ready) = (locks.clone(), key.to_owned(), ready.clone());
        std::thread::spawn(move || {
            ready.wait();
            let g = locks
                .request(&key, TTL)
                .acquire_for(Duration::from_secs(5))
                .expect("handed over");
            let t = g.fencing_token().expect("fenced");
            g.release().expect("release");
            t
        })
    };
    ready.wait();
    std::thread::sleep(Duration::from_millis(100)); // the waiter queues
    first.release().expect("hand over");
    (t, waiter.join().expect("waiter"))
}

#[test]
fn a_hand_over_between_threads_gives_the_next_token() {
    let c = shared();
    let key = unique_key("fence-handover");
    let (t, next) = hand_over(&fenced(&c.urls()), &key);
    assert_eq!(next, t + 1);
    let g = fenced(&c.urls()).lock(&key, TTL).unwrap();
    assert!(g.fencing_token().unwrap() > t + 1);
}

/// Calls of `command` node `i` has run (`INFO commandstats`).
fn calls(c: &Cluster, i: usize, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut c.conn(i))
        .expect("INFO commandstats");
    let head = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&head))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A fenced hand-over sends only what its safety needs: its swap runs no
/// `TIME` (nor the history read that goes with it) on the nodes; only
/// acquisitions do. Nodes of its own, so that no other test's locks count.
#[test]
fn a_fenced_hand_over_reads_no_node_clock() {
    let c = Cluster::start(3);
    let locks = fenced(&c.urls());
    let key = unique_key("fence-swap-cost");
    let mut g = locks.lock(&key, TTL).expect("free key");
    let before: Vec<u64> = (0..c.len()).map(|i| calls(&c, i, "time")).collect();
    let (mut handed, mut fresh) = (0, 0);
    for _ in 0..10 {
        let section = g.section();
        g = std::thread::scope(|s| {
            let w = s.spawn(|| {
                locks
                    .request(&key, TTL)
                    .acquire_for(Duration::from_secs(2))
                    .expect("handed over or locked anew")
            });
            std::thread::sleep(Duration::from_millis(5)); // let it queue
            g.release().expect("hand over");
            w.join().expect("waiter")
        });
        if g.section() == section + 1 {
            handed += 1;
        } else {
            fresh += 1;
        }
    }
    drop(g);
    assert!(handed >= 5, "only {handed} of 10 were hand-overs");
    for (i, b) in before.iter().enumerate() {
        let time = calls(&c, i, "time") - b;
        assert!(
            time <= fresh,
            "node {i}: {time} TIME calls for {handed} hand-overs and {fresh} acquisitions"
        );
    }
}

// ---------------------------------------------------------------------------------------
// The fault suite. Each scenario runs with and without the protection it is about; the
// unprotected run must show the failure, so that the test can fail.

/// A storage row that remembers the largest fencing token it has seen, as the README's
/// `UPDATE … WHERE last_token <= :token` does. With `check` off it is a plain row: the
/// unprotected control.
pub(crate) struct FencedRow {
    check: bool,
    row: std::sync::Mutex<(i64, u64)>,
}

impl FencedRow {
    pub(crate) fn new(check: bool) -> FencedRow {
        FencedRow {
            check,
            row: std::sync::Mutex::new((0, 0)),
        }
    }

    /// Reads the value; the read registers the token (a writer that read before a newer
    /// holder is refused too).
    pub(crate) fn read(&self, token: u64) -> i64 {
        let mut row = self.row.lock().unwrap();
        row.1 = row.1.max(token);
        row.0
    }

    /// Writes `value` unless a newer token touched the row; returns whether it was applied.
    pub(crate) fn write(&self, token: u64, value: i64) -> bool {
        let mut row = self.row.lock().unwrap();
        if self.check && token < row.1 {
            return false;
        }
        *row = (value, row.1.max(token));
        true
    }

    pub(crate) fn value(&self) -> i64 {
        self.row.lock().unwrap().0
    }
}

/// Scenario 1, one run: holder A reads, stalls past its TTL (renewal off), B takes the
/// lock and increments, then A writes its stale increment. Returns (accepted writes, final
/// value, A's write applied).
fn stalled_holder(store: &FencedRow) -> (i64, i64, bool) {
    const SHORT: Duration = Duration::from_millis(300);
    let c = shared();
    let key = unique_key("fence-stall");
    let (a, b) = (fenced(&c.urls()), fenced(&c.urls()));
    let ga = a.lock(&key, SHORT).expect("A locks");
    let ta = ga.fencing_token().expect("fenced");
    let read_a = store.read(ta);
    // A pauses (GC, swap, a stopped VM) past its TTL.
    std::thread::sleep(SHORT + Duration::from_millis(100));
    assert!(!ga.is_held(), "A's validity is over");
    let gb = b
        .request(&key, SHORT)
        .acquire_for(Duration::from_secs(3))
        .expect("B locks once A's keys expired");
    let tb = gb.fencing_token().expect("fenced");
    assert!(tb > ta, "B's token {tb} after A's {ta}");
    let read_b = store.read(tb);
    let mut accepted = i64::from(store.write(tb, read_b + 1));
    gb.release().expect("B releases");
    // A resumes and writes what it computed before the pause.
    let a_applied = store.write(ta, read_a + 1);
    accepted += i64::from(a_applied);
    drop(ga);
    (accepted, store.value(), a_applied)
}

/// Scenario 1: a holder that paused past its TTL writes after the next holder. The fenced
/// store refuses the stale write; without the token check the update is lost.
#[test]
fn a_holder_paused_past_its_ttl_is_refused_by_the_fenced_store() {
    let (accepted, value, stale_applied) = stalled_holder(&FencedRow::new(true));
    assert!(!stale_applied, "the fenced store took the stale write");
    assert_eq!((accepted, value), (1, 1), "accepted writes = final value");
    // Control: the same schedule against a store that ignores tokens.
    let (accepted, value, stale_applied) = stalled_holder(&FencedRow::new(false));
    assert!(stale_applied);
    assert_eq!(
        (accepted, value),
        (2, 1),
        "without the check, two accepted increments leave 1: a lost update"
    );
    eprintln!(
        "scenario 1: fenced: stale write refused, 0 lost; unfenced: 2 accepted, value 1, 1 lost"
    );
}

/// A naive Redlock attempt, as many clients make it: `SET NX PX` on each node with a
/// timeout and, on failure, an unlock of the nodes that answered OK (a node that timed out
/// is taken for failed). Returns whether it got a majority.
fn naive_attempt(c: &Cluster, key: &str, token: &str, ttl: Duration) -> bool {
    let mut set_on = Vec::new();
    for i in 0..c.len() {
        let Ok(mut conn) = c.try_conn(i, Duration::from_millis(50)) else {
            continue;
        };
        let r: redis::RedisResult<Option<String>> = redis::cmd("SET")
            .arg(key)
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .query(&mut conn);
        if let Ok(Some(_)) = r {
            set_on.push(i);
        }
    }
    if set_on.len() > c.len() / 2 {
        return true;
    }
    for i in set_on {
        if c.get(i, key).as_deref() == Some(token) {
            c.del(i, key);
        }
    }
    false
}

/// Scenario 3, part 1: an attempt that fails while a node is paused (SIGSTOP) leaves its
/// SET queued on that node, executed when it resumes (SIGCONT). quorumlock sends the undo
/// on the same connection, behind the SET, so nothing is left; the naive client's key
/// sits on the resumed node for the whole TTL.
#[test]
fn a_node_paused_mid_round_keeps_no_key_after_it_resumes() {
    let c = Cluster::start(3);
    let ttl = Duration::from_secs(10);
    let locks = fenced(&c.urls());
    drop(
        locks
            .lock(&unique_key("warm"), ttl)
            .expect("warm-up: connections open"),
    );
    let run = |attempt: &dyn Fn(&str) -> bool| {
        let key = unique_key("fence-paused");
        // Another owner holds node 1, so that the attempt fails with node 0 hung.
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg("another-owner")
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .query(&mut c.conn(1))
            .expect("SET on node 1");
        c.pause(0);
        let got = attempt(&key);
        c.unpause(0);
        assert!(!got, "one node of three cannot grant");
        std::thread::sleep(Duration::from_secs(1));
        c.get(0, &key)
    };
    let ours = run(&|key| locks.try_lock(key, ttl).is_ok());
    assert_eq!(ours, None, "quorumlock left a key on the resumed node");
    let naive = run(&|key| naive_attempt(&c, key, "naive-token", ttl));
    assert_eq!(
        naive.as_deref(),
        Some("naive-token"),
        "the control should show the hazard: its SET landed on resume and stayed"
    );
}

/// Scenario 3, part 2: two clients × 3 threads contend for one key for 3 s while a seeded
/// schedule pauses and resumes one node at a time, often mid-round. No two critical
/// sections overlap within their validity, and the key is gone from every node soon after
/// the last release (long before its TTL).
#[test]
fn nodes_paused_and_resumed_mid_round_cause_no_overlap_and_leave_no_key() {
    let c = Arc::new(Cluster::start(3));
    let key = unique_key("fence-pause-storm");
    let ttl = Duration::from_secs(5);
    let clients: Vec<Redlock> = (0..2)
        .map(|_| {
            Redlock::builder()
                .fresh_cluster(true)
                .nodes(c.urls())
                .fencing(true)
                .build()
                .expect("valid config")
        })
        .collect();
    for l in &clients {
        drop(l.lock(&unique_key("warm"), ttl).expect("warm-up"));
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pauser = {
        let (c, stop) = (c.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = 0x5eed_u64;
            let mut next = || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let mut pauses = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let node = (next() % 3) as usize;
                c.pause(node);
                std::thread::sleep(Duration::from_millis(30 + next() % 200));
                c.unpause(node);
                pauses += 1;
                std::thread::sleep(Duration::from_millis(next() % 100));
            }
            pauses
        })
    };
    let sections = Arc::new(std::sync::Mutex::new(Vec::new()));
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        for l in &clients {
            for _ in 0..3 {
                let (l, key, sections) = (l.clone(), key.clone(), sections.clone());
                s.spawn(move || {
                    while started.elapsed() < Duration::from_secs(3) {
                        let Ok(g) = l.request(&key, ttl).acquire_for(Duration::from_millis(500))
                        else {
                            continue;
                        };
                        let begin = std::time::Instant::now();
                        std::thread::sleep(Duration::from_millis(2));
                        let end = std::time::Instant::now().min(g.deadline());
                        sections
                            .lock()
                            .unwrap()
                            .push((begin, end, g.fencing_token()));
                        let _ = g.release();
                    }
                });
            }
        }
    });
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let pauses = pauser.join().expect("pauser");
    let mut sections = std::mem::take(&mut *sections.lock().unwrap());
    sections.sort_by_key(|s| s.0);
    for w in sections.windows(2) {
        assert!(
            w[0].1 <= w[1].0,
            "overlapping sections: {:?} and {:?}",
            w[0],
            w[1]
        );
        assert!(
            w[1].2 > w[0].2,
            "tokens out of order: {:?} then {:?}",
            w[0],
            w[1]
        );
    }
    let last = std::time::Instant::now();
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(2)),
        "a key is left {:?} after the last release",
        last.elapsed()
    );
    assert!(
        sections.len() >= 10,
        "too little progress: {} sections",
        sections.len()
    );
    eprintln!(
        "scenario 3: {} sections, {pauses} pauses, 0 overlaps, tokens increasing, key gone in {:?}",
        sections.len(),
        last.elapsed()
    );
}

/// Scenario 4: one node's wall clock jumps (an NTP step), on a redis-server process run
/// under the clock shim. Redlock assumes clocks that run at about the same rate; what a
/// jump does, and what the README promises:
/// (a) a lock held on every node survives one node's forward jump: the other two still
///     hold it, and no second holder is granted;
/// (b) a lock held on a bare majority does not: the jumped node expires its key early and
///     votes for a second holder while the first is still valid (Kleppmann's example).
///     Fencing tokens still order the two: the fenced store refuses the first holder's
///     stale write, and without the token check its update is lost;
/// (c) a backward jump only lengthens that node's keys, and its counters do not go back.
#[test]
fn a_clock_jump_on_one_node_is_survived_by_a_full_lock_and_fenced_on_a_bare_majority() {
    let offset = ClockOffset::new();
    let c = Cluster::start_processes(3, |i| if i == 0 { offset.env() } else { Vec::new() })
        .unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = (fenced(&c.urls()), fenced(&c.urls()));
    for l in [&a, &b] {
        drop(l.lock(&unique_key("warm"), TTL).expect("warm-up"));
    }
    let on_all = |key: &str, token: &str| {
        crate::common::wait_until(Duration::from_secs(1), || c.holders(key, token) == 3)
    };

    // (a) Held on all three nodes: node 0 jumps a minute ahead.
    let key = unique_key("jump-full");
    let ga = a.lock(&key, TTL).expect("A locks");
    assert!(on_all(&key, ga.token()), "A's key on every node");
    offset.step(&c, 0, 60);
    assert_eq!(c.get(0, &key), None, "node 0 expired A's key early");
    match b.try_lock(&key, TTL) {
        Err(e) => assert!(e.is_retryable(), "{e}"),
        Ok(_) => panic!("a second holder while nodes 1 and 2 still hold A's key"),
    }
    ga.release().expect("A releases");

    // (b) Held on a bare majority (node 2 missed the write, as in a partition): node 0
    // jumps again. B is granted by nodes 0 and 2 while A is valid.
    let run = |store: &FencedRow, jump: i64| {
        let key = unique_key("jump-bare");
        let ga = a.lock(&key, TTL).expect("A locks");
        assert!(on_all(&key, ga.token()));
        c.del(2, &key);
        let read_a = store.read(ga.fencing_token().expect("fenced"));
        offset.step(&c, 0, jump);
        let gb = b.try_lock(&key, TTL).expect("nodes 0 and 2 grant B");
        assert!(
            ga.is_held() && gb.is_held(),
            "two holders, both within validity"
        );
        let (ta, tb) = (ga.fencing_token().unwrap(), gb.fencing_token().unwrap());
        assert!(tb > ta, "B's token {tb} after A's {ta}");
        let read_b = store.read(tb);
        let b_applied = store.write(tb, read_b + 1);
        let a_applied = store.write(ta, read_a + 1);
        let _ = (ga.release(), gb.release());
        (
            i64::from(a_applied) + i64::from(b_applied),
            store.value(),
            a_applied,
        )
    };
    let (accepted, value, a_applied) = run(&FencedRow::new(true), 120);
    assert!(!a_applied, "the fenced store took A's stale write");
    assert_eq!((accepted, value), (1, 1));
    let (accepted, value, a_applied) = run(&FencedRow::new(false), 180);
    assert!(a_applied);
    assert_eq!(
        (accepted, value),
        (2, 1),
        "unfenced: one of two increments lost"
    );

    // (c) Node 0 steps ten minutes back.
    let key = unique_key("jump-back");
    let g = a.lock(&key, TTL).expect("A locks");
    let before = g.fencing_token().unwrap();
    assert!(on_all(&key, g.token()));
    drop(g);
    offset.step(&c, 0, -600);
    let g = b
        .request(&key, TTL)
        .acquire_for(Duration::from_secs(2))
        .expect("B locks");
    assert!(
        g.fencing_token().unwrap() > before,
        "counters do not go back with the clock"
    );
    eprintln!(
        "scenario 4: forward jump on 1 of 3 nodes: full lock kept; bare majority: 2 holders, \
         fenced store refused the stale write, unfenced lost 1 of 2 increments"
    );
}
