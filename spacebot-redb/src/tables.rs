//! The tables of both files, and the value encoding.
//!
//! Keys are redb's native types (strings, integers and tuples of them), so ranges come out in the
//! order the stores need. Values are JSON (`serde_json`): the domain types already derive serde,
//! JSON stays readable with any redb tool, and fields added later with `#[serde(default)]` read
//! older rows without a migration.

use std::fmt::Display;

use std::cell::{RefCell, RefMut};

use redb::{Table, TableDefinition, WriteTransaction};
use serde::Serialize;
use serde::de::DeserializeOwned;
use spacebot_core::StoreError;

use crate::file::{FileKind, store_err};
use crate::worker::Txn;

// Instance file.
/// Link id -> link.
pub(crate) const LINKS: TableDefinition<&str, &[u8]> = TableDefinition::new("links");
/// (from, to) -> link id.
pub(crate) const LINKS_BY_PAIR: TableDefinition<(&str, &str), &str> =
    TableDefinition::new("links_by_pair");
/// (to, from) -> link id.
pub(crate) const LINKS_BY_TO: TableDefinition<(&str, &str), &str> =
    TableDefinition::new("links_by_to");
/// Conversation id -> conversation.
pub(crate) const CONVERSATIONS: TableDefinition<&str, &[u8]> =
    TableDefinition::new("conversations");
/// (created_at, id): the listing order.
pub(crate) const CONVERSATIONS_BY_CREATED: TableDefinition<(i64, &str), ()> =
    TableDefinition::new("conversations_by_created");
/// pair key -> id of the open conversation holding it.
pub(crate) const CONVERSATIONS_OPEN: TableDefinition<&str, &str> =
    TableDefinition::new("conversations_open");
/// (namespace, key, version) -> record: every version of every record.
pub(crate) const RECORDS: TableDefinition<(&str, &str, u64), &[u8]> =
    TableDefinition::new("records");
/// (namespace, key) -> latest version: listing walks these. Files written before the record
/// tables existed get them on their first write.
pub(crate) const RECORD_HEADS: TableDefinition<(&str, &str), u64> =
    TableDefinition::new("record_heads");
/// (namespace, effect key) -> (key, version) the write with that effect key made.
pub(crate) const RECORD_EFFECTS: TableDefinition<(&str, &str), (&str, u64)> =
    TableDefinition::new("record_effects");

// Agent files.
/// Task number -> task.
pub(crate) const TASKS: TableDefinition<u64, &[u8]> = TableDefinition::new("tasks");
/// (3 - priority rank, number) of every ready task: ascending order is the claim order.
pub(crate) const READY: TableDefinition<(u8, u64), ()> = TableDefinition::new("tasks_ready");
/// (lease expiry, number) of every in-progress task.
pub(crate) const LEASES: TableDefinition<(i64, u64), ()> = TableDefinition::new("tasks_leases");
/// Idempotency key of a create -> the number of the task it created. Files written before this
/// table existed get it on their first write.
pub(crate) const TASK_KEYS: TableDefinition<&str, u64> = TableDefinition::new("task_keys");
/// Outbox sequence -> completion notice.
pub(crate) const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("outbox");
/// Notice key -> outbox sequence.
pub(crate) const OUTBOX_KEYS: TableDefinition<&str, u64> = TableDefinition::new("outbox_keys");
/// Known channels.
pub(crate) const CHANNELS: TableDefinition<&str, ()> = TableDefinition::new("channels");
/// (channel, seq) -> record.
pub(crate) const HISTORY: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("history");
/// Named counters (`history_seq`).
pub(crate) const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");
/// Persist order -> envelope.
pub(crate) const DELIVERIES: TableDefinition<u64, &[u8]> = TableDefinition::new("deliveries");
/// Envelope id -> persist order.
pub(crate) const DELIVERY_IDS: TableDefinition<&str, u64> = TableDefinition::new("delivery_ids");
/// Applied idempotency key -> when.
pub(crate) const APPLIED: TableDefinition<&str, i64> = TableDefinition::new("applied_keys");

/// Creates every table of a new file, so that readers find them.
pub(crate) fn create_all(tx: &WriteTransaction, kind: &FileKind) -> Result<(), redb::Error> {
    match kind {
        FileKind::Instance => {
            tx.open_table(LINKS)?;
            tx.open_table(LINKS_BY_PAIR)?;
            tx.open_table(LINKS_BY_TO)?;
            tx.open_table(CONVERSATIONS)?;
            tx.open_table(CONVERSATIONS_BY_CREATED)?;
            tx.open_table(CONVERSATIONS_OPEN)?;
            tx.open_table(RECORDS)?;
            tx.open_table(RECORD_HEADS)?;
            tx.open_table(RECORD_EFFECTS)?;
        }
        FileKind::Agent(_) => {
            tx.open_table(TASKS)?;
            tx.open_table(READY)?;
            tx.open_table(LEASES)?;
            tx.open_table(TASK_KEYS)?;
            tx.open_table(OUTBOX)?;
            tx.open_table(OUTBOX_KEYS)?;
            tx.open_table(CHANNELS)?;
            tx.open_table(HISTORY)?;
            tx.open_table(COUNTERS)?;
            tx.open_table(DELIVERIES)?;
            tx.open_table(DELIVERY_IDS)?;
            tx.open_table(APPLIED)?;
        }
    }
    Ok(())
}

macro_rules! open_tables {
    ($($name:ident: $def:ident => $k:ty, $v:ty;)*) => {
        /// The tables a batch has opened, kept open until the batch ends: opening a table costs
        /// about as much as a small write, and a batch touches the same few tables many times.
        #[derive(Default)]
        pub(crate) struct Tables<'a> {
            $($name: RefCell<Option<Table<'a, $k, $v>>>,)*
        }

        impl<'a> Txn<'a> {
            $(
                #[doc = concat!("The `", stringify!($def), "` table.")]
                pub(crate) fn $name(&self) -> Result<RefMut<'_, Table<'a, $k, $v>>, StoreError> {
                    self.open(&self.tables.$name, $def)
                }
            )*
        }
    };
}

open_tables! {
    links: LINKS => &'static str, &'static [u8];
    links_by_pair: LINKS_BY_PAIR => (&'static str, &'static str), &'static str;
    links_by_to: LINKS_BY_TO => (&'static str, &'static str), &'static str;
    conversations: CONVERSATIONS => &'static str, &'static [u8];
    conversations_by_created: CONVERSATIONS_BY_CREATED => (i64, &'static str), ();
    conversations_open: CONVERSATIONS_OPEN => &'static str, &'static str;
    records: RECORDS => (&'static str, &'static str, u64), &'static [u8];
    record_heads: RECORD_HEADS => (&'static str, &'static str), u64;
    record_effects: RECORD_EFFECTS => (&'static str, &'static str), (&'static str, u64);
    tasks: TASKS => u64, &'static [u8];
    ready: READY => (u8, u64), ();
    leases: LEASES => (i64, u64), ();
    task_keys: TASK_KEYS => &'static str, u64;
    outbox: OUTBOX => u64, &'static [u8];
    outbox_keys: OUTBOX_KEYS => &'static str, u64;
    channels: CHANNELS => &'static str, ();
    history: HISTORY => (&'static str, u64), &'static [u8];
    counters: COUNTERS => &'static str, u64;
    deliveries: DELIVERIES => u64, &'static [u8];
    delivery_ids: DELIVERY_IDS => &'static str, u64;
    applied: APPLIED => &'static str, i64;
}

impl<'a> Txn<'a> {
    fn open<'s, K: redb::Key + 'static, V: redb::Value + 'static>(
        &'s self,
        cell: &'s RefCell<Option<Table<'a, K, V>>>,
        def: TableDefinition<'static, K, V>,
    ) -> Result<RefMut<'s, Table<'a, K, V>>, StoreError> {
        let busy = || StoreError::Backend {
            backend: "redb",
            message: format!(
                "{}: table {} is already in use by this operation",
                self.path.display(),
                redb::TableHandle::name(&def)
            ),
            source: None,
        };
        let mut slot = cell.try_borrow_mut().map_err(|_| busy())?;
        if slot.is_none() {
            *slot = Some(
                self.tx
                    .open_table(def)
                    .map_err(|e| store_err(self.path, "open a table", e))?,
            );
        }
        RefMut::filter_map(slot, Option::as_mut).map_err(|_| busy())
    }
}

impl Txn<'_> {
    /// Maps a redb error raised while doing `what`.
    pub(crate) fn err<E: Into<redb::Error>>(
        &self,
        what: &'static str,
    ) -> impl Fn(E) -> StoreError + '_ {
        move |e| store_err(self.path, what, e)
    }

    /// Decodes a stored value; a value that does not decode is a corrupt file.
    pub(crate) fn decode<T: DeserializeOwned>(
        &self,
        what: impl Display,
        bytes: &[u8],
    ) -> Result<T, StoreError> {
        serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
            location: format!("{} ({what})", self.path.display()),
            reason: format!("undecodable value: {e}"),
        })
    }
}

/// Encodes a value.
pub(crate) fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|e| StoreError::backend("redb", "cannot encode a value", e))
}
