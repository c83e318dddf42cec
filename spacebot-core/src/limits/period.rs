//! The durable spend of each agent and of the organization over rolling periods.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{CallEstimate, Fit, LimitReached, Limits, Period, Refusal, Scope, Spend};
use crate::error::StoreError;
use crate::records::{Expect, RecordStore, RecordWrite, WriteReceipt};
use crate::time::Timestamp;

/// The record namespace of period spend (key: `agent:{id}:{hour|day}` or `org:{hour|day}`).
pub const PERIOD_NAMESPACE: &str = "limits.period";

/// How many times a compare-and-set write is tried against concurrent writers before it gives up.
const CAS_ATTEMPTS: usize = 64;

/// One scope's spend over its period, as stored: settled spend per bucket, and open reservations
/// with the bucket they were made in.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct PeriodEntry {
    /// Settled spend by bucket start (milliseconds since the epoch).
    pub buckets: BTreeMap<i64, Spend>,
    /// Open reservations by call key: `(bucket start, spend)`. A reservation a crash left open
    /// counts until its bucket leaves the period.
    pub reserved: BTreeMap<String, (i64, Spend)>,
    /// An operator's limits for the scope, set at run time
    /// ([`Organization::set_period_limits`](crate::Organization::set_period_limits)): they
    /// replace the configured ones; `None`, the configuration's apply.
    pub limits: Option<Limits>,
}

impl PeriodEntry {
    /// Drops what left the period ending at `now`.
    fn prune(&mut self, period: Period, now: Timestamp) {
        let first = now.0 - period.millis();
        let bucket = period.bucket_millis();
        self.buckets.retain(|start, _| start + bucket > first);
        self.reserved
            .retain(|_, (start, _)| *start + bucket > first);
    }

    /// Settled spend in the period (of what is still in it when read).
    pub fn settled(&self) -> Spend {
        self.buckets
            .values()
            .fold(Spend::default(), |sum, s| sum.plus(s))
    }

    /// Settled spend plus open reservations.
    pub fn committed(&self) -> Spend {
        self.reserved
            .values()
            .fold(self.settled(), |sum, (_, s)| sum.plus(s))
    }
}

/// The record key of a period scope; `None` for [`Scope::Request`].
pub(crate) fn scope_key(scope: &Scope) -> Option<(String, Period)> {
    let name = |p: Period| match p {
        Period::Hour => "hour",
        Period::Day => "day",
    };
    match scope {
        Scope::Request => None,
        Scope::Agent { agent, period } => {
            Some((format!("agent:{agent}:{}", name(*period)), *period))
        }
        Scope::Organization { period } => Some((format!("org:{}", name(*period)), *period)),
    }
}

/// The period scope of a record key (the inverse of [`scope_key`]).
fn scope_of_key(key: &str) -> Option<Scope> {
    let period = |name: &str| match name {
        "hour" => Some(Period::Hour),
        "day" => Some(Period::Day),
        _ => None,
    };
    if let Some(rest) = key.strip_prefix("agent:") {
        let (agent, name) = rest.rsplit_once(':')?;
        return Some(Scope::Agent {
            agent: crate::ids::AgentId::parse(agent).ok()?,
            period: period(name)?,
        });
    }
    Some(Scope::Organization {
        period: period(key.strip_prefix("org:")?)?,
    })
}

/// The spend of agents and of the organization over rolling periods, durably in a
/// [`RecordStore`] (namespace [`PERIOD_NAMESPACE`]). Every change is one compare-and-set write,
/// like [`RequestLedger`](super::RequestLedger)'s. Cheap to clone.
#[derive(Debug, Clone)]
pub struct PeriodLedger {
    records: Arc<dyn RecordStore>,
}

impl PeriodLedger {
    /// A ledger over `records`.
    pub fn new(records: Arc<dyn RecordStore>) -> Self {
        Self { records }
    }

    /// The spend of a period `scope` in the period ending at `now` (`None` for
    /// [`Scope::Request`], or when nothing was spent).
    ///
    /// # Errors
    /// As the store.
    pub async fn get(
        &self,
        scope: &Scope,
        now: Timestamp,
    ) -> Result<Option<PeriodEntry>, StoreError> {
        let Some((key, period)) = scope_key(scope) else {
            return Ok(None);
        };
        match self.records.get(PERIOD_NAMESPACE, &key).await? {
            Some(record) => {
                let mut entry = record.decode::<PeriodEntry>()?.value;
                entry.prune(period, now);
                Ok(Some(entry))
            }
            None => Ok(None),
        }
    }

    async fn update<T, E>(
        &self,
        scope: &Scope,
        now: Timestamp,
        mut change: impl FnMut(&mut PeriodEntry, Period) -> Result<T, E>,
    ) -> Result<Result<T, E>, StoreError> {
        let Some((key, period)) = scope_key(scope) else {
            return Err(StoreError::Backend {
                backend: "limits",
                message: "a request has no period".to_owned(),
                source: None,
            });
        };
        for _ in 0..CAS_ATTEMPTS {
            let current = self.records.get(PERIOD_NAMESPACE, &key).await?;
            let (mut entry, expect) = match current {
                Some(record) => {
                    let version = record.version;
                    (
                        record.decode::<PeriodEntry>()?.value,
                        Expect::Version(version),
                    )
                }
                None => (PeriodEntry::default(), Expect::Absent),
            };
            let before = entry.clone();
            entry.prune(period, now);
            let result = change(&mut entry, period);
            if entry == before || result.is_err() {
                return Ok(result);
            }
            let value = serde_json::to_value(&entry).map_err(|e| {
                StoreError::backend("limits", format!("encoding a period's spend: {e}"), e)
            })?;
            // A bucket's earlier values are not kept.
            let write = RecordWrite::new(PERIOD_NAMESPACE, &key, value, "limits")
                .expect(expect)
                .at(now)
                .replacing();
            match self.records.write_receipt(write).await? {
                WriteReceipt::Written(_) | WriteReceipt::AlreadyApplied(_) => return Ok(result),
                WriteReceipt::Conflict { .. } => continue,
            }
        }
        Err(StoreError::Backend {
            backend: "limits",
            message: format!("the spend of {scope} changed under {CAS_ATTEMPTS} writes in a row"),
            source: None,
        })
    }

    /// Reserves a model call `key` (its worst case, `call`) against `limits` of the period
    /// `scope`: written only when the period's settled spend, its open reservations and this one
    /// stay within every limit (wall time does not apply to a period).
    ///
    /// # Errors
    /// `Ok(Err(Refusal::Reached))` when not even one output token fits against the period's
    /// settled spend; `Ok(Err(Refusal::Busy))` when it would fit but for open reservations;
    /// `Err` as the store.
    pub async fn reserve(
        &self,
        scope: &Scope,
        key: &str,
        call: &CallEstimate,
        limits: &Limits,
        now: Timestamp,
    ) -> Result<Result<Spend, Refusal>, StoreError> {
        self.update(scope, now, |e, period| {
            if let Some((_, existing)) = e.reserved.get(key) {
                return Ok(*existing);
            }
            let limits = Limits {
                wall_time_ms: None,
                ..e.limits.unwrap_or(*limits)
            };
            let settled = e.settled();
            match call.fit(&limits, &settled, &e.committed(), 0) {
                Ok(reserved) => {
                    let bucket = now.0.div_euclid(period.bucket_millis()) * period.bucket_millis();
                    e.reserved.insert(key.to_owned(), (bucket, reserved));
                    Ok(reserved)
                }
                Err(Fit::Reached(over)) => Err(Refusal::Reached(LimitReached {
                    over,
                    spent: settled,
                    scope: scope.clone(),
                })),
                Err(Fit::Busy(over)) => Err(Refusal::Busy(over)),
            }
        })
        .await
    }

    /// Settles the call `key` with what it spent, in the bucket of `now`; a call with no open
    /// reservation changes nothing.
    ///
    /// # Errors
    /// As the store.
    pub async fn settle(
        &self,
        scope: &Scope,
        key: &str,
        spent: Spend,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.update(scope, now, |e, period| {
            if e.reserved.remove(key).is_some() {
                let bucket = now.0.div_euclid(period.bucket_millis()) * period.bucket_millis();
                let slot = e.buckets.entry(bucket).or_default();
                *slot = slot.plus(&spent);
            }
            Ok::<(), ()>(())
        })
        .await
        .map(|_| ())
    }

    /// Sets (`Some`) or clears (`None`) an operator's limits for the period `scope`, replacing
    /// the configured ones from the next call on (see [`PeriodEntry::limits`]).
    ///
    /// # Errors
    /// As the store.
    pub async fn set_limits(
        &self,
        scope: &Scope,
        limits: Option<Limits>,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.update(scope, now, |e, _| {
            e.limits = limits;
            Ok::<(), ()>(())
        })
        .await
        .map(|_| ())
    }

    /// Every period scope an operator set limits for, with them.
    ///
    /// # Errors
    /// As the store.
    pub async fn operator_limits(&self) -> Result<Vec<(Scope, Limits)>, StoreError> {
        let mut found = Vec::new();
        for record in self.records.list(PERIOD_NAMESPACE, "").await? {
            let key = record.key.clone();
            let entry = record.decode::<PeriodEntry>()?.value;
            let Some(limits) = entry.limits else { continue };
            if let Some(scope) = scope_of_key(&key) {
                found.push((scope, limits));
            }
        }
        Ok(found)
    }

    /// Releases the reservation `key` without charging it.
    ///
    /// # Errors
    /// As the store.
    pub async fn release(
        &self,
        scope: &Scope,
        key: &str,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.update(scope, now, |e, _| {
            e.reserved.remove(key);
            Ok::<(), ()>(())
        })
        .await
        .map(|_| ())
    }

    /// Charges `spent` at once against `limits` (tool calls).
    ///
    /// # Errors
    /// `Ok(Err(LimitReached))` when a limit would be passed; `Err` as the store.
    pub async fn charge(
        &self,
        scope: &Scope,
        spent: Spend,
        limits: &Limits,
        now: Timestamp,
    ) -> Result<Result<(), LimitReached>, StoreError> {
        self.update(scope, now, |e, period| {
            let limits = Limits {
                wall_time_ms: None,
                ..e.limits.unwrap_or(*limits)
            };
            match limits.check(&e.committed().plus(&spent), 0) {
                Ok(()) => {
                    let bucket = now.0.div_euclid(period.bucket_millis()) * period.bucket_millis();
                    let slot = e.buckets.entry(bucket).or_default();
                    *slot = slot.plus(&spent);
                    Ok(())
                }
                Err(over) => Err(LimitReached {
                    over,
                    spent: e.settled(),
                    scope: scope.clone(),
                }),
            }
        })
        .await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::ids::AgentId;
    use crate::limits::Limit;
    use crate::stores::Stores;

    fn spent(n: u64) -> Spend {
        Spend {
            input_tokens: n,
            total_tokens: n,
            model_calls: 1,
            ..Spend::default()
        }
    }

    #[test]
    fn spend_leaves_the_rolling_hour_bucket_by_bucket() {
        futures::executor::block_on(async {
            let l = PeriodLedger::new(Stores::memory().records.clone());
            let scope = Scope::Agent {
                agent: AgentId::parse("a").unwrap(),
                period: Period::Hour,
            };
            let limits = Limits {
                total_tokens: Some(100),
                ..Limits::NONE
            };
            let call = CallEstimate {
                input: 40,
                max_output: 10,
                price: None,
            };
            let t0 = Timestamp(10 * 60_000);
            l.reserve(&scope, "c1", &call, &limits, t0)
                .await
                .unwrap()
                .unwrap();
            l.settle(&scope, "c1", spent(50), t0).await.unwrap();
            let t1 = Timestamp(t0.0 + 30 * 60_000);
            l.reserve(&scope, "c2", &call, &limits, t1)
                .await
                .unwrap()
                .unwrap();
            l.settle(&scope, "c2", spent(50), t1).await.unwrap();
            // 100 spent within the hour: not one more call.
            let refused = l.reserve(&scope, "c3", &call, &limits, t1).await.unwrap();
            let Err(Refusal::Reached(reached)) = refused else {
                panic!("reached: {refused:?}")
            };
            assert_eq!(
                (reached.over.limit, reached.spent.total_tokens),
                (Limit::TotalTokens, 100)
            );
            assert_eq!(reached.scope, scope);
            // An hour after the first call's minute, its bucket has left the window.
            let t2 = Timestamp(t0.0 + 61 * 60_000);
            l.reserve(&scope, "c3", &call, &limits, t2)
                .await
                .unwrap()
                .unwrap();
            let entry = l.get(&scope, t2).await.unwrap().unwrap();
            assert_eq!(entry.settled().total_tokens, 50);
            // A reservation a crash left open stops counting when its bucket leaves.
            let t3 = Timestamp(t2.0 + 61 * 60_000);
            let entry = l.get(&scope, t3).await.unwrap().unwrap();
            assert_eq!(entry.committed(), Spend::default());
        });
    }

    #[test]
    fn a_price_turns_tokens_into_cost_and_the_cost_limit_caps_the_answer() {
        futures::executor::block_on(async {
            let l = PeriodLedger::new(Stores::memory().records.clone());
            let scope = Scope::Organization {
                period: Period::Day,
            };
            // 1.00 per million in, 2.00 per million out; 0.001 to spend: 1,000 millionths.
            let price = crate::limits::Price {
                input_per_million: crate::limits::Money::from_units(1.0).unwrap(),
                output_per_million: crate::limits::Money::from_units(2.0).unwrap(),
            };
            let limits = Limits {
                cost: Some(crate::limits::Money(1_000)),
                ..Limits::NONE
            };
            let call = CallEstimate {
                input: 200,
                max_output: 4_096,
                price: Some(price),
            };
            let granted = l
                .reserve(&scope, "c1", &call, &limits, Timestamp(0))
                .await
                .unwrap()
                .unwrap();
            // 200 in costs 200; 800 left buys 400 out.
            assert_eq!((granted.output_tokens, granted.cost.0), (400, 1_000));
            assert_eq!(price.cost(1, 1), crate::limits::Money(3));
        });
    }
}
