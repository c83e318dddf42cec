//! Channel history as model input: pure conversion from stored records to chat messages.

use crate::channel::{ChannelRecord, HistoryText, RecordKind};
use crate::llm::{ChatMessage, ToolCall};

/// Turns a channel's stored records into the chat messages a model sees before the current message.
///
/// User records become user messages (prefixed with their author when it is not the human user),
/// the agent's own replies become assistant messages, sent records (copies of what the agent sent to a
/// peer) become assistant messages marked as such, and system records (notices the runtime wrote:
/// a task's outcome, a conversation's rules, a turn that failed) become system messages, so the
/// model never takes them for the user's words.
///
/// Tool records are the tool chatter of past turns: those of a turn that answered in the channel
/// stay out. Those of a turn that ended without an answer (by a tool that ends the turn, such as
/// `send_agent_message`, or by a failure) are replayed as the assistant's tool call and its
/// result, so the message that wakes the agent later (a task's result) follows its own call: the
/// sequence stays user, assistant, tool, user, never two user messages in a row for that reason.
///
/// ```
/// use spacebot_core::runtime::history::to_messages;
/// assert!(to_messages(&[]).is_empty());
/// ```
pub fn to_messages(records: &[ChannelRecord]) -> Vec<crate::llm::ChatMessage> {
    let mut messages: Vec<ChatMessage> = Vec::with_capacity(records.len());
    for r in records {
        let replayed = replay(HistoryText {
            seq: r.seq,
            kind: r.record.kind,
            author: r.record.author.clone(),
            content: r.record.content.clone(),
        });
        if replayed.is_answer() {
            // The turn answered: its tool calls stay out.
            while messages.len() >= 2
                && matches!(messages.last(), Some(ChatMessage::Tool { .. }))
                && matches!(
                    messages.get(messages.len() - 2),
                    Some(ChatMessage::Assistant { tool_calls, .. }) if !tool_calls.is_empty()
                )
            {
                messages.truncate(messages.len() - 2);
            }
        }
        messages.extend(replayed.into_messages());
    }
    messages
}

/// The prefix of the ids of the tool calls replayed from a channel's history (`history-<seq>`):
/// a turn's own calls carry the ids the model gave them.
pub const REPLAYED_CALL_ID_PREFIX: &str = "history-";

/// Whether `tool_call_id` names a call replayed from the channel's history (a past turn's), not
/// one the running turn made.
///
/// ```
/// use spacebot_core::runtime::history::is_replayed;
/// assert!(is_replayed("history-12"));
/// assert!(!is_replayed("call_1"));
/// ```
pub fn is_replayed(tool_call_id: &str) -> bool {
    tool_call_id.starts_with(REPLAYED_CALL_ID_PREFIX)
}

/// What one history record is replayed as.
#[derive(Debug)]
pub(crate) enum Replayed {
    /// One message.
    Message(ChatMessage),
    /// A past tool call and its result (an assistant message with the call, then the result).
    ToolCall(ChatMessage, ChatMessage),
    /// Nothing (a record the model does not see).
    Nothing,
}

impl Replayed {
    /// Whether this is the agent's answer in the channel (its turn's tool calls then stay out).
    pub(crate) fn is_answer(&self) -> bool {
        matches!(self, Replayed::Message(ChatMessage::Assistant { tool_calls, .. }) if tool_calls.is_empty())
    }

    /// The messages, in order.
    pub(crate) fn into_messages(self) -> Vec<ChatMessage> {
        match self {
            Replayed::Message(m) => vec![m],
            Replayed::ToolCall(call, result) => vec![call, result],
            Replayed::Nothing => Vec::new(),
        }
    }
}

/// One record of a history read as what a model sees.
pub(crate) fn replay(rec: HistoryText) -> Replayed {
    Replayed::Message(match rec.kind {
        RecordKind::User if rec.author == "user" => ChatMessage::user(rec.content),
        RecordKind::User => ChatMessage::user(["[", &rec.author, "] ", &rec.content].concat()),
        RecordKind::Assistant => ChatMessage::assistant(rec.content),
        RecordKind::Sent => ChatMessage::assistant(["(sent) ", &rec.content].concat()),
        RecordKind::System => ChatMessage::system(rec.content),
        RecordKind::Tool => {
            return match parse_tool_record(&rec.content) {
                Some((name, arguments, result)) => {
                    let id = format!("{REPLAYED_CALL_ID_PREFIX}{}", rec.seq);
                    Replayed::ToolCall(
                        ChatMessage::Assistant {
                            content: None,
                            tool_calls: vec![ToolCall {
                                id: id.clone(),
                                name: name.to_owned(),
                                arguments: arguments.to_owned(),
                            }],
                        },
                        ChatMessage::Tool {
                            tool_call_id: id,
                            content: result.into(),
                        },
                    )
                }
                None => Replayed::Nothing,
            };
        }
    })
}

/// Splits a tool record's text, `name(arguments) -> result` as the runtime writes it, into its
/// parts. The arguments are the model's text: a JSON value when it parses (whatever it holds),
/// otherwise everything up to the first `) -> `.
fn parse_tool_record(content: &str) -> Option<(&str, &str, &str)> {
    const ARROW: &str = ") -> ";
    let open = content.find('(')?;
    let (name, rest) = (content.get(..open)?, content.get(open + 1..)?);
    if name.is_empty() {
        return None;
    }
    let mut values = serde_json::Deserializer::from_str(rest).into_iter::<serde::de::IgnoredAny>();
    let end = match values.next() {
        Some(Ok(_)) if rest.get(values.byte_offset()..)?.starts_with(ARROW) => values.byte_offset(),
        _ => rest.find(ARROW)?,
    };
    Some((name, rest.get(..end)?, rest.get(end + ARROW.len()..)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::NewRecord;
    use crate::ids::{AgentId, ChannelId};
    use crate::time::Timestamp;

    fn rec(kind: RecordKind, author: &str, text: &str) -> ChannelRecord {
        let a = AgentId::parse("a").unwrap();
        ChannelRecord {
            seq: 1,
            agent: a.clone(),
            record: NewRecord::new(ChannelId::portal(&a), kind, author, text, Timestamp(0)),
        }
    }

    #[test]
    fn records_map_to_roles_and_tool_chatter_of_an_answered_turn_stays_out() {
        let msgs = to_messages(&[
            rec(RecordKind::User, "user", "hello"),
            rec(
                RecordKind::Tool,
                "a",
                "search({\"q\": \"x) -> y\"}) -> found",
            ),
            rec(RecordKind::Assistant, "a", "hi"),
            rec(RecordKind::User, "agent b", "status?"),
            rec(RecordKind::System, "system", "b completed task #1"),
            rec(RecordKind::Sent, "a", "to b: go"),
        ]);
        assert_eq!(
            msgs,
            vec![
                ChatMessage::user("hello"),
                ChatMessage::assistant("hi"),
                ChatMessage::user("[agent b] status?"),
                ChatMessage::system("b completed task #1"),
                ChatMessage::assistant("(sent) to b: go"),
            ]
        );
    }

    #[test]
    fn a_turn_ended_by_a_tool_keeps_its_call_and_result() {
        let msgs = to_messages(&[
            rec(RecordKind::User, "user", "ask b"),
            rec(
                RecordKind::Tool,
                "a",
                "send_agent_message({\"target\": \"b\", \"message\": \"f(x) -> y\"}) -> Assigned task #1",
            ),
            rec(RecordKind::Tool, "a", "odd(not json) -> error: bad"),
            rec(RecordKind::User, "user", "b completed task #1: y"),
        ]);
        let call = |name: &str, args: &str| ChatMessage::Assistant {
            content: None,
            tool_calls: vec![ToolCall {
                id: "history-1".into(),
                name: name.into(),
                arguments: args.into(),
            }],
        };
        let result = |text: &str| ChatMessage::Tool {
            tool_call_id: "history-1".into(),
            content: text.into(),
        };
        assert_eq!(
            msgs,
            vec![
                ChatMessage::user("ask b"),
                call(
                    "send_agent_message",
                    "{\"target\": \"b\", \"message\": \"f(x) -> y\"}"
                ),
                result("Assigned task #1"),
                call("odd", "not json"),
                result("error: bad"),
                ChatMessage::user("b completed task #1: y"),
            ]
        );
        assert!(parse_tool_record("no parenthesis").is_none());
        assert!(parse_tool_record("(x) -> y").is_none());
        assert_eq!(parse_tool_record("t() -> r"), Some(("t", "", "r")));
    }
}
