//! The crash test's pieces: the failpoint wrapper, the workload the child runs, and the checks.
#![allow(unreachable_pub, dead_code)]

pub mod failpoint;
pub mod verify;
pub mod workload;
