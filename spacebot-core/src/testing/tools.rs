//! Small tools for tests: [`EchoTool`] (`echo`), [`BrokenTool`] (`broken`, always fails) and
//! [`PingTool`] (`ping`, sends a task to another agent over the internal channel).

use async_trait::async_trait;

use crate::llm::ToolDefinition;
use crate::org::InternalMessage;
use crate::tools::{Tool, ToolContext, ToolError, ToolOutput};

/// Echoes its `text` argument.
#[derive(Debug)]
pub struct EchoTool;

#[async_trait]
impl Tool for EchoTool {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition {
            name: "echo".into(),
            description: "Echoes text.".into(),
            parameters: serde_json::json!({
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"]
            }),
        }
    }
    async fn call(
        &self,
        _ctx: &ToolContext,
        args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        #[derive(serde::Deserialize)]
        struct Args {
            text: String,
        }
        let args: Args = crate::tools::parse_args("echo", args)?;
        Ok(ToolOutput::text(format!("echo: {}", args.text)))
    }
}

/// Always fails.
#[derive(Debug)]
pub struct BrokenTool;

#[async_trait]
impl Tool for BrokenTool {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition {
            name: "broken".into(),
            description: "Always fails.".into(),
            parameters: serde_json::json!({"type": "object"}),
        }
    }
    async fn call(
        &self,
        _ctx: &ToolContext,
        _args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        Err(ToolError::failed("broken", "the disk is on fire"))
    }
}

/// Sends a task to `target` over the internal channel, as the calling agent.
#[derive(Debug)]
pub struct PingTool;

#[async_trait]
impl Tool for PingTool {
    fn definition(&self) -> ToolDefinition {
        ToolDefinition {
            name: "ping".into(),
            description: "Sends a task to another agent.".into(),
            parameters: serde_json::json!({
                "type": "object",
                "properties": {"target": {"type": "string"}},
                "required": ["target"]
            }),
        }
    }
    async fn call(
        &self,
        ctx: &ToolContext,
        args: serde_json::Value,
    ) -> Result<ToolOutput, ToolError> {
        #[derive(serde::Deserialize)]
        struct Args {
            target: String,
        }
        let args: Args = crate::tools::parse_args("ping", args)?;
        let target = ctx
            .org
            .resolve(&args.target)
            .map_err(|e| ToolError::failed("ping", e.to_string()))?;
        match ctx
            .org
            .send_internal(&ctx.agent, &target, InternalMessage::task("ping"))
            .await
        {
            Ok(_) => Ok(ToolOutput::text("sent")),
            Err(crate::DeliveryError::Denied(d)) => Err(ToolError::Denied(d)),
            Err(e) => Err(ToolError::failed("ping", e.to_string())),
        }
    }
}
