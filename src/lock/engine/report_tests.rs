//! What the engine reports to an [`EventHandler`](crate::EventHandler), on fake
//! nodes: every attempt, renewal, loss, release and node change, once.

use std::sync::Arc;
use std::time::Duration;

use crate::events::*;
use crate::lock::settings::Settings;
use crate::testing::fake::{client_over, client_with, Mode};
use parking_lot::Mutex;

const TTL: Duration = Duration::from_secs(10);

/// Writes every event down as a line.
#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

impl Recorder {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock())
    }
    fn push(&self, s: String) {
        self.0.lock().push(s);
    }
}

fn kinds(nodes: Nodes<'_>) -> String {
    nodes
        .iter()
        .map(|(_, o)| match o {
            NodeOutcome::Agreed => "ok".to_owned(),
            NodeOutcome::HeldByOther => "other".to_owned(),
            NodeOutcome::Missing => "missing".to_owned(),
            NodeOutcome::Restored => "restored".to_owned(),
            NodeOutcome::Failed(k) => format!("{k:?}"),
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl EventHandler for Recorder {
    fn on_attempt(&self, e: &AttemptEvent<'_>) {
        assert!(e.elapsed() < TTL);
        assert_eq!(e.acquired(), e.validity().is_some());
        assert_eq!(e.acquired(), e.error().is_none());
        self.push(format!(
            "attempt {} {} [{}]",
            e.resource(),
            if e.validity().is_some_and(|v| v > TTL / 2 && v < TTL) {
                "acquired".to_owned()
            } else {
                format!("{:?}", e.error().map(|e| e.to_string()))
            },
            kinds(e.nodes())
        ));
    }
    fn on_renewal(&self, e: &RenewalEvent<'_>) {
        self.push(format!(
            "renewal {} auto={} ok={} [{}]",
            e.resource(),
            e.is_automatic(),
            e.validity().is_some(),
            kinds(e.nodes())
        ));
    }
    fn on_lost(&self, e: &LostEvent<'_>) {
        self.push(format!("lost {} {}", e.resource(), e.error()));
    }
    fn on_release(&self, e: &ReleaseEvent<'_>) {
        self.push(format!(
            "release {} ok={} [{}]",
            e.resource(),
            e.error().is_none(),
            kinds(e.nodes())
        ));
    }
    fn on_node(&self, e: &NodeEvent<'_>) {
        let change = match e.change() {
            NodeChange::HeldBack { votes_in } if votes_in > Duration::ZERO => {
                "held back".to_owned()
            }
            c => format!("{c:?}"),
        };
        self.push(format!("node {} {change}", e.node()));
    }
}

#[test]
fn a_lock_cycle_reports_attempts_renewals_losses_and_releases() {
    let rec = Arc::new(Recorder::default());
    let settings = Settings {
        events: Events(Some(rec.clone())),
        ..crate::testing::fake::settings()
    };
    let (locks, nodes, _clock) = client_with(3, settings);
    let g = locks.try_lock("r", TTL).unwrap();
    assert!(locks.try_lock("r", TTL).is_err());
    g.extend(TTL).unwrap();
    let other = client_over(&nodes, crate::testing::fake::settings());
    assert!(other.try_lock("r", TTL).is_err());
    g.release().unwrap();
    nodes.set_mode(2, Mode::Down);
    let g = locks.try_lock("s", TTL).unwrap();
    nodes.del(0, "s");
    nodes.del(1, "s");
    assert!(g.extend(TTL).is_err());
    drop(g);
    assert_eq!(
        rec.take(),
        [
            "attempt r acquired [ok,ok,ok]",
            "attempt r Some(\"taken: another owner holds the lock on 3 of 3 nodes\") [other,other,other]",
            "renewal r auto=false ok=true [ok,ok,ok]",
            "release r ok=true [ok,ok,ok]",
            "attempt s acquired [ok,ok,Unavailable]",
            "renewal s auto=false ok=false [missing,missing,Unavailable]",
            "lost s expired: the lock's time ran out (or its keys were deleted)",
            "release s ok=false [missing,missing,Unavailable]",
        ]
    );
}

#[test]
fn the_restart_rule_reports_when_it_holds_a_node_back_and_when_it_stops() {
    let (x, nodes, clock) = client_with(3, crate::testing::fake::settings());
    drop(x.try_lock("warm", TTL).unwrap());
    clock.advance(60 * TTL);
    nodes.wipe(2);
    let rec = Arc::new(Recorder::default());
    let y = client_over(
        &nodes,
        Settings {
            events: Events(Some(rec.clone())),
            ..Settings::default()
        },
    );
    drop(y.try_lock("a", TTL).unwrap());
    drop(y.try_lock("b", TTL).unwrap());
    clock.advance(2 * TTL);
    drop(y.try_lock("c", TTL).unwrap());
    let nodes_events: Vec<String> = rec
        .take()
        .into_iter()
        .filter(|e| e.starts_with("node") || e.starts_with("attempt"))
        .collect();
    assert_eq!(
        nodes_events,
        [
            "attempt a acquired [ok,ok,Restarted]",
            "node fake2:6379 held back",
            "attempt b acquired [ok,ok,Restarted]",
            "attempt c acquired [ok,ok,ok]",
            "node fake2:6379 HoldOver",
        ]
    );
}

#[test]
fn renewals_by_the_renewal_thread_are_reported_as_automatic() {
    let rec = Arc::new(Recorder::default());
    let (locks, _nodes, _clock) = client_with(
        3,
        Settings {
            events: Events(Some(rec.clone())),
            ..crate::testing::fake::settings()
        },
    );
    let g = locks.try_lock("r", TTL).unwrap();
    // The renewal thread's call (crate::lock::watchdog::tick).
    let out = locks.engine.extend_many(&[g.state()], TTL, true);
    assert!(out[0].is_ok());
    g.extend(TTL).unwrap();
    let seen = rec.take();
    assert_eq!(
        seen[1..3],
        [
            "renewal r auto=true ok=true [ok,ok,ok]",
            "renewal r auto=false ok=true [ok,ok,ok]"
        ]
    );
}

/// Panics everywhere.
struct Panicky;

impl EventHandler for Panicky {
    fn on_attempt(&self, _: &AttemptEvent<'_>) {
        panic!("on_attempt");
    }
    fn on_renewal(&self, _: &RenewalEvent<'_>) {
        panic!("on_renewal");
    }
    fn on_lost(&self, _: &LostEvent<'_>) {
        panic!("on_lost");
    }
    fn on_release(&self, _: &ReleaseEvent<'_>) {
        panic!("on_release");
    }
}

#[test]
fn a_panicking_handler_costs_its_events_only() {
    let (locks, nodes, _clock) = client_with(
        3,
        Settings {
            events: Events(Some(Arc::new(Panicky))),
            ..crate::testing::fake::settings()
        },
    );
    let g = locks.try_lock("r", TTL).unwrap();
    // The renewal thread's call: a panic there would end every renewal.
    assert!(locks.engine.extend_many(&[g.state()], TTL, true)[0].is_ok());
    g.release().unwrap();
    let g = locks.try_lock("r", TTL).unwrap();
    (0..3).for_each(|i| nodes.del(i, "r"));
    assert!(locks.engine.extend_many(&[g.state()], TTL, true)[0].is_err());
    assert!(g.is_lost());
}

#[test]
fn a_lock_refused_at_its_write_back_is_neither_acquired_nor_released() {
    let rec = Arc::new(Recorder::default());
    let (locks, nodes, _) = client_with(
        3,
        Settings {
            fencing: true,
            events: Events(Some(rec.clone())),
            ..crate::testing::fake::settings()
        },
    );
    *nodes.before_round.lock() = Some(crate::testing::fake::Hook(Box::new(|n, op| {
        if matches!(op, crate::algorithm::round::Op::Fence { .. }) {
            n.del(0, "s");
            n.del(1, "s");
        }
    })));
    assert!(locks.try_lock("s", TTL).is_err());
    let seen = rec.take();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(seen[0].starts_with("attempt s Some("), "{seen:?}");
}

/// Writes down each call's end (`on_acquire`) and each renewal's margin.
#[derive(Default)]
struct Calls(Mutex<Vec<String>>);

impl EventHandler for Calls {
    fn on_attempt(&self, _: &AttemptEvent<'_>) {
        self.0.lock().push("attempt".to_owned());
    }
    fn on_acquire(&self, e: &AcquireEvent<'_>) {
        self.0.lock().push(format!(
            "acquire {} acquired={} attempts={} waited~{}ms error={:?}",
            e.resource(),
            e.acquired(),
            e.attempts(),
            // (Rounds on the fake nodes take a few virtual ms.)
            e.waited().as_millis() / 100 * 100,
            e.error().map(|e| e.to_string()),
        ));
    }
    fn on_renewal(&self, e: &RenewalEvent<'_>) {
        self.0.lock().push(format!("renewal left={:?}", e.left()));
    }
}

#[test]
fn a_call_reports_its_whole_wait_and_its_attempts_once_after_them() {
    let calls = Arc::new(Calls::default());
    let (locks, nodes, clock) = client_with(
        3,
        Settings {
            events: Events(Some(calls.clone())),
            retry_count: 3,
            retry_delay: Duration::from_millis(200),
            retry_jitter: Duration::ZERO,
            wake_ups: false,
            ..crate::testing::fake::settings()
        },
    );
    let other = client_over(&nodes, crate::testing::fake::settings());
    let held = other.try_lock("r", TTL).unwrap();
    // Three attempts, two pauses between them (the fake clock's sleeps).
    assert!(locks.lock("r", TTL).is_err());
    let taken = "Some(\"taken: another owner holds the lock on 3 of 3 nodes\")";
    assert_eq!(
        std::mem::take(&mut *calls.0.lock()),
        [
            "attempt".to_owned(),
            "attempt".to_owned(),
            "attempt".to_owned(),
            format!("acquire r acquired=false attempts=3 waited~400ms error={taken}"),
        ]
    );
    held.release().unwrap();
    let g = locks.try_lock("r", TTL).unwrap();
    clock.advance(Duration::from_secs(4));
    // What it had left when the extension began (the fake clock stands
    // still until its round).
    let left = g.validity();
    assert!(left < TTL - Duration::from_secs(4), "{left:?}");
    g.extend(TTL).unwrap();
    assert_eq!(
        std::mem::take(&mut *calls.0.lock()),
        [
            "attempt".to_owned(),
            "acquire r acquired=true attempts=1 waited~0ms error=None".to_owned(),
            format!("renewal left={left:?}"),
        ]
    );
    // Input rejected: no call to report.
    assert!(locks.try_lock("", TTL).is_err());
    assert!(calls.0.lock().is_empty());
}
