//! The host's side of [`crate::limits`]: binding a request's limits, reserving and settling each
//! model call, charging tool calls, and telling the user once.

use std::sync::atomic::Ordering;

use crate::error::StoreError;
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use futures::channel::oneshot;

use crate::limits::{LimitReached, Refusal, RequestLedger, Spend};
use crate::records::{Expect, RecordWrite};
use crate::runtime::host::{Host, lock};

/// How often a call waiting for the request's other reservations looks again without being woken.
pub(crate) const BUSY_POLL: std::time::Duration = std::time::Duration::from_millis(250);
/// How many times a call waits for the request's other reservations before it is refused.
pub(crate) const BUSY_ROUNDS: u32 = 240;

/// The record saying that some message bound limits of its own: turns read the ledger even when
/// `[settings.limits]` is empty (across a restart too).
const MARKER: (&str, &str) = ("limits.meta", "bound");

impl Host {
    /// The ledger of requests' spend.
    pub(crate) fn ledger(&self) -> RequestLedger {
        RequestLedger::new(self.stores.records.clone())
    }

    /// Whether turns check limits.
    pub(crate) fn limits_in_use(&self) -> bool {
        self.limits_in_use.load(Ordering::Acquire)
    }

    /// At build: a message bound limits before a restart.
    pub(crate) async fn load_limits_marker(&self) -> Result<(), StoreError> {
        if self.limits_in_use() {
            return Ok(());
        }
        if self.stores.records.get(MARKER.0, MARKER.1).await?.is_some() {
            self.limits_in_use.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Stores a message's own limits with its request, before it is queued.
    pub(crate) async fn bind_limits(
        &self,
        request: &EnvelopeId,
        limits: crate::limits::Limits,
    ) -> Result<(), StoreError> {
        let now = self.clock.now();
        if !self.limits_in_use() {
            let marker = RecordWrite::new(MARKER.0, MARKER.1, serde_json::json!(true), "limits")
                .expect(Expect::Absent)
                .at(now);
            self.stores.records.write(marker).await?;
            self.limits_in_use.store(true, Ordering::Release);
        }
        self.ledger().bind(request, limits, now).await
    }

    /// Says a request reached a limit.
    pub(crate) fn limit_reached(
        &self,
        agent: &AgentId,
        channel: &ChannelId,
        request: &EnvelopeId,
        reached: &LimitReached,
    ) {
        let mut event = self.event(
            agent,
            EventKind::LimitReached {
                request: request.clone(),
                over: reached.over,
                spent: reached.spent,
            },
        );
        event.channel = Some(channel.clone());
        self.emit(event);
    }

    /// Reserves a model call of `request` under key `key` (see [`RequestLedger::reserve`]);
    /// `Ok(Ok(None))` when no limit applies (nothing to settle).
    ///
    /// A call that would fit but for the request's other open reservations waits for them to
    /// settle (woken by a settlement in this process, or every [`BUSY_POLL`] of the clock for
    /// one in another), at most [`BUSY_ROUNDS`] times, then is refused.
    pub(crate) async fn reserve_call(
        &self,
        request: &EnvelopeId,
        key: &str,
        input: u64,
        max_output: u64,
    ) -> Result<Result<Option<Spend>, LimitReached>, StoreError> {
        if !self.limits_in_use() {
            return Ok(Ok(None));
        }
        let mut rounds = 0;
        loop {
            let settled = {
                let (tx, rx) = oneshot::channel();
                lock(&self.settle_waiters).push(tx);
                rx
            };
            let now = self.clock.now();
            match self
                .ledger()
                .reserve(request, key, input, max_output, &self.settings.limits, now)
                .await?
            {
                Ok(granted) => return Ok(Ok(Some(granted))),
                Err(Refusal::Reached(reached)) => return Ok(Err(reached)),
                Err(Refusal::Busy(over)) if rounds >= BUSY_ROUNDS => {
                    let spent = self
                        .ledger()
                        .get(request)
                        .await?
                        .map(|e| e.settled)
                        .unwrap_or_default();
                    return Ok(Err(LimitReached { over, spent }));
                }
                Err(Refusal::Busy(_)) => {
                    rounds += 1;
                    let poll = self.clock.sleep(BUSY_POLL);
                    futures::future::select(settled, poll).await;
                }
            }
        }
    }

    /// Settles a reserved model call with what it spent.
    pub(crate) async fn settle_call(
        &self,
        request: &EnvelopeId,
        key: &str,
        spent: Spend,
    ) -> Result<(), StoreError> {
        let settled = self
            .ledger()
            .settle(request, key, spent, self.clock.now())
            .await;
        for waiter in std::mem::take(&mut *lock(&self.settle_waiters)) {
            let _ = waiter.send(());
        }
        settled
    }

    /// Charges `n` tool calls to `request`.
    pub(crate) async fn charge_tools(
        &self,
        request: &EnvelopeId,
        n: u64,
    ) -> Result<Result<(), LimitReached>, StoreError> {
        if !self.limits_in_use() {
            return Ok(Ok(()));
        }
        self.ledger()
            .charge(
                request,
                Spend::tool_calls(n),
                &self.settings.limits,
                self.clock.now(),
            )
            .await
    }

    /// Whether this failure is the one to tell the user about the request's limit (once per
    /// request); a store that fails says yes (telling twice beats never).
    pub(crate) async fn tell_limit_once(&self, request: &EnvelopeId) -> bool {
        self.ledger()
            .tell_once(request, self.clock.now())
            .await
            .unwrap_or(true)
    }
}
