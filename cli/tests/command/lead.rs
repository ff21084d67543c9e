//! `quorumlock lead NAME -- CMD` (issue 42, item 3): the command runs while this process
//! leads the election NAME, with the term in QUORUMLOCK_TERM; it is stopped when the
//! leadership is lost, and started again when re-elected; a command that ends by itself
//! ends the lead (resigned, its status passed through). `status NAME` names the leader.

use std::process::Command;
use std::time::{Duration, Instant};

use rustix::process::{kill_process, Pid, Signal};

use crate::cli::{
    alive, assert_gone, dead_nodes, finish, held, leftover, lines, quorumlock, supervisor_cmd,
    until_started, Leftovers, Proc, Scratch, EX_CONFIG, EX_USAGE, NODE_TIMEOUT, SOON,
};
use crate::common::{shared, unique_key, wait_until, Cluster};

/// `quorumlock lead --nodes … [extra] NAME -- sh -c SCRIPT`.
fn lead_cmd(
    c: &Cluster,
    dir: &Scratch,
    name: &str,
    key: &str,
    extra: &[&str],
    script: &str,
) -> Command {
    supervisor_cmd("lead", c, dir, (name, key), extra, script)
}

/// `lead NAME` as `me` (`--id me`, then `extra`) with `script`, started.
fn spawn_lead(
    c: &Cluster,
    dir: &Scratch,
    (key, me): (&str, &str),
    extra: &[&str],
    script: &str,
) -> Proc {
    let mut args = vec!["--id", me];
    args.extend_from_slice(extra);
    Proc::spawn(lead_cmd(c, dir, me, key, &args, script), dir, me)
}

/// [`spawn_lead`], once its command has touched `$D/<me>`: the leader.
fn leader(
    c: &Cluster,
    dir: &Scratch,
    (key, me): (&str, &str),
    extra: &[&str],
    script: &str,
) -> Proc {
    let mut p = spawn_lead(c, dir, (key, me), extra, script);
    until_started(c, dir, &mut p, me, key);
    p
}

/// [`spawn_lead`] of [`turn`] while another leads: it waits (half a second here) and
/// does not run its command.
fn standby(c: &Cluster, dir: &Scratch, (key, me): (&str, &str), extra: &[&str]) -> Proc {
    let mut p = spawn_lead(c, dir, (key, me), extra, &turn(me));
    std::thread::sleep(Duration::from_millis(500));
    assert!(p.running(), "{me} ended; stderr:\n{}", p.stderr());
    assert!(
        !dir.path(me).exists(),
        "{me} ran its command while another led"
    );
    p
}

/// A lead's command for `me`: records its start (`<ns> <me> <term>`, a line of
/// `$D/starts`) and its pid (`$D/<me>.pid`), touches `$D/<me>`, waits for `$D/<me>.go`,
/// records its end (`$D/<me>.end`, ns) and exits 0.
fn turn(me: &str) -> String {
    format!(
        r#"{}
        echo $$ > "$D/{me}.pid"
        touch "$D/{me}"
        while [ ! -e "$D/{me}.go" ]; do sleep 0.05; done
        date +%s%N > "$D/{me}.end""#,
        record_start(me)
    )
}

/// The line of a command of `me` that records its start for [`starts`].
fn record_start(me: &str) -> String {
    format!(r#"echo "$(date +%s%N) {me} $QUORUMLOCK_TERM" >> "$D/starts""#)
}

/// Waits until `me`'s command has started `n` times, its lead still running.
fn until_starts(dir: &Scratch, p: &mut Proc, me: &str, n: usize) {
    let ok = wait_until(SOON, || !p.running() || starts(dir, me).len() >= n);
    assert!(
        ok && p.running(),
        "{me}'s command did not start {n} times; stderr:\n{}",
        p.stderr()
    );
}

/// The starts `me`'s commands recorded in `$D/starts`: `(ns, term)`, in order.
fn starts(dir: &Scratch, me: &str) -> Vec<(u128, u64)> {
    dir.read("starts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [ns, who, term] if who == me => Some((ns.parse().ok()?, term.parse().ok()?)),
            _ => None,
        })
        .collect()
}

/// The term of `me`'s only (or last) command.
fn term_of(dir: &Scratch, me: &str) -> u64 {
    let all = starts(dir, me);
    all.last()
        .unwrap_or_else(|| panic!("{me} never started its command: {all:?}"))
        .1
}

/// The lead's command sees the election (QUORUMLOCK_NAME, _ID, _TERM, _TTL_MS) and
/// none of an enclosing run's variables; the term is the one a majority of the nodes
/// record with the leader's token. A command that exits by itself ends the lead with its status, and
/// the leadership is resigned (gone at once, not after its TTL).
#[test]
fn lead_runs_its_command_with_the_term_and_exits_with_its_status() {
    let c = shared();
    let dir = Scratch::new("lead-env");
    let key = unique_key("lead-env");
    let script = r#"printf '%s\n' "$QUORUMLOCK_NAME" "$QUORUMLOCK_ID" "$QUORUMLOCK_TERM" \
            "$QUORUMLOCK_TTL_MS" "${QUORUMLOCK_TOKEN-unset}" "${QUORUMLOCK_KEY-unset}" \
            > "$D/env.tmp"
        mv "$D/env.tmp" "$D/env"
        while [ ! -e "$D/go" ]; do sleep 0.05; done
        exit 7"#;
    let mut cmd = lead_cmd(
        &c,
        &dir,
        "lead",
        &key,
        &["--id", "worker-7", "--ttl", "20s"],
        script,
    );
    // As under an enclosing `quorumlock run`.
    cmd.env("QUORUMLOCK_TOKEN", "stale")
        .env("QUORUMLOCK_KEY", "stale");
    let mut p = Proc::spawn(cmd, &dir, "lead");
    until_started(&c, &dir, &mut p, "env", &key);
    let env = dir.read("env").unwrap_or_default();
    let lines: Vec<&str> = env.lines().collect();
    assert_eq!(lines.len(), 6, "{env:?}");
    assert_eq!(lines[0], key);
    assert_eq!(lines[1], "worker-7");
    let term: u64 = lines[2].parse().expect("QUORUMLOCK_TERM is a number");
    assert!(term > 0, "term {term}");
    // The term the nodes record with the leader's token (`TERM TOKEN`).
    let token = (0..c.len())
        .find_map(|i| c.get(i, &key))
        .expect("the leader's token");
    let recorded: Vec<Option<String>> = (0..c.len())
        .map(|i| {
            redis::cmd("HGET")
                .arg("quorumlock:meta")
                .arg(format!("term:{key}"))
                .query(&mut c.conn(i))
                .expect("HGET the term")
        })
        .collect();
    let with_token = format!("{term} {token}");
    assert!(
        recorded
            .iter()
            .flatten()
            .filter(|r| **r == with_token)
            .count()
            > c.len() / 2,
        "the command's term is not the one a majority records with {token}: {recorded:?}"
    );
    assert_eq!(lines[3], "20000");
    assert_eq!(lines[4], "unset", "an enclosing run's token passed on");
    assert_eq!(lines[5], "unset", "an enclosing run's key passed on");

    dir.touch("go");
    assert_eq!(p.exit_code(SOON), 7, "stderr:\n{}", p.stderr());
    // Resigned: not left to expire after 20 s.
    assert_gone(&c, &key, Duration::from_secs(1));
}

/// `status NAME` adds the leader to its verdict: its id (by default host:pid of the
/// `lead` process) and term, as the leader's command sees them; none once it resigned.
#[test]
fn status_shows_the_leader_and_its_term() {
    let c = shared();
    let dir = Scratch::new("lead-status");
    let key = unique_key("lead-status");
    let script = r#"echo "$QUORUMLOCK_ID $QUORUMLOCK_TERM" > "$D/who.tmp"; mv "$D/who.tmp" "$D/who"
        while [ ! -e "$D/go" ]; do sleep 0.05; done"#;
    let mut p = Proc::spawn(lead_cmd(&c, &dir, "lead", &key, &[], script), &dir, "lead");
    until_started(&c, &dir, &mut p, "who", &key);
    let who = dir.read("who").unwrap_or_default();
    let (id, term) = who.split_once(' ').expect("id and term");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    assert_eq!(
        id,
        format!("{}:{}", host.trim(), p.pid().as_raw_nonzero()),
        "the default id"
    );
    let status = |name: &str| -> String {
        let mut cmd = quorumlock(&dir, name);
        cmd.arg("status")
            .arg("--nodes")
            .arg(c.urls().join(","))
            .args(["--node-timeout", NODE_TIMEOUT])
            .arg(&key);
        let (code, err) = finish(cmd, &dir, name);
        let out = std::fs::read_to_string(dir.path(&format!("{name}.stdout"))).unwrap_or_default();
        assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
        out
    };
    let out = status("s1");
    let verdict = out.lines().last().unwrap_or_default();
    assert!(
        verdict.starts_with(&format!("{key}: held on "))
            && verdict.ends_with(&format!(" nodes; led by {id} in term {term}")),
        "{out}"
    );
    assert_eq!(out.lines().count(), c.len() + 1, "{out}");

    dir.touch("go");
    assert_eq!(p.exit_code(SOON), 0, "stderr:\n{}", p.stderr());
    assert_gone(&c, &key, Duration::from_secs(1));
    let out = status("s2");
    assert!(!out.contains("led by"), "{out}");
}

/// Two `lead` of one name: one runs its command at a time, and the other's starts once the
/// first ends by itself (its lead resigns: the next is woken at once, well within the 30 s
/// TTL), in a higher term. A leader's command killed by SIGKILL ends its lead in the same
/// way (exit 137) and hands over at once. A candidate that gets SIGTERM while it waits
/// exits 143 and never runs its command; a leader that gets it forwards it to its command
/// and exits with the command's status.
#[test]
fn two_leads_take_turns_and_a_command_that_dies_hands_over_at_once() {
    let c = shared();
    let dir = Scratch::new("lead-turns");
    let key = unique_key("lead-turns");
    let ttl = ["--ttl", "30s"];
    let mut a = leader(&c, &dir, (&key, "a"), &ttl, &turn("a"));
    let mut b = standby(&c, &dir, (&key, "b"), &ttl);

    dir.touch("a.go");
    assert_eq!(a.exit_code(SOON), 0, "a stderr:\n{}", a.stderr());
    let ended = Instant::now();
    until_started(&c, &dir, &mut b, "b", &key);
    let took = ended.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "b led {took:?} after a resigned (its TTL is 30 s)"
    );
    let a_end: u128 = dir
        .read("a.end")
        .and_then(|e| e.parse().ok())
        .expect("a's end");
    let (b_start, b_term) = starts(&dir, "b")[0];
    assert!(b_start >= a_end, "b's command started before a's ended");
    assert!(b_term > term_of(&dir, "a"), "{:?}", dir.read("starts"));

    // The leader's command killed: b exits with its status and resigns.
    let mut third = standby(&c, &dir, (&key, "third"), &ttl);
    let pid: i32 = dir
        .read("b.pid")
        .and_then(|p| p.parse().ok())
        .expect("b's pid");
    kill_process(Pid::from_raw(pid).expect("pid"), Signal::KILL).expect("SIGKILL b's command");
    assert_eq!(b.exit_code(SOON), 128 + 9, "b stderr:\n{}", b.stderr());
    let ended = Instant::now();
    until_started(&c, &dir, &mut third, "third", &key);
    let took = ended.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "third led {took:?} after b's command died (the TTL is 30 s)"
    );
    assert!(term_of(&dir, "third") > b_term);

    // SIGTERM to a candidate: it stops campaigning.
    let mut fourth = standby(&c, &dir, (&key, "fourth"), &ttl);
    kill_process(fourth.pid(), Signal::TERM).expect("signal the fourth");
    assert_eq!(fourth.exit_code(SOON), 128 + 15, "{}", fourth.stderr());
    assert!(!dir.path("fourth").exists(), "the fourth ran its command");

    // SIGTERM to the leader: forwarded; the command's status.
    kill_process(third.pid(), Signal::TERM).expect("signal the third");
    assert_eq!(third.exit_code(SOON), 128 + 15, "{}", third.stderr());
    assert_gone(&c, &key, Duration::from_secs(1));
}

/// A SIGKILLed `lead` takes its command and the command's children with it (its watcher
/// stops their process group, as `run`'s does), and its leadership, which nobody resigned,
/// lapses with its TTL: the next candidate leads within the TTL and a retry pause.
#[test]
fn a_sigkilled_lead_takes_its_command_with_it_and_the_next_leads_within_the_ttl() {
    let c = shared();
    let dir = Scratch::new("lead-kill9");
    let key = unique_key("lead-kill9");
    let script = record_start("a")
        + r#"
        (while :; do echo c >> "$D/child.ticks"; sleep 0.02; done) &
        echo $! > "$D/child"
        echo $$ > "$D/a.pid"
        touch "$D/a"
        while :; do echo p >> "$D/parent.ticks"; sleep 0.02; done"#;
    let ttl = Duration::from_secs(2);
    let mut a = leader(
        &c,
        &dir,
        (&key, "a"),
        &["--ttl", "2s", "--grace", "300ms"],
        &script,
    );
    let mut leftovers = Leftovers::default();
    let (child, command) = (leftovers.add(&dir, "child"), leftovers.add(&dir, "a.pid"));
    let mut b = standby(&c, &dir, (&key, "b"), &["--ttl", "2s"]);

    let killed = Instant::now();
    kill_process(a.pid(), Signal::KILL).expect("SIGKILL lead");
    let _ = a.wait(SOON);
    let lines = |f: &str| dir.read(f).map_or(0, |t| t.lines().count());
    assert!(
        wait_until(Duration::from_secs(3), || !alive(&child)
            && !alive(&command)),
        "a's command or its child outlived the lead"
    );
    let stopped = killed.elapsed();
    assert!(
        stopped < Duration::from_millis(1500),
        "stopped {stopped:?} after the SIGKILL"
    );
    let ticks = (lines("parent.ticks"), lines("child.ticks"));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        (lines("parent.ticks"), lines("child.ticks")),
        ticks,
        "a's command went on writing"
    );

    until_started(&c, &dir, &mut b, "b", &key);
    let took = killed.elapsed();
    assert!(
        took < ttl + Duration::from_secs(5),
        "b led {took:?} after a was killed (TTL {ttl:?})"
    );
    assert!(term_of(&dir, "b") > term_of(&dir, "a"));
    dir.touch("b.go");
    assert_eq!(b.exit_code(SOON), 0, "b stderr:\n{}", b.stderr());
    assert_gone(&c, &key, Duration::from_secs(1));
}

/// A leader's command that exits by itself leaving a background child in its group: `lead`
/// stops the child before it resigns, and exits with the command's status; the next
/// leader's command never runs beside it. The child used to run on after the resignation.
#[test]
fn a_lead_stops_what_its_command_left_behind_before_resigning() {
    let c = shared();
    let dir = Scratch::new("lead-leftovers");
    let key = unique_key("lead-leftovers");
    let mut leftovers = Leftovers::default();
    let args = ["--ttl", "30s", "--grace", "20s"];
    let script = format!("{}\n{}", leftover("child", false), turn("a"));
    let mut a = leader(&c, &dir, (&key, "a"), &args, &script);
    let child = leftovers.add(&dir, "child.pid");
    let mut b = standby(&c, &dir, (&key, "b"), &args);

    dir.touch("a.go");
    assert_eq!(a.exit_code(SOON), 0, "a stderr:\n{}", a.stderr());
    assert!(
        !alive(&child),
        "a's command's child {child} outlived its lead; stderr:\n{}",
        a.stderr()
    );
    until_started(&c, &dir, &mut b, "b", &key);
    let ticks = lines(&dir, "child.ticks");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        lines(&dir, "child.ticks"),
        ticks,
        "a's leftover ran on beside b's command"
    );
    dir.touch("b.go");
    assert_eq!(b.exit_code(SOON), 0, "b stderr:\n{}", b.stderr());
    assert_gone(&c, &key, Duration::from_secs(1));
}

/// The election's key deleted on every node: the renewal finds it gone, the command gets
/// SIGTERM, and `lead` goes on: it campaigns again, leads in a higher term and starts the
/// command again.
#[test]
fn a_lead_whose_leadership_is_deleted_stops_its_command_and_leads_again() {
    let c = shared();
    let dir = Scratch::new("lead-deleted");
    let key = unique_key("lead-deleted");
    let script = record_start("a")
        + r#"
        trap 'echo term >> "$D/term"; kill $! 2>/dev/null; exit 143' TERM
        touch "$D/a"
        sleep 60 &
        wait"#;
    let mut p = leader(
        &c,
        &dir,
        (&key, "a"),
        &["--ttl", "2s", "--grace", "5s"],
        &script,
    );
    for i in 0..c.len() {
        c.del(i, &key);
    }
    until_starts(&dir, &mut p, "a", 2);
    let terms: Vec<u64> = starts(&dir, "a").iter().map(|s| s.1).collect();
    assert!(terms[1] > terms[0], "terms {terms:?}");
    assert_eq!(
        dir.read("term").as_deref(),
        Some("term"),
        "the first command did not get SIGTERM"
    );
    let err = p.stderr();
    assert!(
        err.contains(&format!("quorumlock: leadership of {key} lost: ")),
        "{err}"
    );
    assert!(held(&c, &key), "not leading again");

    kill_process(p.pid(), Signal::TERM).expect("signal lead");
    assert_eq!(p.exit_code(SOON), 143, "stderr:\n{}", p.stderr());
    assert_gone(&c, &key, Duration::from_secs(1));
}

/// A `lead` stopped (SIGSTOP) past its TTL renews nothing: its watcher stops the command
/// before the leadership lapses, and the other candidate leads. Resumed, the stopped one
/// does not start its command while the other leads; it campaigns, and leads again (a
/// higher term) once the other ends.
#[test]
fn a_lead_paused_past_its_ttl_loses_its_command_and_campaigns_again() {
    let c = shared();
    let dir = Scratch::new("lead-paused");
    let key = unique_key("lead-paused");
    let ticker = record_start("a")
        + r#"
        echo $$ > "$D/a.pid"
        touch "$D/a"
        while :; do echo x >> "$D/a.ticks"; sleep 0.02; done"#;
    let mut a = leader(
        &c,
        &dir,
        (&key, "a"),
        &["--ttl", "1s", "--grace", "2s"],
        &ticker,
    );
    let mut b = standby(&c, &dir, (&key, "b"), &["--ttl", "1s"]);
    let mut leftovers = Leftovers::default();
    let command = leftovers.add(&dir, "a.pid");

    kill_process(a.pid(), Signal::STOP).expect("SIGSTOP lead");
    let took_over = wait_until(SOON, || dir.path("b").exists());
    // Before b's command started: a's was gone (and b took over).
    let overlap = alive(&command);
    kill_process(a.pid(), Signal::CONT).expect("SIGCONT lead");
    assert!(took_over, "b never led; b stderr:\n{}", b.stderr());
    assert!(!overlap, "a's command ran on beside b's");

    std::thread::sleep(Duration::from_secs(1));
    assert!(a.running(), "a ended; stderr:\n{}", a.stderr());
    assert_eq!(
        starts(&dir, "a").len(),
        1,
        "a started its command while b led"
    );
    assert!(a.stderr().contains("lost"), "{}", a.stderr());

    kill_process(b.pid(), Signal::TERM).expect("signal b");
    assert_eq!(b.exit_code(SOON), 143, "b stderr:\n{}", b.stderr());
    until_starts(&dir, &mut a, "a", 2);
    assert!(term_of(&dir, "a") > term_of(&dir, "b"));
    kill_process(a.pid(), Signal::TERM).expect("signal a");
    assert_eq!(a.exit_code(SOON), 143, "a stderr:\n{}", a.stderr());
    assert_gone(&c, &key, Duration::from_secs(1));
}

/// `lead` campaigns on through node failures, and says so: a node of its list where nothing
/// listens is named on stderr, and the other two elect it.
#[test]
fn lead_names_the_nodes_that_do_not_answer() {
    let c = shared();
    let dir = Scratch::new("lead-dead-node");
    let key = unique_key("lead-dead-node");
    let dead = dead_nodes();
    let dead = dead.split(',').next().unwrap_or_default();
    let mut cmd = quorumlock(&dir, "a");
    cmd.arg("lead")
        .arg("--nodes")
        .arg(format!("{},{},{dead}", c.url(0), c.url(1)))
        .args(["--node-timeout", NODE_TIMEOUT, "--fresh-cluster", &key])
        .args(["--", "sh", "-c", &turn("a")]);
    let mut p = Proc::spawn(cmd, &dir, "a");
    until_started(&c, &dir, &mut p, "a", &key);
    let named = format!("quorumlock: node {} ", dead.trim_start_matches("redis://"));
    assert!(
        wait_until(SOON, || p.stderr().contains(&named)),
        "{named:?} not in the stderr:\n{}",
        p.stderr()
    );
    dir.touch("a.go");
    assert_eq!(p.exit_code(SOON), 0, "stderr:\n{}", p.stderr());
    assert_gone(&c, &key, Duration::from_secs(1));
}

/// Bad input has `run`'s exit codes, and nothing runs: no command or `--ttl 0` is a usage
/// error (64); an id the library refuses or no nodes is a configuration error (78).
/// `lead --help` documents the environment and the exit codes.
#[test]
fn lead_refuses_bad_input_with_runs_exit_codes() {
    let c = shared();
    let dir = Scratch::new("lead-bad");
    let key = unique_key("lead-bad");
    let ok = r#"touch "$D/ran""#;
    for (name, extra, code) in [
        ("ttl0", &["--ttl", "0"][..], EX_USAGE),
        ("empty-id", &["--id", ""][..], EX_CONFIG),
    ] {
        let (got, err) = finish(lead_cmd(&c, &dir, name, &key, extra, ok), &dir, name);
        assert_eq!(got, code, "{name} stderr:\n{err}");
    }
    let mut cmd = quorumlock(&dir, "no-cmd");
    cmd.args(["lead", "--nodes", &c.urls().join(","), &key]);
    let (code, err) = finish(cmd, &dir, "no-cmd");
    assert_eq!(code, EX_USAGE, "stderr:\n{err}");
    let mut cmd = quorumlock(&dir, "no-nodes");
    cmd.args(["lead", &key, "--", "sh", "-c", ok]);
    let (code, err) = finish(cmd, &dir, "no-nodes");
    assert_eq!(code, EX_CONFIG, "stderr:\n{err}");
    assert!(!dir.path("ran").exists(), "a command ran");
    assert!(!held(&c, &key));

    let mut cmd = quorumlock(&dir, "help");
    cmd.args(["lead", "--help"]);
    let (code, _) = finish(cmd, &dir, "help");
    assert_eq!(code, 0);
    let help = std::fs::read_to_string(dir.path("help.stdout")).unwrap_or_default();
    for needle in ["QUORUMLOCK_TERM", "--id", "Exit codes of `quorumlock lead`"] {
        assert!(help.contains(needle), "{needle} missing from:\n{help}");
    }
}
