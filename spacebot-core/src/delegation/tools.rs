//! The tools delegation gives every agent: `send_agent_message` (delegate to a linked agent) and
//! the board tools `task_create`, `task_list` and `task_update`, each a [`TypedTool`] with a serde
//! argument struct.

use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use serde::Deserialize;

use super::DelegationError;
use super::admission::{DelegationOrigin, delegate, reachable_agents};
use super::outbox::task_transition;
use crate::error::InvalidInput;
use crate::policy;
use crate::task::{NewTask, Priority, TaskEvent, TaskFilter, TaskStatus};
use crate::tools::{Tool, ToolCapability, ToolContext, ToolError, ToolOutput, TypedTool};

/// A tool's parameter schema, built once per process in `cell` (it never changes) and cloned for
/// each agent's definitions: every agent's first turn asks for it.
fn built_once(
    cell: &'static OnceLock<serde_json::Value>,
    build: fn() -> serde_json::Value,
) -> serde_json::Value {
    cell.get_or_init(build).clone()
}

/// The `send_agent_message` tool: delegation as a task on the target's board.
#[derive(Debug, Default)]
pub struct SendAgentMessage;

/// The arguments of [`SendAgentMessage`].
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct SendAgentMessageArgs {
    /// The target agent's id or display name.
    pub target: String,
    /// What the target should do: the task's description (its first sentence is the title).
    pub message: String,
}

#[async_trait]
impl TypedTool for SendAgentMessage {
    const NAME: &'static str = "send_agent_message";
    type Args = SendAgentMessageArgs;

    fn description(&self) -> String {
        String::from(
            "Delegate work to another agent you are linked to. The message becomes a \
                task on that agent's board; your turn ends, and you are woken with the result when \
                the task is done or failed. `target` is the agent's id or name.",
        )
    }

    fn parameters(&self) -> serde_json::Value {
        static SCHEMA: OnceLock<serde_json::Value> = OnceLock::new();
        built_once(&SCHEMA, || {
            serde_json::json!({
                "type": "object",
                "properties": {
                    "target": {"type": "string", "description": "The agent's id or display name."},
                    "message": {"type": "string", "description": "What the agent should do, with the context it needs."}
                },
                "required": ["target", "message"],
                "additionalProperties": false
            })
        })
    }

    /// Offered only to an agent that may delegate to someone now (a link it may start an
    /// exchange over, enabled, within the depth limit): an agent whose links all come one-way
    /// from others is never offered it.
    fn offered_to(&self, scope: &ToolCapability) -> bool {
        !reachable_agents(&scope.behaviour_context(), scope.agent()).is_empty()
    }

    fn description_for(&self, scope: &ToolCapability) -> String {
        let org = scope.behaviour_context();
        let targets = reachable_agents(&org, scope.agent())
            .into_iter()
            .map(|(id, name)| crate::prompts::AgentSummary { id, name })
            .collect();
        match org
            .prompts()
            .render_send_agent_message(&crate::prompts::SendAgentMessageContext { targets })
        {
            Ok(text) => text,
            Err(e) => {
                org.report_error(
                    scope.agent(),
                    None,
                    format!("send_agent_message description not rendered: {e}"),
                );
                self.description()
            }
        }
    }

    async fn run(
        &self,
        ctx: &ToolContext,
        args: SendAgentMessageArgs,
    ) -> Result<ToolOutput, ToolError> {
        let origin = DelegationOrigin {
            channel: ctx.channel.clone(),
            task: ctx.task.clone(),
            round: ctx.round,
            cause: Some(ctx.cause.clone()),
            key: Some(ctx.key.clone()),
        };
        let org = ctx.org.behaviour_context();
        match delegate(&org, &ctx.agent, &args.target, &args.message, origin).await {
            Ok(task) => {
                let name = ctx.org.display_name(&task.agent);
                let stop = if task.title.ends_with(['.', '!', '?']) {
                    ""
                } else {
                    "."
                };
                let waiting = if task.status == TaskStatus::PendingApproval {
                    " It waits for approval before it runs."
                } else {
                    ""
                };
                Ok(ToolOutput::end_turn(format!(
                    "Assigned task #{} to {name} ({}): {}{stop}{waiting} Your turn ends now; you \
                     will be woken with the result.",
                    task.number, task.agent, task.title
                )))
            }
            Err(DelegationError::Denied(denied)) => Err(ToolError::Denied(denied)),
            Err(e) => Err(ToolError::failed("send_agent_message", e.to_string())),
        }
    }
}

/// `task_create`: adds a task to the calling agent's own board.
#[derive(Debug, Default)]
pub struct TaskCreate;

/// The arguments of [`TaskCreate`].
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TaskCreateArgs {
    /// The task's title.
    pub title: String,
    /// The task's description (empty when left out).
    #[serde(default)]
    pub description: String,
    /// `low`, `medium` (the default), `high` or `urgent`; another word is refused when the tool
    /// runs.
    #[serde(default)]
    pub priority: Option<String>,
    /// Whether the task starts in the backlog instead of ready.
    #[serde(default)]
    pub backlog: bool,
}

#[async_trait]
impl TypedTool for TaskCreate {
    const NAME: &'static str = "task_create";
    type Args = TaskCreateArgs;

    fn description(&self) -> String {
        String::from("Add a task to your own board. It is ready to run unless `backlog` is true.")
    }

    fn parameters(&self) -> serde_json::Value {
        static SCHEMA: OnceLock<serde_json::Value> = OnceLock::new();
        built_once(&SCHEMA, || {
            serde_json::json!({
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "description": {"type": "string"},
                    "priority": {"type": "string", "enum": ["low", "medium", "high", "urgent"]},
                    "backlog": {"type": "boolean"}
                },
                "required": ["title"],
                "additionalProperties": false
            })
        })
    }

    async fn run(&self, ctx: &ToolContext, args: TaskCreateArgs) -> Result<ToolOutput, ToolError> {
        let priority = match &args.priority {
            Some(p) => p
                .parse::<Priority>()
                .map_err(|e| ToolError::invalid_arguments("task_create", e.to_string()))?,
            None => Priority::Medium,
        };
        let mut new = NewTask::new(args.title, args.description);
        new.priority = priority;
        new.created_by = format!("agent:{}", ctx.agent);
        if args.backlog {
            new.status = TaskStatus::Backlog;
        }
        let org = ctx.org.behaviour_context();
        let task = org
            .stores()
            .tasks
            .create(&ctx.agent, new, org.clock().now())
            .await
            .map_err(|e| ToolError::failed("task_create", e.to_string()))?;
        org.ring(&ctx.agent);
        Ok(ToolOutput::text(format!(
            "Created task #{} ({}): {}",
            task.number, task.status, task.title
        )))
    }
}

/// `task_list`: the calling agent's board, or a subordinate's (read-only).
#[derive(Debug, Default)]
pub struct TaskList;

/// The arguments of [`TaskList`].
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TaskListArgs {
    /// A subordinate's id or name; `None` for the caller's own board.
    #[serde(default)]
    pub agent: Option<String>,
    /// Only tasks in this status (a [`TaskStatus`] name); checked when the tool runs.
    #[serde(default)]
    pub status: Option<String>,
}

#[async_trait]
impl TypedTool for TaskList {
    const NAME: &'static str = "task_list";
    type Args = TaskListArgs;

    fn description(&self) -> String {
        String::from(
            "List tasks on your board, or (read-only) on the board of an agent that \
                reports to you. Optionally only one status.",
        )
    }

    fn parameters(&self) -> serde_json::Value {
        static SCHEMA: OnceLock<serde_json::Value> = OnceLock::new();
        built_once(&SCHEMA, || {
            serde_json::json!({
                "type": "object",
                "properties": {
                    "agent": {"type": "string", "description": "A subordinate's id or name; omit for your own board."},
                    "status": {"type": "string", "enum": TaskStatus::ALL.iter().map(|s| s.as_str()).collect::<Vec<_>>()}
                },
                "additionalProperties": false
            })
        })
    }

    async fn run(&self, ctx: &ToolContext, args: TaskListArgs) -> Result<ToolOutput, ToolError> {
        let board = match &args.agent {
            None => ctx.agent.clone(),
            Some(name) => {
                let id = ctx
                    .org
                    .resolve(name)
                    .map_err(|e| ToolError::failed("task_list", e.to_string()))?;
                if id != ctx.agent
                    && !policy::is_superior(&ctx.org.graph(), ctx.agent.as_str(), id.as_str())
                {
                    return Err(ToolError::failed(
                        "task_list",
                        format!(
                            "{id} does not report to you; you can list only your own board and your subordinates' boards"
                        ),
                    ));
                }
                id
            }
        };
        let mut filter = TaskFilter::default();
        if let Some(status) = &args.status {
            filter
                .statuses
                .push(status.parse().map_err(|e: InvalidInput| {
                    ToolError::invalid_arguments("task_list", e.to_string())
                })?);
        }
        let tasks = ctx
            .org
            .behaviour_context()
            .stores()
            .tasks
            .list(&board, &filter)
            .await
            .map_err(|e| ToolError::failed("task_list", e.to_string()))?;
        if tasks.is_empty() {
            return Ok(ToolOutput::text(format!("No tasks on {board}'s board.")));
        }
        let lines: Vec<String> = tasks
            .iter()
            .map(|t| {
                format!(
                    "#{} [{}] {} ({})",
                    t.number, t.status, t.title, t.created_by
                )
            })
            .collect();
        Ok(ToolOutput::text(lines.join("\n")))
    }
}

/// `task_update`: changes the status of a task on the calling agent's own board.
#[derive(Debug, Default)]
pub struct TaskUpdate;

/// The arguments of [`TaskUpdate`].
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TaskUpdateArgs {
    /// The task's number on the caller's board.
    pub number: u64,
    /// `approve`, `schedule`, `park` or `cancel`; another word is refused when the tool runs.
    pub action: String,
    /// Why, for `cancel` (default: "cancelled by {agent}").
    #[serde(default)]
    pub reason: Option<String>,
}

#[async_trait]
impl TypedTool for TaskUpdate {
    const NAME: &'static str = "task_update";
    type Args = TaskUpdateArgs;

    fn description(&self) -> String {
        String::from(
            "Change a task on your own board: approve (pending_approval -> ready), \
                schedule (backlog -> ready), park (-> backlog) or cancel.",
        )
    }

    fn parameters(&self) -> serde_json::Value {
        static SCHEMA: OnceLock<serde_json::Value> = OnceLock::new();
        built_once(&SCHEMA, || {
            serde_json::json!({
                "type": "object",
                "properties": {
                    "number": {"type": "integer", "minimum": 1},
                    "action": {"type": "string", "enum": ["approve", "schedule", "park", "cancel"]},
                    "reason": {"type": "string"}
                },
                "required": ["number", "action"],
                "additionalProperties": false
            })
        })
    }

    async fn run(&self, ctx: &ToolContext, args: TaskUpdateArgs) -> Result<ToolOutput, ToolError> {
        let event = match args.action.as_str() {
            "approve" => TaskEvent::Approve,
            "schedule" => TaskEvent::Schedule,
            "park" => TaskEvent::Park,
            "cancel" => TaskEvent::Cancel {
                reason: args
                    .reason
                    .unwrap_or_else(|| format!("cancelled by {}", ctx.agent)),
            },
            other => {
                return Err(ToolError::invalid_arguments(
                    "task_update",
                    format!("unknown action {other:?}; use approve, schedule, park or cancel"),
                ));
            }
        };
        let org = ctx.org.behaviour_context();
        let t = task_transition(&org, &ctx.agent, args.number, event)
            .await
            .map_err(|e| ToolError::failed("task_update", e.to_string()))?;
        org.ring(&ctx.agent);
        Ok(ToolOutput::text(format!(
            "Task #{} is now {}.",
            t.task.number, t.task.status
        )))
    }
}

/// The tools every agent gets from the runtime.
pub(super) fn builtin_tools() -> Vec<Arc<dyn Tool>> {
    vec![
        Arc::new(SendAgentMessage),
        Arc::new(TaskCreate),
        Arc::new(TaskList),
        Arc::new(TaskUpdate),
    ]
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::llm::ToolDefinition;

    /// The definitions as they were before the tools became `TypedTool`s, copied verbatim: the
    /// model must see the same names, descriptions and schemas.
    fn definitions_before() -> Vec<ToolDefinition> {
        vec![
            ToolDefinition::new(
                "send_agent_message",
                "Delegate work to another agent you are linked to. The message becomes a \
                    task on that agent's board; your turn ends, and you are woken with the result when \
                    the task is done or failed. `target` is the agent's id or name.",
                serde_json::json!({
                    "type": "object",
                    "properties": {
                        "target": {"type": "string", "description": "The agent's id or display name."},
                        "message": {"type": "string", "description": "What the agent should do, with the context it needs."}
                    },
                    "required": ["target", "message"],
                    "additionalProperties": false
                }),
            ),
            ToolDefinition::new(
                "task_create",
                "Add a task to your own board. It is ready to run unless `backlog` is true.",
                serde_json::json!({
                    "type": "object",
                    "properties": {
                        "title": {"type": "string"},
                        "description": {"type": "string"},
                        "priority": {"type": "string", "enum": ["low", "medium", "high", "urgent"]},
                        "backlog": {"type": "boolean"}
                    },
                    "required": ["title"],
                    "additionalProperties": false
                }),
            ),
            ToolDefinition::new(
                "task_list",
                "List tasks on your board, or (read-only) on the board of an agent that \
                    reports to you. Optionally only one status.",
                serde_json::json!({
                    "type": "object",
                    "properties": {
                        "agent": {"type": "string", "description": "A subordinate's id or name; omit for your own board."},
                        "status": {"type": "string", "enum": [
                            "pending_approval", "backlog", "ready", "in_progress", "waiting",
                            "done", "failed", "cancelled"
                        ]}
                    },
                    "additionalProperties": false
                }),
            ),
            ToolDefinition::new(
                "task_update",
                "Change a task on your own board: approve (pending_approval -> ready), \
                    schedule (backlog -> ready), park (-> backlog) or cancel.",
                serde_json::json!({
                    "type": "object",
                    "properties": {
                        "number": {"type": "integer", "minimum": 1},
                        "action": {"type": "string", "enum": ["approve", "schedule", "park", "cancel"]},
                        "reason": {"type": "string"}
                    },
                    "required": ["number", "action"],
                    "additionalProperties": false
                }),
            ),
        ]
    }

    #[test]
    fn the_definitions_are_those_the_model_saw_before() {
        let after: Vec<ToolDefinition> = builtin_tools().iter().map(|t| t.definition()).collect();
        assert_eq!(after, definitions_before());
    }

    #[test]
    fn arguments_that_do_not_fit_are_refused_before_the_tool_runs() {
        let cases: [(&str, serde_json::Value); 6] = [
            ("send_agent_message", serde_json::json!({"target": "b"})),
            (
                "send_agent_message",
                serde_json::json!({"target": "b", "message": "m", "cc": "c"}),
            ),
            ("task_create", serde_json::json!({"title": 7})),
            ("task_list", serde_json::json!({"board": "b"})),
            (
                "task_update",
                serde_json::json!({"number": -1, "action": "park"}),
            ),
            ("task_update", serde_json::json!({"action": "park"})),
        ];
        for (name, args) in cases {
            let parsed = match name {
                "send_agent_message" => {
                    crate::tools::parse_args::<SendAgentMessageArgs>(name, args).map(|_| ())
                }
                "task_create" => crate::tools::parse_args::<TaskCreateArgs>(name, args).map(|_| ()),
                "task_list" => crate::tools::parse_args::<TaskListArgs>(name, args).map(|_| ()),
                _ => crate::tools::parse_args::<TaskUpdateArgs>(name, args).map(|_| ()),
            };
            assert!(
                matches!(&parsed, Err(ToolError::InvalidArguments { tool, .. }) if tool == name),
                "{name}: {parsed:?}"
            );
        }
    }
}

#[cfg(all(test, feature = "testing", feature = "tokio"))]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod org_tests {
    use super::super::testkit::{board, harness, id, tool_context};
    use super::*;
    use crate::error::DenialReason;
    use crate::llm::{ChatMessage, ToolCall};
    use crate::tools::ToolRegistry;

    fn registry() -> ToolRegistry {
        let mut registry = ToolRegistry::new();
        for tool in builtin_tools() {
            registry.register(tool).unwrap();
        }
        registry
    }

    fn call(name: &str, args: serde_json::Value) -> ToolCall {
        ToolCall {
            id: "call_1".into(),
            name: name.into(),
            arguments: args.to_string(),
        }
    }

    /// The text the model sees for `args` given to tool `name` by agent `agent`.
    async fn answer(
        h: &crate::testing::OrgHarness,
        agent: &str,
        name: &str,
        args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        registry()
            .call(&tool_context(h, agent), &call(name, args))
            .await
    }

    #[tokio::test]
    async fn values_the_arguments_cannot_take_are_answered_to_the_model() {
        let (h, _llm) = harness("").await;
        let cases = [
            (
                "task_create",
                serde_json::json!({"title": "t", "priority": "soon"}),
                "priority",
            ),
            (
                "task_list",
                serde_json::json!({"status": "sleeping"}),
                "status",
            ),
            (
                "task_update",
                serde_json::json!({"number": 1, "action": "shred"}),
                "unknown action \"shred\"",
            ),
        ];
        for (name, args, says) in cases {
            let error = answer(&h, "a", name, args).await.unwrap_err();
            assert!(
                matches!(&error, ToolError::InvalidArguments { tool, .. } if tool == name),
                "{name}: {error:?}"
            );
            let text = error.to_model_text();
            assert!(
                text.starts_with(&format!("Error: invalid arguments for tool {name}: ")),
                "{text}"
            );
            assert!(text.contains(says), "{text}");
        }
        assert!(board(&h, "a").await.is_empty(), "nothing created");
    }

    #[tokio::test]
    async fn a_tool_error_goes_back_to_the_model_as_the_tool_result() {
        let (mut h, llm) = harness("").await;
        let a = id("a");
        llm.push_tool_call(
            &a,
            "task_create",
            serde_json::json!({"title": "t", "urgency": "high"}),
        );
        llm.push_text(&a, "sorry");
        h.org.start_agent(&a).await.unwrap();
        h.org
            .deliver(
                "a",
                crate::InboundMessage::new("portal", "u1", "add a task"),
            )
            .await
            .unwrap();
        assert_eq!(h.reply().await.content, "sorry");
        let requests = llm.requests_for(&a);
        assert_eq!(requests.len(), 2);
        let results: Vec<String> = requests[1]
            .messages
            .iter()
            .filter_map(|m| match m {
                ChatMessage::Tool { content, .. } => Some(content.as_str().to_string()),
                _ => None,
            })
            .collect();
        assert_eq!(results.len(), 1, "{results:?}");
        assert!(
            results[0].starts_with(
                "Error: invalid arguments for tool task_create: unknown field `urgency`"
            ),
            "{results:?}"
        );
        assert!(board(&h, "a").await.is_empty());
    }

    #[tokio::test]
    async fn send_agent_message_assigns_the_task_and_ends_the_turn_or_says_why_not() {
        let (h, _llm) = harness("").await;
        let output = answer(
            &h,
            "a",
            "send_agent_message",
            serde_json::json!({"target": "Beta", "message": "Pick a random word"}),
        )
        .await
        .unwrap();
        assert!(output.end_turn);
        assert_eq!(
            output.content,
            "Assigned task #1 to Beta (b): Pick a random word. Your turn ends now; you will be woken with the result."
        );
        assert_eq!(board(&h, "b").await.len(), 1);
        let denied = answer(
            &h,
            "a",
            "send_agent_message",
            serde_json::json!({"target": "x", "message": "Pick a word."}),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&denied, ToolError::Denied(d) if d.reason == DenialReason::NoLink),
            "{denied:?}"
        );
        let unknown = answer(
            &h,
            "a",
            "send_agent_message",
            serde_json::json!({"target": "zed", "message": "Pick a word."}),
        )
        .await
        .unwrap_err();
        assert!(
            unknown
                .to_model_text()
                .contains("agents you can delegate to: b (Beta), c (Gamma)"),
            "{unknown}"
        );
    }

    #[tokio::test]
    async fn the_board_tools_act_on_the_callers_board_and_read_a_subordinates() {
        let (h, _llm) = harness("").await;
        let created = answer(
            &h,
            "b",
            "task_create",
            serde_json::json!({"title": "Tidy up", "priority": "high", "backlog": true}),
        )
        .await
        .unwrap();
        assert_eq!(created.content, "Created task #1 (backlog): Tidy up");
        let task = board(&h, "b").await.remove(0);
        assert_eq!(
            (task.priority, task.created_by.as_str()),
            (Priority::High, "agent:b")
        );
        let scheduled = answer(
            &h,
            "b",
            "task_update",
            serde_json::json!({"number": 1, "action": "schedule"}),
        )
        .await
        .unwrap();
        assert_eq!(scheduled.content, "Task #1 is now ready.");
        // a is b's superior: it may read b's board, not the other way round.
        let listed = answer(&h, "a", "task_list", serde_json::json!({"agent": "Beta"}))
            .await
            .unwrap();
        assert_eq!(listed.content, "#1 [ready] Tidy up (agent:b)");
        let refused = answer(&h, "b", "task_list", serde_json::json!({"agent": "a"}))
            .await
            .unwrap_err();
        assert!(
            matches!(&refused, ToolError::Failed { message, .. } if message.contains("does not report to you")),
            "{refused:?}"
        );
        let empty = answer(&h, "a", "task_list", serde_json::json!({"status": "ready"}))
            .await
            .unwrap();
        assert_eq!(empty.content, "No tasks on a's board.");
    }
}
