//! The `tracing` feature (issue 43): a span per lock call under the caller's span, with
//! its outcome; rounds at trace level; a span per renewal of a lock, on the renewal
//! thread, under the span of the caller that took the lock; no token in a span's fields
//! above debug.
//!
//! The renewal thread is spawned per client, so a thread-local default subscriber would
//! not reach it: the collector below is the binary's global default, set once. It keeps
//! only the spans under a span named [`ROOT`] (this module's tests open one each), so that
//! the other modules' lock calls in this binary cost it nothing to keep.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use quorumlock::{Error, Redlock};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_core::span::Current;

use crate::common::{shared, unique_key, wait_until};

/// The name of the span a test opens as the caller's.
const ROOT: &str = "caller";

/// One span as the collector saw it.
#[derive(Clone, Debug)]
struct Seen {
    id: u64,
    name: &'static str,
    level: Level,
    parent: Option<u64>,
    /// The name of the thread that created it.
    thread: String,
    fields: BTreeMap<String, String>,
}

struct Collector {
    next: AtomicU64,
    /// The spans kept (those under a [`ROOT`] span), by id.
    spans: Mutex<BTreeMap<u64, (Seen, &'static Metadata<'static>)>>,
}

thread_local! {
    /// The spans this thread is in, innermost last.
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl Subscriber for Collector {
    fn register_callsite(&self, _: &'static Metadata<'static>) -> Interest {
        Interest::always()
    }
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::TRACE)
    }
    fn new_span(&self, attrs: &Attributes<'_>) -> Id {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let parent = match attrs.parent() {
            Some(p) => Some(p.into_u64()),
            None if attrs.is_contextual() => STACK.with(|s| s.borrow().last().copied()),
            None => None,
        };
        let meta = attrs.metadata();
        if parent.is_none() && meta.name() != ROOT {
            // (Another module's lock call: not kept, and no lock taken.)
            return Id::from_u64(id);
        }
        let mut spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        let kept = meta.name() == ROOT || parent.is_some_and(|p| spans.contains_key(&p));
        if kept {
            let mut fields = BTreeMap::new();
            attrs.record(&mut Fields(&mut fields));
            let thread = std::thread::current().name().unwrap_or("").to_owned();
            let seen = Seen {
                id,
                name: meta.name(),
                level: *meta.level(),
                parent,
                thread,
                fields,
            };
            spans.insert(id, (seen, meta));
        }
        Id::from_u64(id)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        let mut spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((seen, _)) = spans.get_mut(&span.into_u64()) {
            values.record(&mut Fields(&mut seen.fields));
        }
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, span: &Id) {
        STACK.with(|s| s.borrow_mut().push(span.into_u64()));
    }
    fn exit(&self, span: &Id) {
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            if let Some(at) = s.iter().rposition(|&i| i == span.into_u64()) {
                s.remove(at);
            }
        });
    }
    fn current_span(&self) -> Current {
        let Some(top) = STACK.with(|s| s.borrow().last().copied()) else {
            return Current::none();
        };
        let spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        match spans.get(&top) {
            Some((_, meta)) => Current::new(Id::from_u64(top), meta),
            // (Another module's span: not kept, so not known here.)
            None => Current::none(),
        }
    }
}

/// The binary's collector, set as the global default on first use.
fn collector() -> &'static Collector {
    static SET: OnceLock<&'static Collector> = OnceLock::new();
    SET.get_or_init(|| {
        let c: &'static Collector = Box::leak(Box::new(Collector {
            next: AtomicU64::new(1),
            spans: Mutex::new(BTreeMap::new()),
        }));
        tracing::subscriber::set_global_default(Forward(c)).expect("no other global subscriber");
        c
    })
}

/// The global default must own its subscriber: this one forwards to the leaked collector.
struct Forward(&'static Collector);

impl Subscriber for Forward {
    fn register_callsite(&self, m: &'static Metadata<'static>) -> Interest {
        self.0.register_callsite(m)
    }
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        self.0.enabled(m)
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        self.0.max_level_hint()
    }
    fn new_span(&self, a: &Attributes<'_>) -> Id {
        self.0.new_span(a)
    }
    fn record(&self, s: &Id, v: &Record<'_>) {
        self.0.record(s, v)
    }
    fn record_follows_from(&self, s: &Id, f: &Id) {
        self.0.record_follows_from(s, f)
    }
    fn event(&self, e: &Event<'_>) {
        self.0.event(e)
    }
    fn enter(&self, s: &Id) {
        self.0.enter(s)
    }
    fn exit(&self, s: &Id) {
        self.0.exit(s)
    }
    fn current_span(&self) -> Current {
        self.0.current_span()
    }
}

impl Collector {
    /// Every kept span whose ancestors include `root`.
    fn under(&self, root: u64) -> Vec<Seen> {
        let spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        let descends = |mut id: u64| loop {
            match spans.get(&id).and_then(|(s, _)| s.parent) {
                Some(p) if p == root => return true,
                Some(p) => id = p,
                None => return false,
            }
        };
        spans
            .values()
            .filter(|(s, _)| descends(s.id))
            .map(|(s, _)| s.clone())
            .collect()
    }
}

/// A new caller span (a [`ROOT`]) for `test`, with its id.
fn caller(test: &str) -> (tracing::Span, u64) {
    collector();
    let span = tracing::info_span!(ROOT, test);
    let id = span
        .id()
        .expect("the collector keeps the caller's span")
        .into_u64();
    (span, id)
}

fn client(urls: Vec<String>, renew: bool) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .node_timeout(Duration::from_millis(250))
        .auto_renew(renew)
        .build()
        .expect("valid config")
}

fn field<'a>(s: &'a Seen, name: &str) -> &'a str {
    s.fields.get(name).map_or("<none>", String::as_str)
}

/// Each lock call, won or lost, is one `quorumlock.lock` span whose parent is the
/// caller's span, with its resource, kind, outcome, attempts and wait recorded at its end;
/// its rounds are `quorumlock.round` spans under it, at trace level.
#[test]
fn each_lock_call_is_one_span_under_the_callers_span() {
    let c = shared();
    let (holder, rival) = (client(c.urls(), false), client(c.urls(), false));
    let key = unique_key("spans-call");
    let (root, root_id) = caller("each_lock_call");
    let (held, refused, read) = root.in_scope(|| {
        let held = holder.lock(&key, Duration::from_secs(5)).expect("free");
        let refused = rival.try_lock(&key, Duration::from_secs(5));
        let read_key = unique_key("spans-read");
        let read = rival
            .request(&read_key, Duration::from_secs(5))
            .read()
            .try_acquire()
            .expect("free");
        (held, refused, read)
    });
    assert!(matches!(refused, Err(Error::Taken { .. })), "{refused:?}");
    let spans = collector().under(root_id);
    let calls: Vec<&Seen> = spans
        .iter()
        .filter(|s| s.name == "quorumlock.lock")
        .collect();
    assert_eq!(calls.len(), 3, "one span per lock call: {spans:#?}");
    for s in &calls {
        assert_eq!(
            s.parent,
            Some(root_id),
            "the caller's span is the parent: {s:?}"
        );
        assert_eq!(s.level, Level::DEBUG, "{s:?}");
    }
    let (won, lost, reader) = (calls[0], calls[1], calls[2]);
    assert_eq!(field(won, "resource"), key);
    assert_eq!(field(won, "kind"), "write");
    assert_eq!(field(won, "outcome"), "acquired");
    assert_eq!(field(won, "attempts"), "1");
    assert!(won.fields.contains_key("waited"), "{won:?}");
    assert_eq!(field(lost, "resource"), key);
    assert_eq!(field(lost, "outcome"), "taken");
    assert_eq!(field(lost, "attempts"), "1");
    assert_eq!(field(reader, "kind"), "read");
    assert_eq!(field(reader, "outcome"), "acquired");
    // The rounds: one per attempt, under its call, at trace level.
    for call in [won, lost] {
        let rounds: Vec<&Seen> = spans
            .iter()
            .filter(|s| s.name == "quorumlock.round" && s.parent == Some(call.id))
            .collect();
        assert_eq!(rounds.len(), 1, "{spans:#?}");
        assert_eq!(rounds[0].level, Level::TRACE);
    }
    // Nothing above debug on the happy path, and no token in any field.
    for s in &spans {
        let quiet = matches!(s.level, Level::DEBUG | Level::TRACE);
        assert!(s.id == root_id || quiet, "{s:?}");
        for v in s.fields.values() {
            assert!(
                !v.contains(held.token()) && !v.contains(read.token()),
                "{s:?}"
            );
        }
    }
    drop((held, read));
}

/// A retried call counts its attempts and how long it waited; a leader election's
/// campaign is a lock call too, of kind `election`.
#[test]
fn a_retried_call_and_a_campaign_record_attempts_wait_and_kind() {
    let c = shared();
    let holder = client(c.urls(), false);
    let rival = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .retry_count(3)
        .retry_delay(Duration::from_millis(50))
        .retry_jitter(Duration::ZERO)
        .build()
        .expect("valid config");
    let key = unique_key("spans-retried");
    let name = unique_key("spans-election");
    let (root, root_id) = caller("retried");
    let held = holder.lock(&key, Duration::from_secs(5)).expect("free");
    // (A new client's first lock may reach a node still connecting after its round: a
    // rival that then sets that node retries at once, as after a split vote.)
    assert!(
        wait_until(Duration::from_secs(2), || c.holders(&key, held.token())
            == 3),
        "the lock never reached every node"
    );
    root.in_scope(|| {
        let refused = rival.lock(&key, Duration::from_secs(5));
        assert!(matches!(refused, Err(Error::Taken { .. })), "{refused:?}");
        let leader = rival
            .election(&name, Duration::from_secs(5))
            .id("a")
            .campaign()
            .expect("leads");
        leader.resign().expect("resigned");
    });
    let spans = collector().under(root_id);
    let calls: Vec<&Seen> = spans
        .iter()
        .filter(|s| s.name == "quorumlock.lock")
        .collect();
    assert_eq!(calls.len(), 2, "{spans:#?}");
    let (retried, campaign) = (calls[0], calls[1]);
    let attempts: u32 = field(retried, "attempts").parse().expect("a number");
    // Three attempts by the clock, and the subscribed waiter's one more at once.
    assert!((3..=5).contains(&attempts), "{retried:?}");
    let rounds = spans
        .iter()
        .filter(|s| s.name == "quorumlock.round" && s.parent == Some(retried.id))
        .count();
    assert_eq!(rounds as u32, attempts, "{spans:#?}");
    // At least the two retry pauses (50 ms each) before its last attempt.
    let waited = field(retried, "waited");
    let ms = match waited.strip_suffix("ms") {
        Some(ms) => ms.parse::<f64>().expect("a number"),
        // (Under a second, a Duration's Debug is in ms, µs or ns.)
        None if !waited.ends_with("µs") && !waited.ends_with("ns") => 1000.0,
        None => 0.0,
    };
    assert!(ms >= 100.0, "{retried:?}");
    assert_eq!(field(campaign, "kind"), "election");
    assert_eq!(field(campaign, "resource"), name);
    assert_eq!(field(campaign, "outcome"), "acquired");
    drop(held);
}

/// The renewal thread renews a lock under a `quorumlock.renewal` span whose parent is the
/// span of the caller that took the lock (the thread is the client's, spawned before or
/// after: the span is carried with the lock).
#[test]
fn a_renewal_on_the_renewal_thread_is_under_the_callers_span() {
    let c = shared();
    let locks = client(c.urls(), true);
    let key = unique_key("spans-renewal");
    let (root, root_id) = caller("renewal");
    let ttl = Duration::from_millis(900);
    let guard = root.in_scope(|| locks.lock(&key, ttl).expect("free"));
    drop(root);
    let renewals = || {
        collector()
            .under(root_id)
            .into_iter()
            .filter(|s| s.name == "quorumlock.renewal" && field(s, "outcome") != "<none>")
            .collect::<Vec<_>>()
    };
    assert!(
        wait_until(Duration::from_secs(10), || !renewals().is_empty()),
        "no renewal span under the caller's span: {:#?}",
        collector().under(root_id)
    );
    let renewal = &renewals()[0];
    assert_eq!(renewal.parent, Some(root_id), "{renewal:?}");
    assert_eq!(renewal.thread, "qlock-watchdog", "{renewal:?}");
    assert_eq!(renewal.level, Level::DEBUG, "{renewal:?}");
    assert_eq!(field(renewal, "resource"), key);
    assert_eq!(field(renewal, "outcome"), "renewed");
    for s in collector().under(root_id) {
        for v in s.fields.values() {
            assert!(!v.contains(guard.token()), "{s:?}");
        }
    }
    guard.release().expect("released");
}

/// A lock found gone at a renewal is lost, and the renewal thread deletes what is left of
/// it under a `quorumlock.release_lost` span, whose parent is the caller's span too.
#[test]
fn the_release_of_a_lost_lock_is_under_the_callers_span() {
    let c = shared();
    let locks = client(c.urls(), true);
    let key = unique_key("spans-lost");
    let (root, root_id) = caller("lost");
    let ttl = Duration::from_millis(900);
    let guard = root.in_scope(|| locks.lock(&key, ttl).expect("free"));
    assert!(
        wait_until(Duration::from_secs(2), || c.holders(&key, guard.token())
            == 3),
        "the lock never reached every node"
    );
    c.del(0, &key);
    c.del(1, &key);
    let why = guard
        .lost()
        .wait_timeout(ttl * 2)
        .expect("lost at the next renewal");
    assert!(matches!(why, Error::Expired), "{why:?}");
    let released = || {
        collector()
            .under(root_id)
            .into_iter()
            .filter(|s| s.name == "quorumlock.release_lost")
            .collect::<Vec<_>>()
    };
    assert!(
        wait_until(Duration::from_secs(5), || !released().is_empty()),
        "{:#?}",
        collector().under(root_id)
    );
    let release = &released()[0];
    assert_eq!(release.parent, Some(root_id), "{release:?}");
    assert_eq!(release.thread, "qlock-watchdog", "{release:?}");
    assert_eq!(field(release, "resource"), key);
    // The renewal that found it gone says so.
    let failed = collector()
        .under(root_id)
        .into_iter()
        .filter(|s| s.name == "quorumlock.renewal")
        .any(|s| field(&s, "outcome") == "expired");
    assert!(failed, "{:#?}", collector().under(root_id));
    drop(guard);
}
