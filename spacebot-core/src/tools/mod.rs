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

use crate::conversation::{Conversation, ConversationFilter};
use crate::error::{InvalidInput, PolicyDenied, StoreError};
use crate::ids::{AgentId, ChannelId, EnvelopeId, TaskRef};
use crate::llm::{ToolCall, ToolDefinition};
use crate::policy::LinkGraph;
use crate::runtime::behaviour::BehaviourContext;
use crate::runtime::host::Host;
use crate::task::{Task, TaskFilter};
use crate::time::Clock;

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
    /// What the tool may do in the organization: act as its own agent, and read.
    pub org: ToolCapability,
}

/// The narrow view of the organization a tool gets: it acts as its own agent only (it cannot send
/// as another agent, stop agents or write stores behind the runtime's back) and reads what its
/// agent may see.
#[derive(Debug, Clone)]
pub struct ToolCapability {
    pub(crate) host: Arc<Host>,
    agent: AgentId,
}

impl ToolCapability {
    /// The capability of `agent`'s tools.
    pub(crate) fn new(host: Arc<Host>, agent: AgentId) -> Self {
        Self { host, agent }
    }

    /// The agent the tool runs for.
    pub fn agent(&self) -> &AgentId {
        &self.agent
    }

    /// The host as the built-in behaviours' tools reach it: through the same
    /// [`BehaviourContext`] their behaviour gets. Those tools are stateless values an application
    /// may make itself ([`Organization::tool_context`](crate::Organization::tool_context) calls
    /// them directly), so they find the context here; a tool of a behaviour of your own keeps the
    /// context its behaviour got in [`on_build`](crate::Behaviour::on_build) instead. Not public:
    /// the capability stays narrow for every other tool.
    pub(crate) fn behaviour_context(&self) -> BehaviourContext {
        BehaviourContext::new(self.host.clone())
    }

    /// An agent's display name.
    pub fn display_name(&self, agent: &AgentId) -> String {
        self.host.display_name(agent)
    }

    /// The link graph, as the policy sees it now.
    pub fn graph(&self) -> Arc<LinkGraph> {
        self.host.graph()
    }

    /// The organization's clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.host.clock
    }

    /// The conversations this tool's agent is a member of (read-only).
    pub async fn conversations(&self) -> Result<Vec<Conversation>, StoreError> {
        let filter = ConversationFilter {
            member: Some(self.agent.clone()),
            statuses: Vec::new(),
        };
        self.host.stores.conversations.list(&filter).await
    }

    /// Tasks on this tool's agent's own board (read-only).
    pub async fn own_tasks(&self, filter: &TaskFilter) -> Result<Vec<Task>, StoreError> {
        self.host.stores.tasks.list(&self.agent, filter).await
    }
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
    /// The definition offered to the agent `scope` runs for (default: [`definition`](Self::definition)).
    /// A tool whose description depends on the agent (the agents it may reach, say) renders it here;
    /// the name and the parameters stay those of `definition`.
    fn definition_for(&self, scope: &ToolCapability) -> ToolDefinition {
        let _ = scope;
        self.definition()
    }
    /// Whether the agent `scope` runs for is offered this tool (default: every agent). A tool
    /// not offered is left out of the agent's definitions, and a call naming it is refused in code
    /// as an unknown tool, whatever the model asks. Offers may change at run time: call
    /// [`Organization::tools_changed`](crate::Organization::tools_changed) when they do, so the
    /// next turn renders the definitions again.
    fn offered_to(&self, scope: &ToolCapability) -> bool {
        let _ = scope;
        true
    }
    /// The description of [`definition_for`](Self::definition_for), when that is the only part of
    /// it that depends on the agent (its name and parameters being [`definition`](Self::definition)'s):
    /// agents offered the same descriptions then share one rendering of the tools, the schemas
    /// copied once for all of them instead of once per agent. `None` (the default): the registry
    /// asks [`definition_for`](Self::definition_for) for every agent. Tools made with
    /// [`TypedTool`] answer it.
    fn offered_description(&self, scope: &ToolCapability) -> Option<String> {
        let _ = scope;
        None
    }
    /// Runs the tool.
    async fn call(
        &self,
        ctx: &ToolContext,
        args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError>;
}

/// A tool with typed arguments: a name, an argument type with its JSON Schema, and a run function
/// that gets the arguments already parsed. Every `TypedTool` is a [`Tool`]; arguments that do not
/// fit `Args` go back to the model as [`ToolError::InvalidArguments`] without calling `run`.
///
/// ```
/// use spacebot_core::tools::{ToolContext, ToolError, ToolOutput, TypedTool};
/// #[derive(Debug)]
/// struct Add;
/// #[derive(serde::Deserialize)]
/// struct AddArgs { a: i64, b: i64 }
/// #[async_trait::async_trait]
/// impl TypedTool for Add {
///     const NAME: &'static str = "add";
///     type Args = AddArgs;
///     fn description(&self) -> String { "Adds two integers.".into() }
///     fn parameters(&self) -> serde_json::Value {
///         serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
///                            "required": ["a", "b"], "additionalProperties": false})
///     }
///     async fn run(&self, _ctx: &ToolContext, args: AddArgs) -> Result<ToolOutput, ToolError> {
///         Ok(ToolOutput::text((args.a + args.b).to_string()))
///     }
/// }
/// use spacebot_core::tools::Tool;
/// assert_eq!(Add.definition().name, "add");
/// ```
#[async_trait]
pub trait TypedTool: Send + Sync + fmt::Debug {
    /// The tool's name (1 to 64 ASCII letters, digits, `_`, `-`).
    const NAME: &'static str;
    /// The arguments, parsed from the model's JSON.
    type Args: serde::de::DeserializeOwned + Send;
    /// The description the model reads.
    fn description(&self) -> String;
    /// The description offered to the agent `scope` runs for (default: [`description`](Self::description)).
    fn description_for(&self, scope: &ToolCapability) -> String {
        let _ = scope;
        self.description()
    }
    /// The JSON Schema of `Args`.
    fn parameters(&self) -> serde_json::Value;
    /// Whether the agent `scope` runs for is offered this tool (see [`Tool::offered_to`]).
    fn offered_to(&self, scope: &ToolCapability) -> bool {
        let _ = scope;
        true
    }
    /// Runs the tool.
    async fn run(&self, ctx: &ToolContext, args: Self::Args) -> Result<ToolOutput, ToolError>;
}

#[async_trait]
impl<T: TypedTool> Tool for T {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition::new(T::NAME, self.description(), self.parameters())
    }
    fn definition_for(&self, scope: &ToolCapability) -> ToolDefinition {
        ToolDefinition::new(T::NAME, self.description_for(scope), self.parameters())
    }
    fn offered_to(&self, scope: &ToolCapability) -> bool {
        TypedTool::offered_to(self, scope)
    }
    fn offered_description(&self, scope: &ToolCapability) -> Option<String> {
        Some(self.description_for(scope))
    }
    async fn call(
        &self,
        ctx: &ToolContext,
        args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        let args: T::Args = parse_args(T::NAME, args)?;
        self.run(ctx, args).await
    }
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

/// Tools whose names and number change at run time (the tools of MCP servers, listed by the
/// servers and granted per agent): one value offers them all and runs their calls.
///
/// # Contract
/// - `definitions_for` is what the agent is offered now: names of 1 to 64 ASCII letters, digits,
///   `_` and `-`, none of them a name the registry's own tools use (those win). It is rendered
///   again after [`BehaviourContext::tools_changed`](crate::BehaviourContext::tools_changed).
/// - `call` answers `None` for a name that is not the set's (the registry then answers an
///   unknown tool); for one of its names it checks, in code, that the calling agent may use it
///   now, whatever the model asked, and answers every failure as an `Err` for the model.
#[async_trait]
pub trait ToolSet: Send + Sync + fmt::Debug {
    /// The definitions offered to the agent `scope` runs for, now.
    fn definitions_for(&self, scope: &ToolCapability) -> Vec<ToolDefinition>;
    /// Runs a call of the tool `name` with `args` (a JSON object); `None` when `name` is not one
    /// of the set's.
    async fn call(
        &self,
        ctx: &ToolContext,
        name: &str,
        args: serde_json::Value,
    ) -> Option<Result<ToolOutput, ToolError>>;
}

/// The tools offered to one agent, each by its place in the registry, with its description (see
/// [`ToolRegistry::offer`]).
pub(crate) type Offer = Vec<(usize, String)>;

/// The tools of one agent, by name.
#[derive(Debug, Clone, Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Arc<dyn Tool>>,
    sets: Vec<Arc<dyn ToolSet>>,
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

    /// Adds a set of tools whose names change at run time (see [`ToolSet`]).
    pub fn register_set(&mut self, set: Arc<dyn ToolSet>) {
        self.sets.push(set);
    }

    /// The tool called `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.tools.get(name)
    }

    /// Every tool's definition, sorted by name.
    pub fn definitions(&self) -> Vec<ToolDefinition> {
        self.tools.values().map(|t| t.definition()).collect()
    }

    /// Every tool's definition as offered to the agent `scope` runs for, sorted by name (the
    /// registry's own tools, then those of its [`ToolSet`]s that no earlier tool named).
    pub fn definitions_for(&self, scope: &ToolCapability) -> Vec<ToolDefinition> {
        let mut defs: Vec<ToolDefinition> = self
            .tools
            .values()
            .filter(|t| t.offered_to(scope))
            .map(|t| t.definition_for(scope))
            .collect();
        let mut seen: std::collections::BTreeSet<String> = self.tools.keys().cloned().collect();
        for set in &self.sets {
            let mut more: Vec<ToolDefinition> = set
                .definitions_for(scope)
                .into_iter()
                .filter(|d| seen.insert(d.name.clone()))
                .collect();
            more.sort_by(|a, b| a.name.cmp(&b.name));
            defs.extend(more);
        }
        defs
    }

    /// What tells the definitions offered to the agent `scope` runs for apart from another
    /// agent's: each offered tool (by its place in the registry) with its description. Two agents
    /// with the same offer get the same [`definitions_for`](Self::definitions_for). `None` when a
    /// tool renders its whole definition per agent (no
    /// [`offered_description`](Tool::offered_description)) or a [`ToolSet`] is registered.
    pub(crate) fn offer(&self, scope: &ToolCapability) -> Option<Offer> {
        if !self.sets.is_empty() {
            return None;
        }
        let mut offer = Vec::with_capacity(self.tools.len());
        for (place, tool) in self.tools.values().enumerate() {
            if tool.offered_to(scope) {
                offer.push((place, tool.offered_description(scope)?));
            }
        }
        Some(offer)
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
    /// A tool the calling agent is not offered (see [`Tool::offered_to`]) is an unknown tool to it.
    pub async fn call(&self, ctx: &ToolContext, call: &ToolCall) -> Result<ToolOutput, ToolError> {
        let tool = self
            .tools
            .get(&call.name)
            .filter(|t| t.offered_to(&ctx.org));
        let in_set = tool.is_none() && !self.tools.contains_key(&call.name);
        if tool.is_none() && !in_set {
            return Err(self.unknown(ctx, &call.name));
        }
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
        if let Some(tool) = tool {
            return tool.call(ctx, args).await;
        }
        for set in &self.sets {
            if let Some(result) = set.call(ctx, &call.name, args.clone()).await {
                return result;
            }
        }
        Err(self.unknown(ctx, &call.name))
    }

    /// The error for a call naming a tool the calling agent is not offered.
    fn unknown(&self, ctx: &ToolContext, name: &str) -> ToolError {
        ToolError::UnknownTool {
            name: name.to_owned(),
            available: self
                .definitions_for(&ctx.org)
                .into_iter()
                .map(|d| d.name)
                .collect(),
        }
    }
}
