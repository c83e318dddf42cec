//! `spacebot`: serve an organization with its API and dashboard, check a config, print a topology,
//! read a stopped organization's tasks and channels.
//!
//! Exit codes: 0 on success, 1 when the command failed (an invalid config, a damaged data
//! directory, a server error), 2 for a usage error.
#![forbid(unsafe_code)]

mod data;
mod demo;
mod serve;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use spacebot_core::{OrgConfig, Topology};

/// Operate a spacebot organization: serve it with its HTTP API and dashboard, check its config,
/// print its topology, read a stopped organization's task boards and channels.
#[derive(Debug, Parser)]
#[command(name = "spacebot", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run an organization with the HTTP API and the dashboard; prints the URL and the token.
    ///
    /// The model is a scripted mock by default (chat messages are delegated down the hierarchy and
    /// answered); built with `--features openai`, a real provider is used when OPENAI_API_KEY,
    /// OPENAI_BASE_URL, SPACEBOT_MODEL or SPACEBOT_DIALECT is set.
    Serve(ServeArgs),
    /// Serve the organization as an MCP server over standard input and output, for an MCP client
    /// that starts it as a child process: the agents with `mcp_expose = true` are the tools
    /// `ask_<agent>`; the topology and the task boards are resources. Nothing but the protocol is
    /// written on standard output; `spacebot serve` serves the same over HTTP at `/mcp`.
    Mcp(McpArgs),
    /// Validate an organization config and print every problem found.
    Check {
        /// The organization config (TOML).
        config: PathBuf,
    },
    /// Print the configured topology.
    Topology {
        /// The organization config (TOML).
        config: PathBuf,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Json)]
        format: Format,
    },
    /// Print the task boards of a stopped organization's data directory (read-only).
    Tasks {
        /// The data directory (SQLite or redb; detected).
        dir: PathBuf,
        /// Only this agent's board.
        #[arg(long)]
        agent: Option<String>,
        /// Only tasks with this status (pending_approval, ready, in_progress, done, ...).
        #[arg(long)]
        status: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print a channel's history from a stopped organization's data directory (read-only).
    Channel {
        /// The data directory (SQLite or redb; detected).
        dir: PathBuf,
        /// The channel, such as `link:a:b` (agent a's side of its link with b).
        channel: String,
        /// The owning agent (needed unless the channel is a link channel `link:{owner}:{peer}`).
        #[arg(long)]
        agent: Option<String>,
        /// Only the last N records.
        #[arg(long)]
        limit: Option<usize>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// `spacebot serve` arguments.
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// The organization config (TOML).
    #[arg(long)]
    config: PathBuf,
    /// The data directory (created if missing).
    #[arg(long)]
    data_dir: PathBuf,
    /// The storage backend.
    #[arg(long, value_enum, default_value_t = Store::Sqlite)]
    store: Store,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1:7860")]
    addr: SocketAddr,
    /// The bearer token (default: a random one, printed). Also read from SPACEBOT_TOKEN.
    #[arg(long, env = "SPACEBOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Serve without any authentication (only on a trusted machine).
    #[arg(long, conflicts_with = "token")]
    insecure_no_auth: bool,
    /// Where the dashboard links a task's trace: a URL with `{trace_id}` in it, such as
    /// `http://localhost:16686/trace/{trace_id}` (Jaeger). Also read from SPACEBOT_TRACE_URL.
    #[arg(long, env = "SPACEBOT_TRACE_URL")]
    trace_url: Option<String>,
}

/// `spacebot mcp` arguments.
#[derive(Debug, clap::Args)]
struct McpArgs {
    /// The organization config (TOML).
    #[arg(long)]
    config: PathBuf,
    /// The data directory (created if missing).
    #[arg(long)]
    data_dir: PathBuf,
    /// The storage backend.
    #[arg(long, value_enum, default_value_t = Store::Sqlite)]
    store: Store,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Json,
    Dot,
    Mermaid,
}

/// A storage backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Store {
    /// SQLite: the whole organization in `instance.db` (a directory of the per-agent layout,
    /// `agents/{id}/data/spacebot.db`, is migrated into it when `serve` opens it).
    Sqlite,
    /// redb files (`instance.redb`, `agents/{id}/spacebot.redb`).
    Redb,
}

/// A failure of a command, printed on stderr; the process exits with 1.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    #[error(transparent)]
    Config(#[from] spacebot_core::ConfigError),
    #[error("{0}")]
    Failed(String),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("spacebot: {e}");
            ExitCode::from(1)
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Failed(format!("cannot start the runtime: {e}")))
}

fn run(cli: Cli) -> Result<ExitCode, CliError> {
    match cli.command {
        Command::Serve(args) => runtime()?
            .block_on(serve::serve(args))
            .map(|()| ExitCode::SUCCESS),
        Command::Mcp(args) => runtime()?
            .block_on(serve::mcp_stdio(args))
            .map(|()| ExitCode::SUCCESS),
        Command::Check { config } => Ok(check(&config)),
        Command::Topology { config, format } => {
            let config = OrgConfig::load(&config)?;
            let topology = Topology::from_config(&config);
            let text = match format {
                Format::Json => topology
                    .to_json()
                    .map_err(|e| CliError::Failed(format!("cannot write JSON: {e}")))?,
                Format::Dot => topology.to_dot(),
                Format::Mermaid => topology.to_mermaid(),
            };
            println!("{}", text.trim_end());
            Ok(ExitCode::SUCCESS)
        }
        Command::Tasks {
            dir,
            agent,
            status,
            json,
        } => runtime()?
            .block_on(data::tasks(&dir, agent.as_deref(), status.as_deref(), json))
            .map(|()| ExitCode::SUCCESS),
        Command::Channel {
            dir,
            channel,
            agent,
            limit,
            json,
        } => runtime()?
            .block_on(data::channel(&dir, &channel, agent.as_deref(), limit, json))
            .map(|()| ExitCode::SUCCESS),
    }
}

/// Reads the configuration as `serve` does: the organization's own checks, then every section's
/// (shared notes, MCP servers and grants; a section or an `[[agents]]` field nothing claims is
/// refused).
fn load_checked(
    path: &std::path::Path,
) -> Result<(OrgConfig, spacebot_notes::NotesConfig), spacebot_core::ConfigError> {
    let config = OrgConfig::load(path)?;
    let mut issues = Vec::new();
    if let Err(e) = config.check_sections(&[spacebot_notes::SECTION, spacebot_mcp::SECTION]) {
        issues.extend(e.issues().iter().cloned());
    }
    if let Err(e) = config.check_agent_fields(&[
        spacebot_mcp::AGENT_FIELD,
        spacebot_mcp::EXPOSE_FIELD,
        spacebot_a2a::EXPOSE_FIELD,
        spacebot_a2a::URL_FIELD,
        spacebot_a2a::TOKEN_FIELD,
    ]) {
        issues.extend(e.issues().iter().cloned());
    }
    if let Err(e) = spacebot_mcp::McpConfig::from_org(&config) {
        issues.extend(e.issues().iter().cloned());
    }
    if let Err(e) = spacebot_a2a::A2aConfig::from_org(&config) {
        issues.extend(e.issues().iter().cloned());
    }
    let notes =
        match spacebot_notes::NotesConfig::from_org(&config, spacebot_notes::DEFAULT_MAX_TEXT) {
            Ok(notes) => notes,
            Err(e) => {
                issues.extend(e.issues().iter().cloned());
                spacebot_notes::NotesConfig::default()
            }
        };
    if issues.is_empty() {
        Ok((config, notes))
    } else {
        Err(spacebot_core::ConfigError::Invalid {
            path: Some(path.to_owned()),
            issues,
        })
    }
}

fn check(path: &std::path::Path) -> ExitCode {
    match load_checked(path) {
        Ok((config, notes)) => {
            let topology = Topology::from_config(&config);
            println!(
                "{}: ok ({} agents, {} links)",
                path.display(),
                topology.agents.len(),
                topology.links.len()
            );
            if !notes.notes.is_empty() {
                let names: Vec<String> = notes.notes.iter().map(|n| n.name.to_string()).collect();
                println!("  shared notes: {}", names.join(", "));
            }
            for line in topology.describe_links() {
                println!("  {line}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let issues = e.issues();
            if issues.is_empty() {
                eprintln!("spacebot: {e}");
            } else {
                eprintln!(
                    "{}: {} problem{}:",
                    path.display(),
                    issues.len(),
                    if issues.len() == 1 { "" } else { "s" }
                );
                for issue in issues {
                    eprintln!("  {issue}");
                }
            }
            ExitCode::from(1)
        }
    }
}
