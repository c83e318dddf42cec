//! What a test needs from outside the workspace (a Python with the protocol kits, a PostgreSQL
//! server), named by an environment variable: a test without it says why and returns, unless the
//! matching `SPACEBOT_REQUIRE_*` is `1` (CI), when it fails.

/// The value of `var`, or `None` after saying on stderr that the test is skipped for want of
/// `what`. Panics when `require` is set to `1`: under CI a test that cannot run fails.
///
/// ```
/// // Unset, not required: the test is skipped.
/// assert_eq!(spacebot_core::testing::external::env_or_skip(
///     "SPACEBOT_DOC_UNSET_VAR", "SPACEBOT_DOC_UNSET_REQUIRE", "nothing"), None);
/// ```
pub fn env_or_skip(var: &str, require: &str, what: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v),
        _ => {
            assert!(
                std::env::var(require).as_deref() != Ok("1"),
                "{require}=1 but {var} is not set"
            );
            eprintln!("skipped: {var} is not set ({what})");
            None
        }
    }
}

/// `SPACEBOT_PYTHON`: a Python with PyPI's `mcp`, `opentelemetry-proto` and `a2a-sdk` (made by
/// `.ci/python`); required under `SPACEBOT_REQUIRE_PYTHON=1`.
pub fn python() -> Option<String> {
    env_or_skip(
        "SPACEBOT_PYTHON",
        "SPACEBOT_REQUIRE_PYTHON",
        "a Python with the protocol kits; see .ci/python",
    )
}

/// `DATABASE_URL`: a PostgreSQL server; required under `SPACEBOT_REQUIRE_POSTGRES=1`.
pub fn database_url() -> Option<String> {
    env_or_skip(
        "DATABASE_URL",
        "SPACEBOT_REQUIRE_POSTGRES",
        "a PostgreSQL server; see README",
    )
}
