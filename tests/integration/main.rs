//! The integration-test binary: one binary, so that the Redis nodes of `common::shared()`
//! are started once and shared by every module's tests.

#[path = "../common/mod.rs"]
mod common;

mod degraded;
mod harness;
mod lock;
mod watchdog;
