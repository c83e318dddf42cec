//! [`ScriptedLlm`]: per-agent FIFO scripts of answers.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::{Recorder, lock};
use crate::error::LlmError;
use crate::ids::AgentId;
use crate::llm::{ChatRequest, ChatResponse, LlmProvider, ToolCall};

type Fallback = dyn Fn(&ChatRequest) -> Result<ChatResponse, LlmError> + Send + Sync;

#[derive(Default)]
struct Scripts {
    /// `None` is the default script, used by requests without an agent.
    queues: HashMap<Option<AgentId>, VecDeque<Result<ChatResponse, LlmError>>>,
    next_call: u64,
}

impl Scripts {
    fn push(&mut self, agent: Option<AgentId>, entry: Result<ChatResponse, LlmError>) {
        self.queues.entry(agent).or_default().push_back(entry);
    }

    fn call(&mut self, name: String, args: &serde_json::Value) -> ToolCall {
        self.next_call += 1;
        ToolCall {
            id: format!("call_{}", self.next_call),
            name,
            arguments: args.to_string(),
        }
    }
}

/// A provider that answers from per-agent scripts, first in, first out.
///
/// [`ChatRequest::agent`] selects the script; a request without an agent uses the default script
/// (filled by [`push_default`](Self::push_default)). When the selected script is empty the
/// provider returns [`LlmError::Other`] naming the agent, unless a fallback was set with
/// [`with_fallback`](Self::with_fallback). Clones share scripts and the request log.
///
/// Tool calls pushed with [`push_tool_call`](Self::push_tool_call) and
/// [`push_tool_calls`](Self::push_tool_calls) get the ids `call_1`, `call_2`, ... in push order.
///
/// ```
/// # futures::executor::block_on(async {
/// use spacebot_core::testing::ScriptedLlm;
/// use spacebot_core::{AgentId, ChatRequest, LlmProvider};
///
/// let a = AgentId::parse("a").unwrap();
/// let llm = ScriptedLlm::new();
/// llm.push_tool_call(&a, "send_agent_message", serde_json::json!({"target": "b", "message": "hi"}));
/// llm.push_text(&a, "done");
///
/// let request = ChatRequest { agent: Some(a.clone()), ..Default::default() };
/// let first = llm.complete(request.clone()).await.unwrap();
/// assert_eq!(first.tool_calls[0].id, "call_1");
/// assert_eq!(llm.complete(request.clone()).await.unwrap().content.as_deref(), Some("done"));
/// // The script is spent: the next request is an error naming the agent.
/// assert!(llm.complete(request).await.unwrap_err().to_string().contains("\"a\""));
/// assert_eq!(llm.requests_for(&a).len(), 3);
/// # });
/// ```
#[derive(Clone, Default)]
pub struct ScriptedLlm {
    scripts: Arc<Mutex<Scripts>>,
    fallback: Option<Arc<Fallback>>,
    recorder: Recorder,
}

impl fmt::Debug for ScriptedLlm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scripts = lock(&self.scripts);
        let mut remaining: Vec<(String, usize)> = scripts
            .queues
            .iter()
            .map(|(agent, q)| {
                let name = agent.as_ref().map_or("<default>", AgentId::as_str);
                (name.to_owned(), q.len())
            })
            .collect();
        remaining.sort();
        f.debug_struct("ScriptedLlm")
            .field("remaining", &remaining)
            .field("fallback", &self.fallback.is_some())
            .finish_non_exhaustive()
    }
}

impl ScriptedLlm {
    /// A provider with empty scripts and no fallback.
    pub fn new() -> Self {
        Self::default()
    }

    /// Answers with `fallback(request)` whenever the selected script is empty, instead of an error.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use spacebot_core::testing::ScriptedLlm;
    /// use spacebot_core::{ChatRequest, ChatResponse, LlmProvider};
    /// let llm = ScriptedLlm::new().with_fallback(|_| Ok(ChatResponse::text("ok")));
    /// let answer = llm.complete(ChatRequest::default()).await.unwrap();
    /// assert_eq!(answer.content.as_deref(), Some("ok"));
    /// # });
    /// ```
    pub fn with_fallback<F>(mut self, fallback: F) -> Self
    where
        F: Fn(&ChatRequest) -> Result<ChatResponse, LlmError> + Send + Sync + 'static,
    {
        self.fallback = Some(Arc::new(fallback));
        self
    }

    /// Appends `response` to `agent`'s script.
    pub fn push(&self, agent: &AgentId, response: ChatResponse) {
        lock(&self.scripts).push(Some(agent.clone()), Ok(response));
    }

    /// Appends a text answer to `agent`'s script.
    pub fn push_text(&self, agent: &AgentId, text: &str) {
        self.push(agent, ChatResponse::text(text));
    }

    /// Appends an answer calling tool `name` with JSON arguments `args` (call id `call_{n}`).
    pub fn push_tool_call(
        &self,
        agent: &AgentId,
        name: impl Into<String>,
        args: serde_json::Value,
    ) {
        let mut scripts = lock(&self.scripts);
        let call = scripts.call(name.into(), &args);
        scripts.push(
            Some(agent.clone()),
            Ok(ChatResponse::tool_calls(vec![call])),
        );
    }

    /// Appends one answer calling several tools, in order (call ids `call_{n}`, `call_{n+1}`, ...).
    pub fn push_tool_calls<N: Into<String>>(
        &self,
        agent: &AgentId,
        calls: impl IntoIterator<Item = (N, serde_json::Value)>,
    ) {
        let mut scripts = lock(&self.scripts);
        let calls = calls
            .into_iter()
            .map(|(name, args)| scripts.call(name.into(), &args))
            .collect();
        scripts.push(Some(agent.clone()), Ok(ChatResponse::tool_calls(calls)));
    }

    /// Appends an error to `agent`'s script.
    pub fn push_error(&self, agent: &AgentId, error: LlmError) {
        lock(&self.scripts).push(Some(agent.clone()), Err(error));
    }

    /// Appends `response` to the default script (requests without an agent).
    pub fn push_default(&self, response: ChatResponse) {
        lock(&self.scripts).push(None, Ok(response));
    }

    /// Appends an error to the default script.
    pub fn push_default_error(&self, error: LlmError) {
        lock(&self.scripts).push(None, Err(error));
    }

    /// How many scripted answers `agent` has left.
    pub fn remaining(&self, agent: &AgentId) -> usize {
        lock(&self.scripts)
            .queues
            .get(&Some(agent.clone()))
            .map_or(0, VecDeque::len)
    }

    /// How many scripted answers the default script has left.
    pub fn remaining_default(&self) -> usize {
        lock(&self.scripts)
            .queues
            .get(&None)
            .map_or(0, VecDeque::len)
    }

    /// Every request received, in arrival order.
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.recorder.all()
    }

    /// The requests received for `agent`, in arrival order.
    pub fn requests_for(&self, agent: &AgentId) -> Vec<ChatRequest> {
        self.recorder.for_agent(agent)
    }

    fn answer(&self, request: &ChatRequest) -> Result<ChatResponse, LlmError> {
        self.recorder.record(request);
        let next = lock(&self.scripts)
            .queues
            .get_mut(&request.agent)
            .and_then(VecDeque::pop_front);
        match (next, &self.fallback) {
            (Some(entry), _) => entry,
            (None, Some(fallback)) => fallback(request),
            (None, None) => Err(LlmError::Other(match &request.agent {
                Some(agent) => format!("the script of agent \"{agent}\" is empty"),
                None => "the default script (requests without an agent) is empty".to_owned(),
            })),
        }
    }
}

#[async_trait]
impl LlmProvider for ScriptedLlm {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        self.answer(&request)
    }
}

#[cfg(test)]
mod tests {
    use futures::executor::block_on;
    use serde_json::json;

    use super::*;
    use crate::llm::ChatMessage;

    fn id(s: &str) -> AgentId {
        AgentId::parse(s).unwrap()
    }

    fn req(agent: Option<&AgentId>, text: &str) -> ChatRequest {
        ChatRequest {
            agent: agent.cloned(),
            messages: vec![ChatMessage::user(text)],
            ..Default::default()
        }
    }

    #[test]
    fn scripts_are_per_agent_and_fifo() {
        let (a, b) = (id("a"), id("b"));
        let llm = ScriptedLlm::new();
        llm.push_text(&a, "a1");
        llm.push_text(&b, "b1");
        llm.push_text(&a, "a2");
        assert_eq!((llm.remaining(&a), llm.remaining(&b)), (2, 1));
        let text = |r: Result<ChatResponse, LlmError>| r.unwrap().content.unwrap();
        assert_eq!(text(block_on(llm.complete(req(Some(&b), "x")))), "b1");
        assert_eq!(text(block_on(llm.complete(req(Some(&a), "y")))), "a1");
        assert_eq!(text(block_on(llm.complete(req(Some(&a), "z")))), "a2");
        assert_eq!(llm.remaining(&a), 0);
        let err = block_on(llm.complete(req(Some(&a), "w"))).unwrap_err();
        assert!(
            matches!(&err, LlmError::Other(m) if m.contains("\"a\"")),
            "{err}"
        );
    }

    #[test]
    fn requests_are_recorded_in_arrival_order() {
        let (a, b) = (id("a"), id("b"));
        let llm = ScriptedLlm::new().with_fallback(|_| Ok(ChatResponse::text("f")));
        for (agent, text) in [(&a, "1"), (&b, "2"), (&a, "3")] {
            block_on(llm.complete(req(Some(agent), text))).unwrap();
        }
        block_on(llm.complete(req(None, "4"))).unwrap();
        let firsts = |v: Vec<ChatRequest>| -> Vec<ChatMessage> {
            v.into_iter().map(|r| r.messages[0].clone()).collect()
        };
        assert_eq!(
            firsts(llm.requests()),
            ["1", "2", "3", "4"].map(ChatMessage::user).to_vec()
        );
        assert_eq!(
            firsts(llm.requests_for(&a)),
            ["1", "3"].map(ChatMessage::user).to_vec()
        );
        assert_eq!(
            firsts(llm.requests_for(&b)),
            [ChatMessage::user("2")].to_vec()
        );
    }

    #[test]
    fn tool_call_ids_follow_push_order() {
        let (a, b) = (id("a"), id("b"));
        let llm = ScriptedLlm::new();
        llm.push_tool_call(&a, "t1", json!({"x": 1}));
        llm.push_tool_calls(&b, vec![("t2", json!({})), ("t3", json!([1]))]);
        let ra = block_on(llm.complete(req(Some(&a), ""))).unwrap();
        let rb = block_on(llm.complete(req(Some(&b), ""))).unwrap();
        let ids: Vec<_> = ra
            .tool_calls
            .iter()
            .chain(&rb.tool_calls)
            .map(|c| (c.id.clone(), c.name.clone(), c.arguments.clone()))
            .collect();
        assert_eq!(
            ids,
            vec![
                ("call_1".into(), "t1".into(), r#"{"x":1}"#.into()),
                ("call_2".into(), "t2".into(), "{}".into()),
                ("call_3".into(), "t3".into(), "[1]".into()),
            ]
        );
    }

    #[test]
    fn errors_and_the_default_script() {
        let a = id("a");
        let llm = ScriptedLlm::new();
        llm.push_error(&a, LlmError::Timeout(std::time::Duration::from_secs(1)));
        llm.push_default(ChatResponse::text("anon"));
        llm.push_default_error(LlmError::Other("boom".into()));
        assert!(matches!(
            block_on(llm.complete(req(Some(&a), ""))),
            Err(LlmError::Timeout(_))
        ));
        assert_eq!(llm.remaining_default(), 2);
        let anon = block_on(llm.complete(req(None, ""))).unwrap();
        assert_eq!(anon.content.as_deref(), Some("anon"));
        assert!(
            matches!(block_on(llm.complete(req(None, ""))), Err(LlmError::Other(m)) if m == "boom")
        );
        let spent = block_on(llm.complete(req(None, ""))).unwrap_err();
        assert!(spent.to_string().contains("default script"), "{spent}");
    }

    #[test]
    fn fallback_sees_the_request_and_clones_share_state() {
        let a = id("a");
        let llm = ScriptedLlm::new()
            .with_fallback(|r| Ok(ChatResponse::text(format!("{} messages", r.messages.len()))));
        let clone = llm.clone();
        clone.push_text(&a, "scripted");
        assert_eq!(llm.remaining(&a), 1);
        let first = block_on(llm.complete(req(Some(&a), ""))).unwrap();
        let second = block_on(llm.complete(req(Some(&a), ""))).unwrap();
        assert_eq!(first.content.as_deref(), Some("scripted"));
        assert_eq!(second.content.as_deref(), Some("1 messages"));
        assert_eq!(clone.requests().len(), 2);
        assert!(format!("{llm:?}").contains("fallback: true"));
    }
}
