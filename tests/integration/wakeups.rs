//! Waiting across clients (issue 22): a release wakes the waiters of other clients by
//! pub/sub, a hint to try at once, never a grant. Two clients of one process stand for two
//! processes here: they share no queue, connection or subscription. Each waiter's retry
//! pause is made long, so that a wake-up is told apart from polling by a wide margin (a
//! subscribed waiter's fallback is then its cap, 1 s, or the owner's expiry where sooner).

use std::sync::Arc;
use std::time::{Duration, Instant};

use quorumlock::{AttemptEvent, EventHandler, Redlock};

use crate::common::{shared, unique_key, wait_until, Cluster};

const TTL: Duration = Duration::from_secs(10);

/// A client whose retry pause is `pause` (no jitter); also the election
/// tests' candidate client.
pub(crate) fn client(urls: Vec<String>, pause: Duration) -> Redlock {
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .node_timeout(Duration::from_millis(250))
        .retry_delay(pause)
        .retry_jitter(Duration::ZERO)
        .build()
        .expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    locks
}

/// Counts the attempts a client makes; keeps what the one that acquired says of its wait.
#[derive(Default)]
struct Attempts(
    std::sync::atomic::AtomicUsize,
    parking_lot::Mutex<Option<(bool, Duration)>>,
    parking_lot::Mutex<Vec<String>>,
);

impl EventHandler for Attempts {
    fn on_attempt(&self, e: &AttemptEvent<'_>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.2.lock().push(format!(
            "woken {} waited {:?} took {:?} {:?}",
            e.woken(),
            e.waited(),
            e.elapsed(),
            e.error().map(|e| e.to_string())
        ));
        if e.acquired() {
            *self.1.lock() = Some((e.woken(), e.waited()));
        }
    }
}

impl Attempts {
    fn get(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The attempts a release woke (not a fallback's).
    fn woken(&self) -> usize {
        self.2
            .lock()
            .iter()
            .filter(|l| l.starts_with("woken true"))
            .count()
    }

    /// Whether the attempt that acquired was woken, and how long its call had waited.
    fn acquired(&self) -> Option<(bool, Duration)> {
        *self.1.lock()
    }
}

/// [`client`], its attempts counted.
fn counted(urls: Vec<String>, pause: Duration) -> (Redlock, Arc<Attempts>) {
    let attempts = Arc::new(Attempts::default());
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .node_timeout(Duration::from_millis(250))
        .retry_delay(pause)
        .retry_jitter(Duration::ZERO)
        .events(attempts.clone())
        .build()
        .expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    (locks, attempts)
}

/// Starts a thread that waits for `key` on `locks` (up to 20 s) and returns when it got
/// it, and the guard's token.
fn waiter(locks: Arc<Redlock>, key: &str) -> std::thread::JoinHandle<(Instant, String)> {
    let key = key.to_owned();
    std::thread::spawn(move || {
        let g = locks
            .request(&key, TTL)
            .acquire_for(Duration::from_secs(20))
            .expect("the waiter gets the lock");
        let got = (Instant::now(), g.token().to_owned());
        g.release().expect("release");
        got
    })
}

/// Releases `g`, then waits for the waiter `w`: how long after the release it got the lock.
fn release_then_join(
    g: quorumlock::LockGuard,
    w: std::thread::JoinHandle<(Instant, String)>,
) -> Duration {
    let released = Instant::now();
    g.release().expect("release");
    let (got, _) = w.join().expect("waiter");
    got.saturating_duration_since(released)
}

/// [`waiter`] for a lock of several resources: starts a thread that waits for `set` on
/// `locks` (up to 20 s), lets it subscribe, and returns it.
fn set_waiter(locks: Arc<Redlock>, set: [String; 2]) -> std::thread::JoinHandle<(Instant, String)> {
    let w = std::thread::spawn(move || {
        let g = crate::common::request_all(&locks, &set, TTL)
            .acquire_for(Duration::from_secs(20))
            .expect("the set's waiter gets it");
        let got = (Instant::now(), g.token().to_owned());
        g.release().expect("release");
        got
    });
    let_it_subscribe();
    w
}

/// Until every node has `n` subscribers to `key`'s release channel (at most 10 s): a
/// waiter that failed its first attempt is listening (a fixed sleep was too short on a
/// loaded machine: the release went unheard and the waiter got in at its fallback).
fn await_subscribers(c: &Cluster, key: &str, n: i64) {
    let channel = format!("quorumlock:free:{key}");
    let all = wait_until(Duration::from_secs(10), || {
        (0..c.len()).all(|i| {
            let counts: Vec<(String, i64)> = redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg(&channel)
                .query(&mut c.conn(i))
                .unwrap_or_default();
            counts.first().is_some_and(|(_, k)| *k >= n)
        })
    });
    assert!(all, "{n} subscriber(s) to {channel} on every node");
}

/// The waiter's first attempt failed and it subscribed: its retry pause is long, so this
/// only waits for the subscriptions to be made.
fn let_it_subscribe() {
    std::thread::sleep(Duration::from_millis(500));
}

#[test]
fn a_release_wakes_a_waiter_of_another_client_at_once() {
    let c = shared();
    let holder = client(c.urls(), Duration::from_millis(100));
    let key = unique_key("woken");
    let g = holder.lock(&key, TTL).expect("lock");
    let (waiting, attempts) = counted(c.urls(), Duration::from_secs(5));
    let w = waiter(Arc::new(waiting), &key);
    let_it_subscribe();
    let after = release_then_join(g, w);
    // Its fallback would come 1 s after it began (the cap; its pause is 5 s).
    assert!(
        after < Duration::from_secs(1),
        "the waiter got the lock {after:?} after the release"
    );
    // Its events say so.
    let (woken, waited) = attempts.acquired().expect("an acquiring attempt");
    assert!(woken, "the acquiring attempt was woken");
    assert!(waited >= Duration::from_millis(400), "waited {waited:?}");
}

/// A message on the channel that no release sent changes nothing but a retry or two,
/// however many nodes it comes from: one for its first copy, and one more where its
/// copies make a majority only after that retry began (a real release frees the key on a
/// majority only then: the retry met it still held). A release's copies from every node
/// used to wake a loser again and again, using up `lock()`'s attempts. The copies come
/// one node at a time here, the second after the first retry, so that the count is
/// exact on a loaded machine too (all three at once gave one retry or two, depending on
/// whether the retry began before the second copy came). The lock is still held, the
/// waiter keeps waiting, and the real release wakes it.
#[test]
fn a_forged_notice_costs_two_retries_at_most_and_nothing_else() {
    let c = shared();
    let holder = client(c.urls(), Duration::from_millis(100));
    let key = unique_key("forged");
    let g = holder.lock(&key, TTL).expect("lock");
    let (waiting, attempts) = counted(c.urls(), Duration::from_secs(5));
    let w = waiter(Arc::new(waiting), &key);
    let_it_subscribe();
    let before = attempts.woken();
    forge(&c, &key, 0);
    assert!(
        wait_until(Duration::from_secs(2), || attempts.woken() > before),
        "node 0's copy woke no retry"
    );
    forge(&c, &key, 1);
    forge(&c, &key, 2);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        attempts.woken(),
        before + 2,
        "one forged notice from 3 nodes, its majority after the first retry: two woken \
         retries; attempts: {:#?}",
        attempts.2.lock()
    );
    assert!(g.is_held(), "the holder still holds it");
    assert!(!w.is_finished(), "a forged message granted the lock");
    assert_eq!(c.holders(&key, g.token()), 3, "the holder's keys stay");
    assert!(release_then_join(g, w) < Duration::from_secs(1));
}

/// Publishes a forged release message for `key` on node `i`, with the same notice each
/// time (the copies of one release).
fn forge(c: &Cluster, key: &str, i: usize) {
    forge_notice(c, key, i, "forged-notice");
}

/// Publishes a forged release message for `key` on node `i` with `notice`.
fn forge_notice(c: &Cluster, key: &str, i: usize, notice: &str) {
    let _: i64 = redis::cmd("PUBLISH")
        .arg(format!("quorumlock:free:{key}"))
        .arg(notice)
        .query(&mut c.conn(i))
        .expect("PUBLISH");
}

/// A forged notice costs a waiter one step toward deafness (three woken tries in a row
/// that meet the same owners, after which it stops listening until its next try by the
/// clock), whether its copies come from one node or from every node, their majority
/// after its first retry: that retry read the owners before the copies made a majority,
/// too early to say anything of the message. So two such notices leave it listening,
/// and a third notice still wakes it. (Counted twice, the second notice's first retry
/// made it deaf; a real release whose majority came after the woken try, as it does on
/// a loaded machine, then went unheard for a second.)
#[test]
fn a_forged_notice_from_every_node_costs_one_step_toward_deafness() {
    let c = shared();
    let holder = client(c.urls(), Duration::from_millis(100));
    let key = unique_key("forged-deaf");
    let g = holder.lock(&key, TTL).expect("lock");
    let (waiting, attempts) = counted(c.urls(), Duration::from_secs(5));
    let w = waiter(Arc::new(waiting), &key);
    let_it_subscribe();
    let before = attempts.woken();
    let woken = |n: usize| wait_until(Duration::from_secs(2), || attempts.woken() >= before + n);
    for (i, notice) in ["forged-1", "forged-2"].into_iter().enumerate() {
        forge_notice(&c, &key, 0, notice);
        assert!(woken(2 * i + 1), "{notice} from node 0 woke no retry");
        forge_notice(&c, &key, 1, notice);
        forge_notice(&c, &key, 2, notice);
        assert!(
            woken(2 * i + 2),
            "{notice}'s majority after the retry woke no retry; attempts: {:#?}",
            attempts.2.lock()
        );
    }
    forge_notice(&c, &key, 0, "forged-3");
    assert!(
        woken(5),
        "a third forged notice woke no retry (deaf after two); attempts: {:#?}",
        attempts.2.lock()
    );
    assert!(
        g.is_held() && !w.is_finished(),
        "a forged message granted the lock"
    );
    // Deaf now: the release is heard at its fallback, a second at most.
    assert!(release_then_join(g, w) < Duration::from_secs(2));
}

/// A waiter whose attempt fails after its SET landed on a node the holder lacks undoes it
/// there: that delete wakes nobody (it freed nothing). It woke the waiter itself, which
/// then tried again at once, round after round, for as long as the holder held.
#[test]
fn a_failed_attempts_undo_wakes_nobody() {
    let c = shared();
    let holder = client(c.urls(), Duration::from_millis(100));
    let key = unique_key("undo-quiet");
    let g = holder.lock(&key, TTL).expect("lock");
    assert!(wait_until(Duration::from_secs(2), || c
        .holders(&key, g.token())
        == 3));
    c.del(2, &key);
    let (waiting, attempts) = counted(c.urls(), Duration::from_millis(300));
    let r = waiting
        .request(&key, TTL)
        .acquire_for(Duration::from_millis(1500));
    assert!(r.is_err(), "the holder holds it on 2 of 3 nodes");
    // 1.5 s of 300 ms pauses, and the retry after subscribing: about 7.
    let n = attempts.get();
    assert!(n <= 12, "{n} attempts in 1.5 s with a 300 ms retry pause");
    assert!(
        c.get(2, &key).is_none(),
        "the waiter's SET on node 2 was undone"
    );
    drop(g);
}

/// A waiter whose subscriber connections are killed (`CLIENT KILL TYPE pubsub`) just
/// before the release misses its message: it still gets the lock, by its fallback (its
/// retry pause, 400 ms here) or by the subscription made again, which wakes it to try.
#[test]
fn a_waiter_whose_subscription_was_killed_still_gets_the_lock() {
    let c = Cluster::start(3);
    let holder = client(c.urls(), Duration::from_millis(100));
    let key = unique_key("killed-sub");
    let g = holder.lock(&key, TTL).expect("lock");
    let waiting = Arc::new(client(c.urls(), Duration::from_millis(400)));
    let w = waiter(waiting.clone(), &key);
    let_it_subscribe();
    for i in 0..3 {
        let killed: i64 = redis::cmd("CLIENT")
            .arg(&["KILL", "TYPE", "pubsub"])
            .query(&mut c.conn(i))
            .expect("CLIENT KILL");
        assert!(killed >= 1, "node {i}: no subscriber to kill");
    }
    let after = release_then_join(g, w);
    assert!(
        after < Duration::from_secs(3),
        "got it {after:?} after the release"
    );
    // And it subscribed again (the client still lives): the next wait is woken.
    assert!(
        wait_until(Duration::from_secs(2), || (0..3)
            .all(|i| c.subscribers(i, &key) >= 1)),
        "not subscribed again"
    );
    drop(waiting);
}

/// Sets `key` on every node of `c` for `ttl` with a token no client holds: a holder that
/// stopped (a killed process), whose key nobody releases.
fn dead_holder(c: &Cluster, key: &str, ttl: Duration) {
    for i in 0..3 {
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg("a-dead-holder")
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .query(&mut c.conn(i))
            .expect("SET");
    }
}

/// A holder that stops without a release sends no message: its waiter's fallback is the
/// moment its keys expire, as the failed attempt read them, not the retry pause (5 s) nor
/// the fallback's cap (1 s).
#[test]
fn a_waiter_follows_a_dead_holder_at_its_expiry() {
    let c = shared();
    let key = unique_key("dead-holder");
    let (waiting, attempts) = counted(c.urls(), Duration::from_secs(5));
    dead_holder(&c, &key, Duration::from_millis(300));
    let start = Instant::now();
    let g = waiting
        .request(&key, TTL)
        .acquire_for(Duration::from_secs(20))
        .expect("the waiter gets the lock");
    let took = start.elapsed();
    // Below the fallback's cap (1 s), so that only the expiry explains it.
    assert!(
        took < Duration::from_millis(800),
        "got it {took:?} after it began, the dead holder's keys lasting 300 ms; attempts: {:#?}",
        attempts.2.lock()
    );
    assert_eq!(attempts.acquired().map(|(woken, _)| woken), Some(false));
    drop(g);
}

/// A lock of several resources waits for a release of any of them: another client's
/// release of one key of the set wakes it at once, not after its retry pause (5 s) or the
/// fallback's cap (1 s). Its waiters polled at the retry pause.
#[test]
fn a_set_waiter_is_woken_by_the_release_of_one_of_its_keys() {
    let c = shared();
    let holder = client(c.urls(), Duration::from_millis(100));
    let (a, b) = (unique_key("set-woken-a"), unique_key("set-woken-b"));
    // Its first key (a wait on the last alone is not enough).
    let g = holder.lock(&a, TTL).expect("lock");
    let (waiting, attempts) = counted(c.urls(), Duration::from_secs(5));
    let w = set_waiter(Arc::new(waiting), [a, b]);
    let after = release_then_join(g, w);
    assert!(
        after < Duration::from_millis(500),
        "the set's waiter got it {after:?} after the release; attempts: {:#?}",
        attempts.2.lock()
    );
    assert_eq!(attempts.acquired().map(|(woken, _)| woken), Some(true));
}

/// A lock of several is woken by a release of any of its keys, a hint: those tries do not
/// use up `request().and().acquire`'s attempts, which stay a retry pause apart. Behind a long holder of
/// one key and a stream of releases of the other, 3 attempts 2 s apart gave up after a
/// few of those releases (about 150 ms).
#[test]
fn lock_all_is_not_used_up_by_releases_of_one_of_its_keys() {
    let c = shared();
    let (a, b) = (unique_key("set-count-a"), unique_key("set-count-b"));
    let holder = client(c.urls(), Duration::from_millis(100));
    let g = holder.lock(&a, TTL).expect("lock");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = std::thread::spawn({
        let (stop, b, urls) = (stop.clone(), b.clone(), c.urls());
        move || {
            let other = client(urls, Duration::from_millis(10));
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Ok(g) = other.lock(&b, TTL) {
                    g.release().expect("release");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    });
    let waiting = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(250))
        .retry_delay(Duration::from_secs(2))
        .retry_jitter(Duration::ZERO)
        .retry_count(3)
        .build()
        .expect("valid config");
    let start = Instant::now();
    let r = waiting.request(a.as_str(), TTL).and(b.as_str()).acquire();
    let took = start.elapsed();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    churn.join().expect("churn");
    assert!(r.is_err(), "a is held throughout");
    assert!(
        took >= Duration::from_millis(3500),
        "request().and().acquire with 3 attempts 2 s apart gave up after {took:?}"
    );
    drop(g);
}

/// A lock of several has no place in its client's local queue, so that client's own
/// release of one of its keys wakes it (a lone lock's waiters here are served by the
/// queue instead). It waited for its fallback.
#[test]
fn a_set_waiter_is_woken_by_its_own_clients_release() {
    let c = shared();
    let (a, b) = (unique_key("set-own-a"), unique_key("set-own-b"));
    let (locks, attempts) = counted(c.urls(), Duration::from_secs(5));
    let locks = Arc::new(locks);
    let g = locks.lock(&b, TTL).expect("lock");
    let w = set_waiter(locks.clone(), [a, b]);
    let after = release_then_join(g, w);
    assert!(
        after < Duration::from_millis(300),
        "the set's waiter got it {after:?} after its own client's release; attempts: {:#?}",
        attempts.2.lock()
    );
    assert_eq!(attempts.acquired().map(|(woken, _)| woken), Some(true));
}

/// A dead holder whose keys are on a bare majority (a node was down when it locked, or
/// restarted empty since): the waiter's SET lands on the free node and is undone, and it
/// still follows the owners' expiry (the shorter of it and the pause never waits longer).
/// It waited for the fallback's cap, 1 s.
#[test]
fn a_waiter_follows_a_dead_holder_on_a_bare_majority_at_its_expiry() {
    let c = shared();
    let key = unique_key("dead-majority");
    let (waiting, attempts) = counted(c.urls(), Duration::from_secs(5));
    for i in 0..2 {
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg("a-dead-holder")
            .arg("PX")
            .arg(300)
            .query(&mut c.conn(i))
            .expect("SET");
    }
    let start = Instant::now();
    let g = waiting
        .request(&key, TTL)
        .acquire_for(Duration::from_secs(20))
        .expect("the waiter gets the lock");
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(800),
        "got it {took:?} after it began, the dead holder's keys lasting 300 ms on 2 of 3 \
         nodes; attempts: {:#?}",
        attempts.2.lock()
    );
    drop(g);
}

/// `lock()` makes `retry_count` attempts a retry pause apart: a subscribed waiter's
/// shorter fallbacks (the 1 s cap, the owner's expiry) are extra tries, not counted
/// among them. With 3 attempts 5 s apart it gave up after 2 s, before a release at 3 s.
#[test]
fn lock_keeps_its_attempts_a_retry_pause_apart() {
    let c = shared();
    let key = unique_key("counted-attempts");
    let holder = client(c.urls(), Duration::from_millis(100));
    let g = holder.lock(&key, TTL).expect("lock");
    let waiting = Arc::new(
        Redlock::builder()
            .fresh_cluster(true)
            .nodes(c.urls())
            .node_timeout(Duration::from_millis(250))
            .retry_delay(Duration::from_secs(5))
            .retry_jitter(Duration::ZERO)
            .retry_count(3)
            .build()
            .expect("valid config"),
    );
    let w = std::thread::spawn({
        let (waiting, key) = (waiting.clone(), key.clone());
        move || waiting.lock(&key, TTL).map(|g| g.release())
    });
    std::thread::sleep(Duration::from_secs(3));
    g.release().expect("release");
    let r = w.join().expect("waiter");
    assert!(
        matches!(r, Ok(Ok(()))),
        "lock() with 3 attempts 5 s apart gave up before a release at 3 s: {r:?}"
    );
}

/// A forged message, behind a renewed holder whose expiry the waiter has stopped
/// trusting, costs its woken retries alone (see
/// `a_forged_notice_costs_two_retries_at_most_and_nothing_else`: two, its majority coming after
/// the first): a woken try does not make it trust the expiry again (it tried at the
/// expiry it read next, a third retry here).
#[test]
fn a_forged_notice_behind_a_renewed_holder_costs_only_its_woken_retries() {
    let c = shared();
    let key = unique_key("forged-renewed");
    let (_holder, g) = renewed_holder(&c, &key);
    let (waiting, attempts) = counted(c.urls(), Duration::from_secs(5));
    let w = std::thread::spawn({
        let key = key.clone();
        move || {
            waiting
                .request(&key, TTL)
                .acquire_for(Duration::from_secs(3))
                .is_err()
        }
    });
    // Its first attempts and its try at the expiry it read (within 0.6 s) are made; its
    // next is the fallback's cap, 1 s after that.
    std::thread::sleep(Duration::from_millis(1200));
    let before = attempts.get();
    forge(&c, &key, 0);
    assert!(
        wait_until(Duration::from_secs(1), || attempts.get() > before),
        "node 0's copy woke no retry"
    );
    forge(&c, &key, 1);
    forge(&c, &key, 2);
    std::thread::sleep(Duration::from_millis(700));
    let n = attempts.get() - before;
    assert_eq!(
        n,
        2,
        "attempts in the 800 ms after one forged message; attempts: {:#?}",
        attempts.2.lock()
    );
    assert!(w.join().expect("waiter"), "the holder renews its lock");
    assert!(g.is_held());
    drop(g);
}

/// A key freed without a message (deleted by hand here; a release whose messages were
/// all lost alike) costs a subscribed waiter at most its fallback cap, 1 s, however long
/// the owner's TTL and the retry pause (20 s and 5 s here).
#[test]
fn a_freed_key_without_a_message_costs_at_most_the_fallback_cap() {
    let c = shared();
    let key = unique_key("silent-free");
    let (waiting, attempts) = counted(c.urls(), Duration::from_secs(5));
    dead_holder(&c, &key, Duration::from_secs(20));
    let w = std::thread::spawn({
        let key = key.clone();
        move || {
            let g = waiting
                .request(&key, TTL)
                .acquire_for(Duration::from_secs(20));
            (Instant::now(), g.map(|g| g.release()).is_ok())
        }
    });
    let_it_subscribe();
    for i in 0..3 {
        c.del(i, &key);
    }
    let freed = Instant::now();
    let (got, ok) = w.join().expect("waiter");
    assert!(ok, "the waiter got the lock");
    let after = got.saturating_duration_since(freed);
    assert!(
        after < Duration::from_millis(2000),
        "got it {after:?} after the key was freed; attempts: {:#?}",
        attempts.2.lock()
    );
}

/// Threads of one client without a local queue are not woken by each other's releases
/// (a client's own releases wake none of its waiters): they poll at their retry pause,
/// 100 ms here, even behind a holder with a long TTL (the owner's expiry, 10 s away, must
/// not stretch the wait to the fallback's cap).
#[test]
fn threads_of_one_client_without_a_queue_poll_at_their_pause() {
    let c = shared();
    let key = unique_key("own-poll");
    let locks = Arc::new(
        Redlock::builder()
            .fresh_cluster(true)
            .nodes(c.urls())
            .node_timeout(Duration::from_millis(250))
            .local_queue(false)
            .retry_delay(Duration::from_millis(100))
            .retry_jitter(Duration::ZERO)
            .build()
            .expect("valid config"),
    );
    let g = locks.lock(&key, TTL).expect("lock");
    let w = waiter(locks.clone(), &key);
    std::thread::sleep(Duration::from_millis(300));
    let after = release_then_join(g, w);
    assert!(
        after < Duration::from_millis(600),
        "got it {after:?} after the release, polling every 100 ms"
    );
}

/// A client holding `key` with a 600 ms TTL, renewed (every 200 ms), and its guard.
fn renewed_holder(c: &Cluster, key: &str) -> (Redlock, quorumlock::LockGuard) {
    let holder = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(250))
        .auto_renew(true)
        .build()
        .expect("valid config");
    let g = holder.lock(key, Duration::from_millis(600)).expect("lock");
    (holder, g)
}

/// A live holder whose renewals keep moving its expiry does not make its waiter try at
/// every expiry it read (every 200-600 ms here): once one such try found the key still
/// held, the waiter goes back to its retry pause (1 s here).
#[test]
fn a_renewed_holder_does_not_make_its_waiter_poll_faster() {
    let c = shared();
    let key = unique_key("renewed-holder");
    let (_holder, g) = renewed_holder(&c, &key);
    let (waiting, attempts) = counted(c.urls(), Duration::from_secs(1));
    let r = waiting
        .request(&key, TTL)
        .acquire_for(Duration::from_secs(3));
    assert!(r.is_err(), "the holder renews its lock");
    assert!(g.is_held(), "the holder lost its lock");
    // The first attempt, the one after subscribing, one at the expiry it read (within
    // 0.6 s), then one a second and one at the deadline: 6. At every expiry: 10 or more.
    let n = attempts.get();
    assert!(
        n <= 7,
        "{n} attempts in 3 s with a 1 s retry pause; attempts: {:#?}",
        attempts.2.lock()
    );
    drop(g);
}

/// An ACL user without channel rights (`resetchannels`, Redis 7's default for new users)
/// locks and releases as before (the release's `PUBLISH` is refused inside the script,
/// which goes on), and waits by polling.
#[test]
fn an_acl_user_without_channel_rights_still_locks_and_waits_by_polling() {
    let c = Cluster::start(3);
    let mut urls = Vec::new();
    for i in 0..3 {
        let _: () = redis::cmd("ACL")
            .arg(&[
                "SETUSER",
                "nochan",
                "on",
                ">secret",
                "~*",
                "resetchannels",
                "+@all",
            ])
            .query(&mut c.conn(i))
            .expect("ACL SETUSER");
        urls.push(c.url(i).replace("redis://", "redis://nochan:secret@"));
    }
    let key = unique_key("no-channels");
    let limited = client(urls.clone(), Duration::from_millis(100));
    let g = limited.lock(&key, TTL).expect("lock");
    g.release()
        .expect("a release whose PUBLISH is refused is still a release");
    let holder = client(c.urls(), Duration::from_millis(100));
    let g = holder.lock(&key, TTL).expect("lock");
    let w = waiter(Arc::new(client(urls, Duration::from_millis(100))), &key);
    std::thread::sleep(Duration::from_millis(300));
    g.release().expect("release");
    let (got, _) = w.join().expect("the polling waiter");
    assert!(got.elapsed() < Duration::from_secs(20));
    assert!(c.gone_everywhere(&key, Duration::from_secs(2)));
}

/// Two clients, three threads each, all wanting one key for a second and a half: the
/// client that releases yields to the other's woken waiters, and neither starves. (Before,
/// one client's local queue kept the key: 351 / 0 / 0 in the run.)
#[test]
fn two_clients_with_local_queues_share_one_key() {
    let c = shared();
    let key = unique_key("two-queues");
    let run = Duration::from_millis(1500);
    let counts: Vec<_> = (0..2)
        .map(|_| Arc::new(std::sync::atomic::AtomicUsize::new(0)))
        .collect();
    let start = Instant::now();
    let mut threads = Vec::new();
    for count in &counts {
        let locks = Arc::new(client(c.urls(), Duration::from_millis(100)));
        for _ in 0..3 {
            let (locks, count, key) = (locks.clone(), count.clone(), key.clone());
            threads.push(std::thread::spawn(move || {
                while start.elapsed() < run {
                    if let Ok(g) = locks
                        .request(&key, Duration::from_millis(500))
                        .acquire_for(Duration::from_secs(1))
                    {
                        std::thread::sleep(Duration::from_millis(2));
                        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let _ = g.release();
                    }
                }
            }));
        }
    }
    for t in threads {
        t.join().expect("worker");
    }
    let n: Vec<usize> = counts
        .iter()
        .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
        .collect();
    let total: usize = n.iter().sum();
    assert!(total >= 20, "only {total} sections in {run:?}");
    assert!(
        n.iter().all(|&k| k * 10 >= total),
        "sections per client {n:?}: one starved"
    );
}

/// A node that accepts TCP and never answers, present from the client's start (one of
/// three): a majority still confirms the subscriptions, the waiters are woken through
/// the two that answer, and no wait costs more than the other nodes' answers.
#[test]
fn a_node_that_never_answers_does_not_hold_the_wake_ups_back() {
    let c = shared();
    let hole = crate::common::faults::Blackhole::start();
    let urls = vec![c.url(0), c.url(1), hole.url()];
    let client = |pause: Duration, events: Option<Arc<Attempts>>| {
        let b = Redlock::builder()
            .fresh_cluster(true)
            .nodes(urls.clone())
            .node_timeout(Duration::from_millis(250))
            .retry_delay(pause)
            .retry_jitter(Duration::ZERO);
        match events {
            Some(e) => b.events(e),
            None => b,
        }
        .build()
        .expect("valid config")
    };
    let holder = client(Duration::from_millis(100), None);
    let key = unique_key("woken-past-a-hole");
    let g = holder
        .request(&key, TTL)
        .acquire_for(Duration::from_secs(5))
        .expect("lock on 2 of 3");
    let attempts = Arc::new(Attempts::default());
    let w = waiter(
        Arc::new(client(Duration::from_secs(5), Some(attempts.clone()))),
        &key,
    );
    std::thread::sleep(Duration::from_millis(800));
    let after = release_then_join(g, w);
    assert!(
        after < Duration::from_secs(2),
        "woken {after:?} after the release"
    );
    // Woken, not its fallback (1 s after it began), which the bound alone allows.
    assert_eq!(
        attempts.acquired().map(|(woken, _)| woken),
        Some(true),
        "attempts: {:#?}",
        attempts.2.lock()
    );
}

/// `wake_ups(false)`: the waiter polls (its 2 s retry pause), whatever the release says.
#[test]
fn a_client_without_wake_ups_polls() {
    let c = shared();
    let holder = client(c.urls(), Duration::from_millis(100));
    let key = unique_key("not-woken");
    let g = holder.lock(&key, TTL).expect("lock");
    let polling = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(Duration::from_millis(250))
        .retry_delay(Duration::from_secs(2))
        .retry_jitter(Duration::ZERO)
        .wake_ups(false)
        .build()
        .expect("valid config");
    let w = waiter(Arc::new(polling), &key);
    std::thread::sleep(Duration::from_millis(300));
    let after = release_then_join(g, w);
    assert!(
        after >= Duration::from_millis(1200),
        "woken {after:?} after the release"
    );
}

/// A real release followed at once by a new owner whose time left is shorter than the
/// old owner's was (a shorter TTL; or, for a reader, an owner after a writer's intent,
/// which answered "no end known") is not a forged message: the waiter must still hear
/// the new owner's release. Found by a hostile review: the woken try judged "same
/// owners" and stopped listening, so the waiter got in only at its fallback, ~1 s after
/// the release (2–24 ms on the commit before).
#[test]
fn a_new_owner_with_less_time_left_is_not_taken_for_a_forged_message() {
    let c = shared();
    let slow = |urls| {
        let l = Redlock::builder()
            .fresh_cluster(true)
            .nodes(urls)
            .node_timeout(Duration::from_millis(250))
            .retry_delay(Duration::from_secs(2))
            .retry_jitter(Duration::from_millis(1))
            .build()
            .expect("valid config");
        assert_eq!(l.wait_connected(Duration::from_secs(5)).ok(), Some(3));
        l
    };
    let (a, b, w) = (slow(c.urls()), slow(c.urls()), slow(c.urls()));
    let long = Duration::from_secs(10);
    let bound = Duration::from_millis(500);

    // A writer: A (10 s) releases, B takes it at once for 1 s, holds 5 ms, releases.
    let key = unique_key("wake-shorter");
    let ga = a.try_lock(&key, long).expect("A");
    let waiter = {
        let (w, key) = (w.clone(), key.clone());
        std::thread::spawn(move || {
            let g = w.request(&key, long).acquire_for(Duration::from_secs(5));
            (Instant::now(), g.map(|g| g.release()))
        })
    };
    await_subscribers(&c, &key, 1);
    ga.release().expect("A released");
    if let Ok(gb) = b.try_lock(&key, Duration::from_secs(1)) {
        std::thread::sleep(Duration::from_millis(5));
        let released = Instant::now();
        gb.release().expect("B released");
        let (got, r) = waiter.join().expect("no panic");
        assert!(r.is_ok(), "the waiter got the lock");
        let late = got.saturating_duration_since(released);
        assert!(late < bound, "the writer got in {late:?} after B's release");
    } else {
        // The waiter won the race against B: nothing to check here.
        let _ = waiter.join();
    }

    // A reader behind a writer's intent: the last reader out lets the writer in (5 ms),
    // and the reader must hear the writer's release.
    let key = unique_key("wake-reader");
    let r0 = a
        .request(&key, long)
        .read()
        .try_acquire()
        .expect("a reader");
    let writer = {
        let (b, key) = (b.clone(), key.clone());
        std::thread::spawn(move || {
            let g = b
                .request(&key, long)
                .acquire_for(Duration::from_secs(5))
                .expect("the writer");
            std::thread::sleep(Duration::from_millis(5));
            let released = Instant::now();
            g.release().expect("the writer released");
            released
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let reader = {
        let (w, key) = (w.clone(), key.clone());
        std::thread::spawn(move || {
            let g = w
                .request(&key, long)
                .read()
                .acquire_for(Duration::from_secs(5));
            (Instant::now(), g.map(|g| g.release()))
        })
    };
    await_subscribers(&c, &key, 2);
    r0.release().expect("the first reader released");
    let released = writer.join().expect("no panic");
    let (got, r) = reader.join().expect("no panic");
    assert!(r.is_ok(), "the reader got in");
    let late = got.saturating_duration_since(released);
    assert!(
        late < bound,
        "the reader got in {late:?} after the writer's release"
    );
}

/// A set {a, b}: `a` held long by one client, `b` locked and released again
/// and again by another. The set must get in soon after `a`'s release,
/// however many times `b` came and went before. It did not: each release of
/// `b` woke the set, its try met `a`'s owner and a free `b` (the same owners
/// as the try before), and after three such tries it stopped listening until
/// its next try by the clock (a second here). A set now listens only to the
/// keys its last try found held: `b`'s releases, once it was seen free, are
/// none of its business. Found by review during issue 41.
#[test]
fn a_set_woken_by_its_other_keys_releases_keeps_listening() {
    let c = shared();
    let a = unique_key("set-deaf-a");
    let b = unique_key("set-deaf-b");
    let holder = client(c.urls(), Duration::from_secs(5));
    let churn = client(c.urls(), Duration::from_secs(5));
    let (set, attempts) = counted(c.urls(), Duration::from_secs(5));
    let ga = holder.try_lock(&a, Duration::from_secs(10)).expect("a");
    let w = set_waiter(Arc::new(set), [a.clone(), b.clone()]);
    await_subscribers(&c, &b, 1);
    let w0 = attempts.woken();
    for _ in 0..6 {
        let g = churn.try_lock(&b, Duration::from_secs(2)).expect("b");
        std::thread::sleep(Duration::from_millis(30));
        g.release().expect("release b");
        std::thread::sleep(Duration::from_millis(30));
    }
    let woken = attempts.woken() - w0;
    let late = release_then_join(ga, w);
    // Its fallback would come up to a second later.
    assert!(
        late < Duration::from_millis(300),
        "the set got in {late:?} after a's release ({woken} woken tries during b's 6 releases)"
    );
}

/// A release that a majority missed (two of three nodes hung) frees the key only when the
/// nodes come back and run it: their messages must wake the other clients' waiters. They
/// carried the notice of the release's first copy, which had woken the waiter already (to a
/// key still held), so they woke nobody, and the waiter slept out its fallback (a second
/// here) on a free key. Found measuring issue 41's "after a majority outage" goal.
#[test]
fn a_release_the_nodes_run_when_back_wakes_the_waiters() {
    let c = Cluster::start(3);
    let key = unique_key("outage-retry");
    let holder = client(c.urls(), Duration::from_secs(5));
    let w = Arc::new(client(c.urls(), Duration::from_secs(5)));
    let g = holder.try_lock(&key, TTL).expect("the holder");
    let wait = waiter(w, &key);
    await_subscribers(&c, &key, 1);
    c.pause(1);
    c.pause(2);
    // Reaches node 0 alone: the retries owe nodes 1 and 2 the delete.
    let _ = g.release();
    std::thread::sleep(Duration::from_millis(400));
    c.unpause(1);
    c.unpause(2);
    let back = Instant::now();
    let (got, _) = wait.join().expect("waiter");
    let late = got.saturating_duration_since(back);
    assert!(
        late < Duration::from_millis(500),
        "the waiter got in {late:?} after the nodes came back"
    );
}
