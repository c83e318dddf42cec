//! Values kept typed beside a store's records, for stores owned by one process: in memory alone,
//! or in memory with an image of each value stored durably.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::error::StoreError;
use crate::fasthash::FastMap;

/// Values kept as Rust values under `(namespace, key)`, beside the records of a store owned by
/// one process (see [`RecordStore::typed_cells`]). A writer that changes one value at every step
/// (the request ledger, twice a model call) keeps it here instead of as a JSON record: no
/// decoding, no version read, no compare-and-set, one lock taken a change.
///
/// A cell is changed in place under the lock ([`update`](Self::update)): changes of one cell
/// never interleave, so the compare-and-set a record needs is not needed here. Cells are a
/// keyspace of their own: nothing in them is seen through the store's records, and the reverse.
/// A namespace's cells hold one type; a cell read or changed as another type is absent.
///
/// Cells live in memory. A durable store that is the only writer of its data (SQLite: one process
/// owns a data directory) backs them with [`CellImages`] ([`TypedCells::stored_in`]): the writer
/// of a cell stores its image (its JSON text and a revision) when it must survive a crash, loads
/// it when the cell is not in memory (after a restart, or once evicted), and may drop cells whose
/// image is stored ([`retain`](Self::retain)). The memory store's cells have no images
/// ([`images`](Self::images) is `None`): they are the value.
///
/// [`RecordStore::typed_cells`]: super::RecordStore::typed_cells
///
/// ```
/// use spacebot_core::records::TypedCells;
///
/// let cells = TypedCells::default();
/// let total = cells.update("counters", "calls", |n: &mut Option<u64>| {
///     *n.get_or_insert(0) += 2;
///     n.unwrap_or_default()
/// });
/// assert_eq!(total, 2);
/// assert_eq!(cells.read("counters", "calls", |n: Option<&u64>| n.copied()), Some(2));
/// assert_eq!(cells.read("counters", "other", |n: Option<&u64>| n.copied()), None);
/// ```
#[derive(Default)]
pub struct TypedCells {
    namespaces: Mutex<Namespaces>,
    images: Option<Arc<dyn CellImages>>,
}

/// The stored image of a typed cell: its value as JSON text, and its revision (one more at every
/// change the writer stores; an image never replaces a later one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellImage {
    /// The cell's namespace.
    pub namespace: String,
    /// The cell's key.
    pub key: String,
    /// The revision: an image is stored only over an older one (a lower revision) or none.
    pub revision: u64,
    /// The value, as JSON text.
    pub value: String,
}

/// Where a store owned by one process keeps the images of its [`TypedCells`] durably.
///
/// Each image is one row keyed by `(namespace, key)`, replaced in place: no version history is
/// kept (a store's records keep theirs).
#[async_trait]
pub trait CellImages: Send + Sync + fmt::Debug {
    /// The stored image of `(namespace, key)`: its revision and value. A store may answer a value
    /// it held before it had cells (the latest record at the same address, revision 0), so that
    /// a writer that moved from records to cells reads what it wrote before.
    ///
    /// # Errors
    /// As the store.
    async fn load(&self, namespace: &str, key: &str) -> Result<Option<(u64, String)>, StoreError>;

    /// Stores `images` in one commit (synced as the store's other writes issued at the same point:
    /// see [`durability`](crate::durability)). An image whose revision is not above the stored
    /// one's is left out. When it fails, some images may have been stored (each one whole).
    ///
    /// # Errors
    /// As the store.
    async fn store(&self, images: Vec<CellImage>) -> Result<(), StoreError>;
}

/// Namespace -> key -> the value, boxed as `Option<T>`.
type Namespaces = FastMap<String, FastMap<String, Box<dyn Any + Send>>>;

impl fmt::Debug for TypedCells {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let namespaces = self.lock();
        f.debug_map()
            .entries(namespaces.iter().map(|(ns, cells)| (ns, cells.len())))
            .finish()
    }
}

impl TypedCells {
    /// Cells whose images are stored in `images` (see [`CellImages`]).
    pub fn stored_in(images: Arc<dyn CellImages>) -> Self {
        Self {
            namespaces: Mutex::default(),
            images: Some(images),
        }
    }

    /// Where the cells' images are stored: `None` for cells that are the value themselves (the
    /// memory store's).
    pub fn images(&self) -> Option<&dyn CellImages> {
        self.images.as_deref()
    }

    /// How many cells `namespace` holds in memory.
    pub fn len(&self, namespace: &str) -> usize {
        self.lock().get(namespace).map_or(0, FastMap::len)
    }

    /// Whether `namespace` holds no cell in memory.
    pub fn is_empty(&self, namespace: &str) -> bool {
        self.len(namespace) == 0
    }

    /// Keeps in memory the cells of `namespace` of type `T` for which `keep` answers `true`, and
    /// drops the others (cells of another type are kept). For stored cells: drop only cells whose
    /// latest change is stored; a dropped cell is loaded again from its image when next needed.
    pub fn retain<T: 'static>(&self, namespace: &str, mut keep: impl FnMut(&str, &T) -> bool) {
        let mut namespaces = self.lock();
        if let Some(cells) = namespaces.get_mut(namespace) {
            cells.retain(|key, cell| match cell.downcast_ref::<Option<T>>() {
                Some(Some(value)) => keep(key, value),
                _ => true,
            });
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Namespaces> {
        self.namespaces.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `change` on the value of `(namespace, key)` (`None` when absent), under the lock, and
    /// answers what it answers. A value it leaves `Some` is kept; `None`, the cell is removed.
    pub fn update<T: Send + 'static, R>(
        &self,
        namespace: &str,
        key: &str,
        change: impl FnOnce(&mut Option<T>) -> R,
    ) -> R {
        let mut namespaces = self.lock();
        if let Some(cells) = namespaces.get_mut(namespace)
            && let Some(cell) = cells.get_mut(key)
            && let Some(value) = cell.downcast_mut::<Option<T>>()
        {
            let answer = change(value);
            if value.is_none() {
                cells.remove(key);
            }
            return answer;
        }
        let mut value: Option<T> = None;
        let answer = change(&mut value);
        if value.is_some() {
            let value: Box<dyn Any + Send> = Box::new(value);
            // The namespace's text is copied once, when its first cell is made.
            match namespaces.get_mut(namespace) {
                Some(cells) => {
                    cells.insert(key.to_owned(), value);
                }
                None => {
                    let mut cells = FastMap::default();
                    cells.insert(key.to_owned(), value);
                    namespaces.insert(namespace.to_owned(), cells);
                }
            }
        }
        answer
    }

    /// Answers `read(the value of (namespace, key))`, under the lock.
    pub fn read<T: 'static, R>(
        &self,
        namespace: &str,
        key: &str,
        read: impl FnOnce(Option<&T>) -> R,
    ) -> R {
        let namespaces = self.lock();
        let value = namespaces
            .get(namespace)
            .and_then(|cells| cells.get(key))
            .and_then(|cell| cell.downcast_ref::<Option<T>>())
            .and_then(Option::as_ref);
        read(value)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_cell_is_changed_in_place_removed_when_left_empty_and_typed() {
        let cells = TypedCells::default();
        // Left `None`: nothing kept.
        cells.update("ns", "k", |v: &mut Option<String>| assert!(v.is_none()));
        assert_eq!(cells.read("ns", "k", |v: Option<&String>| v.cloned()), None);
        cells.update("ns", "k", |v: &mut Option<String>| *v = Some("a".into()));
        cells.update("ns", "k", |v: &mut Option<String>| {
            v.as_mut().unwrap().push('b');
        });
        assert_eq!(
            cells.read("ns", "k", |v: Option<&String>| v.cloned()),
            Some("ab".into())
        );
        // Namespaces and keys are separate.
        assert_eq!(
            cells.read("other", "k", |v: Option<&String>| v.cloned()),
            None
        );
        assert_eq!(
            cells.read("ns", "k2", |v: Option<&String>| v.cloned()),
            None
        );
        // Another type: absent, and replaced if written.
        assert_eq!(cells.read("ns", "k", |v: Option<&u64>| v.copied()), None);
        cells.update("ns", "k", |v: &mut Option<u64>| {
            assert!(v.is_none());
            *v = Some(7);
        });
        assert_eq!(cells.read("ns", "k", |v: Option<&u64>| v.copied()), Some(7));
        assert_eq!(cells.read("ns", "k", |v: Option<&String>| v.cloned()), None);
        // Emptied: removed.
        cells.update("ns", "k", |v: &mut Option<u64>| *v = None);
        assert_eq!(cells.read("ns", "k", |v: Option<&u64>| v.copied()), None);
        assert_eq!(format!("{cells:?}"), r#"{"ns": 0}"#);
    }

    #[test]
    fn changes_of_one_cell_from_many_threads_never_interleave() {
        let cells = std::sync::Arc::new(TypedCells::default());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let cells = cells.clone();
                std::thread::spawn(move || {
                    for _ in 0..1_000 {
                        cells.update("ns", "n", |v: &mut Option<u64>| {
                            let read = v.unwrap_or(0);
                            std::hint::black_box(&read);
                            *v = Some(read + 1);
                        });
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(
            cells.read("ns", "n", |v: Option<&u64>| v.copied()),
            Some(4_000)
        );
    }
}
