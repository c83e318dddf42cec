//! The scripted model `spacebot serve` runs by default: no network, predictable, and enough to
//! watch the README's story on the dashboard, hop by hop.
//!
//! - A chat message to an agent that is superior to someone is delegated to the first such
//!   subordinate (`send_agent_message`); if the delegation is refused (a disabled link), the agent
//!   says so.
//! - A delegated task is handed on the same way to the worker's own subordinate, down to an
//!   agent with nobody below it, which does the work: asked for a word, it picks one (a different
//!   one each time); otherwise it says it did what was asked.
//! - A worker whose delegated task came back finishes its own task with that result, and a
//!   delegator woken by a result reports it to the chat. Each reply quotes only the work's own
//!   text (the request, the result), never the runtime's wrapper sentences.
//! - Anything else is acknowledged.
//!
//! It reads the task and result texts as the built-in `task_assigned` and `task_retrigger`
//! templates write them (`spacebot serve` uses the built-in prompts).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use spacebot_core::llm::{ChatMessage, ChatResponse};
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{AgentId, EnvelopeKind, LinkRelationship, OrgConfig, Timestamp};

/// The words the demo's workers pick, in turn.
const WORDS: [&str; 8] = [
    "nebula", "lantern", "orbit", "meadow", "quasar", "harbor", "ember", "tundra",
];

fn excerpt(text: &str, max: usize) -> String {
    let line = text
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    if line.chars().count() <= max {
        line.to_string()
    } else {
        format!("{}…", line.chars().take(max).collect::<String>())
    }
}

/// The header of the results part of a resumed task's text (the `task_assigned` template).
const ENDED: &str = "The tasks you delegated have ended:";

/// What a task asks for: the description of a task's text as the `task_assigned` template writes
/// it (`You have been assigned task #N: title`, the description, `(Delegated by x.)`, then the
/// results of the tasks it delegated).
fn task_request(text: &str) -> String {
    let body = match text.split_once('\n') {
        Some((first, rest)) if first.starts_with("You have been assigned task #") => rest,
        _ => text,
    };
    let body = body.split("\n\n(Delegated by ").next().unwrap_or(body);
    let body = body.split(ENDED).next().unwrap_or(body);
    body.trim().to_string()
}

/// The results of the tasks a resumed task delegated: `(agent, status, outcome)` per line
/// `- agent#n (status): outcome`.
fn ended_children(text: &str) -> Vec<(String, String, String)> {
    let Some((_, rest)) = text.split_once(ENDED) else {
        return Vec::new();
    };
    rest.lines()
        .filter_map(|line| {
            let line = line.trim().strip_prefix("- ")?;
            let (task, rest) = line.split_once(" (")?;
            let (status, outcome) = rest.split_once("): ")?;
            let agent = task.split('#').next()?.to_string();
            Some((agent, status.to_string(), outcome.trim().to_string()))
        })
        .collect()
}

/// A delegator's notice, as the `task_retrigger` template writes it: `(worker, ended well,
/// result)`.
fn notice(text: &str) -> Option<(String, bool, String)> {
    let text = text.trim();
    if let Some((who, rest)) = text.split_once(" completed task #") {
        let (_, result) = rest.split_once(": ")?;
        return Some((who.to_string(), true, result.trim().to_string()));
    }
    if let Some((who, rest)) = text.split_once("'s worker failed on task #") {
        let (_, error) = rest.split_once(": ")?;
        return Some((who.to_string(), false, error.trim().to_string()));
    }
    let (head, reason) = text.split_once(" was cancelled: ")?;
    let who = head.split_once(" assigned to ")?.1;
    Some((
        who.to_string(),
        false,
        format!("cancelled ({})", reason.trim()),
    ))
}

/// The demo model for `config`.
pub(crate) fn model(config: &OrgConfig) -> ScriptedLlm {
    let names: HashMap<AgentId, String> = config
        .agents
        .iter()
        .map(|a| (a.id.clone(), a.name.clone()))
        .collect();
    let mut subordinate: HashMap<AgentId, AgentId> = HashMap::new();
    for link in config.links_at(Timestamp(0)) {
        let (boss, report) = match link.relationship {
            LinkRelationship::Superior => (link.from, link.to),
            LinkRelationship::Subordinate => (link.to, link.from),
            LinkRelationship::Peer => continue,
        };
        subordinate.entry(boss).or_insert(report);
    }
    let picked = AtomicUsize::new(0);
    ScriptedLlm::new().with_fallback(move |request| {
        let agent = request.agent.clone();
        let name_of = |id: &str| {
            AgentId::parse(id)
                .ok()
                .and_then(|a| names.get(&a).cloned())
                .unwrap_or_else(|| id.to_string())
        };
        let name = agent
            .as_ref()
            .map(|a| name_of(a.as_str()))
            .unwrap_or_else(|| "the agent".into());
        let last = request.messages.last();
        let last_user = request
            .messages
            .iter()
            .rev()
            .find_map(|m| match m {
                ChatMessage::User { content } => Some(content.as_str()),
                _ => None,
            })
            .unwrap_or("");
        let delegate = |message: &str| {
            let target = agent.as_ref().and_then(|a| subordinate.get(a))?;
            Some(ChatResponse::tool_calls(vec![
                spacebot_core::testing::tool_call(
                    "send_agent_message",
                    serde_json::json!({
                        "target": target.as_str(),
                        "message": excerpt(message, 400),
                    }),
                ),
            ]))
        };
        let text = match (request.envelope_kind, last) {
            (_, Some(ChatMessage::Tool { content, .. })) => {
                format!("I could not hand this on: {}", excerpt(content, 160))
            }
            (Some(EnvelopeKind::UserMessage), _) => match delegate(last_user) {
                Some(call) => return Ok(call),
                None => format!("{name} here. You said: {}", excerpt(last_user, 200)),
            },
            (Some(EnvelopeKind::TaskAssigned), _) => {
                let children = ended_children(last_user);
                let asked = task_request(last_user);
                if !children.is_empty() {
                    // Back from the task it handed on: finish with its result.
                    children
                        .iter()
                        .map(|(worker, status, outcome)| match status.as_str() {
                            "done" => format!("{} answered: {outcome}", name_of(worker)),
                            other => {
                                format!("{} could not do it ({other}): {outcome}", name_of(worker))
                            }
                        })
                        .collect::<Vec<_>>()
                        .join(" ")
                } else if let Some(call) = delegate(&asked) {
                    return Ok(call);
                } else if asked.to_lowercase().contains("word") {
                    let n = picked.fetch_add(1, Ordering::Relaxed);
                    format!("My word is “{}”.", WORDS[n % WORDS.len()])
                } else {
                    format!("Done: {}", excerpt(&asked, 200))
                }
            }
            (Some(EnvelopeKind::Retrigger), _) => match notice(last_user) {
                Some((worker, true, result)) => format!("{worker} reports: {result}"),
                Some((worker, false, error)) => format!("{worker} could not do it: {error}"),
                None => format!("{name}: noted."),
            },
            _ => format!("{name}: noted."),
        };
        Ok(ChatResponse::text(text))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::sync::Arc;
    use std::time::Duration;

    use futures::StreamExt;
    use spacebot_core::llm::{ChatMessage, ChatRequest};
    use spacebot_core::rt::{TokioClock, TokioSpawner};
    use spacebot_core::task::{TaskFilter, TaskStatus};
    use spacebot_core::{
        AgentId, ChannelId, EnvelopeKind, InboundMessage, LlmProvider, OrgConfig, Organization,
        Stores,
    };

    const ORG: &str = r#"
[[agents]]
id = "boss"
name = "Boss"
[[agents]]
id = "worker"
name = "Worker"
[[links]]
from = "worker"
to = "boss"
relationship = "subordinate"
direction = "two_way"
"#;

    fn request(agent: &str, kind: EnvelopeKind, messages: Vec<ChatMessage>) -> ChatRequest {
        ChatRequest {
            agent: Some(AgentId::parse(agent).unwrap()),
            envelope_kind: Some(kind),
            messages,
            ..ChatRequest::default()
        }
    }

    fn user(text: &str) -> ChatMessage {
        ChatMessage::User {
            content: text.into(),
        }
    }

    #[tokio::test]
    async fn delegates_chat_down_and_reports_back() {
        let llm = super::model(&OrgConfig::from_toml_str(ORG).unwrap());
        // A chat message to the superior (written bottom-up in the config) is delegated.
        let answer = llm
            .complete(request(
                "boss",
                EnvelopeKind::UserMessage,
                vec![user("Plan the launch")],
            ))
            .await
            .unwrap();
        assert_eq!(answer.tool_calls[0].name, "send_agent_message");
        let args: serde_json::Value =
            serde_json::from_str(&answer.tool_calls[0].arguments).unwrap();
        assert_eq!(args["target"], "worker");
        assert_eq!(args["message"], "Plan the launch");
        // A refused delegation comes back as a tool result, and is said.
        let refused = ChatMessage::Tool {
            tool_call_id: answer.tool_calls[0].id.clone(),
            content: "their link is disabled".into(),
        };
        let answer = llm
            .complete(request(
                "boss",
                EnvelopeKind::UserMessage,
                vec![user("Plan the launch"), refused],
            ))
            .await
            .unwrap();
        assert_eq!(
            answer.content.as_deref(),
            Some("I could not hand this on: their link is disabled")
        );
        // The subordinate has nobody to delegate to: it does its task, and answers a chat message.
        let answer = llm
            .complete(request(
                "worker",
                EnvelopeKind::TaskAssigned,
                vec![user(
                    "You have been assigned task #1: Plan the launch\n\nPlan the launch\n\n(Delegated by boss.)",
                )],
            ))
            .await
            .unwrap();
        assert_eq!(answer.content.as_deref(), Some("Done: Plan the launch"));
        let answer = llm
            .complete(request(
                "worker",
                EnvelopeKind::UserMessage,
                vec![user("hi")],
            ))
            .await
            .unwrap();
        assert!(answer.tool_calls.is_empty());
        assert_eq!(answer.content.as_deref(), Some("Worker here. You said: hi"));
        // A result coming back is reported without the notice's wrapper.
        for (notice, said) in [
            (
                "Worker completed task #1: planned",
                "Worker reports: planned",
            ),
            (
                "Worker's worker failed on task #2: no time",
                "Worker could not do it: no time",
            ),
            (
                "Task #3 assigned to Worker was cancelled: not needed",
                "Worker could not do it: cancelled (not needed)",
            ),
        ] {
            let answer = llm
                .complete(request("boss", EnvelopeKind::Retrigger, vec![user(notice)]))
                .await
                .unwrap();
            assert_eq!(answer.content.as_deref(), Some(said));
        }
    }

    /// The wrapper sentences of the runtime's own texts, which no reply may quote.
    const WRAPPERS: [&str; 6] = [
        "assigned task #",
        "completed task #",
        "Delegated by",
        "The tasks you delegated",
        "Finish your task",
        "failed on task #",
    ];

    /// The README's story on the demo model and the README's organization: the user asks the
    /// chief to have the community manager pick a word; the chief hands it to the tech lead, the
    /// tech lead to the community manager, who picks it; the word comes back up, hop by hop, and
    /// no reply or task result quotes the runtime's wrapper text.
    #[tokio::test]
    async fn the_demo_tells_the_readme_story_hop_by_hop() {
        let config =
            OrgConfig::load(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/org.toml")).unwrap();
        let llm = Arc::new(super::model(&config));
        let stores = Stores::memory();
        let org = Organization::builder(config)
            .stores(stores.clone())
            .llm(llm.clone())
            .spawner(Arc::new(TokioSpawner::current()))
            .clock(Arc::new(TokioClock))
            .build()
            .await
            .unwrap();
        let mut replies = org.take_replies().unwrap();
        org.start_all().await.unwrap();
        let id = |s: &str| AgentId::parse(s).unwrap();
        let (chief, lead, cm) = (
            id("chief-ai-officer"),
            id("spacebot-tech-lead"),
            id("community-manager"),
        );
        let asked =
            "Please ask the community manager to pick a random word for me, and tell me which one.";
        org.deliver(
            "chief-ai-officer",
            InboundMessage::new("portal", "user-1", asked).with_channel(ChannelId::portal(&chief)),
        )
        .await
        .unwrap();
        let reply = tokio::time::timeout(Duration::from_secs(20), replies.next())
            .await
            .expect("the chief answers")
            .unwrap();
        assert!(!reply.is_failure(), "{}", reply.content);
        assert_eq!(
            reply.content,
            "Spacebot Tech Lead reports: Community Manager answered: My word is “nebula”."
        );

        // Hop by hop: the chief delegated the user's request to the tech lead ...
        let calls_of = |agent: &AgentId| llm.requests_for(agent);
        let chief_calls = calls_of(&chief);
        assert_eq!(chief_calls.len(), 2, "asked, then woken by the result");
        assert_eq!(chief_calls[1].envelope_kind, Some(EnvelopeKind::Retrigger));
        // ... who handed it to the community manager, and finished once it came back ...
        let lead_calls = calls_of(&lead);
        assert_eq!(lead_calls.len(), 2, "its task, then the task resumed");
        // ... who picked the word.
        let cm_calls = calls_of(&cm);
        assert_eq!(cm_calls.len(), 1);
        assert_eq!(cm_calls[0].envelope_kind, Some(EnvelopeKind::TaskAssigned));
        let boards = |agent: &AgentId| {
            let stores = stores.clone();
            let agent = agent.clone();
            async move {
                stores
                    .tasks
                    .list(&agent, &TaskFilter::default())
                    .await
                    .unwrap()
            }
        };
        let lead_tasks = boards(&lead).await;
        assert_eq!(lead_tasks.len(), 1);
        assert_eq!(lead_tasks[0].status, TaskStatus::Done);
        assert_eq!(lead_tasks[0].description, asked);
        assert_eq!(
            lead_tasks[0].result.as_deref(),
            Some("Community Manager answered: My word is “nebula”.")
        );
        let cm_tasks = boards(&cm).await;
        assert_eq!(cm_tasks.len(), 1);
        assert_eq!(cm_tasks[0].description, asked);
        assert_eq!(cm_tasks[0].result.as_deref(), Some("My word is “nebula”."));
        assert_eq!(
            cm_tasks[0].metadata.delegated_by.as_ref(),
            Some(&lead),
            "the community manager's task came from the tech lead"
        );
        for text in [
            Some(reply.content.as_str()),
            lead_tasks[0].result.as_deref(),
            cm_tasks[0].result.as_deref(),
        ] {
            let text = text.unwrap();
            for wrapper in WRAPPERS {
                assert!(!text.contains(wrapper), "{wrapper:?} in {text:?}");
            }
        }
        org.shutdown().await.unwrap();
    }
}
