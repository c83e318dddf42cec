//! Governance: limits on what one request may spend, binding across its whole tree.
//!
//! A **request** is everything one inbound message causes: the turns answering it, every task
//! delegated from it at any depth, every retrigger and conversation turn it leads to. They all
//! carry the message's id as their [`cause`](crate::Envelope::cause), and the request's spend is
//! kept under that id in a [`RequestLedger`], durably, in [`Stores::records`](crate::Stores).
//!
//! [`Limits`] bound tokens (input, output, total), model calls, tool calls and wall time. They
//! come from `[settings.limits]` (every request) and from the message itself
//! ([`InboundMessage::with_limits`](crate::InboundMessage::with_limits): the tighter of the two
//! binds).
//!
//! **Reservations.** Before each model call the turn reserves the call's worst case (an estimate
//! of the prompt's tokens plus the most the model may answer) and one model call; the call is made
//! only if the request's settled spend, plus every open reservation, plus this one stays within
//! every limit. After the call the reservation is settled with what the provider reported. A
//! reservation and a settlement are each one compare-and-set write of the request's record (on
//! the memory store, a change of its typed cell under one lock), so
//! turns of the same request on several agents (and, on PostgreSQL, in several processes) can never
//! overspend together. A process killed between a reservation and its settlement leaves the
//! reservation counted: the request is charged its worst case, never less than it spent.
//!
//! **When a limit is reached** the model is not called: the turn fails with
//! [`TurnError::LimitReached`](crate::runtime::TurnError::LimitReached) naming the limit and what was
//! spent; a task's turn fails the task (its delegator is told as for any failure), and the user gets
//! one failure reply for the request, however many of its turns were refused
//! ([`RequestLedger::tell_once`]). An `EventKind::LimitReached` event says which limit, where.
//!
//! ```
//! use spacebot_core::limits::{Limits, Spend};
//! let limits = Limits { total_tokens: Some(1_000), model_calls: Some(3), ..Limits::default() };
//! let spent = Spend { total_tokens: 900, model_calls: 1, ..Spend::default() };
//! let call = Spend { total_tokens: 200, model_calls: 1, ..Spend::default() };
//! let over = limits.check(&spent.plus(&call), 0).unwrap_err();
//! assert_eq!(over.to_string(), "total tokens: 1100 would pass the limit of 1000");
//! ```

mod ledger;
mod period;

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::llm::ChatMessage;

pub use ledger::{LedgerEntry, NAMESPACE, Refusal, RequestLedger};
pub use period::{PERIOD_NAMESPACE, PeriodEntry, PeriodLedger};

/// Limits on what one request may spend; `None` is no limit on that measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Prompt (input) tokens.
    pub input_tokens: Option<u64>,
    /// Completion (output) tokens.
    pub output_tokens: Option<u64>,
    /// Tokens in all.
    pub total_tokens: Option<u64>,
    /// Model calls.
    pub model_calls: Option<u64>,
    /// Tool calls.
    pub tool_calls: Option<u64>,
    /// Milliseconds from the request's first turn to the start of a model call (requests only:
    /// a period limit has no wall time).
    pub wall_time_ms: Option<u64>,
    /// Cost, priced by [`Settings::prices`](crate::config::Settings::prices) (`cost = 0.50` in
    /// config: units of the price table's currency).
    pub cost: Option<Money>,
}

impl Limits {
    /// No limit at all.
    pub const NONE: Limits = Limits {
        input_tokens: None,
        output_tokens: None,
        total_tokens: None,
        model_calls: None,
        tool_calls: None,
        wall_time_ms: None,
        cost: None,
    };

    /// Whether no measure is limited.
    pub fn is_none(&self) -> bool {
        *self == Self::NONE
    }

    /// The tighter of two limits, measure by measure.
    pub fn tighter(&self, other: &Limits) -> Limits {
        fn min(a: Option<u64>, b: Option<u64>) -> Option<u64> {
            match (a, b) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        }
        Limits {
            input_tokens: min(self.input_tokens, other.input_tokens),
            output_tokens: min(self.output_tokens, other.output_tokens),
            total_tokens: min(self.total_tokens, other.total_tokens),
            model_calls: min(self.model_calls, other.model_calls),
            tool_calls: min(self.tool_calls, other.tool_calls),
            wall_time_ms: min(self.wall_time_ms, other.wall_time_ms),
            cost: match (self.cost, other.cost) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        }
    }

    /// Checks a spend (settled plus reserved) `elapsed_ms` into the request.
    ///
    /// # Errors
    /// The first limit `spend` passes.
    pub fn check(&self, spend: &Spend, elapsed_ms: u64) -> Result<(), Over> {
        let measures = [
            (Limit::InputTokens, self.input_tokens, spend.input_tokens),
            (Limit::OutputTokens, self.output_tokens, spend.output_tokens),
            (Limit::TotalTokens, self.total_tokens, spend.total_tokens),
            (Limit::ModelCalls, self.model_calls, spend.model_calls),
            (Limit::ToolCalls, self.tool_calls, spend.tool_calls),
            (Limit::WallTime, self.wall_time_ms, elapsed_ms),
            (Limit::Cost, self.cost.map(|c| c.0), spend.cost.0),
        ];
        for (limit, max, value) in measures {
            if let Some(max) = max
                && value > max
            {
                return Err(Over { limit, max, value });
            }
        }
        Ok(())
    }
}

/// What a request spent (or reserved).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Spend {
    /// Prompt (input) tokens.
    pub input_tokens: u64,
    /// Completion (output) tokens.
    pub output_tokens: u64,
    /// Tokens in all.
    pub total_tokens: u64,
    /// Model calls.
    pub model_calls: u64,
    /// Tool calls.
    pub tool_calls: u64,
    /// Cost of the model calls, priced by the price table (zero without one).
    pub cost: Money,
}

impl Spend {
    /// The sum of two spends (saturating).
    pub fn plus(&self, other: &Spend) -> Spend {
        Spend {
            input_tokens: self.input_tokens.saturating_add(other.input_tokens),
            output_tokens: self.output_tokens.saturating_add(other.output_tokens),
            total_tokens: self.total_tokens.saturating_add(other.total_tokens),
            model_calls: self.model_calls.saturating_add(other.model_calls),
            tool_calls: self.tool_calls.saturating_add(other.tool_calls),
            cost: Money(self.cost.0.saturating_add(other.cost.0)),
        }
    }

    /// This spend with its tokens priced by `price` (no price: no cost).
    pub fn priced(mut self, price: Option<&Price>) -> Spend {
        self.cost = price.map_or(Money::ZERO, |p| {
            p.cost(self.input_tokens, self.output_tokens)
        });
        self
    }

    /// One model call that reported `usage`.
    pub fn of_call(usage: crate::llm::Usage) -> Spend {
        let input = u64::from(usage.prompt_tokens);
        let output = u64::from(usage.completion_tokens);
        Spend {
            input_tokens: input,
            output_tokens: output,
            total_tokens: u64::from(usage.total_tokens).max(input + output),
            model_calls: 1,
            tool_calls: 0,
            cost: Money::ZERO,
        }
    }

    /// `n` tool calls.
    pub fn tool_calls(n: u64) -> Spend {
        Spend {
            tool_calls: n,
            ..Spend::default()
        }
    }
}

impl fmt::Display for Spend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} tokens ({} in, {} out), {} model calls, {} tool calls",
            self.total_tokens,
            self.input_tokens,
            self.output_tokens,
            self.model_calls,
            self.tool_calls
        )?;
        if self.cost != Money::ZERO {
            write!(f, ", cost {}", self.cost)?;
        }
        Ok(())
    }
}

/// One limited measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Limit {
    /// [`Limits::input_tokens`].
    InputTokens,
    /// [`Limits::output_tokens`].
    OutputTokens,
    /// [`Limits::total_tokens`].
    TotalTokens,
    /// [`Limits::model_calls`].
    ModelCalls,
    /// [`Limits::tool_calls`].
    ToolCalls,
    /// [`Limits::wall_time_ms`].
    WallTime,
    /// [`Limits::cost`] (in millionths of the currency unit).
    Cost,
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Limit::InputTokens => "input tokens",
            Limit::OutputTokens => "output tokens",
            Limit::TotalTokens => "total tokens",
            Limit::ModelCalls => "model calls",
            Limit::ToolCalls => "tool calls",
            Limit::WallTime => "wall time (ms)",
            Limit::Cost => "cost (millionths)",
        })
    }
}

/// A measure a spend would take past its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{limit}: {value} would pass the limit of {max}")]
pub struct Over {
    /// The measure.
    pub limit: Limit,
    /// Its limit.
    pub max: u64,
    /// What it would reach.
    pub value: u64,
}

/// A limit refused a call: what a refused turn fails with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{scope} reached its limit on {} (limit {}); it spent {spent}", over.limit, over.max)]
pub struct LimitReached {
    /// The limit and what the refused call would have reached.
    pub over: Over,
    /// What the scope had spent (settled) when it was refused.
    pub spent: Spend,
    /// Whose limit: the request's own, or a period's.
    #[serde(default)]
    pub scope: Scope,
}

/// Whose limit a [`LimitReached`] is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
#[non_exhaustive]
pub enum Scope {
    /// The request's ([`Settings::limits`](crate::config::Settings::limits), the message's own).
    #[default]
    Request,
    /// One agent's, over a rolling period.
    Agent {
        /// The agent.
        agent: crate::ids::AgentId,
        /// The period.
        period: Period,
    },
    /// The organization's, over a rolling period.
    Organization {
        /// The period.
        period: Period,
    },
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::Request => f.write_str("the request"),
            Scope::Agent { agent, period } => write!(f, "agent {agent} ({period})"),
            Scope::Organization { period } => write!(f, "the organization ({period})"),
        }
    }
}

/// An amount of money in millionths of the price table's currency unit; written in config and
/// JSON as a decimal number of units (`0.25`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Money(pub u64);

impl Money {
    /// Nothing.
    pub const ZERO: Money = Money(0);

    /// `units` of the currency (`0.25`), to the millionth; `None` for a negative or non-finite
    /// amount, or one past 2^53 millionths.
    pub fn from_units(units: f64) -> Option<Money> {
        let micros = (units * 1e6).round();
        (units.is_finite() && units >= 0.0 && micros <= 9_007_199_254_740_992.0)
            .then_some(Money(micros as u64))
    }

    /// This amount in units of the currency.
    pub fn units(self) -> f64 {
        self.0 as f64 / 1e6
    }
}

impl fmt::Display for Money {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:06}", self.0 / 1_000_000, self.0 % 1_000_000)
    }
}

impl Serialize for Money {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.units())
    }
}

impl<'de> Deserialize<'de> for Money {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let units = f64::deserialize(d)?;
        Money::from_units(units).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "{units} is not an amount (a number of units, 0 or more)"
            ))
        })
    }
}

/// What a model's tokens cost (`[settings.prices."model-name"]`, or `default` for every model
/// without its own entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Per million prompt (input) tokens.
    pub input_per_million: Money,
    /// Per million completion (output) tokens.
    pub output_per_million: Money,
}

impl Price {
    /// What `input` and `output` tokens cost, rounded up to the millionth.
    pub fn cost(&self, input: u64, output: u64) -> Money {
        let micros = u128::from(input) * u128::from(self.input_per_million.0)
            + u128::from(output) * u128::from(self.output_per_million.0);
        Money(u64::try_from(micros.div_ceil(1_000_000)).unwrap_or(u64::MAX))
    }
}

/// The rolling period of an agent's or the organization's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Period {
    /// The last 60 minutes (counted in one-minute buckets).
    Hour,
    /// The last 24 hours (counted in fifteen-minute buckets).
    Day,
}

impl Period {
    /// The period's length, in milliseconds.
    pub fn millis(self) -> i64 {
        match self {
            Period::Hour => 3_600_000,
            Period::Day => 86_400_000,
        }
    }

    /// The length of one bucket, in milliseconds: spend is counted per bucket and a bucket leaves
    /// the window whole.
    pub fn bucket_millis(self) -> i64 {
        match self {
            Period::Hour => 60_000,
            Period::Day => 900_000,
        }
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Period::Hour => "last hour",
            Period::Day => "last day",
        })
    }
}

/// Limits over a rolling period: an agent's (`[settings.agent_limits]` for every agent,
/// `[[agents]] limits` for one) or the organization's (`[settings.org_limits]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeriodLimits {
    /// The period.
    pub period: Period,
    /// The limits (no wall time).
    #[serde(flatten)]
    pub limits: Limits,
}

/// What one model call may spend at most, reserved before it is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CallEstimate {
    /// The prompt's tokens, estimated ([`estimate_input`]).
    pub input: u64,
    /// The most the model may answer.
    pub max_output: u64,
    /// The model's price, if the price table has one.
    pub price: Option<Price>,
}

impl CallEstimate {
    /// The spend of this call answering `output` tokens.
    pub fn spend(&self, output: u64) -> Spend {
        Spend {
            input_tokens: self.input,
            output_tokens: output,
            total_tokens: self.input.saturating_add(output),
            model_calls: 1,
            tool_calls: 0,
            cost: Money::ZERO,
        }
        .priced(self.price.as_ref())
    }

    /// The most this call may answer under `limits` against `committed` (settled plus reserved):
    /// at most `max_output`, at least 1.
    pub fn fit_output(&self, limits: &Limits, committed: &Spend) -> u64 {
        let mut output = self.max_output.max(1);
        if let Some(max) = limits.output_tokens {
            output = output.min(max.saturating_sub(committed.output_tokens));
        }
        if let Some(max) = limits.total_tokens {
            output = output.min(
                max.saturating_sub(committed.total_tokens)
                    .saturating_sub(self.input),
            );
        }
        if let (Some(max), Some(price)) = (limits.cost, self.price)
            && price.output_per_million.0 > 0
        {
            let left = max
                .0
                .saturating_sub(committed.cost.0)
                .saturating_sub(price.cost(self.input, 0).0);
            // The most tokens whose cost (rounded up) stays within what is left.
            let fits = u128::from(left) * 1_000_000 / u128::from(price.output_per_million.0);
            output = output.min(u64::try_from(fits).unwrap_or(u64::MAX));
        }
        output.max(1)
    }

    /// Checks this call against `limits`: `Err(Refusal::Reached)` when even its smallest form (one
    /// output token) passes a limit against `settled`, `Err(Refusal::Busy)` when it would fit
    /// but for `committed`'s open reservations; otherwise the spend to reserve.
    pub fn fit(
        &self,
        limits: &Limits,
        settled: &Spend,
        committed: &Spend,
        elapsed_ms: u64,
    ) -> Result<Spend, Fit> {
        limits
            .check(&settled.plus(&self.spend(1)), elapsed_ms)
            .map_err(Fit::Reached)?;
        limits
            .check(&committed.plus(&self.spend(1)), elapsed_ms)
            .map_err(Fit::Busy)?;
        Ok(self.spend(self.fit_output(limits, committed)))
    }
}

/// Why a call does not fit ([`CallEstimate::fit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// Not even alone: the limit is reached.
    Reached(Over),
    /// Not with the open reservations.
    Busy(Over),
}

/// The most a model call may answer when its request sets no `max_tokens` of its own and no
/// limit leaves less.
pub const DEFAULT_MAX_OUTPUT: u64 = 4_096;

/// An estimate of the prompt tokens of `request`: a third of its text's bytes, rounded up, plus
/// four per message and per tool call (English text averages about four bytes a token; the margin
/// covers the message framing). A provider that counts more than this can take a call's spend past
/// its reservation by the difference; settlement records what it reported.
pub fn estimate_input(request: &crate::llm::ChatRequest) -> u64 {
    TextSize::of_messages(&request.messages)
        .plus(TextSize::of_tools(&request.tools))
        .estimate()
}

/// What [`estimate_input`] counts of a request's parts: their bytes of text and their pieces
/// (messages, tool calls, tools). Parts measured apart add up to the request's estimate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TextSize {
    bytes: u64,
    pieces: u64,
}

impl TextSize {
    /// The size of `messages`.
    pub(crate) fn of_messages(messages: &[ChatMessage]) -> Self {
        messages
            .iter()
            .fold(Self::default(), |size, m| size.plus(Self::of_message(m)))
    }

    /// The size of one message.
    pub(crate) fn of_message(message: &ChatMessage) -> Self {
        match message {
            ChatMessage::System { content }
            | ChatMessage::User { content }
            | ChatMessage::Tool { content, .. } => Self {
                bytes: content.len() as u64,
                pieces: 1,
            },
            ChatMessage::Assistant {
                content,
                tool_calls,
            } => tool_calls.iter().fold(
                Self {
                    bytes: content.as_ref().map_or(0, |c| c.len() as u64),
                    pieces: 1,
                },
                |size, call| Self {
                    bytes: size.bytes + (call.name.len() + call.arguments.len()) as u64,
                    pieces: size.pieces + 1,
                },
            ),
        }
    }

    /// The size of `tools` (their schemas as JSON).
    pub(crate) fn of_tools(tools: &[crate::llm::ToolDefinition]) -> Self {
        let mut size = Self::default();
        for t in tools {
            size.pieces += 1;
            size.bytes +=
                (t.name.len() + t.description.len() + t.parameters.to_string().len()) as u64;
        }
        size
    }

    /// Both sizes together.
    pub(crate) fn plus(self, other: Self) -> Self {
        Self {
            bytes: self.bytes + other.bytes,
            pieces: self.pieces + other.pieces,
        }
    }

    /// This size without `other` (a part of it).
    pub(crate) fn minus(self, other: Self) -> Self {
        Self {
            bytes: self.bytes.saturating_sub(other.bytes),
            pieces: self.pieces.saturating_sub(other.pieces),
        }
    }

    /// The estimated tokens.
    pub(crate) fn estimate(self) -> u64 {
        self.bytes.div_ceil(3) + 4 * self.pieces
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_tighter_limit_binds_measure_by_measure() {
        let a = Limits {
            total_tokens: Some(100),
            model_calls: Some(5),
            ..Limits::NONE
        };
        let b = Limits {
            total_tokens: Some(50),
            tool_calls: Some(2),
            ..Limits::NONE
        };
        let t = a.tighter(&b);
        assert_eq!(
            (t.total_tokens, t.model_calls, t.tool_calls, t.input_tokens),
            (Some(50), Some(5), Some(2), None)
        );
        assert!(Limits::NONE.is_none() && !t.is_none());
    }

    #[test]
    fn a_spend_at_the_limit_passes_and_one_more_does_not() {
        let limits = Limits {
            model_calls: Some(2),
            wall_time_ms: Some(1_000),
            ..Limits::NONE
        };
        let two = Spend {
            model_calls: 2,
            ..Spend::default()
        };
        assert!(limits.check(&two, 1_000).is_ok());
        let over = limits
            .check(
                &two.plus(&Spend {
                    model_calls: 1,
                    ..Spend::default()
                }),
                0,
            )
            .unwrap_err();
        assert_eq!(
            (over.limit, over.max, over.value),
            (Limit::ModelCalls, 2, 3)
        );
        let late = limits.check(&two, 1_001).unwrap_err();
        assert_eq!(late.limit, Limit::WallTime);
    }
}
