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

/// A server (`redis-server` or `valkey-server`, as the process backend picks) serving TLS
/// only (or, for the ACL tests on a server without TLS, plain TCP only), with the
/// tests' ACL users, killed on drop.
struct TlsNode {
    port: u16,
    child: Child,
    tls: bool,
}

/// Why a TLS node did not start.
#[derive(Debug)]
enum TlsStartError {
    /// The server was built without TLS (Valkey's PyPI build, a `BUILD_TLS=no` Redis):
    /// its own words.
    NoTls(String),
    /// Anything else: the server's own words.
    Failed(String),
}

impl TlsNode {
    /// `cert`: the server certificate's name in `certs` (its key is `server.key`).
    fn try_start(certs: &Certs, client_certs: bool, cert: &str) -> Result<TlsNode, TlsStartError> {
        TlsNode::start_as(certs, Some((client_certs, cert)))
    }

    /// A node serving TLS (`Some((client_certs, cert))`) or plain TCP (`None`).
    fn start_as(certs: &Certs, tls: Option<(bool, &str)>) -> Result<TlsNode, TlsStartError> {
        let bin = crate::common::server_binary().map_err(TlsStartError::Failed)?;
        let mut last = String::new();
        // A port free when picked can be taken before the server binds it: another port.
        for attempt in 0..5 {
            let port = pick_port().map_err(TlsStartError::Failed)?;
            let log_path = certs.path(&format!("node-{port}-{attempt}.log"));
            let log = std::fs::File::create(&log_path).map_err(|e| {
                TlsStartError::Failed(format!("cannot create {}: {e}", log_path.display()))
            })?;
            let log2 = log
                .try_clone()
                .map_err(|e| TlsStartError::Failed(format!("cannot dup the log file: {e}")))?;
            let mut cmd = Command::new(&bin);
            cmd.args(["--bind", "127.0.0.1"]).args(THROWAWAY);
            match tls {
                Some((client_certs, cert)) => cmd
                    .args(["--port", "0", "--tls-port", &port.to_string()])
                    .arg("--tls-cert-file")
                    .arg(certs.path(cert))
                    .arg("--tls-key-file")
                    .arg(certs.path("server.key"))
                    .arg("--tls-ca-cert-file")
                    .arg(certs.path("ca.crt"))
                    .args([
                        "--tls-auth-clients",
                        if client_certs { "yes" } else { "no" },
                    ]),
                None => cmd.args(["--port", &port.to_string()]),
            };
            let mut child = cmd
                .arg("--user")
                .args(MINIMAL_ACL)
                .arg("--user")
                .args(["reader", "on", ">read-pass"])
                .args(&MINIMAL_ACL[3..])
                .args(READ_COMMANDS)
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log2)
                .spawn()
                .map_err(|e| TlsStartError::Failed(format!("cannot run {}: {e}", bin.display())))?;
            let start = Instant::now();
            let mut status = None;
            while start.elapsed() < Duration::from_secs(15) {
                if let Ok(Some(s)) = child.try_wait() {
                    status = Some(s);
                    break;
                }
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Ok(TlsNode {
                        port,
                        child,
                        tls: tls.is_some(),
                    });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            last = format!(
                "{} on port {port} (TLS: {}) {}; {}",
                bin.display(),
                tls.is_some(),
                status.map_or("did not listen within 15 s".to_string(), |s| format!(
                    "exited ({s})"
                )),
                crate::common::log_excerpt_of(&text)
            );
            if lacks_tls(&text) {
                return Err(TlsStartError::NoTls(last));
            }
            if !text.to_ascii_lowercase().contains("address already in use") {
                break;
            }
        }
        Err(TlsStartError::Failed(format!(
            "no TLS node came up: {last}"
        )))
    }

    fn url(&self, userinfo: &str) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://{userinfo}127.0.0.1:{}", self.port)
    }
}

/// `n` TLS nodes; None where the server has no TLS and `QUORUMLOCK_ALLOW_NO_TLS=1` lets
/// the test skip what needs them (said on the terminal, past the test harness's output
/// capture). Without that variable such a server fails the test, saying why: a TLS test
/// never passes silently without TLS.
fn tls_nodes(certs: &Certs, n: usize, client_certs: bool) -> Option<Vec<TlsNode>> {
    nodes_or_skip(certs, n, client_certs, false)
}

/// `n` nodes with the tests' ACL users for the ACL tests, which need no TLS: TLS nodes, or
/// on a server without TLS (with `QUORUMLOCK_ALLOW_NO_TLS=1`, said on the terminal)
/// plain ones.
fn acl_nodes(certs: &Certs, n: usize) -> Vec<TlsNode> {
    nodes_or_skip(certs, n, false, true).unwrap_or_default()
}

fn nodes_or_skip(
    certs: &Certs,
    n: usize,
    client_certs: bool,
    plain_instead: bool,
) -> Option<Vec<TlsNode>> {
    let mut nodes = Vec::with_capacity(n);
    for _ in 0..n {
        match TlsNode::try_start(certs, client_certs, "server.crt") {
            Ok(node) => nodes.push(node),
            Err(TlsStartError::NoTls(why)) if allow_no_tls() => {
                use std::io::Write;
                // libtest names a test's thread after the test.
                let test = std::thread::current()
                    .name()
                    .unwrap_or("a TLS test")
                    .to_string();
                let what = if plain_instead {
                    "runs over plain TCP"
                } else {
                    "SKIPPED the part that needs TLS"
                };
                // Straight to the process's stderr: libtest captures `eprintln!`.
                let _ = writeln!(
                    std::io::stderr(),
                    "\n!!! {test} {what}: this server has no TLS support \
                     (QUORUMLOCK_ALLOW_NO_TLS=1).\n!!! {why}"
                );
                if !plain_instead {
                    return None;
                }
                drop(nodes);
                let plain = (0..n)
                    .map(|_| TlsNode::start_as(certs, None).unwrap_or_else(|e| panic!("{e:?}")));
                return Some(plain.collect());
            }
            Err(TlsStartError::NoTls(why)) => panic!(
                "this server has no TLS support, so the TLS tests cannot run: {why}\n\
                 Point QUORUMLOCK_REDIS_SERVER at a server built with TLS, or set \
                 QUORUMLOCK_ALLOW_NO_TLS=1 to skip what needs a TLS node (each skip is printed)."
            ),
            Err(TlsStartError::Failed(why)) => panic!("{why}"),
        }
    }
    Some(nodes)
}

fn allow_no_tls() -> bool {
    std::env::var("QUORUMLOCK_ALLOW_NO_TLS").is_ok_and(|v| v.trim() == "1")
}

/// Subscribers to `channel` on a node (its default user, through `redis-cli`, with
/// `--tls` on a TLS node; 0 where that cannot be asked).
fn subscribers(certs: &Certs, node: &TlsNode, channel: &str) -> i64 {
    let mut cli = Command::new("redis-cli");
    if node.tls {
        cli.args(["--tls", "--cacert"]).arg(certs.path("ca.crt"));
    }
    cli.args(["-h", "127.0.0.1", "-p", &node.port.to_string()])
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
    let Some(nodes) = tls_nodes(&certs, 3, false) else {
        return;
    };
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
    let Some(node) = tls_nodes(&certs, 1, false).and_then(|mut n| n.pop()) else {
        return;
    };
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
    let Some(node) = tls_nodes(&certs, 1, true).and_then(|mut n| n.pop()) else {
        return;
    };
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
    let nodes = acl_nodes(&certs, 3);
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
    let nodes = acl_nodes(&certs, 3);
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
            // Refused for good by the ACL, in the server's words (either
            // wording: see `acl_refused_in_script`).
            Err(Error::ScriptsRefused { failures, .. }) => assert!(
                failures
                    .iter()
                    .any(|f| f.kind() == NodeErrorKind::ScriptsRefused
                        && acl_refused_in_script(f.detail())),
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
    let Some(node) = tls_nodes(&certs, 1, false).and_then(|mut n| n.pop()) else {
        return;
    };
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

/// A TLS node that cannot start (its certificate file is missing) says why in the
/// server's own words, not only "exited: exit status: 1".
#[test]
fn a_tls_node_that_cannot_start_says_why() {
    let certs = Certs::new();
    let msg = match TlsNode::try_start(&certs, false, "missing.crt") {
        Ok(node) => panic!(
            "a TLS node started without its certificate on port {}",
            node.port
        ),
        Err(TlsStartError::Failed(msg) | TlsStartError::NoTls(msg)) => msg,
    };
    eprintln!("as expected: {msg}");
    // Redis: "Failed to configure TLS…"; a server without TLS: "Failed finding TLS support."
    assert!(
        msg.contains("Failed to configure TLS") || msg.contains("Failed finding TLS support"),
        "{msg}"
    );
}

/// Whether a server's log says it was built without TLS: Redis ≥ 7.2 and Valkey
/// ("Failed finding TLS support."), older Redis (`tls-port` is an unknown directive).
fn lacks_tls(log: &str) -> bool {
    log.contains("Failed finding TLS support")
        || log.lines().any(|l| l.contains("'tls-port")) && log.contains("Bad directive")
}

/// Whether a node's error says its ACL refused a command a script called. The servers
/// word it differently: Redis 7.0 "ERR The user executing the script can't run this
/// command or subcommand script: …", Redis ≥ 7.2 and Valkey "ERR ACL failure in script:
/// User reader has no permissions to run the 'zadd' command script: …".
fn acl_refused_in_script(msg: &str) -> bool {
    msg.contains("script")
        && (msg.contains("can't run this command") || msg.contains("no permissions to run"))
}

#[test]
fn both_wordings_of_an_acl_refusal_in_a_script_are_recognised() {
    for msg in [
        "ERR The user executing the script can't run this command or subcommand script: \
         956ac7400b4485995027f6ca245f2a19788a2042, on @user_script:1.",
        "ERR ACL failure in script: User u has no permissions to run the 'zadd' command \
         script: on @user_script:1.",
    ] {
        assert!(acl_refused_in_script(msg), "{msg}");
    }
    // A refusal outside a script (the key is not the user's) is another failure.
    assert!(!acl_refused_in_script(
        "NOPERM No permissions to access a key"
    ));
}
