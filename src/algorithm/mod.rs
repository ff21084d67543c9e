//! The rules, free of I/O: what counts as a vote, when a round is decided,
//! validity and drift, the delayed-restart rule, and each node's health.
//!
//! Nothing here sends a command, takes a lock or reads a clock: every input
//! (answers, instants, settings) is passed in, so the same code decides for
//! the production driver, the fake nodes and the simulation.

pub(crate) mod health;
pub(crate) mod quorum;
pub(crate) mod restart;
pub(crate) mod round;
pub(crate) mod server;
