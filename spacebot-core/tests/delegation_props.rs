//! Property test over random delegation workloads: every delegated task that ends yields exactly
//! one notice to its delegator, in the originating channel and nowhere else.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: failing loudly is the point

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use proptest::prelude::*;
use spacebot_core::delegation::{DelegationOrigin, TaskContext, TaskExecutor, TaskOutcome};
use spacebot_core::testing::{FnLlm, OrgHarness, agent as id, last_user_text, orgs};
use spacebot_core::{ChannelId, ChatResponse, ManualClock, Task, TaskStatus};

/// Works by the description: `ok:X` is done with X, `fail:X` always fails with X, `flaky:X`
/// fails its first attempt and then is done with X.
#[derive(Debug)]
struct ByDescription;

#[async_trait]
impl TaskExecutor for ByDescription {
    async fn execute(
        &self,
        _ctx: TaskContext,
        task: Task,
    ) -> Result<TaskOutcome, spacebot_core::delegation::TaskError> {
        let (kind, rest) = task.description.split_once(':').unwrap_or(("ok", ""));
        match kind {
            "fail" => Err(rest.to_string().into()),
            "flaky" if task.attempts == 0 => Err(format!("first try of {rest}").into()),
            _ => Ok(TaskOutcome::Done(rest.to_string())),
        }
    }
}

/// Pairs the organization's links allow (see `spacebot_core::testing::orgs::DELEGATION`).
const PAIRS: [(&str, &str); 9] = [
    ("a", "b"),
    ("a", "c"),
    ("a", "d"),
    ("b", "a"),
    ("b", "c"),
    ("c", "a"),
    ("c", "b"),
    ("c", "d"),
    ("d", "c"),
];

#[derive(Debug, Clone)]
struct Delegation {
    pair: usize,
    channel: usize,
    kind: &'static str,
}

fn delegation() -> impl Strategy<Value = Delegation> {
    (
        0..PAIRS.len(),
        0usize..3,
        prop::sample::select(vec!["ok", "fail", "flaky"]),
    )
        .prop_map(|(pair, channel, kind)| Delegation {
            pair,
            channel,
            kind,
        })
}

fn name(agent: &str) -> &'static str {
    match agent {
        "a" => "Alpha",
        "b" => "Beta",
        "c" => "Gamma",
        _ => "Delta",
    }
}

async fn run(workload: Vec<Delegation>) -> Result<(), TestCaseError> {
    let llm = FnLlm::new(|_| Ok(ChatResponse::text("noted")));
    let mut builder = OrgHarness::builder(orgs::with_settings(
        "task_concurrency = 2",
        orgs::DELEGATION,
    ))
    .llm(Arc::new(llm.clone()))
    .manual_clock(ManualClock::new(1_000));
    for agent in ["a", "b", "c", "d"] {
        builder = builder.executor(agent, Arc::new(ByDescription));
    }
    let h = builder.build().await;
    h.org.start_all().await.unwrap();
    // (delegator, target, task number, channel, kind)
    let mut delegated = Vec::new();
    for (i, d) in workload.iter().enumerate() {
        let (from, to) = PAIRS[d.pair];
        let channel = ChannelId::new(format!("portal:ch{}", d.channel));
        let origin = DelegationOrigin {
            channel: channel.clone(),
            task: None,
            round: 0,
            cause: None,
            key: None,
        };
        let task = h
            .org
            .delegate(&id(from), to, &format!("{}:result-{i}", d.kind), origin)
            .await
            .unwrap();
        delegated.push((from, to, task.number, channel, d.kind));
    }
    // Every task ends and every delegator's model is woken once per task.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let mut done = llm.requests().len() >= delegated.len();
        for (_, to, number, _, _) in &delegated {
            done &= h.task(to, *number).await.status.is_terminal();
        }
        if done {
            break;
        }
        prop_assert!(
            tokio::time::Instant::now() < deadline,
            "workload did not finish"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    h.wait_quiet().await;
    prop_assert_eq!(
        llm.requests().len(),
        delegated.len(),
        "one wake-up per ended task"
    );

    for (from, to, number, channel, kind) in &delegated {
        let task = h.task(to, *number).await;
        let expected_status = if *kind == "fail" {
            TaskStatus::Failed
        } else {
            TaskStatus::Done
        };
        prop_assert_eq!(task.status, expected_status);
        let text = match task.status {
            TaskStatus::Done => format!(
                "{} completed task #{number}: {}",
                name(to),
                task.result.clone().unwrap_or_default()
            ),
            _ => format!(
                "{}'s worker failed on task #{number}: {}",
                name(to),
                task.error.clone().unwrap_or_default()
            ),
        };
        // Exactly once in the originating channel, nowhere else on either side.
        for agent in ["a", "b", "c", "d"] {
            for ch in 0..3 {
                let c = ChannelId::new(format!("portal:ch{ch}"));
                let n = h
                    .history(agent, &c)
                    .await
                    .iter()
                    .filter(|r| r.record.content == text)
                    .count();
                let expected = usize::from(agent == *from && &c == channel);
                prop_assert_eq!(n, expected, "{:?} in {}'s {}", text, agent, c);
            }
            for peer in ["a", "b", "c", "d"] {
                if peer != agent {
                    let link = h.link_texts(agent, peer).await;
                    prop_assert!(
                        !link.contains(&text),
                        "retrigger in link:{}:{}",
                        agent,
                        peer
                    );
                }
            }
        }
        let woken = llm
            .requests_for(&id(from))
            .iter()
            .filter(|r| last_user_text(&r.messages) == text)
            .count();
        prop_assert_eq!(woken, 1, "{} woken {} times by {:?}", from, woken, text);
        // The passive record is in both link channels, once.
        let verb = if task.status == TaskStatus::Done {
            format!("{to} completed task #{number}:")
        } else {
            format!("{to}'s worker failed on task #{number}:")
        };
        for (owner, peer) in [(*from, *to), (*to, *from)] {
            let n = h
                .link_texts(owner, peer)
                .await
                .iter()
                .filter(|t| t.starts_with(&verb))
                .count();
            prop_assert_eq!(n, 1, "{} in link:{}:{}", verb, owner, peer);
        }
    }
    for agent in ["a", "b", "c", "d"] {
        prop_assert!(
            h.stores
                .tasks
                .outbox_pending(&id(agent))
                .await
                .unwrap()
                .is_empty()
        );
    }
    h.org.shutdown().await.unwrap();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_ended_task_notifies_its_delegator_once_in_the_originating_channel(
        workload in prop::collection::vec(delegation(), 1..10)
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        rt.block_on(run(workload))?;
    }
}
