//! A round's command, packed once for all nodes, and the decoding of each
//! node's reply.

use std::time::Duration;

use redis::Value;

use crate::algorithm::round::Key;
use crate::algorithm::round::{After, Answer, NodeFacts, Op, Reply};
use crate::driver::conn::{is_auth_error, server_text};
use crate::driver::scripts;
use crate::error::NodeErrorKind;

/// Elements of an acquire or swap reply before its answers: the lock
/// history's epoch, age, longest TTL, the longest TTL before that was first
/// used, and the histories it was first used after (a string, last).
pub(crate) const FACTS: usize = 5;

/// A round's commands, packed once for all nodes.
pub(crate) struct Encoded {
    pub(crate) op: Op,
    pub(crate) n: usize,
    /// A release's tokens, in key order.
    pub(crate) tokens: Vec<String>,
    /// The tokens an acquire or swap writes.
    pub(crate) written: Vec<String>,
    pub(crate) packed: Vec<u8>,
    /// The script's source, for a node that answers NOSCRIPT.
    pub(crate) code: &'static str,
    /// How many frames a node's reply is (see
    /// [`InFlight::frames`](crate::driver::conn_state::InFlight::frames)).
    pub(crate) frames: usize,
    /// A lean acquire's resource (see [`Encoded::script`]).
    lean_key: Option<String>,
}

impl Encoded {
    /// `op` on `keys`, packed once for all nodes: a lean acquire's plain
    /// commands (see [`Encoded::lean`]), or else its script's `EVALSHA`.
    pub(crate) fn new(op: Op, keys: &[Key<'_>]) -> Self {
        if let (
            Op::Acquire {
                lean: Some(_), ttl, ..
            },
            [k],
        ) = (op, keys)
        {
            return Encoded::lean(op, k, ttl);
        }
        let (script, code, args) = script_of(op);
        let tokens = match op {
            Op::Release { .. } => keys.iter().map(|k| k.token.to_owned()).collect(),
            _ => Vec::new(),
        };
        let written = match op {
            Op::Acquire { .. } | Op::Swap { .. } | Op::Restore { .. } => {
                crate::algorithm::round::written(op, keys)
                    .iter()
                    .map(|k| k.token.to_owned())
                    .collect()
            }
            Op::Release { .. } | Op::Fence { .. } | Op::Extend { .. } => Vec::new(),
        };
        Encoded {
            op,
            n: named(op, keys).len(),
            tokens,
            written,
            packed: pack("EVALSHA", script.get_hash(), op, keys, &args),
            code,
            frames: 1,
            lean_key: None,
        }
    }

    /// The lean acquire of one writer's key (see [`Op::Acquire`]): `SET NX
    /// PX`, then `PTTL` of the key (how long another owner holds it) and
    /// the lock history's epoch, read after the SET; three plain commands
    /// in one write, answered in three frames.
    fn lean(op: Op, k: &Key<'_>, ttl: Duration) -> Self {
        let mut packed = redis::cmd("SET")
            .arg(k.resource)
            .arg(k.token)
            .arg("NX")
            .arg("PX")
            .arg(millis_ceil(ttl))
            .get_packed_command();
        packed.extend(redis::cmd("PTTL").arg(k.resource).get_packed_command());
        packed.extend(
            redis::cmd("HGET")
                .arg(scripts::META_KEY)
                .arg("epoch")
                .get_packed_command(),
        );
        Encoded {
            op,
            n: 1,
            tokens: Vec::new(),
            written: vec![k.token.to_owned()],
            packed,
            code: "",
            frames: 3,
            lean_key: Some(k.resource.to_owned()),
        }
    }

    /// A lean acquire's script form (`EVAL`), for a node whose connection
    /// closed under the lean one: sent again, the script tells our own key
    /// from another owner's (a plain SET cannot). `None` for any other
    /// command.
    pub(crate) fn script(&self) -> Option<Vec<u8>> {
        let (Op::Acquire { .. }, Some(resource), Some(token)) =
            (self.op, &self.lean_key, self.written.first())
        else {
            return None;
        };
        let mut full = self.op;
        if let Op::Acquire { lean, .. } = &mut full {
            *lean = None;
        }
        let e = Encoded::new(full, &[Key::new(resource, token)]);
        Some(eval_form(&e.packed, e.code))
    }

    /// Whether `v` is a lean acquire's reply (see [`lean_shaped`]).
    pub(crate) fn is_lean_reply(&self, v: &Value) -> bool {
        self.frames > 1 && matches!(v, Value::Array(items) if lean_shaped(items))
    }

    /// A lean acquire's reply (see [`Encoded::lean`]): the SET's answer,
    /// the owner's time left where it did not set, and the facts with the
    /// epoch alone (0: no history), which the node layer checks against
    /// the facts it last read there.
    fn decode_lean(items: &[Value]) -> Result<Reply, (NodeErrorKind, String)> {
        let [set, pttl, epoch] = items else {
            return Err(unexpected(Value::Array(items.to_vec())));
        };
        for v in [set, epoch] {
            if let Value::ServerError(_) = v {
                return Err(unexpected(v.clone()));
            }
        }
        let (answer, held) = match (set, pttl) {
            (Value::Okay, _) => (Answer::Ok, None),
            // Refused (an ACL without it): no end known, as the script's.
            (Value::Nil, Value::ServerError(_)) => (Answer::Other, Some(Duration::MAX)),
            (Value::Nil, Value::Int(ms)) => (
                Answer::Other,
                Some(match *ms {
                    // No expiry.
                    -1 => Duration::MAX,
                    ms => Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
                }),
            ),
            _ => return Err(unexpected(Value::Array(items.to_vec()))),
        };
        let epoch = match epoch {
            Value::Nil => 0,
            Value::BulkString(b) => std::str::from_utf8(b)
                .ok()
                .and_then(|t| t.parse().ok())
                .unwrap_or(0),
            v => return Err(unexpected(v.clone())),
        };
        Ok(Reply {
            answers: vec![answer],
            facts: Some(NodeFacts {
                epoch,
                age: Duration::ZERO,
                max_ttl: Duration::ZERO,
                history: 0,
                after: After::NONE,
                prev_max: Duration::ZERO,
            }),
            fence: None,
            server: None,
            woke: 0,
            held: held.map_or_else(Vec::new, |h| vec![Some(h)]),
        })
    }

    /// For a command that may write a key of ours (an acquire, a swap, a
    /// restore): how long after it was sent the key may live.
    pub(crate) fn writes(&self) -> Option<Duration> {
        match self.op {
            Op::Acquire { ttl, .. } | Op::Swap { ttl, .. } | Op::Restore { ttl } => Some(ttl),
            Op::Release { .. } | Op::Fence { .. } | Op::Extend { .. } => None,
        }
    }

    /// The same command as `EVAL` with the script's source (built only for
    /// a node that answered NOSCRIPT): `packed` with its `EVALSHA <sha1>`
    /// elements replaced.
    pub(crate) fn fallback(&self) -> Vec<u8> {
        match self.script() {
            // A lean acquire's is its script form.
            Some(script) => script,
            None => eval_form(&self.packed, self.code),
        }
    }

    pub(crate) fn decode(&self, v: Value) -> Result<Reply, (NodeErrorKind, String)> {
        let items = match v {
            Value::Array(items) => items,
            // The script itself refused (every command here is one but
            // the lean acquire, whose frames come as an array).
            Value::ServerError(e) if refused_for_good(&server_text(&e)) => {
                return Err((NodeErrorKind::ScriptsRefused, server_text(&e)))
            }
            v => return Err(unexpected(v)),
        };
        if self.frames > 1 && lean_shaped(&items) {
            return Encoded::decode_lean(&items);
        }
        let int = |v: &Value| match v {
            Value::Int(x) => Some(*x),
            _ => None,
        };
        let (facts, rest) = match self.op {
            Op::Acquire { .. } => {
                if items.len() != self.n + FACTS {
                    return Err(unexpected(Value::Array(items)));
                }
                let f: Vec<i64> = items[..FACTS - 1].iter().filter_map(int).collect();
                let [epoch, age, max, prev] = f[..] else {
                    return Err(unexpected(Value::Array(items)));
                };
                let after = match &items[FACTS - 1] {
                    Value::BulkString(b) => After::parse(b),
                    Value::SimpleString(t) => After::parse(t.as_bytes()),
                    _ => return Err(unexpected(Value::Array(items))),
                };
                let ms = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
                let facts = NodeFacts {
                    epoch: u64::try_from(epoch).unwrap_or(0),
                    age: ms(age),
                    max_ttl: ms(max),
                    // Set by the connection that read it (`NodeFacts::seen_by`).
                    history: 0,
                    after,
                    prev_max: ms(prev),
                };
                (Some(facts), &items[FACTS..])
            }
            _ => {
                if items.len() != self.n {
                    return Err(unexpected(Value::Array(items)));
                }
                (None, &items[..])
            }
        };
        // An acquire's 0 or less is "exists"; everyone else's 0 "absent". A fenced
        // acquire answers a set key with its counter.
        let acquire = matches!(self.op, Op::Acquire { .. });
        let fenced = matches!(self.op, Op::Acquire { fenced: true, .. });
        let restore = matches!(self.op, Op::Restore { .. });
        let release = matches!(self.op, Op::Release { .. });
        let mut fence = None;
        let mut woke = 0u32;
        let mut held = vec![None; rest.len()];
        let mut any_held = false;
        let answers = rest
            .iter()
            .zip(held.iter_mut())
            .map(|(v, h)| match (int(v), acquire) {
                (Some(2), false) if restore => Ok(Answer::Restored),
                // A release's `1 + subscribers reached` (see `RELEASE_LUA`).
                (Some(c), false) if release && c >= 1 => {
                    woke = woke.max(u32::try_from(c - 1).unwrap_or(u32::MAX));
                    Ok(Answer::Ok)
                }
                (Some(1), _) if !fenced => Ok(Answer::Ok),
                (Some(c), true) if fenced && c > 0 && c.unsigned_abs() <= scripts::FENCE_LIMIT => {
                    fence = fence.max(u64::try_from(c).ok());
                    Ok(Answer::Ok)
                }
                // Held by another owner: `-1 - PTTL`, or 0 (no expiry).
                (Some(c), true) if c <= 0 => {
                    let left = match u64::try_from(-1 - c) {
                        Ok(ms) => Duration::from_millis(ms),
                        Err(_) => Duration::MAX,
                    };
                    *h = Some(left);
                    any_held = true;
                    Ok(Answer::Other)
                }
                (Some(0), false) => Ok(Answer::Absent),
                (Some(-1), false) => Ok(Answer::Other),
                _ => Err(unexpected(v.clone())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Reply {
            answers,
            facts,
            fence,
            server: None,
            woke,
            held: if any_held { held } else { Vec::new() },
        })
    }
}

/// The script a command of `op` runs (cached, and its source) and its
/// numeric arguments, in order.
fn script_of(op: Op) -> (&'static redis::Script, &'static str, Vec<u64>) {
    match op {
        Op::Acquire {
            ttl,
            known_max,
            fenced,
            intent,
            ..
        } => (
            &scripts::ACQUIRE,
            scripts::ACQUIRE_LUA,
            vec![
                millis_ceil(ttl),
                millis_ceil(known_max),
                acquire_mode(fenced, intent),
            ],
        ),
        Op::Swap {
            ttl,
            known_max,
            fence,
        } => (
            &scripts::SWAP,
            scripts::SWAP_LUA,
            vec![millis_ceil(ttl), millis_ceil(known_max), fence.unwrap_or(0)],
        ),
        Op::Release { notice, .. } => (&scripts::RELEASE, scripts::RELEASE_LUA, vec![notice]),
        Op::Extend { ttl, known_max, .. } => (
            &scripts::EXTEND,
            scripts::EXTEND_LUA,
            vec![millis_ceil(ttl), millis_ceil(known_max)],
        ),
        Op::Restore { ttl } => (
            &scripts::RESTORE,
            scripts::RESTORE_LUA,
            vec![millis_ceil(ttl)],
        ),
        Op::Fence { value } => (&scripts::FENCE, scripts::FENCE_LUA, vec![value]),
    }
}

/// What the client knows of its longest TTL (see `raise_lua!`), after
/// `known`: `keys` for a first use of `ttl`, `keys;prev` for the histories
/// `known` was first used after, `None` for none (in use since always) and
/// for any command but an acquire or an extend.
fn begun(op: Op) -> Option<String> {
    match op {
        Op::Acquire {
            ttl,
            known_max,
            after,
            known_prev,
            ..
        }
        | Op::Extend {
            ttl,
            known_max,
            after,
            known_prev,
            ..
        } if !after.is_empty() => Some(if ttl > known_max {
            after.to_text()
        } else {
            format!("{};{}", after.to_text(), millis_ceil(known_prev))
        }),
        _ => None,
    }
}

/// The keys a command of `op` names: a swap's first alone (then come its
/// new token and the tokens it may hold), every other's all of `keys`.
fn named<'a, 'k>(op: Op, keys: &'a [Key<'k>]) -> &'a [Key<'k>] {
    if matches!(op, Op::Swap { .. }) {
        &keys[..keys.len().min(1)]
    } else {
        keys
    }
}

/// `verb body` (`EVALSHA` and the script's hash) for `op` on `keys` with
/// the script's `args`, packed: the keys it names (and the lock-history
/// key), the arguments (the second with what [`begun`] adds), a swap's new
/// token, then the tokens.
fn pack(verb: &str, body: &str, op: Op, keys: &[Key<'_>], args: &[u64]) -> Vec<u8> {
    let begun = begun(op);
    // All but release and restore also take the node's lock-history key.
    let meta = !matches!(op, Op::Release { .. } | Op::Restore { .. });
    let swap = matches!(op, Op::Swap { .. });
    let named = named(op, keys);
    let mut cmd = redis::cmd(verb);
    cmd.arg(body).arg(named.len() + usize::from(meta));
    for k in named {
        cmd.arg(k.resource);
    }
    if meta {
        cmd.arg(scripts::META_KEY);
    }
    // An acquire's mode, with a waiting call's place (see `Place`).
    let place = match op {
        Op::Acquire { place, .. } => place.order().map(|o| {
            // (Rounded up: a life under a millisecond is one, not a drop.)
            let life = if place.life.is_zero() {
                0
            } else {
                millis_ceil(place.life).min(86_400_000)
            };
            format!("{o};{life};{}", place.mask(keys.len()))
        }),
        _ => None,
    };
    for (j, a) in args.iter().enumerate() {
        match (&begun, &place) {
            (Some(b), _) if j == 1 => cmd.arg(format!("{a};{b}")),
            (_, Some(p)) if j == 2 => cmd.arg(format!("{a};{p}")),
            _ => cmd.arg(*a),
        };
    }
    if swap {
        cmd.arg(keys.first().and_then(|k| k.next).unwrap_or_default());
    }
    for k in keys {
        cmd.arg(k.token);
    }
    cmd.get_packed_command()
}

/// `packed`, an `EVALSHA` of the script `code`, as `EVAL` with the source.
pub(crate) fn eval_form(packed: &[u8], code: &str) -> Vec<u8> {
    // `*N\r\n` then `$7\r\nEVALSHA\r\n` then `$40\r\n<sha1>\r\n`.
    let head = packed
        .windows(2)
        .position(|w| w == b"\r\n")
        .map_or(0, |p| p + 2);
    let rest = packed.get(head + 13 + 47..).unwrap_or_default();
    let mut out = Vec::with_capacity(packed.len() + code.len());
    out.extend_from_slice(&packed[..head]);
    out.extend_from_slice(b"$4\r\nEVAL\r\n");
    out.extend_from_slice(format!("${}\r\n", code.len()).as_bytes());
    out.extend_from_slice(code.as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(rest);
    out
}

/// Whether a reply's items are a lean acquire's: three, its SET's answer
/// first (a script's replies begin with a number).
fn lean_shaped(items: &[Value]) -> bool {
    items.len() == 3 && !matches!(items[0], Value::Int(_))
}

/// Whether an acquire or swap reply says some key was set: `1`, or a
/// fenced acquire's counter. An acquire's answers follow its [`FACTS`]
/// (so it has more than `FACTS` elements); a swap's one answer is all its
/// reply.
pub(crate) fn acquired_any(v: &Value) -> bool {
    let Value::Array(items) = v else {
        return false;
    };
    if lean_shaped(items) {
        return items[0] == Value::Okay;
    }
    let head = if items.len() > FACTS { FACTS } else { 0 };
    items[head..]
        .iter()
        .any(|x| matches!(x, Value::Int(c) if *c > 0))
}

/// Whether a server's error reply (`text`, in the server's or the driver's
/// words) refuses a script, or a command a script runs, for good rather
/// than for now: the ACL lacks the command (`NOPERM`; "ACL failure in
/// script" or "can't run this command" from inside a script), it is
/// renamed away ("unknown command"), or the server has no Lua ("Could not
/// find scripting engine"). Not a key or channel outside the user's ACL
/// (that lock's name is refused, not the scripts), and not OOM, READONLY,
/// BUSY or a script's runtime error: those may pass.
pub(crate) fn refused_for_good(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    let acl = t.starts_with("noperm")
        || t.contains("acl failure in script")
        || t.contains("can't run this command");
    // (In the server's phrases: Valkey names the user, whose name may hold
    // any word.)
    let a_name = t.contains("permissions to access") || t.contains("can't access");
    (acl && !a_name)
        || t.contains("unknown command")
        || t.contains("could not find scripting engine")
}

pub(crate) fn unexpected(v: Value) -> (NodeErrorKind, String) {
    match v {
        Value::ServerError(e) if is_auth_error(&e) => (NodeErrorKind::Auth, server_text(&e)),
        Value::ServerError(e) => (NodeErrorKind::Server, server_text(&e)),
        v => (NodeErrorKind::Protocol, format!("{v:?}")),
    }
}

/// An acquire's `ARGV[3]`: `1` for a fenced lock, plus twice the writers'
/// intent in ms (zero: none, not rounded up; at most a day, far above any
/// TTL, so that the sum stays exact in Lua's doubles). One argument, so
/// that the command keeps its shape (its element count tells it from a
/// swap's on the connection state).
pub(crate) fn acquire_mode(fenced: bool, intent: Duration) -> u64 {
    let intent = if intent.is_zero() {
        0
    } else {
        millis_ceil(intent).min(86_400_000)
    };
    intent * 2 + u64::from(fenced)
}

/// Whole milliseconds, rounded up (the server keeps the key at least as long
/// as we assume), at least 1.
pub(crate) fn millis_ceil(d: Duration) -> u64 {
    let ms = d.as_nanos().div_ceil(1_000_000).max(1);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

#[cfg(test)]
#[path = "encode_tests.rs"]
mod tests;
