//! The wake-up thread: one subscriber connection per node, polled
//! together; subscriptions written one channel per command; messages read
//! and told to the keys' waiters (see [`super`]).

use std::collections::VecDeque;
use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use log::{debug, warn};
use redis::Value;

use super::{Shared, FREED_PREFIX, KEEPALIVE, LINGER, RECENT, RECONNECT, RECONNECT_MAX};
use crate::clock::after;
use crate::driver::conn::{Conn, For, Target};
use crate::driver::poll::{poll, PollFd, PollFlags};

/// What a subscriber connection owes an answer to, in order.
enum Owed {
    Subscribe(String),
    Other,
    Ping,
}

/// One node's subscriber connection, as the thread keeps it.
struct Link {
    name: String,
    target: Target,
    conn: Option<Conn>,
    owed: VecDeque<Owed>,
    retry_at: Instant,
    backoff: Duration,
    /// Connected before: a subscription confirmed again wakes its waiters
    /// (what was published meanwhile is lost).
    was_up: bool,
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
    let mut links: Vec<Link> = targets
        .into_iter()
        .map(|(name, target)| Link {
            name,
            target,
            conn: None,
            owed: VecDeque::new(),
            retry_at: now,
            backoff: RECONNECT,
            was_up: false,
            last_heard: now,
            pinged: None,
        })
        .collect();
    // A node silent this long after a `PING` is gone.
    let ping_wait = timeout.saturating_mul(4).max(Duration::from_secs(1));
    while !sh.stop.load(Ordering::Acquire) {
        for (i, l) in links.iter_mut().enumerate() {
            if l.conn.is_none() && Instant::now() >= l.retry_at {
                connect(sh, i, l, timeout);
                if sh.stop.load(Ordering::Acquire) {
                    return;
                }
            }
        }
        let now = Instant::now();
        sh.st.lock().expire(now);
        for (i, l) in links.iter_mut().enumerate() {
            if l.conn.is_none() {
                continue;
            }
            if l.pinged
                .is_some_and(|t| now.saturating_duration_since(t) >= ping_wait)
            {
                debug!("node {}: subscriber connection silent; made again", l.name);
                down(sh, i, l);
            } else if l.pinged.is_none() && now.saturating_duration_since(l.last_heard) >= KEEPALIVE
            {
                if let Some(c) = l.conn.as_mut() {
                    c.wire
                        .queue_unpaired(&redis::cmd("PING").get_packed_command());
                    l.owed.push_back(Owed::Ping);
                    l.pinged = Some(now);
                }
            }
        }
        write_subscriptions(sh, &mut links);
        let wait = links
            .iter()
            .map(|l| match (&l.conn, l.pinged) {
                (None, _) => l.retry_at,
                (Some(_), Some(t)) => after(t, ping_wait),
                (Some(_), None) => after(l.last_heard, KEEPALIVE),
            })
            .min()
            .map_or(LINGER, |t| t.saturating_duration_since(Instant::now()))
            .clamp(Duration::from_millis(1), LINGER);
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
    }
}

/// Makes node `i`'s subscriber connection; every channel is subscribed on
/// it next.
fn connect(sh: &Shared, i: usize, l: &mut Link, timeout: Duration) {
    let made = Conn::connect_for(&l.target, timeout, For::Query);
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

/// Node `i`'s connection is gone: its confirmations with it. Made again
/// after a pause that doubles while the node keeps failing.
fn down(sh: &Shared, i: usize, l: &mut Link) {
    if l.conn.take().is_some() {
        l.was_up = true;
    }
    l.owed.clear();
    l.pinged = None;
    l.retry_at = after(Instant::now(), l.backoff);
    l.backoff = l.backoff.saturating_mul(2).min(RECONNECT_MAX);
    let mut st = sh.st.lock();
    st.up[i] = false;
    for c in st.chans.values_mut() {
        c.confirmed[i] = false;
        c.sent[i] = false;
    }
    st.notify_all();
}

/// Writes the subscriptions (one channel per command, so that a refusal
/// names its channel) and unsubscriptions the connections lack.
fn write_subscriptions(sh: &Shared, links: &mut [Link]) {
    let mut failed = Vec::new();
    {
        let mut st = sh.st.lock();
        let dirty = std::mem::replace(&mut st.dirty, false);
        let dropped = if dirty {
            std::mem::take(&mut st.dropped)
        } else {
            Vec::new()
        };
        for (i, l) in links.iter_mut().enumerate() {
            let Some(conn) = l.conn.as_mut() else {
                continue;
            };
            if dirty {
                for k in &dropped {
                    let cmd = redis::cmd("UNSUBSCRIBE")
                        .arg(format!("{FREED_PREFIX}{k}"))
                        .get_packed_command();
                    conn.wire.queue_unpaired(&cmd);
                    l.owed.push_back(Owed::Other);
                }
                for (k, c) in st.chans.iter_mut() {
                    if !c.sent[i] {
                        c.sent[i] = true;
                        let cmd = redis::cmd("SUBSCRIBE")
                            .arg(format!("{FREED_PREFIX}{k}"))
                            .get_packed_command();
                        conn.wire.queue_unpaired(&cmd);
                        l.owed.push_back(Owed::Subscribe(k.clone()));
                    }
                }
            }
            if conn.wants_write() {
                if let Err(e) = conn.flush() {
                    debug!("node {}: subscriber connection lost: {e}", l.name);
                    failed.push(i);
                }
            }
        }
    }
    for i in failed {
        down(sh, i, &mut links[i]);
    }
}

/// Reads what node `i` sent: messages wake their key's waiters,
/// confirmations the threads waiting to subscribe.
fn read_frames(sh: &Shared, i: usize, l: &mut Link, ready: PollFlags) -> io::Result<()> {
    let Some(conn) = l.conn.as_mut() else {
        return Ok(());
    };
    conn.on_ready(ready)?;
    while let Some(v) = conn.next_frame()? {
        l.last_heard = Instant::now();
        let items = match v {
            Value::Array(items) => items,
            Value::ServerError(e) => {
                let what = l.owed.pop_front();
                let why = e.to_string();
                let mut st = sh.st.lock();
                match what {
                    Some(Owed::Subscribe(k)) if why.to_ascii_uppercase().contains("NOPERM") => {
                        if let Some(c) = st.chans.get_mut(&k) {
                            c.refused[i] = true;
                            c.cv.notify_all();
                        }
                        if !std::mem::replace(&mut st.warned_refused, true) {
                            warn!(
                                "node {}: subscribing to a key's releases refused ({why}); its \
                                 waiters poll instead of being woken (an ACL user needs \
                                 `&{FREED_PREFIX}*`, `+subscribe`, `+unsubscribe`)",
                                l.name
                            );
                        }
                        continue;
                    }
                    _ => {
                        return Err(io::Error::other(format!("refused: {why}")));
                    }
                }
            }
            _ => continue,
        };
        let word = |j: usize| match items.get(j) {
            Some(Value::BulkString(b)) => Some(b.as_slice()),
            _ => None,
        };
        let kind = word(0).unwrap_or_default().to_ascii_lowercase();
        if kind != b"message" {
            // Answers come in the order of the commands.
            if l.owed.pop_front().is_some_and(|o| matches!(o, Owed::Ping)) {
                l.pinged = None;
            }
        }
        let key = word(1)
            .and_then(|c| c.strip_prefix(FREED_PREFIX.as_bytes()))
            .and_then(|c| std::str::from_utf8(c).ok());
        let Some(key) = key else {
            continue;
        };
        let mut st = sh.st.lock();
        let Some(c) = st.chans.get_mut(key) else {
            continue;
        };
        match kind.as_slice() {
            b"message" => {
                let notice = word(2).unwrap_or_default();
                if !c.recent.iter().any(|n| n == notice) {
                    if c.recent.len() >= RECENT {
                        c.recent.pop_front();
                    }
                    c.recent
                        .push_back(notice.iter().take(32).copied().collect());
                    c.wake();
                }
            }
            b"subscribe" => {
                c.confirmed[i] = true;
                l.backoff = RECONNECT;
                if l.was_up {
                    // Messages may have been lost while the link was down.
                    c.wake();
                } else {
                    c.cv.notify_all();
                }
            }
            _ => {}
        }
    }
    Ok(())
}
