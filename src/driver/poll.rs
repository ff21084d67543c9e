//! Waiting on sockets (`poll(2)`) and telling a close from other errors.

use std::io;
use std::time::Duration;

/// Whether `e` says the connection was closed or reset under us (not a
/// timeout, not a reply): no answer from the node, on that connection.
pub(crate) fn is_close(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::NotConnected
    )
}

pub(crate) use rustix::event::{PollFd, PollFlags};

/// `poll(2)` for at most `wait` (nanosecond precision where the OS has it).
pub(crate) fn poll(fds: &mut [PollFd<'_>], wait: Duration) -> io::Result<usize> {
    let ts = rustix::event::Timespec {
        tv_sec: i64::try_from(wait.as_secs())
            .unwrap_or(i64::MAX)
            .min(86_400),
        tv_nsec: wait.subsec_nanos().into(),
    };
    match rustix::event::poll(fds, Some(&ts)) {
        Ok(n) => Ok(n),
        Err(rustix::io::Errno::INTR) => Ok(0),
        Err(e) => Err(e.into()),
    }
}
