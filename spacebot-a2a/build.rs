//! Tells the tests against PyPI's protocol kits whether they can run here (see `spacebot-probe`): where
//! their tool cannot be had they are compiled as ignored, with the reason, so a test run reports
//! them as not run instead of passed.

use spacebot_probe::{Tool, probe};

fn main() {
    probe(&[Tool::Python]);
}
