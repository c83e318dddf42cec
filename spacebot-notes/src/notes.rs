//! The [`Notes`] behaviour and its API for operators.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::json;
use spacebot_core::{
    AgentId, Behaviour, BehaviourContext, Expect, OrgError, Record, Records, StoreError, Tool,
    WriteOutcome,
};

use crate::access::{AccessRecord, reconcile};
use crate::config::{NotesConfig, SECTION};
use crate::model::{
    Access, CONFIG_AUTHOR, DEFAULT_MAX_TEXT, NoteName, NoteSummary, NoteVersion, NotesError,
    OPERATOR,
};

/// The record namespace of the notes' texts (key: the note's name).
pub const NOTES_NAMESPACE: &str = "notes";
/// The record namespace of the notes' grants (key: the note's name; value: an [`AccessRecord`]).
pub const ACCESS_NAMESPACE: &str = "notes.access";

/// How many times a grant is tried again when another writer changed the same note's grants
/// in between (compare-and-set).
const GRANT_ATTEMPTS: usize = 32;

/// The stored value of one note version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct NoteBody {
    text: String,
}

/// What [`Notes::write_as_agent`] did: the version, and whether this call wrote it (`false`: a
/// write with the same effect key wrote it before, and nothing was written now).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Written {
    /// The version the write made (now or before).
    pub version: NoteVersion,
    /// Whether this call wrote it.
    pub fresh: bool,
}

/// Shared notes: named, versioned notes that agents read and write with the tools
/// `list_shared_notes`, `read_shared_note` and `write_shared_note`, under per-agent grants
/// ([`Access`]) checked in code on every call. Add it to an organization with
/// `OrganizationBuilder::behaviour(Arc::new(notes.clone()))` and keep the handle: it is also the
/// API for operators and the HTTP layer (cheap to clone; every clone is the same notes).
///
/// See the [crate docs](crate) for the configuration, the tools and the durability of writes.
#[derive(Clone)]
pub struct Notes {
    inner: Arc<Inner>,
}

struct Inner {
    max_text: usize,
    attached: RwLock<Option<Attached>>,
    /// The grants as last read from the store, for the tools' offers (which must answer
    /// without a store call); every tool call reads the store again.
    cache: RwLock<BTreeMap<NoteName, BTreeMap<AgentId, Access>>>,
}

#[derive(Clone)]
struct Attached {
    ctx: BehaviourContext,
    config: Arc<NotesConfig>,
}

impl fmt::Debug for Notes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notes")
            .field("max_text", &self.inner.max_text)
            .field("attached", &self.attached().is_ok())
            .finish_non_exhaustive()
    }
}

impl Default for Notes {
    fn default() -> Self {
        Self::new()
    }
}

impl Notes {
    /// Shared notes, not attached to an organization yet (the organization's build attaches
    /// them), with texts capped at [`DEFAULT_MAX_TEXT`] bytes.
    pub fn new() -> Self {
        Self::with_max_text(DEFAULT_MAX_TEXT)
    }

    /// Shared notes whose texts may be at most `max_text` bytes (a larger write is refused).
    pub fn with_max_text(max_text: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                max_text,
                attached: RwLock::new(None),
                cache: RwLock::new(BTreeMap::new()),
            }),
        }
    }

    /// The largest text accepted, in bytes.
    pub fn max_text(&self) -> usize {
        self.inner.max_text
    }

    fn attached(&self) -> Result<Attached, NotesError> {
        self.inner
            .attached
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or(NotesError::NotBuilt)
    }

    fn texts(ctx: &BehaviourContext) -> Result<Records<NoteBody>, NotesError> {
        Ok(Records::new(ctx.stores().records.clone(), NOTES_NAMESPACE)?)
    }

    fn grants(ctx: &BehaviourContext) -> Result<Records<AccessRecord>, NotesError> {
        Ok(Records::new(
            ctx.stores().records.clone(),
            ACCESS_NAMESPACE,
        )?)
    }

    // ---- the operator's API ---------------------------------------------------------------

    /// Every note: written ones, configured ones and ones someone has access to, by name.
    ///
    /// # Errors
    /// [`NotesError::NotBuilt`] before the organization was built; a store's error.
    pub async fn list(&self) -> Result<Vec<NoteSummary>, NotesError> {
        let at = self.attached()?;
        let texts = Self::texts(&at.ctx)?.list("").await?;
        let grants = self.refresh_all(&at.ctx).await?;
        let mut latest: BTreeMap<NoteName, NoteVersion> = BTreeMap::new();
        for record in texts {
            let version = to_version(record)?;
            latest.insert(version.name.clone(), version);
        }
        let names: BTreeSet<NoteName> = latest
            .keys()
            .cloned()
            .chain(grants.keys().cloned())
            .chain(at.config.notes.iter().map(|n| n.name.clone()))
            .collect();
        Ok(names
            .into_iter()
            .map(|name| NoteSummary {
                description: description(&at.config, &name),
                latest: latest.remove(&name),
                access: grants.get(&name).cloned().unwrap_or_default(),
                name,
            })
            .collect())
    }

    /// One note: its latest version, description and grants.
    ///
    /// # Errors
    /// [`NotesError::InvalidName`]; [`NotesError::NotFound`] for a note never written, not
    /// configured and granted to no one; [`NotesError::NotBuilt`]; a store's error.
    pub async fn read(&self, name: &str) -> Result<NoteSummary, NotesError> {
        let name = NoteName::parse(name)?;
        let at = self.attached()?;
        let latest = self.latest(&at.ctx, &name).await?;
        let access = self.refresh(&at.ctx, &name).await?;
        if latest.is_none() && access.is_empty() && at.config.note(&name).is_none() {
            return Err(NotesError::NotFound { name });
        }
        Ok(NoteSummary {
            description: description(&at.config, &name),
            latest,
            access,
            name,
        })
    }

    /// Every version of a note, oldest first (empty for a note known but never written).
    ///
    /// # Errors
    /// As [`Notes::read`].
    pub async fn history(&self, name: &str) -> Result<Vec<NoteVersion>, NotesError> {
        let summary = self.read(name).await?;
        let at = self.attached()?;
        Self::texts(&at.ctx)?
            .history(summary.name.as_str())
            .await?
            .into_iter()
            .map(to_version)
            .collect()
    }

    /// Writes a note as the operator ([`OPERATOR`]), compared and set: `base_version` is the
    /// version the text was based on (0 for a new note). Returns the version written.
    ///
    /// # Errors
    /// [`NotesError::Conflict`] with the current version when the note is not at
    /// `base_version` (nothing is written); [`NotesError::TooLarge`]; as [`Notes::read`].
    pub async fn write_as_operator(
        &self,
        name: &str,
        text: &str,
        base_version: u64,
    ) -> Result<NoteVersion, NotesError> {
        let name = NoteName::parse(name)?;
        let at = self.attached()?;
        let written = self
            .write(&at.ctx, &name, text, base_version, OPERATOR, None)
            .await?;
        Ok(written.version)
    }

    /// Lets `agent` read (or read and write) the note `name` (which need not exist yet). Takes
    /// effect on the agent's next tool call and its next turn's tool definitions; stored, so it
    /// survives a restart. Returns the agent's access before.
    ///
    /// # Errors
    /// [`NotesError::UnknownAgent`] for an agent not in the organization; [`NotesError::InvalidName`];
    /// [`NotesError::NotBuilt`]; a store's error.
    pub async fn grant(
        &self,
        name: &str,
        agent: &AgentId,
        access: Access,
    ) -> Result<Option<Access>, NotesError> {
        let name = NoteName::parse(name)?;
        let at = self.attached()?;
        if !at.ctx.agent_ids().contains(agent) {
            return Err(NotesError::UnknownAgent {
                agent: agent.to_string(),
            });
        }
        self.set_access(&at.ctx, &name, agent, Some(access)).await
    }

    /// Takes `agent`'s access to the note `name` away (no-op when it has none). Takes effect on
    /// the agent's next tool call; stored. Returns the agent's access before.
    ///
    /// # Errors
    /// [`NotesError::InvalidName`]; [`NotesError::NotBuilt`]; a store's error.
    pub async fn revoke(&self, name: &str, agent: &AgentId) -> Result<Option<Access>, NotesError> {
        let name = NoteName::parse(name)?;
        let at = self.attached()?;
        self.set_access(&at.ctx, &name, agent, None).await
    }

    /// Who may read or write the note `name`, as stored now.
    ///
    /// # Errors
    /// [`NotesError::InvalidName`]; [`NotesError::NotBuilt`]; a store's error.
    pub async fn access(&self, name: &str) -> Result<BTreeMap<AgentId, Access>, NotesError> {
        let name = NoteName::parse(name)?;
        let at = self.attached()?;
        self.refresh(&at.ctx, &name).await
    }

    // ---- what the tools use ---------------------------------------------------------------

    /// Whether `agent` has access to at least one note (as last read): the tools are offered to
    /// it.
    pub(crate) fn offered(&self, agent: &AgentId) -> bool {
        self.inner
            .cache
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .any(|grants| grants.contains_key(agent))
    }

    /// The notes `agent` may read (as last read), with its access.
    pub(crate) fn cached_for(&self, agent: &AgentId) -> Vec<(NoteName, Access)> {
        self.inner
            .cache
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter_map(|(name, grants)| grants.get(agent).map(|a| (name.clone(), *a)))
            .collect()
    }

    /// `agent`'s access to `name`, read from the store now.
    pub(crate) async fn access_of(
        &self,
        name: &NoteName,
        agent: &AgentId,
    ) -> Result<Option<Access>, NotesError> {
        let at = self.attached()?;
        Ok(self.refresh(&at.ctx, name).await?.get(agent).copied())
    }

    /// The notes `agent` may read, read from the store now, with their latest versions.
    pub(crate) async fn readable_by(
        &self,
        agent: &AgentId,
    ) -> Result<Vec<(NoteSummary, Access)>, NotesError> {
        Ok(self
            .list()
            .await?
            .into_iter()
            .filter_map(|n| n.access.get(agent).copied().map(|a| (n, a)))
            .collect())
    }

    /// The latest version of `name`.
    pub(crate) async fn latest_version(
        &self,
        name: &NoteName,
    ) -> Result<Option<NoteVersion>, NotesError> {
        let at = self.attached()?;
        self.latest(&at.ctx, name).await
    }

    /// Writes a note as `agent`, as `write_shared_note` does in a turn: compared and set against
    /// `base_version`, and **at most once per `effect_key`** (the tool uses the call's
    /// `ToolContext::key`): the same write again (a turn run again after a crash) writes nothing
    /// and returns the version that key wrote, with [`Written::fresh`] `false`. Does not check
    /// the agent's access (the tool does).
    ///
    /// # Errors
    /// As [`Notes::write_as_operator`].
    pub async fn write_as_agent(
        &self,
        name: &str,
        text: &str,
        base_version: u64,
        agent: &AgentId,
        effect_key: &str,
    ) -> Result<Written, NotesError> {
        let name = NoteName::parse(name)?;
        let at = self.attached()?;
        self.write(
            &at.ctx,
            &name,
            text,
            base_version,
            agent.as_str(),
            Some(effect_key),
        )
        .await
    }

    // ---- internals -------------------------------------------------------------------------

    async fn latest(
        &self,
        ctx: &BehaviourContext,
        name: &NoteName,
    ) -> Result<Option<NoteVersion>, NotesError> {
        Self::texts(ctx)?
            .get(name.as_str())
            .await?
            .map(to_version)
            .transpose()
    }

    async fn write(
        &self,
        ctx: &BehaviourContext,
        name: &NoteName,
        text: &str,
        base_version: u64,
        author: &str,
        effect_key: Option<&str>,
    ) -> Result<Written, NotesError> {
        if text.len() > self.inner.max_text {
            return Err(NotesError::TooLarge {
                name: name.clone(),
                len: text.len(),
                max: self.inner.max_text,
            });
        }
        let texts = Self::texts(ctx)?;
        let mut write = texts
            .draft(
                name.as_str(),
                &NoteBody {
                    text: text.to_owned(),
                },
                author,
            )?
            .expect(Expect::Version(base_version))
            .at(ctx.clock().now());
        if let Some(key) = effect_key {
            write = write.effect_key(key);
        }
        match texts.write(write).await? {
            WriteOutcome::Written(record) => {
                let version = to_version(record)?;
                emit(
                    ctx,
                    author,
                    "note_written",
                    json!({"name": version.name, "version": version.version, "author": version.author}),
                );
                Ok(Written {
                    version,
                    fresh: true,
                })
            }
            WriteOutcome::AlreadyApplied(record) => Ok(Written {
                version: to_version(record)?,
                fresh: false,
            }),
            WriteOutcome::Conflict { current } => Err(NotesError::Conflict {
                name: name.clone(),
                base_version,
                current: current.map(to_version).transpose()?.map(Box::new),
            }),
        }
    }

    async fn set_access(
        &self,
        ctx: &BehaviourContext,
        name: &NoteName,
        agent: &AgentId,
        access: Option<Access>,
    ) -> Result<Option<Access>, NotesError> {
        let grants = Self::grants(ctx)?;
        for _ in 0..GRANT_ATTEMPTS {
            let stored = grants.get(name.as_str()).await?;
            let (base, mut record) = match stored {
                Some(r) => (r.version, r.value),
                None => (0, AccessRecord::default()),
            };
            let previous = record.grants.get(agent).copied();
            if previous == access {
                self.cache_note(name, record.grants);
                return Ok(previous);
            }
            match access {
                Some(a) => record.grants.insert(agent.clone(), a),
                None => record.grants.remove(agent),
            };
            let write = grants
                .draft(name.as_str(), &record, OPERATOR)?
                .expect(Expect::Version(base))
                .at(ctx.clock().now());
            match grants.write(write).await? {
                WriteOutcome::Written(r) | WriteOutcome::AlreadyApplied(r) => {
                    self.cache_note(name, r.value.grants);
                    ctx.tools_changed();
                    ctx.emit(
                        agent,
                        SECTION,
                        "note_access_changed",
                        json!({"name": name, "agent": agent, "access": access, "previous": previous, "by": OPERATOR}),
                    );
                    return Ok(previous);
                }
                WriteOutcome::Conflict { .. } => continue,
            }
        }
        Err(NotesError::Store(StoreError::Invalid(
            spacebot_core::InvalidInput::new(
                "note access",
                format!(
                    "the grants of note {name} kept changing under {GRANT_ATTEMPTS} attempts; try again"
                ),
            ),
        )))
    }

    fn cache_note(&self, name: &NoteName, grants: BTreeMap<AgentId, Access>) {
        let mut cache = self
            .inner
            .cache
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let before = cache.get(name).cloned().unwrap_or_default();
        if grants.is_empty() {
            cache.remove(name);
        } else {
            cache.insert(name.clone(), grants.clone());
        }
        drop(cache);
        // Another process (or a grant written behind this handle) changed the offers: the next
        // turns render their definitions again.
        if before != grants
            && let Ok(at) = self.attached()
        {
            at.ctx.tools_changed();
        }
    }

    /// Reads one note's grants from the store and updates the cache.
    async fn refresh(
        &self,
        ctx: &BehaviourContext,
        name: &NoteName,
    ) -> Result<BTreeMap<AgentId, Access>, NotesError> {
        let grants = Self::grants(ctx)?
            .get(name.as_str())
            .await?
            .map(|r| r.value.grants)
            .unwrap_or_default();
        self.cache_note(name, grants.clone());
        Ok(grants)
    }

    /// Reads every note's grants from the store and replaces the cache.
    async fn refresh_all(
        &self,
        ctx: &BehaviourContext,
    ) -> Result<BTreeMap<NoteName, BTreeMap<AgentId, Access>>, NotesError> {
        let mut all = BTreeMap::new();
        for record in Self::grants(ctx)?.list("").await? {
            let name = NoteName::parse(record.key.clone()).map_err(|_| corrupt(&record.key))?;
            if !record.value.grants.is_empty() {
                all.insert(name, record.value.grants);
            }
        }
        let mut cache = self
            .inner
            .cache
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let changed = *cache != all;
        *cache = all.clone();
        drop(cache);
        if changed {
            ctx.tools_changed();
        }
        Ok(all)
    }

    /// At build: checks the configuration, writes configured notes' first versions, merges the
    /// configured grants into the stored ones (see [`reconcile`]) and loads the grants.
    async fn attach(&self, ctx: &BehaviourContext) -> Result<(), OrgError> {
        let config = Arc::new(NotesConfig::from_org(ctx.config(), self.inner.max_text)?);
        *self
            .inner
            .attached
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(Attached {
            ctx: ctx.clone(),
            config: config.clone(),
        });
        let store_error = |e: NotesError| match e {
            NotesError::Store(e) => OrgError::Store(e),
            other => OrgError::Store(StoreError::Invalid(spacebot_core::InvalidInput::new(
                "notes",
                other.to_string(),
            ))),
        };
        for note in &config.notes {
            if let Some(text) = &note.text {
                match self
                    .write(ctx, &note.name, text, 0, CONFIG_AUTHOR, None)
                    .await
                {
                    Ok(_) | Err(NotesError::Conflict { .. }) => {}
                    Err(e) => return Err(store_error(e)),
                }
            }
        }
        let grants = Self::grants(ctx).map_err(store_error)?;
        let mut names: BTreeSet<NoteName> = config.notes.iter().map(|n| n.name.clone()).collect();
        for record in grants.list("").await? {
            names.insert(NoteName::parse(record.key.clone()).map_err(|_| corrupt(&record.key))?);
        }
        for name in names {
            let configured = config
                .note(&name)
                .map(|n| n.access.clone())
                .unwrap_or_default();
            self.reconcile_note(ctx, &grants, &name, &configured)
                .await?;
        }
        self.refresh_all(ctx).await.map_err(store_error)?;
        ctx.tools_changed();
        Ok(())
    }

    async fn reconcile_note(
        &self,
        ctx: &BehaviourContext,
        grants: &Records<AccessRecord>,
        name: &NoteName,
        configured: &BTreeMap<AgentId, Access>,
    ) -> Result<(), StoreError> {
        for _ in 0..GRANT_ATTEMPTS {
            let stored = grants.get(name.as_str()).await?;
            let (base, record) = match stored {
                Some(r) => (r.version, r.value),
                None => (0, AccessRecord::default()),
            };
            let (next, report) = reconcile(&record, configured);
            if next != record {
                let write = grants
                    .draft(name.as_str(), &next, CONFIG_AUTHOR)?
                    .expect(Expect::Version(base))
                    .at(ctx.clock().now());
                if let WriteOutcome::Conflict { .. } = grants.write(write).await? {
                    continue;
                }
            }
            if !report.is_empty() {
                tracing::info!(
                    note = %name,
                    applied = ?report.applied,
                    kept = ?report.kept,
                    "shared note grants at start: configuration changes applied, run-time grants kept"
                );
                emit(
                    ctx,
                    OPERATOR,
                    "note_access_reconciled",
                    json!({"name": name, "applied": report.applied, "kept": report.kept}),
                );
            }
            return Ok(());
        }
        Err(StoreError::Invalid(spacebot_core::InvalidInput::new(
            "note access",
            format!("the grants of note {name} kept changing at start; build again"),
        )))
    }
}

fn description(config: &NotesConfig, name: &NoteName) -> String {
    config
        .note(name)
        .map(|n| n.description.clone())
        .unwrap_or_default()
}

fn corrupt(key: &str) -> StoreError {
    StoreError::Corrupt {
        location: format!("record {ACCESS_NAMESPACE}/{key:?}"),
        reason: "its key is not a note name".to_owned(),
    }
}

fn to_version(record: Record<NoteBody>) -> Result<NoteVersion, NotesError> {
    let name = NoteName::parse(record.key.clone()).map_err(|_| StoreError::Corrupt {
        location: format!("record {NOTES_NAMESPACE}/{:?}", record.key),
        reason: "its key is not a note name".to_owned(),
    })?;
    Ok(NoteVersion {
        name,
        version: record.version,
        text: record.value.text,
        author: record.author,
        written_at: record.written_at,
    })
}

/// Emits a notes event about the author when it is an agent id, else about [`OPERATOR`].
fn emit(ctx: &BehaviourContext, author: &str, name: &str, detail: serde_json::Value) {
    if let Ok(agent) = AgentId::parse(author).or_else(|_| AgentId::parse(OPERATOR)) {
        ctx.emit(&agent, SECTION, name, detail);
    }
}

#[async_trait]
impl Behaviour for Notes {
    fn name(&self) -> &'static str {
        SECTION
    }

    fn config_section(&self) -> Option<&'static str> {
        Some(SECTION)
    }

    fn tools(&self) -> Vec<Arc<dyn Tool>> {
        crate::tools::tools(self)
    }

    async fn on_build(&self, ctx: &BehaviourContext) -> Result<(), OrgError> {
        self.attach(ctx).await
    }
}
