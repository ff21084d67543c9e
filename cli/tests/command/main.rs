//! The `quorumlock` command's tests, on throwaway Redis nodes shared by every module
//! (the library's node harness, `tests/common`).

#[path = "../../../tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

mod cli;
mod lead;
mod messages;
mod processes;
