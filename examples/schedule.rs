//! A behaviour of your own: an agent woken on a schedule.
//!
//! `Schedule` is written here, outside the SDK, against its public API only: it implements
//! [`Behaviour`], takes its own doorbell for each agent it wakes, and reaches the host only through
//! the [`BehaviourContext`] (the clock, `enqueue`, `spawn`, `emit`). Every tick hands the agent a
//! system message whose idempotency key names the tick's slot (`schedule:{agent}:{slot}`, the slot
//! being the scheduled time divided by the period): the agent applies a key once, so a tick handed
//! over again (after a crash between the hand-over and the turn's commit, or by a second process)
//! is never answered twice.
//!
//! ```text
//! cargo run --example schedule
//! ```
//!
//! The run: the reporter is woken three times, 200 ms apart, answers each tick (the model is a
//! small function of the request), then the organization shuts down and opens again on the same
//! SQLite directory and the last tick is handed over once more: it is not answered again.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use spacebot_core::config::OrgConfig;
use spacebot_core::rt::{TokioClock, TokioSpawner};
use spacebot_core::testing::FnLlm;
use spacebot_core::{
    AgentId, AgentWorker, Behaviour, BehaviourContext, ChannelId, ChatMessage, ChatResponse,
    Envelope, EnvelopeKind, Organization, Source,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Wakes one agent every `period`, `ticks` times.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    agent: AgentId,
    period: Duration,
    ticks: u32,
}

impl Schedule {
    /// A schedule waking `agent` every `period`, `ticks` times.
    pub(crate) fn new(agent: AgentId, period: Duration, ticks: u32) -> Self {
        Self {
            agent,
            period,
            ticks,
        }
    }

    /// The tick of the slot `slot` for `agent`: a system message in the agent's schedule channel,
    /// keyed by the slot.
    pub(crate) fn tick(agent: &AgentId, slot: i64, ctx: &BehaviourContext) -> Envelope {
        Envelope::new(
            Source::System,
            ChannelId::new(format!("schedule:{agent}")),
            EnvelopeKind::Retrigger,
            format!("Scheduled report #{slot}: say in one line what you would report now."),
            ctx.clock().now(),
        )
        .with_idempotency_key(format!("schedule:{agent}:{slot}"))
    }
}

#[async_trait::async_trait]
impl Behaviour for Schedule {
    fn name(&self) -> &'static str {
        "schedule"
    }

    fn on_agent_started(&self, ctx: &BehaviourContext, agent: AgentWorker) {
        if agent.id() != &self.agent {
            return;
        }
        // The doorbell ends when the agent stops: so does the worker (a shutdown waits for it).
        let Some(mut bell) = agent.take_doorbell(self.name()) else {
            return;
        };
        let (ctx, schedule) = (ctx.clone(), self.clone());
        ctx.clone().spawn(async move {
            // The first round marks the worker started (the agent is not idle until it ended).
            drop(agent.round(&ctx));
            let period = i64::try_from(schedule.period.as_millis())
                .unwrap_or(i64::MAX)
                .max(1);
            for _ in 0..schedule.ticks {
                let wait = ctx.clock().sleep(schedule.period);
                match futures::future::select(wait, bell.next()).await {
                    futures::future::Either::Left(_) => {}
                    // Rung: nothing of ours to do on a ring; ended: the agent stopped.
                    futures::future::Either::Right((Some(()), _)) => continue,
                    futures::future::Either::Right((None, _)) => return,
                }
                let _round = agent.round(&ctx);
                let slot = ctx.clock().now().as_millis() / period;
                let tick = Schedule::tick(agent.id(), slot, &ctx);
                match ctx.enqueue(agent.id(), tick).await {
                    Ok(()) => ctx.emit(
                        agent.id(),
                        "schedule",
                        "tick",
                        serde_json::json!({ "slot": slot }),
                    ),
                    Err(e) => ctx.emit(
                        agent.id(),
                        "schedule",
                        "tick_refused",
                        serde_json::json!({ "slot": slot, "error": e.to_string() }),
                    ),
                }
            }
        });
    }
}

/// The reporter's model: one line per tick.
fn model() -> FnLlm {
    FnLlm::new(|request| {
        let asked = request
            .messages
            .iter()
            .rev()
            .find_map(|m| match m {
                ChatMessage::User { content } => Some(content.to_string()),
                _ => None,
            })
            .unwrap_or_default();
        let slot = asked
            .split('#')
            .nth(1)
            .and_then(|rest| rest.split(':').next())
            .unwrap_or("?")
            .to_string();
        Ok(ChatResponse::text(format!(
            "report for slot {slot}: all quiet"
        )))
    })
}

const CONFIG: &str = r#"
[[agents]]
id = "reporter"
name = "Reporter"
"#;

async fn organization(dir: &std::path::Path, schedule: Schedule) -> Result<Organization, BoxError> {
    let stores = spacebot_sqlite::open(dir).await?;
    let org = Organization::builder(OrgConfig::from_toml_str(CONFIG)?)
        .stores(stores)
        .llm(Arc::new(model()))
        .spawner(Arc::new(TokioSpawner::current()))
        .clock(Arc::new(TokioClock))
        .behaviour(Arc::new(schedule))
        .build()
        .await?;
    Ok(org)
}

/// Runs the example in `dir`; returns the reports the reporter gave, in order.
pub(crate) async fn run(dir: &std::path::Path, ticks: u32) -> Result<Vec<String>, BoxError> {
    let reporter = AgentId::parse("reporter")?;
    let schedule = Schedule::new(reporter.clone(), Duration::from_millis(200), ticks);
    let org = organization(dir, schedule).await?;
    let mut replies = org.take_replies().ok_or("replies already taken")?;
    org.start_all().await?;
    let mut reports = Vec::new();
    let mut last_slot = None;
    while reports.len() < ticks as usize {
        let reply = tokio::time::timeout(Duration::from_secs(10), replies.next())
            .await?
            .ok_or("the replies ended")?;
        println!("reporter: {}", reply.content);
        last_slot = reply
            .content
            .split_whitespace()
            .nth(3)
            .map(|s| s.trim_end_matches(':').parse::<i64>().unwrap_or_default());
        reports.push(reply.content);
    }
    org.shutdown().await?;
    drop(org);

    // Open the same directory again, without a schedule, and hand the last tick over once more
    // (as a crash before the hand-over was recorded would): its key was applied, so no turn runs.
    let org = organization(
        dir,
        Schedule::new(reporter.clone(), Duration::from_secs(3600), 0),
    )
    .await?;
    let mut replies = org.take_replies().ok_or("replies already taken")?;
    org.start_all().await?;
    let slot = last_slot.ok_or("no slot in the last report")?;
    let ctx = org.behaviour_context();
    ctx.enqueue(&reporter, Schedule::tick(&reporter, slot, &ctx))
        .await?;
    org.wait_idle(&reporter).await?;
    match replies.try_recv() {
        Ok(reply) => {
            return Err(format!("the repeated tick was answered again: {}", reply.content).into());
        }
        Err(_) => {
            println!("tick of slot {slot} handed over again after the restart: not answered twice")
        }
    }
    org.shutdown().await?;
    Ok(reports)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let reports = run(dir.path(), 3).await?;
    println!("{} scheduled reports", reports.len());
    Ok(())
}
