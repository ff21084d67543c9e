//! Fencing tokens (issue 9) against real Redis nodes: the scripts' counters,
//! the write-back, hand-overs, and the fault suite's scenarios.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use quorumlock::Redlock;

use crate::common::{shared, unique_key};

const TTL: Duration = Duration::from_secs(5);
const SLACK: Duration = Duration::from_millis(250);

/// A fenced client over `urls` (fresh cluster, generous node timeout).
pub(crate) fn fenced(urls: &[String]) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls.iter().cloned())
        .node_timeout(SLACK)
        .fencing(true)
        .build()
        .expect("valid config")
}

#[test]
fn tokens_grow_across_clients_and_are_written_back() {
    let c = shared();
    let key = unique_key("fence-grow");
    let (a, b) = (fenced(&c.urls()), fenced(&c.urls()));
    let mut last = 0;
    for i in 0..30 {
        let locks = if i % 2 == 0 { &a } else { &b };
        let g = locks.lock(&key, TTL).expect("free key");
        let t = g.fencing_token().expect("fencing on");
        assert!(t > last, "token {t} after {last}");
        // Below 2^53, from the nodes' µs clocks.
        assert!(t > 1_600_000_000_000_000 && t < 1 << 53, "{t}");
        let written = (0..c.len())
            .filter(|&n| c.fence(n, &key) == Some(t))
            .count();
        assert!(written >= 2, "token on {written} nodes' counters");
        g.extend(TTL).expect("extend");
        assert_eq!(g.fencing_token(), Some(t), "renewal keeps the token");
        last = t;
        g.release().expect("release");
    }
    let plain = crate::client_with(c.urls(), SLACK);
    let g = plain.lock(&key, TTL).unwrap();
    assert_eq!(g.fencing_token(), None);
    assert!(
        c.fence(0, &key).is_some_and(|f| f <= last),
        "an unfenced lock leaves counters alone"
    );
}

#[test]
fn a_hand_over_between_threads_gives_the_next_token() {
    let c = shared();
    let key = unique_key("fence-handover");
    let locks = fenced(&c.urls());
    let first = locks.lock(&key, TTL).unwrap();
    let t = first.fencing_token().unwrap();
    let ready = Arc::new(Barrier::new(2));
    let waiter = {
        let (locks, key, ready) = (locks.clone(), key.clone(), ready.clone());
        std::thread::spawn(move || {
            ready.wait();
            let g = locks
                .lock_timeout(&key, TTL, Duration::from_secs(5))
                .expect("handed over");
            let t = g.fencing_token();
            g.release().expect("release");
            t
        })
    };
    ready.wait();
    std::thread::sleep(Duration::from_millis(100)); // the waiter queues
    first.release().expect("hand over");
    let next = waiter.join().expect("waiter");
    assert_eq!(next, Some(t + 1));
    let g = fenced(&c.urls()).lock(&key, TTL).unwrap();
    assert!(g.fencing_token().unwrap() > t + 1);
}
