//! What the notes are: names, access, versions, and the errors of the notes API.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use spacebot_core::{AgentId, StoreError, Timestamp};

/// The longest note name, in characters.
pub const MAX_NAME_LEN: usize = 64;

/// The largest note text by default, in bytes (see [`Notes::with_max_text`](crate::Notes::with_max_text)).
pub const DEFAULT_MAX_TEXT: usize = 64 * 1024;

/// Who wrote a version when no agent did: the operator API and the HTTP layer.
pub const OPERATOR: &str = "operator";

/// Who wrote a note's first version from the configuration's `text`.
pub const CONFIG_AUTHOR: &str = "config";

/// A note's name: 1 to [`MAX_NAME_LEN`] characters of `a-z`, `0-9`, `_`, `-` and `.`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NoteName(String);

impl NoteName {
    /// Validates a note name.
    ///
    /// ```
    /// use spacebot_notes::NoteName;
    /// assert!(NoteName::parse("deploy-status.v2").is_ok());
    /// assert!(NoteName::parse("Deploy").is_err());
    /// assert!(NoteName::parse("").is_err());
    /// ```
    ///
    /// # Errors
    /// [`NotesError::InvalidName`] saying what is wrong.
    pub fn parse(name: impl Into<String>) -> Result<Self, NotesError> {
        let name = name.into();
        let ok = !name.is_empty()
            && name.chars().count() <= MAX_NAME_LEN
            && name.chars().all(|c| {
                c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '_' | '-' | '.')
            });
        if ok {
            Ok(Self(name))
        } else {
            Err(NotesError::InvalidName { name })
        }
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NoteName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for NoteName {
    type Error = NotesError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(value)
    }
}

impl From<NoteName> for String {
    fn from(value: NoteName) -> Self {
        value.0
    }
}

/// What an agent may do with a note.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    /// Read it (list it, read it).
    Read,
    /// Read it and write it.
    ReadWrite,
}

impl Access {
    /// Whether this access allows writing.
    pub fn can_write(self) -> bool {
        self == Self::ReadWrite
    }

    /// `read` or `read_write`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::ReadWrite => "read_write",
        }
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One version of a note.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoteVersion {
    /// The note.
    pub name: NoteName,
    /// 1 for the first write, one more for each later write.
    pub version: u64,
    /// The text of this version.
    pub text: String,
    /// Who wrote it: an agent id, [`OPERATOR`] or [`CONFIG_AUTHOR`].
    pub author: String,
    /// When, by the organization's clock.
    pub written_at: Timestamp,
}

/// A note as the operator sees it: its latest version (if written), its description and who may
/// read or write it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoteSummary {
    /// The note.
    pub name: NoteName,
    /// The description from the configuration (empty when none).
    pub description: String,
    /// The latest version, or `None` when the note was never written (it has grants only).
    pub latest: Option<NoteVersion>,
    /// Who may read or write it.
    pub access: BTreeMap<AgentId, Access>,
}

/// Why a notes call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NotesError {
    /// The name is not a valid note name.
    #[error(
        "invalid note name {name:?}: use 1 to {MAX_NAME_LEN} characters of a-z, 0-9, '_', '-' and '.'"
    )]
    InvalidName {
        /// The name as given.
        name: String,
    },
    /// The text is larger than the cap.
    #[error("the text of note {name} is {len} bytes, more than the limit of {max}")]
    TooLarge {
        /// The note.
        name: NoteName,
        /// The text's size in bytes.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// No note of this name exists (never written and no one has access to it).
    #[error("no note named {name}")]
    NotFound {
        /// The note.
        name: NoteName,
    },
    /// The agent is not part of the organization.
    #[error("unknown agent {agent}")]
    UnknownAgent {
        /// The agent as given.
        agent: String,
    },
    /// A compare-and-set write found another version than the one it was based on: nothing was
    /// written.
    #[error("note {name} is at version {}, not {base_version}: read it and write again", current.as_ref().map_or(0, |c| c.version))]
    Conflict {
        /// The note.
        name: NoteName,
        /// The version the write was based on.
        base_version: u64,
        /// The note's latest version (`None`: never written).
        current: Option<Box<NoteVersion>>,
    },
    /// The behaviour is not part of a built organization yet (add it with
    /// `OrganizationBuilder::behaviour` and build the organization first).
    #[error("shared notes are not attached to an organization yet; build the organization first")]
    NotBuilt,
    /// A store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}
