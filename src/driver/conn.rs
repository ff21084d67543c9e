//! One connection to a node: a non-blocking `TcpStream` speaking RESP, in
//! the clear or (feature `tls-rustls`) through rustls.
//!
//! The `redis` crate encodes commands and decodes replies; this module only
//! moves bytes and finds where one reply ends, so that a round can send to
//! every node, wait on all sockets at once with `poll(2)` and take replies in
//! the order they arrive.
//!
//! What a connection owes (the replies to the commands sent on it, and the
//! bytes not yet written) is its [`ConnState`], which does no I/O: a round that
//! ended before a slow node answered leaves its reply owed there, and the
//! next user of the connection reads it first.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use redis::Value;

use crate::clock::after;
use crate::driver::conn_state::{ConnState, InFlight, Setup};
use crate::driver::resp::frame_len;

/// The smallest socket timeout we set (`Some(ZERO)` is an error for std).
pub(crate) const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// Most replies one connection may owe before it is given up. Commands are
/// pipelined behind replies still owed by a slow node; a node that does not
/// answer at all is caught before this, when its oldest reply is overdue
/// (so this only bounds memory: a few hundred bytes a reply).
pub(crate) const MAX_PENDING: usize = 1024;

/// The most one read takes off a socket.
const READ_CHUNK: usize = 8192;

/// Where and how to connect: address, credentials, database, TLS.
#[derive(Clone)]
pub(crate) struct Target {
    pub host: String,
    pub port: u16,
    pub username: Option<String>,
    pub password: Option<String>,
    pub db: i64,
    /// For `rediss://` nodes.
    #[cfg(feature = "tls-rustls")]
    pub tls: Option<crate::driver::tls::TlsTarget>,
}

/// The socket, in the clear or under TLS.
#[derive(Debug)]
enum Stream {
    Plain(TcpStream),
    #[cfg(feature = "tls-rustls")]
    Tls(Box<crate::driver::tls::TlsStream>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            #[cfg(feature = "tls-rustls")]
            Stream::Tls(t) => &t.tcp,
        }
    }

    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            #[cfg(feature = "tls-rustls")]
            Stream::Tls(t) => t.write(buf),
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            #[cfg(feature = "tls-rustls")]
            Stream::Tls(t) => t.read(buf),
        }
    }

    /// Encrypted bytes still to write (TLS only).
    fn wants_write(&self) -> bool {
        match self {
            Stream::Plain(_) => false,
            #[cfg(feature = "tls-rustls")]
            Stream::Tls(t) => t.wants_write(),
        }
    }

    fn push(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(_) => Ok(()),
            #[cfg(feature = "tls-rustls")]
            Stream::Tls(t) => t.push(),
        }
    }

    /// Whether a short read means the socket is drained (not so under TLS:
    /// rustls hands out one record's bytes at a time).
    fn short_read_drains(&self) -> bool {
        matches!(self, Stream::Plain(_))
    }
}

/// A connection to one node: its socket, what has been read of it, and
/// what it owes ([`ConnState`]).
#[derive(Debug)]
pub(crate) struct Conn {
    stream: Stream,
    rbuf: Vec<u8>,
    /// Where a read lands before `rbuf` takes it: made (zeroed) once, not
    /// per read.
    chunk: Box<[u8]>,
    /// How much of `wire`'s output the socket took.
    wpos: usize,
    /// The commands sent and the replies owed; the bytes to write.
    pub wire: ConnState,
    /// The same socket, to poll while the connection is in use elsewhere
    /// (see [`poll_handle`](Self::poll_handle)); made once.
    poll: Option<std::sync::Arc<TcpStream>>,
}

/// What a connection is for, and so which commands it sends at connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum For {
    /// A pooled connection for rounds: the scripts loaded, `INFO`, and the
    /// metadata's id (written where missing).
    Rounds,
    /// `Redlock::check`: as for rounds, but the id only read.
    Check,
    /// A status query or a last release: nothing (no write, nothing a
    /// write-paused node would hold back).
    Query,
}

/// Why a connect failed: the node refused or did not answer (its health
/// changes), or it answered the handshake with an error.
#[derive(Debug)]
pub(crate) enum ConnectError {
    /// Refused, reset, unreachable, or no answer within the timeout.
    Io(io::Error),
    /// SELECT (or the first PING) was answered with an error.
    Handshake(String),
    /// AUTH was refused (`WRONGPASS`), or the node wants a password none
    /// was given for (`NOAUTH`): the server's words.
    Auth(String),
    /// The TLS handshake failed: the node's certificate was refused, or
    /// the node refused ours (or our lack of one).
    #[cfg_attr(not(feature = "tls-rustls"), allow(dead_code))]
    Tls(String),
}

impl ConnectError {
    /// The kind of node failure this is.
    pub(crate) fn kind(&self) -> crate::error::NodeErrorKind {
        use crate::error::NodeErrorKind;
        match self {
            ConnectError::Io(e) if e.kind() == io::ErrorKind::TimedOut => NodeErrorKind::Timeout,
            ConnectError::Io(_) => NodeErrorKind::Unavailable,
            ConnectError::Handshake(_) => NodeErrorKind::Server,
            ConnectError::Auth(_) => NodeErrorKind::Auth,
            ConnectError::Tls(_) => NodeErrorKind::Tls,
        }
    }

    /// The I/O error beneath, for [`NodeError`](crate::NodeError)'s
    /// `source` (the same kind and message: `io::Error` is not `Clone`).
    pub(crate) fn io(&self) -> Option<crate::error::Source> {
        match self {
            ConnectError::Io(e) => {
                Some(std::sync::Arc::new(io::Error::new(e.kind(), e.to_string())))
            }
            _ => None,
        }
    }

    /// The message, without what [`kind`](Self::kind) already says.
    pub(crate) fn detail(&self) -> String {
        match self {
            ConnectError::Tls(e) | ConnectError::Auth(e) => e.clone(),
            e => e.to_string(),
        }
    }
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Io(e) => write!(f, "{e}"),
            ConnectError::Handshake(e) => write!(f, "handshake refused: {e}"),
            ConnectError::Auth(e) => write!(f, "credentials refused: {e}"),
            ConnectError::Tls(e) => write!(f, "TLS handshake failed: {e}"),
        }
    }
}

impl std::error::Error for ConnectError {}

impl From<io::Error> for ConnectError {
    fn from(e: io::Error) -> Self {
        #[cfg(feature = "tls-rustls")]
        if let Some(why) = crate::driver::tls::tls_failure(&e) {
            return ConnectError::Tls(why);
        }
        ConnectError::Io(e)
    }
}

impl Conn {
    /// Connects within `timeout` per resolved address (name resolution itself
    /// is not bounded), runs the TLS handshake (within `timeout` again),
    /// authenticates and selects the database, each within `timeout`; then
    /// queues the setup commands `purpose` needs (see [`For`]).
    pub(crate) fn connect(
        t: &Target,
        timeout: Duration,
        purpose: For,
    ) -> Result<Conn, ConnectError> {
        let timeout = timeout.max(MIN_TIMEOUT);
        let mut last = None;
        let mut stream = None;
        for addr in (t.host.as_str(), t.port).to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let stream = match stream {
            Some(s) => s,
            None => {
                return Err(last
                    .unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))
                    .into())
            }
        };
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        #[cfg(feature = "tls-rustls")]
        let stream = match &t.tls {
            Some(tls) => Stream::Tls(Box::new(crate::driver::tls::TlsStream::new(stream, tls)?)),
            None => Stream::Plain(stream),
        };
        #[cfg(not(feature = "tls-rustls"))]
        let stream = Stream::Plain(stream);
        let mut conn = Conn {
            poll: stream.tcp().try_clone().ok().map(std::sync::Arc::new),
            stream,
            rbuf: Vec::with_capacity(512),
            chunk: vec![0; READ_CHUNK].into_boxed_slice(),
            wpos: 0,
            wire: ConnState::new(Instant::now()),
        };
        conn.tls_handshake(timeout)?;
        let mut checked = false;
        if let Some(password) = &t.password {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = &t.username {
                auth.arg(user);
            }
            auth.arg(password);
            conn.handshake(&auth.get_packed_command(), timeout)?;
            checked = true;
        }
        if t.db != 0 {
            conn.handshake(
                &redis::cmd("SELECT").arg(t.db).get_packed_command(),
                timeout,
            )?;
            checked = true;
        }
        if !checked && !conn.stream.short_read_drains() {
            // Under TLS 1.3 a node refuses a client certificate (or its
            // absence) only after our side of the handshake is done: one
            // PING makes that a connect error, not a failed round. (A plain
            // connection is not made to wait for an answer: connects run
            // one at a time on the node's thread, and a round that needs a
            // new connection would wait for the extra round trip.)
            conn.handshake(&redis::cmd("PING").get_packed_command(), timeout)?;
        }
        // Load the scripts so that rounds never meet NOSCRIPT on a node that
        // answers late, and ask who the server is. Not waited for: the replies
        // are read ahead of the first round's (in order), so a connect costs
        // one handshake and a round never counts an answer whose server it
        // does not know; an error reply (an ACL without SCRIPT or INFO) is
        // fine: rounds fall back to EVAL, and the checks to what is known.
        queue_connect_commands(&mut conn.wire, purpose, Instant::now());
        conn.flush()?;
        Ok(conn)
    }

    /// Runs the TLS handshake to its end (nothing to do in the clear).
    fn tls_handshake(&mut self, timeout: Duration) -> Result<(), ConnectError> {
        #[cfg(feature = "tls-rustls")]
        if let Stream::Tls(t) = &mut self.stream {
            let deadline = after(Instant::now(), timeout);
            loop {
                t.push()?;
                if !t.is_handshaking() {
                    return Ok(());
                }
                let now = Instant::now();
                if now >= deadline {
                    self.wire.broken = true;
                    return Err(ConnectError::Io(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no reply to the TLS handshake (is this a TLS port?)",
                    )));
                }
                let mut fds = [PollFd::new(&t.tcp, {
                    let mut f = PollFlags::IN;
                    if t.wants_write() {
                        f |= PollFlags::OUT;
                    }
                    f
                })];
                poll(&mut fds, deadline.saturating_duration_since(now))?;
                if fds[0].revents().is_empty() {
                    continue;
                }
                match t.pull() {
                    Ok(true) => {}
                    Ok(false) => {
                        return Err(ConnectError::Io(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            "connection closed during the TLS handshake",
                        )))
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let _ = timeout;
        Ok(())
    }

    /// Sends one setup command and waits for `+OK` (`+PONG` for `PING`).
    fn handshake(&mut self, cmd: &[u8], timeout: Duration) -> Result<(), ConnectError> {
        let now = Instant::now();
        self.wire.queue(cmd, now, false);
        self.flush()?;
        match self.wait_reply(after(now, timeout))? {
            Value::Okay => Ok(()),
            Value::SimpleString(s) if s == "PONG" => Ok(()),
            Value::ServerError(e) if is_auth_error(&e) => Err(ConnectError::Auth(server_text(&e))),
            Value::ServerError(e) => Err(ConnectError::Handshake(server_text(&e))),
            v => Err(ConnectError::Handshake(format!("{v:?}"))),
        }
    }

    /// Blocks (on this connection alone) until the next reply or `deadline`.
    pub(crate) fn wait_reply(&mut self, deadline: Instant) -> io::Result<Value> {
        loop {
            if let Some((_, v)) = self.next_reply()? {
                return Ok(v);
            }
            let now = Instant::now();
            if now >= deadline {
                self.wire.broken = true;
                return Err(io::ErrorKind::TimedOut.into());
            }
            let want_out = self.wants_write();
            let mut fds = [self.poll_fd(want_out)];
            poll(&mut fds, deadline.saturating_duration_since(now))?;
            let ready = fds[0].revents();
            self.on_ready(ready)?;
        }
    }

    /// Gives up the connection: first sends (without waiting) what
    /// [`ConnState::give_up`] queues, so that the node, when it gets to a SET
    /// still in flight, deletes the key right after it.
    pub(crate) fn abandon(&mut self) {
        if self.wire.give_up(Instant::now()) {
            let _ = self.flush();
        }
        self.wire.broken = true;
        // Closed now, after what was just sent (not when the last round lets go).
        let _ = self.stream.tcp().shutdown(std::net::Shutdown::Write);
    }

    /// Writes what the socket takes now. An error marks the connection broken.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        if let Err(e) = self.stream.push() {
            self.wire.broken = true;
            return Err(e);
        }
        loop {
            let out = self.wire.output();
            if self.wpos >= out.len() {
                break;
            }
            match self.stream.write(&out[self.wpos..]) {
                Ok(0) => {
                    self.wire.broken = true;
                    return Err(io::ErrorKind::WriteZero.into());
                }
                Ok(k) => self.wpos += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.wire.broken = true;
                    return Err(e);
                }
            }
        }
        // All written: the buffer is reused from its start.
        self.wire.written(self.wpos);
        self.wpos = 0;
        Ok(())
    }

    /// Whether part of a command is still unwritten.
    pub(crate) fn wants_write(&self) -> bool {
        self.wpos < self.wire.output().len() || self.stream.wants_write()
    }

    /// Reads what has arrived, without waiting; `to_end`: until the socket
    /// would block even after a short read, so that a close right behind
    /// the last reply is seen. End of stream or an error marks the
    /// connection broken.
    pub(crate) fn fill(&mut self, to_end: bool) -> io::Result<()> {
        let chunk = &mut self.chunk;
        loop {
            match self.stream.read(chunk) {
                Ok(0) => {
                    self.wire.broken = true;
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "connection closed by the node",
                    ));
                }
                Ok(k) => {
                    self.rbuf.extend_from_slice(&chunk[..k]);
                    if !to_end && k < chunk.len() && self.stream.short_read_drains() {
                        return Ok(());
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.wire.broken = true;
                    return Err(e);
                }
            }
        }
    }

    /// Handles what `poll` reported for this connection: writes the rest of
    /// a command, reads what arrived.
    pub(crate) fn on_ready(&mut self, ready: PollFlags) -> io::Result<()> {
        if ready.contains(PollFlags::OUT) {
            self.flush()?;
        }
        if ready.intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR) {
            self.fill(false)?;
        }
        Ok(())
    }

    /// Takes the next complete reply off the buffer, with the command it
    /// answers. A malformed or unexpected reply marks the connection broken.
    pub(crate) fn next_reply(&mut self) -> io::Result<Option<(InFlight, Value)>> {
        while let Some(value) = self.take_frame("malformed reply")? {
            match value {
                Ok(v) => {
                    if let Some(r) = self.wire.gather(v)? {
                        return Ok(Some(r));
                    }
                }
                Err(e) => {
                    // The frame answers the command owed, whether or not it
                    // parses: a garbled reply still says that command ran.
                    let _ = self.wire.answered();
                    return Err(self.wire.protocol_error(&e.to_string()));
                }
            }
        }
        Ok(None)
    }

    /// Takes the next complete frame off the buffer without pairing it with
    /// a command owed (a subscriber connection's pushes and answers).
    pub(crate) fn next_frame(&mut self) -> io::Result<Option<Value>> {
        self.take_frame("malformed frame")?
            .transpose()
            .map_err(|e| self.wire.protocol_error(&e.to_string()))
    }

    /// The next complete frame off the buffer, decoded or not; `Err` (the
    /// connection broken, saying `malformed`) when the bytes are not RESP.
    fn take_frame(&mut self, malformed: &str) -> io::Result<Option<redis::RedisResult<Value>>> {
        let len = match frame_len(&self.rbuf) {
            Ok(Some(len)) => len,
            Ok(None) => return Ok(None),
            Err(()) => return Err(self.wire.protocol_error(malformed)),
        };
        let value = crate::driver::resp::parse(&self.rbuf[..len]);
        self.rbuf.drain(..len);
        Ok(Some(value))
    }

    /// A handle to poll this connection's socket by while the connection
    /// itself is in use elsewhere (the same socket, duplicated at connect).
    pub(crate) fn poll_handle(&self) -> Option<std::sync::Arc<TcpStream>> {
        self.poll.clone()
    }

    /// The poll entry for this connection.
    pub(crate) fn poll_fd(&self, out: bool) -> PollFd<'_> {
        let mut flags = PollFlags::IN;
        if out {
            flags |= PollFlags::OUT;
        }
        PollFd::new(self.stream.tcp(), flags)
    }
}

/// A server's error as it wrote it: `ERR max number of clients reached`.
pub(crate) fn server_text(e: &redis::ServerError) -> String {
    match e.details() {
        Some(d) => format!("{} {d}", e.code()),
        None => e.code().to_owned(),
    }
}

/// Whether the server refused this client's credentials: a wrong password
/// or user (`WRONGPASS`), none where it wants one (`NOAUTH`), or one where
/// it has none (`ERR AUTH <password> called without any password
/// configured`).
pub(crate) fn is_auth_error(e: &redis::ServerError) -> bool {
    matches!(e.code(), "WRONGPASS" | "NOAUTH")
        || (e.code() == "ERR"
            && e.details()
                .is_some_and(|d| d.contains("called without any password configured")))
}

/// Queues what a new connection for `purpose` sends before its first
/// command (see [`For`]).
pub(crate) fn queue_connect_commands(wire: &mut ConnState, purpose: For, now: Instant) {
    if purpose != For::Query {
        for load in &crate::driver::scripts::load_commands() {
            wire.queue_setup(load, now, Setup::Load);
        }
        wire.queue_setup(&redis::cmd("INFO").get_packed_command(), now, Setup::Info);
    }
    match purpose {
        For::Rounds => wire.queue_setup(
            &crate::driver::scripts::history_id_command(),
            now,
            Setup::History,
        ),
        // Read only (the script writes the id where it is missing, and a
        // node under `CLIENT PAUSE … WRITE` holds every write).
        For::Check => wire.queue_setup(
            &redis::cmd("HGET")
                .arg(crate::driver::scripts::META_KEY)
                .arg("id")
                .get_packed_command(),
            now,
            Setup::History,
        ),
        For::Query => {}
    }
}

pub(crate) use crate::driver::poll::{is_close, poll, PollFd, PollFlags};

#[cfg(test)]
mod tests {
    use std::io::Write as _;
    use std::net::TcpListener;

    use super::*;

    /// A password given to a node that has none configured is refused as
    /// credentials too (Redis and Valkey answer `ERR AUTH <password> called
    /// without any password configured`): the node URL to fix, not a node
    /// that answered (`quorumlock status` counted it as an answer).
    #[test]
    fn a_password_the_node_does_not_want_is_refused_credentials() {
        let error = |text: &[u8]| match redis::parse_redis_value(text) {
            Ok(redis::Value::ServerError(e)) => e,
            v => panic!("{v:?}"),
        };
        for text in [
            &b"-WRONGPASS invalid username-password pair or user is disabled.\r\n"[..],
            b"-NOAUTH Authentication required.\r\n",
            b"-ERR AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?\r\n",
        ] {
            assert!(is_auth_error(&error(text)), "{}", String::from_utf8_lossy(text));
        }
        for text in [
            &b"-ERR unknown command 'AUTH'\r\n"[..],
            b"-LOADING loading\r\n",
        ] {
            assert!(
                !is_auth_error(&error(text)),
                "{}",
                String::from_utf8_lossy(text)
            );
        }
    }

    /// A connection to a local listener that answers with `reply`.
    fn answered_with(reply: &[u8]) -> Conn {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let target = Target::local(listener.local_addr().expect("addr").port());
        let mut c = Conn::connect(&target, Duration::from_secs(2), For::Query).expect("connect");
        let (mut server, _) = listener.accept().expect("accept");
        c.wire.queue(b"*1\r\n$4\r\nPING\r\n", Instant::now(), true);
        c.flush().expect("sent");
        server.write_all(reply).expect("reply");
        let deadline = after(Instant::now(), Duration::from_secs(2));
        while c.rbuf.len() < reply.len() && Instant::now() < deadline {
            let _ = c.fill(false);
            std::thread::sleep(Duration::from_millis(1));
        }
        c
    }

    /// A node that refuses the password (`WRONGPASS`) is a configuration
    /// error, named as one, with the server's words, not a server error.
    #[test]
    fn refused_credentials_are_their_own_kind() {
        use std::io::Read as _;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut target = Target::local(listener.local_addr().expect("addr").port());
        target.password = Some("wrong".into());
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut buf = [0u8; 256];
            let _ = s.read(&mut buf);
            let _ =
                s.write_all(b"-WRONGPASS invalid username-password pair or user is disabled.\r\n");
        });
        let e = Conn::connect(&target, Duration::from_secs(2), For::Query).expect_err("refused");
        let _ = server.join();
        assert_eq!(e.kind(), crate::error::NodeErrorKind::Auth, "{e}");
        assert_eq!(
            e.detail(),
            "WRONGPASS invalid username-password pair or user is disabled."
        );
    }

    /// A garbled reply still answers the command it follows: that command ran,
    /// and is not owed any more (a write it carried cannot land later).
    #[test]
    fn a_garbled_reply_answers_its_command() {
        let mut c = answered_with(b":abc\r\n");
        let e = c.next_reply().expect_err("not RESP");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(!c.wire.awaits_wanted(), "the command was answered");
        assert!(c.wire.broken);
    }

    #[test]
    fn a_reply_pairs_with_the_oldest_command_owed() {
        let mut c = answered_with(b"+PONG\r\n");
        let (p, v) = c.next_reply().expect("read").expect("a reply");
        assert!(p.wanted);
        assert_eq!(v, Value::SimpleString("PONG".into()));
        assert!(c.wire.pending().is_empty());
    }
}
