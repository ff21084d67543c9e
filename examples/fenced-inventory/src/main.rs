//! Fencing tokens against a real database: the seed article's inventory on
//! SQLite, where a worker that stalls past its lock cannot oversell.
//!
//! Four workers, each with its own fenced client, reserve one unit at a time
//! of a SKU with 50 in stock: lock, read the stock, work, write stock − 1.
//! One of them, once, stalls between its read and its write for twice the
//! lock's TTL (think GC pause or a descheduled VM). Its lock expires, another
//! worker takes it and sells meanwhile, and the stalled worker then writes a
//! stock computed from a stale read. The lock cannot stop that write; the
//! database does: every statement carries the section's fencing token, and
//! the row refuses a token older than the newest it has seen.
//!
//! ```text
//! cargo run -p fenced-inventory
//! ```
//! Nodes come from `REDLOCK_NODES`, or are started as in the quickstart. The
//! example exits non-zero unless the books balance and the store refused at
//! least one stale write.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use quorumlock::{LockGuard, Redlock};
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

#[path = "../../../tests/common/mod.rs"]
mod common;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SKU: &str = "sku-42";
/// A fixed name: every fenced resource keeps a counter on each node for good.
const RESOURCE: &str = "quorumlock-example:fenced-inventory:sku-42";
const INITIAL_STOCK: i64 = 50;
const WORKERS: usize = 4;
/// Short and never renewed, so that the stall below outlives the lock.
const TTL: Duration = Duration::from_millis(300);
const STALL: Duration = Duration::from_millis(600);
const WORK: Duration = Duration::from_millis(5);
const STOCK: &str = "SELECT stock FROM inventory WHERE sku = ?1";

/// The inventory table. Every access, read or write, carries the section's
/// fencing token and is refused once a newer section has touched the row.
struct Store {
    conn: Connection,
}

/// A write's outcome; refused: a newer section touched the row since our read.
enum Write {
    Applied,
    Refused { stock_now: i64 },
}

impl Store {
    fn open(path: &Path) -> Result<Store> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        Ok(Store { conn })
    }

    fn create(path: &Path) -> Result<Store> {
        let store = Store::open(path)?;
        store.conn.execute_batch(
            "CREATE TABLE inventory (sku TEXT PRIMARY KEY, stock INTEGER NOT NULL,
                                     last_token INTEGER NOT NULL)",
        )?;
        store.conn.execute(
            "INSERT INTO inventory VALUES (?1, ?2, 0)",
            params![SKU, INITIAL_STOCK],
        )?;
        Ok(store)
    }

    /// Reads the stock and registers `token` on the row (`None`: a newer
    /// section got there first). Without the registration a stale holder
    /// could still write between a newer section's read and its write (the
    /// row has seen no newer token yet), and the newer write, computed from
    /// the same stock, would erase that sale. With it, a write succeeds only
    /// if no other section touched the row since the same section's read.
    fn read(&self, token: i64) -> Result<Option<i64>> {
        let sql = "UPDATE inventory SET last_token = ?2
                    WHERE sku = ?1 AND last_token <= ?2 RETURNING stock";
        let stock = self
            .conn
            .query_row(sql, params![SKU, token], |row| row.get(0));
        Ok(stock.optional()?)
    }

    /// Writes the stock, fenced. `<=` rather than `<`: tokens grow strictly
    /// from one section to the next, so an equal token can only be this same
    /// section (whose read registered it; it may also write more than once).
    /// `<` would refuse a section its own writes.
    fn write(&mut self, stock: i64, token: i64) -> Result<Write> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let sql = "UPDATE inventory SET stock = ?2, last_token = ?3
                    WHERE sku = ?1 AND last_token <= ?3";
        let outcome = if tx.execute(sql, params![SKU, stock, token])? == 1 {
            Write::Applied
        } else {
            let stock_now = tx.query_row(STOCK, [SKU], |row| row.get(0))?;
            Write::Refused { stock_now }
        };
        tx.commit()?;
        Ok(outcome)
    }
}

#[derive(Default)]
struct Stats {
    reserved: i64,
    stale_writes: i64,
    stale_reads: i64,
    /// Sales a refused write would have erased (stock it read − stock it met).
    undone: i64,
}

/// Locks the SKU, retrying a busy lock or a failed round with backoff; gives
/// up after 30 s so that dead nodes end the example instead of hanging it.
fn lock(locks: &Redlock) -> Result<LockGuard> {
    let give_up = Instant::now() + Duration::from_secs(30);
    let mut pause = Duration::from_millis(2);
    loop {
        match locks.lock(RESOURCE, TTL) {
            Err(e) if e.is_retryable() && Instant::now() < give_up => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            other => return Ok(other?),
        }
    }
}

/// Reserves one unit per critical section until the stock is gone. The first
/// worker to find 5 units sold while `stall_once` is set pauses past its TTL
/// between its read and its write.
fn worker(id: usize, locks: &Redlock, mut store: Store, stall_once: &AtomicBool) -> Result<Stats> {
    let mut stats = Stats::default();
    loop {
        let guard = lock(locks)?;
        let token = guard.fencing_token().ok_or("the client is not fenced")?;
        let token = i64::try_from(token)?;
        let Some(stock) = store.read(token)? else {
            stats.stale_reads += 1; // lost the lock before even reading
            continue;
        };
        if stock == 0 {
            break;
        }
        std::thread::sleep(WORK);
        if stock <= INITIAL_STOCK - 5 && stall_once.swap(false, Ordering::Relaxed) {
            println!("worker {id}: token {token} read stock {stock}, then stalls {STALL:?} (TTL {TTL:?})");
            std::thread::sleep(STALL);
        }
        // No `guard.is_held()` check before writing, on purpose: it would
        // catch this pause, but a pause can as well fall between the check
        // and the write. Only the store can decide, atomically.
        match store.write(stock - 1, token)? {
            Write::Applied => stats.reserved += 1,
            Write::Refused { stock_now } => {
                println!(
                    "worker {id}: write of stock {} with token {token} refused (stock is now {stock_now}): lost the lock, nothing reserved",
                    stock - 1
                );
                stats.stale_writes += 1;
                stats.undone += stock - stock_now;
            }
        }
        drop(guard); // releases; an expired lock has nothing left to release
    }
    Ok(stats)
}

/// A database file in the temp dir, deleted on drop.
struct TempDb(PathBuf);

impl Drop for TempDb {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("fenced_inventory failed: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let (urls, cluster) = common::example_nodes(3)?;
    // Our own throwaway nodes are brand new: trust their empty lock history.
    let fresh = cluster.is_some();
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let name = format!("quorumlock-fenced-{}-{nanos}.sqlite", std::process::id());
    let db = TempDb(std::env::temp_dir().join(name));
    let store = Store::create(&db.0)?;
    let (path, stall_once) = (db.0.as_path(), &AtomicBool::new(true));
    let builder = Redlock::builder()
        .nodes(urls)
        .fencing(true)
        .fresh_cluster(fresh);
    let clients = (0..WORKERS).map(|_| builder.clone().build());
    let clients = clients.collect::<std::result::Result<Vec<_>, _>>()?;

    let results: Vec<Result<Stats>> = std::thread::scope(|s| {
        let workers: Vec<_> = (clients.iter().enumerate())
            .map(|(id, locks)| s.spawn(move || worker(id, locks, Store::open(path)?, stall_once)))
            .collect();
        let joined = workers.into_iter().map(|w| w.join());
        joined
            .map(|r| r.unwrap_or_else(|_| Err("a worker panicked".into())))
            .collect()
    });
    let (mut total, mut per_worker) = (Stats::default(), Vec::new());
    for stats in results {
        let stats = stats?;
        per_worker.push(stats.reserved);
        total.reserved += stats.reserved;
        total.stale_writes += stats.stale_writes;
        total.stale_reads += stats.stale_reads;
        total.undone += stats.undone;
    }

    let final_stock: i64 = store.conn.query_row(STOCK, [SKU], |row| row.get(0))?;
    println!(
        "reservations made:                 {} {per_worker:?}",
        total.reserved
    );
    println!(
        "stale writes refused by the store: {} (stale reads: {})",
        total.stale_writes, total.stale_reads
    );
    println!("final stock:                       {final_stock} of {INITIAL_STOCK}");
    // Applied, a stale write would have put back the units sold during its
    // stall (and counted its own sale): those units would be sold twice.
    println!(
        "without the token check: final stock {} instead of {final_stock} for {} reservations: {} units oversold",
        final_stock + total.undone - total.stale_writes,
        total.reserved + total.stale_writes,
        total.undone,
    );
    if final_stock != INITIAL_STOCK - total.reserved {
        return Err("the books do not balance: fencing let a stale write through".into());
    }
    if total.stale_writes < 1 {
        return Err("no stale write reached the store: the stall did not outlive the lock".into());
    }
    println!("fenced: the stale write changed nothing, every unit was sold once");
    Ok(())
}
