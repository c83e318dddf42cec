//! Tells the facade crate's PostgreSQL tests and its telemetry tests (against PyPI's
//! `opentelemetry-proto`) whether they can run here (see `spacebot-probe`): where their tool
//! cannot be had they are compiled as ignored, with the reason, so a test run reports them as not
//! run instead of passed.

use spacebot_probe::{Tool, probe};

fn main() {
    probe(&[Tool::Postgres, Tool::Python]);
}
