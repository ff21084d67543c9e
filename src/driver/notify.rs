//! Wake-ups for waiters: a released key reaches the clients waiting for it
//! by pub/sub, as a hint to try again at once.
//!
//! The release script publishes every key it deletes on
//! [`FREED_PREFIX`]`<key>` (see `scripts::RELEASE_LUA`). A client that
//! waits for a key subscribes to its channel on every node, through one
//! subscriber connection per node that every key it waits for shares, read
//! by one thread (`qlock-notify`, started with the first wait) that polls
//! them all. A message, or a subscription made again after a reconnect
//! (messages may have been lost meanwhile), wakes the key's waiters; they
//! try, and the quorum `SET NX` decides. A lost, late, duplicated or forged
//! message costs at most latency: a waiter never waits longer than its
//! retry pause, as it did before.
//!
//! Bounded: at most [`MAX_CHANNELS`] keys are subscribed at once; a key no
//! thread waits for is unsubscribed when the room is needed. Past that, or
//! where a node refuses the subscription (an ACL without channel rights:
//! `&quorumlock:free:*` grants them), waiters poll, and the log says so once.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, warn};
use parking_lot::{Condvar, Mutex};
use redis::Value;

use crate::clock::after;
use crate::driver::conn::{Conn, For, Target};
use crate::driver::poll::{poll, PollFd, PollFlags};
pub(crate) use crate::driver::scripts::FREED_PREFIX;
use crate::lock::transport::Watch;

/// The most keys one client is subscribed to at once.
pub(crate) const MAX_CHANNELS: usize = 4096;
/// Channels per `SUBSCRIBE` command.
const PER_COMMAND: usize = 256;
/// A lost subscriber connection is made again after this.
const RECONNECT: Duration = Duration::from_millis(200);
/// A node that refused the subscription (its ACL) is asked again after this.
const REFUSED_RETRY: Duration = Duration::from_secs(30);

/// The client's wake-ups: the subscriptions, and the thread that reads them.
pub(crate) struct Notifier {
    shared: Arc<Shared>,
}

struct Shared {
    st: Mutex<St>,
    /// Notified on every message, confirmation and reconnect.
    cv: Condvar,
    /// Wakes the thread for new subscriptions, and to stop.
    wake: UnixStream,
    stop: AtomicBool,
    nodes: usize,
}

#[derive(Default)]
struct St {
    chans: HashMap<String, Chan>,
    /// Unsubscribed for room, to tell the nodes.
    dropped: Vec<String>,
    /// New subscriptions (or dropped ones) to write.
    dirty: bool,
    /// Per node: its subscriber connection is up and not refused.
    up: Vec<bool>,
    warned_full: bool,
    warned_refused: bool,
}

struct Chan {
    /// Messages, and subscriptions made again, so far.
    count: u64,
    /// Per node: the node confirmed the subscription.
    confirmed: Vec<bool>,
    /// Per node: the `SUBSCRIBE` was written on its current connection.
    sent: Vec<bool>,
    /// Threads waiting on it now.
    users: usize,
    last_used: Instant,
}

impl Notifier {
    /// Starts the thread for `targets` (one per node), each connection made
    /// within `timeout`.
    pub(crate) fn start(targets: Vec<(String, Target)>, timeout: Duration) -> io::Result<Notifier> {
        let (rx, tx) = UnixStream::pair()?;
        rx.set_nonblocking(true)?;
        tx.set_nonblocking(true)?;
        let nodes = targets.len();
        let shared = Arc::new(Shared {
            st: Mutex::new(St {
                up: vec![false; nodes],
                ..St::default()
            }),
            cv: Condvar::new(),
            wake: tx,
            stop: AtomicBool::new(false),
            nodes,
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("qlock-notify".into())
            .spawn(move || run(&s, targets, timeout, rx))?;
        Ok(Notifier { shared })
    }

    /// Subscribes to `resource`'s channel (where not yet) and waits, until
    /// `confirm_by` at most, until enough nodes confirmed it that every
    /// majority holds one (a release that succeeds then reaches us), or no
    /// node can. `None` when no room is left (the caller polls).
    pub(crate) fn watch(&self, resource: &str, confirm_by: Instant) -> Option<Box<dyn Watch>> {
        let sh = &self.shared;
        let mut st = sh.st.lock();
        if !st.chans.contains_key(resource) {
            if st.chans.len() >= MAX_CHANNELS && !st.make_room() {
                if !std::mem::replace(&mut st.warned_full, true) {
                    warn!(
                        "waiting for more than {MAX_CHANNELS} keys at once: the others poll \
                         (retry_delay) instead of being woken by their release"
                    );
                }
                return None;
            }
            st.chans.insert(
                resource.to_owned(),
                Chan {
                    count: 0,
                    confirmed: vec![false; sh.nodes],
                    sent: vec![false; sh.nodes],
                    users: 0,
                    last_used: Instant::now(),
                },
            );
            st.dirty = true;
            let _ = (&sh.wake).write(&[1]);
        }
        if let Some(c) = st.chans.get_mut(resource) {
            c.users += 1;
        }
        // Every majority meets `needed` nodes.
        let needed = sh.nodes - sh.nodes / 2;
        loop {
            let confirmed = st
                .chans
                .get(resource)
                .map_or(0, |c| c.confirmed.iter().filter(|&&b| b).count());
            let up = st.up.iter().filter(|&&b| b).count();
            if confirmed >= needed.min(up) {
                break;
            }
            if sh.cv.wait_until(&mut st, confirm_by).timed_out() {
                break;
            }
        }
        Some(Box::new(Waiting {
            shared: self.shared.clone(),
            resource: resource.to_owned(),
        }))
    }

    /// Whether this client is subscribed to `resource`'s channel (its own
    /// subscriber is among those a release reached).
    pub(crate) fn watching(&self, resource: &str) -> bool {
        self.shared.st.lock().chans.contains_key(resource)
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = (&self.shared.wake).write(&[0]);
    }
}

impl St {
    /// Unsubscribes the least recently used channel nobody waits on.
    fn make_room(&mut self) -> bool {
        let victim = self
            .chans
            .iter()
            .filter(|(_, c)| c.users == 0)
            .min_by_key(|(_, c)| c.last_used)
            .map(|(k, _)| k.clone());
        match victim {
            Some(k) => {
                self.chans.remove(&k);
                self.dropped.push(k);
                self.dirty = true;
                true
            }
            None => false,
        }
    }

    /// Wakes every waiter of every channel (a connection made again: what
    /// was published meanwhile is lost).
    fn bump_all(&mut self) {
        for c in self.chans.values_mut() {
            c.count = c.count.wrapping_add(1);
        }
    }
}

/// One thread's wait for one key.
struct Waiting {
    shared: Arc<Shared>,
    resource: String,
}

impl Watch for Waiting {
    fn seen(&self) -> u64 {
        let st = self.shared.st.lock();
        st.chans.get(&self.resource).map_or(0, |c| c.count)
    }

    fn wait(&self, seen: u64, until: Instant) -> bool {
        let mut st = self.shared.st.lock();
        loop {
            match st.chans.get(&self.resource) {
                Some(c) if c.count != seen => return true,
                Some(_) => {}
                None => return false,
            }
            if self.shared.cv.wait_until(&mut st, until).timed_out() {
                return st
                    .chans
                    .get(&self.resource)
                    .is_some_and(|c| c.count != seen);
            }
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut st = self.shared.st.lock();
        if let Some(c) = st.chans.get_mut(&self.resource) {
            c.users = c.users.saturating_sub(1);
            c.last_used = Instant::now();
        }
    }
}

/// One node's subscriber connection, as the thread keeps it.
struct Link {
    name: String,
    target: Target,
    conn: Option<Conn>,
    retry_at: Instant,
    /// Connected before: a new connection wakes every waiter.
    was_up: bool,
}

/// The thread: connects, writes subscriptions, reads messages, until the
/// client is dropped.
fn run(sh: &Shared, targets: Vec<(String, Target)>, timeout: Duration, mut wake: UnixStream) {
    let now = Instant::now();
    let mut links: Vec<Link> = targets
        .into_iter()
        .map(|(name, target)| Link {
            name,
            target,
            conn: None,
            retry_at: now,
            was_up: false,
        })
        .collect();
    while !sh.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        for (i, l) in links.iter_mut().enumerate() {
            if l.conn.is_none() && now >= l.retry_at {
                connect(sh, i, l, timeout);
            }
        }
        write_subscriptions(sh, &mut links);
        let next_retry = links
            .iter()
            .filter(|l| l.conn.is_none())
            .map(|l| l.retry_at)
            .min();
        let wait = next_retry.map_or(Duration::from_secs(1), |t| {
            t.saturating_duration_since(Instant::now())
                .min(Duration::from_secs(1))
        });
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
            if let Err(e) = read_messages(sh, i, l, ready[i]) {
                debug!("node {}: subscriber connection lost: {e}", l.name);
                down(sh, i, l, RECONNECT);
            }
        }
    }
}

/// Makes node `i`'s subscriber connection; every channel is subscribed on
/// it next.
fn connect(sh: &Shared, i: usize, l: &mut Link, timeout: Duration) {
    match Conn::connect_for(&l.target, timeout, For::Query) {
        Ok(c) => {
            l.conn = Some(c);
            let mut st = sh.st.lock();
            st.up[i] = true;
            for c in st.chans.values_mut() {
                c.sent[i] = false;
            }
            st.dirty = true;
            if std::mem::replace(&mut l.was_up, true) {
                st.bump_all();
            }
            drop(st);
            sh.cv.notify_all();
        }
        Err(e) => {
            debug!("node {}: no subscriber connection: {e:?}", l.name);
            l.retry_at = after(Instant::now(), RECONNECT);
        }
    }
}

/// Node `i`'s connection is gone (or refused us): its confirmations with it.
fn down(sh: &Shared, i: usize, l: &mut Link, retry: Duration) {
    l.conn = None;
    l.retry_at = after(Instant::now(), retry);
    let mut st = sh.st.lock();
    st.up[i] = false;
    for c in st.chans.values_mut() {
        c.confirmed[i] = false;
        c.sent[i] = false;
    }
    drop(st);
    sh.cv.notify_all();
}

/// Writes the subscriptions (and unsubscriptions) the connections lack.
fn write_subscriptions(sh: &Shared, links: &mut [Link]) {
    let mut st = sh.st.lock();
    if !std::mem::replace(&mut st.dirty, false) {
        return;
    }
    let dropped = std::mem::take(&mut st.dropped);
    for (i, l) in links.iter_mut().enumerate() {
        let Some(conn) = l.conn.as_mut() else {
            continue;
        };
        let mut new: Vec<String> = Vec::new();
        for (k, c) in st.chans.iter_mut() {
            if !c.sent[i] {
                c.sent[i] = true;
                new.push(k.clone());
            }
        }
        for (verb, keys) in [("SUBSCRIBE", &new), ("UNSUBSCRIBE", &dropped)] {
            for chunk in keys.chunks(PER_COMMAND) {
                let mut cmd = redis::cmd(verb);
                for k in chunk {
                    cmd.arg(format!("{FREED_PREFIX}{k}"));
                }
                conn.wire.queue_unpaired(&cmd.get_packed_command());
            }
        }
        if let Err(e) = conn.flush() {
            debug!("node {}: subscriber connection lost: {e}", l.name);
            l.conn = None;
            l.retry_at = after(Instant::now(), RECONNECT);
            st.up[i] = false;
            for c in st.chans.values_mut() {
                c.confirmed[i] = false;
                c.sent[i] = false;
            }
        }
    }
}

/// Reads what node `i` sent: messages wake their key's waiters,
/// confirmations the threads waiting to subscribe.
fn read_messages(sh: &Shared, i: usize, l: &mut Link, ready: PollFlags) -> io::Result<()> {
    let Some(conn) = l.conn.as_mut() else {
        return Ok(());
    };
    conn.on_ready(ready)?;
    let mut woke = false;
    let mut refusal = None;
    while let Some(v) = conn.next_frame()? {
        let items = match v {
            Value::Array(items) => items,
            Value::ServerError(e) => {
                refusal = Some(e.to_string());
                break;
            }
            _ => continue,
        };
        let kind = match items.first() {
            Some(Value::BulkString(b)) => b.as_slice(),
            _ => continue,
        };
        let channel = match items.get(1) {
            Some(Value::BulkString(b)) => b.strip_prefix(FREED_PREFIX.as_bytes()),
            _ => None,
        };
        let Some(key) = channel.and_then(|c| std::str::from_utf8(c).ok()) else {
            continue;
        };
        let mut st = sh.st.lock();
        let Some(c) = st.chans.get_mut(key) else {
            continue;
        };
        match kind {
            b"message" => c.count = c.count.wrapping_add(1),
            b"subscribe" => c.confirmed[i] = true,
            _ => continue,
        }
        woke = true;
    }
    if woke {
        sh.cv.notify_all();
    }
    if let Some(why) = refusal {
        refused(sh, i, l, &why);
    }
    Ok(())
}

/// The node refused a subscription (its ACL, most likely): its waiters
/// poll; asked again later.
fn refused(sh: &Shared, i: usize, l: &mut Link, why: &str) {
    let first = !std::mem::replace(&mut sh.st.lock().warned_refused, true);
    if first {
        warn!(
            "node {}: subscribing to {FREED_PREFIX}* refused ({why}); waiters poll instead of \
             being woken by releases (an ACL user needs `&{FREED_PREFIX}*`)",
            l.name
        );
    } else {
        debug!("node {}: subscription refused: {why}", l.name);
    }
    down(sh, i, l, REFUSED_RETRY);
}
