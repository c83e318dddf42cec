//! A snapshot of the organization's graph for display: agents and links, as seed 003's JSON
//! payload, as Graphviz DOT and as Mermaid.
//!
//! ```json
//! {
//!   "agents": [{ "id": "support", "name": "Support Agent" }],
//!   "links": [{ "id": "uuid", "from": "support", "to": "engineering",
//!               "direction": "two_way", "relationship": "subordinate", "enabled": true }]
//! }
//! ```

use std::collections::HashSet;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::config::{AgentConfig, OrgConfig};
use crate::error::StoreError;
use crate::ids::{AgentId, LinkId};
use crate::link::{AgentLink, LinkDirection, LinkRelationship, LinkStore};
use crate::time::Timestamp;

/// An agent in a [`Topology`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyAgent {
    /// Id.
    pub id: AgentId,
    /// Display name.
    pub name: String,
}

impl From<&AgentConfig> for TopologyAgent {
    fn from(agent: &AgentConfig) -> Self {
        Self {
            id: agent.id.clone(),
            name: agent.name.clone(),
        }
    }
}

/// A link in a [`Topology`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyLink {
    /// Id.
    pub id: LinkId,
    /// The agent the link starts from.
    pub from: AgentId,
    /// The agent the link points to.
    pub to: AgentId,
    /// Who may start an exchange.
    pub direction: LinkDirection,
    /// What `from` is to `to`.
    pub relationship: LinkRelationship,
    /// Whether the link allows anything.
    pub enabled: bool,
}

impl From<AgentLink> for TopologyLink {
    fn from(link: AgentLink) -> Self {
        Self {
            id: link.id,
            from: link.from,
            to: link.to,
            direction: link.direction,
            relationship: link.relationship,
            enabled: link.enabled,
        }
    }
}

/// The organization's graph: agents and links.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Topology {
    /// Agents, in the order given.
    pub agents: Vec<TopologyAgent>,
    /// Links, in the order given.
    pub links: Vec<TopologyLink>,
}

impl Topology {
    /// A topology of `agents` and `links`, both kept in the order given. An agent that a link
    /// names but `agents` does not is appended, named by its id, so every link has both ends.
    pub fn from_parts(
        agents: impl IntoIterator<Item = TopologyAgent>,
        links: impl IntoIterator<Item = AgentLink>,
    ) -> Self {
        let mut agents: Vec<TopologyAgent> = agents.into_iter().collect();
        let links: Vec<TopologyLink> = links.into_iter().map(TopologyLink::from).collect();
        let mut known: HashSet<AgentId> = agents.iter().map(|a| a.id.clone()).collect();
        for link in &links {
            for end in [&link.from, &link.to] {
                if known.insert(end.clone()) {
                    agents.push(TopologyAgent {
                        id: end.clone(),
                        name: end.to_string(),
                    });
                }
            }
        }
        Self { agents, links }
    }

    /// The configured agents and links (link ids and times as in
    /// [`OrgConfig::links_at`]).
    pub fn from_config(config: &OrgConfig) -> Self {
        Self::from_parts(
            config.agents.iter().map(TopologyAgent::from),
            config.links_at(Timestamp(0)),
        )
    }

    /// The configured agents and every link `store` holds (sorted by `(from, to)`).
    pub async fn load(config: &OrgConfig, store: &dyn LinkStore) -> Result<Self, StoreError> {
        let links = store.list().await?;
        Ok(Self::from_parts(
            config.agents.iter().map(TopologyAgent::from),
            links,
        ))
    }

    /// The JSON payload of seed 003, pretty-printed.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self)
    }

    fn name_of<'a>(&'a self, id: &'a AgentId) -> &'a str {
        self.agents
            .iter()
            .find(|a| &a.id == id)
            .map_or(id.as_str(), |a| a.name.as_str())
    }

    /// A Graphviz `digraph`: one box per agent (labelled with its name), one edge per link
    /// labelled with its relationship; two-way links have arrows at both ends, one-way links at
    /// `to` only; disabled links are dashed.
    ///
    /// ```
    /// use spacebot_core::topology::{Topology, TopologyAgent};
    /// use spacebot_core::{AgentId, AgentLink, LinkDirection, LinkRelationship, Timestamp};
    /// let id = |s: &str| AgentId::parse(s).unwrap();
    /// let link = AgentLink::new(id("a"), id("b"), LinkDirection::OneWay, LinkRelationship::Superior, Timestamp(0));
    /// let topology = Topology::from_parts([], [link]);
    /// assert!(topology.to_dot().contains("\"a\" -> \"b\" [label=\"superior\", dir=forward];"));
    /// ```
    pub fn to_dot(&self) -> String {
        let mut out = String::from("digraph org {\n    node [shape=box];\n");
        for agent in &self.agents {
            let _ = writeln!(
                out,
                "    \"{}\" [label=\"{}\"];",
                dot_escape(agent.id.as_str()),
                dot_escape(&agent.name)
            );
        }
        for link in &self.links {
            let dir = match link.direction {
                LinkDirection::OneWay => "forward",
                LinkDirection::TwoWay => "both",
            };
            let style = if link.enabled { "" } else { ", style=dashed" };
            let _ = writeln!(
                out,
                "    \"{}\" -> \"{}\" [label=\"{}\", dir={dir}{style}];",
                dot_escape(link.from.as_str()),
                dot_escape(link.to.as_str()),
                link.relationship,
            );
        }
        out.push_str("}\n");
        out
    }

    /// A Mermaid `flowchart`: nodes `a0`, `a1`, ... (in agent order) labelled with names, one
    /// edge per link labelled with its relationship; two-way links have arrows at both ends,
    /// disabled links are dotted.
    pub fn to_mermaid(&self) -> String {
        let mut out = String::from("flowchart TD\n");
        for (i, agent) in self.agents.iter().enumerate() {
            let _ = writeln!(out, "    a{i}[\"{}\"]", mermaid_escape(&agent.name));
        }
        let node = |id: &AgentId| self.agents.iter().position(|a| &a.id == id);
        for link in &self.links {
            let (Some(from), Some(to)) = (node(&link.from), node(&link.to)) else {
                continue; // from_parts adds every end; only a hand-built topology can miss one
            };
            let start = if link.direction == LinkDirection::TwoWay {
                "<"
            } else {
                ""
            };
            let (open, close) = if link.enabled {
                ("--", "-->")
            } else {
                ("-.", ".->")
            };
            let _ = writeln!(
                out,
                "    a{from} {start}{open} {} {close} a{to}",
                link.relationship
            );
        }
        out
    }

    /// A one-line description of each link, such as
    /// `Support Agent -> Engineering Agent (two_way, subordinate)`.
    pub fn describe_links(&self) -> Vec<String> {
        self.links
            .iter()
            .map(|l| {
                format!(
                    "{} -> {} ({}, {}{})",
                    self.name_of(&l.from),
                    self.name_of(&l.to),
                    l.direction,
                    l.relationship,
                    if l.enabled { "" } else { ", disabled" }
                )
            })
            .collect()
    }
}

fn dot_escape(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"")
}

fn mermaid_escape(text: &str) -> String {
    text.replace('"', "#quot;")
}
