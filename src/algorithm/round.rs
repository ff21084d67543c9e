//! The words of a round: the operation sent to every node, the keys it
//! names, and what each node answered (with the facts a reply carries for
//! the delayed-restart rule). Data only; drivers encode and parse it.

use std::time::{Duration, Instant};

use crate::error::NodeError;

/// The node's own lock metadata (a hash, no TTL): `epoch`, the node time in
/// ms when it first carried a lock; `max_ttl`, the longest TTL in use, with
/// `after` and `prev_max` (the histories it was first used after, and the
/// longest before it: see `raise_lua!` in
/// [`crate::driver::scripts`]); `id`, the history's id.
/// It disappears exactly when the node loses its data, which is what the
/// delayed-restart rule needs to know. Not usable as a resource name.
pub(crate) const META_KEY: &str = "quorumlock:meta";

/// The largest fencing counter: Lua's numbers are doubles, exact only up
/// to 2^53, so a counter past it could round `+ 1` away (two sections with
/// one token). A fenced acquire meeting a counter at this limit, or a node
/// clock within 2^40 µs (12 days) of it, in the year 2255, fails with an
/// error instead.
pub(crate) const FENCE_LIMIT: u64 = (1 << 53) - 1;

/// Keys a round carries per node timeout: a round of more keys waits for a
/// node one node timeout more per this many (see [`allowance`]). Measured
/// on two cores with three local nodes and a debug client: a round of
/// 8,256 keys took 60–150 ms idle, and up to 1.3 s with another cargo build
/// running; per 1,000 keys (450 ms for that set) it failed there most
/// times, per 200 (2.1 s) it never did.
pub(crate) const KEYS_PER_TIMEOUT: usize = 200;

/// How long a round of `keys` keys waits for a node's reply, and how long a
/// reply may take before the node is charged a timeout: the node timeout,
/// plus one more per [`KEYS_PER_TIMEOUT`] keys (the node runs them all in
/// one script, and the client encodes and reads them all). Every round
/// kind is bounded by it (acquire, release, extend, restore, swap, fence,
/// an undo, a retried release); a round of fewer than 200 keys, a lone
/// lock's above all, gets exactly the node timeout. Saturates.
pub(crate) fn allowance(node_timeout: Duration, keys: usize) -> Duration {
    let scale = u32::try_from(keys / KEYS_PER_TIMEOUT).map_or(u32::MAX, |n| n.saturating_add(1));
    node_timeout.saturating_mul(scale)
}

/// One lock's identity on a node: the key and our token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Key<'a> {
    pub resource: &'a str,
    pub token: &'a str,
    /// For [`Op::Swap`]: the token that replaces `token`.
    pub next: Option<&'a str>,
}

impl<'a> Key<'a> {
    pub(crate) fn new(resource: &'a str, token: &'a str) -> Self {
        Key {
            resource,
            token,
            next: None,
        }
    }
}

/// The keys whose tokens a round of `op` writes, as keys to release: a
/// swap's new token (whose lineage also covers the old one, see `ours`),
/// else the keys themselves.
pub(crate) fn written<'a>(op: Op, keys: &[Key<'a>]) -> Vec<Key<'a>> {
    match op {
        Op::Swap { .. } => keys
            .iter()
            .map(|k| Key::new(k.resource, k.next.unwrap_or(k.token)))
            .collect(),
        _ => keys.to_vec(),
    }
}

/// Whether a key's value `v` belongs to token `t`, as the release and swap
/// scripts decide: `v` is `t` or, for a handed-over lock's token `L.S`, any
/// token of lineage `L` (`L` itself or `L.*`). The fake nodes' copy.
#[cfg(test)]
pub(crate) fn ours(v: &str, t: &str) -> bool {
    if v == t {
        return true;
    }
    match t.split_once('.') {
        Some((lineage, _)) => v == lineage || v.split_once('.').is_some_and(|(l, _)| l == lineage),
        None => false,
    }
}

/// Whether `token` is a reader's (a read lock, shared with other readers:
/// see `LockRequest::read`): it begins with `r`, where a writer's
/// token is hexadecimal. Every script decides by it what the key must be
/// (a reader set, or a writer's value), so that every round, its retries
/// and undo, a renewal batch and a restore carry readers and writers alike.
pub(crate) fn is_reader(token: &str) -> bool {
    token.as_bytes().first() == Some(&b'r')
}

/// Whether `value`, stored under a lock's name, has the shape of a
/// writer's token this crate writes: 32 lowercase hex digits (see
/// `crate::clock::new_token`), for a candidate of an election followed by
/// `@` and its id in hex (see [`candidate_of`]), perhaps followed by a
/// section's `.` and 16 more (`crate::clock::section_token`). Any other
/// value is not a lock's: `inspect` calls it so (the scripts never take it
/// for ours either: they compare whole tokens).
pub(crate) fn is_token(value: &str) -> bool {
    let (lineage, section) = match value.split_once('.') {
        Some((l, s)) => (l, Some(s)),
        None => (value, None),
    };
    let (random, id) = match lineage.split_once('@') {
        Some((r, id)) => (r, Some(id)),
        None => (lineage, None),
    };
    is_hex(random)
        && random.len() == 32
        && section.is_none_or(|s| is_hex(s) && s.len() == 16)
        && id.is_none_or(|id| candidate_of_hex(id).is_some())
}

/// Whether `s` is lowercase hex digits only.
fn is_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The id of the election's candidate whose token is `token` (see
/// `crate::election`): what its lineage carries after `@`, in hex.
pub(crate) fn candidate_of(token: &str) -> Option<String> {
    let lineage = token.split('.').next()?;
    candidate_of_hex(lineage.split_once('@')?.1)
}

/// A candidate's id from its hex: 1 to `MAX_ID_LEN` bytes of UTF-8.
fn candidate_of_hex(hex: &str) -> Option<String> {
    if hex.is_empty()
        || !hex.len().is_multiple_of(2)
        || hex.len() > 2 * crate::MAX_ID_LEN
        || !is_hex(hex)
    {
        return None;
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}

/// A candidate's id as its token carries it (see [`candidate_of`]).
pub(crate) fn candidate_hex(id: &str) -> String {
    id.bytes().map(|b| format!("{b:02x}")).collect()
}

/// A waiting writer's place among the waiters of its keys, in the order
/// their calls began: a lock of several that another key keeps out claims
/// each key it waited for once that key is free, and a claim gives way to
/// a call that began before the set's (see `ACQUIRE_LUA`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Place {
    /// When the call began, in ms of the wall clock (the one order every
    /// process and node shares; only fairness rests on it). 0: no place
    /// (the call does not wait).
    pub since: u64,
    /// A lock of several's claim: its id, random per call (0: a lock of
    /// one, which claims nothing).
    pub claim: u64,
    /// How long the set's claims live (zero: its claims go).
    pub life: Duration,
    /// The keys a set claims where free (bit `i`: the `i`-th key; the
    /// keys its last try found held): its claims already made stay.
    pub keys: u64,
}

impl Place {
    /// No place: a call that does not wait.
    pub(crate) const NONE: Place = Place {
        since: 0,
        claim: 0,
        life: Duration::ZERO,
        keys: 0,
    };

    /// The keys to claim of a set of `n`, as the script reads them: `1`
    /// for each key to claim, `0` for the others.
    pub(crate) fn mask(&self, n: usize) -> String {
        (0..n)
            .map(|i| {
                if i < 64 && self.keys & (1 << i) != 0 {
                    '1'
                } else {
                    '0'
                }
            })
            .collect()
    }

    /// The place as the script reads it: `since` in 12 hex digits, then a
    /// set's id in 16 (`None`: no place).
    pub(crate) fn order(&self) -> Option<String> {
        match (self.since, self.claim) {
            (0, _) => None,
            (s, 0) => Some(format!("{:012x}", s.min(0xffff_ffff_ffff))),
            (s, c) => Some(format!("{:012x}{c:016x}", s.min(0xffff_ffff_ffff))),
        }
    }
}

/// The value of a key a waiting set claims: this prefix, then its
/// [`Place::order`] (no token of a lock begins with a NUL).
pub(crate) const CLAIM_PREFIX: &str = "\0claim:";

/// What to do to every key of a round, on every node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// `SET key token NX PX ttl`, in a script that also records `known_max`
    /// (the longest TTL the client knows to be in use) on the node and
    /// reports the node's [`NodeFacts`]. `fenced`: where set, the key's
    /// fencing counter is advanced and reported in [`Reply::fence`].
    Acquire {
        ttl: Duration,
        known_max: Duration,
        fenced: bool,
        /// Where `ttl` is longer than `known_max` (a first use): the lock
        /// histories the client knows to have begun, recorded with `ttl`.
        /// Otherwise the histories `known_max` was first used after, as
        /// the client knows (empty: in use since always), recorded with it
        /// where the node does not know it yet.
        after: After,
        /// With a non-empty `after` and no first use: the longest TTL in
        /// use before `known_max` was first used, as the client knows.
        known_prev: Duration,
        /// A writer that will try again: where live readers hold a key,
        /// no new reader enters it for this long (zero: none; see
        /// [`is_reader`]).
        intent: Duration,
        /// A waiting call's place among the waiters of its keys (see
        /// [`Place`]).
        place: Place,
        /// The lean form: plain `SET key token NX PX ttl`, `PTTL key` and
        /// `HMGET` of the lock history's epoch and id, read after the SET,
        /// in one write; no script. Only for one writer's key, unfenced,
        /// with no intent and no TTL to record, where every node's history
        /// was read before and counts (see `Engine::lean`): the node
        /// layer answers with the facts last read on that node where the
        /// history read after the SET is the same one, and holds the vote
        /// back where it is not (a flush, an eviction, a restart). The
        /// value is the generation of the reads the decision saw: a reply
        /// is checked only against those (see `Read::gen`).
        lean: Option<u64>,
    },
    /// Delete the key if it holds our token. A node that does not answer is
    /// asked again in the background until `keep_until` (when every key of
    /// the round has expired anyway). `notice`: where not 0, a deleted key
    /// is published with it (the wake-ups of other clients' waiters; one
    /// release's messages on every node carry the same notice, so that a
    /// waiter counts them once). An undo or a retry sends 0: a failed
    /// attempt's undo woke its own waiter into a loop of attempts.
    Release { keep_until: Instant, notice: u64 },
    /// Make the key live at least `ttl` more if it holds our token (its
    /// expiry never moves back). `linger`: once the outcome is settled, the
    /// round keeps reading the replies of the nodes it waits for, for as
    /// long again as it took to settle (the renewal thread's rounds: a node
    /// that lost the key says so, and its copy is restored). `known_max`
    /// `after` and `known_prev`: recorded with `ttl` as `Acquire` records
    /// them.
    Extend {
        ttl: Duration,
        linger: bool,
        known_max: Duration,
        after: After,
        known_prev: Duration,
    },
    /// A held lock handed to a new critical section: where the key holds
    /// our token (or an earlier one of its lineage, see `ours`), it gets
    /// the key's `next` token, atomically, keeping its expiry. One key.
    /// `ttl` is the lock's; records and reports like `Acquire`. `fence`:
    /// the new section's fencing token, written to the counter where
    /// swapped (`counter = max(counter, fence)`).
    Swap {
        ttl: Duration,
        known_max: Duration,
        fence: Option<u64>,
    },
    /// A fenced lock's write-back: where the key holds exactly our token,
    /// its fencing counter becomes at least `value`.
    Fence { value: u64 },
    /// A held lock's missing copies: where the key is absent, set it with
    /// our token for `ttl` (`SET NX PX`); never where another owner has it.
    Restore { ttl: Duration },
}

/// One node's answer for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Done: set, deleted or extended.
    Ok,
    /// The key exists with another token.
    Other,
    /// The key does not exist.
    Absent,
    /// A restore found the key absent and set it with our token: a copy
    /// restored, not a vote (the key was not ours when the command ran).
    Restored,
}

/// What an acquire reply says about the node itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NodeFacts {
    /// Identity of the node's lock history: the node time (ms) at which it
    /// first recorded lock metadata. Changes when the node loses its data.
    pub epoch: u64,
    /// How long the node has kept its lock history (by its own clock).
    pub age: Duration,
    /// The longest TTL recorded on the node before this command.
    pub max_ttl: Duration,
    /// The key of this lock history (a hash of the server's `run_id` and
    /// the epoch, see [`NodeFacts::seen_by`]): new when the node loses its
    /// data or restarts. `0`: unknown.
    pub history: u64,
    /// The lock histories that had begun before `max_ttl` was first used
    /// (as the client that first used it knew them); empty: in use since
    /// always, as far as anyone can tell.
    pub after: After,
    /// The longest TTL recorded before that first use (as recorded: equal
    /// to `max_ttl` or not, it counts only for the histories in `after`).
    pub prev_max: Duration,
}

impl NodeFacts {
    /// The script's facts as the connection that read them knows its
    /// server: its `run_id` (`None`: `INFO` refused) makes, with the epoch,
    /// the history's key (`key`, the connection's cache of it, keyed by
    /// epoch), and its uptime caps the age (a node restarted from a
    /// snapshot or an AOF kept its history, not its latest locks; `None`:
    /// no cap, as under an ACL without `INFO`).
    pub(crate) fn seen_by(
        mut self,
        run_id: Option<&str>,
        uptime: Option<Duration>,
        key: &mut Option<(u64, u64)>,
    ) -> NodeFacts {
        self.history = match *key {
            Some((epoch, k)) if epoch == self.epoch => k,
            _ => {
                let k = history_key(run_id, self.epoch);
                *key = Some((self.epoch, k));
                k
            }
        };
        if let Some(up) = uptime {
            self.age = self.age.min(up);
        }
        self
    }
}

/// A lock history's key: the first 48 bits of the SHA1 of the server's
/// `run_id` (`?` when unknown), a colon and the history's epoch, as the
/// scripts of earlier releases computed it (`redis.sha1hex`), so that every
/// client, of this release or an earlier one, names one history alike (the
/// keys are recorded in the nodes' `after` lists). A restart (new run id)
/// or a loss of data (new epoch) makes a new one.
pub(crate) fn history_key(run_id: Option<&str>, epoch: u64) -> u64 {
    let text = format!("{}:{epoch}", run_id.unwrap_or("?"));
    // `redis::Script` names a script by the SHA1 of its text.
    let sha1 = redis::Script::new(&text).get_hash().to_owned();
    sha1.get(..12)
        .and_then(|h| u64::from_str_radix(h, 16).ok())
        .unwrap_or(0)
}

/// A set of lock-history keys (see [`NodeFacts::history`]), at most
/// [`After::CAP`]: the histories a TTL was first used after. Keys beyond
/// the capacity are left out, which only makes the rule hold more back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct After {
    keys: [u64; After::CAP],
    len: u8,
}

impl After {
    /// How many keys one set holds.
    pub(crate) const CAP: usize = 8;

    /// No history: since always.
    pub(crate) const NONE: After = After {
        keys: [0; After::CAP],
        len: 0,
    };

    /// The keys in the set.
    pub(crate) fn keys(&self) -> &[u64] {
        &self.keys[..usize::from(self.len)]
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn contains(&self, key: u64) -> bool {
        key != 0 && self.keys().contains(&key)
    }

    /// Adds `key` (unknown, repeated or beyond the capacity: ignored).
    pub(crate) fn insert(&mut self, key: u64) {
        if key != 0 && !self.contains(key) && usize::from(self.len) < After::CAP {
            self.keys[usize::from(self.len)] = key;
            self.len += 1;
        }
    }

    /// The keys in both.
    pub(crate) fn intersect(&self, other: &After) -> After {
        let mut out = After::NONE;
        for &k in self.keys() {
            if other.contains(k) {
                out.insert(k);
            }
        }
        out
    }

    /// Parses the script's form: decimal keys separated by commas.
    pub(crate) fn parse(text: &[u8]) -> After {
        let mut out = After::NONE;
        for part in text.split(|&b| b == b',') {
            if let Some(k) = std::str::from_utf8(part).ok().and_then(|p| p.parse().ok()) {
                out.insert(k);
            }
        }
        out
    }

    /// The script's form (empty for none).
    pub(crate) fn to_text(self) -> String {
        use std::fmt::Write as _;
        // One allocation: the encoder sends it with most commands.
        let mut out = String::with_capacity(16 * self.keys().len());
        for (i, k) in self.keys().iter().enumerate() {
            let _ = write!(out, "{}{k}", if i == 0 { "" } else { "," });
        }
        out
    }
}

/// Who answered a command: the server's identity, and whether it can keep
/// locks at all, as the connection learnt them (`INFO` at connect, the lock
/// history's id). Compared between the entries of one round (see
/// [`crate::algorithm::quorum::insert_vote`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct ServerTag {
    /// A hash of the server's `run_id` (same process, whatever the
    /// database), when `INFO` was allowed.
    pub run: Option<u64>,
    /// A hash of the id in its lock history (same database).
    pub history: Option<u64>,
    /// What kind of node it is.
    pub kind: ServerKind,
}

impl ServerTag {
    /// Whether both tags name one server. Two run ids decide when both are
    /// known (a lock history's id travels with its data: a replica promoted
    /// since, or a node restored from another's dump, carries the id of the
    /// server it copied); the history id only when one run id is not.
    pub(crate) fn same_server(&self, other: &ServerTag) -> bool {
        match (self.run, other.run) {
            (Some(a), Some(b)) => a == b,
            _ => self.history.is_some() && self.history == other.history,
        }
    }
}

/// What kind of node answered, for whether it can hold a vote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ServerKind {
    /// A primary without an evicting memory policy, or not known.
    #[default]
    Fit,
    /// A replica (`role:slave`): its writes are not its own.
    Replica,
    /// A Redis Cluster node: not an independent server.
    Cluster,
    /// `maxmemory` with this evicting policy: lock keys can be evicted.
    Evicting(&'static str),
}

/// One node's reply to a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    /// One answer per key, in key order.
    pub answers: Vec<Answer>,
    /// Present on acquire and swap replies.
    pub facts: Option<NodeFacts>,
    /// A fenced acquire's counter, where the key was set (fenced acquire
    /// rounds have one key; with several, the largest).
    pub fence: Option<u64>,
    /// Who answered, when known.
    pub server: Option<ServerTag>,
    /// A release's: how many subscribers on the node its freed-key message
    /// reached (waiters of any client, this one's included).
    pub woke: u32,
    /// An acquire's, per key: how long another owner still holds it on the
    /// node (`Duration::MAX`: no end known; zero: free, where another key
    /// of the set kept it from being set, or ending), `None` where it was
    /// set. Empty where no key is held by another.
    pub held: Vec<Option<Duration>>,
}

impl Reply {
    /// A reply of `answers` alone.
    pub(crate) fn new(answers: Vec<Answer>) -> Self {
        Reply {
            answers,
            facts: None,
            fence: None,
            server: None,
            woke: 0,
            held: Vec::new(),
        }
    }
}

/// One node's reply, or why the node gave none.
pub(crate) type NodeResult = Result<Reply, NodeError>;

/// Folds one node's answers for a round of locks that may each have several
/// keys (`sizes[i]` consecutive keys for the `i`-th lock; see
/// `LockRequest::and`) into one answer per lock: the node holds a lock
/// only where it holds every key of it. `Other` where any key has another
/// owner; a release's `Ok` where any key of ours was deleted (else
/// `Absent`); anything else's `Ok` only where every key answered it
/// (`Absent` where one is missing, `Restored` where one was restored).
pub(crate) fn fold_answers(op: Op, answers: &[Answer]) -> Answer {
    if answers.contains(&Answer::Other) {
        return Answer::Other;
    }
    let has = |a: Answer| answers.contains(&a);
    match op {
        Op::Release { .. } if has(Answer::Ok) => Answer::Ok,
        Op::Release { .. } => Answer::Absent,
        _ if has(Answer::Absent) || answers.is_empty() => Answer::Absent,
        _ if has(Answer::Restored) => Answer::Restored,
        _ => Answer::Ok,
    }
}

/// [`fold_answers`] for every lock of one node's result (errors stay as
/// they are). `sizes`: keys per lock, in key order, summing to the round's
/// keys.
pub(crate) fn fold(op: Op, result: &NodeResult, sizes: &[usize]) -> NodeResult {
    let reply = result.as_ref().map_err(Clone::clone)?;
    let mut answers = Vec::with_capacity(sizes.len());
    let mut at = 0usize;
    for &n in sizes {
        let end = at.saturating_add(n).min(reply.answers.len());
        let own = &reply.answers[at.min(end)..end];
        // (A reply short of answers has none for the rest: no hold.)
        answers.push(if own.len() < n {
            Answer::Absent
        } else {
            fold_answers(op, own)
        });
        at = end;
    }
    Ok(Reply {
        answers,
        ..reply.clone()
    })
}

/// Whether any lock of a round has more than one key (its results need
/// [`fold`]ing).
pub(crate) fn grouped(sizes: &[usize]) -> bool {
    sizes.iter().any(|&n| n != 1)
}

#[cfg(test)]
mod tests {
    use super::ours;

    #[test]
    fn a_lock_of_several_keys_is_held_on_a_node_only_with_every_key() {
        use super::{fold, fold_answers, Answer::*, Op, Reply};
        use std::time::{Duration, Instant};
        let extend = Op::Extend {
            ttl: Duration::from_secs(1),
            linger: false,
            known_max: Duration::ZERO,
            after: super::After::NONE,
            known_prev: std::time::Duration::ZERO,
        };
        let release = Op::Release {
            keep_until: Instant::now(),
            notice: 0,
        };
        let restore = Op::Restore {
            ttl: Duration::from_secs(1),
        };
        assert_eq!(fold_answers(extend, &[Ok, Ok, Ok]), Ok);
        assert_eq!(fold_answers(extend, &[Ok, Absent, Ok]), Absent);
        assert_eq!(fold_answers(extend, &[Ok, Absent, Other]), Other);
        assert_eq!(fold_answers(extend, &[]), Absent, "no answer is no hold");
        assert_eq!(fold_answers(restore, &[Ok, Restored]), Restored);
        assert_eq!(fold_answers(restore, &[Restored, Other]), Other);
        assert_eq!(
            fold_answers(release, &[Absent, Ok]),
            Ok,
            "something of ours deleted"
        );
        assert_eq!(fold_answers(release, &[Absent, Absent]), Absent);
        assert_eq!(
            fold_answers(release, &[Ok, Other]),
            Other,
            "taken over: not ours"
        );
        // Locks of 1, 2 and 3 keys in one round; a short reply folds what
        // it has and never panics.
        let r = Result::Ok(Reply::new(vec![Ok, Ok, Absent, Ok, Ok, Ok]));
        let folded = fold(extend, &r, &[1, 2, 3]).unwrap();
        assert_eq!(folded.answers, vec![Ok, Absent, Ok]);
        let short = Result::Ok(Reply::new(vec![Ok, Ok]));
        assert_eq!(
            fold(extend, &short, &[1, 2, 3]).unwrap().answers,
            vec![Ok, Absent, Absent]
        );
    }

    #[test]
    fn a_round_waits_one_node_timeout_more_per_200_keys() {
        use super::allowance;
        use std::time::Duration;
        let t = Duration::from_millis(50);
        let rule = [(0, 1), (1, 1), (199, 1), (200, 2), (1_000, 6), (8_256, 42)];
        for (keys, timeouts) in rule {
            assert_eq!(allowance(t, keys), t * timeouts, "{keys} keys");
        }
        assert_eq!(allowance(Duration::MAX, 2_000), Duration::MAX);
        assert_eq!(allowance(t, usize::MAX), t.saturating_mul(u32::MAX));
    }

    #[test]
    fn a_section_token_owns_its_lineage_and_nothing_else() {
        assert!(ours("abc", "abc"));
        assert!(!ours("abc.1", "abc"), "a plain token is exact");
        assert!(ours("abc", "abc.2"));
        assert!(ours("abc.1", "abc.2"));
        assert!(!ours("abd.1", "abc.2"));
        assert!(!ours("abcd", "abc.2"), "a lineage is whole");
        assert!(!ours("ab", "abc.2"));
    }
}
