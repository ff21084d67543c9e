//! What one connection owes: the commands sent on it whose replies have not
//! been read, oldest first, and the bytes not yet handed to the socket. No
//! I/O: the connection writes [`ConnState::output`], and hands every reply it
//! reads to [`ConnState::answer`], which pairs it with the command it answers.
//!
//! A round that ended before a slow node answered leaves its reply owed
//! here, marked no longer wanted: the next user of the connection reads it
//! first, and what it says (a SET that landed after all, a NOSCRIPT) is
//! acted on by [`crate::driver::node`]'s late-reply rules.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::Value;

use crate::algorithm::round::ServerTag;

/// Why a multiplexed connection was given up: a reply on it was owed past the node timeout
/// (observed once, by whoever gave it up).
#[derive(Debug)]
struct GivenUp;

impl std::fmt::Display for GivenUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the connection was given up: a reply on it was owed past the node timeout")
    }
}

impl std::error::Error for GivenUp {}

/// The error a multiplexed connection ends with when it is given up.
pub(crate) fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, GivenUp)
}

/// Whether `e` says a shared connection was given up after a timeout (not
/// the node's close, nor a socket error).
pub(crate) fn is_given_up(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|r| r.is::<GivenUp>())
}

/// What a command sent at connect asks, for its reply to be understood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Setup {
    /// Not a setup command.
    None,
    /// `SCRIPT LOAD`: the reply is dropped (an error means rounds send EVAL).
    Load,
    /// `INFO`: who the server is and whether it can keep locks.
    Info,
    /// The metadata's id (see [`crate::driver::scripts::HISTORY_ID_LUA`]).
    History,
}

/// One reply the connection still owes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InFlight {
    /// When the command was queued.
    pub sent: Instant,
    /// How many keys the command names: its reply may take a node timeout
    /// more per 200 before the node is charged a timeout (see
    /// [`allowance`](crate::algorithm::round::allowance)). One for a
    /// command that names none.
    pub keys: usize,
    /// Whether the current round waits for it (else it is read and dropped).
    pub wanted: bool,
    /// For an acquire or a swap whose round ended without its reply: the
    /// release that undoes it, sent on this connection (after the SET) if
    /// the late reply says it was set and the lock was released meanwhile,
    /// or before the connection is given up.
    pub undo: Option<Vec<u8>>,
    /// For a command that may write a key of ours (an acquire, a swap, a
    /// restore) whose round ended without its reply: its tokens, whose write
    /// may still land (until this reply is read).
    pub tokens: Vec<String>,
    /// For a command sent at connect: what it asks.
    pub setup: Setup,
    /// For a release whose round ended without its reply: the same release
    /// as `EVAL`, sent if the late reply is NOSCRIPT (a delete is never lost).
    pub resend: Option<Vec<u8>>,
    /// For a retried release: the tokens of its batch, which leave the
    /// node's retry queue once the node answers it.
    pub retried: Vec<String>,
    /// On a connection several rounds share (see
    /// [`crate::driver::node::multiplexed`]): whose command this is (0: the
    /// connection's own, and what it owes is in this entry; another: a
    /// round's, whose own connection state holds the entry).
    pub owner: u64,
    /// How many frames the reply is: 1, or several for a command of
    /// several (the lean acquire, see
    /// [`Op::Acquire`](crate::algorithm::round::Op::Acquire)), whose reply
    /// is handed out as one array once all are read.
    pub frames: usize,
}

/// A command's entry as it is carried onto a shared connection: when it
/// was queued, how many keys it names ([`InFlight::keys`]) and how many
/// frames its reply is ([`InFlight::frames`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owed {
    pub sent: Instant,
    pub keys: usize,
    pub frames: usize,
}

impl InFlight {
    fn new(sent: Instant, wanted: bool, setup: Setup) -> Self {
        InFlight {
            sent,
            keys: 1,
            wanted,
            undo: None,
            tokens: Vec::new(),
            setup,
            resend: None,
            retried: Vec::new(),
            owner: 0,
            frames: 1,
        }
    }
}

/// The protocol state of one connection.
#[derive(Debug)]
pub(crate) struct ConnState {
    /// Commands queued and not yet taken by the socket (see
    /// [`written`](Self::written)).
    out: Vec<u8>,
    pending: VecDeque<InFlight>,
    /// Must not be reused: an error, a timeout, a half-written command.
    pub broken: bool,
    /// When the connection was made.
    pub made: Instant,
    /// Who is at the other end, as its `INFO` and lock history said (read
    /// ahead of the first round's reply).
    pub server: ServerTag,
    /// When `INFO` was last asked on this connection.
    pub info_at: Instant,
    /// The server's uptime as its last `INFO` said, less a second (its
    /// resolution), and when that reply was read; `None` when refused.
    pub uptime: Option<(Duration, Instant)>,
    /// The server's `run_id`, as its last `INFO` said.
    pub run_id: Option<Arc<str>>,
    /// The last lock history's epoch seen on this connection, and its key
    /// (see [`crate::algorithm::round::history_key`]).
    pub history_key: Option<(u64, u64)>,
    /// Returned to the pool owing replies: counted in this counter (the
    /// node's idle connections that owe replies) until a checkout reads
    /// them or the connection is dropped.
    pub owing: Option<Arc<AtomicUsize>>,
    /// Commands queued on this connection state so far.
    pushed: u64,
    /// Of those, the ones carried onto a shared connection (see
    /// [`take_uncarried`](Self::take_uncarried)).
    carried: u64,
    /// Bumped by each reply that changes what the connection knows of its
    /// server ([`Facts`]).
    pub facts_seq: u64,
    /// The frames read so far of a reply of several (see
    /// [`InFlight::frames`]).
    partial: Vec<Value>,
}

/// What a connection knows of its server, as the replies read on it so
/// far said: what a round's reply is read against.
#[derive(Debug, Clone)]
pub(crate) struct Facts {
    server: ServerTag,
    uptime: Option<(Duration, Instant)>,
    run_id: Option<Arc<str>>,
}

impl Drop for ConnState {
    fn drop(&mut self) {
        if let Some(n) = self.owing.take() {
            n.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl ConnState {
    /// A lower bound on the server's uptime when it ran a command sent at
    /// `sent` on this connection: at least its last `INFO`'s, plus the time
    /// from reading that reply to sending the command, less 1 % (the two
    /// clocks' rates may differ).
    pub(crate) fn uptime_at(&self, sent: Instant) -> Option<Duration> {
        let (up, read) = self.uptime?;
        let since = sent.saturating_duration_since(read);
        Some(up.saturating_add(crate::clock::slower(since)))
    }

    /// The connection goes back to its pool, to idle: one that owes replies
    /// is counted in `owing` (the node's idle connections that owe some,
    /// which the retry job drains), once. Returns whether it is broken (to
    /// be dropped, which uncounts it).
    pub(crate) fn idles(&mut self, owing: &Arc<AtomicUsize>) -> bool {
        if !self.broken && self.owing.is_none() && !self.pending.is_empty() {
            owing.fetch_add(1, Ordering::AcqRel);
            self.owing = Some(owing.clone());
        }
        self.broken
    }

    /// A connection made at `now`, owing nothing.
    pub(crate) fn new(now: Instant) -> Self {
        ConnState {
            out: Vec::new(),
            pending: VecDeque::new(),
            broken: false,
            made: now,
            server: ServerTag::default(),
            info_at: now,
            uptime: None,
            run_id: None,
            history_key: None,
            owing: None,
            pushed: 0,
            carried: 0,
            facts_seq: 0,
            partial: Vec::new(),
        }
    }

    /// What it knows of its server now.
    pub(crate) fn facts(&self) -> Facts {
        Facts {
            server: self.server,
            uptime: self.uptime,
            run_id: self.run_id.clone(),
        }
    }

    /// Takes what the shared connection knew of its server when it read
    /// the reply this round takes next.
    pub(crate) fn adopt(&mut self, f: Facts) {
        if self.run_id != f.run_id {
            self.history_key = None;
        }
        self.server = f.server;
        self.uptime = f.uptime;
        self.run_id = f.run_id;
    }

    /// A round's own connection state on a shared connection (whose own state is `line`): what
    /// the connection knows of its server, owing nothing.
    pub(crate) fn joining(line: &ConnState) -> Self {
        let mut w = ConnState::new(line.made);
        w.server = line.server;
        w.info_at = line.info_at;
        w.uptime = line.uptime;
        w.run_id = line.run_id.clone();
        w.history_key = line.history_key;
        w.facts_seq = line.facts_seq;
        w
    }

    /// Hands over what was queued since the last call, for a shared
    /// connection to carry: the bytes (appended to `bytes`) and, per
    /// command, when it was queued and how many keys it names (given to
    /// `sent`, oldest first). Returns how many commands.
    pub(crate) fn take_uncarried(&mut self, bytes: &mut Vec<u8>, sent: impl FnMut(Owed)) -> usize {
        let n = usize::try_from(self.pushed.saturating_sub(self.carried)).unwrap_or(usize::MAX);
        let skip = self.pending.len().saturating_sub(n);
        self.pending
            .iter()
            .skip(skip)
            .map(|p| Owed {
                sent: p.sent,
                keys: p.keys,
                frames: p.frames,
            })
            .for_each(sent);
        bytes.extend_from_slice(&self.out);
        self.out.clear();
        self.carried = self.pushed;
        n
    }

    /// Carries rounds' commands onto this shared connection's own state: their
    /// bytes, and one entry per command (its owner, when it was queued,
    /// and how many keys it names) that says whose reply it is.
    pub(crate) fn carry(&mut self, bytes: &[u8], cmds: impl Iterator<Item = (u64, Owed)>) {
        self.out.extend_from_slice(bytes);
        for (owner, o) in cmds {
            let mut p = InFlight::new(o.sent, false, Setup::None);
            p.owner = owner;
            p.keys = o.keys;
            p.frames = o.frames;
            self.pending.push_back(p);
        }
    }

    /// The connection is no longer shared: each entry of another owner is
    /// replaced by that owner's own (`take` gives it, oldest first). False
    /// (and the connection broken) when one is missing.
    pub(crate) fn unshare(&mut self, mut take: impl FnMut(u64) -> Option<InFlight>) -> bool {
        for p in &mut self.pending {
            if p.owner != 0 {
                match take(p.owner) {
                    Some(mut own) => {
                        own.owner = 0;
                        *p = own;
                    }
                    None => {
                        self.broken = true;
                        return false;
                    }
                }
            }
        }
        true
    }

    /// The bytes queued and not yet written.
    pub(crate) fn output(&self) -> &[u8] {
        &self.out
    }

    /// The socket took the first `n` bytes of [`output`](Self::output).
    pub(crate) fn written(&mut self, n: usize) {
        self.out.drain(..n.min(self.out.len()));
    }

    /// Pairs a reply read off the connection with the command it answers,
    /// the oldest one owed. A reply to no command marks it broken. (A
    /// socket parses the frame first, see [`answered`](Self::answered);
    /// the simulation's connections carry parsed replies.)
    pub(crate) fn answer(&mut self, v: Value) -> io::Result<(InFlight, Value)> {
        Ok((self.answered()?, v))
    }

    /// A frame read off the connection (parsed): the reply to the oldest
    /// command owed once all its frames are in (see [`InFlight::frames`]),
    /// as one array where it has several.
    pub(crate) fn gather(&mut self, v: Value) -> io::Result<Option<(InFlight, Value)>> {
        let frames = self.pending.front().map_or(1, |p| p.frames);
        if frames <= 1 {
            return self.answer(v).map(Some);
        }
        self.partial.push(v);
        if self.partial.len() < frames {
            return Ok(None);
        }
        let items = std::mem::take(&mut self.partial);
        Ok(Some((self.answered()?, Value::Array(items))))
    }

    /// The last command queued answers in `frames` frames (see
    /// [`InFlight::frames`]).
    pub(crate) fn last_frames(&mut self, frames: usize) {
        if let Some(p) = self.pending.back_mut() {
            p.frames = frames.max(1);
        }
    }

    /// A reply to the oldest command owed has arrived (whether or not it
    /// parses, that command is answered): takes it off the list. A reply
    /// to no command marks the connection broken.
    pub(crate) fn answered(&mut self) -> io::Result<InFlight> {
        match self.pending.pop_front() {
            Some(p) => Ok(p),
            None => Err(self.protocol_error("reply to no command")),
        }
    }

    /// Marks the connection broken by bytes that are not what was owed.
    pub(crate) fn protocol_error(&mut self, what: &str) -> io::Error {
        self.broken = true;
        io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
    }

    /// Appends bytes no reply is paired with (a subscriber connection's
    /// commands, whose answers are read as frames: see `Conn::next_frame`).
    pub(crate) fn queue_unpaired(&mut self, cmd: &[u8]) {
        self.out.extend_from_slice(cmd);
    }

    /// Appends a command; its reply is expected in order after the others.
    pub(crate) fn queue(&mut self, cmd: &[u8], now: Instant, wanted: bool) {
        self.push(cmd, now, wanted, Setup::None);
    }

    /// [`queue`](Self::queue) for a command that names `keys` keys (see
    /// [`InFlight::keys`]).
    pub(crate) fn queue_keys(&mut self, cmd: &[u8], now: Instant, wanted: bool, keys: usize) {
        self.push(cmd, now, wanted, Setup::None);
        if let Some(p) = self.pending.back_mut() {
            p.keys = keys.max(1);
        }
    }

    /// Appends a command sent at connect, whose reply is read and dropped.
    pub(crate) fn queue_setup(&mut self, cmd: &[u8], now: Instant, setup: Setup) {
        self.push(cmd, now, false, setup);
    }

    fn push(&mut self, cmd: &[u8], now: Instant, wanted: bool, setup: Setup) {
        self.out.extend_from_slice(cmd);
        self.pushed += 1;
        self.pending.push_back(InFlight::new(now, wanted, setup));
    }

    /// Appends a retried release no round waits for (see
    /// [`InFlight::retried`]); `resend` is the same release as `EVAL`.
    pub(crate) fn queue_retry(
        &mut self,
        cmd: &[u8],
        now: Instant,
        resend: Vec<u8>,
        retried: Vec<String>,
    ) {
        self.queue_unwanted(cmd, now, |p| {
            p.resend = Some(resend);
            p.keys = retried.len().max(1);
            p.retried = retried;
        });
    }

    /// Appends a command no round waits for, its pending entry completed
    /// by `complete`.
    pub(crate) fn queue_unwanted(
        &mut self,
        cmd: &[u8],
        now: Instant,
        complete: impl FnOnce(&mut InFlight),
    ) {
        self.push(cmd, now, false, Setup::None);
        if let Some(p) = self.pending.back_mut() {
            complete(p);
        }
    }

    /// The connection is given up: queues (not waited for) the undo of
    /// every acquire still in flight, and every release again as `EVAL` (a
    /// release whose reply never came may have met NOSCRIPT; deleting twice
    /// is harmless). True when something was queued to send.
    pub(crate) fn give_up(&mut self, now: Instant) -> bool {
        let undos: Vec<(Vec<u8>, usize)> = self
            .pending
            .iter_mut()
            .filter_map(|p| Some((p.undo.take().or_else(|| p.resend.take())?, p.keys)))
            .collect();
        if undos.is_empty() || self.broken {
            return false;
        }
        for (u, keys) in &undos {
            self.queue_keys(u, now, false, *keys);
        }
        true
    }

    /// Replies still owed, oldest first.
    pub(crate) fn pending(&self) -> &VecDeque<InFlight> {
        &self.pending
    }

    /// Whether a release whose reply has not been read is owed.
    pub(crate) fn owes_release(&self) -> bool {
        self.pending.iter().any(|p| p.resend.is_some())
    }

    /// Whether a reply the current round waits for is still owed.
    pub(crate) fn awaits_wanted(&self) -> bool {
        self.pending.iter().any(|p| p.wanted)
    }

    /// The round is over: replies still owed are read and dropped later;
    /// `tokens` are those whose write may still land until such a reply is
    /// read, and `undo` (for an acquire or a swap) is sent if it says set.
    /// For a release whose keys (tokens `retried`) its round queued for the
    /// retry job, its late reply takes them off the queue, as a retried
    /// release's does (see [`InFlight::retried`]), so that a delete the
    /// node did run is not sent again.
    pub(crate) fn unwant(
        &mut self,
        undo: Option<&[u8]>,
        tokens: &[String],
        resend: Option<&[u8]>,
        retried: &[String],
    ) {
        for p in &mut self.pending {
            if p.wanted {
                p.wanted = false;
                p.undo = undo.map(<[u8]>::to_vec);
                p.tokens = tokens.to_vec();
                p.resend = resend.map(<[u8]>::to_vec);
                p.retried = retried.to_vec();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply of several frames (the lean acquire's) is handed out once
    /// all its frames are read, as one array, between single ones.
    #[test]
    fn a_reply_of_several_frames_is_handed_out_whole() {
        let now = Instant::now();
        let mut w = ConnState::new(now);
        w.queue(b"PING", now, true);
        w.queue(b"SET PTTL HGET", now, true);
        w.last_frames(3);
        w.queue(b"DEL", now, true);
        let mut one = |v: Value| w.gather(v).expect("owed").map(|(p, v)| (p.frames, v));
        let pong = Value::SimpleString("PONG".into());
        assert_eq!(one(pong.clone()), Some((1, pong)));
        assert_eq!(one(Value::Okay), None);
        assert_eq!(one(Value::Int(5000)), None);
        let whole = Value::Array(vec![Value::Okay, Value::Int(5000), Value::Nil]);
        assert_eq!(one(Value::Nil), Some((3, whole)));
        assert_eq!(one(Value::Int(1)), Some((1, Value::Int(1))));
        assert!(w.gather(Value::Int(2)).is_err(), "a reply to no command");
    }
}
