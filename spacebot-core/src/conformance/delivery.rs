//! [`DeliveryStore`] conformance.

use futures::future::join_all;

use super::support::{ConformanceError, UNUSUAL_TEXT, agent, ensure, ensure_eq, large_text, ok};
use crate::channel::{ChannelStore, NewRecord, RecordKind};
use crate::envelope::{DeliveryStore, Envelope, EnvelopeKind, Source, TurnCommit};
use crate::ids::{AgentId, ChannelId, EnvelopeId, LinkId};
use crate::stores::Stores;
use crate::time::Timestamp;

#[doc(hidden)]
#[macro_export]
macro_rules! __delivery_store_tests {
    ($module:ident, $make:expr, |$s:ident| $access:expr) => {
        $crate::__conformance_module!(
            $module,
            $make,
            |$s| $access,
            [
                delivery_store_persist_pending_remove,
                delivery_store_mark_applied_once,
                delivery_store_concurrent_mark_applied,
                delivery_store_round_trip,
                delivery_store_is_applied,
                delivery_store_commit_removes_appends_and_marks,
                delivery_store_commit_ignores_absent_ids_and_applied_keys,
            ]
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __turn_commit_tests {
    ($module:ident, $make:expr, |$s:ident| $access:expr) => {
        $crate::__conformance_module!(
            $module,
            $make,
            |$s| $access,
            [
                stores_commit_appends_records_in_order,
                stores_concurrent_commits_are_all_or_nothing,
            ]
        );
    };
}

async fn ensure_empty(
    store: &dyn DeliveryStore,
    agents: &[&AgentId],
) -> Result<(), ConformanceError> {
    for a in agents {
        let pending = ok!(store.pending(a));
        ensure!(
            pending.is_empty(),
            "the suite needs a fresh, empty delivery store; agent {a} has {} pending envelopes",
            pending.len()
        );
    }
    Ok(())
}

fn envelope(to: &AgentId, content: &str, at: i64) -> Envelope {
    Envelope::new(
        Source::System,
        ChannelId::portal(to),
        EnvelopeKind::UserMessage,
        content,
        Timestamp(at),
    )
}

fn contents(envelopes: &[Envelope]) -> Vec<&str> {
    envelopes.iter().map(|e| e.content.as_str()).collect()
}

/// `pending` returns envelopes in persist order (whatever their timestamps); persisting an id
/// again is a no-op (the first copy is kept); `remove` deletes one and is idempotent; agents are
/// separate.
pub async fn delivery_store_persist_pending_remove(
    store: &dyn DeliveryStore,
) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a, &b]).await?;
    let e1 = envelope(&a, "first", 300);
    let e2 = envelope(&a, "second", 100);
    let e3 = envelope(&a, "third", 200);
    for e in [&e1, &e2, &e3] {
        ok!(store.persist(&a, e));
    }
    let changed_copy = Envelope {
        content: "changed".into(),
        ..e1.clone()
    };
    ok!(store.persist(&a, &changed_copy));
    ok!(store.persist(&a, &e2));
    ensure_eq!(
        ok!(store.pending(&a)),
        vec![e1.clone(), e2.clone(), e3.clone()],
        "persist order, each id once, the first copy kept"
    );
    ensure!(
        ok!(store.pending(&b)).is_empty(),
        "another agent has nothing pending"
    );
    ok!(store.persist(&b, &e2));
    ensure_eq!(
        contents(&ok!(store.pending(&b))),
        vec!["second"],
        "the same envelope persisted for another agent is separate"
    );
    ok!(store.remove(&a, &e2.id));
    ensure_eq!(
        contents(&ok!(store.pending(&a))),
        vec!["first", "third"],
        "after a remove"
    );
    ok!(store.remove(&a, &e2.id));
    ok!(store.remove(&a, &EnvelopeId::new("no-such-envelope")));
    ok!(store.remove(&agent("nobody")?, &e1.id));
    ensure_eq!(
        contents(&ok!(store.pending(&a))),
        vec!["first", "third"],
        "removing an absent id changes nothing"
    );
    ensure_eq!(
        contents(&ok!(store.pending(&b))),
        vec!["second"],
        "removing for one agent leaves another alone"
    );
    let e4 = envelope(&a, "fourth", 0);
    ok!(store.persist(&a, &e4));
    ensure_eq!(
        contents(&ok!(store.pending(&a))),
        vec!["first", "third", "fourth"],
        "a later persist comes last"
    );
    ok!(store.persist(&a, &e2));
    ensure_eq!(
        contents(&ok!(store.pending(&a))),
        vec!["first", "third", "fourth", "second"],
        "a removed id persisted again is stored again, last"
    );
    Ok(())
}

/// `mark_applied` returns `true` the first time a key is marked for an agent and `false` ever
/// after; keys are per agent.
pub async fn delivery_store_mark_applied_once(
    store: &dyn DeliveryStore,
) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a, &b]).await?;
    let key = "support#4:done";
    ensure!(ok!(store.mark_applied(&a, key, Timestamp(1))), "first mark");
    ensure!(
        !ok!(store.mark_applied(&a, key, Timestamp(2))),
        "second mark"
    );
    ensure!(
        !ok!(store.mark_applied(&a, key, Timestamp(0))),
        "third mark, earlier time"
    );
    ensure!(
        ok!(store.mark_applied(&b, key, Timestamp(3))),
        "the same key for another agent"
    );
    ensure!(
        ok!(store.mark_applied(&a, "support#4:failed", Timestamp(4))),
        "another key"
    );
    ensure!(
        ok!(store.mark_applied(&a, UNUSUAL_TEXT, Timestamp(5))),
        "an unusual key"
    );
    ensure!(
        !ok!(store.mark_applied(&a, UNUSUAL_TEXT, Timestamp(6))),
        "an unusual key again"
    );
    ensure!(
        ok!(store.mark_applied(&a, "", Timestamp(7))),
        "the empty key"
    );
    ensure!(
        !ok!(store.mark_applied(&a, "", Timestamp(8))),
        "the empty key again"
    );
    ensure!(
        ok!(store.pending(&a)).is_empty(),
        "marking keys persists no envelope"
    );
    Ok(())
}

/// Concurrent `mark_applied` calls with one key: exactly one gets `true`.
pub async fn delivery_store_concurrent_mark_applied(
    store: &dyn DeliveryStore,
) -> Result<(), ConformanceError> {
    const N: usize = 32;
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    let marks = (0..N).map(|i| store.mark_applied(&a, "contended", Timestamp(i as i64)));
    let mut firsts = 0;
    for result in join_all(marks).await {
        match result {
            Ok(true) => firsts += 1,
            Ok(false) => {}
            Err(e) => {
                return Err(ConformanceError::Store {
                    op: "concurrent mark_applied".into(),
                    location: concat!(file!(), ":", line!()),
                    source: e,
                });
            }
        }
    }
    ensure_eq!(firsts, 1, "exactly one concurrent mark is the first");
    Ok(())
}

/// Envelopes of every source and kind, with unusual text, empty and nested metadata, a megabyte
/// of content and extreme timestamps round-trip exactly.
pub async fn delivery_store_round_trip(store: &dyn DeliveryStore) -> Result<(), ConformanceError> {
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    let mut metadata = serde_json::Map::new();
    metadata.insert(
        UNUSUAL_TEXT.into(),
        serde_json::json!([1, {"k": UNUSUAL_TEXT}, null]),
    );
    let sources = [
        Source::External {
            platform: "discord".into(),
            reply_target: UNUSUAL_TEXT.into(),
        },
        Source::External {
            platform: String::new(),
            reply_target: String::new(),
        },
        Source::Internal {
            from_agent: agent("beta")?,
            link_id: Some(LinkId::new(UNUSUAL_TEXT)),
        },
        Source::Internal {
            from_agent: agent("gamma")?,
            link_id: None,
        },
        Source::System,
    ];
    let kinds = [
        EnvelopeKind::UserMessage,
        EnvelopeKind::SentRecord,
        EnvelopeKind::SystemRecord,
        EnvelopeKind::Retrigger,
        EnvelopeKind::TaskAssigned,
        EnvelopeKind::Announce,
        EnvelopeKind::Cancel,
    ];
    let mut expected = Vec::new();
    for (i, kind) in kinds.into_iter().enumerate() {
        let e = Envelope {
            id: EnvelopeId::new(format!("{UNUSUAL_TEXT} {i}")),
            source: sources[i % sources.len()].clone(),
            channel: ChannelId::new(format!("chan {UNUSUAL_TEXT}")),
            content: match i {
                0 => String::new(),
                1 => large_text(),
                _ => UNUSUAL_TEXT.into(),
            },
            kind,
            metadata: if i % 2 == 0 {
                serde_json::Map::new()
            } else {
                metadata.clone()
            },
            timestamp: Timestamp([i64::MIN, -1, 0, 1, i64::MAX, 7, 8][i]),
            idempotency_key: match i % 3 {
                0 => None,
                1 => Some(String::new()),
                _ => Some(UNUSUAL_TEXT.into()),
            },
            task: (i % 2 == 1).then(|| crate::envelope::TaskWork {
                owner: UNUSUAL_TEXT.into(),
                number: u64::MAX - i as u64,
                holder: UNUSUAL_TEXT.into(),
                generation: i as u32,
            }),
            round: i as u32,
            conversation: (i % 3 == 2).then(|| crate::ids::ConversationId::new(UNUSUAL_TEXT)),
            cause: (i % 2 == 0).then(|| EnvelopeId::new(format!("cause {UNUSUAL_TEXT}"))),
            trace_context: (i % 2 == 1)
                .then(|| "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string()),
        };
        ok!(store.persist(&a, &e));
        expected.push(e);
    }
    ensure_eq!(ok!(store.pending(&a)), expected, "pending round-trips");
    Ok(())
}

/// `is_applied` is `false` for a key never marked and `true` once `mark_applied` marked it, per
/// agent; it marks nothing itself.
pub async fn delivery_store_is_applied(store: &dyn DeliveryStore) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a, &b]).await?;
    for key in ["support#4:done", UNUSUAL_TEXT, ""] {
        ensure!(
            !ok!(store.is_applied(&a, key)),
            "{key:?} is not applied before it is marked"
        );
        ensure!(
            !ok!(store.is_applied(&a, key)),
            "{key:?} is still not applied after asking twice"
        );
        ensure!(
            ok!(store.mark_applied(&a, key, Timestamp(1))),
            "asking whether {key:?} is applied does not mark it"
        );
        ensure!(
            ok!(store.is_applied(&a, key)),
            "{key:?} is applied once marked"
        );
        ensure!(
            !ok!(store.is_applied(&b, key)),
            "{key:?} marked for one agent is not applied for another"
        );
    }
    ensure!(
        !ok!(store.is_applied(&a, "support#4:failed")),
        "another key is not applied"
    );
    ensure!(
        !ok!(store.is_applied(&agent("nobody")?, "support#4:done")),
        "an agent with no store yet has nothing applied"
    );
    Ok(())
}

fn commit_record(to: &AgentId, channel: &ChannelId, content: &str, at: i64) -> NewRecord {
    NewRecord::new(
        channel.clone(),
        RecordKind::Assistant,
        to.as_str(),
        content,
        Timestamp(at),
    )
}

/// `commit` removes the consumed envelopes (keeping the others in persist order), marks the
/// applied keys (`is_applied` becomes `true`, a later `mark_applied` returns `false`) and leaves
/// other agents alone; an empty commit changes nothing.
pub async fn delivery_store_commit_removes_appends_and_marks(
    store: &dyn DeliveryStore,
) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a, &b]).await?;
    let es: Vec<Envelope> = (0..4).map(|i| envelope(&a, &format!("e{i}"), i)).collect();
    for e in &es {
        ok!(store.persist(&a, e));
    }
    ok!(store.persist(&b, &es[0]));
    let channel = ChannelId::portal(&a);
    let commit = TurnCommit {
        consumed: vec![es[2].id.clone(), es[0].id.clone()],
        records: vec![
            commit_record(&a, &channel, "first", 10),
            commit_record(&a, &channel, "second", 5),
        ],
        applied: vec!["turn:e0".into(), UNUSUAL_TEXT.into()],
    };
    ok!(store.commit(&a, &commit, Timestamp(20)));
    ensure_eq!(
        contents(&ok!(store.pending(&a))),
        vec!["e1", "e3"],
        "the consumed envelopes are removed, the others kept in order"
    );
    ensure_eq!(
        contents(&ok!(store.pending(&b))),
        vec!["e0"],
        "a commit for one agent leaves another's deliveries alone"
    );
    for key in ["turn:e0", UNUSUAL_TEXT] {
        ensure!(
            ok!(store.is_applied(&a, key)),
            "{key:?} is applied after the commit"
        );
        ensure!(
            !ok!(store.mark_applied(&a, key, Timestamp(21))),
            "{key:?} marked by a commit is not marked again"
        );
        ensure!(
            !ok!(store.is_applied(&b, key)),
            "{key:?} committed for one agent is not applied for another"
        );
    }
    ok!(store.commit(&a, &TurnCommit::default(), Timestamp(22)));
    ensure_eq!(
        contents(&ok!(store.pending(&a))),
        vec!["e1", "e3"],
        "an empty commit changes nothing"
    );
    let records_only = TurnCommit {
        records: vec![commit_record(&a, &channel, "third", 30)],
        ..TurnCommit::default()
    };
    ok!(store.commit(&a, &records_only, Timestamp(30)));
    ensure_eq!(
        contents(&ok!(store.pending(&a))),
        vec!["e1", "e3"],
        "a commit of records only removes nothing"
    );
    ensure!(
        !ok!(store.is_applied(&a, "turn:e1")),
        "a key no commit named is not applied"
    );
    Ok(())
}

/// `commit` ignores consumed ids that are not pending (never persisted, already removed, named
/// twice, or pending for another agent) and applied keys that are already marked (or named twice),
/// and applies the rest.
pub async fn delivery_store_commit_ignores_absent_ids_and_applied_keys(
    store: &dyn DeliveryStore,
) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a, &b]).await?;
    let (e1, e2, e3) = (
        envelope(&a, "e1", 1),
        envelope(&a, "e2", 2),
        envelope(&b, "b only", 3),
    );
    ok!(store.persist(&a, &e1));
    ok!(store.persist(&a, &e2));
    ok!(store.persist(&b, &e3));
    ok!(store.remove(&a, &e2.id));
    ensure!(
        ok!(store.mark_applied(&a, "old", Timestamp(1))),
        "first mark of a key"
    );
    let commit = TurnCommit {
        consumed: vec![
            EnvelopeId::new("never-persisted"),
            e2.id.clone(),
            e1.id.clone(),
            e1.id.clone(),
            e3.id.clone(),
        ],
        records: Vec::new(),
        applied: vec!["old".into(), "new".into(), "new".into(), String::new()],
    };
    ok!(store.commit(&a, &commit, Timestamp(5)));
    ensure!(
        ok!(store.pending(&a)).is_empty(),
        "the pending envelope named is removed"
    );
    ensure_eq!(
        contents(&ok!(store.pending(&b))),
        vec!["b only"],
        "an id pending for another agent is not removed"
    );
    for key in ["old", "new", ""] {
        ensure!(ok!(store.is_applied(&a, key)), "{key:?} is applied");
        ensure!(
            !ok!(store.mark_applied(&a, key, Timestamp(6))),
            "{key:?} is not marked again"
        );
    }
    ok!(store.commit(&a, &commit, Timestamp(7)));
    ensure!(
        ok!(store.pending(&a)).is_empty(),
        "the same commit again is accepted and changes nothing"
    );
    ok!(store.commit(&agent("nobody")?, &commit, Timestamp(8)));
    ensure!(
        ok!(store.is_applied(&agent("nobody")?, "new")),
        "a commit for an agent with no store yet is applied"
    );
    Ok(())
}

async fn ensure_no_history(
    stores: &Stores,
    agent: &AgentId,
    channels: &[&ChannelId],
) -> Result<(), ConformanceError> {
    ensure_empty(&*stores.deliveries, &[agent]).await?;
    for c in channels {
        let history = ok!(stores.channels.history(agent, c, None));
        ensure!(
            history.is_empty(),
            "the suite needs fresh, empty stores; channel {c} of {agent} has {} records",
            history.len()
        );
    }
    Ok(())
}

/// Through a [`Stores`] bundle: a commit's records land in the bundle's channel store, appended in
/// the commit's order after what was there (as `ChannelStore::append` would: increasing sequence
/// numbers, the channels become known), together with the removal of the consumed envelopes and the
/// applied keys; later appends come after them. The same holds for
/// [`commit_owned`](crate::envelope::DeliveryStore::commit_owned).
pub async fn stores_commit_appends_records_in_order(
    stores: &Stores,
) -> Result<(), ConformanceError> {
    let a = agent("alpha")?;
    let (x, y) = (ChannelId::portal(&a), ChannelId::new("link:alpha:beta"));
    ensure_no_history(stores, &a, &[&x, &y]).await?;
    let (channels, deliveries) = (&*stores.channels, &*stores.deliveries);
    let before = ok!(channels.append(&a, commit_record(&a, &x, "before", 1)));
    let e = envelope(&a, "question", 2);
    ok!(deliveries.persist(&a, &e));
    let records = vec![
        commit_record(&a, &x, "one", 9),
        commit_record(&a, &y, UNUSUAL_TEXT, 3),
        commit_record(&a, &x, "two", 3),
        NewRecord {
            metadata: serde_json::json!({"task": 4, "k": UNUSUAL_TEXT})
                .as_object()
                .cloned()
                .unwrap_or_default(),
            ..commit_record(&a, &x, "three", 3)
        },
    ];
    let commit = TurnCommit {
        consumed: vec![e.id.clone()],
        records: records.clone(),
        applied: vec![format!("{}:reply", e.id)],
    };
    ok!(deliveries.commit(&a, &commit, Timestamp(10)));
    let after = ok!(channels.append(&a, commit_record(&a, &x, "after", 11)));
    let history_x = ok!(channels.history(&a, &x, None));
    ensure_eq!(
        history_x
            .iter()
            .map(|r| r.record.clone())
            .collect::<Vec<_>>(),
        vec![
            before.record.clone(),
            records[0].clone(),
            records[2].clone(),
            records[3].clone(),
            after.record.clone(),
        ],
        "the channel's history: earlier records, the commit's in order, later ones"
    );
    let history_y = ok!(channels.history(&a, &y, None));
    ensure_eq!(
        history_y
            .iter()
            .map(|r| r.record.clone())
            .collect::<Vec<_>>(),
        vec![records[1].clone()],
        "another channel the commit wrote to"
    );
    let mut seqs: Vec<u64> = history_x.iter().map(|r| r.seq).collect();
    seqs.extend(history_y.iter().map(|r| r.seq));
    seqs.sort_unstable();
    seqs.dedup();
    ensure_eq!(seqs.len(), 6, "every record has its own sequence number");
    ensure!(
        history_x.windows(2).all(|w| w[0].seq < w[1].seq)
            && history_y[0].seq > history_x[1].seq
            && history_y[0].seq < history_x[2].seq
            && history_x.iter().all(|r| r.agent == a),
        "sequence numbers increase in append order: {:?} and {:?}",
        history_x.iter().map(|r| r.seq).collect::<Vec<_>>(),
        history_y.iter().map(|r| r.seq).collect::<Vec<_>>()
    );
    ensure!(
        ok!(channels.channels(&a)).contains(&y),
        "a channel a commit wrote to is known"
    );
    ensure!(
        ok!(deliveries.pending(&a)).is_empty(),
        "the consumed envelope is removed with the records"
    );
    ensure!(
        ok!(deliveries.is_applied(&a, &format!("{}:reply", e.id))),
        "the key is applied with the records"
    );
    ensure!(
        ok!(channels.history(&agent("beta")?, &x, None)).is_empty(),
        "another agent's history is untouched"
    );
    // The same through `commit_owned` (a commit given away, as a turn writes its records).
    let e2 = envelope(&a, "again", 12);
    ok!(deliveries.persist(&a, &e2));
    let owned = vec![
        commit_record(&a, &x, "owned one", 12),
        commit_record(&a, &y, "owned two", 12),
    ];
    let commit = TurnCommit {
        consumed: vec![e2.id.clone()],
        records: owned.clone(),
        applied: vec![format!("{}:reply", e2.id)],
    };
    ok!(async {
        deliveries
            .commit_owned(&a, commit, Timestamp(12))
            .await
            .map_err(|(e, _)| e)
    });
    let tail_x = ok!(channels.history(&a, &x, Some(2)));
    ensure_eq!(
        tail_x.iter().map(|r| r.record.clone()).collect::<Vec<_>>(),
        vec![after.record.clone(), owned[0].clone()],
        "commit_owned appends after what was there"
    );
    let tail_y = ok!(channels.history(&a, &y, None));
    ensure_eq!(
        tail_y.iter().map(|r| r.record.clone()).collect::<Vec<_>>(),
        vec![records[1].clone(), owned[1].clone()],
        "commit_owned writes to every channel of the commit"
    );
    ensure!(
        ok!(deliveries.pending(&a)).is_empty()
            && ok!(deliveries.is_applied(&a, &format!("{}:reply", e2.id))),
        "commit_owned removes the consumed envelope and applies the key"
    );
    Ok(())
}

/// Through a [`Stores`] bundle: commits run concurrently with readers are all-or-nothing. Commit
/// `i` consumes envelope `i`, appends record `i` and marks key `i`; a reader that finds envelope
/// `i` gone, or key `i` applied, must then find record `i` in the history; in the end every commit
/// is wholly there.
pub async fn stores_concurrent_commits_are_all_or_nothing(
    stores: &Stores,
) -> Result<(), ConformanceError> {
    const N: usize = 16;
    const READERS: usize = 8;
    const ROUNDS: usize = 8;
    let a = agent("alpha")?;
    let channel = ChannelId::portal(&a);
    ensure_no_history(stores, &a, &[&channel]).await?;
    let (channels, deliveries) = (&*stores.channels, &*stores.deliveries);
    let envelopes: Vec<Envelope> = (0..N)
        .map(|i| envelope(&a, &format!("e{i}"), i as i64))
        .collect();
    for e in &envelopes {
        ok!(deliveries.persist(&a, e));
    }
    let key = |i: usize| format!("turn:{i}");
    let commits: Vec<TurnCommit> = (0..N)
        .map(|i| TurnCommit {
            consumed: vec![envelopes[i].id.clone()],
            records: vec![commit_record(&a, &channel, &format!("r{i}"), i as i64)],
            applied: vec![key(i)],
        })
        .collect();
    let writers = futures::future::join_all(
        commits
            .iter()
            .map(|c| deliveries.commit(&a, c, Timestamp(100))),
    );
    // A reader looks at one side of the commits, then at the other, in both orders: whatever part
    // of commit `i` it saw first, it must find the rest of commit `i` after.
    let (a, channel, key) = (&a, &channel, &key);
    let read = move |history_first: bool| async move {
        let mut views = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            let view = if history_first {
                let history = channels.history(a, channel, None).await?;
                let pending = deliveries.pending(a).await?;
                let mut applied = Vec::with_capacity(N);
                for i in 0..N {
                    applied.push(deliveries.is_applied(a, &key(i)).await?);
                }
                (history_first, history, pending, applied)
            } else {
                let pending = deliveries.pending(a).await?;
                let history = channels.history(a, channel, None).await?;
                (history_first, history, pending, Vec::new())
            };
            views.push(view);
        }
        Ok::<_, crate::error::StoreError>(views)
    };
    let readers = futures::future::join_all((0..READERS).map(|r| read(r % 2 == 0)));
    let (written, read_views) = futures::future::join(writers, readers).await;
    for result in written {
        if let Err(e) = result {
            return Err(ConformanceError::Store {
                op: "concurrent commit".into(),
                location: concat!(file!(), ":", line!()),
                source: e,
            });
        }
    }
    for views in read_views {
        let views = match views {
            Ok(v) => v,
            Err(e) => {
                return Err(ConformanceError::Store {
                    op: "read during concurrent commits".into(),
                    location: concat!(file!(), ":", line!()),
                    source: e,
                });
            }
        };
        for (history_first, history, pending, applied) in views {
            let recorded: Vec<&str> = history.iter().map(|r| r.record.content.as_str()).collect();
            for i in 0..N {
                let has_record = recorded.contains(&format!("r{i}").as_str());
                let consumed = !pending.iter().any(|e| e.id == envelopes[i].id);
                if history_first {
                    ensure!(
                        !has_record || (consumed && applied[i]),
                        "commit {i} was seen in part: its record was in the history, but a \
                         read after found its envelope consumed: {consumed}, its key applied: {}",
                        applied[i]
                    );
                } else {
                    ensure!(
                        !consumed || has_record,
                        "commit {i} was seen in part: its envelope was consumed, but its record \
                         was not in the history read after: {recorded:?}"
                    );
                }
            }
        }
    }
    ensure!(
        ok!(deliveries.pending(a)).is_empty(),
        "every commit removed its envelope"
    );
    for i in 0..N {
        ensure!(
            ok!(deliveries.is_applied(a, &key(i))),
            "commit {i} marked its key"
        );
    }
    let mut recorded: Vec<String> = ok!(channels.history(a, channel, None))
        .into_iter()
        .map(|r| r.record.content.into_string())
        .collect();
    recorded.sort();
    let mut expected: Vec<String> = (0..N).map(|i| format!("r{i}")).collect();
    expected.sort();
    ensure_eq!(recorded, expected, "every commit appended its record, once");
    Ok(())
}
