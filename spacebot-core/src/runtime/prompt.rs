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
    // Agents offered the same tools with the same descriptions share one rendering: what tells
    // offers apart is much cheaper to make than the definitions (every schema copied).
    let offer = org.tools.offer(scope);
    if let Some(offer) = &offer
        && let Some(defs) = org.caches.offered(version, offer)
    {
        org.caches
            .set_definitions(scope.agent().clone(), version, defs.clone());
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
    if let Some(offer) = offer {
        org.caches.remember_offer(version, offer, defs.clone());
    }
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use async_trait::async_trait;

    use super::*;
    use crate::config::OrgConfig;
    use crate::testing::FnLlm;
    use crate::tools::{Tool, ToolContext, ToolError, ToolOutput, TypedTool};
    use crate::{ChatResponse, Organization, Stores, ToolDefinition};

    /// A tool whose description names the agent only for agents whose id starts with `x`, and
    /// that counts how often its schema is made.
    #[derive(Debug, Default)]
    struct Greet(Arc<AtomicUsize>);

    #[async_trait]
    impl TypedTool for Greet {
        const NAME: &'static str = "greet";
        type Args = serde_json::Value;
        fn description(&self) -> String {
            "Greets.".into()
        }
        fn description_for(&self, scope: &ToolCapability) -> String {
            if scope.agent().as_str().starts_with('x') {
                format!("Greets for {}.", scope.agent())
            } else {
                self.description()
            }
        }
        fn parameters(&self) -> serde_json::Value {
            self.0.fetch_add(1, Ordering::Relaxed);
            serde_json::json!({"type": "object"})
        }
        async fn run(
            &self,
            _: &ToolContext,
            _: serde_json::Value,
        ) -> Result<ToolOutput, ToolError> {
            Ok(ToolOutput::text("hi"))
        }
    }

    /// A tool that renders its whole definition per agent.
    #[derive(Debug)]
    struct Whole;

    #[async_trait]
    impl Tool for Whole {
        fn definition(&self) -> ToolDefinition {
            ToolDefinition::new("whole", "Whole.", serde_json::json!({"type": "object"}))
        }
        fn definition_for(&self, scope: &ToolCapability) -> ToolDefinition {
            ToolDefinition::new(
                "whole",
                format!("Whole, for {}.", scope.agent()),
                serde_json::json!({"type": "object"}),
            )
        }
        async fn call(
            &self,
            _: &ToolContext,
            _: serde_json::Value,
        ) -> Result<ToolOutput, ToolError> {
            Ok(ToolOutput::text("whole"))
        }
    }

    async fn org(tools: Vec<Arc<dyn Tool>>) -> Organization {
        let config = OrgConfig::from_toml_str(
            "[[agents]]\nid = \"a\"\n[[agents]]\nid = \"b\"\n[[agents]]\nid = \"x1\"\n",
        )
        .unwrap();
        let mut builder = Organization::builder(config)
            .stores(Stores::memory())
            .llm(Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("ok")))));
        for tool in tools {
            builder = builder.tool(tool);
        }
        builder.build().await.unwrap()
    }

    fn definitions(org: &Organization, agent: &str) -> crate::runtime::host::Definitions {
        let scope = ToolCapability::new(org.inner.clone(), AgentId::parse(agent).unwrap());
        cached_definitions(&org.inner, &scope)
    }

    fn description(defs: &crate::runtime::host::Definitions, tool: &str) -> String {
        defs.list
            .iter()
            .find(|d| d.name == tool)
            .map(|d| d.description.clone())
            .unwrap()
    }

    #[tokio::test]
    async fn agents_offered_the_same_tools_share_one_rendering() {
        let made = Arc::new(AtomicUsize::new(0));
        let org = org(vec![Arc::new(Greet(made.clone()))]).await;
        // Building the organization looks at the definition once.
        let built = made.load(Ordering::Relaxed);
        let (a, b, x) = (
            definitions(&org, "a"),
            definitions(&org, "b"),
            definitions(&org, "x1"),
        );
        assert!(Arc::ptr_eq(&a.list, &b.list), "a and b share one list");
        assert!(!Arc::ptr_eq(&a.list, &x.list));
        assert_eq!(description(&a, "greet"), "Greets.");
        assert_eq!(description(&x, "greet"), "Greets for x1.");
        // Rendered for a's offer and for x1's, not again for b's.
        assert_eq!(made.load(Ordering::Relaxed) - built, 2);
        // A changed offer renders again.
        org.tools_changed();
        let again = definitions(&org, "b");
        assert!(!Arc::ptr_eq(&a.list, &again.list));
        assert_eq!(made.load(Ordering::Relaxed) - built, 3);
    }

    #[tokio::test]
    async fn a_tool_rendered_whole_per_agent_is_rendered_for_each() {
        let made = Arc::new(AtomicUsize::new(0));
        let org = org(vec![Arc::new(Greet(made.clone())), Arc::new(Whole)]).await;
        let built = made.load(Ordering::Relaxed);
        let (a, b) = (definitions(&org, "a"), definitions(&org, "b"));
        assert_eq!(description(&a, "whole"), "Whole, for a.");
        assert_eq!(description(&b, "whole"), "Whole, for b.");
        assert_eq!(description(&b, "greet"), "Greets.");
        assert_eq!(made.load(Ordering::Relaxed) - built, 2);
    }
}
