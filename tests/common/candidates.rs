//! Candidate processes of a leader election (issue 42), for
//! `tests/integration/election_processes.rs` and the bench's `election` row.
//!
//! A child ([`child_main`], when `QL_CANDIDATE` holds its [`Spec`]) is a
//! client of its own running [`Election::run`](quorumlock::Election::run)
//! and reports each event on stdout, one line at once, times in wall-clock
//! ns (one clock for every process of the machine):
//!
//! ```text
//! READY    who
//! ELECTED  who term elected-ns validity-deadline-ns
//! VALID    who term validity-deadline-ns          (the deadline moved: a renewal)
//! WROTE    who term ns accepted last past-check   (a write to the term-checking store)
//! LATE     who term ns accepted last              (a stale write, made after the loss on purpose)
//! ENDED    who term ended-ns why last-validity-deadline-ns   (why: resigned, lost, stopped)
//! HELDBACK who node ns                            (an attempt where the restart rule held the node's vote back)
//! RESTORED who node ns                            (a renewal restored the lease's copy on the node)
//! WON      who woken ns                           (an attempt that got the lease: woken by a release, 1, or not, 0)
//! COUNTS   who attempts woken alive-ms            (at exit)
//! ```
//!
//! Its stdin takes `resign <term>` (the leader of that term resigns) and
//! `quit` (it stops: a leader ends its term, a campaign returns); at EOF
//! (the parent is gone) it exits at once. The parent side is [`Candidates`],
//! which kills its children when dropped; [`leases`] and [`Leases`] check
//! what they reported.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use quorumlock::{
    AttemptEvent, EventHandler, Leadership, NodeErrorKind, NodeOutcome, Redlock, RenewalEvent,
};

/// The environment variable that makes a process a candidate.
pub const CHILD_ENV: &str = "QL_CANDIDATE";

/// How often a leader looks at its leadership (and writes to the store).
const STEP: Duration = Duration::from_millis(10);

/// The kinds of lines a child writes. Anything else on its stdout, a test
/// harness's own lines, is not read; its first line may follow the
/// harness's `test name ... ` on the same line.
const KINDS: [&str; 11] = [
    "READY", "ELECTED", "VALID", "WROTE", "LATE", "ENDED", "HELDBACK", "RESTORED", "WON", "COUNTS",
    "GONE",
];

pub fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// How long a leader leads before it resigns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// A random time in `lo..hi`.
    Random(Duration, Duration),
    /// Until told (`resign <term>`), lost or stopped.
    Told,
}

/// What a child is: its candidate id `c<who>`, the election, its client.
#[derive(Debug, Clone)]
pub struct Spec {
    pub who: usize,
    pub nodes: Vec<String>,
    pub name: String,
    pub ttl: Duration,
    /// The client's retry pause and its jitter.
    pub pause: Duration,
    pub jitter: Duration,
    /// `fresh_cluster(true)` (throwaway nodes); false: production settings,
    /// the restart rule in full.
    pub fresh: bool,
    /// The term-checking store's URL (a leader writes each step).
    pub store: Option<String>,
    pub hold: Hold,
    /// Leads one term, then stops and exits.
    pub once: bool,
}

impl Spec {
    /// A spec with the defaults: fresh, no store, held until told, many terms.
    pub fn new(who: usize, nodes: Vec<String>, name: &str, ttl: Duration) -> Spec {
        Spec {
            who,
            nodes,
            name: name.to_owned(),
            ttl,
            pause: Duration::from_millis(100),
            jitter: Duration::ZERO,
            fresh: true,
            store: None,
            hold: Hold::Told,
            once: false,
        }
    }

    fn encode(&self) -> String {
        let ms = |d: Duration| d.as_millis().to_string();
        let hold = match self.hold {
            Hold::Random(lo, hi) => format!("{}-{}", ms(lo), ms(hi)),
            Hold::Told => "told".to_owned(),
        };
        [
            self.who.to_string(),
            self.nodes.join(","),
            self.name.clone(),
            ms(self.ttl),
            ms(self.pause),
            ms(self.jitter),
            u8::from(self.fresh).to_string(),
            self.store.clone().unwrap_or_default(),
            hold,
            u8::from(self.once).to_string(),
        ]
        .join("|")
    }

    fn parse(s: &str) -> Option<Spec> {
        let f: Vec<&str> = s.split('|').collect();
        let [who, nodes, name, ttl, pause, jitter, fresh, store, hold, once] = f[..] else {
            return None;
        };
        let ms = |s: &str| s.parse().ok().map(Duration::from_millis);
        let hold = match hold.split_once('-') {
            Some((lo, hi)) => Hold::Random(ms(lo)?, ms(hi)?),
            None => Hold::Told,
        };
        Some(Spec {
            who: who.parse().ok()?,
            nodes: nodes.split(',').map(str::to_owned).collect(),
            name: name.to_owned(),
            ttl: ms(ttl)?,
            pause: ms(pause)?,
            jitter: ms(jitter)?,
            fresh: fresh == "1",
            store: Some(store.to_owned()).filter(|s| !s.is_empty()),
            hold,
            once: once == "1",
        })
    }
}

// ---------------------------------------------------------------------------
// the child

/// One line on stdout, whole, at once (the library's threads report too).
fn say(line: String) {
    static OUT: Mutex<()> = Mutex::new(());
    let _one = OUT.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The child's counts and reports from the library's events.
struct Events {
    who: usize,
    attempts: AtomicUsize,
    woken: AtomicUsize,
}

impl EventHandler for Events {
    fn on_attempt(&self, e: &AttemptEvent<'_>) {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        if e.woken() {
            self.woken.fetch_add(1, Ordering::Relaxed);
        }
        if e.acquired() {
            let woken = u8::from(e.woken());
            say(format!("WON {} {woken} {}", self.who, wall_ns()));
        }
        for (node, (_, o)) in e.nodes().iter().enumerate() {
            if matches!(o, NodeOutcome::Failed(NodeErrorKind::Restarted)) {
                say(format!("HELDBACK {} {node} {}", self.who, wall_ns()));
            }
        }
    }

    fn on_renewal(&self, e: &RenewalEvent<'_>) {
        for (node, (_, o)) in e.nodes().iter().enumerate() {
            if matches!(o, NodeOutcome::Restored) {
                say(format!("RESTORED {} {node} {}", self.who, wall_ns()));
            }
        }
    }
}

/// The term-checking store: a hash `{term, by, accepted, refused}` that
/// refuses a write whose term is below the highest it accepted.
pub const STORE_LUA: &str = r"local last = tonumber(redis.call('HGET', KEYS[1], 'term')) or 0
local term = tonumber(ARGV[1])
if term < last then
  redis.call('HINCRBY', KEYS[1], 'refused', 1)
  return {0, last}
end
redis.call('HSET', KEYS[1], 'term', ARGV[1], 'by', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'accepted', 1)
return {1, last}";

/// The store's key for an election.
pub fn store_key(name: &str) -> String {
    format!("{name}:store")
}

struct Store {
    conn: redis::Connection,
    key: String,
    who: usize,
}

impl Store {
    /// A write with `term`: whether it was accepted, and the term the store
    /// had before.
    fn write(&mut self, term: u64) -> (bool, u64) {
        let script = redis::Script::new(STORE_LUA);
        let r: Vec<u64> = script
            .key(&self.key)
            .arg(term)
            .arg(format!("c{}", self.who))
            .invoke(&mut self.conn)
            .expect("the store answers (it is never faulted)");
        (r[0] == 1, r[1])
    }
}

/// A small xorshift generator (no crate).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// In a candidate process (`QL_CANDIDATE` set): runs the election loop
/// until told to quit, then exits; returns at once elsewhere.
pub fn child_main() {
    let Ok(raw) = std::env::var(CHILD_ENV) else {
        return;
    };
    let born = Instant::now();
    let spec = Spec::parse(&raw).unwrap_or_else(|| panic!("bad {CHILD_ENV}: {raw}"));
    let events = Arc::new(Events {
        who: spec.who,
        attempts: AtomicUsize::new(0),
        woken: AtomicUsize::new(0),
    });
    let locks = Redlock::builder()
        .nodes(spec.nodes.clone())
        .fresh_cluster(spec.fresh)
        .node_timeout(Duration::from_millis(250))
        .retry_delay(spec.pause)
        .retry_jitter(spec.jitter)
        .events(events.clone())
        .build()
        .expect("valid config");
    let _ = locks.wait_connected(Duration::from_secs(5));
    let election = locks
        .election(&spec.name, spec.ttl)
        .id(format!("c{}", spec.who));
    let resign = Arc::new(AtomicU64::new(0));
    let quit = Arc::new(AtomicBool::new(false));
    {
        let (resign, quit, stopper) = (resign.clone(), quit.clone(), election.clone());
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                let mut w = line.split_whitespace();
                match (w.next(), w.next().and_then(|t| t.parse().ok())) {
                    (Some("resign"), Some(term)) => resign.store(term, Ordering::SeqCst),
                    (Some("quit"), _) => {
                        quit.store(true, Ordering::SeqCst);
                        stopper.stop();
                    }
                    _ => {}
                }
            }
            // The parent is gone: nobody reads us.
            std::process::exit(0);
        });
    }
    let mut store = spec.store.as_ref().map(|url| Store {
        conn: redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection())
            .expect("connect to the store"),
        key: store_key(&spec.name),
        who: spec.who,
    });
    let mut rng = Rng(wall_ns() as u64 ^ u64::from(std::process::id()) << 32 | 1);
    say(format!("READY {}", spec.who));
    let stopper = election.clone();
    election
        .run(|l| {
            let hold = match spec.hold {
                Hold::Random(lo, hi) => {
                    let span = hi.saturating_sub(lo).as_millis() as u64;
                    Some(Instant::now() + lo + Duration::from_millis(rng.below(span + 1)))
                }
                Hold::Told => None,
            };
            lead(l, &spec, hold, (&resign, &quit), store.as_mut());
            if spec.once || quit.load(Ordering::SeqCst) {
                stopper.stop();
            }
        })
        .expect("the election loop runs");
    let n = |a: &AtomicUsize| a.load(Ordering::Relaxed);
    say(format!(
        "COUNTS {} {} {} {}",
        spec.who,
        n(&events.attempts),
        n(&events.woken),
        born.elapsed().as_millis()
    ));
    std::process::exit(0);
}

/// One term: leads until `hold` ends, the parent says `resign <term>`, the
/// lease is lost or the election stopped; each step checks the leadership
/// first, then (with a store) writes with the term. The resignation itself
/// is `run`'s, when this returns.
fn lead(
    l: &Leadership,
    spec: &Spec,
    hold: Option<Instant>,
    (resign, quit): (&AtomicU64, &AtomicBool),
    mut store: Option<&mut Store>,
) {
    let (who, term) = (spec.who, l.term());
    let deadline_of = |l: &Leadership| wall_ns() + l.validity().as_nanos();
    let mut deadline = deadline_of(l);
    say(format!("ELECTED {who} {term} {} {deadline}", wall_ns()));
    let why = loop {
        let checked = Instant::now();
        if !l.is_leader() {
            break if quit.load(Ordering::SeqCst) {
                "stopped"
            } else {
                "lost"
            };
        }
        let now = deadline_of(l);
        // (A renewal moves it by a third of the TTL; the clock's own
        // wobble is far less.)
        if now > deadline + 1_000_000 {
            say(format!("VALID {who} {term} {now}"));
        }
        deadline = deadline.max(now);
        if let Some(s) = store.as_deref_mut() {
            let (ok, last) = s.write(term);
            // Stopped between the check and the write's reply (SIGSTOP): an
            // action already past the check.
            let past = checked.elapsed() > spec.ttl / 2;
            say(format!(
                "WROTE {who} {term} {} {} {last} {}",
                wall_ns(),
                u8::from(ok),
                u8::from(past)
            ));
        }
        let told = resign.load(Ordering::SeqCst) == term;
        if told || hold.is_some_and(|h| Instant::now() >= h) {
            break "resigned";
        }
        if quit.load(Ordering::SeqCst) {
            break "stopped";
        }
        l.wait_end(STEP);
    };
    let ended = wall_ns();
    if why == "lost" {
        if let Some(s) = store {
            // What an action already past its check would write.
            let (ok, last) = s.write(term);
            say(format!(
                "LATE {who} {term} {} {} {last}",
                wall_ns(),
                u8::from(ok)
            ));
        }
    }
    say(format!("ENDED {who} {term} {ended} {why} {deadline}"));
}

// ---------------------------------------------------------------------------
// the parent

/// One line a child wrote, split in words (`words[0]` is its kind).
#[derive(Debug, Clone)]
pub struct Line {
    pub words: Vec<String>,
}

impl Line {
    pub fn kind(&self) -> &str {
        &self.words[0]
    }

    /// The candidate that wrote it.
    pub fn who(&self) -> usize {
        self.num(1) as usize
    }

    /// Word `i` as a number (0 where it is none).
    pub fn num(&self, i: usize) -> u128 {
        self.words.get(i).and_then(|w| w.parse().ok()).unwrap_or(0)
    }

    /// The term of an `ELECTED`, `VALID`, `WROTE`, `LATE` or `ENDED` line.
    pub fn term(&self) -> u64 {
        self.num(2) as u64
    }

    /// Its time: when elected, written or ended.
    pub fn at(&self) -> u128 {
        self.num(3)
    }

    pub fn is(&self, kind: &str) -> bool {
        self.kind() == kind
    }
}

impl std::fmt::Display for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.words.join(" "))
    }
}

struct Kid {
    child: Child,
    stdin: Option<ChildStdin>,
}

/// The candidate processes of one election, killed (and reaped) when
/// dropped, also on a panic. What they wrote is kept in `lines`, in the
/// order read.
pub struct Candidates {
    command: Box<dyn Fn() -> Command>,
    kids: Vec<Kid>,
    tx: mpsc::Sender<Line>,
    rx: mpsc::Receiver<Line>,
    pub lines: Vec<Line>,
    /// Candidates killed, and when (wall ns, just after the signal).
    pub killed: Vec<(usize, u128)>,
}

impl Candidates {
    /// Nobody yet: `command` makes the command that runs this program as a
    /// candidate (the spec is added to its environment).
    pub fn new(command: impl Fn() -> Command + 'static) -> Candidates {
        let (tx, rx) = mpsc::channel();
        Candidates {
            command: Box::new(command),
            kids: Vec::new(),
            tx,
            rx,
            lines: Vec::new(),
            killed: Vec::new(),
        }
    }

    /// Starts candidate `spec.who` (the next index: 0, 1, ...).
    pub fn spawn(&mut self, spec: &Spec) {
        assert_eq!(
            spec.who,
            self.kids.len(),
            "candidates are numbered in order"
        );
        let mut child = (self.command)()
            .env(CHILD_ENV, spec.encode())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start a candidate process");
        let out = child.stdout.take().expect("piped stdout");
        let stdin = child.stdin.take();
        self.kids.push(Kid { child, stdin });
        let (tx, who) = (self.tx.clone(), spec.who);
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let words: Vec<&str> = line.split_whitespace().collect();
                if let Some(at) = words.iter().position(|w| KINDS.contains(w)) {
                    let words = words[at..].iter().map(|w| (*w).to_owned()).collect();
                    let _ = tx.send(Line { words });
                }
            }
            let _ = tx.send(Line {
                words: vec!["GONE".into(), who.to_string()],
            });
        });
    }

    pub fn len(&self) -> usize {
        self.kids.len()
    }

    pub fn pid(&self, who: usize) -> u32 {
        self.kids[who].child.id()
    }

    /// Writes `line` to candidate `who`'s stdin.
    pub fn tell(&mut self, who: usize, line: &str) {
        if let Some(s) = self.kids[who].stdin.as_mut() {
            let _ = writeln!(s, "{line}");
            let _ = s.flush();
        }
    }

    /// Tells the leader of `term` (candidate `who`) to resign.
    pub fn resign(&mut self, who: usize, term: u64) {
        self.tell(who, &format!("resign {term}"));
    }

    /// SIGKILLs candidate `who`; when (wall ns).
    pub fn kill(&mut self, who: usize) -> u128 {
        let _ = self.kids[who].child.kill();
        let at = wall_ns();
        self.killed.push((who, at));
        let _ = self.kids[who].child.wait();
        at
    }

    /// Sends `sig` (`STOP`, `CONT`) to candidate `who`.
    pub fn signal(&self, who: usize, sig: &str) {
        let pid = self.pid(who).to_string();
        let ok = Command::new("kill")
            .args(["-s", sig, &pid])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -s {sig} {pid}");
    }

    /// The next line any candidate writes before `until` (kept in `lines`).
    pub fn next(&mut self, until: Instant) -> Option<Line> {
        let wait = until.saturating_duration_since(Instant::now());
        let line = self.rx.recv_timeout(wait).ok()?;
        self.lines.push(line.clone());
        Some(line)
    }

    /// Reads lines for `limit`, or until one satisfies `want`: that one.
    pub fn wait_for(
        &mut self,
        limit: Duration,
        mut want: impl FnMut(&Line) -> bool,
    ) -> Option<Line> {
        let until = Instant::now() + limit;
        while let Some(l) = self.next(until) {
            if want(&l) {
                return Some(l);
            }
        }
        None
    }

    /// Reads whatever comes for `d`.
    pub fn read_for(&mut self, d: Duration) {
        let until = Instant::now() + d;
        while self.next(until).is_some() {}
    }

    /// The next `ELECTED` line within `limit` (of anyone but `not`).
    pub fn elected(&mut self, limit: Duration, not: Option<usize>) -> Option<Line> {
        self.wait_for(limit, |l| l.is("ELECTED") && Some(l.who()) != not)
    }

    /// Tells every live candidate to quit and reads their lines until they
    /// have exited (at most `limit`); whether all did.
    pub fn quit_all(&mut self, limit: Duration) -> bool {
        let live: Vec<usize> = (0..self.kids.len())
            .filter(|&w| !self.killed.iter().any(|&(k, _)| k == w))
            .collect();
        for &w in &live {
            self.tell(w, "quit");
        }
        let mut gone = 0;
        let until = Instant::now() + limit;
        while gone < live.len() {
            match self.next(until) {
                Some(l) if l.is("GONE") && live.contains(&l.who()) => gone += 1,
                Some(_) => {}
                None => return false,
            }
        }
        true
    }

    /// The lines of candidate `who` of `kind`.
    pub fn of(&self, who: usize, kind: &str) -> Vec<&Line> {
        self.lines
            .iter()
            .filter(|l| l.is(kind) && l.who() == who)
            .collect()
    }
}

impl Drop for Candidates {
    fn drop(&mut self) {
        for k in &mut self.kids {
            let _ = k.child.kill();
            let _ = k.child.wait();
        }
    }
}

// ---------------------------------------------------------------------------
// what they reported

/// A term as its leader saw it: from its election to the end of its valid
/// lease, the earlier of when it ended (resigned, or saw the loss) and its
/// validity deadline, or its death.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub who: usize,
    pub term: u64,
    pub start: u128,
    pub end: u128,
    /// `None`: still leading when the lines ran out.
    pub why: Option<&'static str>,
}

/// The leases in `lines` (killed candidates' from `killed`), by start.
pub fn leases(lines: &[Line], killed: &[(usize, u128)]) -> Vec<Lease> {
    let mut out: Vec<Lease> = Vec::new();
    // Each candidate's open term: its index in `out` and validity deadline.
    let mut open: std::collections::HashMap<usize, (usize, u128)> = Default::default();
    for l in lines {
        let who = l.who();
        match l.kind() {
            "ELECTED" => {
                open.insert(who, (out.len(), l.num(4)));
                out.push(Lease {
                    who,
                    term: l.term(),
                    start: l.at(),
                    end: u128::MAX,
                    why: None,
                });
            }
            "VALID" => {
                if let Some(o) = open.get_mut(&who) {
                    o.1 = o.1.max(l.num(3));
                }
            }
            "ENDED" => {
                if let Some((i, _)) = open.remove(&who) {
                    let why = match l.words.get(4).map(String::as_str) {
                        Some("resigned") => "resigned",
                        Some("lost") => "lost",
                        _ => "stopped",
                    };
                    out[i].end = l.at().min(l.num(5));
                    out[i].why = Some(why);
                }
            }
            _ => {}
        }
    }
    for (who, (i, deadline)) in open {
        if let Some(&(_, at)) = killed.iter().find(|&&(k, _)| k == who) {
            out[i].end = at.min(deadline);
            out[i].why = Some("killed");
        }
    }
    out.sort_by_key(|l| (l.start, l.term));
    out
}

/// Checks of a run's leases.
pub struct Leases<'a>(pub &'a [Lease]);

impl Leases<'_> {
    /// Pairs of leases that were valid at once: a lease that began before
    /// an earlier one ended.
    pub fn overlaps(&self) -> Vec<(Lease, Lease)> {
        let mut out = Vec::new();
        let mut longest: Option<Lease> = None;
        for &l in self.0 {
            if let Some(p) = longest.filter(|p| l.start < p.end) {
                out.push((p, l));
            }
            if longest.is_none_or(|p| l.end > p.end) {
                longest = Some(l);
            }
        }
        out
    }

    /// Consecutive leases (in lease order) whose terms do not rise.
    pub fn terms_not_rising(&self) -> Vec<(Lease, Lease)> {
        self.0
            .windows(2)
            .filter(|w| w[1].term <= w[0].term)
            .map(|w| (w[0], w[1]))
            .collect()
    }

    /// How many ended so.
    pub fn ended(&self, why: &str) -> usize {
        self.0.iter().filter(|l| l.why == Some(why)).count()
    }
}
