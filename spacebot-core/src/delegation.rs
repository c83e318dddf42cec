//! Delegation: tasks across agents (seed 001).

use std::sync::Arc;

use crate::tools::Tool;

/// The tools every agent gets from the runtime.
pub(crate) fn builtin_tools() -> Vec<Arc<dyn Tool>> {
    Vec::new()
}
