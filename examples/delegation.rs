//! The main job: multi-hop delegation across an organization of three agents.
//!
//! The user asks the chief AI officer to have the community manager pick a random word. The chief
//! delegates to the tech lead, the tech lead to the community manager; the word comes back up the
//! chain, hop by hop, and the chief answers the user.
//!
//! ```text
//! cargo run --example delegation                          # SQLite in a temporary directory, mock LLM
//! cargo run --example delegation -- --data-dir ./orgdata  # keep the data; run twice to see it survive
//! cargo run --example delegation -- --store memory
//! cargo run --example delegation --features redb -- --store redb
//! DATABASE_URL=postgres://... cargo run --example delegation --features postgres -- --store postgres
//! DATABASE_URL=postgres://... cargo run --example delegation --features postgres -- --store postgres --schema org1
//! OPENAI_API_KEY=... cargo run --example delegation --features openai   # the real provider
//! ```
//!
//! Offline (no `OPENAI_API_KEY`) every agent runs on the scripted mock LLM, so the run is the same
//! every time. With `OPENAI_API_KEY` set (and optionally `OPENAI_BASE_URL`, `SPACEBOT_MODEL`) and the
//! `openai` feature on, the same organization runs on the real provider.
//!
//! On PostgreSQL (`--store postgres`, feature `postgres`) the organization runs in the database at
//! `DATABASE_URL`: in a new schema dropped at the end, or with `--schema NAME` in that schema, kept
//! (run again to see it survive, or run several processes on it).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use spacebot_core::config::OrgConfig;
use spacebot_core::rt::{TokioClock, TokioSpawner};
use spacebot_core::task::TaskFilter;
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{
    AgentId, ChannelId, ChannelStore, InboundMessage, LlmProvider, Organization, RecordKind,
    Stores, TaskStore,
};

const USER_MESSAGE: &str =
    "Please ask the community manager to pick a random word for me, and tell me which one.";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Args {
    store: String,
    data_dir: Option<PathBuf>,
    /// The PostgreSQL schema to keep the data in (`None`: a temporary one).
    schema: Option<String>,
}

fn args() -> Result<Args, BoxError> {
    let mut args = Args {
        store: "sqlite".into(),
        data_dir: None,
        schema: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--store" => {
                args.store = it
                    .next()
                    .ok_or("--store needs sqlite, redb, postgres or memory")?
            }
            "--schema" => args.schema = Some(it.next().ok_or("--schema needs a schema name")?),
            "--data-dir" => {
                args.data_dir = Some(it.next().ok_or("--data-dir needs a path")?.into())
            }
            "-h" | "--help" => {
                println!(
                    "usage: delegation [--store sqlite|redb|postgres|memory] [--data-dir DIR] \
                     [--schema NAME (postgres; DATABASE_URL names the database)]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (try --help)").into()),
        }
    }
    Ok(args)
}

/// The stores `args` ask for, and where they keep their data.
async fn stores(args: &Args, dir: &std::path::Path) -> Result<(Stores, String), BoxError> {
    let in_dir = || dir.display().to_string();
    match args.store.as_str() {
        "memory" => Ok((Stores::memory(), "memory".into())),
        "sqlite" => Ok((spacebot_sqlite::open(dir).await?, in_dir())),
        #[cfg(feature = "redb")]
        "redb" => Ok((spacebot_redb::open(dir)?, in_dir())),
        #[cfg(not(feature = "redb"))]
        "redb" => Err("this build has no redb backend: run with --features redb".into()),
        #[cfg(feature = "postgres")]
        "postgres" => {
            let url = std::env::var("DATABASE_URL")
                .map_err(|_| "--store postgres needs DATABASE_URL (postgres://user@host/db)")?;
            let options = spacebot_postgres::PgOptions::new();
            // The stores (and a temporary schema) live as long as the bundle's last clone.
            let pg = match &args.schema {
                Some(schema) => options.schema(schema.clone()).connect(&url).await?,
                None => options.temporary(&url).await?,
            };
            Ok((pg.stores(), pg.location().to_string()))
        }
        #[cfg(not(feature = "postgres"))]
        "postgres" => {
            Err("this build has no PostgreSQL backend: run with --features postgres".into())
        }
        other => {
            Err(format!("unknown store {other:?}: use sqlite, redb, postgres or memory").into())
        }
    }
}

fn id(s: &str) -> Result<AgentId, BoxError> {
    Ok(AgentId::parse(s)?)
}

/// The scripted mock LLM: what each agent's model answers, turn by turn.
fn scripted() -> Result<Arc<dyn LlmProvider>, BoxError> {
    let llm = ScriptedLlm::new();
    let (chief, lead, cm) = (
        id("chief-ai-officer")?,
        id("spacebot-tech-lead")?,
        id("community-manager")?,
    );
    llm.push_tool_call(
        &chief,
        "send_agent_message",
        serde_json::json!({
            "target": "Spacebot Tech Lead",
            "message": "Have the community manager pick a random word. Report the word back to me."
        }),
    );
    llm.push_tool_call(
        &lead,
        "send_agent_message",
        serde_json::json!({
            "target": "community-manager",
            "message": "Pick a random word. Reply with the word only."
        }),
    );
    llm.push_text(&cm, "nebula");
    llm.push_text(&lead, "The community manager picked the word \"nebula\".");
    llm.push_text(
        &chief,
        "The community manager picked a random word for you: nebula.",
    );
    Ok(Arc::new(llm))
}

#[cfg(feature = "openai")]
fn provider() -> Result<(Arc<dyn LlmProvider>, &'static str), BoxError> {
    if std::env::var_os("OPENAI_API_KEY").is_some() {
        let config = spacebot_openai::OpenAiConfig::from_env()?;
        let provider = spacebot_openai::OpenAiProvider::new(config, Arc::new(TokioClock))?;
        return Ok((Arc::new(provider), "the OpenAI-compatible provider"));
    }
    Ok((scripted()?, "the scripted mock LLM"))
}

#[cfg(not(feature = "openai"))]
fn provider() -> Result<(Arc<dyn LlmProvider>, &'static str), BoxError> {
    if std::env::var_os("OPENAI_API_KEY").is_some() {
        eprintln!(
            "OPENAI_API_KEY is set but this build has no provider: run with --features openai"
        );
    }
    Ok((scripted()?, "the scripted mock LLM"))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = args()?;
    let temp = tempfile::tempdir()?;
    let dir = args
        .data_dir
        .clone()
        .unwrap_or_else(|| temp.path().to_path_buf());
    std::fs::create_dir_all(&dir)?;
    let (stores, place) = stores(&args, &dir).await?;
    let (llm, llm_name) = provider()?;
    println!(
        "spacebot delegation example: store {} in {place}, {llm_name}\n",
        args.store,
    );

    // Chief superior of the tech lead, tech lead superior of the community manager (seed 000).
    let config = OrgConfig::load(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/org.toml"))?;
    let org = Organization::builder(config)
        .stores(stores.clone())
        .llm(llm)
        .spawner(Arc::new(TokioSpawner::current()))
        .clock(Arc::new(TokioClock))
        .build()
        .await?;
    let mut replies = org.take_replies().ok_or("replies already taken")?;
    org.start_all().await?;

    let chief = id("chief-ai-officer")?;
    let message = InboundMessage::new("portal", "user-1", USER_MESSAGE)
        .with_channel(ChannelId::portal(&chief));
    org.deliver("chief-ai-officer", message).await?;
    let reply = tokio::time::timeout(Duration::from_secs(120), replies.next())
        .await
        .map_err(|_| "no answer within 120 s")?
        .ok_or("the reply stream closed")?;
    if reply.is_failure() {
        // The turn failed (the model could not be reached, or it ran out of tool rounds): say why
        // at once instead of waiting.
        org.shutdown().await?;
        return Err(format!("{} {}", org.display_name(&chief), reply.content).into());
    }
    org.shutdown().await?;

    println!(
        "== The user's conversation with {}",
        org.display_name(&chief)
    );
    print_channel(&stores, &chief, &ChannelId::portal(&chief), false).await?;
    println!(
        "\n   reply delivered to {:?}: {}\n",
        reply.reply_target(),
        reply.content
    );

    for link in org.graph().links() {
        for (owner, peer) in [(&link.from, &link.to), (&link.to, &link.from)] {
            println!(
                "== Link channel {} (audit log)",
                ChannelId::link(owner, peer)
            );
            print_channel(&stores, owner, &ChannelId::link(owner, peer), true).await?;
            println!();
        }
    }
    for agent in org.agent_ids() {
        println!("== Task board of {}", org.display_name(&agent));
        let tasks = stores.tasks.list(&agent, &TaskFilter::default()).await?;
        if tasks.is_empty() {
            println!("   (empty)");
        }
        for task in tasks {
            println!(
                "   #{} [{}] {} (created by {}, chain {:?}) -> {}",
                task.number,
                task.status,
                task.title,
                task.created_by,
                task.metadata
                    .delegation_chain
                    .iter()
                    .map(AgentId::as_str)
                    .collect::<Vec<_>>(),
                task.result.as_deref().unwrap_or("-")
            );
        }
        println!();
    }
    let kept = match args.store.as_str() {
        "postgres" => args.schema.is_some(),
        "memory" => false,
        _ => args.data_dir.is_some(),
    };
    if kept {
        println!("The data stays in {place}: run again to see the boards and logs grow.");
    }
    Ok(())
}

async fn print_channel(
    stores: &Stores,
    agent: &AgentId,
    channel: &ChannelId,
    audit_only: bool,
) -> Result<(), BoxError> {
    let history = stores.channels.history(agent, channel, None).await?;
    if history.is_empty() {
        println!("   (empty)");
    }
    for record in history {
        let r = record.record;
        if audit_only && r.kind != RecordKind::System {
            continue;
        }
        if !audit_only && r.kind == RecordKind::Tool {
            println!("   [tool] {}", r.content);
            continue;
        }
        println!("   [{}] {}: {}", r.kind, r.author, r.content);
    }
    Ok(())
}
