//! `quorumlock status KEY`: the key on every node, a writer's or a set of
//! readers, and the verdict of the majority, with the leader where KEY is
//! an election's name.

use std::io::{self, Write};
use std::time::Duration;

use quorumlock::{KeyInfo, NodeKey};

use super::{
    client, error_detail, exit_code, refused_credentials, seconds, StatusArgs, EX_CONFIG, EX_OSERR,
    EX_UNAVAILABLE,
};

pub(crate) fn status(args: StatusArgs) -> u8 {
    let locks = match client(&args.nodes, |b| b) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let nodes = match locks.inspect(&args.key) {
        Ok(n) => n,
        Err(e) => {
            say!("cannot inspect {}: {e}", args.key);
            return exit_code(&e);
        }
    };
    let width = nodes.iter().map(|n| n.node().len()).max().unwrap_or(0);
    let mut out = io::stdout().lock();
    let mut answered = 0;
    for n in &nodes {
        let line = match n.key() {
            Ok(Some(k)) => {
                answered += 1;
                key_line(k, args.show_token)
            }
            Ok(None) => {
                answered += 1;
                "free".to_owned()
            }
            Err(e) => {
                // A server's error reply (WRONGTYPE: not a lock) is an answer.
                if e.kind() == quorumlock::NodeErrorKind::Server {
                    answered += 1;
                }
                format!("error: {}", error_detail(e))
            }
        };
        if writeln!(out, "{:<width$}  {line}", n.node()).is_err() {
            return EX_OSERR;
        }
    }
    let mut verdict = summary(&args.key, &nodes, locks.quorum());
    // Where a candidate of an election (`quorumlock lead`) holds the key
    // on a majority: who, in which term. (Reading who leads takes no TTL:
    // the election's is for campaigns.) A failure to read it leaves the
    // verdict as it is; the node lines say what failed.
    let election = locks.election(args.key.as_str(), Duration::from_secs(1));
    if let Ok(Some(leader)) = election.leader() {
        verdict.push_str(&format!(
            "; led by {} in term {}",
            leader.id().escape_debug(),
            leader.term()
        ));
    }
    if writeln!(out, "{verdict}").is_err() {
        return EX_OSERR;
    }
    if answered >= locks.quorum() {
        return 0;
    }
    say!(
        "only {answered} of {} nodes answered; {} needed",
        nodes.len(),
        locks.quorum()
    );
    // Nodes that refuse the credentials: the node list to fix.
    let refused = nodes
        .iter()
        .any(|n| n.key().is_err_and(refused_credentials));
    if refused {
        EX_CONFIG
    } else {
        EX_UNAVAILABLE
    }
}

/// One node's key: `held  ttl=12.3s`, or for a set of readers `read
/// readers=2  ttl=9.8s,9.1s`, `  writer waiting` where a writer's intent
/// lives; a set with no live reader is `free` (with its waiting writer);
/// a free key a waiting lock of several claims, `free  claimed by a
/// waiting lock of several  ttl=0.3s`. Tokens only when asked for,
/// control characters escaped.
fn key_line(k: &KeyInfo, show_token: bool) -> String {
    let waiting = if k.writer_waiting().is_some() {
        "  writer waiting"
    } else {
        ""
    };
    if !k.is_lock() {
        return "not a lock key (another owner's value: no lock takes or changes it)".to_owned();
    }
    if let Some(ttl) = k.set_waiting() {
        return format!(
            "free  claimed by a waiting lock of several  ttl={}",
            seconds(ttl)
        );
    }
    if !k.is_read() {
        let ttl = k.ttl().map_or_else(|| "none".to_owned(), seconds);
        return if show_token {
            format!("held  ttl={ttl}  token={}", k.token().escape_debug())
        } else {
            format!("held  ttl={ttl}")
        };
    }
    let readers = k.readers();
    if readers.is_empty() {
        return format!("free{waiting}");
    }
    let ttls: Vec<String> = readers.iter().map(|r| seconds(r.ttl())).collect();
    let mut line = format!(
        "read  readers={}  ttl={}{waiting}",
        readers.len(),
        ttls.join(",")
    );
    if show_token {
        let tokens: Vec<String> = readers
            .iter()
            .map(|r| r.token().escape_debug().to_string())
            .collect();
        line.push_str(&format!("  tokens={}", tokens.join(",")));
    }
    line
}

/// The majority's verdict. A writer's token or a reader's is counted on
/// every node that holds it: `KEY: held on N of M nodes` (a writer),
/// `KEY: held for reading by K readers on N of M nodes` (K readers each on
/// a majority, N the fewest nodes any of them is on; where none is on a
/// majority, those on the most nodes, N), `KEY: free on every node that
/// answered`, or `KEY: no node answered`; then `; writer waiting on W of M nodes` where a writer's
/// intent lives, and `; claimed by a waiting lock of several on C of M
/// nodes` where a set's claim does. A lock on a bare majority is one node
/// failure from loss.
fn summary(key: &str, nodes: &[NodeKey], quorum: usize) -> String {
    let mut writers: Vec<(&str, usize)> = Vec::new();
    let mut readers: Vec<(&str, usize)> = Vec::new();
    let mut waiting = 0;
    let mut foreign = 0;
    let mut claimed = 0;
    for k in nodes.iter().filter_map(|n| n.key().ok().flatten()) {
        if k.writer_waiting().is_some() {
            waiting += 1;
        }
        if !k.is_lock() {
            foreign += 1;
        } else if k.set_waiting().is_some() {
            claimed += 1;
        } else if k.is_read() {
            for r in k.readers() {
                count(&mut readers, r.token());
            }
        } else {
            count(&mut writers, k.token());
        }
    }
    let writer = writers.iter().map(|(_, c)| *c).max().unwrap_or(0);
    let reader = readers.iter().map(|(_, c)| *c).max().unwrap_or(0);
    let m = nodes.len();
    let mut line = if writer > 0 && (writer >= quorum || writer >= reader) {
        format!("{key}: held on {writer} of {m} nodes")
    } else if reader > 0 {
        let on = if reader >= quorum {
            readers
                .iter()
                .map(|(_, c)| *c)
                .filter(|&c| c >= quorum)
                .min()
                .unwrap_or(reader)
        } else {
            reader
        };
        let by = readers.iter().filter(|(_, c)| *c >= on).count();
        let plural = if by == 1 { "" } else { "s" };
        format!("{key}: held for reading by {by} reader{plural} on {on} of {m} nodes")
    } else if foreign > 0 {
        format!("{key}: not a lock key on {foreign} of {m} nodes (another owner's value)")
    } else if nodes.iter().any(|n| n.key().is_ok()) {
        format!("{key}: free on every node that answered")
    } else {
        format!("{key}: no node answered")
    };
    if waiting > 0 {
        line.push_str(&format!("; writer waiting on {waiting} of {m} nodes"));
    }
    if claimed > 0 {
        line.push_str(&format!(
            "; claimed by a waiting lock of several on {claimed} of {m} nodes"
        ));
    }
    line
}

/// One more node holding `token`.
fn count<'a>(tally: &mut Vec<(&'a str, usize)>, token: &'a str) {
    match tally.iter_mut().find(|(t, _)| *t == token) {
        Some((_, c)) => *c += 1,
        None => tally.push((token, 1)),
    }
}
