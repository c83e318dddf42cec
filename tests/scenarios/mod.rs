//! Behaviour scenarios through the public API, each taking the stores to run on.
pub mod junctions;
