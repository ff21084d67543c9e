//! What a user reads: each message says what happened, and each exit code
//! is the one docs/command.md gives for it.

use crate::cli::{dead_nodes, finish, quorumlock, Scratch, EX_CONFIG, NODE_TIMEOUT};
use crate::common::faults::Blackhole;
use crate::common::{shared, unique_key};

/// `quorumlock SUB --nodes NODES --node-timeout … [extra]`: its exit code,
/// stdout and stderr.
fn command(
    dir: &Scratch,
    name: &str,
    sub: &str,
    nodes: &str,
    extra: &[&str],
) -> (i32, String, String) {
    let mut cmd = quorumlock(dir, name);
    cmd.args([sub, "--nodes", nodes, "--node-timeout", NODE_TIMEOUT])
        .args(extra);
    let (code, err) = finish(cmd, dir, name);
    let out = dir.read(&format!("{name}.stdout")).unwrap_or_default();
    (code, out, err)
}

/// A node down of three: `check` calls the set degraded, not safe, and
/// exits 1 (it exited 0 with "verdict: safe for Redlock").
#[test]
fn check_calls_a_set_with_a_node_down_degraded_and_exits_1() {
    let c = shared();
    let dir = Scratch::new("msg-degraded");
    let dead = dead_nodes();
    let one_dead = dead.split(',').next().unwrap_or_default();
    let nodes = format!("{},{},{one_dead}", c.url(0), c.url(1));
    let (code, out, err) = command(&dir, "check", "check", &nodes, &[]);
    assert_eq!(code, 1, "stdout:\n{out}\nstderr:\n{err}");
    let verdict = out.lines().last().unwrap_or_default();
    assert!(
        verdict.starts_with("verdict: degraded: 2 of 3 nodes usable, 2 needed"),
        "{out}"
    );
    assert!(!out.contains("safe for Redlock"), "{out}");
}

/// A password the nodes refuse is the configuration's fault: `run`,
/// `lead` (which campaigned on for ever), `status` and `check` exit 78 (not 69), name the refusal in the
/// server's words, and never show the password.
#[test]
fn a_refused_password_exits_78_and_says_so() {
    let c = shared();
    let dir = Scratch::new("msg-auth");
    let key = unique_key("msg-auth");
    let nodes: Vec<String> = c
        .urls()
        .iter()
        .map(|u| u.replace("redis://", "redis://nobody:pw-s3cret@"))
        .collect();
    let nodes = nodes.join(",");
    let cases: [(&str, &[&str]); 4] = [
        ("run", &["--fresh-cluster", &key, "--", "true"]),
        ("lead", &["--fresh-cluster", &key, "--", "true"]),
        ("status", &[&key]),
        ("check", &[]),
    ];
    for (sub, extra) in cases {
        let (code, out, err) = command(&dir, sub, sub, &nodes, extra);
        assert_eq!(code, EX_CONFIG, "{sub}: stdout:\n{out}\nstderr:\n{err}");
        let all = format!("{out}{err}");
        assert!(all.contains("refused the credentials"), "{sub}: {all}");
        assert!(all.contains("WRONGPASS"), "{sub}: {all}");
        assert!(!all.contains("pw-s3cret"), "{sub}: {all}");
        assert!(!all.contains("unreachable"), "{sub}: {all}");
    }
}

/// A node URL that does not parse is shown, so that one can tell which
/// entry is wrong; only a password is masked.
#[test]
fn a_malformed_node_url_is_shown_without_its_password() {
    let c = shared();
    let dir = Scratch::new("msg-url");
    let key = unique_key("msg-url");
    let port = c.url(1).rsplit(':').next().unwrap_or_default().to_owned();
    for (name, bad, shown, secret) in [
        (
            "no-scheme",
            format!("127.0.0.1:{port}"),
            format!("\"127.0.0.1:{port}\""),
            None,
        ),
        (
            "bad-port",
            "redis://locker:pw-s3cret@127.0.0.1:99999".to_owned(),
            "\"redis://locker:***@127.0.0.1:99999\"".to_owned(),
            Some("pw-s3cret"),
        ),
    ] {
        let nodes = format!("{},{bad},{}", c.url(0), c.url(2));
        let (code, _, err) = command(&dir, name, "status", &nodes, &[&key]);
        assert_eq!(code, EX_CONFIG, "{name}: {err}");
        assert!(err.contains(&shown), "{name}: {shown} not in {err}");
        if let Some(secret) = secret {
            assert!(!err.contains(secret), "{name}: {err}");
        }
    }
}

/// A hung node's line in `status` says it timed out once, and how long
/// was waited (it said "timed out (timed out)").
#[test]
fn status_says_once_that_a_hung_node_timed_out() {
    let c = shared();
    let dir = Scratch::new("msg-hung");
    let key = unique_key("msg-hung");
    let hole = Blackhole::start();
    let nodes = format!("{},{},{}", c.url(0), c.url(1), hole.url());
    let (code, out, err) = command(&dir, "status", "status", &nodes, &[&key]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let addr = hole.url().trim_start_matches("redis://").to_owned();
    let line = out
        .lines()
        .find(|l| l.starts_with(&addr))
        .unwrap_or_default();
    assert!(line.contains("timed out"), "{out}");
    assert!(line.matches("timed out").count() == 1, "{line}");
    assert!(line.contains(NODE_TIMEOUT), "{line}");
}

/// With no node answering, `status` does not call the key free (it said
/// "free on every node that answered" of none).
#[test]
fn status_with_no_node_answering_does_not_call_the_key_free() {
    let dir = Scratch::new("msg-none");
    let key = unique_key("msg-none");
    let (code, out, err) = command(&dir, "status", "status", &dead_nodes(), &[&key]);
    assert_eq!(code, 69, "stdout:\n{out}\nstderr:\n{err}");
    let verdict = out.lines().last().unwrap_or_default();
    assert_eq!(verdict, format!("{key}: no node answered"), "{out}");
}
