//! The in-memory [`RecordStore`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use async_trait::async_trait;

use super::lock;
use crate::error::StoreError;
use crate::records::{
    Record, RecordStore, RecordWrite, TypedCells, WriteOutcome, WriteReceipt, check_address,
    check_list_prefix, check_namespace,
};

#[derive(Debug, Default)]
struct State {
    /// Each namespace's keys (looked up by borrowed text: no copy of an address to find it).
    namespaces: crate::fasthash::FastMap<String, Namespace>,
}

/// One namespace's records.
#[derive(Debug, Default)]
struct Namespace {
    /// Every version of every key kept, oldest first: iteration order is the key order of the
    /// contract.
    keys: BTreeMap<String, Vec<Version>>,
    /// Effect key -> the `(key, version)` that write made.
    effects: HashMap<String, (String, u64)>,
}

/// One version of a key.
#[derive(Debug, Clone)]
struct Version {
    record: Record,
    /// Whether it was written with an effect key (a replacing write keeps it).
    effect: bool,
}

impl State {
    fn versions(&self, namespace: &str, key: &str) -> Option<&Vec<Version>> {
        self.namespaces.get(namespace)?.keys.get(key)
    }

    /// Version `version` of the key, if kept.
    fn version(&self, namespace: &str, key: &str, version: u64) -> Option<&Record> {
        let versions = self.versions(namespace, key)?;
        // Versions are kept in order; replacing writes leave gaps, so the number is looked for.
        let at = versions
            .binary_search_by_key(&version, |v| v.record.version)
            .ok()?;
        Some(&versions[at].record)
    }

    fn latest(&self, namespace: &str, key: &str) -> Option<&Record> {
        self.versions(namespace, key)?.last().map(|v| &v.record)
    }
}

/// A [`RecordStore`] in process memory. Its [typed cells](RecordStore::typed_cells) keep what
/// writers keep there (the request ledger) beside the records.
#[derive(Debug, Default)]
pub struct MemoryRecordStore {
    state: Mutex<State>,
    cells: TypedCells,
}

impl MemoryRecordStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `write`, answering `answer(the record written)`, or what was done instead.
    fn apply<T>(
        &self,
        write: RecordWrite,
        answer: impl FnOnce(&Record) -> T,
    ) -> Result<Result<T, WriteOutcome>, StoreError> {
        write.check()?;
        let mut st = lock(&self.state);
        if let Some(effect) = &write.effect_key
            && let Some((key, version)) = st
                .namespaces
                .get(&write.namespace)
                .and_then(|ns| ns.effects.get(effect))
        {
            let record = st
                .version(&write.namespace, key, *version)
                .cloned()
                .ok_or_else(|| StoreError::Backend {
                    backend: "memory",
                    message: format!(
                        "effect key {effect:?} of namespace {} names a record that is not stored",
                        write.namespace
                    ),
                    source: None,
                })?;
            return Ok(Err(WriteOutcome::AlreadyApplied(record)));
        }
        let ns = match st.namespaces.get_mut(&write.namespace) {
            Some(ns) => ns,
            None => st.namespaces.entry(write.namespace.clone()).or_default(),
        };
        // One look-up of the key: its versions, or none yet.
        let versions = ns.keys.get_mut(&write.key);
        let latest = versions
            .as_ref()
            .and_then(|v| v.last())
            .map_or(0, |v| v.record.version);
        if !write.expect.admits(latest) {
            // Only a refusal copies what is stored.
            let current = versions.and_then(|v| v.last()).map(|v| v.record.clone());
            return Ok(Err(WriteOutcome::Conflict { current }));
        }
        let replacing = write.replacing;
        let effect = write.effect_key.clone();
        let record = write.into_record(latest + 1);
        let version = Version {
            effect: effect.is_some(),
            record,
        };
        if let Some(effect) = effect {
            ns.effects
                .insert(effect, (version.record.key.clone(), version.record.version));
        }
        let answered = answer(&version.record);
        match versions {
            Some(v) => {
                if replacing && v.last().is_some_and(|last| !last.effect) {
                    v.pop();
                }
                v.push(version);
            }
            None => {
                ns.keys.insert(version.record.key.clone(), vec![version]);
            }
        }
        Ok(Ok(answered))
    }
}

#[async_trait]
impl RecordStore for MemoryRecordStore {
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, StoreError> {
        check_address(namespace, key)?;
        let st = lock(&self.state);
        Ok(st.latest(namespace, key).cloned())
    }

    async fn version(
        &self,
        namespace: &str,
        key: &str,
        version: u64,
    ) -> Result<Option<Record>, StoreError> {
        check_address(namespace, key)?;
        let st = lock(&self.state);
        Ok(st.version(namespace, key, version).cloned())
    }

    async fn write(&self, write: RecordWrite) -> Result<WriteOutcome, StoreError> {
        Ok(self
            .apply(write, Record::clone)?
            .map_or_else(|outcome| outcome, WriteOutcome::Written))
    }

    async fn write_receipt(&self, write: RecordWrite) -> Result<WriteReceipt, StoreError> {
        Ok(self
            .apply(write, |record| record.version)?
            .map_or_else(WriteReceipt::from, WriteReceipt::Written))
    }

    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<Record>, StoreError> {
        check_namespace(namespace)?;
        check_list_prefix(prefix)?;
        let st = lock(&self.state);
        let Some(ns) = st.namespaces.get(namespace) else {
            return Ok(Vec::new());
        };
        Ok(ns
            .keys
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(key, _)| key.starts_with(prefix))
            .filter_map(|(_, versions)| versions.last().map(|v| v.record.clone()))
            .collect())
    }

    async fn history(&self, namespace: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        check_address(namespace, key)?;
        let st = lock(&self.state);
        Ok(st
            .versions(namespace, key)
            .map(|versions| versions.iter().map(|v| v.record.clone()).collect())
            .unwrap_or_default())
    }

    fn typed_cells(&self) -> Option<&TypedCells> {
        Some(&self.cells)
    }
}
