//! A lock never touches a key that is not its own (issue 38, item 1): where a lock's name
//! holds an application's value of any type (string, hash, list, set, sorted set,
//! stream), every call (writer, reader, set, release, extend, renewal and restore,
//! hand-over, fencing, inspect, check) leaves it as it was, byte for byte (`DUMP`) and
//! with its TTL, and is refused there as by another owner. Clients use
//! `fresh_cluster(true)` on the shared throwaway nodes.

use std::time::Duration;

use quorumlock::Redlock;

use crate::common::{shared, unique_key, wait_until, Cluster};

const TTL: Duration = Duration::from_secs(5);

/// The application data types, each planted by its own commands.
const TYPES: [&str; 6] = ["string", "hash", "list", "set", "zset", "stream"];

/// An application's key of type `kind` under `key` on node `i`, with a TTL of an hour
/// where `ttl` (none otherwise). The sorted set has members scored in the past and in
/// the future (the node's ms), as a lock's reader set would be.
fn plant(c: &Cluster, i: usize, key: &str, kind: &str, ttl: bool) {
    let mut conn = c.conn(i);
    let (secs, _): (u64, u64) = redis::cmd("TIME").query(&mut conn).expect("TIME");
    let now_ms = secs * 1000;
    let mut cmd = match kind {
        "string" => redis::cmd("SET").arg(key).arg("app-value").to_owned(),
        "hash" => redis::cmd("HSET")
            .arg(key)
            .arg("field")
            .arg("1")
            .arg("other")
            .arg("2")
            .to_owned(),
        "list" => redis::cmd("RPUSH").arg(key).arg("a").arg("b").to_owned(),
        "set" => redis::cmd("SADD").arg(key).arg("a").arg("w").to_owned(),
        "zset" => redis::cmd("ZADD")
            .arg(key)
            .arg(1)
            .arg("past")
            .arg(now_ms - 1000)
            .arg("r-old")
            .arg(now_ms + 3_600_000)
            .arg("future")
            .to_owned(),
        "stream" => redis::cmd("XADD")
            .arg(key)
            .arg("*")
            .arg("f")
            .arg("v")
            .to_owned(),
        other => panic!("no such type {other}"),
    };
    let _: redis::Value = cmd.query(&mut conn).expect("plant");
    if ttl {
        let _: i64 = redis::cmd("PEXPIRE")
            .arg(key)
            .arg(3_600_000)
            .query(&mut conn)
            .expect("PEXPIRE");
    }
    cmd = redis::cmd("TYPE").arg(key).to_owned();
    let t: String = cmd.query(&mut conn).expect("TYPE");
    assert_eq!(t, kind, "planted");
}

/// What node `i` keeps under `key`: its type, its `DUMP` and its TTL (ms, or -1).
fn snapshot(c: &Cluster, i: usize, key: &str) -> (String, Vec<u8>, i64) {
    let mut conn = c.conn(i);
    let t: String = redis::cmd("TYPE").arg(key).query(&mut conn).expect("TYPE");
    let d: Vec<u8> = redis::cmd("DUMP").arg(key).query(&mut conn).expect("DUMP");
    let p: i64 = redis::cmd("PTTL").arg(key).query(&mut conn).expect("PTTL");
    (t, d, p)
}

/// The key on node `i` is as `before`: same type and bytes, and its TTL still none or
/// no longer than it was (and not cut by more than the test's own run).
fn assert_untouched(c: &Cluster, i: usize, key: &str, before: &(String, Vec<u8>, i64), what: &str) {
    let now = snapshot(c, i, key);
    assert_eq!(
        now.0, before.0,
        "{what}: the type of {key} changed on node {i}"
    );
    assert_eq!(
        now.1, before.1,
        "{what}: the value of {key} changed on node {i}"
    );
    if before.2 == -1 {
        assert_eq!(now.2, -1, "{what}: {key} got a TTL on node {i}");
    } else {
        assert!(
            now.2 <= before.2 && now.2 > before.2 - 120_000,
            "{what}: the TTL of {key} on node {i} went from {} to {} ms",
            before.2,
            now.2
        );
    }
}

fn client(c: &Cluster, fencing: bool) -> Redlock {
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(250))
        .retry_delay(Duration::from_millis(20))
        .retry_jitter(Duration::from_millis(10))
        .fencing(fencing)
        .build()
        .expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    locks
}

/// On every node the name is an application's key: every kind of call is refused, and
/// the data stays as it was on every node (type, bytes, TTL).
#[test]
fn an_applications_key_of_any_type_is_refused_and_left_as_it_was() {
    let c = shared();
    let locks = client(&c, false);
    let fenced = client(&c, true);
    for kind in TYPES {
        for ttl in [false, true] {
            let key = unique_key(&format!("foreign-all-{kind}"));
            let free = unique_key("foreign-free");
            for i in 0..3 {
                plant(&c, i, &key, kind, ttl);
            }
            let before: Vec<_> = (0..3).map(|i| snapshot(&c, i, &key)).collect();
            let what = format!("{kind} (ttl {ttl})");
            let wait = Duration::from_millis(120);
            assert!(
                locks.try_lock(&key, TTL).is_err(),
                "{what}: a writer got it"
            );
            assert!(
                fenced.try_lock(&key, TTL).is_err(),
                "{what}: a fenced writer got it"
            );
            assert!(
                locks.request(&key, TTL).read().try_acquire().is_err(),
                "{what}: a reader got it"
            );
            assert!(
                locks.request(&key, TTL).acquire_for(wait).is_err(),
                "{what}: a waiting writer got it"
            );
            assert!(
                locks.request(&key, TTL).read().acquire_for(wait).is_err(),
                "{what}: a waiting reader got it"
            );
            assert!(
                locks
                    .request(free.as_str(), TTL)
                    .and(key.as_str())
                    .try_acquire()
                    .is_err(),
                "{what}: a set got it"
            );
            assert!(
                locks
                    .request(key.as_str(), TTL)
                    .and(free.as_str())
                    .acquire_for(wait)
                    .is_err(),
                "{what}: a waiting set got it"
            );
            // A set refused as a whole leaves its free key free.
            assert!(
                c.gone_everywhere(&free, Duration::from_secs(2)),
                "{what}: the set's other key stayed"
            );
            let _ = locks.check(&key);
            for (i, b) in before.iter().enumerate() {
                assert_untouched(&c, i, &key, b, &what);
            }
            for n in locks.inspect(&key).expect("inspect") {
                let k = n.key().expect("the node answers").expect("the key exists");
                assert!(!k.is_lock(), "{what}: {} calls it a lock key", n.node());
                assert!(k.readers().is_empty() && !k.is_read(), "{what}: readers");
            }
            for (i, b) in before.iter().enumerate() {
                assert_untouched(&c, i, &key, b, &format!("{what}, inspect"));
            }
        }
    }
}

/// One node of three keeps an application's key under the lock's name: the lock is held
/// on the other two, and its extension, renewal (and the restore that follows it, which
/// sets a held lock's missing copies), hand-over to another thread, fencing and release
/// all reach that node too, and leave its key as it was. A reader and a set likewise.
#[test]
fn a_held_lock_never_touches_an_applications_key_on_a_minority() {
    let c = shared();
    let locks = client(&c, false);
    let fenced = client(&c, true);
    let renewing = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(250))
        .auto_renew(true)
        .build()
        .expect("valid config");
    for kind in TYPES {
        let key = unique_key(&format!("foreign-one-{kind}"));
        plant(&c, 0, &key, kind, false);
        let before = snapshot(&c, 0, &key);
        let what = kind.to_string();

        // A writer: held on nodes 1 and 2, extended, handed over to another thread of
        // its client (a swap), released.
        let g = locks
            .try_lock(&key, TTL)
            .expect("a writer on nodes 1 and 2");
        assert_eq!(g.nodes_held(), 2, "{what}");
        g.extend(TTL * 2).expect("extended on 1 and 2");
        let waiter = {
            let locks = locks.clone();
            let key = key.clone();
            std::thread::spawn(move || locks.request(&key, TTL).acquire_for(Duration::from_secs(5)))
        };
        std::thread::sleep(Duration::from_millis(100));
        g.release().expect("released");
        let g = waiter.join().expect("no panic").expect("handed over");
        g.release().expect("released");
        assert_untouched(&c, 0, &key, &before, &format!("{what}, writer"));

        // A fenced writer.
        let g = fenced.try_lock(&key, TTL).expect("fenced on 1 and 2");
        assert!(g.fencing_token().is_some());
        g.release().expect("released");
        assert_untouched(&c, 0, &key, &before, &format!("{what}, fenced"));

        // A renewed writer: its renewal extends and restores where the key is missing.
        let g = renewing
            .try_lock(&key, Duration::from_millis(600))
            .expect("renewed writer");
        assert!(g.is_auto_renewed());
        std::thread::sleep(Duration::from_millis(1_000));
        assert!(g.is_held(), "{what}: renewed on 1 and 2");
        g.release().expect("released");
        assert_untouched(&c, 0, &key, &before, &format!("{what}, renewal"));

        // A reader, extended and renewed, and released.
        let r = renewing
            .request(&key, Duration::from_millis(600))
            .read()
            .try_acquire()
            .expect("a reader on 1 and 2");
        r.extend(Duration::from_millis(600)).expect("extended");
        std::thread::sleep(Duration::from_millis(1_000));
        assert!(r.is_held(), "{what}: reader renewed on 1 and 2");
        r.release().expect("released");
        assert_untouched(&c, 0, &key, &before, &format!("{what}, reader"));

        // A set with the key.
        let other = unique_key("foreign-one-other");
        let s = locks
            .request(other.as_str(), TTL)
            .and(key.as_str())
            .try_acquire()
            .expect("a set on 1 and 2");
        s.extend(TTL).expect("extended");
        s.release().expect("released");
        assert_untouched(&c, 0, &key, &before, &format!("{what}, set"));

        for n in locks.inspect(&key).expect("inspect").iter().take(1) {
            let k = n.key().expect("node 0 answers").expect("node 0 keeps it");
            assert!(!k.is_lock(), "{what}: node 0's key called a lock key");
        }
        assert!(
            wait_until(Duration::from_secs(2), || c.get(1, &key).is_none()
                && c.get(2, &key).is_none()),
            "{what}: the lock's own copies were released"
        );
    }
}
