//! Why a configuration was refused: every problem, each naming its entry and field.

use std::fmt;
use std::path::{Path, PathBuf};

/// One problem in a configuration: the entry, the field (when one is at fault) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigIssue {
    /// The entry, such as `links[2] (support -> engineering)`, `agents[0] (support)` or `settings`.
    pub entry: String,
    /// The field at fault, if one is.
    pub field: Option<String>,
    /// What is wrong.
    pub problem: String,
}

impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.field {
            Some(field) => write!(f, "{}: field \"{}\": {}", self.entry, field, self.problem),
            None => write!(f, "{}: {}", self.entry, self.problem),
        }
    }
}

fn list_issues(issues: &[ConfigIssue]) -> String {
    issues
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

fn origin(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map(|p| format!(" {}", p.display()))
        .unwrap_or_default()
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read organization config {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not valid TOML.
    #[error("organization config{} is not valid TOML: {message}", origin(path))]
    Syntax {
        /// The file, when loaded from one.
        path: Option<PathBuf>,
        /// The parser's message, with line and column.
        message: String,
    },
    /// The TOML is well-formed but some entries are invalid; every problem found is listed.
    #[error("invalid organization config{}: {}", origin(path), list_issues(issues))]
    Invalid {
        /// The file, when loaded from one.
        path: Option<PathBuf>,
        /// Every problem, in file order.
        issues: Vec<ConfigIssue>,
    },
}

impl ConfigError {
    /// The problems, for [`ConfigError::Invalid`]; empty otherwise.
    pub fn issues(&self) -> &[ConfigIssue] {
        match self {
            Self::Invalid { issues, .. } => issues,
            _ => &[],
        }
    }

    pub(super) fn with_path(self, file: &Path) -> Self {
        match self {
            Self::Syntax { message, .. } => Self::Syntax {
                path: Some(file.to_owned()),
                message,
            },
            Self::Invalid { issues, .. } => Self::Invalid {
                path: Some(file.to_owned()),
                issues,
            },
            other => other,
        }
    }
}
