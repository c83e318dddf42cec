//! What a turn writes and where its answers go: the turn's log (records, consumed envelopes,
//! applied keys) and its one commit, store retries with backoff, errors reported as events, the
//! records of what arrived, and the reply sources remembered per channel.

use std::collections::HashSet;
use std::sync::OnceLock;
use std::time::Duration;

use tracing::Instrument;

use crate::channel::{NewRecord, RecordKind};
use crate::envelope::{Envelope, EnvelopeKind, Source, TurnCommit};
use crate::error::StoreError;
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId};
use crate::runtime::host::{AgentRuntime, Host};
use crate::text::Text;

/// How many of a channel's newest records a turn reads to recall its reply source (what a turn
/// sends of the history is chosen by tokens: see [`crate::context`]).
pub(crate) const HISTORY_LIMIT: usize = 50;

/// The first wait after a store failure; it doubles up to [`MAX_BACKOFF`].
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// The longest wait between two tries of a failing store write.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What a turn writes to the agent's own store at its end, gathered while it runs.
#[derive(Debug, Default)]
pub(crate) struct TurnLog {
    pub(crate) commit: TurnCommit,
    pub(crate) keys: HashSet<String>,
    /// Tokens the turn's model calls spent, as the provider reported them.
    pub(crate) usage: crate::llm::Usage,
}

impl TurnLog {
    pub(crate) fn record(&mut self, record: NewRecord) {
        self.commit.records.push(record);
    }

    /// Takes `envelope` as consumed by this turn; its key (if any) is applied at the commit.
    pub(crate) fn consume(&mut self, envelope: &Envelope) {
        self.commit.consumed.push(envelope.id.clone());
        if let Some(key) = &envelope.idempotency_key
            && self.keys.insert(key.clone())
        {
            self.commit.applied.push(key.clone());
        }
    }

    /// Whether this turn consumed an envelope with `key` already.
    pub(crate) fn has_key(&self, key: &str) -> bool {
        self.keys.contains(key)
    }

    /// Writes the records gathered so far (in one store transaction), so the history shows them
    /// while the turn goes on and before its answer leaves. The consumed envelopes and applied keys
    /// wait for the turn's commit: a turn killed before it runs again (its records may then show
    /// twice; its effects do not happen twice).
    pub(crate) async fn flush_records(&mut self, org: &Host, agent: &AgentId) {
        if self.commit.records.is_empty() {
            return;
        }
        let records = TurnCommit {
            records: std::mem::take(&mut self.commit.records),
            ..TurnCommit::default()
        };
        if let Err((e, records)) = org
            .stores
            .deliveries
            .commit_owned(agent, records, org.clock.now())
            .await
        {
            // Kept for the turn's commit, which retries.
            self.commit.records = records.records;
            report_error(org, agent, None, format!("history not written yet: {e}"));
        }
    }
}

/// Reports a failure no caller waits for: an event, never only a log line.
pub(crate) fn report_error(
    org: &Host,
    agent: &AgentId,
    channel: Option<&ChannelId>,
    message: String,
) {
    tracing::warn!(agent = %agent, "{message}");
    let mut event = org.event(agent, EventKind::Error { message });
    event.channel = channel.cloned();
    org.emit(event);
}

/// The wait before try `attempt + 1` of a failing store operation.
pub(crate) fn backoff(attempt: u32) -> Duration {
    FIRST_BACKOFF
        .saturating_mul(1u32 << attempt.min(10))
        .min(MAX_BACKOFF)
}

pub(crate) async fn backoff_sleep(org: &Host, attempt: u32) {
    org.clock.sleep(backoff(attempt)).await;
}

/// Runs a store operation until it succeeds, waiting longer after each failure (an Error event
/// each time). Gives up only when the agent is stopping, returning the last error.
pub(crate) async fn retry_store<T, F, Fut>(
    org: &Host,
    agent: &AgentRuntime,
    what: &str,
    mut op: F,
) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut attempt = 0u32;
    loop {
        match op().await {
            Ok(value) => return Ok(value),
            Err(e) => {
                report_error(
                    org,
                    agent.id(),
                    None,
                    format!("{what} failed (attempt {}; retrying): {e}", attempt + 1),
                );
                if agent.queue.is_closed() {
                    return Err(e);
                }
                let wait = backoff(attempt);
                org.clock
                    .sleep(wait)
                    .instrument(crate::telemetry::store_retry(what, attempt + 1, wait))
                    .await;
                attempt = attempt.saturating_add(1);
            }
        }
    }
}

/// Writes a turn's commit, retrying until it is stored.
pub(crate) async fn commit(org: &Host, agent: &AgentRuntime, log: TurnLog) {
    if !log.usage.is_zero() {
        org.add_usage(agent.id(), log.usage);
    }
    if log.commit.is_empty() {
        return;
    }
    let me = agent.id();
    let span = crate::telemetry::store_commit(log.commit.records.len(), log.commit.consumed.len());
    let attempts = std::sync::atomic::AtomicU32::new(0);
    let result = retry_store(org, agent, "committing a turn", || {
        attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        org.stores
            .deliveries
            .commit(me, &log.commit, org.clock.now())
    })
    .instrument(span.clone())
    .await;
    crate::telemetry::commit_ended(
        &span,
        attempts.load(std::sync::atomic::Ordering::Relaxed),
        result.is_err(),
    );
    drop(span);
    match result {
        Ok(()) => {}
        Err(e) => report_error(
            org,
            me,
            None,
            format!("turn not committed (it runs again at the next start): {e}"),
        ),
    }
    agent.forget(&log.commit.consumed);
}

/// The authors `user` and `system`, made once per process (a clone is a reference count).
pub(crate) fn fixed_author(user: bool) -> Text {
    static USER: OnceLock<Text> = OnceLock::new();
    static SYSTEM: OnceLock<Text> = OnceLock::new();
    if user {
        USER.get_or_init(|| Text::from("user")).clone()
    } else {
        SYSTEM.get_or_init(|| Text::from("system")).clone()
    }
}

pub(crate) fn author_of(source: &Source) -> Text {
    match source {
        Source::External { .. } => fixed_author(true),
        Source::Internal { from_agent, .. } => ["agent ", from_agent.as_str()].concat().into(),
        Source::System => fixed_author(false),
    }
}

pub(crate) fn user_record(envelope: &Envelope) -> NewRecord {
    let kind = match envelope.kind {
        EnvelopeKind::SentRecord => RecordKind::Sent,
        EnvelopeKind::SystemRecord | EnvelopeKind::Retrigger | EnvelopeKind::Cancel => {
            RecordKind::System
        }
        _ => RecordKind::User,
    };
    let mut record = NewRecord::new(
        envelope.channel.clone(),
        kind,
        author_of(&envelope.source),
        envelope.content.clone(),
        envelope.timestamp,
    );
    record.metadata.insert(
        "envelope".into(),
        serde_json::Value::String(envelope.id.to_string()),
    );
    // Where replies in this channel go, kept with the history: a retrigger answered after a
    // restart (or in another process) still reaches the application's user.
    if let Some(source) = external_source_value(&envelope.source) {
        record.metadata.insert(META_REPLY_SOURCE.into(), source);
    }
    if let Some(conversation) = &envelope.conversation {
        record.metadata.insert(
            crate::envelope::META_CONVERSATION.into(),
            serde_json::Value::String(conversation.to_string()),
        );
    }
    record
}

/// An external source as JSON, as `serde_json::to_value` writes it (`{"source": "external",
/// "platform": ..., "reply_target": ...}`), built directly: once per user message.
pub(crate) fn external_source_value(source: &Source) -> Option<serde_json::Value> {
    let Source::External {
        platform,
        reply_target,
    } = source
    else {
        return None;
    };
    let mut map = serde_json::Map::new();
    map.insert("source".into(), serde_json::Value::from("external"));
    map.insert(
        "platform".into(),
        serde_json::Value::from(platform.as_str()),
    );
    map.insert(
        "reply_target".into(),
        serde_json::Value::from(reply_target.as_str()),
    );
    Some(serde_json::Value::Object(map))
}

pub(crate) fn system_record(
    channel: &ChannelId,
    text: impl Into<crate::text::Text>,
    org: &Host,
) -> NewRecord {
    NewRecord::new(
        channel.clone(),
        RecordKind::System,
        fixed_author(false),
        text,
        org.clock.now(),
    )
}

/// The record metadata key holding the external source of a user's message.
pub(crate) const META_REPLY_SOURCE: &str = "reply_source";

/// Before a turn on a system message (a retrigger) in `channel`: when this process knows no
/// external source for that channel yet (after a restart, or an agent taken over from another
/// process), recalls the last one recorded in the channel's history, so the answer reaches the
/// user. Read only in that case: the turn's own history read skips metadata.
pub(crate) async fn recall_source(
    org: &Host,
    agent: &AgentRuntime,
    channel: &ChannelId,
    first: &Envelope,
) {
    if first.source != Source::System
        || agent
            .reply_sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(channel)
    {
        return;
    }
    let history = match org
        .stores
        .channels
        .history(agent.id(), channel, Some(HISTORY_LIMIT))
        .await
    {
        Ok(history) => history,
        Err(e) => {
            report_error(
                org,
                agent.id(),
                None,
                format!("the reply target of {channel} not recalled: {e}"),
            );
            return;
        }
    };
    let recorded = history.iter().rev().find_map(|r| {
        r.record
            .metadata
            .get(META_REPLY_SOURCE)
            .and_then(|v| serde_json::from_value::<Source>(v.clone()).ok())
    });
    if let Some(source) = recorded {
        agent
            .reply_sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(channel.clone())
            .or_insert(source);
    }
}

/// Remembers the external sources of `current`, per channel.
pub(crate) fn remember_sources(agent: &AgentRuntime, current: &[Envelope]) {
    let mut known = agent
        .reply_sources
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    for envelope in current {
        if matches!(envelope.source, Source::External { .. }) {
            known.insert(envelope.channel.clone(), envelope.source.clone());
        }
    }
}

/// Where a reply to `current` goes: the source of the first envelope, or, for a system message (a
/// retrigger), the last external source seen in its channel.
pub(crate) fn reply_source(agent: &AgentRuntime, current: &[Envelope]) -> Source {
    match current.first() {
        Some(first) if first.source == Source::System => agent
            .reply_sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&first.channel)
            .cloned()
            .unwrap_or(Source::System),
        Some(first) => first.source.clone(),
        None => Source::System,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_external_source_is_written_as_serde_writes_it() {
        let source = Source::External {
            platform: "portal".into(),
            reply_target: "u \"1\"".into(),
        };
        assert_eq!(
            external_source_value(&source),
            serde_json::to_value(&source).ok()
        );
        let back: Source =
            serde_json::from_value(external_source_value(&source).unwrap_or_default())
                .unwrap_or(Source::System);
        assert_eq!(back, source);
        assert_eq!(external_source_value(&Source::System), None);
    }
}
