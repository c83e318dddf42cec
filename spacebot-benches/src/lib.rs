//! The spacebot workspace's benchmarks live in this crate's `benches/` (criterion): run them with
//! `cargo bench -p spacebot-benches` (one with `--bench NAME`). They are a crate of their own so
//! that the facade crate's examples (`cargo run --example delegation`) never build criterion.
//! Nothing here is published; the library holds what several benches share.

use async_trait::async_trait;
use spacebot::error::LlmError;
use spacebot::llm::{ChatRequest, ChatResponse, LlmProvider, Usage};

/// A model that answers "ok" at once, reporting 12 tokens of usage, and keeps nothing (a recording
/// model's copies of every request would be much of what a turn's bench measures).
#[derive(Debug, Clone, Copy, Default)]
pub struct Stub;

#[async_trait]
impl LlmProvider for Stub {
    async fn complete(&self, _req: ChatRequest) -> Result<ChatResponse, LlmError> {
        let mut answer = ChatResponse::text("ok");
        answer.usage = Some(Usage {
            prompt_tokens: 10,
            completion_tokens: 2,
            total_tokens: 12,
        });
        Ok(answer)
    }
}
