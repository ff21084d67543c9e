//! Leader election (issue 42), within one process: clients of their own stand for
//! candidates in different processes (no queue, connection or subscription shared).
//! The many-process runs, with kills and pauses, are in `election_processes`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use quorumlock::{
    Error, EventHandler, InvalidInput, LeadershipChange, LeadershipEvent, Redlock, MAX_ID_LEN,
};

use crate::common::{shared, unique_key, wait_until};
use crate::wakeups::client;

const TTL: Duration = Duration::from_secs(2);

#[derive(Default)]
struct Changes(Mutex<Vec<(LeadershipChange, String, u64)>>);

impl EventHandler for Changes {
    fn on_leadership(&self, e: &LeadershipEvent<'_>) {
        self.0
            .lock()
            .push((e.change(), e.id().to_owned(), e.term()));
    }
}

#[test]
fn a_resigning_leader_is_followed_by_a_woken_candidate_in_a_higher_term() {
    let cluster = shared();
    let name = unique_key("election-resign");
    // A retry pause of 5 s: a successor within 1 s was woken, not polling.
    let a = client(cluster.urls(), Duration::from_secs(5));
    let b = client(cluster.urls(), Duration::from_secs(5));
    let first = a.election(&name, TTL).id("a").campaign().expect("a leads");
    assert!(first.is_leader());
    assert!(first.term() > 0);
    let seen = a
        .election(&name, TTL)
        .leader()
        .expect("read")
        .expect("a leader");
    assert_eq!((seen.id(), seen.term()), ("a", first.term()));
    assert!(seen.nodes() >= 2);

    let (tx, rx) = crossbeam_channel::bounded(1);
    let b_name = name.clone();
    let waiter = std::thread::spawn(move || {
        let election = b.election(&b_name, TTL).id("b");
        let next = election.campaign().map(|l| (l.term(), Instant::now()));
        let _ = tx.send(());
        next
    });
    // b has tried once and waits.
    std::thread::sleep(Duration::from_millis(300));
    assert!(rx.try_recv().is_err(), "b must wait while a leads");
    let resigned = Instant::now();
    first.resign().expect("resigned");
    let (term, at) = waiter.join().expect("no panic").expect("b leads");
    let took = at.saturating_duration_since(resigned);
    assert!(
        took < Duration::from_secs(1),
        "b took {took:?}: polled, not woken"
    );
    assert!(
        term > seen.term(),
        "terms must rise: {term} after {}",
        seen.term()
    );
}

#[test]
fn only_one_of_several_candidates_leads_and_the_others_wait() {
    let cluster = shared();
    let name = unique_key("election-one");
    let clients: Vec<Redlock> = (0..3)
        .map(|_| client(cluster.urls(), Duration::from_millis(50)))
        .collect();
    let leading = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let overlaps = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let terms = Arc::new(Mutex::new(Vec::new()));
    let handles: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, locks)| {
            let (name, leading, overlaps, terms) = (
                name.clone(),
                leading.clone(),
                overlaps.clone(),
                terms.clone(),
            );
            std::thread::spawn(move || {
                let election = locks.election(&name, TTL).id(format!("c{i}"));
                for _ in 0..3 {
                    let l = election
                        .campaign_for(Duration::from_secs(20))
                        .expect("elected");
                    if leading.fetch_add(1, std::sync::atomic::Ordering::SeqCst) != 0 {
                        overlaps.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    terms.lock().push(l.term());
                    std::thread::sleep(Duration::from_millis(30));
                    leading.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    l.resign().expect("resigned");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("no panic");
    }
    assert_eq!(overlaps.load(std::sync::atomic::Ordering::SeqCst), 0);
    let terms = terms.lock().clone();
    assert_eq!(terms.len(), 9);
    let mut sorted = terms.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), 9, "every term is new: {terms:?}");
    // In the order the terms were recorded (one leader at a time): rising.
    assert!(
        terms.windows(2).all(|w| w[0] < w[1]),
        "terms must rise: {terms:?}"
    );
}

#[test]
fn leadership_events_say_elected_lost_and_resigned_with_the_term() {
    let cluster = shared();
    let name = unique_key("election-events");
    let changes = Arc::new(Changes::default());
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(cluster.urls())
        .events(changes.clone())
        .build()
        .expect("valid config");
    let election = locks.election(&name, TTL).id("ev");
    let l = election.campaign().expect("leads");
    let term = l.term();
    l.resign().expect("resigned");
    let l = election.campaign().expect("leads again");
    let second = l.term();
    // Lost: the key deleted under it.
    for i in 0..3 {
        cluster.del(i, &name);
    }
    assert!(wait_until(Duration::from_secs(5), || !l.is_leader()));
    assert!(l.wait_end(Duration::from_secs(5)));
    drop(l);
    let got = changes.0.lock().clone();
    let want = vec![
        (LeadershipChange::Elected, "ev".to_owned(), term),
        (LeadershipChange::Resigned, "ev".to_owned(), term),
        (LeadershipChange::Elected, "ev".to_owned(), second),
        (LeadershipChange::Lost, "ev".to_owned(), second),
    ];
    assert_eq!(got, want);
}

#[test]
fn a_stopped_election_stops_its_campaign_its_loop_and_its_observer() {
    let cluster = shared();
    let name = unique_key("election-stop");
    let a = client(cluster.urls(), Duration::from_millis(100));
    let b = client(cluster.urls(), Duration::from_millis(100));
    let held = a.election(&name, TTL).id("a").campaign().expect("a leads");
    let election = b.election(&name, TTL).id("b");
    let (stopper, observer) = (election.clone(), election.clone());
    let campaign = std::thread::spawn(move || election.campaign().map(|l| l.term()));
    let watch = std::thread::spawn(move || observer.observe().count());
    std::thread::sleep(Duration::from_millis(300));
    let stopped = Instant::now();
    stopper.stop();
    let r = campaign.join().expect("no panic");
    assert!(matches!(r, Err(Error::Stopped)), "{r:?}");
    assert!(
        watch.join().expect("no panic") >= 1,
        "it saw a's leadership first"
    );
    assert!(
        stopped.elapsed() < Duration::from_secs(3),
        "{:?}",
        stopped.elapsed()
    );
    // The loop returns at once, stopped.
    assert!(stopper.run(|_| panic!("never elected")).is_ok());
    drop(held);
}

#[test]
fn the_loop_leads_again_after_its_work_returns_and_stops_when_told() {
    let cluster = shared();
    let name = unique_key("election-loop");
    let locks = client(cluster.urls(), Duration::from_millis(20));
    let election = locks.election(&name, TTL).id("loop");
    let mut terms = Vec::new();
    let stopper = election.clone();
    election
        .run(|l| {
            terms.push(l.term());
            if terms.len() == 3 {
                stopper.stop();
                assert!(!l.is_leader(), "a stopped election's leader stops");
                assert!(l.wait_end(Duration::from_secs(5)));
            }
        })
        .expect("ran");
    assert_eq!(terms.len(), 3);
    assert!(terms.windows(2).all(|w| w[0] < w[1]), "{terms:?}");
    assert!(crate::common::wait_until(Duration::from_secs(2), || {
        locks.election(&name, TTL).leader().ok() == Some(None)
    }));
}

#[test]
fn a_bad_candidate_id_is_refused_by_name() {
    let cluster = shared();
    let locks = client(cluster.urls(), Duration::from_millis(20));
    let name = unique_key("election-id");
    for id in [String::new(), "x".repeat(MAX_ID_LEN + 1)] {
        let len = id.len();
        let r = locks
            .election(&name, TTL)
            .id(id)
            .campaign_for(Duration::ZERO);
        assert!(
            matches!(&r, Err(Error::InvalidInput(InvalidInput::BadCandidateId { len: l })) if *l == len),
            "{r:?}"
        );
    }
    // The longest id, of several-byte characters, and one with dots and `@`.
    for id in [
        "é".repeat(MAX_ID_LEN / 2),
        "host.example.com:80@x".to_owned(),
    ] {
        let l = locks
            .election(&name, TTL)
            .id(id.clone())
            .campaign()
            .expect("leads");
        let seen = locks
            .election(&name, TTL)
            .leader()
            .expect("read")
            .expect("leader");
        assert_eq!(seen.id(), id);
        l.resign().expect("resigned");
    }
}

/// Counts a client's attempts (also the review tests').
#[derive(Default)]
pub(crate) struct Attempts(pub(crate) std::sync::atomic::AtomicUsize);

impl EventHandler for Attempts {
    fn on_attempt(&self, _: &quorumlock::AttemptEvent<'_>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn a_waiting_candidate_tries_about_once_a_second_not_once_per_retry_pause() {
    let cluster = shared();
    let name = unique_key("election-patient");
    let leader = client(cluster.urls(), Duration::from_millis(20));
    let held = leader
        .election(&name, TTL)
        .id("leader")
        .campaign()
        .expect("leads");
    let attempts = Arc::new(Attempts::default());
    let waiting = Redlock::builder()
        .fresh_cluster(true)
        .nodes(cluster.urls())
        .retry_delay(Duration::from_millis(20))
        .retry_jitter(Duration::ZERO)
        .events(attempts.clone())
        .build()
        .expect("valid config");
    let r = waiting
        .election(&name, TTL)
        .id("waiting")
        .campaign_for(Duration::from_secs(3));
    assert!(matches!(r, Err(Error::Taken { .. })), "{r:?}");
    // A lock call would have tried every 20 ms: 150 times. A candidate tries
    // at each 1 s slice's start, by the clock once a second, and at the
    // lease's expiry as read (2 s, renewed every 0.67 s): about 6.
    let n = attempts.0.load(std::sync::atomic::Ordering::SeqCst);
    assert!((2..=12).contains(&n), "{n} attempts in 3 s");
    drop(held);
}

#[test]
fn an_observer_sees_each_leader_in_turn_with_rising_terms() {
    let cluster = shared();
    let name = unique_key("election-observe");
    let (a, b, c) = (
        client(cluster.urls(), Duration::from_millis(20)),
        client(cluster.urls(), Duration::from_millis(20)),
        client(cluster.urls(), Duration::from_millis(20)),
    );
    let watching = c.election(&name, TTL);
    let mut seen = watching.observe();
    let first = seen
        .next_within(Duration::from_secs(5))
        .expect("a first reading");
    assert_eq!(first.expect("answered"), None, "no one leads yet");
    let la = a.election(&name, TTL).id("a").campaign().expect("a leads");
    let next = seen.next_within(Duration::from_secs(5)).expect("a change");
    let got = next.expect("answered").expect("a leader");
    assert_eq!((got.id(), got.term()), ("a", la.term()));
    // Nothing changes while a leads (renewals keep its term).
    assert!(seen.next_within(Duration::from_millis(1500)).is_none());
    let eb = b.election(&name, TTL).id("b");
    let waiting = std::thread::spawn(move || eb.campaign().map(|l| (l.term(), l)));
    std::thread::sleep(Duration::from_millis(200));
    let term_a = la.term();
    la.resign().expect("resigned");
    let (term_b, lb) = waiting.join().expect("no panic").expect("b leads");
    let mut last = None;
    while let Some(change) = seen.next_within(Duration::from_secs(5)) {
        last = change.expect("answered");
        if last.is_some() {
            break;
        }
    }
    let got = last.expect("b seen");
    assert_eq!((got.id(), got.term()), ("b", term_b));
    assert!(term_b > term_a, "{term_b} after {term_a}");
    drop(lb);
}

#[test]
fn extreme_inputs_get_typed_errors_not_panics_or_hangs() {
    let cluster = shared();
    let locks = client(cluster.urls(), Duration::from_millis(20));
    let huge = "n".repeat(quorumlock::MAX_RESOURCE_LEN + 1);
    let r = locks.election(&huge, TTL).campaign();
    assert!(
        matches!(
            r,
            Err(Error::InvalidInput(InvalidInput::ResourceTooLong { .. }))
        ),
        "{r:?}"
    );
    let r = locks.election(&huge, TTL).leader();
    assert!(
        matches!(
            r,
            Err(Error::InvalidInput(InvalidInput::ResourceTooLong { .. }))
        ),
        "{r:?}"
    );
    let name = unique_key("election-extreme");
    let r = locks.election(&name, Duration::MAX).campaign();
    assert!(
        matches!(r, Err(Error::InvalidInput(InvalidInput::TtlTooLong(_)))),
        "{r:?}"
    );
    let r = locks.election(&name, Duration::ZERO).campaign();
    assert!(
        matches!(r, Err(Error::InvalidInput(InvalidInput::ZeroTtl))),
        "{r:?}"
    );
    // The longest waits saturate: elected at once, and resigned.
    let l = locks
        .election(&name, TTL)
        .campaign_for(Duration::MAX)
        .expect("leads");
    assert_eq!(l.wait_end(Duration::ZERO), !l.is_leader());
    l.resign().expect("resigned");
    // An observer of a TTL too long reads as any (at most once a second).
    let mut seen = locks.election(&name, Duration::MAX).observe();
    assert!(seen.next_within(Duration::from_secs(5)).is_some());
}
