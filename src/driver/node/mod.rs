//! The Redis driver: one r2d2 pool of non-blocking connections per node, and
//! rounds that take replies in the order they arrive.
//!
//! A round checks out a connection per node without waiting, writes the same
//! packed command to every node, then waits on all sockets at once
//! (`poll(2)`) and takes each reply as it arrives, until the caller says the
//! outcome is settled (plus a short grace for stragglers) or the deadline
//! passes. Nodes still lacking a connection are checked again while the round
//! waits, so a node whose pool is busy or still connecting costs nothing
//! unless its answer is needed.
//!
//! Health follows one rule: only a node's own answers to commands change it
//! (see [`crate::algorithm::health`]). Replies still in flight when a round ends stay on
//! their connection and are read by its next user.

use crate::driver::node::conns::Node;
use crate::driver::node::queries::{inspect_one, probe_one};
use crate::driver::node::replies::catch_up;
use crate::driver::node::servers::Servers;
use crate::driver::node::state::{ConnectErrors, Manager, NodeState};

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use r2d2::{Pool, PooledConnection};
use scheduled_thread_pool::{OnPoolDropBehavior, ScheduledThreadPool};

use crate::algorithm::quorum::VoteRules;
use crate::algorithm::round::Key;
use crate::algorithm::round::{NodeResult, Op};
use crate::clock::{SystemClock, Throttle};
use crate::driver::conn::{Target, MIN_TIMEOUT};
use crate::error::{InvalidInput, NodeError, NodeErrorKind};
use crate::events::Events;
use crate::lock::transport::{Decided, Stored, Transport, Undo};

pub(crate) mod conns;
pub(crate) mod encode;
pub(crate) mod jobs;
pub(crate) mod link;
pub(crate) mod links;
pub(crate) mod multiplexed;
pub(crate) mod node_round;
pub(crate) mod queries;
pub(crate) mod replies;
pub(crate) mod retries;
pub(crate) mod round;
pub(crate) mod servers;
pub(crate) mod sockets;
pub(crate) mod state;

/// A parsed node address.
#[derive(Clone)]
pub(crate) struct NodeSpec {
    /// `host:port`, with `/db` when not 0. No credentials.
    pub name: String,
    pub target: Target,
}

impl fmt::Debug for NodeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeSpec")
            .field("name", &self.name)
            .finish()
    }
}

/// Settings the driver needs beyond addresses.
#[derive(Debug, Clone)]
pub(crate) struct DriverConfig {
    pub timeout: Duration,
    pub pool_size: u32,
    pub events: Events,
    /// Which answers count as votes (see [`crate::algorithm::quorum::insert_vote`]).
    pub rules: VoteRules,
}

/// Idle connections kept open per node.
const MIN_IDLE: u32 = 2;
/// A wake-up thread that failed to start is tried again after this.
const NOTIFIER_RETRY: Duration = Duration::from_secs(10);
/// How often a round looks again for a connection it is still missing.
const CONN_RECHECK: Duration = Duration::from_micros(200);

/// The production [`Transport`].
pub(crate) struct RedisTransport {
    /// Who reads the multiplexed connections (see [`multiplexed::role`]).
    role: Arc<multiplexed::Role<state::Pooled>>,
    names: Vec<String>,
    nodes: Vec<Arc<Node>>,
    timeout: Duration,
    rules: VoteRules,
    servers: Arc<Servers>,
    /// The wake-ups' subscriber connections, made with the first wait.
    notifier: std::sync::OnceLock<crate::driver::notify::Notifier>,
    /// When the wake-up thread last failed to start (tried again after
    /// [`NOTIFIER_RETRY`]; waiters poll meanwhile).
    notifier_failed: parking_lot::Mutex<Option<Instant>>,
}

impl fmt::Debug for RedisTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTransport")
            .field("nodes", &self.names)
            .finish()
    }
}

impl RedisTransport {
    /// Creates the pools without waiting for any node.
    pub(crate) fn new(specs: Vec<NodeSpec>, config: DriverConfig) -> Self {
        let timeout = config.timeout.max(MIN_TIMEOUT);
        let servers = Arc::new(Servers::new(
            specs.iter().map(|s| s.name.clone()).collect(),
            config.rules.allow_evicting,
        ));
        let role: Arc<multiplexed::Role<state::Pooled>> = Arc::default();
        let mut names = Vec::with_capacity(specs.len());
        let mut nodes = Vec::with_capacity(specs.len());
        for (i, spec) in specs.into_iter().enumerate() {
            let threads = Arc::new(
                ScheduledThreadPool::builder()
                    .num_threads(1)
                    .thread_name_pattern(&format!("quorumlock-n{i}"))
                    .on_drop_behavior(OnPoolDropBehavior::DiscardPendingScheduled)
                    .build(),
            );
            let shared = Arc::new(NodeState::new(
                i,
                servers.clone(),
                spec.name.clone(),
                timeout,
                config.events.clone(),
                Arc::new(SystemClock),
            ));
            let manager = Manager {
                target: spec.target.clone(),
                shared: shared.clone(),
            };
            let pool = Pool::builder()
                .max_size(config.pool_size)
                .min_idle(Some(MIN_IDLE.min(config.pool_size)))
                .test_on_check_out(false)
                // A failed background connect is retried after at most half
                // of this: a node that comes back is connected within 200 ms.
                .connection_timeout(Duration::from_millis(400))
                .error_handler(Box::new(ConnectErrors {
                    node: spec.name.clone(),
                    warned: Throttle::default(),
                }))
                .thread_pool(threads.clone())
                .build_unchecked(manager);
            names.push(spec.name);
            nodes.push(Arc::new(Node {
                shared,
                pool,
                line: Arc::default(),
                line_started: Default::default(),
                role: role.clone(),
                target: spec.target,
                threads,
            }));
        }
        RedisTransport {
            role,
            names,
            nodes,
            timeout,
            rules: config.rules,
            servers,
            notifier: std::sync::OnceLock::new(),
            notifier_failed: parking_lot::Mutex::new(None),
        }
    }

    /// The wake-ups, started on first use.
    fn notifier(&self) -> Option<&crate::driver::notify::Notifier> {
        if let Some(n) = self.notifier.get() {
            return Some(n);
        }
        let mut failed = self.notifier_failed.lock();
        if let Some(n) = self.notifier.get() {
            return Some(n);
        }
        if failed.is_some_and(|t| t.elapsed() < NOTIFIER_RETRY) {
            return None;
        }
        let targets = self
            .names
            .iter()
            .cloned()
            .zip(self.nodes.iter().map(|n| n.target.clone()))
            .collect();
        match crate::driver::notify::Notifier::start(targets, self.timeout) {
            Ok(n) => Some(self.notifier.get_or_init(|| n)),
            Err(e) => {
                log::warn!("no wake-up thread ({e}); waiters poll");
                *failed = Some(Instant::now());
                None
            }
        }
    }

    /// A connection to node `i` if one is idle (a new one is started in the
    /// background otherwise; for a failing node, only when `anyway`). Late
    /// replies on it are read first; a connection owing a reply older than
    /// the node timeout is the node's timeout.
    fn take_pooled(
        &self,
        i: usize,
        now: Instant,
        anyway: bool,
    ) -> Option<PooledConnection<Manager>> {
        let node = &self.nodes[i];
        // Only a healthy node gets new connections started on demand; a
        // failing one is reconnected by the pool's background retries
        // (but for a command whose connection closed under it, which the
        // node has not answered). Nor while the retry job holds the idle
        // ones: they are back at once.
        let grow =
            (anyway || node.shared.is_healthy()) && !node.shared.draining.load(Ordering::Acquire);
        for _ in 0..3 {
            let mut c = if grow {
                node.pool.get_timeout(Duration::ZERO).ok()?
            } else {
                node.pool.try_get()?
            };
            if catch_up(&mut c, &node.shared, now) {
                return Some(c);
            }
        }
        None
    }
}

impl Transport for RedisTransport {
    fn node_names(&self) -> &[String] {
        &self.names
    }

    fn watch(
        &self,
        resource: &str,
        confirm_by: Instant,
    ) -> Option<Box<dyn crate::lock::transport::Watch>> {
        self.notifier()?.watch(resource, confirm_by)
    }

    fn watch_all(
        &self,
        resources: &[&str],
        confirm_by: Instant,
    ) -> Option<Box<dyn crate::lock::transport::Watch>> {
        self.notifier()?.watch_all(resources, confirm_by)
    }

    fn watch_existing(&self, resource: &str) -> Option<Box<dyn crate::lock::transport::Watch>> {
        self.notifier.get()?.watch_existing(resource)
    }

    fn released(&self, resources: &[&str]) {
        if let Some(n) = self.notifier.get() {
            n.released(resources);
        }
    }

    fn releasing(&self, resource: &str, notice: u64) {
        if let Some(n) = self.notifier.get() {
            n.releasing(resource, notice);
        }
    }

    fn watching(&self, resource: &str) -> Vec<bool> {
        self.notifier
            .get()
            .map(|n| n.watching(resource))
            .unwrap_or_default()
    }

    fn begun(&self, until: Option<Instant>) -> Vec<u64> {
        if let Some(until) = until {
            // For a majority's histories at most: a node that has not
            // answered its connect by then (hung, slow) is left out, and only
            // it is held back (a round waits for a node only while its
            // answer can change the outcome). Two entries of one server:
            // the rounds count it once anyway.
            let _ = self.await_setups(until, crate::algorithm::quorum::quorum(self.nodes.len()));
        }
        self.servers.begun_keys()
    }

    fn wait_connected(&self, deadline: Instant) -> Result<usize, InvalidInput> {
        self.await_setups(deadline, usize::MAX)
    }

    fn reads(&self) -> (u64, Vec<Option<crate::algorithm::restart::Read>>) {
        let gen = self.servers.reads_made();
        let reads = self.nodes.iter().map(|n| *n.shared.read.lock());
        (gen, reads.collect())
    }

    fn probe(&self, key: &str, timeout: Duration) -> Vec<crate::lock::transport::Probe> {
        // A fresh connection per node, all at once, as for `inspect`.
        std::thread::scope(|scope| {
            let jobs: Vec<_> = self
                .nodes
                .iter()
                .map(|node| scope.spawn(move || probe_one(&node.target, key, timeout)))
                .collect();
            jobs.into_iter()
                .map(|job| {
                    job.join()
                        .unwrap_or_else(|_| crate::lock::transport::Probe {
                            connect: Some("not checked: the check panicked".into()),
                            ..Default::default()
                        })
                })
                .collect()
        })
    }

    fn inspect(&self, resource: &str, timeout: Duration) -> Vec<Result<Option<Stored>, NodeError>> {
        // A fresh connection per node, all at once: a status query neither
        // waits for a pooled connection nor changes a node's health.
        std::thread::scope(|scope| {
            let jobs: Vec<_> = self
                .nodes
                .iter()
                .zip(&self.names)
                .map(|(node, name)| {
                    scope.spawn(move || {
                        inspect_one(&node.target, resource, timeout)
                            .map_err(|(kind, detail)| NodeError::new(name, kind, detail))
                    })
                })
                .collect();
            jobs.into_iter()
                .zip(&self.names)
                .map(|(job, name)| {
                    job.join().unwrap_or_else(|_| {
                        Err(NodeError::new(
                            name,
                            NodeErrorKind::Protocol,
                            "status query panicked",
                        ))
                    })
                })
                .collect()
        })
    }

    fn run(
        &self,
        op: Op,
        keys: &[Key<'_>],
        deadline: Instant,
        decided: Option<Decided<'_>>,
        undo: Option<Undo<'_>>,
    ) -> Vec<NodeResult> {
        round::RoundRunner::run_round(self, op, keys, deadline, decided, undo)
    }
}

impl RedisTransport {
    /// Waits until every node has a connection whose server and lock
    /// history are known (its connect commands answered), or is failing,
    /// or `enough` nodes' histories are known, at most until `deadline`;
    /// returns how many nodes have a connection, or the first two entries
    /// found to reach one server.
    fn await_setups(&self, deadline: Instant, enough: usize) -> Result<usize, InvalidInput> {
        // One connection per node, kept while its setup replies are awaited:
        // popping one again every recheck left the pool below its idle
        // minimum each time, and each such pop started another connection.
        let mut held: Vec<Option<PooledConnection<Manager>>> =
            self.nodes.iter().map(|_| None).collect();
        loop {
            let mut connected = 0;
            let mut pending = false;
            for (i, node) in self.nodes.iter().enumerate() {
                let shared = &node.shared;
                if node.pool.state().connections > 0 {
                    connected += 1;
                    if !self.servers.begun_read(i) && shared.is_healthy() {
                        // Read what its connections have been told (who the
                        // server is), without waiting.
                        let now = Instant::now();
                        let c = &mut held[i];
                        if c.is_none() {
                            *c = node.pool.try_get();
                        }
                        if let Some(conn) = c.as_mut() {
                            if !catch_up(conn, shared, now) {
                                *c = None;
                            }
                        }
                        pending |= !self.servers.begun_read(i);
                    }
                } else if shared.is_healthy() {
                    // Connecting (or not started): a failing node has
                    // answered for itself.
                    pending = true;
                }
            }
            if let Some((a, b)) = self.servers.twins() {
                return Err(InvalidInput::SameServer {
                    first: self.names[a].clone(),
                    second: self.names[b].clone(),
                });
            }
            let now = Instant::now();
            let read = (0..self.nodes.len())
                .filter(|&i| self.servers.begun_read(i))
                .count();
            if !pending || now >= deadline || read >= enough {
                return Ok(connected);
            }
            std::thread::sleep(CONN_RECHECK.min(deadline.saturating_duration_since(now)));
        }
    }
}
