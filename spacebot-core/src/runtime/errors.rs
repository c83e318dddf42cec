//! Why an organization could not be built or changed, and why a delivery was refused.

use crate::config::ConfigError;
use crate::error::{InvalidInput, PolicyDenied, StoreError};
use crate::ids::AgentId;
use crate::prompts::{IdentityError, PromptError};
use crate::runtime::queue::QueueError;

/// Why the organization could not be built or changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OrgError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An agent's identity files could not be read.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// A prompt template is invalid.
    #[error(transparent)]
    Prompt(#[from] PromptError),
    /// An argument was refused.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    /// The builder lacks something it needs.
    #[error("the organization needs {0}; set it on the builder")]
    Missing(&'static str),
    /// The agent is not part of the organization.
    #[error("unknown agent {0}")]
    UnknownAgent(AgentId),
    /// The agent has ended and cannot be started again.
    #[error("agent {0} has ended")]
    Ended(AgentId),
}

/// Why a delivery was refused. The envelope was not taken (and nothing was stored) unless the
/// variant says otherwise.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeliveryError {
    /// No agent has this id.
    #[error("unknown agent {agent:?}")]
    UnknownAgent {
        /// The id as given.
        agent: String,
    },
    /// The agent has ended (a finished child, or one removed from the organization).
    #[error("agent {agent} has ended and takes no more messages")]
    Ended {
        /// The agent.
        agent: AgentId,
    },
    /// The agent's queue is full; try again later.
    #[error(transparent)]
    QueueFull(QueueError),
    /// The policy refused the message.
    #[error(transparent)]
    Denied(#[from] PolicyDenied),
    /// Persisting for a stopped agent failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The message itself was refused.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
}
