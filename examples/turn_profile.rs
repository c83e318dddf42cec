//! A fixed amount of work for a profiler: `n` turns of one agent (deliver, a stub model answers at
//! once, the reply is out), or `n` delegation round trips, on memory stores and a `current_thread`
//! runtime (`multi` for the 2-worker runtime, `multi_on_org` for the 2-worker runtime with the
//! driver on the organization's executor), driven from a spawned task. Prints the rate it reached.
//!
//! `compare` runs the three set-ups in alternation, `rounds` times each (a fresh organization each
//! time), and prints the median rate of each and the median of the per-round ratios to
//! `current_thread`: on a shared machine, the load changes between runs; in alternation it hits
//! all three alike.
//!
//! ```text
//! cargo build --release --example turn_profile
//! valgrind --tool=callgrind target/release/examples/turn_profile turn 20000
//! perf record -g target/release/examples/turn_profile delegation 200000
//! target/release/examples/turn_profile turn 100000 multi_on_org
//! target/release/examples/turn_profile compare 50000 9        # turns; `compare_delegation` too
//! target/release/examples/turn_profile memory 10000   # resident bytes per idle agent
//! ```

#![allow(clippy::expect_used, clippy::unwrap_used)] // A profiling run that fails should stop.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use futures::StreamExt;
use spacebot::config::OrgConfig;
use spacebot::llm::{ChatRequest, ChatResponse, LlmProvider};
use spacebot::{EnvelopeKind, InboundMessage, Organization, Stores};
use spacebot_core::error::LlmError;
use spacebot_core::testing::tool_call;

/// A model that answers at once and keeps nothing (the testing providers record every request).
#[derive(Debug)]
struct Stub {
    delegate: bool,
}

#[async_trait]
impl LlmProvider for Stub {
    async fn complete(&self, req: ChatRequest) -> Result<ChatResponse, LlmError> {
        let me = req.agent.as_ref().map(|a| a.as_str()).unwrap_or("");
        Ok(match (self.delegate, me, req.envelope_kind) {
            (true, "agent-0", Some(EnvelopeKind::UserMessage)) => {
                ChatResponse::tool_calls(vec![tool_call(
                    "send_agent_message",
                    serde_json::json!({"target": "agent-1", "message": "Compute."}),
                )])
            }
            (true, "agent-1", _) => ChatResponse::text("42"),
            _ => ChatResponse::text("ok"),
        })
    }
}

/// `n` agents in a ring, each linked to the next three.
fn config(n: usize) -> OrgConfig {
    let mut toml = String::from("[settings]\nqueue_capacity = 100000\n");
    for i in 0..n {
        toml.push_str(&format!("\n[[agents]]\nid = \"agent-{i}\"\n"));
    }
    for i in 0..n {
        for step in 1..=3 {
            let j = (i + step) % n;
            toml.push_str(&format!(
                "\n[[links]]\nfrom = \"agent-{i}\"\nto = \"agent-{j}\"\nrelationship = \"peer\"\n"
            ));
        }
    }
    OrgConfig::from_toml_str(&toml).expect("valid config")
}

/// Resident memory of this process in bytes (Linux `/proc/self/statm`; 0 elsewhere).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Resident bytes per agent of `n` started, idle agents (memory stores), and after each of them
/// answered one message and went idle again.
fn memory(rt: &tokio::runtime::Runtime, n: usize) {
    rt.block_on(async {
        let config = config(n);
        let before = resident_bytes();
        let org = Organization::builder(config)
            .stores(Stores::memory())
            .llm(Arc::new(Stub { delegate: false }))
            .build()
            .await
            .expect("organization");
        org.start_all().await.expect("start");
        tokio::task::yield_now().await;
        let started = resident_bytes();
        let mut replies = org.take_replies().expect("replies");
        for i in 0..n {
            org.deliver(
                &format!("agent-{i}"),
                InboundMessage::new("portal", "u", "hi"),
            )
            .await
            .unwrap();
        }
        for _ in 0..n {
            replies.next().await.unwrap();
        }
        let answered = resident_bytes();
        let per = |bytes: u64| bytes.saturating_sub(before) as f64 / n as f64;
        println!(
            "memory: {n} agents: {:.0} B/agent started and idle, {:.0} B/agent after one turn each \
             (resident set growth; the memory stores hold each agent's history)",
            per(started),
            per(answered)
        );
    });
}

/// Where the run happens.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Setup {
    CurrentThread,
    Multi,
    MultiOnOrg,
}

impl Setup {
    fn parse(arg: Option<&str>) -> Self {
        match arg {
            Some("multi") => Self::Multi,
            Some("multi_on_org") => Self::MultiOnOrg,
            _ => Self::CurrentThread,
        }
    }

    fn runtime(self) -> tokio::runtime::Runtime {
        if self == Self::CurrentThread {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
        }
        .expect("runtime")
    }
}

/// `n` turns (or delegation round trips) of a fresh 10-agent organization; the rate per second.
fn run(setup: Setup, delegation: bool, n: usize) -> f64 {
    let rt = setup.runtime();
    let (org, mut replies) = rt.block_on(async {
        let org = Organization::builder(config(10))
            .stores(Stores::memory())
            .llm(Arc::new(Stub {
                delegate: delegation,
            }))
            .build()
            .await
            .expect("organization");
        org.start_all().await.expect("start");
        let replies = org.take_replies().expect("replies");
        (org, replies)
    });
    let driver = org.clone();
    let chain = async move {
        let start = Instant::now();
        for _ in 0..n {
            driver
                .deliver("agent-0", InboundMessage::new("portal", "u", "hi"))
                .await
                .unwrap();
            replies.next().await.unwrap();
        }
        start.elapsed().as_secs_f64()
    };
    // Driven from a spawned task, as an application's own tasks would be: on the multi-thread
    // runtime a `block_on` thread is not a worker, so every delivery and reply would cross threads.
    let secs = match setup {
        Setup::MultiOnOrg => rt.block_on(org.spawn(chain)),
        _ => rt.block_on(rt.spawn(chain)).expect("the run"),
    };
    n as f64 / secs
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn compare(delegation: bool, n: usize, rounds: usize) {
    let setups = [Setup::CurrentThread, Setup::Multi, Setup::MultiOnOrg];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); setups.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); setups.len()];
    for round in 0..rounds {
        let mut this_round = [0.0; 3];
        // The order rotates each round.
        for k in 0..setups.len() {
            let i = (k + round) % setups.len();
            this_round[i] = run(setups[i], delegation, n);
        }
        for i in 0..setups.len() {
            rates[i].push(this_round[i]);
            ratios[i].push(this_round[i] / this_round[0]);
        }
    }
    let what = if delegation { "round trips" } else { "turns" };
    for (i, setup) in setups.iter().enumerate() {
        println!(
            "{what}, {setup:?}: median {:.1}k/s over {rounds} rounds of {n}; median ratio to \
             CurrentThread {:.2}",
            median(rates[i].clone()) / 1000.0,
            median(ratios[i].clone()),
        );
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let what = args.next().unwrap_or_else(|| "turn".into());
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let third = args.next();
    match what.as_str() {
        "memory" => memory(&Setup::parse(third.as_deref()).runtime(), n),
        "compare" | "compare_delegation" => {
            let rounds = third.and_then(|s| s.parse().ok()).unwrap_or(9);
            compare(what == "compare_delegation", n, rounds);
        }
        _ => {
            let rate = run(Setup::parse(third.as_deref()), what == "delegation", n);
            println!("{what}: {n} at {rate:.0}/s");
        }
    }
}
