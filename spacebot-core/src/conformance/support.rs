//! The suite's error type and the checks its functions use.

use std::fmt;

use crate::error::StoreError;
use crate::ids::AgentId;

/// Why a store failed a conformance check.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum ConformanceError {
    /// A check on the store's behaviour failed.
    #[error("conformance check `{check}` failed at {location}: {detail}")]
    Check {
        /// The condition that did not hold.
        check: String,
        /// What was expected and what the store did.
        detail: String,
        /// Where in the suite the check is (`file:line`).
        location: &'static str,
    },
    /// A store call that the contract says succeeds returned an error.
    #[error("store call `{op}` failed at {location}: {source}")]
    Store {
        /// The call.
        op: String,
        /// Where in the suite the call is (`file:line`).
        location: &'static str,
        /// The store's error.
        #[source]
        source: StoreError,
    },
}

// Tests print the `Debug` form of a returned error: make it the readable message.
impl fmt::Debug for ConformanceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl ConformanceError {
    pub(crate) fn check(
        check: impl Into<String>,
        detail: impl Into<String>,
        location: &'static str,
    ) -> Self {
        Self::Check {
            check: check.into(),
            detail: detail.into(),
            location,
        }
    }
}

/// Returns a [`ConformanceError::Check`] unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::conformance::ConformanceError::check(
                stringify!($cond),
                format!($($fmt)+),
                concat!(file!(), ":", line!()),
            ));
        }
    };
}

/// Returns a [`ConformanceError::Check`] unless `left == right`.
macro_rules! ensure_eq {
    ($left:expr, $right:expr, $($fmt:tt)+) => {
        match (&$left, &$right) {
            (left, right) => {
                if left != right {
                    return Err($crate::conformance::ConformanceError::check(
                        concat!(stringify!($left), " == ", stringify!($right)),
                        format!("{}: expected {:?}, found {:?}", format!($($fmt)+), right, left),
                        concat!(file!(), ":", line!()),
                    ));
                }
            }
        }
    };
}

/// Returns a [`ConformanceError::Check`] unless `result` is an `Err` matching `pattern` (and
/// `guard`, when given).
macro_rules! ensure_err {
    ($result:expr, $pattern:pat if $guard:expr, $($fmt:tt)+) => {
        match $result {
            Err($pattern) if $guard => {}
            other => {
                return Err($crate::conformance::ConformanceError::check(
                    concat!("result is Err(", stringify!($pattern), ") if ", stringify!($guard)),
                    format!("{}: found {:?}", format!($($fmt)+), other),
                    concat!(file!(), ":", line!()),
                ));
            }
        }
    };
    ($result:expr, $pattern:pat, $($fmt:tt)+) => {
        match $result {
            Err($pattern) => {}
            other => {
                return Err($crate::conformance::ConformanceError::check(
                    concat!("result is Err(", stringify!($pattern), ")"),
                    format!("{}: found {:?}", format!($($fmt)+), other),
                    concat!(file!(), ":", line!()),
                ));
            }
        }
    };
}

/// Awaits a store call that must succeed, turning its error into [`ConformanceError::Store`].
macro_rules! ok {
    ($call:expr) => {
        match $call.await {
            Ok(value) => value,
            Err(source) => {
                return Err($crate::conformance::ConformanceError::Store {
                    op: stringify!($call).to_string(),
                    location: concat!(file!(), ":", line!()),
                    source,
                });
            }
        }
    };
}

pub(crate) use {ensure, ensure_eq, ensure_err, ok};

/// An agent id the suite uses (always valid).
pub(crate) fn agent(id: &str) -> Result<AgentId, ConformanceError> {
    AgentId::parse(id).map_err(|e| {
        ConformanceError::check(
            "AgentId::parse",
            e.to_string(),
            concat!(file!(), ":", line!()),
        )
    })
}

/// Text that tends to break storage code: quotes, SQL, escapes, NUL, right-to-left and combining
/// characters, emoji, and line breaks of every kind.
pub(crate) const UNUSUAL_TEXT: &str = "it's \"quoted\" `back` \\ ; DROP TABLE tasks; -- %_ \0 nul \
    \u{202e}rtl\u{202c} e\u{301} 漢字 😀🏳️‍🌈 \r\n\t tab \u{2028} end";

/// A large text (one MiB plus a multibyte tail).
pub(crate) fn large_text() -> String {
    let mut s = "x".repeat(1 << 20);
    s.push_str("…🦀");
    s
}
