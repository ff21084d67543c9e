//! `quorumlock lead NAME -- CMD`: runs the command while this host leads the
//! election NAME (the library's [`Election::run`]: campaign, lead, resign,
//! a jittered pause, campaign again), under the supervisor `run` uses, with
//! the leadership as its lease.

use std::io::{self, Write};
use std::sync::Arc;
use std::time::Duration;

use quorumlock::{Election, EventHandler, Leadership, NodeChange, NodeEvent};

use super::supervisor::{Launch, Outcome};
use super::{
    client, exit_code, seconds, signal_exit, LeadArgs, Signals, CONNECT_WAIT, EX_CONFIG, EX_OSERR,
    EX_SOFTWARE,
};

/// How often a campaign (or the pause after a term) looks for a signal
/// that ends it.
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

pub(crate) fn lead(args: LeadArgs) -> u8 {
    // Before anything else, so that a signal while campaigning is handled
    // (the campaign stops) rather than fatal.
    let signals = match Signals::install() {
        Ok(s) => s,
        Err(e) => {
            say!("cannot install signal handlers: {e}");
            return EX_OSERR;
        }
    };
    let locks = match client(&args.nodes, |b| b.events(Arc::new(NodeLog))) {
        Ok(l) => l,
        Err(code) => return code,
    };
    // As `run` does: a round does not wait for a node still connecting.
    if let Err(e) = locks.wait_connected(CONNECT_WAIT) {
        say!("{e}");
        return exit_code(&e);
    }
    let mut election = locks.election(args.name.as_str(), args.lease.ttl);
    if let Some(id) = &args.id {
        election = election.id(id.as_str());
    }
    // What no campaign can get past (credentials or scripts the nodes
    // refuse) ends `lead` at once, as `run`; anything else it campaigns
    // through. One read of who leads, from a majority, tells.
    if let Err(e) = election.leader() {
        if exit_code(&e) == EX_CONFIG {
            say!("cannot campaign for {}: {e}", args.name);
            return EX_CONFIG;
        }
    }
    let launch = Launch {
        command: &args.command.argv,
        grace: args.lease.grace,
        ttl: args.lease.ttl,
        foreground: false,
    };
    let mut exit = None;
    let ran = std::thread::scope(|s| {
        // A campaign, or the pause after a term, blocks this thread: another
        // stops the election once a terminating signal comes.
        let stopper = std::thread::Builder::new()
            .name("quorumlock-signals".into())
            .spawn_scoped(s, || {
                while !election.is_stopped() {
                    if signals.received().is_some() {
                        election.stop();
                    }
                    std::thread::sleep(SIGNAL_CHECK);
                }
            });
        if let Err(e) = stopper {
            say!("cannot start a thread: {e}");
            return Ok(Some(EX_OSERR));
        }
        let ran = election.run(|leadership| {
            if let Some(code) = term(&election, leadership, &launch, &signals) {
                exit = Some(code);
                election.stop();
            }
        });
        election.stop();
        ran.map(|()| None)
    });
    match ran {
        Ok(code) => code
            .or(exit)
            .or_else(|| signals.received().map(signal_exit))
            // Not reached: the election stops only with a code or a signal.
            .unwrap_or(EX_SOFTWARE),
        Err(e) => {
            say!("cannot campaign for {}: {e}", args.name);
            exit_code(&e)
        }
    }
}

/// One term: runs the command under `leadership`. `lead`'s exit code once
/// it is to end (the command exited by itself or could not run, or a
/// terminating signal came), `None` to campaign again.
fn term(
    election: &Election,
    leadership: &Leadership,
    launch: &Launch,
    signals: &Signals,
) -> Option<u8> {
    // Stops and continues received while no command ran are no one's; a
    // terminating signal is recorded, and the command is not started.
    let _ = signals.take();
    if let Some(sig) = signals.received() {
        return Some(signal_exit(sig));
    }
    let (name, id, term) = (leadership.name(), election.candidate(), leadership.term());
    say!(
        "leading {} as {} in term {term}",
        name.escape_debug(),
        id.escape_debug()
    );
    let env = [
        ("QUORUMLOCK_NAME", name.to_owned()),
        ("QUORUMLOCK_ID", id.to_owned()),
        ("QUORUMLOCK_TERM", term.to_string()),
        ("QUORUMLOCK_TTL_MS", launch.ttl.as_millis().to_string()),
    ];
    match launch.supervise(leadership, &env, signals) {
        // Resigned by `Election::run` as the leadership drops.
        Outcome::Exited(code) => Some(code),
        Outcome::Lost => signals.received().map(signal_exit),
    }
}

/// Says on stderr when a node stops or starts counting: `lead` campaigns on
/// through node failures, and would otherwise wait in silence on nodes that
/// do not answer (a wrong address, a majority down).
struct NodeLog;

impl EventHandler for NodeLog {
    fn on_node(&self, event: &NodeEvent<'_>) {
        let node = event.node();
        match event.change() {
            NodeChange::Skipped { refused: true } => {
                say!("node {node} refused a connection; rounds go on without it")
            }
            NodeChange::Skipped { refused: false } => {
                say!("node {node} did not answer in time; rounds go on without it")
            }
            NodeChange::Rejoined => say!("node {node} answers again"),
            NodeChange::HeldBack { votes_in } => say!(
                "node {node} is new or restarted empty: its votes count in {} (delayed restarts)",
                seconds(votes_in)
            ),
            NodeChange::HoldOver => say!("node {node}: its votes count again"),
            _ => {}
        }
    }
}
