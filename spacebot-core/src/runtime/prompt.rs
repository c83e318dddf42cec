//! The system prompt and tool definitions of an agent's turn, rendered once per link graph.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::ids::{AgentId, ChannelId};
use crate::policy;
use crate::prompts::{LinkContext, OrgContext, PromptError, SystemPromptContext};
use crate::runtime::host::{AgentRuntime, Host};
use crate::tools::ToolCapability;

/// The version of the link graph a cached rendering was made for (bumped whenever a link changes).
pub(crate) fn graph_version(org: &Host) -> u64 {
    org.graph_version.load(Ordering::Acquire)
}

/// The system prompt of `agent` in `channel`, rendered once per link graph and link peer.
pub(crate) fn cached_system_prompt(
    org: &Host,
    agent: &AgentRuntime,
    channel: &ChannelId,
) -> Result<Arc<str>, PromptError> {
    let peer = channel
        .as_link()
        .filter(|(owner, _)| owner == agent.id())
        .map(|(_, peer)| peer);
    let version = graph_version(org);
    let key = (agent.id().clone(), peer);
    if let Some((v, text)) = org.caches.prompts(&key)
        && v == version
    {
        return Ok(text);
    }
    let text: Arc<str> = system_prompt(org, agent, channel)?.into();
    org.caches.set_prompt(key, version, text.clone());
    Ok(text)
}

/// The tool definitions offered to the agent of `scope`, rendered once per link graph and measured
/// once per distinct list (agents offered the same tools share the list and its measure).
pub(crate) fn cached_definitions(
    org: &Host,
    scope: &ToolCapability,
) -> crate::runtime::host::Definitions {
    let version = graph_version(org);
    if let Some((v, defs)) = org.caches.definitions(scope.agent())
        && v == version
    {
        return defs;
    }
    let list = org.tools.definitions_for(scope);
    let defs = match org.caches.measured(version, &list) {
        Some(shared) => shared,
        None => {
            let list: Arc<[crate::llm::ToolDefinition]> = list.into();
            let defs = crate::runtime::host::Definitions {
                tokens: org.counter.count_tools(&list),
                size: crate::limits::TextSize::of_tools(&list),
                list,
            };
            org.caches.remember_measured(version, defs.clone());
            defs
        }
    };
    org.caches
        .set_definitions(scope.agent().clone(), version, defs.clone());
    defs
}

/// The system prompt of `agent` answering in `channel`.
pub(crate) fn system_prompt(
    org: &Host,
    agent: &AgentRuntime,
    channel: &ChannelId,
) -> Result<String, PromptError> {
    let graph = org.graph();
    let me = agent.id();
    let name = |id: &AgentId| org.display_name(id);
    let chart = policy::org_chart(&graph, me);
    let org_context =
        (!chart.superiors.is_empty() || !chart.subordinates.is_empty() || !chart.peers.is_empty())
            .then(|| {
                let mut context = OrgContext::from_chart(&chart, name);
                let depth = org.settings.max_delegation_depth;
                context.may_delegate = graph
                    .links_of(me.as_str())
                    .filter_map(|l| l.other(me))
                    .any(|peer| policy::check_delegate(&graph, me, peer, &[], depth).is_ok());
                context
            });
    let link_context = channel.as_link().and_then(|(owner, peer)| {
        if &owner != me {
            return None;
        }
        let link = graph
            .between(me.as_str(), peer.as_str())
            .or_else(|| graph.between(peer.as_str(), me.as_str()))?;
        Some(LinkContext {
            agent_id: peer.clone(),
            agent_name: org.display_name(&peer),
            relationship: link.relationship_of_other(me)?,
        })
    });
    org.prompts.render_system_prompt(&SystemPromptContext {
        agent_name: agent.spec.name.clone(),
        identity: agent.spec.identity.clone(),
        org_context,
        link_context,
        extra: agent.spec.instructions.clone(),
    })
}
