//! Context windows: what of a channel's history a turn sends, chosen by tokens against the
//! model's window, and compaction of what no longer fits.
//!
//! **The window.** Each agent has a context window in tokens: `context_window` of its
//! `[[agents]]` entry, else `[settings] context_window`, else what the provider reports
//! ([`LlmProvider::context_window`](crate::LlmProvider::context_window)), else
//! [`DEFAULT_CONTEXT_WINDOW`]. Part of it is kept for the answer: the request's `max_tokens`, else
//! an eighth of the window, at most [`MAX_ANSWER_ROOM`] ([`answer_room`]).
//!
//! **Choosing the history.** Every request a turn sends holds its system prompt, the tools'
//! schemas, the message it answers and its newest tool round; then, newest first, the turn's
//! earlier tool rounds, the channel's history, and the summary of older history, as long as the
//! budget (the window less the answer's room) lasts. The first message that does not fit ends the
//! choice: nothing older goes in. When not even that mandatory part fits a window that was
//! configured or reported, the turn fails without calling the model; with the default window
//! (nobody gave one), the mandatory part is sent alone and the server decides. An assistant message with tool calls goes in with all its tool
//! results or not at all; a tool result never goes in without its call. Tokens are counted by the
//! provider's [`TokenCounter`] (when it gives one), else by
//! [`EstimateCounter`] (a third of the text's bytes plus 4 per message). Each history record is
//! counted once, when it is first read.
//!
//! **Reading the history.** A turn joins what the agent kept in memory from its last turn in
//! that channel (the newest records up to one window's worth of tokens) to the records appended
//! since, read with [`ChannelStore::history_texts_after`](crate::ChannelStore::history_texts_after)
//! (one index seek on SQLite); the first turn in a channel after a start reads its newest
//! [`HISTORY_PAGE`] records. Only such a first turn on a longer channel, or a turn after a page or
//! more of records arrived, reads more: the newest [`MAX_HISTORY_READ`] records.
//!
//! **Compaction.** When the history does not fit, the [`Compaction`] hook runs (default
//! [`ModelSummary`]: the agent's own model writes a summary of the older messages and the earlier
//! summary). The summary is stored in [`Stores::records`](crate::Stores) (namespace
//! [`SUMMARY_NAMESPACE`], key `{agent}/{channel}`) with the sequence number of the newest record
//! it covers, so later turns, after a restart too, send the summary and the newer records only.
//! Its model call is reserved, settled and counted like any model call of the turn. With
//! `[settings] compaction = false` older messages are left out without a summary. When the server
//! still answers that the prompt is too long, the turn compacts and sends once more; if the server
//! refuses again, the turn fails with
//! [`TurnError::ContextTooLong`](crate::runtime::TurnError::ContextTooLong).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::llm::{ChatMessage, ChatRequest, ChatResponse, ToolDefinition};

/// The context window (tokens) of an agent whose window neither the configuration nor the
/// provider gives.
pub const DEFAULT_CONTEXT_WINDOW: u32 = 8_192;

/// The most of the window kept for the answer when the request sets no `max_tokens`.
pub const MAX_ANSWER_ROOM: u64 = 4_096;

/// How many of its channel's newest records a turn reads when the agent kept the older ones.
pub const HISTORY_PAGE: usize = 64;

/// The most records a turn reads from its channel's history.
pub const MAX_HISTORY_READ: usize = 2_048;

/// The namespace of the durable summaries in [`Stores::records`](crate::Stores).
pub const SUMMARY_NAMESPACE: &str = "spacebot.context";

/// The room kept for the answer in a window of `window` tokens: `max_tokens` when the request
/// sets it, else an eighth of the window, at most [`MAX_ANSWER_ROOM`].
///
/// ```
/// use spacebot_core::context::answer_room;
/// assert_eq!(answer_room(2_000, None), 250);
/// assert_eq!(answer_room(128_000, None), 4_096);
/// assert_eq!(answer_room(2_000, Some(300)), 300);
/// ```
pub fn answer_room(window: u64, max_tokens: Option<u32>) -> u64 {
    max_tokens.map_or((window / 8).min(MAX_ANSWER_ROOM), u64::from)
}

/// Counts the tokens of a request's parts, as the model will see them.
///
/// # Contract
/// Counts never less than the model's tokenizer would (an estimate errs on the high side): the
/// runtime sends only requests whose count fits the window.
pub trait TokenCounter: Send + Sync + fmt::Debug {
    /// The tokens of a text.
    fn count_text(&self, text: &str) -> u64;

    /// The tokens of a message: its text, its tool calls, and 4 of framing for the message and
    /// each call.
    fn count_message(&self, message: &ChatMessage) -> u64 {
        match message {
            ChatMessage::System { content }
            | ChatMessage::User { content }
            | ChatMessage::Tool { content, .. } => 4 + self.count_text(content),
            ChatMessage::Assistant {
                content,
                tool_calls,
            } => {
                let text = content.as_deref().map_or(0, |c| self.count_text(c));
                let calls: u64 = tool_calls
                    .iter()
                    .map(|c| 4 + self.count_text(&c.name) + self.count_text(&c.arguments))
                    .sum();
                4 + text + calls
            }
        }
    }

    /// The tokens of the tools' schemas: name, description and parameters, and 4 of framing
    /// each.
    fn count_tools(&self, tools: &[ToolDefinition]) -> u64 {
        tools
            .iter()
            .map(|t| {
                4 + self.count_text(&t.name)
                    + self.count_text(&t.description)
                    + self.count_text(&t.parameters.to_string())
            })
            .sum()
    }
}

/// The estimate used when the provider has no tokenizer: a third of the text's bytes, rounded
/// up (tokenizers of current models give about four bytes a token for English text, fewer for
/// other scripts and code). Never less than
/// [`limits::estimate_input`](crate::limits::estimate_input) for the same request.
///
/// ```
/// use spacebot_core::context::{EstimateCounter, TokenCounter};
/// use spacebot_core::ChatMessage;
/// assert_eq!(EstimateCounter.count_text("abcdefg"), 3);
/// assert_eq!(EstimateCounter.count_message(&ChatMessage::user("abcdefg")), 7);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct EstimateCounter;

impl TokenCounter for EstimateCounter {
    fn count_text(&self, text: &str) -> u64 {
        (text.len() as u64).div_ceil(3)
    }
}

/// A channel's durable summary: what the older records said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// The sequence number of the newest record it covers: a turn sends only newer records.
    pub through: u64,
    /// The summary's text.
    pub text: String,
}

impl Summary {
    /// The summary as the message a turn sends before the newer history.
    pub fn message(&self) -> ChatMessage {
        ChatMessage::system(format!(
            "Summary of the earlier conversation in this channel:\n{}",
            self.text
        ))
    }
}

/// What a compaction has to summarize.
#[derive(Debug, Clone, Copy)]
pub struct CompactionInput<'a> {
    /// The earlier summary, if any (older than every message here).
    pub previous: Option<&'a str>,
    /// The messages to summarize, oldest first; a tool call comes with its results.
    pub messages: &'a [ChatMessage],
    /// The most tokens the summary request may take, the answer's room included: the agent's
    /// window.
    pub window: u64,
}

/// What a [`Compaction`] hook decides.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum CompactionPlan {
    /// Ask the agent's model this (the runtime makes the call, reserved and counted like any model
    /// call of the turn) and read the summary from its answer with
    /// [`Compaction::read_summary`].
    Ask(ChatRequest),
    /// This is the summary.
    Summary(String),
    /// Leave the messages out without a summary.
    Drop,
}

/// The compaction hook: how older messages that no longer fit the window are summarized.
pub trait Compaction: Send + Sync + fmt::Debug {
    /// What to do with `input`.
    fn plan(&self, input: &CompactionInput<'_>, counter: &dyn TokenCounter) -> CompactionPlan;

    /// The summary in the model's answer to [`CompactionPlan::Ask`]; `None` keeps the earlier
    /// summary (the messages are then left out).
    fn read_summary(&self, response: &ChatResponse) -> Option<String> {
        response
            .content
            .as_deref()
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
    }
}

/// The default compaction: the agent's own model summarizes the earlier summary and the older
/// messages (as many of the newest of them as fit its window; older ones are left out).
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelSummary;

/// The instructions of [`ModelSummary`]'s request.
pub const SUMMARY_INSTRUCTIONS: &str = "You keep the memory of a long conversation. Summarize \
the earlier summary (if any) and the messages below into one concise summary that keeps every \
fact, decision, open question, commitment, name and number a later reply may need. Write only \
the summary.";

impl Compaction for ModelSummary {
    fn plan(&self, input: &CompactionInput<'_>, counter: &dyn TokenCounter) -> CompactionPlan {
        if input.messages.is_empty() {
            return CompactionPlan::Drop;
        }
        let room = answer_room(input.window, None);
        let system = ChatMessage::system(SUMMARY_INSTRUCTIONS);
        let mut budget = input
            .window
            .saturating_sub(room)
            .saturating_sub(counter.count_message(&system))
            // The transcript message's own framing.
            .saturating_sub(4);
        let mut lines: Vec<String> = Vec::new();
        for message in input.messages.iter().rev() {
            let line = transcript_line(message);
            let cost = counter.count_text(&line) + 1;
            if cost > budget {
                break;
            }
            budget -= cost;
            lines.push(line);
        }
        let mut text = String::new();
        if let Some(previous) = input.previous {
            let block = format!("Earlier summary:\n{previous}\n\n");
            if counter.count_text(&block) <= budget {
                text.push_str(&block);
            }
        }
        if lines.is_empty() && text.is_empty() {
            return CompactionPlan::Drop;
        }
        text.push_str("Messages:\n");
        for line in lines.iter().rev() {
            text.push_str(line);
            text.push('\n');
        }
        CompactionPlan::Ask(ChatRequest {
            messages: vec![system, ChatMessage::user(text)],
            max_tokens: u32::try_from(room).ok(),
            ..ChatRequest::default()
        })
    }
}

/// One message as a line of a transcript.
fn transcript_line(message: &ChatMessage) -> String {
    match message {
        ChatMessage::System { content } => format!("system: {content}"),
        ChatMessage::User { content } => format!("user: {content}"),
        ChatMessage::Tool {
            tool_call_id,
            content,
        } => format!("tool result ({tool_call_id}): {content}"),
        ChatMessage::Assistant {
            content,
            tool_calls,
        } => {
            let mut line = format!("assistant: {}", content.as_deref().unwrap_or_default());
            for call in tool_calls {
                line.push_str(&format!(
                    " [calls {} ({}) with {}]",
                    call.name, call.id, call.arguments
                ));
            }
            line
        }
    }
}

/// Messages that go into a request together or not at all: one message, or an assistant message
/// with tool calls and their results.
#[derive(Debug, Clone)]
pub(crate) struct Unit {
    pub(crate) messages: Vec<ChatMessage>,
    pub(crate) tokens: u64,
    /// Its size as request limits estimate it ([`crate::limits::estimate_input`]), measured once:
    /// a reservation adds up the units a request sends instead of measuring every message again.
    pub(crate) size: crate::limits::TextSize,
    /// The sequence number of the history record it comes from (`None`: the turn's own).
    pub(crate) seq: Option<u64>,
}

impl Unit {
    pub(crate) fn new(message: ChatMessage, counter: &dyn TokenCounter, seq: Option<u64>) -> Self {
        Self {
            tokens: counter.count_message(&message),
            size: crate::limits::TextSize::of_message(&message),
            messages: vec![message],
            seq,
        }
    }

    /// Adds a message to the unit (a tool result to its call).
    pub(crate) fn add(&mut self, message: ChatMessage, counter: &dyn TokenCounter) {
        self.tokens += counter.count_message(&message);
        self.size = self
            .size
            .plus(crate::limits::TextSize::of_message(&message));
        self.messages.push(message);
    }

    /// Whether a tool result joins this unit (its last message is a call or a result).
    pub(crate) fn takes_results(&self) -> bool {
        match self.messages.first() {
            Some(ChatMessage::Assistant { tool_calls, .. }) => !tool_calls.is_empty(),
            _ => false,
        }
    }
}

/// A channel's history in [`Unit`]s, oldest first, with their total size (as request limits
/// estimate it) kept as units come and go: a reservation sums a long history without walking
/// it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Units {
    units: Vec<Unit>,
    size: crate::limits::TextSize,
}

impl Units {
    /// Adds the newest unit.
    pub(crate) fn push(&mut self, unit: Unit) {
        self.size = self.size.plus(unit.size);
        self.units.push(unit);
    }

    /// Takes the newest unit off.
    pub(crate) fn pop(&mut self) -> Option<Unit> {
        let unit = self.units.pop()?;
        self.size = self.size.minus(unit.size);
        Some(unit)
    }

    /// Drops the `n` oldest units.
    pub(crate) fn drop_oldest(&mut self, n: usize) {
        let n = n.min(self.units.len());
        for unit in &self.units[..n] {
            self.size = self.size.minus(unit.size);
        }
        self.units.drain(..n);
    }

    /// Keeps the units `keep` answers `true` for.
    pub(crate) fn retain(&mut self, keep: impl FnMut(&Unit) -> bool) {
        self.units.retain(keep);
        self.size = self.sum(0..self.units.len());
    }

    /// The size of the units from `from` on (the newest ones).
    pub(crate) fn size_from(&self, from: usize) -> crate::limits::TextSize {
        let from = from.min(self.units.len());
        // Whichever side is shorter is walked.
        if from <= self.units.len() / 2 {
            self.size.minus(self.sum(0..from))
        } else {
            self.sum(from..self.units.len())
        }
    }

    fn sum(&self, range: std::ops::Range<usize>) -> crate::limits::TextSize {
        self.units[range]
            .iter()
            .fold(crate::limits::TextSize::default(), |size, u| {
                size.plus(u.size)
            })
    }
}

impl std::ops::Deref for Units {
    type Target = [Unit];

    fn deref(&self) -> &[Unit] {
        &self.units
    }
}

impl FromIterator<Unit> for Units {
    fn from_iter<I: IntoIterator<Item = Unit>>(iter: I) -> Self {
        let mut units = Units::default();
        for unit in iter {
            units.push(unit);
        }
        units
    }
}

/// How many of `units` (the newest last) fit `budget`, newest first, stopping at the first that
/// does not: the index of the oldest one kept (`units.len()` when none fits) and the tokens kept.
pub(crate) fn fit_newest(units: &[Unit], budget: u64) -> (usize, u64) {
    let mut used = 0u64;
    let mut start = units.len();
    for (i, unit) in units.iter().enumerate().rev() {
        if used + unit.tokens > budget {
            break;
        }
        used += unit.tokens;
        start = i;
    }
    (start, used)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::limits::estimate_input;
    use crate::llm::ToolCall;

    #[test]
    fn the_estimate_never_counts_less_than_the_limits_estimate() {
        let call = ToolCall {
            id: "c1".into(),
            name: "search".into(),
            arguments: "{\"q\":\"x\"}".into(),
        };
        let request = ChatRequest {
            messages: vec![
                ChatMessage::system("s".repeat(101)),
                ChatMessage::user("hello"),
                ChatMessage::Assistant {
                    content: None,
                    tool_calls: vec![call],
                },
                ChatMessage::tool("c1", "r".repeat(7)),
            ],
            tools: vec![ToolDefinition::new(
                "search",
                "Searches.",
                serde_json::json!({"type": "object"}),
            )]
            .into(),
            ..ChatRequest::default()
        };
        let ours: u64 = request
            .messages
            .iter()
            .map(|m| EstimateCounter.count_message(m))
            .sum::<u64>()
            + EstimateCounter.count_tools(&request.tools);
        assert!(ours >= estimate_input(&request), "{ours}");
    }

    #[test]
    fn fitting_stops_at_the_first_unit_that_does_not_fit() {
        let units: Vec<Unit> = [5u64, 50, 5, 5]
            .iter()
            .map(|&t| Unit {
                messages: Vec::new(),
                tokens: t,
                size: crate::limits::TextSize::default(),
                seq: None,
            })
            .collect();
        assert_eq!(fit_newest(&units, 12), (2, 10));
        assert_eq!(fit_newest(&units, 100), (0, 65));
        assert_eq!(fit_newest(&units, 4), (4, 0));
    }

    #[test]
    fn a_summary_request_fits_the_window() {
        let messages: Vec<ChatMessage> = (0..500)
            .map(|i| ChatMessage::user(format!("message {i} {}", "x".repeat(40))))
            .collect();
        let input = CompactionInput {
            previous: Some("earlier"),
            messages: &messages,
            window: 2_000,
        };
        let CompactionPlan::Ask(request) = ModelSummary.plan(&input, &EstimateCounter) else {
            panic!("expected a request");
        };
        let Some(ChatMessage::User { content: user }) = request.messages.last() else {
            panic!("expected the transcript last");
        };
        assert!(user.contains("message 499"), "the newest are kept");
        assert!(!user.contains("message 0 "), "the oldest are left out");
        assert!(estimate_input(&request) + answer_room(2_000, None) <= 2_000);
    }

    #[test]
    fn units_keep_their_size_as_they_come_and_go() {
        use crate::limits::TextSize;
        let unit = |i: usize| {
            Unit::new(
                ChatMessage::user("m".repeat(i * 7 % 23)),
                &EstimateCounter,
                Some(i as u64),
            )
        };
        let check = |units: &Units| {
            for from in 0..=units.len() + 1 {
                let walked = units[from.min(units.len())..]
                    .iter()
                    .fold(TextSize::default(), |s, u| s.plus(u.size));
                assert_eq!(
                    units.size_from(from),
                    walked,
                    "from {from} of {}",
                    units.len()
                );
            }
        };
        let mut units: Units = (0..40).map(unit).collect();
        check(&units);
        units.pop();
        units.push(unit(41));
        check(&units);
        units.drop_oldest(7);
        check(&units);
        units.retain(|u| u.seq.is_some_and(|s| s % 3 != 0));
        check(&units);
        units.drop_oldest(1_000);
        assert!(units.is_empty());
        check(&units);
    }
}
