//! How a simulated node serves the driver's own commands on a simulated
//! connection ([`crate::testing::sim::redis`] reads them): the scripts run
//! on its store, `SCRIPT LOAD`, `INFO` and the history id answer as Redis
//! does, a restart empties the script cache (NOSCRIPT), and replies travel
//! back in order on their connection, or reset it when lost.

use std::sync::Arc;

use crate::algorithm::round::{Key, Op};
use crate::testing::sim::check::Observed;
use crate::testing::sim::redis::Inbox;
use crate::testing::sim::world::{Event, Msg, World};

impl World {
    /// A client releases `keys` at `now`: a key of which no node holds a
    /// live copy and no write is in flight needs no delete (it expired
    /// before the client let go), which the leak check is told.
    pub(crate) fn let_go(&mut self, keys: &[Key<'_>], now: u64) {
        use crate::testing::sim::check::lineage;
        use crate::testing::sim::redis::{command, Command};
        for k in keys {
            let l = lineage(k.token);
            let carries = |m: &Msg| {
                m.keys.iter().any(|mk| lineage(&mk.token) == l)
                    || m.wire.as_ref().is_some_and(|(cmd, _)| {
                        matches!(command(cmd), Command::Script { keys, .. }
                            if keys.iter().any(|mk| lineage(&mk.token) == l))
                    })
            };
            let held = self
                .nodes
                .iter()
                .any(|n| n.holds(self.base, now, k.resource, l) || n.backlog.iter().any(carries));
            let in_flight = self
                .events
                .values()
                .any(|e| matches!(e, Event::Arrive(m) if carries(m)));
            if !held && !in_flight {
                self.check.nothing_left(l, now);
            }
        }
    }

    /// What node `i`'s `INFO` says: who it is (its process) and whether its
    /// memory policy can evict lock keys.
    fn info(&self, i: usize) -> redis::Value {
        let node = &self.nodes[i];
        let mut text = format!(
            "# Server\r\nrun_id:sim{i}run{}\r\nuptime_in_seconds:3600\r\n# Replication\r\nrole:master\r\n",
            node.run
        );
        if node.evicting {
            text.push_str("maxmemory:1000000\r\nmaxmemory_policy:volatile-lru\r\n");
        }
        redis::Value::BulkString(text.into_bytes())
    }

    /// Node `msg.node` runs a command of a simulated connection and replies
    /// on it (unless the reply is lost).
    pub(crate) fn process_wire(
        &mut self,
        msg: &Msg,
        cmd: &redis::Value,
        inbox: Arc<Inbox>,
        now: u64,
    ) {
        use crate::testing::sim::redis::{self as wire, Command};
        let i = msg.node;
        if inbox.is_closed() {
            // The connection was gone before the node read the command.
            return;
        }
        let reply = match wire::command(cmd) {
            Command::Info => self.info(i),
            Command::Load => {
                self.nodes[i].loaded = true;
                redis::Value::BulkString(b"loaded".to_vec())
            }
            Command::HistoryId => {
                redis::Value::BulkString(self.nodes[i].store.id().to_string().into_bytes())
            }
            Command::Unknown(what) => wire::error(&format!("ERR unknown command {what}")),
            Command::Script { by_sha: true, .. } if !self.nodes[i].loaded => {
                wire::error("NOSCRIPT No matching script. Please use EVAL.")
            }
            Command::Script { op, keys, .. } => {
                let local = self.nodes[i].clock.at(now);
                let node_now = self.instant(local);
                let micros = 1_700_000_000_000_000 + local / 1_000;
                let keys: Vec<Key<'_>> = keys
                    .iter()
                    .map(|k| Key {
                        resource: &k.resource,
                        token: &k.token,
                        next: k.next.as_deref(),
                    })
                    .collect();
                let reply = self.nodes[i]
                    .store
                    .round(op, &keys, node_now, self.base, micros);
                if let (
                    Ok(r),
                    Op::Acquire { .. } | Op::Extend { .. } | Op::Swap { .. } | Op::Restore { .. },
                ) = (&reply, op)
                {
                    for (k, a) in keys.iter().zip(&r.answers) {
                        if matches!(
                            a,
                            crate::algorithm::round::Answer::Ok
                                | crate::algorithm::round::Answer::Restored
                        ) {
                            self.check.landed(k.token, msg.sent);
                        }
                    }
                }
                if std::env::var_os("QUORUMLOCK_SIM_TRACE").is_some() {
                    println!(
                        "{:10.3} ms node {i} ran {op:?} sent {:.3} ms: {:?}",
                        now as f64 / 1e6,
                        msg.sent as f64 / 1e6,
                        reply.as_ref().map(|r| &r.answers)
                    );
                }
                wire::reply(op, reply)
            }
        };
        if self.nodes[i].isolated || self.nodes[i].muted {
            return;
        }
        if self.rng.chance(self.net.loss) {
            let at = now + self.delay();
            self.push(at, Event::Reset(inbox));
            return;
        }
        // Replies come back in order on their connection.
        let back = msg.lane | (1 << 63);
        let last = self.lanes.get(&back).copied().unwrap_or(0);
        let at = (now + self.delay()).max(last + 1);
        self.lanes.insert(back, at);
        self.push(at, Event::Wire(inbox, reply));
    }
}
