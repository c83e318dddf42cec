//! Remote A2A agents as members of the organization: a task delegated to one is run by a
//! [`RemoteExecutor`], the A2A client, which sends it to the remote agent once and polls it
//! until it ends.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use spacebot_core::delegation::{TaskContext, TaskError, TaskExecutor, TaskOutcome};
use spacebot_core::{AgentId, Expect, OrgConfig, Records, Task as SpacebotTask, WriteOutcome};

use crate::config::{A2aConfig, RemoteAgent};
use crate::types::{
    AGENT_CARD_PATH, Message, PROTOCOL_VERSION, Role, StreamResponse, Task, TaskState,
    VERSION_HEADER, methods,
};

/// The records namespace of the tasks sent to remote agents (`{agent}#{number}` to the remote
/// task's id), so a task resumed after a restart polls the remote task instead of sending again.
pub const REMOTE_NAMESPACE: &str = "a2a_remote";

/// How a [`RemoteExecutor`] retries an unreachable remote agent and polls a remote task.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// How many times a request is tried before the task fails (at least 1).
    pub tries: u32,
    /// The wait after the first failed try; doubled after each.
    pub first_wait: Duration,
    /// The longest wait between two tries.
    pub max_wait: Duration,
    /// The wait between two polls of a remote task that is not done.
    pub poll: Duration,
    /// How long one request may take.
    pub timeout: Duration,
}

impl Default for RetryPolicy {
    /// 5 tries, waits from 200 ms doubling up to 5 s; polls every 250 ms; 30 s per request.
    fn default() -> Self {
        Self {
            tries: 5,
            first_wait: Duration::from_millis(200),
            max_wait: Duration::from_secs(5),
            poll: Duration::from_millis(250),
            timeout: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// This policy with `tries` tries and a first wait of `first_wait`.
    pub fn new(tries: u32, first_wait: Duration) -> Self {
        Self {
            tries: tries.max(1),
            first_wait,
            ..Self::default()
        }
    }
}

/// What the executor keeps of a task sent to a remote agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Sent {
    message_id: String,
    endpoint: String,
    remote_task: String,
}

/// Why a request did not give a result.
enum CallError {
    /// Not reached, or a server error: worth trying again.
    Unreachable(String),
    /// Reached and refused (an HTTP 4xx, a JSON-RPC error): trying again cannot help.
    Refused(String),
}

/// The A2A client as a task executor: the worker of a remote agent's tasks.
///
/// An attempt (1) finds the remote task stored for this task (a resumed task never sends
/// again), else (2) reads the agent card at `{url}/.well-known/agent-card.json` for the JSON-RPC
/// endpoint, sends the task's title and description with `SendMessage` (`returnImmediately`,
/// message id `spacebot-{agent}-{number}-{created}`: derived from the task) and stores the
/// remote task's id, then (3) polls `GetTask` until the remote task ends: `completed` completes
/// the task with the remote agent's answer (its artifacts' text, else its status message);
/// `failed`, `rejected`, `canceled`, `input-required` and `auth-required` fail it with a reason
/// naming the state. A remote agent that cannot be reached is tried again with a doubling wait
/// ([`RetryPolicy`]); after the last try the task fails, not retried, with a reason naming the
/// agent and the error, and the delegator is told once, as of any failed task.
#[derive(Clone)]
pub struct RemoteExecutor {
    remote: RemoteAgent,
    http: reqwest::Client,
    retry: RetryPolicy,
}

impl fmt::Debug for RemoteExecutor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteExecutor")
            .field("agent", &self.remote.id)
            .field("url", &self.remote.url)
            .field("retry", &self.retry)
            .finish_non_exhaustive()
    }
}

/// A remote agent's id and the executor of its tasks.
pub type RemoteMember = (AgentId, Arc<dyn TaskExecutor>);

/// The executors of the remote agents `config` declares (`[[agents]] a2a = "..."`): give each
/// to the organization's builder with
/// [`task_executor`](spacebot_core::OrganizationBuilder::task_executor).
///
/// # Errors
/// As [`A2aConfig::from_org`].
pub fn remote_executors(
    config: &OrgConfig,
    retry: &RetryPolicy,
) -> Result<Vec<RemoteMember>, spacebot_core::ConfigError> {
    let config = A2aConfig::from_org(config)?;
    Ok(config
        .remote
        .into_values()
        .map(|remote| {
            let id = remote.id.clone();
            let executor: Arc<dyn TaskExecutor> =
                Arc::new(RemoteExecutor::new(remote).with_retry(retry.clone()));
            (id, executor)
        })
        .collect())
}

fn clip(text: &str) -> String {
    let mut cut = text.len().min(300);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text[..cut].to_owned()
}

impl RemoteExecutor {
    /// The executor of `remote`, with the default [`RetryPolicy`].
    pub fn new(remote: RemoteAgent) -> Self {
        Self {
            remote,
            http: reqwest::Client::new(),
            retry: RetryPolicy::default(),
        }
    }

    /// This executor with `retry`.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    fn request(&self, builder: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let builder = builder
            .timeout(self.retry.timeout)
            .header(VERSION_HEADER, PROTOCOL_VERSION);
        match &self.remote.token {
            Some(token) => builder.bearer_auth(token),
            None => builder,
        }
    }

    async fn json(response: Result<reqwest::Response, reqwest::Error>) -> Result<Value, CallError> {
        let response = response.map_err(|e| CallError::Unreachable(e.to_string()))?;
        let status = response.status();
        let body = response
            .text()
            .await
            .map_err(|e| CallError::Unreachable(e.to_string()))?;
        if status.is_server_error() {
            return Err(CallError::Unreachable(format!(
                "HTTP {status}: {}",
                clip(&body)
            )));
        }
        if !status.is_success() {
            return Err(CallError::Refused(format!(
                "HTTP {status}: {}",
                clip(&body)
            )));
        }
        serde_json::from_str(&body).map_err(|e| {
            CallError::Refused(format!("the answer is not JSON ({e}): {}", clip(&body)))
        })
    }

    /// The JSON-RPC endpoint, from the agent card.
    async fn endpoint(&self) -> Result<String, CallError> {
        let url = format!("{}{AGENT_CARD_PATH}", self.remote.url);
        let card = Self::json(self.request(self.http.get(&url)).send().await).await?;
        card["supportedInterfaces"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|i| i["protocolBinding"] == "JSONRPC")
            .and_then(|i| i["url"].as_str())
            .map(str::to_owned)
            .ok_or_else(|| {
                CallError::Refused(format!(
                    "the agent card at {url} offers no JSONRPC interface"
                ))
            })
    }

    async fn call(&self, endpoint: &str, method: &str, params: Value) -> Result<Value, CallError> {
        let body = json!({"jsonrpc": "2.0", "id": uuid::Uuid::new_v4().to_string(), "method": method, "params": params});
        let answer = Self::json(
            self.request(self.http.post(endpoint))
                .json(&body)
                .send()
                .await,
        )
        .await?;
        if let Some(error) = answer.get("error") {
            return Err(CallError::Refused(format!(
                "{method}: error {}: {}",
                error["code"],
                error["message"].as_str().unwrap_or("")
            )));
        }
        answer
            .get("result")
            .cloned()
            .ok_or_else(|| CallError::Refused(format!("{method}: an answer with no result")))
    }

    /// `what` tried until it gives a result, at most [`RetryPolicy::tries`] times.
    async fn retrying<T, F, Fut>(
        &self,
        ctx: &TaskContext,
        what: &str,
        mut attempt: F,
    ) -> Result<T, TaskError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, CallError>>,
    {
        let mut wait = self.retry.first_wait;
        let mut tries = 0;
        loop {
            tries += 1;
            match attempt().await {
                Ok(value) => return Ok(value),
                Err(CallError::Refused(e)) => {
                    return Err(TaskError::GiveUp(format!(
                        "the remote A2A agent {} ({}) refused {what}: {e}",
                        self.remote.id, self.remote.url
                    )));
                }
                Err(CallError::Unreachable(e)) if tries >= self.retry.tries.max(1) => {
                    return Err(TaskError::GiveUp(format!(
                        "the remote A2A agent {} ({}) is unreachable: {what} failed {tries} times, last: {e}",
                        self.remote.id, self.remote.url
                    )));
                }
                Err(CallError::Unreachable(e)) => {
                    tracing::warn!(agent = %self.remote.id, task = %ctx.task, tries, "remote A2A agent not reached ({what}): {e}; trying again");
                    tokio::time::sleep(wait).await;
                    wait = wait.saturating_mul(2).min(self.retry.max_wait);
                }
            }
        }
    }

    fn outcome(&self, task: &Task) -> Option<Result<TaskOutcome, TaskError>> {
        let state = task.status.state;
        match state {
            TaskState::Completed => Some(Ok(TaskOutcome::Done(task.result_text()))),
            TaskState::Failed
            | TaskState::Rejected
            | TaskState::Canceled
            | TaskState::InputRequired
            | TaskState::AuthRequired => {
                let why = task
                    .status
                    .message
                    .as_ref()
                    .map(Message::to_text)
                    .filter(|t| !t.is_empty())
                    .map(|t| format!(": {t}"))
                    .unwrap_or_default();
                Some(Err(TaskError::GiveUp(format!(
                    "the remote A2A agent {} ended its task {} as {}{why}",
                    self.remote.id,
                    task.id,
                    state.as_str()
                ))))
            }
            _ => None,
        }
    }

    async fn send(
        &self,
        ctx: &TaskContext,
        records: &Records<Sent>,
        key: &str,
        task: &SpacebotTask,
    ) -> Result<Result<Sent, TaskOutcome>, TaskError> {
        let endpoint = self
            .retrying(ctx, "reading the agent card", || self.endpoint())
            .await?;
        let message_id = format!(
            "spacebot-{}-{}-{}",
            task.agent,
            task.number,
            task.created_at.as_millis()
        );
        let text = if task.description.trim().is_empty() || task.description == task.title {
            task.title.clone()
        } else {
            format!("{}\n\n{}", task.title, task.description)
        };
        let message = Message::text(Role::User, message_id.clone(), text);
        let params = json!({"message": message, "configuration": {"returnImmediately": true}});
        let result = self
            .retrying(ctx, "SendMessage", || {
                self.call(&endpoint, methods::SEND_MESSAGE, params.clone())
            })
            .await?;
        let remote = match serde_json::from_value::<StreamResponse>(result.clone()) {
            Ok(StreamResponse::Task(remote)) => remote,
            Ok(StreamResponse::Message(answer)) => {
                return Ok(Err(TaskOutcome::Done(answer.to_text())));
            }
            _ => {
                return Err(TaskError::GiveUp(format!(
                    "the remote A2A agent {} answered SendMessage with neither a task nor a message: {}",
                    self.remote.id,
                    clip(&result.to_string())
                )));
            }
        };
        let sent = Sent {
            message_id,
            endpoint,
            remote_task: remote.id.clone(),
        };
        let now = ctx.org.behaviour_context().clock().now();
        let draft = records
            .draft(key, &sent, "a2a")
            .map_err(|e| TaskError::Retry(e.to_string()))?
            .expect(Expect::Absent)
            .at(now);
        match records.write(draft).await {
            Ok(WriteOutcome::Written(_) | WriteOutcome::AlreadyApplied(_)) => Ok(Ok(sent)),
            // Another attempt stored its remote task first: follow that one.
            Ok(WriteOutcome::Conflict { current: Some(r) }) => Ok(Ok(r.value)),
            Ok(WriteOutcome::Conflict { current: None }) => Ok(Ok(sent)),
            Err(e) => Err(TaskError::Retry(format!(
                "the remote task's id was not stored: {e}"
            ))),
        }
    }
}

#[async_trait]
impl TaskExecutor for RemoteExecutor {
    async fn execute(
        &self,
        ctx: TaskContext,
        task: SpacebotTask,
    ) -> Result<TaskOutcome, TaskError> {
        let records: Records<Sent> =
            Records::new(ctx.org.stores().records.clone(), REMOTE_NAMESPACE)
                .map_err(|e| TaskError::Retry(e.to_string()))?;
        let key = format!("{}#{}", task.agent, task.number);
        let stored = records
            .get(&key)
            .await
            .map_err(|e| TaskError::Retry(e.to_string()))?;
        let sent = match stored {
            Some(record) => {
                tracing::info!(agent = %self.remote.id, task = %ctx.task, remote_task = %record.value.remote_task, "resuming a task sent to a remote A2A agent");
                record.value
            }
            None => match self.send(&ctx, &records, &key, &task).await? {
                Ok(sent) => sent,
                Err(done) => return Ok(done),
            },
        };
        let mut renewed = Instant::now();
        loop {
            let result = self
                .retrying(&ctx, "GetTask", || {
                    self.call(
                        &sent.endpoint,
                        methods::GET_TASK,
                        json!({"id": sent.remote_task}),
                    )
                })
                .await?;
            let remote: Task = serde_json::from_value(result.clone()).map_err(|e| {
                TaskError::GiveUp(format!(
                    "the remote A2A agent {} answered GetTask with what is not a task ({e}): {}",
                    self.remote.id,
                    clip(&result.to_string())
                ))
            })?;
            if let Some(outcome) = self.outcome(&remote) {
                return outcome;
            }
            if renewed.elapsed() > Duration::from_secs(60) {
                ctx.renew()
                    .await
                    .map_err(|e| TaskError::Retry(format!("the claim is over: {e}")))?;
                renewed = Instant::now();
            }
            tokio::time::sleep(self.retry.poll).await;
        }
    }
}
