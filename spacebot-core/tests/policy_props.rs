//! Property tests of the link policy over random link sets.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use proptest::prelude::*;
use spacebot_core::error::DenialReason;
use spacebot_core::policy::{
    ApprovalPolicy, LinkGraph, check_answer, check_delegate, check_start, needs_approval, org_chart,
};
use spacebot_core::{AgentId, AgentLink, LinkDirection, LinkRelationship, Timestamp};

const AGENTS: usize = 5;

fn agent(i: usize) -> AgentId {
    AgentId::parse(format!("agent-{i}")).unwrap()
}

fn direction() -> impl Strategy<Value = LinkDirection> {
    prop_oneof![Just(LinkDirection::OneWay), Just(LinkDirection::TwoWay)]
}

fn relationship() -> impl Strategy<Value = LinkRelationship> {
    prop_oneof![
        Just(LinkRelationship::Peer),
        Just(LinkRelationship::Superior),
        Just(LinkRelationship::Subordinate)
    ]
}

/// Up to one link per ordered pair of distinct agents, with random properties.
fn link_set() -> impl Strategy<Value = Vec<AgentLink>> {
    let pairs: Vec<(usize, usize)> = (0..AGENTS)
        .flat_map(|a| (0..AGENTS).map(move |b| (a, b)))
        .filter(|(a, b)| a != b)
        .collect();
    let n = pairs.len();
    proptest::collection::vec(
        proptest::option::weighted(0.4, (direction(), relationship(), any::<bool>())),
        n,
    )
    .prop_map(move |choices| {
        pairs
            .iter()
            .zip(choices)
            .filter_map(|(&(a, b), choice)| {
                let (d, r, enabled) = choice?;
                let mut link = AgentLink::new(agent(a), agent(b), d, r, Timestamp(0));
                link.enabled = enabled;
                Some(link)
            })
            .collect()
    })
}

/// The links between `a` and `b`, found by scanning the whole list.
fn scan<'a>(links: &'a [AgentLink], a: &AgentId, b: &AgentId) -> Vec<&'a AgentLink> {
    links
        .iter()
        .filter(|l| (&l.from == a && &l.to == b) || (&l.from == b && &l.to == a))
        .collect()
}

/// The reason the start rules must give, derived link by link.
fn expected_start_denial(links: &[AgentLink], a: &AgentId, b: &AgentId) -> Option<DenialReason> {
    if a == b {
        return Some(DenialReason::SelfTarget);
    }
    let between = scan(links, a, b);
    let lets_a_start = |l: &&AgentLink| l.direction == LinkDirection::TwoWay || &l.from == a;
    if between.iter().any(|l| l.enabled && lets_a_start(l)) {
        return None;
    }
    if between.is_empty() {
        return Some(DenialReason::NoLink);
    }
    let only_reverse_one_way = between.iter().all(|l| !lets_a_start(l));
    if only_reverse_one_way && between.iter().any(|l| l.enabled) {
        Some(DenialReason::OneWayReverse)
    } else {
        Some(DenialReason::LinkDisabled)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every allowed start is allowed by an enabled link that lets the actor start; every denial
    /// carries the reason the rules give and names who, whom and what.
    #[test]
    fn start_is_allowed_by_the_right_link_and_denials_carry_their_reason(links in link_set()) {
        let graph = LinkGraph::new((0..AGENTS).map(agent), links.clone());
        for a in (0..AGENTS).map(agent) {
            for b in (0..AGENTS).map(agent) {
                match check_start(&graph, &a, &b) {
                    Ok(link) => {
                        prop_assert!(link.enabled);
                        prop_assert!(link.involves(&a) && link.involves(&b));
                        prop_assert!(link.direction == LinkDirection::TwoWay || link.from == a);
                        prop_assert_eq!(expected_start_denial(&links, &a, &b), None);
                    }
                    Err(denied) => {
                        prop_assert_eq!(&denied.actor, &a);
                        prop_assert_eq!(denied.target.as_str(), b.as_str());
                        prop_assert_eq!(Some(denied.reason), expected_start_denial(&links, &a, &b));
                    }
                }
            }
        }
    }

    /// An answer inside an open exchange is allowed exactly when an enabled link joins the pair,
    /// in either direction; a closed exchange allows no answer.
    #[test]
    fn answers_follow_enabled_links_in_either_direction(links in link_set(), open in any::<bool>()) {
        let graph = LinkGraph::new((0..AGENTS).map(agent), links.clone());
        for a in (0..AGENTS).map(agent) {
            for b in (0..AGENTS).map(agent).filter(|b| b != &a) {
                let between = scan(&links, &a, &b);
                let expected = if between.is_empty() {
                    Some(DenialReason::NoLink)
                } else if !between.iter().any(|l| l.enabled) {
                    Some(DenialReason::LinkDisabled)
                } else if !open {
                    Some(DenialReason::NoOpenExchange)
                } else {
                    None
                };
                match check_answer(&graph, &a, &b, open) {
                    Ok(link) => {
                        prop_assert!(link.enabled && link.involves(&a) && link.involves(&b));
                        prop_assert_eq!(expected, None);
                    }
                    Err(denied) => prop_assert_eq!(Some(denied.reason), expected),
                }
                // Whoever may start may also answer inside an open exchange.
                if open && check_start(&graph, &b, &a).is_ok() {
                    prop_assert!(check_answer(&graph, &a, &b, true).is_ok());
                }
            }
        }
    }

    /// Delegation: the chain and depth rules come first, then exactly the start rules.
    #[test]
    fn delegation_adds_chain_rules_to_the_start_rules(
        links in link_set(),
        chain in proptest::collection::vec(0..AGENTS, 0..4),
        max_depth in 0usize..6,
    ) {
        let graph = LinkGraph::new((0..AGENTS).map(agent), links.clone());
        let chain: Vec<AgentId> = chain.into_iter().map(agent).collect();
        for a in (0..AGENTS).map(agent) {
            for b in (0..AGENTS).map(agent) {
                let expected = if a == b {
                    Some(DenialReason::SelfTarget)
                } else if chain.contains(&b) {
                    let mut full = chain.clone();
                    full.push(a.clone());
                    Some(DenialReason::Cycle { chain: full })
                } else if chain.len() + 1 > max_depth {
                    Some(DenialReason::DepthExceeded { limit: max_depth })
                } else {
                    expected_start_denial(&links, &a, &b)
                };
                let got = check_delegate(&graph, &a, &b, &chain, max_depth).err().map(|d| d.reason);
                prop_assert_eq!(got, expected);
            }
        }
    }

    /// A hierarchy written top-down (`A superior of B`) or bottom-up (`B subordinate of A`), each
    /// edge chosen independently, gives every agent the same org chart and the same policy answers.
    #[test]
    fn org_chart_is_the_same_for_both_ways_of_writing_a_hierarchy(
        edges in proptest::collection::vec(
            (0..AGENTS, 0..AGENTS, prop_oneof![Just(true), Just(false)], direction(), any::<bool>(), any::<bool>()),
            0..12,
        ),
    ) {
        // (x, y, hierarchical, direction, enabled, written_down): if hierarchical, x is above y.
        let mut seen = std::collections::HashSet::new();
        let mut down = Vec::new();
        let mut mixed = Vec::new();
        for (x, y, hierarchical, d, enabled, written_down) in edges {
            if x == y || !seen.insert((x.min(y), x.max(y))) {
                continue;
            }
            let canonical = if hierarchical { LinkRelationship::Superior } else { LinkRelationship::Peer };
            let mut a = AgentLink::new(agent(x), agent(y), d, canonical, Timestamp(0));
            a.enabled = enabled;
            let mut b = AgentLink::new(agent(y), agent(x), d, canonical.reversed(), Timestamp(0));
            b.enabled = enabled;
            // One-way links keep their direction of travel, so only two-way ones may be flipped.
            let flip = !written_down && d == LinkDirection::TwoWay;
            down.push(a.clone());
            mixed.push(if flip { b } else { a });
        }
        let g1 = LinkGraph::new((0..AGENTS).map(agent), down);
        let g2 = LinkGraph::new((0..AGENTS).map(agent), mixed);
        for a in (0..AGENTS).map(agent) {
            prop_assert_eq!(org_chart(&g1, &a), org_chart(&g2, &a));
            for b in (0..AGENTS).map(agent) {
                prop_assert_eq!(
                    check_start(&g1, &a, &b).err().map(|d| d.reason),
                    check_start(&g2, &a, &b).err().map(|d| d.reason)
                );
                prop_assert_eq!(
                    needs_approval(ApprovalPolicy::UnlessSuperior, &g1, &a, &b),
                    needs_approval(ApprovalPolicy::UnlessSuperior, &g2, &a, &b)
                );
            }
        }
    }

    /// The org chart lists an agent's enabled neighbours once each, by what the link says they are.
    #[test]
    fn org_chart_matches_a_link_by_link_reading(links in link_set()) {
        let graph = LinkGraph::new((0..AGENTS).map(agent), links.clone());
        for a in (0..AGENTS).map(agent) {
            let chart = org_chart(&graph, &a);
            for l in links.iter().filter(|l| l.enabled && l.involves(&a)) {
                let other = l.other(&a).unwrap();
                let list = match l.relationship_of_other(&a).unwrap() {
                    LinkRelationship::Superior => &chart.superiors,
                    LinkRelationship::Subordinate => &chart.subordinates,
                    LinkRelationship::Peer => &chart.peers,
                };
                prop_assert!(list.contains(other), "{other} missing for {a}");
            }
            let listed = chart.superiors.len() + chart.subordinates.len() + chart.peers.len();
            let mut neighbours: Vec<(&AgentId, LinkRelationship)> = links
                .iter()
                .filter(|l| l.enabled && l.involves(&a))
                .map(|l| (l.other(&a).unwrap(), l.relationship_of_other(&a).unwrap()))
                .collect();
            neighbours.sort_by_key(|(id, r)| (*id, r.as_str()));
            neighbours.dedup();
            prop_assert_eq!(listed, neighbours.len());
        }
    }
}
