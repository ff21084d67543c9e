//! A round's place on a line, as the round sees it: its connection.

use std::io;

use redis::Value;

use super::Share;
use crate::driver::node::link::Link;
use crate::driver::wire::{Pending, Wire};

impl<C: Link> Drop for Share<C> {
    fn drop(&mut self) {
        let made = self.wire.made;
        let wire = std::mem::replace(&mut self.wire, Wire::new(made));
        self.line.leave(self.id, wire);
    }
}

impl<C: Link> Link for Share<C> {
    type Ready = ();
    type Handle = ();

    fn handle(&self) -> Option<()> {
        None
    }

    fn wire(&self) -> &Wire {
        &self.wire
    }

    fn wire_mut(&mut self) -> &mut Wire {
        &mut self.wire
    }

    fn flush(&mut self) -> io::Result<()> {
        self.line.send(self.id, &mut self.wire)
    }

    fn on_ready(&mut self, (): ()) -> io::Result<()> {
        // The reader read for it; a close comes with the replies.
        Ok(())
    }

    fn next_reply(&mut self) -> io::Result<Option<(Pending, Value)>> {
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
        // Its bytes are the line's once flushed.
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
