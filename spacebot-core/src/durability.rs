//! Which writes must reach the disk before they return.
//!
//! Every write the application makes through the organization (a [`deliver`], an operator's
//! change, a store call of its own) is an acknowledgement: on a backend that syncs, it survives a
//! power loss once it returns ([`Durability::Immediate`], the default). The runtime's own writes
//! between two acknowledgements (a turn's commit, a task's claim, a completion notice handed to its
//! delegator) need not each wait for the disk: nothing outside the process has been told of them.
//! The runtime runs its loops in a [`Durability::Deferred`] scope, and a backend that can keep
//! the order of its commits (SQLite in the organization layout: one write-ahead log) commits
//! those writes without syncing; the next immediate write, or the backend's delay, syncs them
//! with it.
//!
//! A power loss can then take back the last deferred writes, but only ever together with every
//! write after them: what is left is what a kill at that moment would have left, which the crash
//! gate tests at every write boundary. What the outside world was told before the loss (a reply,
//! a model call) may happen again after the restart, as after a kill: replies are at least once
//! and name what they answer, effects carry idempotency keys (`docs/durability.md`).
//!
//! A write that must survive before something outside the process happens, inside the runtime's
//! loops, can run in an [`Immediate`](Durability::Immediate) scope of its own. The runtime's own
//! writes do not: a limit's reservation is deferred too, so after a power loss the ledger may
//! miss the model calls of the last moments before it (a kill loses nothing of it; see
//! `docs/governance.md`).
//!
//! The scope is a property of the task that polls the future, like a tracing span: set by
//! [`scope`] on every poll of the future it wraps, read by a backend with [`current`] when a
//! write is issued. Futures spawned from inside a scope do not inherit it.
//!
//! ```
//! use spacebot_core::durability::{self, Durability};
//! # futures::executor::block_on(async {
//! assert_eq!(durability::current(), Durability::Immediate);
//! let inner = durability::scope(Durability::Deferred, async { durability::current() }).await;
//! assert_eq!(inner, Durability::Deferred);
//! assert_eq!(durability::current(), Durability::Immediate);
//! # });
//! ```
//!
//! Writes issued together (the futures of a `join`) can say so with [`together`]: a backend that
//! runs a write on its caller's thread (SQLite under deferred syncing) then holds the first a
//! moment, one yield, so that the others join its commit; outside it, a write runs at once.
//!
//! [`deliver`]: crate::Organization::deliver

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// When a write issued in a scope must be on the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// Synced before the write returns (on a backend set to sync at all). The default outside any
    /// scope.
    #[default]
    Immediate,
    /// May be synced later, with the next immediate write or after the backend's delay, on a
    /// backend whose commits are replayed in order after a power loss; others treat it as
    /// immediate.
    Deferred,
}

thread_local! {
    static CURRENT: Cell<Durability> = const { Cell::new(Durability::Immediate) };
    static TOGETHER: Cell<bool> = const { Cell::new(false) };
}

/// The durability of writes issued now, on this thread: that of the innermost [`scope`] being
/// polled, else [`Durability::Immediate`].
pub fn current() -> Durability {
    CURRENT.with(Cell::get)
}

/// Runs `future` with writes issued while it is polled taking `durability`.
pub fn scope<F: Future>(durability: Durability, future: F) -> Scoped<F> {
    Scoped {
        durability,
        future: Box::pin(future),
    }
}

/// A future whose polls run in a durability scope ([`scope`]).
#[must_use = "futures do nothing unless polled"]
pub struct Scoped<F> {
    durability: Durability,
    future: Pin<Box<F>>,
}

impl<F> std::fmt::Debug for Scoped<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scoped")
            .field("durability", &self.durability)
            .finish_non_exhaustive()
    }
}

/// Restores the outer scope's durability when a poll ends, also by a panic.
struct Restore(Durability);

impl Drop for Restore {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
    }
}

impl<F: Future> Future for Scoped<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let durability = self.durability;
        let _restore = Restore(CURRENT.with(|c| c.replace(durability)));
        self.future.as_mut().poll(cx)
    }
}

/// Whether writes issued now, on this thread, are issued together with others: inside a
/// [`together`] future being polled.
pub fn is_together() -> bool {
    TOGETHER.with(Cell::get)
}

/// Runs `future`, whose writes are issued together (for example the futures of a `join`): a
/// backend may hold the first of them a moment, one yield, so that the others join its commit.
/// Outside it, [`is_together`] is `false`. Set on every poll of `future`, as [`scope`].
///
/// ```
/// use spacebot_core::durability;
/// # futures::executor::block_on(async {
/// let (a, b) = durability::together(futures::future::join(
///     async { durability::is_together() },
///     async { durability::is_together() },
/// ))
/// .await;
/// assert!(a && b && !durability::is_together());
/// # });
/// ```
pub fn together<F: Future>(future: F) -> Together<F> {
    Together {
        while_many: None,
        future: Box::pin(future),
    }
}

/// Runs `future` with its writes issued [`together`] while `count` (of the callers writing now,
/// this one included) is above one: others are likely to write beside it.
pub(crate) fn together_while_many<F: Future>(
    count: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    future: F,
) -> Together<F> {
    Together {
        while_many: Some(count),
        future: Box::pin(future),
    }
}

/// A future whose writes are issued together ([`together`]).
#[must_use = "futures do nothing unless polled"]
pub struct Together<F> {
    /// `None`: always; else while the count is above one ([`together_while_many`]).
    while_many: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
    future: Pin<Box<F>>,
}

impl<F> std::fmt::Debug for Together<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Together").finish_non_exhaustive()
    }
}

/// Restores the outer value of [`is_together`] when a poll ends, also by a panic.
struct RestoreTogether(bool);

impl Drop for RestoreTogether {
    fn drop(&mut self) {
        TOGETHER.with(|c| c.set(self.0));
    }
}

impl<F: Future> Future for Together<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let now = self
            .while_many
            .as_ref()
            .is_none_or(|count| count.load(std::sync::atomic::Ordering::Acquire) > 1);
        // An outer `together` holds inside.
        let _restore = RestoreTogether(TOGETHER.with(|c| c.replace(c.get() || now)));
        self.future.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pending once (waking itself), then ready: the next poll is a new one.
    async fn yield_once() {
        let mut yielded = false;
        futures::future::poll_fn(|cx| {
            if yielded {
                Poll::Ready(())
            } else {
                yielded = true;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        })
        .await;
    }

    /// `together_while_many` issues writes together while the count is above one, decided at
    /// each poll, and keeps an outer `together`.
    #[test]
    fn together_while_many_follows_the_count() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let count = Arc::new(AtomicUsize::new(1));
        futures::executor::block_on(async {
            let counter = count.clone();
            let seen = together_while_many(count.clone(), async move {
                let alone = is_together();
                counter.store(2, Ordering::Release);
                // The next poll sees the new count.
                yield_once().await;
                (alone, is_together())
            })
            .await;
            assert_eq!(seen, (false, true));
            assert!(!is_together());
            count.store(1, Ordering::Release);
            let outer = together(together_while_many(count.clone(), async { is_together() }));
            assert!(outer.await);
        });
    }

    /// `together` holds across polls and is restored after each, also by a panic; a future
    /// polled outside it does not inherit it.
    #[test]
    fn together_holds_while_its_future_is_polled() {
        futures::executor::block_on(async {
            let mut made = None;
            let seen = together(async {
                let before = is_together();
                futures::future::ready(()).await;
                made = Some(async { is_together() });
                before
            })
            .await;
            assert!(seen);
            assert!(!is_together());
            assert!(!made.expect("made inside").await);
        });
        let caught = std::panic::catch_unwind(|| {
            futures::executor::block_on(together(async { panic!("on purpose") }))
        });
        assert!(caught.is_err());
        assert!(!is_together());
    }

    #[test]
    fn a_scope_holds_across_awaits_and_nests() {
        futures::executor::block_on(async {
            let seen = scope(Durability::Deferred, async {
                let before = current();
                futures::future::ready(()).await;
                // The scope is set again on the next poll.
                yield_once().await;
                let after = current();
                let inner = scope(Durability::Immediate, async { current() }).await;
                (before, after, inner, current())
            })
            .await;
            assert_eq!(
                seen,
                (
                    Durability::Deferred,
                    Durability::Deferred,
                    Durability::Immediate,
                    Durability::Deferred
                )
            );
            assert_eq!(current(), Durability::Immediate);
        });
    }

    /// A future made inside a scope but polled outside it (as a spawned one is) does not
    /// inherit it.
    #[test]
    fn a_future_polled_outside_the_scope_does_not_inherit_it() {
        futures::executor::block_on(async {
            let mut made = None;
            scope(Durability::Deferred, async {
                made = Some(async { current() });
            })
            .await;
            let made = made.expect("made in the scope");
            assert_eq!(made.await, Durability::Immediate);
        });
    }

    #[test]
    fn a_panicking_poll_leaves_the_outer_scope() {
        let caught = std::panic::catch_unwind(|| {
            futures::executor::block_on(scope(Durability::Deferred, async { panic!("on purpose") }))
        });
        assert!(caught.is_err());
        assert_eq!(current(), Durability::Immediate);
    }
}
