//! Faulty nodes on 127.0.0.1 for tests and benchmarks: a black hole (accepts TCP, never
//! answers), a delaying proxy in front of a real node (a slow node), and `CLIENT PAUSE …
//! WRITE` (a node that answers reads but not writes). Each stops when dropped.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A node that accepts connections and reads what it is sent, but never replies.
pub struct Blackhole {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Blackhole {
    pub fn start() -> Blackhole {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a black hole");
        let addr = listener.local_addr().expect("local addr");
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ql-blackhole".into())
            .spawn(move || {
                let held: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
                for stream in listener.incoming() {
                    if flag.load(Ordering::SeqCst) {
                        break;
                    }
                    if let Ok(s) = stream {
                        // Keep the socket open and drain it, so that writes never block on
                        // our side: the node "received" everything and answers nothing.
                        let mut reader = match s.try_clone() {
                            Ok(r) => r,
                            Err(_) => continue,
                        };
                        held.lock().unwrap().push(s);
                        let flag = flag.clone();
                        let _ = std::thread::Builder::new()
                            .name("ql-blackhole-rd".into())
                            .spawn(move || {
                                let mut buf = [0u8; 65536];
                                while !flag.load(Ordering::SeqCst) {
                                    match reader.read(&mut buf) {
                                        Ok(0) | Err(_) => break,
                                        Ok(_) => {}
                                    }
                                }
                            });
                    }
                }
                for s in held.lock().unwrap().drain(..) {
                    let _ = s.shutdown(Shutdown::Both);
                }
            })
            .expect("spawn black hole");
        Blackhole {
            addr,
            stop,
            thread: Some(thread),
        }
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A proxy in front of a real node that delays every reply by `delay`, and the node's
/// close of a connection as well: a node whose round trip is about `delay`.
pub struct DelayProxy(Proxy);

impl DelayProxy {
    /// Proxies to `upstream` (`redis://host:port`).
    pub fn start(upstream: &str, delay: Duration) -> DelayProxy {
        DelayProxy(Proxy::start(
            "ql-delay",
            upstream,
            move |client, server, stop| {
                pipe(client.try_clone(), server.try_clone(), Duration::ZERO, stop);
                pipe(server.try_clone(), client.try_clone(), delay, stop);
            },
        ))
    }

    pub fn url(&self) -> String {
        self.0.url()
    }
}

/// A proxy in front of a real node that holds back, for `delay`, every chunk of commands
/// that contains `marker` (what follows on that connection waits behind it): a node that
/// answers one kind of command late.
pub struct HoldProxy(Proxy);

impl HoldProxy {
    /// Proxies to `upstream` (`redis://host:port`).
    pub fn start(upstream: &str, marker: Vec<u8>, delay: Duration) -> HoldProxy {
        HoldProxy(Proxy::start(
            "ql-hold",
            upstream,
            move |client, server, stop| {
                let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
                    return;
                };
                pipe(Ok(s2), Ok(c2), Duration::ZERO, stop);
                let marker = marker.clone();
                let stop = stop.clone();
                let _ = std::thread::Builder::new()
                    .name("ql-hold-wr".into())
                    .spawn(move || {
                        let (mut from, mut to) = (client, server);
                        let mut buf = [0u8; 65536];
                        while !stop.load(Ordering::SeqCst) {
                            let Ok(k @ 1..) = from.read(&mut buf) else {
                                break;
                            };
                            if buf[..k]
                                .windows(marker.len())
                                .any(|w| w == marker.as_slice())
                            {
                                std::thread::sleep(delay);
                            }
                            if to.write_all(&buf[..k]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Both);
                    });
            },
        ))
    }

    pub fn url(&self) -> String {
        self.0.url()
    }
}

/// A proxy's listener: each connection accepted is paired with one to the node and handed
/// to `serve`. Stops when dropped.
struct Proxy {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Proxy {
    fn start(
        name: &str,
        upstream: &str,
        mut serve: impl FnMut(TcpStream, TcpStream, &Arc<AtomicBool>) + Send + 'static,
    ) -> Proxy {
        let target: SocketAddr = upstream
            .trim_start_matches("redis://")
            .trim_end_matches('/')
            .parse()
            .expect("upstream host:port");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a proxy");
        let addr = listener.local_addr().expect("local addr");
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for client in listener.incoming() {
                    if flag.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    let Ok(server) = TcpStream::connect(target) else {
                        let _ = client.shutdown(Shutdown::Both);
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    serve(client, server, &flag);
                }
            })
            .expect("spawn proxy");
        Proxy {
            addr,
            stop,
            thread: Some(thread),
        }
    }

    fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Copies `from` to `to`, each chunk no earlier than `delay` after it was read.
fn pipe(
    from: std::io::Result<TcpStream>,
    to: std::io::Result<TcpStream>,
    delay: Duration,
    stop: &Arc<AtomicBool>,
) {
    let (Ok(mut from), Ok(mut to)) = (from, to) else {
        return;
    };
    let stop = stop.clone();
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    let _ = std::thread::Builder::new()
        .name("ql-delay-rd".into())
        .spawn(move || {
            let mut buf = [0u8; 65536];
            loop {
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => {
                        // The close is delayed like the data: an empty chunk.
                        let _ = tx.send((Instant::now(), Vec::new()));
                        break;
                    }
                    Ok(k) => {
                        if tx.send((Instant::now(), buf[..k].to_vec())).is_err() {
                            break;
                        }
                    }
                }
            }
        });
    let _ = std::thread::Builder::new()
        .name("ql-delay-wr".into())
        .spawn(move || {
            while let Ok((at, chunk)) = rx.recv() {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let due = at + delay;
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                if chunk.is_empty() || to.write_all(&chunk).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(Shutdown::Both);
        });
}

/// `CLIENT PAUSE ms WRITE` on node `i`: it keeps answering reads (PING, INFO) and accepting
/// connections, but holds every write until the pause ends.
pub fn pause_writes(c: &super::Cluster, i: usize, pause: Duration) {
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(pause.as_millis() as u64)
        .arg("WRITE")
        .query(&mut c.conn(i))
        .expect("CLIENT PAUSE … WRITE");
}

/// Ends a `CLIENT PAUSE` on node `i` early.
pub fn unpause_writes(c: &super::Cluster, i: usize) {
    let _: () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query(&mut c.conn(i))
        .expect("CLIENT UNPAUSE");
}

/// Threads of this process whose name starts with `prefix` (Linux: /proc/self/task).
pub fn threads_named(prefix: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
        .filter(|name| name.trim_end().starts_with(prefix))
        .count()
}

/// [`pause_writes`] for as long as the guard lives: dropping it (also while a test panics)
/// ends the pause.
pub struct WritePause<'a> {
    cluster: &'a super::Cluster,
    node: usize,
}

impl<'a> WritePause<'a> {
    /// `CLIENT PAUSE pause WRITE` on node `i` of `cluster`.
    pub fn start(cluster: &'a super::Cluster, i: usize, pause: Duration) -> WritePause<'a> {
        pause_writes(cluster, i, pause);
        WritePause { cluster, node: i }
    }
}

impl Drop for WritePause<'_> {
    fn drop(&mut self) {
        // No panic here: this may run while a test is already panicking.
        match self.cluster.try_conn(self.node, Duration::from_secs(1)) {
            Ok(mut conn) => {
                if let Err(e) = redis::cmd("CLIENT").arg("UNPAUSE").query::<()>(&mut conn) {
                    eprintln!("CLIENT UNPAUSE on node {}: {e}", self.node);
                }
            }
            Err(e) => eprintln!("CLIENT UNPAUSE on node {}: connect: {e}", self.node),
        }
    }
}

/// A proxy in front of a real node that, when a command containing `marker` arrives, cuts
/// the connection: it forwards the command or not, and closes our side `close_after` later
/// without passing on the reply (with `forward`: "the command ran, its reply was lost").
/// At most `budget` cuts (`None`: every time). Each new connection after the first cut
/// waits `slow_accept` (a node slow to take new connections).
pub struct CutProxy {
    proxy: Proxy,
    cuts: Arc<AtomicUsize>,
}

/// Options of a [`CutProxy`].
#[derive(Clone, Copy)]
pub struct Cut {
    pub marker: &'static [u8],
    pub forward: bool,
    pub budget: Option<usize>,
    pub close_after: Duration,
    pub slow_accept: Duration,
    /// Instead of `forward`: pass the command on this long after it arrived, after the close
    /// (a proxy that had read it, cut by an idle timeout).
    pub forward_late: Option<Duration>,
}

impl Cut {
    /// Forwards the command, then drops its reply and closes 2 ms later, at most `budget` times.
    pub fn after_running(marker: &'static [u8], budget: usize) -> Cut {
        Cut {
            marker,
            forward: true,
            budget: Some(budget),
            close_after: Duration::from_millis(2),
            slow_accept: Duration::ZERO,
            forward_late: None,
        }
    }
}

/// The start of a one-key acquire, as the client sends it (`EVALSHA` with 9 elements).
pub const ACQUIRE_1: &[u8] = b"*9\r\n$7\r\nEVALSHA";
/// The start of a lean acquire (`SET key token NX PX ttl`, 6 elements).
pub const ACQUIRE_LEAN: &[u8] = b"*6\r\n$3\r\nSET";
/// The start of a one-key hand-over (`EVALSHA` with 10 elements).
pub const SWAP_1: &[u8] = b"*10\r\n$7\r\nEVALSHA";
/// The start of a one-key release (`EVALSHA` with 6 elements).
pub const RELEASE_1: &[u8] = b"*6\r\n$7\r\nEVALSHA";

impl CutProxy {
    /// Proxies to `upstream` (`redis://host:port`).
    pub fn start(upstream: &str, cut: Cut) -> CutProxy {
        let cuts = Arc::new(AtomicUsize::new(0));
        let budget = Arc::new(AtomicUsize::new(cut.budget.unwrap_or(usize::MAX)));
        let made = cuts.clone();
        let proxy = Proxy::start("ql-cut", upstream, move |client, server, _| {
            if made.load(Ordering::SeqCst) > 0 && !cut.slow_accept.is_zero() {
                std::thread::sleep(cut.slow_accept);
            }
            let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
                return;
            };
            let muted = Arc::new(AtomicBool::new(false));
            let m = muted.clone();
            // Replies, unless muted by a cut.
            let _ = std::thread::Builder::new()
                .name("ql-cut-rd".into())
                .spawn(move || {
                    let (mut from, mut to) = (s2, c2);
                    let mut buf = [0u8; 65536];
                    while let Ok(k @ 1..) = from.read(&mut buf) {
                        if !m.load(Ordering::SeqCst) && to.write_all(&buf[..k]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Both);
                });
            let (budget, made) = (budget.clone(), made.clone());
            // Commands, until one carrying the marker is cut.
            let _ = std::thread::Builder::new()
                .name("ql-cut-wr".into())
                .spawn(move || {
                    let (mut from, mut to) = (client, server);
                    let mut buf = [0u8; 65536];
                    while let Ok(k @ 1..) = from.read(&mut buf) {
                        let chunk = &buf[..k];
                        let hit = chunk.windows(cut.marker.len()).any(|w| w == cut.marker);
                        if hit
                            && budget
                                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
                                    b.checked_sub(1)
                                })
                                .is_ok()
                        {
                            made.fetch_add(1, Ordering::SeqCst);
                            muted.store(true, Ordering::SeqCst);
                            if cut.forward && cut.forward_late.is_none() {
                                let _ = to.write_all(chunk);
                            }
                            std::thread::sleep(cut.close_after);
                            let _ = from.shutdown(Shutdown::Both);
                            if let Some(late) = cut.forward_late {
                                std::thread::sleep(late.saturating_sub(cut.close_after));
                                let _ = to.write_all(chunk);
                                // Let the node read it before the close.
                                std::thread::sleep(Duration::from_millis(50));
                            }
                            break;
                        }
                        if to.write_all(chunk).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Both);
                });
        });
        CutProxy { proxy, cuts }
    }

    pub fn url(&self) -> String {
        self.proxy.url()
    }

    /// How many connections were cut.
    pub fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }
}
