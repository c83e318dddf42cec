//! Links: the directed, policy-carrying edges of the communication graph (seed 003).

use std::fmt;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::StoreError;
use crate::ids::{AgentId, LinkId};
use crate::time::Timestamp;

/// Who may start an exchange over a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkDirection {
    /// Only `from` may start an exchange; `to` may answer inside one.
    OneWay,
    /// Either side may start an exchange.
    TwoWay,
}

/// What `from` is to `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkRelationship {
    /// Equals.
    Peer,
    /// `from` is above `to`.
    Superior,
    /// `from` is below `to`.
    Subordinate,
}

impl LinkRelationship {
    /// The same relationship seen from the other end (`Superior` <-> `Subordinate`).
    pub fn reversed(self) -> Self {
        match self {
            Self::Peer => Self::Peer,
            Self::Superior => Self::Subordinate,
            Self::Subordinate => Self::Superior,
        }
    }
}

macro_rules! text_enum {
    ($ty:ty, $what:literal, [$($variant:ident => $text:literal),+ $(,)?]) => {
        impl $ty {
            /// The stored text form.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }
        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
        impl ::std::str::FromStr for $ty {
            type Err = $crate::error::InvalidInput;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok(Self::$variant),)+
                    other => Err($crate::error::InvalidInput::new(
                        $what,
                        format!("unknown value {other:?}; expected one of: {}", [$($text),+].join(", ")),
                    )),
                }
            }
        }
    };
}
pub(crate) use text_enum;

text_enum!(LinkDirection, "link direction", [OneWay => "one_way", TwoWay => "two_way"]);
text_enum!(LinkRelationship, "link relationship", [Peer => "peer", Superior => "superior", Subordinate => "subordinate"]);

/// A link between two agents. Unique per ordered pair `(from, to)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentLink {
    /// The link's id.
    pub id: LinkId,
    /// The agent the link starts from.
    pub from: AgentId,
    /// The agent the link points to.
    pub to: AgentId,
    /// Who may start an exchange.
    pub direction: LinkDirection,
    /// What `from` is to `to`.
    pub relationship: LinkRelationship,
    /// A disabled link allows nothing.
    pub enabled: bool,
    /// When the link was created.
    pub created_at: Timestamp,
    /// When the link last changed.
    pub updated_at: Timestamp,
}

impl AgentLink {
    /// A new enabled link with a random id, created and updated at `now`.
    pub fn new(
        from: AgentId,
        to: AgentId,
        direction: LinkDirection,
        relationship: LinkRelationship,
        now: Timestamp,
    ) -> Self {
        Self {
            id: LinkId::new_random(),
            from,
            to,
            direction,
            relationship,
            enabled: true,
            created_at: now,
            updated_at: now,
        }
    }

    /// Whether `agent` is one of the two ends.
    pub fn involves(&self, agent: &AgentId) -> bool {
        &self.from == agent || &self.to == agent
    }

    /// The other end, seen from `agent` (`None` if `agent` is not on the link).
    pub fn other(&self, agent: &AgentId) -> Option<&AgentId> {
        if &self.from == agent {
            Some(&self.to)
        } else if &self.to == agent {
            Some(&self.from)
        } else {
            None
        }
    }

    /// What the other end is to `agent`: for `from`, `to` is `relationship.reversed()`;
    /// for `to`, `from` is `relationship`. `None` if `agent` is not on the link.
    pub fn relationship_of_other(&self, agent: &AgentId) -> Option<LinkRelationship> {
        if &self.from == agent {
            Some(self.relationship.reversed())
        } else if &self.to == agent {
            Some(self.relationship)
        } else {
            None
        }
    }
}

/// Storage of [`AgentLink`]s (instance-wide; not per agent).
///
/// # Contract
/// - `create` fails with [`StoreError::AlreadyExists`] if the id or the ordered pair `(from, to)`
///   exists; nothing is written then.
/// - `update` replaces direction, relationship, enabled and `updated_at` of the link with that id
///   (`from`, `to`, `created_at` are kept, whatever the argument holds); [`StoreError::NotFound`]
///   if absent.
/// - `delete` removes the link; [`StoreError::NotFound`] if absent.
/// - `get_between(from, to)` looks up the exact ordered pair; it does not look at `(to, from)`.
/// - `list` and `links_for_agent` return links sorted by `(from, to)`.
/// - `upsert_all` is atomic: either every link is written or none is. For each link, an existing
///   link with the same ordered pair keeps its id and `created_at` and takes every other field from
///   the argument; otherwise the link is inserted as given. Links not named are left alone.
///   A batch that names one ordered pair twice is refused with [`StoreError::Invalid`]; a new pair
///   whose id another link holds (stored, or a new pair earlier in the batch) is refused with
///   [`StoreError::AlreadyExists`]; nothing is written then.
///
/// The conformance suite (module `conformance`, feature `conformance`: `link_store_*`) checks every clause.
#[async_trait]
pub trait LinkStore: Send + Sync + fmt::Debug {
    /// Inserts a new link.
    async fn create(&self, link: &AgentLink) -> Result<(), StoreError>;
    /// Updates an existing link's direction, relationship, enabled flag and `updated_at`.
    async fn update(&self, link: &AgentLink) -> Result<(), StoreError>;
    /// Deletes a link.
    async fn delete(&self, id: &LinkId) -> Result<(), StoreError>;
    /// The link with this id.
    async fn get(&self, id: &LinkId) -> Result<Option<AgentLink>, StoreError>;
    /// The link for the exact ordered pair.
    async fn get_between(
        &self,
        from: &AgentId,
        to: &AgentId,
    ) -> Result<Option<AgentLink>, StoreError>;
    /// Every link with `agent` at either end, sorted by `(from, to)`.
    async fn links_for_agent(&self, agent: &AgentId) -> Result<Vec<AgentLink>, StoreError>;
    /// Every link, sorted by `(from, to)`.
    async fn list(&self) -> Result<Vec<AgentLink>, StoreError>;
    /// Inserts or updates several links by ordered pair, atomically (see the contract).
    async fn upsert_all(&self, links: &[AgentLink]) -> Result<(), StoreError>;

    /// Closes what backs this store, waiting for the operations in progress, and releases what it
    /// holds (a data directory's lock, a connection pool); later calls fail with
    /// [`StoreError::Backend`]. Closing one store of a backend closes the backend's every store;
    /// closing again does nothing. The default does nothing (stores that hold nothing to release).
    async fn release(&self) {}
}

/// A `dyn` link store.
pub type DynLinkStore = dyn LinkStore;

#[async_trait]
impl<T: LinkStore + ?Sized> LinkStore for std::sync::Arc<T> {
    async fn create(&self, link: &AgentLink) -> Result<(), StoreError> {
        (**self).create(link).await
    }
    async fn update(&self, link: &AgentLink) -> Result<(), StoreError> {
        (**self).update(link).await
    }
    async fn delete(&self, id: &LinkId) -> Result<(), StoreError> {
        (**self).delete(id).await
    }
    async fn get(&self, id: &LinkId) -> Result<Option<AgentLink>, StoreError> {
        (**self).get(id).await
    }
    async fn get_between(
        &self,
        from: &AgentId,
        to: &AgentId,
    ) -> Result<Option<AgentLink>, StoreError> {
        (**self).get_between(from, to).await
    }
    async fn links_for_agent(&self, agent: &AgentId) -> Result<Vec<AgentLink>, StoreError> {
        (**self).links_for_agent(agent).await
    }
    async fn list(&self) -> Result<Vec<AgentLink>, StoreError> {
        (**self).list().await
    }
    async fn upsert_all(&self, links: &[AgentLink]) -> Result<(), StoreError> {
        (**self).upsert_all(links).await
    }
    async fn release(&self) {
        (**self).release().await
    }
}
