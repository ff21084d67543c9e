//! A Docker API version-rewriting proxy, run as threads inside the test process.
//!
//! testcontainers 0.28 (bollard 0.21) puts `/v1.53/` in front of every request path and
//! never negotiates; an older engine (Debian 12's docker.io 20.10 speaks API 1.41) answers
//! such requests with 400 "client version 1.53 is too new". The proxy listens on a unix
//! socket in a fresh temp directory and forwards every connection to the real engine
//! endpoint. In the client-to-engine direction it parses just enough HTTP/1.1 to find each
//! request head (request line + headers, which may arrive split across reads), rewrites a
//! `/vX.Y/` path prefix newer than the engine's version to the engine's version, and passes
//! bodies through untouched (Content-Length or chunked framing is followed so that the next
//! request head is found; the body is never altered, so its length stays right). After a
//! request that asks for a connection upgrade (attach / exec hijacking) the stream is
//! passed through raw. The engine-to-client direction is a plain byte copy, so streaming
//! responses (logs follow, pull progress, hijacked streams) work unchanged.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::thread;

/// Where the real engine listens.
#[derive(Debug, Clone)]
pub(crate) enum Endpoint {
    Unix(PathBuf),
    /// `host:port`, plain HTTP.
    Tcp(String),
}

enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn connect(ep: &Endpoint) -> io::Result<Stream> {
        Ok(match ep {
            Endpoint::Unix(p) => Stream::Unix(UnixStream::connect(p)?),
            Endpoint::Tcp(a) => Stream::Tcp(TcpStream::connect(a.as_str())?),
        })
    }

    fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    fn shutdown(&self, how: Shutdown) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.flush(),
            Stream::Tcp(s) => s.flush(),
        }
    }
}

/// An API version such as 1.41.
pub(crate) type ApiVersion = (u32, u32);

pub(crate) fn parse_version(s: &str) -> Option<ApiVersion> {
    let (a, b) = s.trim().split_once('.')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// Starts the proxy; returns the path of its unix socket. The listener thread lives for
/// the rest of the process (its socket is in a per-process temp directory).
pub(crate) fn start(upstream: Endpoint, engine: ApiVersion) -> io::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "quorumlock-docker-proxy-{}-{}",
        std::process::id(),
        super::nanos()
    ));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("docker.sock");
    let listener = UnixListener::bind(&path)?;
    thread::Builder::new()
        .name("docker-api-proxy".into())
        .spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let upstream = upstream.clone();
                let _ = thread::Builder::new()
                    .name("docker-api-proxy-conn".into())
                    .spawn(move || serve(Stream::Unix(client), &upstream, engine));
            }
        })?;
    Ok(path)
}

fn serve(client: Stream, upstream: &Endpoint, engine: ApiVersion) {
    let server = match Stream::connect(upstream) {
        Ok(s) => s,
        Err(e) => {
            // Answer with a proper HTTP error so that the client reports something useful.
            let msg = format!("quorumlock docker proxy: cannot reach engine {upstream:?}: {e}");
            let mut c = client;
            let _ = write!(
                c,
                "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{msg}",
                msg.len()
            );
            return;
        }
    };
    let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    // Engine -> client: plain copy.
    let down = thread::Builder::new()
        .name("docker-api-proxy-down".into())
        .spawn(move || {
            let (mut from, mut to) = (server2, client2);
            match io::copy(&mut from, &mut to) {
                Ok(_) => to.shutdown(Shutdown::Write),
                Err(_) => {
                    to.shutdown(Shutdown::Both);
                    from.shutdown(Shutdown::Both);
                }
            }
        });
    // Client -> engine: request heads rewritten.
    let (mut from, mut to) = (client, server);
    match pump_requests(&mut from, &mut to, engine) {
        Ok(()) => to.shutdown(Shutdown::Write),
        Err(_) => {
            to.shutdown(Shutdown::Both);
            from.shutdown(Shutdown::Both);
        }
    }
    if let Ok(down) = down {
        let _ = down.join();
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Waiting for a complete request head.
    Head,
    /// `n` more body bytes to pass through.
    Body(u64),
    /// Waiting for a chunk-size line.
    ChunkSize,
    /// `n` more bytes of chunk data, including the chunk's trailing CRLF.
    ChunkData(u64),
    /// Trailer lines after the last chunk, up to an empty line.
    Trailers,
    /// Upgraded connection: everything passes through.
    Raw,
}

const MAX_HEAD: usize = 1 << 20;

/// Incremental rewriter for the client-to-engine byte stream. `feed` takes whatever a read
/// returned and gives back the bytes to send on; partial heads and chunk-size lines stay
/// buffered until complete.
pub(crate) struct RequestRewriter {
    engine: ApiVersion,
    buf: Vec<u8>,
    state: State,
    upgrade_after_body: bool,
}

impl RequestRewriter {
    pub(crate) fn new(engine: ApiVersion) -> Self {
        RequestRewriter {
            engine,
            buf: Vec::new(),
            state: State::Head,
            upgrade_after_body: false,
        }
    }

    pub(crate) fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        self.buf.extend_from_slice(input);
        loop {
            match self.state {
                State::Raw => {
                    out.append(&mut self.buf);
                    return Ok(());
                }
                State::Head => {
                    let Some(end) = find(&self.buf, b"\r\n\r\n") else {
                        if self.buf.len() > MAX_HEAD {
                            return Err(io::Error::other("request head too large"));
                        }
                        return Ok(());
                    };
                    let head: Vec<u8> = self.buf.drain(..end + 4).collect();
                    let (head, next, upgrade) = rewrite_head(&head, self.engine)?;
                    out.extend_from_slice(&head);
                    self.upgrade_after_body = upgrade;
                    self.state = next;
                    if next == State::Body(0) {
                        self.state = self.after_body();
                    }
                }
                State::Body(n) | State::ChunkData(n) => {
                    if self.buf.is_empty() {
                        return Ok(());
                    }
                    let take = (n.min(self.buf.len() as u64)) as usize;
                    out.extend(self.buf.drain(..take));
                    let left = n - take as u64;
                    self.state = match (self.state, left) {
                        (State::Body(_), 0) => self.after_body(),
                        (State::Body(_), l) => State::Body(l),
                        (_, 0) => State::ChunkSize,
                        (_, l) => State::ChunkData(l),
                    };
                }
                State::ChunkSize => {
                    let Some(end) = find(&self.buf, b"\r\n") else {
                        if self.buf.len() > MAX_HEAD {
                            return Err(io::Error::other("chunk size line too long"));
                        }
                        return Ok(());
                    };
                    let line: Vec<u8> = self.buf.drain(..end + 2).collect();
                    let text = String::from_utf8_lossy(&line[..end]);
                    let hex = text.split(';').next().unwrap_or("").trim();
                    let size = u64::from_str_radix(hex, 16)
                        .map_err(|_| io::Error::other(format!("bad chunk size {text:?}")))?;
                    out.extend_from_slice(&line);
                    self.state = if size == 0 {
                        State::Trailers
                    } else {
                        State::ChunkData(size + 2)
                    };
                }
                State::Trailers => {
                    let Some(end) = find(&self.buf, b"\r\n") else {
                        return Ok(());
                    };
                    out.extend(self.buf.drain(..end + 2));
                    if end == 0 {
                        self.state = self.after_body();
                    }
                }
            }
        }
    }

    fn after_body(&self) -> State {
        if self.upgrade_after_body {
            State::Raw
        } else {
            State::Head
        }
    }
}

fn pump_requests(from: &mut Stream, to: &mut Stream, engine: ApiVersion) -> io::Result<()> {
    let mut rw = RequestRewriter::new(engine);
    let mut input = vec![0u8; 64 * 1024];
    let mut out = Vec::with_capacity(64 * 1024);
    loop {
        let n = from.read(&mut input)?;
        if n == 0 {
            return Ok(());
        }
        out.clear();
        rw.feed(&input[..n], &mut out)?;
        if !out.is_empty() {
            to.write_all(&out)?;
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Rewrites the request line of one head; returns the new head, the body state and whether
/// the connection is upgraded after this request.
fn rewrite_head(head: &[u8], engine: ApiVersion) -> io::Result<(Vec<u8>, State, bool)> {
    let line_end = find(head, b"\r\n").unwrap_or(head.len());
    let line = &head[..line_end];
    let mut out = Vec::with_capacity(head.len());
    // "METHOD SP /vX.Y/rest SP HTTP/1.1"
    let rewritten = (|| {
        let sp = line.iter().position(|&b| b == b' ')?;
        let target = &line[sp + 1..];
        let rest = target.strip_prefix(b"/v")?;
        let slash = rest.iter().position(|&b| b == b'/')?;
        let version = parse_version(std::str::from_utf8(&rest[..slash]).ok()?)?;
        if version <= engine {
            return None;
        }
        let mut l = line[..sp + 1].to_vec();
        l.extend_from_slice(format!("/v{}.{}", engine.0, engine.1).as_bytes());
        l.extend_from_slice(&rest[slash..]);
        Some(l)
    })();
    out.extend_from_slice(rewritten.as_deref().unwrap_or(line));
    out.extend_from_slice(&head[line_end..]);

    let text = String::from_utf8_lossy(&head[line_end..]);
    let mut length: u64 = 0;
    let mut chunked = false;
    let mut upgrade = false;
    for h in text.split("\r\n") {
        let Some((name, value)) = h.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        match name.as_str() {
            "content-length" => {
                length = value
                    .parse()
                    .map_err(|_| io::Error::other(format!("bad Content-Length {value:?}")))?
            }
            "transfer-encoding" => chunked = value.to_ascii_lowercase().contains("chunked"),
            "upgrade" => upgrade = true,
            "connection" => upgrade |= value.to_ascii_lowercase().contains("upgrade"),
            _ => {}
        }
    }
    let state = if chunked {
        State::ChunkSize
    } else {
        State::Body(length)
    };
    Ok((out, state, upgrade))
}

#[cfg(test)]
mod tests {
    use super::RequestRewriter;

    /// Feeds `input` in pieces of `step` bytes and returns everything passed on.
    fn run(input: &[u8], step: usize) -> Vec<u8> {
        let mut rw = RequestRewriter::new((1, 41));
        let mut out = Vec::new();
        for piece in input.chunks(step) {
            rw.feed(piece, &mut out).expect("valid HTTP");
        }
        out
    }

    #[test]
    fn proxy_rewrites_each_request_head_and_never_a_body() {
        let input: &[u8] = b"POST /v1.53/containers/create?name=x HTTP/1.1\r\nHost: d\r\n\
            Content-Length: 12\r\n\r\n/v1.53/body!\
            GET /v1.53/containers/x/json HTTP/1.1\r\nHost: d\r\n\r\n\
            POST /v1.53/images/load HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n\
            7\r\n/v1.53/\r\n0\r\n\r\n\
            GET /v1.40/version HTTP/1.1\r\n\r\n\
            GET /_ping HTTP/1.1\r\n\r\n";
        let want: &[u8] = b"POST /v1.41/containers/create?name=x HTTP/1.1\r\nHost: d\r\n\
            Content-Length: 12\r\n\r\n/v1.53/body!\
            GET /v1.41/containers/x/json HTTP/1.1\r\nHost: d\r\n\r\n\
            POST /v1.41/images/load HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n\
            7\r\n/v1.53/\r\n0\r\n\r\n\
            GET /v1.40/version HTTP/1.1\r\n\r\n\
            GET /_ping HTTP/1.1\r\n\r\n";
        // Every split point, including one inside the "/v1.53/" prefix.
        for step in [1, 2, 3, 5, 7, 64, input.len()] {
            assert_eq!(
                String::from_utf8_lossy(&run(input, step)),
                String::from_utf8_lossy(want),
                "step {step}"
            );
        }
    }

    #[test]
    fn proxy_passes_an_upgraded_stream_through_raw() {
        let input: &[u8] = b"POST /v1.53/containers/x/attach?stream=1 HTTP/1.1\r\n\
            Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n\
            GET /v1.53/not-a-request HTTP/1.1\r\n\r\nraw bytes";
        let out = run(input, 3);
        assert_eq!(
            String::from_utf8_lossy(&out),
            "POST /v1.41/containers/x/attach?stream=1 HTTP/1.1\r\n\
             Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n\
             GET /v1.53/not-a-request HTTP/1.1\r\n\r\nraw bytes"
        );
    }
}
