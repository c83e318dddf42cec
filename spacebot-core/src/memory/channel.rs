//! The in-memory [`ChannelStore`].

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;

use super::lock;
use crate::channel::{ChannelRecord, ChannelStore, HistoryText, NewRecord, RecordKind};
use crate::error::StoreError;
use crate::ids::{AgentId, ChannelId};
use crate::text::Text;
use crate::time::Timestamp;

/// A record as this store keeps it: the agent and the channel are the keys it is filed under, and
/// its metadata is kept as its JSON text.
///
/// A `serde_json::Map` is a B-tree whose first entry allocates a 632-byte node (per nested object
/// too): the two maps of a user message's record (its envelope and its reply source) weighed
/// 1.3 KB, three quarters of what a turn left in memory. The text of the same metadata is about a
/// hundred bytes in one allocation. History is kept for as long as the store lives, so what each
/// record weighs decides how fast the heap grows (on a thread other than the main one, glibc grows
/// its arena a page at a time, one `mprotect` each). The metadata is decoded again only when
/// [`ChannelStore::history`] hands a record out; a turn's own read,
/// [`ChannelStore::history_texts`], never looks at it.
#[derive(Debug)]
struct Kept {
    seq: u64,
    kind: RecordKind,
    author: Text,
    content: Text,
    metadata: KeptMetadata,
    at: Timestamp,
}

/// A kept record's metadata.
#[derive(Debug)]
enum KeptMetadata {
    /// No metadata (most records).
    None,
    /// The map as JSON text.
    Json(Box<str>),
    /// The map itself, should it ever not serialize (a map of JSON values always does).
    Map(Box<serde_json::Map<String, serde_json::Value>>),
}

impl KeptMetadata {
    fn keep(metadata: &serde_json::Map<String, serde_json::Value>) -> Self {
        if metadata.is_empty() {
            return Self::None;
        }
        match serde_json::to_string(metadata) {
            Ok(json) => Self::Json(json.into_boxed_str()),
            Err(_) => Self::Map(Box::new(metadata.clone())),
        }
    }

    fn map(&self) -> Result<serde_json::Map<String, serde_json::Value>, StoreError> {
        match self {
            Self::None => Ok(serde_json::Map::new()),
            Self::Json(json) => serde_json::from_str(json).map_err(|e| StoreError::Corrupt {
                location: "memory channel store".into(),
                reason: format!("a record's metadata does not read back: {e}"),
            }),
            Self::Map(map) => Ok((**map).clone()),
        }
    }
}

impl Kept {
    /// The record as kept, its sequence number still to be given (under the store's lock; the
    /// metadata is encoded before it is taken).
    fn new(record: &NewRecord) -> Self {
        Self {
            seq: 0,
            kind: record.kind,
            author: record.author.clone(),
            content: record.content.clone(),
            metadata: KeptMetadata::keep(&record.metadata),
            at: record.at,
        }
    }

    /// The stored record, as the trait hands it out.
    fn record(&self, agent: &AgentId, channel: &ChannelId) -> Result<ChannelRecord, StoreError> {
        Ok(ChannelRecord {
            seq: self.seq,
            agent: agent.clone(),
            record: NewRecord {
                channel: channel.clone(),
                kind: self.kind,
                author: self.author.clone(),
                content: self.content.clone(),
                metadata: self.metadata.map()?,
                at: self.at,
            },
        })
    }
}

/// One agent's channels.
#[derive(Debug, Default)]
struct AgentChannels {
    /// The last sequence number handed out.
    last_seq: u64,
    /// Every known channel with its records in append order.
    channels: BTreeMap<ChannelId, Vec<Kept>>,
}

/// A [`ChannelStore`] in process memory. Sequence numbers start at 1 per agent.
///
/// Everything appended is kept for as long as the store lives. Texts are kept shared (a history
/// read hands them out without a copy); a record's metadata is kept as its JSON text (about a
/// tenth of a map's size in memory) and decoded when [`ChannelStore::history`] hands the record
/// out, while [`ChannelStore::history_texts`] (what a turn reads) never decodes it.
#[derive(Debug, Default)]
pub struct MemoryChannelStore {
    agents: Mutex<crate::fasthash::FastMap<AgentId, AgentChannels>>,
}

impl MemoryChannelStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `records` (given away: their texts are kept, not copied) to `agent`'s channels in
    /// order, under one hold of the lock: no reader sees some of them without the others.
    pub(crate) fn append_owned(&self, agent: &AgentId, records: Vec<NewRecord>) {
        if records.is_empty() {
            return;
        }
        let kept: Vec<Kept> = records.iter().map(Kept::new).collect();
        let mut agents = lock(&self.agents);
        let state = agents.entry(agent.clone()).or_default();
        for (record, kept) in records.iter().zip(kept) {
            state.push(&record.channel, kept);
        }
    }
}

impl AgentChannels {
    /// Appends one record to `channel` with the next sequence number and returns that number.
    fn push(&mut self, channel: &ChannelId, mut kept: Kept) -> u64 {
        self.last_seq += 1;
        kept.seq = self.last_seq;
        match self.channels.get_mut(channel) {
            Some(records) => records.push(kept),
            None => {
                self.channels.insert(channel.clone(), vec![kept]);
            }
        }
        self.last_seq
    }

    /// The channel's kept records, the last `limit` of them with a limit.
    fn tail(&self, channel: &ChannelId, limit: Option<usize>) -> &[Kept] {
        let Some(records) = self.channels.get(channel) else {
            return &[];
        };
        let skip = limit.map_or(0, |l| records.len().saturating_sub(l));
        &records[skip..]
    }
}

#[async_trait]
impl ChannelStore for MemoryChannelStore {
    async fn append(
        &self,
        agent: &AgentId,
        record: NewRecord,
    ) -> Result<ChannelRecord, StoreError> {
        let kept = Kept::new(&record);
        let seq = lock(&self.agents)
            .entry(agent.clone())
            .or_default()
            .push(&record.channel, kept);
        Ok(ChannelRecord {
            seq,
            agent: agent.clone(),
            record,
        })
    }

    async fn history(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<ChannelRecord>, StoreError> {
        let agents = lock(&self.agents);
        let Some(state) = agents.get(agent) else {
            return Ok(Vec::new());
        };
        state
            .tail(channel, limit)
            .iter()
            .map(|kept| kept.record(agent, channel))
            .collect()
    }

    async fn history_texts(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<HistoryText>, StoreError> {
        let agents = lock(&self.agents);
        let Some(state) = agents.get(agent) else {
            return Ok(Vec::new());
        };
        // The texts are shared, not copied; the metadata is not decoded.
        Ok(state
            .tail(channel, limit)
            .iter()
            .map(|kept| HistoryText {
                seq: kept.seq,
                kind: kept.kind,
                author: kept.author.clone(),
                content: kept.content.clone(),
            })
            .collect())
    }

    async fn ensure_channel(&self, agent: &AgentId, channel: &ChannelId) -> Result<(), StoreError> {
        let mut agents = lock(&self.agents);
        agents
            .entry(agent.clone())
            .or_default()
            .channels
            .entry(channel.clone())
            .or_default();
        Ok(())
    }

    async fn channels(&self, agent: &AgentId) -> Result<Vec<ChannelId>, StoreError> {
        let agents = lock(&self.agents);
        Ok(agents
            .get(agent)
            .map(|a| a.channels.keys().cloned().collect())
            .unwrap_or_default())
    }
}
