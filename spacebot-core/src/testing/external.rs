//! What a test needs from outside the workspace (a Python with the protocol kits, a PostgreSQL
//! server, npm's MCP reference server), named by an environment variable or found where the
//! workspace's `.ci/` scripts put it.
//!
//! Tests that need a tool are compiled as ignored, with the reason, where the tool cannot be had:
//! the build scripts set a cfg per tool (`spacebot_pg`, `spacebot_python`, `spacebot_node`,
//! `spacebot_chromium`; see the `spacebot-probe` crate), so a run reports them as not run instead
//! of passed. A test that runs because its cfg is set and then finds no tool fails, saying what is
//! missing: [`python`] and [`mcp_everything`] panic, [`database_url`] panics under
//! `SPACEBOT_REQUIRE_POSTGRES=1`.

use std::path::{Path, PathBuf};

/// The value of `var`, or `None` after saying on stderr that the test is skipped for want of
/// `what`. Panics when `require` is set to `1`: under CI a test that cannot run fails.
///
/// ```
/// // Unset, not required: the test is skipped.
/// assert_eq!(spacebot_core::testing::external::env_or_skip(
///     "SPACEBOT_DOC_UNSET_VAR", "SPACEBOT_DOC_UNSET_REQUIRE", "nothing"), None);
/// ```
pub fn env_or_skip(var: &str, require: &str, what: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v),
        _ => {
            assert!(
                std::env::var(require).as_deref() != Ok("1"),
                "{require}=1 but {var} is not set"
            );
            eprintln!("skipped: {var} is not set ({what})");
            None
        }
    }
}

/// The workspace's directory (the tests of its crates run from it or below it).
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `var` when it is set, else `default` when it exists; panics otherwise, saying what the test
/// needs. Only tests compiled to run (their cfg set by the build script) call it.
#[allow(clippy::panic)] // Test support: a test that was compiled to run and cannot, fails.
fn tool(var: &str, default: PathBuf, what: &str) -> String {
    if let Ok(v) = std::env::var(var)
        && !v.trim().is_empty()
    {
        return v;
    }
    if default.is_file() {
        return default.display().to_string();
    }
    panic!(
        "this test needs {what}: {var} is not set and {} does not exist (the build found the tool \
         or was told it must run; see README, Tests)",
        default.display()
    )
}

/// `SPACEBOT_PYTHON`, or the Python of `.ci/python`'s virtual environment (`target/ci-venv`, or
/// `$SPACEBOT_VENV`): a Python with PyPI's `mcp`, `opentelemetry-proto` and `a2a-sdk`.
///
/// For tests marked `#[cfg_attr(not(spacebot_python), ignore = "...")]`: panics, saying what is
/// missing, when there is neither.
pub fn python() -> String {
    let venv = std::env::var_os("SPACEBOT_VENV")
        .map_or_else(|| workspace().join("target/ci-venv"), PathBuf::from);
    tool(
        "SPACEBOT_PYTHON",
        venv.join("bin/python"),
        "a Python with the protocol kits (make one with .ci/python)",
    )
}

/// `SPACEBOT_MCP_EVERYTHING`, or where `.ci/node` installs it (`target/ci-node`, or
/// `$SPACEBOT_NODE_DIR`): the `dist/index.js` of npm's `@modelcontextprotocol/server-everything`.
///
/// For tests marked `#[cfg_attr(not(spacebot_node), ignore = "...")]`: panics, saying what is
/// missing, when there is neither.
pub fn mcp_everything() -> String {
    let dir = std::env::var_os("SPACEBOT_NODE_DIR")
        .map_or_else(|| workspace().join("target/ci-node"), PathBuf::from);
    tool(
        "SPACEBOT_MCP_EVERYTHING",
        dir.join("node_modules/@modelcontextprotocol/server-everything/dist/index.js"),
        "npm's MCP reference server (install it with .ci/node)",
    )
}

/// A PostgreSQL server to test against: `DATABASE_URL` when it is set; otherwise, where the
/// server binaries (`initdb`, `pg_ctl`) are installed and the workspace's `.ci/postgres` script is
/// at hand, a throwaway server started once and shared by every test process of the build (see
/// [`throwaway_postgres`]). Without either the test says why on stderr and gets `None`, unless
/// `SPACEBOT_REQUIRE_POSTGRES=1` (CI), when it fails.
///
/// Tests that need a server are compiled as ignored, with the reason, where none can be had (the
/// `spacebot_pg` cfg the crates' build scripts set with `spacebot-probe`), so a run reports them
/// as not run.
pub fn database_url() -> Option<String> {
    if let Ok(url) = std::env::var("DATABASE_URL")
        && !url.trim().is_empty()
    {
        return Some(url);
    }
    match throwaway_postgres() {
        Ok(url) => Some(url),
        Err(why) => env_or_skip(
            "DATABASE_URL",
            "SPACEBOT_REQUIRE_POSTGRES",
            &format!("a PostgreSQL server, and none could be started: {why}; see README"),
        ),
    }
}

/// The URL of the throwaway PostgreSQL server of this build's target directory, started when
/// there is none yet (or the one recorded no longer answers).
///
/// The server lives in `<target>/spacebot-pg/` (`<target>` is the directory above the test
/// binary's profile directory), made by the workspace's `.ci/postgres start` (on 127.0.0.1, the
/// first free port from 54330, trust authentication, fsync off; as root it runs as the
/// `postgres` or `nobody` user). Its variables are kept in `<target>/spacebot-pg/server.env`
/// and a file lock makes concurrent test processes start one server, not one each. It keeps
/// running after the tests, for the next run; `.ci/postgres stop <dir>` with the `SPACEBOT_PG_DIR`
/// written in `server.env` stops it and deletes it. The result is computed once per process.
pub fn throwaway_postgres() -> Result<String, String> {
    static URL: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    URL.get_or_init(start_or_reuse).clone()
}

/// Whether `initdb` and `pg_ctl` are installed (in a `/usr/lib/postgresql/*/bin` or on `PATH`).
fn server_binaries() -> bool {
    let has = |dir: &std::path::Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    let versioned = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .any(|entry| has(&entry.path().join("bin")));
    versioned
        || std::env::var_os("PATH")
            .is_some_and(|path| std::env::split_paths(&path).any(|dir| has(&dir)))
}

/// The value of `export NAME=value` in `exports`.
fn exported<'a>(exports: &'a str, name: &str) -> Option<&'a str> {
    exports.lines().find_map(|line| {
        line.trim()
            .strip_prefix("export ")?
            .strip_prefix(name)?
            .strip_prefix('=')
    })
}

/// Whether the server of `url` (`postgres://user@127.0.0.1:PORT/db`) accepts connections.
fn answers(url: &str) -> bool {
    let Some(address) = url
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
    else {
        return false;
    };
    use std::net::ToSocketAddrs;
    address.to_socket_addrs().into_iter().flatten().any(|a| {
        std::net::TcpStream::connect_timeout(&a, std::time::Duration::from_secs(2)).is_ok()
    })
}

fn start_or_reuse() -> Result<String, String> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.ci/postgres");
    if !script.is_file() {
        return Err(format!("{} is missing", script.display()));
    }
    if !server_binaries() {
        return Err("the PostgreSQL server binaries (initdb, pg_ctl) are not installed".into());
    }
    let exe = std::env::current_exe().map_err(|e| format!("no test binary path: {e}"))?;
    // <target>/<profile>/deps/<binary>
    let target = exe
        .ancestors()
        .nth(3)
        .ok_or_else(|| format!("no target directory above {}", exe.display()))?;
    let dir = target.join("spacebot-pg");
    let io = |what: &str, e: std::io::Error| format!("{what} {}: {e}", dir.display());
    std::fs::create_dir_all(&dir).map_err(|e| io("cannot create", e))?;
    let lock = std::fs::File::create(dir.join("lock")).map_err(|e| io("cannot lock", e))?;
    lock.lock().map_err(|e| io("cannot lock", e))?;
    let env_file = dir.join("server.env");
    if let Ok(exports) = std::fs::read_to_string(&env_file) {
        if let Some(url) = exported(&exports, "DATABASE_URL")
            && answers(url)
        {
            return Ok(url.to_string());
        }
        // Recorded but gone (a reboot): stop what is left of it and delete its directory.
        if let Some(old) = exported(&exports, "SPACEBOT_PG_DIR") {
            let _ = std::process::Command::new("bash")
                .arg(&script)
                .args(["stop", old])
                .stderr(std::process::Stdio::null())
                .status();
            let _ = std::fs::remove_dir_all(old);
        }
        let _ = std::fs::remove_file(&env_file);
    }
    eprintln!(
        "starting a throwaway PostgreSQL server in {}",
        dir.display()
    );
    let output = std::process::Command::new("bash")
        .arg(&script)
        .arg("start")
        .env("SPACEBOT_PG_PARENT", &dir)
        .env("SPACEBOT_PG_PORT", "54330")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !output.status.success() {
        return Err(format!(
            ".ci/postgres start failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let exports = String::from_utf8_lossy(&output.stdout).into_owned();
    let url = exported(&exports, "DATABASE_URL")
        .ok_or_else(|| format!(".ci/postgres start printed no DATABASE_URL: {exports}"))?
        .to_string();
    std::fs::write(&env_file, &exports).map_err(|e| io("cannot write to", e))?;
    Ok(url)
}
