//! The faults a plan schedules, as they happen to the world's nodes and
//! network.

use crate::testing::sim::plan::{Fault, Net};
use crate::testing::sim::world::{ServerStatus, World};
use crate::testing::store::Store;

impl World {
    /// Node `i` loses every key and its lock history (a restart without
    /// its data, a `FLUSHALL`).
    fn wipe(&mut self, i: usize, now: u64) {
        let broken = self.nodes[i].store.broken;
        self.nodes[i].store = Store {
            broken,
            ..Store::default()
        };
        self.nodes[i].wiped_at = Some(now);
        self.nodes[i].keys_lost_at = Some(now);
    }

    pub(crate) fn fault(&mut self, f: Fault, now: u64) {
        match f {
            Fault::Pause(i) => {
                if self.nodes[i].state == ServerStatus::Up {
                    self.nodes[i].state = ServerStatus::Paused;
                }
            }
            Fault::Resume(i) => {
                if self.nodes[i].state == ServerStatus::Paused {
                    self.nodes[i].state = ServerStatus::Up;
                    self.nodes[i].resumed.push(now);
                    for msg in std::mem::take(&mut self.nodes[i].backlog) {
                        self.process(msg, now);
                    }
                }
            }
            Fault::Crash(i) => {
                self.nodes[i].state = ServerStatus::Down;
                self.nodes[i].backlog.clear();
                // Its process is gone, and its connections with it.
                self.sever(i, now);
                self.nodes[i].run += 1;
                self.nodes[i].loaded = false;
            }
            Fault::Restart { node, wipe } => {
                if self.nodes[node].state == ServerStatus::Down {
                    if wipe {
                        self.wipe(node, now);
                    }
                    self.nodes[node].state = ServerStatus::Up;
                }
            }
            Fault::Isolate(i) => self.nodes[i].isolated = true,
            Fault::Heal(i) => self.nodes[i].isolated = false,
            Fault::Mute(i) => self.nodes[i].muted = true,
            Fault::Unmute(i) => self.nodes[i].muted = false,
            Fault::Jump(i, delta) => self.nodes[i].clock.jump(now, delta),
            Fault::LoseKeys(i) => {
                if self.nodes[i].state != ServerStatus::Down {
                    // Writers' keys and reader sets alike.
                    self.nodes[i].store.keys.clear();
                    self.nodes[i].store.readers.clear();
                    self.nodes[i].keys_lost_at = Some(now);
                }
            }
            Fault::FlushScripts(i) => self.nodes[i].loaded = false,
            Fault::Flush(i) => {
                if self.nodes[i].state != ServerStatus::Down {
                    self.wipe(i, now);
                }
            }
            Fault::Kill(i) => self.sever(i, now),
            Fault::Forge(n) => return self.forge(n, now),
            Fault::HealAll => {
                self.net = Net::calm();
                for i in 0..self.nodes.len() {
                    self.nodes[i].isolated = false;
                    self.nodes[i].muted = false;
                    match self.nodes[i].state {
                        ServerStatus::Paused => self.fault(Fault::Resume(i), now),
                        ServerStatus::Down => self.fault(
                            Fault::Restart {
                                node: i,
                                wipe: false,
                            },
                            now,
                        ),
                        ServerStatus::Up => {}
                    }
                }
            }
        }
        let node = match f {
            Fault::Pause(i) | Fault::Resume(i) | Fault::Crash(i) | Fault::Isolate(i) => Some(i),
            Fault::Heal(i) | Fault::Jump(i, _) | Fault::Mute(i) | Fault::Unmute(i) => Some(i),
            Fault::LoseKeys(i) | Fault::Kill(i) | Fault::FlushScripts(i) | Fault::Flush(i) => {
                Some(i)
            }
            Fault::Restart { node, .. } => Some(node),
            Fault::HealAll | Fault::Forge(_) => None,
        };
        for i in node.map_or(0..self.nodes.len(), |i| i..i + 1) {
            self.reachable(i, now);
            // Any fault on it, whatever it leaves, starts its soundness over.
            let n = &mut self.nodes[i];
            let sound = n.state == ServerStatus::Up
                && !n.isolated
                && !n.muted
                && !n.evicting
                && !n.clock.jumped_back;
            n.sound_since = sound.then_some(now);
        }
    }
}
