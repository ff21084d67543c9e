//! Wake-ups for waiters: a released key reaches the clients waiting for it
//! by pub/sub, as a hint to try again at once.
//!
//! A release publishes every key it deletes on [`FREED_PREFIX`]`<key>`,
//! with its notice, one random number per release (see
//! `scripts::RELEASE_LUA`). A client that waits for a key subscribes to its
//! channel on every node, through one subscriber connection per node that
//! every key it waits for shares, read by one thread (`qlock-notify`,
//! started with the first wait) that polls them all. A message with a
//! notice not seen yet, or a subscription made again after its connection
//! was lost (messages may have been lost meanwhile), wakes the key's
//! waiters; they try, and the quorum `SET NX` decides. So does the copy
//! that makes a notice's majority after a try began (see
//! [`Notices::heard`]): that try may have read the key before the release
//! freed it on a majority. A lost, late,
//! duplicated or forged message costs at most latency: a waiter never
//! waits longer than its retry pause (nor a second), as it did before,
//! and tries sooner where the owner's keys expire sooner (see
//! `Engine::acquire`).
//!
//! Bounded: at most [`MAX_CHANNELS`] keys are subscribed at once, and a key
//! nobody has waited for in [`LINGER`] is unsubscribed. Past that bound,
//! or where a node refuses a channel (an ACL without channel rights:
//! `&quorumlock:free:*` grants them), waiters poll, and the log says so
//! once. A connection that stops answering (no reply to a `PING` sent
//! after [`KEEPALIVE`] of silence) is made again, with a growing pause.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::warn;
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::driver::conn::Target;
pub(crate) use crate::driver::scripts::FREED_PREFIX;
use crate::lock::transport::Watch;

mod thread;

/// The most keys one client is subscribed to at once.
pub(crate) const MAX_CHANNELS: usize = 4096;

/// Most resources a lock of several waits for by wake-ups; a larger set
/// polls.
pub(crate) const MAX_SET_CHANNELS: usize = 64;
/// A key nobody waited for this long is unsubscribed (a process that waits
/// for a key again and again keeps its subscription).
pub(crate) const LINGER: Duration = Duration::from_secs(1);
/// A connection silent this long is sent a `PING`.
pub(crate) const KEEPALIVE: Duration = Duration::from_secs(2);
/// The first pause before a lost connection is made again; it doubles up
/// to [`RECONNECT_MAX`] while the node keeps failing.
const RECONNECT: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(5);
/// The longest a connect may keep the thread (the node timeout, at most this).
const CONNECT_MAX: Duration = Duration::from_millis(250);
/// Notices remembered per key (one release's messages, one per node, carry
/// one notice; releases closer together than this many are told apart).
const RECENT: usize = 8;

/// What a release's copy does to a key's waiters (see [`Notices::heard`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heard {
    /// Nothing: a copy of a notice heard already.
    Nothing,
    /// Wakes them: a notice's first copy.
    First,
    /// Wakes them again: the copy that makes a notice's majority after a
    /// try began. That try read the owners before the release freed the
    /// key on a majority (see [`Watch::again`]).
    Majority,
}

/// The last [`RECENT`] notices a key's waiters saw, each with the nodes its
/// copies came from, and whether a waiter began a try since the last
/// wake-up: the rule that one release wakes them once, whichever node its
/// message comes from, and again where a try may have met it before it
/// reached a majority (the simulation keeps its clients' notices in one
/// too).
#[derive(Debug)]
pub(crate) struct Notices<T> {
    recent: VecDeque<(T, u64)>,
    tried: bool,
}

impl<T> Default for Notices<T> {
    fn default() -> Self {
        Notices {
            recent: VecDeque::new(),
            tried: false,
        }
    }
}

impl<T: PartialEq> Notices<T> {
    /// Remembers `notice` from node `node` of `nodes`: whether it wakes.
    /// Its first copy does ([`Heard::First`]) (the others follow within a round trip); and the
    /// copy that makes a majority where a waiter began a try since the last
    /// wake-up: that try may have met the key still held on a majority (the
    /// releaser's round reached the other nodes later: milliseconds on a
    /// loaded machine, or an outage's length where they ran it when back),
    /// and nothing else would wake it ([`Heard::Majority`]). (Where every
    /// copy comes before the woken try begins, as it does on an idle
    /// machine, none wakes again.)
    pub(crate) fn heard(&mut self, notice: T, node: usize, nodes: usize) -> Heard {
        let majority = crate::algorithm::quorum::quorum(nodes);
        let bit = 1u64 << node.min(63);
        let heard = match self.recent.iter_mut().find(|(n, _)| *n == notice) {
            Some((_, nodes)) => {
                let was = nodes.count_ones() as usize;
                *nodes |= bit;
                let is = nodes.count_ones() as usize;
                if was < majority && is >= majority && self.tried {
                    Heard::Majority
                } else {
                    Heard::Nothing
                }
            }
            None => {
                self.remember(notice, bit);
                Heard::First
            }
        };
        if heard != Heard::Nothing {
            self.tried = false;
        }
        heard
    }

    /// A waiter of the key begins a try: it reads the nodes from now on
    /// (see [`heard`](Self::heard)).
    pub(crate) fn tried(&mut self) {
        self.tried = true;
    }

    /// This client's own release's `notice`: none of its copies wakes
    /// (heard from every node already).
    pub(crate) fn mine(&mut self, notice: T) {
        self.recent.retain(|(n, _)| *n != notice);
        self.remember(notice, u64::MAX);
    }

    fn remember(&mut self, notice: T, nodes: u64) {
        if self.recent.len() >= RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((notice, nodes));
    }
}

/// The client's wake-ups: the subscriptions, and the thread that reads them.
pub(crate) struct Notifier {
    shared: Arc<Shared>,
}

struct Shared {
    st: Mutex<St>,
    /// Wakes the thread for new subscriptions, and to stop.
    wake: UnixStream,
    stop: AtomicBool,
    nodes: usize,
}

#[derive(Default)]
struct St {
    chans: HashMap<String, Chan>,
    /// Unsubscribed, to tell the nodes (at most [`MAX_CHANNELS`]).
    dropped: Vec<String>,
    /// Subscriptions or unsubscriptions to write.
    dirty: bool,
    /// Per node: its subscriber connection is up.
    up: Vec<bool>,
    /// Per node: its first connect was tried (until then it may still
    /// confirm: the first wait waits for it).
    tried: Vec<bool>,
    warned_full: bool,
    warned_refused: bool,
    /// The next channel's generation (a key unsubscribed and subscribed
    /// again is a new channel: answers to the old one's commands are not
    /// its own).
    next_gen: u64,
    /// Notified at every wake-up of any channel: the waits for one of
    /// several keys (a lock of several resources, [`Notifier::watch_all`]).
    any: Arc<Condvar>,
}

struct Chan {
    /// Wakes one waiter per message (a release lets one in: the client's
    /// other threads that wait for the key stay asleep, no herd), every
    /// waiter when messages may have been lost.
    cv: Arc<Condvar>,
    /// Notified on a confirmation or refusal, and a connection lost or
    /// made (for the threads waiting to subscribe).
    confirm: Arc<Condvar>,
    /// Wake-ups so far.
    count: u64,
    /// Wake-ups so far by [`Heard::Majority`] (see [`Watch::again`]).
    again: u64,
    /// Wake-ups so far for the waits for several keys: every wake-up, and
    /// this client's own releases (see [`Notifier::released`]).
    sets: u64,
    /// The last notices seen (a release's copies from other nodes wake
    /// nobody again).
    recent: Notices<Vec<u8>>,
    /// Per node: the node confirmed the subscription.
    confirmed: Vec<bool>,
    /// Per node: the `SUBSCRIBE` was written on its current connection.
    sent: Vec<bool>,
    /// Per node: the node refused it (an ACL).
    refused: Vec<bool>,
    /// Per node: confirmed on a connection since lost (what was published
    /// meanwhile is lost: its confirmation again wakes the waiters).
    lost: Vec<bool>,
    gen: u64,
    /// Threads waiting on it now.
    users: usize,
    last_used: Instant,
}

impl Chan {
    fn new(nodes: usize, gen: u64) -> Chan {
        Chan {
            lost: vec![false; nodes],
            gen,
            cv: Arc::new(Condvar::new()),
            confirm: Arc::new(Condvar::new()),
            count: 0,
            again: 0,
            sets: 0,
            recent: Notices::default(),
            confirmed: vec![false; nodes],
            sent: vec![false; nodes],
            refused: vec![false; nodes],
            users: 0,
            last_used: Instant::now(),
        }
    }

    /// A release's message (`heard`, not [`Heard::Nothing`]): one waiter
    /// tries.
    fn wake(&mut self, heard: Heard) {
        if heard == Heard::Majority {
            self.again = self.again.wrapping_add(1);
        }
        self.count = self.count.wrapping_add(1);
        self.sets = self.sets.wrapping_add(1);
        self.cv.notify_one();
    }

    /// Messages may have been lost: every waiter tries.
    fn wake_all(&mut self) {
        self.count = self.count.wrapping_add(1);
        self.sets = self.sets.wrapping_add(1);
        self.cv.notify_all();
    }

    fn notify_all(&self) {
        self.cv.notify_all();
        self.confirm.notify_all();
    }
}

impl Notifier {
    /// Starts the thread for `targets` (name and address, one per node),
    /// each connection made within `timeout` (at most [`CONNECT_MAX`]).
    pub(crate) fn start(targets: Vec<(String, Target)>, timeout: Duration) -> io::Result<Notifier> {
        let (rx, tx) = UnixStream::pair()?;
        rx.set_nonblocking(true)?;
        tx.set_nonblocking(true)?;
        let nodes = targets.len();
        let shared = Arc::new(Shared {
            st: Mutex::new(St {
                up: vec![false; nodes],
                tried: vec![false; nodes],
                ..St::default()
            }),
            wake: tx,
            stop: AtomicBool::new(false),
            nodes,
        });
        let s = shared.clone();
        let timeout = timeout.min(CONNECT_MAX);
        std::thread::Builder::new()
            .name("qlock-notify".into())
            .spawn(move || thread::run(&s, targets, timeout, rx))?;
        Ok(Notifier { shared })
    }

    /// Subscribes to `resource`'s channel (where not yet) and waits, until
    /// `confirm_by` at most, until enough nodes confirmed it that every
    /// majority holds one (a release that succeeds then reaches us), or no
    /// more nodes can. `None` when no room is left (the caller polls).
    pub(crate) fn watch(&self, resource: &str, confirm_by: Instant) -> Option<Box<dyn Watch>> {
        let w = self.watch_if(resource, confirm_by, false)?;
        Some(Box::new(w))
    }

    /// [`watch`](Self::watch) for every one of `resources` (each confirmed
    /// by `confirm_by` at most): one wait, woken by a release of any of
    /// them (a lock of several resources waits for them all to be free; a
    /// release of one is a hint to try). `None` when any has no room.
    ///
    /// All are subscribed first, then confirmed together (one round trip,
    /// not one per key). A set of more than [`MAX_SET_CHANNELS`] resources
    /// gets `None` (it polls): it would crowd out every other wait.
    pub(crate) fn watch_all(
        &self,
        resources: &[&str],
        confirm_by: Instant,
    ) -> Option<Box<dyn Watch>> {
        if resources.len() > MAX_SET_CHANNELS {
            return None;
        }
        let mut st = self.shared.st.lock();
        let mut parts = Vec::with_capacity(resources.len());
        for r in resources {
            match self.join(&mut st, r, false) {
                Some(w) => parts.push(w),
                None => {
                    // (Each part leaves its channel on drop, which locks.)
                    drop(st);
                    return None;
                }
            }
        }
        self.await_confirmed(&mut st, resources, confirm_by);
        let any = st.any.clone();
        drop(st);
        let listen = vec![true; parts.len()];
        Some(Box::new(WaitingAll { parts, any, listen }))
    }

    /// This client's own release of `resources` ended: its waiters for a
    /// lock of several, which no local queue serves, try again (a single
    /// lock's waiters here are not woken by it: see
    /// [`releasing`](Self::releasing)).
    pub(crate) fn released(&self, resources: &[&str]) {
        let mut st = self.shared.st.lock();
        let mut any = false;
        for r in resources {
            if let Some(c) = st.chans.get_mut(*r) {
                c.sets = c.sets.wrapping_add(1);
                any = true;
            }
        }
        if any {
            st.any.notify_all();
        }
    }

    /// [`watch`](Self::watch), or with `existing` only where `resource` is
    /// subscribed already (checked under the same lock).
    fn watch_if(&self, resource: &str, confirm_by: Instant, existing: bool) -> Option<Waiting> {
        let mut st = self.shared.st.lock();
        let w = self.join(&mut st, resource, existing)?;
        self.await_confirmed(&mut st, &[resource], confirm_by);
        Some(w)
    }

    /// Subscribes to `resource`'s channel where not yet (or, `existing`,
    /// only where it is), as one more waiter of it; `None` when no room is
    /// left. Does not wait for the nodes.
    fn join(&self, st: &mut MutexGuard<'_, St>, resource: &str, existing: bool) -> Option<Waiting> {
        let sh = &self.shared;
        if existing && !st.chans.contains_key(resource) {
            return None;
        }
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
            st.dropped.retain(|k| k != resource);
            st.next_gen = st.next_gen.wrapping_add(1);
            let gen = st.next_gen;
            st.chans
                .insert(resource.to_owned(), Chan::new(sh.nodes, gen));
            st.dirty = true;
            let _ = (&sh.wake).write(&[1]);
        }
        let cv = {
            let c = st.chans.get_mut(resource)?;
            c.users += 1;
            c.cv.clone()
        };
        Some(Waiting {
            shared: self.shared.clone(),
            cv,
            resource: resource.to_owned(),
            seen: 0,
            again: 0,
        })
    }

    /// Waits, until `confirm_by` at most, until each of `resources` is
    /// confirmed by enough nodes that every majority holds one (a release
    /// that succeeds then reaches us), or by every node that still may.
    fn await_confirmed(
        &self,
        st: &mut MutexGuard<'_, St>,
        resources: &[&str],
        confirm_by: Instant,
    ) {
        // Every majority meets `needed` nodes.
        let needed = self.shared.nodes - self.shared.nodes / 2;
        loop {
            let Some(r) = resources.iter().find(|r| !confirmed_enough(st, r, needed)) else {
                return;
            };
            let Some(confirm) = st.chans.get(*r).map(|c| c.confirm.clone()) else {
                return;
            };
            if confirm.wait_until(st, confirm_by).timed_out() {
                return;
            }
        }
    }

    /// [`watch`](Self::watch), only where `resource` is subscribed already
    /// (the wake-ups from before an attempt then count), without waiting.
    pub(crate) fn watch_existing(&self, resource: &str) -> Option<Box<dyn Watch>> {
        let w = self.watch_if(resource, Instant::now(), true)?;
        Some(Box::new(w))
    }

    /// This client releases `resource` with `notice`: its message (the
    /// decimal notice, as the script publishes it) wakes nobody here.
    pub(crate) fn releasing(&self, resource: &str, notice: u64) {
        let mut st = self.shared.st.lock();
        if let Some(c) = st.chans.get_mut(resource) {
            c.recent.mine(notice.to_string().into_bytes());
        }
    }

    /// Per node, whether this client's own subscriber may listen to
    /// `resource`'s releases there (subscribed, or its `SUBSCRIBE` written:
    /// a release's subscriber count may include it then). Empty when not
    /// subscribed (an `UNSUBSCRIBE` still on its way is not seen).
    pub(crate) fn watching(&self, resource: &str) -> Vec<bool> {
        let st = self.shared.st.lock();
        st.chans
            .get(resource)
            .map(|c| {
                c.confirmed
                    .iter()
                    .zip(&c.sent)
                    .map(|(&a, &b)| a || b)
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Whether `resource` is confirmed on `needed` nodes, or on every node that
/// still may (up or not tried yet, and not refusing it).
fn confirmed_enough(st: &St, resource: &str, needed: usize) -> bool {
    let Some(c) = st.chans.get(resource) else {
        return true;
    };
    let confirmed = c.confirmed.iter().filter(|&&b| b).count();
    let may = (0..st.up.len())
        .filter(|&i| (st.up[i] || !st.tried[i]) && !c.refused[i])
        .count();
    confirmed >= needed.min(may)
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
                self.unsubscribe(k);
                true
            }
            None => false,
        }
    }

    fn unsubscribe(&mut self, key: String) {
        if let Some(c) = self.chans.remove(&key) {
            c.notify_all();
        }
        if self.dropped.len() < MAX_CHANNELS {
            self.dropped.push(key);
        }
        self.dirty = true;
    }

    /// Unsubscribes the channels nobody waited for in [`LINGER`].
    fn expire(&mut self, now: Instant) {
        let idle: Vec<String> = self
            .chans
            .iter()
            .filter(|(_, c)| c.users == 0 && now.saturating_duration_since(c.last_used) >= LINGER)
            .map(|(k, _)| k.clone())
            .collect();
        for k in idle {
            self.unsubscribe(k);
        }
    }

    fn notify_all(&self) {
        for c in self.chans.values() {
            c.notify_all();
        }
        self.any.notify_all();
    }
}

/// One thread's wait for one key.
struct Waiting {
    shared: Arc<Shared>,
    cv: Arc<Condvar>,
    resource: String,
    /// The key's wake-ups at the mark (for a wait for several keys, its
    /// wake-ups of those waits).
    seen: u64,
    /// The key's wake-ups by [`Heard::Majority`] at the mark.
    again: u64,
}

impl Waiting {
    /// Whether the key's wake-ups since the mark were all by
    /// [`Heard::Majority`] (`now`: its count of wake-ups now, as
    /// [`seen`](Self::seen) counts them).
    fn again_only(&self, st: &MutexGuard<'_, St>, now: u64) -> bool {
        st.chans
            .get(&self.resource)
            .is_some_and(|c| now.wrapping_sub(self.seen) == c.again.wrapping_sub(self.again))
    }

    fn count(&self, st: &MutexGuard<'_, St>) -> Option<u64> {
        st.chans.get(&self.resource).map(|c| c.count)
    }

    /// The key's wake-ups of waits for several keys.
    fn sets(&self, st: &MutexGuard<'_, St>) -> u64 {
        st.chans.get(&self.resource).map_or(0, |c| c.sets)
    }
}

impl Watch for Waiting {
    fn mark(&mut self) {
        let mut st = self.shared.st.lock();
        (self.seen, self.again) = st.chans.get_mut(&self.resource).map_or((0, 0), |c| {
            c.recent.tried();
            (c.count, c.again)
        });
    }

    fn wait(&self, until: Instant) -> bool {
        let mut st = self.shared.st.lock();
        loop {
            // (Never without its channel while this wait lives; if it were,
            // the wait would still last until `until`.)
            if self.count(&st).is_some_and(|c| c != self.seen) {
                return true;
            }
            if self.cv.wait_until(&mut st, until).timed_out() {
                // Not chosen: another thread of this client took the
                // wake-up (or none came). Its retry pause ran out.
                return false;
            }
        }
    }

    fn listen_to(&mut self, _keys: &[bool]) {}

    fn again(&self) -> bool {
        let st = self.shared.st.lock();
        self.count(&st)
            .is_some_and(|c| c != self.seen && self.again_only(&st, c))
    }
}

/// One thread's wait for any of several keys (see [`Notifier::watch_all`]).
struct WaitingAll {
    parts: Vec<Waiting>,
    any: Arc<Condvar>,
    /// Per part, whether its wake-ups wake this wait.
    listen: Vec<bool>,
}

impl WaitingAll {
    fn woken(&self, st: &MutexGuard<'_, St>) -> bool {
        self.parts
            .iter()
            .zip(&self.listen)
            .any(|(w, l)| *l && w.sets(st) != w.seen)
    }
}

impl Watch for WaitingAll {
    fn mark(&mut self) {
        let Some(first) = self.parts.first() else {
            return;
        };
        let mut st = first.shared.st.lock();
        let seen: Vec<(u64, u64)> = self
            .parts
            .iter()
            .map(|w| {
                st.chans.get_mut(&w.resource).map_or((0, 0), |c| {
                    c.recent.tried();
                    (c.sets, c.again)
                })
            })
            .collect();
        drop(st);
        for (w, s) in self.parts.iter_mut().zip(seen) {
            (w.seen, w.again) = s;
        }
    }

    fn wait(&self, until: Instant) -> bool {
        let Some(first) = self.parts.first() else {
            return false;
        };
        let mut st = first.shared.st.lock();
        loop {
            if self.woken(&st) {
                return true;
            }
            if self.any.wait_until(&mut st, until).timed_out() {
                return self.woken(&st);
            }
        }
    }

    fn listen_to(&mut self, keys: &[bool]) {
        if keys.len() == self.listen.len() {
            self.listen.copy_from_slice(keys);
        }
    }

    fn again(&self) -> bool {
        let Some(first) = self.parts.first() else {
            return false;
        };
        let st = first.shared.st.lock();
        let mut woken = self
            .parts
            .iter()
            .zip(&self.listen)
            .filter(|(w, l)| **l && w.sets(&st) != w.seen)
            .peekable();
        woken.peek().is_some() && woken.all(|(w, _)| w.again_only(&st, w.sets(&st)))
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

#[cfg(test)]
mod notices_tests {
    use super::{Heard, Notices};

    /// One release wakes once, whichever node's copy comes first; again
    /// only where the copy that frees the key on a majority comes after a
    /// waiter began a try (it may have met the key still held: the nodes
    /// ran the release later, a few milliseconds under load, or when back
    /// from an outage); this client's own never.
    #[test]
    fn a_release_wakes_once_and_again_when_its_majority_comes_after_a_try() {
        let mut n = Notices::default();
        assert_eq!(n.heard(7u64, 0, 3), Heard::First, "the first copy");
        assert_eq!(
            n.heard(7, 1, 3),
            Heard::Nothing,
            "the majority before any try"
        );
        n.tried();
        assert_eq!(n.heard(7, 2, 3), Heard::Nothing, "past the majority");
        assert_eq!(n.heard(7, 0, 3), Heard::Nothing, "a copy again");
        // Nodes 1 and 2 ran it after the woken try began.
        assert_eq!(n.heard(8, 0, 3), Heard::First);
        n.tried();
        assert_eq!(n.heard(8, 0, 3), Heard::Nothing, "the same node again");
        assert_eq!(
            n.heard(8, 2, 3),
            Heard::Majority,
            "the majority after the try"
        );
        n.tried();
        assert_eq!(n.heard(8, 1, 3), Heard::Nothing);
        // A try before the first copy does not count: the first copy woke it.
        n.tried();
        assert_eq!(n.heard(9, 4, 5), Heard::First);
        assert_eq!(n.heard(9, 3, 5), Heard::Nothing);
        n.tried();
        assert_eq!(
            n.heard(9, 1, 5),
            Heard::Majority,
            "five nodes: the third copy is the majority"
        );
        // This client's own release.
        n.mine(10);
        n.tried();
        for node in 0..5 {
            assert_eq!(n.heard(10, node, 5), Heard::Nothing);
        }
    }
}
