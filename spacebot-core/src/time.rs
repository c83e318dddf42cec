//! Time and spawning: the two effects the runtime needs from an executor.
//!
//! The core never names an async runtime. [`Clock`] gives the current time and sleeps;
//! [`Spawner`] starts background futures. The `tokio` feature supplies
//! [`TokioClock`](crate::rt::TokioClock) and [`TokioSpawner`](crate::rt::TokioSpawner); tests use
//! [`ManualClock`], whose time only moves when the test says so.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::channel::oneshot;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

/// Milliseconds since the Unix epoch. Stored as an integer by every backend.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Timestamp(pub i64);

impl Timestamp {
    /// Milliseconds since the Unix epoch.
    pub fn as_millis(self) -> i64 {
        self.0
    }

    /// This instant plus `d` (saturating).
    pub fn plus(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Self(self.0.saturating_add(ms))
    }

    /// The current wall-clock time.
    pub fn now_utc() -> Self {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        Self(ms)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// The source of time for leases, retries, backoff and timeouts.
///
/// # Contract
/// - `now` never goes backwards.
/// - The future returned by `sleep(d)` completes once `now()` has advanced by at least `d` since the
///   call; it must not complete earlier. It may be dropped at any time.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
    /// A future that completes after `duration`, measured by this clock.
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()>;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        (**self).sleep(duration)
    }
}

/// Starts background futures. The runtime uses it for agent loops, task loops and outbox delivery.
///
/// # Contract
/// - `spawn` runs the future to completion (unless the executor shuts down); it does not block.
pub trait Spawner: Send + Sync + fmt::Debug + 'static {
    /// Runs `future` in the background.
    fn spawn(&self, future: BoxFuture<'static, ()>);

    /// Whether the calling thread is inside the executor this spawner spawns onto, so that a
    /// future of that executor could as well be polled right here. An organization then lets a
    /// caller that waits on it (the replies stream) run its ready agent loops in the caller's own
    /// task. The default, `false`, never does.
    fn is_current(&self) -> bool {
        false
    }
}

impl<S: Spawner + ?Sized> Spawner for Arc<S> {
    fn spawn(&self, future: BoxFuture<'static, ()>) {
        (**self).spawn(future)
    }
    fn is_current(&self) -> bool {
        (**self).is_current()
    }
}

#[derive(Debug, Default)]
struct ManualState {
    now: i64,
    next_id: u64,
    sleepers: BTreeMap<(i64, u64), oneshot::Sender<()>>,
}

/// A clock whose time moves only when [`ManualClock::advance`] or [`ManualClock::set`] is called.
///
/// Sleeps complete, in deadline order, when the clock reaches their deadline, so leases, retries and
/// timeouts are deterministic in tests.
///
/// ```
/// use spacebot_core::{Clock, ManualClock};
/// use std::time::Duration;
/// let clock = ManualClock::new(1_000);
/// let mut sleep = clock.sleep(Duration::from_millis(50));
/// assert!(futures::FutureExt::now_or_never(&mut sleep).is_none());
/// clock.advance(Duration::from_millis(50));
/// assert!(futures::FutureExt::now_or_never(&mut sleep).is_some());
/// assert_eq!(clock.now().as_millis(), 1_050);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    state: Arc<Mutex<ManualState>>,
}

impl ManualClock {
    /// A manual clock starting at `start_millis` since the epoch.
    pub fn new(start_millis: i64) -> Self {
        let clock = Self::default();
        clock.lock().now = start_millis;
        clock
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ManualState> {
        // A poisoned lock only means another thread panicked mid-update of plain data.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Moves time forward by `d`, waking every sleep whose deadline has been reached.
    pub fn advance(&self, d: Duration) {
        let target = Timestamp(self.lock().now).plus(d).0;
        self.set(target);
    }

    /// Sets the time to `millis` (ignored if it would go backwards), waking due sleeps.
    pub fn set(&self, millis: i64) {
        let due = {
            let mut st = self.lock();
            if millis > st.now {
                st.now = millis;
            }
            let now = st.now;
            let later = st.sleepers.split_off(&(now + 1, 0));
            std::mem::replace(&mut st.sleepers, later)
        };
        for (_, tx) in due {
            let _ = tx.send(());
        }
    }

    /// Number of sleeps that have not completed yet (dropped ones included until time passes them).
    pub fn pending_sleeps(&self) -> usize {
        self.lock().sleepers.len()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.lock().now)
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.lock();
            let deadline = Timestamp(st.now).plus(duration).0;
            if duration.is_zero() {
                let _ = tx.send(());
            } else {
                let id = st.next_id;
                st.next_id += 1;
                st.sleepers.insert((deadline, id), tx);
            }
        }
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn sleeps_wake_in_deadline_order_and_not_before() {
        let clock = ManualClock::new(0);
        let mut a = clock.sleep(Duration::from_millis(10));
        let mut b = clock.sleep(Duration::from_millis(20));
        clock.advance(Duration::from_millis(9));
        assert!((&mut a).now_or_never().is_none());
        clock.advance(Duration::from_millis(1));
        assert!((&mut a).now_or_never().is_some());
        assert!((&mut b).now_or_never().is_none());
        clock.set(5); // backwards: ignored
        assert_eq!(clock.now(), Timestamp(10));
        clock.advance(Duration::from_millis(10));
        assert!(b.now_or_never().is_some());
        assert_eq!(clock.pending_sleeps(), 0);
    }
}
