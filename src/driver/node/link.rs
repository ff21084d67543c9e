//! [`Link`]: one connection as the node engine sees it, whatever carries its
//! bytes (a socket in production, a simulated connection in the tests).

use redis::Value;

use crate::driver::conn_state::{ConnState, InFlight};

/// One connection, whatever carries its bytes.
pub(crate) trait Link {
    /// What a wait says is ready on it.
    type Ready: Copy;
    /// What a thread waits on for it while it is shared (see
    /// [`crate::driver::node::multiplexed`]).
    type Handle: Send + Sync;
    /// That handle, when it can be had.
    fn handle(&self) -> Option<Self::Handle>;
    /// The connection's protocol state.
    fn wire(&self) -> &ConnState;
    /// The same, to change.
    fn wire_mut(&mut self) -> &mut ConnState;
    /// Writes what the connection takes now of its connection state's output. An error
    /// marks it broken.
    fn flush(&mut self) -> std::io::Result<()>;
    /// Handles what a wait reported: writes the rest of a command, reads
    /// what arrived.
    fn on_ready(&mut self, ready: Self::Ready) -> std::io::Result<()>;
    /// The next complete reply read, with the command it answers.
    fn next_reply(&mut self) -> std::io::Result<Option<(InFlight, Value)>>;
    /// Whether part of a command is still unwritten.
    fn wants_write(&self) -> bool;
    /// Reads what has arrived, without waiting, until nothing more is
    /// there: `Err` when the connection was closed (what arrived before
    /// the close is read first).
    fn read_all(&mut self) -> std::io::Result<()>;
    /// Gives the connection up: sends what [`ConnState::give_up`] queues, and
    /// marks it broken.
    fn abandon(&mut self);
}
