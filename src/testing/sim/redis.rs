//! The driver's commands as a simulated node reads them, and the node's
//! replies in the shape the scripts give them: a simulated client runs the
//! production driver's encoding and decoding, not a copy of them.

use std::time::Duration;

use std::sync::Arc;

use parking_lot::Mutex;
use redis::Value;

use crate::clock::Signal;

use crate::algorithm::round::{After, Answer, Key, NodeFacts, Op, Reply};
use crate::driver::resp::frame_len;
use crate::driver::scripts;

/// What a simulated connection has received from its node: replies, in
/// order, and whether the node closed it. Who reads it waits on `signal`.
#[derive(Debug)]
pub(crate) struct Inbox {
    state: Mutex<(std::collections::VecDeque<Value>, bool)>,
    /// The node closed it: it reads nothing more there (the client learns
    /// of it when the close arrives).
    severed: std::sync::atomic::AtomicBool,
    signal: Arc<Signal>,
}

impl Inbox {
    pub(crate) fn new(signal: Arc<Signal>) -> Arc<Inbox> {
        Arc::new(Inbox {
            state: Mutex::new((std::collections::VecDeque::new(), false)),
            severed: Default::default(),
            signal,
        })
    }

    pub(crate) fn push(&self, v: Value) {
        let mut st = self.state.lock();
        if !st.1 {
            st.0.push_back(v);
        }
        drop(st);
        self.signal.notify();
    }

    /// The node closed the connection (or reset it): what it sent before
    /// stays readable.
    pub(crate) fn close(&self) {
        self.state.lock().1 = true;
        self.signal.notify();
    }

    /// The next reply, if one has arrived.
    pub(crate) fn pop(&self) -> Option<Value> {
        self.state.lock().0.pop_front()
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.state.lock().1
    }

    /// Whether a reply waits to be read.
    pub(crate) fn ready_replies(&self) -> bool {
        !self.state.lock().0.is_empty()
    }

    /// The node's side closes (see [`World::sever`]).
    ///
    /// [`World::sever`]: crate::testing::sim::world::World::sever
    pub(crate) fn sever(&self) {
        self.severed
            .store(true, std::sync::atomic::Ordering::Release);
    }

    pub(crate) fn is_severed(&self) -> bool {
        self.severed.load(std::sync::atomic::Ordering::Acquire) || self.is_closed()
    }
}

/// One key of a command, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OwnedKey {
    pub(crate) resource: String,
    pub(crate) token: String,
    pub(crate) next: Option<String>,
}

impl OwnedKey {
    /// The same key, borrowed, as the scripts' semantics take it.
    pub(crate) fn key(&self) -> Key<'_> {
        Key {
            resource: &self.resource,
            token: &self.token,
            next: self.next.as_deref(),
        }
    }
}

/// A command, as a node understands it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Command {
    /// One of the lock scripts, by its SHA1 (`EVALSHA`: the node must have
    /// it cached) or by its source (`EVAL`).
    Script {
        op: Op,
        keys: Vec<OwnedKey>,
        by_sha: bool,
    },
    /// `SCRIPT LOAD`: the node caches a script.
    Load,
    /// `INFO`.
    Info,
    /// The connect-time script that returns the lock history's id, writing
    /// one where it is missing.
    HistoryId,
    /// The lean acquire's `SET key token NX PX ttl`.
    Set { key: OwnedKey, ttl: Duration },
    /// `PTTL key`.
    Pttl(String),
    /// `HGET` of the lock history's epoch.
    Epoch,
    /// `GET key` (a status query's: see `SimEngine::inspect`).
    Get(String),
    /// `HGET` of an election's term in the lock history (a status
    /// query's).
    TermOf(String),
    /// Anything else: the node answers with an error.
    Unknown(String),
}

/// The complete commands in `bytes`, in order (a command cut short is
/// left out: the driver writes whole commands).
pub(crate) fn commands(bytes: &[u8]) -> Vec<Value> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Ok(Some(len)) = frame_len(&bytes[at..]) {
        if let Ok(v) = redis::parse_redis_value(&bytes[at..at + len]) {
            out.push(v);
        }
        at += len;
    }
    out
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

/// The lock script a SHA1 or a source names, with how many arguments it
/// takes before the tokens.
fn script(name: &str, by_sha: bool) -> Option<(&'static str, usize)> {
    let all: [(&redis::Script, &'static str, &'static str, usize); 6] = [
        (&scripts::ACQUIRE, scripts::ACQUIRE_LUA, "acquire", 3),
        (&scripts::SWAP, scripts::SWAP_LUA, "swap", 4),
        (&scripts::RELEASE, scripts::RELEASE_LUA, "release", 1),
        (&scripts::EXTEND, scripts::EXTEND_LUA, "extend", 2),
        (&scripts::RESTORE, scripts::RESTORE_LUA, "restore", 1),
        (&scripts::FENCE, scripts::FENCE_LUA, "fence", 1),
    ];
    all.iter()
        .find(|(s, src, _, _)| {
            if by_sha {
                s.get_hash() == name
            } else {
                *src == name
            }
        })
        .map(|&(_, _, kind, args)| (kind, args))
}

/// A TTL argument (whole ms).
fn ms(s: &str) -> Duration {
    Duration::from_millis(s.parse().unwrap_or(0))
}

/// The second argument of an acquire or an extension: the longest TTL
/// known, and for a first use the histories it comes after.
fn known(s: &str) -> (Duration, After, Duration) {
    let mut parts = s.splitn(3, ';');
    let max = ms(parts.next().unwrap_or(""));
    let after = After::parse(parts.next().unwrap_or("").as_bytes());
    let prev = parts.next().map_or(Duration::ZERO, ms);
    (max, after, prev)
}

/// What command `v` asks.
pub(crate) fn command(v: &Value) -> Command {
    let Value::Array(items) = v else {
        return Command::Unknown(format!("{v:?}"));
    };
    let words: Vec<String> = items.iter().map(|i| text(i).unwrap_or_default()).collect();
    let verb = words
        .first()
        .map(|w| w.to_ascii_uppercase())
        .unwrap_or_default();
    match verb.as_str() {
        "INFO" => return Command::Info,
        "SCRIPT" if words.get(1).is_some_and(|w| w.eq_ignore_ascii_case("load")) => {
            return Command::Load
        }
        "EVAL" if words.get(1).map(String::as_str) == Some(scripts::HISTORY_ID_LUA) => {
            return Command::HistoryId
        }
        "EVAL" | "EVALSHA" => {}
        "SET" if words.len() == 6 => {
            return Command::Set {
                key: OwnedKey {
                    resource: words[1].clone(),
                    token: words[2].clone(),
                    next: None,
                },
                ttl: ms(&words[5]),
            }
        }
        "PTTL" if words.len() == 2 => return Command::Pttl(words[1].clone()),
        "GET" if words.len() == 2 => return Command::Get(words[1].clone()),
        "HGET"
            if words.get(1).map(String::as_str) == Some(scripts::META_KEY)
                && words.len() == 3
                && words[2].starts_with("term:") =>
        {
            return Command::TermOf(words[2]["term:".len()..].to_owned())
        }
        "HGET"
            if words.get(1).map(String::as_str) == Some(scripts::META_KEY)
                && words.get(2).map(String::as_str) == Some("epoch") =>
        {
            return Command::Epoch
        }
        _ => return Command::Unknown(verb),
    }
    let by_sha = verb == "EVALSHA";
    let Some((kind, argc)) = words.get(1).and_then(|n| script(n, by_sha)) else {
        return Command::Unknown(format!("{verb} of an unknown script"));
    };
    let nkeys: usize = words.get(2).and_then(|n| n.parse().ok()).unwrap_or(0);
    let keys = words.get(3..3 + nkeys).unwrap_or_default();
    let rest = words.get(3 + nkeys..).unwrap_or_default();
    let (args, tokens) = rest.split_at(argc.min(rest.len()));
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or("");
    // The lock keys, without the history key the script also names.
    let meta = keys.last().map(String::as_str) == Some(scripts::META_KEY);
    let named = &keys[..keys.len() - usize::from(meta)];
    let op = match kind {
        "acquire" => {
            let (known_max, after, known_prev) = known(arg(1));
            // The mode: fenced in its low bit, the intent (ms) above; then
            // a waiting call's place (`Place::order`) and its claims' life.
            let mut parts = arg(2).split(';');
            let mode: u64 = parts.next().and_then(|m| m.parse().ok()).unwrap_or(0);
            let place = match (parts.next(), parts.next(), parts.next()) {
                (Some(o), Some(life), Some(mask)) => crate::algorithm::round::Place {
                    keys: mask
                        .bytes()
                        .enumerate()
                        .filter(|&(i, b)| b == b'1' && i < 64)
                        .fold(0, |m, (i, _)| m | 1 << i),
                    since: o
                        .get(..12)
                        .and_then(|s| u64::from_str_radix(s, 16).ok())
                        .unwrap_or(0),
                    claim: o
                        .get(12..)
                        .and_then(|s| u64::from_str_radix(s, 16).ok())
                        .unwrap_or(0),
                    life: ms(life),
                },
                _ => crate::algorithm::round::Place::NONE,
            };
            Op::Acquire {
                lean: None,
                place,
                intent: Duration::from_millis(mode / 2),
                ttl: ms(arg(0)),
                known_max,
                fenced: mode % 2 == 1,
                after,
                known_prev,
            }
        }
        "swap" => Op::Swap {
            ttl: ms(arg(0)),
            known_max: ms(arg(1)),
            fence: arg(2).parse().ok().filter(|f| *f > 0),
        },
        // The delete's keep-until is the client's, not sent; its notice
        // (nonzero: the freed key is published to its waiters) is.
        "release" => Op::Release {
            keep_until: std::time::Instant::now(),
            notice: arg(0).parse().unwrap_or(0),
        },
        "extend" => {
            let (known_max, after, known_prev) = known(arg(1));
            Op::Extend {
                ttl: ms(arg(0)),
                known_max,
                linger: false,
                after,
                known_prev,
            }
        }
        "restore" => Op::Restore { ttl: ms(arg(0)) },
        _ => Op::Fence {
            value: arg(0).parse().unwrap_or(0),
        },
    };
    let keys = if kind == "swap" {
        // One key, the token that replaces ours, then the tokens it may hold.
        let resource = named.first().cloned().unwrap_or_default();
        let next = arg(3).to_owned();
        tokens
            .iter()
            .map(|t| OwnedKey {
                resource: resource.clone(),
                token: t.clone(),
                next: Some(next.clone()),
            })
            .collect()
    } else {
        named
            .iter()
            .zip(tokens)
            .map(|(r, t)| OwnedKey {
                resource: r.clone(),
                token: t.clone(),
                next: None,
            })
            .collect()
    };
    Command::Script { op, keys, by_sha }
}

/// A whole number of milliseconds, as the scripts return times.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// An error reply, as the server words it.
pub(crate) fn error(text: &str) -> Value {
    let line = format!("-{}\r\n", text.replace(['\r', '\n'], " "));
    redis::parse_redis_value(line.as_bytes()).unwrap_or(Value::Nil)
}

/// The scripts' reply to `op`: for an acquire or a swap the lock history's
/// facts first, then one number per key (or the error the script raised).
pub(crate) fn reply(op: Op, r: Result<Reply, &str>) -> Value {
    let reply = match r {
        Ok(r) => r,
        Err(why) => return error(&format!("ERR quorumlock: {why}")),
    };
    let fenced = matches!(op, Op::Acquire { fenced: true, .. });
    let acquire = matches!(op, Op::Acquire { .. });
    let answer = |(i, a): (usize, &Answer)| match (a, acquire) {
        (Answer::Ok, true) if fenced => i64::try_from(reply.fence.unwrap_or(1)).unwrap_or(1),
        (Answer::Ok, _) => 1,
        (Answer::Restored, _) => 2,
        // As the script: `-1 - PTTL` (0: no expiry).
        (Answer::Other, true) => match reply.held.get(i).copied().flatten() {
            Some(left) if left != Duration::MAX => (-1i64).saturating_sub(millis(left)),
            _ => 0,
        },
        (Answer::Absent, _) => 0,
        (Answer::Other, false) => -1,
    };
    let mut items = Vec::new();
    if let (Op::Acquire { .. }, Some(f)) = (op, reply.facts) {
        // The history's key is the reading connection's to make.
        let NodeFacts {
            epoch,
            age,
            max_ttl,
            history: _,
            after,
            prev_max,
        } = f;
        items.push(Value::Int(i64::try_from(epoch).unwrap_or(i64::MAX)));
        items.push(Value::Int(millis(age)));
        items.push(Value::Int(millis(max_ttl)));
        items.push(Value::Int(millis(prev_max)));
        items.push(Value::BulkString(after.to_text().into_bytes()));
    }
    items.extend(
        reply
            .answers
            .iter()
            .enumerate()
            .map(|a| Value::Int(answer(a))),
    );
    Value::Array(items)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::algorithm::round::Key;
    use crate::driver::node::encode::Encoded;

    /// Every command the driver encodes reads back as what it asks.
    #[test]
    fn the_drivers_commands_read_back_as_sent() {
        let after = {
            let mut a = After::NONE;
            a.insert(42);
            a
        };
        let keys = [Key::new("r1", "t1"), Key::new("r2", "t2")];
        let ops = [
            Op::Acquire {
                lean: None,
                place: crate::algorithm::round::Place {
                    since: 1_796_000_000_123,
                    claim: u64::MAX - 5,
                    life: Duration::from_millis(350),
                    keys: 0b10,
                },
                intent: Duration::from_millis(350),
                ttl: Duration::from_millis(5000),
                known_max: Duration::from_millis(7000),
                fenced: true,
                after,
                known_prev: Duration::from_millis(2000),
            },
            Op::Extend {
                ttl: Duration::from_millis(3000),
                known_max: Duration::from_millis(3000),
                linger: false,
                after: After::NONE,
                known_prev: std::time::Duration::ZERO,
            },
            Op::Restore {
                ttl: Duration::from_millis(900),
            },
            Op::Fence { value: 77 },
        ];
        for op in ops {
            let enc = Encoded::new(op, &keys);
            for (bytes, by_sha) in [(enc.packed.clone(), true), (enc.fallback(), false)] {
                let cmds = commands(&bytes);
                assert_eq!(cmds.len(), 1);
                let Command::Script {
                    op: read,
                    keys: k,
                    by_sha: s,
                } = command(&cmds[0])
                else {
                    panic!("{op:?}: not read as a script");
                };
                assert_eq!((read, s), (op, by_sha));
                let names: Vec<(&str, &str)> = k
                    .iter()
                    .map(|k| (k.resource.as_str(), k.token.as_str()))
                    .collect();
                assert_eq!(names, [("r1", "t1"), ("r2", "t2")]);
            }
        }
        let release = Encoded::new(
            Op::Release {
                keep_until: Instant::now(),
                notice: 77,
            },
            &keys,
        );
        assert!(matches!(
            command(&commands(&release.packed)[0]),
            Command::Script {
                op: Op::Release { notice: 77, .. },
                ..
            }
        ));
        let swap_keys = [Key {
            resource: "r",
            token: "old",
            next: Some("new"),
        }];
        let swap = Op::Swap {
            ttl: Duration::from_millis(4000),
            known_max: Duration::from_millis(4000),
            fence: Some(9),
        };
        let Command::Script { op, keys, .. } =
            command(&commands(&Encoded::new(swap, &swap_keys).packed)[0])
        else {
            panic!("swap not read");
        };
        assert_eq!(op, swap);
        assert_eq!(keys[0].next.as_deref(), Some("new"));
        assert_eq!(keys[0].token, "old");
        assert_eq!(
            command(&commands(&scripts::history_id_command())[0]),
            Command::HistoryId
        );
        for load in scripts::load_commands() {
            assert_eq!(command(&commands(&load)[0]), Command::Load);
        }
    }

    /// A node's reply decodes, by the driver's own decoder, to what it said.
    #[test]
    fn a_nodes_replies_decode_to_what_it_said() {
        let keys = [Key::new("r1", "t1"), Key::new("r2", "t2")];
        let facts = NodeFacts {
            epoch: 12,
            age: Duration::from_millis(3500),
            max_ttl: Duration::from_millis(9000),
            history: 5,
            after: After::NONE,
            prev_max: Duration::from_millis(1000),
        };
        let op = Op::Acquire {
            lean: None,
            intent: std::time::Duration::ZERO,
            place: crate::algorithm::round::Place::NONE,
            ttl: Duration::from_millis(5000),
            known_max: Duration::from_millis(5000),
            fenced: false,
            after: After::NONE,
            known_prev: std::time::Duration::ZERO,
        };
        let said = Reply {
            answers: vec![Answer::Ok, Answer::Other],
            facts: Some(facts),
            fence: None,
            server: None,
            woke: 0,
            held: vec![None, Some(Duration::from_millis(800))],
        };
        let enc = Encoded::new(op, &keys);
        let got = enc.decode(reply(op, Ok(said.clone()))).expect("decodes");
        assert_eq!(got.answers, said.answers);
        // The owner's remaining TTL, as the script answers it.
        assert_eq!(got.held, said.held);
        // The history's key is not in the reply: the reading connection
        // makes it (`NodeFacts::seen_by`).
        assert_eq!(
            got.facts,
            Some(NodeFacts {
                history: 0,
                ..facts
            })
        );
        let release = Op::Release {
            keep_until: Instant::now(),
            notice: 0,
        };
        let enc = Encoded::new(release, &keys);
        let said = Reply {
            answers: vec![Answer::Absent, Answer::Other],
            facts: None,
            fence: None,
            server: None,
            woke: 0,
            held: Vec::new(),
        };
        assert_eq!(
            enc.decode(reply(release, Ok(said)))
                .expect("decodes")
                .answers,
            [Answer::Absent, Answer::Other]
        );
        assert!(enc.decode(reply(release, Err("refused"))).is_err());
    }
}
