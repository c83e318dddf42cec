//! [`MockLlm::pair`]: a provider whose every call the test answers by hand.

use async_trait::async_trait;
use futures::StreamExt;
use futures::channel::{mpsc, oneshot};

use super::Recorder;
use crate::error::LlmError;
use crate::ids::AgentId;
use crate::llm::{ChatRequest, ChatResponse, LlmProvider, ToolCall};

/// A provider whose `complete` waits until the test answers through the paired
/// [`MockLlmHandle`]. Clones share the handle.
///
/// ```
/// # futures::executor::block_on(async {
/// use futures::future::join;
/// use spacebot_core::testing::MockLlm;
/// use spacebot_core::{ChatRequest, ChatResponse, LlmProvider};
///
/// let (llm, mut handle) = MockLlm::pair();
/// let call = llm.complete(ChatRequest::default());
/// let answer = async {
///     let pending = handle.next().await.unwrap();
///     assert!(pending.request.messages.is_empty());
///     pending.respond(ChatResponse::text("hello"));
/// };
/// let (response, ()) = join(call, answer).await;
/// assert_eq!(response.unwrap().content.as_deref(), Some("hello"));
/// drop(llm);
/// assert!(handle.next().await.is_none());
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct MockLlm {
    calls: mpsc::UnboundedSender<PendingCall>,
    recorder: Recorder,
}

/// The test's side of a [`MockLlm`]: receives each call, in arrival order.
#[derive(Debug)]
pub struct MockLlmHandle {
    calls: mpsc::UnboundedReceiver<PendingCall>,
    recorder: Recorder,
}

/// One call waiting for the test's answer. Dropping it unanswered makes the provider return
/// [`LlmError::Other`].
#[derive(Debug)]
pub struct PendingCall {
    /// The request the provider received.
    pub request: ChatRequest,
    reply: oneshot::Sender<Result<ChatResponse, LlmError>>,
}

impl MockLlm {
    /// A provider and the handle that answers its calls.
    pub fn pair() -> (MockLlm, MockLlmHandle) {
        let (tx, rx) = mpsc::unbounded();
        let recorder = Recorder::default();
        (
            MockLlm {
                calls: tx,
                recorder: recorder.clone(),
            },
            MockLlmHandle {
                calls: rx,
                recorder,
            },
        )
    }

    /// Every request received, in arrival order.
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.recorder.all()
    }

    /// The requests received for `agent`, in arrival order.
    pub fn requests_for(&self, agent: &AgentId) -> Vec<ChatRequest> {
        self.recorder.for_agent(agent)
    }
}

impl MockLlmHandle {
    /// The next call, waiting for one to arrive; `None` once every provider clone is dropped and
    /// every call has been taken.
    pub async fn next(&mut self) -> Option<PendingCall> {
        self.calls.next().await
    }

    /// The next call if one is waiting now; `None` otherwise (and once every provider clone is
    /// dropped).
    pub fn try_next(&mut self) -> Option<PendingCall> {
        self.calls.try_recv().ok()
    }

    /// Every request received, in arrival order (answered or not).
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.recorder.all()
    }

    /// The requests received for `agent`, in arrival order.
    pub fn requests_for(&self, agent: &AgentId) -> Vec<ChatRequest> {
        self.recorder.for_agent(agent)
    }
}

impl PendingCall {
    /// The agent the request is for, if it names one.
    pub fn agent(&self) -> Option<&AgentId> {
        self.request.agent.as_ref()
    }

    /// Answers the call.
    pub fn respond(self, response: ChatResponse) {
        // The provider's caller may have given up (its future dropped); nothing waits then.
        let _ = self.reply.send(Ok(response));
    }

    /// Answers the call with a text response.
    pub fn respond_text(self, text: impl Into<String>) {
        self.respond(ChatResponse::text(text));
    }

    /// Answers the call with tool calls.
    pub fn respond_tool_calls(self, calls: Vec<ToolCall>) {
        self.respond(ChatResponse::tool_calls(calls));
    }

    /// Fails the call with `error`.
    pub fn fail(self, error: LlmError) {
        let _ = self.reply.send(Err(error));
    }
}

#[async_trait]
impl LlmProvider for MockLlm {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        self.recorder.record(&request);
        let (reply, answer) = oneshot::channel();
        self.calls
            .unbounded_send(PendingCall { request, reply })
            .map_err(|_| LlmError::Other("the mock LLM handle was dropped".to_owned()))?;
        answer.await.unwrap_or_else(|_| {
            Err(LlmError::Other(
                "the mock LLM call was dropped without an answer".to_owned(),
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;
    use futures::executor::block_on;
    use futures::future::join;

    use super::*;
    use crate::testing::tool_call_with_id;

    fn for_agent(name: &str) -> ChatRequest {
        ChatRequest {
            agent: Some(AgentId::parse(name).unwrap()),
            ..Default::default()
        }
    }

    #[test]
    fn calls_wait_for_the_test_and_arrive_in_order() {
        let (llm, mut handle) = MockLlm::pair();
        assert!(handle.try_next().is_none());
        let mut first = llm.complete(for_agent("a"));
        let mut second = llm.complete(for_agent("b"));
        assert!((&mut first).now_or_never().is_none());
        assert!((&mut second).now_or_never().is_none());

        let p1 = handle.try_next().unwrap();
        let p2 = handle.try_next().unwrap();
        assert!(handle.try_next().is_none());
        assert_eq!(p1.agent().map(AgentId::as_str), Some("a"));
        assert_eq!(p2.agent().map(AgentId::as_str), Some("b"));

        p2.respond_tool_calls(vec![tool_call_with_id("c1", "t", serde_json::json!({}))]);
        assert!(
            (&mut first).now_or_never().is_none(),
            "answered the wrong call"
        );
        let second = second.now_or_never().unwrap().unwrap();
        assert_eq!(second.tool_calls[0].id, "c1");
        p1.fail(LlmError::Other("nope".into()));
        assert!(matches!(first.now_or_never().unwrap(), Err(LlmError::Other(m)) if m == "nope"));
        let a = AgentId::parse("a").unwrap();
        assert_eq!(handle.requests().len(), 2);
        assert_eq!(llm.requests_for(&a).len(), 1);
    }

    #[test]
    fn a_dropped_pending_call_is_an_error() {
        let (llm, mut handle) = MockLlm::pair();
        let (result, ()) = block_on(join(llm.complete(for_agent("a")), async {
            drop(handle.next().await.unwrap());
        }));
        let err = result.unwrap_err();
        assert!(err.to_string().contains("without an answer"), "{err}");
    }

    #[test]
    fn next_ends_when_every_provider_clone_is_dropped() {
        let (llm, mut handle) = MockLlm::pair();
        let clone = llm.clone();
        drop(llm);
        assert!(
            handle.next().now_or_never().is_none(),
            "ended while a clone lives"
        );
        drop(clone);
        assert!(block_on(handle.next()).is_none());
        assert!(handle.try_next().is_none());
    }

    #[test]
    fn a_dropped_handle_fails_calls_at_once() {
        let (llm, handle) = MockLlm::pair();
        drop(handle);
        let err = block_on(llm.complete(ChatRequest::default())).unwrap_err();
        assert!(err.to_string().contains("handle was dropped"), "{err}");
        block_on(async {
            let (llm, mut handle) = MockLlm::pair();
            let (r, ()) = join(llm.complete(ChatRequest::default()), async {
                handle.next().await.unwrap().respond_text("hi");
            })
            .await;
            assert_eq!(r.unwrap().content.as_deref(), Some("hi"));
        });
    }
}
