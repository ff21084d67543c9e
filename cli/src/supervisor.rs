//! The supervisor `run` and `lead` share: it starts the watcher and the command (in the
//! watcher's process group), forwards signals, follows the command, the lease it runs
//! under (a lock's guard or a leadership) and the watcher, and terminates the command
//! when the lease is lost. Nothing of the command's group outlives supervision: what
//! the command leaves behind in it when it exits is terminated too, before the lease
//! is released.

use std::ffi::OsString;
use std::io::{self, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use quorumlock::{Error, Leadership, LockGuard, LostSignal};
use rustix::process::{kill_process, kill_process_group, Pid, Signal};

use super::{seconds, Signals, EX_CANNOT_EXECUTE, EX_NOT_FOUND, EX_OSERR, SIGNAL_BASE, STOPS};
use crate::watcher::{others_in_group, Watcher};

/// How often the supervisor looks at the child and at received signals,
/// and tells the watcher it is alive: at most this, and a tenth of the TTL.
const TICK: Duration = Duration::from_millis(50);

/// How often the command's group is looked at while it is being ended.
const END_POLL: Duration = Duration::from_millis(20);

/// How long, at most, for the processes of the command's group to be gone
/// once sent SIGKILL (a process in an uninterruptible sleep finishes its
/// system call first) before the lease is released anyway.
const KILL_WAIT: Duration = Duration::from_secs(1);

/// The supervisor's tick for a lease of `ttl`: short enough that the watcher
/// tells a stopped supervisor from a running one well inside the validity.
fn watch_tick(ttl: Duration) -> Duration {
    (ttl / 10).clamp(Duration::from_millis(1), TICK)
}

/// Every variable `run` or `lead` sets in its command's environment: each
/// command's variables describe its own lock or election only, never an
/// enclosing one's (`quorumlock run` under `quorumlock lead`, or the reverse).
const EXPORTED: [&str; 8] = [
    "QUORUMLOCK_KEY",
    "QUORUMLOCK_KEYS",
    "QUORUMLOCK_TOKEN",
    "QUORUMLOCK_FENCING_TOKEN",
    "QUORUMLOCK_TTL_MS",
    "QUORUMLOCK_NAME",
    "QUORUMLOCK_ID",
    "QUORUMLOCK_TERM",
];

/// What the command runs under: `run`'s lock, `lead`'s leadership.
pub(crate) trait Lease {
    /// Until when it may be assumed held (at the latest).
    fn deadline(&self) -> Instant;
    /// Whether it may still be assumed held.
    fn is_held(&self) -> bool;
    /// Its loss, to wait on.
    fn lost(&self) -> LostSignal;
    /// What it is, for messages: `lock KEY`, `leadership of NAME`.
    fn what(&self) -> String;
}

impl Lease for LockGuard {
    fn deadline(&self) -> Instant {
        LockGuard::deadline(self)
    }
    fn is_held(&self) -> bool {
        LockGuard::is_held(self)
    }
    fn lost(&self) -> LostSignal {
        LockGuard::lost(self)
    }
    fn what(&self) -> String {
        format!("lock {}", self.resource())
    }
}

impl Lease for Leadership {
    fn deadline(&self) -> Instant {
        Leadership::deadline(self)
    }
    fn is_held(&self) -> bool {
        // Not `is_leader`: a stopped election ends the campaign, not the
        // lease, which the command keeps until it exits.
        !self.validity().is_zero()
    }
    fn lost(&self) -> LostSignal {
        Leadership::lost(self)
    }
    fn what(&self) -> String {
        format!("leadership of {}", self.name())
    }
}

/// How a supervised command runs.
pub(crate) struct Launch<'a> {
    /// The program and its arguments.
    pub(crate) command: &'a [OsString],
    /// SIGTERM to SIGKILL when the lease is lost.
    pub(crate) grace: Duration,
    /// The lease's TTL (the watcher's tick follows it).
    pub(crate) ttl: Duration,
    /// In quorumlock's process group rather than the watcher's.
    pub(crate) foreground: bool,
}

/// How supervision ended.
pub(crate) enum Outcome {
    /// The command exited by itself (or of a forwarded signal), or could not
    /// be started or waited for: quorumlock's exit code. Whatever it left in
    /// its group is gone. The lease is held unless it ran out meanwhile.
    Exited(u8),
    /// The lease was lost (or ran out while quorumlock was stopped) and the
    /// command was terminated.
    Lost,
}

impl Launch<'_> {
    /// Starts the watcher, then the command with `env` added to its
    /// environment, and supervises it under `lease` until it exits or the
    /// lease is lost.
    pub(crate) fn supervise(
        &self,
        lease: &dyn Lease,
        env: &[(&str, String)],
        signals: &Signals,
    ) -> Outcome {
        let Some((program, args)) = self.command.split_first() else {
            say!("no command to run");
            return Outcome::Exited(super::EX_USAGE);
        };
        // The watcher stops the command if we die without doing so (SIGKILL,
        // the OOM killer): without it, nothing could.
        let mut watcher = match Watcher::start(self.grace, watch_tick(self.ttl)) {
            Ok(w) => w,
            Err(e) => {
                say!("cannot start the watcher that stops the command if quorumlock dies: {e}");
                return Outcome::Exited(EX_OSERR);
            }
        };
        watcher.valid_until(lease.deadline());
        let mut cmd = Command::new(program);
        if !self.foreground {
            // A process group of its own, as under timeout(1) (the watcher's,
            // which lives as long as the command may): signals reach the
            // command's children too, and a terminal's Ctrl-C reaches it once,
            // through us.
            cmd.process_group(watcher.group());
        }
        cmd.args(args);
        for var in EXPORTED {
            cmd.env_remove(var);
        }
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                say!("cannot run {}: {e}", program.to_string_lossy());
                watcher.done();
                return Outcome::Exited(spawn_failure(&e));
            }
        };
        if self.foreground {
            watcher.command(child.id());
        }
        let mut job = Job {
            child,
            group: (!self.foreground)
                .then(|| Pid::from_raw(watcher.group()))
                .flatten(),
        };
        let outcome = match watch(&mut job, lease, signals, &mut watcher) {
            Ended::Exited(status) => {
                // Its children may still run in its group (started in the
                // background, or a daemon that did not leave the group): not
                // past the lease, which is released (resigned) next.
                let left = job.leftovers();
                if left != Some(false) {
                    if left == Some(true) {
                        say!("the command exited and left processes in its group; sending them SIGTERM");
                    }
                    terminate(&mut job, self.grace, signals, &mut watcher, Some(lease));
                }
                Outcome::Exited(status_code(status))
            }
            Ended::WaitFailed(e) => {
                // Not expected for our own child; stop it rather than run
                // unsupervised.
                say!("cannot wait for the command: {e}; killing it");
                job.signal(Signal::KILL);
                job.until_gone();
                Outcome::Exited(EX_OSERR)
            }
            Ended::Lost(why) => {
                say!("{} lost: {why}; terminating the command", lease.what());
                terminate(&mut job, self.grace, signals, &mut watcher, None);
                Outcome::Lost
            }
        };
        watcher.done();
        outcome
    }
}

fn spawn_failure(e: &io::Error) -> u8 {
    use rustix::io::Errno;
    if e.kind() == io::ErrorKind::NotFound {
        return EX_NOT_FOUND;
    }
    match Errno::from_io_error(e) {
        Some(Errno::ACCESS | Errno::PERM | Errno::NOEXEC | Errno::ISDIR | Errno::TXTBSY) => {
            EX_CANNOT_EXECUTE
        }
        _ => EX_OSERR,
    }
}

/// The command's exit status as ours: its code, or 128+N for signal N.
pub(crate) fn status_code(status: ExitStatus) -> u8 {
    if let Some(code) = status.code() {
        // 0..=255 on Unix.
        return u8::try_from(code & 0xff).unwrap_or(u8::MAX);
    }
    match status.signal() {
        Some(n) => u8::try_from(n)
            .ok()
            .and_then(|n| SIGNAL_BASE.checked_add(n))
            .unwrap_or(u8::MAX),
        None => EX_OSERR,
    }
}

/// The running command: its process, and the process group it runs in when
/// not in ours (then signals go to the whole group).
struct Job {
    child: Child,
    group: Option<Pid>,
}

impl Job {
    /// Sends `sig` to the command's group, or to the command alone while
    /// it runs. This process is the only one that reaps it (`try_wait`),
    /// so a pid seen running is not reused.
    fn signal(&mut self, sig: Signal) {
        if self.group.is_some() || matches!(self.child.try_wait(), Ok(None)) {
            self.signal_any(sig);
        }
    }

    /// Sends `sig` to the command's group (its id is the watcher's pid,
    /// not reused while the watcher lives), or to the command alone.
    fn signal_any(&self, sig: Signal) {
        let sent = match self.group {
            Some(group) => kill_process_group(group, sig),
            None => kill_process(Pid::from_child(&self.child), sig),
        };
        if let Err(e) = sent {
            if e != rustix::io::Errno::SRCH {
                say!("cannot send signal {} to the command: {e}", sig.as_raw());
            }
        }
    }

    /// Whether a process of the command's group other than the watcher is
    /// left: the command while it runs, and the children it may leave behind
    /// when it exits (`None`: cannot be told, there is no /proc). With
    /// `--foreground` none is found: the command's children are in our own
    /// group, not told apart from its other processes.
    fn leftovers(&self) -> Option<bool> {
        match self.group {
            // The group's leader is the (first) watcher.
            Some(group) => others_in_group(group, group),
            None => Some(false),
        }
    }

    /// Whether the command has exited (it is reaped, or cannot be waited
    /// for) and nothing is left of its group.
    fn is_gone(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None)) && self.leftovers() == Some(false)
    }

    /// After a SIGKILL to the group, waits up to [`KILL_WAIT`] for its
    /// processes to be gone (a dying process may finish a system call, a
    /// write, first), reaping the command.
    fn until_gone(&mut self) {
        let _ = self.child.wait();
        let start = Instant::now();
        while self.leftovers() == Some(true) {
            if start.elapsed() >= KILL_WAIT {
                say!(
                    "processes of the command's group are still there {} after SIGKILL",
                    seconds(KILL_WAIT)
                );
                return;
            }
            std::thread::sleep(END_POLL);
        }
    }
}

/// Why watching ended.
enum Ended {
    Exited(ExitStatus),
    Lost(Error),
    WaitFailed(io::Error),
}

/// Watches the command, the lease and received signals until the command
/// exits or the lease is lost.
fn watch(job: &mut Job, lease: &dyn Lease, signals: &Signals, watcher: &mut Watcher) -> Ended {
    let lost = lease.lost();
    let tick = watcher.tick();
    loop {
        // The watcher kills the command before this, should we die or stop.
        watcher.valid_until(lease.deadline());
        if watcher.lapsed() {
            // We were stopped past the lease's validity, and the watcher
            // stopped the command meanwhile.
            let _ = job.child.wait();
            return Ended::Lost(Error::Expired);
        }
        for sig in signals.take() {
            if STOPS.contains(&sig) {
                // Stop the command, then ourselves (renewals too: the lease
                // may lapse meanwhile, and the command must not run on).
                job.signal(sig);
                let _ = kill_process(rustix::process::getpid(), Signal::STOP);
                if let Some(why) = resumed(job, lease) {
                    return Ended::Lost(why);
                }
            } else if sig == Signal::CONT {
                if let Some(why) = resumed(job, lease) {
                    return Ended::Lost(why);
                }
            } else {
                job.signal(sig);
            }
        }
        match job.child.try_wait() {
            // Killed by a signal: the watcher's, if the lease was lapsing
            // while we were stopped (it exits just after).
            Ok(Some(status)) if status.signal().is_some() && watcher.lapsed_within(tick * 2) => {
                return Ended::Lost(Error::Expired)
            }
            Ok(Some(status)) => return Ended::Exited(status),
            Ok(None) => {}
            Err(e) => return Ended::WaitFailed(e),
        }
        // The lease is held until we return: the signal ends only with a
        // loss.
        if let Some(why) = lost.wait_timeout(tick) {
            return Ended::Lost(why);
        }
    }
}

/// After a stop: the command continues only while the lease is still held
/// (else the reason it is not; the command is then terminated).
fn resumed(job: &mut Job, lease: &dyn Lease) -> Option<Error> {
    if !lease.is_held() {
        return Some(Error::Expired);
    }
    job.signal(Signal::CONT);
    None
}

/// SIGTERM (and SIGCONT, should they be stopped) to the command's group
/// (to the command alone with `--foreground`), up to `grace` for the
/// command and whatever is left of its group to exit, then SIGKILL to what
/// is left; reaps the command. Terminating signals received meanwhile are
/// still forwarded.
///
/// `held`: the lease, when the command exited by itself and what it left
/// behind is being ended. The watcher is then told its validity, and if it
/// is lost meanwhile what is left gets SIGKILL at once: it must not run on
/// past the lease.
fn terminate(
    job: &mut Job,
    grace: Duration,
    signals: &Signals,
    watcher: &mut Watcher,
    held: Option<&dyn Lease>,
) {
    if watcher.lapsed() {
        // We were stopped past the lease's validity: the watcher ended the
        // group itself (and its id is no longer held by it).
        let _ = job.child.wait();
        return;
    }
    job.signal(Signal::TERM);
    job.signal(Signal::CONT);
    let lost = held.map(|lease| (lease, lease.lost()));
    let start = Instant::now();
    let gone = loop {
        if let Some(sig) = signals.take_forwarded() {
            job.signal(sig);
        }
        if watcher.lapsed() {
            break true;
        }
        if let Some((lease, lost)) = &lost {
            watcher.valid_until(lease.deadline());
            let why = lost
                .check()
                .or_else(|| (!lease.is_held()).then_some(Error::Expired));
            if let Some(why) = why {
                say!(
                    "{} lost: {why}; sending SIGKILL to what the command left in its group",
                    lease.what()
                );
                break false;
            }
        }
        if job.is_gone() {
            break true;
        }
        if start.elapsed() >= grace {
            if matches!(job.child.try_wait(), Ok(None)) {
                say!(
                    "the command did not exit within {} of SIGTERM; sending SIGKILL",
                    seconds(grace)
                );
            } else if job.leftovers() == Some(true) {
                say!(
                    "processes of the command's group did not exit within {} of SIGTERM; sending SIGKILL",
                    seconds(grace)
                );
            }
            break false;
        }
        std::thread::sleep(END_POLL);
    };
    if gone {
        let _ = job.child.wait();
    } else {
        // The watcher goes with them when the group is ours: its work is
        // done (and it is reaped once told so).
        job.signal(Signal::KILL);
        job.until_gone();
    }
}
