//! [`LinkStore`] conformance.

use super::support::{ConformanceError, agent, ensure, ensure_eq, ensure_err, ok};
use crate::error::StoreError;
use crate::ids::{AgentId, LinkId};
use crate::link::{AgentLink, LinkDirection, LinkRelationship, LinkStore};
use crate::time::Timestamp;

#[doc(hidden)]
#[macro_export]
macro_rules! __link_store_tests {
    ($module:ident, $make:expr, |$s:ident| $access:expr) => {
        $crate::__conformance_module!(
            $module,
            $make,
            |$s| $access,
            [
                link_store_create_get_delete,
                link_store_unique_ordered_pair,
                link_store_update_keeps_identity,
                link_store_sort_orders,
                link_store_upsert_all_keeps_id,
                link_store_upsert_all_is_atomic,
                link_store_round_trip,
            ]
        );
    };
}

async fn ensure_empty(store: &dyn LinkStore) -> Result<(), ConformanceError> {
    let all = ok!(store.list());
    ensure!(
        all.is_empty(),
        "the suite needs a fresh, empty link store; found {} links",
        all.len()
    );
    Ok(())
}

fn link(from: &AgentId, to: &AgentId, at: i64) -> AgentLink {
    AgentLink::new(
        from.clone(),
        to.clone(),
        LinkDirection::TwoWay,
        LinkRelationship::Peer,
        Timestamp(at),
    )
}

/// `create`, `get`, `get_between` (exact ordered pair only) and `delete`, with `NotFound` for
/// absent links.
pub async fn link_store_create_get_delete(store: &dyn LinkStore) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b) = (agent("alpha")?, agent("beta")?);
    let l = AgentLink {
        direction: LinkDirection::OneWay,
        relationship: LinkRelationship::Superior,
        ..link(&a, &b, 1_000)
    };
    ok!(store.create(&l));
    ensure_eq!(ok!(store.get(&l.id)), Some(l.clone()), "get after create");
    ensure_eq!(
        ok!(store.get_between(&a, &b)),
        Some(l.clone()),
        "get_between(from, to)"
    );
    ensure_eq!(
        ok!(store.get_between(&b, &a)),
        None,
        "get_between looks at the exact ordered pair, not (to, from)"
    );
    ensure_eq!(
        ok!(store.get(&LinkId::new("no-such-link"))),
        None,
        "get of an unknown id"
    );
    ok!(store.delete(&l.id));
    ensure_eq!(ok!(store.get(&l.id)), None, "get after delete");
    ensure_eq!(
        ok!(store.get_between(&a, &b)),
        None,
        "get_between after delete"
    );
    ensure!(ok!(store.list()).is_empty(), "list after delete is empty");
    ensure_err!(
        store.delete(&l.id).await,
        StoreError::NotFound { what } if what.contains(l.id.as_str()),
        "deleting an absent link (the error names the link)"
    );
    ensure_err!(
        store.update(&l).await,
        StoreError::NotFound { .. },
        "updating an absent link"
    );
    // The pair is free again after a delete.
    let again = link(&a, &b, 2_000);
    ok!(store.create(&again));
    ensure_eq!(
        ok!(store.get_between(&a, &b)),
        Some(again),
        "re-create after delete"
    );
    Ok(())
}

/// A second link for an existing ordered pair, or with an existing id, is refused with
/// `AlreadyExists` and writes nothing; the reverse pair is a different link.
pub async fn link_store_unique_ordered_pair(store: &dyn LinkStore) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b, c) = (agent("alpha")?, agent("beta")?, agent("gamma")?);
    let first = link(&a, &b, 1_000);
    ok!(store.create(&first));
    let same_pair = AgentLink {
        enabled: false,
        ..link(&a, &b, 2_000)
    };
    ensure_err!(
        store.create(&same_pair).await,
        StoreError::AlreadyExists { .. },
        "a second link for the same ordered pair"
    );
    let same_id = AgentLink {
        id: first.id.clone(),
        ..link(&a, &c, 2_000)
    };
    ensure_err!(
        store.create(&same_id).await,
        StoreError::AlreadyExists { what } if what.contains(first.id.as_str()),
        "a second link with the same id (the error names the link)"
    );
    ensure_eq!(
        ok!(store.list()),
        vec![first.clone()],
        "refused creates write nothing"
    );
    let reverse = link(&b, &a, 3_000);
    ok!(store.create(&reverse));
    ensure_eq!(
        ok!(store.get_between(&b, &a)),
        Some(reverse),
        "the reverse pair is its own link"
    );
    ensure_eq!(
        ok!(store.get_between(&a, &b)),
        Some(first),
        "the first link is untouched"
    );
    Ok(())
}

/// `update` replaces direction, relationship, enabled and `updated_at`, and keeps `from`, `to`
/// and `created_at` whatever the argument says.
pub async fn link_store_update_keeps_identity(
    store: &dyn LinkStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b, c) = (agent("alpha")?, agent("beta")?, agent("gamma")?);
    let original = link(&a, &b, 1_000);
    ok!(store.create(&original));
    let changed = AgentLink {
        id: original.id.clone(),
        from: c.clone(),
        to: a.clone(),
        direction: LinkDirection::OneWay,
        relationship: LinkRelationship::Subordinate,
        enabled: false,
        created_at: Timestamp(9_999),
        updated_at: Timestamp(5_000),
    };
    ok!(store.update(&changed));
    let expected = AgentLink {
        direction: LinkDirection::OneWay,
        relationship: LinkRelationship::Subordinate,
        enabled: false,
        updated_at: Timestamp(5_000),
        ..original.clone()
    };
    ensure_eq!(
        ok!(store.get(&original.id)),
        Some(expected.clone()),
        "update keeps id, from, to and created_at"
    );
    ensure_eq!(
        ok!(store.get_between(&a, &b)),
        Some(expected),
        "the link is still found by its pair"
    );
    ensure_eq!(
        ok!(store.get_between(&c, &a)),
        None,
        "update does not move the link to another pair"
    );
    Ok(())
}

/// `list` and `links_for_agent` sort by `(from, to)`; `links_for_agent` returns links with the
/// agent at either end.
pub async fn link_store_sort_orders(store: &dyn LinkStore) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let names = ["delta", "alpha", "charlie", "bravo"];
    let ids: Vec<AgentId> = names.iter().map(|n| agent(n)).collect::<Result<_, _>>()?;
    // Create every ordered pair, in a scrambled order.
    let mut created = Vec::new();
    for (i, from) in ids.iter().enumerate() {
        for (j, to) in ids.iter().enumerate().rev() {
            if i != j {
                let l = link(from, to, 1_000 + created.len() as i64);
                ok!(store.create(&l));
                created.push(l);
            }
        }
    }
    let mut expected = created.clone();
    expected.sort_by(|x, y| (&x.from, &x.to).cmp(&(&y.from, &y.to)));
    ensure_eq!(ok!(store.list()), expected, "list is sorted by (from, to)");
    let charlie = agent("charlie")?;
    let for_charlie: Vec<AgentLink> = expected
        .iter()
        .filter(|l| l.involves(&charlie))
        .cloned()
        .collect();
    ensure_eq!(
        ok!(store.links_for_agent(&charlie)),
        for_charlie,
        "links_for_agent: both ends, sorted by (from, to)"
    );
    ensure!(
        ok!(store.links_for_agent(&agent("nobody")?)).is_empty(),
        "an agent without links has none"
    );
    Ok(())
}

/// `upsert_all`: an existing ordered pair keeps its id and `created_at` and takes every other
/// field from the argument; a new pair is inserted as given; links not named are left alone.
pub async fn link_store_upsert_all_keeps_id(store: &dyn LinkStore) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b, c) = (agent("alpha")?, agent("beta")?, agent("gamma")?);
    let ab = link(&a, &b, 1_000);
    let bc = link(&b, &c, 1_000);
    ok!(store.create(&ab));
    ok!(store.create(&bc));
    let ab_new = AgentLink {
        direction: LinkDirection::OneWay,
        relationship: LinkRelationship::Superior,
        enabled: false,
        ..link(&a, &b, 7_000)
    };
    let ca = link(&c, &a, 7_000);
    ok!(store.upsert_all(&[ab_new.clone(), ca.clone()]));
    let ab_expected = AgentLink {
        id: ab.id.clone(),
        created_at: ab.created_at,
        ..ab_new.clone()
    };
    ensure_eq!(
        ok!(store.get_between(&a, &b)),
        Some(ab_expected.clone()),
        "an upserted existing pair keeps id and created_at, takes the rest"
    );
    ensure_eq!(
        ok!(store.get(&ab_new.id)),
        None,
        "the argument's id of an existing pair is not stored"
    );
    ensure_eq!(
        ok!(store.get(&ca.id)),
        Some(ca.clone()),
        "a new pair is inserted as given"
    );
    ensure_eq!(
        ok!(store.get(&bc.id)),
        Some(bc.clone()),
        "links not named are left alone"
    );
    ensure_eq!(ok!(store.list()).len(), 3, "three links in all");
    ok!(store.upsert_all(&[]));
    ensure_eq!(
        ok!(store.list()).len(),
        3,
        "an empty upsert changes nothing"
    );
    Ok(())
}

/// `upsert_all` is atomic: a batch naming an ordered pair twice (refused with `Invalid`) or
/// inserting an id another link holds (refused with `AlreadyExists`) writes none of its links.
pub async fn link_store_upsert_all_is_atomic(
    store: &dyn LinkStore,
) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let (a, b, c) = (agent("alpha")?, agent("beta")?, agent("gamma")?);
    let ab = link(&a, &b, 1_000);
    ok!(store.create(&ab));
    let before = ok!(store.list());

    let ab_changed = AgentLink {
        enabled: false,
        ..link(&a, &b, 2_000)
    };
    let bc = link(&b, &c, 2_000);
    let stolen_id = AgentLink {
        id: ab.id.clone(),
        ..link(&c, &a, 2_000)
    };
    ensure_err!(
        store
            .upsert_all(&[ab_changed.clone(), bc.clone(), stolen_id])
            .await,
        StoreError::AlreadyExists { .. },
        "a new pair whose id belongs to another link"
    );
    ensure_eq!(
        ok!(store.list()),
        before.clone(),
        "a refused upsert_all writes nothing"
    );

    let twice = AgentLink {
        enabled: false,
        ..link(&b, &c, 3_000)
    };
    ensure_err!(
        store
            .upsert_all(&[ab_changed.clone(), bc.clone(), twice])
            .await,
        StoreError::Invalid(_),
        "a batch naming the same ordered pair twice"
    );
    ensure_eq!(
        ok!(store.list()),
        before,
        "a refused upsert_all writes nothing"
    );

    let ca = link(&c, &a, 4_000);
    let ca_clash = AgentLink {
        id: ca.id.clone(),
        ..link(&c, &b, 4_000)
    };
    ensure_err!(
        store.upsert_all(&[ca, ca_clash]).await,
        StoreError::AlreadyExists { .. },
        "two new pairs with one id in the same batch"
    );
    ensure_eq!(
        ok!(store.list()).len(),
        1,
        "a refused upsert_all writes nothing"
    );
    Ok(())
}

/// A link round-trips exactly, through every store method, for every direction and relationship
/// and extreme timestamps.
pub async fn link_store_round_trip(store: &dyn LinkStore) -> Result<(), ConformanceError> {
    ensure_empty(store).await?;
    let max_id = "z".repeat(AgentId::MAX_LEN);
    let ends = [
        (agent("a")?, agent(&max_id)?),
        (agent("A-b_c.d")?, agent("a")?),
        (agent("a")?, agent("A-b_c.d")?),
    ];
    let mut expected = Vec::new();
    let combos = [
        (LinkDirection::OneWay, LinkRelationship::Peer, i64::MIN),
        (LinkDirection::TwoWay, LinkRelationship::Superior, 0),
        (
            LinkDirection::OneWay,
            LinkRelationship::Subordinate,
            i64::MAX,
        ),
    ];
    for ((from, to), (direction, relationship, at)) in ends.iter().zip(combos) {
        let l = AgentLink {
            id: LinkId::new(format!("id with spaces, \"quotes\" and ünïcødé {at}")),
            direction,
            relationship,
            enabled: at != 0,
            created_at: Timestamp(at),
            updated_at: Timestamp(at.saturating_add(1)),
            ..link(from, to, 0)
        };
        ok!(store.create(&l));
        ensure_eq!(ok!(store.get(&l.id)), Some(l.clone()), "get round-trips");
        expected.push(l);
    }
    expected.sort_by(|x, y| (&x.from, &x.to).cmp(&(&y.from, &y.to)));
    ensure_eq!(ok!(store.list()), expected, "list round-trips");
    Ok(())
}
