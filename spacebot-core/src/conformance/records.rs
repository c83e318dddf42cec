//! [`RecordStore`] conformance.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;

use futures::future::join_all;
use serde_json::{Value, json};

use super::support::{ConformanceError, UNUSUAL_TEXT, ensure, ensure_eq, ensure_err, ok};
use crate::error::StoreError;
use crate::records::{
    Expect, MAX_KEY_LEN, MAX_NAMESPACE_LEN, MAX_VALUE_LEN, Record, RecordStore, RecordWrite,
    WriteOutcome, WriteReceipt,
};
use crate::time::Timestamp;

#[doc(hidden)]
#[macro_export]
macro_rules! __record_store_tests {
    ($module:ident, $make:expr, |$s:ident| $access:expr) => {
        $crate::__conformance_module!(
            $module,
            $make,
            |$s| $access,
            [
                record_store_first_write,
                record_store_compare_and_set,
                record_store_write_receipt,
                record_store_replacing,
                record_store_absent,
                record_store_effect_key_applies_once,
                record_store_history_order,
                record_store_list_by_prefix,
                record_store_namespaces_isolated,
                record_store_concurrent_writers,
                record_store_round_trip,
                record_store_invalid_input,
            ]
        );
    };
}

const NS: &str = "notes";
const OTHER_NS: &str = "notes2";

async fn ensure_empty(
    store: &dyn RecordStore,
    namespaces: &[&str],
) -> Result<(), ConformanceError> {
    for ns in namespaces {
        let all = ok!(store.list(ns, ""));
        ensure!(
            all.is_empty(),
            "the suite needs a fresh, empty record store; namespace {ns} holds {} keys",
            all.len()
        );
    }
    Ok(())
}

fn put(ns: &str, key: &str, value: Value, at: i64) -> RecordWrite {
    RecordWrite::new(ns, key, value, "agent-a").at(Timestamp(at))
}

/// The record a write is expected to make as `version`.
fn made(write: &RecordWrite, version: u64) -> Record {
    write.clone().into_record(version)
}

async fn written(store: &dyn RecordStore, write: RecordWrite) -> Result<Record, ConformanceError> {
    let expected = write.clone();
    match store.write(write).await {
        Ok(WriteOutcome::Written(r)) => Ok(r),
        other => Err(ConformanceError::check(
            "outcome is Written",
            format!(
                "write of {}/{} expecting {}: found {other:?}",
                expected.namespace, expected.key, expected.expect
            ),
            concat!(file!(), ":", line!()),
        )),
    }
}

/// The first write of a key is version 1 with the write's value, author and time; `get`,
/// `version` and `history` return it; other versions and keys are `None`.
pub async fn record_store_first_write(store: &dyn RecordStore) -> Result<(), ConformanceError> {
    ensure_empty(store, &[NS]).await?;
    ensure_eq!(ok!(store.get(NS, "plan")), None, "get before any write");
    ensure_eq!(
        ok!(store.history(NS, "plan")),
        vec![],
        "history before any write"
    );
    let w = RecordWrite::new(NS, "plan", json!({"text": "ship it", "n": 1}), "alice")
        .at(Timestamp(1_000));
    let r = written(store, w.clone()).await?;
    ensure_eq!(
        r,
        made(&w, 1),
        "the written record is version 1 of the write"
    );
    ensure_eq!(
        ok!(store.get(NS, "plan")),
        Some(r.clone()),
        "get after the write"
    );
    ensure_eq!(
        ok!(store.version(NS, "plan", 1)),
        Some(r.clone()),
        "version 1"
    );
    ensure_eq!(
        ok!(store.version(NS, "plan", 0)),
        None,
        "version 0 is never a record"
    );
    ensure_eq!(
        ok!(store.version(NS, "plan", 2)),
        None,
        "version 2 is not written"
    );
    ensure_eq!(
        ok!(store.version(NS, "plan", u64::MAX)),
        None,
        "the largest version number"
    );
    ensure_eq!(ok!(store.history(NS, "plan")), vec![r.clone()], "history");
    ensure_eq!(ok!(store.get(NS, "plan2")), None, "another key");
    ensure_eq!(ok!(store.list(NS, "")), vec![r], "list");
    Ok(())
}

/// `Expect::Version(n)` writes only over version `n` and `Expect::Any` over anything; a failed
/// expectation is a `Conflict` carrying the latest record, and writes nothing.
pub async fn record_store_compare_and_set(store: &dyn RecordStore) -> Result<(), ConformanceError> {
    ensure_empty(store, &[NS]).await?;
    let v1 = written(store, put(NS, "k", json!(1), 10)).await?;
    let w2 = put(NS, "k", json!(2), 20).expect(Expect::Version(1));
    let v2 = written(store, w2.clone()).await?;
    ensure_eq!(
        v2,
        made(&w2, 2),
        "a write over the expected version is the next version"
    );
    for (expect, what) in [
        (Expect::Version(1), "a stale version"),
        (Expect::Version(3), "a version not written yet"),
        (Expect::Version(0), "version 0 (absent) on a written key"),
    ] {
        let outcome = ok!(store.write(put(NS, "k", json!("lost"), 30).expect(expect)));
        ensure_eq!(
            outcome,
            WriteOutcome::Conflict {
                current: Some(v2.clone())
            },
            "{what}: a conflict carrying the latest record"
        );
    }
    ensure_eq!(
        ok!(store.history(NS, "k")),
        vec![v1.clone(), v2.clone()],
        "conflicting writes write nothing"
    );
    let outcome = ok!(store.write(put(NS, "never", json!(0), 30).expect(Expect::Version(1))));
    ensure_eq!(
        outcome,
        WriteOutcome::Conflict { current: None },
        "expecting a version of a key never written"
    );
    ensure_eq!(
        ok!(store.get(NS, "never")),
        None,
        "nothing written on a conflict"
    );
    let w3 = put(NS, "k", json!(3), 40).expect(Expect::Any);
    let v3 = written(store, w3.clone()).await?;
    ensure_eq!(v3, made(&w3, 3), "Any writes over whatever is there");
    let w4 = put(NS, "k", json!(4), 50).expect(Expect::Version(3));
    ensure_eq!(
        written(store, w4.clone()).await?,
        made(&w4, 4),
        "version 3 -> 4"
    );
    ensure_eq!(
        ok!(store.get(NS, "k")).map(|r| r.version),
        Some(4),
        "latest"
    );
    let fresh = put(NS, "fresh", json!("new"), 60).expect(Expect::Version(0));
    ensure_eq!(
        written(store, fresh.clone()).await?,
        made(&fresh, 1),
        "Version(0) writes a key never written"
    );
    Ok(())
}

/// `write_receipt` makes the same writes as `write`: a write that happens is answered by its
/// version and stored as `write` would store it; a refusal and an effect key applied before are
/// answered as `write` answers them.
pub async fn record_store_write_receipt(store: &dyn RecordStore) -> Result<(), ConformanceError> {
    ensure_empty(store, &[NS]).await?;
    let w1 = put(NS, "r", json!({"n": 1}), 10)
        .expect(Expect::Absent)
        .effect_key("receipt-1");
    ensure_eq!(
        ok!(store.write_receipt(w1.clone())),
        WriteReceipt::Written(1),
        "a first write is version 1"
    );
    let v1 = made(&w1, 1);
    ensure_eq!(ok!(store.get(NS, "r")), Some(v1.clone()), "stored whole");
    let w2 = put(NS, "r", json!({"n": 2}), 20).expect(Expect::Version(1));
    ensure_eq!(
        ok!(store.write_receipt(w2.clone())),
        WriteReceipt::Written(2),
        "over the expected version"
    );
    let v2 = made(&w2, 2);
    ensure_eq!(
        ok!(store.write_receipt(put(NS, "r", json!("lost"), 30).expect(Expect::Version(1)))),
        WriteReceipt::Conflict {
            current: Some(v2.clone())
        },
        "a stale version: a conflict carrying the latest record"
    );
    ensure_eq!(
        ok!(store.write_receipt(w1)),
        WriteReceipt::AlreadyApplied(v1.clone()),
        "an effect key applied before"
    );
    ensure_eq!(
        ok!(store.history(NS, "r")),
        vec![v1, v2],
        "the refused and repeated writes wrote nothing"
    );
    ensure_err!(
        store
            .write_receipt(RecordWrite::new(NS, "", json!(1), "a"))
            .await,
        StoreError::Invalid(_),
        "an empty key is refused as by write"
    );
    Ok(())
}

/// A replacing write takes the place of the latest version (no longer kept: not in the history,
/// not found by `version`), unless that version carries an effect key; versions count up and
/// compare-and-set works alike; racing replacing writers each write one version, and one is
/// left.
pub async fn record_store_replacing(store: &dyn RecordStore) -> Result<(), ConformanceError> {
    ensure_empty(store, &[NS]).await?;
    let w1 = put(NS, "run", json!(1), 10)
        .expect(Expect::Absent)
        .replacing();
    let v1 = written(store, w1.clone()).await?;
    ensure_eq!(v1, made(&w1, 1), "a first replacing write is version 1");
    let w2 = put(NS, "run", json!(2), 20)
        .expect(Expect::Version(1))
        .replacing();
    let v2 = written(store, w2.clone()).await?;
    ensure_eq!(v2, made(&w2, 2), "the next version");
    ensure_eq!(
        ok!(store.history(NS, "run")),
        vec![v2.clone()],
        "version 1 replaced"
    );
    ensure_eq!(
        ok!(store.version(NS, "run", 1)),
        None,
        "a replaced version is gone"
    );
    ensure_eq!(ok!(store.get(NS, "run")), Some(v2.clone()), "get");
    ensure_eq!(
        ok!(store.write(
            put(NS, "run", json!("lost"), 25)
                .expect(Expect::Version(1))
                .replacing()
        )),
        WriteOutcome::Conflict {
            current: Some(v2.clone())
        },
        "a stale version is refused, as without replacing"
    );
    ensure_eq!(
        ok!(store.history(NS, "run")),
        vec![v2.clone()],
        "the refusal changed nothing"
    );
    // A version written without replacing is added; a replacing write after it replaces it alone.
    let v3 = written(
        store,
        put(NS, "run", json!(3), 30).expect(Expect::Version(2)),
    )
    .await?;
    let v4 = written(store, put(NS, "run", json!(4), 40).replacing()).await?;
    ensure_eq!(v4.version, 4, "versions count up");
    ensure_eq!(
        ok!(store.history(NS, "run")),
        vec![v2.clone(), v4.clone()],
        "version 3 replaced, version 2 kept"
    );
    ensure_eq!(ok!(store.version(NS, "run", 3)), None, "version 3 is gone");
    drop(v3);
    ensure_eq!(
        ok!(store.write(
            put(NS, "run", json!("lost"), 45)
                .expect(Expect::Version(2))
                .replacing()
        )),
        WriteOutcome::Conflict {
            current: Some(v4.clone())
        },
        "a version still kept but no longer the latest is refused"
    );
    // A version written with an effect key is kept, so its key still applies once.
    let w5 = put(NS, "run", json!(5), 50).effect_key("once").replacing();
    let v5 = written(store, w5.clone()).await?;
    let v6 = written(store, put(NS, "run", json!(6), 60).replacing()).await?;
    ensure_eq!(
        ok!(store.history(NS, "run")),
        vec![v2.clone(), v5.clone(), v6.clone()],
        "version 4 replaced by 5; 5 (an effect key's) kept by 6"
    );
    ensure_eq!(
        ok!(store.write(w5)),
        WriteOutcome::AlreadyApplied(v5.clone()),
        "the effect key applies once"
    );
    ensure_eq!(ok!(store.list(NS, "ru")), vec![v6.clone()], "list");
    // Racing replacing writers: each writes a version; the last is what is left of them.
    let racers =
        join_all((0..8).map(|i| store.write(put(NS, "race", json!(i), 70 + i).replacing()))).await;
    let mut versions = BTreeSet::new();
    for outcome in racers {
        match outcome {
            Ok(WriteOutcome::Written(r)) => {
                versions.insert(r.version);
            }
            other => {
                return Err(ConformanceError::check(
                    "every racing replacing write is written",
                    format!("found {other:?}"),
                    concat!(file!(), ":", line!()),
                ));
            }
        }
    }
    ensure_eq!(
        versions,
        (1..=8).collect::<BTreeSet<u64>>(),
        "one version each"
    );
    let left = ok!(store.history(NS, "race"));
    ensure_eq!(
        left.iter().map(|r| r.version).collect::<Vec<_>>(),
        vec![8],
        "the latest alone is kept"
    );
    Ok(())
}

/// `Expect::Absent` writes a key never written, and is a `Conflict` carrying the record on a key
/// that exists (no new version).
pub async fn record_store_absent(store: &dyn RecordStore) -> Result<(), ConformanceError> {
    ensure_empty(store, &[NS]).await?;
    let w = put(NS, "once", json!({"a": 1}), 1).expect(Expect::Absent);
    let v1 = written(store, w.clone()).await?;
    ensure_eq!(v1, made(&w, 1), "Absent on a key never written");
    let again = ok!(store.write(put(NS, "once", json!({"a": 2}), 2).expect(Expect::Absent)));
    ensure_eq!(
        again,
        WriteOutcome::Conflict {
            current: Some(v1.clone())
        },
        "Absent on an existing key"
    );
    ensure_eq!(ok!(store.history(NS, "once")), vec![v1], "no new version");
    Ok(())
}

/// A write whose effect key was applied in the namespace writes nothing and answers
/// `AlreadyApplied` with the record that key wrote, whatever its expectation and value, even after
/// newer versions; a write refused by its expectation does not record its effect key.
pub async fn record_store_effect_key_applies_once(
    store: &dyn RecordStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store, &[NS, OTHER_NS]).await?;
    let w = put(NS, "k", json!("first"), 1)
        .expect(Expect::Absent)
        .effect_key("turn-1/call-1");
    let v1 = written(store, w.clone()).await?;
    ensure_eq!(
        ok!(store.write(w.clone())),
        WriteOutcome::AlreadyApplied(v1.clone()),
        "the same write again"
    );
    let v2 = written(
        store,
        put(NS, "k", json!("second"), 2)
            .expect(Expect::Version(1))
            .effect_key("turn-2/call-1"),
    )
    .await?;
    let rerun = put(NS, "k", json!("first, computed again"), 3)
        .expect(Expect::Version(7))
        .effect_key("turn-1/call-1");
    ensure_eq!(
        ok!(store.write(rerun)),
        WriteOutcome::AlreadyApplied(v1.clone()),
        "a re-run after newer versions: the record its key wrote, not the latest"
    );
    let elsewhere = put(NS, "other-key", json!("x"), 4).effect_key("turn-1/call-1");
    ensure_eq!(
        ok!(store.write(elsewhere)),
        WriteOutcome::AlreadyApplied(v1.clone()),
        "an effect key is per namespace, not per key"
    );
    ensure_eq!(
        ok!(store.get(NS, "other-key")),
        None,
        "nothing written for it"
    );
    ensure_eq!(
        ok!(store.history(NS, "k")),
        vec![v1.clone(), v2.clone()],
        "no version was added by the repeated effects"
    );
    let other_ns = put(OTHER_NS, "k", json!("x"), 5).effect_key("turn-1/call-1");
    let o1 = written(store, other_ns.clone()).await?;
    ensure_eq!(
        o1,
        made(&other_ns, 1),
        "the same effect key in another namespace"
    );
    // A conflict does not use the effect key up.
    let refused = put(NS, "k", json!("third"), 6)
        .expect(Expect::Version(1))
        .effect_key("turn-3/call-1");
    ensure_eq!(
        ok!(store.write(refused)),
        WriteOutcome::Conflict {
            current: Some(v2.clone())
        },
        "a stale expectation with a new effect key"
    );
    let retried = put(NS, "k", json!("third"), 7)
        .expect(Expect::Version(2))
        .effect_key("turn-3/call-1");
    let v3 = written(store, retried.clone()).await?;
    ensure_eq!(
        v3,
        made(&retried, 3),
        "the effect key of a conflict is still free"
    );
    ensure_eq!(
        ok!(store.write(retried)),
        WriteOutcome::AlreadyApplied(v3),
        "and applied once written"
    );
    Ok(())
}

/// `history` is every version oldest first; `version(n)` is the n-th write; `get` the last.
pub async fn record_store_history_order(store: &dyn RecordStore) -> Result<(), ConformanceError> {
    ensure_empty(store, &[NS]).await?;
    let mut expected = Vec::new();
    for i in 0..12i64 {
        // Times that go backwards: the order is the order of the writes, not of their times.
        let w = RecordWrite::new(NS, "log", json!({ "i": i }), format!("author-{i}"))
            .at(Timestamp(1_000 - i));
        expected.push(written(store, w).await?);
        // Another key written in between does not take version numbers.
        written(store, put(NS, "log-other", json!(i), i)).await?;
    }
    ensure_eq!(
        expected.iter().map(|r| r.version).collect::<Vec<_>>(),
        (1..=12).collect::<Vec<u64>>(),
        "versions count the writes of the key"
    );
    ensure_eq!(
        ok!(store.history(NS, "log")),
        expected,
        "history, oldest first"
    );
    for r in &expected {
        ensure_eq!(
            ok!(store.version(NS, "log", r.version)),
            Some(r.clone()),
            "version {}",
            r.version
        );
    }
    ensure_eq!(
        ok!(store.get(NS, "log")),
        expected.last().cloned(),
        "get is the last"
    );
    Ok(())
}

/// `list(ns, prefix)` is the latest version of every key starting with `prefix`, in byte order of
/// the keys; the prefix is text, never a pattern.
pub async fn record_store_list_by_prefix(store: &dyn RecordStore) -> Result<(), ConformanceError> {
    ensure_empty(store, &[NS]).await?;
    let keys = [
        "a/2", "a/10", "a/1", "ab", "a", "b", "x%y", "x_y", "xay", "x\\y", "é", "éa", "z", "😀",
        "A",
    ];
    for (i, key) in keys.iter().enumerate() {
        written(store, put(NS, key, json!(i), 0)).await?;
    }
    // A second version of some keys: list shows the latest.
    let a2 = written(store, put(NS, "a/2", json!("latest"), 1)).await?;
    let b = written(store, put(NS, "b", json!("latest"), 1)).await?;
    let listed = |records: Vec<Record>| records.into_iter().map(|r| r.key).collect::<Vec<_>>();
    let mut sorted: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    sorted.sort();
    ensure_eq!(
        listed(ok!(store.list(NS, ""))),
        sorted,
        "every key, in byte order"
    );
    ensure_eq!(
        listed(ok!(store.list(NS, "a/"))),
        vec!["a/1", "a/10", "a/2"],
        "prefix a/"
    );
    ensure_eq!(
        listed(ok!(store.list(NS, "a"))),
        vec!["a", "a/1", "a/10", "a/2", "ab"],
        "prefix a (the key equal to the prefix included)"
    );
    ensure_eq!(
        listed(ok!(store.list(NS, "x%"))),
        vec!["x%y"],
        "% is not a wildcard"
    );
    ensure_eq!(
        listed(ok!(store.list(NS, "x_"))),
        vec!["x_y"],
        "_ is not a wildcard"
    );
    ensure_eq!(
        listed(ok!(store.list(NS, "x\\"))),
        vec!["x\\y"],
        "\\ is not an escape"
    );
    ensure_eq!(
        listed(ok!(store.list(NS, "é"))),
        vec!["é", "éa"],
        "a multibyte prefix"
    );
    ensure_eq!(
        listed(ok!(store.list(NS, "a/10"))),
        vec!["a/10"],
        "a whole key"
    );
    ensure_eq!(
        listed(ok!(store.list(NS, "c"))),
        Vec::<String>::new(),
        "no key"
    );
    ensure_eq!(
        listed(ok!(store.list(NS, "😀😀"))),
        Vec::<String>::new(),
        "longer than a key"
    );
    let all = ok!(store.list(NS, ""));
    ensure_eq!(
        all.iter().find(|r| r.key == "a/2"),
        Some(&a2),
        "list returns the latest version"
    );
    ensure_eq!(all.iter().find(|r| r.key == "b"), Some(&b), "of every key");
    Ok(())
}

/// Nothing written in one namespace is read, listed, or its effect keys applied, in another;
/// namespaces that are prefixes of each other too.
pub async fn record_store_namespaces_isolated(
    store: &dyn RecordStore,
) -> Result<(), ConformanceError> {
    let (a, b, c) = ("notes", "notes2", "note");
    ensure_empty(store, &[a, b, c]).await?;
    let ra = written(store, put(a, "k", json!("a"), 1).effect_key("e")).await?;
    ensure_eq!(ok!(store.get(b, "k")), None, "another namespace");
    ensure_eq!(ok!(store.get(c, "k")), None, "a namespace that is a prefix");
    let rb = written(store, put(b, "k", json!("b"), 2).effect_key("e")).await?;
    ensure_eq!(rb.version, 1, "versions are per namespace");
    let rc = written(store, put(c, "k", json!("c"), 3).expect(Expect::Absent)).await?;
    ensure_eq!(rc.version, 1, "Absent is per namespace");
    let ra2 = written(store, put(a, "k2", json!("a2"), 4)).await?;
    ensure_eq!(
        ok!(store.list(a, "")),
        vec![ra.clone(), ra2],
        "list of notes"
    );
    ensure_eq!(ok!(store.list(b, "")), vec![rb.clone()], "list of notes2");
    ensure_eq!(ok!(store.list(c, "")), vec![rc.clone()], "list of note");
    ensure_eq!(ok!(store.history(b, "k")), vec![rb], "history of notes2");
    ensure_eq!(ok!(store.version(c, "k", 1)), Some(rc), "version in note");
    ensure_eq!(ok!(store.get(a, "k")), Some(ra), "notes is untouched");
    Ok(())
}

/// Writers racing with one expectation: exactly one is `Written`, the others `Conflict` with a
/// record at least as new as the winner's; racing `Absent` writers likewise; racing writers with
/// one effect key: one `Written`, the others `AlreadyApplied` with its record; racing `Any`
/// writers are all written, with distinct versions.
pub async fn record_store_concurrent_writers(
    store: &dyn RecordStore,
) -> Result<(), ConformanceError> {
    const WRITERS: usize = 16;
    ensure_empty(store, &[NS]).await?;
    written(store, put(NS, "cas", json!(0), 0)).await?;
    for (key, expect, what) in [
        ("cas", Expect::Version(1), "Version(1)"),
        ("absent", Expect::Absent, "Absent"),
    ] {
        let writes = (0..WRITERS).map(|i| {
            store.write(
                RecordWrite::new(NS, key, json!(i), format!("writer-{i}"))
                    .expect(expect)
                    .at(Timestamp(0)),
            )
        });
        let mut winners = Vec::new();
        let mut conflicts = Vec::new();
        for result in join_all(writes).await {
            match result {
                Ok(WriteOutcome::Written(r)) => winners.push(r),
                Ok(WriteOutcome::Conflict { current }) => conflicts.push(current),
                other => {
                    return Err(ConformanceError::check(
                        "Written or Conflict",
                        format!("racing {what} writers: found {other:?}"),
                        concat!(file!(), ":", line!()),
                    ));
                }
            }
        }
        ensure_eq!(winners.len(), 1, "racing {what} writers: exactly one wins");
        let winner = &winners[0];
        for current in &conflicts {
            ensure_eq!(
                current.as_ref(),
                Some(winner),
                "racing {what} writers: a loser is shown the winner's record"
            );
        }
        ensure_eq!(
            ok!(store.get(NS, key)),
            Some(winner.clone()),
            "racing {what} writers: the winner's record is stored"
        );
    }
    let effects = (0..WRITERS).map(|i| {
        store.write(
            RecordWrite::new(NS, "effect", json!(i), format!("writer-{i}"))
                .effect_key("turn-9/call-2")
                .at(Timestamp(0)),
        )
    });
    let mut winner = None;
    let mut repeats = Vec::new();
    for result in join_all(effects).await {
        match result {
            Ok(WriteOutcome::Written(r)) => {
                ensure!(
                    winner.is_none(),
                    "two writes with one effect key were written"
                );
                winner = Some(r);
            }
            Ok(WriteOutcome::AlreadyApplied(r)) => repeats.push(r),
            other => {
                return Err(ConformanceError::check(
                    "Written or AlreadyApplied",
                    format!("racing writers with one effect key: found {other:?}"),
                    concat!(file!(), ":", line!()),
                ));
            }
        }
    }
    let Some(winner) = winner else {
        return Err(ConformanceError::check(
            "winner.is_some()",
            "racing writers with one effect key: none was written",
            concat!(file!(), ":", line!()),
        ));
    };
    for r in &repeats {
        ensure_eq!(r, &winner, "the others are shown the record the key wrote");
    }
    ensure_eq!(
        ok!(store.history(NS, "effect")).len(),
        1,
        "one version written"
    );

    let anys = (0..WRITERS).map(|i| store.write(put(NS, "any", json!(i), 0)));
    let mut versions = BTreeSet::new();
    for result in join_all(anys).await {
        match result {
            Ok(WriteOutcome::Written(r)) => {
                versions.insert(r.version);
            }
            other => {
                return Err(ConformanceError::check(
                    "Written",
                    format!("racing Any writers: found {other:?}"),
                    concat!(file!(), ":", line!()),
                ));
            }
        }
    }
    ensure_eq!(
        versions.into_iter().collect::<Vec<_>>(),
        (1..=WRITERS as u64).collect::<Vec<_>>(),
        "racing Any writers: every one written, with distinct versions"
    );
    ensure_eq!(
        ok!(store.history(NS, "any")).len(),
        WRITERS,
        "history of the Any writers"
    );
    Ok(())
}

/// Values (any JSON: unusual text, numbers at the edges, nesting, a value near the size cap),
/// keys and authors of any Unicode, and timestamps at the edges come back exactly.
pub async fn record_store_round_trip(store: &dyn RecordStore) -> Result<(), ConformanceError> {
    ensure_empty(store, &[NS]).await?;
    let unusual_key: String = UNUSUAL_TEXT.chars().filter(|c| !c.is_control()).collect();
    let values = [
        json!(null),
        json!(true),
        json!(0),
        json!(-1),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(1.5),
        json!(-0.000_001_25),
        json!(""),
        json!(UNUSUAL_TEXT),
        json!([1, "two", [3], {"four": 4}]),
        json!({"z": 1, "a": {"nested": [null, {"deep": UNUSUAL_TEXT}]}, "": "empty key"}),
        Value::Object(serde_json::Map::from_iter([(
            UNUSUAL_TEXT.to_string(),
            json!(UNUSUAL_TEXT),
        )])),
    ];
    for (i, value) in values.iter().enumerate() {
        let key = format!("{unusual_key} #{i}");
        let w = RecordWrite::new(NS, key.as_str(), value.clone(), unusual_key.as_str())
            .at(Timestamp(if i % 2 == 0 { i64::MIN } else { i64::MAX }))
            .effect_key(format!("{unusual_key} effect {i}"));
        let r = written(store, w.clone()).await?;
        ensure_eq!(r, made(&w, 1), "the written record of value {i}");
        ensure_eq!(
            ok!(store.get(NS, &key)),
            Some(r.clone()),
            "value {i} read back"
        );
        ensure_eq!(
            ok!(store.write(w)),
            WriteOutcome::AlreadyApplied(r),
            "effect key {i}"
        );
    }
    // The largest value allowed: a string whose JSON text is exactly the cap.
    let big = Value::String("x".repeat(MAX_VALUE_LEN - 2));
    let w = put(NS, "big", big, 0);
    let r = written(store, w.clone()).await?;
    ensure_eq!(
        ok!(store.get(NS, "big")),
        Some(r),
        "a value of the largest size"
    );
    let long_key = "k".repeat(MAX_KEY_LEN);
    let long_ns = "n".repeat(MAX_NAMESPACE_LEN);
    let w = put(&long_ns, &long_key, json!(1), 0).effect_key("e".repeat(MAX_KEY_LEN));
    let r = written(store, w.clone()).await?;
    ensure_eq!(
        ok!(store.list(&long_ns, &long_key)),
        vec![r],
        "the longest namespace and key"
    );
    Ok(())
}

/// Empty or over-long namespaces and keys, namespaces with other characters than the allowed
/// ones, control characters, an empty author or effect key, and a value over the size cap are
/// refused with `Invalid`, and nothing is written.
pub async fn record_store_invalid_input(store: &dyn RecordStore) -> Result<(), ConformanceError> {
    ensure_empty(store, &[NS]).await?;
    let long_ns = "n".repeat(MAX_NAMESPACE_LEN + 1);
    let long_key = "k".repeat(MAX_KEY_LEN + 1);
    let too_big = Value::String("x".repeat(MAX_VALUE_LEN - 1));
    let cases = [
        ("an empty namespace", put("", "k", json!(1), 0)),
        ("an over-long namespace", put(&long_ns, "k", json!(1), 0)),
        ("a namespace with a slash", put("no/tes", "k", json!(1), 0)),
        (
            "a namespace with a space",
            put("my notes", "k", json!(1), 0),
        ),
        ("a namespace with a NUL", put("notes\0", "k", json!(1), 0)),
        ("an empty key", put(NS, "", json!(1), 0)),
        ("an over-long key", put(NS, &long_key, json!(1), 0)),
        ("a key with a NUL", put(NS, "a\0b", json!(1), 0)),
        ("a key with a line break", put(NS, "a\nb", json!(1), 0)),
        (
            "an empty author",
            RecordWrite::new(NS, "k", json!(1), "").at(Timestamp(0)),
        ),
        (
            "an over-long author",
            RecordWrite::new(NS, "k", json!(1), "a".repeat(300)).at(Timestamp(0)),
        ),
        (
            "an empty effect key",
            put(NS, "k", json!(1), 0).effect_key(""),
        ),
        (
            "an over-long effect key",
            put(NS, "k", json!(1), 0).effect_key("e".repeat(MAX_KEY_LEN + 1)),
        ),
        ("a value over the cap", put(NS, "k", too_big, 0)),
    ];
    for (what, write) in cases {
        ensure_err!(
            store.write(write).await,
            StoreError::Invalid(_),
            "writing {what}"
        );
    }
    ensure_eq!(ok!(store.list(NS, "")), vec![], "nothing was written");
    ensure_err!(
        store.get("", "k").await,
        StoreError::Invalid(_),
        "get in an empty namespace"
    );
    ensure_err!(
        store.get(NS, "").await,
        StoreError::Invalid(_),
        "get of an empty key"
    );
    ensure_err!(
        store.get(NS, &long_key).await,
        StoreError::Invalid(_),
        "get of an over-long key"
    );
    ensure_err!(
        store.version(NS, "a\0b", 1).await,
        StoreError::Invalid(_),
        "version of a key with a NUL"
    );
    ensure_err!(
        store.history(&long_ns, "k").await,
        StoreError::Invalid(_),
        "history in an over-long namespace"
    );
    ensure_err!(
        store.list("no/tes", "").await,
        StoreError::Invalid(_),
        "list of an invalid namespace"
    );
    ensure_err!(
        store.list(NS, &long_key).await,
        StoreError::Invalid(_),
        "list with an over-long prefix"
    );
    ensure_err!(
        store.list(NS, "a\0").await,
        StoreError::Invalid(_),
        "list with a NUL in the prefix"
    );
    Ok(())
}

/// A durable store keeps every acknowledged record, version, history and effect key across a
/// reopen, and a replaced version stays replaced: `open` must open the **same** store each time (the same directory or database), fresh
/// and empty the first time. Each opened store is released before the next is opened. A store in
/// memory passes by returning the same store each time.
///
/// Not generated by the macros (they cannot reopen): call it from a test of the backend.
///
/// ```ignore
/// #[tokio::test(flavor = "multi_thread")]
/// async fn records_survive_reopen() -> Result<(), ConformanceError> {
///     let dir = tempfile::tempdir().unwrap();
///     let path = dir.path().to_path_buf();
///     spacebot_core::conformance::record_store_survives_reopen(|| {
///         let path = path.clone();
///         async move { Ok(Arc::new(MyStores::open(&path).await?.records()) as Arc<dyn RecordStore>) }
///     })
///     .await
/// }
/// ```
pub async fn record_store_survives_reopen<F, Fut>(open: F) -> Result<(), ConformanceError>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<Arc<dyn RecordStore>, StoreError>>,
{
    let store = ok!(open());
    ensure_empty(&*store, &[NS, OTHER_NS]).await?;
    let w1 = put(NS, "kept", json!({"v": 1}), 1).effect_key("turn-1/call-1");
    let v1 = written(&*store, w1.clone()).await?;
    let w2 = put(NS, "kept", json!({"v": 2}), 2)
        .expect(Expect::Version(1))
        .effect_key("turn-2/call-1");
    let v2 = written(&*store, w2.clone()).await?;
    let o1 = written(&*store, put(OTHER_NS, "kept", json!("other"), 3)).await?;
    // A key written replacing: one version left before the reopen.
    written(&*store, put(NS, "count", json!(1), 1).replacing()).await?;
    let c2 = written(
        &*store,
        put(NS, "count", json!(2), 2)
            .expect(Expect::Version(1))
            .replacing(),
    )
    .await?;
    store.release().await;
    drop(store);

    let store = ok!(open());
    ensure_eq!(
        ok!(store.history(NS, "count")),
        vec![c2.clone()],
        "a replaced version stays gone after a reopen"
    );
    let c3 = written(
        &*store,
        put(NS, "count", json!(3), 3)
            .expect(Expect::Version(2))
            .replacing(),
    )
    .await?;
    ensure_eq!(
        (c3.version, ok!(store.history(NS, "count"))),
        (3, vec![c3.clone()]),
        "replacing writes count on after a reopen"
    );
    ensure_eq!(
        ok!(store.get(NS, "kept")),
        Some(v2.clone()),
        "the latest after a reopen"
    );
    ensure_eq!(
        ok!(store.history(NS, "kept")),
        vec![v1.clone(), v2.clone()],
        "the history after a reopen"
    );
    ensure_eq!(
        ok!(store.list(OTHER_NS, "")),
        vec![o1],
        "another namespace after a reopen"
    );
    ensure_eq!(
        ok!(store.write(w1)),
        WriteOutcome::AlreadyApplied(v1),
        "an effect key applied before the reopen"
    );
    ensure_eq!(
        ok!(store.write(w2)),
        WriteOutcome::AlreadyApplied(v2.clone()),
        "the second effect key too"
    );
    ensure_eq!(
        ok!(store.write(put(NS, "kept", json!(0), 4).expect(Expect::Version(1)))),
        WriteOutcome::Conflict {
            current: Some(v2.clone())
        },
        "compare-and-set against the stored version after a reopen"
    );
    let w3 = put(NS, "kept", json!({"v": 3}), 5)
        .expect(Expect::Version(2))
        .effect_key("turn-3/call-1");
    let v3 = written(&*store, w3.clone()).await?;
    ensure_eq!(v3, made(&w3, 3), "versions continue after a reopen");
    store.release().await;
    drop(store);

    let store = ok!(open());
    ensure_eq!(
        ok!(store.write(w3)),
        WriteOutcome::AlreadyApplied(v3.clone()),
        "an effect key applied after the first reopen"
    );
    ensure_eq!(
        ok!(store.history(NS, "kept")).len(),
        3,
        "three versions after two reopens"
    );
    store.release().await;
    Ok(())
}
