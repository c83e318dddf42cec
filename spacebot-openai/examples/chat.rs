//! Sends one chat request and streams the answer to stdout.
//!
//! ```text
//! OPENAI_API_KEY=sk-... cargo run -p spacebot-openai --example chat -- "Why is the sky blue?"
//! # a local server (llama.cpp, llama-cpp-python, Ollama, vLLM): no key needed
//! OPENAI_BASE_URL=http://127.0.0.1:8080/v1 SPACEBOT_MODEL=qwen2.5-7b-instruct \
//!     SPACEBOT_DIALECT=llama_cpp cargo run -p spacebot-openai --example chat
//! ```
//!
//! Every setting comes from the environment through `OpenAiConfig::from_env` (see
//! `docs/providers.md` for the variables); a bad value stops it with the variable named.
//! Without `OPENAI_API_KEY` or `OPENAI_BASE_URL` it says so and exits.

use std::io::Write;
use std::sync::Arc;

use futures::StreamExt;
use spacebot_core::llm::StreamEvent;
use spacebot_core::rt::TokioClock;
use spacebot_core::{ChatMessage, ChatRequest, LlmProvider};
use spacebot_openai::{OpenAiConfig, OpenAiProvider};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("OPENAI_API_KEY").is_none() && std::env::var_os("OPENAI_BASE_URL").is_none()
    {
        eprintln!(
            "set OPENAI_API_KEY (OpenAI) or OPENAI_BASE_URL (a local server) to run this example"
        );
        return Ok(());
    }
    let provider = OpenAiProvider::new(OpenAiConfig::from_env()?, Arc::new(TokioClock))?;
    let question = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "Say hello in five words.".to_owned());
    let request = ChatRequest {
        messages: vec![
            ChatMessage::system("You answer briefly."),
            ChatMessage::user(question),
        ],
        ..ChatRequest::default()
    };

    let mut stream = provider.stream(request).await?;
    let mut stdout = std::io::stdout();
    while let Some(event) = stream.next().await {
        match event? {
            StreamEvent::TextDelta { text } => {
                write!(stdout, "{text}")?;
                stdout.flush()?;
            }
            StreamEvent::Done(response) => {
                writeln!(stdout)?;
                if let Some(usage) = response.usage {
                    eprintln!(
                        "[{} prompt + {} completion tokens]",
                        usage.prompt_tokens, usage.completion_tokens
                    );
                }
            }
            _ => {}
        }
    }
    Ok(())
}
