//! In-memory delegation round trips: `delegate` creates the task on the target's board, the
//! target's task loop claims it, the task completes, and the notice is delivered to the delegator,
//! whose model is woken in its originating channel and answers (the iteration ends at that
//! answer).
//!
//! Two workers: a deterministic custom `TaskExecutor`, and the target's own tool loop over the
//! scripted mock LLM. Each sample builds a fresh organization so boards do not grow across samples.
//!
//! Run: `cargo bench -p spacebot-benches --bench delegation -- --warm-up-time 1 --measurement-time 3`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: failing loudly is the point

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use futures::StreamExt;
use spacebot_core::delegation::{DelegationOrigin, TaskContext, TaskExecutor, TaskOutcome};
use spacebot_core::rt::{TokioClock, TokioSpawner};
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{AgentId, ChannelId, ChatResponse, OrgConfig, Organization, Stores, Task};

const CONFIG: &str = r#"
[[agents]]
id = "chief"

[[agents]]
id = "worker"

[[links]]
from = "chief"
to = "worker"
relationship = "superior"
"#;

/// Done at once with a fixed result.
#[derive(Debug)]
struct Instant42;

#[async_trait]
impl TaskExecutor for Instant42 {
    async fn execute(
        &self,
        _ctx: TaskContext,
        _task: Task,
    ) -> Result<TaskOutcome, spacebot_core::delegation::TaskError> {
        Ok(TaskOutcome::Done("42".into()))
    }
}

fn agent(s: &str) -> AgentId {
    AgentId::parse(s).unwrap_or_else(|e| panic!("agent id {s}: {e}"))
}

/// Runs `iters` round trips on a fresh organization and returns the time they took.
async fn round_trips(iters: u64, custom_executor: bool) -> Duration {
    let config = OrgConfig::from_toml_str(CONFIG).unwrap_or_else(|e| panic!("config: {e}"));
    let llm = ScriptedLlm::new().with_fallback(|_| Ok(ChatResponse::text("42, relayed")));
    let mut builder = Organization::builder(config)
        .stores(Stores::memory())
        .llm(Arc::new(llm))
        .spawner(Arc::new(TokioSpawner::current()))
        .clock(Arc::new(TokioClock));
    if custom_executor {
        builder = builder.task_executor(agent("worker"), Arc::new(Instant42));
    }
    let org = builder
        .build()
        .await
        .unwrap_or_else(|e| panic!("build: {e}"));
    let mut replies = org
        .take_replies()
        .unwrap_or_else(|| panic!("replies taken"));
    org.start_all()
        .await
        .unwrap_or_else(|e| panic!("start: {e}"));
    let chief = agent("chief");
    let origin = DelegationOrigin::new(ChannelId::new("portal:bench"));
    let start = Instant::now();
    for _ in 0..iters {
        org.delegate(&chief, "worker", "Compute the answer.", origin.clone())
            .await
            .unwrap_or_else(|e| panic!("delegate: {e}"));
        // The chief's answer to the retrigger: the notice arrived and woke its model.
        replies.next().await.unwrap_or_else(|| panic!("no reply"));
    }
    let elapsed = start.elapsed();
    org.shutdown()
        .await
        .unwrap_or_else(|e| panic!("shutdown: {e}"));
    elapsed
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let mut group = c.benchmark_group("delegation_round_trip");
    group.throughput(Throughput::Elements(1));
    group.bench_function("custom_executor", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| round_trips(iters, true));
    });
    group.bench_function("scripted_llm_worker", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| round_trips(iters, false));
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
