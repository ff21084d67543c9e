//! Test harness: N throwaway Redis nodes, as Docker containers (testcontainers) or as
//! `redis-server` processes on 127.0.0.1.
//!
//! Environment:
//! - `QUORUMLOCK_TEST_BACKEND` = `auto` (default) | `docker` | `process`. `auto` uses Docker
//!   when the engine answers and the image is present (or can be pulled quickly), else
//!   `redis-server` processes (one line on stderr says why). `docker` / `process` force a
//!   backend and fail loudly when it does not work.
//! - `QUORUMLOCK_REDIS_IMAGE` = image `name:tag` for the Docker backend, default
//!   `redis:7-alpine`. `.ci/redis-image.sh` builds `quorumlock/redis:7-debian` from Debian's
//!   redis-server package for engines that cannot pull.
//! - `QUORUMLOCK_DOCKER_PULL_TIMEOUT` = seconds `auto`/`docker` may spend pulling a missing
//!   image (default 60).
//! - `QUORUMLOCK_AUTO_INSTALL` = `0` stops `auto` from installing redis-server with apt-get
//!   when nothing else works (it does so only as root on a machine with apt-get).
//! - `QUORUMLOCK_REDIS_SERVER` = path of the `redis-server` binary for the process backend
//!   (default: `redis-server` on PATH).
//! - `QUORUMLOCK_HARNESS_VERBOSE` (any value) = print each cluster's backend, start time
//!   and URLs on stderr.
//!
//! Old Docker engines (API < 1.53, e.g. Debian 12's 20.10 = 1.41) are handled by an
//! in-process proxy that rewrites the API version in request paths (see `proxy.rs`).
//!
//! Include it with `#[path = "../common/mod.rs"] mod common;` (tests/integration) or
//! `#[path = "../tests/common/mod.rs"] mod common;` (examples); an `#[allow(dead_code)]`
//! on that line is optional.
// `unused` rather than `dead_code`: includers may add `#[allow(dead_code)]` themselves and
// clippy rejects the same lint allowed twice (duplicated_attributes).
#![allow(unused)]

pub mod candidates;
mod docker;
pub mod faults;
mod process;
mod proxy;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Polls `f` every 20 ms until it is true or `limit` has passed; its last answer.
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

/// A one-line summary of a lock error: its variant and, for `NoQuorum`, each failure's kind.
pub fn summary(e: &quorumlock::Error) -> String {
    match e {
        quorumlock::Error::NoQuorum {
            agreed, failures, ..
        } => {
            let kinds: Vec<String> = failures.iter().map(|f| format!("{:?}", f.kind())).collect();
            format!("NoQuorum(agreed {agreed}: {})", kinds.join("+"))
        }
        quorumlock::Error::Taken { held, nodes } => format!("Taken({held}/{nodes})"),
        e => format!("{e:?}"),
    }
}

/// Server flags both backends pass: no protected mode, no persistence (a
/// restart loses every key, as the restart tests need).
pub(crate) const THROWAWAY: [&str; 6] =
    ["--protected-mode", "no", "--save", "", "--appendonly", "no"];

/// Default image for the Docker backend.
pub const DEFAULT_IMAGE: &str = "redis:7-alpine";

/// Which kind of nodes a [`Cluster`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// testcontainers-managed containers of `QUORUMLOCK_REDIS_IMAGE`.
    Docker,
    /// `redis-server` child processes on 127.0.0.1.
    Process,
}

/// N throwaway Redis nodes. Dropping it removes every container / kills every process it
/// started (also while a test panics).
pub struct Cluster {
    backend: Backend,
    nodes: Vec<Node>,
}

struct Node {
    host: String,
    port: u16,
    inner: Mutex<NodeImpl>,
}

enum NodeImpl {
    Docker(Box<docker::DockerNode>),
    Process(process::ProcessNode),
}

impl Cluster {
    /// Starts `n` nodes; panics with a message saying what to install when no backend works.
    pub fn start(n: usize) -> Cluster {
        match Cluster::try_start(n) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    /// Starts `n` nodes, or says why it could not.
    pub fn try_start(n: usize) -> Result<Cluster, String> {
        let backend = selected()?;
        let started = Instant::now();
        // Start the nodes in parallel; collect results so that a failure of one still lets
        // the others be cleaned up (they drop with the Vec).
        let results: Vec<Result<Node, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|_| {
                    std::thread::Builder::new()
                        .name("ql-harness-start".into())
                        .spawn_scoped(s, move || start_node(backend))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|_| Err("node start panicked".to_string())),
                    Err(e) => Err(format!("cannot spawn a thread: {e}")),
                })
                .collect()
        });
        let mut nodes = Vec::with_capacity(n);
        let mut errors = Vec::new();
        for r in results {
            match r {
                Ok(node) => nodes.push(node),
                Err(e) => errors.push(e),
            }
        }
        let cluster = Cluster {
            backend: backend.kind(),
            nodes,
        };
        if !errors.is_empty() {
            drop(cluster);
            return Err(format!(
                "quorumlock test harness: could not start {n} Redis node(s) with the {:?} backend:\n  {}",
                backend.kind(),
                errors.join("\n  ")
            ));
        }
        if std::env::var_os("QUORUMLOCK_HARNESS_VERBOSE").is_some() {
            eprintln!(
                "quorumlock test harness: {n} {:?} node(s) up in {:?}: {:?}",
                cluster.backend,
                started.elapsed(),
                cluster.urls()
            );
        }
        Ok(cluster)
    }

    /// Starts `n` `redis-server` processes whatever the selected backend, node `i` with the
    /// extra environment `env_for(i)` (e.g. libfaketime's, to move one node's clock).
    pub fn start_processes(
        n: usize,
        env_for: impl Fn(usize) -> Vec<(String, String)>,
    ) -> Result<Cluster, String> {
        static PROCESS: OnceLock<Result<Selected, String>> = OnceLock::new();
        let backend = PROCESS
            .get_or_init(|| process::probe().map(Selected::Process))
            .as_ref()
            .map_err(|e| format!("quorumlock test harness: redis-server is not usable: {e}"))?;
        let mut cluster = Cluster {
            backend: Backend::Process,
            nodes: Vec::with_capacity(n),
        };
        for i in 0..n {
            // On failure, `cluster` drops and removes the nodes already started.
            cluster.nodes.push(start_node_with(backend, env_for(i))?);
        }
        Ok(cluster)
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// `redis://127.0.0.1:PORT` for every node; stable for the cluster's lifetime.
    pub fn urls(&self) -> Vec<String> {
        (0..self.len()).map(|i| self.url(i)).collect()
    }

    pub fn url(&self, i: usize) -> String {
        let n = self.node(i);
        format!("redis://{}:{}", n.host, n.port)
    }

    /// Kills node `i` (a dead node: connections are refused afterwards).
    pub fn stop(&self, i: usize) {
        let n = self.node(i);
        let r = match &mut *n.lock() {
            NodeImpl::Docker(d) => d.stop(),
            NodeImpl::Process(p) => p.stop(),
        };
        if let Err(e) = r {
            panic!("stop node {i} ({}): {e}", self.url(i));
        }
    }

    /// Starts node `i` again on the same port, with no data; returns once it answers PING.
    /// A running node is stopped first.
    pub fn restart(&self, i: usize) {
        let n = self.node(i);
        let r = match &mut *n.lock() {
            NodeImpl::Docker(d) => d.restart(&n.host, n.port),
            NodeImpl::Process(p) => p.restart(),
        };
        if let Err(e) = r {
            panic!("restart node {i} ({}): {e}", self.url(i));
        }
    }

    /// Freezes node `i` (a hung node: TCP connections are accepted, nothing is answered).
    pub fn pause(&self, i: usize) {
        let n = self.node(i);
        let r = match &mut *n.lock() {
            NodeImpl::Docker(d) => d.pause(),
            NodeImpl::Process(p) => p.pause(),
        };
        if let Err(e) = r {
            panic!("pause node {i} ({}): {e}", self.url(i));
        }
    }

    pub fn unpause(&self, i: usize) {
        let n = self.node(i);
        let r = match &mut *n.lock() {
            NodeImpl::Docker(d) => d.unpause(),
            NodeImpl::Process(p) => p.unpause(),
        };
        if let Err(e) = r {
            panic!("unpause node {i} ({}): {e}", self.url(i));
        }
    }

    /// Whether `key` is gone from every node within `limit` (polled): a release returns
    /// once a majority deleted the key, and the other nodes' deletes land a moment later.
    pub fn gone_everywhere(&self, key: &str, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        loop {
            if (0..self.len()).all(|i| self.get(i, key).is_none()) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A direct connection to node `i` with 1 s connect/read/write timeouts.
    pub fn conn(&self, i: usize) -> redis::Connection {
        self.try_conn(i, Duration::from_secs(1))
            .unwrap_or_else(|e| panic!("connect to node {i} ({}): {e}", self.url(i)))
    }

    /// Like [`Cluster::conn`] with a chosen timeout, as a Result.
    pub fn try_conn(&self, i: usize, timeout: Duration) -> redis::RedisResult<redis::Connection> {
        use redis::IntoConnectionInfo;
        let info = self.url(i).into_connection_info()?;
        let settings = info.redis_settings().clone().set_skip_set_lib_name();
        let client = redis::Client::open(info.set_redis_settings(settings))?;
        let conn = client.get_connection_with_timeout(timeout)?;
        conn.set_read_timeout(Some(timeout))?;
        conn.set_write_timeout(Some(timeout))?;
        Ok(conn)
    }

    /// Whether node `i` carries a lock history (`quorumlock:meta`).
    pub fn has_history(&self, i: usize) -> bool {
        redis::cmd("EXISTS")
            .arg("quorumlock:meta")
            .query::<i64>(&mut self.conn(i))
            .unwrap_or_else(|e| panic!("EXISTS on node {i}: {e}"))
            == 1
    }

    /// Locks throwaway keys for `ttl` with `locks` until every node carries a
    /// lock history recording `ttl` (a round settles without the slowest
    /// node, and a node still connecting is not sent anything); false if
    /// that takes over 5 s. The history's age counts from here.
    pub fn write_history(&self, locks: &quorumlock::Redlock, ttl: Duration) -> bool {
        wait_until(Duration::from_secs(5), || {
            drop(locks.try_lock(&unique_key("history"), ttl));
            (0..self.len()).all(|i| self.has_history(i))
        })
    }

    /// `GET key` on node `i`.
    pub fn get(&self, i: usize, key: &str) -> Option<String> {
        redis::cmd("GET")
            .arg(key)
            .query(&mut self.conn(i))
            .unwrap_or_else(|e| panic!("GET {key} on node {i}: {e}"))
    }

    /// On how many nodes `key` holds `token`; panics if any node holds
    /// another value (a lock held by two owners at once).
    pub fn holders(&self, key: &str, token: &str) -> usize {
        (0..self.len())
            .filter(|&i| match self.get(i, key) {
                Some(v) if v == token => true,
                Some(v) => panic!("node {i} holds {key} for another owner ({v})"),
                None => false,
            })
            .count()
    }

    /// The live readers of `key` on node `i`: the members of its reader set whose expiry
    /// (the score, in the node's ms) is still ahead, the writers' intent `w` left out.
    /// Empty where the key is absent or a writer's.
    pub fn readers(&self, i: usize, key: &str) -> Vec<String> {
        self.reader_set(i, key)
            .into_iter()
            .filter(|m| m != "w")
            .collect()
    }

    /// Whether a waiting writer's intent is live on `key` on node `i`.
    pub fn intent(&self, i: usize, key: &str) -> bool {
        self.reader_set(i, key).iter().any(|m| m == "w")
    }

    /// The live members of `key`'s reader set on node `i` (none where it is no set).
    fn reader_set(&self, i: usize, key: &str) -> Vec<String> {
        let mut c = self.conn(i);
        let (secs, micros): (u64, u64) = redis::cmd("TIME")
            .query(&mut c)
            .unwrap_or_else(|e| panic!("TIME on node {i}: {e}"));
        let now = secs * 1000 + micros / 1000;
        let kind: String = redis::cmd("TYPE")
            .arg(key)
            .query(&mut c)
            .unwrap_or_else(|e| panic!("TYPE {key} on node {i}: {e}"));
        if kind != "zset" {
            return Vec::new();
        }
        redis::cmd("ZRANGEBYSCORE")
            .arg(key)
            .arg(format!("({now}"))
            .arg("+inf")
            .query(&mut c)
            .unwrap_or_else(|e| panic!("ZRANGEBYSCORE {key} on node {i}: {e}"))
    }

    /// The fencing counter of `key` on node `i` (`HGET quorumlock:meta fence:<key>`).
    pub fn fence(&self, i: usize, key: &str) -> Option<u64> {
        redis::cmd("HGET")
            .arg("quorumlock:meta")
            .arg(format!("fence:{key}"))
            .query(&mut self.conn(i))
            .unwrap_or_else(|e| panic!("HGET fence:{key} on node {i}: {e}"))
    }

    /// `DEL key` on node `i`.
    pub fn del(&self, i: usize, key: &str) {
        let _: i64 = redis::cmd("DEL")
            .arg(key)
            .query(&mut self.conn(i))
            .unwrap_or_else(|e| panic!("DEL {key} on node {i}: {e}"));
    }

    /// `PTTL key` on node `i` (-2: no such key, -1: no expiry).
    pub fn pttl(&self, i: usize, key: &str) -> i64 {
        redis::cmd("PTTL")
            .arg(key)
            .query(&mut self.conn(i))
            .unwrap_or_else(|e| panic!("PTTL {key} on node {i}: {e}"))
    }

    /// Subscribers to the channel a release of `key` publishes on, on node
    /// `i` (`PUBSUB NUMSUB`; 0 where it cannot tell).
    pub fn subscribers(&self, i: usize, key: &str) -> i64 {
        let v: Vec<redis::Value> = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(format!("quorumlock:free:{key}"))
            .query(&mut self.conn(i))
            .unwrap_or_default();
        match v.get(1) {
            Some(redis::Value::Int(n)) => *n,
            _ => 0,
        }
    }

    fn node(&self, i: usize) -> &Node {
        self.nodes.get(i).unwrap_or_else(|| {
            panic!(
                "node index {i} out of range: the cluster has {} nodes",
                self.nodes.len()
            )
        })
    }
}

impl Node {
    fn lock(&self) -> MutexGuard<'_, NodeImpl> {
        // A panic while holding the lock (a failed stop, say) must not wedge Drop.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let nodes = std::mem::take(&mut self.nodes);
        std::thread::scope(|s| {
            for node in nodes {
                // If no thread can be spawned the closure, and with it the node, is dropped
                // right here: the nodes' own Drop impls still remove container / process.
                let _ = std::thread::Builder::new()
                    .name("ql-harness-drop".into())
                    .spawn_scoped(s, move || {
                        let port = node.port;
                        let inner = node.inner.into_inner().unwrap_or_else(|e| e.into_inner());
                        match inner {
                            NodeImpl::Docker(d) => d.remove(),
                            NodeImpl::Process(p) => p.remove(),
                        }
                        release_port(port);
                    });
            }
        });
    }
}

fn start_node(backend: &'static Selected) -> Result<Node, String> {
    start_node_with(backend, Vec::new())
}

/// Starts a node; `extra_env` goes to a process node's redis-server.
fn start_node_with(
    backend: &'static Selected,
    extra_env: Vec<(String, String)>,
) -> Result<Node, String> {
    let mut last = String::new();
    // A port that was free when checked can be taken before the node binds it: retry with
    // another port.
    for _ in 0..3 {
        let port = pick_port()?;
        let r = match backend {
            Selected::Docker(env) => docker::DockerNode::start(env, port)
                .map(|(d, host)| (NodeImpl::Docker(Box::new(d)), host)),
            Selected::Process(env) => {
                process::ProcessNode::start_with_env(env, port, extra_env.clone())
                    .map(|p| (NodeImpl::Process(p), "127.0.0.1".to_string()))
            }
        };
        match r {
            Ok((inner, host)) => {
                return Ok(Node {
                    host,
                    port,
                    inner: Mutex::new(inner),
                })
            }
            Err(e) => {
                release_port(port);
                let lower = e.to_ascii_lowercase();
                last = e;
                if !lower.contains("address already in use") && !lower.contains("already allocated")
                {
                    break;
                }
            }
        }
    }
    Err(last)
}

// ---------------------------------------------------------------------------------------
// shared cluster and keys

static SHARED: Mutex<Weak<Cluster>> = Mutex::new(Weak::new());

/// A 3-node cluster shared by concurrently running non-destructive tests (do not stop or
/// pause its nodes). Created on demand; torn down when the last `Arc` drops.
pub fn shared() -> Arc<Cluster> {
    let mut guard = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = guard.upgrade() {
        return c;
    }
    let c = Arc::new(Cluster::start(3));
    *guard = Arc::downgrade(&c);
    c
}

/// Builds `tests/common/clockshift.c`, the LD_PRELOAD shim that moves one redis-server's
/// wall clock (libfaketime deadlocks with redis-server's jemalloc: wolfcw/libfaketime#130).
/// Panics, naming what is missing, when gcc cannot build it: clock tests are never skipped.
pub fn clockshift_lib() -> std::path::PathBuf {
    static LIB: OnceLock<std::path::PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let out =
            std::env::temp_dir().join(format!("quorumlock-clockshift-{}.so", std::process::id()));
        // The source goes in on stdin, from the binary: any package that
        // includes this harness can build it.
        let mut gcc = Command::new("gcc")
            .args(["-shared", "-fPIC", "-O2", "-x", "c", "-", "-o"])
            .arg(&out)
            .stdin(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("clock tests need gcc to build clockshift.c: {e}"));
        if let Some(mut stdin) = gcc.stdin.take() {
            stdin
                .write_all(include_bytes!("clockshift.c"))
                .expect("clockshift.c to gcc");
        }
        let status = gcc.wait().expect("gcc");
        assert!(
            status.success(),
            "gcc could not build clockshift.c: {status}"
        );
        out
    })
    .clone()
}

/// One node's wall-clock offset, read by the clock shim through a shared mapping of a file.
/// Start the node with [`ClockOffset::env`]; the file is removed on drop.
pub struct ClockOffset(std::path::PathBuf);

impl ClockOffset {
    pub fn new() -> ClockOffset {
        let path = std::env::temp_dir().join(format!("{}.offset", unique_key("clock")));
        std::fs::write(&path, 0i64.to_le_bytes()).expect("offset file");
        ClockOffset(path)
    }

    /// The environment that runs a redis-server under the shim, reading this offset.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), clockshift_lib().display().to_string()),
            ("QL_CLOCK_OFFSET_FILE".into(), self.0.display().to_string()),
        ]
    }

    /// Steps the node's wall clock to `micros` from real time (in place: the file is mapped).
    pub fn set_micros(&self, micros: i64) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.0)
            .expect("offset file");
        f.write_all_at(&micros.to_le_bytes(), 0)
            .expect("write offset");
    }

    /// Steps the node's wall clock to `secs` from real time.
    pub fn set(&self, secs: i64) {
        self.set_micros(secs.saturating_mul(1_000_000));
    }
}

impl Drop for ClockOffset {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// For the examples: the nodes in `REDLOCK_NODES` (comma-separated URLs) or, when it is unset,
/// `n` throwaway nodes started here, returned too so that they live as long as the caller
/// keeps them (they are removed when dropped). Says which on stdout.
pub fn example_nodes(n: usize) -> Result<(Vec<String>, Option<Cluster>), String> {
    let configured = std::env::var("REDLOCK_NODES")
        .ok()
        .filter(|s| !s.trim().is_empty());
    if let Some(list) = configured {
        let urls: Vec<String> = list.split(',').map(|s| s.trim().to_owned()).collect();
        println!("using REDLOCK_NODES: {urls:?}");
        return Ok((urls, None));
    }
    println!("REDLOCK_NODES not set: starting {n} throwaway Redis nodes...");
    let t = Instant::now();
    let cluster = Cluster::try_start(n)?;
    println!(
        "  started with the {:?} backend in {:?}: {:?}",
        cluster.backend(),
        t.elapsed(),
        cluster.urls()
    );
    Ok((cluster.urls(), Some(cluster)))
}

/// The member that marks a sorted set as a reader set of quorumlock's (score 0): a test
/// that plants a reader set by hand adds it.
pub const READERS_MARK: &str = "\0quorumlock";

/// A key unique per call and per process: `test:{name}:{pid}:{counter}:{nanos}`.
pub fn unique_key(name: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    format!(
        "test:{name}:{}:{}:{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        nanos()
    )
}

// ---------------------------------------------------------------------------------------
// backend selection (once per process)

enum Selected {
    Docker(docker::DockerEnv),
    Process(process::ProcessEnv),
}

impl Selected {
    fn kind(&self) -> Backend {
        match self {
            Selected::Docker(_) => Backend::Docker,
            Selected::Process(_) => Backend::Process,
        }
    }
}

fn selected() -> Result<&'static Selected, String> {
    static SELECTED: OnceLock<Result<Selected, String>> = OnceLock::new();
    SELECTED.get_or_init(select).as_ref().map_err(Clone::clone)
}

fn image() -> String {
    std::env::var("QUORUMLOCK_REDIS_IMAGE")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| DEFAULT_IMAGE.to_string())
}

fn install_hint(image: &str) -> String {
    format!(
        "Install one of:\n  \
         - redis-server (Debian/Ubuntu: `apt-get install redis-server`; macOS: `brew install redis`), or\n  \
         - Docker (engine running, `docker` CLI on PATH) with the image `{image}` available \
         (`docker pull {image}`; without a registry build a local one with `.ci/redis-image.sh` \
         and set QUORUMLOCK_REDIS_IMAGE=quorumlock/redis:7-debian)."
    )
}

/// Last resort of `auto` on a Debian-like machine where we are root (a fresh
/// CI or dev box with no registry for Docker): install redis-server with apt,
/// saying so loudly, and probe again. `QUORUMLOCK_AUTO_INSTALL=0` turns it off.
fn auto_install(probe_err: String) -> Result<process::ProcessEnv, String> {
    let allowed = std::env::var("QUORUMLOCK_AUTO_INSTALL").map_or(true, |v| v.trim() != "0");
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let apt = Command::new("apt-get")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !(allowed && root && apt) {
        return Err(probe_err);
    }
    eprintln!(
        "quorumlock test harness: no redis-server and no usable Docker image; installing          redis-server with apt-get (set QUORUMLOCK_AUTO_INSTALL=0 to prevent this)"
    );
    let run = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .status()
            .map_err(|e| e.to_string())
            .and_then(|s| {
                s.success()
                    .then_some(())
                    .ok_or(format!("apt-get {args:?}: {s}"))
            })
    };
    run(&["update", "-qq"])
        .and_then(|()| {
            run(&[
                "install",
                "-y",
                "-qq",
                "--no-install-recommends",
                "redis-server",
            ])
        })
        .map_err(|e| format!("{probe_err}; installing redis-server failed: {e}"))?;
    process::probe()
}

fn select() -> Result<Selected, String> {
    let mode = std::env::var("QUORUMLOCK_TEST_BACKEND")
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let image = image();
    match mode.as_str() {
        "docker" => docker::probe(&image).map(Selected::Docker).map_err(|e| {
            format!(
                "quorumlock test harness: QUORUMLOCK_TEST_BACKEND=docker, but Docker is not usable: {e}\n{}",
                install_hint(&image)
            )
        }),
        "process" => process::probe().map(Selected::Process).map_err(|e| {
            format!(
                "quorumlock test harness: QUORUMLOCK_TEST_BACKEND=process, but redis-server is not usable: {e}\n{}",
                install_hint(&image)
            )
        }),
        "" | "auto" => match docker::probe(&image) {
            Ok(env) => Ok(Selected::Docker(env)),
            Err(docker_err) => match process::probe().or_else(auto_install) {
                Ok(env) => {
                    eprintln!(
                        "quorumlock test harness: using redis-server processes on 127.0.0.1, not Docker: {docker_err}"
                    );
                    Ok(Selected::Process(env))
                }
                Err(proc_err) => Err(format!(
                    "quorumlock test harness: no Redis backend works.\n  Docker: {docker_err}\n  \
                     Process: {proc_err}\n{}",
                    install_hint(&image)
                )),
            },
        },
        other => Err(format!(
            "quorumlock test harness: QUORUMLOCK_TEST_BACKEND={other:?} is not one of auto, docker, process"
        )),
    }
}

// ---------------------------------------------------------------------------------------
// helpers shared by the backends

pub(crate) fn nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// `(pid, start time in clock ticks)` of a process, from /proc; None when it is gone.
pub(crate) fn proc_identity(pid: u32) -> Option<(u32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    // Fields after "(comm)" start with field 3 (state); starttime is field 22.
    let start = after.split_whitespace().nth(19)?.parse().ok()?;
    Some((pid, start))
}

/// Identifies this test process across pid reuse: `hostname/pid/starttime`.
pub(crate) fn owner_tag() -> &'static str {
    static TAG: OnceLock<String> = OnceLock::new();
    TAG.get_or_init(|| {
        let pid = std::process::id();
        let start = proc_identity(pid).map(|(_, s)| s).unwrap_or(0);
        format!("{}/{pid}/{start}", hostname())
    })
}

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Whether the process named by an `owner_tag()` of this host is still running.
pub(crate) fn owner_alive(tag: &str) -> bool {
    let mut parts = tag.split('/');
    let (Some(_host), Some(pid), Some(start)) = (parts.next(), parts.next(), parts.next()) else {
        return true; // unknown format: leave it alone
    };
    let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
        return true;
    };
    proc_identity(pid).is_some_and(|(_, s)| s == start)
}

static PORTS_IN_USE: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A port that is free on both 127.0.0.1 and 0.0.0.0, below the kernel's ephemeral range
/// (so that a client socket cannot take it while a node is stopped), and not handed out
/// to another live node of this process.
pub(crate) fn pick_port() -> Result<u16, String> {
    let (eph_low, _) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|p| p.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999));
    let (lo, hi) = if eph_low > 12000 {
        (10000u16, eph_low)
    } else {
        (eph_low.max(1024), 65535)
    };
    let span = u32::from(hi - lo);
    let seed = (nanos() as u32) ^ std::process::id().wrapping_mul(2654435761);
    let mut used = PORTS_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
    let used = used.get_or_insert_with(HashSet::new);
    for k in 0..span.min(4000) {
        let port = lo + ((seed.wrapping_add(k.wrapping_mul(7919))) % span) as u16;
        if used.contains(&port) {
            continue;
        }
        let free = TcpListener::bind(("127.0.0.1", port)).is_ok()
            && TcpListener::bind(("0.0.0.0", port)).is_ok();
        if free {
            used.insert(port);
            return Ok(port);
        }
    }
    Err(format!("no free TCP port found in {lo}..{hi}"))
}

pub(crate) fn release_port(port: u16) {
    let mut used = PORTS_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(used) = used.as_mut() {
        used.remove(&port);
    }
}

/// One raw `PING` (inline command); true on `+PONG`.
pub(crate) fn ping_once(host: &str, port: u16, timeout: Duration) -> bool {
    let Some(addr) = (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
    else {
        return false;
    };
    let Ok(mut s) = TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    let _ = s.shutdown(Shutdown::Both);
    buf[..got].starts_with(b"+PONG")
}

/// Polls PING until it answers or `limit` passes; `alive` may abort early with an error
/// (e.g. the process exited).
pub(crate) fn wait_for_ping(
    host: &str,
    port: u16,
    limit: Duration,
    mut alive: impl FnMut() -> Result<(), String>,
) -> Result<Duration, String> {
    let start = Instant::now();
    loop {
        if ping_once(host, port, Duration::from_millis(250)) {
            return Ok(start.elapsed());
        }
        alive()?;
        if start.elapsed() > limit {
            return Err(format!("no PONG from {host}:{port} within {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs a command with a time limit; Ok(stdout) on exit status 0, else Err with stderr.
pub(crate) fn run_cmd(cmd: &mut Command, limit: Duration) -> Result<String, String> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: cannot run: {e}"))?;
    let out = child.stdout.take().expect("piped stdout");
    let err = child.stderr.take().expect("piped stderr");
    let reader = |mut r: Box<dyn Read + Send>| {
        std::thread::Builder::new()
            .name("ql-harness-cmd".into())
            .spawn(move || {
                let mut s = String::new();
                let _ = r.read_to_string(&mut s);
                s
            })
    };
    let out_t = reader(Box::new(out)).map_err(|e| format!("{what}: spawn reader: {e}"))?;
    let err_t = reader(Box::new(err)).map_err(|e| format!("{what}: spawn reader: {e}"))?;
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => return Err(format!("{what}: wait: {e}")),
        }
    };
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    match status {
        Some(st) if st.success() => Ok(stdout),
        Some(st) => Err(format!("{what} failed ({st}): {}", stderr.trim())),
        None => Err(format!("{what} did not finish within {limit:?}")),
    }
}

/// Benches run short when `QUORUMLOCK_BENCH_SMOKE` is set (CI runs every
/// bench that way, so none can rot): a count scaled down to a fiftieth (at
/// least `min`).
pub fn bench_count(full: usize, min: usize) -> usize {
    if bench_smoke() {
        (full / 50).max(min)
    } else {
        full
    }
}

/// Whether benches run short (see [`bench_count`]).
pub fn bench_smoke() -> bool {
    std::env::var_os("QUORUMLOCK_BENCH_SMOKE").is_some()
}

/// A request for every one of `set` (at least one), as one lock.
pub fn request_all<'a, S: AsRef<str>>(
    locks: &'a quorumlock::Redlock,
    set: &'a [S],
    ttl: Duration,
) -> quorumlock::LockRequest<'a> {
    let (first, rest) = set.split_first().expect("a set of at least one");
    rest.iter()
        .fold(locks.request(first.as_ref(), ttl), |r, k| r.and(k.as_ref()))
}
