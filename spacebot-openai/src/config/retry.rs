//! When and how long to wait before trying a request again.

use std::time::Duration;

use super::ConfigError;

/// When and how long to wait before trying a request again.
///
/// Retries happen on HTTP 429, HTTP 5xx, timeouts and connection failures (see
/// [`LlmError::is_retryable`](spacebot_core::LlmError::is_retryable)); never on other 4xx. The wait
/// before retry `n` (from 0) is `min(base_backoff * 2^n, max_backoff)`, shortened by a random part of
/// up to `jitter` of itself, unless the server said how long to wait (`Retry-After`), in which case
/// that is the wait. Every wait goes through the provider's [`Clock`](spacebot_core::Clock).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Retries after the first attempt (0: no retry).
    pub max_retries: u32,
    /// The wait before the first retry.
    pub base_backoff: Duration,
    /// The longest computed wait.
    pub max_backoff: Duration,
    /// The fraction (0.0 to 1.0) of each computed wait that is randomised away ("jitter"), so
    /// clients that failed together do not retry together. 0.0 makes waits exact.
    pub jitter: f64,
    /// The longest `Retry-After` honoured: a server asking for a longer wait gets its
    /// [`LlmError::RateLimited`](spacebot_core::LlmError::RateLimited) back at once, with the wait
    /// it asked for, so the caller decides.
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 3,
            base_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(20),
            jitter: 0.25,
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// A policy that never retries.
    pub fn none() -> Self {
        Self {
            max_retries: 0,
            ..Self::default()
        }
    }

    /// This policy with `max_retries` retries.
    pub fn with_max_retries(mut self, max_retries: u32) -> Self {
        self.max_retries = max_retries;
        self
    }

    /// This policy with the given base and maximum backoff.
    pub fn with_backoff(mut self, base: Duration, max: Duration) -> Self {
        self.base_backoff = base;
        self.max_backoff = max;
        self
    }

    /// This policy with the given jitter fraction (0.0 to 1.0).
    pub fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// This policy honouring `Retry-After` up to `max`.
    pub fn with_max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// The computed wait before retry `retry` (0 for the first retry), before jitter.
    pub fn backoff(&self, retry: u32) -> Duration {
        let factor = 1u32.checked_shl(retry.min(31)).unwrap_or(u32::MAX);
        self.base_backoff
            .checked_mul(factor)
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff)
    }

    /// The wait before retry `retry` with jitter applied, using `random` (uniform in `[0, 1)`).
    pub fn jittered_backoff(&self, retry: u32, random: f64) -> Duration {
        let wait = self.backoff(retry);
        let cut = self.jitter.clamp(0.0, 1.0) * random.clamp(0.0, 1.0);
        wait.mul_f64(1.0 - cut)
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(ConfigError::invalid(
                "retry.jitter",
                format!("must be between 0.0 and 1.0, got {}", self.jitter),
            ));
        }
        if self.base_backoff > self.max_backoff {
            return Err(ConfigError::invalid(
                "retry.base_backoff",
                format!(
                    "{:?} is longer than retry.max_backoff {:?}",
                    self.base_backoff, self.max_backoff
                ),
            ));
        }
        Ok(())
    }
}
