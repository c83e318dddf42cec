//! Loads an organization from TOML and prints each agent's org chart, then the topology as JSON,
//! Graphviz DOT and Mermaid.
//!
//! ```text
//! cargo run --example org_chart                  # examples/org.toml
//! cargo run --example org_chart -- path/to/org.toml
//! ```

use std::error::Error;
use std::path::PathBuf;

use spacebot::config::OrgConfig;
use spacebot::policy::{ApprovalPolicy, check_start, needs_approval, org_chart};
use spacebot::topology::Topology;

fn main() -> Result<(), Box<dyn Error>> {
    let path = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/org.toml"));
    let config = OrgConfig::load(&path)?;
    let graph = config.graph();
    let names = |ids: &[spacebot::AgentId]| {
        let names: Vec<&str> = ids.iter().map(|id| config.name_of(id.as_str())).collect();
        if names.is_empty() {
            "-".to_owned()
        } else {
            names.join(", ")
        }
    };

    println!("# Org chart ({})\n", path.display());
    for agent in &config.agents {
        let chart = org_chart(&graph, &agent.id);
        println!("{} ({})", agent.name, agent.id);
        println!("  reports to:     {}", names(&chart.superiors));
        println!("  direct reports: {}", names(&chart.subordinates));
        println!("  peers:          {}", names(&chart.peers));
        for other in config.agent_ids().filter(|other| *other != &agent.id) {
            let verdict = match check_start(&graph, &agent.id, other) {
                Ok(_) if needs_approval(config.settings.approval, &graph, &agent.id, other) => {
                    "may start (delegated tasks wait for approval)".to_owned()
                }
                Ok(_) => "may start".to_owned(),
                Err(denied) => format!("may not start: {}", denied.reason),
            };
            println!("  -> {other}: {verdict}");
        }
        println!();
    }
    if config.settings.approval != ApprovalPolicy::Never {
        println!("approval policy: {}\n", config.settings.approval);
    }

    let topology = Topology::from_config(&config);
    println!("# Topology (JSON)\n\n{}\n", topology.to_json()?);
    println!("# Topology (Graphviz DOT)\n\n{}", topology.to_dot());
    println!("# Topology (Mermaid)\n\n{}", topology.to_mermaid());
    Ok(())
}
