//! Links and conversations, in `instance.redb`.

use std::collections::HashMap;

use redb::{ReadableTable, Table};
use spacebot_core::conversation::{Conversation, ConversationFilter, ConversationStatus};
use spacebot_core::{AgentId, AgentLink, ConversationId, InvalidInput, LinkId, StoreError};

use crate::tables::encode;
use crate::worker::Txn;

fn link_what(link: &AgentLink) -> String {
    format!("link {} -> {}", link.from, link.to)
}

impl Txn<'_> {
    fn read_link(
        &self,
        links: &Table<'_, &str, &[u8]>,
        id: &str,
    ) -> Result<Option<AgentLink>, StoreError> {
        match links.get(id).map_err(self.err("read a link"))? {
            Some(v) => Ok(Some(self.decode(format_args!("link {id}"), v.value())?)),
            None => Ok(None),
        }
    }

    fn write_link(&self, link: &AgentLink) -> Result<(), StoreError> {
        let bytes = encode(link)?;
        let e = self.err("write a link");
        self.links()?
            .insert(link.id.as_str(), bytes.as_slice())
            .map_err(&e)?;
        self.links_by_pair()?
            .insert((link.from.as_str(), link.to.as_str()), link.id.as_str())
            .map_err(&e)?;
        self.links_by_to()?
            .insert((link.to.as_str(), link.from.as_str()), link.id.as_str())
            .map_err(&e)?;
        Ok(())
    }

    fn pair_id(&self, from: &str, to: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .links_by_pair()?
            .get((from, to))
            .map_err(self.err("read a link"))?
            .map(|v| v.value().to_string()))
    }

    pub(crate) fn link_create(&self, link: &AgentLink) -> Result<(), StoreError> {
        if self.read_link(&*self.links()?, link.id.as_str())?.is_some() {
            return Err(StoreError::already_exists(format!("link {}", link.id)));
        }
        if self
            .pair_id(link.from.as_str(), link.to.as_str())?
            .is_some()
        {
            return Err(StoreError::already_exists(link_what(link)));
        }
        self.write_link(link)
    }

    pub(crate) fn link_update(&self, link: &AgentLink) -> Result<(), StoreError> {
        let Some(mut stored) = self.read_link(&*self.links()?, link.id.as_str())? else {
            return Err(StoreError::not_found(format!("link {}", link.id)));
        };
        stored.direction = link.direction;
        stored.relationship = link.relationship;
        stored.enabled = link.enabled;
        stored.updated_at = link.updated_at;
        self.write_link(&stored)
    }

    pub(crate) fn link_delete(&self, id: &LinkId) -> Result<(), StoreError> {
        let mut links = self.links()?;
        let Some(stored) = self.read_link(&links, id.as_str())? else {
            return Err(StoreError::not_found(format!("link {id}")));
        };
        let e = self.err("delete a link");
        links.remove(id.as_str()).map_err(&e)?;
        self.links_by_pair()?
            .remove((stored.from.as_str(), stored.to.as_str()))
            .map_err(&e)?;
        self.links_by_to()?
            .remove((stored.to.as_str(), stored.from.as_str()))
            .map_err(&e)?;
        Ok(())
    }

    pub(crate) fn link_get(&self, id: &LinkId) -> Result<Option<AgentLink>, StoreError> {
        self.read_link(&*self.links()?, id.as_str())
    }

    pub(crate) fn link_between(
        &self,
        from: &AgentId,
        to: &AgentId,
    ) -> Result<Option<AgentLink>, StoreError> {
        match self.pair_id(from.as_str(), to.as_str())? {
            Some(id) => self.read_link(&*self.links()?, &id),
            None => Ok(None),
        }
    }

    fn ids_in(&self, by_to: bool, first: Option<&str>) -> Result<Vec<String>, StoreError> {
        let table = if by_to {
            self.links_by_to()?
        } else {
            self.links_by_pair()?
        };
        let e = self.err("list links");
        let mut ids = Vec::new();
        let range = match first {
            Some(a) => table.range((a, "")..).map_err(&e)?,
            None => table.iter().map_err(&e)?,
        };
        for row in range {
            let (k, v) = row.map_err(&e)?;
            if first.is_some_and(|a| k.value().0 != a) {
                break;
            }
            ids.push(v.value().to_string());
        }
        Ok(ids)
    }

    pub(crate) fn links_for_agent(&self, agent: &AgentId) -> Result<Vec<AgentLink>, StoreError> {
        let mut ids = self.ids_in(false, Some(agent.as_str()))?;
        ids.extend(self.ids_in(true, Some(agent.as_str()))?);
        let links = self.links()?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(link) = self.read_link(&links, &id)? {
                out.push(link);
            }
        }
        out.sort_by(|a, b| (&a.from, &a.to).cmp(&(&b.from, &b.to)));
        out.dedup_by(|a, b| a.id == b.id);
        Ok(out)
    }

    pub(crate) fn links_all(&self) -> Result<Vec<AgentLink>, StoreError> {
        let links = self.links()?;
        let mut out = Vec::new();
        for id in self.ids_in(false, None)? {
            if let Some(link) = self.read_link(&links, &id)? {
                out.push(link);
            }
        }
        Ok(out)
    }

    pub(crate) fn links_upsert_all(&self, given: &[AgentLink]) -> Result<(), StoreError> {
        // Plan every write first, so that a refused entry leaves the file untouched.
        let links = self.links()?;
        let mut pairs: HashMap<(String, String), String> = HashMap::new();
        let mut ids: HashMap<String, (String, String)> = HashMap::new();
        let mut plan: Vec<AgentLink> = Vec::with_capacity(given.len());
        for link in given {
            let pair = (link.from.to_string(), link.to.to_string());
            if pairs.contains_key(&pair) {
                return Err(StoreError::Invalid(InvalidInput::new(
                    "links",
                    format!("the batch names {} twice", link_what(link)),
                )));
            }
            let existing_id = self.pair_id(&pair.0, &pair.1)?;
            let next = match existing_id {
                Some(id) => {
                    let created_at = self
                        .read_link(&links, &id)?
                        .map(|l| l.created_at)
                        .unwrap_or(link.created_at);
                    AgentLink {
                        id: LinkId::new(id),
                        created_at,
                        ..link.clone()
                    }
                }
                None => {
                    let taken = match ids.get(link.id.as_str()) {
                        Some(other) => other != &pair,
                        None => self.read_link(&links, link.id.as_str())?.is_some(),
                    };
                    if taken {
                        return Err(StoreError::already_exists(format!(
                            "link {} (named by {})",
                            link.id,
                            link_what(link)
                        )));
                    }
                    link.clone()
                }
            };
            pairs.insert(pair.clone(), next.id.to_string());
            ids.insert(next.id.to_string(), pair);
            plan.push(next);
        }
        drop(links);
        for link in &plan {
            self.write_link(link)?;
        }
        Ok(())
    }

    // Conversations.

    fn read_conversation(&self, id: &str) -> Result<Option<Conversation>, StoreError> {
        match self
            .conversations()?
            .get(id)
            .map_err(self.err("read a conversation"))?
        {
            Some(v) => Ok(Some(
                self.decode(format_args!("conversation {id}"), v.value())?,
            )),
            None => Ok(None),
        }
    }

    fn open_holder(&self, key: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .conversations_open()?
            .get(key)
            .map_err(self.err("read a conversation"))?
            .map(|v| v.value().to_string()))
    }

    fn write_conversation(
        &self,
        previous: Option<&Conversation>,
        next: &Conversation,
    ) -> Result<(), StoreError> {
        let e = self.err("write a conversation");
        let bytes = encode(next)?;
        self.conversations()?
            .insert(next.id.as_str(), bytes.as_slice())
            .map_err(&e)?;
        let mut by_created = self.conversations_by_created()?;
        let mut open = self.conversations_open()?;
        if let Some(prev) = previous {
            by_created
                .remove((prev.created_at.as_millis(), prev.id.as_str()))
                .map_err(&e)?;
            if let Some(key) = prev.pair_key.as_deref() {
                let held = open
                    .get(key)
                    .map_err(&e)?
                    .map(|v| v.value() == prev.id.as_str());
                if held == Some(true) {
                    open.remove(key).map_err(&e)?;
                }
            }
        }
        by_created
            .insert((next.created_at.as_millis(), next.id.as_str()), ())
            .map_err(&e)?;
        if next.status == ConversationStatus::Open
            && let Some(key) = next.pair_key.as_deref()
        {
            open.insert(key, next.id.as_str()).map_err(&e)?;
        }
        Ok(())
    }

    fn check_key_free(&self, c: &Conversation) -> Result<(), StoreError> {
        if c.status != ConversationStatus::Open {
            return Ok(());
        }
        if let Some(key) = c.pair_key.as_deref()
            && let Some(holder) = self.open_holder(key)?
            && holder != c.id.as_str()
        {
            return Err(StoreError::already_exists(format!(
                "open conversation with key {key} ({holder})"
            )));
        }
        Ok(())
    }

    pub(crate) fn conversation_create(&self, c: &Conversation) -> Result<(), StoreError> {
        if self.read_conversation(c.id.as_str())?.is_some() {
            return Err(StoreError::already_exists(format!("conversation {}", c.id)));
        }
        self.check_key_free(c)?;
        self.write_conversation(None, c)
    }

    pub(crate) fn conversation_get(
        &self,
        id: &ConversationId,
    ) -> Result<Option<Conversation>, StoreError> {
        self.read_conversation(id.as_str())
    }

    pub(crate) fn conversation_update(
        &self,
        next: &Conversation,
        expected_revision: u64,
    ) -> Result<Conversation, StoreError> {
        let Some(stored) = self.read_conversation(next.id.as_str())? else {
            return Err(StoreError::not_found(format!("conversation {}", next.id)));
        };
        if stored.revision != expected_revision {
            return Err(StoreError::Conflict {
                what: format!("conversation {}", next.id),
                expected: format!("revision {expected_revision}"),
                actual: format!("revision {}", stored.revision),
            });
        }
        stored.check_successor(next)?;
        let mut written = next.clone();
        written.revision = expected_revision + 1;
        self.check_key_free(&written)?;
        self.write_conversation(Some(&stored), &written)?;
        Ok(written)
    }

    pub(crate) fn conversation_find_open(
        &self,
        key: &str,
    ) -> Result<Option<Conversation>, StoreError> {
        match self.open_holder(key)? {
            Some(id) => self.read_conversation(&id),
            None => Ok(None),
        }
    }

    pub(crate) fn conversation_list(
        &self,
        filter: &ConversationFilter,
    ) -> Result<Vec<Conversation>, StoreError> {
        let e = self.err("list conversations");
        let index = self.conversations_by_created()?;
        let rows = self.conversations()?;
        let mut out = Vec::new();
        for row in index.iter().map_err(&e)? {
            let (k, _) = row.map_err(&e)?;
            let (_, id) = k.value();
            if let Some(v) = rows.get(id).map_err(&e)? {
                let c: Conversation = self.decode(format_args!("conversation {id}"), v.value())?;
                if filter.matches(&c) {
                    out.push(c);
                }
            }
        }
        Ok(out)
    }
}
