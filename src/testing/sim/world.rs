//! The simulated world: nodes with their own clocks, a network that delays,
//! loses and reorders messages (and resets or hangs the connections that
//! carry them), and faults on a schedule.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::algorithm::round::{Key, Op};
use crate::clock::after;
use crate::testing::sim::check::Checker;
use crate::testing::sim::plan::{Fault, Net};
use crate::testing::sim::redis::{Inbox, OwnedKey};
use crate::testing::sim::rng::SimRng;
use crate::testing::store::Store;

/// Where every node's clock starts (ns), and how long each node has been
/// up with its lock history: two hours, so that clocks can jump back, and
/// every history is older than any TTL in use ([`MAX_TTL`](crate::MAX_TTL))
/// even as a client bounds it by the uptime `INFO` says, less a second.
pub(crate) const CLOCK_START: u64 = 7_200_000_000_000;

/// A node's wall clock: `local(t) = local + (t − anchor) × rate`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NodeClock {
    anchor: u64,
    local: u64,
    pub(crate) rate: f64,
    /// It was ever set back (keys then outlive their TTL in real time).
    pub(crate) jumped_back: bool,
}

impl NodeClock {
    fn new(rate: f64) -> Self {
        NodeClock {
            anchor: 0,
            local: CLOCK_START,
            rate,
            jumped_back: false,
        }
    }

    pub(crate) fn at(&self, t: u64) -> u64 {
        let d = t.saturating_sub(self.anchor) as f64 * self.rate;
        self.local.saturating_add(d as u64)
    }

    pub(crate) fn jump(&mut self, t: u64, delta: i64) {
        self.local = self.at(t).saturating_add_signed(delta);
        self.anchor = t;
        self.jumped_back |= delta < 0;
    }
}

/// How a node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ServerStatus {
    Up,
    /// SIGSTOPped: messages queue up and run at resume.
    Paused,
    /// Crashed: connections are refused.
    Down,
}

pub(crate) struct SimNode {
    pub(crate) store: Store,
    pub(crate) state: ServerStatus,
    /// Messages and replies to and from it are dropped (a black hole).
    pub(crate) isolated: bool,
    /// It runs commands, but its replies are lost.
    pub(crate) muted: bool,
    pub(crate) backlog: Vec<Msg>,
    pub(crate) clock: NodeClock,
    /// When it last restarted without its data (virtual ns).
    pub(crate) wiped_at: Option<u64>,
    /// When it last lost its keys: a restart without its data, an eviction.
    pub(crate) keys_lost_at: Option<u64>,
    /// Time it spent paused, crashed or cut off (virtual ns): messages it
    /// held meanwhile may land that much later.
    pub(crate) unreachable: u64,
    since: Option<u64>,
    /// Its memory policy can evict lock keys (`maxmemory` with
    /// `volatile-lru`), which its `INFO` says.
    pub(crate) evicting: bool,
    /// Its process: a new one (a new `run_id`, an empty script cache) at
    /// every restart.
    pub(crate) run: u64,
    /// The scripts are cached (`SCRIPT LOAD`): `EVALSHA` runs.
    pub(crate) loaded: bool,
    /// The connections open to it (lane, inbox), closed when its process
    /// ends or a `CLIENT KILL` closes them.
    pub(crate) open: Vec<(u64, std::sync::Weak<Inbox>)>,
    /// The spans (virtual ns) in which no connection to it could be made
    /// (down, cut off or muted), and the start of the current one.
    pub(crate) dark: Vec<(u64, u64)>,
    pub(crate) dark_since: Option<u64>,
    /// When it resumed from pauses (virtual ns).
    pub(crate) resumed: Vec<u64>,
    /// Since when it has been sound (see `Observed::sound_since`).
    pub(crate) sound_since: Option<u64>,
}

/// A command on a simulated connection (the driver's own bytes), answered
/// into the connection's inbox.
pub(crate) struct Msg {
    /// The server it goes to.
    pub(crate) node: usize,
    /// When the client sent it (virtual ns).
    pub(crate) sent: u64,
    pub(crate) cmd: redis::Value,
    pub(crate) inbox: Arc<Inbox>,
    /// The connection it travels on.
    pub(crate) lane: u64,
}

pub(crate) enum Event {
    Arrive(Msg),
    Fault(Fault),
    /// A reply reaches a simulated connection.
    ConnState(Arc<Inbox>, redis::Value),
    /// A simulated connection is reset (a lost packet, as TCP shows it).
    Reset(Arc<Inbox>),
    /// A release's message reaches a client waiting for its key.
    /// A release's message, from a node.
    Notify(Arc<crate::testing::sim::chan::SimChan>, u64, usize),
}

/// Nodes, network and checkers, guarded by the scheduler's lock.
pub(crate) struct World {
    pub(crate) base: Instant,
    /// The clients' node list: per entry, its name and the node (server)
    /// it reaches (one server may be listed twice).
    pub(crate) names: Vec<String>,
    pub(crate) entries: Vec<usize>,
    pub(crate) nodes: Vec<SimNode>,
    pub(crate) net: Net,
    pub(crate) check: Checker,
    /// Each client's shared-connection counts.
    pub(crate) line_stats: Vec<Arc<crate::driver::node::multiplexed::MultiplexedStats>>,
    pub(crate) events: BTreeMap<(u64, u64), Event>,
    seq: u64,
    pub(crate) rng: SimRng,
    /// Per connection, when its last message arrives (FIFO per connection).
    pub(crate) lanes: BTreeMap<u64, u64>,
    pub(crate) next_lane: u64,
    /// Simulated connections that lost a command or a reply: nothing more
    /// travels on them (a TCP stream has no gaps; it hangs or resets).
    pub(crate) dead: std::collections::BTreeSet<u64>,
    /// Those of them that reset (a loss, not a node cut off or muted):
    /// what the client writes there was sent in vain, but it was sent.
    pub(crate) resetting: std::collections::BTreeSet<u64>,
    /// Who waits for which key (`None`: no wake-ups in this run).
    pub(crate) subs: crate::testing::sim::chan::Subscribers,
    pub(crate) wakes: crate::testing::sim::chan::WakeStats,
}

impl World {
    pub(crate) fn new(
        base: Instant,
        rates: &[f64],
        entries: &[usize],
        net: Net,
        rng: SimRng,
        check: Checker,
    ) -> Self {
        let nodes = rates
            .iter()
            .map(|&rate| SimNode {
                // Running for two hours already: its votes count at once.
                store: Store::with_history(base),
                state: ServerStatus::Up,
                isolated: false,
                muted: false,
                backlog: Vec::new(),
                clock: NodeClock::new(rate),
                wiped_at: None,
                keys_lost_at: None,
                unreachable: 0,
                since: None,
                evicting: false,
                run: 1,
                loaded: false,
                open: Vec::new(),
                dark: Vec::new(),
                dark_since: None,
                resumed: Vec::new(),
                sound_since: Some(0),
            })
            .collect();
        World {
            base,
            names: (0..entries.len())
                .map(|e| format!("sim{}:{}", entries[e], 6379 + e))
                .collect(),
            entries: entries.to_vec(),
            nodes,
            net,
            check,
            line_stats: Vec::new(),
            events: BTreeMap::new(),
            seq: 0,
            rng,
            lanes: BTreeMap::new(),
            next_lane: 0,
            dead: std::collections::BTreeSet::new(),
            resetting: std::collections::BTreeSet::new(),
            subs: None,
            wakes: Default::default(),
        }
    }

    pub(crate) fn push(&mut self, at: u64, e: Event) {
        self.seq += 1;
        self.events.insert((at, self.seq), e);
    }

    pub(crate) fn schedule(&mut self, at: u64, f: Fault) {
        self.push(at, Event::Fault(f));
    }

    /// Stores `token` under `resource` on `node` for `ttl` of its clock,
    /// as another client's lock.
    pub(crate) fn plant(
        &mut self,
        node: usize,
        resource: &str,
        token: &str,
        ttl: Duration,
        now: u64,
    ) {
        let local = self.instant(self.nodes[node].clock.at(now));
        let keys = &mut self.nodes[node].store.keys;
        keys.insert(resource.to_owned(), (token.to_owned(), after(local, ttl)));
    }

    pub(crate) fn next_event(&self) -> Option<u64> {
        self.events.keys().next().map(|k| k.0)
    }

    /// Runs the checkers at `now` (after any change).
    pub(crate) fn observe(&mut self, now: u64) {
        self.check.observe(now, &self.nodes, self.base);
    }

    /// Fires every event due at or before `now`, in order.
    pub(crate) fn fire(&mut self, now: u64) {
        while let Some(entry) = self.events.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let ((at, _), e) = entry.remove_entry();
            match e {
                Event::Arrive(msg) => self.arrive(msg, at),
                Event::Fault(f) => self.fault(f, at),
                Event::ConnState(inbox, v) => inbox.push(v),
                Event::Reset(inbox) => inbox.close(),
                Event::Notify(chan, notice, node) => {
                    if chan.deliver(notice, (node, self.nodes.len())) {
                        self.wakes.woken += 1;
                    }
                }
            }
        }
    }

    pub(crate) fn delay(&mut self) -> u64 {
        let (lo, hi) = self.net.latency;
        let mut d = lo + self.rng.below(hi.saturating_sub(lo) + 1);
        if self.rng.chance(self.net.spike) {
            d += self.rng.below(self.net.spike_max + 1);
        }
        d
    }

    /// Keeps count of the time `node` is unreachable, after a fault.
    pub(crate) fn reachable(&mut self, node: usize, now: u64) {
        let n = &mut self.nodes[node];
        // A muted node takes connections, but the first reply it loses
        // leaves that connection hanging: nothing more reaches it there.
        let dark = n.state == ServerStatus::Down || n.isolated || n.muted;
        match (dark, n.dark_since) {
            (true, None) => n.dark_since = Some(now),
            (false, Some(s)) => {
                n.dark.push((s, now));
                n.dark_since = None;
            }
            _ => {}
        }
        let down = n.state != ServerStatus::Up || n.isolated;
        match (down, n.since) {
            (true, None) => n.since = Some(now),
            (false, Some(s)) => {
                n.unreachable += now.saturating_sub(s);
                n.since = None;
            }
            _ => {}
        }
    }

    /// Sends `msg` on its connection at `now`.
    pub(crate) fn send(&mut self, msg: Msg, now: u64) {
        let (i, lane) = (msg.node, msg.lane);
        if self.dead.contains(&lane) {
            return;
        }
        if self.nodes[i].state == ServerStatus::Down {
            msg.inbox.close();
            return;
        }
        if self.nodes[i].isolated {
            // Cut off: the connection hangs from here on.
            self.dead.insert(lane);
            return;
        }
        if self.rng.chance(self.net.loss) {
            // TCP does not lose a command: the connection resets.
            self.dead.insert(lane);
            self.resetting.insert(lane);
            let at = now + self.delay();
            self.push(at, Event::Reset(msg.inbox));
            return;
        }
        let last = self.lanes.get(&lane).copied().unwrap_or(0);
        let at = (now + self.delay()).max(last + 1);
        self.lanes.insert(lane, at);
        self.push(at, Event::Arrive(msg));
    }

    pub(crate) fn instant(&self, nanos: u64) -> Instant {
        after(self.base, Duration::from_nanos(nanos))
    }

    fn arrive(&mut self, msg: Msg, now: u64) {
        let node = &mut self.nodes[msg.node];
        match node.state {
            ServerStatus::Down => {}
            ServerStatus::Paused => node.backlog.push(msg),
            ServerStatus::Up if node.isolated => {
                // Cut off while it was on its way: the connection hangs
                // from here on (nothing after it may arrive in its place).
                self.dead.insert(msg.lane);
            }
            ServerStatus::Up => self.process(msg, now),
        }
    }

    /// Node `i` runs one lock script now, as the Lua does, for a command
    /// sent at `sent`: the checker learns which of our keys it set or kept.
    pub(crate) fn run_script(
        &mut self,
        i: usize,
        op: Op,
        keys: &[OwnedKey],
        sent: u64,
        now: u64,
    ) -> Result<crate::algorithm::round::Reply, &'static str> {
        let local = self.nodes[i].clock.at(now);
        let node_now = self.instant(local);
        let micros = 1_700_000_000_000_000 + local / 1_000;
        let keys: Vec<Key<'_>> = keys.iter().map(OwnedKey::key).collect();
        let mut reply = self.nodes[i]
            .store
            .round(op, &keys, node_now, self.base, micros);
        if let (Ok(r), Op::Release { notice, .. }) = (reply.as_mut(), op) {
            self.publish(i, r, &keys, notice, now);
        }
        if let (
            Ok(r),
            Op::Acquire { .. } | Op::Extend { .. } | Op::Swap { .. } | Op::Restore { .. },
        ) = (&reply, op)
        {
            for (k, a) in keys.iter().zip(&r.answers) {
                if matches!(
                    a,
                    crate::algorithm::round::Answer::Ok | crate::algorithm::round::Answer::Restored
                ) {
                    self.check.landed(k.token, i, sent, now);
                }
            }
        }
        if std::env::var_os("QUORUMLOCK_SIM_TRACE").is_some() {
            println!(
                "{:10.3} ms node {i} ran {} sent {:.3} ms: {:?}",
                now as f64 / 1e6,
                crate::testing::sim::check::traced(op, &keys),
                sent as f64 / 1e6,
                reply.as_ref().map(|r| &r.answers)
            );
        }
        reply
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::{Msg, World};
    use crate::clock::Signal;
    use crate::testing::sim::check::Checker;
    use crate::testing::sim::plan::{Fault, Net, MS};
    use crate::testing::sim::redis::{commands, Inbox};
    use crate::testing::sim::rng::SimRng;

    /// A command that reaches its node while the node is cut off is lost,
    /// and its connection hangs: a command sent on it after the node is
    /// back is not answered in its place (its reply would be read as the
    /// lost one's: seed 0x760 of the sweep with elections granted a lock on
    /// an acquire the node had refused).
    #[test]
    fn a_command_lost_to_a_cut_off_node_hangs_its_connection() {
        let base = Instant::now();
        let net = Net {
            latency: (MS, MS),
            ..Net::calm()
        };
        let check = Checker::new(base, net.max_delay());
        let mut w = World::new(base, &[1.0], &[0], net, SimRng::new(1), check);
        let inbox = Inbox::new(Arc::new(Signal::default()));
        let lane = w.connect(0, &inbox).expect("up");
        let pttl = |key: &str| {
            let bytes = redis::cmd("PTTL").arg(key).get_packed_command();
            commands(&bytes).remove(0)
        };
        let msg = |cmd, sent| Msg {
            node: 0,
            sent,
            cmd,
            inbox: inbox.clone(),
            lane,
        };
        w.send(msg(pttl("a"), 0), 0);
        // Cut off before it arrives (1 ms on its way), back after.
        w.schedule(MS / 2, Fault::Isolate(0));
        w.schedule(2 * MS, Fault::Heal(0));
        w.fire(3 * MS);
        w.send(msg(pttl("b"), 3 * MS), 3 * MS);
        w.fire(10 * MS);
        assert_eq!(
            inbox.pop(),
            None,
            "a reply came back on a connection that lost a command"
        );
    }
}
