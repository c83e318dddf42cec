//! The in-memory [`LinkStore`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;

use async_trait::async_trait;

use super::lock;
use crate::error::{InvalidInput, StoreError};
use crate::ids::{AgentId, LinkId};
use crate::link::{AgentLink, LinkStore};

type Pair = (AgentId, AgentId);

#[derive(Debug, Default)]
struct State {
    /// Links by ordered pair; iteration order is the `(from, to)` sort order of the contract.
    by_pair: BTreeMap<Pair, AgentLink>,
    /// The pair of each link id.
    by_id: HashMap<LinkId, Pair>,
}

impl State {
    fn insert(&mut self, link: AgentLink) {
        let pair = (link.from.clone(), link.to.clone());
        self.by_id.insert(link.id.clone(), pair.clone());
        self.by_pair.insert(pair, link);
    }
}

/// A [`LinkStore`] in process memory.
#[derive(Debug, Default)]
pub struct MemoryLinkStore {
    state: Mutex<State>,
}

impl MemoryLinkStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

fn pair_name(from: &AgentId, to: &AgentId) -> String {
    format!("link {from} -> {to}")
}

#[async_trait]
impl LinkStore for MemoryLinkStore {
    async fn create(&self, link: &AgentLink) -> Result<(), StoreError> {
        let mut st = lock(&self.state);
        if st.by_id.contains_key(&link.id) {
            return Err(StoreError::already_exists(format!("link {}", link.id)));
        }
        if st
            .by_pair
            .contains_key(&(link.from.clone(), link.to.clone()))
        {
            return Err(StoreError::already_exists(pair_name(&link.from, &link.to)));
        }
        st.insert(link.clone());
        Ok(())
    }

    async fn update(&self, link: &AgentLink) -> Result<(), StoreError> {
        let mut st = lock(&self.state);
        let pair = st
            .by_id
            .get(&link.id)
            .cloned()
            .ok_or_else(|| StoreError::not_found(format!("link {}", link.id)))?;
        if let Some(stored) = st.by_pair.get_mut(&pair) {
            stored.direction = link.direction;
            stored.relationship = link.relationship;
            stored.enabled = link.enabled;
            stored.updated_at = link.updated_at;
        }
        Ok(())
    }

    async fn delete(&self, id: &LinkId) -> Result<(), StoreError> {
        let mut st = lock(&self.state);
        let pair = st
            .by_id
            .remove(id)
            .ok_or_else(|| StoreError::not_found(format!("link {id}")))?;
        st.by_pair.remove(&pair);
        Ok(())
    }

    async fn get(&self, id: &LinkId) -> Result<Option<AgentLink>, StoreError> {
        let st = lock(&self.state);
        Ok(st.by_id.get(id).and_then(|p| st.by_pair.get(p)).cloned())
    }

    async fn get_between(
        &self,
        from: &AgentId,
        to: &AgentId,
    ) -> Result<Option<AgentLink>, StoreError> {
        let st = lock(&self.state);
        Ok(st.by_pair.get(&(from.clone(), to.clone())).cloned())
    }

    async fn links_for_agent(&self, agent: &AgentId) -> Result<Vec<AgentLink>, StoreError> {
        let st = lock(&self.state);
        Ok(st
            .by_pair
            .values()
            .filter(|l| l.involves(agent))
            .cloned()
            .collect())
    }

    async fn list(&self) -> Result<Vec<AgentLink>, StoreError> {
        Ok(lock(&self.state).by_pair.values().cloned().collect())
    }

    async fn upsert_all(&self, links: &[AgentLink]) -> Result<(), StoreError> {
        let mut st = lock(&self.state);
        // Validate the whole batch before writing anything: first the batch itself, then against
        // what is stored.
        let mut pairs = HashSet::new();
        for link in links {
            if !pairs.insert((&link.from, &link.to)) {
                return Err(StoreError::Invalid(InvalidInput::new(
                    "links to upsert",
                    format!("{} is named twice", pair_name(&link.from, &link.to)),
                )));
            }
        }
        let mut new_ids: HashMap<&LinkId, Pair> = HashMap::new();
        for link in links {
            let pair = (link.from.clone(), link.to.clone());
            if st.by_pair.contains_key(&pair) {
                continue; // keeps its stored id
            }
            let taken_by_stored = st.by_id.get(&link.id).is_some_and(|p| p != &pair);
            let taken_in_batch = new_ids.insert(&link.id, pair).is_some();
            if taken_by_stored || taken_in_batch {
                return Err(StoreError::already_exists(format!("link {}", link.id)));
            }
        }
        for link in links {
            let pair = (link.from.clone(), link.to.clone());
            let next = match st.by_pair.get(&pair) {
                Some(stored) => AgentLink {
                    id: stored.id.clone(),
                    created_at: stored.created_at,
                    ..link.clone()
                },
                None => link.clone(),
            };
            st.insert(next);
        }
        Ok(())
    }
}
