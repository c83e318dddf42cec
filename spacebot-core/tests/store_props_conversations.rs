//! Property test of the in-memory conversation store: random creates and updates (including
//! attempts to raise the budget, overwrite `initiated_from`, revive a severed conversation, reopen
//! onto a taken key, or write from a stale revision) never raise a budget, never overwrite
//! `initiated_from`, never revive a severed conversation, and never leave two open conversations
//! holding one key.

// The harness below runs outside `#[test]` functions, where clippy does not relax these lints.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, HashMap};

use futures::executor::block_on;
use proptest::prelude::*;
use spacebot_core::conversation::{
    Conversation, ConversationFilter, ConversationMode, ConversationStatus, ConversationStore,
};
use spacebot_core::error::StoreError;
use spacebot_core::memory::MemoryConversationStore;
use spacebot_core::{AgentId, ChannelId, ConversationId, Timestamp};

#[derive(Debug, Clone)]
enum Op {
    Create {
        id: u8,
        key: Option<u8>,
        open: bool,
        budget: u32,
    },
    Update {
        id: u8,
        status: u8,
        budget_delta: i8,
        initiated_from: Option<u8>,
        stale: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..6, prop::option::of(0u8..2), any::<bool>(), 0u32..10).prop_map(
            |(id, key, open, budget)| Op::Create {
                id,
                key,
                open,
                budget
            }
        ),
        (
            0u8..6,
            0u8..3,
            -3i8..3,
            prop::option::of(0u8..2),
            prop::bool::weighted(0.2)
        )
            .prop_map(
                |(id, status, budget_delta, initiated_from, stale)| Op::Update {
                    id,
                    status,
                    budget_delta,
                    initiated_from,
                    stale
                }
            ),
    ]
}

fn status(n: u8) -> ConversationStatus {
    [
        ConversationStatus::Open,
        ConversationStatus::Concluded,
        ConversationStatus::Severed,
    ][usize::from(n % 3)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn conversation_store_keeps_its_invariants(ops in prop::collection::vec(op(), 1..60)) {
        let store = MemoryConversationStore::new();
        let a = AgentId::parse("alpha").unwrap();
        let mut before: BTreeMap<ConversationId, Conversation> = BTreeMap::new();
        for op in &ops {
            match op {
                Op::Create { id, key, open, budget } => {
                    let c = Conversation {
                        id: ConversationId::new(format!("c{id}")),
                        mode: ConversationMode::Mirrored,
                        members: Vec::new(),
                        initiator: a.clone(),
                        initiated_from: None,
                        status: if *open { ConversationStatus::Open } else { ConversationStatus::Concluded },
                        budget_remaining: *budget,
                        pair_key: key.map(|k| format!("key-{k}")),
                        summary: None,
                        revision: 1,
                        created_at: Timestamp(0),
                        updated_at: Timestamp(0),
                    };
                    let result = block_on(store.create(&c));
                    let clash = before.contains_key(&c.id)
                        || (c.status == ConversationStatus::Open
                            && c.pair_key.is_some()
                            && before.values().any(|x| {
                                x.status == ConversationStatus::Open && x.pair_key == c.pair_key
                            }));
                    match result {
                        Ok(()) => prop_assert!(!clash, "create of {} accepted a clash", c.id),
                        Err(StoreError::AlreadyExists { .. }) => prop_assert!(clash),
                        Err(e) => panic!("unexpected error {e}"),
                    }
                }
                Op::Update { id, status: s, budget_delta, initiated_from, stale } => {
                    let Some(current) = block_on(store.get(&ConversationId::new(format!("c{id}")))).unwrap() else {
                        continue;
                    };
                    let budget = i64::from(current.budget_remaining) + i64::from(*budget_delta);
                    let next = Conversation {
                        status: status(*s),
                        budget_remaining: u32::try_from(budget.max(0)).unwrap(),
                        initiated_from: initiated_from.map(|n| ChannelId::new(format!("from-{n}"))),
                        ..current.clone()
                    };
                    let expected = if *stale { current.revision.saturating_sub(1) } else { current.revision };
                    match block_on(store.update(&next, expected)) {
                        Ok(stored) => {
                            prop_assert!(!stale);
                            prop_assert_eq!(stored.revision, current.revision + 1);
                        }
                        Err(StoreError::Conflict { .. }) => prop_assert!(*stale),
                        Err(StoreError::Invalid(_)) => {
                            prop_assert!(current.check_successor(&next).is_err());
                        }
                        Err(StoreError::AlreadyExists { .. }) => {
                            prop_assert_eq!(next.status, ConversationStatus::Open);
                        }
                        Err(e) => panic!("unexpected error {e}"),
                    }
                }
            }
            let after: BTreeMap<ConversationId, Conversation> =
                block_on(store.list(&ConversationFilter::default()))
                    .unwrap()
                    .into_iter()
                    .map(|c| (c.id.clone(), c))
                    .collect();
            for (id, prev) in &before {
                let now = &after[id];
                prop_assert!(now.budget_remaining <= prev.budget_remaining, "budget of {} raised", id);
                if prev.initiated_from.is_some() {
                    prop_assert_eq!(&now.initiated_from, &prev.initiated_from);
                }
                if prev.status == ConversationStatus::Severed {
                    prop_assert_eq!(now.status, ConversationStatus::Severed);
                }
                prop_assert!(now.revision >= prev.revision);
            }
            let mut holders: HashMap<&str, usize> = HashMap::new();
            for c in after.values() {
                if let (ConversationStatus::Open, Some(k)) = (c.status, c.pair_key.as_deref()) {
                    *holders.entry(k).or_default() += 1;
                }
            }
            prop_assert!(holders.values().all(|&n| n == 1), "two open conversations share a key: {:?}", holders);
            before = after;
        }
    }
}
