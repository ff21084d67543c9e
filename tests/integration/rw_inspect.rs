//! `Redlock::inspect` of read locks (issue 23, item 4): a node's reader set shows as its
//! live readers (token and time left each) and a waiting writer's intent, a writer's key
//! as before, with only the commands a read lock's ACL already allows. Clients use
//! `fresh_cluster(true)` on the shared throwaway nodes.

use std::time::Duration;

use quorumlock::{KeyInfo, NodeErrorKind, NodeKey, Redlock};

use crate::common::{shared, unique_key, wait_until, Cluster, READERS_MARK};

const TTL: Duration = Duration::from_secs(10);

fn client(urls: Vec<String>) -> Redlock {
    let locks = crate::client_with(urls, Duration::from_millis(250));
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    locks
}

/// The key on every node, panicking on a node that did not answer.
fn keys(locks: &Redlock, key: &str) -> Vec<Option<KeyInfo>> {
    locks
        .inspect(key)
        .expect("a valid key")
        .iter()
        .map(|n| match n.key() {
            Ok(k) => k.cloned(),
            Err(e) => panic!("{}: {e}", n.node()),
        })
        .collect()
}

/// The node's time in ms (`TIME`).
fn node_ms(c: &Cluster, i: usize) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut c.conn(i)).expect("TIME");
    secs * 1000 + micros / 1000
}

/// Two readers, of different TTLs, on every node: each node's key is a reader set with
/// both (longest-lived first, each with its own time left), no token of its own, the
/// set's life at least the longest reader's, and no writer waiting. `Debug` shows no
/// token.
#[test]
fn inspect_lists_every_live_reader_with_its_time_left() {
    let c = shared();
    let (a, b) = (client(c.urls()), client(c.urls()));
    let key = unique_key("rwi-readers");
    let short = a
        .request(&key, TTL)
        .read()
        .try_acquire()
        .expect("first reader");
    let long = b
        .request(&key, TTL * 3)
        .read()
        .try_acquire()
        .expect("second reader shares");
    // A round ends at a majority: the third node's entry may land a moment later.
    assert!(wait_until(Duration::from_secs(2), || (0..3)
        .all(|i| c.readers(i, &key).len() == 2)));
    let nodes = a.inspect(&key).expect("inspect");
    assert_eq!(nodes.len(), 3);
    for n in &nodes {
        let k = match n.key() {
            Ok(Some(k)) => k,
            other => panic!("{}: expected a reader set, got {other:?}", n.node()),
        };
        assert!(k.is_read(), "{k:?}");
        assert_eq!(k.token(), "", "a reader set has no token of its own");
        let tokens: Vec<&str> = k.readers().iter().map(|r| r.token()).collect();
        assert_eq!(tokens, [long.token(), short.token()], "{}", n.node());
        let ttls: Vec<Duration> = k.readers().iter().map(|r| r.ttl()).collect();
        assert!(ttls[0] > TTL * 2 && ttls[0] <= TTL * 3, "{ttls:?}");
        assert!(ttls[1] > TTL / 2 && ttls[1] <= TTL, "{ttls:?}");
        let life = k.ttl().expect("the set expires");
        assert!(
            life + Duration::from_millis(50) >= ttls[0],
            "{life:?} {ttls:?}"
        );
        assert_eq!(k.writer_waiting(), None);
        let shown = format!("{n:?}");
        assert!(
            !shown.contains(short.token()) && !shown.contains(long.token()),
            "Debug shows a token: {shown}"
        );
    }
    short.release().expect("release");
    // The one left is all a node lists (the third node's release may land a moment
    // after the call returns).
    let mut after = Vec::new();
    let only_long = wait_until(Duration::from_secs(2), || {
        after = keys(&a, &key);
        after.iter().all(|k| {
            k.as_ref()
                .is_some_and(|k| k.readers().iter().map(|r| r.token()).eq([long.token()]))
        })
    });
    assert!(only_long, "{after:?}");
    long.release().expect("release");
    assert!(wait_until(Duration::from_secs(1), || keys(&a, &key)
        .iter()
        .all(Option::is_none)));
}

/// A writer that waits for a reader marks its intent: inspect shows it on a majority,
/// beside the reader, with no more time left than the writer's wait between tries;
/// once the reader leaves and the writer holds, the key is the writer's token as before.
#[test]
fn inspect_shows_a_waiting_writer_then_the_writers_key() {
    let c = shared();
    let (a, w) = (client(c.urls()), client(c.urls()));
    let key = unique_key("rwi-intent");
    let reader = a.request(&key, TTL).read().try_acquire().expect("reader");
    let writer = {
        let key = key.clone();
        std::thread::spawn(move || w.request(&key, TTL).acquire_for(Duration::from_secs(8)))
    };
    let mut seen = Vec::new();
    let marked = wait_until(Duration::from_secs(3), || {
        seen = keys(&a, &key);
        seen.iter()
            .flatten()
            .filter(|k| k.writer_waiting().is_some())
            .count()
            >= 2
    });
    assert!(marked, "no writer's intent on a majority: {seen:?}");
    for k in seen.iter().flatten() {
        assert!(k.is_read());
        let tokens: Vec<&str> = k.readers().iter().map(|r| r.token()).collect();
        assert_eq!(tokens, [reader.token()], "the intent is no reader");
        if let Some(left) = k.writer_waiting() {
            assert!(left > Duration::ZERO && left <= TTL, "{left:?}");
        }
    }
    reader.release().expect("the reader leaves");
    let g = writer
        .join()
        .expect("writer thread")
        .expect("the writer gets in");
    // The writer's key on a majority (a node the writer's round reached before the
    // reader's release may keep the emptied set until the writer's renewal restores it).
    let found = keys(&a, &key);
    let mut writers = 0;
    for k in found.iter().flatten() {
        if k.is_read() {
            assert!(
                k.readers().is_empty(),
                "a reader beside the writer: {found:?}"
            );
            continue;
        }
        writers += 1;
        assert_eq!(k.token(), g.token());
        assert!(k.readers().is_empty());
        assert_eq!(k.writer_waiting(), None);
        assert!(k.ttl().is_some_and(|t| t > Duration::ZERO && t <= TTL));
        assert!(!format!("{k:?}").contains(g.token()));
    }
    assert!(writers >= 2, "{found:?}");
    g.release().expect("release");
}

/// Entries whose score has passed count for nobody: a set written by hand with a dead
/// reader, a live one and a dead intent lists the live reader alone; a set of dead
/// entries only is a reader set with no reader; a live intent alone is a waiting writer.
/// A set without expiry has no TTL.
#[test]
fn inspect_leaves_out_entries_whose_expiry_has_passed() {
    let c = shared();
    let locks = client(c.urls());
    let (mixed, dead, intent) = (
        unique_key("rwi-mixed"),
        unique_key("rwi-dead"),
        unique_key("rwi-w"),
    );
    for i in 0..3 {
        let now = node_ms(&c, i);
        let zadd = |key: &str, entries: &[(u64, &str)]| {
            // A reader set of the crate's: with its mark.
            let mut cmd = redis::cmd("ZADD");
            cmd.arg(key).arg(0).arg(READERS_MARK);
            for (score, m) in entries {
                cmd.arg(*score).arg(*m);
            }
            let _: i64 = cmd.query(&mut c.conn(i)).expect("ZADD");
        };
        zadd(
            &mixed,
            &[
                (now - 5_000, "rdead"),
                (now + 60_000, "rlive"),
                (now - 1, "w"),
            ],
        );
        zadd(&dead, &[(now - 5_000, "rdead")]);
        zadd(&intent, &[(now + 5_000, "w")]);
        let _: i64 = redis::cmd("PEXPIRE")
            .arg(&dead)
            .arg(60_000)
            .query(&mut c.conn(i))
            .expect("PEXPIRE");
    }
    for k in keys(&locks, &mixed) {
        let k = k.expect("the set");
        let readers: Vec<(&str, Duration)> =
            k.readers().iter().map(|r| (r.token(), r.ttl())).collect();
        assert_eq!(readers.len(), 1, "{k:?}");
        assert_eq!(readers[0].0, "rlive");
        assert!(readers[0].1 > Duration::from_secs(50), "{readers:?}");
        assert_eq!(k.writer_waiting(), None, "a dead intent");
        assert_eq!(k.ttl(), None, "no PEXPIRE: no expiry");
    }
    for k in keys(&locks, &dead) {
        let k = k.expect("the set");
        assert!(k.is_read() && k.readers().is_empty(), "{k:?}");
        assert_eq!(k.writer_waiting(), None);
        assert!(k.ttl().is_some_and(|t| t > Duration::from_secs(50)));
    }
    for k in keys(&locks, &intent) {
        let k = k.expect("the set");
        assert!(k.is_read() && k.readers().is_empty(), "{k:?}");
        let left = k.writer_waiting().expect("a live intent");
        assert!(
            left > Duration::from_secs(3) && left <= Duration::from_secs(5),
            "{left:?}"
        );
    }
    for i in 0..3 {
        for key in [&mixed, &dead, &intent] {
            c.del(i, key);
        }
    }
}

/// A writer's key, a free key and a key that is no lock answer as before the reader
/// sets: the token and its TTL (none for a key without expiry), `None`, and the node's
/// `WRONGTYPE` as a server error.
#[test]
fn inspect_of_a_writer_a_free_key_and_another_type_is_as_before() {
    let c = shared();
    let locks = client(c.urls());
    let key = unique_key("rwi-writer");
    let g = locks.try_lock(&key, TTL).expect("lock");
    assert!(wait_until(Duration::from_secs(2), || c
        .holders(&key, g.token())
        == 3));
    for k in keys(&locks, &key) {
        let k = k.expect("held");
        assert_eq!(k.token(), g.token());
        assert!(k.ttl().is_some_and(|t| t > TTL / 2 && t <= TTL));
        assert!(!k.is_read() && k.readers().is_empty());
        assert_eq!(k.writer_waiting(), None);
    }
    g.release().expect("release");
    assert!(wait_until(Duration::from_secs(1), || keys(&locks, &key)
        .iter()
        .all(Option::is_none)));

    let (plain, hash) = (unique_key("rwi-plain"), unique_key("rwi-hash"));
    for i in 0..3 {
        let _: () = redis::cmd("SET")
            .arg(&plain)
            .arg("by-hand")
            .query(&mut c.conn(i))
            .expect("SET");
        let _: () = redis::cmd("HSET")
            .arg(&hash)
            .arg("f")
            .arg("v")
            .query(&mut c.conn(i))
            .expect("HSET");
    }
    // Not a lock's: a string of another shape, a hash. Their values are not shown.
    for k in keys(&locks, &plain).into_iter().chain(keys(&locks, &hash)) {
        let k = k.expect("the key");
        assert_eq!(
            (k.is_lock(), k.token(), k.ttl(), k.is_read()),
            (false, "", None, false)
        );
    }
    for n in locks.inspect(&hash).expect("inspect") {
        match n.key() {
            Ok(Some(k)) if !k.is_lock() => {}
            other => panic!("{}: expected not a lock key, got {other:?}", n.node()),
        }
    }
    for i in 0..3 {
        c.del(i, &plain);
        c.del(i, &hash);
    }
}

/// An ACL user on each node, removed when dropped.
struct AclUser<'a> {
    c: &'a Cluster,
    name: String,
}

impl<'a> AclUser<'a> {
    /// `name` with password `pw`, `rules` on top of `on >pw resetkeys ~<prefix>*
    /// ~quorumlock:meta resetchannels -@all`.
    fn new(c: &'a Cluster, name: &str, prefix: &str, rules: &[&str]) -> AclUser<'a> {
        for i in 0..c.len() {
            let mut cmd = redis::cmd("ACL");
            cmd.arg("SETUSER")
                .arg(name)
                .arg("on")
                .arg(">pw")
                .arg("resetkeys")
                .arg(format!("~{prefix}*"))
                .arg("~quorumlock:meta")
                .arg("resetchannels")
                .arg("-@all")
                .arg(rules);
            let _: () = cmd.query(&mut c.conn(i)).expect("ACL SETUSER");
        }
        AclUser {
            c,
            name: name.to_owned(),
        }
    }

    fn urls(&self) -> Vec<String> {
        self.c
            .urls()
            .iter()
            .map(|u| u.replace("redis://", &format!("redis://{}:pw@", self.name)))
            .collect()
    }
}

impl Drop for AclUser<'_> {
    fn drop(&mut self) {
        for i in 0..self.c.len() {
            let _: redis::RedisResult<i64> = redis::cmd("ACL")
                .arg("DELUSER")
                .arg(&self.name)
                .query(&mut self.c.conn(i));
        }
    }
}

/// The README's minimal ACL for exclusive locks.
const LOCK_RULES: [&str; 17] = [
    "+ping",
    "+eval",
    "+evalsha",
    "+script|load",
    "+set",
    "+get",
    "+del",
    "+pexpire",
    "+pttl",
    "+hget",
    "+hmget",
    "+hset",
    "+time",
    "+info",
    "+publish",
    "+subscribe",
    "+unsubscribe",
];

/// What read locks add: the sorted-set commands of the scripts.
const READ_RULES: [&str; 6] = [
    "+zadd",
    "+zrem",
    "+zscore",
    "+zcard",
    "+zrevrange",
    "+zremrangebyscore",
];

/// Inspect asks only what the lock's ACL allows: a user with the read lock's commands
/// takes a read lock and inspects it; a user with the exclusive lock's alone still
/// inspects a writer's key (the set commands' refusals do not matter there) and is told
/// why it cannot read a reader set.
#[test]
fn inspect_runs_under_the_locks_own_acl() {
    let c = shared();
    let prefix = unique_key("rwi-acl");
    let tag = prefix.replace([':', '-'], "_");
    let rules: Vec<&str> = LOCK_RULES.iter().chain(&READ_RULES).copied().collect();
    let reads = AclUser::new(&c, &format!("r{tag}"), &prefix, &rules);
    let writes = AclUser::new(&c, &format!("w{tag}"), &prefix, &LOCK_RULES);
    let (reader, writer) = (client(reads.urls()), client(writes.urls()));

    let key = format!("{prefix}:set");
    let r = reader
        .request(&key, TTL)
        .read()
        .try_acquire()
        .expect("a read lock under its ACL");
    let found = keys(&reader, &key);
    assert!(
        found
            .iter()
            .flatten()
            .filter(|k| k.readers().iter().any(|e| e.token() == r.token()))
            .count()
            >= 2,
        "{found:?}"
    );
    let mut refused = 0;
    for n in writer.inspect(&key).expect("inspect") {
        match n.key() {
            // Where the reader's entry has not landed yet.
            Ok(None) => {}
            Err(e) if e.kind() == NodeErrorKind::Server && e.detail().contains("NOPERM") => {
                refused += 1
            }
            other => panic!("{}: expected the ACL's refusal, got {other:?}", n.node()),
        }
    }
    assert!(refused >= 2, "refused on {refused} nodes");
    r.release().expect("release");

    let key = format!("{prefix}:writer");
    let g = writer.try_lock(&key, TTL).expect("a lock under its ACL");
    let answers: Vec<NodeKey> = writer.inspect(&key).expect("inspect");
    let held = answers
        .iter()
        .filter(|n| matches!(n.key(), Ok(Some(k)) if k.token() == g.token()))
        .count();
    assert!(held >= 2, "{answers:?}");
    assert!(answers.iter().all(|n| n.key().is_ok()), "{answers:?}");
    g.release().expect("release");
}

/// Under the README's ACL for read locks (the lock's commands and the sorted-set ones,
/// nothing else), a renewed reader whose copy a node lost gets it back: the renewal's
/// restore meets no key there, and must tell that from another owner's with the
/// commands the ACL allows (it called `EXISTS`, which the ACL refuses: the node's copy
/// stayed missing). Its release where the key is gone answers too.
#[test]
fn a_readers_lost_copy_is_restored_under_the_read_locks_acl() {
    let c = shared();
    let prefix = unique_key("rwi-restore");
    let tag = prefix.replace([':', '-'], "_");
    let rules: Vec<&str> = LOCK_RULES.iter().chain(&READ_RULES).copied().collect();
    let user = AclUser::new(&c, &format!("r{tag}"), &prefix, &rules);
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(user.urls())
        .node_timeout(Duration::from_millis(250))
        .auto_renew(true)
        .build()
        .expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    let key = format!("{prefix}:k");
    let on = |i: usize, token: &str| c.readers(i, &key).iter().any(|t| t == token);
    let r = locks
        .request(&key, Duration::from_millis(600))
        .read()
        .try_acquire()
        .expect("a reader under its ACL");
    assert!(
        wait_until(Duration::from_secs(2), || (0..3).all(|i| on(i, r.token()))),
        "the reader on every node"
    );
    c.del(0, &key);
    assert!(
        wait_until(Duration::from_secs(3), || on(0, r.token())),
        "node 0's copy was not restored by the renewal"
    );
    assert!(r.is_held());
    c.del(0, &key);
    r.release().expect("released");
}
