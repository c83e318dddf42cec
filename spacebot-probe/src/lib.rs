//! Build-script probes for the workspace's tests: whether a test that needs a tool from outside
//! the workspace can run here.
//!
//! Each [`Tool`] has a cfg. A crate's build script calls [`probe`] with the tools its tests need;
//! the cfg of each tool found is set, and tests that need it are marked
//! `#[cfg_attr(not(spacebot_python), ignore = "...")]`, so a run without the tool reports them
//! as *ignored* (not run, with the reason) instead of passed. A tool is "here" when:
//!
//! - its environment variable names it (`DATABASE_URL`, `SPACEBOT_PYTHON`,
//!   `SPACEBOT_MCP_EVERYTHING`, `SPACEBOT_CHROMIUM` and `SPACEBOT_CHROMEDRIVER`);
//! - or its `SPACEBOT_REQUIRE_*` variable is `1` (CI: the tests must run, and fail without it);
//! - or it is installed where the workspace's `.ci/` scripts put it, or where Debian does.
//!
//! A test whose cfg is set still checks at run time (`spacebot_core::testing::external`) and
//! fails with a message naming what is missing. Only build scripts use this crate.
//!
//! ```no_run
//! // build.rs of a crate whose tests need PostgreSQL and the Python kits:
//! spacebot_probe::probe(&[spacebot_probe::Tool::Postgres, spacebot_probe::Tool::Python]);
//! ```

use std::path::{Path, PathBuf};

/// A tool some tests need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tool {
    /// A PostgreSQL server: `DATABASE_URL`, or the server binaries (`initdb`, `pg_ctl`) from which
    /// the tests start a throwaway one. Cfg `spacebot_pg`; `SPACEBOT_REQUIRE_POSTGRES`.
    Postgres,
    /// A Python with PyPI's `mcp`, `opentelemetry-proto` and `a2a-sdk`: `SPACEBOT_PYTHON`, or the
    /// virtual environment `.ci/python` makes (`target/ci-venv`, or `$SPACEBOT_VENV`). Cfg
    /// `spacebot_python`; `SPACEBOT_REQUIRE_PYTHON`.
    Python,
    /// Headless Chromium and chromedriver: `SPACEBOT_CHROMIUM` and `SPACEBOT_CHROMEDRIVER`, or
    /// `/usr/bin/chromium` and `/usr/bin/chromedriver` (Debian's `chromium chromium-driver`).
    /// Cfg `spacebot_chromium`; `SPACEBOT_REQUIRE_CHROMIUM`.
    Chromium,
    /// npm's MCP reference server (`server-everything`) and `node`: `SPACEBOT_MCP_EVERYTHING`, or
    /// where `.ci/node` installs it (`target/ci-node`, or `$SPACEBOT_NODE_DIR`). Cfg
    /// `spacebot_node`; `SPACEBOT_REQUIRE_NODE`.
    Node,
}

impl Tool {
    /// The cfg set when the tool is here.
    pub fn cfg(self) -> &'static str {
        match self {
            Tool::Postgres => "spacebot_pg",
            Tool::Python => "spacebot_python",
            Tool::Chromium => "spacebot_chromium",
            Tool::Node => "spacebot_node",
        }
    }

    /// The variable that makes its tests run (and fail without it): CI sets it to `1`.
    pub fn require_var(self) -> &'static str {
        match self {
            Tool::Postgres => "SPACEBOT_REQUIRE_POSTGRES",
            Tool::Python => "SPACEBOT_REQUIRE_PYTHON",
            Tool::Chromium => "SPACEBOT_REQUIRE_CHROMIUM",
            Tool::Node => "SPACEBOT_REQUIRE_NODE",
        }
    }

    /// The variables that name it (a change makes the build script run again).
    fn vars(self) -> &'static [&'static str] {
        match self {
            Tool::Postgres => &["DATABASE_URL"],
            Tool::Python => &["SPACEBOT_PYTHON", "SPACEBOT_VENV"],
            Tool::Chromium => &["SPACEBOT_CHROMIUM", "SPACEBOT_CHROMEDRIVER"],
            Tool::Node => &["SPACEBOT_MCP_EVERYTHING", "SPACEBOT_NODE_DIR"],
        }
    }
}

/// Prints the build-script lines for `tools`: each one's `check-cfg`, what makes the probe run
/// again, and its cfg when it is here.
pub fn probe(tools: &[Tool]) {
    let root = workspace_root();
    for &tool in tools {
        println!("cargo::rustc-check-cfg=cfg({})", tool.cfg());
        println!("cargo::rerun-if-env-changed={}", tool.require_var());
        for var in tool.vars() {
            println!("cargo::rerun-if-env-changed={var}");
        }
        // What installing or removing the tool changes, where that exists (a path that does not
        // exist would make Cargo run the probe at every build).
        for watched in watched(tool, root.as_deref()) {
            if watched.exists() {
                println!("cargo::rerun-if-changed={}", watched.display());
            }
        }
        if here(tool, root.as_deref()) {
            println!("cargo::rustc-cfg={}", tool.cfg());
        }
    }
}

/// Whether `tool` is here (see [`Tool`]); `root` is the workspace's directory, when known.
pub fn here(tool: Tool, root: Option<&Path>) -> bool {
    if std::env::var(tool.require_var()).as_deref() == Ok("1") {
        return true;
    }
    let set = |var: &str| std::env::var(var).is_ok_and(|v| !v.trim().is_empty());
    match tool {
        Tool::Postgres => set("DATABASE_URL") || postgres_binaries(),
        Tool::Python => set("SPACEBOT_PYTHON") || default_python(root).is_some_and(|p| p.is_file()),
        Tool::Chromium => {
            let path = |var: &str, default: &str| {
                std::env::var_os(var).map_or_else(|| PathBuf::from(default), PathBuf::from)
            };
            path("SPACEBOT_CHROMIUM", CHROMIUM).is_file()
                && path("SPACEBOT_CHROMEDRIVER", CHROMEDRIVER).is_file()
        }
        Tool::Node => {
            set("SPACEBOT_MCP_EVERYTHING")
                || (default_everything(root).is_some_and(|p| p.is_file()) && on_path("node"))
        }
    }
}

/// Where Debian installs Chromium.
pub const CHROMIUM: &str = "/usr/bin/chromium";
/// Where Debian installs chromedriver.
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const PG_LIB: &str = "/usr/lib/postgresql";

fn watched(tool: Tool, root: Option<&Path>) -> Vec<PathBuf> {
    match tool {
        // Installing a server version adds a directory here.
        Tool::Postgres => vec![PathBuf::from(PG_LIB)],
        Tool::Python => default_python(root).into_iter().collect(),
        Tool::Chromium => vec![PathBuf::from(CHROMIUM), PathBuf::from(CHROMEDRIVER)],
        Tool::Node => default_everything(root).into_iter().collect(),
    }
}

/// The workspace's directory: the nearest directory above the crate's with a `.ci` directory.
fn workspace_root() -> Option<PathBuf> {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR")?);
    manifest
        .ancestors()
        .find(|dir| dir.join(".ci").is_dir())
        .map(Path::to_path_buf)
}

/// The Python of the virtual environment `.ci/python` makes.
fn default_python(root: Option<&Path>) -> Option<PathBuf> {
    let venv = match std::env::var_os("SPACEBOT_VENV") {
        Some(v) => PathBuf::from(v),
        None => root?.join("target/ci-venv"),
    };
    Some(venv.join("bin/python"))
}

/// The server `.ci/node` installs.
fn default_everything(root: Option<&Path>) -> Option<PathBuf> {
    let dir = match std::env::var_os("SPACEBOT_NODE_DIR") {
        Some(d) => PathBuf::from(d),
        None => root?.join("target/ci-node"),
    };
    Some(dir.join("node_modules/@modelcontextprotocol/server-everything/dist/index.js"))
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Whether `initdb` and `pg_ctl` are installed (in a `/usr/lib/postgresql/*/bin` or on `PATH`).
fn postgres_binaries() -> bool {
    let has = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    let versioned = std::fs::read_dir(PG_LIB)
        .into_iter()
        .flatten()
        .flatten()
        .any(|entry| has(&entry.path().join("bin")));
    versioned
        || std::env::var_os("PATH")
            .is_some_and(|path| std::env::split_paths(&path).any(|dir| has(&dir)))
}
