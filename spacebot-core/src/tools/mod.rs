//! Tools the model can call: the [`Tool`] trait, the per-agent [`ToolRegistry`], and the context a
//! tool runs in.
//!
//! Every failure of a tool (unknown tool, malformed arguments, a policy denial, an error of the tool
//! itself) goes back to the model as the tool's result, so the model can correct itself; none of
//! them ends the agent's turn or crashes the loop.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use crate::error::{InvalidInput, PolicyDenied};
use crate::ids::{AgentId, ChannelId, EnvelopeId, TaskRef};
use crate::llm::{ToolCall, ToolDefinition};
use crate::org::Organization;

/// What a tool call produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    /// The text the model sees as the tool's result.
    pub content: String,
    /// Whether the agent's turn ends after this tool round (no further model call). Delegation
    /// uses it: the delegator's turn ends, and the result comes back later as a retrigger.
    pub end_turn: bool,
}

impl ToolOutput {
    /// A result that lets the turn go on.
    pub fn text(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            end_turn: false,
        }
    }

    /// A result that ends the turn.
    pub fn end_turn(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            end_turn: true,
        }
    }
}

/// Why a tool call failed. Shown to the model as the tool result (see [`ToolError::to_model_text`]).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ToolError {
    /// The model asked for a tool this agent does not have.
    #[error("unknown tool {name:?}; available tools: {}", available.join(", "))]
    UnknownTool {
        /// The name the model used.
        name: String,
        /// The agent's tools.
        available: Vec<String>,
    },
    /// The arguments were not valid JSON or did not match the tool's schema.
    #[error("invalid arguments for tool {tool}: {message}")]
    InvalidArguments {
        /// The tool.
        tool: String,
        /// What was wrong.
        message: String,
    },
    /// The runtime's policy refused the operation.
    #[error(transparent)]
    Denied(#[from] PolicyDenied),
    /// The tool failed.
    #[error("tool {tool} failed: {message}")]
    Failed {
        /// The tool.
        tool: String,
        /// What went wrong (and, where it helps, what to do instead).
        message: String,
    },
}

impl ToolError {
    /// A [`ToolError::Failed`].
    pub fn failed(tool: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Failed {
            tool: tool.into(),
            message: message.into(),
        }
    }

    /// A [`ToolError::InvalidArguments`].
    pub fn invalid_arguments(tool: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidArguments {
            tool: tool.into(),
            message: message.into(),
        }
    }

    /// The tool result the model sees: `Error: ...`.
    pub fn to_model_text(&self) -> String {
        format!("Error: {self}")
    }
}

/// Where a tool call happens: which agent, which channel, which task, and the organization to act on.
///
/// The agent id is the runtime's, never the model's: a tool that sends messages stamps this id as
/// the sender.
#[derive(Debug, Clone)]
pub struct ToolContext {
    /// The calling agent.
    pub agent: AgentId,
    /// The channel of the message being answered.
    pub channel: ChannelId,
    /// The task being worked on, when the turn runs a task.
    pub task: Option<TaskRef>,
    /// How many delegate-and-retrigger rounds led to this turn (0 for a fresh message); delegation
    /// refuses past a limit so a model that re-delegates on every result cannot loop forever.
    pub round: u32,
    /// The envelope that started the exchange this call is part of (see [`Envelope::cause`](crate::Envelope::cause)).
    pub cause: EnvelopeId,
    /// The idempotency key of this call: derived from the envelope being answered, the tool round
    /// and the call's position, so a turn run again after a crash asks for the same effects under
    /// the same keys and the stores apply them once.
    pub key: String,
    /// The organization (for tools that message, delegate or read boards).
    pub org: Organization,
}

/// A tool the model can call.
///
/// # Contract
/// - `definition().name` is 1 to 64 characters of ASCII letters, digits, `_` and `-` and does not
///   change; `parameters` is a JSON Schema object.
/// - `call` gets the arguments as parsed JSON (the runtime refuses text that is not JSON before
///   calling) and validates them itself, returning [`ToolError::InvalidArguments`] when they do not fit.
/// - `call` never panics on bad arguments; errors go back to the model as the tool result.
#[async_trait]
pub trait Tool: Send + Sync + fmt::Debug {
    /// Name, description and JSON Schema of the arguments.
    fn definition(&self) -> ToolDefinition;
    /// Runs the tool.
    async fn call(
        &self,
        ctx: &ToolContext,
        args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError>;
}

/// Parses typed arguments, turning a mismatch into [`ToolError::InvalidArguments`].
///
/// ```
/// #[derive(serde::Deserialize)]
/// struct Args { target: String }
/// let ok: Args = spacebot_core::tools::parse_args("t", serde_json::json!({"target": "b"})).unwrap();
/// assert_eq!(ok.target, "b");
/// assert!(spacebot_core::tools::parse_args::<Args>("t", serde_json::json!({})).is_err());
/// ```
pub fn parse_args<T: serde::de::DeserializeOwned>(
    tool: &str,
    args: serde_json::Value,
) -> Result<T, ToolError> {
    serde_json::from_value(args).map_err(|e| ToolError::invalid_arguments(tool, e.to_string()))
}

/// The tools of one agent, by name.
#[derive(Debug, Clone, Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Arc<dyn Tool>>,
}

impl ToolRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tool; a second tool with the same name, or an invalid name, is refused.
    pub fn register(&mut self, tool: Arc<dyn Tool>) -> Result<(), InvalidInput> {
        let name = tool.definition().name;
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(InvalidInput::new(
                "tool name",
                format!("{name:?} must be 1 to 64 characters of ASCII letters, digits, '_' or '-'"),
            ));
        }
        if self.tools.contains_key(&name) {
            return Err(InvalidInput::new(
                "tool name",
                format!("a tool named {name:?} is registered already"),
            ));
        }
        self.tools.insert(name, tool);
        Ok(())
    }

    /// The tool called `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.tools.get(name)
    }

    /// Every tool's definition, sorted by name.
    pub fn definitions(&self) -> Vec<ToolDefinition> {
        self.tools.values().map(|t| t.definition()).collect()
    }

    /// Tool names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tools.keys().cloned().collect()
    }

    /// Number of tools.
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// Runs one tool call as the model wrote it. Every failure becomes `Err`, never a panic: an
    /// unknown tool, arguments that are not a JSON object, or the tool's own error.
    pub async fn call(&self, ctx: &ToolContext, call: &ToolCall) -> Result<ToolOutput, ToolError> {
        let Some(tool) = self.tools.get(&call.name) else {
            return Err(ToolError::UnknownTool {
                name: call.name.clone(),
                available: self.names(),
            });
        };
        let text = call.arguments.trim();
        let args = if text.is_empty() {
            serde_json::Value::Object(serde_json::Map::new())
        } else {
            serde_json::from_str::<serde_json::Value>(text).map_err(|e| {
                ToolError::invalid_arguments(
                    &call.name,
                    format!("the arguments are not valid JSON ({e}); send one JSON object"),
                )
            })?
        };
        if !args.is_object() {
            return Err(ToolError::invalid_arguments(
                &call.name,
                "the arguments must be one JSON object",
            ));
        }
        tool.call(ctx, args).await
    }
}
