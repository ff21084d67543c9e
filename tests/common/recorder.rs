//! A `metrics` recorder that keeps what it is given: counters' totals and
//! histograms' samples, by name and labels. Installed once per process as the
//! global recorder ([`installed`]); the metrics tests read it, the metrics
//! example prints it.
// Each includer uses part of it (`#[path = "…/recorder.rs"] mod recorder;`).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use metrics::{
    Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};

/// A metric's name and labels (sorted by key).
pub type Series = (String, Vec<(String, String)>);

#[derive(Default)]
pub struct Recorded {
    counters: Mutex<BTreeMap<Series, Arc<Total>>>,
    histograms: Mutex<BTreeMap<Series, Arc<Samples>>>,
    described: Mutex<BTreeMap<String, (Option<Unit>, String)>>,
}

#[derive(Default)]
struct Total(AtomicU64);

impl CounterFn for Total {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Samples(Mutex<Vec<f64>>);

impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        if let Ok(mut v) = self.0.lock() {
            v.push(value);
        }
    }
}

fn series(key: &Key) -> Series {
    let mut labels: Vec<(String, String)> = key
        .labels()
        .map(|l| (l.key().to_owned(), l.value().to_owned()))
        .collect();
    labels.sort();
    (key.name().to_owned(), labels)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The process's global recorder, installed on the first call.
pub fn installed() -> &'static Recorded {
    static RECORDED: OnceLock<&'static Recorded> = OnceLock::new();
    RECORDED.get_or_init(|| {
        let recorded: &'static Recorded = Box::leak(Box::default());
        metrics::set_global_recorder(Global(recorded))
            .unwrap_or_else(|_| panic!("another global metrics recorder is installed"));
        recorded
    })
}

impl Recorded {
    /// Forgets every value (descriptions stay).
    pub fn clear(&self) {
        lock(&self.counters).clear();
        lock(&self.histograms).clear();
    }

    /// Every counter and its total.
    pub fn counters(&self) -> Vec<(Series, u64)> {
        lock(&self.counters)
            .iter()
            .map(|(s, t)| (s.clone(), t.0.load(Ordering::Relaxed)))
            .collect()
    }

    /// Every histogram and its samples.
    pub fn histograms(&self) -> Vec<(Series, Vec<f64>)> {
        lock(&self.histograms)
            .iter()
            .map(|(s, h)| (s.clone(), lock(&h.0).clone()))
            .collect()
    }

    /// The total of the counter `name` with exactly these labels (0 where none).
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let want = wanted(name, labels);
        self.counters()
            .into_iter()
            .find(|(s, _)| *s == want)
            .map_or(0, |(_, n)| n)
    }

    /// The samples of the histogram `name` with exactly these labels.
    pub fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        let want = wanted(name, labels);
        self.histograms()
            .into_iter()
            .find(|(s, _)| *s == want)
            .map(|(_, v)| v)
            .unwrap_or_default()
    }

    /// Every series recorded, counters and histograms.
    pub fn series(&self) -> Vec<Series> {
        let mut all: Vec<Series> = self.counters().into_iter().map(|(s, _)| s).collect();
        all.extend(self.histograms().into_iter().map(|(s, _)| s));
        all
    }

    /// A metric's unit and description, where described.
    pub fn described(&self, name: &str) -> Option<(Option<Unit>, String)> {
        lock(&self.described).get(name).cloned()
    }
}

fn wanted(name: &str, labels: &[(&str, &str)]) -> Series {
    let mut l: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    l.sort();
    (name.to_owned(), l)
}

/// What `metrics::set_global_recorder` holds.
struct Global(&'static Recorded);

impl Global {
    fn describe(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        lock(&self.0.described).insert(key.as_str().to_owned(), (unit, description.to_string()));
    }
}

impl Recorder for Global {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.describe(key, unit, description);
    }
    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.describe(key, unit, description);
    }
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.describe(key, unit, description);
    }
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let total = lock(&self.0.counters)
            .entry(series(key))
            .or_default()
            .clone();
        Counter::from_arc(total)
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let samples = lock(&self.0.histograms)
            .entry(series(key))
            .or_default()
            .clone();
        Histogram::from_arc(samples)
    }
}
