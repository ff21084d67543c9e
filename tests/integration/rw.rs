//! Read-write locks (issue 23): readers share a resource, a writer (any exclusive lock)
//! excludes readers and writers, and a waiting writer keeps new readers out. Clients use
//! `fresh_cluster(true)` on the shared throwaway nodes (the restart test starts its own).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use quorumlock::{Error, InvalidInput, Redlock};

use crate::common::{shared, unique_key, wait_until, Cluster, READERS_MARK};

const TTL: Duration = Duration::from_secs(10);

fn client(urls: Vec<String>) -> Redlock {
    let locks = crate::client_with(urls, Duration::from_millis(250));
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    locks
}

fn taken<T: std::fmt::Debug>(r: quorumlock::Result<T>, what: &str) {
    match r {
        Err(Error::Taken { .. }) => {}
        other => panic!("{what}: expected Taken, got {other:?}"),
    }
}

/// Readers share; a writer (`try_lock`, or a plain `try_lock`) is refused while
/// they hold, and readers are refused while it holds. Each node keeps every reader in
/// the key's reader set, never beside a writer's value.
#[test]
fn readers_share_and_a_writer_excludes_them() {
    let c = shared();
    let (a, b) = (client(c.urls()), client(c.urls()));
    let key = unique_key("rw-share");
    let r1 = a
        .request(&key, TTL)
        .read()
        .try_acquire()
        .expect("first reader");
    let r2 = b
        .request(&key, TTL)
        .read()
        .try_acquire()
        .expect("second reader shares");
    assert!(r1.is_read() && r2.is_read());
    assert!(r1.nodes_held() >= 2 && r2.nodes_held() >= 2);
    assert!(wait_until(Duration::from_secs(1), || {
        (0..3)
            .filter(|&i| {
                let r = c.readers(i, &key);
                r.contains(&r1.token().to_owned()) && r.contains(&r2.token().to_owned())
            })
            .count()
            >= 2
    }));
    taken(a.try_lock(&key, TTL), "a writer beside two readers");
    taken(b.try_lock(&key, TTL), "a plain lock beside two readers");
    r1.release().expect("first reader's release");
    taken(a.try_lock(&key, TTL), "a writer beside one reader");
    r2.release().expect("second reader's release");
    let w = a
        .try_lock(&key, TTL)
        .expect("the writer, once readers left");
    assert!(!w.is_read());
    taken(
        b.request(&key, TTL).read().try_acquire(),
        "a reader beside a writer",
    );
    w.release().expect("writer's release");
    assert!(c.gone_everywhere(&key, Duration::from_secs(1)));
}

/// A reader's release, extension and loss: it is extended while its entry lives, and a
/// release of an entry that a writer's key replaced (the reader was lost) reports
/// `NotOwner` instead of failing the script on the key's type. The writer's own rounds on
/// a reader set answer "another owner" likewise.
#[test]
fn rounds_of_one_kind_meet_the_other_kind_as_another_owner() {
    let c = shared();
    let locks = client(c.urls());
    let key = unique_key("rw-kinds");
    let r = locks
        .request(&key, TTL)
        .read()
        .try_acquire()
        .expect("reader");
    assert!(r.extend(TTL).expect("a reader extends") > Duration::ZERO);
    // The reader set replaced by another writer's value on every node.
    for i in 0..3 {
        c.del(i, &key);
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg("someone-else")
            .arg("PX")
            .arg(30_000)
            .query(&mut c.conn(i))
            .expect("SET");
    }
    match r.extend(TTL) {
        Err(Error::NotOwner { .. }) => {}
        other => panic!("a reader whose key is a writer's now: {other:?}"),
    }
    match r.release() {
        Err(Error::NotOwner { .. }) => {}
        other => panic!("released over a writer: {other:?}"),
    }
    for i in 0..3 {
        c.del(i, &key);
    }
    let w = locks.try_lock(&key, TTL).expect("writer");
    let other = client(c.urls());
    let r2 = other.request(&key, TTL).read().try_acquire();
    taken(r2, "a reader beside a writer");
    // The writer's key replaced by a reader set: its extension is refused, not an error.
    for i in 0..3 {
        c.del(i, &key);
        let _: i64 = redis::cmd("ZADD")
            .arg(&key)
            .arg(0)
            .arg(READERS_MARK)
            .arg(u64::MAX >> 12)
            .arg("rsomeone")
            .query(&mut c.conn(i))
            .expect("ZADD");
    }
    match w.extend(TTL) {
        Err(Error::NotOwner { .. }) => {}
        other => panic!("a writer whose key is a reader set now: {other:?}"),
    }
    for i in 0..3 {
        c.del(i, &key);
    }
}

/// A writer that waits keeps new readers out: while one reader holds, a `lock`
/// call marks its intent on the nodes; a new reader is refused from then on, although
/// only a reader holds; the writer gets in when that reader leaves (woken by its
/// release), and the intent is gone with the reader set.
#[test]
fn a_waiting_writer_keeps_new_readers_out() {
    let c = shared();
    let (a, b, w) = (client(c.urls()), client(c.urls()), client(c.urls()));
    let key = unique_key("rw-intent");
    let r1 = a
        .request(&key, TTL)
        .read()
        .try_acquire()
        .expect("first reader");
    let writer = {
        let key = key.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            let g = w.request(&key, TTL).acquire_for(Duration::from_secs(8));
            (g.map(|g| g.release()), t.elapsed())
        })
    };
    assert!(
        wait_until(Duration::from_secs(3), || (0..3)
            .filter(|&i| c.intent(i, &key))
            .count()
            >= 2),
        "the waiting writer's intent never reached a majority"
    );
    taken(
        b.request(&key, TTL).read().try_acquire(),
        "a new reader behind a waiting writer",
    );
    std::thread::sleep(Duration::from_millis(300));
    let released = Instant::now();
    r1.release().expect("the reader leaves");
    let (got, waited) = writer.join().expect("writer thread");
    assert!(
        matches!(got, Ok(Ok(()))),
        "the writer did not get in: {got:?}"
    );
    assert!(
        released.elapsed() < Duration::from_millis(900),
        "the writer got in {:?} after the last reader left (waited {waited:?})",
        released.elapsed()
    );
    // Free again: a reader gets in (the intent went with the reader set).
    let r = b
        .request(&key, TTL)
        .read()
        .try_acquire()
        .expect("a reader after the writer");
    r.release().expect("release");
}

/// A `try_lock` never marks an intent (it does not wait): readers keep coming.
#[test]
fn a_writer_that_does_not_wait_leaves_no_intent() {
    let c = shared();
    let (a, b) = (client(c.urls()), client(c.urls()));
    let key = unique_key("rw-no-intent");
    let r1 = a.request(&key, TTL).read().try_acquire().expect("reader");
    taken(b.try_lock(&key, TTL), "a writer beside a reader");
    for i in 0..3 {
        assert!(!c.intent(i, &key), "node {i} got an intent from try_lock");
    }
    let r2 = b
        .request(&key, TTL)
        .read()
        .try_acquire()
        .expect("a new reader");
    drop((r1, r2));
}

/// A set waiting on `[a, b]` while another job holds `b` marks no intent on `a`'s
/// readers: on a node where `b` has another owner, the readers of `a` are not what keeps
/// the set out, and keeping them out would only slow them (issue 38: 48 reader sections
/// a second fell to 9–15 for the whole wait). New readers of `a` get in meanwhile.
#[test]
fn a_set_that_cannot_get_in_keeps_no_readers_out() {
    let c = shared();
    let (a, b, s) = (client(c.urls()), client(c.urls()), client(c.urls()));
    let (ka, kb) = (unique_key("rw-set-a"), unique_key("rw-set-b"));
    let held_b = b.try_lock(&kb, TTL).expect("another job holds b");
    // b lands on the third node a moment after the round's majority.
    assert!(wait_until(Duration::from_secs(2), || (0..3)
        .all(|i| c.get(i, &kb).is_some())));
    let r1 = a
        .request(&ka, TTL)
        .read()
        .try_acquire()
        .expect("a reader of a");
    let set = {
        let (ka, kb) = (ka.clone(), kb.clone());
        std::thread::spawn(move || {
            s.request(ka.as_str(), TTL)
                .and(kb.as_str())
                .acquire_for(Duration::from_secs(2))
        })
    };
    let started = Instant::now();
    let mut readers = 0;
    while started.elapsed() < Duration::from_millis(1_500) {
        for i in 0..3 {
            assert!(!c.intent(i, &ka), "node {i}: the set marked an intent on a");
        }
        let r = a
            .request(&ka, TTL)
            .read()
            .try_acquire()
            .expect("a new reader of a while the set waits");
        r.release().expect("release");
        readers += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(readers > 5);
    taken(set.join().expect("set thread"), "the set while b is held");
    drop((r1, held_b));
}

/// A stream of readers, each holding a little while and overlapping the next, never
/// leaves the resource free; a writer still gets in within one reader TTL of its call.
#[test]
fn a_writer_is_not_starved_by_a_stream_of_readers() {
    let c = shared();
    let key = unique_key("rw-stream");
    let reader_ttl = Duration::from_secs(2);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let granted = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..4)
        .map(|n| {
            let (locks, key, stop, granted) =
                (client(c.urls()), key.clone(), stop.clone(), granted.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(n * 60));
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(g) = locks.request(&key, reader_ttl).read().try_acquire() {
                        granted.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(250));
                        drop(g);
                    } else {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            })
        })
        .collect();
    // The stream is flowing: readers hold the key without a break.
    assert!(wait_until(Duration::from_secs(5), || granted
        .load(Ordering::SeqCst)
        >= 8));
    let w = client(c.urls());
    let t = Instant::now();
    let g = w
        .request(&key, TTL)
        .acquire_for(Duration::from_secs(8))
        .expect("the writer gets in despite the stream");
    let waited = t.elapsed();
    stop.store(true, Ordering::SeqCst);
    drop(g);
    for r in readers {
        r.join().expect("reader thread");
    }
    assert!(
        waited < reader_ttl,
        "the writer waited {waited:?}, more than one reader TTL ({reader_ttl:?})"
    );
}

/// A reader that crashed (its guard forgotten: no release, no renewal) drops out of the
/// reader set at its own TTL, although another reader renews its entry all along: the
/// writer gets in as soon as the live reader leaves.
#[test]
fn a_crashed_readers_entry_expires_on_its_own() {
    let c = shared();
    let (a, b, w) = (client(c.urls()), client(c.urls()), client(c.urls()));
    let key = unique_key("rw-crash");
    let crashed = a
        .request(&key, Duration::from_millis(600))
        .read()
        .try_acquire()
        .expect("short reader");
    let token = crashed.token().to_owned();
    std::mem::forget(crashed);
    let live = b
        .request(&key, Duration::from_millis(900))
        .read()
        .try_acquire()
        .expect("reader");
    live.auto_renew();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(live.is_held(), "the renewed reader lapsed");
    for i in 0..3 {
        assert!(
            !c.readers(i, &key).contains(&token),
            "node {i} still counts the crashed reader"
        );
    }
    taken(w.try_lock(&key, TTL), "a writer beside the live reader");
    live.release().expect("release");
    let g = w
        .try_lock(&key, TTL)
        .expect("writer after the live reader left");
    g.release().expect("release");
}

/// A writer meets a reader set whose readers all expired (or whose only entry is a
/// writer's intent left behind): the key is free, and the writer takes it at once.
#[test]
fn a_reader_set_without_live_readers_is_free_for_a_writer() {
    let c = shared();
    let locks = client(c.urls());
    let key = unique_key("rw-stale");
    for i in 0..3 {
        let mut conn = c.conn(i);
        let (secs, _): (u64, u64) = redis::cmd("TIME").query(&mut conn).expect("TIME");
        let past = secs * 1000 - 5_000;
        let future = secs * 1000 + 60_000;
        let _: i64 = redis::cmd("ZADD")
            .arg(&key)
            .arg(0)
            .arg(READERS_MARK)
            .arg(past)
            .arg("rexpired")
            .arg(future)
            .arg("w")
            .query(&mut conn)
            .expect("ZADD");
        let _: i64 = redis::cmd("PEXPIRE")
            .arg(&key)
            .arg(60_000)
            .query(&mut conn)
            .expect("PEXPIRE");
    }
    let g = locks
        .try_lock(&key, TTL)
        .expect("a stale reader set is free");
    assert!(c.holders(&key, g.token()) >= 2);
    g.release().expect("release");
}

/// Every reader thread of one client that waits behind a writer gets in when the writer
/// leaves, without waiting for the fallback (a release wakes one exclusive waiter per
/// client, but every reader).
#[test]
fn waiting_readers_of_one_client_all_get_in_at_the_writers_release() {
    let c = shared();
    let key = unique_key("rw-wake");
    let writer = client(c.urls());
    let readers = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(250))
        .retry_count(1000)
        .retry_delay(Duration::from_secs(5))
        .retry_jitter(Duration::ZERO)
        .build()
        .expect("valid config");
    let w = writer.try_lock(&key, TTL).expect("writer");
    let n = 6;
    let start = Arc::new(Barrier::new(n + 1));
    let threads: Vec<_> = (0..n)
        .map(|_| {
            let (locks, key, start) = (readers.clone(), key.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let g = locks
                    .request(&key, TTL)
                    .read()
                    .acquire_for(Duration::from_secs(10));
                let at = Instant::now();
                (g, at)
            })
        })
        .collect();
    start.wait();
    // Every reader tried and waits (subscribed).
    assert!(wait_until(Duration::from_secs(3), || (0..3)
        .all(|i| c.subscribers(i, &key) >= 1)));
    std::thread::sleep(Duration::from_millis(300));
    let released = Instant::now();
    w.release().expect("writer's release");
    let mut held = Vec::new();
    for t in threads {
        let (g, at) = t.join().expect("reader thread");
        let g = g.expect("each reader gets in");
        assert!(
            at.saturating_duration_since(released) < Duration::from_millis(800),
            "a reader got in {:?} after the writer left (its fallback, not a wake-up)",
            at.saturating_duration_since(released)
        );
        held.push(g);
    }
    assert!(held.iter().all(|g| g.is_held()), "readers share");
    drop(held);
    assert!(c.gone_everywhere(&key, Duration::from_secs(1)));
}

/// Bad input is refused by name, as for any lock.
#[test]
fn bad_input_to_a_read_lock_is_refused_by_name() {
    let c = shared();
    let locks = client(c.urls());
    assert!(matches!(
        locks.request("", TTL).read().try_acquire(),
        Err(Error::InvalidInput(InvalidInput::EmptyResource))
    ));
    assert!(matches!(
        locks.request("k", Duration::ZERO).read().acquire(),
        Err(Error::InvalidInput(InvalidInput::ZeroTtl))
    ));
    assert!(matches!(
        locks
            .request("k", Duration::MAX)
            .read()
            .acquire_for(Duration::MAX),
        Err(Error::InvalidInput(InvalidInput::TtlTooLong(_)))
    ));
    assert!(matches!(
        locks
            .request(&"x".repeat(quorumlock::MAX_RESOURCE_LEN + 1), TTL)
            .read()
            .try_acquire(),
        Err(Error::InvalidInput(InvalidInput::ResourceTooLong { .. }))
    ));
    assert!(matches!(
        locks.request("quorumlock:meta", TTL).read().try_acquire(),
        Err(Error::InvalidInput(InvalidInput::ReservedResource(_)))
    ));
}

/// A renewed reader outlives many TTLs, and a node restarted empty under it gets its
/// entry back from the renewal (a copy, not a vote): the reader stays held on every node,
/// and a writer is refused throughout.
#[test]
fn a_renewed_reader_survives_and_gets_its_entry_back_after_a_restart() {
    let c = Cluster::start(3);
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_secs(1))
        .build()
        .expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    let key = unique_key("rw-renew");
    let ttl = Duration::from_secs(3);
    let r = locks
        .request(&key, ttl)
        .read()
        .try_acquire()
        .expect("reader");
    r.auto_renew();
    c.restart(0);
    assert!(
        wait_until(Duration::from_secs(8), || c
            .readers(0, &key)
            .contains(&r.token().to_owned())),
        "the restarted node never got the reader's entry back"
    );
    std::thread::sleep(ttl);
    assert!(r.is_held(), "the renewed reader lapsed");
    let other = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_secs(1))
        .build()
        .expect("valid config");
    taken(
        other.try_lock(&key, ttl),
        "a writer beside a renewed reader",
    );
    r.release().expect("release");
}

/// A writer that gives up leaves no intent behind for long: its last attempt marks none,
/// and none outlives the call's wait, so an earlier attempt's lasts at most the three node
/// timeouts of margin past the call (750 ms here). (Each kept readers out for a whole retry
/// pause after the call returned: 3.7 s after a 50 ms `acquire_for` with a 3 s
/// pause, seen failing.)
#[test]
fn a_writer_that_gave_up_lets_readers_in_at_once() {
    let c = shared();
    let key = unique_key("rw-gave-up");
    let reader = client(c.urls());
    let writer = |attempts: u32| {
        let w = Redlock::builder()
            .fresh_cluster(true)
            .nodes(c.urls())
            .node_timeout(Duration::from_millis(250))
            .retry_count(attempts)
            .retry_delay(Duration::from_secs(3))
            .retry_jitter(Duration::ZERO)
            .build()
            .expect("valid config");
        assert_eq!(w.wait_connected(Duration::from_secs(5)).ok(), Some(3));
        w
    };
    let held = reader
        .request(&key, TTL)
        .read()
        .try_acquire()
        .expect("a reader");
    type Call<'a> = Box<dyn Fn() -> quorumlock::Result<quorumlock::LockGuard> + 'a>;
    let calls: [(&str, Call<'_>); 2] = [
        (
            "acquire_for(50 ms)",
            Box::new(|| {
                writer(3)
                    .request(&key, TTL)
                    .acquire_for(Duration::from_millis(50))
            }),
        ),
        (
            "lock() with 2 attempts",
            Box::new(|| writer(2).lock(&key, TTL)),
        ),
    ];
    for (what, call) in calls {
        taken(call(), what);
        let gave_up = Instant::now();
        let other = client(c.urls());
        let r = loop {
            match other.request(&key, TTL).read().try_acquire() {
                Err(Error::Taken { .. }) if gave_up.elapsed() < Duration::from_secs(5) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                r => break r,
            }
        };
        assert!(r.is_ok(), "{what}: a new reader: {r:?}");
        assert!(
            gave_up.elapsed() < Duration::from_millis(1200),
            "{what}: readers kept out {:?} after the writer gave up",
            gave_up.elapsed()
        );
    }
    drop(held);
}

/// A node out of memory (`noeviction`) refuses a reader's renewal (`ZADD`), and the
/// refusal failed the whole renewal script on that node, writers' renewals in the same
/// round with it: with 2 of 3 nodes out of memory, a writer renewed beside a reader of its
/// client lost its lock (seen failing in 1 run of 3: a script that wrote before the
/// `ZADD` is let through), where alone it stays held (its `PEXPIRE` needs no memory).
/// Readers and writers now go in separate rounds (`watchdog`'s unit test pins that).
#[test]
fn a_reader_refused_by_a_full_node_does_not_cost_a_writer_its_renewal() {
    let c = Cluster::start(3);
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(250))
        .build()
        .expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    let ttl = Duration::from_millis(1500);
    let r = locks
        .request(&unique_key("rw-oom-r"), ttl)
        .read()
        .try_acquire()
        .expect("reader");
    let w = locks
        .try_lock(&unique_key("rw-oom-w"), ttl)
        .expect("writer");
    r.auto_renew();
    w.auto_renew();
    for i in 1..3 {
        for (k, v) in [("maxmemory", "1"), ("maxmemory-policy", "noeviction")] {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(k)
                .arg(v)
                .query(&mut c.conn(i))
                .expect("CONFIG SET");
        }
    }
    std::thread::sleep(Duration::from_secs(4));
    let (held, lost) = (w.is_held(), w.lost().check());
    for i in 1..3 {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg("0")
            .query(&mut c.conn(i))
            .expect("CONFIG SET");
    }
    assert!(
        held,
        "the writer was lost beside a refused reader: {lost:?}"
    );
    assert!(!r.is_held(), "a reader renewed on one node of three");
}
