//! Opening a file: creating it, refusing foreign or damaged ones, and checking the schema version.

use std::fs;
use std::io::{ErrorKind, Read};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use redb::{Builder, Database, ReadableDatabase, TableDefinition, TableHandle};
use spacebot_core::{AgentId, StoreError};

use crate::backend::{FileStorage, ScratchStorage};
use crate::options::RedbOptions;

/// The schema version this code writes and reads. A file with a higher version is refused.
pub const SCHEMA_VERSION: u64 = 1;

/// The `format` value of every file this backend writes.
pub(crate) const FORMAT: &str = "spacebot-redb";

/// `format`, `kind`, `schema_version` and (agent files) `agent`.
pub(crate) const META: TableDefinition<&str, &str> = TableDefinition::new("spacebot_meta");

/// Which file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FileKind {
    /// `{dir}/instance.redb`.
    Instance,
    /// `{dir}/agents/{id}/spacebot.redb`.
    Agent(AgentId),
}

impl FileKind {
    fn kind(&self) -> &'static str {
        match self {
            Self::Instance => "instance",
            Self::Agent(_) => "agent",
        }
    }

    /// A short name for the file's thread.
    pub(crate) fn label(&self) -> String {
        match self {
            Self::Instance => "instance".into(),
            Self::Agent(id) => format!("agent {id}"),
        }
    }
}

/// A failure that may have to be reported to several callers (every operation of a batch).
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    corrupt: bool,
    /// An I/O error of the storage: redb refuses every later operation on that handle, so the
    /// file must be reopened.
    io: bool,
    location: String,
    message: String,
}

impl Failure {
    /// The file is damaged, foreign or too new.
    pub(crate) fn corrupt(path: &Path, reason: impl Into<String>) -> Self {
        Self {
            corrupt: true,
            io: false,
            location: path.display().to_string(),
            message: reason.into(),
        }
    }

    /// Any other failure about `path`.
    pub(crate) fn backend(path: &Path, message: impl Into<String>) -> Self {
        Self {
            corrupt: false,
            io: false,
            location: path.display().to_string(),
            message: message.into(),
        }
    }

    /// Classifies a redb error raised while doing `what` on `path`.
    pub(crate) fn from_redb(path: &Path, what: &str, e: redb::Error) -> Self {
        match &e {
            redb::Error::Corrupted(reason) => Self::corrupt(path, reason.clone()),
            redb::Error::UpgradeRequired(v) => Self::corrupt(
                path,
                format!("written in redb file format {v}, which this version of redb cannot read"),
            ),
            redb::Error::TableTypeMismatch { .. }
            | redb::Error::TableIsMultimap(_)
            | redb::Error::TableIsNotMultimap(_)
            | redb::Error::TypeDefinitionChanged { .. } => Self::corrupt(
                path,
                format!("a table does not have the spacebot layout: {e}"),
            ),
            redb::Error::Io(io) if io.kind() == ErrorKind::UnexpectedEof => {
                Self::corrupt(path, format!("the file is truncated: {io}"))
            }
            redb::Error::Io(io) if io.kind() == ErrorKind::InvalidData => {
                Self::corrupt(path, io.to_string())
            }
            redb::Error::DatabaseAlreadyOpen => Self::backend(
                path,
                "the file is already open (by another process, or another handle in this one)",
            ),
            redb::Error::Io(_) | redb::Error::PreviousIo => Self {
                io: true,
                ..Self::backend(path, format!("{what}: {e}"))
            },
            _ => Self::backend(path, format!("{what}: {e}")),
        }
    }

    /// Whether the storage failed (the handle is unusable until the file is reopened).
    pub(crate) fn is_io(&self) -> bool {
        self.io
    }

    /// This failure, as the reason a reopen was needed, followed by why the reopen failed.
    pub(crate) fn reopen_failed(&self, reopen: &Failure) -> Self {
        Self {
            message: format!(
                "the file could not be reopened after an I/O error ({}): {}",
                self.message, reopen.message
            ),
            ..reopen.clone()
        }
    }

    /// The error to hand to a caller.
    pub(crate) fn to_error(&self) -> StoreError {
        if self.corrupt {
            StoreError::Corrupt {
                location: self.location.clone(),
                reason: self.message.clone(),
            }
        } else {
            StoreError::Backend {
                backend: "redb",
                message: format!("{}: {}", self.location, self.message),
                source: None,
            }
        }
    }
}

/// The first bytes of every redb file.
const REDB_MAGIC: [u8; 9] = [b'r', b'e', b'd', b'b', 0x1A, 0x0A, 0xA9, 0x0D, 0x0A];

/// Opens (or creates) the file at `path` and checks that it is a spacebot file of `kind` with a
/// schema this code knows. Never writes to a file that fails the checks.
pub(crate) fn open_database(
    path: &Path,
    kind: &FileKind,
    options: &RedbOptions,
) -> Result<Database, Failure> {
    let mut builder = Builder::new();
    builder
        .set_cache_size(options.cache_size)
        .set_check_integrity_on_open(options.verify_on_open);
    let existing = match fs::metadata(path) {
        Ok(meta) if !meta.is_file() => {
            return Err(Failure::backend(path, "exists and is not a regular file"));
        }
        Ok(meta) => meta.len() > 0,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).map_err(|e| {
                    Failure::backend(path, format!("cannot create {}: {e}", parent.display()))
                })?;
            }
            false
        }
        Err(e) => return Err(Failure::backend(path, format!("cannot read metadata: {e}"))),
    };
    if !existing {
        // A new file is made whole under a temporary name, then renamed into place: a process
        // killed while creating it leaves no half-made file that a later open would refuse.
        create_atomically(&builder, path, kind)?;
    }
    precheck(&builder, path, kind)?;
    // The check above verified the checksums (and recovered the file, in memory); the directory's
    // lock keeps anyone else from changing it since.
    builder.set_check_integrity_on_open(false);
    let storage =
        FileStorage::open(path, false).map_err(|e| Failure::from_redb(path, "open", e.into()))?;
    // redb may panic on a file damaged outside it when not verifying; never let that take the
    // caller down.
    let opened = catch_unwind(AssertUnwindSafe(|| builder.create_with_backend(storage)));
    let db = match opened {
        Ok(Ok(db)) => db,
        Ok(Err(e)) => return Err(Failure::from_redb(path, "open", e.into())),
        Err(_) => return Err(Failure::corrupt(path, "redb could not read the file")),
    };
    if check_meta(&db, path, kind)? == Meta::Missing {
        init(&db, path, kind)?;
    }
    Ok(db)
}

/// Creates `path` as a new, initialized database: built at `{path}.creating`, synced, then renamed
/// into place (and the directory synced).
fn create_atomically(builder: &Builder, path: &Path, kind: &FileKind) -> Result<(), Failure> {
    let tmp = path.with_extension("creating");
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(Failure::backend(&tmp, format!("cannot remove: {e}"))),
    }
    {
        let storage = FileStorage::open(&tmp, true)
            .map_err(|e| Failure::from_redb(&tmp, "create", e.into()))?;
        let db = match catch_unwind(AssertUnwindSafe(|| builder.create_with_backend(storage))) {
            Ok(Ok(db)) => db,
            Ok(Err(e)) => return Err(Failure::from_redb(&tmp, "create", e.into())),
            Err(_) => return Err(Failure::corrupt(&tmp, "redb could not create the file")),
        };
        init(&db, &tmp, kind)?;
    }
    fs::rename(&tmp, path)
        .map_err(|e| Failure::backend(path, format!("cannot move the new file into place: {e}")))?;
    if let Some(parent) = path.parent()
        && let Ok(dir) = fs::File::open(parent)
    {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// Checks an existing file without ever writing to it, so that a file that is not ours, or is
/// damaged, is refused untouched: first its magic number, then a full open (with the crash
/// recovery and checksum verification it needs) of a copy-on-write view whose writes stay in
/// memory.
fn precheck(builder: &Builder, path: &Path, kind: &FileKind) -> Result<(), Failure> {
    let mut magic = Vec::with_capacity(REDB_MAGIC.len());
    fs::File::open(path)
        .and_then(|f| f.take(REDB_MAGIC.len() as u64).read_to_end(&mut magic))
        .map_err(|e| Failure::backend(path, format!("cannot read the file header: {e}")))?;
    if magic != REDB_MAGIC {
        return Err(Failure::corrupt(
            path,
            "not a redb file (its first bytes are not redb's magic number): refusing to touch it",
        ));
    }
    let scratch =
        ScratchStorage::open(path).map_err(|e| Failure::from_redb(path, "open", e.into()))?;
    match catch_unwind(AssertUnwindSafe(|| builder.create_with_backend(scratch))) {
        Ok(Ok(db)) => {
            check_meta(&db, path, kind)?;
            Ok(())
        }
        Ok(Err(e)) => Err(Failure::from_redb(path, "open", e.into())),
        Err(_) => Err(Failure::corrupt(path, "redb could not read the file")),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Meta {
    /// A new, empty file: to initialize.
    Missing,
    /// Ours, of the right kind and a known version.
    Valid,
}

fn check_meta(db: &impl ReadableDatabase, path: &Path, kind: &FileKind) -> Result<Meta, Failure> {
    let err = |what: &'static str| move |e: redb::Error| Failure::from_redb(path, what, e);
    let read = db.begin_read().map_err(|e| err("read")(e.into()))?;
    let tables: Vec<String> = read
        .list_tables()
        .map_err(|e| err("list tables")(e.into()))?
        .map(|t| t.name().to_string())
        .collect();
    if !tables.iter().any(|t| t == META.name()) {
        if !tables.is_empty() {
            return Err(Failure::corrupt(
                path,
                format!(
                    "a redb file without the spacebot schema (its tables: {})",
                    tables.join(", ")
                ),
            ));
        }
        return Ok(Meta::Missing);
    }
    let meta = read
        .open_table(META)
        .map_err(|e| err("open the schema table")(e.into()))?;
    let get = |key: &str| -> Result<Option<String>, Failure> {
        Ok(meta
            .get(key)
            .map_err(|e| err("read the schema table")(e.into()))?
            .map(|v| v.value().to_string()))
    };
    if get("format")?.as_deref() != Some(FORMAT) {
        return Err(Failure::corrupt(
            path,
            format!("not a {FORMAT} file (format {:?})", get("format")?),
        ));
    }
    let version = get("schema_version")?.unwrap_or_default();
    let version: u64 = version
        .parse()
        .map_err(|_| Failure::corrupt(path, format!("unreadable schema version {version:?}")))?;
    if version > SCHEMA_VERSION {
        return Err(Failure::corrupt(
            path,
            format!(
                "schema version {version} is newer than this code knows ({SCHEMA_VERSION}); upgrade spacebot-redb"
            ),
        ));
    }
    let found = get("kind")?.unwrap_or_default();
    if found != kind.kind() {
        return Err(Failure::corrupt(
            path,
            format!(
                "a spacebot {found} file where an {} file belongs",
                kind.kind()
            ),
        ));
    }
    if let FileKind::Agent(agent) = kind {
        let owner = get("agent")?.unwrap_or_default();
        if owner != agent.as_str() {
            return Err(Failure::corrupt(
                path,
                format!("belongs to agent {owner:?}, not {agent}"),
            ));
        }
    }
    Ok(Meta::Valid)
}

fn init(db: &Database, path: &Path, kind: &FileKind) -> Result<(), Failure> {
    let err = |what: &'static str| move |e: redb::Error| Failure::from_redb(path, what, e);
    let tx = db.begin_write().map_err(|e| err("initialize")(e.into()))?;
    {
        let mut meta = tx
            .open_table(META)
            .map_err(|e| err("initialize")(e.into()))?;
        let version = SCHEMA_VERSION.to_string();
        let mut put = |k: &str, v: &str| -> Result<(), Failure> {
            meta.insert(k, v)
                .map(|_| ())
                .map_err(|e| err("initialize")(e.into()))
        };
        put("format", FORMAT)?;
        put("kind", kind.kind())?;
        put("schema_version", &version)?;
        if let FileKind::Agent(agent) = kind {
            put("agent", agent.as_str())?;
        }
    }
    crate::tables::create_all(&tx, kind).map_err(|e| err("initialize")(e))?;
    tx.commit().map_err(|e| err("initialize")(e.into()))
}

/// Maps a redb error raised inside an operation on `path`.
pub(crate) fn store_err(path: &Path, what: &str, e: impl Into<redb::Error>) -> StoreError {
    Failure::from_redb(path, what, e.into()).to_error()
}
