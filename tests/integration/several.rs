//! Locks of several resources (issue 23): `request().and()` and its forms take every
//! resource or none, each node voting for the whole set. Clients use `fresh_cluster(true)`
//! on the shared throwaway nodes (the restart test starts its own).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quorumlock::{Error, InvalidInput, Redlock};

use crate::common::{shared, unique_key, wait_until, Cluster};

const TTL: Duration = Duration::from_secs(10);

fn client(urls: Vec<String>) -> Redlock {
    let locks = crate::client_with(urls, Duration::from_millis(250));
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    locks
}

/// Keys `name-0` … `name-(n-1)`, unique to this test.
fn keys(name: &str, n: usize) -> Vec<String> {
    let base = unique_key(name);
    (0..n).map(|i| format!("{base}-{i}")).collect()
}

/// A node where one key of the set has another owner sets none of the set: its vote is
/// for the whole set. The lock is held on the other two nodes, and the first node has no
/// key of ours (a script setting each key on its own left the free ones set there).
#[test]
fn a_node_where_one_key_is_taken_sets_none_of_the_set() {
    let c = shared();
    let locks = client(c.urls());
    let set = keys("aon", 3);
    let _: () = redis::cmd("SET")
        .arg(&set[1])
        .arg("someone-else")
        .arg("PX")
        .arg(30_000)
        .query(&mut c.conn(0))
        .expect("SET");
    let g = crate::common::request_all(&locks, &set, TTL)
        .try_acquire()
        .expect("held on nodes 1 and 2");
    assert_eq!(g.nodes_held(), 2);
    for k in [&set[0], &set[2]] {
        assert_eq!(c.get(0, k), None, "node 0 set {k} of a set it refused");
        assert_eq!(c.holders(k, g.token()), 2);
    }
    assert_eq!(c.get(0, &set[1]).as_deref(), Some("someone-else"));
    assert_eq!(g.resources().collect::<Vec<_>>(), set);
    assert_eq!(g.resource(), set[0]);
    g.release().expect("release");
    for k in &set {
        assert!(k == &set[1] || c.gone_everywhere(k, Duration::from_secs(1)));
    }
}

/// A set with one key held by another client on a majority is refused, and leaves
/// nothing behind on any node.
#[test]
fn a_set_with_one_key_held_elsewhere_is_refused_and_leaves_nothing() {
    let c = shared();
    let (a, b) = (client(c.urls()), client(c.urls()));
    let set = keys("refused", 4);
    let held = a.try_lock(&set[2], TTL).expect("lock one of them");
    match crate::common::request_all(&b, &set, TTL).try_acquire() {
        Err(Error::Taken { .. }) => {}
        other => panic!("expected Taken, got {other:?}"),
    }
    for (j, k) in set.iter().enumerate().filter(|(j, _)| *j != 2) {
        for i in 0..3 {
            assert_eq!(c.get(i, k), None, "node {i} kept key {j} of a refused set");
        }
    }
    // (A round ends at a majority: the third node's SET may still be on its way.)
    assert!(c.holders(&set[2], held.token()) >= 2);
}

/// Three clients take sets that overlap in a cycle ({x, y}, {y, z}, {z, x}: taken one key
/// at a time, the classic deadlock). Every pair shares a key, so at most one may hold at a
/// time; each gets its turns, and no call waits for ever.
#[test]
fn overlapping_sets_never_both_hold_and_never_deadlock() {
    let c = shared();
    let k = keys("cycle", 3);
    let sets = [
        vec![k[0].clone(), k[1].clone()],
        vec![k[1].clone(), k[2].clone()],
        vec![k[2].clone(), k[0].clone()],
    ];
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = sets
        .into_iter()
        .map(|set| {
            let locks = Redlock::builder()
                .fresh_cluster(true)
                .nodes(c.urls())
                .node_timeout(Duration::from_millis(250))
                .retry_delay(Duration::from_millis(5))
                .retry_jitter(Duration::from_millis(5))
                .build()
                .expect("valid config");
            let (inside, most) = (inside.clone(), most.clone());
            std::thread::spawn(move || {
                for _ in 0..15 {
                    let g = crate::common::request_all(&locks, &set, TTL)
                        .acquire_for(Duration::from_secs(20))
                        .expect("a set is taken in time");
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(2));
                    inside.fetch_sub(1, Ordering::SeqCst);
                    g.release().expect("release");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker");
    }
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "two overlapping sets held at once"
    );
    assert!(start.elapsed() < Duration::from_secs(60));
    for key in &k {
        assert!(
            c.gone_everywhere(key, Duration::from_secs(1)),
            "{key} left behind"
        );
    }
}

/// A set is extended (and lost) as one: with one key gone from a majority, the extension
/// fails, although every other key is still there (a count of the first key alone said
/// held).
#[test]
fn a_set_missing_one_key_on_a_majority_is_not_extended() {
    let c = shared();
    let locks = client(c.urls());
    let set = keys("extend", 3);
    let g = crate::common::request_all(&locks, &set, TTL)
        .try_acquire()
        .expect("lock");
    assert_eq!(g.extend(TTL).ok().map(|v| v > Duration::ZERO), Some(true));
    c.del(0, &set[1]);
    c.del(1, &set[1]);
    match g.extend(TTL) {
        Err(Error::Expired | Error::NotOwner { .. }) => {}
        other => panic!("a set missing a key on 2 of 3 nodes was extended: {other:?}"),
    }
}

/// With fencing, the set's one token is above every resource's last token and is written
/// back to each: a later lock of any one of them gets a larger token. The first key's
/// counter is raised far above the clock here, so that only the write-back to the second
/// explains its next token.
#[test]
fn a_fenced_set_orders_every_resource_after_it() {
    let c = shared();
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(250))
        .fencing(true)
        .build()
        .expect("valid config");
    let set = keys("fenced", 2);
    let high: u64 = 1 << 52;
    for i in 0..3 {
        let _: i64 = redis::cmd("HSET")
            .arg("quorumlock:meta")
            .arg(format!("fence:{}", set[0]))
            .arg(high)
            .query(&mut c.conn(i))
            .expect("HSET");
    }
    let g = crate::common::request_all(&locks, &set, TTL)
        .try_acquire()
        .expect("lock");
    let t = g.fencing_token().expect("fenced");
    assert!(
        t > high,
        "the set's token {t} is not above the first key's counter"
    );
    g.release().expect("release");
    let second = locks.try_lock(&set[1], TTL).expect("lock the second alone");
    let t2 = second.fencing_token().expect("fenced");
    assert!(
        t2 > t,
        "the second resource's next token {t2} is not above the set's {t}"
    );
}

/// A held set whose node restarts empty gets every key back there from its renewal (a
/// copy, not a vote), and stays held.
#[test]
fn a_renewed_set_gets_its_keys_back_on_a_node_restarted_empty() {
    let c = Cluster::start(3);
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(250))
        .auto_renew(true)
        .build()
        .expect("valid config");
    let set = keys("restarted", 3);
    let g = crate::common::request_all(&locks, &set, Duration::from_secs(2))
        .try_acquire()
        .expect("lock");
    c.stop(2);
    c.restart(2);
    assert_eq!(c.get(2, &set[0]), None, "node 2 came back empty");
    let back = wait_until(Duration::from_secs(5), || {
        set.iter()
            .all(|k| c.get(2, k).as_deref() == Some(g.token()))
    });
    assert!(
        back,
        "the renewal did not restore every key of the set on node 2"
    );
    assert!(g.is_held());
    g.release().expect("release");
}

/// The most resources the bounds admit: every one-byte name, then two-byte names until
/// [`MAX_RESOURCES_LEN`](quorumlock::MAX_RESOURCES_LEN) bytes (8,256 names).
fn largest_set() -> Vec<String> {
    let ascii = || (0u8..128).map(char::from);
    let mut set: Vec<String> = ascii().map(String::from).collect();
    let pairs = ascii().flat_map(|a| ascii().map(move |b| format!("{a}{b}")));
    set.extend(pairs.take((quorumlock::MAX_RESOURCES_LEN - set.len()) / 2));
    set
}

/// The largest set the bounds admit is taken and released every time with the default
/// settings, on a loaded machine too (its rounds took 60–150 ms idle, up to 1.3 s with
/// another cargo build running: far past the 50 ms node timeout; each round of a set has one
/// node timeout more per 200 keys), and leaves no key behind. Its own nodes: the names are
/// the shortest there are, not unique to this test.
#[test]
fn the_largest_set_the_bounds_admit_is_taken_and_released_with_default_settings() {
    let c = Cluster::start(3);
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .build()
        .expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    let set = largest_set();
    let mut one_more = set.clone();
    one_more.push("\u{80}".to_owned());
    assert!(
        matches!(
            crate::common::request_all(&locks, &one_more, TTL).try_acquire(),
            Err(Error::InvalidInput(InvalidInput::ResourcesTooLong { .. }))
        ),
        "{} names are not the most the bounds admit",
        set.len()
    );
    for run in 0..3 {
        let started = Instant::now();
        let g = match crate::common::request_all(&locks, &set, TTL).try_acquire() {
            Ok(g) => g,
            Err(e) => panic!("run {run}: {} names not taken: {e}", set.len()),
        };
        let took = started.elapsed();
        assert_eq!(g.resources().count(), set.len());
        let released = Instant::now();
        if let Err(e) = g.release() {
            panic!("run {run}: held set (taken in {took:?}) not released: {e}");
        }
        let took = released.elapsed();
        // (A release ends at a majority's answers: the last node's delete may still run.)
        let left = |i: usize| -> i64 {
            redis::cmd("EXISTS")
                .arg(&set)
                .query(&mut c.conn(i))
                .expect("EXISTS")
        };
        assert!(
            wait_until(Duration::from_secs(5), || (0..3).all(|i| left(i) == 0)),
            "run {run}: keys left after a release in {took:?}"
        );
    }
}

/// Bad input gets a typed error naming the problem, before any round.
#[test]
fn bad_sets_are_refused_with_what_is_wrong() {
    let c = shared();
    let locks = client(c.urls());
    let invalid = |r: quorumlock::Result<quorumlock::LockGuard>| match r {
        Err(Error::InvalidInput(i)) => i,
        other => panic!("expected invalid input, got {other:?}"),
    };
    let readers = locks.request("a", TTL).and("b").read();
    assert!(matches!(
        invalid(readers.try_acquire()),
        InvalidInput::ReadOfSeveral
    ));
    let k = unique_key("bad");
    assert!(matches!(
        invalid(locks.request(k.as_str(), TTL).and("other").and(k.as_str()).acquire()),
        InvalidInput::DuplicateResource(d) if d == k
    ));
    assert!(matches!(
        invalid(locks.request(k.as_str(), TTL).and("").try_acquire()),
        InvalidInput::EmptyResource
    ));
    let long: Vec<String> = (0..17)
        .map(|i| format!("{i:02}{}", "x".repeat(quorumlock::MAX_RESOURCE_LEN - 2)))
        .collect();
    assert!(matches!(
        invalid(crate::common::request_all(&locks, &long, TTL).try_acquire()),
        InvalidInput::ResourcesTooLong { .. }
    ));
    assert!(matches!(
        invalid(
            locks
                .request(k.as_str(), TTL)
                .and("quorumlock:meta")
                .try_acquire()
        ),
        InvalidInput::ReservedResource(_)
    ));
    assert!(matches!(
        invalid(locks.request(k.as_str(), Duration::ZERO).try_acquire()),
        InvalidInput::ZeroTtl
    ));
    assert!(matches!(
        invalid(
            locks
                .request(k.as_str(), Duration::MAX)
                .and("b")
                .acquire_for(Duration::MAX)
        ),
        InvalidInput::TtlTooLong(_)
    ));
    // Nothing was sent: no key exists.
    assert_eq!(c.get(0, &k), None);
}

/// `run` renews the set while the closure runs and releases every key after.
#[test]
fn with_lock_all_releases_every_key() {
    let c = shared();
    let locks = client(c.urls());
    let set = keys("with", 3);
    let held = crate::common::request_all(&locks, &set, TTL)
        .acquire()
        .and_then(|g| {
            g.run(|g| {
                assert!(g.is_auto_renewed());
                set.iter()
                    .map(|k| c.holders(k, g.token()))
                    .collect::<Vec<_>>()
            })
        })
        .expect("run");
    // Every key held with the set's token on a majority (a round ends at one).
    assert!(held.iter().all(|&n| n >= 2), "{held:?}");
    for k in &set {
        assert!(
            c.gone_everywhere(k, Duration::from_secs(1)),
            "{k} left behind"
        );
    }
}

/// Two clients each lock one of `keys` again and again (10 ms sections) until `stop`;
/// returns the longest wait any of their calls had.
fn single_lockers(
    urls: &[String],
    keys: &[String],
    stop: &Arc<std::sync::atomic::AtomicBool>,
) -> Vec<std::thread::JoinHandle<Duration>> {
    let mut threads = Vec::new();
    for key in keys {
        for _ in 0..2 {
            let (locks, key, stop) = (client(urls.to_vec()), key.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut longest = Duration::ZERO;
                while !stop.load(Ordering::Relaxed) {
                    let asked = Instant::now();
                    let g = locks
                        .request(&key, TTL)
                        .acquire_for(Duration::from_secs(10))
                        .expect("a single lock");
                    longest = longest.max(asked.elapsed());
                    std::thread::sleep(Duration::from_millis(10));
                    g.release().expect("released");
                }
                longest
            }));
        }
    }
    threads
}

/// Stops the single lockers: the longest wait any of their calls had.
fn stop_lockers(
    stop: &std::sync::atomic::AtomicBool,
    singles: Vec<std::thread::JoinHandle<Duration>>,
) -> Duration {
    stop.store(true, Ordering::Relaxed);
    singles
        .into_iter()
        .map(|t| t.join().expect("a single locker"))
        .max()
        .unwrap_or_default()
}

/// A set of three resources among clients that take turns on each of them: it gets its
/// turn. Each key is free only between one single lock and the next, so a set that needs
/// all three free at once waited seconds here; it now claims each as it comes free (after
/// a retry pause of waiting), and gets in within a few of their sections. The single locks
/// keep getting theirs.
#[test]
fn a_set_among_single_locks_of_its_resources_gets_its_turn() {
    let c = shared();
    let set = keys("turn", 3);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let singles = single_lockers(&c.urls(), &set, &stop);
    std::thread::sleep(Duration::from_millis(300));
    let locks = client(c.urls());
    let asked = Instant::now();
    let g = crate::common::request_all(&locks, &set, TTL)
        .acquire_for(Duration::from_secs(20))
        .expect("the set");
    let waited = asked.elapsed();
    g.release().expect("released");
    std::thread::sleep(Duration::from_millis(200));
    let longest = stop_lockers(&stop, singles);
    assert!(waited < Duration::from_secs(2), "the set waited {waited:?}");
    assert!(
        longest < Duration::from_secs(2),
        "a single lock waited {longest:?}"
    );
}

/// A set of `a` and `b` while another client holds `a` for two seconds: the clients
/// taking turns on `b` are not kept out for more than a moment (the set claims `b` once it
/// comes free, and drops the claim when `a` keeps its holder through a retry pause), and
/// the set gets in soon after `a`'s release.
#[test]
fn a_set_behind_a_long_holder_keeps_no_one_out() {
    let c = shared();
    let ab = keys("behind", 2);
    let holder = client(c.urls());
    let ga = holder.try_lock(&ab[0], TTL).expect("a");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let singles = single_lockers(&c.urls(), &ab[1..], &stop);
    let set = {
        let (locks, ab) = (client(c.urls()), ab.clone());
        std::thread::spawn(move || {
            let g = crate::common::request_all(&locks, &ab, TTL)
                .acquire_for(Duration::from_secs(20))
                .expect("the set");
            let got = Instant::now();
            g.release().expect("released");
            got
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    let released = Instant::now();
    ga.release().expect("a released");
    let got = set.join().expect("the set");
    let longest = stop_lockers(&stop, singles);
    assert!(
        longest < Duration::from_secs(1),
        "a single lock of b waited {longest:?} behind the set"
    );
    let late = got.saturating_duration_since(released);
    assert!(
        late < Duration::from_secs(2),
        "the set got in {late:?} after a's release"
    );
}
