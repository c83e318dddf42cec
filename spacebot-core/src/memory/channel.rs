//! The in-memory [`ChannelStore`].

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;

use super::lock;
use crate::channel::{ChannelRecord, ChannelStore, HistoryText, NewRecord};
use crate::error::StoreError;
use crate::ids::{AgentId, ChannelId};

/// One agent's channels.
#[derive(Debug, Default)]
struct AgentChannels {
    /// The last sequence number handed out.
    last_seq: u64,
    /// Every known channel with its records in append order.
    channels: BTreeMap<ChannelId, Vec<ChannelRecord>>,
}

/// A [`ChannelStore`] in process memory. Sequence numbers start at 1 per agent.
#[derive(Debug, Default)]
pub struct MemoryChannelStore {
    agents: Mutex<crate::fasthash::FastMap<AgentId, AgentChannels>>,
}

impl MemoryChannelStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `records` (given away: moved, not copied) to `agent`'s channels in order, under
    /// one hold of the lock: no reader sees some of them without the others.
    pub(crate) fn append_owned(&self, agent: &AgentId, records: Vec<NewRecord>) {
        if records.is_empty() {
            return;
        }
        let mut agents = lock(&self.agents);
        let state = agents.entry(agent.clone()).or_default();
        for record in records {
            state.push(agent, record);
        }
    }
}

impl AgentChannels {
    /// Appends one record with the next sequence number and returns it as stored.
    fn push(&mut self, agent: &AgentId, record: NewRecord) -> &ChannelRecord {
        self.last_seq += 1;
        let records = self.channels.entry(record.channel.clone()).or_default();
        records.push(ChannelRecord {
            seq: self.last_seq,
            agent: agent.clone(),
            record,
        });
        // Just pushed: the channel's records are not empty.
        &records[records.len() - 1]
    }
}

#[async_trait]
impl ChannelStore for MemoryChannelStore {
    async fn append(
        &self,
        agent: &AgentId,
        record: NewRecord,
    ) -> Result<ChannelRecord, StoreError> {
        let mut agents = lock(&self.agents);
        Ok(agents
            .entry(agent.clone())
            .or_default()
            .push(agent, record)
            .clone())
    }

    async fn history(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<ChannelRecord>, StoreError> {
        let agents = lock(&self.agents);
        let Some(records) = agents.get(agent).and_then(|a| a.channels.get(channel)) else {
            return Ok(Vec::new());
        };
        let skip = limit.map_or(0, |l| records.len().saturating_sub(l));
        Ok(records[skip..].to_vec())
    }

    async fn history_texts(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        limit: Option<usize>,
    ) -> Result<Vec<HistoryText>, StoreError> {
        let agents = lock(&self.agents);
        let Some(records) = agents.get(agent).and_then(|a| a.channels.get(channel)) else {
            return Ok(Vec::new());
        };
        let skip = limit.map_or(0, |l| records.len().saturating_sub(l));
        // The texts are shared, not copied; no metadata map, id or channel is cloned.
        Ok(records[skip..]
            .iter()
            .map(|r| HistoryText {
                kind: r.record.kind,
                author: r.record.author.clone(),
                content: r.record.content.clone(),
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
