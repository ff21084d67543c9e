//! Test-only doubles: in-memory fake nodes and the deterministic simulation.

pub(crate) mod fake;
pub(crate) mod sim;
