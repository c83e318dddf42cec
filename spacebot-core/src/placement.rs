//! Placement: which process hosts which agent's loop, when one organization runs in several
//! processes (or hosts) that share one database.
//!
//! Each agent's loop runs in exactly one process at a time. A process *claims* an agent with a
//! lease it renews ([`Placement::acquire`]); while it holds the lease it runs the agent's loop and
//! its task loop. Everything else about the agent (its pending deliveries, its task board, its
//! outbox, its channels) lives in the shared stores, so when a process dies its leases expire and
//! another process takes its agents over with their queues intact.
//!
//! A delivery to an agent hosted elsewhere is written to the shared store and the hosting process
//! is woken with a hint ([`Placement::notify`], received through [`Placement::wakeups`]). Hints may
//! be lost: the table is the truth, and each process checks its agents' stores periodically.
//!
//! # Fencing: never two loops for one agent
//!
//! The rule that keeps two processes from running one agent at once rests on the lease and on each
//! process's own clock:
//!
//! - a lease granted to a call made at `now` (the caller's clock, read *before* the call) expires
//!   at `now + lease`; [`Placement::acquire`] grants an agent to another process only once that
//!   expiry is reached (`expires_at <= now` of the taker);
//! - the holder stops hosting the agent (its loop is aborted, nothing of the running turn is
//!   committed) when no renewal has succeeded by `now + lease - margin`, `now` being the time it
//!   read before sending the last successful renewal ([`PlacementOptions::margin`]).
//!
//! So the holder has stopped at least `margin` before any taker may start, **provided the clocks
//! of the processes differ by less than `margin` minus the time it takes to stop a loop** (and the
//! fence check's own granularity, a quarter of the margin at most). Use synchronized clocks (NTP)
//! and a margin well above their worst skew; see `docs/scale-out.md`.
//!
//! # Backends
//!
//! [`MemoryPlacement`] shares one table between several [`Organization`](crate::Organization)s in
//! one process (each playing one process), for tests and for the design itself; the PostgreSQL
//! crate (`spacebot-postgres`) implements the same trait with a placement table and
//! `LISTEN`/`NOTIFY`. The `conformance` feature holds the checks every implementation runs
//! (`placement_*` in [`conformance`](crate::conformance)).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use futures::channel::mpsc;
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

use crate::error::{InvalidInput, StoreError};
use crate::ids::AgentId;
use crate::time::Timestamp;

/// The id of one process (or one [`Organization`](crate::Organization) instance) taking part in
/// placement: unique among the processes sharing a database, stable for the life of the process.
///
/// 1 to 128 characters, none of them whitespace, `@` or a control character (claims of tasks name
/// their process after an `@`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ProcessId(String);

impl ProcessId {
    /// Checks and wraps a process id.
    ///
    /// ```
    /// use spacebot_core::placement::ProcessId;
    /// assert!(ProcessId::new("web-1").is_ok());
    /// assert!(ProcessId::new("has space").is_err());
    /// assert!(ProcessId::new("").is_err());
    /// ```
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidInput> {
        let id = id.into();
        if id.is_empty() || id.chars().count() > 128 {
            return Err(InvalidInput::new(
                "process id",
                "it must have 1 to 128 characters",
            ));
        }
        if id
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '@')
        {
            return Err(InvalidInput::new(
                "process id",
                format!("{id:?} contains whitespace, a control character or '@'"),
            ));
        }
        Ok(Self(id))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ProcessId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for ProcessId {
    type Error = InvalidInput;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<ProcessId> for String {
    fn from(value: ProcessId) -> Self {
        value.0
    }
}

/// One agent's placement: which process hosts it, until when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementLease {
    /// The agent.
    pub agent: AgentId,
    /// The process hosting it.
    pub process: ProcessId,
    /// When the lease runs out unless renewed (the `now` of the granting call plus the lease).
    pub expires_at: Timestamp,
    /// Grows every time the agent passes to a holder that did not hold a live lease on it (a new
    /// process, or the same one after its lease ran out); renewals keep it. A fencing token:
    /// a larger epoch is a later hosting.
    pub epoch: u64,
}

/// Lease-based hosting of agents by processes, and wake-up hints between them.
///
/// # Contract
/// - [`acquire`](Self::acquire) is atomic per agent: of concurrent calls for one agent whose lease
///   is free or expired, exactly one (one process) gets it. A lease is expired when `expires_at <=
///   now` of the caller. The holder's own call renews (and may re-take an expired lease of its own
///   that nobody took). The new expiry is `now + lease`, `now` as given by the caller.
/// - [`epoch`](PlacementLease::epoch) grows when an agent changes hands (see its docs) and is kept
///   by renewals.
/// - [`release`](Self::release) frees the lease only when `process` holds it.
/// - [`holder`](Self::holder) and [`held_by`](Self::held_by) report live (unexpired at `now`)
///   leases only.
/// - [`notify`](Self::notify) and [`wakeups`](Self::wakeups) are hints: a hint may be lost (a
///   process subscribing late, a dropped connection) or reach a process that no longer hosts the
///   agent, and the receiver filters. A hint sent while the agent's holder has a subscription open
///   reaches it, eventually, as long as its connection holds.
/// - A failure of the backend (connection lost) is an error, never a guess: an `acquire` that
///   fails has not granted anything the caller may count on.
#[async_trait]
pub trait Placement: Send + Sync + fmt::Debug {
    /// Acquires `agent` for `process`, or renews the lease `process` holds, until `now + lease`.
    /// `None` when another process holds a live lease on it.
    async fn acquire(
        &self,
        agent: &AgentId,
        process: &ProcessId,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<PlacementLease>, StoreError>;

    /// Renews the live leases `process` holds, in one call: each of `held` (as last granted) is
    /// extended to `now + lease` when the table still has it for `process` with the same
    /// [`epoch`](PlacementLease::epoch) and unexpired at `now`; never shortened. Returns, in the
    /// order of `held`, the renewed lease or `None` when it is lost (expired at `now`, taken by
    /// another process, or re-taken with another epoch). Unlike [`acquire`](Self::acquire), it
    /// never grants an expired or released lease again: a lease that ran out was fenced by its
    /// holder, and is acquired like any free agent.
    ///
    /// The hosting loops renew every lease of a process with one call per round, so a backend
    /// should make it one round trip (PostgreSQL: one statement). The default calls
    /// [`holder`](Self::holder) and then [`acquire`](Self::acquire) per lease.
    async fn renew(
        &self,
        held: &[PlacementLease],
        lease: Duration,
        now: Timestamp,
    ) -> Result<Vec<Option<PlacementLease>>, StoreError> {
        let mut out = Vec::with_capacity(held.len());
        for old in held {
            let live = self.holder(&old.agent, now).await?;
            if live.is_none_or(|l| l.process != old.process || l.epoch != old.epoch) {
                out.push(None);
                continue;
            }
            let renewed = self.acquire(&old.agent, &old.process, lease, now).await?;
            out.push(renewed.filter(|l| l.epoch == old.epoch && l.process == old.process));
        }
        Ok(out)
    }

    /// Gives up `process`'s lease on `agent` (a clean shutdown): another process may take the
    /// agent at once. `true` when `process` held it (live or expired).
    async fn release(&self, agent: &AgentId, process: &ProcessId) -> Result<bool, StoreError>;

    /// The live lease on `agent` at `now`, if any.
    async fn holder(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Option<PlacementLease>, StoreError>;

    /// The live leases `process` holds at `now`, ordered by agent.
    async fn held_by(
        &self,
        process: &ProcessId,
        now: Timestamp,
    ) -> Result<Vec<PlacementLease>, StoreError>;

    /// Sends a wake-up hint for `agent` to whichever process hosts it (PostgreSQL: `NOTIFY`).
    async fn notify(&self, agent: &AgentId) -> Result<(), StoreError>;

    /// The wake-up hints for `process` (PostgreSQL: `LISTEN`): agents that something was stored
    /// for. The stream may end when the connection is lost; the caller subscribes again later.
    fn wakeups(&self, process: &ProcessId) -> BoxStream<'static, AgentId>;
}

/// A `dyn` placement.
pub type DynPlacement = dyn Placement;

#[async_trait]
impl<T: Placement + ?Sized> Placement for Arc<T> {
    async fn acquire(
        &self,
        agent: &AgentId,
        process: &ProcessId,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<PlacementLease>, StoreError> {
        (**self).acquire(agent, process, lease, now).await
    }
    async fn renew(
        &self,
        held: &[PlacementLease],
        lease: Duration,
        now: Timestamp,
    ) -> Result<Vec<Option<PlacementLease>>, StoreError> {
        (**self).renew(held, lease, now).await
    }
    async fn release(&self, agent: &AgentId, process: &ProcessId) -> Result<bool, StoreError> {
        (**self).release(agent, process).await
    }
    async fn holder(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Option<PlacementLease>, StoreError> {
        (**self).holder(agent, now).await
    }
    async fn held_by(
        &self,
        process: &ProcessId,
        now: Timestamp,
    ) -> Result<Vec<PlacementLease>, StoreError> {
        (**self).held_by(process, now).await
    }
    async fn notify(&self, agent: &AgentId) -> Result<(), StoreError> {
        (**self).notify(agent).await
    }
    fn wakeups(&self, process: &ProcessId) -> BoxStream<'static, AgentId> {
        (**self).wakeups(process)
    }
}

/// How one [`Organization`](crate::Organization) takes part in placement (see
/// [`OrganizationBuilder::placement`](crate::OrganizationBuilder::placement)).
///
/// The defaults suit a database on a local network: a 30 s lease renewed every 5 s, fenced 10 s
/// before it runs out, stores checked every 5 s for deliveries whose hint was lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementOptions {
    /// This process's id.
    pub process: ProcessId,
    /// How many agents this process hosts at most.
    pub capacity: usize,
    /// How many free agents one renewal round acquires at most: processes starting together then
    /// share the agents instead of the first one taking all it may.
    pub acquire_per_round: usize,
    /// How long a granted lease lasts.
    pub lease: Duration,
    /// How often the leases held are renewed (and free agents looked for).
    pub renew_interval: Duration,
    /// How often the stores of the agents hosted here are checked for deliveries and tasks whose
    /// wake-up hint was lost.
    pub check_interval: Duration,
    /// How long before its lease runs out (by this process's clock) an agent whose renewal has not
    /// succeeded stops here. Must exceed the worst clock skew between processes plus the time to
    /// stop a loop.
    pub margin: Duration,
    /// The agents this process may host (all configured agents when `None`).
    pub agents: Option<HashSet<AgentId>>,
}

impl PlacementOptions {
    /// The defaults for `process`: capacity unbounded, 8 agents acquired per round, lease 30 s, renewal every 5 s, checks every
    /// 5 s, margin 10 s, every agent.
    pub fn new(process: ProcessId) -> Self {
        Self {
            process,
            capacity: usize::MAX,
            acquire_per_round: 8,
            lease: Duration::from_secs(30),
            renew_interval: Duration::from_secs(5),
            check_interval: Duration::from_secs(5),
            margin: Duration::from_secs(10),
            agents: None,
        }
    }

    /// Sets the capacity.
    pub fn with_capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity;
        self
    }

    /// Sets how many free agents one round acquires at most.
    pub fn with_acquire_per_round(mut self, n: usize) -> Self {
        self.acquire_per_round = n;
        self
    }

    /// Sets the lease, the renewal interval and the margin together.
    pub fn with_lease(
        mut self,
        lease: Duration,
        renew_interval: Duration,
        margin: Duration,
    ) -> Self {
        self.lease = lease;
        self.renew_interval = renew_interval;
        self.margin = margin;
        self
    }

    /// Sets the check interval.
    pub fn with_check_interval(mut self, check_interval: Duration) -> Self {
        self.check_interval = check_interval;
        self
    }

    /// Limits the agents this process may host.
    pub fn with_agents(mut self, agents: impl IntoIterator<Item = AgentId>) -> Self {
        self.agents = Some(agents.into_iter().collect());
        self
    }

    /// Checks the timings: a positive capacity and intervals, a margin shorter than the lease, and
    /// a renewal that comes round before the fencing deadline (`renew_interval < lease - margin`).
    pub fn validate(&self) -> Result<(), InvalidInput> {
        let what = "placement options";
        if self.capacity == 0 || self.acquire_per_round == 0 {
            return Err(InvalidInput::new(
                what,
                "capacity and acquire_per_round must be at least 1",
            ));
        }
        if self.renew_interval.is_zero() || self.check_interval.is_zero() || self.margin.is_zero() {
            return Err(InvalidInput::new(
                what,
                "renew_interval, check_interval and margin must be positive",
            ));
        }
        if self.margin >= self.lease {
            return Err(InvalidInput::new(what, "margin must be shorter than lease"));
        }
        if self.renew_interval >= self.lease - self.margin {
            return Err(InvalidInput::new(
                what,
                "renew_interval must be shorter than lease - margin (better a third of it, so \
                 that two renewals may fail before the agent stops here)",
            ));
        }
        Ok(())
    }
}

/// Locks `mutex`, recovering the data if a thread panicked while holding it.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug, Default)]
struct MemoryState {
    leases: HashMap<AgentId, PlacementLease>,
    epoch: u64,
    subscribers: HashMap<ProcessId, Vec<mpsc::UnboundedSender<AgentId>>>,
    cut: HashSet<ProcessId>,
}

/// A [`Placement`] table in process memory, shared (clones share it) by several
/// [`Organization`](crate::Organization)s of one process, each playing one process of a deployment.
///
/// Wake-up hints travel over unbounded `futures` channels (no async runtime needed).
/// [`cut_off`](Self::cut_off) simulates a process whose database connection dropped: every call
/// naming it fails and it receives no more hints, until [`reconnect`](Self::reconnect). Only the
/// placement calls fail: the stores shared with it keep working, so a test sees exactly what the
/// fencing rule does.
#[derive(Debug, Clone, Default)]
pub struct MemoryPlacement {
    state: Arc<Mutex<MemoryState>>,
}

impl MemoryPlacement {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// From now on, calls naming `process` fail and its hint streams end (a lost connection).
    pub fn cut_off(&self, process: &ProcessId) {
        let mut state = lock(&self.state);
        state.cut.insert(process.clone());
        state.subscribers.remove(process);
    }

    /// Undoes [`cut_off`](Self::cut_off).
    pub fn reconnect(&self, process: &ProcessId) {
        lock(&self.state).cut.remove(process);
    }

    fn check(state: &MemoryState, process: &ProcessId) -> Result<(), StoreError> {
        if state.cut.contains(process) {
            return Err(StoreError::Backend {
                backend: "memory-placement",
                message: format!("process {process} is cut off from the placement table"),
                source: None,
            });
        }
        Ok(())
    }
}

#[async_trait]
impl Placement for MemoryPlacement {
    async fn acquire(
        &self,
        agent: &AgentId,
        process: &ProcessId,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Option<PlacementLease>, StoreError> {
        let mut state = lock(&self.state);
        Self::check(&state, process)?;
        let expires_at = now.plus(lease);
        let epoch = match state.leases.get(agent) {
            Some(current) if current.process == *process => {
                if current.expires_at > now {
                    current.epoch
                } else {
                    state.epoch + 1
                }
            }
            Some(current) if current.expires_at > now => return Ok(None),
            _ => state.epoch + 1,
        };
        state.epoch = state.epoch.max(epoch);
        let granted = PlacementLease {
            agent: agent.clone(),
            process: process.clone(),
            // A renewal never shortens a lease (a late call with an older `now`).
            expires_at: state
                .leases
                .get(agent)
                .filter(|l| l.process == *process && l.epoch == epoch)
                .map_or(expires_at, |l| l.expires_at.max(expires_at)),
            epoch,
        };
        state.leases.insert(agent.clone(), granted.clone());
        Ok(Some(granted))
    }

    async fn renew(
        &self,
        held: &[PlacementLease],
        lease: Duration,
        now: Timestamp,
    ) -> Result<Vec<Option<PlacementLease>>, StoreError> {
        let mut state = lock(&self.state);
        for old in held {
            Self::check(&state, &old.process)?;
        }
        let expires_at = now.plus(lease);
        Ok(held
            .iter()
            .map(|old| {
                let current = state.leases.get_mut(&old.agent)?;
                if current.process != old.process
                    || current.epoch != old.epoch
                    || current.expires_at <= now
                {
                    return None;
                }
                current.expires_at = current.expires_at.max(expires_at);
                Some(current.clone())
            })
            .collect())
    }

    async fn release(&self, agent: &AgentId, process: &ProcessId) -> Result<bool, StoreError> {
        let mut state = lock(&self.state);
        Self::check(&state, process)?;
        if state
            .leases
            .get(agent)
            .is_some_and(|l| l.process == *process)
        {
            state.leases.remove(agent);
            return Ok(true);
        }
        Ok(false)
    }

    async fn holder(
        &self,
        agent: &AgentId,
        now: Timestamp,
    ) -> Result<Option<PlacementLease>, StoreError> {
        let state = lock(&self.state);
        Ok(state
            .leases
            .get(agent)
            .filter(|l| l.expires_at > now)
            .cloned())
    }

    async fn held_by(
        &self,
        process: &ProcessId,
        now: Timestamp,
    ) -> Result<Vec<PlacementLease>, StoreError> {
        let state = lock(&self.state);
        Self::check(&state, process)?;
        let mut held: Vec<PlacementLease> = state
            .leases
            .values()
            .filter(|l| l.process == *process && l.expires_at > now)
            .cloned()
            .collect();
        held.sort_by(|a, b| a.agent.cmp(&b.agent));
        Ok(held)
    }

    async fn notify(&self, agent: &AgentId) -> Result<(), StoreError> {
        let mut state = lock(&self.state);
        let Some(process) = state.leases.get(agent).map(|l| l.process.clone()) else {
            return Ok(());
        };
        if let Some(senders) = state.subscribers.get_mut(&process) {
            senders.retain(|tx| tx.unbounded_send(agent.clone()).is_ok());
        }
        Ok(())
    }

    fn wakeups(&self, process: &ProcessId) -> BoxStream<'static, AgentId> {
        let (tx, rx) = mpsc::unbounded();
        let mut state = lock(&self.state);
        if !state.cut.contains(process) {
            state
                .subscribers
                .entry(process.clone())
                .or_default()
                .push(tx);
        }
        Box::pin(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use futures::executor::block_on;

    fn agent(id: &str) -> AgentId {
        AgentId::parse(id).unwrap()
    }

    #[test]
    fn options_are_validated() {
        let p = ProcessId::new("p1").unwrap();
        assert!(PlacementOptions::new(p.clone()).validate().is_ok());
        let bad = PlacementOptions::new(p.clone()).with_lease(
            Duration::from_secs(10),
            Duration::from_secs(8),
            Duration::from_secs(3),
        );
        assert!(bad.validate().is_err());
        assert!(
            PlacementOptions::new(p.clone())
                .with_capacity(0)
                .validate()
                .is_err()
        );
        let margin_too_long = PlacementOptions::new(p).with_lease(
            Duration::from_secs(10),
            Duration::from_secs(1),
            Duration::from_secs(10),
        );
        assert!(margin_too_long.validate().is_err());
    }

    #[test]
    fn a_cut_off_process_fails_and_gets_no_hints() {
        block_on(async {
            let table = MemoryPlacement::new();
            let (p1, a) = (ProcessId::new("p1").unwrap(), agent("a"));
            let mut hints = table.wakeups(&p1);
            assert!(
                table
                    .acquire(&a, &p1, Duration::from_secs(1), Timestamp(0))
                    .await
                    .unwrap()
                    .is_some()
            );
            table.notify(&a).await.unwrap();
            assert_eq!(hints.next().await, Some(a.clone()));
            table.cut_off(&p1);
            assert!(
                table
                    .acquire(&a, &p1, Duration::from_secs(1), Timestamp(1))
                    .await
                    .is_err()
            );
            assert_eq!(hints.next().await, None);
            table.reconnect(&p1);
            assert!(
                table
                    .acquire(&a, &p1, Duration::from_secs(1), Timestamp(2))
                    .await
                    .unwrap()
                    .is_some()
            );
        });
    }
}
