//! What delegation keeps in this process only (see
//! [`BehaviourContext::state`](crate::runtime::behaviour::BehaviourContext::state)): the claims its
//! custom executors work on, the attempts to abort on a hand-over, one gate per agent serializing
//! its outbox flushes. Nothing here outlives the process: the stores hold the tasks.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::future::AbortHandle;

use crate::ids::AgentId;

/// Delegation's state in this process.
#[derive(Debug, Default)]
pub(crate) struct Local {
    /// Lease holders of claims a custom executor of this process still works on.
    live_claims: Mutex<HashSet<String>>,
    /// Attempts of custom executors running here, per agent and lease holder: aborted when the
    /// agent is handed over (its next host runs them again at once).
    attempts: Mutex<HashMap<AgentId, HashMap<String, AbortHandle>>>,
    /// One gate per agent serializing its outbox flushes (a notice is delivered by one at a time).
    flush_gates: Mutex<HashMap<AgentId, Arc<futures::lock::Mutex<()>>>>,
}

/// Plain maps: a panic elsewhere cannot leave them half-updated.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Local {
    /// Whether a custom executor of this process still works on the claim of `holder`.
    pub(crate) fn is_live(&self, holder: &str) -> bool {
        lock(&self.live_claims).contains(holder)
    }

    /// Marks the claim of `holder` as worked on here until the returned guard drops.
    pub(crate) fn live(self: &Arc<Self>, holder: &str) -> LiveClaim {
        lock(&self.live_claims).insert(holder.to_string());
        LiveClaim(self.clone(), holder.to_string())
    }

    /// Registers the attempt of `holder` on `agent`, aborted by [`abort_attempts`](Self::abort_attempts).
    pub(crate) fn attempt_started(&self, agent: &AgentId, holder: &str, attempt: AbortHandle) {
        lock(&self.attempts)
            .entry(agent.clone())
            .or_default()
            .insert(holder.to_string(), attempt);
    }

    /// Forgets the attempt of `holder` on `agent` (it ended).
    pub(crate) fn attempt_ended(&self, agent: &AgentId, holder: &str) {
        let mut attempts = lock(&self.attempts);
        if let Some(of_agent) = attempts.get_mut(agent) {
            of_agent.remove(holder);
            if of_agent.is_empty() {
                attempts.remove(agent);
            }
        }
    }

    /// Aborts every attempt running here for `agent` (a hand-over).
    pub(crate) fn abort_attempts(&self, agent: &AgentId) {
        let aborted = lock(&self.attempts).remove(agent);
        for (_, attempt) in aborted.into_iter().flatten() {
            attempt.abort();
        }
    }

    /// The gate serializing `agent`'s outbox flushes.
    pub(crate) fn flush_gate(&self, agent: &AgentId) -> Arc<futures::lock::Mutex<()>> {
        lock(&self.flush_gates)
            .entry(agent.clone())
            .or_default()
            .clone()
    }
}

/// A claim worked on in this process while alive (a restarted task loop leaves it be).
pub(crate) struct LiveClaim(Arc<Local>, String);

impl Drop for LiveClaim {
    fn drop(&mut self) {
        lock(&self.0.live_claims).remove(&self.1);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_live_claim_ends_with_its_guard_and_a_hand_over_aborts_only_its_agent() {
        let local = Arc::new(Local::default());
        let guard = local.live("h1");
        assert!(local.is_live("h1") && !local.is_live("h2"));
        drop(guard);
        assert!(!local.is_live("h1"));

        let (a, a_reg) = AbortHandle::new_pair();
        let (b, b_reg) = AbortHandle::new_pair();
        let (x, y) = (AgentId::parse("x").unwrap(), AgentId::parse("y").unwrap());
        local.attempt_started(&x, "h1", a);
        local.attempt_started(&y, "h2", b);
        local.abort_attempts(&x);
        assert!(a_reg.handle().is_aborted());
        assert!(!b_reg.handle().is_aborted());
        local.attempt_ended(&y, "h2");
        local.abort_attempts(&y);
        assert!(
            !b_reg.handle().is_aborted(),
            "an ended attempt is not aborted"
        );
    }
}
