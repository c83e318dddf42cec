//! Channel history as model input: pure conversion from stored records to chat messages.

use crate::channel::{ChannelRecord, HistoryText, RecordKind};
use crate::llm::ChatMessage;

/// Turns a channel's stored records into the chat messages a model sees before the current message.
///
/// User records become user messages (prefixed with their author when it is not the human user),
/// the agent's own replies become assistant messages, sent records (copies of what the agent sent to a
/// peer) become assistant messages marked as such, and system records (notices the runtime wrote:
/// a task's outcome, a conversation's rules, a turn that failed) become system messages, so the
/// model never takes them for the user's words. Tool records stay out: tool chatter of past turns
/// is not replayed.
///
/// ```
/// use spacebot_core::runtime::history::to_messages;
/// assert!(to_messages(&[]).is_empty());
/// ```
pub fn to_messages(records: &[ChannelRecord]) -> Vec<crate::llm::ChatMessage> {
    let mut messages = Vec::with_capacity(records.len());
    extend_messages(
        &mut messages,
        records.iter().map(|r| HistoryText {
            seq: r.seq,
            kind: r.record.kind,
            author: r.record.author.clone(),
            content: r.record.content.clone(),
        }),
    );
    messages
}

/// [`to_messages`] for the texts of a history read ([`ChannelStore::history_texts`]), appended to
/// `messages` (a turn's request, after its system prompt: no list in between): shared texts move
/// into the messages; only prefixed ones (`[author] `, `(sent) `) are new.
///
/// [`ChannelStore::history_texts`]: crate::channel::ChannelStore::history_texts
pub(crate) fn extend_messages(
    messages: &mut Vec<ChatMessage>,
    records: impl IntoIterator<Item = HistoryText>,
) {
    messages.extend(records.into_iter().filter_map(to_message));
}

/// One record of a history read as the message a model sees (`None`: tool chatter, left out).
pub(crate) fn to_message(rec: HistoryText) -> Option<ChatMessage> {
    Some(match rec.kind {
        RecordKind::User if rec.author == "user" => ChatMessage::user(rec.content),
        RecordKind::User => ChatMessage::user(["[", &rec.author, "] ", &rec.content].concat()),
        RecordKind::Assistant => ChatMessage::assistant(rec.content),
        RecordKind::Sent => ChatMessage::assistant(["(sent) ", &rec.content].concat()),
        RecordKind::System => ChatMessage::system(rec.content),
        _ => return None,
    })
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
                ChatMessage::system("b completed task #1"),
                ChatMessage::assistant("(sent) to b: go"),
            ]
        );
    }
}
