//! A round's place on a multiplexed connection, as the round sees it: its connection; and
//! the multiplexed connection's connection given back when the last round leaves.

use std::io;

use redis::Value;

#[cfg(test)]
use super::count;
use super::{Multiplexed, RoundConn};
use crate::driver::conn_state::{ConnState, InFlight};
use crate::driver::node::link::Link;

impl<C: Link> Drop for RoundConn<C> {
    fn drop(&mut self) {
        let made = self.wire.made;
        let wire = std::mem::replace(&mut self.wire, ConnState::new(made));
        self.line.leave(self.id, wire);
    }
}

impl<C: Link> Link for RoundConn<C> {
    type Ready = ();
    type Handle = ();

    fn handle(&self) -> Option<()> {
        None
    }

    fn wire(&self) -> &ConnState {
        &self.wire
    }

    fn wire_mut(&mut self) -> &mut ConnState {
        &mut self.wire
    }

    fn flush(&mut self) -> io::Result<()> {
        self.line.send(self.id, &mut self.wire)
    }

    fn on_ready(&mut self, (): ()) -> io::Result<()> {
        // The reader read for it; a close comes with the replies.
        Ok(())
    }

    fn next_reply(&mut self) -> io::Result<Option<(InFlight, Value)>> {
        match self.line.take(self.id) {
            Some(Ok((v, facts))) => {
                if let Some(f) = facts {
                    self.wire.adopt(f);
                }
                self.wire.answer(v).map(Some)
            }
            Some(Err(e)) => {
                self.wire.broken = true;
                Err(e)
            }
            None => Ok(None),
        }
    }

    fn wants_write(&self) -> bool {
        // Its bytes are the multiplexed connection's once flushed.
        false
    }

    fn read_all(&mut self) -> io::Result<()> {
        self.line.pump(None);
        Ok(())
    }

    fn abandon(&mut self) {
        let now = self.line.node.clock.now();
        self.wire.give_up(now);
        self.wire.broken = true;
        let _ = self.flush();
    }
}

impl<C: Link> Drop for Multiplexed<C> {
    /// No round left on it: the connection goes back to its pool owing what
    /// the rounds that left are owed, each entry its owner's own.
    fn drop(&mut self) {
        let st = self.state.get_mut();
        #[cfg(test)]
        if st.closed_batches {
            count(&self.node.line_stats.closed_batches);
        }
        if st.closed.is_some() {
            return;
        }
        if st.conn.wants_write() {
            // A command half-written: the connection cannot be reused.
            st.conn.wire_mut().broken = true;
            return;
        }
        let owners = &mut st.owners;
        let unshared = st.conn.wire_mut().unshare(|id| {
            owners
                .iter_mut()
                .find(|o| o.id == id)
                .and_then(|o| o.orphan.as_mut())
                .and_then(|w| w.answered().ok())
        });
        if !unshared {
            st.conn.wire_mut().broken = true;
        }
    }
}
