//! `quorumlock`: `flock(1)` for a cluster. Runs a command under a Redlock
//! lock held on N Redis nodes, so that a job started on several hosts runs
//! on one of them at a time (`quorumlock run`), or while its host leads an
//! election (`quorumlock lead`), and shows a lock's key on every node and
//! who leads (`quorumlock status`).
//!
//! The `quorumlock-cli` package: `cargo install quorumlock-cli` (or, from a
//! checkout, `cargo install --path cli`).
//! See `quorumlock --help` and docs/command.md in the repository for the exit codes
//! and the behaviour on a lost lock or a signal.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::io::{self, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use quorumlock::{Builder, Error, LockGuard, Redlock};
use rustix::process::Signal;

mod watcher;

// ---------------------------------------------------------------------------
// Exit codes (sysexits.h where one fits; shell conventions for the command)
// ---------------------------------------------------------------------------

/// Longest wait for the pools' first connections before taking the lock.
const CONNECT_WAIT: Duration = Duration::from_secs(1);

/// Bad arguments: unknown option, bad duration, missing command.
const EX_USAGE: u8 = 64;
/// No quorum: too many nodes unavailable (down, timing out, too slow).
const EX_UNAVAILABLE: u8 = 69;
/// The lock was lost while the command ran; the command was terminated.
const EX_SOFTWARE: u8 = 70;
/// Spawning the command or waiting for it failed for another OS reason;
/// or signal handlers could not be installed.
const EX_OSERR: u8 = 71;
/// Busy: another owner holds the lock (after `--wait`, if given).
const EX_TEMPFAIL: u8 = 75;
/// Bad configuration: no nodes, a bad node URL, input the library refuses,
/// credentials the nodes refuse.
const EX_CONFIG: u8 = 78;
/// The command was found but cannot be executed (as shells and `timeout(1)`).
const EX_CANNOT_EXECUTE: u8 = 126;
/// The command was not found (as shells and `timeout(1)`).
const EX_NOT_FOUND: u8 = 127;
/// Added to a signal's number when the command (or quorumlock, while it
/// waits for the lock) is ended by that signal.
const SIGNAL_BASE: u8 = 128;

/// Environment variable read when `--nodes` is absent.
const NODES_ENV: &str = "REDLOCK_NODES";

/// Longest single `acquire_for` call of `--wait`, so that a signal received
/// while waiting is acted on promptly.
const WAIT_SLICE: Duration = Duration::from_millis(250);

const EXIT_CODES: &str = "\
Exit codes of `quorumlock run`:
  N        the command's own exit status
  128+N    the command was killed by signal N (or quorumlock got signal N
           while waiting for the lock; the command was then never started)
  64       bad arguments (EX_USAGE), e.g. --ttl 0 or an unparsable duration
  69       nodes unavailable: no majority of nodes answered (EX_UNAVAILABLE)
  70       the lock was lost while the command ran; the command was sent
           SIGTERM, then SIGKILL after --grace (EX_SOFTWARE)
  71       other OS error spawning or waiting for the command (EX_OSERR)
  75       busy: the lock is held by someone else, with --no-wait (the
           default) or once --wait ran out (EX_TEMPFAIL)
  78       configuration: no nodes, a bad node URL, a key or TTL the
           library refuses, no majority because nodes refused the
           credentials or the lock's scripts (an ACL without EVAL, a
           server without Lua) (EX_CONFIG)
  126      the command cannot be executed (permission denied, not a program)
  127      the command was not found
Exit codes of `quorumlock lead` (it runs until its command exits by itself
or it gets a signal):
  N        the command exited by itself with status N while this host led
           (128+N: a signal N killed it); the leadership was resigned
  128+N    quorumlock got signal N while no command ran (campaigning, or
           once the command of a lost leadership was stopped); a signal
           that comes while the command runs is forwarded, and lead exits
           when the command does, with its status, campaigning no more
  64, 71, 78, 126, 127  as for run (78 also for an --id the library
           refuses); never 69, 70 or 75: lead campaigns on through node
           failures, lost leaderships and other leaders
Exit codes of `quorumlock status`: 0 when a majority of nodes answered,
69 otherwise (78 when nodes refused the credentials); 64 and 78 as above.
Exit codes of `quorumlock check`: 0 when the set is safe for Redlock, 1 when
it is safe but degraded (some node not usable), 2 when it is not safe, 69
when fewer than a majority of the nodes could be reached, 78 when a node
refused the credentials; 64 and 78 as above.";

const RUN_ABOUT: &str = "\
Run a command while holding a lock on a majority of Redis nodes.

Takes KEY with one attempt (or retries for up to --wait), renews it in the
background while the command runs, then releases it. With --and KEY2 (and
more), all the keys are one lock: taken all or none, renewed and released
together. The command inherits
stdin, stdout and stderr (quorumlock writes only to stderr, lines starting
with `quorumlock: `) and gets in its environment:
  QUORUMLOCK_KEY            the lock's key (KEY)
  QUORUMLOCK_KEYS           every key held (KEY and each --and KEY), one
                            per line
  QUORUMLOCK_TOKEN          the lock's random token, as stored on the nodes:
                            the lock's identity; treat it as a secret (it
                            lets its holder release or extend the lock)
  QUORUMLOCK_FENCING_TOKEN  the fencing token, with --fencing only
  QUORUMLOCK_TTL_MS         the TTL in milliseconds

The command runs in a process group of its own, as under timeout(1), and
signals go to that whole group (the command and its children). If the lock
is lost while the command runs (renewal failed, the keys were deleted or
taken), quorumlock sends the group SIGTERM, then SIGKILL after --grace to
whatever of the group is left, and exits 70. SIGTERM, SIGINT, SIGHUP and
SIGQUIT received by quorumlock are forwarded to the group; the lock is kept
(and renewed) until the command exits, then released, and quorumlock exits
with the command's status. Being outside the terminal's
foreground group, the command cannot read from the terminal (see
--foreground). SIGTSTP (Ctrl-Z), SIGTTIN and SIGTTOU stop the command, then
quorumlock; on SIGCONT the command continues only if the lock is still
valid, else it is terminated as on a lost lock (exit 70).

When the command exits, whatever it left running in its group (a job put
in the background) is sent SIGTERM, then SIGKILL after --grace (at once if
the lock is lost meanwhile), before the lock is released: nothing of the
group outlives the lock. quorumlock still exits with the command's status.

With --read, the lock is a read lock of KEY: any number of `run --read` of
KEY hold it at once, and a writer (a `run` without --read, or any exclusive
lock of KEY) waits for them all to leave, as they wait for it. A writer that
waits (--wait) keeps new readers out, so that a stream of readers cannot
starve it: a `run --read` is then busy too. Everything else is as above
(renewal, release, a lost lock, signals, exit codes); a reader's
QUORUMLOCK_TOKEN begins with `r`.

Without --nodes, the nodes come from REDLOCK_NODES (comma-separated). A
brand-new cluster (or nodes restarted without their data) refuses votes for
one TTL, the Redlock delayed-restart rule: runs then exit 69.";

const LEAD_ABOUT: &str = "\
Run a command while this host leads the election NAME, and again each
time it is elected.

Campaigns for NAME (a lock on a majority of the nodes, whose token carries
this candidate's --id) until elected, on through node failures and while
another candidate leads (it says on stderr when a node stops answering
or answers again); then runs the command and renews the leadership in
the background. Each leader is elected in a term, a number above every
earlier leader's term of NAME: pass it to storage that refuses a lower
one. The command inherits stdin, stdout and stderr (quorumlock writes only
to stderr, lines starting with `quorumlock: `) and gets in its environment:
  QUORUMLOCK_NAME    the election's name (NAME)
  QUORUMLOCK_ID      this candidate's id (--id)
  QUORUMLOCK_TERM    the term: the leadership's fencing token
  QUORUMLOCK_TTL_MS  the TTL in milliseconds

The command runs as under `quorumlock run` (see its --help): in a process
group of its own, which a watcher process stops if quorumlock dies or is
stopped past the leadership's validity; signals are forwarded to the group.

If the leadership is lost while the command runs (renewal failed, the key
was deleted or taken, quorumlock was stopped past its validity), quorumlock
sends the group SIGTERM, then SIGKILL after --grace, and campaigns again
after a jittered pause (doubling up to the TTL while terms end lost within
a TTL of their start); re-elected, it starts the command again, in a new
term.

When the command exits by itself, quorumlock ends what it left running in
its group as `quorumlock run` does, resigns (the next candidate is elected
at once) and exits with the command's status: a command that fails hands
the leadership over rather than being restarted here.
SIGTERM, SIGINT, SIGHUP and SIGQUIT are forwarded to the command's group,
and quorumlock campaigns no more: it exits when the command does, with its
status, or, while no command runs, within about a second (128+N). Ctrl-Z stops the command
and quorumlock as under run, and is ignored while no command runs.

Without --nodes, the nodes come from REDLOCK_NODES (comma-separated).
`quorumlock status NAME` shows who leads, and in which term.";

const CHECK_ABOUT: &str = "\
Audit the node list the way the client judges nodes at connect, and more,
and print a verdict per node and for the set:
  identity     each entry's run_id and lock history id: one server listed
               twice (two names, a load balancer, two databases) is UNSAFE
  role         a replica is UNSAFE: its keys are not its own
  cluster      a Redis Cluster node is UNSAFE: not an independent server
  memory       maxmemory with an evicting policy is UNSAFE: it evicts lock
               keys under pressure (volatile-* evicts exactly the keys with
               a TTL), and the client does not count its vote; only
               noeviction, or no maxmemory, keeps them: set
               maxmemory-policy noeviction
  persistence  what a restart keeps, and how the restart rule covers it
  clock        each node's clock against this machine's (one round trip),
               and how far apart the nodes' clocks are
  latency      round trips against the node timeout
  scripts      whether the lock's scripts run on --key under the ACL (FAIL
               if not), tried once per node with a random token
Each node is asked on a connection of its own. The verdict line says
whether the set is safe (no UNSAFE finding, and a majority of usable
nodes), and degraded where some node is not usable.
Exit status: 0 safe (warnings aside), 1 degraded (safe, some node not
usable), 2 not safe, 69 fewer than a majority of the nodes reachable, 78 a
node refused the credentials, 64 and 78 as for run.";

const STATUS_ABOUT: &str = "\
Show, for each node, whether KEY exists and its remaining TTL, or its
readers.

One line per node on stdout: `NODE  held  ttl=12.3s` (a writer's lock),
`NODE  read  readers=2  ttl=9.8s,9.1s` (a read lock's live readers on that
node, each one's TTL), `NODE  free` or `NODE  error: MESSAGE`; a node where
a writer waits for the readers to leave (no new reader gets in) adds
`  writer waiting`. Then the verdict: `KEY: held on N of M nodes` (N: the
nodes holding the most common token), `KEY: held for reading by K readers
on N of M nodes` (K readers each on a majority; N: the fewest nodes any of
them is on), `KEY: free on every node that answered` or `KEY: no node
answered`, followed by
`; writer waiting on W of M nodes` where a writer waits, and `; led by ID
in term T` where KEY is the name of an election (`quorumlock lead`) and a
candidate's lease is on a majority: its id and term. A lock on a bare
majority is one node failure from loss. Tokens are printed only with
--show-token. A node's copy alone says nothing about who holds the lock: a
lock is held only on a majority, within its validity.";

#[derive(Parser, Debug)]
#[command(
    name = "quorumlock",
    version,
    about = "flock(1) for a cluster: run a command under a Redlock lock held on N Redis nodes",
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Run a command while holding KEY on a majority of the nodes.
    #[command(
        long_about = RUN_ABOUT,
        after_help = EXIT_CODES,
        override_usage = "quorumlock run [OPTIONS] <KEY> [--and <KEY>]... -- <CMD> [ARGS]..."
    )]
    Run(RunArgs),
    /// Run a command while this host leads the election NAME.
    #[command(
        long_about = LEAD_ABOUT,
        after_help = EXIT_CODES,
        override_usage = "quorumlock lead [OPTIONS] <NAME> -- <CMD> [ARGS]..."
    )]
    Lead(LeadArgs),
    /// Show KEY's state on every node, and who leads the election KEY.
    #[command(long_about = STATUS_ABOUT, after_help = EXIT_CODES)]
    Status(StatusArgs),
    /// Audit the node list: is it safe for Redlock?
    #[command(long_about = CHECK_ABOUT, after_help = EXIT_CODES)]
    Check(CheckArgs),
    /// The watcher `run` starts (internal).
    #[command(name = "__watch", hide = true)]
    Watch {
        /// SIGTERM to SIGKILL, in ms.
        grace_ms: String,
        /// How often `run` beats, in µs.
        tick_us: String,
        /// The process group to stop (default: the watcher's own).
        group: Option<String>,
    },
}

#[derive(clap::Args, Debug)]
struct NodeArgs {
    /// Comma-separated node URLs, `redis://[user:password@]host:port[/db]`
    /// or `rediss://…` (TLS)
    /// (default: the REDLOCK_NODES environment variable). Use 3 or 5
    /// independent servers.
    #[arg(long, value_name = "URL,...", value_delimiter = ',')]
    nodes: Vec<String>,
    /// Timeout of each node call (connect, read, write): a slow or dead node
    /// costs its vote after this long. Default: the library's, 50ms.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    node_timeout: Option<Duration>,
    /// Trust the nodes' lock history at first sight, so that a brand-new
    /// cluster's first lock need not wait one TTL (restart protection off
    /// for this client). For throwaway nodes (tests, demos) only: never on
    /// nodes that may restart without their data while a lock is held.
    #[arg(long)]
    fresh_cluster: bool,
    /// UNSAFE: count the votes of nodes whose maxmemory-policy can evict
    /// lock keys (by default they do not vote: an evicted key lets a second
    /// holder in). Set maxmemory-policy noeviction on lock nodes instead.
    #[arg(long)]
    allow_evicting_nodes: bool,
    /// For rediss:// nodes: trust the CA certificates in this PEM file
    /// instead of the system's roots.
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<std::path::PathBuf>,
    /// For rediss:// nodes that require client certificates: this
    /// certificate chain (PEM), with --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
}

/// The command `run` and `lead` supervise.
#[derive(clap::Args, Debug)]
struct CommandLine {
    /// The command and its arguments (after `--`).
    #[arg(
        value_name = "CMD",
        required = true,
        num_args = 1..,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_parser = clap::value_parser!(OsString)
    )]
    argv: Vec<OsString>,
}

/// The lease a supervised command runs under: `run`'s lock, `lead`'s
/// leadership.
#[derive(clap::Args, Debug)]
struct LeaseArgs {
    /// The lease's time to live (run: the lock's; lead: the leadership's);
    /// renewed every TTL/3 while the command runs. It bounds how long KEY
    /// stays blocked (NAME stays led) if this host dies. Durations: 500ms,
    /// 30s, 2m, 1h, or whole seconds; at most 1h.
    ///
    /// A TTL longer than the nodes have recorded makes this command wait
    /// on nodes whose lock history is younger than it (started or
    /// restarted empty within it). It holds other clients back only where
    /// the restart rule needs it (a node that loses its data later), on a
    /// brand-new cluster (no lock taken yet: the first TTL used on it counts
    /// for every client, once), on a node whose lock history this command
    /// could not read before its first attempt (unreachable or slow then),
    /// and, while some node does not answer a round, on every node younger
    /// than it: until their histories are that old.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_ttl)]
    ttl: Duration,
    /// Time between SIGTERM and SIGKILL when the lock (the leadership) is
    /// lost.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    grace: Duration,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    nodes: NodeArgs,
    #[command(flatten)]
    lease: LeaseArgs,
    /// If KEY is busy, retry for up to this long before giving up (exit 75).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, conflicts_with = "no_wait")]
    wait: Option<Duration>,
    /// If KEY is busy, give up at once (exit 75): one attempt, like
    /// `flock -n`. The default.
    #[arg(long)]
    no_wait: bool,
    /// Run the command in quorumlock's own process group, not one of its
    /// own, so that it can read from the terminal (as `timeout
    /// --foreground`): signals then go to the command alone, not to its
    /// children, a terminal's Ctrl-C reaches it twice, and children it
    /// leaves behind when it exits are not stopped.
    #[arg(long)]
    foreground: bool,
    /// Take a fencing token with the lock and export it to the command as
    /// QUORUMLOCK_FENCING_TOKEN (one more round trip).
    #[arg(long)]
    fencing: bool,
    /// Take KEY for reading: shared with every other `run --read` of KEY,
    /// excluded by a writer (a `run` without --read, or any exclusive lock
    /// of KEY). Busy (exit 75) while a writer holds KEY or waits for it.
    /// Of one KEY only (not with --and), and without --fencing.
    #[arg(long)]
    read: bool,
    /// The lock's name (the Redis key).
    #[arg(value_name = "KEY")]
    key: String,
    /// Another key to hold with KEY, as one lock: all of them or none (a
    /// lock of several resources). Repeat for more.
    #[arg(long = "and", value_name = "KEY")]
    and: Vec<String>,
    #[command(flatten)]
    command: CommandLine,
}

#[derive(clap::Args, Debug)]
struct LeadArgs {
    #[command(flatten)]
    nodes: NodeArgs,
    #[command(flatten)]
    lease: LeaseArgs,
    /// This candidate's id: the leader's, in `quorumlock status NAME`, and
    /// the command's QUORUMLOCK_ID. 1 to 128 bytes of any text; ids need
    /// not be unique (the term tells two leaders apart). Default: HOST:PID,
    /// the host's name and this process's id.
    #[arg(long, value_name = "ID")]
    id: Option<String>,
    /// The election's name (the Redis key of its lock).
    #[arg(value_name = "NAME")]
    name: String,
    #[command(flatten)]
    command: CommandLine,
}

#[derive(clap::Args, Debug)]
struct CheckArgs {
    #[command(flatten)]
    nodes: NodeArgs,
    /// The key the lock's scripts are tried on, once per node, with a random
    /// token for at most a second (use a name your locks' ACL allows).
    #[arg(long, value_name = "KEY", default_value = "quorumlock:check")]
    key: String,
}

#[derive(clap::Args, Debug)]
struct StatusArgs {
    #[command(flatten)]
    nodes: NodeArgs,
    /// Also print each node's stored token (the lock's secret identity),
    /// or its readers' tokens.
    #[arg(long)]
    show_token: bool,
    /// The lock's name (the Redis key).
    #[arg(value_name = "KEY")]
    key: String,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to stdout with status 0; errors to stderr.
            let code = if e.use_stderr() { EX_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    ExitCode::from(match cli.command {
        Cmd::Run(args) => run(args),
        Cmd::Lead(args) => lead(args),
        Cmd::Status(args) => status(args),
        Cmd::Check(args) => check(args),
        Cmd::Watch {
            grace_ms,
            tick_us,
            group,
        } => watcher::watch(&grace_ms, &tick_us, group.as_deref()),
    })
}

/// Prints `quorumlock: MESSAGE` on stderr.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(io::stderr().lock(), "quorumlock: {}", format_args!($($arg)*));
    }};
}

// After `say!`, which they use.
mod lead;
mod status;
mod supervisor;

use lead::lead;
use status::status;
use supervisor::{Launch, Outcome};

// ---------------------------------------------------------------------------
// Durations
// ---------------------------------------------------------------------------

/// Longest duration accepted for any option (about 136 years).
const MAX_DURATION: Duration = Duration::from_secs(u32::MAX as u64);

/// `500ms`, `30s`, `2m`, `1h`, or a bare whole number of seconds; not zero.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let bad = || {
        format!(
            "invalid duration {s:?}: expected a whole number with a unit, ms, s, m or h \
             (500ms, 30s, 2m, 1h), or whole seconds"
        )
    };
    if digits.is_empty() {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let d = match unit {
        "ms" => Some(Duration::from_millis(n)),
        "" | "s" => Some(Duration::from_secs(n)),
        "m" => n.checked_mul(60).map(Duration::from_secs),
        "h" => n.checked_mul(3600).map(Duration::from_secs),
        _ => return Err(bad()),
    };
    // The cap keeps `Instant + duration` far from overflowing.
    match d {
        None => Err(format!("duration {s:?} is too long")),
        Some(d) if d > MAX_DURATION => Err(format!("duration {s:?} is too long")),
        Some(d) if d.is_zero() => Err(format!("duration {s:?} must be greater than zero")),
        Some(d) => Ok(d),
    }
}

/// A duration that is also a valid lock TTL: at most [`quorumlock::MAX_TTL`].
fn parse_ttl(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d > quorumlock::MAX_TTL {
        return Err(format!(
            "ttl {s:?} is too long: at most {}s (renewal keeps a lock as long as needed)",
            quorumlock::MAX_TTL.as_secs()
        ));
    }
    Ok(d)
}

/// `12.3s`
fn seconds(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

// ---------------------------------------------------------------------------
// Client and error mapping
// ---------------------------------------------------------------------------

/// The client for `--nodes` or `REDLOCK_NODES`, with what `more` sets on
/// its builder (a command's own settings); `Err(exit code)` after a
/// message.
fn client(args: &NodeArgs, more: impl FnOnce(Builder) -> Builder) -> Result<Redlock, u8> {
    let mut urls: Vec<String> = args
        .nodes
        .iter()
        .map(|u| u.trim().to_owned())
        .filter(|u| !u.is_empty())
        .collect();
    if urls.is_empty() && !args.nodes.is_empty() {
        say!("--nodes names no node");
        return Err(EX_CONFIG);
    }
    if urls.is_empty() {
        if let Some(v) = std::env::var_os(NODES_ENV) {
            let Some(v) = v.to_str() else {
                say!("{NODES_ENV} is not valid UTF-8");
                return Err(EX_CONFIG);
            };
            urls = v
                .split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(str::to_owned)
                .collect();
        }
    }
    if urls.is_empty() {
        say!("no nodes configured: pass --nodes URL,URL,... or set {NODES_ENV} (comma-separated redis:// URLs)");
        return Err(EX_CONFIG);
    }
    let mut builder = Redlock::builder()
        .nodes(urls)
        .fresh_cluster(args.fresh_cluster)
        .allow_evicting_nodes(args.allow_evicting_nodes);
    if let Some(t) = args.node_timeout {
        builder = builder.node_timeout(t);
    }
    let mut tls = quorumlock::Tls::new();
    if let Some(ca) = &args.tls_ca {
        tls = tls.ca_file(ca);
    }
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        tls = tls.client_auth(cert, key);
    }
    builder = more(builder.tls(tls));
    builder.build().map_err(|e| {
        say!("{e}");
        exit_code(&e)
    })
}

/// The exit code for a failure to take (or inspect) a lock.
fn exit_code(e: &Error) -> u8 {
    match e {
        // The nodes' configuration refuses the scripts: nothing to wait for.
        Error::InvalidInput(_) | Error::ScriptsRefused { .. } => EX_CONFIG,
        // Nodes that refuse the credentials: the node list to fix, not
        // nodes to wait for.
        Error::NoQuorum { failures, .. } if failures.iter().any(refused_credentials) => EX_CONFIG,
        Error::NoQuorum { .. } | Error::ValidityExhausted { .. } => EX_UNAVAILABLE,
        // Taken, and what a single-threaded caller cannot really meet
        // (Expired, NotOwner): the resource is someone else's.
        _ => EX_TEMPFAIL,
    }
}

// ---------------------------------------------------------------------------
// Signals
// ---------------------------------------------------------------------------

/// The signals `run` and `lead` catch and forward to the command.
const FORWARDED: [Signal; 4] = [Signal::TERM, Signal::INT, Signal::HUP, Signal::QUIT];
/// Job-control stops: forwarded, then `run` stops itself (SIGSTOP) so that
/// the command never runs while nothing renews its lock.
const STOPS: [Signal; 3] = [Signal::TSTP, Signal::TTIN, Signal::TTOU];

/// One flag per caught signal, set by its handler, cleared when taken.
struct Signals {
    flags: Vec<(Signal, Arc<AtomicBool>)>,
    /// The first terminating signal taken (1 + its index in [`FORWARDED`]),
    /// 0 before one is: `lead` then campaigns no more.
    first: AtomicUsize,
}

impl Signals {
    fn install() -> io::Result<Signals> {
        let mut flags = Vec::with_capacity(FORWARDED.len() + STOPS.len() + 1);
        for sig in FORWARDED.into_iter().chain(STOPS).chain([Signal::CONT]) {
            let flag = Arc::new(AtomicBool::new(false));
            signal_hook::flag::register(sig.as_raw(), flag.clone())?;
            flags.push((sig, flag));
        }
        Ok(Signals {
            flags,
            first: AtomicUsize::new(0),
        })
    }

    /// The first terminating signal received, taken or not.
    fn received(&self) -> Option<Signal> {
        let first = self.first.load(Ordering::SeqCst);
        let taken = first.checked_sub(1).and_then(|i| FORWARDED.get(i).copied());
        taken.or_else(|| {
            self.flags
                .iter()
                .find(|(s, f)| FORWARDED.contains(s) && f.load(Ordering::SeqCst))
                .map(|(s, _)| *s)
        })
    }

    /// The first terminating signal received since the last call (stops
    /// and continues are dropped: nothing runs yet, or nothing will).
    fn take_forwarded(&self) -> Option<Signal> {
        self.take().into_iter().find(|s| FORWARDED.contains(s))
    }

    /// The signals received since the last call.
    fn take(&self) -> Vec<Signal> {
        let taken: Vec<Signal> = self
            .flags
            .iter()
            .filter(|(_, f)| f.swap(false, Ordering::SeqCst))
            .map(|(s, _)| *s)
            .collect();
        if let Some(i) = taken
            .iter()
            .find_map(|s| FORWARDED.iter().position(|f| f == s))
        {
            let _ = self
                .first
                .compare_exchange(0, i + 1, Ordering::SeqCst, Ordering::SeqCst);
        }
        taken
    }
}

fn signal_exit(sig: Signal) -> u8 {
    u8::try_from(sig.as_raw())
        .ok()
        .and_then(|n| SIGNAL_BASE.checked_add(n))
        .unwrap_or(u8::MAX)
}

// ---------------------------------------------------------------------------
// run
// ---------------------------------------------------------------------------

fn run(args: RunArgs) -> u8 {
    if args.read && !args.and.is_empty() {
        say!("--read takes one KEY: a read lock is of one resource, and --and makes a lock of several");
        return EX_USAGE;
    }
    if args.read && args.fencing {
        say!("--read and --fencing: a read lock has no fencing token (readers share KEY; fence the writers)");
        return EX_USAGE;
    }
    // Before anything else, so that a signal while waiting for the lock is
    // handled (the attempt in flight is cleaned up) rather than fatal.
    let signals = match Signals::install() {
        Ok(s) => s,
        Err(e) => {
            say!("cannot install signal handlers: {e}");
            return EX_OSERR;
        }
    };
    let locks = match client(&args.nodes, |b| b.fencing(args.fencing)) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let keys: Vec<&str> = std::iter::once(args.key.as_str())
        .chain(args.and.iter().map(String::as_str))
        .collect();
    let key = keys.join(" and ");
    let wait = if args.no_wait { None } else { args.wait };
    // A new client's pools connect in the background, and a round does not
    // wait for a node still connecting: a lock taken at once may land on a
    // bare majority (about half the time on local nodes) and keep it through
    // every renewal, so that one node failing loses it. Each connect is
    // bounded by the node timeout; a node that fails is not waited for.
    if let Err(e) = locks.wait_connected(CONNECT_WAIT) {
        // Two entries of the list reach one server.
        say!("{e}");
        return exit_code(&e);
    }
    let how = if args.read { How::Read } else { How::Write };
    let guard = match acquire(&locks, &keys, how, args.lease.ttl, wait, &signals) {
        Ok(g) => g,
        Err(Stop::Signal(sig)) => return signal_exit(sig),
        Err(Stop::Failed(e)) => {
            let code = exit_code(&e);
            match code {
                EX_TEMPFAIL => say!("{key} is busy: {e}"),
                EX_UNAVAILABLE => say!("cannot take {key}, nodes unavailable: {e}"),
                _ => say!("cannot take {key}: {e}"),
            }
            return code;
        }
    };
    guard.auto_renew();
    // A signal that arrived while the lock was being taken: do not start.
    if let Some(sig) = signals.take_forwarded() {
        release(guard);
        return signal_exit(sig);
    }

    let launch = Launch {
        command: &args.command.argv,
        grace: args.lease.grace,
        ttl: args.lease.ttl,
        foreground: args.foreground,
    };
    let mut env = vec![
        ("QUORUMLOCK_KEY", guard.resource().to_owned()),
        (
            "QUORUMLOCK_KEYS",
            guard.resources().collect::<Vec<_>>().join("\n"),
        ),
        ("QUORUMLOCK_TOKEN", guard.token().to_owned()),
        ("QUORUMLOCK_TTL_MS", args.lease.ttl.as_millis().to_string()),
    ];
    if let Some(f) = guard.fencing_token() {
        env.push(("QUORUMLOCK_FENCING_TOKEN", f.to_string()));
    }
    match launch.supervise(&guard, &env, &signals) {
        Outcome::Exited(code) => {
            release(guard);
            code
        }
        Outcome::Lost => {
            // The watchdog already deletes what is left of the keys; the
            // release on drop only confirms it.
            drop(guard);
            EX_SOFTWARE
        }
    }
}

/// Why `acquire` gave up.
enum Stop {
    Failed(Error),
    Signal(Signal),
}

/// Which lock `run` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// Exclusive, of every key.
    Write,
    /// Shared with other readers, of the first key (`run` refuses more).
    Read,
}

/// One attempt, or retries until `wait` has passed, looking at received
/// signals between slices of the wait.
fn acquire(
    locks: &Redlock,
    keys: &[&str],
    how: How,
    ttl: Duration,
    wait: Option<Duration>,
    signals: &Signals,
) -> Result<LockGuard, Stop> {
    let first = keys.first().copied().unwrap_or_default();
    let rest = keys.get(1..).unwrap_or_default();
    let all = rest
        .iter()
        .fold(locks.request(first, ttl), |r, k| r.and(*k));
    let request = match how {
        How::Write => all,
        How::Read => all.read(),
    };
    let Some(wait) = wait else {
        return request.try_acquire().map_err(Stop::Failed);
    };
    let until = Instant::now() + wait;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let slice = left.min(WAIT_SLICE);
        let e = match request.clone().acquire_for(slice) {
            Ok(g) => return Ok(g),
            Err(e) => e,
        };
        if let Some(sig) = signals.take_forwarded() {
            return Err(Stop::Signal(sig));
        }
        if !e.is_retryable() || Instant::now() >= until {
            return Err(Stop::Failed(e));
        }
    }
}

/// Releases the lock, reporting a failure on stderr.
fn release(guard: LockGuard) {
    let key = guard.resources().collect::<Vec<_>>().join(" and ");
    if let Err(e) = guard.release() {
        say!("releasing {key}: {e}");
    }
}

// ---------------------------------------------------------------------------
// check (status is in status.rs)
// ---------------------------------------------------------------------------

/// Exit status of `check` when the set is safe but some node is not
/// usable: one failure closer to no lock at all.
const EX_DEGRADED: u8 = 1;
/// Exit status of `check` when the set is not safe for Redlock.
const EX_NOT_SAFE: u8 = 2;

fn check(args: CheckArgs) -> u8 {
    let locks = match client(&args.nodes, |b| b) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let report = match locks.check(&args.key) {
        Ok(r) => r,
        Err(e) => {
            say!("cannot check the nodes: {e}");
            return exit_code(&e);
        }
    };
    if writeln!(io::stdout().lock(), "{report}").is_err() {
        return EX_OSERR;
    }
    let credentials = report
        .nodes()
        .iter()
        .any(|n| n.findings().iter().any(|f| f.topic() == "credentials"));
    if credentials {
        EX_CONFIG
    } else if report.reachable() < locks.quorum() {
        EX_UNAVAILABLE
    } else if !report.is_safe() {
        EX_NOT_SAFE
    } else if report.is_degraded() {
        EX_DEGRADED
    } else {
        0
    }
}

/// A node error as the library words it, without the node's name (the
/// line starts with it).
fn error_detail(e: &quorumlock::NodeError) -> String {
    let shown = e.to_string();
    shown
        .strip_prefix(e.node())
        .map_or(shown.as_str(), str::trim_start)
        .to_owned()
}

/// Whether the node refused the credentials of its URL (a configuration
/// error: exit 78).
fn refused_credentials(e: &quorumlock::NodeError) -> bool {
    e.kind() == quorumlock::NodeErrorKind::Auth
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        for bad in [
            "",
            "0",
            "0s",
            "ms",
            "1.5s",
            "-1",
            "5d",
            "s5",
            "99999999999999999999",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert!(parse_ttl("2h").is_err());
        assert!(parse_ttl("1h").is_ok());
    }

    #[test]
    fn exit_statuses() {
        use std::os::unix::process::ExitStatusExt;
        use std::process::ExitStatus;
        use supervisor::status_code;
        assert_eq!(status_code(ExitStatus::from_raw(7 << 8)), 7);
        assert_eq!(status_code(ExitStatus::from_raw(15)), 143);
        assert_eq!(status_code(ExitStatus::from_raw(9)), 137);
    }

    #[test]
    fn cli_parses() {
        Cli::command().debug_assert();
        let c =
            Cli::try_parse_from(["quorumlock", "run", "k", "--", "sh", "-c", "exit 3"]).unwrap();
        let Cmd::Run(r) = c.command else {
            panic!("run")
        };
        assert_eq!(r.command.argv, ["sh", "-c", "exit 3"]);
        assert_eq!(r.lease.ttl, Duration::from_secs(30));
        assert!(
            Cli::try_parse_from(["quorumlock", "run", "--wait", "1s", "--no-wait", "k", "x"])
                .is_err()
        );
    }
}
