//! Log records of the calling thread, for tests of what is logged.

use std::sync::Arc;

/// A logger that keeps the records of the calling thread only.
struct Capture {
    thread: std::thread::ThreadId,
    records: Arc<parking_lot::Mutex<Vec<(log::Level, String)>>>,
}

pub(crate) struct Records(Arc<parking_lot::Mutex<Vec<(log::Level, String)>>>);

impl Records {
    pub(crate) fn take(&self) -> Vec<(log::Level, String)> {
        std::mem::take(&mut *self.0.lock())
    }
}

static SINK: std::sync::OnceLock<parking_lot::Mutex<Vec<Capture>>> = std::sync::OnceLock::new();

struct Logger;

impl log::Log for Logger {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        let me = std::thread::current().id();
        if let Some(sink) = SINK.get() {
            for c in sink.lock().iter().filter(|c| c.thread == me) {
                c.records
                    .lock()
                    .push((record.level(), record.args().to_string()));
            }
        }
    }
    fn flush(&self) {}
}

pub(crate) fn capture_logs() -> Records {
    static LOGGER: Logger = Logger;
    let sink = SINK.get_or_init(Default::default);
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Trace);
    }
    let records = Arc::new(parking_lot::Mutex::new(Vec::new()));
    sink.lock().push(Capture {
        thread: std::thread::current().id(),
        records: records.clone(),
    });
    Records(records)
}
