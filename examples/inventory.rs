//! The seed article's InventoryService: reserve stock under a lock, and let
//! the caller retry with backoff when the lock is busy.
//!
//! Eight worker threads try to reserve 40 units of a SKU that has 20 in
//! stock. The repository's read-modify-write is deliberately not atomic, so
//! without the lock the workers would oversell; with it, exactly 20
//! reservations succeed.
//!
//! ```text
//! cargo run --example inventory
//! ```
//! Nodes come from `REDLOCK_NODES`, or are started as in the quickstart.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use quorumlock::{Error, Redlock};

#[path = "../tests/common/mod.rs"]
mod common;

/// Stock levels, with a slow, non-atomic read-modify-write.
#[derive(Default)]
struct InventoryRepository {
    stock: Mutex<HashMap<String, i64>>,
}

impl InventoryRepository {
    fn find_stock(&self, sku: &str) -> i64 {
        let v = self.stock.lock().get(sku).copied().unwrap_or(0);
        std::thread::sleep(Duration::from_millis(2)); // a slow database
        v
    }

    fn update_stock(&self, sku: &str, value: i64) {
        self.stock.lock().insert(sku.to_owned(), value);
    }
}

#[derive(Debug)]
enum Reserve {
    Reserved,
    OutOfStock,
}

struct InventoryService {
    locks: Redlock,
    repository: Arc<InventoryRepository>,
}

impl InventoryService {
    /// One attempt: `Err(Error::Taken)` means "busy, retry later".
    fn reserve(&self, sku: &str, quantity: i64) -> Result<Reserve, Error> {
        let guard = self
            .locks
            .try_lock(&format!("lock:sku:{sku}"), Duration::from_secs(10))?;
        let stock = self.repository.find_stock(sku);
        let outcome = if stock < quantity {
            Reserve::OutOfStock
        } else {
            self.repository.update_stock(sku, stock - quantity);
            Reserve::Reserved
        };
        guard.release()?;
        Ok(outcome)
    }
}

/// The caller's side: retry a busy lock with exponential backoff.
fn reserve_with_backoff(service: &InventoryService, sku: &str) -> Result<Reserve, Error> {
    let mut pause = Duration::from_millis(2);
    loop {
        match service.reserve(sku, 1) {
            Err(e) if e.is_retryable() => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("inventory failed: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (urls, _cluster) = common::example_nodes(3)?;
    let sku = format!("sku-{}", std::process::id());
    let repository = Arc::new(InventoryRepository::default());
    repository.update_stock(&sku, 20);
    let service = Arc::new(InventoryService {
        locks: Redlock::builder().nodes(urls).build()?,
        repository: repository.clone(),
    });

    let reserved = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|s| {
        for _ in 0..8 {
            let (service, sku) = (service.clone(), sku.clone());
            let (reserved, refused) = (reserved.clone(), refused.clone());
            s.spawn(move || {
                for _ in 0..5 {
                    match reserve_with_backoff(&service, &sku) {
                        Ok(Reserve::Reserved) => reserved.fetch_add(1, Ordering::Relaxed),
                        Ok(Reserve::OutOfStock) => refused.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            eprintln!("reservation failed: {e}");
                            0
                        }
                    };
                }
            });
        }
    });
    let left = repository.find_stock(&sku);
    println!(
        "reserved {}, out of stock {}, stock left {left}",
        reserved.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed)
    );
    if reserved.load(Ordering::Relaxed) != 20 || left != 0 {
        return Err("oversold or undersold: the lock did not hold".into());
    }
    println!("no overselling: every reservation ran alone");
    Ok(())
}
