//! Behaviours' records, in `instance.redb`.

use redb::{ReadableTable, Table};
use spacebot_core::StoreError;
use spacebot_core::records::{Record, RecordWrite, WriteOutcome};

use crate::tables::encode;
use crate::worker::Txn;

type Versions<'a> = Table<'a, (&'static str, &'static str, u64), &'static [u8]>;

impl Txn<'_> {
    fn read_record(
        &self,
        records: &Versions<'_>,
        namespace: &str,
        key: &str,
        version: u64,
    ) -> Result<Option<Record>, StoreError> {
        match records
            .get((namespace, key, version))
            .map_err(self.err("read a record"))?
        {
            Some(v) => Ok(Some(self.decode(
                format_args!("record {namespace}/{key:?} version {version}"),
                v.value(),
            )?)),
            None => Ok(None),
        }
    }

    fn head(&self, namespace: &str, key: &str) -> Result<u64, StoreError> {
        Ok(self
            .record_heads()?
            .get((namespace, key))
            .map_err(self.err("read a record's version"))?
            .map_or(0, |v| v.value()))
    }

    /// A stored reference that leads nowhere: the file is damaged.
    fn dangling(&self, what: String) -> StoreError {
        StoreError::Corrupt {
            location: self.path.display().to_string(),
            reason: what,
        }
    }

    pub(crate) fn record_get(
        &self,
        namespace: &str,
        key: &str,
    ) -> Result<Option<Record>, StoreError> {
        match self.head(namespace, key)? {
            0 => Ok(None),
            latest => {
                let record = self.read_record(&*self.records()?, namespace, key, latest)?;
                record.map(Some).ok_or_else(|| {
                    self.dangling(format!(
                        "record {namespace}/{key:?}: its latest version {latest} is missing"
                    ))
                })
            }
        }
    }

    pub(crate) fn record_version(
        &self,
        namespace: &str,
        key: &str,
        version: u64,
    ) -> Result<Option<Record>, StoreError> {
        self.read_record(&*self.records()?, namespace, key, version)
    }

    pub(crate) fn record_write(&self, write: RecordWrite) -> Result<WriteOutcome, StoreError> {
        // Every check before the first insert: an operation refused half-way would keep what it
        // wrote (only a failed one rolls the batch back).
        if let Some(effect) = &write.effect_key {
            let applied = self
                .record_effects()?
                .get((write.namespace.as_str(), effect.as_str()))
                .map_err(self.err("read an effect key"))?
                .map(|v| {
                    let (key, version) = v.value();
                    (key.to_string(), version)
                });
            if let Some((key, version)) = applied {
                let record = self
                    .read_record(&*self.records()?, &write.namespace, &key, version)?
                    .ok_or_else(|| {
                        self.dangling(format!(
                            "effect key {effect:?} of namespace {} names record {key:?} version \
                             {version}, which is missing",
                            write.namespace
                        ))
                    })?;
                return Ok(WriteOutcome::AlreadyApplied(record));
            }
        }
        let current = self.record_get(&write.namespace, &write.key)?;
        let latest = current.as_ref().map_or(0, |r| r.version);
        if !write.expect.admits(latest) {
            return Ok(WriteOutcome::Conflict { current });
        }
        let next = latest.checked_add(1).ok_or_else(|| {
            self.dangling(format!("record {:?} has too many versions", write.key))
        })?;
        let replaces = write.replacing
            && latest > 0
            && !self.has_effect_key(&write.namespace, &write.key, latest)?;
        let effect = write.effect_key.clone();
        let record = write.into_record(next);
        let bytes = encode(&record)?;
        let e = self.err("write a record");
        let (ns, key) = (record.namespace.as_str(), record.key.as_str());
        let mut records = self.records()?;
        if replaces {
            records.remove((ns, key, latest)).map_err(&e)?;
        }
        records
            .insert((ns, key, next), bytes.as_slice())
            .map_err(&e)?;
        drop(records);
        self.record_heads()?.insert((ns, key), next).map_err(&e)?;
        if let Some(effect) = &effect {
            self.record_effects()?
                .insert((ns, effect.as_str()), (key, next))
                .map_err(&e)?;
        }
        Ok(WriteOutcome::Written(record))
    }

    /// Whether version `version` of the key was written with an effect key. The effect keys are
    /// kept by namespace and key: the namespace's are looked through (none in a namespace whose
    /// writes carry none, such as the request ledger's).
    fn has_effect_key(&self, namespace: &str, key: &str, version: u64) -> Result<bool, StoreError> {
        let effects = self.record_effects()?;
        let e = self.err("read the effect keys");
        for row in effects.range((namespace, "")..).map_err(&e)? {
            let (k, v) = row.map_err(&e)?;
            if k.value().0 != namespace {
                break;
            }
            if v.value() == (key, version) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    pub(crate) fn record_list(
        &self,
        namespace: &str,
        prefix: &str,
    ) -> Result<Vec<Record>, StoreError> {
        let heads = self.record_heads()?;
        let records = self.records()?;
        let e = self.err("list records");
        let mut out = Vec::new();
        for row in heads.range((namespace, prefix)..).map_err(&e)? {
            let (k, v) = row.map_err(&e)?;
            let (ns, key) = k.value();
            if ns != namespace || !key.starts_with(prefix) {
                break;
            }
            let version = v.value();
            let record = self
                .read_record(&records, ns, key, version)?
                .ok_or_else(|| {
                    self.dangling(format!(
                        "record {ns}/{key:?}: its latest version {version} is missing"
                    ))
                })?;
            out.push(record);
        }
        Ok(out)
    }

    pub(crate) fn record_history(
        &self,
        namespace: &str,
        key: &str,
    ) -> Result<Vec<Record>, StoreError> {
        let records = self.records()?;
        let e = self.err("read a record's history");
        let mut out = Vec::new();
        for row in records
            .range((namespace, key, 0)..=(namespace, key, u64::MAX))
            .map_err(&e)?
        {
            let (k, v) = row.map_err(&e)?;
            let (_, _, version) = k.value();
            out.push(self.decode(
                format_args!("record {namespace}/{key:?} version {version}"),
                v.value(),
            )?);
        }
        Ok(out)
    }
}
