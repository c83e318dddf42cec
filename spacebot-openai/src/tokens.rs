//! Token counting with OpenAI's own tokenizers ([`TiktokenCounter`], feature `tiktoken`, on by
//! default): what the runtime chooses a turn's history with (see `spacebot_core::context`).

use std::fmt;
use std::sync::Arc;

use spacebot_core::context::TokenCounter;

/// Counts tokens as OpenAI's models do, with the tokenizer the model uses (`o200k_base` for
/// `gpt-4o`, `gpt-4.1`, `o1`...; `cl100k_base` for `gpt-4`, `gpt-3.5-turbo`...), from
/// [tiktoken-rs](https://docs.rs/tiktoken-rs). The provider offers it for models the crate knows
/// by name; for others (a model served by llama.cpp, say) it offers none and the runtime
/// estimates.
///
/// ```
/// use spacebot_core::context::TokenCounter;
/// use spacebot_openai::TiktokenCounter;
/// let counter = TiktokenCounter::for_model("gpt-4o-mini").expect("a known model");
/// assert_eq!(counter.count_text("hello world"), 2);
/// assert!(TiktokenCounter::for_model("smollm2-360m-instruct").is_none());
/// ```
#[derive(Clone)]
pub struct TiktokenCounter {
    model: String,
    bpe: &'static tiktoken_rs::CoreBPE,
}

impl TiktokenCounter {
    /// The counter of `model`'s tokenizer, or `None` when tiktoken-rs does not know the model.
    pub fn for_model(model: &str) -> Option<Self> {
        tiktoken_rs::tokenizer::get_tokenizer(model)?;
        let bpe = tiktoken_rs::bpe_for_model(model).ok()?;
        Some(Self {
            model: model.to_owned(),
            bpe,
        })
    }

    /// The counter as the runtime takes it.
    pub(crate) fn shared(model: &str) -> Option<Arc<dyn TokenCounter>> {
        Self::for_model(model).map(|c| Arc::new(c) as Arc<dyn TokenCounter>)
    }
}

impl fmt::Debug for TiktokenCounter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TiktokenCounter")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl TokenCounter for TiktokenCounter {
    fn count_text(&self, text: &str) -> u64 {
        self.bpe.encode_ordinary(text).len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spacebot_core::context::EstimateCounter;

    #[test]
    fn counts_as_the_models_tokenizer_does() {
        let counter = TiktokenCounter::for_model("gpt-4o").unwrap();
        // o200k_base: "Hello, world!" is 4 tokens (Hello / , / world / !).
        assert_eq!(counter.count_text("Hello, world!"), 4);
        let old = TiktokenCounter::for_model("gpt-3.5-turbo").unwrap();
        assert_eq!(old.count_text("Hello, world!"), 4);
        assert_eq!(counter.count_text(""), 0);
    }

    #[test]
    fn the_estimate_stays_above_the_tokenizer_on_prose() {
        let counter = TiktokenCounter::for_model("gpt-4o-mini").unwrap();
        let text = "The launch plan has three parts: the press kit, the partner emails, and \
                    the community post. Each part has an owner and a date."
            .repeat(20);
        let exact = counter.count_text(&text);
        let estimate = EstimateCounter.count_text(&text);
        assert!(exact > 0 && estimate > exact, "{estimate} > {exact}");
    }

    #[test]
    fn unknown_models_have_no_counter() {
        assert!(TiktokenCounter::for_model("smollm2").is_none());
        assert!(TiktokenCounter::for_model("").is_none());
    }
}
