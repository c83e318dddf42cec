//! Tells the PostgreSQL tests whether they can run here: `cfg(spacebot_pg)` is set when
//! `DATABASE_URL` names a server, when `SPACEBOT_REQUIRE_POSTGRES=1` (CI: they must run, and fail
//! without one), or when the server binaries (`initdb`, `pg_ctl`) are installed, from which the
//! tests start a throwaway server themselves (`spacebot_core::testing::external::database_url`).
//! Without it those tests are compiled as ignored, with the reason, so the test run reports them
//! as not run instead of passed. Nothing else in the crate reads the cfg.

use std::path::Path;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(spacebot_pg)");
    println!("cargo::rerun-if-env-changed=DATABASE_URL");
    println!("cargo::rerun-if-env-changed=SPACEBOT_REQUIRE_POSTGRES");
    // Installing a server version adds a directory here: probe again then.
    if Path::new(PG_LIB).is_dir() {
        println!("cargo::rerun-if-changed={PG_LIB}");
    }
    if postgres_here() {
        println!("cargo::rustc-cfg=spacebot_pg");
    }
}

const PG_LIB: &str = "/usr/lib/postgresql";

fn postgres_here() -> bool {
    std::env::var("DATABASE_URL").is_ok_and(|url| !url.trim().is_empty())
        || std::env::var("SPACEBOT_REQUIRE_POSTGRES").as_deref() == Ok("1")
        || server_binaries()
}

/// Whether `initdb` and `pg_ctl` are installed (in a `/usr/lib/postgresql/*/bin` or on `PATH`).
fn server_binaries() -> bool {
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
