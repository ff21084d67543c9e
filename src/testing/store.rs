//! What one fake or simulated node keeps: its keys, its lock history and
//! the scripts' semantics on them (the Lua in [`crate::driver::scripts`],
//! in Rust).

use crate::algorithm::round::is_reader;
use crate::algorithm::round::After;
use crate::algorithm::round::Answer;
use crate::algorithm::round::Key;
use crate::algorithm::round::NodeFacts;
use crate::algorithm::round::Op;
use crate::algorithm::round::Reply;
use crate::algorithm::round::CLAIM_PREFIX;
use crate::clock::after;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

/// One node's data, as the scripts keep it (shared with the simulation).
#[derive(Debug)]
pub(crate) struct Store {
    /// Writers' keys: token and expiry.
    pub(crate) keys: HashMap<String, (String, Instant)>,
    /// Reader sets (never a key of `keys` too; see `readers_lua!` in
    /// [`crate::driver::scripts`]).
    pub(crate) readers: HashMap<String, Readers>,
    /// Keys an application keeps under a lock's name (of any type, without
    /// expiry; never a key of `keys` or `readers` too): every round meets
    /// another owner there, and none changes them.
    pub(crate) foreign: std::collections::HashSet<String>,
    /// Lock history: when it began, and the TTLs recorded.
    pub(crate) meta: Option<Meta>,
    /// Fencing counters, per resource (they go with the lock history).
    pub(crate) fences: HashMap<String, u64>,
    /// An election's term, per resource, with the candidate's token it is
    /// the term of (`term:<key>` in the lock history: see `FENCE_LUA`).
    pub(crate) terms: HashMap<String, (u64, String)>,
    /// The metadata's id: unique per store, new when its data is lost
    /// (what the connect-time script writes on a real node).
    pub(crate) id: u64,
    /// Rules of the scripts broken on purpose (never, but where a
    /// simulation test shows that its checkers find what that allows).
    pub(crate) broken: Broken,
}

/// Rules of the reader-writer scripts that a simulation test breaks, one
/// at a time, to show that its checkers find what each break allows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Broken {
    /// A writer's acquire takes a reader set that still has live readers
    /// (as one with none left).
    pub(crate) writer_over_readers: bool,
    /// A reader enters a key a writer holds (beside the writer's value).
    pub(crate) reader_beside_writer: bool,
    /// New readers enter while a waiting writer's intent is on the set.
    pub(crate) readers_ignore_intent: bool,
    /// An application's key under a lock's name is taken as absent.
    pub(crate) takes_foreign: bool,
}

/// A resource read-locked on a node: each reader's token and expiry, and
/// the waiting writers' intent (the sorted set `readers_lua!` keeps).
#[derive(Debug, Clone, Default)]
pub(crate) struct Readers {
    pub(crate) entries: std::collections::BTreeMap<String, Instant>,
    pub(crate) intent: Option<Instant>,
}

impl Readers {
    /// When the last reader's entry ends (none: no reader).
    pub(crate) fn last(&self) -> Option<Instant> {
        self.entries.values().max().copied()
    }

    /// Drops what ended by `now`; whether anything is left.
    fn prune(&mut self, now: Instant) -> bool {
        self.entries.retain(|_, exp| *exp > now);
        self.intent = self.intent.filter(|i| *i > now);
        !self.entries.is_empty() || self.intent.is_some()
    }
}

/// A node's lock history, as the scripts keep it in `quorumlock:meta`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meta {
    /// When the history began (`None`: a record an extension wrote on a
    /// node without history; the next acquire begins it).
    pub(crate) epoch: Option<Instant>,
    /// The longest TTL recorded.
    pub(crate) max: Duration,
    /// The longest before `max` was first used.
    pub(crate) prev: Duration,
    /// The histories `max` was first used after (empty: since always).
    pub(crate) after: After,
}

impl Meta {
    pub(crate) fn new(epoch: Option<Instant>) -> Meta {
        Meta {
            epoch,
            max: Duration::ZERO,
            prev: Duration::ZERO,
            after: After::NONE,
        }
    }

    /// The scripts' record of a command's `ttl`, with `known`, the longest
    /// its client knew of before, and `after`: for a first use of `ttl`,
    /// the histories the client knew to have begun; else the ones `known`
    /// was first used after, with `prev`, the longest before it, as the
    /// client knows them (see `raise_lua!`).
    pub(crate) fn raise(&mut self, ttl: Duration, known: Duration, after: After, prev: Duration) {
        let base = self.max.max(known);
        if ttl > base {
            (self.max, self.prev, self.after) = (ttl, base, after);
        } else if known > self.max && after.is_empty() {
            (self.max, self.prev, self.after) = (known, known, After::NONE);
        } else if known > self.max {
            (self.max, self.prev, self.after) = (known, prev.max(self.max), after);
        }
    }
}

impl Default for Store {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Store {
            keys: HashMap::new(),
            readers: HashMap::new(),
            foreign: Default::default(),
            meta: None,
            fences: HashMap::new(),
            terms: HashMap::new(),
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            broken: Broken::default(),
        }
    }
}

impl Store {
    /// The acquire script's bookkeeping: facts before this command.
    pub(crate) fn history(
        &mut self,
        (ttl, known, after, prev): (Duration, Duration, After, Duration),
        now: Instant,
        base: Instant,
    ) -> NodeFacts {
        let meta = self.meta.get_or_insert(Meta::new(Some(now)));
        let epoch = *meta.epoch.get_or_insert(now);
        let before = *meta;
        meta.raise(ttl, known, after, prev);
        NodeFacts {
            epoch: epoch_number(epoch, base),
            age: now.saturating_duration_since(epoch),
            max_ttl: before.max,
            // One key per history: a store that loses its data is a new one.
            history: self.id,
            after: before.after,
            prev_max: before.prev,
        }
    }

    /// Why the acquire script refuses a fenced acquire (before any write):
    /// a node clock or a counter at the limit of exact Lua numbers.
    pub(crate) fn refuses_fence(
        &self,
        op: Op,
        keys: &[Key<'_>],
        micros: u64,
    ) -> Option<&'static str> {
        let limit = crate::algorithm::round::FENCE_LIMIT;
        if !matches!(op, Op::Acquire { fenced: true, .. }) {
            None
        } else if micros >= limit - (1 << 40) {
            Some("the node clock is past the year 2255")
        } else if keys
            .iter()
            .any(|k| self.fences.get(k.resource).is_some_and(|&c| c >= limit))
        {
            Some("this resource's fencing counter is at its limit")
        } else {
            None
        }
    }

    /// `counter = max(counter, value)`; returns the new counter.
    pub(crate) fn raise_fence(&mut self, resource: &str, value: u64) -> u64 {
        let c = self.fences.entry(resource.into()).or_default();
        *c = (*c).max(value);
        *c
    }

    /// Runs one round's `op` on this node at `now` (its own clock; `base`
    /// is the instant its epochs count from, `micros` its wall clock), as
    /// the scripts do: the reply, or why the node refused.
    pub(crate) fn round(
        &mut self,
        op: Op,
        keys: &[Key<'_>],
        now: Instant,
        base: Instant,
        micros: u64,
    ) -> Result<Reply, &'static str> {
        if let Some(why) = self.refuses_fence(op, keys, micros) {
            return Err(why);
        }
        let facts = match op {
            Op::Acquire {
                ttl,
                known_max,
                after,
                known_prev,
                ..
            } => Some(self.history((ttl, known_max, after, known_prev), now, base)),
            Op::Swap { ttl, known_max, .. } => {
                // As an extension: the TTL recorded, no history read.
                let meta = self.meta.get_or_insert(Meta::new(None));
                meta.raise(ttl, known_max, After::NONE, known_max);
                None
            }
            Op::Extend {
                ttl,
                known_max,
                after,
                known_prev,
                ..
            } => {
                // The script writes the record even where the history is
                // gone (a hash without an epoch, which the next acquire
                // starts).
                let meta = self.meta.get_or_insert(Meta::new(None));
                meta.raise(ttl, known_max, after, known_prev);
                None
            }
            Op::Release { .. } | Op::Fence { .. } | Op::Restore { .. } => None,
        };
        let mut fence = None;
        let mut held = Vec::with_capacity(keys.len());
        self.prune(now);
        // The keys of an acquire are one lock: all set or none (see
        // `ACQUIRE_LUA`), none where any has another owner or live readers.
        // Where any has another owner, readers are not all that keeps the
        // lock out: no intent.
        let several = matches!(op, Op::Acquire { .. }) && keys.len() > 1;
        // A waiting call's place (see `Place`): a set's claims of this
        // set or of one that began after it are no owner.
        let (order, claim_life, claims) = match op {
            // (The life as sent: whole ms, rounded up.)
            Op::Acquire { place, .. } => (
                place.order(),
                Duration::from_nanos(
                    u64::try_from(place.life.as_nanos().div_ceil(1_000_000) * 1_000_000)
                        .unwrap_or(u64::MAX),
                ),
                place.keys,
            ),
            _ => (None, Duration::ZERO, 0),
        };
        let yields = |t: &str| {
            order
                .as_deref()
                .is_some_and(|o| claim_of(t).is_some_and(|c| o.len() == 28 && c >= o && several))
        };
        let owned = several
            && keys.iter().any(|k| {
                self.keys
                    .get(k.resource)
                    .is_some_and(|(t, _)| t != k.token && !yields(t))
                    || self.is_foreign(k.resource)
            });
        let taken = owned || several && keys.iter().any(|k| self.live_readers(k.resource) > 0);
        let answers: Vec<Answer> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                // How long the owner has left: a writer's key, or the last
                // reader's entry (a reader refused by an intent: no end
                // known, as the script's `0`).
                let left = match (self.keys.get(k.resource), self.readers.get(k.resource)) {
                    // An application's key, without expiry: no end known.
                    _ if self.is_foreign(k.resource) => Some(Duration::MAX),
                    (Some((_, exp)), _) => Some(exp.saturating_duration_since(now)),
                    (None, Some(_)) if is_reader(k.token) => Some(Duration::MAX),
                    (None, Some(r)) => Some(
                        r.last()
                            .map_or(Duration::ZERO, |l| l.saturating_duration_since(now)),
                    ),
                    (None, None) => None,
                };
                let claim = self.keys.get(k.resource).is_some_and(|(t, _)| yields(t));
                let (a, f) = match self.keys.get(k.resource) {
                    _ if self.is_foreign(k.resource) => (Answer::Other, None),
                    _ if taken && self.live_readers(k.resource) > 0 => {
                        if !owned {
                            self.mark_intent(op, k.resource, now);
                        }
                        (Answer::Other, None)
                    }
                    Some((t, _)) if taken && t != k.token && !claim => (Answer::Other, None),
                    Some(_) | None if taken && (claim || !self.keys.contains_key(k.resource)) => {
                        // Free, or claimed by this set or a later one: a
                        // claim while the set waits, its own gone when it
                        // stops. (Not a reader set that no reader lives in.)
                        let free = claim || !self.readers.contains_key(k.resource);
                        if let Some(o) = order.as_deref().filter(|_| several && free) {
                            let value = format!("{CLAIM_PREFIX}{o}");
                            let mine = self.keys.get(k.resource).is_some_and(|(t, _)| *t == value);
                            let wanted = i < 64 && claims & (1 << i) != 0;
                            if !claim_life.is_zero() && (mine || wanted) {
                                self.keys
                                    .insert(k.resource.into(), (value, after(now, claim_life)));
                            } else if self.keys.get(k.resource).is_some_and(|(t, _)| *t == value) {
                                self.keys.remove(k.resource);
                            }
                        }
                        (Answer::Other, None)
                    }
                    _ => {
                        // A claim that gives way: to its own set, to a set
                        // that began before, to a lock of one whose call did.
                        let gives = self.keys.get(k.resource).is_some_and(|(t, _)| {
                            claim
                                || order.as_deref().is_some_and(|o| {
                                    !several
                                        && !is_reader(k.token)
                                        && claim_of(t).is_some_and(|c| &c[..12] > o)
                                })
                        });
                        if gives {
                            self.keys.remove(k.resource);
                        }
                        self.apply(op, k, now, micros)
                    }
                };
                fence = fence.max(f);
                // (A free key of a set kept out by another, or one it
                // claims: no time left.)
                let left = if claim || left.is_none() {
                    Duration::ZERO
                } else {
                    left.unwrap_or(Duration::ZERO)
                };
                held.push(matches!((op, a), (Op::Acquire { .. }, Answer::Other)).then_some(left));
                a
            })
            .collect();
        Ok(Reply {
            answers,
            facts,
            fence,
            server: None,
            woke: 0,
            held: if held.iter().any(Option::is_some) {
                held
            } else {
                Vec::new()
            },
        })
    }

    /// Whether `resource` is an application's key here (another owner's
    /// to every round).
    fn is_foreign(&self, resource: &str) -> bool {
        self.foreign.contains(resource) && !self.broken.takes_foreign
    }

    /// The metadata's id.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The lock history's epoch as the scripts answer it (`base`: the
    /// instant epochs count from), if one has begun.
    pub(crate) fn epoch(&self, base: Instant) -> Option<u64> {
        let epoch = self.meta.as_ref()?.epoch?;
        Some(epoch_number(epoch, base))
    }

    /// The key of the lock history, as a connection made now learns it
    /// (the connect-time script, `HISTORY_ID_LUA`): 0 where none has begun.
    pub(crate) fn begun(&self) -> u64 {
        match self.meta {
            Some(Meta { epoch: Some(_), .. }) => self.id,
            _ => 0,
        }
    }

    /// A lock history that began at `epoch` (a node that has run for a
    /// while), so that its votes count from the start.
    pub(crate) fn with_history(epoch: Instant) -> Self {
        Store {
            meta: Some(Meta::new(Some(epoch))),
            ..Store::default()
        }
    }

    /// Runs `op` for one key, as the scripts do; also returns the fencing
    /// counter a fenced acquire set. `micros`: the node's clock, the floor
    /// of a counter.
    pub(crate) fn apply(
        &mut self,
        op: Op,
        k: &Key<'_>,
        now: Instant,
        micros: u64,
    ) -> (Answer, Option<u64>) {
        if self.is_foreign(k.resource) {
            return (Answer::Other, None);
        }
        if is_reader(k.token) {
            return (self.apply_reader(op, k, now), None);
        }
        if let (Op::Acquire { fenced, .. }, Some((t, exp))) = (op, self.keys.get(k.resource)) {
            if t == k.token && *exp > now {
                // This attempt's own SET, sent again: set, with its counter.
                let fence = fenced.then(|| self.fences.get(k.resource).copied().unwrap_or(0));
                return (Answer::Ok, fence);
            }
        }
        let answer = self.apply_key(op, k, now);
        let fence = match (op, answer) {
            (Op::Acquire { fenced: true, .. }, Answer::Ok) => {
                let next = self.fences.get(k.resource).map_or(0, |c| c + 1);
                Some(self.raise_fence(k.resource, next.max(micros)))
            }
            _ => None,
        };
        (answer, fence)
    }

    /// A plain `SET key token NX PX ttl` (the lean acquire's): whether it
    /// set the key. A key of any owner or type under the name stays as it
    /// is (an application's too, unless that rule is broken on purpose).
    pub(crate) fn set_nx(&mut self, k: &Key<'_>, ttl: Duration, now: Instant) -> bool {
        self.prune(now);
        if self.keys.contains_key(k.resource)
            || self.readers.contains_key(k.resource)
            || self.is_foreign(k.resource)
        {
            return false;
        }
        self.keys
            .insert(k.resource.into(), (k.token.into(), after(now, ttl)));
        true
    }

    /// `PTTL key` in ms: -2 where absent, -1 where it never expires (an
    /// application's key); a reader set lives as long as its last entry
    /// or the intent on it.
    pub(crate) fn pttl(&mut self, resource: &str, now: Instant) -> i64 {
        self.prune(now);
        let left = |exp: Instant| {
            i64::try_from(exp.saturating_duration_since(now).as_millis()).unwrap_or(i64::MAX)
        };
        if let Some((_, exp)) = self.keys.get(resource) {
            return left(*exp);
        }
        if let Some(r) = self.readers.get(resource) {
            let last = r.entries.values().copied().chain(r.intent).max();
            return last.map_or(-2, left);
        }
        if self.is_foreign(resource) {
            return -1;
        }
        -2
    }

    /// Drops the keys and reader entries that ended by `now`.
    pub(crate) fn prune(&mut self, now: Instant) {
        self.keys.retain(|_, (_, exp)| *exp > now);
        self.readers.retain(|_, r| r.prune(now));
    }

    /// The live readers of `resource` (after [`prune`](Self::prune)).
    pub(crate) fn live_readers(&self, resource: &str) -> usize {
        self.readers.get(resource).map_or(0, |r| r.entries.len())
    }

    /// Until when (live or not) `resource` holds a copy of lineage
    /// `lineage` (see [`ours`](crate::algorithm::round::ours)): a writer's
    /// key, or a reader's entry (a reader's token is its own lineage).
    pub(crate) fn expiry(&self, resource: &str, lineage: &str) -> Option<Instant> {
        match self.keys.get(resource) {
            Some((t, exp)) if t.split('.').next() == Some(lineage) => Some(*exp),
            _ => self
                .readers
                .get(resource)
                .and_then(|r| r.entries.get(lineage).copied()),
        }
    }

    /// Every writer's key and reader's entry: resource, token, expiry.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (&str, &str, Instant)> {
        // (A set's claim is no lock's copy.)
        let writers = self
            .keys
            .iter()
            .filter(|(_, (t, _))| !t.starts_with(CLAIM_PREFIX))
            .map(|(r, (t, exp))| (r.as_str(), t.as_str(), *exp));
        let readers = self.readers.iter().flat_map(|(r, rs)| {
            rs.entries
                .iter()
                .map(move |(t, exp)| (r.as_str(), t.as_str(), *exp))
        });
        writers.chain(readers)
    }

    /// A writer's acquire that found live readers: with an intent, no new
    /// reader enters for that long.
    fn mark_intent(&mut self, op: Op, resource: &str, now: Instant) {
        if let (Op::Acquire { intent, .. }, Some(r)) = (op, self.readers.get_mut(resource)) {
            if !intent.is_zero() {
                let until = after(now, intent);
                r.intent = Some(r.intent.map_or(until, |i| i.max(until)));
            }
        }
    }

    /// What `op` does to a reader's entry (see `readers_lua!`).
    fn apply_reader(&mut self, op: Op, k: &Key<'_>, now: Instant) -> Answer {
        self.prune(now);
        if self.keys.contains_key(k.resource) && !self.broken.reader_beside_writer {
            // A writer's key.
            return Answer::Other;
        }
        let set = self.readers.get(k.resource);
        let mine = set.is_some_and(|r| r.entries.contains_key(k.token));
        let exists = set.is_some();
        let waits = set.is_some_and(|r| r.intent.is_some()) && !self.broken.readers_ignore_intent;
        let mut enter = |ttl: Duration| {
            let r = self.readers.entry(k.resource.to_owned()).or_default();
            let until = after(now, ttl);
            let e = r.entries.entry(k.token.to_owned()).or_insert(until);
            *e = (*e).max(until);
        };
        match op {
            // This attempt's own entry, sent again.
            Op::Acquire { .. } if mine => Answer::Ok,
            // A writer waits: no new reader.
            Op::Acquire { .. } if waits => Answer::Other,
            Op::Acquire { ttl, .. } => {
                enter(ttl);
                Answer::Ok
            }
            Op::Extend { ttl, .. } if mine => {
                enter(ttl);
                Answer::Ok
            }
            Op::Restore { .. } if mine => Answer::Ok,
            Op::Restore { ttl } => {
                enter(ttl);
                Answer::Restored
            }
            Op::Release { .. } if mine => {
                if let Some(r) = self.readers.get_mut(k.resource) {
                    r.entries.remove(k.token);
                }
                self.prune(now);
                Answer::Ok
            }
            Op::Release { .. } | Op::Extend { .. } => Answer::Absent,
            // Never a reader's round: as the scripts meet a set.
            Op::Swap { .. } | Op::Fence { .. } if exists => Answer::Other,
            Op::Swap { .. } | Op::Fence { .. } => Answer::Absent,
        }
    }

    /// What `op` does to one key.
    pub(crate) fn apply_key(&mut self, op: Op, k: &Key<'_>, now: Instant) -> Answer {
        self.prune(now);
        if self.readers.contains_key(k.resource) {
            // A reader set: a writer's acquire takes it where no reader
            // lives (the intent served); every other round of a writer
            // meets another owner.
            match op {
                Op::Acquire { .. }
                    if self.live_readers(k.resource) == 0 || self.broken.writer_over_readers =>
                {
                    self.readers.remove(k.resource);
                }
                _ => {
                    self.mark_intent(op, k.resource, now);
                    return Answer::Other;
                }
            }
        }
        match (op, self.keys.get(k.resource)) {
            (Op::Acquire { ttl, .. }, None) => {
                self.keys
                    .insert(k.resource.into(), (k.token.into(), after(now, ttl)));
                Answer::Ok
            }
            (Op::Acquire { .. }, Some(_)) => Answer::Other,
            (Op::Restore { ttl }, None) => {
                self.keys
                    .insert(k.resource.into(), (k.token.into(), after(now, ttl)));
                Answer::Restored
            }
            (Op::Restore { .. }, Some((t, _))) if t == k.token => Answer::Ok,
            (Op::Restore { .. }, Some(_)) => Answer::Other,
            (_, None) => Answer::Absent,
            // This swap, sent again: done already.
            (Op::Swap { .. }, Some((t, _))) if k.next.is_some_and(|n| n == t) => Answer::Ok,
            (Op::Release { .. } | Op::Swap { .. }, Some((t, _)))
                if !crate::algorithm::round::ours(t, k.token) =>
            {
                Answer::Other
            }
            (Op::Extend { .. } | Op::Fence { .. }, Some((t, _))) if t != k.token => Answer::Other,
            (Op::Fence { value }, Some(_)) => {
                self.raise_fence(k.resource, value);
                if k.token.contains('@') {
                    let term = (value, k.token.to_owned());
                    self.terms.insert(k.resource.into(), term);
                }
                Answer::Ok
            }
            (Op::Release { .. }, Some(_)) => {
                self.keys.remove(k.resource);
                Answer::Ok
            }
            (Op::Extend { ttl, .. }, Some(&(_, expiry))) => {
                // Never shortens (the script's PTTL check).
                let expiry = expiry.max(after(now, ttl));
                self.keys
                    .insert(k.resource.into(), (k.token.into(), expiry));
                Answer::Ok
            }
            (Op::Swap { fence, .. }, Some(&(_, expiry))) => {
                let next = k.next.unwrap_or(k.token);
                self.keys.insert(k.resource.into(), (next.into(), expiry));
                if let Some(f) = fence {
                    self.raise_fence(k.resource, f);
                }
                Answer::Ok
            }
        }
    }
}

/// An epoch as a number, as the scripts answer it (never 0).
fn epoch_number(epoch: Instant, base: Instant) -> u64 {
    u64::try_from(epoch.saturating_duration_since(base).as_nanos()).unwrap_or(0) + 1
}

/// A set's claim's order, where `value` is one (see `claim` in the acquire
/// script): the prefix, then 28 hex digits. (Every key the model keeps has
/// a TTL; an application's keys are `foreign`.)
fn claim_of(value: &str) -> Option<&str> {
    value
        .strip_prefix(CLAIM_PREFIX)
        .filter(|c| c.len() == 28 && c.bytes().all(|b| b.is_ascii_hexdigit()))
}
