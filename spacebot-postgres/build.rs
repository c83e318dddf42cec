//! Tells the PostgreSQL tests whether they can run here (see `spacebot-probe`): where
//! their tool cannot be had they are compiled as ignored, with the reason, so a test run reports
//! them as not run instead of passed.

use spacebot_probe::{Tool, probe};

fn main() {
    // `sqlx::migrate!` embeds the migrations at compile time.
    println!("cargo::rerun-if-changed=migrations");
    probe(&[Tool::Postgres]);
}
