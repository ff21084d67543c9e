//! The wake-up thread: one subscriber connection per node, polled
//! together; subscriptions written one channel per command; messages read
//! and told to the keys' waiters (see [`super`]).
//!
//! Every command's answer is paired with it, in order ([`Owed`]): a
//! `subscribe` confirms the channel generation that sent it (not a channel
//! of the same name made since), a refusal names its own channel, and a
//! `PING` is answered by `pong` in subscribed mode and `+PONG` outside it.
//! A frame owed to nothing, or of the wrong kind, makes the connection
//! anew. With no channel left the connections close (made again with the
//! next wait).

use std::collections::VecDeque;
use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use log::{debug, warn};
use redis::Value;

use super::{Shared, St, FREED_PREFIX, KEEPALIVE, LINGER, RECONNECT, RECONNECT_MAX};
use crate::clock::after;
use crate::driver::conn::{Conn, For, Target};
use crate::driver::poll::{poll, PollFd, PollFlags};

/// What a subscriber connection owes an answer to, in order.
enum Owed {
    /// `SUBSCRIBE` of this key's channel, of this generation.
    Subscribe(String, u64),
    Unsubscribe,
    Ping,
}

/// One node's subscriber connection, as the thread keeps it.
struct Subscriber {
    name: String,
    target: Target,
    conn: Option<Conn>,
    owed: VecDeque<Owed>,
    retry_at: Instant,
    backoff: Duration,
    last_heard: Instant,
    /// When the `PING` still unanswered was sent.
    pinged: Option<Instant>,
}

/// The thread: connects, writes subscriptions, reads messages, until the
/// client is dropped.
pub(super) fn run(
    sh: &Shared,
    targets: Vec<(String, Target)>,
    timeout: Duration,
    mut wake: UnixStream,
) {
    let now = Instant::now();
    let mut links: Vec<Subscriber> = targets
        .into_iter()
        .map(|(name, target)| Subscriber {
            name,
            target,
            conn: None,
            owed: VecDeque::new(),
            retry_at: now,
            backoff: RECONNECT,
            last_heard: now,
            pinged: None,
        })
        .collect();
    // A node silent this long after a `PING` is gone.
    let ping_wait = timeout.saturating_mul(4).max(Duration::from_secs(1));
    while !sh.stop.load(Ordering::Acquire) {
        let idle = {
            let mut st = sh.st.lock();
            st.expire(Instant::now());
            st.chans.is_empty() && st.dropped.is_empty()
        };
        if idle {
            close_all(sh, &mut links);
        } else {
            for (i, l) in links.iter_mut().enumerate() {
                if l.conn.is_none() && Instant::now() >= l.retry_at {
                    connect(sh, i, l, timeout);
                    if sh.stop.load(Ordering::Acquire) {
                        return;
                    }
                }
            }
        }
        write_subscriptions(sh, &mut links);
        let wait = if idle {
            LINGER
        } else {
            links
                .iter()
                .map(|l| match (&l.conn, l.pinged) {
                    (None, _) => l.retry_at,
                    (Some(_), Some(t)) => after(t, ping_wait),
                    (Some(_), None) => after(l.last_heard, KEEPALIVE),
                })
                .min()
                .map_or(LINGER, |t| t.saturating_duration_since(Instant::now()))
                .clamp(Duration::from_millis(1), LINGER)
        };
        let mut ready = vec![PollFlags::empty(); links.len()];
        {
            let mut fds = vec![PollFd::new(&wake, PollFlags::IN)];
            let mut which = Vec::new();
            for (i, l) in links.iter().enumerate() {
                if let Some(c) = &l.conn {
                    fds.push(c.poll_fd(c.wants_write()));
                    which.push(i);
                }
            }
            if poll(&mut fds, wait).is_err() {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            for (fd, &i) in fds[1..].iter().zip(&which) {
                ready[i] = fd.revents();
            }
        }
        let mut sink = [0u8; 64];
        while matches!(wake.read(&mut sink), Ok(1..)) {}
        for (i, l) in links.iter_mut().enumerate() {
            if ready[i].is_empty() {
                continue;
            }
            if let Err(e) = read_frames(sh, i, l, ready[i]) {
                debug!("node {}: subscriber connection lost: {e}", l.name);
                down(sh, i, l);
            }
        }
        // Judged after reading (a connect that kept the thread must not
        // make an answer waiting in the socket look late).
        keep_alive(sh, &mut links, ping_wait);
    }
}

/// Sends a `PING` on a connection silent for [`KEEPALIVE`]; makes anew one
/// that did not answer it within `ping_wait`.
fn keep_alive(sh: &Shared, links: &mut [Subscriber], ping_wait: Duration) {
    let now = Instant::now();
    for (i, l) in links.iter_mut().enumerate() {
        let Some(c) = l.conn.as_mut() else {
            continue;
        };
        match l.pinged {
            Some(t) if now.saturating_duration_since(t) >= ping_wait => {
                debug!("node {}: subscriber connection silent; made again", l.name);
                down(sh, i, l);
            }
            None if now.saturating_duration_since(l.last_heard) >= KEEPALIVE => {
                c.wire
                    .queue_unpaired(&redis::cmd("PING").get_packed_command());
                l.owed.push_back(Owed::Ping);
                l.pinged = Some(now);
                if c.flush().is_err() {
                    down(sh, i, l);
                }
            }
            _ => {}
        }
    }
}

/// Makes node `i`'s subscriber connection; every channel is subscribed on
/// it next.
fn connect(sh: &Shared, i: usize, l: &mut Subscriber, timeout: Duration) {
    let made = Conn::connect(&l.target, timeout, For::Query);
    let mut st = sh.st.lock();
    st.tried[i] = true;
    match made {
        Ok(c) => {
            l.conn = Some(c);
            l.owed.clear();
            l.last_heard = Instant::now();
            l.pinged = None;
            st.up[i] = true;
            for c in st.chans.values_mut() {
                c.sent[i] = false;
                c.confirmed[i] = false;
                c.refused[i] = false;
            }
            st.dirty = true;
        }
        Err(e) => {
            debug!("node {}: no subscriber connection: {e:?}", l.name);
            l.retry_at = after(Instant::now(), l.backoff);
            l.backoff = l.backoff.saturating_mul(2).min(RECONNECT_MAX);
        }
    }
    st.notify_all();
}

/// Node `i`'s connection is gone: its confirmations with it (those
/// channels lost what was published meanwhile). Made again after a pause
/// that doubles while the node keeps failing.
fn down(sh: &Shared, i: usize, l: &mut Subscriber) {
    l.conn = None;
    l.owed.clear();
    l.pinged = None;
    l.retry_at = after(Instant::now(), l.backoff);
    l.backoff = l.backoff.saturating_mul(2).min(RECONNECT_MAX);
    let mut st = sh.st.lock();
    st.up[i] = false;
    for c in st.chans.values_mut() {
        if std::mem::replace(&mut c.confirmed[i], false) {
            c.lost[i] = true;
        }
        c.sent[i] = false;
    }
    st.notify_all();
}

/// Nobody waits for anything: every connection closes, and the next wait
/// waits for them to be made again.
fn close_all(sh: &Shared, links: &mut [Subscriber]) {
    let mut st = sh.st.lock();
    for (i, l) in links.iter_mut().enumerate() {
        if l.conn.take().is_some() {
            debug!(
                "node {}: no key waited for; subscriber connection closed",
                l.name
            );
        }
        l.owed.clear();
        l.pinged = None;
        l.retry_at = Instant::now();
        st.up[i] = false;
        st.tried[i] = false;
    }
}

/// Writes the subscriptions (one channel per command, so that each answer
/// names its own) and unsubscriptions the connections lack.
fn write_subscriptions(sh: &Shared, links: &mut [Subscriber]) {
    let mut failed = Vec::new();
    {
        let mut st = sh.st.lock();
        if !std::mem::replace(&mut st.dirty, false) {
            return;
        }
        let dropped = std::mem::take(&mut st.dropped);
        for (i, l) in links.iter_mut().enumerate() {
            let Some(conn) = l.conn.as_mut() else {
                continue;
            };
            for k in &dropped {
                let cmd = redis::cmd("UNSUBSCRIBE")
                    .arg(format!("{FREED_PREFIX}{k}"))
                    .get_packed_command();
                conn.wire.queue_unpaired(&cmd);
                l.owed.push_back(Owed::Unsubscribe);
            }
            for (k, c) in st.chans.iter_mut() {
                if !c.sent[i] && !c.refused[i] {
                    c.sent[i] = true;
                    let cmd = redis::cmd("SUBSCRIBE")
                        .arg(format!("{FREED_PREFIX}{k}"))
                        .get_packed_command();
                    conn.wire.queue_unpaired(&cmd);
                    l.owed.push_back(Owed::Subscribe(k.clone(), c.gen));
                }
            }
            if conn.flush().is_err() {
                failed.push(i);
            }
        }
    }
    for i in failed {
        debug!("node {}: subscriber connection lost writing", links[i].name);
        down(sh, i, &mut links[i]);
    }
}

/// The bulk string at `j` of a push or an answer.
fn word(items: &[Value], j: usize) -> &[u8] {
    match items.get(j) {
        Some(Value::BulkString(b)) => b.as_slice(),
        _ => &[],
    }
}

/// Reads what node `i` sent: messages wake their key's waiters, answers
/// are paired with the commands they answer.
fn read_frames(sh: &Shared, i: usize, l: &mut Subscriber, ready: PollFlags) -> io::Result<()> {
    let Some(conn) = l.conn.as_mut() else {
        return Ok(());
    };
    conn.on_ready(ready)?;
    while let Some(v) = conn.next_frame()? {
        l.last_heard = Instant::now();
        if let Value::Array(items) = &v {
            if word(items, 0).eq_ignore_ascii_case(b"message") {
                message(sh, i, items);
                continue;
            }
        }
        let Some(owed) = l.owed.pop_front() else {
            return Err(io::Error::other("a subscriber answer owed to no command"));
        };
        match (owed, v) {
            (Owed::Subscribe(k, gen), Value::Array(items))
                if word(&items, 0).eq_ignore_ascii_case(b"subscribe") =>
            {
                l.backoff = RECONNECT;
                let mut st = sh.st.lock();
                let mut woke = false;
                if let Some(c) = st.chans.get_mut(&k).filter(|c| c.gen == gen) {
                    c.confirmed[i] = true;
                    if std::mem::replace(&mut c.lost[i], false) {
                        // Messages may have been lost while it was down.
                        c.wake_all();
                        woke = true;
                    }
                    c.confirm.notify_all();
                }
                if woke {
                    st.any.notify_all();
                }
            }
            (Owed::Subscribe(k, gen), Value::ServerError(e)) => {
                refused(&mut sh.st.lock(), i, &l.name, &k, gen, &e.to_string());
            }
            (Owed::Unsubscribe, Value::Array(items))
                if word(&items, 0).eq_ignore_ascii_case(b"unsubscribe") => {}
            (Owed::Unsubscribe, Value::ServerError(e)) => {
                debug!("node {}: unsubscribing refused: {e}", l.name);
            }
            (Owed::Ping, Value::Array(items)) if word(&items, 0).eq_ignore_ascii_case(b"pong") => {
                l.pinged = None;
            }
            (Owed::Ping, Value::SimpleString(s)) if s.eq_ignore_ascii_case("PONG") => {
                l.pinged = None;
            }
            (Owed::Ping, Value::ServerError(e)) => {
                // Refused (an ACL without `+ping`), but answered.
                debug!("node {}: keepalive PING refused: {e}", l.name);
                l.pinged = None;
            }
            (_, v) => {
                return Err(io::Error::other(format!(
                    "a subscriber answer out of step: {v:?}"
                )));
            }
        }
    }
    Ok(())
}

/// A message on a key's channel from node `node`: a notice not heard
/// lately wakes its waiters, and so does the copy that completes its
/// majority after a waiter began a try (see [`super::Notices::heard`]).
fn message(sh: &Shared, node: usize, items: &[Value]) {
    let Some(key) = word(items, 1)
        .strip_prefix(FREED_PREFIX.as_bytes())
        .and_then(|c| std::str::from_utf8(c).ok())
    else {
        return;
    };
    let mut st = sh.st.lock();
    let Some(c) = st.chans.get_mut(key) else {
        return;
    };
    // A forged message's notice is kept short.
    let notice = word(items, 2);
    let notice = &notice[..notice.len().min(64)];
    let heard = c.recent.heard(notice.to_vec(), node, sh.nodes);
    if heard != super::Heard::Nothing {
        log::trace!("lock {key:?}: release message read ({heard:?}); waking its waiters");
        c.wake(heard);
        st.any.notify_all();
    }
}

/// Node `i` refused key `k`'s subscription (generation `gen`), an ACL most
/// likely: that key's waiters poll, and the log says so once.
fn refused(st: &mut St, i: usize, node: &str, k: &str, gen: u64, why: &str) {
    if let Some(c) = st.chans.get_mut(k).filter(|c| c.gen == gen) {
        c.refused[i] = true;
        c.confirm.notify_all();
    }
    if !std::mem::replace(&mut st.warned_refused, true) {
        warn!(
            "node {node}: subscribing to a key's releases refused ({why}); its waiters poll \
             instead of being woken (an ACL user needs `&{FREED_PREFIX}*`, `+subscribe`, \
             `+unsubscribe` and `+ping`)"
        );
    } else {
        debug!("node {node}: subscription refused: {why}");
    }
}

#[cfg(test)]
#[path = "thread_tests.rs"]
mod tests;
