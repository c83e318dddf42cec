//! Property test of the in-memory link store against a plain model: random creates, updates,
//! deletes and batch upserts (with clashing ids and repeated pairs) give the same results and the
//! same contents as the model, `list` stays sorted, and a refused call changes nothing.

// The harness below runs outside `#[test]` functions, where clippy does not relax these lints.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures::executor::block_on;
use proptest::prelude::*;
use spacebot_core::error::StoreError;
use spacebot_core::memory::MemoryLinkStore;
use spacebot_core::{
    AgentId, AgentLink, LinkDirection, LinkId, LinkRelationship, LinkStore, Timestamp,
};

#[derive(Debug, Clone)]
struct Spec {
    id: u8,
    from: u8,
    to: u8,
    one_way: bool,
    relationship: u8,
    enabled: bool,
    at: i64,
}

#[derive(Debug, Clone)]
enum Op {
    Create(Spec),
    Update(Spec),
    Delete(u8),
    Upsert(Vec<Spec>),
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        0u8..6,
        0u8..3,
        0u8..3,
        any::<bool>(),
        0u8..3,
        any::<bool>(),
        0i64..100,
    )
        .prop_map(|(id, from, to, one_way, relationship, enabled, at)| Spec {
            id,
            from,
            to,
            one_way,
            relationship,
            enabled,
            at,
        })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => spec().prop_map(Op::Create),
        2 => spec().prop_map(Op::Update),
        1 => (0u8..6).prop_map(Op::Delete),
        3 => prop::collection::vec(spec(), 0..4).prop_map(Op::Upsert),
    ]
}

fn link(s: &Spec) -> AgentLink {
    let agent = |n: u8| AgentId::parse(format!("agent-{n}")).unwrap();
    AgentLink {
        id: LinkId::new(format!("id-{}", s.id)),
        from: agent(s.from),
        to: agent(s.to),
        direction: if s.one_way {
            LinkDirection::OneWay
        } else {
            LinkDirection::TwoWay
        },
        relationship: [
            LinkRelationship::Peer,
            LinkRelationship::Superior,
            LinkRelationship::Subordinate,
        ][usize::from(s.relationship)],
        enabled: s.enabled,
        created_at: Timestamp(s.at),
        updated_at: Timestamp(s.at + 1),
    }
}

/// What the result should be, by kind.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    NotFound,
    AlreadyExists,
    Invalid,
}

fn outcome(r: Result<(), StoreError>) -> Outcome {
    match r {
        Ok(()) => Outcome::Ok,
        Err(StoreError::NotFound { .. }) => Outcome::NotFound,
        Err(StoreError::AlreadyExists { .. }) => Outcome::AlreadyExists,
        Err(StoreError::Invalid(_)) => Outcome::Invalid,
        Err(e) => panic!("unexpected error {e}"),
    }
}

/// The contract, written as plainly as possible over a vector.
fn model(links: &mut Vec<AgentLink>, op: &Op) -> Outcome {
    let same_pair = |a: &AgentLink, b: &AgentLink| a.from == b.from && a.to == b.to;
    match op {
        Op::Create(s) => {
            let l = link(s);
            if links.iter().any(|x| x.id == l.id || same_pair(x, &l)) {
                return Outcome::AlreadyExists;
            }
            links.push(l);
            Outcome::Ok
        }
        Op::Update(s) => {
            let l = link(s);
            match links.iter_mut().find(|x| x.id == l.id) {
                Some(x) => {
                    x.direction = l.direction;
                    x.relationship = l.relationship;
                    x.enabled = l.enabled;
                    x.updated_at = l.updated_at;
                    Outcome::Ok
                }
                None => Outcome::NotFound,
            }
        }
        Op::Delete(id) => {
            let id = LinkId::new(format!("id-{id}"));
            match links.iter().position(|x| x.id == id) {
                Some(i) => {
                    links.remove(i);
                    Outcome::Ok
                }
                None => Outcome::NotFound,
            }
        }
        Op::Upsert(specs) => {
            let batch: Vec<AgentLink> = specs.iter().map(link).collect();
            for (i, l) in batch.iter().enumerate() {
                if batch[..i].iter().any(|x| same_pair(x, l)) {
                    return Outcome::Invalid;
                }
            }
            let mut next = links.clone();
            for l in batch {
                let id_taken = next.iter().any(|x| x.id == l.id);
                match next.iter_mut().find(|x| same_pair(x, &l)) {
                    Some(x) => {
                        *x = AgentLink {
                            id: x.id.clone(),
                            created_at: x.created_at,
                            ..l
                        }
                    }
                    None if id_taken => return Outcome::AlreadyExists,
                    None => next.push(l),
                }
            }
            *links = next;
            Outcome::Ok
        }
    }
}

fn apply(store: &MemoryLinkStore, op: &Op) -> Outcome {
    outcome(block_on(async {
        match op {
            Op::Create(s) => store.create(&link(s)).await,
            Op::Update(s) => store.update(&link(s)).await,
            Op::Delete(id) => store.delete(&LinkId::new(format!("id-{id}"))).await,
            Op::Upsert(specs) => {
                let batch: Vec<AgentLink> = specs.iter().map(link).collect();
                store.upsert_all(&batch).await
            }
        }
    }))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn link_store_matches_the_model(ops in prop::collection::vec(op(), 1..40)) {
        let store = MemoryLinkStore::new();
        let mut expected: Vec<AgentLink> = Vec::new();
        for op in &ops {
            let want = model(&mut expected, op);
            let got = apply(&store, op);
            prop_assert_eq!(&got, &want, "result of {:?}", op);
            let listed = block_on(store.list()).unwrap();
            let mut sorted = expected.clone();
            sorted.sort_by(|a, b| (&a.from, &a.to).cmp(&(&b.from, &b.to)));
            prop_assert_eq!(&listed, &sorted, "contents after {:?}", op);
            for l in &sorted {
                let by_id = block_on(store.get(&l.id)).unwrap();
                let by_pair = block_on(store.get_between(&l.from, &l.to)).unwrap();
                prop_assert_eq!(by_id.as_ref(), Some(l));
                prop_assert_eq!(by_pair.as_ref(), Some(l));
            }
        }
    }
}
