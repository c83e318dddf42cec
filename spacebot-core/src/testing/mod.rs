//! Test helpers: mock LLM providers and a recording event sink.
//!
//! Every provider here records each [`ChatRequest`] it receives, in arrival order, so tests can
//! assert on prompts and tool schemas:
//!
//! - [`ScriptedLlm`]: per-agent FIFO scripts of answers (text, tool calls, errors);
//! - [`MockLlm::pair`]: a provider and a [`MockLlmHandle`] through which the test answers each call
//!   as it arrives, turn by turn (in the style of `tower-test`);
//! - [`FnLlm`]: a closure from request to response, for adversarial property tests.
//!
//! [`RecordingSink`] keeps every emitted [`Event`](crate::event::Event).
//!
//! None of them needs an async runtime: they are built on `futures` alone. With the `tokio` feature,
//! [`OrgHarness`] wires a whole organization for a test: replies, recorded events, waits that
//! fail the test after a timeout, and read-outs of its stores. It is the one harness every suite
//! runs on (this crate's tests, the scenario suites on every backend, the provider's and the
//! HTTP API's tests); what the suites share besides lives here too:
//!
//! - [`orgs`]: the organizations the suites run, as TOML;
//! - [`tools`]: small tools (`echo`, `broken`, `ping`);
//! - [`FailingDeliveries`]: a delivery store that refuses one agent's deliveries;
//! - helpers to build tool calls and read requests ([`tool_call`], [`last_user_text`],
//!   [`tool_results`]) and messages and channels ([`user`], [`chat`], [`portal`], [`link`]).

pub mod external;
mod fn_llm;
#[cfg(feature = "tokio")]
mod harness;
pub mod orgs;
mod pair;
mod recording;
mod scripted;
mod stores;
pub mod tools;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub use fn_llm::FnLlm;
#[cfg(feature = "tokio")]
pub use harness::{OrgHarness, OrgHarnessBuilder, next_call};
pub use pair::{MockLlm, MockLlmHandle, PendingCall};
pub use recording::RecordingSink;
pub use scripted::ScriptedLlm;
pub use stores::FailingDeliveries;

use crate::ids::{AgentId, ChannelId};
use crate::llm::{ChatMessage, ChatRequest, ToolCall};
use crate::org::InboundMessage;

/// Locks a mutex, recovering the data if another thread panicked while holding it (the guarded
/// data are plain collections that stay consistent between statements).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A shared, ordered log of the requests a mock provider received.
#[derive(Debug, Clone, Default)]
pub(crate) struct Recorder {
    requests: Arc<Mutex<Vec<ChatRequest>>>,
}

impl Recorder {
    pub(crate) fn record(&self, request: &ChatRequest) {
        lock(&self.requests).push(request.clone());
    }

    pub(crate) fn all(&self) -> Vec<ChatRequest> {
        lock(&self.requests).clone()
    }

    pub(crate) fn for_agent(&self, agent: &AgentId) -> Vec<ChatRequest> {
        lock(&self.requests)
            .iter()
            .filter(|r| r.agent.as_ref() == Some(agent))
            .cloned()
            .collect()
    }
}

static NEXT_HELPER_CALL: AtomicU64 = AtomicU64::new(1);

/// The text of the last user message in `messages` (empty when there is none): what a mock
/// model usually answers.
///
/// ```
/// use spacebot_core::llm::ChatMessage;
/// use spacebot_core::testing::last_user_text;
/// let messages = vec![
///     ChatMessage::User { content: "first".into() },
///     ChatMessage::User { content: "second".into() },
/// ];
/// assert_eq!(last_user_text(&messages), "second");
/// assert_eq!(last_user_text(&[]), "");
/// ```
pub fn last_user_text(messages: &[crate::llm::ChatMessage]) -> String {
    messages
        .iter()
        .rev()
        .find_map(|m| match m {
            crate::llm::ChatMessage::User { content } => Some(content.to_string()),
            _ => None,
        })
        .unwrap_or_default()
}

/// The texts of every user message in `messages`, in order.
///
/// ```
/// use spacebot_core::llm::ChatMessage;
/// use spacebot_core::testing::user_texts;
/// let messages = vec![
///     ChatMessage::User { content: "first".into() },
///     ChatMessage::assistant("ok"),
///     ChatMessage::User { content: "second".into() },
/// ];
/// assert_eq!(user_texts(&messages), ["first", "second"]);
/// ```
pub fn user_texts(messages: &[crate::llm::ChatMessage]) -> Vec<String> {
    messages
        .iter()
        .filter_map(|m| match m {
            crate::llm::ChatMessage::User { content } => Some(content.to_string()),
            _ => None,
        })
        .collect()
}

/// The results of the tool calls the running turn made, in `messages` (a request), in order:
/// the calls of earlier turns replayed from the channel's history are left out (see
/// [`history::to_messages`](crate::runtime::history::to_messages)).
///
/// ```
/// use spacebot_core::llm::ChatMessage;
/// use spacebot_core::testing::{tool_results, tool_round};
/// let messages = vec![
///     ChatMessage::User { content: "hi".into() },
///     ChatMessage::Tool { tool_call_id: "history-3".into(), content: "earlier".into() },
///     ChatMessage::User { content: "again".into() },
///     ChatMessage::Tool { tool_call_id: "c1".into(), content: "42".into() },
/// ];
/// assert_eq!(tool_results(&messages), vec!["42".to_string()]);
/// assert!(tool_round(&messages));
/// assert!(!tool_round(&messages[..3]));
/// ```
pub fn tool_results(messages: &[ChatMessage]) -> Vec<String> {
    messages
        .iter()
        .filter_map(|m| match m {
            ChatMessage::Tool {
                content,
                tool_call_id,
            } if !crate::runtime::history::is_replayed(tool_call_id) => Some(content.to_string()),
            _ => None,
        })
        .collect()
}

/// Whether the running turn has called a tool already: `messages` (a request) hold a result of
/// its own (not one replayed from the channel's history). What a scripted model asks to tell its
/// first answer in a turn from the next.
pub fn tool_round(messages: &[ChatMessage]) -> bool {
    messages.iter().any(|m| {
        matches!(m, ChatMessage::Tool { tool_call_id, .. } if !crate::runtime::history::is_replayed(tool_call_id))
    })
}

/// Agent id `s`.
///
/// # Panics
/// When `s` is not a valid agent id (a test's own mistake).
#[allow(clippy::panic)]
pub fn agent(s: &str) -> AgentId {
    AgentId::parse(s).unwrap_or_else(|e| panic!("{s:?} is not a valid agent id: {e}"))
}

/// A message from user `u1` of the portal (channel `portal:u1`).
pub fn user(text: &str) -> InboundMessage {
    InboundMessage::new("portal", "u1", text)
}

/// A message from the portal chat of `agent` (channel [`portal`]`(agent)`).
pub fn chat(agent_id: &str, text: &str) -> InboundMessage {
    InboundMessage::new("portal", format!("chat:{agent_id}"), text).with_channel(portal(agent_id))
}

/// The portal chat channel of `agent`.
pub fn portal(agent_id: &str) -> ChannelId {
    ChannelId::portal(&agent(agent_id))
}

/// The link channel `owner` keeps with `peer`.
pub fn link(owner: &str, peer: &str) -> ChannelId {
    ChannelId::link(&agent(owner), &agent(peer))
}

/// A [`ToolCall`] of tool `name` with JSON arguments `args`.
///
/// Its id is `call_{name}_{n}` with `n` unique within the process, so calls built by this helper
/// never share an id. Use [`tool_call_with_id`] when a test needs a fixed id.
///
/// ```
/// use spacebot_core::testing::tool_call;
/// let call = tool_call("send_agent_message", serde_json::json!({"target": "b", "message": "hi"}));
/// assert_eq!(call.name, "send_agent_message");
/// assert_eq!(call.arguments, r#"{"message":"hi","target":"b"}"#);
/// assert!(call.id.starts_with("call_send_agent_message_"));
/// ```
pub fn tool_call(name: impl Into<String>, args: serde_json::Value) -> ToolCall {
    let name = name.into();
    let n = NEXT_HELPER_CALL.fetch_add(1, Ordering::Relaxed);
    ToolCall {
        id: format!("call_{name}_{n}"),
        name,
        arguments: args.to_string(),
    }
}

/// A [`ToolCall`] with the given id, tool name and JSON arguments.
///
/// ```
/// use spacebot_core::testing::tool_call_with_id;
/// let call = tool_call_with_id("call_7", "conclude_link", serde_json::json!({"summary": "done"}));
/// assert_eq!((call.id.as_str(), call.name.as_str()), ("call_7", "conclude_link"));
/// ```
pub fn tool_call_with_id(
    id: impl Into<String>,
    name: impl Into<String>,
    args: serde_json::Value,
) -> ToolCall {
    ToolCall {
        id: id.into(),
        name: name.into(),
        arguments: args.to_string(),
    }
}

/// A [`ToolCall`] whose arguments are the raw text given, which need not be valid JSON (for
/// testing how malformed model output is handled).
///
/// ```
/// use spacebot_core::testing::raw_tool_call;
/// let call = raw_tool_call("call_1", "send_agent_message", "{not json");
/// assert_eq!(call.arguments, "{not json");
/// ```
pub fn raw_tool_call(
    id: impl Into<String>,
    name: impl Into<String>,
    arguments: impl Into<String>,
) -> ToolCall {
    ToolCall {
        id: id.into(),
        name: name.into(),
        arguments: arguments.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helper_tool_calls_have_distinct_ids() {
        let a = tool_call("t", serde_json::json!({}));
        let b = tool_call("t", serde_json::json!({}));
        assert_ne!(a.id, b.id);
        assert_eq!(a.arguments, "{}");
    }
}
