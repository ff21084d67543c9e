//! What one node's connections, rounds and background jobs share: its
//! health, its pool and how the pool connects.

use crate::driver::node::retries::{Retries, Unsettled, MAX_RETRIES};
use crate::driver::node::servers::Servers;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use parking_lot::Mutex;
use r2d2::ManageConnection;

use crate::algorithm::health::{Admit, NodeHealth, Outcome};
use crate::algorithm::restart::Read;
use crate::clock::{Clock, Throttle, WARN_EVERY};
use crate::driver::conn::{self, Conn, ConnectError, Target};
use crate::error::{NodeError, NodeErrorKind};
use crate::events::{Events, NodeChange, NodeEvent};

/// A node event held back: the handler, the node's name, the change.
type Held = (Events, String, NodeChange);

thread_local! {
    /// How many [`HeldEvents`] this thread has, and the node events they
    /// hold back.
    static HELD: std::cell::RefCell<(u32, Vec<Held>)> =
        const { std::cell::RefCell::new((0, Vec::new())) };
}

/// While it lives, this thread's node events wait (a shared connection's
/// lock is held): they reach the handler when the last one is dropped, with
/// none of the client's mutexes held (see [`crate::events`]). Declare it
/// before the lock guards, so that it drops after them.
pub(crate) struct HeldEvents(());

impl HeldEvents {
    pub(crate) fn new() -> Self {
        let _ = HELD.try_with(|h| h.borrow_mut().0 += 1);
        HeldEvents(())
    }
}

impl Drop for HeldEvents {
    fn drop(&mut self) {
        let held = HELD
            .try_with(|h| {
                let mut h = h.borrow_mut();
                h.0 = h.0.saturating_sub(1);
                if h.0 == 0 {
                    std::mem::take(&mut h.1)
                } else {
                    Vec::new()
                }
            })
            .unwrap_or_default();
        for (events, name, change) in held {
            emit(&events, &name, change);
        }
    }
}

fn emit(events: &Events, node: &str, change: NodeChange) {
    if let Some(h) = events.get() {
        h.on_node(&NodeEvent { node, change });
    }
}

/// Sends a node event to the handler now, or holds it (see [`HeldEvents`]).
fn emit_or_hold(events: &Events, node: &str, change: NodeChange) {
    let held = HELD
        .try_with(|h| {
            let mut h = h.borrow_mut();
            if h.0 > 0 {
                h.1.push((events.clone(), node.to_owned(), change));
                true
            } else {
                false
            }
        })
        .unwrap_or(false);
    if !held {
        emit(events, node, change);
    }
}

/// A pooled connection to a node.
pub(crate) type Pooled = r2d2::PooledConnection<Manager>;

/// What one node's connections, rounds and background jobs share.
pub(crate) struct NodeState {
    /// The node's place in the node list.
    pub(crate) index: usize,
    pub(crate) servers: Arc<Servers>,
    pub(crate) name: String,
    pub(crate) timeout: Duration,
    pub(crate) health: Mutex<NodeHealth>,
    /// Releases to send this node again.
    pub(crate) retries: Mutex<Retries>,
    /// Batches of retried releases the node answered (their tokens), for
    /// the retry job to take off `retries`.
    pub(crate) answered: Mutex<Vec<Vec<String>>>,
    /// Tokens of acquires sent to this node whose reply has not been read:
    /// their SET may still land, after a delete sent on another connection.
    /// Kept until the reply is read (or the key would have expired), with
    /// whether a release was sent meanwhile: then the reader deletes the key
    /// again, on the connection that carried the SET.
    pub(crate) unsettled: Mutex<HashMap<String, Unsettled>>,
    /// Tokens whose late SET was deleted again here, by that undo, because
    /// a release was under way (until when the key would have expired). The
    /// release's own delete, on another connection, may then find the key
    /// gone: deleted by us, and counted so.
    pub(crate) undone: Mutex<HashMap<String, Instant>>,
    /// The node's lock history as the last acquire script read it (see
    /// [`Read`]): what a lean acquire's reply is checked against.
    pub(crate) read: Mutex<Option<Read>>,
    /// The node refused a command of the lean acquire (an ACL without
    /// `+hget`, say): this client's acquires send it the script.
    pub(crate) lean_refused: AtomicBool,
    pub(crate) retry_scheduled: AtomicBool,
    /// Idle connections that were returned to the pool owing replies (a
    /// round that settled before this node answered): the retry job reads
    /// those, and pops no more of the pool than it takes to find them.
    pub(crate) owing: Arc<AtomicUsize>,
    /// The retry job holds idle connections (for microseconds: it only
    /// reads what has arrived): a round that finds none waits for them
    /// instead of failing or growing the pool.
    pub(crate) draining: AtomicBool,
    /// Why the node last refused a connection (a failed connect, or a
    /// server that turned it away), cleared when it answers again: for the
    /// errors of rounds that could not use the node.
    pub(crate) connect_error: Mutex<Option<NodeError>>,
    pub(crate) events: Events,
    /// Time (virtual in the simulation).
    pub(crate) clock: Arc<dyn Clock>,
    /// Defects the simulation puts back, to show its checkers find them.
    #[cfg(test)]
    pub(crate) defects: Defects,
    /// What the shared connections did (the simulation checks that its
    /// schedules cover each case).
    #[cfg(test)]
    pub(crate) line_stats: Arc<crate::driver::node::multiplexed::MultiplexedStats>,
    /// Lets other simulated threads run between a round's staging of its
    /// commands and its write (see `multiplexed::Multiplexed::send`).
    #[cfg(test)]
    pub(crate) stage_yield: Option<Arc<dyn Fn() + Send + Sync>>,
}

/// Defects fixed in the node engine that the simulation can put back, one
/// at a time, to show that its checkers find each (never set otherwise).
#[cfg(test)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Defects {
    /// A connection closed under a round is the node's answer (it failed),
    /// even one older than the round: the command is not sent again.
    pub(crate) close_is_answer: bool,
    /// A failed attempt's undo skips a node whose connection closed under
    /// its SET (the SET may have run). The code before the fix skipped such
    /// a node only when the round had not sent the SET again; rounds now
    /// always send again while they can, so the skip is put back for every
    /// SET lost with its connection.
    pub(crate) undo_skips_lost: bool,
    /// The release retry job puts the batch it sent back at the head of
    /// the queue, and forgets what the node answered: the same batch goes
    /// out every time, the rest only once it expires.
    pub(crate) retry_same_batch: bool,
    /// A lean acquire's reply stands for the facts last read on the node
    /// whatever history it read after its SET: a node flushed while
    /// connected votes at once.
    pub(crate) lean_ignores_history: bool,
}

impl NodeState {
    /// Node `index` of the list, named `name`, healthy, owing nothing.
    pub(crate) fn new(
        index: usize,
        servers: Arc<Servers>,
        name: String,
        timeout: Duration,
        events: Events,
        clock: Arc<dyn Clock>,
    ) -> Self {
        NodeState {
            index,
            servers,
            name,
            timeout,
            health: Mutex::new(NodeHealth::default()),
            retries: Mutex::new(Retries::default()),
            answered: Mutex::new(Vec::new()),
            unsettled: Mutex::new(HashMap::new()),
            undone: Mutex::new(HashMap::new()),
            read: Mutex::new(None),
            lean_refused: AtomicBool::new(false),
            retry_scheduled: AtomicBool::new(false),
            owing: Arc::new(AtomicUsize::new(0)),
            draining: AtomicBool::new(false),
            connect_error: Mutex::new(None),
            events,
            clock,
            #[cfg(test)]
            defects: Defects::default(),
            #[cfg(test)]
            line_stats: Arc::default(),
            #[cfg(test)]
            stage_yield: None,
        }
    }

    /// Writes of `tokens` that may still land here, until `until` at the
    /// latest: a release of them from now on deletes again behind them
    /// (see [`Unsettled`]). Expired entries make room once the map is full.
    pub(crate) fn unsettle(&self, tokens: &[String], until: Instant, now: Instant) {
        let mut unsettled = self.unsettled.lock();
        if unsettled.len() >= MAX_RETRIES {
            unsettled.retain(|_, u| u.until > now);
        }
        for t in tokens {
            unsettled.entry(t.clone()).or_insert(Unsettled {
                until,
                released: false,
            });
        }
    }

    /// The error of this node when a round did not wait for it (`admit`):
    /// why (refusing, not answering, its TLS or handshake error), since when.
    pub(crate) fn not_waited(&self, admit: Admit, now: Instant) -> NodeError {
        let h = *self.health.lock();
        let connect_error = match h {
            NodeHealth::Failing { .. } => self.connect_error.lock().clone(),
            NodeHealth::Healthy => None,
        };
        let source = connect_error.as_ref().and_then(|e| e.source.clone());
        let kind = match (h, connect_error.as_ref().map(NodeError::kind)) {
            (
                _,
                Some(kind @ (NodeErrorKind::Tls | NodeErrorKind::Server | NodeErrorKind::Auth)),
            ) => kind,
            (
                NodeHealth::Failing {
                    last: Outcome::Refused,
                    ..
                },
                _,
            ) => NodeErrorKind::Unavailable,
            _ => NodeErrorKind::Skipped,
        };
        // (`Skipped` reads "not answering, not waited for" already.)
        let skipped = kind == NodeErrorKind::Skipped;
        let tried = match (admit == Admit::Trial, skipped) {
            (true, true) => "; tried",
            (false, true) => "",
            (true, false) => "; tried, not waited for",
            (false, false) => "; not waited for",
        };
        let detail = match (h, &connect_error) {
            (NodeHealth::Failing { since, .. }, Some(e)) => format!(
                "{}, for {:?}{tried}",
                // (A server's sentence ends with a full stop; this goes on.)
                e.detail().trim_end_matches('.'),
                now.saturating_duration_since(since),
            ),
            (NodeHealth::Failing { since, last, .. }, None) => format!(
                "{}for {:?}{tried}",
                match last {
                    Outcome::Refused => "refusing connections ",
                    _ if skipped => "",
                    _ => "not answering ",
                },
                now.saturating_duration_since(since),
            ),
            (NodeHealth::Healthy, _) => String::new(),
        };
        NodeError::new(&self.name, kind, detail).caused_by(source)
    }

    /// Node 0, `n0`, of a one-node list, on the system clock (for tests).
    #[cfg(test)]
    pub(crate) fn for_tests() -> Self {
        let servers = Arc::new(Servers::new(vec!["n0".to_owned()], false));
        NodeState::new(
            0,
            servers,
            "n0".into(),
            Duration::from_millis(50),
            Events::default(),
            Arc::new(crate::clock::SystemClock),
        )
    }

    /// The single door of the node's health state machine.
    pub(crate) fn observe(&self, outcome: Outcome) {
        let flipped = self.health.lock().observe(self.clock.now(), outcome);
        if flipped {
            let change = match outcome {
                Outcome::Answered => {
                    self.connect_error.lock().take();
                    info!("node {}: answering again, back in use", self.name);
                    NodeChange::Rejoined
                }
                o => {
                    debug!("node {}: {o:?}; not waited for until it answers", self.name);
                    NodeChange::Skipped {
                        refused: o == Outcome::Refused,
                    }
                }
            };
            if self.events.get().is_some() {
                emit_or_hold(&self.events, &self.name, change);
            }
        }
    }

    pub(crate) fn is_healthy(&self) -> bool {
        self.health.lock().is_healthy()
    }
}

/// Our r2d2 connection manager: connect with a timeout, non-blocking
/// socket, TCP_NODELAY, AUTH and SELECT when configured. A refused or
/// timed-out connect is the node's answer; a successful one changes nothing.
pub(crate) struct Manager {
    pub(crate) target: Target,
    pub(crate) shared: Arc<NodeState>,
}

impl fmt::Debug for Manager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Manager")
            .field("node", &self.shared.name)
            .finish()
    }
}

impl ManageConnection for Manager {
    type Connection = Conn;
    type Error = ConnectError;

    fn connect(&self) -> Result<Conn, ConnectError> {
        let mut result = Conn::connect(&self.target, self.shared.timeout, conn::For::Rounds);
        if let Err(ConnectError::Io(e)) = &result {
            if conn::is_close(e) {
                // Closed before the node answered: a proxy in front of a dead
                // node, or a kill (`CLIENT KILL`, a restart) that met this
                // connect. One more try tells them apart.
                debug!(
                    "node {}: connection closed while connecting ({e}), trying again",
                    self.shared.name
                );
                result = Conn::connect(&self.target, self.shared.timeout, conn::For::Rounds);
            }
        }
        // Kept until the node answers again (a connect that succeeds may
        // still be turned away by the server, see `setup_reply`).
        if let Err(e) = &result {
            *self.shared.connect_error.lock() =
                Some(NodeError::new(&self.shared.name, e.kind(), e.detail()).caused_by(e.io()));
        }
        result.inspect_err(|e| {
            self.shared.observe(match e {
                ConnectError::Io(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                    Outcome::TimedOut
                }
                _ => Outcome::Refused,
            })
        })
    }

    fn is_valid(&self, _conn: &mut Conn) -> Result<(), ConnectError> {
        // Not called (test_on_check_out is off): the command itself is the
        // health check.
        Ok(())
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        // Called by the pool as the connection comes back (the last word on
        // it before it idles).
        conn.wire.idles(&self.shared.owing)
    }
}

/// Logs background connect failures: every one at debug, at most one per
/// [`WARN_EVERY`] per node at warn, so a dead node does not flood the log.
#[derive(Debug)]
pub(crate) struct ConnectErrors {
    pub(crate) node: String,
    pub(crate) warned: Throttle,
}

impl r2d2::HandleError<ConnectError> for ConnectErrors {
    fn handle_error(&self, error: ConnectError) {
        if self.warned.ready(Instant::now(), WARN_EVERY) {
            warn!(
                "node {}: cannot connect: {error} (repeats logged at debug for {WARN_EVERY:?})",
                self.node
            );
        } else {
            debug!("node {}: cannot connect: {error}", self.node);
        }
    }
}

#[cfg(test)]
mod held_tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl crate::EventHandler for Count {
        fn on_node(&self, _: &NodeEvent<'_>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A node event raised while a shared connection's lock is held reaches
    /// the handler only once no such lock is (a handler may call the client).
    #[test]
    fn node_events_wait_until_no_lock_is_held() {
        let count = Arc::new(Count::default());
        let mut node = NodeState::for_tests();
        node.events = Events(Some(count.clone()));
        let outer = HeldEvents::new();
        let inner = HeldEvents::new();
        node.observe(Outcome::TimedOut);
        drop(inner);
        assert_eq!(count.0.load(Ordering::SeqCst), 0, "emitted under a lock");
        drop(outer);
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        node.observe(Outcome::Answered);
        assert_eq!(count.0.load(Ordering::SeqCst), 2, "none held: at once");
    }

    /// A node the round did not wait for is told once, not as "n0 not
    /// answering, not waited for (not answering for 1ms; not waited for)".
    #[test]
    fn a_node_not_waited_for_says_so_once() {
        let node = NodeState::for_tests();
        node.observe(Outcome::TimedOut);
        for admit in [Admit::Skip, Admit::Trial] {
            let shown = node.not_waited(admit, Instant::now()).to_string();
            for words in ["not answering", "not waited for"] {
                assert_eq!(shown.matches(words).count(), 1, "{words:?} in {shown}");
            }
            assert!(shown.contains(" for "), "how long: {shown}");
        }
        *node.connect_error.lock() = Some(NodeError::new(
            "n0",
            NodeErrorKind::Timeout,
            "connect timed out",
        ));
        let shown = node.not_waited(Admit::Skip, Instant::now()).to_string();
        assert_eq!(shown.matches("not waited for").count(), 1, "{shown}");
        assert!(shown.contains("connect timed out"), "{shown}");
    }
}
