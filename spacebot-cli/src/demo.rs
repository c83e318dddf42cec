//! The scripted model `spacebot serve` runs by default: no network, predictable, and enough to
//! watch delegation on the dashboard.
//!
//! - A chat message to an agent that is superior to someone is delegated to the first such
//!   subordinate (`send_agent_message`); if the delegation is refused (a disabled link), the agent
//!   says so.
//! - A delegated task is answered as done.
//! - A task's result coming back is reported to the chat.
//! - Anything else is acknowledged.

use std::collections::HashMap;

use spacebot_core::llm::{ChatMessage, ChatResponse};
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{AgentId, EnvelopeKind, LinkRelationship, OrgConfig, Timestamp};

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
    ScriptedLlm::new().with_fallback(move |request| {
        let agent = request.agent.clone();
        let name = agent
            .as_ref()
            .and_then(|a| names.get(a).cloned())
            .unwrap_or_else(|| "the agent".into());
        let last = request.messages.last();
        let last_user = request.messages.iter().rev().find_map(|m| match m {
            ChatMessage::User { content } => Some(content.as_str()),
            _ => None,
        });
        let text = match (request.envelope_kind, last) {
            (_, Some(ChatMessage::Tool { content, .. })) => {
                format!(
                    "{name}: I could not hand this on ({})",
                    excerpt(content, 160)
                )
            }
            (Some(EnvelopeKind::UserMessage), _) => {
                let target = agent.as_ref().and_then(|a| subordinate.get(a));
                match (target, last_user) {
                    (Some(target), Some(message)) => {
                        return Ok(ChatResponse::tool_calls(vec![
                            spacebot_core::testing::tool_call(
                                "send_agent_message",
                                serde_json::json!({
                                    "target": target.as_str(),
                                    "message": excerpt(message, 400),
                                }),
                            ),
                        ]));
                    }
                    _ => format!(
                        "{name} here. You said: {}",
                        excerpt(last_user.unwrap_or(""), 200)
                    ),
                }
            }
            (Some(EnvelopeKind::TaskAssigned), _) => {
                format!("{name}: done. ({})", excerpt(last_user.unwrap_or(""), 120))
            }
            (Some(EnvelopeKind::Retrigger), _) => format!(
                "{name} reporting back: {}",
                excerpt(last_user.unwrap_or(""), 300)
            ),
            _ => format!("{name}: noted."),
        };
        Ok(ChatResponse::text(text))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use spacebot_core::llm::{ChatMessage, ChatRequest};
    use spacebot_core::{AgentId, EnvelopeKind, LlmProvider, OrgConfig};

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
        assert!(
            answer
                .content
                .unwrap()
                .contains("could not hand this on (their link is disabled)")
        );
        // The subordinate has nobody to delegate to: it answers its task, and a chat message.
        let answer = llm
            .complete(request(
                "worker",
                EnvelopeKind::TaskAssigned,
                vec![user("Plan the launch")],
            ))
            .await
            .unwrap();
        assert!(answer.content.unwrap().starts_with("Worker: done."));
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
        // A result coming back is reported.
        let answer = llm
            .complete(request(
                "boss",
                EnvelopeKind::Retrigger,
                vec![user("worker completed task #1: planned")],
            ))
            .await
            .unwrap();
        assert_eq!(
            answer.content.as_deref(),
            Some("Boss reporting back: worker completed task #1: planned")
        );
    }
}
