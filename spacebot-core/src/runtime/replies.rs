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
#[allow(clippy::expect_used, clippy::unwrap_used)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use futures::StreamExt;

    use crate::testing::FnLlm;
    use crate::{ChatResponse, InboundMessage, OrgConfig, Organization, Stores};

    /// On the memory stores a turn never waits, so a chain driven from a task of the runtime
    /// runs its turns in that task: the stream ran them while it waited.
    #[test]
    fn a_chain_on_memory_stores_runs_in_the_waiting_task() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
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
            let mut replies = org.take_replies().unwrap();
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
}
