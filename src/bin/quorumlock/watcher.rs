//! The watcher: a small process that outlives `quorumlock run` only to stop
//! its command when `run` dies without doing so itself (SIGKILL, the OOM
//! killer), before the lock's validity ends.
//!
//! `run` starts it (this same binary, `quorumlock __watch`) before the
//! command, in a process group of its own, and starts the command in that
//! group: the group's id is the watcher's pid, alive as long as the watcher
//! is. `run` keeps the write end of a pipe to the watcher's stdin and tells
//! it, one line at a time, how long the lock is still valid (`v <ms>`) and,
//! with `--foreground`, the command's pid (`pid <n>`); `done` says `run`
//! finished on its own. End of file without `done` means `run` died: the
//! watcher sends SIGTERM to the command's group (or, with `--foreground`, to
//! the command alone), and SIGKILL after the grace period or shortly before
//! the lock's validity ends, whichever comes first.
//!
//! A parent-death signal (`PR_SET_PDEATHSIG`) would reach the command only,
//! not the children it started, and only on Linux; a pipe's end of file
//! reaches the watcher on every Unix, however `run` ended.

use std::io::{self, BufRead, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::process::{kill_process, kill_process_group, Pid, Signal};

/// How long before the lock's validity ends the watcher sends SIGKILL at the
/// latest: the command must be gone while the lock is still ours.
const MARGIN: Duration = Duration::from_millis(100);

/// The signals a terminal, `run` or the group's kill would send the
/// watcher: it ignores them all (it acts on its pipe only).
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
    /// The last validity told (to write only when it moves).
    told: Option<Instant>,
}

impl Watcher {
    /// Starts the watcher in a process group of its own; `grace` is the
    /// time between SIGTERM and SIGKILL.
    pub(crate) fn start(grace: Duration) -> io::Result<Watcher> {
        use std::os::unix::process::CommandExt;
        // The running binary, even if its file was replaced since (Linux).
        let exe = if std::path::Path::new("/proc/self/exe").exists() {
            std::path::PathBuf::from("/proc/self/exe")
        } else {
            std::env::current_exe()?
        };
        let mut child = Command::new(exe)
            .arg("__watch")
            .arg(grace.as_millis().to_string())
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .env_remove("QUORUMLOCK_TOKEN")
            .spawn()?;
        let pipe = child.stdin.take();
        Ok(Watcher {
            child,
            pipe,
            told: None,
        })
    }

    /// The process group the command joins: the watcher's.
    pub(crate) fn group(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap_or(0)
    }

    /// Tells the watcher the command's pid (with `--foreground`: it is then
    /// in `run`'s group, and the watcher stops it alone).
    pub(crate) fn command(&mut self, pid: u32) {
        self.say(&format!("pid {pid}"));
    }

    /// Tells the watcher the lock is valid until `deadline`, if that moved.
    pub(crate) fn valid_until(&mut self, deadline: Instant) {
        if self.told == Some(deadline) {
            return;
        }
        self.told = Some(deadline);
        let ms = deadline
            .saturating_duration_since(Instant::now())
            .as_millis();
        self.say(&format!("v {ms}"));
    }

    /// `run` ends on its own: the watcher exits without touching the group
    /// (it may be gone already: a lost lock's final SIGKILL to the group).
    pub(crate) fn done(mut self) {
        if let Some(mut pipe) = self.pipe.take() {
            let _ = writeln!(pipe, "done");
        }
        let _ = self.child.wait();
    }

    fn say(&mut self, line: &str) {
        if let Some(pipe) = self.pipe.as_mut() {
            if writeln!(pipe, "{line}").is_err() {
                // The watcher is gone: nothing would stop the command if we
                // died now. Say so once.
                eprintln!("quorumlock: the watcher process is gone; if quorumlock dies now, the command is not stopped");
                self.pipe = None;
            }
        }
    }
}

/// The watcher's own `main`: `quorumlock __watch GRACE_MS`, stdin a pipe
/// from `run`.
pub(crate) fn watch(grace_ms: &str) -> u8 {
    // Signals meant for the command's group are not for us.
    let flag = Arc::new(AtomicBool::new(false));
    for sig in IGNORED {
        let _ = signal_hook::flag::register(sig.as_raw(), flag.clone());
    }
    let grace = Duration::from_millis(grace_ms.parse().unwrap_or(10_000));
    let mut deadline: Option<Instant> = None;
    let mut command: Option<Pid> = None;
    let stdin = io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let line = line.trim();
        if line == "done" {
            return 0;
        }
        if let Some(ms) = line.strip_prefix("v ").and_then(|v| v.parse::<u64>().ok()) {
            deadline = Some(Instant::now() + Duration::from_millis(ms));
        } else if let Some(pid) = line
            .strip_prefix("pid ")
            .and_then(|p| p.parse::<i32>().ok())
        {
            command = Pid::from_raw(pid);
        }
    }
    // `run` is gone without saying done: stop the command while the lock
    // still holds.
    let now = Instant::now();
    let last = deadline.map_or(now, |d| d.checked_sub(MARGIN).unwrap_or(now));
    let kill_at = (now + grace).min(last);
    let send = |sig: Signal| match command {
        Some(pid) => {
            let _ = kill_process(pid, sig);
        }
        None => {
            // Our own group: the command and its children (and us, for
            // SIGTERM ignored).
            let _ = kill_process_group(rustix::process::getpid(), sig);
        }
    };
    send(Signal::TERM);
    send(Signal::CONT);
    while Instant::now() < kill_at && others_left(command) {
        std::thread::sleep(Duration::from_millis(10));
    }
    send(Signal::KILL);
    0
}

/// Whether a process to stop is still there: the command, or another member
/// of our group (a zombie, reaped by its new parent later, still counts).
fn others_left(command: Option<Pid>) -> bool {
    match command {
        Some(pid) => rustix::process::test_kill_process(pid).is_ok(),
        None => {
            // Signal 0 to the group reaches us too: look for another member.
            let me = rustix::process::getpid();
            std::fs::read_dir("/proc").map_or(true, |dir| {
                dir.flatten().any(|e| {
                    let Some(pid) = e
                        .file_name()
                        .to_str()
                        .and_then(|n| n.parse::<i32>().ok())
                        .and_then(Pid::from_raw)
                    else {
                        return false;
                    };
                    pid != me && rustix::process::getpgid(Some(pid)).is_ok_and(|g| g == me)
                })
            })
        }
    }
}
