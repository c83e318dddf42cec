//! Channel history as model input: pure conversion from stored records to chat messages.

use crate::channel::{ChannelRecord, RecordKind};
use crate::llm::ChatMessage;

/// Turns a channel's stored records into the chat messages a model sees before the current message.
///
/// User records become user messages (prefixed with their author when it is not the human user),
/// the agent's own replies become assistant messages, sent records (copies of what the agent sent to a
/// peer) become assistant messages marked as such, and system records become user messages marked
/// `[system]`. Tool records stay out: tool chatter of past turns is not replayed.
///
/// ```
/// use spacebot_core::runtime::history::to_messages;
/// assert!(to_messages(&[]).is_empty());
/// ```
pub fn to_messages(records: &[ChannelRecord]) -> Vec<crate::llm::ChatMessage> {
    into_messages(records.to_vec())
}

/// [`to_messages`] for records the caller owns: their texts move into the messages instead of being
/// copied.
pub(crate) fn into_messages(records: Vec<ChannelRecord>) -> Vec<ChatMessage> {
    records
        .into_iter()
        .filter_map(|r| {
            let rec = r.record;
            match rec.kind {
                RecordKind::User => Some(ChatMessage::user(if rec.author == "user" {
                    rec.content
                } else {
                    ["[", &rec.author, "] ", &rec.content].concat().into()
                })),
                RecordKind::Assistant => Some(ChatMessage::assistant(rec.content)),
                RecordKind::Sent => {
                    Some(ChatMessage::assistant(["(sent) ", &rec.content].concat()))
                }
                RecordKind::System => Some(ChatMessage::user(["[system] ", &rec.content].concat())),
                _ => None,
            }
        })
        .collect()
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
    fn records_map_to_roles_and_tool_chatter_stays_out() {
        let msgs = to_messages(&[
            rec(RecordKind::User, "user", "hello"),
            rec(RecordKind::Tool, "a", "search(...) -> ..."),
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
                ChatMessage::user("[system] b completed task #1"),
                ChatMessage::assistant("(sent) to b: go"),
            ]
        );
    }
}
