//! The agent's loop: the only consumer of its queue and the only caller of the tool loop.
//!
//! One envelope at a time: a record is written, a task runs as a turn whose answer is the task's
//! result, anything else runs as a turn whose answer goes to the envelope's own destination. A turn
//! commits once, at its end: the envelopes it consumed leave the agent's pending deliveries in the
//! same store transaction as the records it wrote and the idempotency keys it applied (see
//! [`TurnCommit`]). A turn killed before that commit runs again after a restart; the effects its
//! tools had carry idempotency keys derived from the envelope and the call, so they are not repeated.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use async_trait::async_trait;
use futures::future::{AbortHandle, Abortable};
use tracing::Instrument;

use crate::envelope::{Envelope, EnvelopeKind, Source};
use crate::event::EventKind;
use crate::ids::{AgentId, ChannelId, EnvelopeId, TaskRef};
use crate::runtime::behaviour::BehaviourContext;
use crate::runtime::commit::*;
pub(crate) use crate::runtime::commit::{report_error, retry_store};
use crate::runtime::host::{AgentRuntime, Host};
use crate::runtime::outbound::{Outbound, OutboundError, Reply, ReplyKind};
use crate::runtime::steer::source_label;
use crate::runtime::turn::*;

pub(crate) use crate::runtime::turn::TurnOutcome;

/// One agent loop counted in [`Host::handling`] while it lives.
struct Handling(Arc<std::sync::atomic::AtomicUsize>);

impl Handling {
    fn count(count: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count.clone())
    }
}

impl Drop for Handling {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The loop of one agent: take an envelope, run a turn, repeat until the queue closes.
///
/// What it awaits besides the queue is boxed, so an idle agent's loop holds a small future instead
/// of the state of a whole turn (about 4 KB), for every agent.
pub(crate) async fn run_loop(org: Arc<Host>, agent: Arc<AgentRuntime>) {
    loop {
        if agent.queue.is_empty() && agent.pending.swap(false, Ordering::AcqRel) {
            Box::pin(hand_over_pending(&org, &agent)).await;
        }
        let Some(envelope) = agent.queue.recv().await else {
            break;
        };
        agent.busy.store(true, Ordering::Release);
        // Counted while it handles the envelope (also if the loop is dropped meanwhile): with
        // other agents handling theirs, the writes of each are issued together.
        let handling = Handling::count(&org.handling);
        let many = |future| crate::durability::together_while_many(org.handling.clone(), future);
        if envelope.kind.wakes_model() {
            let span = crate::telemetry::invoke_agent(agent.id(), &agent.spec.name, &envelope);
            let started = std::time::Instant::now();
            many(Box::pin(process(&org, &agent, envelope)))
                .instrument(span)
                .await;
            if let Some(hook) = crate::telemetry::hook() {
                hook.turn_ended(agent.id(), started.elapsed());
            }
        } else {
            many(Box::pin(process(&org, &agent, envelope))).await;
        }
        drop(handling);
        agent.busy.store(false, Ordering::Release);
        if agent.queue.is_empty() {
            org.emit(org.event(agent.id(), EventKind::AgentIdle));
        }
        if let Some(parent) = &agent.spec.parent
            && parent.end_after_reply
            && agent.queue.is_empty()
        {
            let leftovers = org.end_agent(agent.id());
            for envelope in leftovers {
                Box::pin(report_to_parent(
                    &org,
                    &agent,
                    format!(
                        "child agent {} ended before answering a message from {}: {}",
                        agent.id(),
                        source_label(&envelope.source),
                        envelope.content
                    ),
                ))
                .await;
            }
            break;
        }
    }
    Box::pin(org.behaviours_agent_stopped(agent.id())).await;
    org.emit(org.event(agent.id(), EventKind::AgentStopped));
}

/// Envelopes kept in the store that the queue does not hold yet (persisted while the queue was
/// full, or while the agent started) go into the queue now that it is empty.
pub(crate) async fn hand_over_pending(org: &Host, agent: &AgentRuntime) {
    match org.stores.deliveries.pending(agent.id()).await {
        Ok(pending) => {
            let fresh: Vec<Envelope> = pending.into_iter().filter(|e| agent.admit(&e.id)).collect();
            for envelope in fresh.into_iter().rev() {
                let _ = agent.queue.push_front(envelope);
            }
        }
        Err(e) => {
            agent.pending.store(true, Ordering::Release);
            report_error(org, agent.id(), None, format!("pending deliveries: {e}"));
            backoff_sleep(org, 0).await;
        }
    }
}

/// Takes one envelope off the queue and handles it.
pub(crate) async fn process(org: &Arc<Host>, agent: &Arc<AgentRuntime>, envelope: Envelope) {
    let me = agent.id().clone();
    let mut log = TurnLog::default();
    if let Some(key) = &envelope.idempotency_key {
        let applied = retry_store(org, agent, "checking an idempotency key", || {
            org.stores.deliveries.is_applied(&me, key)
        })
        .await;
        match applied {
            Ok(true) => {
                // Applied before (a notice delivered twice): nothing to do but let it go.
                log.commit.consumed.push(envelope.id.clone());
                commit(org, agent, log).await;
                return;
            }
            Ok(false) => {}
            Err(_) => {
                // Stopping while the store fails: the envelope stays stored for the next start.
                agent.forget(std::slice::from_ref(&envelope.id));
                keep_for_later(org, agent, envelope).await;
                return;
            }
        }
    }
    if !envelope.kind.wakes_model() {
        log.record(user_record(&envelope));
        log.consume(&envelope);
        commit(org, agent, log).await;
        return;
    }
    // The task path and the failure path are boxed where taken: the future of every turn (boxed
    // by the loop) carries only the common path's state.
    if let Some(work) = envelope.task.clone() {
        Box::pin(run_task(
            org,
            agent,
            envelope,
            work.number,
            work.holder,
            log,
        ))
        .await;
        return;
    }
    let channel = envelope.channel.clone();
    let (abort, registration) = AbortHandle::new_pair();
    *agent.abort.lock().unwrap_or_else(|e| e.into_inner()) = Some(abort);
    let options = TurnOptions {
        task: None,
        work: None,
    };
    let mut turn_log = TurnLog::default();
    let result = {
        let turn = Abortable::new(
            Box::pin(run_turn(
                org,
                agent,
                envelope.clone(),
                options,
                &mut turn_log,
            )),
            registration,
        );
        turn.await
    };
    agent.abort.lock().unwrap_or_else(|e| e.into_inner()).take();
    let mut log = turn_log;
    match result {
        Ok(Ok(_)) => {}
        Ok(Err(failure)) => {
            let text = format!("turn failed: {}", failure.error.public_text());
            for envelope in &failure.unanswered {
                log.record(system_record(&envelope.channel, text.clone(), org));
            }
            report_error(org, &me, Some(&channel), text);
            Box::pin(tell_failure(org, agent, &failure)).await;
        }
        Err(_aborted) => {
            log.record(system_record(
                &channel,
                "turn cancelled; the message was not answered",
                org,
            ));
            let mut event = org.event(&me, EventKind::TurnCancelled);
            event.channel = Some(channel);
            org.emit(event);
        }
    }
    commit(org, agent, log).await;
}

/// An envelope the loop could not process because the agent is stopping: in memory-only stores it
/// is kept in the pending deliveries (durable stores hold it already).
pub(crate) async fn keep_for_later(org: &Host, agent: &AgentRuntime, envelope: Envelope) {
    if org.stores_every_delivery() {
        return;
    }
    if let Err(e) = org.persist(agent.id(), envelope).await {
        report_error(
            org,
            agent.id(),
            None,
            format!("a message could not be kept: {e}"),
        );
    }
}

/// Tells the destinations of a failed turn's envelopes that it failed: a failure reply to the
/// application for external messages, a report to the parent for a child agent.
pub(crate) async fn tell_failure(inner: &Arc<Host>, agent: &AgentRuntime, failure: &TurnFailure) {
    let reason = failure.error.public_text();
    // A request that reached a limit is told so once, however many of its turns were refused.
    let limited = matches!(
        failure.error,
        crate::runtime::turn::TurnError::LimitReached(_)
    );
    let mut by_source: Vec<(Source, ChannelId, Vec<EnvelopeId>)> = Vec::new();
    for envelope in failure.unanswered.iter().filter(|e| e.task.is_none()) {
        let source = reply_source(agent, std::slice::from_ref(envelope));
        if !matches!(source, Source::External { .. }) || agent.spec.parent.is_some() {
            continue;
        }
        match by_source
            .iter_mut()
            .find(|(s, c, _)| s == &source && c == &envelope.channel)
        {
            Some((_, _, ids)) => ids.push(envelope.id.clone()),
            None => by_source.push((source, envelope.channel.clone(), vec![envelope.id.clone()])),
        }
    }
    // The teller is the first message answered: the same failure run again after a crash (which
    // stored the claim but sent nothing) answers it again, and tells again.
    if limited
        && let Some(teller) = by_source
            .first()
            .and_then(|(_, _, ids)| ids.first())
            .cloned()
        && let Some(first) = failure.unanswered.first()
        && !inner.tell_limit_once(first.cause(), &teller).await
    {
        by_source.clear();
    }
    for (source, channel, ids) in by_source {
        let reply = Reply {
            agent: agent.id().clone(),
            channel: channel.clone(),
            source,
            in_reply_to: ids,
            content: format!("the agent could not answer: {reason}"),
            at: inner.clock.now(),
            kind: ReplyKind::Failure,
        };
        if let Err(e) = agent.spec.outbound.send(reply).await {
            report_error(
                inner,
                agent.id(),
                Some(&channel),
                format!("failure reply not delivered: {e}"),
            );
        }
    }
    if agent.spec.parent.is_some() {
        report_to_parent(
            inner,
            agent,
            format!("child agent {} failed: {reason}", agent.id()),
        )
        .await;
    }
}

/// Runs a claimed task as a turn of the agent's own tool loop and records the outcome.
pub(crate) async fn run_task(
    org: &Arc<Host>,
    agent: &Arc<AgentRuntime>,
    envelope: Envelope,
    number: u64,
    holder: String,
    mut log: TurnLog,
) {
    let me = agent.id().clone();
    // Claimed work handed over again after a restart may be stale: run it only while this claim
    // is still valid, as its owner says.
    let work = match envelope.task.clone() {
        Some(work) => work,
        None => crate::envelope::TaskWork::new("", number, holder.clone(), 0),
    };
    let owner = org.behaviour(&work.owner).cloned();
    let ctx = BehaviourContext::new(org.clone());
    let valid = retry_store(org, agent, "checking a claim", || async {
        match &owner {
            Some(owner) => owner.claim_valid(&ctx, &me, &work).await,
            None => Ok(true),
        }
    })
    .await;
    let worker = crate::runtime::behaviour::AgentWorker { rt: agent.clone() };
    match valid {
        Ok(true) => {}
        Ok(false) => {
            // This claim is over (its lease expired and the task moved on): let it go.
            log.consume(&envelope);
            commit(org, agent, log).await;
            worker.claim_ended(number, &holder);
            worker.ring();
            return;
        }
        Err(_) => {
            agent.forget(std::slice::from_ref(&envelope.id));
            keep_for_later(org, agent, envelope).await;
            return;
        }
    }
    let options = TurnOptions {
        task: Some(TaskRef::new(me.clone(), number)),
        work: Some(work.clone()),
    };
    let (abort, registration) = AbortHandle::new_pair();
    *agent.abort.lock().unwrap_or_else(|e| e.into_inner()) = Some(abort);
    let mut turn_log = TurnLog::default();
    let outcome = {
        let turn = Abortable::new(
            Box::pin(run_turn(
                org,
                agent,
                envelope.clone(),
                options,
                &mut turn_log,
            )),
            registration,
        );
        turn.await
    };
    agent.abort.lock().unwrap_or_else(|e| e.into_inner()).take();
    let result = match outcome {
        Ok(Ok(outcome)) => Ok(outcome),
        Ok(Err(failure)) => {
            let reason = failure.error.public_text();
            let text = format!("turn failed: {reason}");
            for e in failure.unanswered.iter().filter(|e| e.task.is_none()) {
                turn_log.record(system_record(&e.channel, text.clone(), org));
            }
            tell_failure(org, agent, &failure).await;
            Err(WorkFailure::of(&failure.error))
        }
        Err(_) => Err(WorkFailure::transient("the turn was cancelled")),
    };
    // The outcome is recorded first: a crash between the two runs the (finished) task envelope
    // again, which then finds its claim over and only lets it go.
    if let Some(owner) = &owner {
        owner
            .work_ended(&ctx, &worker, &work, &result, turn_log.usage)
            .await;
    }
    commit(org, agent, turn_log).await;
}

/// Sends a message to a child's parent (its outbound failed, or its turn failed).
pub(crate) async fn report_to_parent(org: &Host, agent: &AgentRuntime, text: String) {
    let Some(parent) = &agent.spec.parent else {
        return;
    };
    let envelope = Envelope::new(
        Source::Internal {
            from_agent: agent.id().clone(),
            link_id: None,
        },
        parent.report_to.clone(),
        EnvelopeKind::Announce,
        text,
        org.clock.now(),
    );
    if let Err(e) = org.enqueue(&parent.parent, envelope, true).await {
        report_error(
            org,
            agent.id(),
            None,
            format!("could not report to parent {}: {e}", parent.parent),
        );
    }
}

/// A child agent's outbound: its replies go to the parent's queue, in the channel the parent chose.
#[derive(Debug)]
pub(crate) struct ParentOutbound {
    pub(crate) org: Weak<Host>,
    pub(crate) parent: AgentId,
    pub(crate) child: AgentId,
    pub(crate) report_to: ChannelId,
}

#[async_trait]
impl Outbound for ParentOutbound {
    async fn send(&self, reply: Reply) -> Result<(), OutboundError> {
        let Some(org) = self.org.upgrade() else {
            return Err(OutboundError::Closed(
                "the organization is gone".to_string(),
            ));
        };
        let content = match reply.kind {
            ReplyKind::Failure => format!("Child agent {} failed: {}", self.child, reply.content),
            _ => format!("Result from child agent {}: {}", self.child, reply.content),
        };
        let envelope = Envelope::new(
            Source::Internal {
                from_agent: self.child.clone(),
                link_id: None,
            },
            self.report_to.clone(),
            EnvelopeKind::Announce,
            content,
            org.clock.now(),
        )
        .with_idempotency_key(format!("child-reply:{}", reply.in_reply_to_key()));
        // A full parent queue overflows to the parent's pending deliveries (picked up when its queue
        // runs empty): a child's result is never refused for being early.
        org.enqueue(&self.parent, envelope, true)
            .await
            .map_err(|e| OutboundError::Closed(e.to_string()))
    }
}
