//! A simulated client's status query ([`Transport::inspect`], which
//! [`Election::leader`](crate::Election::leader) and its observer read):
//! as the driver's `inspect_one`, a fresh simulated connection per node, all
//! at once, that pipelines `GET`, `PTTL` and the `HGET` of an election's
//! term (`term:<key>`), each node answering from its store when the commands
//! reach it (a paused node when it resumes, a muted or cut-off one never),
//! the replies awaited until the timeout.
//!
//! What it does not model: reader sets (their `ZREVRANGE` and `TIME`: a
//! node holding one answers with an error here), and the connect's own
//! round trip.
//!
//! [`Transport::inspect`]: crate::lock::transport::Transport::inspect

use std::sync::Arc;
use std::time::Duration;

use redis::Value;

use crate::algorithm::health::Outcome;
use crate::algorithm::round::{is_token, CLAIM_PREFIX};
use crate::clock::Signal;
use crate::driver::scripts::META_KEY;
use crate::error::{NodeError, NodeErrorKind};
use crate::lock::transport::Stored;
use crate::testing::sim::redis::{commands, Inbox};
use crate::testing::sim::sched::Sched;
use crate::testing::sim::world::Msg;

/// One node's query: its connection's replies so far, or why it has none.
enum Query {
    Open(Arc<Inbox>, Vec<Value>),
    Failed(NodeErrorKind, &'static str),
}

/// Reads `resource` on every entry's node (`entries`: per entry, its node;
/// `names`: per entry, its name), within `timeout`.
pub(crate) fn inspect(
    sched: &Arc<Sched>,
    names: &[String],
    entries: &[usize],
    resource: &str,
    timeout: Duration,
) -> Vec<Result<Option<Stored>, NodeError>> {
    let cmds: Vec<Value> = [
        redis::cmd("GET").arg(resource).get_packed_command(),
        redis::cmd("PTTL").arg(resource).get_packed_command(),
        redis::cmd("HGET")
            .arg(META_KEY)
            .arg(format!("term:{resource}"))
            .get_packed_command(),
    ]
    .iter()
    .flat_map(|b| commands(b))
    .collect();
    let signal = Arc::new(Signal::default());
    let start = sched.nanos();
    let deadline = start.saturating_add(u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX));
    let mut unanswered_connect = false;
    let mut queries: Vec<Query> = {
        let mut core = sched.lock();
        let world = &mut core.world;
        entries
            .iter()
            .map(|&node| {
                let inbox = Inbox::new(signal.clone());
                match world.connect(node, &inbox) {
                    Ok(lane) => {
                        for cmd in &cmds {
                            let msg = Msg {
                                node,
                                sent: start,
                                cmd: cmd.clone(),
                                inbox: inbox.clone(),
                                lane,
                            };
                            world.send(msg, start);
                        }
                        Query::Open(inbox, Vec::new())
                    }
                    Err(Outcome::Refused) => {
                        Query::Failed(NodeErrorKind::Unavailable, "connection refused")
                    }
                    Err(_) => {
                        unanswered_connect = true;
                        Query::Failed(NodeErrorKind::Timeout, "connect timed out")
                    }
                }
            })
            .collect()
    };
    loop {
        let seen = signal.seen();
        let mut pending = unanswered_connect;
        for q in &mut queries {
            if let Query::Open(inbox, got) = q {
                while let Some(v) = inbox.pop() {
                    got.push(v);
                }
                if got.len() < cmds.len() {
                    if inbox.is_closed() {
                        *q = Query::Failed(NodeErrorKind::Io, "connection reset by the node");
                    } else {
                        pending = true;
                    }
                }
            }
        }
        if !pending || sched.nanos() >= deadline {
            break;
        }
        sched.wait_signal(&signal, seen, Some(sched.instant(deadline)));
    }
    queries
        .into_iter()
        .zip(names)
        .map(|(q, name)| {
            let fail = |kind, what: &str| Err(NodeError::new(name, kind, what));
            match q {
                Query::Failed(kind, what) => fail(kind, what),
                Query::Open(_, got) if got.len() < cmds.len() => {
                    fail(NodeErrorKind::Timeout, "no reply within the timeout")
                }
                Query::Open(_, got) => {
                    stored(&got).map_err(|what| NodeError::new(name, NodeErrorKind::Server, what))
                }
            }
        })
        .collect()
}

/// What the replies to `GET`, `PTTL` and `HGET` (the term) say of the key.
fn stored(got: &[Value]) -> Result<Option<Stored>, String> {
    let (value, claim) = match &got[0] {
        Value::Nil => return Ok(None),
        Value::BulkString(b) => match String::from_utf8(b.clone()) {
            Ok(v) if is_token(&v) => (v, false),
            Ok(v) if v.starts_with(CLAIM_PREFIX) => (String::new(), true),
            // An application's string: not a lock's.
            _ => (String::new(), false),
        },
        Value::ServerError(e) => {
            return Err(format!("{} (a reader set: not modelled here)", e.code()))
        }
        v => return Err(format!("GET: {v:?}")),
    };
    let ttl = match &got[1] {
        Value::Int(ms) if *ms >= 0 => Some(Duration::from_millis(ms.unsigned_abs())),
        Value::Int(-1) => None,
        // Expired between the commands.
        Value::Int(_) => return Ok(None),
        v => return Err(format!("PTTL: {v:?}")),
    };
    // An election's term, with the token it is of.
    let term = match &got[2] {
        Value::BulkString(b) => std::str::from_utf8(b).ok().and_then(|v| {
            let (t, token) = v.split_once(' ')?;
            Some((t.parse().ok()?, token.to_owned()))
        }),
        _ => None,
    };
    Ok(Some(Stored {
        lock: !value.is_empty() || claim,
        value,
        ttl,
        readers: None,
        claim,
        term,
    }))
}
