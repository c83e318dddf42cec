//! The link policy, as pure functions over an immutable [`LinkGraph`].
//!
//! The runtime asks before every operation:
//! - [`check_start`]: may the actor start an exchange (a message, a conversation) with the target?
//! - [`check_answer`]: may the actor answer inside an exchange the target started?
//! - [`check_delegate`]: may the actor delegate a task to the target, given the delegation chain?
//! - [`needs_approval`]: does a delegated task wait for approval ([`ApprovalPolicy`])?
//!
//! A refusal is a [`PolicyDenied`] naming the actor, the target, the action and the
//! [`DenialReason`]. The rules, for a pair of agents `A` (actor) and `B` (target):
//! - a link in either direction between `A` and `B` counts; with none, [`DenialReason::NoLink`];
//! - a disabled link allows nothing: if the only links that would allow the operation are disabled,
//!   [`DenialReason::LinkDisabled`];
//! - a two-way link lets either side start; a one-way link lets only its `from` start, and the
//!   other side gets [`DenialReason::OneWayReverse`] (it may still answer inside an exchange);
//! - addressing oneself is [`DenialReason::SelfTarget`], an unknown target
//!   [`DenialReason::UnknownAgent`].
//!
//! [`org_chart`] gives an agent's superiors, subordinates and peers. It reads what each link says
//! the other end is to the agent ([`AgentLink::relationship_of_other`]), so `A superior of B` and
//! `B subordinate of A` describe the same organization.
//!
//! Checks do not allocate unless they deny: the graph is indexed by agent id and looked up by
//! `&str`.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::{DenialReason, PolicyAction, PolicyDenied, StoreError};
use crate::ids::AgentId;
use crate::link::{AgentLink, LinkDirection, LinkRelationship, LinkStore};

/// An immutable snapshot of the organization: its agents and their links.
///
/// ```
/// use spacebot_core::policy::{LinkGraph, check_start};
/// use spacebot_core::{AgentId, AgentLink, LinkDirection, LinkRelationship, Timestamp};
/// let (a, b) = (AgentId::parse("a").unwrap(), AgentId::parse("b").unwrap());
/// let link = AgentLink::new(a.clone(), b.clone(), LinkDirection::OneWay, LinkRelationship::Superior, Timestamp(0));
/// let graph = LinkGraph::new([a.clone(), b.clone()], [link]);
/// assert!(check_start(&graph, &a, &b).is_ok());
/// assert!(check_start(&graph, &b, &a).is_err());
/// ```
#[derive(Debug, Clone, Default)]
pub struct LinkGraph {
    /// Sorted, without duplicates.
    agents: Vec<AgentId>,
    /// Sorted by `(from, to)`, one per ordered pair.
    links: Vec<AgentLink>,
    /// `agent -> position in agents`.
    index: HashMap<AgentId, usize>,
    /// Per agent position: `(to position, link index)` of its outgoing links, sorted by `to`.
    outgoing: Vec<Vec<(usize, usize)>>,
    /// Per agent position: indexes of the links with the agent at either end, sorted.
    touching: Vec<Vec<usize>>,
}

impl LinkGraph {
    /// A snapshot of `agents` and `links`.
    ///
    /// The ends of every link count as known agents even if `agents` does not list them. If two
    /// links share an ordered pair `(from, to)`, the later one is kept.
    pub fn new(
        agents: impl IntoIterator<Item = AgentId>,
        links: impl IntoIterator<Item = AgentLink>,
    ) -> Self {
        let mut by_pair: HashMap<(AgentId, AgentId), AgentLink> = HashMap::new();
        for link in links {
            by_pair.insert((link.from.clone(), link.to.clone()), link);
        }
        let mut links: Vec<AgentLink> = by_pair.into_values().collect();
        links.sort_by(|x, y| (&x.from, &x.to).cmp(&(&y.from, &y.to)));

        let mut agents: Vec<AgentId> = agents.into_iter().collect();
        agents.extend(links.iter().flat_map(|l| [l.from.clone(), l.to.clone()]));
        agents.sort();
        agents.dedup();

        let index: HashMap<AgentId, usize> = agents
            .iter()
            .enumerate()
            .map(|(i, a)| (a.clone(), i))
            .collect();
        let mut outgoing = vec![Vec::new(); agents.len()];
        let mut touching = vec![Vec::new(); agents.len()];
        for (i, link) in links.iter().enumerate() {
            // Every end is in `index` (added above); links are sorted by (from, to), so each
            // outgoing list comes out sorted by `to`.
            if let (Some(&f), Some(&t)) = (index.get(&link.from), index.get(&link.to)) {
                outgoing[f].push((t, i));
                touching[f].push(i);
                touching[t].push(i);
            }
        }
        Self {
            agents,
            links,
            index,
            outgoing,
            touching,
        }
    }

    /// A snapshot of `agents` and every link in `store`.
    pub async fn load(
        store: &dyn LinkStore,
        agents: impl IntoIterator<Item = AgentId>,
    ) -> Result<Self, StoreError> {
        let links = store.list().await?;
        Ok(Self::new(agents, links))
    }

    /// The link for the exact ordered pair `(from, to)`; it does not look at `(to, from)`.
    pub fn between(&self, from: &str, to: &str) -> Option<&AgentLink> {
        self.link_at(self.position(from)?, self.position(to)?)
    }

    /// Every link with `agent` at either end, sorted by `(from, to)`.
    pub fn links_of<'a>(&'a self, agent: &str) -> impl Iterator<Item = &'a AgentLink> + 'a {
        self.position(agent)
            .and_then(|p| self.touching.get(p))
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .filter_map(|&i| self.links.get(i))
    }

    /// Every link, sorted by `(from, to)`.
    pub fn links(&self) -> &[AgentLink] {
        &self.links
    }

    /// Every known agent, sorted.
    pub fn agents(&self) -> &[AgentId] {
        &self.agents
    }

    /// Whether `agent` is known.
    pub fn contains(&self, agent: &str) -> bool {
        self.index.contains_key(agent)
    }

    fn position(&self, agent: &str) -> Option<usize> {
        self.index.get(agent).copied()
    }

    fn link_at(&self, from: usize, to: usize) -> Option<&AgentLink> {
        let out = self.outgoing.get(from)?;
        let at = out.binary_search_by_key(&to, |&(t, _)| t).ok()?;
        self.links.get(out.get(at)?.1)
    }

    /// The links in both directions between `a` and `b`: `(a -> b, b -> a)`.
    fn pair(&self, a: &str, b: &str) -> (Option<&AgentLink>, Option<&AgentLink>) {
        self.pair_with_known(a, b).unwrap_or((None, None))
    }

    /// Like [`pair`](Self::pair), but `None` when `target` is not a known agent.
    #[allow(clippy::type_complexity)]
    fn pair_with_known(
        &self,
        actor: &str,
        target: &str,
    ) -> Option<(Option<&AgentLink>, Option<&AgentLink>)> {
        let t = self.position(target)?;
        Some(match self.position(actor) {
            Some(a) => (self.link_at(a, t), self.link_at(t, a)),
            None => (None, None),
        })
    }
}

fn deny(actor: &AgentId, target: &str, action: PolicyAction, reason: DenialReason) -> PolicyDenied {
    PolicyDenied {
        actor: actor.clone(),
        target: target.to_owned(),
        action,
        reason,
    }
}

/// Whether `link` would let `actor` start an exchange if it were enabled.
fn startable_by(link: &AgentLink, actor: &str) -> bool {
    link.direction == LinkDirection::TwoWay || link.from.as_str() == actor
}

/// The start rules, shared by [`check_start`] and [`check_delegate`].
fn start_rules<'g>(
    graph: &'g LinkGraph,
    actor: &AgentId,
    target: &str,
    action: PolicyAction,
) -> Result<&'g AgentLink, PolicyDenied> {
    if actor.as_str() == target {
        return Err(deny(actor, target, action, DenialReason::SelfTarget));
    }
    let Some((forward, reverse)) = graph.pair_with_known(actor.as_str(), target) else {
        return Err(deny(actor, target, action, DenialReason::UnknownAgent));
    };
    let candidates = [forward, reverse];
    let mut links = candidates.iter().flatten();
    if let Some(link) = links
        .clone()
        .find(|l| l.enabled && startable_by(l, actor.as_str()))
    {
        return Ok(link);
    }
    let reason = if forward.is_none() && reverse.is_none() {
        DenialReason::NoLink
    } else if links.clone().any(|l| startable_by(l, actor.as_str())) {
        // Only disabled links would allow it.
        DenialReason::LinkDisabled
    } else if links.any(|l| l.enabled) {
        DenialReason::OneWayReverse
    } else {
        DenialReason::LinkDisabled
    };
    Err(deny(actor, target, action, reason))
}

/// May `actor` start an exchange (a message or a conversation) with `target`?
///
/// On success, the link that allows it (the `actor -> target` link when both directions would).
///
/// ```
/// use spacebot_core::error::DenialReason;
/// use spacebot_core::policy::{LinkGraph, check_start};
/// use spacebot_core::{AgentId, AgentLink, LinkDirection, LinkRelationship, Timestamp};
/// let (a, b) = (AgentId::parse("a").unwrap(), AgentId::parse("b").unwrap());
/// let mut link = AgentLink::new(a.clone(), b.clone(), LinkDirection::TwoWay, LinkRelationship::Peer, Timestamp(0));
/// link.enabled = false;
/// let graph = LinkGraph::new([], [link]);
/// let denied = check_start(&graph, &b, &a).unwrap_err();
/// assert_eq!(denied.reason, DenialReason::LinkDisabled);
/// assert_eq!(denied.to_string(), "b may not start an exchange with a: their link is disabled");
/// ```
pub fn check_start<'g, T: AsRef<str> + ?Sized>(
    graph: &'g LinkGraph,
    actor: &AgentId,
    target: &T,
) -> Result<&'g AgentLink, PolicyDenied> {
    start_rules(graph, actor, target.as_ref(), PolicyAction::Start)
}

/// May `actor` answer inside an exchange `target` started?
///
/// Any enabled link between the two allows an answer (a one-way link from `target` to `actor`
/// included), provided the exchange is open (`exchange_open`); otherwise
/// [`DenialReason::NoOpenExchange`]. On success, the link the answer travels over (the
/// `target -> actor` link when both are enabled).
pub fn check_answer<'g, T: AsRef<str> + ?Sized>(
    graph: &'g LinkGraph,
    actor: &AgentId,
    target: &T,
    exchange_open: bool,
) -> Result<&'g AgentLink, PolicyDenied> {
    let target = target.as_ref();
    let action = PolicyAction::Answer;
    if actor.as_str() == target {
        return Err(deny(actor, target, action, DenialReason::SelfTarget));
    }
    let Some((forward, reverse)) = graph.pair_with_known(actor.as_str(), target) else {
        return Err(deny(actor, target, action, DenialReason::UnknownAgent));
    };
    let link = match [reverse, forward].into_iter().flatten().find(|l| l.enabled) {
        Some(link) => link,
        None if forward.is_none() && reverse.is_none() => {
            return Err(deny(actor, target, action, DenialReason::NoLink));
        }
        None => return Err(deny(actor, target, action, DenialReason::LinkDisabled)),
    };
    if !exchange_open {
        return Err(deny(actor, target, action, DenialReason::NoOpenExchange));
    }
    Ok(link)
}

/// May `actor` delegate a task to `target`?
///
/// `chain` lists the agents the work passed through before reaching `actor`, root first (empty
/// when `actor` starts the work). In order: `target == actor` is [`DenialReason::SelfTarget`]; an
/// unknown target [`DenialReason::UnknownAgent`]; a target already in `chain` is
/// [`DenialReason::Cycle`] (carrying the chain with `actor` appended); `chain.len() + 1 >
/// max_depth` is [`DenialReason::DepthExceeded`]; then the start rules of [`check_start`] apply.
///
/// ```
/// use spacebot_core::error::DenialReason;
/// use spacebot_core::policy::{LinkGraph, check_delegate};
/// use spacebot_core::{AgentId, AgentLink, LinkDirection, LinkRelationship, Timestamp};
/// let id = |s: &str| AgentId::parse(s).unwrap();
/// let link = |f: &str, t: &str| AgentLink::new(id(f), id(t), LinkDirection::TwoWay, LinkRelationship::Peer, Timestamp(0));
/// let graph = LinkGraph::new([], [link("a", "b"), link("b", "c"), link("c", "a")]);
/// assert!(check_delegate(&graph, &id("b"), &id("c"), &[id("a")], 4).is_ok());
/// let denied = check_delegate(&graph, &id("c"), &id("a"), &[id("a"), id("b")], 4).unwrap_err();
/// assert_eq!(denied.reason, DenialReason::Cycle { chain: vec![id("a"), id("b"), id("c")] });
/// let denied = check_delegate(&graph, &id("b"), &id("c"), &[id("a")], 1).unwrap_err();
/// assert_eq!(denied.reason, DenialReason::DepthExceeded { limit: 1 });
/// ```
pub fn check_delegate<'g, T: AsRef<str> + ?Sized>(
    graph: &'g LinkGraph,
    actor: &AgentId,
    target: &T,
    chain: &[AgentId],
    max_depth: usize,
) -> Result<&'g AgentLink, PolicyDenied> {
    let target = target.as_ref();
    let action = PolicyAction::Delegate;
    if actor.as_str() == target {
        return Err(deny(actor, target, action, DenialReason::SelfTarget));
    }
    if !graph.contains(target) {
        return Err(deny(actor, target, action, DenialReason::UnknownAgent));
    }
    if chain.iter().any(|a| a.as_str() == target) {
        let mut chain = chain.to_vec();
        chain.push(actor.clone());
        return Err(deny(actor, target, action, DenialReason::Cycle { chain }));
    }
    if chain.len().saturating_add(1) > max_depth {
        let reason = DenialReason::DepthExceeded { limit: max_depth };
        return Err(deny(actor, target, action, reason));
    }
    start_rules(graph, actor, target, action)
}

/// Whether delegated tasks wait for approval before they may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalPolicy {
    /// Delegated tasks are ready at once.
    #[default]
    Never,
    /// Every delegated task starts as `pending_approval`.
    Always,
    /// A delegated task is `pending_approval` unless the delegator is the target's superior.
    UnlessSuperior,
}

crate::link::text_enum!(ApprovalPolicy, "approval policy", [Never => "never", Always => "always", UnlessSuperior => "unless_superior"]);

/// Whether a task `actor` delegates to `target` needs approval under `policy`.
///
/// "Superior" is read from the enabled links as [`org_chart`] reads it.
pub fn needs_approval<T: AsRef<str> + ?Sized>(
    policy: ApprovalPolicy,
    graph: &LinkGraph,
    actor: &AgentId,
    target: &T,
) -> bool {
    match policy {
        ApprovalPolicy::Never => false,
        ApprovalPolicy::Always => true,
        ApprovalPolicy::UnlessSuperior => !is_superior(graph, actor.as_str(), target.as_ref()),
    }
}

/// Whether an enabled link says `superior` is above `subordinate`.
pub fn is_superior(graph: &LinkGraph, superior: &str, subordinate: &str) -> bool {
    let (forward, reverse) = graph.pair(superior, subordinate);
    forward.is_some_and(|l| l.enabled && l.relationship == LinkRelationship::Superior)
        || reverse.is_some_and(|l| l.enabled && l.relationship == LinkRelationship::Subordinate)
}

/// An agent's place in the organization, read from its enabled links.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct OrgChart {
    /// Agents above it, sorted.
    pub superiors: Vec<AgentId>,
    /// Agents below it, sorted.
    pub subordinates: Vec<AgentId>,
    /// Its equals, sorted.
    pub peers: Vec<AgentId>,
}

impl OrgChart {
    /// Whether the agent has no enabled link at all.
    pub fn is_empty(&self) -> bool {
        self.superiors.is_empty() && self.subordinates.is_empty() && self.peers.is_empty()
    }
}

/// The superiors, subordinates and peers of `agent`, from its enabled links.
///
/// The hierarchy may be written either way: a link `A -> B` with relationship `superior` and a
/// link `B -> A` with relationship `subordinate` both make `A` a superior of `B`.
///
/// ```
/// use spacebot_core::policy::{LinkGraph, org_chart};
/// use spacebot_core::{AgentId, AgentLink, LinkDirection, LinkRelationship, Timestamp};
/// let id = |s: &str| AgentId::parse(s).unwrap();
/// let link = |f: &str, t: &str, r| AgentLink::new(id(f), id(t), LinkDirection::TwoWay, r, Timestamp(0));
/// let written_down = LinkGraph::new([], [link("chief", "lead", LinkRelationship::Superior)]);
/// let written_up = LinkGraph::new([], [link("lead", "chief", LinkRelationship::Subordinate)]);
/// for graph in [&written_down, &written_up] {
///     assert_eq!(org_chart(graph, &id("lead")).superiors, vec![id("chief")]);
///     assert_eq!(org_chart(graph, &id("chief")).subordinates, vec![id("lead")]);
/// }
/// ```
pub fn org_chart(graph: &LinkGraph, agent: &AgentId) -> OrgChart {
    let mut chart = OrgChart::default();
    for link in graph.links_of(agent.as_str()).filter(|l| l.enabled) {
        let (Some(other), Some(relationship)) =
            (link.other(agent), link.relationship_of_other(agent))
        else {
            continue;
        };
        let list = match relationship {
            LinkRelationship::Superior => &mut chart.superiors,
            LinkRelationship::Subordinate => &mut chart.subordinates,
            LinkRelationship::Peer => &mut chart.peers,
        };
        list.push(other.clone());
    }
    for list in [
        &mut chart.superiors,
        &mut chart.subordinates,
        &mut chart.peers,
    ] {
        list.sort();
        list.dedup();
    }
    chart
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::Timestamp;
    use LinkDirection::{OneWay, TwoWay};
    use LinkRelationship::{Peer, Subordinate, Superior};

    fn id(s: &str) -> AgentId {
        AgentId::parse(s).unwrap()
    }

    fn link(from: &str, to: &str, d: LinkDirection, r: LinkRelationship, on: bool) -> AgentLink {
        let mut l = AgentLink::new(id(from), id(to), d, r, Timestamp(0));
        l.enabled = on;
        l
    }

    fn reason<T>(r: Result<T, PolicyDenied>) -> Option<DenialReason> {
        r.err().map(|d| d.reason)
    }

    #[test]
    fn graph_indexes_pairs_and_agents() {
        let g = LinkGraph::new(
            [id("z"), id("a")],
            [
                link("b", "a", TwoWay, Peer, true),
                link("a", "b", OneWay, Superior, true),
                link("a", "b", OneWay, Subordinate, false), // replaces the previous a -> b
            ],
        );
        assert_eq!(g.agents(), &[id("a"), id("b"), id("z")]);
        assert_eq!(g.links().len(), 2);
        assert_eq!(
            g.between("a", "b").map(|l| l.relationship),
            Some(Subordinate)
        );
        assert_eq!(g.between("b", "a").map(|l| l.direction), Some(TwoWay));
        assert!(g.between("a", "z").is_none());
        assert_eq!(g.links_of("a").count(), 2);
        assert_eq!(g.links_of("z").count(), 0);
        assert_eq!(g.links_of("nobody").count(), 0);
        assert!(g.contains("z") && !g.contains("y"));
    }

    #[test]
    fn start_rules() {
        let g = LinkGraph::new(
            [id("lonely")],
            [
                link("a", "b", OneWay, Superior, true),
                link("c", "d", TwoWay, Peer, false),
                link("e", "f", OneWay, Peer, false),
                link("f", "e", OneWay, Peer, true),
            ],
        );
        assert_eq!(
            check_start(&g, &id("a"), "b").map(|l| l.to.clone()),
            Ok(id("b"))
        );
        assert_eq!(
            reason(check_start(&g, &id("b"), "a")),
            Some(DenialReason::OneWayReverse)
        );
        assert_eq!(
            reason(check_start(&g, &id("c"), "d")),
            Some(DenialReason::LinkDisabled)
        );
        assert_eq!(
            reason(check_start(&g, &id("d"), "c")),
            Some(DenialReason::LinkDisabled)
        );
        assert_eq!(
            reason(check_start(&g, &id("a"), "lonely")),
            Some(DenialReason::NoLink)
        );
        assert_eq!(
            reason(check_start(&g, &id("a"), "a")),
            Some(DenialReason::SelfTarget)
        );
        assert_eq!(
            reason(check_start(&g, &id("a"), "ghost")),
            Some(DenialReason::UnknownAgent)
        );
        // e -> f is disabled but f -> e one-way lets f start; e may only be refused as disabled.
        assert!(check_start(&g, &id("f"), "e").is_ok());
        assert_eq!(
            reason(check_start(&g, &id("e"), "f")),
            Some(DenialReason::LinkDisabled)
        );
        let denied = check_start(&g, &id("b"), "a").unwrap_err();
        assert_eq!((denied.actor.as_str(), denied.target.as_str()), ("b", "a"));
        assert_eq!(denied.action, PolicyAction::Start);
    }

    #[test]
    fn answer_rules() {
        let g = LinkGraph::new(
            [id("x")],
            [
                link("a", "b", OneWay, Superior, true),
                link("c", "d", TwoWay, Peer, false),
            ],
        );
        let answered = check_answer(&g, &id("b"), "a", true).unwrap();
        assert_eq!((answered.from.as_str(), answered.to.as_str()), ("a", "b"));
        assert!(check_answer(&g, &id("a"), "b", true).is_ok());
        assert_eq!(
            reason(check_answer(&g, &id("b"), "a", false)),
            Some(DenialReason::NoOpenExchange)
        );
        assert_eq!(
            reason(check_answer(&g, &id("d"), "c", true)),
            Some(DenialReason::LinkDisabled)
        );
        assert_eq!(
            reason(check_answer(&g, &id("x"), "a", true)),
            Some(DenialReason::NoLink)
        );
        assert_eq!(
            reason(check_answer(&g, &id("x"), "x", true)),
            Some(DenialReason::SelfTarget)
        );
        assert_eq!(
            reason(check_answer(&g, &id("x"), "?", true)),
            Some(DenialReason::UnknownAgent)
        );
    }

    #[test]
    fn delegate_rules_in_order() {
        let g = LinkGraph::new(
            [],
            [
                link("a", "b", OneWay, Superior, true),
                link("b", "c", TwoWay, Peer, true),
            ],
        );
        let (a, b, c) = (id("a"), id("b"), id("c"));
        assert!(check_delegate(&g, &a, "b", &[], 1).is_ok());
        assert_eq!(
            reason(check_delegate(&g, &a, "a", &[], 4)),
            Some(DenialReason::SelfTarget)
        );
        assert_eq!(
            reason(check_delegate(&g, &a, "q", &[], 4)),
            Some(DenialReason::UnknownAgent)
        );
        assert_eq!(
            reason(check_delegate(&g, &c, "b", &[a.clone(), b.clone()], 1)),
            Some(DenialReason::Cycle {
                chain: vec![a.clone(), b.clone(), c.clone()]
            })
        );
        assert_eq!(
            reason(check_delegate(&g, &b, "c", std::slice::from_ref(&a), 1)),
            Some(DenialReason::DepthExceeded { limit: 1 })
        );
        assert!(check_delegate(&g, &b, "c", std::slice::from_ref(&a), 2).is_ok());
        assert_eq!(
            reason(check_delegate(&g, &b, "a", &[], 4)),
            Some(DenialReason::OneWayReverse)
        );
        let denied = check_delegate(&g, &b, "a", &[], 4).unwrap_err();
        assert_eq!(denied.action, PolicyAction::Delegate);
    }

    #[test]
    fn approval_policies() {
        let g = LinkGraph::new(
            [],
            [
                link("boss", "dev", TwoWay, Superior, true),
                link("ops", "boss", TwoWay, Subordinate, true),
                link("dev", "ops", TwoWay, Peer, true),
            ],
        );
        let (boss, dev, ops) = (id("boss"), id("dev"), id("ops"));
        assert!(!needs_approval(ApprovalPolicy::default(), &g, &boss, &dev));
        assert!(needs_approval(ApprovalPolicy::Always, &g, &boss, &dev));
        assert!(!needs_approval(
            ApprovalPolicy::UnlessSuperior,
            &g,
            &boss,
            &dev
        ));
        assert!(!needs_approval(
            ApprovalPolicy::UnlessSuperior,
            &g,
            &boss,
            &ops
        ));
        assert!(needs_approval(
            ApprovalPolicy::UnlessSuperior,
            &g,
            &dev,
            &ops
        ));
        assert!(needs_approval(
            ApprovalPolicy::UnlessSuperior,
            &g,
            &dev,
            &boss
        ));
        assert_eq!(
            "unless_superior".parse::<ApprovalPolicy>(),
            Ok(ApprovalPolicy::UnlessSuperior)
        );
        assert!("sometimes".parse::<ApprovalPolicy>().is_err());
    }

    #[test]
    fn org_chart_reads_both_ways_and_skips_disabled_links() {
        let g = LinkGraph::new(
            [],
            [
                link("chief", "lead", TwoWay, Superior, true),
                link("cm", "lead", TwoWay, Subordinate, true),
                link("lead", "peer", OneWay, Peer, true),
                link("lead", "gone", TwoWay, Peer, false),
            ],
        );
        let chart = org_chart(&g, &id("lead"));
        assert_eq!(chart.superiors, vec![id("chief")]);
        assert_eq!(chart.subordinates, vec![id("cm")]);
        assert_eq!(chart.peers, vec![id("peer")]);
        assert_eq!(org_chart(&g, &id("cm")).superiors, vec![id("lead")]);
        assert!(org_chart(&g, &id("gone")).is_empty());
    }
}
