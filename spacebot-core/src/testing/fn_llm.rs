//! [`FnLlm`]: a provider that is a closure.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use super::Recorder;
use crate::error::LlmError;
use crate::ids::AgentId;
use crate::llm::{ChatRequest, ChatResponse, LlmProvider};

type Answer = dyn Fn(&ChatRequest) -> Result<ChatResponse, LlmError> + Send + Sync;

/// A provider whose answer is `f(&request)`: for adversarial property tests (a model that always
/// replies, never concludes, re-delegates, writes malformed arguments...). Clones share the
/// closure and the request log.
///
/// ```
/// # futures::executor::block_on(async {
/// use spacebot_core::testing::FnLlm;
/// use spacebot_core::{ChatRequest, ChatResponse, LlmProvider};
/// let echo = FnLlm::new(|req: &ChatRequest| {
///     Ok(ChatResponse::text(format!("{} messages", req.messages.len())))
/// });
/// let answer = echo.complete(ChatRequest::default()).await.unwrap();
/// assert_eq!(answer.content.as_deref(), Some("0 messages"));
/// assert_eq!(echo.requests().len(), 1);
/// # });
/// ```
#[derive(Clone)]
pub struct FnLlm {
    answer: Arc<Answer>,
    recorder: Recorder,
}

impl fmt::Debug for FnLlm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnLlm").finish_non_exhaustive()
    }
}

impl FnLlm {
    /// A provider answering every request with `answer(&request)`.
    pub fn new<F>(answer: F) -> Self
    where
        F: Fn(&ChatRequest) -> Result<ChatResponse, LlmError> + Send + Sync + 'static,
    {
        Self {
            answer: Arc::new(answer),
            recorder: Recorder::default(),
        }
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

#[async_trait]
impl LlmProvider for FnLlm {
    async fn complete(&self, request: ChatRequest) -> Result<ChatResponse, LlmError> {
        self.recorder.record(&request);
        (self.answer)(&request)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::executor::block_on;

    use super::*;

    #[test]
    fn answers_with_the_closure_and_records_per_agent() {
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&calls);
        let llm = FnLlm::new(move |req| {
            let n = counter.fetch_add(1, Ordering::SeqCst);
            match &req.agent {
                Some(agent) => Ok(ChatResponse::text(format!("{agent} {n}"))),
                None => Err(LlmError::Other("no agent".into())),
            }
        });
        let a = AgentId::parse("a").unwrap();
        let with = ChatRequest {
            agent: Some(a.clone()),
            ..Default::default()
        };
        assert_eq!(
            block_on(llm.complete(with.clone()))
                .unwrap()
                .content
                .as_deref(),
            Some("a 0")
        );
        assert!(block_on(llm.complete(ChatRequest::default())).is_err());
        assert_eq!(
            block_on(llm.clone().complete(with))
                .unwrap()
                .content
                .as_deref(),
            Some("a 2")
        );
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        assert_eq!(llm.requests().len(), 3);
        assert_eq!(llm.requests_for(&a).len(), 2);
    }
}
