//! Commands on a connection of their own, outside rounds and pools: the
//! `check` probe, the status query, the owed releases at drop.

use crate::driver::conn::{is_auth_error, server_text};
use crate::driver::node::encode::Encoded;
use crate::driver::node::replies::{info_of, refuses_connection};

use std::time::{Duration, Instant};

use redis::Value;

use crate::algorithm::round::{is_token, Key, CLAIM_PREFIX, META_KEY};
use crate::algorithm::round::{After, Answer, Op, Reply};
use crate::clock::after;
use crate::driver::conn::{self, Conn, Target};
use crate::driver::conn_state::Setup;
use crate::driver::scripts::READERS_MARK;
use crate::error::NodeErrorKind;
use crate::lock::transport::{Probe, Readers, Stored};

/// Sends one release command (`EVAL`, so that no script cache is needed)
/// on a new connection, and waits for its reply: within `connect` to
/// connect and `reply` for the reply.
pub(crate) fn release_once(
    target: &Target,
    cmd: &[u8],
    (connect, reply): (Duration, Duration),
) -> Result<(), String> {
    // A query's connection sends nothing at connect: the first reply is
    // this command's.
    let mut c = Conn::connect(target, connect, conn::For::Query).map_err(|e| e.to_string())?;
    match exchange(&mut c, cmd, reply)?.0 {
        Value::ServerError(e) => Err(server_text(&e)),
        _ => Ok(()),
    }
}

/// What [`Redlock::check`](crate::Redlock::check) reads from one node, on a
/// connection of its own: the connect's own setup replies (`SCRIPT LOAD`,
/// `INFO`, the metadata's id), five `PING`s one after another, `TIME`
/// against this machine's clock, `CONFIG GET` of the persistence settings,
/// and the acquire and release scripts on `key` (on this node alone, for
/// one second at most: no lock is granted by one node).
pub(crate) fn probe_one(target: &Target, key: &str, timeout: Duration) -> Probe {
    let mut p = Probe::default();
    let mut c = match Conn::connect(target, timeout, conn::For::Check) {
        Ok(c) => c,
        Err(conn::ConnectError::Auth(why)) => {
            p.auth = Some(why);
            return p;
        }
        Err(e) => {
            p.connect = Some(format!("unreachable: {e}"));
            return p;
        }
    };
    if let Err(why) = read_setup(&mut c, &mut p, timeout) {
        if p.auth.is_none() {
            p.connect = Some(why);
        }
        return p;
    }
    for _ in 0..5 {
        match ask(&mut c, &redis::cmd("PING"), timeout) {
            Ok((_, rtt)) => p.rtts.push(rtt),
            Err(_) => break,
        }
    }
    p.clock = clock_offset(&mut c, timeout);
    p.persistence = Some(persistence(&mut c, timeout));
    // The lock's own scripts on `key`, on this node: a SET NX of a random
    // token for a second at most, and its compare-and-delete.
    let token = crate::clock::new_token();
    let ops = probe_ops();
    p.scripts = Some(writer_scripts(&mut c, Key::new(key, &token), ops, timeout));
    p.read_scripts = Some(reader_scripts(&mut c, key, ops, timeout));
    p
}

/// The connect's setup replies, in order, into `p` (`SCRIPT LOAD`, `INFO`,
/// the lock history's id): `Err` with why the connection is of no use when
/// one is not answered or the server turned the connection away.
fn read_setup(c: &mut Conn, p: &mut Probe, timeout: Duration) -> Result<(), String> {
    let deadline = after(Instant::now(), timeout);
    while let Some(setup) = c.wire.pending().front().map(|q| q.setup) {
        let v = match c.wait_reply(deadline) {
            Ok(v) => v,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return Err(format!(
                    "not answering: connected, but no reply to the connect's commands within {timeout:?}"
                ))
            }
            Err(e) => return Err(format!("connected, then: {e}")),
        };
        match (setup, &v) {
            // (No password given where the node wants one.)
            (_, Value::ServerError(e)) if is_auth_error(e) => {
                p.auth = Some(server_text(e));
                return Err(server_text(e));
            }
            (_, Value::ServerError(e)) if refuses_connection(e) => {
                return Err(format!(
                    "unreachable: it turned the connection away: {}",
                    server_text(e)
                ));
            }
            (Setup::Load, Value::ServerError(e)) => p.load = Some(server_text(e)),
            (Setup::Info, Value::ServerError(e)) => p.info = Some(Err(server_text(e))),
            (Setup::Info, v) => p.info = Some(Ok(info_of(v))),
            (Setup::History, Value::ServerError(e)) => p.history_refused = Some(server_text(e)),
            (Setup::History, v) => p.history = text(v),
            _ => {}
        }
    }
    Ok(())
}

/// One command on the probe's connection and its reply, timed; within
/// `timeout`.
fn ask(c: &mut Conn, cmd: &redis::Cmd, timeout: Duration) -> Result<(Value, Duration), String> {
    exchange(c, &cmd.get_packed_command(), timeout)
}

/// Sends `bytes` (one command) and reads its reply, timed; within
/// `timeout`. Not after a command timed out or broke the connection: its
/// late reply would be read as this one's.
fn exchange(c: &mut Conn, bytes: &[u8], timeout: Duration) -> Result<(Value, Duration), String> {
    if c.wire.broken {
        return Err("not asked: an earlier command timed out or broke the connection".to_owned());
    }
    let io = |e: std::io::Error| e.to_string();
    let t0 = Instant::now();
    c.wire.queue(bytes, t0, true);
    c.flush().map_err(io)?;
    let v = c.wait_reply(after(t0, timeout)).map_err(io)?;
    Ok((v, t0.elapsed()))
}

/// The node's clock minus this machine's (µs, against the middle of the
/// round trip) by `TIME`, and the round trip; `None` without an answer.
fn clock_offset(c: &mut Conn, timeout: Duration) -> Option<(i64, Duration)> {
    let before = std::time::SystemTime::now();
    let (t, rtt) = ask(c, &redis::cmd("TIME"), timeout).ok()?;
    let node = node_micros(&t)?;
    let mid = before + rtt / 2;
    let local = mid
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
    Some((node.saturating_sub(local), rtt))
}

/// `CONFIG GET` of `save`, `appendonly` and `appendfsync`, or the first
/// refusal.
fn persistence(c: &mut Conn, timeout: Duration) -> Result<(String, String, String), String> {
    let mut config = |name: &str| match ask(c, redis::cmd("CONFIG").arg("GET").arg(name), timeout) {
        Ok((Value::Array(kv), _)) => Ok(kv.get(1).and_then(text).unwrap_or_default()),
        Ok((Value::ServerError(e), _)) => Err(server_text(&e)),
        Ok((v, _)) => Err(format!("{v:?}")),
        Err(e) => Err(e),
    };
    Ok((
        config("save")?,
        config("appendonly")?,
        config("appendfsync")?,
    ))
}

/// The probe's acquire (a writer's, for a second at most) and release.
fn probe_ops() -> (Op, Op) {
    let ttl = Duration::from_secs(1);
    let acquire = Op::Acquire {
        ttl,
        known_max: ttl,
        fenced: false,
        after: After::NONE,
        known_prev: std::time::Duration::ZERO,
        lean: None,
        intent: Duration::ZERO,
        place: crate::algorithm::round::Place::NONE,
    };
    let release = Op::Release {
        keep_until: Instant::now(),
        notice: 0,
    };
    (acquire, release)
}

/// The script of `enc` (`EVAL`) on the probe's connection, its reply
/// decoded; within `timeout`.
fn run_script(c: &mut Conn, enc: &Encoded, timeout: Duration) -> Result<Reply, String> {
    let (v, _) = exchange(c, &enc.fallback(), timeout)?;
    enc.decode(v).map_err(|(_, why)| why)
}

/// The writer's acquire of `k` and its release (`ops`): whether another
/// owner holds it, or the first refusal.
fn writer_scripts(
    c: &mut Conn,
    k: Key<'_>,
    (acquire, release): (Op, Op),
    timeout: Duration,
) -> Result<bool, String> {
    let acquire = Encoded::new(acquire, &[k]);
    let release = Encoded::new(release, &[k]);
    run_script(c, &acquire, timeout).and_then(|r| {
        let other = r.answers.first() == Some(&Answer::Other);
        run_script(c, &release, timeout).map(|_| other)
    })
}

/// Read locks' scripts: two readers of `key` (the second meets a reader
/// set) and their releases (the first leaves one behind), which between
/// them run every sorted-set command a read lock needs. Whether a writer
/// holds `key`, or the first refusal.
fn reader_scripts(
    c: &mut Conn,
    key: &str,
    (acquire, release): (Op, Op),
    timeout: Duration,
) -> Result<bool, String> {
    let readers = [
        crate::clock::new_reader_token(),
        crate::clock::new_reader_token(),
    ];
    let keys = readers.each_ref().map(|t| Key::new(key, t));
    let read = |k: Key<'_>| Encoded::new(acquire, &[k]);
    let free = |k: Key<'_>| Encoded::new(release, &[k]);
    let mut other = false;
    for k in keys {
        other |= run_script(c, &read(k), timeout)?.answers.first() == Some(&Answer::Other);
    }
    for k in keys {
        run_script(c, &free(k), timeout)?;
    }
    Ok(other)
}

/// `GET`, `PTTL`, `ZREVRANGE … WITHSCORES` and `TIME` of one key, and an
/// election's term (`HGET` of the lock metadata), on a new connection, pipelined, within `timeout` each for the connect and for the
/// replies. The last two matter only where `GET` answers `WRONGTYPE` (a
/// reader set: see `readers_lua!`); elsewhere their answers, errors
/// included (an ACL without them), are ignored. All are commands the
/// lock's scripts run.
pub(crate) fn inspect_one(
    target: &Target,
    resource: &str,
    timeout: Duration,
) -> Result<Option<Stored>, (NodeErrorKind, String)> {
    let mut c =
        Conn::connect(target, timeout, conn::For::Query).map_err(|e| (e.kind(), e.detail()))?;
    let now = Instant::now();
    let cmds = [
        redis::cmd("GET").arg(resource).get_packed_command(),
        redis::cmd("PTTL").arg(resource).get_packed_command(),
        redis::cmd("ZREVRANGE")
            .arg(resource)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .get_packed_command(),
        redis::cmd("TIME").get_packed_command(),
        redis::cmd("HGET")
            .arg(META_KEY)
            .arg(format!("term:{resource}"))
            .get_packed_command(),
    ];
    for cmd in &cmds {
        c.wire.queue(cmd, now, true);
    }
    let io = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::TimedOut {
            // (The I/O error's own words, "timed out", repeat the kind.)
            (
                NodeErrorKind::Timeout,
                format!("connected, but no reply within {timeout:?}"),
            )
        } else {
            (NodeErrorKind::Io, e.to_string())
        }
    };
    c.flush().map_err(io)?;
    let deadline = after(now, timeout);
    // A query's connection sends nothing at connect: the replies are the
    // four commands', in order.
    let mut next = || c.wait_reply(deadline).map_err(io);
    let stored = stored_of(next()?, next()?, next()?, next()?)?;
    // An election's term, with the token it is of (an ACL without the
    // lock's metadata, or anything else, reads as none).
    let term = match next()? {
        Value::BulkString(b) => String::from_utf8(b).ok().and_then(|v| {
            let (t, token) = v.split_once(' ')?;
            Some((t.parse().ok()?, token.to_owned()))
        }),
        _ => None,
    };
    Ok(stored.map(|s| Stored { term, ..s }))
}

/// What [`inspect_one`]'s four replies say of the key.
fn stored_of(
    get: Value,
    pttl: Value,
    range: Value,
    time: Value,
) -> Result<Option<Stored>, (NodeErrorKind, String)> {
    let server = |e: &redis::ServerError| {
        let kind = if is_auth_error(e) {
            NodeErrorKind::Auth
        } else {
            NodeErrorKind::Server
        };
        (kind, server_text(e))
    };
    let mut claim = false;
    let (value, readers) = match get {
        Value::Nil => return Ok(None),
        Value::BulkString(b) => match String::from_utf8(b) {
            Ok(v) if is_token(&v) => (v, None),
            Ok(v) if v.starts_with(CLAIM_PREFIX) => {
                claim = true;
                (String::new(), None)
            }
            // An application's string: not a lock's.
            _ => (String::new(), None),
        },
        Value::ServerError(e) if e.code() == "WRONGTYPE" => {
            // A reader set; or a key no lock of this crate wrote, which
            // `ZREVRANGE` refuses as `GET` did (`WRONGTYPE`: not a lock's),
            // or an ACL without it (`NOPERM`): its words.
            let entries = match range {
                Value::Array(a) => a,
                Value::ServerError(z) if z.code() == "WRONGTYPE" => Vec::new(),
                Value::ServerError(z) => return Err(server(&z)),
                _ => return Err(malformed_range()),
            };
            if entries.is_empty() && pttl == Value::Int(-2) {
                // Gone between the commands.
                return Ok(None);
            }
            let now = match (node_ms(&time), &time) {
                (Some(ms), _) => ms,
                (None, Value::ServerError(t)) => {
                    return Err((NodeErrorKind::Server, format!("TIME: {}", server_text(t))))
                }
                (None, v) => return Err(protocol("TIME", v)),
            };
            // A sorted set without the crate's mark is an application's.
            (String::new(), readers_of(entries, now)?)
        }
        Value::ServerError(e) => return Err(server(&e)),
        v => return Err(protocol("GET", &v)),
    };
    let ttl = match pttl {
        Value::Int(ms) if ms >= 0 => Some(Duration::from_millis(ms.unsigned_abs())),
        Value::Int(-1) => None,
        // Expired between the commands.
        Value::Int(_) => return Ok(None),
        Value::ServerError(e) => return Err(server(&e)),
        v => return Err(protocol("PTTL", &v)),
    };
    Ok(Some(Stored {
        lock: !value.is_empty() || readers.is_some() || claim,
        value,
        ttl,
        readers,
        claim,
        term: None,
    }))
}

/// A reader set's live entries at the node's time `now` (ms): each
/// member scored above it, longest-lived first (the range's order), `w`
/// as the writers' intent; `None` for a sorted set without the crate's
/// mark ([`READERS_MARK`]): an application's. RESP2 answers `member,
/// score, …`; RESP3 pairs.
fn readers_of(entries: Vec<Value>, now: f64) -> Result<Option<Readers>, (NodeErrorKind, String)> {
    let mut flat = Vec::with_capacity(entries.len());
    for e in entries {
        match e {
            Value::Array(pair) => flat.extend(pair),
            v => flat.push(v),
        }
    }
    let mut out = Readers {
        live: Vec::new(),
        intent: None,
    };
    let mut marked = false;
    for pair in flat.chunks(2) {
        let [member, score] = pair else {
            return Err(malformed_range());
        };
        let (Some(member), Some(score)) = (text(member), score_of(score)) else {
            return Err(malformed_range());
        };
        marked |= member == READERS_MARK;
        // An entry counts only until its score (the scripts drop it then;
        // the mark, scored 0, is none).
        if score <= now {
            continue;
        }
        // `as` saturates: an entry scored at +inf lives "for ever".
        let left = Duration::from_millis((score - now).ceil() as u64);
        if member == "w" {
            out.intent = Some(left);
        } else {
            out.live.push((member, left));
        }
    }
    Ok(marked.then_some(out))
}

/// A reply's text: a bulk, simple or verbatim string.
fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// A sorted set's score: a string in RESP2 (`inf` and `-inf` too), a
/// double in RESP3.
fn score_of(v: &Value) -> Option<f64> {
    match v {
        Value::Double(d) => Some(*d),
        Value::Int(i) => Some(*i as f64),
        v => text(v)?.parse::<f64>().ok().filter(|s| !s.is_nan()),
    }
}

/// The node's time in µs from `TIME`'s reply.
fn node_micros(v: &Value) -> Option<i64> {
    let Value::Array(t) = v else { return None };
    let num = |v: Option<&Value>| text(v?)?.parse::<i64>().ok();
    let (secs, micros) = (num(t.first())?, num(t.get(1))?);
    Some(secs.saturating_mul(1_000_000).saturating_add(micros))
}

/// The node's time in ms from `TIME`'s reply, rounded down as the
/// scripts' `ms_now()` does.
fn node_ms(v: &Value) -> Option<f64> {
    node_micros(v).map(|us| us.div_euclid(1000) as f64)
}

/// A `ZREVRANGE` reply that is no list of members and scores (never
/// quoted: its members are tokens).
fn malformed_range() -> (NodeErrorKind, String) {
    (
        NodeErrorKind::Protocol,
        "ZREVRANGE answered something other than members and scores".to_owned(),
    )
}

fn protocol(what: &str, v: &Value) -> (NodeErrorKind, String) {
    (NodeErrorKind::Protocol, format!("{what} answered {v:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    fn wrongtype() -> Value {
        let v = redis::parse_redis_value(
            b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
        );
        v.unwrap_or(Value::Nil)
    }

    /// `TIME` at 1000.250 s: 1_000_250 ms.
    fn time() -> Value {
        Value::Array(vec![bulk("1000"), bulk("250999")])
    }

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    /// After a probe's command timed out, its late reply is not taken as the
    /// answer to the next command on that connection (`check` once printed a
    /// `CONFIG GET`'s reply as the scripts' result): the next command is not
    /// asked.
    #[test]
    fn a_command_after_a_timeout_is_not_answered_by_the_late_reply() {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let target = Target::local(listener.local_addr().expect("addr").port());
        let mut c =
            Conn::connect(&target, Duration::from_secs(2), conn::For::Query).expect("connect");
        let (mut server, _) = listener.accept().expect("accept");
        let late = ask(&mut c, &redis::cmd("PING"), Duration::from_millis(50));
        assert!(late.is_err(), "no answer yet: {late:?}");
        // The PING's late reply, then what would answer an ECHO.
        let mut buf = [0u8; 64];
        let _ = server.read(&mut buf).expect("the PING");
        server
            .write_all(b"+PONG\r\n$1\r\nx\r\n")
            .expect("late replies");
        std::thread::sleep(Duration::from_millis(50));
        let next = ask(&mut c, redis::cmd("ECHO").arg("x"), Duration::from_secs(1));
        match next {
            Err(why) => assert!(why.contains("timed out"), "{why}"),
            Ok((v, _)) => panic!("the next command read {v:?}"),
        }
    }

    #[test]
    fn a_writers_key_is_its_value_whatever_the_set_commands_say() {
        for token in [TOKEN.to_owned(), format!("{TOKEN}.00112233445566ff")] {
            let s = stored_of(bulk(&token), Value::Int(1500), wrongtype(), Value::Nil);
            assert_eq!(
                s,
                Ok(Some(Stored {
                    lock: true,
                    value: token,
                    ttl: Some(Duration::from_millis(1500)),
                    readers: None,
                    claim: false,
                    term: None,
                }))
            );
        }
        assert_eq!(
            stored_of(Value::Nil, Value::Int(-2), wrongtype(), time()),
            Ok(None)
        );
    }

    #[test]
    fn a_reader_set_lists_its_live_entries() {
        // RESP2: member, score, … by descending score; one entry dead.
        let range = Value::Array(vec![
            bulk("ra"),
            bulk("1009250"),
            bulk("w"),
            bulk("1000550"),
            bulk("rb"),
            bulk("1000251"),
            bulk("rdead"),
            bulk("1000250"),
            bulk(READERS_MARK),
            bulk("0"),
        ]);
        let s = stored_of(wrongtype(), Value::Int(9000), range, time());
        let want = Stored {
            lock: true,
            value: String::new(),
            ttl: Some(Duration::from_millis(9000)),
            readers: Some(Readers {
                live: vec![
                    ("ra".into(), Duration::from_millis(9000)),
                    ("rb".into(), Duration::from_millis(1)),
                ],
                intent: Some(Duration::from_millis(300)),
            }),
            claim: false,
            term: None,
        };
        assert_eq!(s, Ok(Some(want.clone())));
        // RESP3: pairs, scores as doubles.
        let pairs = Value::Array(vec![
            Value::Array(vec![bulk("ra"), Value::Double(1_009_250.0)]),
            Value::Array(vec![bulk("w"), Value::Double(1_000_550.0)]),
            Value::Array(vec![bulk("rb"), Value::Double(1_000_251.0)]),
            Value::Array(vec![bulk(READERS_MARK), Value::Double(0.0)]),
        ]);
        assert_eq!(
            stored_of(wrongtype(), Value::Int(9000), pairs, time()),
            Ok(Some(want))
        );
        // Scored at +inf: saturates.
        let inf = Value::Array(vec![bulk("rx"), bulk("inf"), bulk(READERS_MARK), bulk("0")]);
        let s = stored_of(wrongtype(), Value::Int(-1), inf, time());
        let live = s.ok().flatten().and_then(|s| s.readers).map(|r| r.live);
        assert_eq!(
            live,
            Some(vec![("rx".into(), Duration::from_millis(u64::MAX))])
        );
    }

    /// A free key a waiting set claims: the crate's own, no token, its
    /// time left.
    #[test]
    fn a_sets_claim_is_read_as_one() {
        let claim = format!("{CLAIM_PREFIX}0193a1b2c3d40123456789abcdef");
        let s = stored_of(bulk(&claim), Value::Int(300), wrongtype(), Value::Nil);
        assert_eq!(
            s,
            Ok(Some(Stored {
                lock: true,
                value: String::new(),
                ttl: Some(Duration::from_millis(300)),
                readers: None,
                claim: true,
                term: None,
            }))
        );
        let k = crate::KeyInfo::from(s.ok().flatten().expect("a key"));
        assert_eq!(k.set_waiting(), Some(Duration::from_millis(300)));
        assert!(k.is_lock() && !k.is_read() && k.token().is_empty());
    }

    #[test]
    fn an_applications_key_of_any_type_is_no_lock_and_its_value_not_shown() {
        let foreign = |ttl: Option<Duration>| {
            Ok(Some(Stored {
                lock: false,
                value: String::new(),
                ttl,
                readers: None,
                claim: false,
                term: None,
            }))
        };
        // A string of another shape.
        for v in [
            "app-value",
            "",
            "0123456789abcdef0123456789abcdeF",
            "r0123456789abcdef",
        ] {
            let s = stored_of(bulk(v), Value::Int(-1), wrongtype(), Value::Nil);
            assert_eq!(s, foreign(None), "{v:?}");
        }
        // A hash, a list, a set or a stream: `ZREVRANGE` refuses it too.
        let s = stored_of(wrongtype(), Value::Int(-1), wrongtype(), time());
        assert_eq!(s, foreign(None));
        // A sorted set without the mark, live-looking members and all.
        let range = Value::Array(vec![
            bulk("ra"),
            bulk("1009250"),
            bulk("w"),
            bulk("1000550"),
        ]);
        let s = stored_of(wrongtype(), Value::Int(5000), range, time());
        assert_eq!(s, foreign(Some(Duration::from_millis(5000))));
    }

    #[test]
    fn bad_replies_are_errors_that_quote_no_token() {
        // An ACL refuses the range.
        let noperm = redis::parse_redis_value(b"-NOPERM no permissions\r\n").unwrap_or(Value::Nil);
        let s = stored_of(wrongtype(), Value::Int(-1), noperm, time());
        assert!(
            matches!(&s, Err((NodeErrorKind::Server, m)) if m.contains("NOPERM")),
            "{s:?}"
        );
        // Gone between the commands.
        let s = stored_of(wrongtype(), Value::Int(-2), Value::Array(vec![]), time());
        assert_eq!(s, Ok(None));
        // An odd entry count or a score that is no number.
        for range in [
            Value::Array(vec![bulk("rsecret")]),
            Value::Array(vec![bulk("rsecret"), bulk("soon")]),
        ] {
            let s = stored_of(wrongtype(), Value::Int(10), range, time());
            assert!(
                matches!(&s, Err((NodeErrorKind::Protocol, m)) if !m.contains("rsecret")),
                "{s:?}"
            );
        }
        let range = Value::Array(vec![
            bulk("ra"),
            bulk("1009250"),
            bulk(READERS_MARK),
            bulk("0"),
        ]);
        let s = stored_of(wrongtype(), Value::Int(10), range, Value::Nil);
        assert!(matches!(&s, Err((NodeErrorKind::Protocol, _))), "{s:?}");
    }
}
