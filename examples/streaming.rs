//! Streaming: a reply appearing token by token.
//!
//! The application's outbound asks for deltas (`StreamingOutbound`), so the runtime calls the
//! model with streaming and forwards the text as it is generated, then sends the complete reply.
//! Tool rounds and steering work as usual; only the final answer streams.
//!
//! ```text
//! cargo run --example streaming
//! ```
//!
//! Offline by default: a small mock model that streams its answer a few characters at a time, with
//! a short pause between pieces. With `--features openai` and `OPENAI_API_KEY` (or `OPENAI_BASE_URL` and the `SPACEBOT_*`
//! variables of docs/providers.md) set, it streams from the real model instead.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use spacebot::llm::{ChatResponse, StreamEvent};
use spacebot::runtime::{OutboundItem, StreamingOutbound};
use spacebot::{
    ChatRequest, InboundMessage, LlmError, LlmProvider, OrgConfig, Organization, Stores,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const ANSWER: &str = "Spacebot streams this answer to you a few characters at a time, \
                      the way a real model generates it.";

/// A mock model that streams a fixed answer in small pieces.
#[derive(Debug)]
struct Typist;

#[async_trait]
impl LlmProvider for Typist {
    async fn complete(&self, _request: ChatRequest) -> Result<ChatResponse, LlmError> {
        Ok(ChatResponse::text(ANSWER))
    }

    async fn stream(
        &self,
        _request: ChatRequest,
    ) -> Result<BoxStream<'static, Result<StreamEvent, LlmError>>, LlmError> {
        let pieces: Vec<String> = ANSWER
            .chars()
            .collect::<Vec<_>>()
            .chunks(4)
            .map(|c| c.iter().collect())
            .collect();
        let deltas = futures::stream::iter(pieces).then(|text| async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            Ok(StreamEvent::TextDelta { text })
        });
        let done =
            futures::stream::once(async { Ok(StreamEvent::Done(ChatResponse::text(ANSWER))) });
        Ok(Box::pin(deltas.chain(done)))
    }
}

#[cfg(feature = "openai")]
fn provider() -> Result<Arc<dyn LlmProvider>, BoxError> {
    if std::env::var_os("OPENAI_API_KEY").is_some() || std::env::var_os("OPENAI_BASE_URL").is_some()
    {
        let config = spacebot::openai::OpenAiConfig::from_env()?;
        let provider =
            spacebot::openai::OpenAiProvider::new(config, Arc::new(spacebot::rt::TokioClock))?;
        return Ok(Arc::new(provider));
    }
    Ok(Arc::new(Typist))
}

#[cfg(not(feature = "openai"))]
fn provider() -> Result<Arc<dyn LlmProvider>, BoxError> {
    Ok(Arc::new(Typist))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let config = OrgConfig::from_toml_str("[[agents]]\nid = \"guide\"\nname = \"Guide\"\n")?;
    let (outbound, mut items) = StreamingOutbound::new();
    let org = Organization::builder(config)
        .stores(Stores::memory())
        .llm(provider()?)
        .outbound(Arc::new(outbound))
        .build()
        .await?;
    org.start_all().await?;
    println!("user: How do you answer?");
    org.deliver(
        "guide",
        InboundMessage::new("portal", "user-1", "How do you answer?"),
    )
    .await?;
    print!("guide: ");
    loop {
        let item = tokio::time::timeout(Duration::from_secs(60), items.next())
            .await
            .map_err(|_| "no answer within 60 s")?
            .ok_or("the reply stream closed")?;
        match item {
            OutboundItem::Delta(delta) if delta.discard => print!(" [discarded]"),
            OutboundItem::Delta(delta) => print!("{}", delta.text),
            OutboundItem::Reply(reply) if reply.is_failure() => {
                println!();
                return Err(reply.content.into());
            }
            OutboundItem::Reply(reply) => {
                println!(
                    "\n(complete reply: {} characters)",
                    reply.content.chars().count()
                );
                break;
            }
            _ => {}
        }
        std::io::stdout().flush()?;
    }
    org.shutdown().await?;
    Ok(())
}
