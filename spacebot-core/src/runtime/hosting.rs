//! Hosting agents under a [`Placement`]: the loops that acquire and renew this process's leases,
//! fence agents whose lease was lost or not renewed in time, and wake the agents hosted here when
//! another process stored something for them.
//!
//! Four background loops per organization, started by `start_all`, each a task of its own:
//!
//! - the **renewer** renews every lease held here with one [`Placement::renew`] call per round,
//!   at least three times per `lease - margin` window, sooner again after a failure. It does
//!   nothing else (no starts, no store reads), so a slow start or a busy store cannot delay a
//!   renewal; a call that has not answered by the first fencing deadline is given up and sent
//!   again;
//! - the **keeper** acquires free agents up to the capacity, starting their loops (the start hands
//!   over their stored deliveries; the task loop's start-up recovery fails only claims of this
//!   process or expired ones);
//! - the **watchdog** stops (fences) an agent whose renewal has not succeeded by its deadline
//!   (`sent + lease - margin`, by this process's clock), independently of the renewer: a renewal
//!   hanging on a dead connection cannot delay it;
//! - the **listener** takes wake-up hints, and every check interval looks at each hosted agent
//!   anyway: stored deliveries not in the queue yet are handed over, the task loop is rung.
//!
//! **Back-pressure**: while a renewal is overdue (a lease's last successful renewal is more than
//! half of `lease - margin` old, or the last round failed) this process is *strained*: the keeper
//! acquires no agent and the listener acts on no wake-up hint (only its periodic check hands
//! stored deliveries over and rings task loops), so the process takes new work more slowly while
//! its leases are at risk, and the renewals get the database (and the machine) first.
//!
//! Without a placement none of this runs and every agent is local (embedded backends).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use futures::future::{AbortHandle, Abortable, Either};

use crate::event::EventKind;
use crate::ids::AgentId;
use crate::placement::{Placement, PlacementLease, PlacementOptions};
use crate::runtime::agent::report_error;
use crate::runtime::host::{AgentRuntime, Host, Slot};
use crate::time::Timestamp;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// One agent hosted here.
#[derive(Debug, Clone)]
struct Held {
    /// The lease as last granted (its epoch: a renewal must find it unchanged).
    lease: PlacementLease,
    /// When the last successful renewal (or the acquisition) was sent, by this process's clock.
    sent: Timestamp,
    /// The deadline (this process's clock) by which the lease must have been renewed again, or
    /// the agent is fenced: `sent + lease - margin`.
    deadline: Timestamp,
}

/// This process's part in placement.
#[derive(Debug)]
pub(crate) struct Hosting {
    pub(crate) placement: Arc<dyn Placement>,
    pub(crate) options: PlacementOptions,
    /// Agents hosted here, each with its lease and fencing deadline.
    held: Mutex<HashMap<AgentId, Held>>,
    /// Agents being fenced right now: not started again until their old loop ended.
    fencing: Mutex<HashSet<AgentId>>,
    /// The background loops, aborted at shutdown.
    loops: Mutex<Vec<AbortHandle>>,
    started: AtomicBool,
    /// Set while the last renewal round failed (see the module's back-pressure).
    renewal_failed: AtomicBool,
    /// Leases lost here since the start (fenced: taken, expired or not renewed in time).
    losses: AtomicU64,
}

impl Hosting {
    pub(crate) fn new(placement: Arc<dyn Placement>, options: PlacementOptions) -> Self {
        Self {
            placement,
            options,
            held: Mutex::default(),
            fencing: Mutex::default(),
            loops: Mutex::default(),
            started: AtomicBool::new(false),
            renewal_failed: AtomicBool::new(false),
            losses: AtomicU64::new(0),
        }
    }

    /// The agents hosted here now, sorted.
    pub(crate) fn hosted(&self) -> Vec<AgentId> {
        let mut agents: Vec<AgentId> = lock(&self.held).keys().cloned().collect();
        agents.sort();
        agents
    }

    pub(crate) fn is_hosted(&self, agent: &AgentId) -> bool {
        lock(&self.held).contains_key(agent)
    }

    /// The fencing deadline of a lease granted to a call sent at `sent`.
    fn deadline(&self, sent: Timestamp) -> Timestamp {
        sent.plus(self.window())
    }

    /// `lease - margin`: how long a granted lease may be relied on here.
    fn window(&self) -> Duration {
        self.options.lease.saturating_sub(self.options.margin)
    }

    /// How often the leases are renewed: `renew_interval`, and at least three times per window
    /// (two renewals may fail before the fence).
    fn renew_every(&self) -> Duration {
        self.options
            .renew_interval
            .min(self.window() / 3)
            .max(Duration::from_millis(1))
    }

    /// How soon a failed renewal round is tried again.
    fn retry_after(&self) -> Duration {
        (self.renew_every() / 4).max(Duration::from_millis(1))
    }

    /// How often the watchdog looks at the deadlines at most.
    fn fence_tick(&self) -> Duration {
        (self.options.margin / 4)
            .min(self.options.renew_interval)
            .max(Duration::from_millis(1))
    }

    fn may_host(&self, agent: &AgentId) -> bool {
        self.options
            .agents
            .as_ref()
            .is_none_or(|set| set.contains(agent))
    }

    /// Whether this process should take no new work now: the last renewal round failed, or a
    /// lease's last successful renewal is older than half the window (a renewal is overdue).
    pub(crate) fn strained(&self, now: Timestamp) -> bool {
        if self.renewal_failed.load(Ordering::Acquire) {
            return true;
        }
        let half = self.window() / 2;
        lock(&self.held).values().any(|h| now >= h.sent.plus(half))
    }

    /// Leases lost here since the start.
    pub(crate) fn losses(&self) -> u64 {
        self.losses.load(Ordering::Acquire)
    }
}

/// Starts the hosting loops (once): one acquisition round runs first, so the agents this process
/// could take are started when `start_all` returns.
pub(crate) async fn start(org: &Arc<Host>, hosting: &Arc<Hosting>) {
    if hosting.started.swap(true, Ordering::AcqRel) {
        return;
    }
    acquire_round(org, hosting).await;
    let loops: [futures::future::BoxFuture<'static, ()>; 4] = [
        Box::pin(renewer(org.clone(), hosting.clone())),
        Box::pin(keeper(org.clone(), hosting.clone())),
        Box::pin(watchdog(org.clone(), hosting.clone())),
        Box::pin(listener(org.clone(), hosting.clone())),
    ];
    for future in loops {
        let (handle, registration) = AbortHandle::new_pair();
        lock(&hosting.loops).push(handle);
        org.spawner.spawn(Box::pin(async move {
            let _ = Abortable::new(future, registration).await;
        }));
    }
}

/// A clean shutdown: stops the hosting loops and every agent hosted here, then releases their
/// leases so that other processes take them over at once.
pub(crate) async fn shutdown(org: &Arc<Host>, hosting: &Arc<Hosting>) {
    for handle in lock(&hosting.loops).drain(..) {
        handle.abort();
    }
    hosting.started.store(false, Ordering::Release);
    let hosted: Vec<AgentId> = lock(&hosting.held).drain().map(|(a, _)| a).collect();
    for agent in hosted {
        if let Err(e) = org.stop_for_hand_over(&agent).await {
            report_error(org, &agent, None, format!("not stopped: {e}"));
        }
        if let Err(e) = hosting
            .placement
            .release(&agent, &hosting.options.process)
            .await
        {
            report_error(
                org,
                &agent,
                None,
                format!("lease not released (it expires instead): {e}"),
            );
        }
    }
}

/// Renews the leases held here, on a task of its own: a round every `renew_every` (measured from
/// the start of the last one: a slow round does not push the next one later), a failed one again
/// after a quarter of that.
async fn renewer(org: Arc<Host>, hosting: Arc<Hosting>) {
    loop {
        let began = org.clock.now();
        let renewed = renew_round(&org, &hosting).await;
        hosting.renewal_failed.store(!renewed, Ordering::Release);
        let every = if renewed {
            hosting.renew_every()
        } else {
            hosting.retry_after()
        };
        let spent = elapsed(began, org.clock.now());
        org.clock
            .sleep(every.saturating_sub(spent).max(Duration::from_millis(1)))
            .await;
    }
}

fn elapsed(from: Timestamp, to: Timestamp) -> Duration {
    Duration::from_millis(u64::try_from(to.0.saturating_sub(from.0)).unwrap_or(0))
}

/// One renewal round: every lease held here in one [`Placement::renew`] call, given up at the
/// first fencing deadline (the watchdog has fenced that agent by then; the others are renewed by
/// the next call). Leases the table no longer grants are fenced. `false` when the call failed.
async fn renew_round(org: &Arc<Host>, hosting: &Arc<Hosting>) -> bool {
    let inner = org;
    let (held, first_deadline): (Vec<PlacementLease>, Option<Timestamp>) = {
        let held = lock(&hosting.held);
        (
            held.values().map(|h| h.lease.clone()).collect(),
            held.values().map(|h| h.deadline).min(),
        )
    };
    let Some(first_deadline) = first_deadline else {
        return true;
    };
    let sent = inner.clock.now();
    let budget = elapsed(sent, first_deadline).max(Duration::from_millis(1));
    let call = hosting.placement.renew(&held, hosting.options.lease, sent);
    let answer = match futures::future::select(call, inner.clock.sleep(budget)).await {
        Either::Left((answer, _)) => answer,
        Either::Right(_) => {
            for lease in &held {
                report_error(
                    inner,
                    &lease.agent,
                    None,
                    format!("lease not renewed: no answer within {budget:?}"),
                );
            }
            return false;
        }
    };
    let renewed = match answer {
        Ok(renewed) => renewed,
        Err(e) => {
            // The watchdog fences the agents if no renewal succeeds by their deadlines.
            for lease in &held {
                report_error(inner, &lease.agent, None, format!("lease not renewed: {e}"));
            }
            return false;
        }
    };
    let mut lost = Vec::new();
    {
        let mut map = lock(&hosting.held);
        for (asked, granted) in held.iter().zip(renewed) {
            let Some(h) = map.get_mut(&asked.agent) else {
                continue;
            };
            if h.lease.epoch != asked.epoch {
                continue;
            }
            match granted {
                Some(lease) => {
                    h.lease = lease;
                    if sent > h.sent {
                        h.sent = sent;
                        h.deadline = h.deadline.max(hosting.deadline(sent));
                    }
                }
                None => {
                    map.remove(&asked.agent);
                    lost.push(asked.agent.clone());
                }
            }
        }
    }
    for agent in lost {
        fence(
            org,
            hosting,
            &agent,
            "its lease was lost (taken by another process, or expired)",
        )
        .await;
    }
    true
}

/// Acquires free agents, on a task of its own, every `renew_interval`.
async fn keeper(org: Arc<Host>, hosting: Arc<Hosting>) {
    loop {
        org.clock.sleep(hosting.options.renew_interval).await;
        acquire_round(&org, &hosting).await;
    }
}

/// Acquires free agents up to the capacity (at most `acquire_per_round`) and starts them; nothing
/// while this process is strained (a renewal overdue).
async fn acquire_round(org: &Arc<Host>, hosting: &Arc<Hosting>) {
    let inner = org;
    let options = &hosting.options;
    if hosting.strained(inner.clock.now()) {
        return;
    }
    let mut candidates: Vec<AgentId> = inner
        .config
        .agents
        .iter()
        .map(|a| a.id.clone())
        .filter(|a| hosting.may_host(a))
        .collect();
    candidates.sort();
    let mut acquired = 0;
    for agent in candidates {
        if lock(&hosting.held).len() >= options.capacity || acquired >= options.acquire_per_round {
            break;
        }
        if hosting.is_hosted(&agent) || lock(&hosting.fencing).contains(&agent) {
            continue;
        }
        if !matches!(inner.slot(&agent), Some(Slot::Stopped(_))) {
            continue;
        }
        let sent = inner.clock.now();
        match hosting
            .placement
            .acquire(&agent, &options.process, options.lease, sent)
            .await
        {
            Ok(Some(lease)) => {
                let deadline = hosting.deadline(sent);
                if inner.clock.now() >= deadline {
                    continue;
                }
                lock(&hosting.held).insert(
                    agent.clone(),
                    Held {
                        lease,
                        sent,
                        deadline,
                    },
                );
                acquired += 1;
                if let Err(e) = org.start_local(&agent).await {
                    lock(&hosting.held).remove(&agent);
                    report_error(inner, &agent, None, format!("not started here: {e}"));
                    let _ = hosting.placement.release(&agent, &options.process).await;
                    continue;
                }
                let mut event = inner.event(
                    &agent,
                    EventKind::AgentPlaced {
                        process: options.process.to_string(),
                    },
                );
                event.channel = None;
                inner.emit(event);
            }
            Ok(None) => {}
            Err(e) => {
                report_error(inner, &agent, None, format!("lease not acquired: {e}"));
                break;
            }
        }
    }
}

async fn watchdog(org: Arc<Host>, hosting: Arc<Hosting>) {
    loop {
        let now = org.clock.now();
        let due: Vec<AgentId> = {
            let mut held = lock(&hosting.held);
            let due: Vec<AgentId> = held
                .iter()
                .filter(|(_, h)| h.deadline <= now)
                .map(|(a, _)| a.clone())
                .collect();
            for agent in &due {
                held.remove(agent);
            }
            due
        };
        for agent in due {
            fence(
                &org,
                &hosting,
                &agent,
                "its lease was not renewed in time (the placement table is unreachable)",
            )
            .await;
        }
        let next = lock(&hosting.held).values().map(|h| h.deadline).min();
        let tick = hosting.fence_tick();
        let wait = next.map_or(tick, |d| {
            elapsed(now, d).clamp(Duration::from_millis(1), tick)
        });
        org.clock.sleep(wait).await;
    }
}

/// Stops hosting `agent` here: its loop is aborted (the running turn is not committed; what it
/// consumed stays in the store for the next host), its queue closed (every envelope in it is in the
/// store), its task loop woken to end.
async fn fence(org: &Arc<Host>, hosting: &Arc<Hosting>, agent: &AgentId, reason: &str) {
    hosting.losses.fetch_add(1, Ordering::AcqRel);
    lock(&hosting.fencing).insert(agent.clone());
    org.fence_agent(agent).await;
    lock(&hosting.fencing).remove(agent);
    org.emit(org.event(
        agent,
        EventKind::PlacementLost {
            process: hosting.options.process.to_string(),
            reason: reason.to_string(),
        },
    ));
}

async fn listener(org: Arc<Host>, hosting: Arc<Hosting>) {
    let check = hosting.options.check_interval;
    loop {
        let mut hints = hosting.placement.wakeups(&hosting.options.process);
        loop {
            let sleep = org.clock.sleep(check);
            match futures::future::select(hints.next(), sleep).await {
                Either::Left((Some(agent), _)) => wake_local(&org, &hosting, &agent).await,
                Either::Left((None, _)) => {
                    // The connection dropped: check everything, subscribe again after a while.
                    check_all(&org, &hosting).await;
                    org.clock.sleep(check).await;
                    break;
                }
                Either::Right(_) => check_all(&org, &hosting).await,
            }
        }
    }
}

/// The periodic check: runs even while strained (the back-pressure slows the taking of new work
/// to one check interval, it never stops it).
async fn check_all(inner: &Arc<Host>, hosting: &Arc<Hosting>) {
    for agent in hosting.hosted() {
        hand_over_to(inner, hosting, &agent).await;
    }
}

/// Hands stored deliveries the queue does not hold yet to a hosted agent, and rings its task loop.
/// On a hint: nothing while this process is strained (see the module's back-pressure); the
/// periodic check hands it over.
async fn wake_local(inner: &Arc<Host>, hosting: &Hosting, agent: &AgentId) {
    if hosting.strained(inner.clock.now()) {
        return;
    }
    hand_over_to(inner, hosting, agent).await;
}

async fn hand_over_to(inner: &Arc<Host>, hosting: &Hosting, agent: &AgentId) {
    if !hosting.is_hosted(agent) {
        return;
    }
    if let Some(Slot::Running(rt)) = inner.slot(agent) {
        hand_over_stored(inner, &rt).await;
        rt.ring();
    }
}

/// Queues the envelopes stored for a running agent that its queue and its running turn do not
/// hold. Read twice: an envelope a turn committed (and forgot) between the first read and its
/// admission here is gone from the second read, so it is never queued again.
pub(crate) async fn hand_over_stored(inner: &Host, rt: &AgentRuntime) {
    let first = match inner.stores.deliveries.pending(rt.id()).await {
        Ok(p) => p,
        Err(e) => {
            report_error(inner, rt.id(), None, format!("pending deliveries: {e}"));
            return;
        }
    };
    let admitted: Vec<_> = first.into_iter().filter(|e| rt.admit(&e.id)).collect();
    if admitted.is_empty() {
        return;
    }
    let still: HashSet<_> = match inner.stores.deliveries.pending(rt.id()).await {
        Ok(p) => p.into_iter().map(|e| e.id).collect(),
        Err(e) => {
            let ids: Vec<_> = admitted.iter().map(|e| e.id.clone()).collect();
            rt.forget(&ids);
            report_error(inner, rt.id(), None, format!("pending deliveries: {e}"));
            return;
        }
    };
    for envelope in admitted {
        if !still.contains(&envelope.id) {
            rt.forget(std::slice::from_ref(&envelope.id));
            continue;
        }
        if let Err((_, envelope)) = rt.queue.try_push(envelope) {
            // Full or closing: the loop takes it from the store when its queue runs empty.
            rt.forget(std::slice::from_ref(&envelope.id));
            rt.pending.store(true, Ordering::Release);
        }
    }
}
