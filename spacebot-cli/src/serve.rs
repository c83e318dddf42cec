//! `spacebot serve`.

use std::sync::Arc;

use spacebot_core::rt::{TokioClock, TokioSpawner};
use spacebot_core::{LlmProvider, OrgConfig, Organization, Stores};
use spacebot_http::{Api, HttpConfig, WebChat};

use crate::{CliError, McpArgs, ServeArgs, Store};

/// Prints a line; a closed stdout (the reader went away) does not stop the server.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, $($arg)*);
        let _ = out.flush();
    }};
}

fn failed(message: impl Into<String>) -> CliError {
    CliError::Failed(message.into())
}

/// Setting any of these selects the OpenAI-compatible provider (built with `--features openai`).
#[cfg(feature = "openai")]
const PROVIDER_VARS: [&str; 4] = [
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "SPACEBOT_MODEL",
    "SPACEBOT_DIALECT",
];

#[cfg(feature = "openai")]
fn provider(config: &OrgConfig) -> Result<(Arc<dyn LlmProvider>, String), CliError> {
    // The variables that choose a model or a server; the provider's tuning variables alone (or
    // unrelated SPACEBOT_* ones, such as a test database's) keep the demo model.
    let configured = PROVIDER_VARS
        .iter()
        .any(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()));
    if configured {
        let settings = spacebot_openai::OpenAiConfig::from_env()
            .map_err(|e| failed(format!("provider settings: {e}")))?;
        let provider = spacebot_openai::OpenAiProvider::new(settings, Arc::new(TokioClock))
            .map_err(|e| failed(format!("provider: {e}")))?;
        return Ok((Arc::new(provider), "the OpenAI-compatible provider".into()));
    }
    Ok((
        Arc::new(crate::demo::model(config)),
        "the scripted demo model".into(),
    ))
}

#[cfg(not(feature = "openai"))]
fn provider(config: &OrgConfig) -> Result<(Arc<dyn LlmProvider>, String), CliError> {
    if std::env::var_os("OPENAI_API_KEY").is_some() {
        eprintln!(
            "note: OPENAI_API_KEY is set but this build has no provider; build with --features openai"
        );
    }
    Ok((
        Arc::new(crate::demo::model(config)),
        "the scripted demo model".into(),
    ))
}

/// Telemetry, when built with `otel` and an OTLP endpoint is configured (`OTEL_*` variables).
#[cfg(feature = "otel")]
fn telemetry() -> Result<Option<spacebot::otel::Otel>, CliError> {
    let configured = [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|name| std::env::var_os(name).is_some_and(|v| !v.is_empty()));
    if !configured {
        return Ok(None);
    }
    spacebot::otel::init()
        .map(Some)
        .map_err(|e| failed(format!("telemetry: {e}")))
}

/// Resolves at the first Ctrl-C (SIGINT) or, on Unix, SIGTERM (what `docker stop` and systemd
/// send). Listening starts when this is called, so a signal that comes while the organization
/// starts is not lost (nor does it kill the process without a shutdown).
fn stop_signal() -> Result<impl std::future::Future<Output = ()> + Send + 'static, CliError> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let listen = |kind: SignalKind, name: &str| {
            signal(kind).map_err(|e| failed(format!("cannot listen for {name}: {e}")))
        };
        let mut interrupt = listen(SignalKind::interrupt(), "Ctrl-C")?;
        let mut terminate = listen(SignalKind::terminate(), "SIGTERM")?;
        Ok(async move {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}

pub(crate) async fn serve(args: ServeArgs) -> Result<(), CliError> {
    #[cfg(feature = "otel")]
    let otel = telemetry()?;
    let config = OrgConfig::load(&args.config)?;
    // The port first: an address in use is reported before anything is opened or started.
    let listener = tokio::net::TcpListener::bind(args.addr)
        .await
        .map_err(|e| failed(format!("cannot listen on {}: {e}", args.addr)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| failed(format!("cannot read the bound address: {e}")))?;
    let stop = stop_signal()?;
    std::fs::create_dir_all(&args.data_dir)
        .map_err(|e| failed(format!("{}: {e}", args.data_dir.display())))?;
    let stores: Stores = match args.store {
        Store::Sqlite => spacebot_sqlite::open(&args.data_dir).await,
        Store::Redb => spacebot_redb::open_async(&args.data_dir).await,
    }
    .map_err(|e| failed(e.to_string()))?;
    // The rule for links: the configuration wins for the links it names, and says so for each
    // link changed or deleted at run time (the dashboard's topology editor) that it resets.
    let stored = stores
        .links
        .list()
        .await
        .map_err(|e| failed(e.to_string()))?;
    for reset in config.link_resets(&stored) {
        say!(
            "warning: {reset} (edit {} to keep a change)",
            args.config.display()
        );
    }
    let (llm, llm_name) = provider(&config)?;
    let chat = WebChat::new();
    // MCP clients' calls get their replies; every other reply goes to the web chat.
    let mcp_chat = spacebot_mcp::McpChat::new().with_fallback(Arc::new(chat.clone()));
    // A2A tasks are completed with their agents' replies; the rest goes on to the MCP chat.
    let a2a = spacebot_a2a::A2a::new().with_fallback(Arc::new(mcp_chat.clone()));
    let notes = spacebot_notes::Notes::new();
    let mcp = spacebot_mcp::Mcp::new();
    let org = Organization::builder(config)
        .stores(stores.clone())
        .llm(llm)
        .spawner(Arc::new(TokioSpawner::current()))
        .clock(Arc::new(TokioClock))
        .outbound(Arc::new(a2a.clone()))
        .behaviour(Arc::new(notes.clone()))
        .behaviour(Arc::new(mcp.clone()))
        .behaviour(Arc::new(a2a.clone()))
        .build()
        .await
        .map_err(|e| failed(e.to_string()))?;
    let http = if args.insecure_no_auth {
        HttpConfig::insecure_no_auth()
    } else if let Some(token) = args.token {
        HttpConfig::with_token(token)
    } else {
        HttpConfig::random_token()
    };
    let http = match args.trace_url.filter(|t| !t.is_empty()) {
        Some(template) => http.with_trace_url(template),
        None => http,
    };
    let token = http.token().map(str::to_string);
    let api = Api::new(org.clone(), chat, http)
        .map_err(|e| failed(e.to_string()))?
        .with_notes(notes)
        .with_mcp_tools(mcp.clone())
        .with_mcp(
            spacebot_mcp::OrgServer::new(org.clone(), mcp_chat)
                .map_err(|e| failed(e.to_string()))?,
        )
        .with_a2a(
            spacebot_a2a::A2aServer::new(org.clone(), a2a).map_err(|e| failed(e.to_string()))?,
        );
    let app = api.router();
    // The agents start once everything that can refuse the settings has accepted them.
    if let Err(e) = org.start_all().await {
        let _ = org.shutdown().await;
        return Err(failed(e.to_string()));
    }
    #[cfg(feature = "otel")]
    if otel.is_some() {
        tokio::spawn(spacebot::otel::observe(org.clone()));
        say!("telemetry: OTLP/HTTP to the collector the OTEL_* variables name");
    }
    say!(
        "spacebot: {} agents, store {:?} in {}, {llm_name}",
        org.agent_ids().len(),
        args.store,
        args.data_dir.display()
    );
    match &token {
        Some(token) => {
            say!("dashboard: http://{addr}/#token={token}");
            say!("api:       http://{addr}/api (Authorization: Bearer {token})");
            say!("mcp:       http://{addr}/mcp (streamable HTTP, the same bearer token)");
            say!(
                "a2a:       http://{addr}/.well-known/agent-card.json (JSON-RPC at /a2a, the same bearer token)"
            );
            say!("token:     {token}");
        }
        None => {
            say!("dashboard: http://{addr}/");
            say!("api:       http://{addr}/api (no authentication)");
            say!("mcp:       http://{addr}/mcp (streamable HTTP, no authentication)");
            say!(
                "a2a:       http://{addr}/.well-known/agent-card.json (JSON-RPC at /a2a, no authentication)"
            );
        }
    }
    say!("press Ctrl-C to stop (or send SIGTERM)");
    // The signal ends the event streams too: a graceful shutdown waits for every connection, and
    // an event stream would never end by itself.
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(api.graceful_shutdown(stop))
        .await;
    mcp.shutdown();
    let stopped = org.shutdown().await;
    // Closed before the process exits: the databases' write-ahead logs folded in, the data
    // directory's lock released.
    stores.close().await;
    served.map_err(|e| failed(format!("server error: {e}")))?;
    stopped.map_err(|e| failed(format!("shutdown: {e}")))?;
    #[cfg(feature = "otel")]
    if let Some(otel) = otel {
        // Flushing blocks until the collector answered.
        let _ = tokio::task::spawn_blocking(move || drop(otel)).await;
    }
    say!("stopped");
    Ok(())
}

/// `spacebot mcp`: the organization as an MCP server over standard input and output. Standard
/// output carries the protocol alone; what is said goes to standard error.
pub(crate) async fn mcp_stdio(args: McpArgs) -> Result<(), CliError> {
    let config = OrgConfig::load(&args.config)?;
    std::fs::create_dir_all(&args.data_dir)
        .map_err(|e| failed(format!("{}: {e}", args.data_dir.display())))?;
    let stores: Stores = match args.store {
        Store::Sqlite => spacebot_sqlite::open(&args.data_dir).await,
        Store::Redb => spacebot_redb::open_async(&args.data_dir).await,
    }
    .map_err(|e| failed(e.to_string()))?;
    let (llm, llm_name) = provider(&config)?;
    let chat = spacebot_mcp::McpChat::new();
    let notes = spacebot_notes::Notes::new();
    let mcp = spacebot_mcp::Mcp::new();
    let org = Organization::builder(config)
        .stores(stores)
        .llm(llm)
        .spawner(Arc::new(TokioSpawner::current()))
        .clock(Arc::new(TokioClock))
        .outbound(Arc::new(chat.clone()))
        .behaviour(Arc::new(notes))
        .behaviour(Arc::new(mcp.clone()))
        // Claims the A2A fields of `[[agents]]` (remote agents work here too); not served here.
        .behaviour(Arc::new(spacebot_a2a::A2a::new()))
        .build()
        .await
        .map_err(|e| failed(e.to_string()))?;
    org.start_all().await.map_err(|e| failed(e.to_string()))?;
    let server =
        spacebot_mcp::OrgServer::new(org.clone(), chat).map_err(|e| failed(e.to_string()))?;
    eprintln!(
        "spacebot mcp: {} agents ({} exposed), {llm_name}; serving MCP on stdin/stdout",
        org.agent_ids().len(),
        server.exposed().len()
    );
    let served = server.serve_stdio().await;
    mcp.shutdown();
    let stopped = org.shutdown().await;
    served.map_err(|e| failed(e.to_string()))?;
    stopped.map_err(|e| failed(format!("shutdown: {e}")))?;
    Ok(())
}
