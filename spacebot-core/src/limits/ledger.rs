//! The durable spend of each request, over the record store.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{CallEstimate, Fit, LimitReached, Limits, Scope, Spend};
use crate::error::StoreError;
use crate::ids::EnvelopeId;
use crate::records::{CellImage, Expect, RecordStore, RecordWrite, TypedCells, WriteReceipt};
use crate::time::Timestamp;

/// The record namespace of requests' spend (on a store with [typed cells](TypedCells), the memory
/// store, the namespace of the cells that keep it instead of records: read a request's spend
/// with [`RequestLedger::get`], which reads either).
pub const NAMESPACE: &str = "limits.request";

/// How many times a compare-and-set write is tried against concurrent writers before it gives up.
const CAS_ATTEMPTS: usize = 64;

/// How many requests' entries a ledger remembers (those it wrote last); past it, it forgets them
/// all and reads again.
const KNOWN_ENTRIES: usize = 1024;

/// How many entries stored cells keep in memory; past it, those whose image is stored and that
/// hold no open reservation are dropped (and loaded again from their image when needed).
const CELLS_KEPT: usize = 4096;

/// Why a reservation was not made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The request reached a limit: not even the smallest call fits against what it spent.
    Reached(LimitReached),
    /// The call would fit but for the request's other open reservations: try again once they
    /// settle.
    Busy(super::Over),
}

/// One request's spend, as stored (the value of its record, keyed by the request's id).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct LedgerEntry {
    /// The limits binding the request.
    #[serde(skip_serializing_if = "Limits::is_none")]
    pub limits: Limits,
    /// When the request's first turn began (wall time is counted from it).
    pub started_at: Timestamp,
    /// What its settled model and tool calls spent.
    #[serde(
        serialize_with = "compact::serialize",
        skip_serializing_if = "compact::is_zero"
    )]
    pub settled: Spend,
    /// Open reservations, by call key: counted until settled (a kill leaves them counted).
    #[serde(
        serialize_with = "compact::map",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub reserved: BTreeMap<String, Spend>,
    /// The limit that refused a call, once one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reached: Option<LimitReached>,
    /// Whether the user was told the request reached its limit.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub told: bool,
    /// Who told ([`RequestLedger::tell_once`]'s teller): the same failure run again after a
    /// crash tells again, any other does not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub told_by: Option<String>,
}

/// A [`Spend`] as the ledger stores it: its measures at zero left out (a record is written twice
/// a model call; reads take either form, a missing measure being zero).
mod compact {
    use std::collections::BTreeMap;

    use serde::{Serialize, Serializer};

    use crate::limits::{Money, Spend};

    fn zero(n: &u64) -> bool {
        *n == 0
    }

    fn no_money(m: &Money) -> bool {
        m.0 == 0
    }

    /// Whether `spend` is nothing at all (the field is then left out).
    pub(super) fn is_zero(spend: &Spend) -> bool {
        *spend == Spend::default()
    }

    #[derive(Serialize)]
    struct Out<'a> {
        #[serde(skip_serializing_if = "zero")]
        input_tokens: &'a u64,
        #[serde(skip_serializing_if = "zero")]
        output_tokens: &'a u64,
        #[serde(skip_serializing_if = "zero")]
        total_tokens: &'a u64,
        #[serde(skip_serializing_if = "zero")]
        model_calls: &'a u64,
        #[serde(skip_serializing_if = "zero")]
        tool_calls: &'a u64,
        #[serde(skip_serializing_if = "no_money")]
        cost: &'a Money,
    }

    impl<'a> From<&'a Spend> for Out<'a> {
        fn from(s: &'a Spend) -> Self {
            Out {
                input_tokens: &s.input_tokens,
                output_tokens: &s.output_tokens,
                total_tokens: &s.total_tokens,
                model_calls: &s.model_calls,
                tool_calls: &s.tool_calls,
                cost: &s.cost,
            }
        }
    }

    pub(super) fn serialize<S: Serializer>(spend: &Spend, s: S) -> Result<S::Ok, S::Error> {
        Out::from(spend).serialize(s)
    }

    /// [`map`] of a borrowed map.
    pub(super) fn map_ref<S: Serializer>(
        map: &&BTreeMap<String, Spend>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        self::map(map, s)
    }

    /// Whether a borrowed map of spends is empty (the field is then left out).
    pub(super) fn no_entries(map: &&BTreeMap<String, Spend>) -> bool {
        map.is_empty()
    }

    /// A map of spends, each compact.
    pub(super) fn map<S: Serializer>(
        map: &BTreeMap<String, Spend>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_map(map.iter().map(|(k, v)| (k, Out::from(v))))
    }
}

impl LedgerEntry {
    /// Records that `over` refused a call; what the refused turn fails with.
    fn refuse(&mut self, over: super::Over) -> LimitReached {
        let reached = LimitReached {
            over,
            spent: self.settled,
            scope: Scope::Request,
        };
        self.reached = Some(reached.clone());
        reached
    }

    /// Replaces the reservation of call `key` with what it spent; nothing when it holds none
    /// (settled already, or released).
    fn settle(&mut self, key: &str, spent: Spend) {
        if self.reserved.remove(key).is_some() {
            self.settled = self.settled.plus(&spent);
            if self.reserved.is_empty() {
                // An emptied map keeps its node (hundreds of bytes): an entry kept in memory
                // for every request settled would hold one each.
                self.reserved = BTreeMap::new();
            }
        }
    }

    /// Settled spend plus open reservations.
    pub fn committed(&self) -> Spend {
        self.reserved
            .values()
            .fold(self.settled, |sum, r| sum.plus(r))
    }
}

/// A [`LedgerEntry`] as a store's typed cell keeps it: what every request has inline, what few
/// have (limits of its own, a limit reached, the user told) boxed apart. A memory store keeps
/// every request's entry for as long as it lives: about a third of the entry's size.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Kept {
    started_at: Timestamp,
    settled: Spend,
    reserved: BTreeMap<String, Spend>,
    rare: Option<Box<Rare>>,
    /// On cells whose images are stored: the revision of this value (one more at every change)
    /// and that of the image stored last (equal: nothing to store). Zero on the memory store.
    revision: u64,
    stored: u64,
}

impl Kept {
    /// Replaces the reservation of call `key` with what it spent (see [`LedgerEntry::settle`]);
    /// whether it held one.
    fn settle(&mut self, key: &str, spent: Spend) -> bool {
        if self.reserved.remove(key).is_none() {
            return false;
        }
        self.settled = self.settled.plus(&spent);
        if self.reserved.is_empty() {
            self.reserved = BTreeMap::new();
        }
        true
    }

    /// The image of the entry of `request`, as its record's value would be.
    fn image(&self, request: &str) -> Result<CellImage, StoreError> {
        let encoding = |e: serde_json::Error| {
            StoreError::backend("limits", format!("encoding a request's spend: {e}"), e)
        };
        let value = match self.rare.as_deref() {
            // Most requests: written directly (the image is stored at every change).
            None => self.encode_common().map_err(encoding)?,
            Some(rare) => {
                let out = KeptOut {
                    limits: Some(&rare.limits).filter(|l| !l.is_none()),
                    started_at: self.started_at,
                    settled: self.settled,
                    reserved: &self.reserved,
                    reached: rare.reached.as_ref(),
                    told: rare.told,
                    told_by: rare.told_by.as_deref(),
                };
                serde_json::to_string(&out).map_err(encoding)?
            }
        };
        Ok(CellImage {
            namespace: NAMESPACE.to_owned(),
            key: request.to_owned(),
            revision: self.revision,
            value,
        })
    }

    /// The JSON of an entry with none of the [`Rare`] fields set, as serde writes its
    /// [`LedgerEntry`] (tested against it), without serde's machinery.
    fn encode_common(&self) -> Result<String, serde_json::Error> {
        let mut out = String::with_capacity(160);
        out.push_str("{\"started_at\":");
        out.push_str(itoa::Buffer::new().format(self.started_at.0));
        if !compact::is_zero(&self.settled) {
            out.push_str(",\"settled\":");
            write_spend(&mut out, &self.settled)?;
        }
        if !self.reserved.is_empty() {
            out.push_str(",\"reserved\":{");
            for (i, (key, spend)) in self.reserved.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(key)?);
                out.push(':');
                write_spend(&mut out, spend)?;
            }
            out.push('}');
        }
        out.push('}');
        Ok(out)
    }

    /// The entry of a stored image of `revision`.
    fn from_image(revision: u64, value: &str) -> Result<Self, StoreError> {
        let entry: LedgerEntry = serde_json::from_str(value).map_err(|e| {
            StoreError::backend("limits", format!("decoding a request's spend: {e}"), e)
        })?;
        let mut kept = Kept::from(entry);
        kept.revision = revision;
        kept.stored = revision;
        Ok(kept)
    }

    /// Whether its latest change is stored and it holds no open reservation: a cell that may be
    /// dropped from memory.
    fn settled_and_stored(&self) -> bool {
        self.revision == self.stored && self.reserved.is_empty()
    }
}

/// Writes `spend` as [`compact`] does: its measures at zero left out.
fn write_spend(out: &mut String, spend: &Spend) -> Result<(), serde_json::Error> {
    out.push('{');
    let mut first = true;
    let mut field = |out: &mut String, name: &str| {
        if !std::mem::take(&mut first) {
            out.push(',');
        }
        out.push('"');
        out.push_str(name);
        out.push_str("\":");
    };
    for (name, n) in [
        ("input_tokens", spend.input_tokens),
        ("output_tokens", spend.output_tokens),
        ("total_tokens", spend.total_tokens),
        ("model_calls", spend.model_calls),
        ("tool_calls", spend.tool_calls),
    ] {
        if n != 0 {
            field(out, name);
            out.push_str(itoa::Buffer::new().format(n));
        }
    }
    if spend.cost.0 != 0 {
        field(out, "cost");
        out.push_str(&serde_json::to_string(&spend.cost)?);
    }
    out.push('}');
    Ok(())
}

/// A [`Kept`] entry serialized as its [`LedgerEntry`] would be (the image of its cell).
#[derive(Serialize)]
struct KeptOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    limits: Option<&'a Limits>,
    started_at: Timestamp,
    #[serde(
        serialize_with = "compact::serialize",
        skip_serializing_if = "compact::is_zero"
    )]
    settled: Spend,
    #[serde(
        serialize_with = "compact::map_ref",
        skip_serializing_if = "compact::no_entries"
    )]
    reserved: &'a BTreeMap<String, Spend>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reached: Option<&'a LimitReached>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    told: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    told_by: Option<&'a str>,
}

/// The mark of a request known to have no entry stored (its id was made in this process, after
/// the store was opened): its first change is stored without reading the store first.
#[derive(Debug, Clone, Copy)]
struct New;

/// The fields of a [`LedgerEntry`] that most requests leave at their defaults.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Rare {
    limits: Limits,
    reached: Option<LimitReached>,
    told: bool,
    told_by: Option<String>,
}

impl From<LedgerEntry> for Kept {
    fn from(e: LedgerEntry) -> Self {
        let rare = Rare {
            limits: e.limits,
            reached: e.reached,
            told: e.told,
            told_by: e.told_by,
        };
        Kept {
            started_at: e.started_at,
            settled: e.settled,
            reserved: e.reserved,
            rare: (rare != Rare::default()).then(|| Box::new(rare)),
            revision: 0,
            stored: 0,
        }
    }
}

impl From<Kept> for LedgerEntry {
    fn from(k: Kept) -> Self {
        let rare = k.rare.map(|r| *r).unwrap_or_default();
        LedgerEntry {
            limits: rare.limits,
            started_at: k.started_at,
            settled: k.settled,
            reserved: k.reserved,
            reached: rare.reached,
            told: rare.told,
            told_by: rare.told_by,
        }
    }
}

/// The spend of every request, durably in a [`RecordStore`] (namespace [`NAMESPACE`], key: the
/// request's id). Every change is one compare-and-set write: writers on several agents, and on
/// PostgreSQL in several processes, never overspend together. Cheap to clone (clones share what
/// they remember).
///
/// A ledger remembers the entries it wrote last (their version and value) and writes the next
/// change of one against that version without reading it first; a request it does not know it
/// writes as new. Either write is refused when the record moved (another writer, another
/// process), and the ledger goes on from the record the refusal carries: what it remembers only
/// saves reads, it never decides.
///
/// On a store that keeps values typed ([`RecordStore::typed_cells`]: the memory store, SQLite),
/// the entries are kept there instead, each change made in place under the cells' lock; where the
/// cells store their images (SQLite), a change that must survive a kill is stored as the entry's
/// image before it answers, settlements made behind by the next flush, all together.
///
/// A settlement may also be made *behind* ([`settle_behind`](Self::settle_behind)): counted at
/// once by this ledger (its reads and its next writes of the request), stored by the next write of
/// the request or by [`flush`](Self::flush). Until it is stored, the record holds the call's
/// reservation, which counts at least as much: another process, or a run after a kill, sees the
/// request as having spent its worst case, never less than it spent.
#[derive(Debug, Clone)]
pub struct RequestLedger {
    records: Arc<dyn RecordStore>,
    known: Arc<std::sync::Mutex<crate::fasthash::FastMap<String, (u64, LedgerEntry)>>>,
    /// Settlements counted but not stored yet, by request: each call's key and what it spent.
    behind: Arc<std::sync::Mutex<Behind>>,
    /// On stored cells: the requests whose cell holds a change not stored yet (a settlement made
    /// behind, or a change whose store failed).
    dirty: Arc<std::sync::Mutex<crate::fasthash::FastSet<String>>>,
}

/// Settlements made behind, by request: each call's key and what it spent.
type Behind = crate::fasthash::FastMap<String, Vec<(String, Spend)>>;

impl RequestLedger {
    /// A ledger over `records`.
    pub fn new(records: Arc<dyn RecordStore>) -> Self {
        Self {
            records,
            known: Arc::default(),
            behind: Arc::default(),
            dirty: Arc::default(),
        }
    }

    fn dirty(&self) -> std::sync::MutexGuard<'_, crate::fasthash::FastSet<String>> {
        self.dirty.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The store's cells when they store their images ([`TypedCells::images`]).
    fn stored_cells(&self) -> Option<&TypedCells> {
        self.records
            .typed_cells()
            .filter(|cells| cells.images().is_some())
    }

    fn behind(&self) -> std::sync::MutexGuard<'_, Behind> {
        self.behind.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether settlements made behind wait for a write of their request's record (on a store
    /// without cells; [`flush_others`](Self::flush_others) then has work).
    pub fn has_pending(&self) -> bool {
        !self.behind().is_empty()
    }

    /// The settlements of `request` made behind and not stored yet.
    fn pending(&self, request: &EnvelopeId) -> Vec<(String, Spend)> {
        self.behind()
            .get(request.as_str())
            .cloned()
            .unwrap_or_default()
    }

    /// Forgets the settlements `applied` of `request`: a write stored them, or the record showed
    /// they had nothing left to settle.
    fn stored(&self, request: &EnvelopeId, applied: &[(String, Spend)]) {
        if applied.is_empty() {
            return;
        }
        let mut behind = self.behind();
        if let Some(list) = behind.get_mut(request.as_str()) {
            list.retain(|(key, _)| !applied.iter().any(|(done, _)| done == key));
            if list.is_empty() {
                behind.remove(request.as_str());
            }
        }
    }

    fn known(
        &self,
    ) -> std::sync::MutexGuard<'_, crate::fasthash::FastMap<String, (u64, LedgerEntry)>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The entry of `record`, with its version.
    fn decoded(record: crate::records::Record) -> Result<(u64, LedgerEntry), StoreError> {
        let version = record.version;
        Ok((version, record.decode::<LedgerEntry>()?.value))
    }

    /// The request's entry, if it spent or reserved anything or was given limits. Settlements
    /// this ledger made behind ([`settle_behind`](Self::settle_behind)) and has not stored yet
    /// count as settled.
    ///
    /// # Errors
    /// As the store.
    pub async fn get(&self, request: &EnvelopeId) -> Result<Option<LedgerEntry>, StoreError> {
        if let Some(cells) = self.records.typed_cells() {
            // A settlement made behind is in the cell already (see `settle_behind`).
            if cells.images().is_some() {
                self.load_into_cell(cells, request).await?;
            } else {
                self.carry_record_into_cell(cells, request).await?;
            }
            return Ok(cells.read(NAMESPACE, request.as_str(), |e: Option<&Kept>| {
                e.cloned().map(LedgerEntry::from)
            }));
        }
        // Taken before the read: a flush storing them in between leaves the record with them
        // (applying one again changes nothing), never a record without them and none pending.
        let pending = self.pending(request);
        match self.records.get(NAMESPACE, request.as_str()).await? {
            Some(record) => {
                let mut entry = record.decode::<LedgerEntry>()?.value;
                for (key, spent) in pending {
                    entry.settle(&key, spent);
                }
                Ok(Some(entry))
            }
            None => Ok(None),
        }
    }

    /// Reads, changes and writes the request's entry with compare-and-set, again on a conflict.
    /// `change` returns `Ok(None)` to leave the entry as it is, or `Err` to refuse (nothing
    /// written).
    async fn update<T, E>(
        &self,
        request: &EnvelopeId,
        now: Timestamp,
        mut change: impl FnMut(&mut LedgerEntry) -> Result<Option<T>, E>,
    ) -> Result<Result<Option<T>, E>, StoreError> {
        if let Some(cells) = self.records.typed_cells() {
            if cells.images().is_some() {
                return self.update_stored(cells, request, now, change).await;
            }
            self.carry_record_into_cell(cells, request).await?;
            return Ok(self.update_cell(cells, request, now, change));
        }
        // What the record is believed to be: remembered, else absent (a new request); a
        // refused write says what it is. Taken out, not copied: a concurrent change of the same
        // request in this process finds nothing remembered and learns the record from its
        // refused write (the store decides).
        let mut current: Option<(u64, LedgerEntry)> = self.known().remove(request.as_str());
        // Settlements made behind ride on this write (a settlement is idempotent: applied again
        // on a record that has it, it changes nothing).
        let pending = self.pending(request);
        let mut read = false;
        for _ in 0..CAS_ATTEMPTS {
            let (mut entry, expect) = match current.take() {
                Some((version, entry)) => (entry, Expect::Version(version)),
                None => (
                    LedgerEntry {
                        started_at: now,
                        ..LedgerEntry::default()
                    },
                    Expect::Absent,
                ),
            };
            let before = entry.clone();
            for (key, spent) in &pending {
                entry.settle(key, *spent);
            }
            let result = change(&mut entry);
            if entry == before {
                if read {
                    // The stored record has nothing left of the pending settlements.
                    self.stored(request, &pending);
                    return Ok(result);
                }
                // Nothing to write, and what was remembered may be old: decide on the record.
                current = match self.records.get(NAMESPACE, request.as_str()).await? {
                    Some(record) => Some(Self::decoded(record)?),
                    None => None,
                };
                read = true;
                continue;
            }
            let value = serde_json::to_value(&entry).map_err(|e| {
                StoreError::backend("limits", format!("encoding a request's spend: {e}"), e)
            })?;
            // The request's earlier entries are not kept: one version a request, not two a call.
            let write = RecordWrite::new(NAMESPACE, request.as_str(), value, "limits")
                .expect(expect)
                .at(now)
                .replacing();
            // Answered by its version alone: the entry written is the one at hand.
            let written = match self.records.write_receipt(write).await? {
                WriteReceipt::Written(version) => Some(version),
                WriteReceipt::AlreadyApplied(record) => Some(record.version),
                WriteReceipt::Conflict {
                    current: now_stored,
                } => {
                    current = match now_stored {
                        Some(record) => Some(Self::decoded(record)?),
                        None => None,
                    };
                    read = true;
                    None
                }
            };
            if let Some(version) = written {
                self.stored(request, &pending);
                let mut known = self.known();
                if known.len() >= KNOWN_ENTRIES {
                    known.clear();
                }
                known.insert(request.as_str().to_owned(), (version, entry));
                return Ok(result);
            }
        }
        Err(StoreError::Backend {
            backend: "limits",
            message: format!(
                "the spend of request {request} changed under {CAS_ATTEMPTS} writes in a row"
            ),
            source: None,
        })
    }

    /// Loads the entry of `request` into its cell from its stored image when the cell is not in
    /// memory (after a restart, or dropped); whether the request has an entry (in memory or
    /// stored).
    async fn load_into_cell(
        &self,
        cells: &TypedCells,
        request: &EnvelopeId,
    ) -> Result<bool, StoreError> {
        let key = request.as_str();
        if cells.read(NAMESPACE, key, |e: Option<&Kept>| e.is_some()) {
            return Ok(true);
        }
        if cells.read(NAMESPACE, key, |n: Option<&New>| n.is_some()) {
            return Ok(false);
        }
        let Some(images) = cells.images() else {
            return Ok(false);
        };
        let Some((revision, value)) = images.load(NAMESPACE, key).await? else {
            return Ok(false);
        };
        let stored = Kept::from_image(revision, &value)?;
        // A change made while it was read is newer: kept.
        cells.update(NAMESPACE, key, |slot: &mut Option<Kept>| {
            slot.get_or_insert(stored);
        });
        Ok(true)
    }

    /// [`update`](Self::update) on cells that store their images: the entry is changed in place
    /// under the cells' lock (no compare-and-set: one process owns the store), and its image is
    /// stored before this answers (alone: the settlements made behind wait for the flush, which
    /// stores them together). A change whose image is not stored is taken back
    /// ([`undo`](Self::undo)) and its caller gets the store's error.
    async fn update_stored<T, E>(
        &self,
        cells: &TypedCells,
        request: &EnvelopeId,
        now: Timestamp,
        mut change: impl FnMut(&mut LedgerEntry) -> Result<Option<T>, E>,
    ) -> Result<Result<Option<T>, E>, StoreError> {
        let key = request.as_str();
        for _ in 0..CAS_ATTEMPTS {
            let exists = self.load_into_cell(cells, request).await?;
            let done = cells.update(NAMESPACE, key, |slot: &mut Option<Kept>| {
                if slot.is_none() && exists {
                    // Dropped from memory since it was loaded: load it again.
                    return None;
                }
                let before = slot.take().unwrap_or_else(|| {
                    Kept::from(LedgerEntry {
                        started_at: now,
                        ..LedgerEntry::default()
                    })
                });
                let mut entry = LedgerEntry::from(before.clone());
                let result = change(&mut entry);
                let mut after = Kept::from(entry);
                after.revision = before.revision;
                after.stored = before.stored;
                if after == before {
                    // A request never written stays unwritten.
                    *slot = exists.then_some(before);
                    return Some((result, None));
                }
                after.revision += 1;
                let image = after.image(key).map(|image| (image, before));
                *slot = Some(after);
                Some((result, Some(image)))
            });
            let Some((result, image)) = done else {
                continue;
            };
            if let Some(image) = image {
                let stored = match image {
                    Ok((image, before)) => {
                        let revision = image.revision;
                        // Alone: the settlements made behind are stored together by the next
                        // flush.
                        self.store_images(cells, vec![image], false)
                            .await
                            .map_err(|e| (e, Some((revision, before))))
                    }
                    Err(e) => Err((e, None)),
                };
                if let Err((e, undo)) = stored {
                    self.undo(cells, key, exists, undo);
                    return Err(e);
                }
            }
            return Ok(result);
        }
        Err(StoreError::Backend {
            backend: "limits",
            message: format!(
                "the spend of request {request} left memory under {CAS_ATTEMPTS} changes in a row"
            ),
            source: None,
        })
    }

    /// Takes back a change whose image was not stored (its caller is told it failed, as a refused
    /// write changes nothing): the cell is what it was `before`, unless another change came since
    /// (then it stays, counted, never less than was reserved). A change undone is stored again by
    /// the next flush (a failed write may have stored its image: the cell's next revision replaces
    /// it).
    fn undo(&self, cells: &TypedCells, key: &str, existed: bool, undo: Option<(u64, Kept)>) {
        let Some((revision, mut before)) = undo else {
            self.dirty().insert(key.to_owned());
            return;
        };
        cells.update(NAMESPACE, key, |slot: &mut Option<Kept>| {
            if slot.as_ref().is_some_and(|k| k.revision == revision) {
                let stored = slot.as_ref().map_or(0, |k| k.stored);
                before.revision = revision + 1;
                before.stored = stored;
                *slot = existed.then_some(before);
            }
        });
        if existed {
            self.dirty().insert(key.to_owned());
        }
    }

    /// Stores `images` (with `behind`, the images of every entry changed behind) in one write;
    /// once stored, their cells are marked so, and past [`CELLS_KEPT`] the cells with nothing
    /// left to store or settle are dropped from memory.
    async fn store_images(
        &self,
        cells: &TypedCells,
        mut images: Vec<CellImage>,
        behind: bool,
    ) -> Result<(), StoreError> {
        let Some(store) = cells.images() else {
            return Ok(());
        };
        let behind: Vec<String> = if behind {
            self.dirty().drain().collect()
        } else {
            Vec::new()
        };
        for request in &behind {
            if images.iter().any(|i| &i.key == request) {
                continue;
            }
            let image = cells.read(NAMESPACE, request, |e: Option<&Kept>| {
                e.filter(|k| k.revision > k.stored)
                    .map(|k| k.image(request))
            });
            match image {
                Some(Ok(image)) => images.push(image),
                Some(Err(e)) => {
                    self.dirty().extend(behind.iter().cloned());
                    return Err(e);
                }
                None => {}
            }
        }
        if images.is_empty() {
            return Ok(());
        }
        let written: Vec<(String, u64)> =
            images.iter().map(|i| (i.key.clone(), i.revision)).collect();
        if let Err(e) = store.store(images).await {
            // Still counted in the cells: the next write stores them.
            self.dirty()
                .extend(written.into_iter().map(|(request, _)| request));
            return Err(e);
        }
        for (request, revision) in &written {
            let newer = cells.update(NAMESPACE, request, |slot: &mut Option<Kept>| {
                slot.as_mut().is_some_and(|k| {
                    k.stored = k.stored.max(*revision);
                    k.revision > k.stored
                })
            });
            if newer {
                // Changed again while it was stored: stored by the next write.
                self.dirty().insert(request.clone());
            }
        }
        if cells.len(NAMESPACE) > CELLS_KEPT {
            cells.retain(NAMESPACE, |_, k: &Kept| !k.settled_and_stored());
            // A dropped mark costs a read of the store, not a wrong answer.
            cells.retain(NAMESPACE, |_, _: &New| false);
        }
        Ok(())
    }

    /// Marks `request` as new: its id was made in this process after the store was opened (an
    /// inbound message just delivered), so nothing of it is stored, and its first change is
    /// stored without reading the store first. Only on cells that store their images (elsewhere
    /// it does nothing); a mark that is dropped (memory kept bounded) costs a read, never a
    /// wrong answer.
    pub fn begin_new(&self, request: &EnvelopeId) {
        if let Some(cells) = self.stored_cells() {
            cells.update(NAMESPACE, request.as_str(), |slot: &mut Option<New>| {
                *slot = Some(New);
            });
        }
    }

    /// When the store keeps no entry of `request` in its cells but holds one as a record (written
    /// through a wrapper of the store that keeps no cells of its own, as on a durable store), the
    /// record's entry becomes the cell's: either way of writing reads the same spend.
    async fn carry_record_into_cell(
        &self,
        cells: &TypedCells,
        request: &EnvelopeId,
    ) -> Result<(), StoreError> {
        let kept = cells.read(NAMESPACE, request.as_str(), |e: Option<&Kept>| e.is_some());
        if kept {
            return Ok(());
        }
        if let Some(record) = self.records.get(NAMESPACE, request.as_str()).await? {
            let stored = record.decode::<LedgerEntry>()?.value;
            cells.update(NAMESPACE, request.as_str(), |slot: &mut Option<Kept>| {
                slot.get_or_insert(Kept::from(stored));
            });
        }
        Ok(())
    }

    /// [`update`](Self::update) on a store that keeps the entries typed ([`TypedCells`]): the
    /// entry is changed in place under the cells' lock (no other change of it interleaves: no
    /// compare-and-set), and kept only when the change leaves it other than a new entry. Nothing
    /// is settled behind on such a store ([`settle_behind`](Self::settle_behind) stores at once),
    /// so nothing pending rides along.
    fn update_cell<T, E>(
        &self,
        cells: &TypedCells,
        request: &EnvelopeId,
        now: Timestamp,
        change: impl FnOnce(&mut LedgerEntry) -> Result<Option<T>, E>,
    ) -> Result<Option<T>, E> {
        cells.update(NAMESPACE, request.as_str(), |slot: &mut Option<Kept>| {
            let fresh = || LedgerEntry {
                started_at: now,
                ..LedgerEntry::default()
            };
            let new = slot.is_none();
            let mut entry = slot.take().map_or_else(fresh, LedgerEntry::from);
            let result = change(&mut entry);
            // A request never written stays unwritten when nothing was changed.
            if !(new && entry == fresh()) {
                *slot = Some(Kept::from(entry));
            }
            result
        })
    }

    /// Sets the limits of a request (the tighter of what it has and `limits`), before its
    /// first turn or at run time (an operator raising a request's limit uses
    /// [`RequestLedger::set_limits`]).
    ///
    /// # Errors
    /// As the store.
    pub async fn bind(
        &self,
        request: &EnvelopeId,
        limits: Limits,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.update(request, now, |e| {
            e.limits = e.limits.tighter(&limits);
            Ok::<Option<()>, ()>(None)
        })
        .await
        .map(|_| ())
    }

    /// Replaces a request's limits (an operator raising or lowering them); a request that reached
    /// a limit it no longer passes may spend again.
    ///
    /// # Errors
    /// As the store.
    pub async fn set_limits(
        &self,
        request: &EnvelopeId,
        limits: Limits,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.update(request, now, |e| {
            e.limits = limits;
            e.reached = None;
            e.told = false;
            e.told_by = None;
            Ok::<Option<()>, ()>(None)
        })
        .await
        .map(|_| ())
    }

    /// Reserves a model call `key` of `request` (its worst case, `call`) under `defaults`
    /// tightened by the request's own limits. The output reserved is what fits: at most
    /// `call.max_output`, at most what the output, total and cost limits leave; the caller caps
    /// the call's `max_tokens` to it. Written only when the settled spend, every open reservation
    /// and this one stay within every limit; answers the reservation.
    ///
    /// # Errors
    /// `Ok(Err(Refusal::Reached))` when not even one output token fits against the settled spend
    /// (it is recorded on the request), or the request reached a limit before (it stays stopped
    /// until [`set_limits`](Self::set_limits)); `Ok(Err(Refusal::Busy))` when it would fit but
    /// for the request's other open reservations (try again once they settle); `Err` as the store.
    pub async fn reserve(
        &self,
        request: &EnvelopeId,
        key: &str,
        call: &CallEstimate,
        defaults: &Limits,
        now: Timestamp,
    ) -> Result<Result<Spend, Refusal>, StoreError> {
        let outcome = self
            .update(request, now, |e| {
                if let Some(existing) = e.reserved.get(key) {
                    return Ok(Some(*existing));
                }
                // A request that reached a limit stays stopped (its open work fails, nothing
                // loops) until an operator changes its limits.
                if let Some(reached) = &e.reached {
                    return Err(Refusal::Reached(reached.clone()));
                }
                let limits = defaults.tighter(&e.limits);
                let elapsed = u64::try_from(now.0.saturating_sub(e.started_at.0)).unwrap_or(0);
                match call.fit(&limits, &e.settled, &e.committed(), elapsed) {
                    Ok(reserved) => {
                        e.reserved.insert(key.to_string(), reserved);
                        Ok(Some(reserved))
                    }
                    Err(Fit::Reached(over)) => Err(Refusal::Reached(e.refuse(over))),
                    Err(Fit::Busy(over)) => Err(Refusal::Busy(over)),
                }
            })
            .await?;
        Ok(outcome.map(|granted| granted.unwrap_or_default()))
    }

    /// Releases the reservation `key` without charging it (the call was not made).
    ///
    /// # Errors
    /// As the store.
    pub async fn release(
        &self,
        request: &EnvelopeId,
        key: &str,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.update(request, now, |e| {
            e.reserved.remove(key);
            Ok::<Option<()>, ()>(None)
        })
        .await
        .map(|_| ())
    }

    /// Settles the call `key`: its reservation is replaced by what it spent. A call with no open
    /// reservation (settled already) changes nothing.
    ///
    /// # Errors
    /// As the store.
    pub async fn settle(
        &self,
        request: &EnvelopeId,
        key: &str,
        spent: Spend,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.update(request, now, |e| {
            e.settle(key, spent);
            Ok::<Option<()>, ()>(None)
        })
        .await
        .map(|_| ())
    }

    /// Settles the call `key` *behind*: this ledger (and its clones) count it at once, in what
    /// they read and write of the request; the record stores it with the request's next write, or
    /// at [`flush`](Self::flush). Until then the record holds the call's reservation (never less
    /// than it spent): a kill before the store counts the reservation, as a kill before any
    /// settlement does.
    ///
    /// On a store that keeps the entries typed ([`TypedCells`]) the call is settled in its entry
    /// at once: on the memory store that is all (no write to save); where the cells store their
    /// images (SQLite), the entry's image is stored by the next [`flush`](Self::flush) (with every
    /// other settlement waiting, in one write). Answers whether the settlement waits for a write
    /// (`false`: it was stored).
    pub fn settle_behind(&self, request: &EnvelopeId, key: &str, spent: Spend) -> bool {
        if let Some(cells) = self.records.typed_cells() {
            let settled = cells.update(NAMESPACE, request.as_str(), |slot: &mut Option<Kept>| {
                slot.as_mut().is_some_and(|kept| {
                    let settled = kept.settle(key, spent);
                    kept.revision += u64::from(settled);
                    settled
                })
            });
            if cells.images().is_none() || !settled {
                return false;
            }
            // Stored with the next write of any request, or by the next flush.
            self.dirty().insert(request.as_str().to_owned());
            return true;
        }
        self.behind()
            .entry(request.as_str().to_owned())
            .or_default()
            .push((key.to_owned(), spent));
        true
    }

    /// Stores the settlements of `request` made behind, if any are left (one write; nothing when
    /// a write of the request stored them already).
    ///
    /// # Errors
    /// As the store (they stay pending, and the next write of the request carries them).
    pub async fn flush(&self, request: &EnvelopeId, now: Timestamp) -> Result<(), StoreError> {
        if let Some(cells) = self.stored_cells() {
            if !self.dirty().contains(request.as_str()) {
                return Ok(());
            }
            return self.store_images(cells, Vec::new(), true).await;
        }
        if !self.behind().contains_key(request.as_str()) {
            return Ok(());
        }
        self.update(request, now, |_| Ok::<Option<()>, ()>(None))
            .await
            .map(|_| ())
    }

    /// Stores every settlement made behind (see [`flush`](Self::flush)).
    ///
    /// # Errors
    /// The first store error (the others are tried still).
    pub async fn flush_all(&self, now: Timestamp) -> Result<(), StoreError> {
        if let Some(cells) = self.stored_cells() {
            return self.store_images(cells, Vec::new(), true).await;
        }
        let requests: Vec<EnvelopeId> = self
            .behind()
            .keys()
            .map(|r| EnvelopeId::new(r.clone()))
            .collect();
        let mut first = Ok(());
        let flushes = futures::future::join_all(requests.iter().map(|r| self.flush(r, now)));
        for done in crate::durability::together(flushes).await {
            if first.is_ok() {
                first = done;
            }
        }
        first
    }

    /// Stores the settlements made behind of every request but `except`, all at once (their
    /// writes sent together); what fails stays pending.
    ///
    /// # Errors
    /// The first store error.
    pub async fn flush_others(
        &self,
        except: &EnvelopeId,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        if self.stored_cells().is_some() {
            // Stored together by the flush `settle_behind` asked for (one write for them all).
            return Ok(());
        }
        let requests: Vec<EnvelopeId> = {
            let behind = self.behind();
            if behind.is_empty() {
                return Ok(());
            }
            behind
                .keys()
                .filter(|r| r.as_str() != except.as_str())
                .map(|r| EnvelopeId::new(r.clone()))
                .collect()
        };
        match requests.as_slice() {
            // Most often one: the request of the call settled last.
            [one] => self.flush(one, now).await,
            many => futures::future::join_all(many.iter().map(|r| self.flush(r, now)))
                .await
                .into_iter()
                .collect::<Result<Vec<()>, _>>()
                .map(|_| ()),
        }
    }

    /// Charges `spent` at once (no reservation), checked against the limits first: what a tool
    /// call costs.
    ///
    /// # Errors
    /// `Ok(Err(LimitReached))` when a limit would be passed; `Err` as the store.
    pub async fn charge(
        &self,
        request: &EnvelopeId,
        spent: Spend,
        defaults: &Limits,
        now: Timestamp,
    ) -> Result<Result<(), LimitReached>, StoreError> {
        let outcome = self
            .update(request, now, |e| {
                if let Some(reached) = &e.reached {
                    return Err(reached.clone());
                }
                let limits = defaults.tighter(&e.limits);
                let elapsed = u64::try_from(now.0.saturating_sub(e.started_at.0)).unwrap_or(0);
                match limits.check(&e.committed().plus(&spent), elapsed) {
                    Ok(()) => {
                        e.settled = e.settled.plus(&spent);
                        Ok::<Option<()>, LimitReached>(None)
                    }
                    Err(over) => Err(e.refuse(over)),
                }
            })
            .await?;
        Ok(outcome.map(|_: Option<()>| ()))
    }

    /// Whether `teller` is the one to tell the user that the request reached its limit: `true`
    /// for the first teller of the request (and again after [`set_limits`](Self::set_limits)),
    /// and for that teller again. A teller names the failure that tells (the message it answers):
    /// the same failure run again after a crash (the claim stored, the reply not sent) tells
    /// again, so the user is told at least once; any other failure of the request does not.
    ///
    /// # Errors
    /// As the store.
    pub async fn tell_once(
        &self,
        request: &EnvelopeId,
        teller: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let outcome = self
            .update(request, now, |e| {
                if e.told {
                    Ok::<Option<bool>, ()>(Some(e.told_by.as_deref() == Some(teller)))
                } else {
                    e.told = true;
                    e.told_by = Some(teller.to_owned());
                    Ok(Some(true))
                }
            })
            .await?;
        Ok(matches!(outcome, Ok(Some(true))))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::limits::Limit;
    use crate::stores::Stores;

    /// A ledger on each kind of store: one keeping the entries typed (the memory store's
    /// cells), one writing them as records (redb, PostgreSQL) and one keeping them in cells that
    /// store their images (SQLite).
    fn ledgers() -> [RequestLedger; 3] {
        let records = || Stores::memory().records.clone();
        [
            RequestLedger::new(records()),
            RequestLedger::new(crate::records::testkit::records_only(records())),
            stored(&Arc::default()),
        ]
    }

    /// A ledger over cells whose images are kept in `images` (see `testkit::stored_cells`):
    /// made again over the same images, the ledger of a restarted process.
    fn stored(images: &Arc<crate::records::testkit::MemoryImages>) -> RequestLedger {
        let records = crate::records::testkit::records_only(Stores::memory().records.clone());
        RequestLedger::new(crate::records::testkit::stored_cells(
            records,
            images.clone(),
        ))
    }

    /// The cells of a ledger made by [`stored`].
    fn cells_of(l: &RequestLedger) -> &TypedCells {
        l.records.typed_cells().unwrap()
    }

    /// What a restart finds of a request's entry: a reservation stored before the call counts
    /// until its settlement is stored; a settlement made behind and flushed is there; one made
    /// behind and not flushed leaves the reservation counted, never less than was spent.
    #[test]
    fn a_stored_entry_comes_back_after_a_restart_and_a_kill_never_loses_a_reservation() {
        futures::executor::block_on(async {
            let images = Arc::new(crate::records::testkit::MemoryImages::default());
            let request = EnvelopeId::new("req-restart");
            let limits = Limits {
                total_tokens: Some(1_000),
                ..Limits::NONE
            };
            let first = stored(&images);
            first
                .reserve(&request, "c1", &est(100, 200), &limits, Timestamp(5))
                .await
                .unwrap()
                .unwrap();
            // Killed before the settlement: the next run counts the reservation.
            let second = stored(&images);
            let entry = second.get(&request).await.unwrap().unwrap();
            assert_eq!(entry.committed().total_tokens, 300, "{entry:?}");
            assert_eq!(entry.started_at, Timestamp(5));
            // Settled behind, not flushed, killed: still the reservation.
            assert!(second.settle_behind(&request, "c1", tokens(120)));
            assert_eq!(
                second
                    .get(&request)
                    .await
                    .unwrap()
                    .unwrap()
                    .settled
                    .total_tokens,
                120,
                "counted at once in the process that settled"
            );
            let third = stored(&images);
            assert_eq!(
                third
                    .get(&request)
                    .await
                    .unwrap()
                    .unwrap()
                    .committed()
                    .total_tokens,
                300
            );
            // Settled and flushed: the next run reads the settlement.
            assert!(third.settle_behind(&request, "c1", tokens(120)));
            third.flush_all(Timestamp(6)).await.unwrap();
            let fourth = stored(&images);
            let entry = fourth.get(&request).await.unwrap().unwrap();
            assert_eq!(
                (entry.settled.total_tokens, entry.reserved.len()),
                (120, 0),
                "{entry:?}"
            );
        });
    }

    /// A request marked new is written without a read of the store; one not marked is read
    /// once (it may have been stored by an earlier run), then kept.
    #[test]
    fn a_request_begun_here_is_written_without_reading_the_store() {
        futures::executor::block_on(async {
            use std::sync::atomic::Ordering;
            let images = Arc::new(crate::records::testkit::MemoryImages::default());
            let l = stored(&images);
            let limits = Limits::NONE;
            let new = EnvelopeId::new("req-new");
            l.begin_new(&new);
            assert_eq!(l.get(&new).await.unwrap(), None, "a mark is no entry");
            l.reserve(&new, "c1", &est(10, 10), &limits, Timestamp(0))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(images.loads.load(Ordering::SeqCst), 0);
            let old = EnvelopeId::new("req-old");
            l.reserve(&old, "c1", &est(10, 10), &limits, Timestamp(0))
                .await
                .unwrap()
                .unwrap();
            l.reserve(&old, "c2", &est(10, 10), &limits, Timestamp(0))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(images.loads.load(Ordering::SeqCst), 1);
            // Both stored, each as one image.
            let stored = images.images.lock().unwrap().len();
            assert_eq!(stored, 2);
        });
    }

    /// A change whose image could not be stored fails its caller and is taken back (as a refused
    /// write changes nothing): the call it reserved for is not made, and nothing counts it; the
    /// next write stores what the cell holds.
    #[test]
    fn a_change_not_stored_is_taken_back() {
        futures::executor::block_on(async {
            use std::sync::atomic::Ordering;
            let images = Arc::new(crate::records::testkit::MemoryImages::default());
            let l = stored(&images);
            let limits = Limits::NONE;
            let a = EnvelopeId::new("req-a");
            // A new request's first change, not stored: no entry.
            images.failing.store(true, Ordering::SeqCst);
            let failed = l
                .reserve(&a, "c1", &est(10, 10), &limits, Timestamp(0))
                .await;
            assert!(failed.is_err(), "{failed:?}");
            assert_eq!(l.get(&a).await.unwrap(), None);
            // A stored request's change, not stored: the entry as it was.
            images.failing.store(false, Ordering::SeqCst);
            l.reserve(&a, "c1", &est(10, 10), &limits, Timestamp(0))
                .await
                .unwrap()
                .unwrap();
            images.failing.store(true, Ordering::SeqCst);
            let failed = l
                .reserve(&a, "c2", &est(100, 100), &limits, Timestamp(0))
                .await;
            assert!(failed.is_err(), "{failed:?}");
            let entry = l.get(&a).await.unwrap().unwrap();
            assert_eq!(
                (entry.reserved.len(), entry.committed().total_tokens),
                (1, 20),
                "{entry:?}"
            );
            // The next write (a flush) stores the cell; a restart reads it.
            images.failing.store(false, Ordering::SeqCst);
            l.flush_all(Timestamp(1)).await.unwrap();
            let after = stored(&images);
            let entry = after.get(&a).await.unwrap().unwrap();
            assert_eq!(
                (entry.reserved.len(), entry.committed().total_tokens),
                (1, 20),
                "{entry:?}"
            );
            // And the change can be made again.
            l.reserve(&a, "c2", &est(100, 100), &limits, Timestamp(0))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(
                stored(&images)
                    .get(&a)
                    .await
                    .unwrap()
                    .unwrap()
                    .committed()
                    .total_tokens,
                220
            );
        });
    }

    /// Past the bound, cells whose latest change is stored and that hold no open reservation
    /// leave memory; they read the same when loaded again, and an open reservation stays.
    #[test]
    fn settled_and_stored_cells_leave_memory_past_the_bound_and_read_the_same() {
        futures::executor::block_on(async {
            let images = Arc::new(crate::records::testkit::MemoryImages::default());
            let l = stored(&images);
            let limits = Limits::NONE;
            let open = EnvelopeId::new("req-open");
            l.reserve(&open, "open", &est(1, 1), &limits, Timestamp(0))
                .await
                .unwrap()
                .unwrap();
            for i in 0..CELLS_KEPT + 10 {
                let r = EnvelopeId::new(format!("req-{i}"));
                l.reserve(&r, "c", &est(1, 1), &limits, Timestamp(0))
                    .await
                    .unwrap()
                    .unwrap();
                l.settle_behind(&r, "c", tokens(i as u64));
            }
            l.flush_all(Timestamp(1)).await.unwrap();
            let kept = cells_of(&l).len(NAMESPACE);
            assert!(kept < 20, "{kept} cells kept");
            assert!(
                cells_of(&l).read(NAMESPACE, "req-open", |k: Option<&Kept>| k.is_some()),
                "an open reservation stays in memory"
            );
            for i in [0, 7, CELLS_KEPT + 9] {
                let r = EnvelopeId::new(format!("req-{i}"));
                let entry = l.get(&r).await.unwrap().unwrap();
                assert_eq!(
                    (entry.settled.total_tokens, entry.reserved.len()),
                    (i as u64, 0),
                    "req-{i}"
                );
            }
        });
    }

    /// The image of an entry is its JSON as serde writes the [`LedgerEntry`], whichever path
    /// writes it.
    #[test]
    fn an_image_is_the_entrys_json() {
        let spend = |n: u64| Spend {
            input_tokens: n,
            output_tokens: 0,
            total_tokens: n * 2,
            model_calls: 1,
            tool_calls: n % 2,
            cost: crate::limits::Money(n * 1_250),
        };
        let mut entries = vec![LedgerEntry::default()];
        for n in [0u64, 1, 7, 123_456_789] {
            let mut e = LedgerEntry {
                started_at: Timestamp(1_700_000_000_000 + n as i64),
                settled: spend(n),
                ..LedgerEntry::default()
            };
            e.reserved.insert("a:1".into(), spend(n + 1));
            e.reserved
                .insert("quote\"back\\slash\u{1}é".into(), spend(0));
            entries.push(e.clone());
            e.told = true;
            e.told_by = Some("teller".into());
            entries.push(e.clone());
            e.limits.total_tokens = Some(n);
            entries.push(e);
        }
        for entry in entries {
            let image = Kept::from(entry.clone()).image("r").unwrap();
            let serde = serde_json::to_value(&entry).unwrap();
            let ours: serde_json::Value = serde_json::from_str(&image.value).unwrap();
            assert_eq!(ours, serde, "{}", image.value);
            let back = Kept::from_image(3, &image.value).unwrap();
            assert_eq!(LedgerEntry::from(back), entry);
        }
    }

    #[test]
    fn an_entry_is_stored_without_its_measures_at_zero_and_read_in_either_form() {
        let mut entry = LedgerEntry {
            started_at: Timestamp(5),
            ..LedgerEntry::default()
        };
        let call = Spend {
            input_tokens: 10,
            output_tokens: 20,
            total_tokens: 30,
            model_calls: 1,
            ..Spend::default()
        };
        entry.reserved.insert("c1".into(), call);
        let stored = serde_json::to_value(&entry).unwrap();
        assert_eq!(
            stored,
            serde_json::json!({
                "started_at": 5,
                "reserved": {"c1": {
                    "input_tokens": 10, "output_tokens": 20, "total_tokens": 30, "model_calls": 1
                }}
            })
        );
        assert_eq!(
            serde_json::from_value::<LedgerEntry>(stored).unwrap(),
            entry
        );
        // As entries were stored before: every measure written out.
        let full = serde_json::json!({
            "started_at": 5,
            "settled": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                        "model_calls": 0, "tool_calls": 0, "cost": 0.0},
            "reserved": {"c1": {"input_tokens": 10, "output_tokens": 20, "total_tokens": 30,
                                "model_calls": 1, "tool_calls": 0, "cost": 0.0}}
        });
        assert_eq!(serde_json::from_value::<LedgerEntry>(full).unwrap(), entry);
        entry.settle("c1", call);
        assert_eq!(
            serde_json::to_value(&entry).unwrap(),
            serde_json::json!({
                "started_at": 5,
                "settled": {
                    "input_tokens": 10, "output_tokens": 20, "total_tokens": 30, "model_calls": 1
                }
            })
        );
    }

    fn est(input: u64, max_output: u64) -> CallEstimate {
        CallEstimate {
            input,
            max_output,
            price: None,
        }
    }

    fn tokens(n: u64) -> Spend {
        Spend {
            input_tokens: n,
            total_tokens: n,
            model_calls: 1,
            ..Spend::default()
        }
    }

    #[test]
    #[allow(clippy::panic)]
    fn reservations_count_until_settled_and_a_refusal_is_recorded() {
        futures::executor::block_on(async {
            for l in ledgers() {
                let r = EnvelopeId::new("req-1");
                let limits = Limits {
                    total_tokens: Some(100),
                    ..Limits::NONE
                };
                let t = Timestamp(10);
                let first = l
                    .reserve(&r, "c1", &est(50, 10), &limits, t)
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(first.total_tokens, 60);
                // The output reserved is what the limit leaves: 100 - 60 - 30 = 10.
                let second = l
                    .reserve(&r, "c2", &est(30, 500), &limits, t)
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!((second.output_tokens, second.total_tokens), (10, 40));
                // Not even one output token fits with both open.
                let refused = l.reserve(&r, "c3", &est(1, 10), &limits, t).await.unwrap();
                let Err(Refusal::Busy(over)) = refused else {
                    panic!("busy while two reservations hold the room: {refused:?}")
                };
                assert_eq!((over.limit, over.value), (Limit::TotalTokens, 102));
                // Settled for less, the room comes back.
                l.settle(&r, "c1", tokens(30), t).await.unwrap();
                l.settle(&r, "c2", tokens(20), t).await.unwrap();
                l.reserve(&r, "c3", &est(20, 10), &limits, t)
                    .await
                    .unwrap()
                    .unwrap();
                l.settle(&r, "c3", tokens(30), t).await.unwrap();
                // 80 settled: a call of 30 input tokens cannot fit even alone.
                let refused = l.reserve(&r, "c4", &est(30, 10), &limits, t).await.unwrap();
                let Err(Refusal::Reached(reached)) = refused else {
                    panic!("reached: {refused:?}")
                };
                assert_eq!(reached.over.limit, Limit::TotalTokens);
                assert_eq!(reached.spent.total_tokens, 80);
                // Settling twice changes nothing.
                l.settle(&r, "c3", tokens(30), t).await.unwrap();
                let entry = l.get(&r).await.unwrap().unwrap();
                assert_eq!(entry.settled.total_tokens, 80);
                assert!(entry.reserved.is_empty());
                assert!(entry.reached.is_some());
                assert_eq!(entry.committed(), entry.settled);
            }
        });
    }

    #[test]
    fn tool_calls_are_charged_all_or_none_against_their_limit() {
        futures::executor::block_on(async {
            for l in ledgers() {
                let r = EnvelopeId::new("req-4");
                let limits = Limits {
                    tool_calls: Some(3),
                    ..Limits::NONE
                };
                l.charge(&r, Spend::tool_calls(2), &limits, Timestamp(1))
                    .await
                    .unwrap()
                    .unwrap();
                let refused = l
                    .charge(&r, Spend::tool_calls(2), &limits, Timestamp(2))
                    .await
                    .unwrap()
                    .unwrap_err();
                assert_eq!(
                    (refused.over.limit, refused.over.value),
                    (Limit::ToolCalls, 4)
                );
                assert_eq!(refused.spent.tool_calls, 2);
                let entry = l.get(&r).await.unwrap().unwrap();
                assert_eq!(entry.settled.tool_calls, 2, "a refused charge adds nothing");
                assert_eq!(entry.reached, Some(refused));
            }
        });
    }

    #[test]
    #[allow(clippy::panic)]
    fn wall_time_counts_from_the_requests_first_write() {
        futures::executor::block_on(async {
            for l in ledgers() {
                let r = EnvelopeId::new("req-5");
                let limits = Limits {
                    wall_time_ms: Some(1_000),
                    ..Limits::NONE
                };
                l.reserve(&r, "c1", &est(10, 10), &limits, Timestamp(5_000))
                    .await
                    .unwrap()
                    .unwrap();
                l.settle(&r, "c1", tokens(10), Timestamp(5_500))
                    .await
                    .unwrap();
                let late = l
                    .reserve(&r, "c2", &est(10, 10), &limits, Timestamp(6_001))
                    .await
                    .unwrap();
                let Err(Refusal::Reached(reached)) = late else {
                    panic!("past the wall time: {late:?}")
                };
                assert_eq!(
                    (reached.over.limit, reached.over.value),
                    (Limit::WallTime, 1_001)
                );
            }
        });
    }

    #[test]
    fn the_user_is_told_once_per_request_until_its_limits_change() {
        futures::executor::block_on(async {
            for l in ledgers() {
                let r = EnvelopeId::new("req-2");
                assert!(l.tell_once(&r, "m1", Timestamp(1)).await.unwrap());
                assert!(!l.tell_once(&r, "m2", Timestamp(2)).await.unwrap());
                // The same teller again (its failure run again after a crash) tells again.
                assert!(l.tell_once(&r, "m1", Timestamp(2)).await.unwrap());
                // As another process would see it: from the record.
                let fresh = RequestLedger::new(l.records.clone());
                assert!(fresh.tell_once(&r, "m1", Timestamp(2)).await.unwrap());
                assert!(!fresh.tell_once(&r, "m2", Timestamp(2)).await.unwrap());
                l.set_limits(&r, Limits::NONE, Timestamp(3)).await.unwrap();
                assert!(l.tell_once(&r, "m2", Timestamp(4)).await.unwrap());
                assert!(!l.tell_once(&r, "m1", Timestamp(5)).await.unwrap());
            }
        });
    }

    #[test]
    fn racing_reservations_never_pass_the_limit_together() {
        futures::executor::block_on(async {
            for l in ledgers() {
                let r = EnvelopeId::new("req-3");
                let limits = Limits {
                    total_tokens: Some(100),
                    ..Limits::NONE
                };
                let attempts = (0..10).map(|i| {
                    let (l, r) = (l.clone(), r.clone());
                    async move {
                        l.reserve(&r, &format!("c{i}"), &est(20, 10), &limits, Timestamp(1))
                            .await
                            .unwrap()
                            .is_ok()
                    }
                });
                let granted = futures::future::join_all(attempts)
                    .await
                    .into_iter()
                    .filter(|ok| *ok)
                    .count();
                assert_eq!(granted, 3, "30 tokens each under 100: three fit");
            }
        });
    }

    /// An entry kept in a cell comes back as it went in, its rarely set fields boxed apart only
    /// when set.
    #[test]
    fn an_entry_kept_in_a_cell_comes_back_whole() {
        let mut entry = LedgerEntry {
            started_at: Timestamp(3),
            settled: tokens(7),
            ..LedgerEntry::default()
        };
        entry.reserved.insert("c1".into(), tokens(5));
        let kept = Kept::from(entry.clone());
        assert!(kept.rare.is_none(), "nothing rare set: nothing boxed");
        assert_eq!(LedgerEntry::from(kept), entry);
        entry.limits.total_tokens = Some(100);
        entry.reached = Some(LimitReached {
            over: crate::limits::Over {
                limit: Limit::TotalTokens,
                max: 100,
                value: 120,
            },
            spent: tokens(7),
            scope: Scope::Request,
        });
        entry.told = true;
        entry.told_by = Some("m1".into());
        let kept = Kept::from(entry.clone());
        assert!(kept.rare.is_some());
        assert_eq!(LedgerEntry::from(kept), entry);
    }

    /// On the memory store the entries are kept in its typed cells, not as records; an entry
    /// written as a record through a wrapper that keeps no cells is read, and changed, through
    /// the store itself all the same.
    #[test]
    fn the_memory_store_keeps_entries_typed_and_reads_one_written_as_a_record() {
        futures::executor::block_on(async {
            let records = Stores::memory().records.clone();
            let typed = RequestLedger::new(records.clone());
            let wrapped =
                RequestLedger::new(crate::records::testkit::records_only(records.clone()));
            let limits = Limits {
                total_tokens: Some(100),
                ..Limits::NONE
            };
            let (r1, r2) = (EnvelopeId::new("req-t1"), EnvelopeId::new("req-t2"));
            typed
                .reserve(&r1, "c1", &est(10, 10), &limits, Timestamp(1))
                .await
                .unwrap()
                .unwrap();
            assert!(
                !typed.settle_behind(&r1, "c1", tokens(15)),
                "settled at once"
            );
            assert!(records.get(NAMESPACE, r1.as_str()).await.unwrap().is_none());
            let kept =
                records
                    .typed_cells()
                    .unwrap()
                    .read(NAMESPACE, r1.as_str(), |e: Option<&Kept>| {
                        e.cloned().map(LedgerEntry::from)
                    });
            let kept = kept.expect("kept in a cell");
            assert_eq!((kept.settled.total_tokens, kept.reserved.len()), (15, 0));
            // Written as a record through the wrapper, then read and changed through the store.
            wrapped
                .reserve(&r2, "c1", &est(40, 10), &limits, Timestamp(2))
                .await
                .unwrap()
                .unwrap();
            assert!(records.get(NAMESPACE, r2.as_str()).await.unwrap().is_some());
            let read = typed.get(&r2).await.unwrap().expect("read from the record");
            assert_eq!(read.committed().total_tokens, 50);
            assert_eq!(read.started_at, Timestamp(2));
            // 50 held: 60 more do not fit.
            let refused = typed
                .reserve(&r2, "c2", &est(50, 10), &limits, Timestamp(3))
                .await
                .unwrap();
            assert!(matches!(refused, Err(Refusal::Busy(_))), "{refused:?}");
            typed
                .reserve(&r2, "c2", &est(40, 10), &limits, Timestamp(3))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(
                typed
                    .get(&r2)
                    .await
                    .unwrap()
                    .unwrap()
                    .committed()
                    .total_tokens,
                100
            );
        });
    }

    /// Two ledgers over one store (two processes): each remembers what it wrote last, which
    /// the other's writes make old; every decision is still made on the stored entry.
    #[test]
    fn a_ledger_whose_remembered_entry_is_old_decides_on_the_stored_one() {
        futures::executor::block_on(async {
            let records = crate::records::testkit::records_only(Stores::memory().records.clone());
            let (a, b) = (
                RequestLedger::new(records.clone()),
                RequestLedger::new(records),
            );
            let r = EnvelopeId::new("req-4");
            let limits = Limits {
                total_tokens: Some(100),
                ..Limits::NONE
            };
            // `a` creates the entry and remembers it; `b` knows nothing of it.
            assert!(
                a.reserve(&r, "a1", &est(20, 10), &limits, Timestamp(1))
                    .await
                    .unwrap()
                    .is_ok()
            );
            a.settle(&r, "a1", tokens(30), Timestamp(2)).await.unwrap();
            // `b` writes as if the request were new, is refused, and goes on from the record.
            assert!(
                b.reserve(&r, "b1", &est(20, 10), &limits, Timestamp(3))
                    .await
                    .unwrap()
                    .is_ok()
            );
            b.settle(&r, "b1", tokens(60), Timestamp(4)).await.unwrap();
            // `a` remembers 30 spent; 90 are: a call of 30 no longer fits.
            let refused = a
                .reserve(&r, "a2", &est(20, 10), &limits, Timestamp(5))
                .await
                .unwrap();
            assert!(matches!(refused, Err(Refusal::Reached(_))), "{refused:?}");
            let entry = b.get(&r).await.unwrap().unwrap();
            assert_eq!(entry.settled.total_tokens, 90);
            assert!(entry.reserved.is_empty());
            assert_eq!(entry.started_at, Timestamp(1));
            // The refusal is stored: `b`, which remembered the entry before it, is refused too.
            assert!(
                b.reserve(&r, "b2", &est(1, 1), &Limits::NONE, Timestamp(6))
                    .await
                    .unwrap()
                    .is_err(),
                "the request reached its limit"
            );
        });
    }

    /// A settlement made behind counts at once for the ledger that made it, rides on the
    /// request's next write (no write of its own), and until stored leaves the record holding the
    /// reservation: another process sees the worst case, never less than was spent.
    #[test]
    fn a_settlement_made_behind_counts_at_once_and_rides_on_the_next_write() {
        futures::executor::block_on(async {
            let records = crate::records::testkit::records_only(Stores::memory().records.clone());
            let (a, b) = (
                RequestLedger::new(records.clone()),
                RequestLedger::new(records.clone()),
            );
            let r = EnvelopeId::new("req-6");
            let limits = Limits {
                total_tokens: Some(100),
                ..Limits::NONE
            };
            // The writes made: the record's version (its earlier versions are not kept).
            let versions = || async {
                let record = records.get(NAMESPACE, r.as_str()).await.unwrap();
                record.map_or(0, |record| record.version)
            };
            a.reserve(&r, "c1", &est(50, 10), &limits, Timestamp(1))
                .await
                .unwrap()
                .unwrap();
            a.settle_behind(&r, "c1", tokens(20));
            assert_eq!(versions().await, 1, "no write of its own");
            let mine = a.get(&r).await.unwrap().unwrap();
            assert_eq!(
                (mine.settled.total_tokens, mine.committed().total_tokens),
                (20, 20)
            );
            let theirs = b.get(&r).await.unwrap().unwrap();
            assert_eq!(
                (theirs.settled.total_tokens, theirs.committed().total_tokens),
                (0, 60),
                "the record still holds the reservation"
            );
            // 20 spent + 70 fits under 100 only with the settlement counted.
            a.reserve(&r, "c2", &est(60, 10), &limits, Timestamp(2))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(
                versions().await,
                2,
                "the settlement rode on the reservation"
            );
            let stored = b.get(&r).await.unwrap().unwrap();
            assert_eq!(stored.settled.total_tokens, 20);
            assert_eq!(stored.reserved.keys().collect::<Vec<_>>(), ["c2"]);
            // A flush with nothing left writes nothing; one with a settlement writes it once.
            a.flush(&r, Timestamp(3)).await.unwrap();
            assert_eq!(versions().await, 2);
            a.settle_behind(&r, "c2", tokens(65));
            a.flush_all(Timestamp(4)).await.unwrap();
            a.flush_all(Timestamp(5)).await.unwrap();
            assert_eq!(versions().await, 3);
            assert_eq!(
                records.history(NAMESPACE, r.as_str()).await.unwrap().len(),
                1,
                "a request's ledger record keeps its latest version alone"
            );
            let done = b.get(&r).await.unwrap().unwrap();
            assert_eq!(done.settled.total_tokens, 85);
            assert!(done.reserved.is_empty());
            // Another process's write in between: the settlement is carried on the record it
            // learns from the refusal, once.
            a.reserve(&r, "c3", &est(5, 5), &limits, Timestamp(6))
                .await
                .unwrap()
                .unwrap();
            a.settle_behind(&r, "c3", tokens(7));
            b.reserve(&r, "b1", &est(1, 1), &limits, Timestamp(7))
                .await
                .unwrap()
                .unwrap();
            a.flush(&r, Timestamp(8)).await.unwrap();
            let last = b.get(&r).await.unwrap().unwrap();
            assert_eq!(last.settled.total_tokens, 92);
            assert_eq!(last.reserved.keys().collect::<Vec<_>>(), ["b1"]);
        });
    }

    /// A flush that stores a settlement between `get`'s read of the record and its use: the
    /// entry still shows the call settled (the pending settlements are taken before the read).
    #[test]
    fn a_flush_between_a_read_and_its_use_never_shows_the_reservation_again() {
        futures::executor::block_on(async {
            // The next read, once armed, lets the ledger flush right after the record was read:
            // what a background flush finishing between a read and its use looks like.
            let ledger: Arc<std::sync::OnceLock<RequestLedger>> = Arc::default();
            let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let store = Arc::new(crate::records::testkit::AfterGet {
                inner: Stores::memory().records.clone(),
                cells: None,
                after: Box::new({
                    let (ledger, armed) = (ledger.clone(), armed.clone());
                    move |_, _| {
                        let flush = armed
                            .swap(false, std::sync::atomic::Ordering::SeqCst)
                            .then(|| ledger.get().cloned())
                            .flatten();
                        Box::pin(async move {
                            if let Some(ledger) = flush {
                                ledger.flush_all(Timestamp(9)).await.unwrap();
                            }
                        })
                    }
                }),
            });
            let l = RequestLedger::new(store.clone());
            ledger.set(l.clone()).unwrap();
            let r = EnvelopeId::new("req-7");
            let limits = Limits {
                total_tokens: Some(100),
                ..Limits::NONE
            };
            l.reserve(&r, "c1", &est(50, 10), &limits, Timestamp(1))
                .await
                .unwrap()
                .unwrap();
            l.settle_behind(&r, "c1", tokens(20));
            armed.store(true, std::sync::atomic::Ordering::SeqCst);
            let entry = l.get(&r).await.unwrap().unwrap();
            assert_eq!(
                (entry.settled.total_tokens, entry.reserved.len()),
                (20, 0),
                "{entry:?}"
            );
            assert!(
                !armed.load(std::sync::atomic::Ordering::SeqCst),
                "the flush ran"
            );
        });
    }
}
