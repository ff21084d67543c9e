//! `rediss://` nodes: TLS-enabled `redis-server` processes with throwaway
//! certificates made by `openssl` (both backends: the nodes need the
//! certificate files, so they are always local processes), and an ACL user
//! with only the commands the lock needs.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quorumlock::{Error, InvalidInput, NodeErrorKind, Redlock, Tls, Verdict};

use crate::common::{pick_port, unique_key, THROWAWAY};

const TTL: Duration = Duration::from_secs(5);
/// TLS handshakes on a loaded 2-core machine: generous.
const NODE_TIMEOUT: Duration = Duration::from_millis(500);

/// The minimal ACL the crate's docs give (keys restricted to the locks'
/// prefix, here `test:lock:*`, and the crate's own `quorumlock:meta`; the release
/// channels of those keys for the wake-ups).
const MINIMAL_ACL: &[&str] = &[
    "locker",
    "on",
    ">lock-pass",
    "resetkeys",
    "~test:lock:*",
    "~quorumlock:meta",
    "resetchannels",
    "&quorumlock:free:test:lock:*",
    "-@all",
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
    "+publish",
    "+subscribe",
    "+unsubscribe",
];

/// What read locks add to [`MINIMAL_ACL`]: the sorted-set commands of their scripts
/// (the README's list), for a second user, `reader`.
const READ_COMMANDS: &[&str] = &[
    "+zadd",
    "+zrem",
    "+zscore",
    "+zcard",
    "+zrevrange",
    "+zremrangebyscore",
];

/// Throwaway CA, server and client certificates in a temporary directory.
struct Certs {
    dir: PathBuf,
}

impl Certs {
    fn new() -> Certs {
        let dir = std::env::temp_dir().join(format!(
            "quorumlock-tls-{}-{}",
            std::process::id(),
            unique_key("d")
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let certs = Certs { dir };
        certs.ca("ca");
        certs.ca("other-ca");
        certs.leaf("server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost");
        certs.leaf("client", "ca", "extendedKeyUsage=clientAuth");
        certs
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .output()
            .expect("openssl runs (apt-get install openssl)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn ca(&self, name: &str) {
        self.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN=quorumlock test {name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
        ]);
    }

    fn leaf(&self, name: &str, ca: &str, ext: &str) {
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN=quorumlock test {name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
        ]);
        std::fs::write(self.path(&format!("{name}.ext")), format!("{ext}\n")).expect("ext");
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-days",
            "2",
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.crt"),
        ]);
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A `redis-server` serving TLS only, killed on drop.
struct TlsNode {
    port: u16,
    child: Child,
}

impl TlsNode {
    fn start(certs: &Certs, client_certs: bool) -> TlsNode {
        let bin =
            std::env::var("QUORUMLOCK_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let mut last = String::new();
        for _ in 0..5 {
            let port = pick_port().expect("a free port");
            let mut child = Command::new(&bin)
                .args([
                    "--port",
                    "0",
                    "--bind",
                    "127.0.0.1",
                    "--tls-port",
                    &port.to_string(),
                ])
                .args(THROWAWAY)
                .arg("--tls-cert-file")
                .arg(certs.path("server.crt"))
                .arg("--tls-key-file")
                .arg(certs.path("server.key"))
                .arg("--tls-ca-cert-file")
                .arg(certs.path("ca.crt"))
                .args([
                    "--tls-auth-clients",
                    if client_certs { "yes" } else { "no" },
                ])
                .arg("--user")
                .args(MINIMAL_ACL)
                .arg("--user")
                .args(["reader", "on", ">read-pass"])
                .args(&MINIMAL_ACL[3..])
                .args(READ_COMMANDS)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server runs");
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(15) {
                if let Ok(Some(status)) = child.try_wait() {
                    last = format!("redis-server exited: {status}");
                    break;
                }
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return TlsNode { port, child };
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("no TLS redis-server came up: {last}");
    }

    fn url(&self, userinfo: &str) -> String {
        format!("rediss://{userinfo}127.0.0.1:{}", self.port)
    }
}

/// Subscribers to `channel` on a TLS node (its default user, through `redis-cli --tls`;
/// 0 where that cannot be asked).
fn subscribers(certs: &Certs, node: &TlsNode, channel: &str) -> i64 {
    Command::new("redis-cli")
        .args(["--tls", "--cacert"])
        .arg(certs.path("ca.crt"))
        .args(["-h", "127.0.0.1", "-p", &node.port.to_string()])
        .args(["PUBSUB", "NUMSUB", channel])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().nth(1)?.trim().parse().ok())
        .unwrap_or(0)
}

impl Drop for TlsNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client(urls: Vec<String>, tls: Tls) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .node_timeout(NODE_TIMEOUT)
        .tls(tls)
        .build()
        .expect("valid config")
}

/// Locks until the nodes answer or `limit`: connects run in the background,
/// so the first attempts may find no connection yet.
fn lock_soon(locks: &Redlock, key: &str, limit: Duration) -> Result<quorumlock::LockGuard, Error> {
    let start = Instant::now();
    loop {
        match locks.try_lock(key, TTL) {
            Err(e) if e.is_retryable() && start.elapsed() < limit => {
                std::thread::sleep(Duration::from_millis(50))
            }
            r => return r,
        }
    }
}

/// The error a refused handshake ends in, once every node has failed one.
fn refused(locks: &Redlock, key: &str) -> (NodeErrorKind, String) {
    let start = Instant::now();
    loop {
        match locks.try_lock(key, TTL) {
            Ok(_) => panic!("locked through a handshake that must fail"),
            Err(e @ Error::NoQuorum { .. }) => {
                let Error::NoQuorum { failures, .. } = &e else {
                    unreachable!()
                };
                let told = |f: &&quorumlock::NodeError| {
                    !matches!(
                        f.kind(),
                        NodeErrorKind::NoConnection | NodeErrorKind::NotAwaited
                    )
                };
                if let Some(f) = failures.iter().find(told) {
                    eprintln!("refused as expected: {e}");
                    return (f.kind(), e.to_string());
                }
                if start.elapsed() > Duration::from_secs(10) {
                    panic!("no handshake error: {e}");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) if start.elapsed() > Duration::from_secs(10) => {
                panic!("no handshake error: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn ca(certs: &Certs, name: &str) -> Tls {
    Tls::new().ca_file(certs.path(&format!("{name}.crt")))
}

#[test]
fn a_trusted_certificate_works_end_to_end() {
    let certs = Certs::new();
    let nodes: Vec<TlsNode> = (0..3).map(|_| TlsNode::start(&certs, false)).collect();
    let locks = client(nodes.iter().map(|n| n.url("")).collect(), ca(&certs, "ca"));
    let key = unique_key("lock:tls");
    let guard = lock_soon(&locks, &key, Duration::from_secs(10)).expect("locks over TLS");
    let seen = locks.inspect(&key).expect("inspect");
    assert_eq!(seen.len(), 3);
    // On a majority at least (a node still connecting may have missed it).
    let held: Vec<_> = seen.iter().filter_map(|n| n.key().ok().flatten()).collect();
    assert!(held.len() >= 2, "{seen:?}");
    for k in held {
        assert_eq!(k.token(), guard.token());
        assert!(k.ttl().is_some_and(|t| t <= TTL), "{k:?}");
    }
    guard.extend(TTL).expect("extend over TLS");
    guard.release().expect("release over TLS");
    for n in locks.inspect(&key).expect("inspect") {
        assert_eq!(n.key().expect("answers"), None, "released on {}", n.node());
    }
}

#[test]
fn a_certificate_from_another_ca_is_refused_with_a_clear_error() {
    let certs = Certs::new();
    let node = TlsNode::start(&certs, false);
    for tls in [ca(&certs, "other-ca"), Tls::new()] {
        let locks = client(vec![node.url("")], tls);
        let (kind, msg) = refused(&locks, &unique_key("lock:wrong-ca"));
        assert_eq!(kind, NodeErrorKind::Tls, "{msg}");
        assert!(msg.contains("certificate"), "{msg}");
    }
}

#[test]
fn a_node_requiring_client_certificates_takes_ours_and_refuses_none() {
    let certs = Certs::new();
    let node = TlsNode::start(&certs, true);
    let key = unique_key("lock:mtls");

    let without = client(vec![node.url("")], ca(&certs, "ca"));
    let (kind, msg) = refused(&without, &key);
    assert_eq!(kind, NodeErrorKind::Tls, "{msg}");
    assert!(msg.to_lowercase().contains("certificate"), "{msg}");

    let with = client(
        vec![node.url("")],
        ca(&certs, "ca").client_auth(certs.path("client.crt"), certs.path("client.key")),
    );
    let guard = lock_soon(&with, &key, Duration::from_secs(10)).expect("mutual TLS works");
    guard.release().expect("release");
}

#[test]
fn an_acl_user_with_only_the_lock_commands_works_and_its_password_stays_hidden() {
    let certs = Certs::new();
    let nodes: Vec<TlsNode> = (0..3).map(|_| TlsNode::start(&certs, false)).collect();
    let key = unique_key("lock:acl");
    for fencing in [false, true] {
        let locks = Redlock::builder()
            .fresh_cluster(true)
            .fencing(fencing)
            .nodes(nodes.iter().map(|n| n.url("locker:lock-pass@")))
            .node_timeout(NODE_TIMEOUT)
            .tls(ca(&certs, "ca"))
            .build()
            .expect("valid config");
        assert!(!format!("{locks:?}").contains("lock-pass"));
        let guard = lock_soon(&locks, &key, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("minimal ACL user locks (fencing {fencing}): {e}"));
        assert_eq!(guard.fencing_token().is_some(), fencing);
        guard.extend(TTL).expect("extend");
        let n = locks.inspect(&key).expect("inspect");
        let on = n
            .iter()
            .filter(|n| n.key().is_ok_and(|k| k.is_some()))
            .count();
        assert!(on >= 2, "{n:?}");
        guard.release().expect("release");
    }
    // The user's release wakes a waiter of another client over TLS (the README's ACL
    // grants the channels): within a second, and by the release (its events say so),
    // where its 5 s retry pause would poll.
    let woken = Arc::new(WokenWin::default());
    let user_client = |pause: Duration, events: Arc<WokenWin>| {
        Redlock::builder()
            .fresh_cluster(true)
            .nodes(nodes.iter().map(|n| n.url("locker:lock-pass@")))
            .node_timeout(NODE_TIMEOUT)
            .retry_delay(pause)
            .retry_jitter(Duration::ZERO)
            .tls(ca(&certs, "ca"))
            .events(events)
            .build()
            .expect("valid config")
    };
    let holder = user_client(Duration::from_millis(100), Arc::default());
    let guard = lock_soon(&holder, &key, Duration::from_secs(10)).expect("lock");
    let waiting = user_client(Duration::from_secs(5), woken.clone());
    let wait_key = key.clone();
    let waiter = std::thread::spawn(move || {
        let g = waiting
            .request(&wait_key, TTL)
            .acquire_for(Duration::from_secs(20))
            .expect("the waiter locks");
        let got = std::time::Instant::now();
        g.release().expect("release");
        got
    });
    // Until the waiter listens on every node (a fixed sleep was too short on a loaded
    // machine: the release went unheard), or 10 s.
    let channel = format!("quorumlock:free:{key}");
    let _ = crate::common::wait_until(Duration::from_secs(10), || {
        nodes.iter().all(|n| subscribers(&certs, n, &channel) >= 1)
    });
    let released = std::time::Instant::now();
    guard.release().expect("release");
    let got = waiter.join().expect("waiter");
    assert!(
        got.saturating_duration_since(released) < Duration::from_secs(1),
        "woken {:?} after the release",
        got.saturating_duration_since(released)
    );
    // By the release, not by its fallback (1 s after it began), which the bound allows.
    assert!(
        woken.0.load(std::sync::atomic::Ordering::SeqCst),
        "the acquiring attempt was not woken"
    );
    // Outside the user's keys: refused by the nodes, said so.
    let locks = client(
        nodes.iter().map(|n| n.url("locker:lock-pass@")).collect(),
        ca(&certs, "ca"),
    );
    let (kind, msg) = refused(&locks, &unique_key("other:acl"));
    assert_eq!(kind, NodeErrorKind::Server, "{msg}");
    assert!(msg.contains("(NOPERM "), "the server's words: {msg}");
    // A wrong password: a refusal of the credentials, in the server's words,
    // without the password.
    let wrong = client(
        nodes
            .iter()
            .map(|n| n.url("locker:not-the-pass@"))
            .collect(),
        ca(&certs, "ca"),
    );
    let (kind, msg) = refused(&wrong, &key);
    assert_eq!(kind, NodeErrorKind::Auth, "{msg}");
    assert!(msg.contains("WRONGPASS"), "{msg}");
    assert!(!msg.contains("not-the-pass"), "{msg}");
}

/// Read locks under an ACL: the docs' minimal user plus the sorted-set commands takes
/// them (readers share, a writer is refused beside them, the last reader out lets it in);
/// the minimal user alone is refused by the nodes, and says so, on a read lock
/// and on a write lock of a resource that readers hold.
#[test]
fn read_locks_need_the_sorted_set_commands_and_say_so_without_them() {
    let certs = Certs::new();
    let nodes: Vec<TlsNode> = (0..3).map(|_| TlsNode::start(&certs, false)).collect();
    let key = unique_key("lock:acl-read");
    let user = |who: &str| client(nodes.iter().map(|n| n.url(who)).collect(), ca(&certs, "ca"));
    let (r1, r2, w) = (
        user("reader:read-pass@"),
        user("reader:read-pass@"),
        user("reader:read-pass@"),
    );
    let a = lock_soon_with(|| r1.request(&key, TTL).read().try_acquire())
        .expect("the reader user reads");
    let b = lock_soon_with(|| r2.request(&key, TTL).read().try_acquire())
        .expect("a second reader shares");
    assert!(matches!(w.try_lock(&key, TTL), Err(Error::Taken { .. })));
    let minimal = user("locker:lock-pass@");
    for (what, r) in [
        (
            "a read lock",
            lock_soon_with(|| minimal.request(&key, TTL).read().try_acquire()),
        ),
        (
            "a write lock beside readers",
            lock_soon_with(|| minimal.try_lock(&key, TTL)),
        ),
    ] {
        match r {
            // Refused for good by the ACL, in the server's words: Redis 7.0
            // says the script "can't run this command", later servers
            // "no permissions to run the '…' command".
            Err(Error::ScriptsRefused { failures, .. }) => assert!(
                failures
                    .iter()
                    .any(|f| f.kind() == NodeErrorKind::ScriptsRefused
                        && (f.detail().contains("can't run this command")
                            || f.detail().contains("no permissions to run"))),
                "{what}: {failures:?}"
            ),
            other => panic!("{what} under the minimal ACL: {other:?}"),
        }
    }
    // `check` says so: a warning for the minimal user, fine for the reader user (on a key
    // nobody holds: on a held one it cannot try).
    let free = unique_key("lock:acl-check");
    for (who, verdict) in [(&minimal, Verdict::Warn), (&w, Verdict::Ok)] {
        let audit = who.check(&free).expect("check");
        for n in audit.nodes() {
            assert!(
                n.findings()
                    .iter()
                    .any(|f| f.topic() == "read locks" && f.verdict() == verdict),
                "{audit}"
            );
        }
    }
    drop((a, b));
    w.try_lock(&key, TTL)
        .expect("the writer once the readers left")
        .release()
        .expect("release");
}

/// Retries `f` while it fails for want of a connection (connects run in the
/// background), for 10 s at most.
fn lock_soon_with(
    f: impl Fn() -> Result<quorumlock::LockGuard, Error>,
) -> Result<quorumlock::LockGuard, Error> {
    let start = Instant::now();
    loop {
        match f() {
            Err(Error::NoQuorum { failures, .. })
                if start.elapsed() < Duration::from_secs(10)
                    && failures.iter().all(|f| {
                        matches!(
                            f.kind(),
                            NodeErrorKind::NoConnection | NodeErrorKind::NotAwaited
                        )
                    }) =>
            {
                std::thread::sleep(Duration::from_millis(50))
            }
            r => return r,
        }
    }
}

#[test]
fn unusable_tls_files_are_refused_at_build() {
    let certs = Certs::new();
    let build = |tls: Tls| {
        Redlock::builder()
            .nodes(["rediss://127.0.0.1:1"])
            .tls(tls)
            .build()
    };
    let missing = certs.path("missing.crt");
    let cases: Vec<(Tls, &str)> = vec![
        (Tls::new().ca_file(&missing), "missing.crt"),
        (Tls::new().ca_file(certs.path("server.ext")), "no PEM"),
        (
            Tls::new().client_auth(certs.path("client.crt"), certs.path("server.key")),
            "client",
        ),
        (
            Tls::new().client_auth(certs.path("client.crt"), &missing),
            "missing.crt",
        ),
    ];
    for (tls, why) in cases {
        match build(tls) {
            Err(Error::InvalidInput(InvalidInput::Tls(msg))) => {
                assert!(msg.contains(why), "{why}: {msg}")
            }
            other => panic!("{why}: {other:?}"),
        }
    }
    // The files are not needed for redis:// nodes only.
    assert!(Redlock::builder()
        .nodes(["redis://127.0.0.1:1"])
        .tls(Tls::new().ca_file(&missing))
        .build()
        .is_ok());
}

#[test]
fn a_tls_url_to_a_plain_node_and_a_plain_url_to_a_tls_node_fail_clearly() {
    let certs = Certs::new();
    // rediss:// to a node that speaks no TLS: its error reply is no record.
    let plain = crate::common::shared();
    let urls: Vec<String> = plain
        .urls()
        .iter()
        .map(|u| u.replacen("redis://", "rediss://", 1))
        .collect();
    // Redis waits for the end of an inline command that never comes.
    let (kind, msg) = refused(&client(urls, ca(&certs, "ca")), &unique_key("lock:mixed"));
    assert_eq!(kind, NodeErrorKind::Skipped, "{msg}");
    assert!(msg.contains("no reply to the TLS handshake"), "{msg}");
    // redis:// to a TLS node: it drops the connection at our first command.
    let node = TlsNode::start(&certs, false);
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes([node.url("").replacen("rediss://", "redis://", 1)])
        .node_timeout(NODE_TIMEOUT)
        .build()
        .expect("valid config");
    let start = Instant::now();
    let err = locks
        .request(&unique_key("lock:mixed"), TTL)
        .acquire_for(Duration::from_secs(2))
        .expect_err("no lock over a plain connection to a TLS port");
    assert!(err.is_retryable(), "{err}");
    // Bounded like any failing node: the wait, plus an attempt's bound.
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

/// Whether an attempt that acquired was woken by a release.
#[derive(Default)]
struct WokenWin(std::sync::atomic::AtomicBool);

impl quorumlock::EventHandler for WokenWin {
    fn on_attempt(&self, e: &quorumlock::AttemptEvent<'_>) {
        if e.acquired() && e.woken() {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}
