//! Identity files: SOUL.md, IDENTITY.md, USER.md and ROLE.md from an agent's workspace.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The identity texts of an agent, each read from a file in its workspace directory.
///
/// `SOUL.md` is personality, `IDENTITY.md` who the agent is, `USER.md` context about the human,
/// `ROLE.md` the job: what to handle, what to escalate, what success looks like.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Identity {
    /// SOUL.md: personality.
    pub soul: Option<String>,
    /// IDENTITY.md: who the agent is.
    pub identity: Option<String>,
    /// USER.md: about the human.
    pub user: Option<String>,
    /// ROLE.md: the agent's responsibilities and scope.
    pub role: Option<String>,
}

/// An identity file exists but cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// The file exists but could not be read (for example it is a directory).
    #[error("cannot read identity file {}: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not UTF-8 text.
    #[error("identity file {} is not valid UTF-8", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
    },
}

impl Identity {
    /// The file names read by [`Identity::load`], in order: soul, identity, user, role.
    pub const FILES: [&'static str; 4] = ["SOUL.md", "IDENTITY.md", "USER.md", "ROLE.md"];

    /// Reads the identity files from `dir`.
    ///
    /// A missing file (or a missing directory) leaves its text `None`, as does a file holding
    /// only whitespace; texts are trimmed. A file that exists but cannot be read, or is not
    /// UTF-8, is an error naming the file.
    pub fn load(dir: &Path) -> Result<Identity, IdentityError> {
        let [soul, identity, user, role] = Self::FILES;
        Ok(Identity {
            soul: read_optional(&dir.join(soul))?,
            identity: read_optional(&dir.join(identity))?,
            user: read_optional(&dir.join(user))?,
            role: read_optional(&dir.join(role))?,
        })
    }

    /// Whether no identity text is present.
    pub fn is_empty(&self) -> bool {
        self.soul.is_none() && self.identity.is_none() && self.user.is_none() && self.role.is_none()
    }
}

fn read_optional(path: &Path) -> Result<Option<String>, IdentityError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(IdentityError::Unreadable {
                path: path.to_owned(),
                source,
            });
        }
    };
    let text = String::from_utf8(bytes).map_err(|_| IdentityError::NotUtf8 {
        path: path.to_owned(),
    })?;
    let text = text.trim();
    Ok((!text.is_empty()).then(|| text.to_owned()))
}
