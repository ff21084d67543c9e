//! The reader role: one waiting round of a client at a time reads every
//! line of the client that owes replies, and hands each reply to its
//! owner; the others sleep until a reply (or the role) is theirs.
//!
//! One reader for all of a client's multiplexed connections means one `poll(2)` for all of
//! them, one wake per round per pass however many of its nodes answered in
//! it, and the next batch of every multiplexed connection written as soon as the last reply
//! of the one in flight is read. A reader that stops waiting (it has
//! replies of its own to take, or its round ended) hands the role to one
//! round that waits, and wakes only that one; when none waits, the next
//! round that waits takes it. A multiplexed connection that comes to owe replies while the
//! reader polls others wakes the reader, which polls it too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use super::sync::Mutex;

use super::{Multiplexed, Wake};
use crate::driver::node::link::Link;

/// Ids of waits ([`crate::driver::node::multiplexed::wait_ready`] calls), unique
/// in the process.
static NEXT_WAIT: AtomicU64 = AtomicU64::new(1);

/// A new wait's id.
pub(crate) fn wait_id() -> u64 {
    NEXT_WAIT.fetch_add(1, Ordering::Relaxed)
}

/// A client's reader role, and the multiplexed connections it reads.
pub(crate) struct Role<C: Link> {
    st: Mutex<RoleState<C>>,
}

struct RoleState<C: Link> {
    /// Every line of the client still alive.
    lines: Vec<Weak<Multiplexed<C>>>,
    /// The wait that holds the role, and what wakes it.
    holder: Option<(u64, Option<Arc<dyn Wake>>)>,
    /// Waits sleeping until a reply is theirs, oldest first.
    waiting: Vec<(u64, Option<Arc<dyn Wake>>)>,
}

impl<C: Link> Default for Role<C> {
    fn default() -> Self {
        Role {
            st: Mutex::new(RoleState {
                lines: Vec::new(),
                holder: None,
                waiting: Vec::new(),
            }),
        }
    }
}

impl<C: Link> Role<C> {
    /// A new line of the client.
    pub(crate) fn register(&self, line: &Arc<Multiplexed<C>>) {
        let mut st = self.st.lock();
        st.lines.retain(|l| l.strong_count() > 0);
        st.lines.push(Arc::downgrade(line));
    }

    /// Wait `id` takes the role if no other wait holds it (true), or
    /// sleeps until woken (false), with `waker`.
    pub(crate) fn take(&self, id: u64, waker: Option<&Arc<dyn Wake>>) -> bool {
        let mut st = self.st.lock();
        match &st.holder {
            Some((h, _)) if *h == id => true,
            Some(_) => {
                if !st.waiting.iter().any(|(w, _)| *w == id) {
                    st.waiting.push((id, waker.cloned()));
                }
                false
            }
            None => {
                st.waiting.retain(|(w, _)| *w != id);
                st.holder = Some((id, waker.cloned()));
                true
            }
        }
    }

    /// Wait `id` ends: it sleeps no more, and if it held the role, the
    /// role passes to the oldest wait that sleeps, which is woken.
    pub(crate) fn leave(&self, id: u64) {
        let next = {
            let mut st = self.st.lock();
            st.waiting.retain(|(w, _)| *w != id);
            if st.holder.as_ref().is_none_or(|(h, _)| *h != id) {
                return;
            }
            st.holder = None;
            if st.waiting.is_empty() {
                return;
            }
            let next = st.waiting.remove(0);
            let waker = next.1.clone();
            st.holder = Some(next);
            waker
        };
        if let Some(w) = next.filter(|w| !w.is_current()) {
            w.wake();
        }
    }

    /// The multiplexed connections that owe replies (or have bytes to write), for the
    /// reader to poll.
    pub(crate) fn owing(&self) -> Vec<Arc<Multiplexed<C>>> {
        let lines: Vec<Arc<Multiplexed<C>>> = {
            let mut st = self.st.lock();
            st.lines.retain(|l| l.strong_count() > 0);
            st.lines.iter().filter_map(Weak::upgrade).collect()
        };
        lines.into_iter().filter(|l| l.owes_reads()).collect()
    }

    /// No wait holds the role or sleeps.
    #[cfg(test)]
    pub(crate) fn idle(&self) -> bool {
        let st = self.st.lock();
        st.holder.is_none() && st.waiting.is_empty()
    }

    /// A multiplexed connection came to owe replies: the reader polls it too.
    pub(crate) fn began_owing(&self) {
        let waker = self.st.lock().holder.as_ref().and_then(|h| h.1.clone());
        if let Some(w) = waker.filter(|w| !w.is_current()) {
            w.wake();
        }
    }
}
