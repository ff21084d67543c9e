//! The watcher: a small process that outlives `quorumlock run` only to stop
//! its command when `run` cannot do so itself (SIGKILL, the OOM killer, a
//! SIGSTOP), before the lock's validity ends. `quorumlock lead` starts one
//! for each term's command in the same way, with the leadership as the
//! lock: `run` below stands for either.
//!
//! `run` starts it (this same binary, `quorumlock __watch`) before the
//! command, in a process group of its own, and starts the command in that
//! group: the group's id is the watcher's pid, and stays the command's group
//! for as long as one of its members lives. `run` keeps the write end of a
//! pipe to the watcher's stdin and tells it, one line at a time, how long
//! the lock is still valid (`v <ms>`) and, with `--foreground`, the
//! command's pid (`pid <n>`); `done` says `run` finished on its own.
//!
//! The watcher stops the command (SIGTERM, then SIGKILL after the grace
//! period or shortly before the lock's validity ends, whichever comes
//! first) when the pipe closes without `done` (`run` died), or when the
//! validity it was last told is about to end without a word from `run`
//! (`run` is stopped or stuck: nothing renews the lock). A watcher that dies
//! is replaced by `run`, aimed at the same group.
//!
//! A parent-death signal (`PR_SET_PDEATHSIG`) would reach the command only,
//! not the children it started, and only on Linux; a pipe's end of file
//! reaches the watcher on every Unix, however `run` ended.

use std::io::{self, BufRead, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rustix::process::{kill_process, kill_process_group, Pid, Signal};

/// How long before the lock's validity ends the watcher sends SIGKILL at the
/// latest, at most: the command must be gone while the lock is still ours.
const MARGIN: Duration = Duration::from_millis(100);

/// The signals a terminal, `run` or the group's kill would send the
/// watcher: it ignores them all (it acts on its pipe and the clock only).
const IGNORED: [Signal; 7] = [
    Signal::TERM,
    Signal::INT,
    Signal::HUP,
    Signal::QUIT,
    Signal::TSTP,
    Signal::TTIN,
    Signal::TTOU,
];

/// `run`'s end of the watcher.
pub(crate) struct Watcher {
    child: Child,
    pipe: Option<ChildStdin>,
    grace: Duration,
    /// How often `run` beats (and the watcher's measure of silence).
    tick: Duration,
    /// The command's process group (the first watcher's pid).
    group: i32,
    /// With `--foreground`: the command's pid.
    command: Option<u32>,
    /// The last validity told (to write only when it moves).
    told: Option<Instant>,
    /// A watcher stopped the command because the lock was lapsing.
    lapsed: bool,
}

impl Watcher {
    /// Starts the watcher in a process group of its own, which the command
    /// is to join; `grace` is the time between SIGTERM and SIGKILL.
    pub(crate) fn start(grace: Duration, tick: Duration) -> io::Result<Watcher> {
        let (child, pipe) = spawn(grace, tick, None)?;
        let group = i32::try_from(child.id()).unwrap_or(0);
        Ok(Watcher {
            child,
            pipe,
            grace,
            tick,
            group,
            command: None,
            told: None,
            lapsed: false,
        })
    }

    /// The process group the command joins: the watcher's.
    pub(crate) fn group(&self) -> i32 {
        self.group
    }

    /// Tells the watcher the command's pid (with `--foreground`: it is then
    /// in `run`'s group, and the watcher stops it alone).
    pub(crate) fn command(&mut self, pid: u32) {
        self.command = Some(pid);
        self.say(&format!("pid {pid}"));
    }

    /// `run`'s tick: how often it beats.
    pub(crate) fn tick(&self) -> Duration {
        self.tick
    }

    /// Tells the watcher the lock is valid until `deadline`, if that moved.
    pub(crate) fn valid_until(&mut self, deadline: Instant) {
        if self.told == Some(deadline) {
            return;
        }
        self.told = Some(deadline);
        self.say(&Self::validity(deadline));
    }

    fn validity(deadline: Instant) -> String {
        let ms = deadline
            .saturating_duration_since(Instant::now())
            .as_millis();
        format!("v {ms}")
    }

    /// `run` ends on its own: the watcher exits without touching the group
    /// (it may be gone already: a lost lock's final SIGKILL to the group).
    pub(crate) fn done(mut self) {
        if let Some(mut pipe) = self.pipe.take() {
            let _ = writeln!(pipe, "done");
        }
        let _ = self.child.wait();
    }

    /// Whether the watcher stopped the command because the lock's validity
    /// was ending and `run` said nothing (it was stopped); a watcher that
    /// died otherwise is replaced.
    pub(crate) fn lapsed(&mut self) -> bool {
        if !self.lapsed && matches!(self.child.try_wait(), Ok(Some(_))) {
            self.replace();
        }
        self.lapsed
    }

    /// [`lapsed`](Self::lapsed), waiting up to `wait` for the watcher to
    /// exit (the command it killed may be seen dead first).
    pub(crate) fn lapsed_within(&mut self, wait: Duration) -> bool {
        let until = Instant::now() + wait;
        loop {
            if self.lapsed() {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Writes a line; if the watcher is gone, starts another, aimed at the
    /// same group (or command), and tells it everything again.
    fn say(&mut self, line: &str) {
        if self.lapsed {
            return;
        }
        let sent = self
            .pipe
            .as_mut()
            .is_some_and(|pipe| writeln!(pipe, "{line}").is_ok());
        if !sent {
            self.replace();
        }
    }

    /// Starts a watcher in place of one that is gone, aimed at the same
    /// group (or command), and tells it everything again.
    fn replace(&mut self) {
        if let Ok(status) = self.child.wait() {
            if status.code() == Some(i32::from(LAPSED)) {
                // It did its work: the command is gone.
                self.lapsed = true;
                self.pipe = None;
                return;
            }
        }
        match spawn(self.grace, self.tick, Some(self.group)) {
            Ok((child, pipe)) => {
                self.child = child;
                self.pipe = pipe;
                let mut lines = Vec::new();
                if let Some(pid) = self.command {
                    lines.push(format!("pid {pid}"));
                }
                if let Some(d) = self.told {
                    lines.push(Self::validity(d));
                }
                if let Some(pipe) = self.pipe.as_mut() {
                    for l in lines {
                        let _ = writeln!(pipe, "{l}");
                    }
                }
            }
            Err(e) => {
                eprintln!("quorumlock: the watcher process is gone and cannot be replaced ({e}); if quorumlock dies now, the command is not stopped");
                self.pipe = None;
            }
        }
    }
}

/// Starts a watcher: `quorumlock __watch GRACE_MS TICK_US [GROUP]`.
fn spawn(
    grace: Duration,
    tick: Duration,
    group: Option<i32>,
) -> io::Result<(Child, Option<ChildStdin>)> {
    use std::os::unix::process::CommandExt;
    // The running binary, even if its file was replaced since (Linux).
    let exe = if std::path::Path::new("/proc/self/exe").exists() {
        std::path::PathBuf::from("/proc/self/exe")
    } else {
        std::env::current_exe()?
    };
    let mut cmd = Command::new(exe);
    cmd.arg0("quorumlock")
        .arg("__watch")
        .arg(grace.as_millis().to_string())
        .arg(tick.as_micros().to_string());
    if let Some(g) = group {
        cmd.arg(g.to_string());
    }
    let mut child = cmd
        .process_group(0)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .env_remove("QUORUMLOCK_TOKEN")
        .spawn()?;
    let pipe = child.stdin.take();
    Ok((child, pipe))
}

/// What the watcher is told.
enum Told {
    Line(String),
    Closed,
}

/// The watcher's own `main`: `quorumlock __watch GRACE_MS TICK_US [GROUP]`,
/// stdin a pipe from `run`. Without `GROUP` it watches its own process group.
pub(crate) fn watch(grace_ms: &str, tick_us: &str, group: Option<&str>) -> u8 {
    // Signals meant for the command's group are not for us.
    let flag = Arc::new(AtomicBool::new(false));
    for sig in IGNORED {
        let _ = signal_hook::flag::register(sig.as_raw(), flag.clone());
    }
    let grace = Duration::from_millis(grace_ms.parse().unwrap_or(10_000));
    let tick =
        Duration::from_micros(tick_us.parse().unwrap_or(50_000)).max(Duration::from_millis(1));
    let parent = rustix::process::getppid();
    let me = rustix::process::getpid();
    let group = group
        .and_then(|g| g.parse::<i32>().ok())
        .and_then(Pid::from_raw)
        .unwrap_or(me);
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::Builder::new()
        .name("quorumlock-watch".into())
        .spawn(move || {
            for line in io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(Told::Line(line)).is_err() {
                    return;
                }
            }
            let _ = tx.send(Told::Closed);
        });
    if reader.is_err() {
        // Without the reader we cannot tell `run` is alive: act as if it died.
        return stop(Target::Group(group), me, grace, None);
    }
    // (deadline, the latest moment to act before it): from `v` lines.
    let mut deadline: Option<(Instant, Instant)> = None;
    let mut target = Target::Group(group);
    loop {
        // Look again shortly before the validity ends (and every tick after
        // that): a `run` that is stopped renews nothing.
        let told = match deadline {
            Some((_, at)) => {
                let now = Instant::now();
                let wait = if now < at { at - now } else { tick };
                match rx.recv_timeout(wait) {
                    Ok(t) => t,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        if Instant::now() >= at && parent.is_some_and(stopped) {
                            // The command must not outlive the lock.
                            stop(target, me, Duration::ZERO, deadline.map(|d| d.0));
                            return LAPSED;
                        }
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => Told::Closed,
                }
            }
            None => rx.recv().unwrap_or(Told::Closed),
        };
        match told {
            Told::Line(line) => {
                let line = line.trim();
                if line == "done" {
                    return 0;
                }
                if let Some(ms) = line.strip_prefix("v ").and_then(|v| v.parse::<u64>().ok()) {
                    let valid = Duration::from_millis(ms);
                    let now = Instant::now();
                    // Act at the latest a quarter of the validity (at most
                    // 100 ms) before it ends: time for SIGKILL to land.
                    let margin = (valid / 4).min(MARGIN);
                    deadline = Some((now + valid, now + valid.saturating_sub(margin)));
                } else if let Some(pid) = line
                    .strip_prefix("pid ")
                    .and_then(|p| p.parse::<i32>().ok())
                    .and_then(Pid::from_raw)
                {
                    target = Target::Process(pid);
                }
            }
            // `run` is gone without saying done.
            Told::Closed => return stop(target, me, grace, deadline.map(|d| d.0)),
        }
    }
}

/// The watcher's exit status when it stopped the command because the
/// lock's validity was ending without a word from `run` (`run` reports the
/// lock lost).
pub(crate) const LAPSED: u8 = 70;

/// What the watcher stops.
#[derive(Clone, Copy)]
enum Target {
    /// A process group: the command and its children.
    Group(Pid),
    /// The command alone (`--foreground`).
    Process(Pid),
}

/// SIGTERM (and SIGCONT, should it be stopped) to `target`, up to `grace`
/// (but no later than shortly before `deadline`) for it to be gone, then
/// SIGKILL.
fn stop(target: Target, me: Pid, grace: Duration, deadline: Option<Instant>) -> u8 {
    let now = Instant::now();
    let last = deadline.map_or(now + grace, |d| d.checked_sub(MARGIN).unwrap_or(now));
    let kill_at = (now + grace).min(last);
    let send = |sig: Signal| match target {
        Target::Process(pid) => {
            let _ = kill_process(pid, sig);
        }
        Target::Group(g) => {
            let _ = kill_process_group(g, sig);
        }
    };
    send(Signal::TERM);
    send(Signal::CONT);
    while Instant::now() < kill_at && left(target, me) {
        std::thread::sleep(Duration::from_millis(10));
    }
    send(Signal::KILL);
    0
}

/// Whether a process to stop is still there: the command, or a member of
/// the group other than this watcher.
fn left(target: Target, me: Pid) -> bool {
    match target {
        Target::Process(pid) => rustix::process::test_kill_process(pid).is_ok(),
        // Signal 0 to the group would reach us too (when it is ours): look
        // for another member, in /proc (elsewhere: wait it out).
        Target::Group(group) => others_in_group(group, me).unwrap_or(true),
    }
}

/// Whether a process of `group` other than `except` is left, zombies aside
/// (they run nothing: they wait for their parent); `None` where there is no
/// /proc to look in (not Linux), when it cannot be told.
///
/// Signal 0 to the group cannot tell: it reaches the watcher, a member
/// (and its leader) for as long as the command may run.
pub(crate) fn others_in_group(group: Pid, except: Pid) -> Option<bool> {
    let dir = std::fs::read_dir("/proc").ok()?;
    let (group, except) = (group.as_raw_nonzero().get(), except.as_raw_nonzero().get());
    Some(dir.flatten().any(|e| {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<i32>().ok()) else {
            return false;
        };
        pid != except
            && stat(pid).is_some_and(|(state, pgrp)| pgrp == group && !matches!(state, 'Z' | 'X'))
    }))
}

/// Whether `run` (our parent) is stopped (SIGSTOP, or a job-control stop):
/// its state in `/proc/<pid>/stat` is `T` or `t`. Where there is no /proc,
/// never (the watcher then acts only when `run` dies).
fn stopped(pid: Pid) -> bool {
    let stat =
        std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_nonzero())).unwrap_or_default();
    stat.rfind(')')
        .and_then(|i| stat.get(i + 1..))
        .and_then(|rest| rest.split_whitespace().next())
        .is_some_and(|state| state == "T" || state == "t")
}

/// A process's state and group, from `/proc/<pid>/stat` (fields 3 and 5,
/// after the command name in parentheses); `None` when it is gone.
fn stat(pid: i32) -> Option<(char, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = stat.get(stat.rfind(')')? + 1..)?.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let pgrp = fields.nth(1)?.parse().ok()?;
    Some((state, pgrp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_group_is_read_from_proc() {
        let me = i32::try_from(std::process::id()).unwrap_or(0);
        let own = rustix::process::getpgrp().as_raw_nonzero().get();
        assert_eq!(stat(me).map(|s| s.1), Some(own));
        assert_eq!(stat(i32::MAX), None);
        // Kernel threads and pid 1 (pgid 0 in a container) do not trip it.
        for pid in 1..64 {
            let _ = stat(pid);
        }
    }

    /// A child of the test, SIGKILLed and reaped on drop (a failed test too).
    struct Reaped(Child);

    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn the_members_of_a_group_are_found_zombies_aside() {
        use std::os::unix::process::CommandExt;
        let child = Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        let mut child = Reaped(child);
        let pid = Pid::from_child(&child.0);
        let other = rustix::process::getpid();
        assert_eq!(others_in_group(pid, other), Some(true));
        assert_eq!(others_in_group(pid, pid), Some(false), "except the leader");
        kill_process(pid, Signal::KILL).unwrap();
        // A zombie until reaped: it runs nothing.
        let gone = (0..500).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            others_in_group(pid, other) == Some(false)
        });
        assert!(gone, "a killed member (a zombie) still counted");
        assert!(matches!(child.0.try_wait(), Ok(Some(_))), "not a zombie");
    }
}
