//! The rules of [`Redlock::check`](crate::Redlock::check): findings from what
//! the driver read of each node ([`Probe`]), a pure function of those
//! facts, so that every rule here is the one the rounds apply.

use std::time::Duration;

use crate::algorithm::round::ServerKind;
use crate::algorithm::server::ServerInfo;
use crate::check::{Check, Finding, NodeCheck, Verdict};
use crate::lock::transport::Probe;

/// Clocks further apart than this are worth a warning: fencing tokens
/// after a data loss assume clocks that agree within the longest TTL.
pub(super) const CLOCK_WARN: Duration = Duration::from_secs(1);

/// The findings for `probes` (one per node, named `names`), for a client
/// whose node timeout is `timeout` and whose rounds need `quorum` votes.
pub(crate) fn assess(
    names: &[String],
    probes: Vec<Probe>,
    timeout: Duration,
    quorum: usize,
    key: &str,
) -> Check {
    let nodes: Vec<NodeCheck> = names
        .iter()
        .zip(&probes)
        .map(|(name, p)| assess_node(name, p, timeout, key))
        .collect();
    let mut findings = Vec::new();
    // One server under two names.
    for (b, pb) in probes.iter().enumerate() {
        for (a, pa) in probes.iter().enumerate().take(b) {
            let run = |p: &Probe| {
                p.info
                    .as_ref()
                    .and_then(|i| i.as_ref().ok())
                    .and_then(|i| i.run_id.clone())
            };
            // As the rounds decide (see `ServerTag::same_server`): run ids
            // when both are known, else lock history ids.
            let (ra, rb) = (run(pa), run(pb));
            let same_run = ra.is_some() && ra == rb;
            let same_history =
                (ra.is_none() || rb.is_none()) && pa.history.is_some() && pa.history == pb.history;
            if same_run || same_history {
                findings.push(Finding::new(
                    Verdict::Unsafe,
                    "identity",
                    format!(
                        "{} and {} are one server ({}): Redlock needs independent servers; list it once",
                        names[a],
                        names[b],
                        if same_run { "the same run_id" } else { "the same lock history" }
                    ),
                ));
            }
        }
    }
    let n = names.len();
    let usable = nodes.iter().filter(|c| c.usable()).count();
    findings.push(usable_nodes(usable, n, quorum));
    if n == 1 {
        findings.push(Finding::new(
            Verdict::Warn,
            "nodes",
            "one node: no fault tolerance (use 3 or 5)",
        ));
    } else if n.is_multiple_of(2) {
        findings.push(Finding::new(
            Verdict::Warn,
            "nodes",
            format!(
                "{n} nodes tolerate {}, as {} {}: use an odd number",
                match (n - 1) / 2 {
                    0 => "no failure".to_owned(),
                    1 => "one failure".to_owned(),
                    f => format!("{f} failures"),
                },
                n - 1,
                if n == 2 { "does" } else { "do" }
            ),
        ));
    }
    let offsets: Vec<i64> = nodes.iter().filter_map(|c| c.clock_offset_us).collect();
    if let (Some(lo), Some(hi)) = (offsets.iter().min(), offsets.iter().max()) {
        let spread = Duration::from_micros(hi.saturating_sub(*lo).unsigned_abs());
        findings.push(Finding::new(
            if spread > CLOCK_WARN {
                Verdict::Warn
            } else {
                Verdict::Ok
            },
            "clock",
            format!(
                "node clocks {} apart (Redlock needs clocks that run at the same rate; fencing tokens after a data loss need them to agree within the longest TTL)",
                human(spread)
            ),
        ));
    }
    Check {
        nodes,
        findings,
        quorum,
    }
}

/// How many of the `n` nodes are usable against the `quorum` needed: ok
/// when all are, a warning when some are not (degraded: fewer failures
/// left to absorb), unsafe when too few are for any lock.
fn usable_nodes(usable: usize, n: usize, quorum: usize) -> Finding {
    if usable >= quorum {
        Finding::new(
            // Degraded: fewer failures left to absorb than configured.
            if usable < n {
                Verdict::Warn
            } else {
                Verdict::Ok
            },
            "nodes",
            format!("{usable} of {n} nodes usable; {quorum} needed for a lock"),
        )
    } else {
        Finding::new(
            Verdict::Unsafe,
            "nodes",
            format!("only {usable} of {n} nodes usable; {quorum} needed: no lock can be taken"),
        )
    }
}

/// The findings for one node, `name`, from its probe `p`, against the
/// client's node `timeout`, with the scripts tried on `key`.
pub(super) fn assess_node(name: &str, p: &Probe, timeout: Duration, key: &str) -> NodeCheck {
    let mut out = NodeCheck {
        node: name.to_owned(),
        findings: Vec::new(),
        round_trip: None,
        clock_offset_us: None,
    };
    let f = &mut out.findings;
    if let Some(why) = &p.auth {
        f.push(Finding::new(
            Verdict::Fail,
            "credentials",
            format!(
                "the node refused the credentials ({why}): fix the user name or password in the node URL"
            ),
        ));
        return out;
    }
    if let Some(why) = &p.connect {
        f.push(Finding::new(Verdict::Fail, "connect", why.clone()));
        return out;
    }
    f.extend(server(p));
    if let Some((median, finding)) = latency(&p.rtts, timeout) {
        out.round_trip = Some(median);
        f.push(finding);
    }
    if let Some((offset, rtt)) = p.clock {
        out.clock_offset_us = Some(offset);
        f.push(clock(offset, rtt));
    }
    if let Some(why) = &p.load {
        f.push(Finding::new(
            Verdict::Warn,
            "scripts",
            format!("SCRIPT LOAD refused ({why}): rounds send whole scripts (EVAL), larger"),
        ));
    }
    f.extend(scripts(p.scripts.as_ref(), key));
    f.extend(read_locks(p.read_scripts.as_ref(), key));
    out
}

/// What `INFO` says of the node: who it is, its role, cluster mode,
/// memory policy and persistence; or that `INFO` was refused or not
/// answered.
fn server(p: &Probe) -> Vec<Finding> {
    let mut f = Vec::new();
    match &p.info {
        Some(Ok(info)) => {
            let ids = format!(
                "run_id {}, lock history id {}",
                info.run_id.as_deref().unwrap_or("?"),
                history(p)
            );
            f.push(Finding::new(Verdict::Ok, "identity", ids));
            let product = info.product();
            f.push(match info.kind() {
                ServerKind::Replica => Finding::new(
                    Verdict::Unsafe,
                    "role",
                    format!("a replica (role:{}): it cannot keep locks of its own", info.role.as_deref().unwrap_or("?")),
                ),
                _ => Finding::new(Verdict::Ok, "role", format!("primary, {product}")),
            });
            if info.cluster == Some(true) {
                f.push(Finding::new(
                    Verdict::Unsafe,
                    "cluster",
                    "Redis Cluster mode: not an independent server (use standalone nodes)",
                ));
            }
            f.push(memory(info));
            f.push(persistence(p.persistence.as_ref(), info));
        }
        Some(Err(why)) => f.push(Finding::new(
            Verdict::Warn,
            "identity",
            format!(
                "INFO refused ({why}): role, cluster mode, memory policy and run_id unknown; grant +info (lock history id {})",
                history(p)
            ),
        )),
        None => f.push(Finding::new(Verdict::Warn, "identity", "INFO not answered")),
    }
    f
}

/// The node's lock history id; or that it has none yet (the first lock
/// client to connect writes it), or the server's refusal to tell.
fn history(p: &Probe) -> String {
    match (&p.history, &p.history_refused) {
        (Some(id), _) => id.clone(),
        (None, Some(why)) => format!("unreadable ({why})"),
        (None, None) => "none yet (the first lock client to connect writes one)".to_owned(),
    }
}

/// The median of the `PING` round trips `rtts` and its finding: a warning
/// where the slowest reached `timeout` or the median half of it. `None`
/// without a round trip.
fn latency(rtts: &[Duration], timeout: Duration) -> Option<(Duration, Finding)> {
    let mut rtts = rtts.to_vec();
    rtts.sort_unstable();
    let (Some(median), Some(max)) = (rtts.get(rtts.len() / 2), rtts.last()) else {
        return None;
    };
    let text = format!(
        "round trip {} (max {}) against a node timeout of {}",
        human(*median),
        human(*max),
        human(timeout)
    );
    let (verdict, advice) = if *max >= timeout {
        (Verdict::Warn, ": rounds will often miss it")
    } else if *median > timeout / 2 {
        (Verdict::Warn, ": raise the node timeout")
    } else {
        (Verdict::Ok, "")
    };
    let finding = Finding::new(verdict, "latency", format!("{text}{advice}"));
    Some((*median, finding))
}

/// The node's clock `offset` (µs) from this machine's, read with a round
/// trip of `rtt`: a warning beyond [`CLOCK_WARN`].
fn clock(offset: i64, rtt: Duration) -> Finding {
    let off = Duration::from_micros(offset.unsigned_abs());
    Finding::new(
        if off > CLOCK_WARN {
            Verdict::Warn
        } else {
            Verdict::Ok
        },
        "clock",
        format!(
            "{}{} from this machine's clock (± {})",
            if offset < 0 { "-" } else { "+" },
            human(off),
            human(rtt / 2)
        ),
    )
}

/// Whether the lock's scripts ran on `key` (`Ok(held by someone)`) or
/// failed: a node they fail on cannot vote. `None` where not tried.
fn scripts(tried: Option<&Result<bool, String>>, key: &str) -> Option<Finding> {
    let (verdict, text) = match tried? {
        Ok(other) => (
            Verdict::Ok,
            format!(
                "the lock's scripts run on {key:?}{}",
                if *other { " (held by someone now)" } else { "" }
            ),
        ),
        Err(why) => (
            Verdict::Fail,
            format!(
                "the lock's scripts fail on {key:?}: {why} ({})",
                if why.contains("scripting engine") {
                    "the server has no Lua: use a build with it"
                } else {
                    "see the minimal ACL in the crate's docs, \"TLS and ACL users\""
                }
            ),
        ),
    };
    Some(Finding::new(verdict, "scripts", text))
}

/// Whether the read locks' scripts ran on `key` (`Ok(a writer held it)`)
/// or failed, a warning only: read locks are optional. `None` where not
/// tried.
fn read_locks(tried: Option<&Result<bool, String>>, key: &str) -> Option<Finding> {
    let (verdict, text) = match tried? {
        Ok(true) => (Verdict::Ok, format!("not tried: a writer holds {key:?} now")),
        Ok(false) => (Verdict::Ok, format!("the read locks' scripts run on {key:?}")),
        // Read locks are optional: a client without them locks as before.
        Err(why) => (
            Verdict::Warn,
            format!(
                "the read locks' scripts fail on {key:?}: {why} (read locks need the sorted-set commands the crate's docs list)"
            ),
        ),
    };
    Some(Finding::new(verdict, "read locks", text))
}

pub(super) fn memory(info: &ServerInfo) -> Finding {
    let policy = info.policy.as_deref().unwrap_or("?");
    match (info.evicting(), info.maxmemory) {
        (Some(_), Some(max)) => Finding::new(
            Verdict::Unsafe,
            "memory",
            format!(
                "maxmemory {} with maxmemory-policy {policy}: under memory pressure it evicts lock keys, and a second client takes a held lock; it does not vote (unless the client is built with allow_evicting_nodes(true)); set maxmemory-policy noeviction (or maxmemory 0)",
                bytes(max)
            ),
        ),
        (_, Some(0)) | (_, None) => Finding::new(Verdict::Ok, "memory", "no maxmemory: nothing is evicted"),
        (_, Some(max)) => Finding::new(
            Verdict::Ok,
            "memory",
            format!(
                "maxmemory {} with {policy}: nothing is evicted; when full, writes (and locks) fail, safely",
                bytes(max)
            ),
        ),
    }
}

pub(super) fn persistence(
    p: Option<&Result<(String, String, String), String>>,
    info: &ServerInfo,
) -> Finding {
    let held = "the restart rule holds it back for the longest TTL in use after a restart";
    match p {
        Some(Ok((save, aof, fsync))) => {
            let text = match (save.trim().is_empty(), aof.as_str(), fsync.as_str()) {
                (_, "yes", "always") => "AOF with fsync always: a restart keeps every lock (its uptime still holds it back once)".to_owned(),
                (_, "yes", f) => format!("AOF with fsync {f}: a crash may lose the latest locks; {held} (its uptime)"),
                (true, _, _) => format!("no persistence: a restart loses every lock and its lock history; {held}"),
                (false, _, _) => format!("RDB snapshots (save {}): a restart reloads a snapshot that may lack the latest locks; {held} (its uptime)", save.trim()),
            };
            Finding::new(Verdict::Ok, "persistence", text)
        }
        Some(Err(why)) => Finding::new(
            Verdict::Ok,
            "persistence",
            format!(
                "CONFIG refused ({why}); aof_enabled:{}: {held}, as long as INFO is allowed",
                match info.aof {
                    Some(true) => "1",
                    Some(false) => "0",
                    None => "?",
                }
            ),
        ),
        None => Finding::new(Verdict::Ok, "persistence", "not answered"),
    }
}

pub(super) fn human(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        format!("{:.1}s", d.as_secs_f64())
    } else if d >= Duration::from_millis(1) {
        format!("{:.1}ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{}µs", d.as_micros())
    }
}

pub(super) fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1}gb", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1}mb", b as f64 / (1u64 << 20) as f64),
        b => format!("{b}b"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(run: &str, extra: &str) -> ServerInfo {
        ServerInfo::parse(&format!(
            "redis_version:7.0.15\nrun_id:{run}\nrole:master\ncluster_enabled:0\nmaxmemory:0\nmaxmemory_policy:noeviction\naof_enabled:0\n{extra}"
        ))
    }

    fn probe(run: &str, extra: &str) -> Probe {
        Probe {
            info: Some(Ok(info(run, extra))),
            history: Some(format!("h-{run}")),
            rtts: vec![Duration::from_micros(200); 5],
            clock: Some((1_000, Duration::from_micros(200))),
            persistence: Some(Ok((String::new(), "no".into(), "everysec".into()))),
            scripts: Some(Ok(false)),
            read_scripts: Some(Ok(false)),
            ..Probe::default()
        }
    }

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("n{i}:6379")).collect()
    }

    const T: Duration = Duration::from_millis(50);

    #[test]
    fn a_healthy_set_is_safe() {
        let c = assess(
            &names(3),
            vec![probe("a", ""), probe("b", ""), probe("c", "")],
            T,
            2,
            "k",
        );
        assert!(c.is_safe(), "{c}");
        assert!(c.nodes().iter().all(|n| n.verdict() == Verdict::Ok), "{c}");
    }

    #[test]
    fn one_server_twice_a_replica_or_an_evicting_node_is_unsafe() {
        let twice = assess(
            &names(3),
            vec![probe("a", ""), probe("a", ""), probe("c", "")],
            T,
            2,
            "k",
        );
        assert!(!twice.is_safe(), "{twice}");
        assert!(twice
            .findings()
            .iter()
            .any(|f| f.topic() == "identity" && f.verdict() == Verdict::Unsafe));
        for extra in [
            "role:slave",
            "cluster_enabled:1",
            "maxmemory:1048576\nmaxmemory_policy:volatile-lru",
        ] {
            // Later lines override the defaults above.
            let c = assess(
                &names(3),
                vec![probe("a", extra), probe("b", ""), probe("c", "")],
                T,
                2,
                "k",
            );
            assert!(!c.is_safe(), "{extra}: {c}");
            assert_eq!(c.nodes()[0].verdict(), Verdict::Unsafe, "{extra}");
        }
    }

    /// An evicting policy is an unsafe memory finding that says what to set,
    /// whatever else the node is (a replica with one used to be told
    /// "nothing is evicted"), Redis 8.6's `-lrm` policies included.
    #[test]
    fn an_evicting_policy_is_unsafe_and_says_what_to_set() {
        for (extra, policy) in [
            (
                "maxmemory:104857600\nmaxmemory_policy:allkeys-lru",
                "allkeys-lru",
            ),
            (
                "maxmemory:104857600\nmaxmemory_policy:volatile-lrm",
                "volatile-lrm",
            ),
            (
                "maxmemory:104857600\nmaxmemory_policy:allkeys-lrm\nrole:slave",
                "allkeys-lrm",
            ),
        ] {
            let f = memory(&info("a", extra));
            assert_eq!(f.verdict(), Verdict::Unsafe, "{extra}: {f}");
            for words in [policy, "maxmemory-policy noeviction", "does not vote"] {
                assert!(f.text().contains(words), "{words:?} not in {f}");
            }
        }
        for extra in ["", "maxmemory:104857600", "maxmemory_policy:allkeys-lru"] {
            let f = memory(&info("a", extra));
            assert_eq!(f.verdict(), Verdict::Ok, "{extra}: {f}");
        }
    }

    #[test]
    fn unreachable_and_refused_nodes_count_against_the_quorum() {
        let down = Probe {
            connect: Some("unreachable: connection refused".into()),
            ..Probe::default()
        };
        let acl = Probe {
            scripts: Some(Err("NOPERM".into())),
            ..probe("b", "")
        };
        let c = assess(
            &names(3),
            vec![down.clone(), acl, probe("c", "")],
            T,
            2,
            "k",
        );
        assert!(!c.is_safe(), "{c}");
        let c = assess(
            &names(3),
            vec![down, probe("b", ""), probe("c", "")],
            T,
            2,
            "k",
        );
        assert!(c.is_safe(), "one node down of three: {c}");
        assert_eq!(c.reachable(), 2);
    }

    /// A server without Lua is told apart from an ACL: the fix differs.
    #[test]
    fn a_server_without_lua_is_told_to_get_lua_not_an_acl() {
        let text = |why: &str| {
            let node = Probe {
                scripts: Some(Err(why.into())),
                ..probe("a", "")
            };
            assess(&names(1), vec![node], T, 1, "k").to_string()
        };
        let no_lua = text("ERR Could not find scripting engine 'lua'");
        assert!(
            no_lua.contains("has no Lua") && !no_lua.contains("ACL"),
            "{no_lua}"
        );
        let acl = text("NOPERM this user has no permissions to run the 'eval' command");
        assert!(acl.contains("minimal ACL"), "{acl}");
    }

    /// One node down of three: still safe, but degraded, and called so: one
    /// more failure and no lock can be taken.
    #[test]
    fn a_node_down_leaves_the_set_degraded() {
        let down = Probe {
            connect: Some("unreachable: connection refused".into()),
            ..Probe::default()
        };
        let c = assess(
            &names(3),
            vec![down, probe("b", ""), probe("c", "")],
            T,
            2,
            "k",
        );
        assert!(c.is_safe() && c.is_degraded(), "{c}");
        let shown = c.to_string();
        let verdict = shown.lines().last().unwrap_or_default();
        assert!(
            verdict.starts_with("verdict: degraded: 2 of 3 nodes usable"),
            "{shown}"
        );
        assert!(c
            .findings()
            .iter()
            .any(|f| f.topic() == "nodes" && f.verdict() == Verdict::Warn));
        let healthy = assess(
            &names(3),
            vec![probe("a", ""), probe("b", ""), probe("c", "")],
            T,
            2,
            "k",
        );
        assert!(!healthy.is_degraded(), "{healthy}");
        assert!(
            healthy.to_string().ends_with("verdict: safe for Redlock"),
            "{healthy}"
        );
    }

    /// A node that refuses the credentials was reached: it is named as a
    /// configuration error, in the server's words, not as unreachable.
    #[test]
    fn refused_credentials_are_named_as_such() {
        let refused = Probe {
            auth: Some("WRONGPASS invalid username-password pair".into()),
            ..Probe::default()
        };
        let c = assess(
            &names(3),
            vec![refused, probe("b", ""), probe("c", "")],
            T,
            2,
            "k",
        );
        let f = &c.nodes()[0].findings()[0];
        assert_eq!(
            (f.verdict(), f.topic()),
            (Verdict::Fail, "credentials"),
            "{c}"
        );
        assert!(
            f.text().contains("WRONGPASS") && !f.text().contains("unreachable"),
            "{f}"
        );
        assert!(c.is_degraded(), "{c}");
    }

    /// A node no lock client has connected to has no lock history yet: the
    /// identity says so (it said "none (not allowed?)"), and says what the
    /// server answered where it refused to tell.
    #[test]
    fn a_missing_lock_history_says_why() {
        let new = Probe {
            history: None,
            ..probe("a", "")
        };
        let refused = Probe {
            history: None,
            history_refused: Some("NOPERM no permissions".into()),
            ..probe("b", "")
        };
        let c = assess(&names(2), vec![new, refused], T, 2, "k");
        let identity = |i: usize| {
            c.nodes()[i]
                .findings()
                .iter()
                .find(|f| f.topic() == "identity")
                .map(|f| f.text().to_owned())
                .unwrap_or_default()
        };
        assert!(identity(0).contains("lock history id none yet"), "{c}");
        assert!(
            identity(1).contains("unreadable (NOPERM no permissions)"),
            "{c}"
        );
    }

    /// An even number of nodes is warned of in plain words (it said "2
    /// nodes tolerate 0 failure(s), as 1 do").
    #[test]
    fn an_even_node_count_is_warned_of_in_plain_words() {
        for (n, words) in [
            (2, "2 nodes tolerate no failure, as 1 does"),
            (4, "4 nodes tolerate one failure, as 3 do"),
            (6, "6 nodes tolerate 2 failures, as 5 do"),
        ] {
            let probes = (0..n).map(|i| probe(&format!("r{i}"), "")).collect();
            let c = assess(&names(n), probes, T, n / 2 + 1, "k");
            assert!(
                c.findings().iter().any(|f| f.text().starts_with(words)),
                "{words}: {c}"
            );
        }
    }

    /// Read locks are optional: an ACL without their commands is warned of, never unsafe.
    #[test]
    fn read_locks_refused_by_the_acl_are_a_warning() {
        let refused = Probe {
            read_scripts: Some(Err("can't run this command".into())),
            ..probe("a", "")
        };
        let c = assess(
            &names(3),
            vec![refused, probe("b", ""), probe("c", "")],
            T,
            2,
            "k",
        );
        assert!(c.is_safe(), "{c}");
        assert_eq!(c.nodes()[0].verdict(), Verdict::Warn, "{c}");
        assert!(c.nodes()[0]
            .findings()
            .iter()
            .any(|f| f.topic() == "read locks" && f.text().contains("sorted-set")));
    }

    #[test]
    fn slow_nodes_and_far_clocks_are_warned_of() {
        let slow = Probe {
            rtts: vec![Duration::from_millis(60); 5],
            clock: Some((5_000_000, Duration::from_millis(60))),
            ..probe("a", "")
        };
        let c = assess(
            &names(3),
            vec![slow, probe("b", ""), probe("c", "")],
            T,
            2,
            "k",
        );
        assert!(c.is_safe(), "{c}");
        let warned: Vec<&str> = c.nodes()[0]
            .findings()
            .iter()
            .filter(|f| f.verdict() == Verdict::Warn)
            .map(|f| f.topic())
            .collect();
        assert_eq!(warned, ["latency", "clock"], "{c}");
        assert!(c
            .findings()
            .iter()
            .any(|f| f.topic() == "clock" && f.verdict() == Verdict::Warn));
    }
}
