//! The host's side of [`crate::limits`]: binding a request's limits, reserving and settling each
//! model call, charging tool calls, and telling the user once.

use std::sync::atomic::Ordering;

use crate::error::{InvalidInput, StoreError};
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId};
use crate::org::OrgError;
use futures::channel::oneshot;

use crate::limits::{
    CallEstimate, LimitReached, Limits, PeriodLedger, Price, Refusal, RequestLedger, Scope, Spend,
};
use crate::records::{Expect, RecordWrite};
use crate::runtime::host::{Host, lock};

/// How often a call waiting for the request's other reservations looks again without being woken.
pub(crate) const BUSY_POLL: std::time::Duration = std::time::Duration::from_millis(250);
/// How many times a call waits for the request's other reservations before it is refused.
pub(crate) const BUSY_ROUNDS: u32 = 240;
/// How long a model call's settlement made behind waits, at most, for a write of this host to
/// carry it (the next reservation) before a flush of its own stores it.
pub(crate) const SETTLE_FLUSH_AFTER: std::time::Duration = std::time::Duration::from_millis(50);

/// The record saying that some message bound limits of its own: turns read the ledger even when
/// `[settings.limits]` is empty (across a restart too).
const MARKER: (&str, &str) = ("limits.meta", "bound");

/// A model call's key among the host's open reservations while it is being reserved: taken out
/// again when dropped (refused, or failed), unless [`keep`](Self::keep) says it was reserved.
struct Reserving<'a> {
    set: &'a std::sync::Mutex<crate::fasthash::FastSet<String>>,
    key: &'a str,
    kept: bool,
}

impl<'a> Reserving<'a> {
    fn open(set: &'a std::sync::Mutex<crate::fasthash::FastSet<String>>, key: &'a str) -> Self {
        lock(set).insert(key.to_owned());
        Self {
            set,
            key,
            kept: false,
        }
    }

    /// The call was reserved: it stays open until settled.
    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Reserving<'_> {
    fn drop(&mut self) {
        if !self.kept {
            lock(self.set).remove(self.key);
        }
    }
}

impl Host {
    /// The ledger of requests' spend.
    pub(crate) fn ledger(&self) -> RequestLedger {
        self.request_ledger.clone()
    }

    /// Whether turns check limits.
    pub(crate) fn limits_in_use(&self) -> bool {
        self.limits_in_use.load(Ordering::Acquire)
    }

    /// Whether a message bound limits before a restart (read at build) or, under a placement, in
    /// another process since (read at the start of each turn until found: a message's limits are
    /// bound before it is queued, so before any turn of its request begins).
    pub(crate) async fn load_limits_marker(&self) -> Result<(), StoreError> {
        if !self.limits_in_use() {
            if self.stores.records.get(MARKER.0, MARKER.1).await?.is_none() {
                return Ok(());
            }
            self.limits_in_use.store(true, Ordering::Release);
        }
        self.load_operator_periods().await
    }

    /// Reads which period scopes an operator set limits for.
    pub(crate) async fn load_operator_periods(&self) -> Result<(), StoreError> {
        let found = PeriodLedger::new(self.stores.records.clone())
            .operator_limits()
            .await?;
        let mut known = lock(&self.operator_periods);
        for (scope, _) in found {
            if !known.contains(&scope) {
                known.push(scope);
            }
        }
        Ok(())
    }

    /// Stores a message's own limits with its request, before it is queued.
    pub(crate) async fn bind_limits(
        &self,
        request: &EnvelopeId,
        limits: crate::limits::Limits,
    ) -> Result<(), StoreError> {
        self.use_limits().await?;
        self.ledger().bind(request, limits, self.clock.now()).await
    }

    /// Turns on the limit checks of every turn, durably (a marker record read at build).
    pub(crate) async fn use_limits(&self) -> Result<(), StoreError> {
        if !self.limits_in_use() {
            let marker = RecordWrite::new(MARKER.0, MARKER.1, serde_json::json!(true), "limits")
                .expect(Expect::Absent)
                .at(self.clock.now());
            self.stores.records.write(marker).await?;
            self.limits_in_use.store(true, Ordering::Release);
        }
        Ok(())
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
        event.request = Some(request.clone());
        self.emit(event);
    }

    /// The period scopes binding `agent`'s calls, each with its limits (the agent's own and
    /// every agent's, tightened when they share a period, and the organization's).
    pub(crate) fn period_scopes(&self, agent: &AgentId) -> Vec<(Scope, Limits)> {
        let mut scopes: Vec<(Scope, Limits)> = Vec::new();
        let own = self.agent_period_limits.get(agent).copied();
        for p in [self.settings.agent_limits, own].into_iter().flatten() {
            let scope = Scope::Agent {
                agent: agent.clone(),
                period: p.period,
            };
            match scopes.iter_mut().find(|(s, _)| s == &scope) {
                Some((_, limits)) => *limits = limits.tighter(&p.limits),
                None => scopes.push((scope, p.limits)),
            }
        }
        if let Some(p) = self.settings.org_limits {
            scopes.push((Scope::Organization { period: p.period }, p.limits));
        }
        // An operator's limits (stored with the scope's spend) replace the configured ones when
        // the ledger reads them; a scope only an operator limited is checked too.
        for scope in lock(&self.operator_periods).iter() {
            let mine = match scope {
                Scope::Agent { agent: a, .. } => a == agent,
                Scope::Organization { .. } => true,
                Scope::Request => false,
            };
            if mine && !scopes.iter().any(|(s, _)| s == scope) {
                scopes.push((scope.clone(), Limits::NONE));
            }
        }
        scopes
    }

    /// The price of the provider's model in the price table (its own entry, else `default`).
    pub(crate) fn price(&self) -> Option<Price> {
        let prices = &self.settings.prices;
        if prices.is_empty() {
            return None;
        }
        self.llm
            .default_model()
            .and_then(|m| prices.get(m).copied())
            .or_else(|| prices.get("default").copied())
    }

    /// Reserves a model call `key` of `agent` for `request` in every scope that binds it (the
    /// request, the agent's periods, the organization's; see [`RequestLedger::reserve`]):
    /// `Ok(Ok(None))` when no limit applies (nothing to settle), else the spend reserved (the
    /// least output any scope leaves).
    ///
    /// A call that would fit but for open reservations waits for them to settle (woken by a
    /// settlement in this process, or every [`BUSY_POLL`] of the clock for one in another), at
    /// most [`BUSY_ROUNDS`] times, then is refused. A scope that refuses releases what the others
    /// reserved.
    pub(crate) async fn reserve_call(
        &self,
        agent: &AgentId,
        request: &EnvelopeId,
        key: &str,
        mut call: CallEstimate,
    ) -> Result<Result<Option<Spend>, LimitReached>, StoreError> {
        if !self.limits_in_use() {
            return Ok(Ok(None));
        }
        call.price = self.price();
        let scopes = self.period_scopes(agent);
        let periods = PeriodLedger::new(self.stores.records.clone());
        let mut rounds = 0;
        // Registered once a call finds the request busy, then tried again before waiting: a
        // settlement in between wakes it (most calls never wait, and register nothing).
        let mut settled: Option<oneshot::Receiver<()>> = None;
        // Whether the last refusal found no reservation of this host open.
        let mut none_open_before = false;
        loop {
            let now = self.clock.now();
            let mut granted = call;
            let mut held: Vec<&Scope> = Vec::new();
            // Settlements of other requests made behind ride along: written beside this
            // reservation (the stores group writes sent together into one commit), not each
            // by a write of its own.
            let ledger = &self.request_ledger;
            // Open in this host from before the reservation shows in the ledger (on a store whose
            // cells store images, it shows while its image is being stored), until refused.
            let open = Reserving::open(&self.reserving, key);
            let reserve = ledger.reserve(request, key, &granted, &self.settings.limits, now);
            let reserved = if ledger.has_pending() {
                let (reserved, flushed) = crate::durability::together(futures::future::join(
                    reserve,
                    ledger.flush_others(request, now),
                ))
                .await;
                if let Err(e) = flushed {
                    tracing::warn!("model calls' settlements were not stored yet: {e}");
                }
                reserved
            } else {
                reserve.await
            };
            let mut refusal = match reserved? {
                Ok(spend) => {
                    granted.max_output = spend.output_tokens;
                    None
                }
                Err(refusal) => Some(refusal),
            };
            if refusal.is_none() {
                for (scope, limits) in &scopes {
                    match periods.reserve(scope, key, &granted, limits, now).await? {
                        Ok(spend) => {
                            granted.max_output = spend.output_tokens;
                            held.push(scope);
                        }
                        Err(r) => {
                            refusal = Some(r);
                            break;
                        }
                    }
                }
            }
            let Some(refusal) = refusal else {
                open.keep();
                return Ok(Ok(Some(granted.spend(granted.max_output))));
            };
            drop(open);
            // One scope refused: the others' reservations go.
            for scope in held {
                periods.release(scope, key, now).await?;
            }
            self.ledger().release(request, key, now).await?;
            // Room held by no reservation of this host, found twice in a row (a settlement that
            // closed the last one between the refusal and this look has freed its room: the
            // next try, at once, counts it).
            let none_open = self.hosting.is_none() && lock(&self.reserving).is_empty();
            let abandoned = none_open && none_open_before;
            none_open_before = none_open;
            match refusal {
                Refusal::Reached(reached) => return Ok(Err(reached)),
                // In one process, room held by no reservation of this host's was left by a run
                // that crashed before settling: it stays counted, and nothing will free it.
                Refusal::Busy(over) if rounds >= BUSY_ROUNDS || abandoned => {
                    let spent = self
                        .ledger()
                        .get(request)
                        .await?
                        .map(|e| e.settled)
                        .unwrap_or_default();
                    return Ok(Err(LimitReached {
                        over,
                        spent,
                        scope: Scope::Request,
                    }));
                }
                Refusal::Busy(over) => {
                    if let Some(waiter) = settled.take() {
                        if rounds == 0 {
                            // Said once a call, before its first wait.
                            let mut event = self.event(
                                agent,
                                EventKind::LimitWait {
                                    request: request.clone(),
                                    over,
                                },
                            );
                            event.request = Some(request.clone());
                            self.emit(event);
                        }
                        rounds += 1;
                        let poll = self.clock.sleep(BUSY_POLL);
                        futures::future::select(waiter, poll).await;
                    }
                    // Registered before the next try: a settlement after it wakes the wait.
                    let (tx, rx) = oneshot::channel();
                    lock(&self.settle_waiters).push(tx);
                    settled = Some(rx);
                }
            }
        }
    }

    /// Settles a reserved model call of `agent` with what it spent (priced), in every scope.
    ///
    /// The request's settlement is made behind ([`RequestLedger::settle_behind`]): counted at
    /// once in this process, stored by the next reservation this host writes (of any request,
    /// in the same batch of writes) or at the latest [`SETTLE_FLUSH_AFTER`] later (or at
    /// shutdown) by a flush in the background, off the turn's way; a kill before it is stored
    /// leaves the reservation counted, as a kill before the settlement always did.
    pub(crate) async fn settle_call(
        &self,
        agent: &AgentId,
        request: &EnvelopeId,
        key: &str,
        spent: Spend,
    ) -> Result<(), StoreError> {
        lock(&self.reserving).remove(key);
        let now = self.clock.now();
        let spent = spent.priced(self.price().as_ref());
        if self.request_ledger.settle_behind(request, key, spent) {
            self.schedule_settle_flush();
        }
        let mut settled = Ok(());
        let scopes = self.period_scopes(agent);
        if !scopes.is_empty() {
            let periods = PeriodLedger::new(self.stores.records.clone());
            for (scope, _) in scopes {
                let done = periods.settle(&scope, key, spent, now).await;
                if settled.is_ok() {
                    settled = done;
                }
            }
        }
        for waiter in std::mem::take(&mut *lock(&self.settle_waiters)) {
            let _ = waiter.send(());
        }
        settled
    }

    /// Schedules a flush of the settlements made behind [`SETTLE_FLUSH_AFTER`] from now, unless
    /// one is scheduled already; [`flush_settlements_now`](Self::flush_settlements_now) makes it
    /// run at once.
    fn schedule_settle_flush(&self) {
        let rx = {
            let mut slot = lock(&self.settle_flush);
            if slot.is_some() {
                return;
            }
            let (tx, rx) = oneshot::channel();
            *slot = Some(tx);
            rx
        };
        let (ledger, clock, slot) = (self.ledger(), self.clock.clone(), self.settle_flush.clone());
        // Its deadline counts from now, not from when the flush is first polled.
        let delay = clock.sleep(SETTLE_FLUSH_AFTER);
        let counted = self.background.enter();
        self.loops.spawn(Box::pin(async move {
            futures::future::select(rx, delay).await;
            // Cleared before the flush: a settlement made during it schedules the next one.
            lock(&slot).take();
            if let Err(e) = ledger.flush_all(clock.now()).await {
                // Still counted in this process, and the records keep the reservations: the
                // requests' next writes, or the next flush, store the settlements.
                tracing::warn!("model calls' settlements were not stored yet: {e}");
            }
            drop(counted);
        }));
    }

    /// Runs the scheduled flush of settlements made behind at once (at shutdown).
    pub(crate) fn flush_settlements_now(&self) {
        if let Some(now) = lock(&self.settle_flush).take() {
            let _ = now.send(());
        }
    }

    /// Charges `n` tool calls of `agent` to `request` and to the agent's and organization's
    /// periods: the request first, then each period (one that refuses leaves the earlier charges:
    /// counted, never less than was run).
    pub(crate) async fn charge_tools(
        &self,
        agent: &AgentId,
        request: &EnvelopeId,
        n: u64,
    ) -> Result<Result<(), LimitReached>, StoreError> {
        if !self.limits_in_use() || n == 0 {
            return Ok(Ok(()));
        }
        let now = self.clock.now();
        let spent = Spend::tool_calls(n);
        if let Err(reached) = self
            .ledger()
            .charge(request, spent, &self.settings.limits, now)
            .await?
        {
            return Ok(Err(reached));
        }
        let periods = PeriodLedger::new(self.stores.records.clone());
        for (scope, limits) in self.period_scopes(agent) {
            if let Err(reached) = periods.charge(&scope, spent, &limits, now).await? {
                return Ok(Err(reached));
            }
        }
        Ok(Ok(()))
    }

    /// Whether this failure (`teller`: the message it answers) is the one to tell the user about
    /// the request's limit (once per request, again when the same failure runs again after a
    /// crash); a store that fails says yes (telling twice beats never).
    pub(crate) async fn tell_limit_once(&self, request: &EnvelopeId, teller: &EnvelopeId) -> bool {
        self.ledger()
            .tell_once(request, teller.as_str(), self.clock.now())
            .await
            .unwrap_or(true)
    }
}

/// Spend and limits, for the application and operators (see [`crate::limits`]).
impl crate::org::Organization {
    /// What request `request` (the id [`deliver`](Self::deliver) answered) spent and holds
    /// reserved, its limits, and whether it reached one; `None` when it spent nothing under
    /// limits (spend is kept only while some limit is in use).
    ///
    /// # Errors
    /// As the store.
    pub async fn request_spend(
        &self,
        request: &EnvelopeId,
    ) -> Result<Option<crate::limits::LedgerEntry>, OrgError> {
        Ok(self.inner.ledger().get(request).await?)
    }

    /// What a period scope (an agent's or the organization's) spent in its period up to now,
    /// reservations included; zero when nothing was spent in it.
    ///
    /// # Errors
    /// [`OrgError::Invalid`] for [`Scope::Request`] (see [`request_spend`](Self::request_spend));
    /// as the store.
    pub async fn period_spend(&self, scope: &Scope) -> Result<Spend, OrgError> {
        if matches!(scope, Scope::Request) {
            return Err(OrgError::Invalid(InvalidInput::new(
                "scope",
                "a request's spend is read with request_spend",
            )));
        }
        let periods = PeriodLedger::new(self.inner.stores.records.clone());
        Ok(periods
            .get(scope, self.inner.clock.now())
            .await?
            .map(|e| e.committed())
            .unwrap_or_default())
    }

    /// Replaces a request's own limits (an operator raising or lowering them; they bind with
    /// `[settings.limits]`, the tighter of the two). A request that reached a limit may spend
    /// again, and its user is told again if it reaches one; resume its work with
    /// [`resume_request`](Self::resume_request).
    ///
    /// # Errors
    /// As the store.
    pub async fn set_request_limits(
        &self,
        request: &EnvelopeId,
        limits: Limits,
    ) -> Result<(), OrgError> {
        self.inner.use_limits().await?;
        let now = self.inner.clock.now();
        Ok(self.inner.ledger().set_limits(request, limits, now).await?)
    }

    /// Sets (`Some`) or clears (`None`) an operator's limits for an agent's or the organization's
    /// period (`scope`), from its next model or tool call on: they replace what
    /// `[settings.agent_limits]`, the agent's `limits` or `[settings.org_limits]` say for that
    /// scope, and a scope the configuration does not limit is checked too. Stored with the
    /// scope's spend: kept across a restart, and read by every process at its next call in a
    /// scope it already checks (a scope only an operator limited is picked up by another
    /// process when it is built).
    ///
    /// # Errors
    /// [`OrgError::Invalid`] for [`Scope::Request`] (see
    /// [`set_request_limits`](Self::set_request_limits)) or an agent not in the organization;
    /// as the store.
    pub async fn set_period_limits(
        &self,
        scope: &Scope,
        limits: Option<Limits>,
    ) -> Result<(), OrgError> {
        match scope {
            Scope::Request => {
                return Err(OrgError::Invalid(InvalidInput::new(
                    "scope",
                    "a request's limits are set with set_request_limits",
                )));
            }
            Scope::Agent { agent, .. } if self.inner.config.agent(agent.as_str()).is_none() => {
                return Err(OrgError::Invalid(InvalidInput::new(
                    "agent",
                    format!("no agent {agent} in the organization"),
                )));
            }
            _ => {}
        }
        self.inner.use_limits().await?;
        let now = self.inner.clock.now();
        PeriodLedger::new(self.inner.stores.records.clone())
            .set_limits(scope, limits, now)
            .await?;
        let mut known = lock(&self.inner.operator_periods);
        if !known.contains(scope) {
            known.push(scope.clone());
        }
        Ok(())
    }

    /// An operator's limits for a period scope, as stored (`None`: the configuration's apply).
    ///
    /// # Errors
    /// As the store.
    pub async fn period_limits(&self, scope: &Scope) -> Result<Option<Limits>, OrgError> {
        let periods = PeriodLedger::new(self.inner.stores.records.clone());
        Ok(periods
            .get(scope, self.inner.clock.now())
            .await?
            .and_then(|e| e.limits))
    }

    /// Resumes a request that stopped at a limit (after
    /// [`set_request_limits`](Self::set_request_limits)): delivers `message` to `agent` as part
    /// of the request (its spend counts against the request's limits, its delegations belong to
    /// the request's tree). The agent sees the request's history, the failures included, and
    /// carries on from there.
    ///
    /// # Errors
    /// [`DeliveryError::Invalid`](crate::DeliveryError::Invalid) when the request has no spend
    /// on record; as [`deliver`](Self::deliver) otherwise.
    pub async fn resume_request(
        &self,
        agent: &str,
        request: &EnvelopeId,
        message: crate::org::InboundMessage,
    ) -> Result<EnvelopeId, crate::DeliveryError> {
        if self.inner.ledger().get(request).await?.is_none() {
            return Err(crate::DeliveryError::Invalid(InvalidInput::new(
                "request",
                format!("no request {request} with spend on record"),
            )));
        }
        self.deliver_as(agent, message, Some(request.clone())).await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::config::OrgConfig;
    use crate::limits::{CallEstimate, LedgerEntry};
    use crate::testing::FnLlm;
    use crate::{ChatResponse, ManualClock, Organization, Stores};

    /// What a settled call spent in these tests: one call, 100 tokens.
    fn one_call_of_100_tokens() -> Spend {
        Spend {
            input_tokens: 90,
            output_tokens: 10,
            total_tokens: 100,
            model_calls: 1,
            ..Spend::default()
        }
    }

    /// A call of 600 tokens at most (400 in, 200 out).
    const CALL_OF_600: CallEstimate = CallEstimate {
        input: 400,
        max_output: 200,
        price: None,
    };

    /// An organization of agents `a` and `b` on `stores` under a request limit of 1,000 tokens
    /// (a manual clock that never moves), with `a`'s call `a:1` of `request` reserved: 600 of
    /// the 1,000, so another such call fits only once it settles.
    async fn with_a_call_reserved(stores: Stores, request: &EnvelopeId) -> Organization {
        let config = OrgConfig::from_toml_str(
            "[settings.limits]\ntotal_tokens = 1000\n[[agents]]\nid = \"a\"\n[[agents]]\nid = \"b\"\n",
        )
        .unwrap();
        let org = Organization::builder(config)
            .stores(stores)
            .llm(Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("ok")))))
            .clock(Arc::new(ManualClock::new(1_000_000)))
            .build()
            .await
            .unwrap();
        let first = org
            .inner
            .reserve_call(&AgentId::parse("a").unwrap(), request, "a:1", CALL_OF_600)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first.map(|s| s.total_tokens), Some(600));
        org
    }

    /// A request begun by `Organization::deliver` on a store whose cells store images (SQLite) is
    /// marked new: its reservations are stored without one read of the store; a request the
    /// organization did not begin (an id it never made) is read once.
    #[tokio::test]
    async fn a_delivered_request_is_reserved_without_reading_the_store() {
        use std::sync::atomic::Ordering;
        let images = Arc::new(crate::records::testkit::MemoryImages::default());
        let records = crate::records::testkit::stored_cells(
            crate::records::testkit::records_only(Stores::memory().records.clone()),
            images.clone(),
        );
        let stores = Stores {
            records,
            ..Stores::memory()
        };
        let org = with_a_call_reserved(stores, &EnvelopeId::new("req-not-ours")).await;
        assert_eq!(
            images.loads.load(Ordering::SeqCst),
            1,
            "an id not made here"
        );
        org.start_all().await.unwrap();
        let mut replies = org.take_replies().unwrap();
        let request = org
            .deliver("a", crate::InboundMessage::new("portal", "u", "hi"))
            .await
            .unwrap();
        let reply = futures::StreamExt::next(&mut replies).await.unwrap();
        assert_eq!(reply.content, "ok");
        org.wait_idle(&AgentId::parse("a").unwrap()).await.unwrap();
        let entry = org.request_spend(&request).await.unwrap().unwrap();
        assert_eq!(entry.settled.model_calls, 1, "{entry:?}");
        assert_eq!(
            images.loads.load(Ordering::SeqCst),
            1,
            "the delivered request was read from the store"
        );
        org.shutdown().await.unwrap();
    }

    /// On the memory store (typed cells) a settlement is stored in the request's entry at once:
    /// the entry shows it settled, and no flush is scheduled for it.
    #[tokio::test]
    async fn on_the_memory_store_a_settlement_is_stored_at_once_and_schedules_no_flush() {
        let request = EnvelopeId::new("req-at-once");
        let stores = Stores::memory();
        let records = stores.records.clone();
        let org = with_a_call_reserved(stores, &request).await;
        let host = org.inner.clone();
        host.settle_call(
            &AgentId::parse("a").unwrap(),
            &request,
            "a:1",
            one_call_of_100_tokens(),
        )
        .await
        .unwrap();
        assert!(
            lock(&host.settle_flush).is_none(),
            "a flush was scheduled for a settlement already stored"
        );
        // Read from the store's cell (nothing is pending in this ledger to add to it).
        let entry = org.request_spend(&request).await.unwrap().unwrap();
        assert_eq!(
            (entry.settled.total_tokens, entry.reserved.len()),
            (100, 0),
            "the entry holds the settlement"
        );
        assert!(
            records
                .get(crate::limits::NAMESPACE, request.as_str())
                .await
                .unwrap()
                .is_none(),
            "kept in the cell, not as a record"
        );
    }

    /// A call kept out only by another call's open reservation waits for it, and the
    /// settlement in this process wakes it at once: the clock is manual and never moves, so
    /// the 250 ms poll never fires and only the wake-up can let it through.
    #[tokio::test]
    async fn a_settlement_wakes_a_call_waiting_for_room() {
        let request = EnvelopeId::new("req-wake");
        let org = with_a_call_reserved(Stores::memory(), &request).await;
        let host = org.inner.clone();
        let (a, b) = (AgentId::parse("a").unwrap(), AgentId::parse("b").unwrap());
        let call = CALL_OF_600;
        let mut events = org.subscribe();
        let waiting = tokio::spawn({
            let (host, request, b) = (host.clone(), request.clone(), b.clone());
            async move { host.reserve_call(&b, &request, "b:1", call).await }
        });
        // It found the request busy and waits for a settlement (positive condition, bounded).
        tokio::time::timeout(Duration::from_secs(10), async {
            while lock(&host.settle_waiters).is_empty() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the second call never waited for the first's settlement");
        assert!(!waiting.is_finished());
        // An event says it waits, for which request and limit, on which agent.
        let said = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let event = events.recv().await.unwrap();
                if let EventKind::LimitWait { request: r, over } = &event.kind {
                    break (event.agent.clone(), r.clone(), *over);
                }
            }
        })
        .await
        .expect("no event said the call waits");
        assert_eq!(said.0, b);
        assert_eq!(said.1, request);
        assert_eq!(said.2.limit, crate::limits::Limit::TotalTokens);
        let spent = one_call_of_100_tokens();
        host.settle_call(&a, &request, "a:1", spent).await.unwrap();
        let second = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("the settlement did not wake the waiting call")
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(second.map(|s| s.total_tokens), Some(600));
        let entry = org.request_spend(&request).await.unwrap().unwrap();
        assert_eq!(entry.settled.total_tokens, 100);
        assert_eq!(entry.committed().total_tokens, 700);
        org.shutdown().await.unwrap();
    }

    /// A settlement made behind is stored by the next reservation of this host (another
    /// request's, in writes sent together), else once [`SETTLE_FLUSH_AFTER`] passed on the
    /// organization's clock, else at shutdown; until then the record holds the reservation.
    #[tokio::test]
    async fn a_settlement_rides_on_the_next_reservation_else_is_flushed_after_its_delay() {
        let config = OrgConfig::from_toml_str(
            "[settings.limits]\ntotal_tokens = 100000\n[[agents]]\nid = \"a\"\n",
        )
        .unwrap();
        // The ledger written as records (as on a durable store), to see what they hold.
        let mut stores = Stores::memory();
        stores.records = crate::records::testkit::records_only(stores.records.clone());
        let records = stores.records.clone();
        let clock = Arc::new(ManualClock::new(1_000_000));
        let org = Organization::builder(config)
            .stores(stores)
            .llm(Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("ok")))))
            .clock(clock.clone())
            .build()
            .await
            .unwrap();
        let host = org.inner.clone();
        let a = AgentId::parse("a").unwrap();
        let call = CallEstimate {
            input: 400,
            max_output: 200,
            price: None,
        };
        let spent = one_call_of_100_tokens();
        // What the record holds: (settled tokens, open reservations).
        let stored = |request: &'static str| {
            let records = records.clone();
            async move {
                let record = records
                    .get(crate::limits::NAMESPACE, request)
                    .await
                    .unwrap()
                    .expect("the request's record");
                let entry = record.decode::<LedgerEntry>().unwrap().value;
                (entry.settled.total_tokens, entry.reserved.len())
            }
        };
        let settle_one = |request: &'static str, key: &'static str| {
            let host = host.clone();
            let a = a.clone();
            async move {
                let request = EnvelopeId::new(request);
                host.reserve_call(&a, &request, key, call)
                    .await
                    .unwrap()
                    .unwrap();
                host.settle_call(&a, &request, key, spent).await.unwrap();
            }
        };
        settle_one("r1", "a:1").await;
        // Counted at once in this process; the record still holds the reservation.
        let entry = org
            .request_spend(&EnvelopeId::new("r1"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(entry.settled.total_tokens, 100);
        assert_eq!(stored("r1").await, (0, 1));
        // The next reservation, of another request, carries it.
        host.reserve_call(&a, &EnvelopeId::new("r2"), "a:2", call)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stored("r1").await, (100, 0));
        assert_eq!(stored("r2").await, (0, 1));
        host.settle_call(&a, &EnvelopeId::new("r2"), "a:2", spent)
            .await
            .unwrap();
        // No reservation follows: the delayed flush stores it once its time passed (the clock is
        // manual: it has not yet).
        assert_eq!(stored("r2").await, (0, 1));
        clock.advance(SETTLE_FLUSH_AFTER);
        tokio::time::timeout(Duration::from_secs(10), async {
            while stored("r2").await != (100, 0) {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the settlement was not stored once its delay passed");
        // Shutdown stores what waits, without the clock moving.
        settle_one("r3", "a:3").await;
        assert_eq!(stored("r3").await, (0, 1));
        tokio::time::timeout(Duration::from_secs(10), org.shutdown())
            .await
            .expect("shutdown waited for the delayed flush")
            .unwrap();
        assert_eq!(stored("r3").await, (100, 0));
    }

    /// In one process, the last open reservation of this host settling between a call's refusal
    /// and its look at what is open leaves no reservation of the host open: the room is not a
    /// crashed run's, and the call, tried once more, counts the settlement and is made. (Its
    /// release of the refused reservation reads the record; the settlement is made while that
    /// read is held, so the look comes after it, every time.)
    #[tokio::test]
    async fn a_settlement_between_a_refusal_and_its_look_lets_the_call_through() {
        let request = EnvelopeId::new("req-race");
        let (reached, at_read) = oneshot::channel();
        let (go, hold) = oneshot::channel();
        let stores = Stores::memory();
        // The refused call reads the record once (its refusal decided on the record), then
        // again when it releases what it did not reserve: that second read is held, once read,
        // until the test lets it go.
        let reads = std::sync::atomic::AtomicUsize::new(0);
        let held = std::sync::Mutex::new(Some((reached, hold)));
        let key = request.as_str().to_owned();
        let records = Arc::new(crate::records::testkit::AfterGet {
            inner: stores.records.clone(),
            cells: None,
            after: Box::new(move |namespace, read| {
                let this = namespace == crate::limits::NAMESPACE
                    && read == key
                    && reads.fetch_add(1, Ordering::SeqCst) + 1 == 2;
                let held = if this { lock(&held).take() } else { None };
                Box::pin(async move {
                    if let Some((reached, go)) = held {
                        let _ = reached.send(());
                        let _ = go.await;
                    }
                })
            }),
        });
        // 600 of 1,000 reserved by this host: a call of 600 is kept out until it settles.
        let org = with_a_call_reserved(Stores { records, ..stores }, &request).await;
        let host = org.inner.clone();
        let (a, b) = (AgentId::parse("a").unwrap(), AgentId::parse("b").unwrap());
        let call = CALL_OF_600;
        let second = tokio::spawn({
            let (host, request, b) = (host.clone(), request.clone(), b.clone());
            async move { host.reserve_call(&b, &request, "b:1", call).await }
        });
        tokio::time::timeout(Duration::from_secs(10), at_read)
            .await
            .expect("the refused call never released its reservation")
            .unwrap();
        // Refused, and between the refusal and its look at what is open: the last open
        // reservation of the host settles.
        host.settle_call(&a, &request, "a:1", one_call_of_100_tokens())
            .await
            .unwrap();
        assert!(lock(&host.reserving).is_empty());
        go.send(()).unwrap();
        let granted = tokio::time::timeout(Duration::from_secs(10), second)
            .await
            .expect("the call did not end")
            .unwrap()
            .unwrap()
            .expect("the call was refused as if the room were a crashed run's");
        assert_eq!(granted.map(|s| s.total_tokens), Some(600));
        let entry = org.request_spend(&request).await.unwrap().unwrap();
        assert_eq!(entry.settled.total_tokens, 100);
        assert_eq!(entry.committed().total_tokens, 700);
        org.shutdown().await.unwrap();
    }
}
