//! The organization's own executor: every agent loop and task loop of one organization runs inside
//! a single background future (the *runner*), started through the organization's [`Spawner`].
//!
//! An agent's turn wakes other agents (a delegated task rings the worker's task loop, a completion
//! notice wakes the delegator, a reply to a conversation wakes the peer). Were each loop its own
//! task of the host runtime, every such wake-up would go through the host's scheduler; on Tokio's
//! multi-thread runtime a chain of wake-ups between tasks leaves the worker's LIFO slot after three
//! hops and wakes another worker thread to steal the next one (a futex call, a parked thread
//! woken for nothing most of the time). Inside the runner those wake-ups are a push on a local
//! queue: a delegation round trip costs the host runtime two polls (the application's call in, the
//! reply out), whatever the number of hops between agents.
//!
//! The runner lives as long as the host runtime keeps it: when that runtime is dropped (a crash
//! test, a process ending), the runner and with it every loop still in it are dropped, as the
//! runtime's own tasks would be. The organization keeps only a weak handle, so no loop keeps
//! itself alive through it; a spawn after the runner is gone starts a new one.
//!
//! A loop that panics ends alone, as a task of the host runtime would: the executor catches the
//! panic into the loop's own (detached) handle.
//!
//! A caller that waits on the organization (the replies stream) may *help*: when it is on the
//! host runtime ([`Spawner::is_current`]), it runs the executor's ready loops in its own task while
//! nothing has arrived for it. A chain driven by the application (deliver, await the reply) then
//! runs on the application's thread without any wake-up through the host's scheduler.

use std::sync::{Arc, Mutex, Weak};

use futures::FutureExt;
use futures::channel::oneshot;
use futures::future::BoxFuture;

use crate::durability::Durability;
use crate::time::Spawner;

type Executor = async_executor::Executor<'static>;

/// Spawns an organization's loops onto its runner.
pub(crate) struct LoopExecutor {
    shared: Arc<Shared>,
    runners: usize,
    /// Dropped with the organization: the runners then end (its loops with them).
    close: Mutex<Option<oneshot::Sender<()>>>,
}

/// What a [`Helper`] shares with the organization: never the organization itself, so that a
/// helper (the replies stream) keeps nothing alive.
struct Shared {
    spawner: Arc<dyn Spawner>,
    executor: Mutex<Weak<Executor>>,
}

impl Shared {
    fn executor(&self) -> std::sync::MutexGuard<'_, Weak<Executor>> {
        self.executor.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs an organization's ready loops in the caller's task, when the caller is on the host
/// runtime (see the module's documentation).
#[derive(Clone)]
pub(crate) struct Helper {
    shared: Arc<Shared>,
}

impl Helper {
    /// The executor, if it runs and the calling thread is on the host runtime.
    pub(crate) fn here(&self) -> Option<Arc<Executor>> {
        if !self.shared.spawner.is_current() {
            return None;
        }
        self.shared.executor().upgrade()
    }
}

impl std::fmt::Debug for Helper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Helper").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for LoopExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopExecutor").finish_non_exhaustive()
    }
}

impl LoopExecutor {
    /// Loops run on `runners` tasks of `spawner` (at least one).
    pub(crate) fn new(spawner: Arc<dyn Spawner>, runners: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                spawner,
                executor: Mutex::default(),
            }),
            runners: runners.max(1),
            close: Mutex::default(),
        }
    }

    /// A helper for callers that wait on the organization.
    pub(crate) fn helper(&self) -> Helper {
        Helper {
            shared: self.shared.clone(),
        }
    }

    /// Runs `future` on the organization's runner, starting one if there is none.
    ///
    /// Whoever polls it (a runner, or a caller helping), its writes are the runtime's own,
    /// acknowledged to no one outside the process: they may wait for the next acknowledged
    /// write's sync ([`Durability::Deferred`]).
    pub(crate) fn spawn(&self, future: BoxFuture<'static, ()>) {
        self.executor()
            .spawn(crate::durability::scope(Durability::Deferred, future))
            .detach();
    }

    /// The live executor, or a new one with its runners started through the spawner.
    fn executor(&self) -> Arc<Executor> {
        let mut current = self.shared.executor();
        if let Some(executor) = current.upgrade() {
            return executor;
        }
        let executor = Arc::new(Executor::new());
        let (close, closed) = oneshot::channel::<()>();
        let closed = closed.shared();
        for _ in 0..self.runners {
            let runner = executor.clone();
            let closed = closed.clone();
            self.shared.spawner.spawn(Box::pin(async move {
                // Ends when the organization is dropped; the last runner to end drops the
                // executor, and with it the loops still in it.
                let _ = runner.run(closed).await;
            }));
        }
        *current = Arc::downgrade(&executor);
        *self.close.lock().unwrap_or_else(|e| e.into_inner()) = Some(close);
        executor
    }
}

/// Counts an organization's background work that uses its stores outside an agent's loop (task
/// loops, custom executor attempts, wake-ups of other processes), so that a shutdown can wait for
/// it to end: once [`Background::idle`] resolves nothing of the organization touches its stores.
#[derive(Debug, Default)]
pub(crate) struct Background {
    state: Mutex<BackgroundState>,
}

#[derive(Debug, Default)]
struct BackgroundState {
    live: usize,
    waiters: Vec<oneshot::Sender<()>>,
}

/// One piece of background work, counted until it is dropped (ended, aborted or dropped unpolled).
#[derive(Debug)]
pub(crate) struct BackgroundGuard(Arc<Background>);

impl Background {
    fn state(&self) -> std::sync::MutexGuard<'_, BackgroundState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts one piece of work until the returned guard is dropped: take it before spawning the
    /// work and move it in.
    pub(crate) fn enter(self: &Arc<Self>) -> BackgroundGuard {
        self.state().live += 1;
        BackgroundGuard(self.clone())
    }

    /// Resolves once no counted work is left.
    pub(crate) async fn idle(&self) {
        loop {
            let wait = {
                let mut state = self.state();
                if state.live == 0 {
                    return;
                }
                let (tx, rx) = oneshot::channel();
                state.waiters.push(tx);
                rx
            };
            let _ = wait.await;
        }
    }
}

impl Drop for BackgroundGuard {
    fn drop(&mut self) {
        let waiters = {
            let mut state = self.0.state();
            state.live -= 1;
            if state.live > 0 {
                return;
            }
            std::mem::take(&mut state.waiters)
        };
        for w in waiters {
            let _ = w.send(());
        }
    }
}

#[cfg(all(test, feature = "tokio"))]
#[allow(clippy::panic, clippy::expect_used)]
pub(crate) mod tests {
    use super::*;
    use crate::rt::TokioSpawner;
    use futures::StreamExt;
    use std::time::Duration;

    /// A Tokio runtime of two workers (the replies tests use it too).
    pub(crate) fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// Says when it is dropped (with the loop that holds it).
    struct Guard(std::sync::mpsc::Sender<()>);

    impl Drop for Guard {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }

    /// A loop that holds a [`Guard`] and never ends, and the receiver of its drop.
    fn held_forever() -> (BoxFuture<'static, ()>, std::sync::mpsc::Receiver<()>) {
        let (dropped_tx, dropped_rx) = std::sync::mpsc::channel::<()>();
        let guard = Guard(dropped_tx);
        let future = Box::pin(async move {
            let _guard = guard;
            futures::future::pending::<()>().await;
        });
        (future, dropped_rx)
    }

    #[test]
    fn loops_run_and_a_panic_ends_only_its_own_loop() {
        let rt = runtime();
        rt.block_on(async {
            let loops = LoopExecutor::new(Arc::new(TokioSpawner::current()), 1);
            loops.spawn(Box::pin(async { panic!("boom") }));
            let (tx, rx) = oneshot::channel();
            loops.spawn(Box::pin(async move {
                let _ = tx.send(7);
            }));
            let got = tokio::time::timeout(Duration::from_secs(5), rx).await;
            assert_eq!(got.ok().and_then(Result::ok), Some(7));
        });
    }

    #[test]
    fn dropping_the_runtime_drops_the_loops() {
        let rt = runtime();
        let loops = rt.block_on(async { LoopExecutor::new(Arc::new(TokioSpawner::current()), 1) });
        let (held, dropped) = held_forever();
        let (started_tx, started_rx) = oneshot::channel::<()>();
        loops.spawn(Box::pin(async move {
            let _ = started_tx.send(());
            held.await;
        }));
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), started_rx)
                .await
                .expect("the loop started")
                .expect("the loop started");
        });
        drop(rt);
        dropped
            .recv_timeout(Duration::from_secs(5))
            .expect("the loop is dropped with the runtime");
    }

    #[test]
    fn dropping_the_organization_side_ends_the_runners() {
        for runners in [1, 2] {
            let rt = runtime();
            let (held, dropped) = held_forever();
            rt.block_on(async {
                let loops = LoopExecutor::new(Arc::new(TokioSpawner::current()), runners);
                loops.spawn(held);
                drop(loops);
            });
            dropped
                .recv_timeout(Duration::from_secs(5))
                .expect("the loop is dropped with its organization's executor");
        }
    }

    #[test]
    fn two_runners_run_two_loops_at_once() {
        let rt = runtime();
        rt.block_on(async {
            let loops = LoopExecutor::new(Arc::new(TokioSpawner::current()), 2);
            // Each loop blocks its runner until the other one has started: only two runners get
            // both going. It blocks in place (its worker thread's queue handed to another
            // thread): a runner woken from a blocked worker waits in that worker's slot, which
            // no other thread takes.
            let (a_tx, a_rx) = std::sync::mpsc::channel::<()>();
            let (b_tx, b_rx) = std::sync::mpsc::channel::<()>();
            let (done_tx, mut done_rx) = futures::channel::mpsc::unbounded::<bool>();
            for (tx, rx) in [(a_tx, b_rx), (b_tx, a_rx)] {
                let done = done_tx.clone();
                loops.spawn(Box::pin(async move {
                    let _ = tx.send(());
                    let met = tokio::task::block_in_place(|| {
                        rx.recv_timeout(Duration::from_secs(5)).is_ok()
                    });
                    let _ = done.unbounded_send(met);
                }));
            }
            for _ in 0..2 {
                let met = tokio::time::timeout(Duration::from_secs(10), done_rx.next())
                    .await
                    .expect("both loops ended");
                assert_eq!(met, Some(true), "the two loops ran at the same time");
            }
        });
    }
}
