//! Identifiers used across the SDK.
//!
//! Every id is a small newtype over a `String` (or a number) so that an agent id can never be passed
//! where a channel id is expected. Ids that come from configuration or from a model are validated by
//! [`AgentId::parse`]; ids minted by the runtime use [`LinkId::new_random`] and friends.

use std::fmt;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::error::InvalidInput;

/// The shared text of an id.
fn shared(text: impl Into<String>) -> Arc<str> {
    let text: String = text.into();
    text.into()
}

macro_rules! string_id {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        ///
        /// The text is shared (`Arc<str>`): a clone is a reference count, not a copy.
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Arc<str>);

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = String::deserialize(deserializer)?;
                Self::from_wire(text).map_err(serde::de::Error::custom)
            }
        }

        impl $name {
            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// Consumes the id and returns the inner string.
            pub fn into_inner(self) -> String {
                self.0.to_string()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl From<&$name> for crate::text::Text {
            /// The id's text, shared (no copy).
            fn from(id: &$name) -> Self {
                crate::text::Text::from(id.0.clone())
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }
    };
}

string_id!(
    /// The id of an agent, such as `support` or `chief-ai-officer`.
    ///
    /// Agent ids are 1 to 64 characters of ASCII letters, digits, `-`, `_` and `.`; they appear in
    /// channel ids, file paths (one directory per agent) and task references, so nothing else is
    /// allowed.
    AgentId
);

impl AgentId {
    /// Longest accepted agent id.
    pub const MAX_LEN: usize = 64;

    /// Validates and wraps an agent id.
    ///
    /// ```
    /// use spacebot_core::AgentId;
    /// assert!(AgentId::parse("community-manager").is_ok());
    /// assert!(AgentId::parse("../etc").is_err());
    /// ```
    pub fn parse(id: impl Into<String>) -> Result<Self, InvalidInput> {
        let id = id.into();
        let ok_chars = id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if id.is_empty() || id.len() > Self::MAX_LEN || !ok_chars || id.starts_with('.') {
            return Err(InvalidInput::new(
                "agent id",
                format!(
                    "{id:?} must be 1 to {} characters of ASCII letters, digits, '-', '_' or '.', not starting with '.'",
                    Self::MAX_LEN
                ),
            ));
        }
        Ok(Self(id.into()))
    }
}

impl AgentId {
    /// Deserialized ids are validated like parsed ones.
    fn from_wire(text: String) -> Result<Self, InvalidInput> {
        Self::parse(text)
    }
}

impl TryFrom<&str> for AgentId {
    type Error = InvalidInput;
    fn try_from(value: &str) -> Result<Self, Self::Error> {
        Self::parse(value)
    }
}

string_id!(
    /// The id of an [`AgentLink`](crate::link::AgentLink) or of a conversation link.
    LinkId
);

impl LinkId {
    fn from_wire(text: String) -> Result<Self, InvalidInput> {
        Ok(Self(text.into()))
    }

    /// Wraps an existing link id (for example one read back from a store).
    pub fn new(id: impl Into<String>) -> Self {
        Self(shared(id))
    }

    /// A fresh random (UUID v4) link id.
    pub fn new_random() -> Self {
        Self(uuid::Uuid::new_v4().to_string().into())
    }
}

string_id!(
    /// The id of a channel: a conversation history owned by one agent.
    ///
    /// Conventions: `link:{owner}:{peer}` for the owner's side of a link, `portal:chat:{agent}` for
    /// an application chat, anything else for external platforms.
    ChannelId
);

impl ChannelId {
    fn from_wire(text: String) -> Result<Self, InvalidInput> {
        Ok(Self(text.into()))
    }

    /// Wraps a channel id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(shared(id))
    }

    /// The owner's side of the link channel between `owner` and `peer`: `link:{owner}:{peer}`.
    ///
    /// ```
    /// use spacebot_core::{AgentId, ChannelId};
    /// let a = AgentId::parse("a").unwrap();
    /// let b = AgentId::parse("b").unwrap();
    /// assert_eq!(ChannelId::link(&a, &b).as_str(), "link:a:b");
    /// ```
    pub fn link(owner: &AgentId, peer: &AgentId) -> Self {
        Self(Arc::from(
            ["link:", owner.as_str(), ":", peer.as_str()].concat(),
        ))
    }

    /// The application chat channel of an agent: `portal:chat:{agent}`.
    pub fn portal(agent: &AgentId) -> Self {
        Self(Arc::from(["portal:chat:", agent.as_str()].concat()))
    }

    /// If this is a link channel `link:{owner}:{peer}`, its owner and peer.
    pub fn as_link(&self) -> Option<(AgentId, AgentId)> {
        let rest = self.0.strip_prefix("link:")?;
        let (owner, peer) = rest.split_once(':')?;
        Some((AgentId::parse(owner).ok()?, AgentId::parse(peer).ok()?))
    }
}

string_id!(
    /// The id of an [`Envelope`](crate::envelope::Envelope).
    EnvelopeId
);

impl EnvelopeId {
    fn from_wire(text: String) -> Result<Self, InvalidInput> {
        Ok(Self(text.into()))
    }

    /// Wraps an existing envelope id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(shared(id))
    }

    /// A fresh unique envelope id: 96 random bits drawn once per process (from a UUID v4), then
    /// a counter, as `{24 hex digits}-{counter in hex}`. Unique across processes and restarts like
    /// a UUID v4, without drawing random numbers per envelope.
    pub fn new_random() -> Self {
        static PREFIX: OnceLock<String> = OnceLock::new();
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let prefix = PREFIX.get_or_init(|| {
            let mut text = uuid::Uuid::new_v4().simple().to_string();
            text.truncate(24);
            text
        });
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        // `{prefix}-{n:x}`, written without the formatting machinery (an id per envelope).
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut buf = [0u8; 24 + 1 + 16];
        let head = prefix.len().min(24);
        buf[..head].copy_from_slice(&prefix.as_bytes()[..head]);
        buf[head] = b'-';
        let digits = (64 - n.leading_zeros()).div_ceil(4).max(1) as usize;
        for i in 0..digits {
            let shift = 4 * (digits - 1 - i);
            buf[head + 1 + i] = HEX[((n >> shift) & 0xf) as usize];
        }
        Self(Arc::from(
            std::str::from_utf8(&buf[..head + 1 + digits]).unwrap_or_default(),
        ))
    }
}

string_id!(
    /// The id of a [`Conversation`](crate::conversation::Conversation).
    ConversationId
);

impl ConversationId {
    fn from_wire(text: String) -> Result<Self, InvalidInput> {
        Ok(Self(text.into()))
    }

    /// Wraps an existing conversation id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(shared(id))
    }

    /// A fresh random (UUID v4) conversation id.
    pub fn new_random() -> Self {
        Self(uuid::Uuid::new_v4().to_string().into())
    }
}

/// A task as people write it: the owning agent and its per-agent number, shown as `{agent}#{n}`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TaskRef {
    /// The agent whose board holds the task.
    pub agent: AgentId,
    /// The task's number on that board, starting at 1.
    pub number: u64,
}

impl TaskRef {
    /// A reference to task `number` on `agent`'s board.
    pub fn new(agent: AgentId, number: u64) -> Self {
        Self { agent, number }
    }
}

impl fmt::Display for TaskRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.agent, self.number)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_ids_are_validated() {
        for bad in ["", ".hidden", "a b", "a/b", "a:b", &"x".repeat(65)] {
            assert!(AgentId::parse(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["a", "A-b_c.d", "chief-ai-officer", &"x".repeat(64)] {
            assert!(AgentId::parse(good).is_ok(), "{good:?} refused");
        }
    }

    #[test]
    fn deserialized_agent_ids_are_validated() {
        assert!(serde_json::from_str::<AgentId>("\"support\"").is_ok());
        let err = serde_json::from_str::<AgentId>("\"../etc\"").unwrap_err();
        assert!(err.to_string().contains("agent id"), "{err}");
    }

    #[test]
    fn link_channels_round_trip() {
        let a = AgentId::parse("a").unwrap();
        let b = AgentId::parse("b-2").unwrap();
        assert_eq!(
            ChannelId::link(&a, &b).as_link(),
            Some((a.clone(), b.clone()))
        );
        assert_eq!(ChannelId::portal(&a).as_link(), None);
        assert_eq!(ChannelId::link(&a, &b).as_str(), "link:a:b-2");
        assert_eq!(ChannelId::portal(&a).as_str(), "portal:chat:a");
        assert_eq!(TaskRef::new(a, 7).to_string(), "a#7");
    }

    #[test]
    fn envelope_ids_are_a_prefix_and_a_hex_counter() {
        let ids: Vec<EnvelopeId> = (0..40).map(|_| EnvelopeId::new_random()).collect();
        let (prefix, _) = ids[0].as_str().split_once('-').unwrap();
        assert_eq!(prefix.len(), 24);
        let mut last = None;
        for id in &ids {
            let (p, n) = id.as_str().split_once('-').unwrap();
            assert_eq!(p, prefix);
            assert!(!n.is_empty() && (n == "0" || !n.starts_with('0')), "{id}");
            let n = u64::from_str_radix(n, 16).unwrap();
            assert!(last.is_none_or(|l| n > l), "{id} after {last:?}");
            last = Some(n);
        }
    }
}
