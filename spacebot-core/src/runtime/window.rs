//! A turn's context window (see [`crate::context`]): the history it read, its own messages, and
//! which of them each request sends.

use std::collections::HashMap;
use std::sync::Arc;

use crate::channel::HistoryText;
use crate::context::{
    HISTORY_PAGE, MAX_HISTORY_READ, SUMMARY_NAMESPACE, Summary, TokenCounter, Unit, Units,
    answer_room, fit_newest,
};
use crate::error::StoreError;
use crate::ids::{AgentId, ChannelId};
use crate::limits::TextSize;
use crate::llm::ChatMessage;
use crate::runtime::history;
use crate::runtime::host::{AgentRuntime, Host};

/// What an agent keeps in memory of a channel between its turns: the summary and the newest
/// records after it, up to one window's worth of tokens.
#[derive(Debug, Clone, Default)]
pub(crate) struct ChannelMemory {
    summary: Option<Summary>,
    /// Shared with the turn that read them last: a turn on a long channel copies none of them
    /// (a copy is made only when a turn still holds them while the next one adds records).
    units: Arc<Units>,
    /// The newest record seen (of any kind).
    newest: u64,
}

/// The memories of an agent's channels.
pub(crate) type Memories = std::sync::Mutex<HashMap<ChannelId, ChannelMemory>>;

/// The key of a channel's summary in [`SUMMARY_NAMESPACE`].
pub(crate) fn summary_key(agent: &AgentId, channel: &ChannelId) -> String {
    format!("{agent}/{channel}")
}

/// The context window of `agent`, in tokens (see [`crate::context`]), and whether it is known
/// (configured or reported by the provider) rather than [`DEFAULT_CONTEXT_WINDOW`]
/// (crate::context::DEFAULT_CONTEXT_WINDOW).
pub(crate) fn window_of(host: &Host, agent: &AgentId) -> (u64, bool) {
    let configured = host
        .context_windows
        .get(agent)
        .copied()
        .or(host.settings.context_window);
    match configured.or_else(|| host.llm.context_window(None)) {
        Some(window) => (u64::from(window), true),
        None => (u64::from(crate::context::DEFAULT_CONTEXT_WINDOW), false),
    }
}

/// Reads a channel's summary and the history after it, joined to what the agent kept of it.
pub(crate) async fn load(
    host: &Host,
    agent: &AgentRuntime,
    channel: &ChannelId,
    window: u64,
) -> Result<(Option<Summary>, Arc<Units>), StoreError> {
    let me = agent.id();
    let counter = host.counter.as_ref();
    // Taken out while this turn extends it (an agent runs one turn at a time; a turn that fails
    // before putting it back leaves the next one to read the channel again).
    let kept = agent
        .memories
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(channel);
    let summary = match &kept {
        Some(memory) => memory.summary.clone(),
        None => match host
            .stores
            .records
            .get(SUMMARY_NAMESPACE, &summary_key(me, channel))
            .await?
        {
            Some(record) => Some(record.decode::<Summary>()?.value),
            None => None,
        },
    };
    let through = summary.as_ref().map_or(0, |s| s.through);
    let channels = &host.stores.channels;
    // What the agent kept is extended with the records appended since (fewer than a page);
    // otherwise the channel's newest page is read, and when that is not all of it, as much more as
    // a turn reads.
    let (kept, page) = match kept {
        Some(memory) => {
            let newer = channels
                .history_texts_after(me, channel, memory.newest, HISTORY_PAGE)
                .await?;
            (Some(memory), newer)
        }
        None => (
            None,
            channels
                .history_texts(me, channel, Some(HISTORY_PAGE))
                .await?,
        ),
    };
    let (mut units, newest, fresh) = match kept {
        _ if page.len() >= HISTORY_PAGE => (
            Arc::default(),
            0,
            channels
                .history_texts(me, channel, Some(MAX_HISTORY_READ))
                .await?,
        ),
        Some(memory) => (memory.units, memory.newest, page),
        None => (Arc::default(), 0, page),
    };
    let mut newest_now = newest;
    let floor = newest.max(through);
    let mut fresh = fresh.into_iter().filter(|r| r.seq > floor).peekable();
    if fresh.peek().is_some() {
        let owned = Arc::make_mut(&mut units);
        for record in fresh {
            newest_now = newest_now.max(record.seq);
            push_record(owned, record, counter);
        }
    }
    // The oldest units past the window go: no request could send them.
    let (start, _) = fit_newest(&units, window);
    if start > 0 {
        Arc::make_mut(&mut units).drop_oldest(start);
    }
    agent
        .memories
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(
            channel.clone(),
            ChannelMemory {
                summary: summary.clone(),
                units: units.clone(),
                newest: newest_now,
            },
        );
    Ok((summary, units))
}

/// Adds a history record to `units`, as [`history::to_messages`] replays it: a past tool call is
/// one unit with its result, and an answer leaves out the tool calls of its own turn just before
/// it.
fn push_record(units: &mut Units, record: HistoryText, counter: &dyn TokenCounter) {
    let seq = record.seq;
    let replayed = history::replay(record);
    if replayed.is_answer() {
        while units
            .last()
            .is_some_and(|u| u.seq.is_some() && u.takes_results())
        {
            units.pop();
        }
    }
    let mut messages = replayed.into_messages().into_iter();
    let Some(first) = messages.next() else {
        return;
    };
    let mut unit = Unit::new(first, counter, Some(seq));
    for message in messages {
        unit.add(message, counter);
    }
    units.push(unit);
}

/// What one request sends of a [`TurnContext`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Selection {
    /// Whether the summary goes in.
    summary: bool,
    /// The first history unit that goes in.
    history_from: usize,
    /// The first of the turn's own units after its first that goes in.
    own_from: usize,
}

/// A turn's messages, in units, with their tokens.
#[derive(Debug)]
pub(crate) struct TurnContext {
    pub(crate) window: u64,
    counter: Arc<dyn TokenCounter>,
    system: Unit,
    tools: u64,
    summary: Option<(Summary, Unit)>,
    history: Arc<Units>,
    /// The turn's own messages; the first is the message the turn started with.
    own: Vec<Unit>,
}

/// What a compaction would summarize.
#[derive(Debug)]
pub(crate) struct Older {
    pub(crate) messages: Vec<ChatMessage>,
    history_to: usize,
    own_to: usize,
}

impl Older {
    pub(crate) fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }
}

impl TurnContext {
    pub(crate) fn new(
        window: u64,
        counter: Arc<dyn TokenCounter>,
        system: ChatMessage,
        tools: u64,
        summary: Option<Summary>,
        history: Arc<Units>,
    ) -> Self {
        let summary = summary.map(|s| {
            let unit = Unit::new(s.message(), counter.as_ref(), None);
            (s, unit)
        });
        Self {
            window,
            system: Unit::new(system, counter.as_ref(), None),
            tools,
            counter,
            summary,
            history,
            own: Vec::new(),
        }
    }

    /// Appends one of the turn's own messages; a tool result joins its call.
    pub(crate) fn push(&mut self, message: ChatMessage) {
        if let ChatMessage::Tool { .. } = message
            && let Some(last) = self.own.last_mut()
            && last.takes_results()
        {
            last.add(message, self.counter.as_ref());
            return;
        }
        self.own
            .push(Unit::new(message, self.counter.as_ref(), None));
    }

    /// What every request sends: the system prompt, the tools, the turn's first message and its
    /// newest.
    fn mandatory(&self) -> u64 {
        let first = self.own.first().map_or(0, |u| u.tokens);
        let last = if self.own.len() > 1 {
            self.own.last().map_or(0, |u| u.tokens)
        } else {
            0
        };
        self.system.tokens + self.tools + first + last
    }

    /// The tokens a request may hold.
    pub(crate) fn budget(&self, max_tokens: Option<u32>) -> u64 {
        self.window
            .saturating_sub(answer_room(self.window, max_tokens))
    }

    /// What fits `budget`, newest first. `Err(needed)`: not even the mandatory part fits.
    pub(crate) fn select(&self, budget: u64) -> Result<Selection, u64> {
        let mandatory = self.mandatory();
        if mandatory > budget {
            return Err(mandatory);
        }
        let mut left = budget - mandatory;
        let middle_end = self.own.len().saturating_sub(1).max(1);
        let middle = self.own.get(1..middle_end).unwrap_or(&[]);
        let (start, used) = fit_newest(middle, left);
        left -= used;
        let own_from = 1 + start;
        if start > 0 {
            return Ok(Selection {
                summary: false,
                history_from: self.history.len(),
                own_from,
            });
        }
        let (history_from, used) = fit_newest(&self.history, left);
        left -= used;
        let summary = history_from == 0
            && self
                .summary
                .as_ref()
                .is_some_and(|(_, unit)| unit.tokens <= left);
        Ok(Selection {
            summary,
            history_from,
            own_from,
        })
    }

    /// Whether `selection` leaves anything out.
    pub(crate) fn drops(&self, selection: &Selection) -> bool {
        selection.history_from > 0
            || selection.own_from > 1
            || (self.summary.is_some() && !selection.summary)
    }

    /// The messages `selection` sends, in order.
    pub(crate) fn messages(&self, selection: &Selection) -> Vec<ChatMessage> {
        let mut out =
            Vec::with_capacity(2 + self.history.len() - selection.history_from + self.own.len());
        out.extend(self.system.messages.iter().cloned());
        if selection.summary
            && let Some((_, unit)) = &self.summary
        {
            out.extend(unit.messages.iter().cloned());
        }
        for unit in &self.history[selection.history_from..] {
            out.extend(unit.messages.iter().cloned());
        }
        if let Some(first) = self.own.first() {
            out.extend(first.messages.iter().cloned());
        }
        for unit in self.own.iter().skip(selection.own_from.max(1)) {
            out.extend(unit.messages.iter().cloned());
        }
        out
    }

    /// The size of what `selection` sends ([`messages`](Self::messages)), as request limits
    /// estimate it: the sum of its units' sizes, measured when each was made.
    pub(crate) fn size(&self, selection: &Selection) -> TextSize {
        let mut size = self.system.size;
        if selection.summary
            && let Some((_, unit)) = &self.summary
        {
            size = size.plus(unit.size);
        }
        size = size.plus(self.history.size_from(selection.history_from));
        if let Some(first) = self.own.first() {
            size = size.plus(first.size);
        }
        for unit in self.own.iter().skip(selection.own_from.max(1)) {
            size = size.plus(unit.size);
        }
        size
    }

    /// What is older than what fits `target` (the turn's first message excepted): what a
    /// compaction summarizes, oldest first.
    pub(crate) fn older(&self, target: u64) -> Older {
        // A target below the mandatory part keeps only that.
        let selection = self.select(target).unwrap_or(Selection {
            summary: false,
            history_from: self.history.len(),
            own_from: self.own.len().saturating_sub(1).max(1),
        });
        let history_to = selection.history_from;
        let own_to = selection.own_from.max(1).min(self.own.len().max(1));
        let mut messages = Vec::new();
        for unit in &self.history[..history_to] {
            messages.extend(unit.messages.iter().cloned());
        }
        for unit in self.own.get(1..own_to).unwrap_or(&[]) {
            messages.extend(unit.messages.iter().cloned());
        }
        Older {
            messages,
            history_to,
            own_to,
        }
    }

    /// The current summary's text.
    pub(crate) fn summary_text(&self) -> Option<&str> {
        self.summary.as_ref().map(|(s, _)| s.text.as_str())
    }

    /// Replaces what `older` held by `text` (`None`: keeps the earlier summary, leaving them
    /// out): the new summary, covering the history up to the newest record it held.
    pub(crate) fn apply(&mut self, older: &Older, text: Option<String>) -> Option<Summary> {
        let through = self.history[..older.history_to]
            .iter()
            .filter_map(|u| u.seq)
            .max()
            .into_iter()
            .chain(self.summary.as_ref().map(|(s, _)| s.through))
            .max()
            .unwrap_or(0);
        Arc::make_mut(&mut self.history).drop_oldest(older.history_to);
        if older.own_to > 1 {
            self.own.drain(1..older.own_to);
        }
        let text = match text {
            Some(text) => text,
            None => self.summary_text()?.to_owned(),
        };
        let summary = Summary { through, text };
        let unit = Unit::new(summary.message(), self.counter.as_ref(), None);
        self.summary = Some((summary.clone(), unit));
        Some(summary)
    }
}

/// Records `summary` as what the agent keeps of `channel` (the records it covers are dropped).
pub(crate) fn remember_summary(agent: &AgentRuntime, channel: &ChannelId, summary: &Summary) {
    let mut memories = agent.memories.lock().unwrap_or_else(|e| e.into_inner());
    let memory = memories.entry(channel.clone()).or_default();
    let kept = |u: &Unit| u.seq.is_some_and(|s| s > summary.through);
    if !memory.units.iter().all(kept) {
        Arc::make_mut(&mut memory.units).retain(kept);
    }
    memory.summary = Some(summary.clone());
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::context::EstimateCounter;
    use crate::llm::ToolCall;

    fn context(history: usize) -> TurnContext {
        let counter: Arc<dyn TokenCounter> = Arc::new(EstimateCounter);
        let units: Units = (0..history)
            .map(|i| {
                Unit::new(
                    ChatMessage::user(format!("record {i:03} {}", "x".repeat(20))),
                    counter.as_ref(),
                    Some(i as u64 + 1),
                )
            })
            .collect();
        TurnContext::new(
            1_000,
            counter,
            ChatMessage::system("system"),
            0,
            None,
            Arc::new(units),
        )
    }

    fn call(id: &str) -> ChatMessage {
        ChatMessage::Assistant {
            content: None,
            tool_calls: vec![ToolCall {
                id: id.into(),
                name: "t".into(),
                arguments: "{}".into(),
            }],
        }
    }

    fn count(messages: &[ChatMessage]) -> u64 {
        messages
            .iter()
            .map(|m| EstimateCounter.count_message(m))
            .sum()
    }

    #[test]
    fn a_selection_fits_its_budget_and_keeps_the_newest() {
        let mut ctx = context(100);
        ctx.push(ChatMessage::user("now"));
        let budget = ctx.budget(None);
        let selection = ctx.select(budget).unwrap();
        let messages = ctx.messages(&selection);
        assert!(count(&messages) <= budget);
        assert_eq!(ctx.size(&selection), TextSize::of_messages(&messages));
        assert!(ctx.drops(&selection));
        assert_eq!(messages.last(), Some(&ChatMessage::user("now")));
        let ChatMessage::User { content } = &messages[messages.len() - 2] else {
            panic!("{messages:?}");
        };
        assert!(
            content.starts_with("record 099"),
            "the newest history is kept"
        );
    }

    #[test]
    fn tool_calls_and_their_results_go_in_together_or_not_at_all() {
        let mut ctx = context(0);
        ctx.push(ChatMessage::user("start"));
        for round in 0..30 {
            let id = format!("c{round}");
            ctx.push(call(&id));
            ctx.push(ChatMessage::tool(id.clone(), "r".repeat(40)));
            ctx.push(ChatMessage::tool(id, "s".repeat(40)));
        }
        for budget in (100..800).step_by(7) {
            let Ok(selection) = ctx.select(budget) else {
                continue;
            };
            let messages = ctx.messages(&selection);
            assert!(count(&messages) <= budget);
            // What a reservation estimates, summed from the units, is what the messages measure.
            assert_eq!(ctx.size(&selection), TextSize::of_messages(&messages));
            for (i, m) in messages.iter().enumerate() {
                if let ChatMessage::Assistant { tool_calls, .. } = m
                    && let Some(call) = tool_calls.first()
                {
                    let results: Vec<_> = messages[i + 1..]
                        .iter()
                        .take_while(|m| matches!(m, ChatMessage::Tool { .. }))
                        .collect();
                    assert_eq!(results.len(), 2, "call {} without its results", call.id);
                }
                if let ChatMessage::Tool { .. } = m {
                    assert!(
                        matches!(
                            messages[i - 1],
                            ChatMessage::Assistant { .. } | ChatMessage::Tool { .. }
                        ),
                        "a result without its call at {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn compaction_replaces_the_older_units_by_a_summary() {
        let mut ctx = context(100);
        ctx.push(ChatMessage::user("now"));
        let older = ctx.older(ctx.budget(None) / 2);
        assert!(!older.is_empty());
        let summary = ctx.apply(&older, Some("what was said".into())).unwrap();
        assert_eq!(summary.through, older.history_to as u64);
        let selection = ctx.select(ctx.budget(None)).unwrap();
        assert!(selection.summary);
        assert!(!ctx.drops(&selection));
    }
}
