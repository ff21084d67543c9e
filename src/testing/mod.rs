//! Test-only doubles: in-memory fake nodes and the deterministic simulation.

pub(crate) mod fake;
mod fencing_checks;
pub(crate) mod logs;
mod scripts_agree;
pub(crate) mod sim;
pub(crate) mod store;
