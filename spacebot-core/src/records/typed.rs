//! [`Records<T>`]: the typed view of one namespace of a [`RecordStore`].

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Record, RecordStore, RecordWrite, WriteOutcome, check_namespace, invalid};
use crate::error::StoreError;

/// The records of one namespace, with values (de)serialized as `T`: the view a behaviour keeps.
/// Cheap to clone. See the [module docs](super).
pub struct Records<T> {
    store: Arc<dyn RecordStore>,
    namespace: Arc<str>,
    _value: PhantomData<fn() -> T>,
}

impl<T> Clone for Records<T> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            namespace: self.namespace.clone(),
            _value: PhantomData,
        }
    }
}

impl<T> fmt::Debug for Records<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Records")
            .field("namespace", &self.namespace)
            .field("value", &std::any::type_name::<T>())
            .field("store", &self.store)
            .finish()
    }
}

impl<T: Serialize + DeserializeOwned> Records<T> {
    /// The records of `namespace` in `store`.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for an invalid namespace.
    pub fn new(
        store: Arc<dyn RecordStore>,
        namespace: impl Into<String>,
    ) -> Result<Self, StoreError> {
        let namespace = namespace.into();
        check_namespace(&namespace)?;
        Ok(Self {
            store,
            namespace: namespace.into(),
            _value: PhantomData,
        })
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The untyped store underneath.
    pub fn store(&self) -> &Arc<dyn RecordStore> {
        &self.store
    }

    /// The latest version of `key`.
    ///
    /// # Errors
    /// The store's; [`StoreError::Corrupt`] naming the record if its value does not decode as `T`.
    pub async fn get(&self, key: &str) -> Result<Option<Record<T>>, StoreError> {
        self.store
            .get(&self.namespace, key)
            .await?
            .map(Record::decode)
            .transpose()
    }

    /// Version `version` of `key`.
    ///
    /// # Errors
    /// As [`Records::get`].
    pub async fn version(&self, key: &str, version: u64) -> Result<Option<Record<T>>, StoreError> {
        self.store
            .version(&self.namespace, key, version)
            .await?
            .map(Record::decode)
            .transpose()
    }

    /// The latest version of every key starting with `prefix`, in key order.
    ///
    /// # Errors
    /// As [`Records::get`].
    pub async fn list(&self, prefix: &str) -> Result<Vec<Record<T>>, StoreError> {
        self.store
            .list(&self.namespace, prefix)
            .await?
            .into_iter()
            .map(Record::decode)
            .collect()
    }

    /// Every version of `key`, oldest first.
    ///
    /// # Errors
    /// As [`Records::get`].
    pub async fn history(&self, key: &str) -> Result<Vec<Record<T>>, StoreError> {
        self.store
            .history(&self.namespace, key)
            .await?
            .into_iter()
            .map(Record::decode)
            .collect()
    }

    /// A write of `value` under `key` in this namespace by `author`; add an expectation, an
    /// effect key and the time, then hand it to [`Records::write`].
    ///
    /// # Errors
    /// [`StoreError::Invalid`] if `value` cannot be serialized.
    pub fn draft(
        &self,
        key: impl Into<String>,
        value: &T,
        author: impl Into<String>,
    ) -> Result<RecordWrite, StoreError> {
        let value = serde_json::to_value(value).map_err(|e| {
            invalid(
                "record value",
                format!(
                    "a {} cannot be written as JSON: {e}",
                    std::any::type_name::<T>()
                ),
            )
        })?;
        Ok(RecordWrite::new(
            self.namespace.as_ref(),
            key,
            value,
            author,
        ))
    }

    /// Writes `write` (from [`Records::draft`]) and decodes the outcome's records.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] if `write` is for another namespace; else as
    /// [`RecordStore::write`] and [`Records::get`].
    pub async fn write(&self, write: RecordWrite) -> Result<WriteOutcome<T>, StoreError> {
        if write.namespace != *self.namespace {
            return Err(invalid(
                "record namespace",
                format!(
                    "a write for {:?} given to the records of {:?}",
                    write.namespace, self.namespace
                ),
            ));
        }
        self.store.write(write).await?.decode()
    }
}
