//! A simulated client's [`Transport`]: the production round over the
//! simulated connections ([`SimLinks`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::algorithm::quorum::VoteRules;
use crate::algorithm::round::{Key, NodeResult, Op};
use crate::clock::Clock;
use crate::driver::node::round::RoundRunner;
use crate::driver::node::state::Defects;
use crate::lock::transport::{Decided, Transport, Undo, Watch};
use crate::testing::sim::check::lineage;
use crate::testing::sim::links::{Fate, SimLinks};
use crate::testing::sim::sched::Sched;
use crate::testing::sim::wakeups::Watches;

/// A simulated client's [`Transport`]: the production round over
/// [`SimLinks`].
pub(crate) struct SimEngine {
    links: Arc<SimLinks>,
    sched: Arc<Sched>,
    /// Yield to the scheduler before every round.
    preempt: bool,
    /// Its waits for releases (see [`wakeups`](crate::testing::sim::wakeups)).
    watches: Watches,
}

impl SimEngine {
    pub(crate) fn new(
        sched: &Arc<Sched>,
        clock: Arc<dyn Clock>,
        timeout: Duration,
        preempt: bool,
        rules: VoteRules,
        defects: Defects,
        fate: Arc<Fate>,
    ) -> Self {
        SimEngine {
            links: SimLinks::new(sched, clock, timeout, rules, defects, fate),
            sched: sched.clone(),
            preempt,
            watches: Default::default(),
        }
    }
}

impl Transport for SimEngine {
    fn node_names(&self) -> &[String] {
        &self.links.names
    }

    /// What the driver's connections learnt at connect, as the driver's
    /// transport: with `until`, nodes still connecting are waited for.
    fn begun(&self, until: Option<Instant>) -> Vec<u64> {
        if let Some(until) = until {
            self.links.learn_histories(until);
        }
        self.links.servers.begun_keys()
    }

    fn reads(&self) -> (u64, Vec<Option<crate::algorithm::restart::Read>>) {
        self.links.reads()
    }

    fn wait_connected(&self, _deadline: Instant) -> Result<usize, crate::error::InvalidInput> {
        Ok(self.links.names.len())
    }

    fn probe(&self, _key: &str, _timeout: Duration) -> Vec<crate::lock::transport::Probe> {
        crate::testing::unsupported_probes(&self.links.names)
    }

    /// As the driver's: see [`inspect`](crate::testing::sim::inspect).
    fn inspect(
        &self,
        resource: &str,
        timeout: Duration,
    ) -> Vec<Result<Option<crate::lock::transport::Stored>, crate::NodeError>> {
        let fate = &self.links.fate;
        fate.hold(&self.sched);
        if fate.is_dead() {
            return crate::testing::unsupported_inspect(&self.links.names);
        }
        let entries = self.sched.lock().world.entries.clone();
        crate::testing::sim::inspect::inspect(
            &self.sched,
            &self.links.names,
            &entries,
            resource,
            timeout,
        )
    }

    fn watch(&self, resource: &str, _confirm_by: Instant) -> Option<Box<dyn Watch>> {
        self.watches.watch(&self.sched, resource, false)
    }

    fn watch_existing(&self, resource: &str) -> Option<Box<dyn Watch>> {
        self.watches.watch(&self.sched, resource, true)
    }

    fn watch_all(&self, resources: &[&str], _confirm_by: Instant) -> Option<Box<dyn Watch>> {
        self.watches.watch_all(&self.sched, resources)
    }

    fn releasing(&self, resource: &str, notice: u64) {
        self.watches.releasing(resource, notice);
    }

    fn released(&self, resources: &[&str]) {
        self.watches.released(resources);
    }

    fn watching(&self, resource: &str) -> Vec<bool> {
        self.watches.watching(resource, self.links.names.len())
    }

    fn run(
        &self,
        op: Op,
        keys: &[Key<'_>],
        deadline: Instant,
        decided: Option<Decided<'_>>,
        undo: Option<Undo<'_>>,
    ) -> Vec<NodeResult> {
        let fate = &self.links.fate;
        fate.hold(&self.sched);
        if self.preempt {
            // Another thread may run between the decision to send and the send.
            self.sched.yield_now();
        }
        if !fate.is_dead() {
            match op {
                Op::Release { .. } => {
                    let now = self.sched.nanos();
                    self.sched.lock().world.let_go(keys, now);
                }
                _ => {
                    let mut mine = fate.lineages.lock();
                    for k in keys {
                        mine.insert(lineage(k.token).to_owned());
                    }
                }
            }
        }
        let results = RoundRunner::run_round(&*self.links, op, keys, deadline, decided, undo);
        // A paused process reads the replies when it resumes.
        fate.hold(&self.sched);
        results
    }
}
