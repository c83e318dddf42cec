//! Tokio implementations of [`Spawner`] and [`Clock`] (feature `tokio`).

use std::time::Duration;

use futures::future::BoxFuture;

use crate::time::{Clock, Spawner, Timestamp};

/// Spawns onto the current Tokio runtime (or the one given to [`TokioSpawner::with_handle`]).
#[derive(Debug, Clone)]
pub struct TokioSpawner {
    handle: tokio::runtime::Handle,
}

impl TokioSpawner {
    /// A spawner for the runtime this is called from.
    ///
    /// # Panics
    /// Panics when called outside a Tokio runtime (as [`tokio::runtime::Handle::current`] does);
    /// use [`TokioSpawner::with_handle`] or [`TokioSpawner::try_current`] to avoid that.
    #[allow(clippy::expect_used)]
    pub fn current() -> Self {
        Self::try_current().expect("TokioSpawner::current called outside a Tokio runtime")
    }

    /// A spawner for the runtime this is called from, or `None` outside one.
    pub fn try_current() -> Option<Self> {
        tokio::runtime::Handle::try_current()
            .ok()
            .map(|handle| Self { handle })
    }

    /// A spawner for the given runtime.
    pub fn with_handle(handle: tokio::runtime::Handle) -> Self {
        Self { handle }
    }
}

impl Spawner for TokioSpawner {
    fn spawn(&self, future: BoxFuture<'static, ()>) {
        drop(self.handle.spawn(future));
    }

    /// Inside this spawner's runtime (on one of its worker threads, or in its `block_on`).
    fn is_current(&self) -> bool {
        tokio::runtime::Handle::try_current().is_ok_and(|here| here.id() == self.handle.id())
    }
}

/// Wall-clock time and Tokio timers.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        Timestamp::now_utc()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(duration))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn spawner_runs_futures_and_clock_sleeps() {
        let (tx, rx) = futures::channel::oneshot::channel();
        TokioSpawner::current().spawn(Box::pin(async move {
            let _ = tx.send(7);
        }));
        assert_eq!(rx.await.ok(), Some(7));
        assert!(TokioSpawner::current().is_current());
        // Another runtime's handle (that runtime built and dropped on a thread of its own).
        let other = std::thread::spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .map(|rt| rt.handle().clone())
        })
        .join()
        .expect("the thread")
        .expect("a runtime");
        assert!(!TokioSpawner::with_handle(other).is_current());
        let before = TokioClock.now();
        TokioClock.sleep(Duration::from_millis(5)).await;
        assert!(TokioClock.now() >= before);
    }
}
