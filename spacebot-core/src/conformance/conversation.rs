//! [`ConversationStore`] conformance.

use futures::future::join_all;

use super::support::{
    ConformanceError, UNUSUAL_TEXT, agent, ensure, ensure_eq, ensure_err, large_text, ok,
};
use crate::conversation::{
    Conversation, ConversationFilter, ConversationMode, ConversationStatus, ConversationStore,
    Member, MemberRole,
};
use crate::error::StoreError;
use crate::ids::{AgentId, ChannelId, ConversationId};
use crate::time::Timestamp;

#[doc(hidden)]
#[macro_export]
macro_rules! __conversation_store_tests {
    ($module:ident, $make:expr, |$s:ident| $access:expr) => {
        $crate::__conformance_module!(
            $module,
            $make,
            |$s| $access,
            [
                conversation_store_create_get,
                conversation_store_update_compare_and_swap,
                conversation_store_budget_never_raised,
                conversation_store_initiated_from_set_once,
                conversation_store_severed_stays_severed,
                conversation_store_identity_is_fixed,
                conversation_store_pair_key_unique_among_open,
                conversation_store_concurrent_creates_one_open,
                conversation_store_reopen_with_taken_key,
                conversation_store_list_filters_and_order,
                conversation_store_round_trip,
            ]
        );
    };
}

async fn ensure_empty(store: &dyn ConversationStore) -> Result<(), ConformanceError> {
    let all = ok!(store.list(&ConversationFilter::default()));
    ensure!(
        all.is_empty(),
        "the suite needs a fresh, empty conversation store; found {} conversations",
        all.len()
    );
    Ok(())
}

fn member(agent: &AgentId, peer: &AgentId, number: u32, role: MemberRole) -> Member {
    Member {
        agent: agent.clone(),
        channel: ChannelId::link(agent, peer),
        name: agent.as_str().to_uppercase(),
        number,
        role,
        open: true,
    }
}

fn pair_key(a: &AgentId, b: &AgentId) -> String {
    let (x, y) = if a <= b { (a, b) } else { (b, a) };
    format!("{x}|{y}")
}

fn mirrored(id: &str, a: &AgentId, b: &AgentId, at: i64) -> Conversation {
    Conversation {
        id: ConversationId::new(id),
        mode: ConversationMode::Mirrored,
        members: vec![
            member(a, b, 1, MemberRole::Initiator),
            member(b, a, 2, MemberRole::Responder),
        ],
        initiator: a.clone(),
        initiated_from: Some(ChannelId::portal(a)),
        status: ConversationStatus::Open,
        budget_remaining: 20,
        pair_key: Some(pair_key(a, b)),
        summary: None,
        revision: 1,
        created_at: Timestamp(at),
        updated_at: Timestamp(at),
    }
}

async fn get(
    store: &dyn ConversationStore,
    id: &ConversationId,
) -> Result<Conversation, ConformanceError> {
    match ok!(store.get(id)) {
        Some(c) => Ok(c),
        None => Err(ConformanceError::check(
            "conversation exists",
            format!("conversation {id} is missing"),
            concat!(file!(), ":", line!()),
        )),
    }
}

/// `create` stores a conversation as given (revision included) and `get` returns it; a second
/// create with the same id is `AlreadyExists` and writes nothing.
pub async fn conversation_store_create_get(
    store: &dyn ConversationStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b, c) = (agent("alpha")?, agent("beta")?, agent("gamma")?);
    let conv = mirrored("conv-1", &a, &b, 1_000);
    ok!(store.create(&conv));
    ensure_eq!(
        get(store, &conv.id).await?,
        conv.clone(),
        "get after create"
    );
    let same_id = Conversation {
        pair_key: Some(pair_key(&a, &c)),
        ..mirrored("conv-1", &a, &c, 2_000)
    };
    ensure_err!(
        store.create(&same_id).await,
        StoreError::AlreadyExists { .. },
        "a second conversation with the same id"
    );
    ensure_eq!(
        get(store, &conv.id).await?,
        conv.clone(),
        "the first is untouched"
    );
    ensure_eq!(
        ok!(store.list(&ConversationFilter::default())).len(),
        1,
        "a refused create writes nothing"
    );
    ensure_eq!(
        ok!(store.get(&ConversationId::new("nope"))),
        None,
        "get of an unknown id"
    );
    let at_rev_7 = Conversation {
        revision: 7,
        pair_key: None,
        ..mirrored("conv-2", &b, &c, 3_000)
    };
    ok!(store.create(&at_rev_7));
    ensure_eq!(
        get(store, &at_rev_7.id).await?.revision,
        7,
        "create keeps the given revision"
    );
    Ok(())
}

/// `update(next, expected)` writes `next` with revision `expected + 1` when the stored revision
/// is `expected`, returns what it stored, and refuses a stale revision with `Conflict` (writing
/// nothing); `NotFound` for an unknown id.
pub async fn conversation_store_update_compare_and_swap(
    store: &dyn ConversationStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b) = (agent("alpha")?, agent("beta")?);
    let conv = mirrored("conv-1", &a, &b, 1_000);
    ok!(store.create(&conv));
    let next = Conversation {
        budget_remaining: 19,
        summary: Some("halfway".into()),
        updated_at: Timestamp(1_500),
        revision: 12345, // ignored: the store writes expected + 1
        ..conv.clone()
    };
    let stored = ok!(store.update(&next, 1));
    let expected = Conversation {
        revision: 2,
        ..next.clone()
    };
    ensure_eq!(&stored, &expected, "update returns the stored record");
    ensure_eq!(
        get(store, &conv.id).await?,
        expected.clone(),
        "get after update"
    );
    let stale = Conversation {
        budget_remaining: 18,
        ..expected.clone()
    };
    ensure_err!(
        store.update(&stale, 1).await,
        StoreError::Conflict { what, .. } if what.contains("conv-1"),
        "update with a stale revision (the error names the conversation)"
    );
    ensure_err!(
        store.update(&stale, 3).await,
        StoreError::Conflict { .. },
        "update with a future revision"
    );
    ensure_eq!(
        get(store, &conv.id).await?,
        expected,
        "a refused update writes nothing"
    );
    ensure_eq!(
        ok!(store.update(&stale, 2)).revision,
        3,
        "the right revision wins"
    );
    let unknown = mirrored("nope", &a, &b, 1_000);
    ensure_err!(
        store.update(&unknown, 1).await,
        StoreError::NotFound { what } if what.contains("nope"),
        "update of an unknown conversation (the error names it)"
    );

    // Two writers read revision 3; exactly one update lands.
    let current = get(store, &conv.id).await?;
    let w1 = Conversation {
        budget_remaining: 10,
        ..current.clone()
    };
    let w2 = Conversation {
        budget_remaining: 11,
        ..current.clone()
    };
    let (r1, r2) = futures::join!(store.update(&w1, 3), store.update(&w2, 3));
    ensure_eq!(
        (r1.is_ok() as u8) + (r2.is_ok() as u8),
        1,
        "of two concurrent updates from one revision, exactly one lands: {r1:?} / {r2:?}"
    );
    Ok(())
}

/// An update that raises the turn budget is refused with `Invalid` and writes nothing; lowering
/// it or keeping it is fine.
pub async fn conversation_store_budget_never_raised(
    store: &dyn ConversationStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b) = (agent("alpha")?, agent("beta")?);
    let conv = mirrored("conv-1", &a, &b, 1_000);
    ok!(store.create(&conv));
    let raised = Conversation {
        budget_remaining: 21,
        ..conv.clone()
    };
    ensure_err!(
        store.update(&raised, 1).await,
        StoreError::Invalid(_),
        "raising the budget"
    );
    ensure_eq!(
        get(store, &conv.id).await?,
        conv.clone(),
        "a refused update writes nothing"
    );
    let same = ok!(store.update(&conv, 1));
    ensure_eq!(same.budget_remaining, 20, "keeping the budget");
    let lowered = ok!(store.update(
        &Conversation {
            budget_remaining: 0,
            ..same.clone()
        },
        2
    ));
    ensure_eq!(lowered.budget_remaining, 0, "lowering the budget to zero");
    let reset = Conversation {
        budget_remaining: 20,
        ..lowered.clone()
    };
    ensure_err!(
        store.update(&reset, 3).await,
        StoreError::Invalid(_),
        "resetting a spent budget"
    );
    ensure_eq!(
        get(store, &conv.id).await?.budget_remaining,
        0,
        "the budget stays spent"
    );
    Ok(())
}

/// `initiated_from` may be set once (from none) and is never overwritten or cleared afterwards.
pub async fn conversation_store_initiated_from_set_once(
    store: &dyn ConversationStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b) = (agent("alpha")?, agent("beta")?);
    let conv = Conversation {
        initiated_from: None,
        ..mirrored("conv-1", &a, &b, 1_000)
    };
    ok!(store.create(&conv));
    let first = ChannelId::portal(&a);
    let set = ok!(store.update(
        &Conversation {
            initiated_from: Some(first.clone()),
            ..conv.clone()
        },
        1
    ));
    ensure_eq!(set.initiated_from.as_ref(), Some(&first), "set once");
    let overwrite = Conversation {
        initiated_from: Some(ChannelId::new("somewhere-else")),
        ..set.clone()
    };
    ensure_err!(
        store.update(&overwrite, 2).await,
        StoreError::Invalid(_),
        "overwriting initiated_from"
    );
    let clear = Conversation {
        initiated_from: None,
        ..set.clone()
    };
    ensure_err!(
        store.update(&clear, 2).await,
        StoreError::Invalid(_),
        "clearing initiated_from"
    );
    ensure_eq!(
        get(store, &conv.id).await?,
        set,
        "a refused update writes nothing"
    );
    Ok(())
}

/// A severed conversation stays severed: reopening or concluding it is refused with `Invalid`;
/// other changes that keep it severed are allowed.
pub async fn conversation_store_severed_stays_severed(
    store: &dyn ConversationStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b) = (agent("alpha")?, agent("beta")?);
    let conv = mirrored("conv-1", &a, &b, 1_000);
    ok!(store.create(&conv));
    let severed = ok!(store.update(
        &Conversation {
            status: ConversationStatus::Severed,
            ..conv.clone()
        },
        1
    ));
    ensure_eq!(severed.status, ConversationStatus::Severed, "sever");
    for status in [ConversationStatus::Open, ConversationStatus::Concluded] {
        ensure_err!(
            store
                .update(
                    &Conversation {
                        status,
                        ..severed.clone()
                    },
                    2
                )
                .await,
            StoreError::Invalid(_),
            "a severed conversation moved to {status}"
        );
    }
    ensure_eq!(
        get(store, &conv.id).await?,
        severed.clone(),
        "a refused update writes nothing"
    );
    let members_closed = Conversation {
        members: severed
            .members
            .iter()
            .cloned()
            .map(|m| Member { open: false, ..m })
            .collect(),
        ..severed.clone()
    };
    ensure_eq!(
        ok!(store.update(&members_closed, 2)).status,
        ConversationStatus::Severed,
        "closing the members of a severed conversation"
    );
    ensure_eq!(
        ok!(store.find_open(&pair_key(&a, &b))),
        None,
        "a severed conversation is not open"
    );
    Ok(())
}

/// An update cannot change a conversation's id, mode or initiator (`Invalid`).
pub async fn conversation_store_identity_is_fixed(
    store: &dyn ConversationStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b) = (agent("alpha")?, agent("beta")?);
    let conv = mirrored("conv-1", &a, &b, 1_000);
    ok!(store.create(&conv));
    let group = Conversation {
        mode: ConversationMode::Group,
        ..conv.clone()
    };
    ensure_err!(
        store.update(&group, 1).await,
        StoreError::Invalid(_),
        "changing the mode"
    );
    let other = Conversation {
        initiator: b.clone(),
        ..conv.clone()
    };
    ensure_err!(
        store.update(&other, 1).await,
        StoreError::Invalid(_),
        "changing the initiator"
    );
    ensure_eq!(
        get(store, &conv.id).await?,
        conv,
        "a refused update writes nothing"
    );
    Ok(())
}

/// At most one open conversation holds a `pair_key`: a second open create is `AlreadyExists`;
/// once the first is concluded or severed the key is free; `find_open` returns the holder.
/// Concluded conversations may share a key, and conversations without a key never clash.
pub async fn conversation_store_pair_key_unique_among_open(
    store: &dyn ConversationStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b) = (agent("alpha")?, agent("beta")?);
    let key = pair_key(&a, &b);
    ensure_eq!(ok!(store.find_open(&key)), None, "no holder yet");
    let first = mirrored("conv-1", &a, &b, 1_000);
    ok!(store.create(&first));
    ensure_eq!(ok!(store.find_open(&key)), Some(first.clone()), "find_open");
    let second = mirrored("conv-2", &b, &a, 2_000);
    ensure_err!(
        store.create(&second).await,
        StoreError::AlreadyExists { .. },
        "a second open conversation with the same key"
    );
    ensure_eq!(
        get(store, &first.id).await?,
        first.clone(),
        "the holder is untouched"
    );
    ensure_eq!(
        ok!(store.get(&second.id)),
        None,
        "a refused create writes nothing"
    );
    let concluded_copy = Conversation {
        status: ConversationStatus::Concluded,
        ..second.clone()
    };
    ok!(store.create(&concluded_copy));
    ensure_eq!(
        ok!(store.find_open(&key)).map(|c| c.id),
        Some(first.id.clone()),
        "a concluded conversation with the key does not hold it"
    );
    let concluded = ok!(store.update(
        &Conversation {
            status: ConversationStatus::Concluded,
            summary: Some("done".into()),
            ..first.clone()
        },
        1
    ));
    ensure_eq!(ok!(store.find_open(&key)), None, "concluding frees the key");
    let third = mirrored("conv-3", &a, &b, 3_000);
    ok!(store.create(&third));
    ensure_eq!(
        ok!(store.find_open(&key)),
        Some(third.clone()),
        "a new holder"
    );
    ok!(store.update(
        &Conversation {
            status: ConversationStatus::Severed,
            ..third.clone()
        },
        1
    ));
    ensure_eq!(ok!(store.find_open(&key)), None, "severing frees the key");
    let keyless_1 = Conversation {
        pair_key: None,
        ..mirrored("conv-4", &a, &b, 4_000)
    };
    let keyless_2 = Conversation {
        pair_key: None,
        ..mirrored("conv-5", &a, &b, 5_000)
    };
    ok!(store.create(&keyless_1));
    ok!(store.create(&keyless_2));
    ensure_eq!(
        ok!(store.find_open(&key)),
        None,
        "keyless conversations hold no key"
    );
    ensure_eq!(concluded.status, ConversationStatus::Concluded, "concluded");
    Ok(())
}

/// Many concurrent creates of open conversations with one `pair_key` leave exactly one open
/// conversation: one create succeeds, every other is `AlreadyExists`.
pub async fn conversation_store_concurrent_creates_one_open(
    store: &dyn ConversationStore,
) -> Result<(), ConformanceError> {
    const N: usize = 24;
    ensure_empty(store).await?;
    let (a, b) = (agent("alpha")?, agent("beta")?);
    let candidates: Vec<Conversation> = (0..N)
        .map(|i| mirrored(&format!("conv-{i}"), &a, &b, 1_000 + i as i64))
        .collect();
    let results = join_all(candidates.iter().map(|c| store.create(c))).await;
    let mut winners = Vec::new();
    for (c, result) in candidates.iter().zip(results) {
        match result {
            Ok(()) => winners.push(c.id.clone()),
            Err(StoreError::AlreadyExists { .. }) => {}
            Err(e) => {
                return Err(ConformanceError::Store {
                    op: "concurrent create".into(),
                    location: concat!(file!(), ":", line!()),
                    source: e,
                });
            }
        }
    }
    ensure_eq!(
        winners.len(),
        1,
        "exactly one concurrent create succeeds: {winners:?}"
    );
    let open = ok!(store.list(&ConversationFilter {
        member: None,
        statuses: vec![ConversationStatus::Open],
    }));
    ensure_eq!(
        open.into_iter().map(|c| c.id).collect::<Vec<_>>(),
        winners.clone(),
        "one open conversation, the winner's"
    );
    ensure_eq!(
        ok!(store.find_open(&pair_key(&a, &b))).map(|c| c.id),
        winners.first().cloned(),
        "find_open returns the winner"
    );
    Ok(())
}

/// A concluded conversation may be reopened (its record, and so its history, kept) while no other
/// open conversation holds its key; otherwise the reopen is `AlreadyExists` and writes nothing.
pub async fn conversation_store_reopen_with_taken_key(
    store: &dyn ConversationStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b) = (agent("alpha")?, agent("beta")?);
    let key = pair_key(&a, &b);
    let first = mirrored("conv-1", &a, &b, 1_000);
    ok!(store.create(&first));
    let concluded = ok!(store.update(
        &Conversation {
            status: ConversationStatus::Concluded,
            summary: Some("s".into()),
            ..first.clone()
        },
        1
    ));
    let reopened = ok!(store.update(
        &Conversation {
            status: ConversationStatus::Open,
            ..concluded.clone()
        },
        2
    ));
    ensure_eq!(
        reopened.status,
        ConversationStatus::Open,
        "reopen while the key is free"
    );
    ensure_eq!(
        reopened.summary.as_deref(),
        Some("s"),
        "reopening keeps the record"
    );
    ensure_eq!(
        ok!(store.find_open(&key)).map(|c| c.id),
        Some(first.id.clone()),
        "the reopened holds the key"
    );
    let concluded = ok!(store.update(
        &Conversation {
            status: ConversationStatus::Concluded,
            ..reopened
        },
        3
    ));
    let other = mirrored("conv-2", &b, &a, 2_000);
    ok!(store.create(&other));
    let reopen = Conversation {
        status: ConversationStatus::Open,
        ..concluded.clone()
    };
    ensure_err!(
        store.update(&reopen, 4).await,
        StoreError::AlreadyExists { .. },
        "reopening while another open conversation holds the key"
    );
    ensure_eq!(
        get(store, &first.id).await?,
        concluded,
        "a refused reopen writes nothing"
    );
    ensure_eq!(
        ok!(store.find_open(&key)).map(|c| c.id),
        Some(other.id.clone()),
        "the other still holds the key"
    );
    // An update of the holder itself (staying open) does not clash with its own key.
    let spent = ok!(store.update(
        &Conversation {
            budget_remaining: 3,
            ..other.clone()
        },
        1
    ));
    ensure_eq!(spent.budget_remaining, 3, "the holder updates while open");
    Ok(())
}

/// `list` filters by member and statuses and sorts by `(created_at, id)`.
pub async fn conversation_store_list_filters_and_order(
    store: &dyn ConversationStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b, c, d) = (
        agent("alpha")?,
        agent("beta")?,
        agent("gamma")?,
        agent("delta")?,
    );
    // Created out of order; two share a created_at and sort by id.
    let c3 = mirrored("c3", &a, &b, 3_000);
    let c1 = mirrored("c1", &b, &c, 1_000);
    let c2b = mirrored("c2-b", &a, &c, 2_000);
    let c2a = Conversation {
        status: ConversationStatus::Concluded,
        ..mirrored("c2-a", &c, &d, 2_000)
    };
    let group = Conversation {
        mode: ConversationMode::Group,
        members: vec![
            member(&d, &a, 1, MemberRole::Initiator),
            member(&a, &d, 2, MemberRole::Member),
            member(&b, &d, 3, MemberRole::Member),
        ],
        initiator: d.clone(),
        pair_key: None,
        status: ConversationStatus::Severed,
        ..mirrored("c0", &d, &a, 500)
    };
    for conv in [&c3, &c1, &c2b, &c2a, &group] {
        ok!(store.create(conv));
    }
    let ids = |v: Vec<Conversation>| v.into_iter().map(|c| c.id.into_inner()).collect::<Vec<_>>();
    ensure_eq!(
        ids(ok!(store.list(&ConversationFilter::default()))),
        vec!["c0", "c1", "c2-a", "c2-b", "c3"],
        "everything, by (created_at, id)"
    );
    let with_a = ConversationFilter {
        member: Some(a.clone()),
        statuses: vec![],
    };
    ensure_eq!(
        ids(ok!(store.list(&with_a))),
        vec!["c0", "c2-b", "c3"],
        "member filter"
    );
    let open = ConversationFilter {
        member: None,
        statuses: vec![ConversationStatus::Open],
    };
    ensure_eq!(
        ids(ok!(store.list(&open))),
        vec!["c1", "c2-b", "c3"],
        "status filter"
    );
    let ended_with_b = ConversationFilter {
        member: Some(b.clone()),
        statuses: vec![ConversationStatus::Severed, ConversationStatus::Concluded],
    };
    ensure_eq!(
        ids(ok!(store.list(&ended_with_b))),
        vec!["c0"],
        "filters combine"
    );
    let nobody = ConversationFilter {
        member: Some(agent("nobody")?),
        statuses: vec![],
    };
    ensure!(
        ok!(store.list(&nobody)).is_empty(),
        "a member in no conversation"
    );
    Ok(())
}

/// Conversations with unusual text, many members, empty and huge summaries and extreme values
/// round-trip exactly through `create`, `update`, `get`, `find_open` and `list`.
pub async fn conversation_store_round_trip(
    store: &dyn ConversationStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let agents: Vec<AgentId> = (0..12)
        .map(|i| agent(&format!("agent-{i:02}")))
        .collect::<Result<_, _>>()?;
    let members: Vec<Member> = agents
        .iter()
        .enumerate()
        .map(|(i, a)| Member {
            agent: a.clone(),
            channel: ChannelId::new(format!("group:{UNUSUAL_TEXT}:{a}")),
            name: if i == 0 {
                String::new()
            } else {
                format!("{UNUSUAL_TEXT} {i}")
            },
            number: u32::try_from(i + 1).unwrap_or(u32::MAX),
            role: match i {
                0 => MemberRole::Initiator,
                1 => MemberRole::Responder,
                _ => MemberRole::Member,
            },
            open: i % 3 != 2,
        })
        .collect();
    let conv = Conversation {
        id: ConversationId::new(format!("{UNUSUAL_TEXT} id")),
        mode: ConversationMode::Group,
        members,
        initiator: agents[0].clone(),
        initiated_from: Some(ChannelId::new(format!("portal:{UNUSUAL_TEXT}"))),
        status: ConversationStatus::Open,
        budget_remaining: u32::MAX,
        pair_key: Some(UNUSUAL_TEXT.into()),
        summary: Some(String::new()),
        revision: 1,
        created_at: Timestamp(i64::MIN),
        updated_at: Timestamp(i64::MAX),
    };
    ok!(store.create(&conv));
    ensure_eq!(get(store, &conv.id).await?, conv.clone(), "get round-trips");
    ensure_eq!(
        ok!(store.find_open(UNUSUAL_TEXT)),
        Some(conv.clone()),
        "find_open round-trips"
    );
    let next = Conversation {
        summary: Some(large_text()),
        budget_remaining: 0,
        status: ConversationStatus::Concluded,
        ..conv.clone()
    };
    let stored = ok!(store.update(&next, 1));
    ensure_eq!(
        &stored,
        &Conversation {
            revision: 2,
            ..next
        },
        "update round-trips"
    );
    ensure_eq!(
        get(store, &conv.id).await?,
        stored.clone(),
        "get after update round-trips"
    );
    ensure_eq!(
        ok!(store.list(&ConversationFilter::default())),
        vec![stored],
        "list round-trips"
    );
    let minimal = Conversation {
        members: Vec::new(),
        initiated_from: None,
        pair_key: None,
        summary: None,
        ..mirrored("minimal", &agents[1], &agents[2], 0)
    };
    ok!(store.create(&minimal));
    ensure_eq!(
        get(store, &minimal.id).await?,
        minimal,
        "a conversation without members or options"
    );
    Ok(())
}
