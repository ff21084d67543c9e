//! The lock engine above the nodes: the [`transport::Transport`] port that
//! drivers implement, the local queue with its hand-over, and the renewal
//! thread.

pub(crate) mod engine;
pub(crate) mod queue;
pub(crate) mod settings;
pub(crate) mod spans;
pub(crate) mod state;
pub(crate) mod transport;
pub(crate) mod watchdog;
