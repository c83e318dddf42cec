//! Each user request as a tree, built from the organization's event stream.
//!
//! A request is the exchange one inbound message starts (its envelope id, the `cause` every
//! envelope, task and event of the exchange carries). The tracker follows the events that name a
//! request (turns, model calls, tool calls, steers, tasks, refusals, limits) and the replies
//! published by [`crate::WebChat`], and keeps the most recent requests' trees in memory.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use spacebot_core::runtime::outbound::ReplyKind;
use spacebot_core::{Event, EventKind, Reply};
use utoipa::ToSchema;

/// Tokens a node used, as the provider reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct UsageView {
    /// Prompt (input) tokens.
    pub input_tokens: u64,
    /// Completion (output) tokens.
    pub output_tokens: u64,
    /// Tokens in all.
    pub total_tokens: u64,
}

impl UsageView {
    fn add(&mut self, u: spacebot_core::llm::Usage) {
        self.input_tokens += u64::from(u.prompt_tokens);
        self.output_tokens += u64::from(u.completion_tokens);
        self.total_tokens += u64::from(u.total_tokens);
    }
}

/// One node of a request's tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RequestNodeView {
    /// Its number in the tree, from 0, in the order the nodes appeared.
    pub id: usize,
    /// The node it hangs from; `None` at the top.
    #[serde(default)]
    pub parent: Option<usize>,
    /// `turn`, `model_call`, `tool_call`, `task`, `conversation`, `steer`, `refused`, `limit` or
    /// `compacted`. A conversation hangs under the turn that opened it (status `running`,
    /// `concluded` or `severed`), the other members' turns in it under the conversation.
    pub kind: String,
    /// The agent it happened on.
    pub agent: String,
    /// What it is, in a few words (`turn`, `retrigger`, the tool's name, the task's title...).
    pub label: String,
    /// `running`, `ok`, `failed`, `refused`, `waiting` (a model call waiting for budget held by
    /// the request's other open calls), or a task's status (`ready`, `in_progress`, `done`...).
    pub status: String,
    /// The task it belongs to (or is), `{agent}#{number}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    /// When it started, milliseconds since the Unix epoch.
    pub started_at: i64,
    /// When it ended, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<i64>,
    /// Tokens it used (a turn: all its model calls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageView>,
}

/// A request in the list of recent ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RequestSummaryView {
    /// The request: the envelope id its message was accepted as.
    pub request: String,
    /// The agent its first turn ran on.
    pub agent: String,
    /// The channel of its first turn (`web:dashboard`, ...).
    pub channel: String,
    /// `running`, `done` (answered) or `failed` (a failure reply).
    pub status: String,
    /// When its first event happened, milliseconds since the Unix epoch.
    pub started_at: i64,
    /// When its last event happened.
    pub updated_at: i64,
    /// Agents that worked on it, in order of appearance.
    pub agents: Vec<String>,
    /// Nodes in its tree.
    pub nodes: usize,
    /// Tokens its model calls used.
    pub usage: UsageView,
}

/// A request's tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RequestTreeView {
    /// The request, as in the list.
    #[serde(flatten)]
    pub summary: RequestSummaryView,
    /// The nodes, parents before their children; `parent` links them.
    pub nodes: Vec<RequestNodeView>,
    /// Its spend and limits from the request ledger, when a limit is in use (see
    /// `GET /api/requests/{request}/spend`).
    #[serde(default)]
    pub spend: Option<crate::api::RequestSpendView>,
}

#[derive(Debug)]
struct Tree {
    summary: RequestSummaryView,
    nodes: Vec<RequestNodeView>,
    /// The open turn of each agent.
    open_turn: HashMap<String, usize>,
    /// Agents whose turn ended already (a later turn without a task is a retrigger).
    turned: Vec<String>,
    /// Task node of each task reference.
    tasks: HashMap<String, usize>,
    /// Conversation node of each conversation opened in the request, with its members.
    conversations: HashMap<String, (usize, Vec<String>)>,
}

impl Tree {
    fn node(&mut self, node: RequestNodeView) -> usize {
        let id = self.nodes.len();
        self.nodes.push(RequestNodeView { id, ..node });
        id
    }
}

#[derive(Debug, Default)]
struct State {
    order: VecDeque<String>,
    trees: HashMap<String, Tree>,
    /// The request of each task seen.
    task_request: HashMap<String, String>,
}

/// The recent requests' trees.
#[derive(Debug)]
pub(crate) struct Requests {
    state: Mutex<State>,
    capacity: usize,
}

/// The most nodes one tree keeps (a runaway request stops growing its tree, not the server).
const MAX_NODES: usize = 2000;

impl Requests {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            state: Mutex::new(State::default()),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The recent requests, newest first.
    pub(crate) fn list(&self, limit: usize) -> Vec<RequestSummaryView> {
        let state = self.lock();
        state
            .order
            .iter()
            .rev()
            .filter_map(|r| state.trees.get(r))
            .take(limit)
            .map(|t| t.summary.clone())
            .collect()
    }

    /// One request's tree (without its spend).
    pub(crate) fn tree(&self, request: &str) -> Option<(RequestSummaryView, Vec<RequestNodeView>)> {
        let state = self.lock();
        state
            .trees
            .get(request)
            .map(|t| (t.summary.clone(), t.nodes.clone()))
    }

    /// Takes in one organization event.
    pub(crate) fn observe(&self, e: &Event) {
        let task = e.task.as_ref().map(ToString::to_string);
        let mut state = self.lock();
        let request = match (&e.request, &task) {
            (Some(r), _) => r.to_string(),
            (None, Some(t)) => match state.task_request.get(t) {
                Some(r) => r.clone(),
                None => return,
            },
            (None, None) => return,
        };
        if !state.trees.contains_key(&request) {
            // Only a turn or a task starts a tree; anything else of an unknown request is old.
            if !matches!(
                e.kind,
                EventKind::TurnStarted | EventKind::TaskCreated { .. }
            ) {
                return;
            }
            let tree = Tree {
                summary: RequestSummaryView {
                    request: request.clone(),
                    agent: e.agent.to_string(),
                    channel: e
                        .channel
                        .as_ref()
                        .map(ToString::to_string)
                        .unwrap_or_default(),
                    status: "running".into(),
                    started_at: e.at.0,
                    updated_at: e.at.0,
                    agents: Vec::new(),
                    nodes: 0,
                    usage: UsageView::default(),
                },
                nodes: Vec::new(),
                open_turn: HashMap::new(),
                turned: Vec::new(),
                tasks: HashMap::new(),
                conversations: HashMap::new(),
            };
            state.trees.insert(request.clone(), tree);
            state.order.push_back(request.clone());
            while state.order.len() > self.capacity {
                if let Some(old) = state.order.pop_front() {
                    state.trees.remove(&old);
                    state.task_request.retain(|_, r| *r != old);
                }
            }
        }
        if let (EventKind::TaskCreated { .. }, Some(t)) = (&e.kind, &task) {
            state.task_request.insert(t.clone(), request.clone());
        }
        let Some(tree) = state.trees.get_mut(&request) else {
            return;
        };
        if tree.nodes.len() >= MAX_NODES {
            return;
        }
        apply(tree, e, task);
        let agent = e.agent.to_string();
        if !tree.summary.agents.contains(&agent) {
            tree.summary.agents.push(agent);
        }
        tree.summary.updated_at = tree.summary.updated_at.max(e.at.0);
        tree.summary.nodes = tree.nodes.len();
    }

    /// Takes in a reply: the request it answers is done, or failed. A reply that answers the
    /// notice that retriggered an agent (its delegated work came back) names no request: it ends
    /// the newest running request that started in the same chat with the same agent.
    pub(crate) fn reply(&self, reply: &Reply) {
        let mut state = self.lock();
        let mut ids: Vec<String> = reply
            .in_reply_to
            .iter()
            .map(ToString::to_string)
            .filter(|id| state.trees.contains_key(id))
            .collect();
        if ids.is_empty() {
            let chat = match &reply.source {
                spacebot_core::Source::External {
                    platform,
                    reply_target,
                } => Some(format!("{platform}:{reply_target}")),
                _ => None,
            };
            let channel = reply.channel.to_string();
            let newest = state.order.iter().rev().find(|r| {
                state.trees.get(*r).is_some_and(|t| {
                    t.summary.status == "running"
                        && t.summary.agent == reply.agent.as_str()
                        && (t.summary.channel == channel
                            || chat.as_ref() == Some(&t.summary.channel))
                })
            });
            ids.extend(newest.cloned());
        }
        for id in &ids {
            let Some(tree) = state.trees.get_mut(id.as_str()) else {
                continue;
            };
            let failed = reply.kind == ReplyKind::Failure;
            if let Some(turn) = tree.open_turn.remove(reply.agent.as_str()) {
                let node = &mut tree.nodes[turn];
                node.status = if failed { "failed" } else { "ok" }.into();
                node.ended_at.get_or_insert(reply.at.0);
            }
            tree.summary.status = if failed { "failed" } else { "done" }.into();
            tree.summary.updated_at = tree.summary.updated_at.max(reply.at.0);
        }
    }
}

fn base(e: &Event, kind: &str, label: String, status: &str) -> RequestNodeView {
    RequestNodeView {
        id: 0,
        parent: None,
        kind: kind.into(),
        agent: e.agent.to_string(),
        label,
        status: status.into(),
        task: e.task.as_ref().map(ToString::to_string),
        started_at: e.at.0,
        ended_at: None,
        usage: None,
    }
}

/// A limit's name as the API writes it (`total_tokens`, `model_calls`...).
fn limit_name(limit: spacebot_core::limits::Limit) -> String {
    serde_json::to_value(limit)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn apply(tree: &mut Tree, e: &Event, task: Option<String>) {
    let agent = e.agent.to_string();
    let turn = tree.open_turn.get(&agent).copied();
    let leaf = |tree: &mut Tree, mut node: RequestNodeView| {
        node.parent = turn;
        node.ended_at = Some(e.at.0);
        tree.node(node)
    };
    match &e.kind {
        EventKind::TurnStarted => {
            let under_task = task.as_ref().and_then(|t| tree.tasks.get(t).copied());
            // A member's turn while a conversation it is in runs (not the opener's own).
            let in_conversation = if task.is_none() {
                tree.conversations
                    .values()
                    .filter(|(node, members)| {
                        tree.nodes[*node].status == "running"
                            && tree.nodes[*node].agent != agent
                            && members.contains(&agent)
                    })
                    .map(|(node, _)| *node)
                    .max()
            } else {
                None
            };
            let label = if task.is_some() {
                "turn on the task".to_string()
            } else if in_conversation.is_some() {
                "turn in the conversation".to_string()
            } else if tree.turned.contains(&agent) {
                "retrigger".to_string()
            } else {
                "turn".to_string()
            };
            let mut node = base(e, "turn", label, "running");
            node.parent = under_task.or(in_conversation);
            let id = tree.node(node);
            tree.open_turn.insert(agent, id);
        }
        EventKind::TurnFinished { rounds } => {
            let Some(id) = tree.open_turn.remove(&agent) else {
                return;
            };
            let node = &mut tree.nodes[id];
            node.status = "ok".into();
            node.ended_at = Some(e.at.0);
            node.label = format!("{} · {rounds} round(s)", node.label);
            if let Some(u) = e.usage
                && node.usage.is_none()
                && u.total_tokens > 0
            {
                let mut usage = UsageView::default();
                usage.add(u);
                node.usage = Some(usage);
            }
            if !tree.turned.contains(&agent) {
                tree.turned.push(agent);
            }
        }
        EventKind::TurnCancelled => {
            if let Some(id) = tree.open_turn.remove(&agent) {
                tree.nodes[id].status = "cancelled".into();
                tree.nodes[id].ended_at = Some(e.at.0);
            }
        }
        EventKind::ModelCalled {
            ok,
            duration_ms,
            tool_calls,
        } => {
            let label = if *tool_calls {
                "model call → tool calls"
            } else {
                "model call"
            };
            let mut node = base(
                e,
                "model_call",
                label.into(),
                if *ok { "ok" } else { "failed" },
            );
            node.started_at =
                e.at.0
                    .saturating_sub(i64::try_from(*duration_ms).unwrap_or(0));
            if let Some(u) = e.usage {
                let mut usage = UsageView::default();
                usage.add(u);
                node.usage = Some(usage);
                tree.summary.usage.add(u);
                if let Some(t) = turn {
                    tree.nodes[t]
                        .usage
                        .get_or_insert_with(UsageView::default)
                        .add(u);
                }
            }
            leaf(tree, node);
        }
        EventKind::ToolCalled { tool, ok } => {
            leaf(
                tree,
                base(
                    e,
                    "tool_call",
                    tool.clone(),
                    if *ok { "ok" } else { "failed" },
                ),
            );
        }
        EventKind::Steered { merged } => {
            leaf(
                tree,
                base(
                    e,
                    "steer",
                    format!("steered: {merged} message(s) merged"),
                    "ok",
                ),
            );
        }
        EventKind::Refused {
            target,
            action,
            reason,
        } => {
            leaf(
                tree,
                base(
                    e,
                    "refused",
                    format!("refused: {action} → {target}: {reason}"),
                    "refused",
                ),
            );
        }
        EventKind::LimitReached { over, .. } => {
            let limit = limit_name(over.limit);
            leaf(
                tree,
                base(
                    e,
                    "limit",
                    format!("limit reached: {limit} {} of {}", over.value, over.max),
                    "failed",
                ),
            );
        }
        EventKind::LimitWait { over, .. } => {
            let limit = limit_name(over.limit);
            leaf(
                tree,
                base(
                    e,
                    "limit",
                    format!(
                        "waits for budget: {limit} {} of {} with the open reservations",
                        over.value, over.max
                    ),
                    "waiting",
                ),
            );
        }
        EventKind::RoundLimitReached { limit } => {
            leaf(
                tree,
                base(e, "limit", format!("round limit {limit} reached"), "failed"),
            );
        }
        EventKind::Compacted { through } => {
            leaf(
                tree,
                base(
                    e,
                    "compacted",
                    format!("history compacted through #{through}"),
                    "ok",
                ),
            );
        }
        EventKind::ConversationOpened {
            conversation,
            members,
        } => {
            let members: Vec<String> = members.iter().map(ToString::to_string).collect();
            let others: Vec<&str> = members
                .iter()
                .filter(|m| **m != agent)
                .map(String::as_str)
                .collect();
            let mut node = base(
                e,
                "conversation",
                format!("conversation {conversation} with {}", others.join(", ")),
                "running",
            );
            node.parent = turn;
            let id = tree.node(node);
            tree.conversations
                .insert(conversation.to_string(), (id, members));
        }
        EventKind::ConversationConcluded { conversation }
        | EventKind::ConversationSevered { conversation, .. } => {
            let Some((id, _)) = tree.conversations.get(&conversation.to_string()) else {
                return;
            };
            let node = &mut tree.nodes[*id];
            if node.status == "running" {
                node.status = match &e.kind {
                    EventKind::ConversationConcluded { .. } => "concluded".into(),
                    _ => "severed".into(),
                };
                node.ended_at = Some(e.at.0);
            }
            if let EventKind::ConversationSevered { reason, .. } = &e.kind {
                node.label = format!("{} · severed: {reason}", node.label);
            }
        }
        EventKind::TaskCreated { created_by, status } => {
            let Some(t) = task else { return };
            let delegator = created_by.strip_prefix("agent:").map(str::to_string);
            let parent = delegator
                .as_ref()
                .and_then(|d| tree.open_turn.get(d).copied())
                .or_else(|| {
                    e.parent
                        .as_ref()
                        .and_then(|p| tree.tasks.get(&p.to_string()).copied())
                });
            let mut node = base(
                e,
                "task",
                format!(
                    "task {t} from {}",
                    delegator.as_deref().unwrap_or(created_by)
                ),
                status.as_str(),
            );
            node.parent = parent;
            let id = tree.node(node);
            tree.tasks.insert(t, id);
        }
        EventKind::TaskClaimed { .. }
        | EventKind::TaskCompleted
        | EventKind::TaskFailed { .. }
        | EventKind::TaskCancelled
        | EventKind::TaskRequeued { .. } => {
            let Some(id) = task.and_then(|t| tree.tasks.get(&t).copied()) else {
                return;
            };
            let (status, ended) = match &e.kind {
                EventKind::TaskClaimed { .. } => ("in_progress", false),
                EventKind::TaskCompleted => ("done", true),
                EventKind::TaskFailed { .. } => ("failed", true),
                EventKind::TaskCancelled => ("cancelled", true),
                _ => ("ready", false),
            };
            let node = &mut tree.nodes[id];
            node.status = status.into();
            node.ended_at = ended.then_some(e.at.0);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use spacebot_core::limits::{Limit, Over};
    use spacebot_core::{AgentId, EnvelopeId, Timestamp};

    use super::*;

    /// A model call waiting for budget shows in its request's tree, under the turn that makes
    /// it, as a `limit` node with status `waiting`, naming the limit.
    #[test]
    fn a_call_waiting_for_budget_is_a_waiting_limit_node() {
        let requests = Requests::new(8);
        let request = EnvelopeId::new("req-1");
        let agent = AgentId::parse("w1").unwrap();
        let at = |ms, kind| {
            let mut e = Event::new(Timestamp(ms), agent.clone(), kind);
            e.request = Some(request.clone());
            e
        };
        requests.observe(&at(1, EventKind::TurnStarted));
        let over = Over {
            limit: Limit::TotalTokens,
            max: 5000,
            value: 6200,
        };
        requests.observe(&at(
            2,
            EventKind::LimitWait {
                request: request.clone(),
                over,
            },
        ));
        let (_, nodes) = requests.tree(request.as_str()).unwrap();
        let waiting = nodes
            .iter()
            .find(|n| n.kind == "limit")
            .expect("a limit node");
        assert_eq!(waiting.status, "waiting");
        assert_eq!(waiting.agent, "w1");
        assert!(
            waiting.label.contains("total_tokens 6200 of 5000"),
            "{}",
            waiting.label
        );
        let turn = nodes.iter().find(|n| n.kind == "turn").unwrap();
        assert_eq!(waiting.parent, Some(turn.id));
    }
}
