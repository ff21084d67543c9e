//! Commands on a connection of their own, outside rounds and pools: the
//! `check` probe, the status query, the owed releases at drop.

use crate::driver::node::encode::Encoded;
use crate::driver::node::replies::{info_of, refuses_connection, server_text};

use std::time::{Duration, Instant};

use redis::Value;

use crate::algorithm::round::Key;
use crate::algorithm::round::{After, Answer, Op, Reply};
use crate::clock::after;
use crate::driver::conn::{self, Conn, Target};
use crate::driver::wire::Setup;
use crate::error::NodeErrorKind;
use crate::lock::transport::Stored;

/// Sends one release command (`EVAL`, so that no script cache is needed)
/// on a new connection, and waits for its reply: within `timeout` to
/// connect and `timeout` for the reply.
pub(crate) fn release_once(target: &Target, cmd: &[u8], timeout: Duration) -> Result<(), String> {
    let mut c = Conn::connect_for(target, timeout, conn::For::Query).map_err(|e| e.to_string())?;
    let now = Instant::now();
    c.wire.queue(cmd, now, true);
    c.flush().map_err(|e| e.to_string())?;
    let deadline = after(now, timeout);
    loop {
        let wanted = c.wire.pending().front().is_some_and(|p| p.wanted);
        let v = c.wait_reply(deadline).map_err(|e| e.to_string())?;
        if wanted {
            return match v {
                Value::ServerError(e) => Err(server_text(&e)),
                _ => Ok(()),
            };
        }
    }
}

/// What [`Redlock::check`](crate::Redlock::check) reads from one node, on a
/// connection of its own: the connect's own setup replies (`SCRIPT LOAD`,
/// `INFO`, the metadata's id), five `PING`s one after another, `TIME`
/// against this machine's clock, `CONFIG GET` of the persistence settings,
/// and the acquire and release scripts on `key` (on this node alone, for
/// one second at most: no lock is granted by one node).
pub(crate) fn probe_one(
    target: &Target,
    key: &str,
    timeout: Duration,
) -> crate::lock::transport::Probe {
    use crate::lock::transport::Probe;
    let mut p = Probe::default();
    let mut c = match Conn::connect_for(target, timeout, conn::For::Check) {
        Ok(c) => c,
        Err(e) => {
            p.connect = Some(e.to_string());
            return p;
        }
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let io = |e: std::io::Error| e.to_string();
    // The connect's setup replies, in order.
    let deadline = after(Instant::now(), timeout);
    while let Some(setup) = c.wire.pending().front().map(|q| q.setup) {
        let v = match c.wait_reply(deadline) {
            Ok(v) => v,
            Err(e) => {
                p.connect = Some(format!("no answer to the connect's commands: {e}"));
                return p;
            }
        };
        match (setup, &v) {
            (_, Value::ServerError(e)) if refuses_connection(e) => {
                p.connect = Some(format!("it turned the connection away: {}", server_text(e)));
                return p;
            }
            (Setup::Load, Value::ServerError(e)) => p.load = Some(server_text(e)),
            (Setup::Info, Value::ServerError(e)) => p.info = Some(Err(server_text(e))),
            (Setup::Info, v) => p.info = Some(Ok(info_of(v))),
            (Setup::History, v) => p.history = text(v),
            _ => {}
        }
    }
    // One command and its reply, timed.
    let ask = |c: &mut Conn, cmd: &redis::Cmd| -> Result<(Value, Duration), String> {
        let t0 = Instant::now();
        c.wire.queue(&cmd.get_packed_command(), t0, true);
        c.flush().map_err(io)?;
        let v = c.wait_reply(after(t0, timeout)).map_err(io)?;
        Ok((v, t0.elapsed()))
    };
    for _ in 0..5 {
        match ask(&mut c, &redis::cmd("PING")) {
            Ok((_, rtt)) => p.rtts.push(rtt),
            Err(_) => break,
        }
    }
    let before = std::time::SystemTime::now();
    if let Ok((Value::Array(t), rtt)) = ask(&mut c, &redis::cmd("TIME")) {
        let num = |v: Option<&Value>| v.and_then(text).and_then(|s| s.parse::<i64>().ok());
        if let (Some(secs), Some(us)) = (num(t.first()), num(t.get(1))) {
            let mid = before + rtt / 2;
            let local = mid
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
            let node = secs.saturating_mul(1_000_000).saturating_add(us);
            p.clock = Some((node.saturating_sub(local), rtt));
        }
    }
    let mut config = |name: &str| match ask(&mut c, redis::cmd("CONFIG").arg("GET").arg(name)) {
        Ok((Value::Array(kv), _)) => Ok(kv.get(1).and_then(text).unwrap_or_default()),
        Ok((Value::ServerError(e), _)) => Err(server_text(&e)),
        Ok((v, _)) => Err(format!("{v:?}")),
        Err(e) => Err(e),
    };
    let persistence = (|| {
        Ok((
            config("save")?,
            config("appendonly")?,
            config("appendfsync")?,
        ))
    })();
    p.persistence = Some(persistence);
    // The lock's own scripts on `key`, on this node: a SET NX of a random
    // token for a second at most, and its compare-and-delete.
    let token = crate::clock::new_token();
    let k = Key::new(key, &token);
    let ttl = Duration::from_secs(1);
    let acquire = Encoded::new(
        Op::Acquire {
            ttl,
            known_max: ttl,
            fenced: false,
            after: After::NONE,
            intent: Duration::ZERO,
        },
        &[k],
    );
    let release = Encoded::new(
        Op::Release {
            keep_until: Instant::now(),
            notice: 0,
        },
        &[k],
    );
    let run = |c: &mut Conn, enc: &Encoded| -> Result<Reply, String> {
        let t0 = Instant::now();
        c.wire.queue(&enc.fallback(), t0, true);
        c.flush().map_err(io)?;
        let v = c.wait_reply(after(t0, timeout)).map_err(io)?;
        enc.decode(v).map_err(|(_, why)| why)
    };
    p.scripts = Some(run(&mut c, &acquire).and_then(|r| {
        let other = r.answers.first() == Some(&Answer::Other);
        run(&mut c, &release).map(|_| other)
    }));
    p
}

/// `GET` and `PTTL` of one key on a new connection, within `timeout` each
/// for the connect and for the replies.
pub(crate) fn inspect_one(
    target: &Target,
    resource: &str,
    timeout: Duration,
) -> Result<Option<Stored>, (NodeErrorKind, String)> {
    let mut c =
        Conn::connect_for(target, timeout, conn::For::Query).map_err(|e| (e.kind(), e.detail()))?;
    let now = Instant::now();
    c.wire.queue(
        &redis::cmd("GET").arg(resource).get_packed_command(),
        now,
        true,
    );
    c.wire.queue(
        &redis::cmd("PTTL").arg(resource).get_packed_command(),
        now,
        true,
    );
    let io = |e: std::io::Error| {
        let kind = if e.kind() == std::io::ErrorKind::TimedOut {
            NodeErrorKind::Timeout
        } else {
            NodeErrorKind::Io
        };
        (kind, e.to_string())
    };
    c.flush().map_err(io)?;
    let deadline = after(now, timeout);
    // Replies to the connect's script loads come first.
    let mut replies = Vec::with_capacity(2);
    while replies.len() < 2 {
        let wanted = c.wire.pending().front().is_some_and(|p| p.wanted);
        let v = c.wait_reply(deadline).map_err(io)?;
        if wanted {
            replies.push(v);
        }
    }
    let pttl = replies.pop();
    let value = replies.pop();
    let value = match value {
        Some(Value::Nil) => return Ok(None),
        Some(Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
        Some(Value::ServerError(e)) => return Err((NodeErrorKind::Server, e.to_string())),
        v => return Err((NodeErrorKind::Protocol, format!("GET answered {v:?}"))),
    };
    let ttl = match pttl {
        Some(Value::Int(ms)) if ms >= 0 => Some(Duration::from_millis(ms.unsigned_abs())),
        Some(Value::Int(-1)) => None,
        // Expired between the two commands.
        Some(Value::Int(_)) => return Ok(None),
        Some(Value::ServerError(e)) => return Err((NodeErrorKind::Server, e.to_string())),
        v => return Err((NodeErrorKind::Protocol, format!("PTTL answered {v:?}"))),
    };
    Ok(Some(Stored { value, ttl }))
}
