//! The stream of an organization's replies ([`Organization::take_replies`]).
//!
//! [`Organization::take_replies`]: crate::Organization::take_replies

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::channel::mpsc;
use futures::stream::{FusedStream, Stream, StreamExt};

use crate::runtime::Reply;
use crate::runtime::executor::Helper;

/// How many agent loop polls one wait for a reply runs in the caller's task before it yields.
const HELP_BUDGET: usize = 64;

/// The replies of an organization's root agents, in the order they were sent.
///
/// A [`Stream`] (use `futures::StreamExt::next`); it ends when the organization is gone and every
/// reply was read.
///
/// **While it waits, it helps.** When nothing has arrived and the caller runs on the
/// organization's host runtime (the runtime its [`Spawner`](crate::Spawner) spawns onto), the
/// stream runs the organization's ready agent loops in the caller's own task, up to 64 polls per
/// wait, before it waits for real. A chain driven by the application (deliver, await the reply,
/// deliver again) then runs on the application's thread: no wake-up goes through the host's
/// scheduler, which on Tokio's multi-thread runtime would cost cross-thread wake-ups every few
/// hops. Nothing else changes: the loops it runs are the organization's (one turn of an agent at
/// a time, wherever it runs), a loop that waits (on a model, a tool, a store) goes back to the
/// organization's own runners, and a panic in a loop stays in that loop. Outside the host runtime
/// it only waits.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use futures::StreamExt;
/// use spacebot_core::testing::FnLlm;
/// use spacebot_core::{ChatResponse, InboundMessage, OrgConfig, Organization, Stores};
///
/// let config = OrgConfig::from_toml_str("[[agents]]\nid = \"echo\"\nname = \"Echo\"\n")?;
/// let org = Organization::builder(config)
///     .stores(Stores::memory())
///     .llm(std::sync::Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("pong")))))
///     .build()
///     .await?;
/// org.start_all().await?;
/// let mut replies = org.take_replies().expect("no outbound was set");
/// let id = org.deliver("echo", InboundMessage::new("portal", "u", "ping")).await?;
/// let reply = replies.next().await.expect("a reply");
/// assert_eq!((reply.content.as_str(), reply.in_reply_to), ("pong", vec![id]));
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Replies {
    rx: mpsc::UnboundedReceiver<Reply>,
    helper: Helper,
}

impl Replies {
    pub(crate) fn new(rx: mpsc::UnboundedReceiver<Reply>, helper: Helper) -> Self {
        Self { rx, helper }
    }

    /// The next reply if one is there already, without waiting (and without running any agent
    /// loop). `Err` when none is there, or when the stream has ended.
    pub fn try_recv(&mut self) -> Result<Reply, mpsc::TryRecvError> {
        self.rx.try_recv()
    }
}

impl Stream for Replies {
    type Item = Reply;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Reply>> {
        let this = self.get_mut();
        let mut executor = None;
        for _ in 0..HELP_BUDGET {
            if let Poll::Ready(item) = this.rx.poll_next_unpin(cx) {
                return Poll::Ready(item);
            }
            if executor.is_none() {
                executor = this.helper.here();
            }
            // Nothing ready to run here: wait for the reply (the runners go on).
            if !executor.as_ref().is_some_and(|e| e.try_tick()) {
                return Poll::Pending;
            }
        }
        match this.rx.poll_next_unpin(cx) {
            Poll::Ready(item) => Poll::Ready(item),
            Poll::Pending => {
                // The budget is spent and work remains: let the caller's runtime run others.
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.rx.size_hint()
    }
}

impl FusedStream for Replies {
    fn is_terminated(&self) -> bool {
        self.rx.is_terminated()
    }
}

#[cfg(all(test, feature = "testing", feature = "tokio"))]
#[allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use futures::StreamExt;

    use super::Replies;
    use crate::runtime::executor::tests::runtime;
    use crate::testing::FnLlm;
    use crate::{ChatResponse, InboundMessage, OrgConfig, Organization, Stores};

    /// A started organization of one agent, `echo`, on the memory stores, whose model answers
    /// "pong" and records the Tokio task each call ran in.
    async fn echo_org() -> (
        Organization,
        Replies,
        Arc<Mutex<Vec<Option<tokio::task::Id>>>>,
    ) {
        let seen: Arc<Mutex<Vec<Option<tokio::task::Id>>>> = Arc::default();
        let record = seen.clone();
        let llm = FnLlm::new(move |_| {
            record.lock().unwrap().push(tokio::task::try_id());
            Ok(ChatResponse::text("pong"))
        });
        let config =
            OrgConfig::from_toml_str("[[agents]]\nid = \"echo\"\nname = \"Echo\"\n").unwrap();
        let org = Organization::builder(config)
            .stores(Stores::memory())
            .llm(Arc::new(llm))
            .build()
            .await
            .unwrap();
        org.start_all().await.unwrap();
        let replies = org.take_replies().unwrap();
        (org, replies, seen)
    }

    /// On the memory stores a turn never waits, so a chain driven from a task of the runtime
    /// runs its turns in that task: the stream ran them while it waited.
    #[test]
    fn a_chain_on_memory_stores_runs_in_the_waiting_task() {
        runtime().block_on(async {
            let (org, mut replies, seen) = echo_org().await;
            let driver = tokio::spawn(async move {
                for n in 0..20 {
                    org.deliver(
                        "echo",
                        InboundMessage::new("portal", "u", format!("ping {n}")),
                    )
                    .await
                    .unwrap();
                    let reply = tokio::time::timeout(Duration::from_secs(10), replies.next())
                        .await
                        .expect("a reply within 10 s")
                        .expect("a reply");
                    assert_eq!(reply.content, "pong");
                }
                tokio::task::id()
            })
            .await
            .unwrap();
            let seen = seen.lock().unwrap().clone();
            let in_driver = seen.iter().filter(|task| **task == Some(driver)).count();
            // The first turns may race the runners' start-up; the chain then settles in the driver.
            assert!(
                in_driver >= 10,
                "{in_driver} of {} turns ran in the waiting task",
                seen.len()
            );
        });
    }

    /// The stream ends once the organization is shut down and dropped and every reply was read.
    #[test]
    fn the_stream_ends_when_the_organization_is_gone() {
        runtime().block_on(async {
            let (org, mut replies, _) = echo_org().await;
            org.deliver("echo", InboundMessage::new("portal", "u", "ping"))
                .await
                .unwrap();
            org.wait_idle(&crate::AgentId::parse("echo").unwrap())
                .await
                .unwrap();
            org.shutdown().await.unwrap();
            drop(org);
            let first = tokio::time::timeout(Duration::from_secs(10), replies.next())
                .await
                .expect("the reply within 10 s");
            assert_eq!(first.map(|r| r.content).as_deref(), Some("pong"));
            let end = tokio::time::timeout(Duration::from_secs(10), replies.next())
                .await
                .expect("the end within 10 s");
            assert!(end.is_none());
            assert!(futures::stream::FusedStream::is_terminated(&replies));
        });
    }

    /// A wait runs at most its budget of loop polls, then gives its thread back: a loop that is
    /// always ready (it wakes itself at every poll) does not keep the waiting task forever. The
    /// wait runs on a current-thread runtime on a thread of its own, and must time out (10 s at
    /// most for the whole check, or the wait kept its thread).
    #[test]
    fn a_wait_gives_its_thread_back_after_its_budget() {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            let outcome = rt.block_on(async {
                let loops = crate::runtime::executor::LoopExecutor::new(
                    Arc::new(crate::rt::TokioSpawner::current()),
                    1,
                );
                let spins = Arc::new(std::sync::atomic::AtomicU64::new(0));
                let counter = spins.clone();
                loops.spawn(Box::pin(futures::future::poll_fn(move |cx| {
                    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    cx.waker().wake_by_ref();
                    std::task::Poll::<()>::Pending
                })));
                let (_never, rx) = futures::channel::mpsc::unbounded();
                let mut replies = Replies::new(rx, loops.helper());
                let waited = tokio::time::timeout(Duration::from_millis(100), replies.next()).await;
                (
                    waited.is_err(),
                    spins.load(std::sync::atomic::Ordering::Relaxed),
                )
            });
            let _ = done_tx.send(outcome);
        });
        let (timed_out, spins) = done_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the wait gave its thread back");
        assert!(timed_out, "nothing was sent, the wait must time out");
        assert!(spins > 64, "the loop was ready all along ({spins} polls)");
    }

    /// `Organization::spawn` runs its future on the organization's executor (the Tokio task of a
    /// runner, not the caller's) and resumes a panic where the handle is awaited.
    #[test]
    fn organization_spawn_runs_on_a_runner_and_resumes_a_panic() {
        runtime().block_on(async {
            let (org, _replies, _) = echo_org().await;
            let caller = tokio::spawn(async { tokio::task::id() }).await.unwrap();
            let ran_in = org.spawn(async { tokio::task::try_id() }).await;
            assert!(ran_in.is_some() && ran_in != Some(caller), "{ran_in:?}");
            let handle = org.spawn(async { panic!("on purpose") });
            let awaited = tokio::spawn(handle).await;
            assert!(awaited.is_err_and(|e| e.is_panic()));
            // The executor goes on after the panic.
            assert_eq!(org.spawn(async { 7 }).await, 7);
        });
    }
}
