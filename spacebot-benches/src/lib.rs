//! The spacebot workspace's benchmarks live in this crate's `benches/` (criterion): run them with
//! `cargo bench -p spacebot-benches` (one with `--bench NAME`). They are a crate of their own so
//! that the facade crate's examples (`cargo run --example delegation`) never build criterion.
//! Nothing here is published; the library is empty.
