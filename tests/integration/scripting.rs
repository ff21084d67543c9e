//! Nodes that refuse the lock's scripts, for good: an ACL without `EVAL`
//! and `EVALSHA` (hardened setups), a server without Lua (Valkey can be built
//! so). The lock needs them; the caller gets one error that says so and what
//! to change, not a `NoQuorum` of script errors after waiting.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quorumlock::{AttemptEvent, Error, EventHandler, NodeErrorKind, Redlock};

use crate::common::{unique_key, Cluster};

/// `ACL SETUSER default <rules>` on node `i`.
fn acl(c: &Cluster, i: usize, rules: &[&str]) {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER").arg("default");
    for r in rules {
        cmd.arg(*r);
    }
    let () = cmd.query(&mut c.conn(i)).expect("ACL SETUSER");
}

/// Counts acquire attempts.
#[derive(Default)]
struct Attempts(AtomicUsize);

impl EventHandler for Attempts {
    fn on_attempt(&self, _: &AttemptEvent<'_>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn client(c: &Cluster) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .build()
        .expect("valid config")
}

#[test]
fn nodes_that_refuse_eval_give_one_clear_error_at_the_first_lock() {
    let c = Cluster::start(3);
    for i in 0..3 {
        acl(&c, i, &["-@scripting"]);
    }
    let attempts = Arc::new(Attempts::default());
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .events(attempts.clone())
        .build()
        .expect("valid config");
    let key = unique_key("no-eval");
    let t0 = Instant::now();
    let e = locks
        .request(&key, Duration::from_secs(5))
        .acquire_for(Duration::from_secs(10))
        .expect_err("no node runs the scripts");
    // Not waited out: no retry can succeed.
    assert_eq!(attempts.0.load(Ordering::SeqCst), 1, "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(!e.is_retryable(), "{e:?}");
    match &e {
        Error::ScriptsRefused { failures, .. } => {
            // Two refusals settle it; the third answer is not waited for.
            let refused: Vec<_> = failures
                .iter()
                .filter(|f| f.kind() == NodeErrorKind::ScriptsRefused)
                .collect();
            assert!(refused.len() >= 2, "{e:?}");
            for f in refused {
                assert!(
                    f.detail().starts_with("NOPERM"),
                    "the server's words: {f:?}"
                );
            }
        }
        e => panic!("expected ScriptsRefused, got {e:?}"),
    }
    let text = e.to_string();
    for words in ["refused", "script", "+eval +evalsha", "minimal ACL", "Lua"] {
        assert!(text.contains(words), "{words:?} missing from {text:?}");
    }
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(1)),
        "a key was left"
    );
}

#[test]
fn one_node_that_refuses_eval_of_three_fails_only_its_own_vote() {
    let c = Cluster::start(3);
    acl(&c, 2, &["-@scripting"]);
    let locks = client(&c);
    let key = unique_key("one-no-eval");
    let g = locks
        .lock(&key, Duration::from_secs(5))
        .expect("two nodes of three run the scripts");
    let other = client(&c).try_lock(&key, Duration::from_secs(5));
    assert!(
        matches!(other, Err(Error::Taken { nodes: 3, .. })),
        "held by the first: {other:?}"
    );
    g.release().expect("released on the two nodes");
}

#[test]
fn a_lock_whose_nodes_stop_running_scripts_gets_the_clear_error_at_release() {
    let c = Cluster::start(3);
    let locks = client(&c);
    let key = unique_key("eval-revoked");
    let g = locks
        .lock(&key, Duration::from_secs(5))
        .expect("scripts allowed yet");
    for i in 0..3 {
        acl(&c, i, &["-@scripting"]);
    }
    match g.release() {
        Err(Error::ScriptsRefused { .. }) => {}
        r => panic!("expected ScriptsRefused, got {r:?}"),
    }
}

/// `check` names the server as it names itself: Valkey by `server_name` and
/// `valkey_version` (it reports `redis_version:7.2.4` whatever its own),
/// Redis by `redis_version`. Run on each server CI tests (`.ci/run`).
#[test]
fn check_names_the_server_and_its_version() {
    let c = Cluster::start(1);
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query(&mut c.conn(0))
        .expect("INFO");
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_owned())
    };
    let want = match field("server_name").as_deref() {
        Some("valkey") => format!(
            "Valkey {}",
            field("valkey_version").expect("valkey_version")
        ),
        _ => format!("Redis {}", field("redis_version").expect("redis_version")),
    };
    let report = client(&c)
        .check(&unique_key("check-names"))
        .expect("checked")
        .to_string();
    assert!(
        report.contains(&format!("primary, {want}\n")),
        "{want:?} not in {report}"
    );
    if want.starts_with("Valkey") {
        assert!(!report.contains("Redis 7.2.4"), "{report}");
    }
}
