//! Hosting agents under a [`Placement`]: the loops that acquire and renew this process's leases,
//! fence agents whose lease was lost or not renewed in time, and wake the agents hosted here when
//! another process stored something for them.
//!
//! Three background loops per organization, started by `start_all`:
//!
//! - the **keeper** renews every lease held here and acquires free agents up to the capacity,
//!   starting their loops (the start hands over their stored deliveries; the task loop's start-up
//!   recovery fails only claims of this process or expired ones);
//! - the **watchdog** stops (fences) an agent whose renewal has not succeeded by its deadline
//!   (`sent + lease - margin`, by this process's clock), independently of the keeper: a renewal
//!   hanging on a dead connection cannot delay it;
//! - the **listener** takes wake-up hints, and every check interval looks at each hosted agent
//!   anyway: stored deliveries not in the queue yet are handed over, the task loop is rung.
//!
//! Without a placement none of this runs and every agent is local (embedded backends).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use futures::future::{AbortHandle, Abortable, Either};

use crate::event::EventKind;
use crate::ids::AgentId;
use crate::org::{AgentRuntime, OrgInner, Organization, Slot};
use crate::placement::{Placement, PlacementOptions};
use crate::runtime::agent::report_error;
use crate::runtime::queue::AgentQueue;
use crate::time::Timestamp;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process's part in placement.
#[derive(Debug)]
pub(crate) struct Hosting {
    pub(crate) placement: Arc<dyn Placement>,
    pub(crate) options: PlacementOptions,
    /// Agents hosted here, each with the deadline (this process's clock) by which its lease must
    /// have been renewed, or it is fenced.
    deadlines: Mutex<HashMap<AgentId, Timestamp>>,
    /// Agents being fenced right now: not started again until their old loop ended.
    fencing: Mutex<HashSet<AgentId>>,
    /// The background loops, aborted at shutdown.
    loops: Mutex<Vec<AbortHandle>>,
    started: AtomicBool,
}

impl Hosting {
    pub(crate) fn new(placement: Arc<dyn Placement>, options: PlacementOptions) -> Self {
        Self {
            placement,
            options,
            deadlines: Mutex::default(),
            fencing: Mutex::default(),
            loops: Mutex::default(),
            started: AtomicBool::new(false),
        }
    }

    /// The agents hosted here now, sorted.
    pub(crate) fn hosted(&self) -> Vec<AgentId> {
        let mut agents: Vec<AgentId> = lock(&self.deadlines).keys().cloned().collect();
        agents.sort();
        agents
    }

    /// The fencing deadline of a lease granted to a call sent at `sent`.
    fn deadline(&self, sent: Timestamp) -> Timestamp {
        sent.plus(self.options.lease.saturating_sub(self.options.margin))
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
}

/// Starts the hosting loops (once): one keeper round runs first, so the agents this process could
/// take are started when `start_all` returns.
pub(crate) async fn start(org: &Organization, hosting: &Arc<Hosting>) {
    if hosting.started.swap(true, Ordering::AcqRel) {
        return;
    }
    keep_round(org, hosting).await;
    let loops: [futures::future::BoxFuture<'static, ()>; 3] = [
        Box::pin(keeper(org.clone(), hosting.clone())),
        Box::pin(watchdog(org.clone(), hosting.clone())),
        Box::pin(listener(org.clone(), hosting.clone())),
    ];
    for future in loops {
        let (handle, registration) = AbortHandle::new_pair();
        lock(&hosting.loops).push(handle);
        org.inner.spawner.spawn(Box::pin(async move {
            let _ = Abortable::new(future, registration).await;
        }));
    }
}

/// A clean shutdown: stops the hosting loops and every agent hosted here, then releases their
/// leases so that other processes take them over at once.
pub(crate) async fn shutdown(org: &Organization, hosting: &Arc<Hosting>) {
    for handle in lock(&hosting.loops).drain(..) {
        handle.abort();
    }
    hosting.started.store(false, Ordering::Release);
    let hosted: Vec<AgentId> = lock(&hosting.deadlines).drain().map(|(a, _)| a).collect();
    for agent in hosted {
        if let Err(e) = org.stop_for_hand_over(&agent).await {
            report_error(&org.inner, &agent, None, format!("not stopped: {e}"));
        }
        if let Err(e) = hosting
            .placement
            .release(&agent, &hosting.options.process)
            .await
        {
            report_error(
                &org.inner,
                &agent,
                None,
                format!("lease not released (it expires instead): {e}"),
            );
        }
    }
}

async fn keeper(org: Organization, hosting: Arc<Hosting>) {
    loop {
        org.inner.clock.sleep(hosting.options.renew_interval).await;
        keep_round(&org, &hosting).await;
    }
}

/// Renews the leases held here, then acquires free agents up to the capacity.
async fn keep_round(org: &Organization, hosting: &Arc<Hosting>) {
    let inner = &org.inner;
    let options = &hosting.options;
    for agent in hosting.hosted() {
        let sent = inner.clock.now();
        match hosting
            .placement
            .acquire(&agent, &options.process, options.lease, sent)
            .await
        {
            Ok(Some(_)) => {
                if let Some(deadline) = lock(&hosting.deadlines).get_mut(&agent) {
                    *deadline = (*deadline).max(hosting.deadline(sent));
                }
            }
            Ok(None) => {
                let removed = lock(&hosting.deadlines).remove(&agent).is_some();
                if removed {
                    fence(
                        org,
                        hosting,
                        &agent,
                        "its lease was taken by another process",
                    )
                    .await;
                }
            }
            // The watchdog fences the agent if no renewal succeeds by its deadline.
            Err(e) => report_error(inner, &agent, None, format!("lease not renewed: {e}")),
        }
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
        if lock(&hosting.deadlines).len() >= options.capacity
            || acquired >= options.acquire_per_round
        {
            break;
        }
        if lock(&hosting.deadlines).contains_key(&agent) || lock(&hosting.fencing).contains(&agent)
        {
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
            Ok(Some(_)) => {
                let deadline = hosting.deadline(sent);
                if inner.clock.now() >= deadline {
                    continue;
                }
                lock(&hosting.deadlines).insert(agent.clone(), deadline);
                acquired += 1;
                if let Err(e) = org.start_local(&agent).await {
                    lock(&hosting.deadlines).remove(&agent);
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

async fn watchdog(org: Organization, hosting: Arc<Hosting>) {
    loop {
        let now = org.inner.clock.now();
        let due: Vec<AgentId> = {
            let mut deadlines = lock(&hosting.deadlines);
            let due: Vec<AgentId> = deadlines
                .iter()
                .filter(|(_, d)| **d <= now)
                .map(|(a, _)| a.clone())
                .collect();
            for agent in &due {
                deadlines.remove(agent);
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
        let next = lock(&hosting.deadlines).values().min().copied();
        let tick = hosting.fence_tick();
        let wait = next.map_or(tick, |d| {
            let ms = u64::try_from(d.0.saturating_sub(now.0)).unwrap_or(0);
            Duration::from_millis(ms).clamp(Duration::from_millis(1), tick)
        });
        org.inner.clock.sleep(wait).await;
    }
}

/// Stops hosting `agent` here: its loop is aborted (the running turn is not committed; what it
/// consumed stays in the store for the next host), its queue closed (every envelope in it is in the
/// store), its task loop woken to end.
async fn fence(org: &Organization, hosting: &Arc<Hosting>, agent: &AgentId, reason: &str) {
    lock(&hosting.fencing).insert(agent.clone());
    org.fence_agent(agent).await;
    lock(&hosting.fencing).remove(agent);
    org.inner.emit(org.inner.event(
        agent,
        EventKind::PlacementLost {
            process: hosting.options.process.to_string(),
            reason: reason.to_string(),
        },
    ));
}

async fn listener(org: Organization, hosting: Arc<Hosting>) {
    let check = hosting.options.check_interval;
    loop {
        let mut hints = hosting.placement.wakeups(&hosting.options.process);
        loop {
            let sleep = org.inner.clock.sleep(check);
            match futures::future::select(hints.next(), sleep).await {
                Either::Left((Some(agent), _)) => wake_local(&org.inner, &hosting, &agent).await,
                Either::Left((None, _)) => {
                    // The connection dropped: check everything, subscribe again after a while.
                    check_all(&org.inner, &hosting).await;
                    org.inner.clock.sleep(check).await;
                    break;
                }
                Either::Right(_) => check_all(&org.inner, &hosting).await,
            }
        }
    }
}

async fn check_all(inner: &Arc<OrgInner>, hosting: &Arc<Hosting>) {
    for agent in hosting.hosted() {
        wake_local(inner, hosting, &agent).await;
    }
}

/// Hands stored deliveries the queue does not hold yet to a hosted agent, and rings its task loop.
async fn wake_local(inner: &Arc<OrgInner>, hosting: &Hosting, agent: &AgentId) {
    if !lock(&hosting.deadlines).contains_key(agent) {
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
pub(crate) async fn hand_over_stored(inner: &OrgInner, rt: &AgentRuntime) {
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

impl Organization {
    /// This process's id under a placement (see
    /// [`OrganizationBuilder::placement`](crate::OrganizationBuilder::placement)), `None` without.
    pub fn process(&self) -> Option<&crate::placement::ProcessId> {
        self.inner.hosting.as_ref().map(|h| &h.options.process)
    }

    /// The configured agents whose loop runs in this process, sorted: under a placement those it
    /// holds a lease on and runs; without one, every running configured agent.
    pub fn hosted_agents(&self) -> Vec<AgentId> {
        let mut agents: Vec<AgentId> = self
            .inner
            .config
            .agents
            .iter()
            .map(|a| a.id.clone())
            .filter(|a| self.is_running(a))
            .filter(|a| {
                self.inner
                    .hosting
                    .as_ref()
                    .is_none_or(|h| lock(&h.deadlines).contains_key(a))
            })
            .collect();
        agents.sort();
        agents
    }
}
