#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

mod config;
mod error;
mod provider;
mod stream;
#[cfg(feature = "tiktoken")]
mod tokens;
mod wire;

pub use config::{
    ApiKey, ConfigError, DEFAULT_BASE_URL, DEFAULT_MODEL, Dialect, MaxTokensField, OpenAiConfig,
    RetryPolicy, ToolChoicePolicy,
};
pub use provider::OpenAiProvider;
pub use stream::StreamAssembler;
#[cfg(feature = "tiktoken")]
pub use tokens::TiktokenCounter;
