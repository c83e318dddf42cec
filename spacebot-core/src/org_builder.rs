//! [`OrganizationBuilder`]: the facade that assembles the host with its behaviours (delegation,
//! conversations, and any the application adds) from configuration plus backends.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};

use crate::config::{AgentConfig, OrgConfig};
use crate::delegation::{Delegation, TaskExecutor};
use crate::dialogue::Conversations;
use crate::event::{EventSink, NullSink};
use crate::ids::AgentId;
use crate::llm::LlmProvider;
use crate::org::{AgentSpec, OrgError, OrgInner, Organization, Slot};
use crate::placement::{Placement, PlacementOptions};
use crate::policy::LinkGraph;
use crate::prompts::{Identity, Prompts};
use crate::runtime::behaviour::Behaviour;
use crate::runtime::outbound::{ChannelOutbound, Outbound};
use crate::stores::Stores;
use crate::time::{Clock, Spawner};
use crate::tools::{Tool, ToolRegistry};

/// Builds an [`Organization`]: configuration plus backends.
#[derive(Debug)]
pub struct OrganizationBuilder {
    config: OrgConfig,
    stores: Option<Stores>,
    llm: Option<Arc<dyn LlmProvider>>,
    spawner: Option<Arc<dyn Spawner>>,
    runners: usize,
    clock: Option<Arc<dyn Clock>>,
    events: Arc<dyn EventSink>,
    outbound: Option<Arc<dyn Outbound>>,
    agent_outbounds: HashMap<AgentId, Arc<dyn Outbound>>,
    prompts: Option<Prompts>,
    tools: Vec<Arc<dyn Tool>>,
    executors: HashMap<AgentId, Arc<dyn TaskExecutor>>,
    behaviours: Vec<Arc<dyn Behaviour>>,
    placement: Option<(Arc<dyn Placement>, PlacementOptions)>,
    compaction: Option<Arc<dyn crate::context::Compaction>>,
}

impl Organization {
    /// Starts building an organization from `config`.
    pub fn builder(config: OrgConfig) -> OrganizationBuilder {
        OrganizationBuilder {
            config,
            stores: None,
            llm: None,
            spawner: None,
            runners: 1,
            clock: None,
            events: Arc::new(NullSink),
            outbound: None,
            agent_outbounds: HashMap::new(),
            prompts: None,
            tools: Vec::new(),
            executors: HashMap::new(),
            behaviours: Vec::new(),
            placement: None,
            compaction: None,
        }
    }
}

impl OrganizationBuilder {
    /// The stores (required).
    pub fn stores(mut self, stores: Stores) -> Self {
        self.stores = Some(stores);
        self
    }
    /// The LLM provider (required).
    pub fn llm(mut self, llm: Arc<dyn LlmProvider>) -> Self {
        self.llm = Some(llm);
        self
    }
    /// The spawner for agent loops (with the `tokio` feature it defaults to the current Tokio
    /// runtime; required otherwise).
    pub fn spawner(mut self, spawner: Arc<dyn Spawner>) -> Self {
        self.spawner = Some(spawner);
        self
    }
    /// How many tasks of the host runtime run the organization's agent loops (default 1; see
    /// `docs/runtime.md`, "Where the loops run").
    ///
    /// With one, a turn that wakes another agent wakes it on the same thread, without the host's
    /// scheduler: the fastest for chains of agents (delegations, conversations). With more, on a
    /// multi-thread runtime, agents run on several threads at once, which pays when many agents
    /// have work at the same time and their turns cost CPU (templating, JSON, tools computing
    /// in-process), at the price of wake-ups between those threads. More runners than the
    /// runtime's worker threads gain nothing.
    pub fn runners(mut self, runners: usize) -> Self {
        self.runners = runners.max(1);
        self
    }
    /// The clock (with the `tokio` feature it defaults to `TokioClock`; required otherwise;
    /// `ManualClock` in tests).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }
    /// Where events go (default: nowhere).
    pub fn events(mut self, events: Arc<dyn EventSink>) -> Self {
        self.events = events;
        self
    }
    /// Where root agents' replies go. Without one, replies are read with
    /// [`Organization::take_replies`].
    pub fn outbound(mut self, outbound: Arc<dyn Outbound>) -> Self {
        self.outbound = Some(outbound);
        self
    }
    /// A different outbound for one root agent.
    pub fn agent_outbound(mut self, agent: AgentId, outbound: Arc<dyn Outbound>) -> Self {
        self.agent_outbounds.insert(agent, outbound);
        self
    }
    /// The prompt templates (default: the embedded ones).
    pub fn prompts(mut self, prompts: Prompts) -> Self {
        self.prompts = Some(prompts);
        self
    }
    /// Runs `agent`'s tasks with `executor` instead of the agent's own tool loop (for example
    /// deterministic code).
    pub fn task_executor(mut self, agent: AgentId, executor: Arc<dyn TaskExecutor>) -> Self {
        self.executors.insert(agent, executor);
        self
    }
    /// A behaviour of your own, beside delegation and conversations: its tools go to every agent
    /// and its hooks run at the points of each agent's life (see [`Behaviour`]).
    pub fn behaviour(mut self, behaviour: Arc<dyn Behaviour>) -> Self {
        self.behaviours.push(behaviour);
        self
    }
    /// Spreads the organization over several processes (or hosts) sharing the stores and the
    /// placement table: this organization is one of them, with `options.process` as its id.
    ///
    /// Each configured agent then runs in exactly one process at a time, the one holding its lease:
    /// [`Organization::start_all`] starts the hosting loops instead of every agent. A delivery to an
    /// agent hosted elsewhere is stored and its host woken with a hint; every delivery is stored
    /// before it is queued (so the delivery store must be shared by every process: one database,
    /// or in tests one [`Stores`] bundle given to every organization). Child agents stay in the
    /// process that spawned them. Without a placement every agent is local. See
    /// `docs/scale-out.md`.
    pub fn placement(mut self, placement: Arc<dyn Placement>, options: PlacementOptions) -> Self {
        self.placement = Some((placement, options));
        self
    }
    /// The compaction hook (default [`ModelSummary`](crate::context::ModelSummary)): how history
    /// that no longer fits an agent's context window is summarized. `[settings] compaction =
    /// false` turns compaction off whatever this says. See [`crate::context`].
    pub fn compaction(mut self, compaction: Arc<dyn crate::context::Compaction>) -> Self {
        self.compaction = Some(compaction);
        self
    }
    /// A tool every agent gets.
    pub fn tool(mut self, tool: Arc<dyn Tool>) -> Self {
        self.tools.push(tool);
        self
    }

    /// Validates everything (a configuration section no behaviour claims is refused, see
    /// [`Behaviour::config_section`]), syncs the configured links into the link store
    /// (configuration wins), reads every agent's identity files, calls every behaviour's
    /// [`on_build`](Behaviour::on_build), and returns the organization with every agent stopped.
    /// Call [`Organization::start_all`] next.
    pub async fn build(self) -> Result<Organization, OrgError> {
        let stores = self.stores.ok_or(OrgError::Missing("stores"))?;
        let llm = self.llm.ok_or(OrgError::Missing("an LLM provider"))?;
        let spawner = self
            .spawner
            .or_else(default_spawner)
            .ok_or(OrgError::Missing("a spawner"))?;
        let clock = self
            .clock
            .or_else(default_clock)
            .ok_or(OrgError::Missing("a clock"))?;
        let config = self.config;
        let limited = !config.settings.limits.is_none()
            || config.settings.agent_limits.is_some()
            || config.settings.org_limits.is_some()
            || config.agents.iter().any(|a| a.limits.is_some());
        config.validate()?;
        for agent in self.agent_outbounds.keys().chain(self.executors.keys()) {
            if !config.agents.iter().any(|a| &a.id == agent) {
                return Err(OrgError::UnknownAgent(agent.clone()));
            }
        }
        // The behaviours this facade assembles: delegation and conversations, then the
        // application's own.
        let mut behaviours: Vec<Arc<dyn Behaviour>> = vec![
            Arc::new(Delegation::new(self.executors.clone())),
            Arc::new(Conversations),
        ];
        behaviours.extend(self.behaviours);
        let claimed: Vec<&str> = behaviours
            .iter()
            .filter_map(|b| b.config_section())
            .collect();
        config.check_sections(&claimed)?;
        let fields: Vec<&str> = behaviours
            .iter()
            .flat_map(|b| b.agent_fields().iter().copied())
            .collect();
        config.check_agent_fields(&fields)?;
        let mut tools = ToolRegistry::new();
        for behaviour in &behaviours {
            for tool in behaviour.tools() {
                tools.register(tool)?;
            }
            for set in behaviour.tool_sets() {
                tools.register_set(set);
            }
        }
        for tool in self.tools {
            tools.register(tool)?;
        }
        let prompts = self.prompts.unwrap_or_default();
        let hosting = match self.placement {
            Some((placement, options)) => {
                options.validate()?;
                Some(Arc::new(crate::runtime::hosting::Hosting::new(
                    placement, options,
                )))
            }
            None => None,
        };

        config
            .sync_links(stores.links.as_ref(), clock.now())
            .await?;
        let links = stores.links.list().await?;
        let graph = LinkGraph::new(config.agents.iter().map(|a| a.id.clone()), links);

        let (default_outbound, replies) = match self.outbound {
            Some(o) => (o, None),
            None => {
                let (o, rx) = ChannelOutbound::new();
                (Arc::new(o) as Arc<dyn Outbound>, Some(rx))
            }
        };
        let mut agents = crate::fasthash::FastMap::default();
        for agent in &config.agents {
            let spec = agent_spec(agent, &self.agent_outbounds, &default_outbound)?;
            agents.insert(agent.id.clone(), Slot::Stopped(Arc::new(spec)));
        }
        let counter = llm
            .token_counter(None)
            .unwrap_or_else(|| Arc::new(crate::context::EstimateCounter));
        let compaction = config.settings.compaction.then(|| {
            self.compaction
                .unwrap_or_else(|| Arc::new(crate::context::ModelSummary))
        });
        let request_ledger = crate::limits::RequestLedger::new(stores.records.clone());
        let org = Organization {
            inner: Arc::new(OrgInner {
                stores,
                llm,
                counter,
                compaction,
                loops: crate::runtime::executor::LoopExecutor::new(spawner.clone(), self.runners),
                background: Arc::default(),
                spawner,
                clock,
                events: self.events,
                prompts,
                settings: config.settings.clone(),
                tools,
                graph: RwLock::new(Arc::new(graph)),
                agents: RwLock::new(agents),
                context_windows: config
                    .agents
                    .iter()
                    .filter_map(|a| Some((a.id.clone(), a.context_window?)))
                    .collect(),
                agent_period_limits: config
                    .agents
                    .iter()
                    .filter_map(|a| Some((a.id.clone(), a.limits?)))
                    .collect(),
                config,
                replies: Mutex::new(replies),
                child_counter: AtomicU64::new(0),
                internal_open: Mutex::new(HashMap::new()),
                bus: crate::bus::EventBus::new(1024),
                states: Mutex::new(HashMap::new()),
                limits_in_use: std::sync::atomic::AtomicBool::new(limited),
                request_ledger,
                settle_waiters: Mutex::new(Vec::new()),
                reserving: Mutex::default(),
                settle_flush: Arc::default(),
                operator_periods: Mutex::new(Vec::new()),
                handing_over: Mutex::new(HashSet::new()),
                idle_waiters: std::sync::atomic::AtomicUsize::new(0),
                handling: Arc::default(),
                behaviours,
                usage: Mutex::new(HashMap::new()),
                caches: crate::org::RenderCache::default(),
                graph_version: AtomicU64::new(0),
                hosting,
                instance_tag: uuid::Uuid::new_v4().simple().to_string()[..8].to_string(),
            }),
        };
        org.inner.load_limits_marker().await?;
        let ctx = org.behaviour_context();
        for behaviour in &org.inner.behaviours {
            behaviour.on_build(&ctx).await?;
        }
        Ok(org)
    }
}

/// With the `tokio` feature, the current Tokio runtime spawns agent loops when the builder was
/// given no spawner.
fn default_spawner() -> Option<Arc<dyn Spawner>> {
    #[cfg(feature = "tokio")]
    {
        crate::rt::TokioSpawner::try_current().map(|s| Arc::new(s) as Arc<dyn Spawner>)
    }
    #[cfg(not(feature = "tokio"))]
    {
        None
    }
}

/// With the `tokio` feature, the wall clock when the builder was given no clock.
fn default_clock() -> Option<Arc<dyn Clock>> {
    #[cfg(feature = "tokio")]
    {
        Some(Arc::new(crate::rt::TokioClock))
    }
    #[cfg(not(feature = "tokio"))]
    {
        None
    }
}

fn agent_spec(
    agent: &AgentConfig,
    outbounds: &HashMap<AgentId, Arc<dyn Outbound>>,
    default: &Arc<dyn Outbound>,
) -> Result<AgentSpec, OrgError> {
    let identity = match &agent.workspace {
        Some(dir) => Identity::load(dir)?,
        None => Identity::default(),
    };
    Ok(AgentSpec {
        id: agent.id.clone(),
        name: agent.name.clone(),
        identity,
        parent: None,
        outbound: outbounds
            .get(&agent.id)
            .cloned()
            .unwrap_or_else(|| default.clone()),
        instructions: None,
    })
}
