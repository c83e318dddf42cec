//! Prompts: minijinja templates embedded in the crate and overridable by the application.
//!
//! | Template | Rendered by | Says |
//! |---|---|---|
//! | `system_prompt` | [`Prompts::render_system_prompt`] | who the agent is (identity files), its place in the organization, the link it is talking over |
//! | `org_context` | [`Prompts::render_org_context`] | superiors, direct reports and peers (seed 003) |
//! | `link_context` | [`Prompts::render_link_context`] | who is on the other end of a link channel and what that relationship means (seed 003) |
//! | `send_agent_message` | [`Prompts::render_send_agent_message`] | the delegation tool's description (seed 001) |
//! | `conversation_rules` | [`Prompts::render_conversation_rules`] | the anti-chattiness rules given to conversation members once, at creation (seed 002) |
//! | `task_retrigger` | [`Prompts::render_task_retrigger`] | the system message that wakes a delegator when its task ends (seed 001) |
//! | `task_assigned` | [`Prompts::render_task_assigned`] | the message a worker's turn on a task starts with: its number, title and description, who delegated it, and the results of the tasks it delegated in turn once they ended ([`TaskAssignedContext`]) |
//!
//! Prompts only explain the organization to the model; the runtime enforces the policy.
//! Rendered text is tidied: trimmed, with runs of blank lines collapsed to one.
//!
//! ```
//! use spacebot_core::prompts::{Prompts, TaskOutcome, TaskRetriggerContext};
//! let mut prompts = Prompts::new();
//! let notice = TaskRetriggerContext {
//!     agent_name: "community-manager".into(),
//!     task_number: 42,
//!     outcome: TaskOutcome::Completed,
//!     summary: "Published 3 posts".into(),
//! };
//! assert_eq!(
//!     prompts.render_task_retrigger(&notice).unwrap(),
//!     "community-manager completed task #42: Published 3 posts"
//! );
//! prompts
//!     .override_template("task_retrigger", "{{ agent_name }} is done with #{{ task_number }}")
//!     .unwrap();
//! assert_eq!(prompts.render_task_retrigger(&notice).unwrap(), "community-manager is done with #42");
//! assert!(prompts.override_template("task_retrigger", "{% if %}").is_err());
//! ```

mod identity;

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, UndefinedBehavior};
use serde::{Deserialize, Serialize};

pub use identity::{Identity, IdentityError};

use crate::ids::AgentId;
use crate::link::{AgentLink, LinkRelationship};
use crate::policy::OrgChart;

/// The built-in templates: `(name, source)`.
pub const TEMPLATES: [(&str, &str); 7] = [
    (
        "system_prompt",
        include_str!("../../templates/system_prompt.j2"),
    ),
    (
        "org_context",
        include_str!("../../templates/org_context.j2"),
    ),
    (
        "link_context",
        include_str!("../../templates/link_context.j2"),
    ),
    (
        "send_agent_message",
        include_str!("../../templates/send_agent_message.j2"),
    ),
    (
        "conversation_rules",
        include_str!("../../templates/conversation_rules.j2"),
    ),
    (
        "task_retrigger",
        include_str!("../../templates/task_retrigger.j2"),
    ),
    (
        "task_assigned",
        include_str!("../../templates/task_assigned.j2"),
    ),
];

/// A template failed to compile or render.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PromptError {
    /// The template has a syntax error, or rendering it failed (for example it prints a
    /// variable the context does not have).
    #[error("prompt template {name:?}: {source}")]
    Template {
        /// The template.
        name: String,
        /// minijinja's error, with the line.
        #[source]
        source: minijinja::Error,
    },
}

/// An agent as prompts show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentSummary {
    /// Id (what tools take).
    pub id: AgentId,
    /// Display name.
    pub name: String,
}

/// The `org_context` template's input: an agent's superiors, subordinates and peers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrgContext {
    /// Superiors.
    pub superiors: Vec<AgentSummary>,
    /// Direct reports.
    pub subordinates: Vec<AgentSummary>,
    /// Peers.
    pub peers: Vec<AgentSummary>,
    /// Whether the agent may delegate to any of them now (the policy's word: an agent whose
    /// links all come one-way from others may not, and is not told to use `send_agent_message`).
    #[serde(default = "yes")]
    pub may_delegate: bool,
}

fn yes() -> bool {
    true
}

impl Default for OrgContext {
    fn default() -> Self {
        Self {
            superiors: Vec::new(),
            subordinates: Vec::new(),
            peers: Vec::new(),
            may_delegate: true,
        }
    }
}

impl OrgContext {
    /// The chart's agents, named by `name_of` (`may_delegate` is true: the runtime sets it from
    /// the policy).
    pub fn from_chart(chart: &OrgChart, name_of: impl Fn(&AgentId) -> String) -> Self {
        let summarize = |ids: &[AgentId]| {
            ids.iter()
                .map(|id| AgentSummary {
                    id: id.clone(),
                    name: name_of(id),
                })
                .collect()
        };
        Self {
            superiors: summarize(&chart.superiors),
            subordinates: summarize(&chart.subordinates),
            peers: summarize(&chart.peers),
            may_delegate: true,
        }
    }

    /// Whether the agent has nobody to talk to.
    pub fn is_empty(&self) -> bool {
        self.superiors.is_empty() && self.subordinates.is_empty() && self.peers.is_empty()
    }
}

/// The `link_context` template's input: the agent on the other end of a link channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkContext {
    /// The other agent.
    pub agent_id: AgentId,
    /// Its display name.
    pub agent_name: String,
    /// What the other agent is to the one reading the prompt.
    pub relationship: LinkRelationship,
}

impl LinkContext {
    /// The context of `link` as `me` sees it (`None` if `me` is not on the link).
    pub fn from_link(
        link: &AgentLink,
        me: &AgentId,
        name_of: impl Fn(&AgentId) -> String,
    ) -> Option<Self> {
        let other = link.other(me)?;
        Some(Self {
            agent_id: other.clone(),
            agent_name: name_of(other),
            relationship: link.relationship_of_other(me)?,
        })
    }
}

/// The `system_prompt` template's input.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SystemPromptContext {
    /// The agent's display name.
    pub agent_name: String,
    /// Its identity texts.
    pub identity: Identity,
    /// Its place in the organization (omitted when `None` or empty).
    pub org_context: Option<OrgContext>,
    /// The link channel this turn runs on, if it is one.
    pub link_context: Option<LinkContext>,
    /// Anything else the application appends.
    pub extra: Option<String>,
}

/// The `send_agent_message` tool description's input.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SendAgentMessageContext {
    /// The agents the caller may delegate to (the list is omitted when empty).
    pub targets: Vec<AgentSummary>,
}

/// The `conversation_rules` template's input.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ConversationRulesContext {
    /// Display names of the other members.
    pub members: Vec<String>,
    /// Whether the reader started the conversation (and owns it).
    pub is_initiator: bool,
    /// The conversation's turn budget, if it has one.
    pub turn_budget: Option<u32>,
}

/// How a delegated task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskOutcome {
    /// Done.
    Completed,
    /// Failed for good.
    Failed,
    /// Cancelled.
    Cancelled,
}

/// The `task_retrigger` template's input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRetriggerContext {
    /// The agent that worked on the task.
    pub agent_name: String,
    /// The task's number on that agent's board.
    pub task_number: u64,
    /// How it ended.
    pub outcome: TaskOutcome,
    /// The result, the error, or the reason for cancelling.
    pub summary: String,
}

/// The `task_assigned` template's input: what a worker's turn on a task starts with.
///
/// The built-in template renders, for task #1 "Find a word." delegated by `a`:
///
/// ```text
/// You have been assigned task #1: Find a word.
///
/// Find a word.
///
/// (Delegated by a.)
/// ```
///
/// followed, when the worker resumes after tasks it delegated in turn ended, by "The tasks you
/// delegated have ended:", one line per child (`- c#1 (done): its result`) and "Finish your task
/// with these results.". Override `task_assigned` to change it:
///
/// ```
/// use spacebot_core::prompts::{Prompts, TaskAssignedContext};
/// let mut prompts = Prompts::new();
/// prompts.override_template("task_assigned", "{{ description }}").unwrap();
/// let ctx = TaskAssignedContext {
///     task_number: 1,
///     title: "Find a word.".into(),
///     description: "Find a word.".into(),
///     delegated_by: Some("a".into()),
///     ended_children: Vec::new(),
/// };
/// assert_eq!(prompts.render_task_assigned(&ctx).unwrap(), "Find a word.");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TaskAssignedContext {
    /// The task's number on the worker's board.
    pub task_number: u64,
    /// Its title (the description's first sentence).
    pub title: String,
    /// Its description: what the delegator asked for.
    pub description: String,
    /// The id of the agent that delegated it, if one did.
    pub delegated_by: Option<String>,
    /// The tasks the worker delegated in turn that have ended, in the order they were delegated.
    pub ended_children: Vec<EndedChild>,
}

/// A task a worker delegated that has ended, as [`TaskAssignedContext`] shows it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct EndedChild {
    /// The task, as `agent#number`.
    pub task: String,
    /// How it ended (`done`, `failed`, `cancelled`).
    pub status: String,
    /// Its result or error.
    pub outcome: String,
}

/// The prompt templates: built in, overridable. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Prompts {
    env: Environment<'static>,
}

impl Default for Prompts {
    fn default() -> Self {
        Self::new()
    }
}

impl Prompts {
    /// The built-in templates.
    pub fn new() -> Self {
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::SemiStrict);
        if let Ok(syntax) = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
        {
            env.set_syntax(syntax);
        }
        for (name, source) in TEMPLATES {
            // The built-in templates are compiled by the tests; a failure here is a bug in them
            // and would surface as a render error naming the template.
            let _ = env.add_template(name, source);
        }
        Self { env }
    }

    /// Replaces template `name` (or adds a new one that others may include) with `source`,
    /// after checking that it compiles; on error the previous template stays in place.
    pub fn override_template(
        &mut self,
        name: impl Into<String>,
        source: impl Into<String>,
    ) -> Result<(), PromptError> {
        let name = name.into();
        let source = source.into();
        // Compile in a scratch environment first so a bad override changes nothing.
        let mut scratch = self.env.clone();
        scratch
            .add_template_owned(name.clone(), source.clone())
            .map_err(|source| PromptError::Template {
                name: name.clone(),
                source,
            })?;
        self.env = scratch;
        Ok(())
    }

    /// Renders template `name` with any serializable context, tidied.
    pub fn render<S: Serialize>(&self, name: &str, context: &S) -> Result<String, PromptError> {
        let err = |source| PromptError::Template {
            name: name.to_owned(),
            source,
        };
        let template = self.env.get_template(name).map_err(err)?;
        let text = template
            .render(minijinja::value::Serde(context))
            .map_err(err)?;
        Ok(tidy(&text))
    }

    /// The system prompt of an agent.
    pub fn render_system_prompt(&self, ctx: &SystemPromptContext) -> Result<String, PromptError> {
        // An empty org context is left out entirely.
        let org_context = ctx.org_context.as_ref().filter(|o| !o.is_empty());
        self.render(
            "system_prompt",
            &SystemPromptContext {
                org_context: org_context.cloned(),
                ..ctx.clone()
            },
        )
    }

    /// The organization section alone.
    pub fn render_org_context(&self, org_context: &OrgContext) -> Result<String, PromptError> {
        let org_context = (!org_context.is_empty()).then_some(org_context);
        self.render(
            "org_context",
            &serde_json::json!({ "org_context": org_context }),
        )
    }

    /// The link channel section alone.
    pub fn render_link_context(&self, link_context: &LinkContext) -> Result<String, PromptError> {
        self.render(
            "link_context",
            &serde_json::json!({ "link_context": link_context }),
        )
    }

    /// The `send_agent_message` tool description.
    pub fn render_send_agent_message(
        &self,
        ctx: &SendAgentMessageContext,
    ) -> Result<String, PromptError> {
        self.render("send_agent_message", ctx)
    }

    /// The rules given to every member of a conversation once, when it is created.
    pub fn render_conversation_rules(
        &self,
        ctx: &ConversationRulesContext,
    ) -> Result<String, PromptError> {
        self.render("conversation_rules", ctx)
    }

    /// The system message that wakes a delegator when its task ends.
    pub fn render_task_retrigger(&self, ctx: &TaskRetriggerContext) -> Result<String, PromptError> {
        self.render("task_retrigger", ctx)
    }

    /// The message a worker's turn on a task starts with (see [`TaskAssignedContext`]).
    pub fn render_task_assigned(&self, ctx: &TaskAssignedContext) -> Result<String, PromptError> {
        self.render("task_assigned", ctx)
    }
}

/// Trims the text and collapses runs of blank lines into one.
fn tidy(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut blank_run = 0;
    for line in text.trim().lines() {
        let line = line.trim_end();
        if line.is_empty() {
            blank_run += 1;
            if blank_run > 1 {
                continue;
            }
        } else {
            blank_run = 0;
        }
        out.push_str(line);
        out.push('\n');
    }
    out.truncate(out.trim_end().len());
    out
}
