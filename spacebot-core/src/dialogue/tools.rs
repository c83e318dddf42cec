//! The conversation tools the model calls: `send_link_message`, `conclude_link`, `open_group`,
//! `close_link` and `sever_link`.

use std::sync::Arc;

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::json;

use super::{DialogueError, Opening};
use crate::conversation::{ConversationMode, ConversationStatus, MemberRole};
use crate::tools::{Tool, ToolCapability, ToolContext, ToolError, ToolOutput, TypedTool};

/// Name of the tool that opens or continues a mirrored conversation.
pub const SEND_LINK_MESSAGE: &str = "send_link_message";
/// Name of the tool that ends a mirrored conversation with a summary.
pub const CONCLUDE_LINK: &str = "conclude_link";
/// Name of the tool that opens a group conversation.
pub const OPEN_GROUP: &str = "open_group";
/// Name of the tool with which the initiator closes a conversation with a final message.
pub const CLOSE_LINK: &str = "close_link";
/// Name of the tool with which any member severs a conversation.
pub const SEVER_LINK: &str = "sever_link";

/// The conversation tools, registered for every agent.
pub(crate) fn dialogue_tools() -> Vec<Arc<dyn Tool>> {
    vec![
        Arc::new(SendLinkMessage),
        Arc::new(ConcludeLink),
        Arc::new(OpenGroup),
        Arc::new(CloseLink),
        Arc::new(SeverLink),
    ]
}

/// Whether the agent of `scope` may start an exchange with anyone now (an enabled link it may
/// start over): what opening a group, or closing a conversation it started, needs.
fn may_start_any(scope: &ToolCapability) -> bool {
    let graph = scope.graph();
    let me = scope.agent();
    graph
        .links_of(me.as_str())
        .filter_map(|l| l.other(me))
        .any(|peer| crate::policy::check_start(&graph, me, peer).is_ok())
}

/// Whether the agent of `scope` has an enabled link: a conversation it is a member of runs over
/// one (a member who only answers may still continue, conclude or sever it).
fn has_enabled_link(scope: &ToolCapability) -> bool {
    scope
        .graph()
        .links_of(scope.agent().as_str())
        .any(|l| l.enabled)
}

fn tool_error(tool: &str, e: DialogueError) -> ToolError {
    match e {
        DialogueError::Denied(d) => ToolError::Denied(d),
        other => ToolError::failed(tool, other.to_string()),
    }
}

fn non_empty(tool: &str, field: &str, text: &str) -> Result<(), ToolError> {
    if text.trim().is_empty() {
        return Err(ToolError::invalid_arguments(
            tool,
            format!("`{field}` must not be empty"),
        ));
    }
    Ok(())
}

/// `send_link_message(target, message)`.
#[derive(Debug)]
struct SendLinkMessage;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SendArgs {
    target: String,
    message: String,
}

#[async_trait]
impl TypedTool for SendLinkMessage {
    const NAME: &'static str = SEND_LINK_MESSAGE;
    type Args = SendArgs;

    fn description(&self) -> String {
        "Talk with a linked agent in a conversation: opens one (or continues the open one) and \
         sends your message; the agent's replies arrive in your link channel with it. End the \
         conversation with conclude_link once its objective is met."
            .into()
    }

    /// Offered to an agent with an enabled link: it may open a conversation over it, or, at the
    /// receiving end of a one-way link, continue one the other side opened.
    fn offered_to(&self, scope: &ToolCapability) -> bool {
        has_enabled_link(scope)
    }

    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "target": {"type": "string", "description": "The agent's id or name."},
                "message": {"type": "string", "description": "What to say."}
            },
            "required": ["target", "message"],
            "additionalProperties": false
        })
    }

    async fn run(&self, ctx: &ToolContext, args: SendArgs) -> Result<ToolOutput, ToolError> {
        non_empty(SEND_LINK_MESSAGE, "message", &args.message)?;
        let (conversation, opening) = super::send_mirrored(
            &ctx.org.behaviour_context(),
            &ctx.agent,
            &args.target,
            &ctx.channel,
            &args.message,
            super::Exchange {
                cause: &ctx.cause,
                key: Some(&ctx.key),
            },
        )
        .await
        .map_err(|e| tool_error(SEND_LINK_MESSAGE, e))?;
        let peer = conversation
            .members
            .iter()
            .find(|m| m.agent != ctx.agent)
            .map_or_else(|| args.target.clone(), |m| m.name.clone());
        let note = match opening {
            Opening::Continued => {
                " (you were already in a conversation with them; the message continues it)"
            }
            Opening::Reopened => " (the earlier conversation was reopened; its history is kept)",
            Opening::Created => "",
        };
        Ok(ToolOutput::text(format!(
            "Message sent to {peer}: conversation {} {}{note}. Their reply will arrive in your link \
             channel with them.",
            conversation.id,
            opening.describe(),
        )))
    }
}

/// `conclude_link(summary, target?)`.
#[derive(Debug)]
struct ConcludeLink;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConcludeArgs {
    summary: String,
    #[serde(default)]
    target: Option<String>,
}

#[async_trait]
impl TypedTool for ConcludeLink {
    const NAME: &'static str = CONCLUDE_LINK;
    type Args = ConcludeArgs;

    fn description(&self) -> String {
        "End the conversation of this link channel: sends your summary as the final message \
         and closes the conversation. Use it as soon as the objective is met."
            .into()
    }

    /// Offered to an agent with an enabled link (any member of a conversation may conclude it).
    fn offered_to(&self, scope: &ToolCapability) -> bool {
        has_enabled_link(scope)
    }

    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "summary": {"type": "string", "description": "The result, for the other side."},
                "target": {"type": "string", "description": "Only outside the link channel: the other agent or the conversation id."}
            },
            "required": ["summary"],
            "additionalProperties": false
        })
    }

    async fn run(&self, ctx: &ToolContext, args: ConcludeArgs) -> Result<ToolOutput, ToolError> {
        non_empty(CONCLUDE_LINK, "summary", &args.summary)?;
        let conversation = super::find_to_conclude(
            &ctx.org.behaviour_context(),
            &ctx.agent,
            &ctx.channel,
            args.target.as_deref(),
            &ctx.key,
        )
        .await
        .map_err(|e| tool_error(CONCLUDE_LINK, e))?;
        if conversation.mode == ConversationMode::Group {
            return Err(ToolError::failed(
                CONCLUDE_LINK,
                format!(
                    "conversation {} is a group: its initiator ends it with close_link, any member \
                     may leave it with sever_link",
                    conversation.id
                ),
            ));
        }
        let concluded = super::conclude(
            &ctx.org.behaviour_context(),
            &conversation.id,
            &ctx.agent,
            &args.summary,
            super::Exchange {
                cause: &ctx.cause,
                key: Some(&ctx.key),
            },
        )
        .await
        .map_err(|e| tool_error(CONCLUDE_LINK, e))?;
        Ok(ToolOutput::end_turn(format!(
            "Conversation {} concluded; your summary was sent.",
            concluded.id
        )))
    }
}

/// `open_group(members, message)`.
#[derive(Debug)]
struct OpenGroup;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpenGroupArgs {
    members: Vec<String>,
    message: String,
}

#[async_trait]
impl TypedTool for OpenGroup {
    const NAME: &'static str = OPEN_GROUP;
    type Args = OpenGroupArgs;

    fn description(&self) -> String {
        "Open a group conversation with several linked agents and send the first message. Each \
         member's output reaches every other member. You own it: close it with close_link and a \
         final message when you have what you need."
            .into()
    }

    /// Offered to an agent that may start an exchange with someone.
    fn offered_to(&self, scope: &ToolCapability) -> bool {
        may_start_any(scope)
    }

    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "members": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                            "description": "The other members' ids or names."},
                "message": {"type": "string", "description": "The opening message."}
            },
            "required": ["members", "message"],
            "additionalProperties": false
        })
    }

    async fn run(&self, ctx: &ToolContext, args: OpenGroupArgs) -> Result<ToolOutput, ToolError> {
        non_empty(OPEN_GROUP, "message", &args.message)?;
        let (conversation, opening) = super::open_group(
            &ctx.org.behaviour_context(),
            &ctx.agent,
            &args.members,
            &ctx.channel,
            &args.message,
            super::Exchange {
                cause: &ctx.cause,
                key: Some(&ctx.key),
            },
        )
        .await
        .map_err(|e| tool_error(OPEN_GROUP, e))?;
        let note = match opening {
            Opening::Continued => {
                " (these members were already linked with you in it; the message continues it)"
            }
            Opening::Reopened => " (the earlier group was reopened; its history is kept)",
            Opening::Created => "",
        };
        Ok(ToolOutput::text(format!(
            "Group conversation {} {} with {}{note}; its channel is {}.",
            conversation.id,
            opening.describe(),
            super::other_names(&conversation, &ctx.agent).join(", "),
            super::group_channel(&conversation.id),
        )))
    }
}

/// `close_link(message, target?)`.
#[derive(Debug)]
struct CloseLink;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CloseArgs {
    message: String,
    #[serde(default)]
    target: Option<String>,
}

#[async_trait]
impl TypedTool for CloseLink {
    const NAME: &'static str = CLOSE_LINK;
    type Args = CloseArgs;

    fn description(&self) -> String {
        "Close a conversation you started, with a final message to the other members. Without \
         `target` it closes the conversation of the current channel."
            .into()
    }

    /// Offered to an agent that may start an exchange (only an initiator closes).
    fn offered_to(&self, scope: &ToolCapability) -> bool {
        may_start_any(scope)
    }

    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "message": {"type": "string", "description": "The final message."},
                "target": {"type": "string", "description": "A member or the conversation id."}
            },
            "required": ["message"],
            "additionalProperties": false
        })
    }

    async fn run(&self, ctx: &ToolContext, args: CloseArgs) -> Result<ToolOutput, ToolError> {
        non_empty(CLOSE_LINK, "message", &args.message)?;
        let conversation = super::find_to_conclude(
            &ctx.org.behaviour_context(),
            &ctx.agent,
            &ctx.channel,
            args.target.as_deref(),
            &ctx.key,
        )
        .await
        .map_err(|e| tool_error(CLOSE_LINK, e))?;
        if conversation.initiator != ctx.agent
            || conversation
                .member(&ctx.agent)
                .is_some_and(|m| m.role != MemberRole::Initiator)
        {
            return Err(ToolError::failed(
                CLOSE_LINK,
                format!(
                    "only its initiator ({}) may close conversation {}; nothing was closed (you may \
                     stay silent, or leave with sever_link)",
                    ctx.org.display_name(&conversation.initiator),
                    conversation.id
                ),
            ));
        }
        let closed = super::conclude(
            &ctx.org.behaviour_context(),
            &conversation.id,
            &ctx.agent,
            &args.message,
            super::Exchange {
                cause: &ctx.cause,
                key: Some(&ctx.key),
            },
        )
        .await
        .map_err(|e| tool_error(CLOSE_LINK, e))?;
        Ok(ToolOutput::end_turn(format!(
            "Conversation {} closed; your final message was delivered.",
            closed.id
        )))
    }
}

/// `sever_link(target?)`.
#[derive(Debug)]
struct SeverLink;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SeverArgs {
    #[serde(default)]
    target: Option<String>,
}

#[async_trait]
impl TypedTool for SeverLink {
    const NAME: &'static str = SEVER_LINK;
    type Args = SeverArgs;

    fn description(&self) -> String {
        "Sever a conversation you are a member of: it ends at once for every member. Without \
         `target` it severs the conversation of the current channel."
            .into()
    }

    /// Offered to an agent with an enabled link (any member may sever).
    fn offered_to(&self, scope: &ToolCapability) -> bool {
        has_enabled_link(scope)
    }

    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "target": {"type": "string", "description": "A member or the conversation id."}
            },
            "additionalProperties": false
        })
    }

    async fn run(&self, ctx: &ToolContext, args: SeverArgs) -> Result<ToolOutput, ToolError> {
        let conversation = super::find_for(
            &ctx.org.behaviour_context(),
            &ctx.agent,
            &ctx.channel,
            args.target.as_deref(),
        )
        .await
        .map_err(|e| tool_error(SEVER_LINK, e))?;
        let reason = format!("{} severed it", ctx.org.display_name(&ctx.agent));
        let severed = super::sever(
            &ctx.org.behaviour_context(),
            &conversation.id,
            Some(&ctx.agent),
            &reason,
        )
        .await
        .map_err(|e| tool_error(SEVER_LINK, e))?;
        debug_assert_eq!(severed.status, ConversationStatus::Severed);
        Ok(ToolOutput::end_turn(format!(
            "Conversation {} severed for every member.",
            severed.id
        )))
    }
}
