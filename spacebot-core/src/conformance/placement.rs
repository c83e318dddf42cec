//! [`Placement`] conformance.
//!
//! Hand each function a **fresh, empty** placement table. The processes and agents used are named
//! `conf-*`.

use std::time::Duration;

use futures::StreamExt;

use super::support::{ConformanceError, agent, ensure, ensure_eq, ok};
use crate::ids::AgentId;
use crate::placement::{Placement, ProcessId};
use crate::time::Timestamp;

#[doc(hidden)]
#[macro_export]
macro_rules! __placement_tests {
    ($module:ident, $make:expr, |$s:ident| $access:expr) => {
        $crate::__conformance_module!(
            $module,
            $make,
            |$s| $access,
            [
                placement_acquire_renew_release,
                placement_renew_keeps_live_leases_only,
                placement_expired_lease_taken_over,
                placement_held_by_lists_live_leases,
                placement_concurrent_acquire_one_winner,
                placement_wakeups_reach_the_holder,
            ]
        );
    };
}

/// Generates one `#[tokio::test]` per [`Placement`] conformance function, given an expression
/// evaluating to a future of a fresh placement table. See the [module docs](crate::conformance).
///
/// ```ignore
/// spacebot_core::placement_conformance!(async { spacebot_core::MemoryPlacement::new() });
/// ```
#[macro_export]
macro_rules! placement_conformance {
    ($module:ident, $make:expr) => {
        $crate::__placement_tests!($module, $make, |placement| &placement);
    };
    ($make:expr) => {
        $crate::placement_conformance!(placement_conformance, $make);
    };
}

const LEASE: Duration = Duration::from_secs(30);
const T0: i64 = 1_700_000_000_000;

fn process(id: &str) -> Result<ProcessId, ConformanceError> {
    ProcessId::new(id).map_err(|e| {
        ConformanceError::check(
            "ProcessId::new",
            e.to_string(),
            concat!(file!(), ":", line!()),
        )
    })
}

async fn ensure_empty(
    placement: &dyn Placement,
    processes: &[&ProcessId],
    agents: &[&AgentId],
) -> Result<(), ConformanceError> {
    for p in processes {
        let held = ok!(placement.held_by(p, Timestamp(T0)));
        ensure!(
            held.is_empty(),
            "the suite needs a fresh, empty placement table; {p} holds {} leases",
            held.len()
        );
    }
    for a in agents {
        let holder = ok!(placement.holder(a, Timestamp(T0)));
        ensure!(
            holder.is_none(),
            "the suite needs a fresh, empty placement table; {a} is held"
        );
    }
    Ok(())
}

/// A free agent is granted until `now + lease`; another process is refused while the lease lives;
/// the holder renews (same epoch, later expiry); only the holder releases; after a release another
/// process takes the agent with a larger epoch.
pub async fn placement_acquire_renew_release(
    placement: &dyn Placement,
) -> Result<(), ConformanceError> {
    let (p1, p2, a) = (process("conf-p1")?, process("conf-p2")?, agent("conf-a")?);
    ensure_empty(placement, &[&p1, &p2], &[&a]).await?;
    let first = ok!(placement.acquire(&a, &p1, LEASE, Timestamp(T0)));
    let Some(first) = first else {
        return Err(ConformanceError::check(
            "acquire of a free agent",
            "returned None",
            concat!(file!(), ":", line!()),
        ));
    };
    ensure_eq!(first.process, p1, "the holder");
    ensure_eq!(first.agent, a, "the agent");
    ensure_eq!(first.expires_at, Timestamp(T0).plus(LEASE), "the expiry");
    let other = ok!(placement.acquire(&a, &p2, LEASE, Timestamp(T0 + 1_000)));
    ensure!(
        other.is_none(),
        "a live lease was granted to another process: {other:?}"
    );
    let renewed = ok!(placement.acquire(&a, &p1, LEASE, Timestamp(T0 + 10_000)));
    let Some(renewed) = renewed else {
        return Err(ConformanceError::check(
            "renewal by the holder",
            "returned None",
            concat!(file!(), ":", line!()),
        ));
    };
    ensure_eq!(renewed.epoch, first.epoch, "a renewal keeps the epoch");
    ensure_eq!(
        renewed.expires_at,
        Timestamp(T0 + 10_000).plus(LEASE),
        "a renewal extends the lease"
    );
    let holder = ok!(placement.holder(&a, Timestamp(T0 + 11_000)));
    ensure_eq!(
        holder.map(|l| l.process),
        Some(p1.clone()),
        "holder() names the holder"
    );
    ensure!(
        !ok!(placement.release(&a, &p2)),
        "a process released a lease it does not hold"
    );
    ensure!(
        ok!(placement.release(&a, &p1)),
        "the holder's release returned false"
    );
    let holder = ok!(placement.holder(&a, Timestamp(T0 + 11_000)));
    ensure!(holder.is_none(), "released, yet held: {holder:?}");
    let taken = ok!(placement.acquire(&a, &p2, LEASE, Timestamp(T0 + 12_000)));
    let Some(taken) = taken else {
        return Err(ConformanceError::check(
            "acquire after a release",
            "returned None",
            concat!(file!(), ":", line!()),
        ));
    };
    ensure!(
        taken.epoch > first.epoch,
        "the epoch did not grow on a change of hands: {} then {}",
        first.epoch,
        taken.epoch
    );
    Ok(())
}

/// `renew` extends, in the order given, the live leases of their holder with the epoch it was
/// granted (keeping the epoch, never shortening), and returns `None` for a lease expired at `now`
/// (without granting it again), held by another process, or of another epoch.
pub async fn placement_renew_keeps_live_leases_only(
    placement: &dyn Placement,
) -> Result<(), ConformanceError> {
    let (p1, p2) = (process("conf-p1")?, process("conf-p2")?);
    let (a, b, c, d) = (
        agent("conf-a")?,
        agent("conf-b")?,
        agent("conf-c")?,
        agent("conf-d")?,
    );
    ensure_empty(placement, &[&p1, &p2], &[&a, &b, &c, &d]).await?;
    let short = Duration::from_secs(5);
    let mut granted = Vec::new();
    for (x, p, lease) in [
        (&a, &p1, LEASE),
        (&b, &p1, short),
        (&c, &p2, LEASE),
        (&d, &p1, LEASE),
    ] {
        let Some(lease) = ok!(placement.acquire(x, p, lease, Timestamp(T0))) else {
            return Err(ConformanceError::check(
                "acquire of a free agent",
                "returned None",
                concat!(file!(), ":", line!()),
            ));
        };
        granted.push(lease);
    }
    ensure!(
        ok!(placement.renew(&[], LEASE, Timestamp(T0))).is_empty(),
        "renewing nothing returned something"
    );
    // `c` as if p1 held it; `d` with an epoch it was never granted.
    let mut not_held = granted[2].clone();
    not_held.process = p1.clone();
    let mut other_epoch = granted[3].clone();
    other_epoch.epoch += 1;
    let asked = [
        granted[0].clone(),
        granted[1].clone(),
        not_held,
        other_epoch,
    ];
    let now = Timestamp(T0 + 6_000);
    let renewed = ok!(placement.renew(&asked, LEASE, now));
    ensure_eq!(renewed.len(), 4, "one answer per lease");
    let Some(first) = &renewed[0] else {
        return Err(ConformanceError::check(
            "renew of a live lease",
            "returned None",
            concat!(file!(), ":", line!()),
        ));
    };
    ensure_eq!(first.agent, a, "the agent, in order");
    ensure_eq!(first.epoch, granted[0].epoch, "a renewal keeps the epoch");
    ensure_eq!(
        first.expires_at,
        now.plus(LEASE),
        "a renewal extends the lease"
    );
    ensure!(
        renewed[1].is_none(),
        "a lease expired at now was renewed: {:?}",
        renewed[1]
    );
    ensure!(
        ok!(placement.holder(&b, now)).is_none(),
        "renew granted an expired lease again"
    );
    ensure!(
        renewed[2].is_none(),
        "another process's lease was renewed: {:?}",
        renewed[2]
    );
    ensure!(
        renewed[3].is_none(),
        "a lease of another epoch was renewed: {:?}",
        renewed[3]
    );
    ensure_eq!(
        ok!(placement.holder(&c, now)).map(|l| l.expires_at),
        Some(Timestamp(T0).plus(LEASE)),
        "the other process's lease is untouched"
    );
    // An older `now` never shortens a lease.
    let late = ok!(placement.renew(&granted[..1], LEASE, Timestamp(T0 + 1_000)));
    ensure_eq!(
        late.first().cloned().flatten().map(|l| l.expires_at),
        Some(now.plus(LEASE)),
        "a late renewal shortened the lease"
    );
    Ok(())
}

/// A lease is live until `expires_at` (exclusive): another process is refused one millisecond
/// before and granted the agent at `expires_at`, with a larger epoch; the old holder's renewal is
/// refused from then on.
pub async fn placement_expired_lease_taken_over(
    placement: &dyn Placement,
) -> Result<(), ConformanceError> {
    let (p1, p2, a) = (process("conf-p1")?, process("conf-p2")?, agent("conf-a")?);
    ensure_empty(placement, &[&p1, &p2], &[&a]).await?;
    let first = ok!(placement.acquire(&a, &p1, LEASE, Timestamp(T0)));
    let first_epoch = first.map(|l| l.epoch).unwrap_or_default();
    let expiry = Timestamp(T0).plus(LEASE);
    let early = ok!(placement.acquire(&a, &p2, LEASE, Timestamp(expiry.0 - 1)));
    ensure!(early.is_none(), "taken before the lease ran out: {early:?}");
    let holder = ok!(placement.holder(&a, expiry));
    ensure!(
        holder.is_none(),
        "an expired lease is reported live: {holder:?}"
    );
    let taken = ok!(placement.acquire(&a, &p2, LEASE, expiry));
    let Some(taken) = taken else {
        return Err(ConformanceError::check(
            "acquire of an expired lease",
            "returned None",
            concat!(file!(), ":", line!()),
        ));
    };
    ensure_eq!(taken.process, p2, "the new holder");
    ensure!(
        taken.epoch > first_epoch,
        "the epoch did not grow on a takeover"
    );
    let old = ok!(placement.acquire(&a, &p1, LEASE, Timestamp(expiry.0 + 1)));
    ensure!(
        old.is_none(),
        "the old holder renewed a lease taken over: {old:?}"
    );
    Ok(())
}

/// `held_by` lists a process's live leases, ordered by agent, and nothing expired or of others.
pub async fn placement_held_by_lists_live_leases(
    placement: &dyn Placement,
) -> Result<(), ConformanceError> {
    let (p1, p2) = (process("conf-p1")?, process("conf-p2")?);
    let (a, b, c) = (agent("conf-a")?, agent("conf-b")?, agent("conf-c")?);
    ensure_empty(placement, &[&p1, &p2], &[&a, &b, &c]).await?;
    ok!(placement.acquire(&b, &p1, LEASE, Timestamp(T0)));
    ok!(placement.acquire(&a, &p1, LEASE, Timestamp(T0)));
    ok!(placement.acquire(&c, &p2, LEASE, Timestamp(T0)));
    ok!(placement.acquire(&c, &p1, Duration::from_secs(1), Timestamp(T0)));
    let held: Vec<AgentId> = ok!(placement.held_by(&p1, Timestamp(T0 + 1)))
        .into_iter()
        .map(|l| l.agent)
        .collect();
    ensure_eq!(held, vec![a.clone(), b.clone()], "p1's leases");
    let later = ok!(placement.held_by(&p1, Timestamp(T0).plus(LEASE)));
    ensure!(later.is_empty(), "expired leases listed: {later:?}");
    Ok(())
}

/// Of eight processes acquiring one free agent at once, exactly one gets it.
pub async fn placement_concurrent_acquire_one_winner(
    placement: &dyn Placement,
) -> Result<(), ConformanceError> {
    let a = agent("conf-a")?;
    let mut processes = Vec::new();
    for i in 0..8 {
        processes.push(process(&format!("conf-p{i}"))?);
    }
    let refs: Vec<&ProcessId> = processes.iter().collect();
    ensure_empty(placement, &refs, &[&a]).await?;
    let calls = processes
        .iter()
        .map(|p| placement.acquire(&a, p, LEASE, Timestamp(T0)));
    let results = futures::future::join_all(calls).await;
    let mut winners = 0;
    for result in results {
        match result {
            Ok(Some(_)) => winners += 1,
            Ok(None) => {}
            Err(source) => {
                return Err(ConformanceError::Store {
                    op: "concurrent acquire".into(),
                    location: concat!(file!(), ":", line!()),
                    source,
                });
            }
        }
    }
    ensure_eq!(winners, 1, "processes granted one agent at once");
    Ok(())
}

/// A hint for an agent reaches the wake-up stream of the process holding it (hints may be lost
/// while a subscription is being set up: the check notifies again every 100 ms, for up to 10 s).
pub async fn placement_wakeups_reach_the_holder(
    placement: &dyn Placement,
) -> Result<(), ConformanceError> {
    let (p1, a) = (process("conf-p1")?, agent("conf-a")?);
    ensure_empty(placement, &[&p1], &[&a]).await?;
    ok!(placement.acquire(&a, &p1, LEASE, Timestamp(T0)));
    let mut hints = placement.wakeups(&p1);
    for _ in 0..100 {
        ok!(placement.notify(&a));
        let next = hints.next();
        let timer = thread_sleep(Duration::from_millis(100));
        match futures::future::select(next, timer).await {
            futures::future::Either::Left((Some(hint), _)) => {
                ensure_eq!(hint, a, "the hinted agent");
                return Ok(());
            }
            futures::future::Either::Left((None, _)) => {
                return Err(ConformanceError::check(
                    "the wake-up stream stays open",
                    "it ended",
                    concat!(file!(), ":", line!()),
                ));
            }
            futures::future::Either::Right(_) => {}
        }
    }
    Err(ConformanceError::check(
        "a hint reaches the holder",
        "no hint arrived within 10 s",
        concat!(file!(), ":", line!()),
    ))
}

/// A timer that needs no async runtime: a thread sleeps, then completes the future.
fn thread_sleep(d: Duration) -> futures::channel::oneshot::Receiver<()> {
    let (tx, rx) = futures::channel::oneshot::channel();
    std::thread::spawn(move || {
        std::thread::sleep(d);
        let _ = tx.send(());
    });
    rx
}
