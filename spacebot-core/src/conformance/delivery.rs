//! [`DeliveryStore`] conformance.

use futures::future::join_all;

use super::support::{ConformanceError, UNUSUAL_TEXT, agent, ensure, ensure_eq, large_text, ok};
use crate::envelope::{DeliveryStore, Envelope, EnvelopeKind, Source};
use crate::ids::{AgentId, ChannelId, EnvelopeId, LinkId};
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
                number: u64::MAX - i as u64,
                holder: UNUSUAL_TEXT.into(),
            }),
            round: i as u32,
            conversation: (i % 3 == 2).then(|| crate::ids::ConversationId::new(UNUSUAL_TEXT)),
            cause: (i % 2 == 0).then(|| EnvelopeId::new(format!("cause {UNUSUAL_TEXT}"))),
        };
        ok!(store.persist(&a, &e));
        expected.push(e);
    }
    ensure_eq!(ok!(store.pending(&a)), expected, "pending round-trips");
    Ok(())
}
