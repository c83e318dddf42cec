//! For tests whose organization spans processes on shared stores: whether anything still waits.

use spacebot::task::TaskFilter;
use spacebot::{AgentId, Stores, TaskStatus};

/// Whether nothing waits for any of `agents` in the shared stores: no pending delivery, no open
/// task, no undelivered completion notice.
pub(crate) async fn nothing_waits(stores: &Stores, agents: &[&str]) -> bool {
    for agent in agents {
        let agent = AgentId::parse(*agent).expect("a valid agent id");
        let open = TaskFilter {
            statuses: vec![TaskStatus::Ready, TaskStatus::InProgress],
            ..TaskFilter::default()
        };
        if !stores.deliveries.pending(&agent).await.unwrap().is_empty()
            || !stores.tasks.list(&agent, &open).await.unwrap().is_empty()
            || !stores
                .tasks
                .outbox_pending(&agent)
                .await
                .unwrap()
                .is_empty()
        {
            return false;
        }
    }
    true
}
