//! The in-memory [`RecordStore`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use async_trait::async_trait;

use super::lock;
use crate::error::StoreError;
use crate::records::{
    Record, RecordStore, RecordWrite, WriteOutcome, check_address, check_list_prefix,
    check_namespace,
};

#[derive(Debug, Default)]
struct State {
    /// Every version of every key, oldest first, by `(namespace, key)`: iteration order is the
    /// key order of the contract.
    keys: BTreeMap<(String, String), Vec<Record>>,
    /// `(namespace, effect key)` -> the `(key, version)` that write made.
    effects: HashMap<(String, String), (String, u64)>,
}

impl State {
    fn versions(&self, namespace: &str, key: &str) -> Option<&Vec<Record>> {
        self.keys.get(&(namespace.to_string(), key.to_string()))
    }
}

/// A [`RecordStore`] in process memory.
#[derive(Debug, Default)]
pub struct MemoryRecordStore {
    state: Mutex<State>,
}

impl MemoryRecordStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl RecordStore for MemoryRecordStore {
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, StoreError> {
        check_address(namespace, key)?;
        let st = lock(&self.state);
        Ok(st.versions(namespace, key).and_then(|v| v.last()).cloned())
    }

    async fn version(
        &self,
        namespace: &str,
        key: &str,
        version: u64,
    ) -> Result<Option<Record>, StoreError> {
        check_address(namespace, key)?;
        let st = lock(&self.state);
        let Some(index) = version.checked_sub(1).and_then(|i| usize::try_from(i).ok()) else {
            return Ok(None);
        };
        Ok(st
            .versions(namespace, key)
            .and_then(|v| v.get(index))
            .cloned())
    }

    async fn write(&self, write: RecordWrite) -> Result<WriteOutcome, StoreError> {
        write.check()?;
        let mut st = lock(&self.state);
        if let Some(effect) = &write.effect_key
            && let Some((key, version)) = st.effects.get(&(write.namespace.clone(), effect.clone()))
        {
            let index = usize::try_from(*version)
                .ok()
                .and_then(|v| v.checked_sub(1));
            let record = st
                .versions(&write.namespace, key)
                .zip(index)
                .and_then(|(v, i)| v.get(i))
                .cloned()
                .ok_or_else(|| StoreError::Backend {
                    backend: "memory",
                    message: format!(
                        "effect key {effect:?} of namespace {} names a record that is not stored",
                        write.namespace
                    ),
                    source: None,
                })?;
            return Ok(WriteOutcome::AlreadyApplied(record));
        }
        let id = (write.namespace.clone(), write.key.clone());
        let latest = st
            .keys
            .get(&id)
            .and_then(|v| v.last())
            .map_or(0, |r| r.version);
        if !write.expect.admits(latest) {
            // Only a refusal copies what is stored.
            let current = st.keys.get(&id).and_then(|v| v.last()).cloned();
            return Ok(WriteOutcome::Conflict { current });
        }
        let effect = write.effect_key.clone();
        let record = write.into_record(latest + 1);
        st.keys.entry(id).or_default().push(record.clone());
        if let Some(effect) = effect {
            st.effects.insert(
                (record.namespace.clone(), effect),
                (record.key.clone(), record.version),
            );
        }
        Ok(WriteOutcome::Written(record))
    }

    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<Record>, StoreError> {
        check_namespace(namespace)?;
        check_list_prefix(prefix)?;
        let st = lock(&self.state);
        let start = (namespace.to_string(), prefix.to_string());
        Ok(st
            .keys
            .range(start..)
            .take_while(|((ns, key), _)| ns == namespace && key.starts_with(prefix))
            .filter_map(|(_, versions)| versions.last().cloned())
            .collect())
    }

    async fn history(&self, namespace: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        check_address(namespace, key)?;
        let st = lock(&self.state);
        Ok(st.versions(namespace, key).cloned().unwrap_or_default())
    }
}
