//! Records: the storage behaviours declare for themselves, provided by every backend.
//!
//! [`Stores`](crate::Stores) holds the stores the host and the built-in behaviours share (links,
//! tasks, channels, ...). A behaviour that needs storage of its own (shared notes, schedules, a
//! third party's state) does not add a store to that bundle: it keeps **records** in a namespace of
//! its own in [`Stores::records`](crate::Stores::records), a [`RecordStore`] that every backend
//! (memory, SQLite, redb, PostgreSQL) provides and the conformance suite checks.
//!
//! A record is a JSON value under `(namespace, key)`, **versioned**: every write adds a new version
//! (1 for the first write, then 2, 3, ...) and keeps the earlier ones as the key's history. A write
//! may be
//! - **compared and set**: [`Expect::Absent`] (only if the key was never written) or
//!   [`Expect::Version`] (only if its latest version is that one); otherwise the outcome is
//!   [`WriteOutcome::Conflict`] carrying the current record, and nothing is written;
//! - **idempotent**: with an [`effect_key`](RecordWrite::effect_key) (a turn's envelope id and tool
//!   call, say), a write whose key was already applied in the namespace writes nothing and answers
//!   [`WriteOutcome::AlreadyApplied`] with the record that key wrote: a turn run again after a crash
//!   does not write twice;
//! - **replacing**: with [`replacing`](RecordWrite::replacing), the new version takes the place
//!   of the version it follows, which the store no longer keeps (unless that version carries an
//!   effect key: it is kept, so its key still applies once). A record kept as a running value (a
//!   counter, a ledger written at every step) then holds one version instead of growing by one a
//!   write; versions still count up, so compare-and-set works alike.
//!
//! A write, its version, its place in the history and its effect key are stored in one transaction;
//! of writers racing with the same expectation exactly one wins, on every backend (on PostgreSQL
//! also across processes).
//!
//! # Typed cells
//!
//! A store owned by one process may also keep values as Rust values: [`RecordStore::typed_cells`]
//! answers its [`TypedCells`], a keyspace of its own beside the records, changed in place under a
//! lock. The memory store's cells are the values; SQLite's (one process owns a data directory)
//! store an image of each cell ([`CellImages`]) that the writer stores when a change must survive
//! a crash. A writer that changes one value at every step keeps it there when the store has cells
//! (the request ledger does), and writes records when it has none (redb and PostgreSQL have none:
//! on PostgreSQL several processes write one database).
//!
//! # Typed records
//!
//! [`Records<T>`] is a view bound to one namespace that (de)serializes the values as `T`:
//!
//! ```
//! # futures::executor::block_on(async {
//! use serde::{Deserialize, Serialize};
//! use spacebot_core::{Expect, Records, Stores, WriteOutcome};
//!
//! #[derive(Debug, PartialEq, Serialize, Deserialize)]
//! struct Note {
//!     text: String,
//! }
//!
//! let stores = Stores::memory();
//! let notes: Records<Note> = Records::new(stores.records.clone(), "notes")?;
//! let first = notes.draft("plan", &Note { text: "ship it".into() }, "alice")?.expect(Expect::Absent);
//! let WriteOutcome::Written(v1) = notes.write(first).await? else { panic!("written") };
//! assert_eq!(v1.version, 1);
//!
//! // Compare and set: a writer that read version 1 replaces it...
//! let edit = notes.draft("plan", &Note { text: "ship it Friday".into() }, "bob")?;
//! let outcome = notes.write(edit.expect(Expect::Version(1)).effect_key("turn-7/call-1")).await?;
//! assert!(matches!(outcome, WriteOutcome::Written(ref r) if r.version == 2));
//! // ...and a second writer that also read version 1 is told what is there now.
//! let late = notes.draft("plan", &Note { text: "ship it Monday".into() }, "carol")?;
//! let outcome = notes.write(late.expect(Expect::Version(1))).await?;
//! assert!(matches!(outcome, WriteOutcome::Conflict { current: Some(ref r) } if r.version == 2));
//!
//! // The same effect again (a turn run again after a crash) writes nothing.
//! let again = notes.draft("plan", &Note { text: "ship it Friday".into() }, "bob")?;
//! let outcome = notes.write(again.expect(Expect::Version(1)).effect_key("turn-7/call-1")).await?;
//! assert!(matches!(outcome, WriteOutcome::AlreadyApplied(ref r) if r.version == 2));
//!
//! let history = notes.history("plan").await?;
//! assert_eq!(history.len(), 2);
//! assert_eq!(history[0].value, Note { text: "ship it".into() });
//! # Ok::<(), spacebot_core::StoreError>(())
//! # }).unwrap();
//! ```
//!
//! # A behaviour's own store trait
//!
//! A behaviour that wants a store trait of its own (so that its code, and its tests, name what it
//! stores rather than keys and JSON) declares the trait and implements it **once**, over
//! [`Records`] (or over `Arc<dyn RecordStore>`). Since every backend provides a [`RecordStore`],
//! every backend then provides the behaviour's store, with no change to any backend crate and no
//! fork of [`Stores`](crate::Stores):
//!
//! ```
//! use std::sync::Arc;
//! use async_trait::async_trait;
//! use serde::{Deserialize, Serialize};
//! use spacebot_core::{Expect, RecordStore, Records, StoreError, Timestamp, WriteOutcome};
//!
//! /// What the "reminders" behaviour stores.
//! #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
//! pub struct Reminder {
//!     pub due: Timestamp,
//!     pub text: String,
//! }
//!
//! /// The behaviour's own store trait.
//! #[async_trait]
//! pub trait ReminderStore: Send + Sync {
//!     /// Adds a reminder under `id`; `false` if one exists already.
//!     async fn add(&self, id: &str, reminder: &Reminder, by: &str) -> Result<bool, StoreError>;
//!     /// The reminders due at `now`.
//!     async fn due(&self, now: Timestamp) -> Result<Vec<Reminder>, StoreError>;
//! }
//!
//! /// Implemented once, over records: every backend provides it.
//! #[async_trait]
//! impl ReminderStore for Records<Reminder> {
//!     async fn add(&self, id: &str, reminder: &Reminder, by: &str) -> Result<bool, StoreError> {
//!         let write = self.draft(id, reminder, by)?.expect(Expect::Absent).at(reminder.due);
//!         Ok(matches!(self.write(write).await?, WriteOutcome::Written(_)))
//!     }
//!     async fn due(&self, now: Timestamp) -> Result<Vec<Reminder>, StoreError> {
//!         let all = self.list("").await?;
//!         Ok(all.into_iter().map(|r| r.value).filter(|r| r.due <= now).collect())
//!     }
//! }
//!
//! /// The behaviour opens its store from whatever backend the organization runs on.
//! pub fn reminders(records: Arc<dyn RecordStore>) -> Result<impl ReminderStore, StoreError> {
//!     Records::<Reminder>::new(records, "reminders")
//! }
//!
//! # futures::executor::block_on(async {
//! let store = reminders(spacebot_core::Stores::memory().records)?;
//! let r = Reminder { due: Timestamp(5), text: "standup".into() };
//! assert!(store.add("standup", &r, "operator").await?);
//! assert!(!store.add("standup", &r, "operator").await?);
//! assert_eq!(store.due(Timestamp(10)).await?, vec![r]);
//! assert!(store.due(Timestamp(1)).await?.is_empty());
//! # Ok::<(), StoreError>(())
//! # }).unwrap();
//! ```
//!
//! # Limits
//!
//! Namespaces are 1 to [`MAX_NAMESPACE_LEN`] bytes of ASCII letters, digits, `_`, `-`, `.` and
//! `:`. Keys, authors and effect keys are 1 to [`MAX_KEY_LEN`] bytes (authors
//! [`MAX_AUTHOR_LEN`]) of any text without control characters. A value is at most
//! [`MAX_VALUE_LEN`] bytes as JSON text. Anything else is refused with [`StoreError::Invalid`]
//! naming the field, and nothing is written.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{InvalidInput, StoreError};
use crate::time::Timestamp;

mod cells;
mod typed;

pub use cells::{CellImage, CellImages, TypedCells};
pub use typed::Records;

/// The longest namespace, in bytes.
pub const MAX_NAMESPACE_LEN: usize = 64;
/// The longest key (and effect key, and list prefix), in bytes.
pub const MAX_KEY_LEN: usize = 512;
/// The longest author, in bytes.
pub const MAX_AUTHOR_LEN: usize = 256;
/// The largest value, in bytes of its JSON text.
pub const MAX_VALUE_LEN: usize = 1 << 20;

/// One version of a record: the value written under `(namespace, key)` by one write.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record<V = serde_json::Value> {
    /// Whose records these are: the behaviour's name, such as `notes`.
    pub namespace: String,
    /// The record's key in its namespace.
    pub key: String,
    /// 1 for the first write of the key, one more for each later write.
    pub version: u64,
    /// The value.
    pub value: V,
    /// Who wrote this version (an agent id, `operator`, ...).
    pub author: String,
    /// When, as the writer said ([`RecordWrite::at`]).
    pub written_at: Timestamp,
}

impl<V> Record<V> {
    /// This record with its value replaced by `f(value)`.
    pub fn map<W>(self, f: impl FnOnce(V) -> W) -> Record<W> {
        Record {
            namespace: self.namespace,
            key: self.key,
            version: self.version,
            value: f(self.value),
            author: self.author,
            written_at: self.written_at,
        }
    }

    /// `namespace/key version n`, as errors name a record.
    pub fn describe(&self) -> String {
        describe(&self.namespace, &self.key, Some(self.version))
    }
}

impl Record {
    /// This record with its value decoded as `T`.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] naming the record and `T` when the value does not decode.
    pub fn decode<T: DeserializeOwned>(self) -> Result<Record<T>, StoreError> {
        let what = self.describe();
        let value = T::deserialize(self.value).map_err(|e| StoreError::Corrupt {
            location: format!("record {what}"),
            reason: format!(
                "its value does not decode as {}: {e}",
                std::any::type_name::<T>()
            ),
        })?;
        Ok(Record {
            namespace: self.namespace,
            key: self.key,
            version: self.version,
            value,
            author: self.author,
            written_at: self.written_at,
        })
    }
}

fn describe(namespace: &str, key: &str, version: Option<u64>) -> String {
    match version {
        Some(v) => format!("{namespace}/{key:?} version {v}"),
        None => format!("{namespace}/{key:?}"),
    }
}

/// The compare of a compare-and-set: what the key must hold for a write to happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Expect {
    /// Write whatever the key holds.
    #[default]
    Any,
    /// Write only if the key was never written.
    Absent,
    /// Write only if the key's latest version is this one. A key never written is at version 0,
    /// so `Version(0)` is the same as [`Expect::Absent`].
    Version(u64),
}

impl Expect {
    /// Whether a key whose latest version is `current` (0 for a key never written) meets this
    /// expectation.
    pub fn admits(self, current: u64) -> bool {
        match self {
            Self::Any => true,
            Self::Absent => current == 0,
            Self::Version(v) => current == v,
        }
    }
}

impl fmt::Display for Expect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Any => f.write_str("any version"),
            Self::Absent => f.write_str("no record"),
            Self::Version(v) => write!(f, "version {v}"),
        }
    }
}

/// One write of a record: built with [`RecordWrite::new`], then [`expect`](RecordWrite::expect),
/// [`effect_key`](RecordWrite::effect_key) and [`at`](RecordWrite::at) as needed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordWrite {
    /// The namespace (the behaviour's name).
    pub namespace: String,
    /// The key.
    pub key: String,
    /// The value to write.
    pub value: serde_json::Value,
    /// Who writes.
    pub author: String,
    /// What the key must hold for the write to happen ([`Expect::Any`] by default).
    pub expect: Expect,
    /// Idempotency: a write whose effect key was already applied in this namespace is not written
    /// again; the outcome is [`WriteOutcome::AlreadyApplied`] with the record that key wrote.
    pub effect_key: Option<String>,
    /// The time the written record carries ([`Record::written_at`]). [`RecordWrite::new`] sets the
    /// wall clock; code that runs on a [`Clock`](crate::Clock) sets `clock.now()` with
    /// [`RecordWrite::at`]. Stores never read a clock of their own.
    pub written_at: Timestamp,
    /// Whether the new version replaces the one it follows ([`RecordWrite::replacing`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replacing: bool,
}

impl RecordWrite {
    /// A write of `value` under `(namespace, key)` by `author`, whatever the key holds, without an
    /// effect key, at the wall clock's time.
    pub fn new(
        namespace: impl Into<String>,
        key: impl Into<String>,
        value: serde_json::Value,
        author: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            key: key.into(),
            value,
            author: author.into(),
            expect: Expect::Any,
            effect_key: None,
            written_at: Timestamp::now_utc(),
            replacing: false,
        }
    }

    /// The new version takes the place of the key's latest version, which the store then no
    /// longer keeps ([`RecordStore::history`] and [`RecordStore::version`] no longer find it),
    /// unless that version was written with an effect key (it is kept, so its key still applies
    /// once). Versions still count up: compare-and-set works as without it, and a key always
    /// written so keeps one version. For a record kept as a running value (a counter, the
    /// request ledger) whose earlier values nobody reads.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use serde_json::json;
    /// use spacebot_core::{Expect, RecordStore, RecordWrite, Stores};
    ///
    /// let records = Stores::memory().records;
    /// for n in 1..=3u64 {
    ///     let count = RecordWrite::new("counters", "visits", json!(n), "app")
    ///         .expect(Expect::Version(n - 1))
    ///         .replacing();
    ///     records.write(count).await?;
    /// }
    /// let history = records.history("counters", "visits").await?;
    /// assert_eq!(history.len(), 1);
    /// assert_eq!((history[0].version, history[0].value.clone()), (3, json!(3)));
    /// # Ok::<(), spacebot_core::StoreError>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub fn replacing(mut self) -> Self {
        self.replacing = true;
        self
    }

    /// Writes only if the key holds what `expect` says.
    #[must_use]
    pub fn expect(mut self, expect: Expect) -> Self {
        self.expect = expect;
        self
    }

    /// Writes at most once per `key` in the namespace (see [`RecordWrite::effect_key`](Self#structfield.effect_key)).
    #[must_use]
    pub fn effect_key(mut self, key: impl Into<String>) -> Self {
        self.effect_key = Some(key.into());
        self
    }

    /// The time the record carries.
    #[must_use]
    pub fn at(mut self, now: Timestamp) -> Self {
        self.written_at = now;
        self
    }

    /// Checks every field against the [limits](self#limits) and returns the value's JSON text
    /// (what the durable backends store).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] naming the field.
    pub fn validate(&self) -> Result<String, StoreError> {
        self.check_fields()?;
        let json = serde_json::to_string(&self.value).map_err(|e| unencodable(&e))?;
        self.check_len(json.len())?;
        Ok(json)
    }

    /// [`validate`](Self::validate) without keeping the JSON text: for a store that keeps the
    /// value as it is (the value's length is counted, not collected).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] naming the field.
    pub fn check(&self) -> Result<(), StoreError> {
        self.check_fields()?;
        // Most values are far below the limit: a bound on their length, walked without writing
        // them, settles it; only a value whose bound passes the limit is written out and counted.
        if !arbitrary_precision() && json_len_bound(&self.value, MAX_VALUE_LEN).is_some() {
            return Ok(());
        }
        let mut counter = LenCounter(0);
        serde_json::to_writer(&mut counter, &self.value).map_err(|e| unencodable(&e))?;
        self.check_len(counter.0)
    }

    fn check_fields(&self) -> Result<(), StoreError> {
        check_namespace(&self.namespace)?;
        check_key(&self.key)?;
        check_text("record author", &self.author, MAX_AUTHOR_LEN)?;
        if let Some(effect) = &self.effect_key {
            check_text("record effect key", effect, MAX_KEY_LEN)?;
        }
        Ok(())
    }

    fn check_len(&self, len: usize) -> Result<(), StoreError> {
        if len > MAX_VALUE_LEN {
            return Err(StoreError::Invalid(InvalidInput::new(
                "record value",
                format!(
                    "{len} bytes as JSON, more than the limit of {MAX_VALUE_LEN} (record {})",
                    describe(&self.namespace, &self.key, None)
                ),
            )));
        }
        Ok(())
    }

    /// The record this write makes as version `version`.
    pub fn into_record(self, version: u64) -> Record {
        Record {
            namespace: self.namespace,
            key: self.key,
            version,
            value: self.value,
            author: self.author,
            written_at: self.written_at,
        }
    }
}

/// The error of a value serde cannot write as JSON.
fn unencodable(e: &serde_json::Error) -> StoreError {
    StoreError::Invalid(InvalidInput::new(
        "record value",
        format!("cannot be written as JSON: {e}"),
    ))
}

/// Whether serde_json keeps numbers as their text (its `arbitrary_precision` feature, which any
/// crate of the build may turn on): a number's length is then not bounded, and
/// [`json_len_bound`] does not apply. Found once, by whether a number past `f64`'s range parses.
fn arbitrary_precision() -> bool {
    static ARBITRARY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ARBITRARY.get_or_init(|| serde_json::from_str::<serde_json::Number>("1e400").is_ok())
}

/// An upper bound of `value`'s length as JSON text, or `None` once it passes `limit` (the walk
/// stops there). A string counts six bytes a byte (the longest escape, `\u001f`) and its quotes,
/// a number 25 (the longest a `u64`, `i64` or `f64` is written), every separator its byte.
fn json_len_bound(value: &serde_json::Value, limit: usize) -> Option<usize> {
    use serde_json::Value;
    fn text(s: &str) -> usize {
        s.len().saturating_mul(6).saturating_add(2)
    }
    let len = match value {
        Value::Null | Value::Bool(_) => 5,
        Value::Number(_) => 25,
        Value::String(s) => text(s),
        Value::Array(items) => {
            let mut len = 2 + items.len();
            for item in items {
                len = len.checked_add(json_len_bound(item, limit)?)?;
                if len > limit {
                    return None;
                }
            }
            len
        }
        Value::Object(map) => {
            let mut len = 2 + 2 * map.len();
            for (key, item) in map {
                len = len
                    .checked_add(text(key))?
                    .checked_add(json_len_bound(item, limit)?)?;
                if len > limit {
                    return None;
                }
            }
            len
        }
    };
    (len <= limit).then_some(len)
}

/// Counts the bytes written to it.
struct LenCounter(usize);

impl std::io::Write for LenCounter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a [`RecordStore::write`] did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteOutcome<V = serde_json::Value> {
    /// The write happened: the new latest version.
    Written(Record<V>),
    /// The write's effect key was applied before: nothing was written; the record that key wrote.
    AlreadyApplied(Record<V>),
    /// The expectation failed: nothing was written.
    Conflict {
        /// The key's latest record (`None`: never written).
        current: Option<Record<V>>,
    },
}

/// What [`RecordStore::write_receipt`] did: a [`WriteOutcome`] whose write, when it happened, is
/// told by its version alone.
#[derive(Debug, Clone, PartialEq)]
pub enum WriteReceipt {
    /// The write happened: the version it made (the key's new latest).
    Written(u64),
    /// As [`WriteOutcome::AlreadyApplied`].
    AlreadyApplied(Record),
    /// As [`WriteOutcome::Conflict`].
    Conflict {
        /// The key's latest record (`None`: never written).
        current: Option<Record>,
    },
}

impl From<WriteOutcome> for WriteReceipt {
    fn from(outcome: WriteOutcome) -> Self {
        match outcome {
            WriteOutcome::Written(record) => Self::Written(record.version),
            WriteOutcome::AlreadyApplied(record) => Self::AlreadyApplied(record),
            WriteOutcome::Conflict { current } => Self::Conflict { current },
        }
    }
}

impl<V> WriteOutcome<V> {
    /// The record written now or by the effect key before (`None` for a conflict).
    pub fn record(&self) -> Option<&Record<V>> {
        match self {
            Self::Written(r) | Self::AlreadyApplied(r) => Some(r),
            Self::Conflict { .. } => None,
        }
    }

    /// Whether this write happened now.
    pub fn is_written(&self) -> bool {
        matches!(self, Self::Written(_))
    }

    /// This outcome with its records' values replaced by `f(value)`.
    pub fn map<W>(self, f: impl Fn(V) -> W) -> WriteOutcome<W> {
        match self {
            Self::Written(r) => WriteOutcome::Written(r.map(f)),
            Self::AlreadyApplied(r) => WriteOutcome::AlreadyApplied(r.map(f)),
            Self::Conflict { current } => WriteOutcome::Conflict {
                current: current.map(|r| r.map(f)),
            },
        }
    }
}

impl WriteOutcome {
    /// This outcome with its records decoded as `T` (see [`Record::decode`]).
    ///
    /// # Errors
    /// As [`Record::decode`].
    pub fn decode<T: DeserializeOwned>(self) -> Result<WriteOutcome<T>, StoreError> {
        Ok(match self {
            Self::Written(r) => WriteOutcome::Written(r.decode()?),
            Self::AlreadyApplied(r) => WriteOutcome::AlreadyApplied(r.decode()?),
            Self::Conflict { current } => WriteOutcome::Conflict {
                current: current.map(Record::decode).transpose()?,
            },
        })
    }
}

/// Keyed, versioned records in namespaces (instance-wide; not per agent): the storage of
/// behaviours. See the [module docs](self).
///
/// # Contract
/// - `write` validates the write ([`RecordWrite::validate`]); an invalid one is refused with
///   [`StoreError::Invalid`] and writes nothing. `get`, `version`, `history` refuse an invalid
///   namespace or key, and `list` an invalid namespace or a prefix longer than [`MAX_KEY_LEN`]
///   or with control characters, the same way.
/// - `write` first looks for the effect key (if any) in the namespace: if a write with it was
///   applied, it returns [`WriteOutcome::AlreadyApplied`] with the record that write made (even if
///   the key has newer versions since, or the effect key wrote another key), and writes nothing.
///   Otherwise, if the key's latest version (0 when never written) does not meet
///   [`RecordWrite::expect`], it returns [`WriteOutcome::Conflict`] with the latest record and
///   writes nothing (the effect key is not recorded). Otherwise it writes version latest + 1 with
///   the write's value, author and `written_at`, records the effect key, and returns
///   [`WriteOutcome::Written`]; the record, its version, its history and its effect key are one
///   transaction.
/// - Concurrent writes are serializable: of writers with the same expectation on one key exactly
///   one is `Written`; of writers with one effect key exactly one is `Written`, the others
///   `AlreadyApplied` with its record; writers with [`Expect::Any`] are all written, with distinct
///   versions. This holds between processes sharing the store too (PostgreSQL).
/// - `get` returns the latest version; `version` the given one (`None` for one never written);
///   `history` every version, oldest first; `list(namespace, prefix)` the latest version of every
///   key of the namespace that starts with `prefix` (as text, `""` for all), ordered by key (byte
///   order of the UTF-8 text, as [`str`]'s `Ord`).
/// - Namespaces are separate: nothing written in one is seen, listed, or its effect keys applied,
///   in another.
/// - Values, keys and authors come back exactly as written (any JSON, any Unicode); a durable
///   backend keeps everything acknowledged across a reopen.
///
/// The conformance suite (module `conformance`, feature `conformance`: `record_store_*`) checks
/// every clause.
#[async_trait]
pub trait RecordStore: Send + Sync + fmt::Debug {
    /// The latest version of the key.
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, StoreError>;
    /// One version of the key.
    async fn version(
        &self,
        namespace: &str,
        key: &str,
        version: u64,
    ) -> Result<Option<Record>, StoreError>;
    /// Writes a new version, compared and set, at most once per effect key (see the contract).
    async fn write(&self, write: RecordWrite) -> Result<WriteOutcome, StoreError>;
    /// [`write`](Self::write), answering a write that happened by its version alone: for a
    /// writer that keeps what it wrote, such as a counter written at every step. The default
    /// calls `write`; a store that would copy the record to answer it (the memory store) does
    /// not.
    async fn write_receipt(&self, write: RecordWrite) -> Result<WriteReceipt, StoreError> {
        Ok(self.write(write).await?.into())
    }
    /// The latest version of every key of the namespace starting with `prefix`, in key order.
    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<Record>, StoreError>;
    /// Every version of one key, oldest first.
    async fn history(&self, namespace: &str, key: &str) -> Result<Vec<Record>, StoreError>;

    /// Closes what backs this store, waiting for the operations in progress, and releases what it
    /// holds (a data directory's lock, a connection pool); later calls fail with
    /// [`StoreError::Backend`]. Closing one store of a backend closes the backend's every store;
    /// closing again does nothing. The default does nothing (stores that hold nothing to release).
    async fn release(&self) {}

    /// Cells that keep values typed beside the records, for a store owned by one process (the
    /// memory store; SQLite, whose cells store their images durably: see [`TypedCells`]): a writer
    /// that changes one value at every step may keep it there instead of as a record. `None`
    /// (the default, and stores several processes may write): records only. A store that wraps
    /// another forwards its cells (as `Arc<T>` does), so that both see the same values.
    fn typed_cells(&self) -> Option<&TypedCells> {
        None
    }
}

/// A `dyn` record store.
pub type DynRecordStore = dyn RecordStore;

#[async_trait]
impl<T: RecordStore + ?Sized> RecordStore for Arc<T> {
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, StoreError> {
        (**self).get(namespace, key).await
    }
    async fn version(
        &self,
        namespace: &str,
        key: &str,
        version: u64,
    ) -> Result<Option<Record>, StoreError> {
        (**self).version(namespace, key, version).await
    }
    async fn write(&self, write: RecordWrite) -> Result<WriteOutcome, StoreError> {
        (**self).write(write).await
    }
    async fn write_receipt(&self, write: RecordWrite) -> Result<WriteReceipt, StoreError> {
        (**self).write_receipt(write).await
    }
    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<Record>, StoreError> {
        (**self).list(namespace, prefix).await
    }
    async fn history(&self, namespace: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        (**self).history(namespace, key).await
    }
    async fn release(&self) {
        (**self).release().await
    }
    fn typed_cells(&self) -> Option<&TypedCells> {
        (**self).typed_cells()
    }
}

fn invalid(what: &str, reason: impl Into<String>) -> StoreError {
    StoreError::Invalid(InvalidInput::new(what, reason))
}

fn check_text(what: &str, text: &str, max: usize) -> Result<(), StoreError> {
    if text.is_empty() {
        return Err(invalid(what, "is empty"));
    }
    check_prefix(what, text, max)
}

fn check_prefix(what: &str, text: &str, max: usize) -> Result<(), StoreError> {
    if text.len() > max {
        return Err(invalid(
            what,
            format!("{} bytes, more than the limit of {max}", text.len()),
        ));
    }
    // ASCII text (ids, names: most of it) is checked by its bytes; other text by its characters.
    let control = if text.is_ascii() {
        text.bytes().find(|b| b.is_ascii_control()).map(char::from)
    } else {
        text.chars().find(|c| c.is_control())
    };
    if let Some(c) = control {
        return Err(invalid(
            what,
            format!("{text:?} holds the control character {c:?}"),
        ));
    }
    Ok(())
}

/// Checks a namespace against the [limits](self#limits).
///
/// # Errors
/// [`StoreError::Invalid`] saying what is wrong.
pub fn check_namespace(namespace: &str) -> Result<(), StoreError> {
    check_text("record namespace", namespace, MAX_NAMESPACE_LEN)?;
    if let Some(c) = namespace
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':')))
    {
        return Err(invalid(
            "record namespace",
            format!("{namespace:?} holds {c:?}; use ASCII letters, digits, '_', '-', '.' and ':'"),
        ));
    }
    Ok(())
}

/// Checks a key against the [limits](self#limits).
///
/// # Errors
/// [`StoreError::Invalid`] saying what is wrong.
pub fn check_key(key: &str) -> Result<(), StoreError> {
    check_text("record key", key, MAX_KEY_LEN)
}

/// Checks a [`RecordStore::list`] prefix (may be empty).
///
/// # Errors
/// [`StoreError::Invalid`] saying what is wrong.
pub fn check_list_prefix(prefix: &str) -> Result<(), StoreError> {
    check_prefix("record key prefix", prefix, MAX_KEY_LEN)
}

/// Checks the namespace and the key of a read.
///
/// # Errors
/// [`StoreError::Invalid`] saying what is wrong.
pub fn check_address(namespace: &str, key: &str) -> Result<(), StoreError> {
    check_namespace(namespace)?;
    check_key(key)
}

/// Record stores for the crate's tests.
#[cfg(test)]
pub(crate) mod testkit {
    use std::sync::Arc;

    use async_trait::async_trait;
    use futures::future::BoxFuture;

    use super::{Record, RecordStore, RecordWrite, WriteOutcome};
    use crate::error::StoreError;

    /// What [`AfterGet`] runs after a read: given the namespace and key read.
    pub(crate) type Hook = Box<dyn Fn(&str, &str) -> BoxFuture<'static, ()> + Send + Sync>;

    /// Images of typed cells in memory, as a durable store keeps them (SQLite's contract: a cell
    /// never stored reads the latest record at its address, revision 0). Kept across "restarts":
    /// cells made again over the same images start empty and load from them.
    #[derive(Debug, Default)]
    pub(crate) struct MemoryImages {
        pub(crate) images:
            std::sync::Mutex<std::collections::HashMap<(String, String), (u64, String)>>,
        /// The records read when a cell has no image.
        pub(crate) records: std::sync::Mutex<Option<Arc<dyn RecordStore>>>,
        /// How many loads were asked for.
        pub(crate) loads: std::sync::atomic::AtomicUsize,
        /// How many stores were asked for.
        pub(crate) stores: std::sync::atomic::AtomicUsize,
        /// While set, every store fails (nothing stored).
        pub(crate) failing: std::sync::atomic::AtomicBool,
    }

    #[async_trait]
    impl super::CellImages for MemoryImages {
        async fn load(
            &self,
            namespace: &str,
            key: &str,
        ) -> Result<Option<(u64, String)>, StoreError> {
            use std::sync::atomic::Ordering;
            self.loads.fetch_add(1, Ordering::SeqCst);
            let stored = self
                .images
                .lock()
                .unwrap()
                .get(&(namespace.to_owned(), key.to_owned()))
                .cloned();
            if stored.is_some() {
                return Ok(stored);
            }
            let records = self.records.lock().unwrap().clone();
            match records {
                Some(records) => Ok(records
                    .get(namespace, key)
                    .await?
                    .map(|r| (0, r.value.to_string()))),
                None => Ok(None),
            }
        }

        async fn store(&self, images: Vec<super::CellImage>) -> Result<(), StoreError> {
            use std::sync::atomic::Ordering;
            self.stores.fetch_add(1, Ordering::SeqCst);
            if self.failing.load(Ordering::SeqCst) {
                return Err(StoreError::Backend {
                    backend: "test",
                    message: "the disk is gone".into(),
                    source: None,
                });
            }
            let mut stored = self.images.lock().unwrap();
            for image in images {
                let slot = stored
                    .entry((image.namespace, image.key))
                    .or_insert((0, String::new()));
                if image.revision > slot.0 || slot.1.is_empty() {
                    *slot = (image.revision, image.value);
                }
            }
            Ok(())
        }
    }

    /// `inner`'s records with typed cells of its own whose images are kept in `images`: a store
    /// owned by one process, as SQLite is. Made again over the same images, a restart.
    pub(crate) fn stored_cells(
        inner: Arc<dyn RecordStore>,
        images: Arc<MemoryImages>,
    ) -> Arc<dyn RecordStore> {
        *images.records.lock().unwrap() = Some(inner.clone());
        Arc::new(AfterGet {
            inner,
            after: Box::new(|_, _| Box::pin(async {})),
            cells: Some(super::TypedCells::stored_in(images)),
        })
    }

    /// `inner` as records only: without its typed cells (a writer that would keep values
    /// there writes records, as on a durable store).
    pub(crate) fn records_only(inner: Arc<dyn RecordStore>) -> Arc<dyn RecordStore> {
        Arc::new(AfterGet {
            inner,
            after: Box::new(|_, _| Box::pin(async {})),
            cells: None,
        })
    }

    /// A record store over `inner` that runs `after` once each `get` has read its record and
    /// before it answers: what another writer acting between a read and its use looks like. Its
    /// typed cells are `cells` (none: records only), never `inner`'s.
    pub(crate) struct AfterGet {
        pub(crate) inner: Arc<dyn RecordStore>,
        pub(crate) after: Hook,
        pub(crate) cells: Option<super::TypedCells>,
    }

    impl std::fmt::Debug for AfterGet {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("AfterGet").finish_non_exhaustive()
        }
    }

    #[async_trait]
    impl RecordStore for AfterGet {
        async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, StoreError> {
            let read = self.inner.get(namespace, key).await;
            (self.after)(namespace, key).await;
            read
        }
        async fn version(
            &self,
            namespace: &str,
            key: &str,
            version: u64,
        ) -> Result<Option<Record>, StoreError> {
            self.inner.version(namespace, key, version).await
        }
        async fn write(&self, write: RecordWrite) -> Result<WriteOutcome, StoreError> {
            self.inner.write(write).await
        }
        async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<Record>, StoreError> {
            self.inner.list(namespace, prefix).await
        }
        async fn history(&self, namespace: &str, key: &str) -> Result<Vec<Record>, StoreError> {
            self.inner.history(namespace, key).await
        }
        fn typed_cells(&self) -> Option<&super::TypedCells> {
            self.cells.as_ref()
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Map, Value};

    use super::{arbitrary_precision, json_len_bound};

    /// Any JSON value: text with escapes and characters outside ASCII, numbers of every kind.
    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            ".{0,12}".prop_map(Value::String),
            "[\\x00-\\x1f\"\\\\]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((".{0,6}", inner), 0..6)
                    .prop_map(|fields| Value::Object(fields.into_iter().collect::<Map<_, _>>())),
            ]
        })
    }

    /// This build keeps numbers as numbers (the bound applies).
    #[test]
    fn numbers_are_not_kept_as_text() {
        assert!(!arbitrary_precision());
    }

    proptest! {
        /// The bound is never below the value's length as JSON text, and it gives up (`None`)
        /// exactly when it would pass the limit.
        #[test]
        fn the_bound_of_a_value_is_never_below_its_json_length(v in value(), limit in 0usize..400) {
            let len = serde_json::to_string(&v).unwrap().len();
            match json_len_bound(&v, usize::MAX) {
                Some(bound) => {
                    prop_assert!(bound >= len, "bound {bound} under {len} for {v}");
                    prop_assert_eq!(json_len_bound(&v, limit), (bound <= limit).then_some(bound));
                }
                None => prop_assert!(false, "no bound without a limit for {}", v),
            }
        }
    }
}
