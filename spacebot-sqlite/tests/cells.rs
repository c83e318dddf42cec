//! The record store's typed cells and their images in `instance.db` (table `cells`): how many
//! images one write stores, which image wins, what a cell never stored reads, and the request
//! ledger kept there across a close and a reopen of the data directory.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use spacebot_core::limits::{CallEstimate, Limits, NAMESPACE, RequestLedger, Spend};
use spacebot_core::records::{CellImage, RecordStore, RecordWrite};
use spacebot_core::{EnvelopeId, Timestamp};
use spacebot_sqlite::{SqliteOptions, SqliteStores};

fn image(key: &str, revision: u64, value: &str) -> CellImage {
    CellImage {
        namespace: "test.cells".into(),
        key: key.into(),
        revision,
        value: value.into(),
    }
}

async fn load(stores: &SqliteStores, key: &str) -> Option<(u64, String)> {
    let records = stores.records();
    let images = records.typed_cells().unwrap().images().unwrap();
    images.load("test.cells", key).await.unwrap()
}

async fn store(stores: &SqliteStores, batch: Vec<CellImage>) {
    let records = stores.records();
    let images = records.typed_cells().unwrap().images().unwrap();
    images.store(batch).await.unwrap();
}

/// Every image of a write is stored, whatever their number (the store writes them by 32, by 8
/// and one by one).
#[tokio::test]
async fn every_image_of_a_write_is_stored_whatever_their_number() {
    let stores = SqliteStores::temporary().await.unwrap();
    let mut first = 0;
    for n in [1usize, 7, 8, 9, 32, 33, 41, 100] {
        let batch: Vec<CellImage> = (first..first + n)
            .map(|i| image(&format!("k{i}"), 1, &format!("{{\"n\":{i}}}")))
            .collect();
        store(&stores, batch).await;
        for i in first..first + n {
            assert_eq!(
                load(&stores, &format!("k{i}")).await,
                Some((1, format!("{{\"n\":{i}}}"))),
                "image {i} of a write of {n}"
            );
        }
        first += n;
    }
    assert_eq!(load(&stores, "never").await, None);
}

/// An image replaces only an older one (a lower revision): a late write of an earlier change
/// never takes a cell back.
#[tokio::test]
async fn an_image_replaces_only_an_older_one() {
    let stores = SqliteStores::temporary().await.unwrap();
    store(&stores, vec![image("k", 2, "\"two\"")]).await;
    store(&stores, vec![image("k", 1, "\"one\"")]).await;
    assert_eq!(load(&stores, "k").await, Some((2, "\"two\"".into())));
    store(&stores, vec![image("k", 2, "\"again\"")]).await;
    assert_eq!(load(&stores, "k").await, Some((2, "\"two\"".into())));
    store(&stores, vec![image("k", 3, "\"three\"")]).await;
    assert_eq!(load(&stores, "k").await, Some((3, "\"three\"".into())));
}

/// A cell never stored reads the latest record at its address (what a writer stored before it
/// kept cells), as revision 0; once stored, its image.
#[tokio::test]
async fn a_cell_never_stored_reads_the_record_at_its_address() {
    let stores = SqliteStores::temporary().await.unwrap();
    let records = stores.records();
    for n in [1, 2] {
        records
            .write(RecordWrite::new(
                "test.cells",
                "k",
                serde_json::json!({ "n": n }),
                "t",
            ))
            .await
            .unwrap();
    }
    assert_eq!(load(&stores, "k").await, Some((0, r#"{"n":2}"#.into())));
    store(&stores, vec![image("k", 1, r#"{"n":3}"#)]).await;
    assert_eq!(load(&stores, "k").await, Some((1, r#"{"n":3}"#.into())));
    // The records are left as they were.
    assert_eq!(
        records.get("test.cells", "k").await.unwrap().unwrap().value,
        serde_json::json!({ "n": 2 })
    );
}

fn estimate(input: u64, max_output: u64) -> CallEstimate {
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

fn ledger(stores: &SqliteStores) -> RequestLedger {
    RequestLedger::new(Arc::new(stores.records()))
}

/// The ledger on SQLite keeps its entries in cells: a reservation is stored before it answers
/// (a close without a flush, as a kill, keeps it counted); a settlement made behind is stored
/// by the flush; the directory reopened right after its close reads both; an entry an earlier
/// release stored as a record is read, then carried on as a cell.
#[tokio::test]
async fn the_ledger_reads_what_it_stored_after_the_directory_is_reopened() {
    let dir = tempfile::tempdir().unwrap();
    let limits = Limits {
        total_tokens: Some(1_000),
        ..Limits::NONE
    };
    let request = EnvelopeId::new("req-1");
    let old = EnvelopeId::new("req-old");
    {
        let stores = SqliteOptions::new().open(dir.path()).await.unwrap();
        // As an earlier release stored a request's spend: a record.
        stores
            .records()
            .write(RecordWrite::new(
                NAMESPACE,
                old.as_str(),
                serde_json::json!({ "started_at": 1, "settled": { "total_tokens": 40 } }),
                "limits",
            ))
            .await
            .unwrap();
        let l = ledger(&stores);
        l.reserve(&request, "c1", &estimate(100, 200), &limits, Timestamp(2))
            .await
            .unwrap()
            .unwrap();
        // Not in the records: in the cells.
        assert!(
            stores
                .records()
                .get(NAMESPACE, request.as_str())
                .await
                .unwrap()
                .is_none()
        );
        stores.close().await;
    }
    {
        let stores = SqliteOptions::new().open(dir.path()).await.unwrap();
        let l = ledger(&stores);
        let entry = l.get(&request).await.unwrap().unwrap();
        assert_eq!(entry.committed().total_tokens, 300, "{entry:?}");
        assert!(l.settle_behind(&request, "c1", tokens(150)));
        l.flush_all(Timestamp(3)).await.unwrap();
        // The old request: its record, then a reservation on top of it, as a cell.
        assert_eq!(l.get(&old).await.unwrap().unwrap().settled.total_tokens, 40);
        l.reserve(&old, "c9", &estimate(10, 10), &limits, Timestamp(3))
            .await
            .unwrap()
            .unwrap();
        stores.close().await;
    }
    let stores = SqliteOptions::new().open(dir.path()).await.unwrap();
    let l = ledger(&stores);
    let entry = l.get(&request).await.unwrap().unwrap();
    assert_eq!(
        (entry.settled.total_tokens, entry.reserved.len()),
        (150, 0),
        "{entry:?}"
    );
    let old_entry = l.get(&old).await.unwrap().unwrap();
    assert_eq!(
        (
            old_entry.settled.total_tokens,
            old_entry.committed().total_tokens
        ),
        (40, 60),
        "{old_entry:?}"
    );
    stores.close().await;
}
