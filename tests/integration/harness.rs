//! Self-tests of the node harness in `tests/common`.

use std::collections::HashSet;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{self, Backend, Cluster};

fn ping(c: &Cluster, i: usize) -> String {
    redis::cmd("PING")
        .query(&mut c.conn(i))
        .unwrap_or_else(|e| panic!("PING node {i} ({}): {e}", c.url(i)))
}

fn addr(c: &Cluster, i: usize) -> SocketAddr {
    c.url(i)
        .strip_prefix("redis://")
        .expect("redis:// URL")
        .parse()
        .expect("host:port")
}

fn started(n: usize) -> Cluster {
    let t = Instant::now();
    let c = Cluster::start(n);
    eprintln!(
        "harness timing: {n}-node {:?} cluster started in {:?}",
        c.backend(),
        t.elapsed()
    );
    c
}

#[test]
fn three_nodes_answer_ping_with_distinct_urls() {
    let c = started(3);
    assert_eq!(c.len(), 3);
    assert_eq!(c.urls().len(), 3);
    for i in 0..3 {
        assert_eq!(ping(&c, i), "PONG");
        assert_eq!(c.urls()[i], c.url(i));
        assert!(
            c.url(i).starts_with("redis://127.0.0.1:"),
            "unexpected URL {}",
            c.url(i)
        );
    }
    let distinct: HashSet<String> = c.urls().into_iter().collect();
    assert_eq!(distinct.len(), 3, "URLs not distinct: {:?}", c.urls());
}

#[test]
fn backend_follows_env() {
    let c = Cluster::start(1);
    match std::env::var("QUORUMLOCK_TEST_BACKEND").as_deref() {
        Ok("docker") => assert_eq!(c.backend(), Backend::Docker),
        Ok("process") => assert_eq!(c.backend(), Backend::Process),
        _ => {}
    }
    eprintln!("harness backend: {:?}", c.backend());
}

#[test]
fn pause_hangs_node_and_unpause_recovers() {
    let c = started(2);
    c.pause(1);
    let t = Instant::now();
    // Connecting still works (TCP is accepted), but nothing is answered.
    let mut conn = c
        .try_conn(1, Duration::from_millis(100))
        .expect("TCP connect to a paused node should succeed");
    let r: redis::RedisResult<String> = redis::cmd("PING").query(&mut conn);
    let elapsed = t.elapsed();
    match r {
        Err(e) => assert!(e.is_timeout(), "expected a timeout, got {e}"),
        Ok(v) => panic!("paused node answered PING with {v:?}"),
    }
    assert!(
        elapsed < Duration::from_millis(900),
        "timing out took {elapsed:?}"
    );
    // The other node is unaffected.
    assert_eq!(ping(&c, 0), "PONG");
    c.unpause(1);
    assert_eq!(ping(&c, 1), "PONG");
}

#[test]
fn stop_refuses_fast_and_restart_comes_back_empty_on_same_url() {
    let c = started(2);
    let key = common::unique_key("restart");
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("v")
        .query(&mut c.conn(1))
        .expect("SET");
    assert_eq!(c.get(1, &key).as_deref(), Some("v"));
    let url = c.url(1);

    let t = Instant::now();
    c.stop(1);
    eprintln!("harness timing: stop took {:?}", t.elapsed());
    let t = Instant::now();
    let r = TcpStream::connect_timeout(&addr(&c, 1), Duration::from_secs(2));
    let elapsed = t.elapsed();
    match r {
        Err(e) => assert_eq!(
            e.kind(),
            std::io::ErrorKind::ConnectionRefused,
            "expected connection refused, got {e}"
        ),
        Ok(_) => panic!("a stopped node accepted a TCP connection"),
    }
    assert!(
        elapsed < Duration::from_millis(200),
        "refusal took {elapsed:?}"
    );
    assert!(c.try_conn(1, Duration::from_secs(1)).is_err());
    assert_eq!(ping(&c, 0), "PONG");
    if c.backend() == Backend::Process {
        assert_no_zombie_redis();
    }

    let t = Instant::now();
    c.restart(1);
    eprintln!("harness timing: restart took {:?}", t.elapsed());
    assert_eq!(c.url(1), url, "restart changed the URL");
    assert_eq!(ping(&c, 1), "PONG");
    assert_eq!(c.get(1, &key), None, "data survived the restart");
}

/// No `redis-server` (or `valkey-server`) child of this process is left as a zombie.
fn assert_no_zombie_redis() {
    let me = std::process::id().to_string();
    let mut zombies = Vec::new();
    for _ in 0..5 {
        zombies.clear();
        for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            let Some(close) = stat.rfind(')') else {
                continue;
            };
            let comm = &stat[stat.find('(').unwrap_or(0)..=close];
            let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
            if (comm.contains("redis") || comm.contains("valkey"))
                && rest.first() == Some(&"Z")
                && rest.get(1) == Some(&me.as_str())
            {
                zombies.push(stat.clone());
            }
        }
        if zombies.is_empty() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("zombie server children: {zombies:?}");
}

#[test]
fn drop_cleans_up_a_paused_node_even_when_the_test_panics() {
    let c = Cluster::start(1);
    let a = addr(&c, 0);
    let r = std::thread::spawn(move || {
        c.pause(0);
        panic!("deliberate panic with a paused node (expected in this test)");
    })
    .join();
    assert!(r.is_err(), "the thread should have panicked");
    // Once Drop has run, nothing listens on the node's port any more.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match TcpStream::connect_timeout(&a, Duration::from_millis(500)) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "port {a} still reachable after Drop: {other:?}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

#[test]
fn shared_returns_the_same_cluster_while_one_arc_is_alive() {
    let a = common::shared();
    let b = common::shared();
    assert!(Arc::ptr_eq(&a, &b));
    assert_eq!(a.len(), 3);
    assert_eq!(ping(&a, 2), "PONG");
}

#[test]
fn key_helpers_and_unique_keys() {
    let c = common::shared();
    let k1 = common::unique_key("helpers");
    let k2 = common::unique_key("helpers");
    assert_ne!(k1, k2);
    assert!(k1.starts_with("test:helpers:"), "{k1}");
    assert_eq!(c.get(0, &k1), None);
    assert_eq!(c.pttl(0, &k1), -2);
    let _: () = redis::cmd("SET")
        .arg(&k1)
        .arg("value")
        .arg("PX")
        .arg(10_000)
        .query(&mut c.conn(0))
        .expect("SET PX");
    assert_eq!(c.get(0, &k1).as_deref(), Some("value"));
    assert_eq!(c.get(1, &k1), None, "nodes are independent");
    let pttl = c.pttl(0, &k1);
    assert!((1..=10_000).contains(&pttl), "PTTL {pttl}");
    c.del(0, &k1);
    assert_eq!(c.get(0, &k1), None);
}

/// Valkey is a server the process backend runs: its `--version` (under either name) and
/// its processes (for the orphan sweep) are recognised, as Redis's are.
#[test]
fn valkey_is_recognised_as_a_server() {
    assert_eq!(
        common::server_version(
            "Valkey server v=9.1.2 sha=00000000:1 malloc=libc bits=64 build=1536df31c0395150\n"
        ),
        Some(("Valkey", "9.1.2"))
    );
    assert_eq!(
        common::server_version("Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc-5.3.0"),
        Some(("Redis", "7.0.15"))
    );
    assert_eq!(common::server_version("KeyDB server v=6.3.4"), None);
    assert_eq!(common::server_version("redis-cli 7.0.15"), None);
    let bin = std::path::Path::new("/opt/servers/valkey-server");
    let redis = std::path::Path::new("/usr/bin/redis-server");
    // The process title a server sets: its argv[0] and address.
    for cmdline in [
        "/tmp/vk/valkey-server 127.0.0.1:16996",
        "valkey-server 127.0.0.1:16996",
        "/usr/bin/redis-server 127.0.0.1:16996",
    ] {
        assert!(common::is_server_cmdline(cmdline, redis), "{cmdline}");
    }
    assert!(common::is_server_cmdline(
        "/opt/x/my-kv 127.0.0.1:1",
        std::path::Path::new("/opt/x/my-kv")
    ));
    assert!(!common::is_server_cmdline("/usr/bin/sleep 16996", bin));
}

/// A node that does not start says why in the server's own words (Redis's warnings, a
/// Valkey config error block), not only its exit status; the start-up chatter is left out.
#[test]
fn a_failed_start_shows_the_servers_last_words() {
    let redis = "\
15079:C 07 Dec 2026 08:07:00.741 # oO0OoO0OoO0Oo Redis is starting oO0OoO0OoO0Oo
15079:C 07 Dec 2026 08:07:00.741 * Redis version=7.0.15, just started
15079:M 07 Dec 2026 08:07:00.741 * monotonic clock: POSIX clock_gettime
15079:M 07 Dec 2026 08:07:00.741 # Failed to configure TLS. Check logs for more info.
";
    let shown = common::log_excerpt_of(redis);
    assert!(shown.contains("Failed to configure TLS"), "{shown}");
    assert!(!shown.contains("monotonic clock"), "{shown}");
    let valkey = "
*** FATAL CONFIG FILE ERROR (Version 9.1.2) ***
Reading the configuration file, at line 4
>>> 'bogus-opt \"1\"'
Bad directive or wrong number of arguments
";
    let shown = common::log_excerpt_of(valkey);
    assert!(shown.contains("'bogus-opt \"1\"'"), "{shown}");
    assert!(shown.contains("Bad directive"), "{shown}");
    // Nothing but chatter: its last lines.
    let shown = common::log_excerpt_of("1:M 07 Dec 2026 08:07:00.741 * Ready\n");
    assert!(shown.contains("Ready"), "{shown}");
    assert!(common::log_excerpt_of("\n\n").contains("empty"));
}
