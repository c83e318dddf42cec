//! Calls that wait for a human's approval: stored as records (namespace [`APPROVALS_NAMESPACE`]),
//! so a pending call survives a restart, and run once after approval.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use spacebot_core::tools::{ToolContext, ToolError, ToolOutput};
use spacebot_core::{AgentId, Expect, Records, WriteOutcome};

use crate::mcp::{McpError, execute};
use crate::server::{McpTool, Server};

/// The records namespace of the calls waiting for approval (and of their outcome).
pub const APPROVALS_NAMESPACE: &str = "mcp_approvals";

/// Where a call that needs approval is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ApprovalStatus {
    /// Waiting for a human.
    Pending,
    /// Approved; not run yet.
    Approved,
    /// Rejected: it never runs; the model is told why.
    Rejected,
    /// Running (a call found running after a restart is run again, with the same idempotency
    /// key: the crash may have come before or after the server applied it).
    Running,
    /// Run; its result is stored and answered again if the turn runs again.
    Done,
}

/// A call of a tool whose grant requires approval (`{ tool = "files:write", approval = true }`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PendingCall {
    /// Its id: the call's idempotency key (the same when the turn runs again).
    pub id: String,
    /// The calling agent.
    pub agent: AgentId,
    /// The server.
    pub server: String,
    /// The tool, as the server names it.
    pub tool: String,
    /// The arguments the model gave (checked against the tool's schema); what runs once
    /// approved.
    pub arguments: Map<String, Value>,
    /// Where it is.
    pub status: ApprovalStatus,
    /// Who approved or rejected it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    /// Why it was rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The text the model was answered once it ran (`Ok`), or the failure's (`Err`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Result<String, String>>,
}

fn store_error(e: impl std::fmt::Display) -> McpError {
    McpError::Store(e.to_string())
}

/// Moves the call `id` from pending to approved or rejected.
pub(crate) async fn decide(
    records: &Records<PendingCall>,
    id: &str,
    by: &str,
    rejection: Option<&str>,
) -> Result<PendingCall, McpError> {
    loop {
        let record = records
            .get(id)
            .await
            .map_err(store_error)?
            .ok_or_else(|| McpError::NoSuchCall { id: id.into() })?;
        if record.value.status != ApprovalStatus::Pending {
            return Err(McpError::NotPending {
                id: id.into(),
                status: record.value.status,
            });
        }
        let mut call = record.value.clone();
        match rejection {
            Some(reason) => {
                call.status = ApprovalStatus::Rejected;
                call.reason = Some(reason.to_owned());
            }
            None => call.status = ApprovalStatus::Approved,
        }
        call.decided_by = Some(by.to_owned());
        let write = records
            .draft(id, &call, by)
            .map_err(store_error)?
            .expect(Expect::Version(record.version));
        match records.write(write).await.map_err(store_error)? {
            WriteOutcome::Conflict { .. } => continue,
            _ => return Ok(call),
        }
    }
}

/// Runs a call that needs approval: stores it as pending (once per idempotency key), waits for
/// the decision (`changed` rings on every decision in this process; the record is read again
/// every second too, for decisions made by another process), then runs it once.
pub(crate) async fn run_approved(
    records: &Records<PendingCall>,
    mut changed: tokio::sync::watch::Receiver<u64>,
    server: &Server,
    tool: &McpTool,
    ctx: &ToolContext,
    args: Map<String, Value>,
) -> Result<ToolOutput, ToolError> {
    let name = tool.exposed.as_str();
    let failed = |e: McpError| ToolError::failed(name, format!("the approval store failed: {e}"));
    let id = ctx.key.clone();
    let call = PendingCall {
        id: id.clone(),
        agent: ctx.agent.clone(),
        server: server.config.id.clone(),
        tool: tool.name.clone(),
        arguments: args,
        status: ApprovalStatus::Pending,
        decided_by: None,
        reason: None,
        result: None,
    };
    let draft = records
        .draft(&id, &call, ctx.agent.as_str())
        .map_err(|e| failed(store_error(e)))?
        .expect(Expect::Absent);
    // A call stored before (the turn runs again) keeps its record.
    records
        .write(draft)
        .await
        .map_err(|e| failed(store_error(e)))?;
    loop {
        let record = records
            .get(&id)
            .await
            .map_err(|e| failed(store_error(e)))?
            .ok_or_else(|| failed(McpError::NoSuchCall { id: id.clone() }))?;
        let mut call = record.value.clone();
        match call.status {
            ApprovalStatus::Pending => {
                tokio::select! {
                    _ = changed.changed() => {}
                    () = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                }
            }
            ApprovalStatus::Rejected => {
                return Err(ToolError::failed(
                    name,
                    format!(
                        "a human rejected this call{}: {}",
                        call.decided_by
                            .as_deref()
                            .map(|b| format!(" ({b})"))
                            .unwrap_or_default(),
                        call.reason.as_deref().unwrap_or("no reason given")
                    ),
                ));
            }
            ApprovalStatus::Done => {
                return match call.result {
                    Some(Ok(text)) => Ok(ToolOutput::text(text)),
                    Some(Err(text)) => Err(ToolError::failed(name, text)),
                    None => Err(ToolError::failed(
                        name,
                        "the call ran; its result was not kept",
                    )),
                };
            }
            ApprovalStatus::Approved | ApprovalStatus::Running => {
                let mut version = record.version;
                if call.status == ApprovalStatus::Approved {
                    call.status = ApprovalStatus::Running;
                    let claim = records
                        .draft(&id, &call, ctx.agent.as_str())
                        .map_err(|e| failed(store_error(e)))?
                        .expect(Expect::Version(version));
                    match records
                        .write(claim)
                        .await
                        .map_err(|e| failed(store_error(e)))?
                    {
                        WriteOutcome::Written(r) => version = r.version,
                        _ => continue,
                    }
                }
                let result = execute(server, tool, ctx, call.arguments.clone()).await;
                call.status = ApprovalStatus::Done;
                call.result = Some(result.clone());
                let done = records
                    .draft(&id, &call, ctx.agent.as_str())
                    .map_err(|e| failed(store_error(e)))?
                    .expect(Expect::Version(version));
                records
                    .write(done)
                    .await
                    .map_err(|e| failed(store_error(e)))?;
                return result
                    .map(ToolOutput::text)
                    .map_err(|e| ToolError::failed(name, e));
            }
        }
    }
}
