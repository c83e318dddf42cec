//! [`ChannelStore`] conformance.

use futures::future::join_all;

use super::support::{ConformanceError, UNUSUAL_TEXT, agent, ensure, ensure_eq, large_text, ok};
use crate::channel::{ChannelRecord, ChannelStore, NewRecord, RecordKind};
use crate::ids::{AgentId, ChannelId};
use crate::text::Text;
use crate::time::Timestamp;

#[doc(hidden)]
#[macro_export]
macro_rules! __channel_store_tests {
    ($module:ident, $make:expr, |$s:ident| $access:expr) => {
        $crate::__conformance_module!(
            $module,
            $make,
            |$s| $access,
            [
                channel_store_append_and_history,
                channel_store_history_limit,
                channel_store_ensure_channel_and_channels,
                channel_store_concurrent_appends,
                channel_store_round_trip,
                channel_store_history_texts_as_it_grows,
            ]
        );
    };
}

async fn ensure_empty(
    store: &dyn ChannelStore,
    agents: &[&AgentId],
) -> Result<(), ConformanceError> {
    for a in agents {
        let channels = ok!(store.channels(a));
        ensure!(
            channels.is_empty(),
            "the suite needs a fresh, empty channel store; agent {a} has channels {channels:?}"
        );
    }
    Ok(())
}

fn record(channel: &ChannelId, content: &str, at: i64) -> NewRecord {
    NewRecord::new(
        channel.clone(),
        RecordKind::User,
        "user",
        content,
        Timestamp(at),
    )
}

fn contents(records: &[ChannelRecord]) -> Vec<&str> {
    records.iter().map(|r| r.record.content.as_str()).collect()
}

/// `append` returns the stored record with a sequence number that increases strictly per agent
/// (across its channels); `history` returns one channel's records in append order, whatever
/// their timestamps.
pub async fn channel_store_append_and_history(
    store: &dyn ChannelStore,
) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a, &b]).await?;
    let (c1, c2) = (ChannelId::link(&a, &b), ChannelId::portal(&a));
    let mut last_seq = None;
    // Timestamps deliberately out of order: history follows append order.
    let plan = [
        (&c1, "one", 50),
        (&c2, "two", 40),
        (&c1, "three", 30),
        (&c1, "four", 60),
    ];
    for (channel, content, at) in plan {
        let new = record(channel, content, at);
        let stored = ok!(store.append(&a, new.clone()));
        ensure_eq!(&stored.record, &new, "append returns the record as given");
        ensure_eq!(&stored.agent, &a, "append returns the owning agent");
        if let Some(prev) = last_seq {
            ensure!(
                stored.seq > prev,
                "sequence numbers increase strictly per agent: {} after {prev}",
                stored.seq
            );
        }
        last_seq = Some(stored.seq);
    }
    let h1 = ok!(store.history(&a, &c1, None));
    ensure_eq!(
        contents(&h1),
        vec!["one", "three", "four"],
        "history of one channel"
    );
    ensure!(
        h1.windows(2).all(|w| w[0].seq < w[1].seq),
        "history is in sequence order"
    );
    ensure_eq!(
        contents(&ok!(store.history(&a, &c2, None))),
        vec!["two"],
        "another channel"
    );
    ensure!(
        ok!(store.history(&b, &c1, None)).is_empty(),
        "the same channel id on another agent is another history"
    );
    let other = ok!(store.append(&b, record(&c1, "b's own", 10)));
    ensure_eq!(&other.agent, &b, "another agent's record");
    ensure_eq!(
        contents(&ok!(store.history(&b, &c1, None))),
        vec!["b's own"],
        "agents' histories are separate"
    );
    ensure_eq!(
        contents(&ok!(store.history(&a, &c1, None))),
        vec!["one", "three", "four"],
        "appending for another agent leaves this one alone"
    );
    ensure!(
        ok!(store.history(&a, &ChannelId::new("unknown"), None)).is_empty(),
        "an unknown channel has no history"
    );
    Ok(())
}

/// With a limit, `history` returns the most recent `limit` records, oldest first; a limit of 0
/// returns nothing, a limit above the length returns everything.
pub async fn channel_store_history_limit(store: &dyn ChannelStore) -> Result<(), ConformanceError> {
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    let (c, noise) = (ChannelId::portal(&a), ChannelId::new("noise"));
    for i in 0..10 {
        ok!(store.append(&a, record(&c, &format!("m{i}"), i)));
        ok!(store.append(&a, record(&noise, &format!("n{i}"), i)));
    }
    ensure_eq!(
        contents(&ok!(store.history(&a, &c, Some(3)))),
        vec!["m7", "m8", "m9"],
        "the last three, oldest first"
    );
    ensure!(ok!(store.history(&a, &c, Some(0))).is_empty(), "limit 0");
    ensure_eq!(
        ok!(store.history(&a, &c, Some(100))).len(),
        10,
        "a limit above the length"
    );
    ensure_eq!(
        ok!(store.history(&a, &c, Some(10))),
        ok!(store.history(&a, &c, None)),
        "a limit equal to the length is everything"
    );
    Ok(())
}

/// `ensure_channel` registers a channel (idempotent) so it is listed with no records;
/// `channels` lists ensured and appended-to channels of one agent, sorted.
pub async fn channel_store_ensure_channel_and_channels(
    store: &dyn ChannelStore,
) -> Result<(), ConformanceError> {
    let (a, b, c) = (agent("alpha")?, agent("beta")?, agent("gamma")?);
    ensure_empty(store, &[&a, &b]).await?;
    let ab = ChannelId::link(&a, &b);
    let ac = ChannelId::link(&a, &c);
    let portal = ChannelId::portal(&a);
    ok!(store.ensure_channel(&a, &ac));
    ok!(store.ensure_channel(&a, &ab));
    ok!(store.ensure_channel(&a, &ab));
    ok!(store.append(&a, record(&portal, "hello", 1)));
    ok!(store.append(&a, record(&ab, "hi", 2)));
    ok!(store.ensure_channel(&a, &ab));
    let mut expected = vec![ab.clone(), ac.clone(), portal];
    expected.sort();
    ensure_eq!(
        ok!(store.channels(&a)),
        expected,
        "channels, sorted, each once"
    );
    ensure!(
        ok!(store.history(&a, &ac, None)).is_empty(),
        "an ensured channel has no records"
    );
    ensure_eq!(
        contents(&ok!(store.history(&a, &ab, None))),
        vec!["hi"],
        "ensure_channel keeps existing records"
    );
    ensure!(ok!(store.channels(&b)).is_empty(), "channels are per agent");
    Ok(())
}

/// Concurrent appends to one agent all land, each with its own sequence number.
pub async fn channel_store_concurrent_appends(
    store: &dyn ChannelStore,
) -> Result<(), ConformanceError> {
    const N: usize = 48;
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    let channels = [ChannelId::new("one"), ChannelId::new("two")];
    let appends = (0..N).map(|i| store.append(&a, record(&channels[i % 2], &format!("m{i}"), 1)));
    let mut seqs = Vec::new();
    for result in join_all(appends).await {
        match result {
            Ok(r) => seqs.push(r.seq),
            Err(e) => {
                return Err(ConformanceError::Store {
                    op: "concurrent append".into(),
                    location: concat!(file!(), ":", line!()),
                    source: e,
                });
            }
        }
    }
    seqs.sort_unstable();
    seqs.dedup();
    ensure_eq!(seqs.len(), N, "every append got its own sequence number");
    let total = ok!(store.history(&a, &channels[0], None)).len()
        + ok!(store.history(&a, &channels[1], None)).len();
    ensure_eq!(total, N, "every concurrent append is stored");
    Ok(())
}

/// Records with unusual text, every kind, empty and nested metadata, a megabyte of content and
/// extreme timestamps round-trip exactly; `history_texts` returns the same records' kinds,
/// authors and texts.
pub async fn channel_store_round_trip(store: &dyn ChannelStore) -> Result<(), ConformanceError> {
    let a = agent("alpha")?;
    ensure_empty(store, &[&a]).await?;
    let channel = ChannelId::new(format!("discord:{UNUSUAL_TEXT}"));
    let mut metadata = serde_json::Map::new();
    metadata.insert("task".into(), serde_json::json!(4));
    metadata.insert(
        UNUSUAL_TEXT.into(),
        serde_json::json!({"x": [UNUSUAL_TEXT, null, -1.5]}),
    );
    let kinds = [
        RecordKind::User,
        RecordKind::Assistant,
        RecordKind::Sent,
        RecordKind::System,
        RecordKind::Tool,
    ];
    let mut expected = Vec::new();
    for (i, kind) in kinds.into_iter().enumerate() {
        let new = NewRecord {
            channel: channel.clone(),
            kind,
            author: if i == 0 {
                Text::default()
            } else {
                UNUSUAL_TEXT.into()
            },
            content: match i {
                0 => Text::default(),
                1 => large_text().into(),
                _ => UNUSUAL_TEXT.into(),
            },
            metadata: if i % 2 == 0 {
                serde_json::Map::new()
            } else {
                metadata.clone()
            },
            at: Timestamp([i64::MIN, -1, 0, 1, i64::MAX][i]),
        };
        expected.push(ok!(store.append(&a, new)));
    }
    ensure_eq!(
        ok!(store.history(&a, &channel, None)),
        expected,
        "history round-trips"
    );
    // `history_texts` returns the same records' kinds, authors and texts, with the limit.
    let texts = ok!(store.history_texts(&a, &channel, Some(4)));
    ensure_eq!(
        texts,
        expected[1..]
            .iter()
            .map(|r| crate::channel::HistoryText {
                seq: r.seq,
                kind: r.record.kind,
                author: r.record.author.clone(),
                content: r.record.content.clone(),
            })
            .collect::<Vec<_>>(),
        "history_texts returns the same records' texts, the most recent `limit`"
    );
    ensure!(
        ok!(store.history_texts(&a, &channel, Some(0))).is_empty()
            && ok!(store.history_texts(&a, &ChannelId::new("nowhere"), None)).is_empty(),
        "history_texts: a limit of 0 and an unknown channel give none"
    );
    ensure_eq!(
        ok!(store.channels(&a)),
        vec![channel],
        "the channel id round-trips"
    );
    Ok(())
}

/// `history_texts` and `history_texts_after` read again and again while channels grow (by one
/// record, by none, by more than a page at once; on two channels of one agent and a channel of the
/// same name of another; appends racing the reads) answer what `history` answers, for every limit
/// and every starting number.
pub async fn channel_store_history_texts_as_it_grows(
    store: &dyn ChannelStore,
) -> Result<(), ConformanceError> {
    let (a, b) = (agent("alpha")?, agent("beta")?);
    ensure_empty(store, &[&a, &b]).await?;
    let (one, two) = (ChannelId::new("portal:one"), ChannelId::new("portal:two"));
    let read = [(&a, &one), (&a, &two), (&b, &one)];
    let texts = |records: Vec<ChannelRecord>| -> Vec<crate::channel::HistoryText> {
        records
            .into_iter()
            .map(|r| crate::channel::HistoryText {
                seq: r.seq,
                kind: r.record.kind,
                author: r.record.author,
                content: r.record.content,
            })
            .collect()
    };
    let mut n = 0i64;
    // How many records each step appends, to which of the three channels in turn.
    for (step, grow) in [1usize, 0, 2, 3, 70, 1, 65, 64, 5, 0, 1, 130, 1]
        .into_iter()
        .enumerate()
    {
        let appends = (0..grow).map(|i| {
            n += 1;
            let (who, channel) = read[(step + i) % read.len()];
            let record = record(channel, &format!("{step}.{i}"), n);
            async move { store.append(who, record).await }
        });
        let appends: Vec<_> = appends.collect();
        // The first read of each step races the step's appends.
        let (appended, raced) =
            futures::join!(join_all(appends), store.history_texts(&a, &one, Some(64)));
        for done in appended {
            ok!(async { done });
        }
        // What it answers is the channel's newest page as it stood at some moment: every
        // record up to its newest, the last 64 of them.
        let raced = ok!(async { raced });
        if let Some(last) = raced.last() {
            let upto: Vec<_> = texts(ok!(store.history(&a, &one, None)))
                .into_iter()
                .filter(|t| t.seq <= last.seq)
                .collect();
            ensure_eq!(
                raced,
                upto[upto.len().saturating_sub(64)..].to_vec(),
                "step {step}: history_texts racing appends answers a page as it stood"
            );
        }
        for (who, channel) in read {
            let all = texts(ok!(store.history(who, channel, None)));
            let last = all.last().map_or(0, |t| t.seq);
            let middle = all.get(all.len() / 2).map_or(0, |t| t.seq);
            for after in [0, middle, last.saturating_sub(1), last, last + 1] {
                for limit in [1, 3, 64, 65] {
                    let newer: Vec<_> = all.iter().filter(|t| t.seq > after).cloned().collect();
                    let expected = newer[newer.len().saturating_sub(limit)..].to_vec();
                    let got = ok!(store.history_texts_after(who, channel, after, limit));
                    ensure_eq!(
                        got,
                        expected,
                        "step {step}: history_texts_after({after}) of {who}'s {channel} with \
                         limit {limit} after {n} appends"
                    );
                }
            }
            for limit in [Some(1), Some(3), Some(64), Some(65), None] {
                let expected = texts(ok!(store.history(who, channel, limit)));
                let got = ok!(store.history_texts(who, channel, limit));
                ensure_eq!(
                    got,
                    expected,
                    "step {step}: history_texts of {who}'s {channel} with limit {limit:?} after \
                     {n} appends"
                );
            }
        }
    }
    Ok(())
}
