//! How a simulated node serves the driver's own commands on a simulated
//! connection ([`crate::testing::sim::redis`] reads them): the scripts run
//! on its store, `SCRIPT LOAD`, `INFO` and the history id answer as Redis
//! does, a restart empties the script cache (NOSCRIPT), and replies travel
//! back in order on their connection, or reset it when lost.

use crate::algorithm::health::Outcome;
use crate::clock::after;
use crate::testing::sim::world::SimNode;
use crate::testing::sim::world::{ServerStatus, CLOCK_START};
use crate::testing::store::Store;
use std::time::Duration;
use std::time::Instant;

use std::sync::Arc;

use crate::algorithm::round::{Key, Op};
use crate::testing::sim::check::{Observed, BACKLOG};
use crate::testing::sim::redis::Inbox;
use crate::testing::sim::world::{Event, Msg, World};

impl World {
    /// A simulated connection to node `i` opens (its lane is returned):
    /// refused when the node is down, unanswered when it is cut off (the
    /// caller counts a timeout).
    pub(crate) fn connect(&mut self, i: usize, inbox: &Arc<Inbox>) -> Result<u64, Outcome> {
        let node = &mut self.nodes[i];
        match node.state {
            ServerStatus::Down => Err(Outcome::Refused),
            _ if node.isolated => Err(Outcome::TimedOut),
            _ => {
                self.next_lane += 1;
                node.open.retain(|(_, c)| c.strong_count() > 0);
                node.open.push((self.next_lane, Arc::downgrade(inbox)));
                Ok(self.next_lane)
            }
        }
    }

    /// Node `i` closes every connection to it (`CLIENT KILL`, or its
    /// process ends): it reads nothing more on them. Each client sees its
    /// close after the replies already on their way back (a FIN), or, as
    /// often, one that overtakes them and loses them (a reset, or a reply
    /// the server had not written yet).
    pub(crate) fn sever(&mut self, i: usize, now: u64) {
        for (lane, c) in std::mem::take(&mut self.nodes[i].open) {
            if let Some(inbox) = c.upgrade() {
                inbox.sever();
                let back = lane | (1 << 63);
                let mut at = now + self.delay();
                if self.rng.chance(0.5) {
                    let last = self.lanes.get(&back).copied().unwrap_or(0);
                    at = at.max(last + 1);
                    self.lanes.insert(back, at);
                }
                self.push(at, Event::Reset(inbox));
            }
        }
    }

    /// A client releases `keys` at `now`: a key of which no node holds a
    /// live copy and no write is in flight needs no delete (it expired
    /// before the client let go), which the leak check is told.
    pub(crate) fn let_go(&mut self, keys: &[Key<'_>], now: u64) {
        use crate::testing::sim::check::lineage;
        use crate::testing::sim::redis::{command, Command};
        for k in keys {
            let l = lineage(k.token);
            // The TTL a message's write of this lineage would set, if it
            // carries one.
            let writes = |m: &Msg| -> Option<std::time::Duration> {
                match command(&m.cmd) {
                    Command::Script { op, keys, .. }
                        if keys.iter().any(|mk| lineage(&mk.token) == l) =>
                    {
                        match op {
                            Op::Acquire { ttl, .. }
                            | Op::Swap { ttl, .. }
                            | Op::Extend { ttl, .. }
                            | Op::Restore { ttl } => Some(ttl),
                            Op::Release { .. } | Op::Fence { .. } => None,
                        }
                    }
                    Command::Set { key, ttl } if lineage(&key.token) == l => Some(ttl),
                    _ => None,
                }
            };
            let nanos = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
            // Where a live copy is left, and until when in virtual time (its
            // node's clock may run at another rate); a write still on its
            // way may leave one until it lands plus its TTL, and one a
            // paused node holds, until whenever it resumes.
            let mut copies: Vec<(usize, u64)> = self
                .nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| n.holds(self.base, now, k.resource, l))
                .filter_map(|(i, n)| {
                    let local = n.local(self.base, now);
                    let exp = n.store.expiry(k.resource, l)?;
                    let left = exp.saturating_duration_since(local).as_nanos() as f64 / n.rate();
                    Some((i, now.saturating_add(left as u64)))
                })
                .collect();
            for (&(at, _), e) in &self.events {
                if let Event::Arrive(m) = e {
                    if let Some(ttl) = writes(m) {
                        copies.push((m.node, at.saturating_add(nanos(ttl))));
                    }
                }
            }
            for (i, n) in self.nodes.iter().enumerate() {
                for ttl in n.backlog.iter().filter_map(writes) {
                    // Runs when the node resumes: marked by the top bit,
                    // with the TTL it sets from then.
                    copies.push((i, BACKLOG | nanos(ttl)));
                }
            }
            if copies.is_empty() {
                self.check.nothing_left(l, now);
            } else {
                self.check.owed(l, now, copies);
            }
        }
    }

    /// What node `i`'s `INFO` says: who it is (its process), its uptime
    /// ([`CLOCK_START`], whatever restarts it had: no node here restarts
    /// from a snapshot, whose history a client caps at the uptime) and
    /// whether its memory policy can evict lock keys.
    fn info(&self, i: usize) -> redis::Value {
        let node = &self.nodes[i];
        let mut text = format!(
            "# Server\r\nrun_id:sim{i}run{}\r\nuptime_in_seconds:{}\r\n# Replication\r\nrole:master\r\n",
            node.run,
            CLOCK_START / 1_000_000_000,
        );
        if node.evicting {
            text.push_str("maxmemory:1000000\r\nmaxmemory_policy:volatile-lru\r\n");
        }
        redis::Value::BulkString(text.into_bytes())
    }

    /// Node `msg.node` runs a command of a simulated connection now and
    /// replies on it (unless the reply is lost).
    pub(crate) fn process(&mut self, msg: Msg, now: u64) {
        use crate::testing::sim::redis::{self as wire, Command};
        let Msg { node: i, inbox, .. } = &msg;
        let (i, inbox) = (*i, inbox.clone());
        if inbox.is_severed() || self.dead.contains(&msg.lane) {
            // The connection was gone before the node read the command.
            return;
        }
        let reply = match wire::command(&msg.cmd) {
            Command::Info => self.info(i),
            Command::Load => {
                self.nodes[i].loaded = true;
                redis::Value::BulkString(b"loaded".to_vec())
            }
            Command::HistoryId => {
                // `{id, epoch}`, the epoch `''` where no history has begun.
                let store = &self.nodes[i].store;
                let epoch = store.epoch(self.base).map(|e| e.to_string());
                redis::Value::Array(vec![
                    redis::Value::BulkString(store.id().to_string().into_bytes()),
                    redis::Value::BulkString(epoch.unwrap_or_default().into_bytes()),
                ])
            }
            Command::Set { key, ttl } => {
                let local = self.nodes[i].clock.at(now);
                let node_now = self.instant(local);
                let set = self.nodes[i].store.set_nx(&key.key(), ttl, node_now);
                if set {
                    self.check.landed(&key.token, i, msg.sent, now);
                }
                if std::env::var_os("QUORUMLOCK_SIM_TRACE").is_some() {
                    println!(
                        "{:10.3} ms node {i} ran SET NX {} sent {:.3} ms: {set}",
                        now as f64 / 1e6,
                        key.resource,
                        msg.sent as f64 / 1e6,
                    );
                }
                if set {
                    redis::Value::Okay
                } else {
                    redis::Value::Nil
                }
            }
            Command::Pttl(resource) => {
                let local = self.nodes[i].clock.at(now);
                let node_now = self.instant(local);
                redis::Value::Int(self.nodes[i].store.pttl(&resource, node_now))
            }
            Command::Get(resource) => {
                let local = self.nodes[i].clock.at(now);
                let node_now = self.instant(local);
                let store = &mut self.nodes[i].store;
                store.prune(node_now);
                if let Some((value, _)) = store.keys.get(&resource) {
                    redis::Value::BulkString(value.clone().into_bytes())
                } else if store.readers.contains_key(&resource) {
                    wire::error("WRONGTYPE Operation against a key holding the wrong kind of value")
                } else if store.foreign.contains(&resource) {
                    redis::Value::BulkString(b"an application's value".to_vec())
                } else {
                    redis::Value::Nil
                }
            }
            Command::TermOf(resource) => match self.nodes[i].store.terms.get(&resource) {
                Some((term, token)) => {
                    redis::Value::BulkString(format!("{term} {token}").into_bytes())
                }
                None => redis::Value::Nil,
            },
            Command::Epoch => match self.nodes[i].store.epoch(self.base) {
                Some(e) => redis::Value::BulkString(e.to_string().into_bytes()),
                None => redis::Value::Nil,
            },
            Command::Unknown(what) => wire::error(&format!("ERR unknown command {what}")),
            Command::Script { by_sha: true, .. } if !self.nodes[i].loaded => {
                if std::env::var_os("QUORUMLOCK_SIM_TRACE").is_some() {
                    println!("{:10.3} ms node {i}: NOSCRIPT", now as f64 / 1e6);
                }
                wire::error("NOSCRIPT No matching script. Please use EVAL.")
            }
            Command::Script { op, keys, .. } => {
                let reply = self.run_script(i, op, &keys, msg.sent, now);
                wire::reply(op, reply)
            }
        };
        if self.nodes[i].isolated || self.nodes[i].muted {
            // Its reply is lost: the connection hangs from here on.
            self.dead.insert(msg.lane);
            return;
        }
        if self.rng.chance(self.net.loss) {
            self.dead.insert(msg.lane);
            self.resetting.insert(msg.lane);
            let at = now + self.delay();
            self.push(at, Event::Reset(inbox));
            return;
        }
        // Replies come back in order on their connection.
        let back = msg.lane | (1 << 63);
        let last = self.lanes.get(&back).copied().unwrap_or(0);
        let at = (now + self.delay()).max(last + 1);
        self.lanes.insert(back, at);
        self.push(at, Event::ConnState(inbox, reply));
    }
}

/// What the checkers read of a simulated node.
impl Observed for SimNode {
    fn wiped_since(&self, t: u64) -> bool {
        self.wiped_at.is_some_and(|w| w >= t)
    }

    fn lost_keys_since(&self, t: u64) -> bool {
        self.keys_lost_at.is_some_and(|w| w >= t)
    }

    fn holds(&self, base: Instant, now: u64, resource: &str, lineage: &str) -> bool {
        let local = self.local(base, now);
        self.store
            .expiry(resource, lineage)
            .is_some_and(|exp| exp > local)
    }

    fn judged(&self) -> bool {
        self.state == ServerStatus::Up && !self.isolated && !self.clock.jumped_back
    }

    fn local(&self, base: Instant, now: u64) -> Instant {
        after(base, Duration::from_nanos(self.clock.at(now)))
    }

    fn store(&self) -> &Store {
        &self.store
    }

    fn rate(&self) -> f64 {
        self.clock.rate
    }

    fn unreachable(&self) -> u64 {
        self.unreachable
    }

    fn copy_until(&self, from: u64, until: u64) -> u64 {
        use crate::testing::sim::check::BACKLOG;
        if until & BACKLOG == 0 {
            return until;
        }
        self.resumed
            .iter()
            .find(|&&r| r >= from)
            .map_or(u64::MAX, |&r| r.saturating_add(until & !BACKLOG))
    }

    fn sound_since(&self) -> Option<u64> {
        self.sound_since
    }

    fn wiped_at(&self) -> Option<u64> {
        self.wiped_at
    }

    fn longest_reachable(&self, from: u64, to: u64) -> u64 {
        let dark = self
            .dark
            .iter()
            .copied()
            .chain(self.dark_since.map(|s| (s, u64::MAX)));
        // Spans are in time order and never overlap.
        let (mut longest, mut t) = (0, from);
        for (s, e) in dark {
            if e <= t {
                continue;
            }
            if s >= to {
                break;
            }
            longest = longest.max(s.saturating_sub(t));
            t = e;
        }
        longest.max(to.saturating_sub(t))
    }
}
