//! The crash test of the whole runtime: an `Organization` with agents (a delegation over two hops,
//! a mirrored conversation, a delivery to a stopped agent, a child agent) on SQLite and on redb,
//! killed with SIGKILL before every store write in turn, then at random, and restarted on the same
//! directory until every job is answered. After each restart the stores, the acknowledgements and
//! the replies are checked and counted; a table per backend is printed.
//!
//! The child is this test binary again (`crash_child`, with `SPACEBOT_CRASH_CHILD_DIR` set). Its
//! stores are wrapped by a failpoint (`crash_support/failpoint.rs`) that counts every write and,
//! with `SPACEBOT_CRASH_AT=K`, prints `CRASHPOINT K` and blocks before write K: the parent kills it
//! there, so the kill lands exactly at that boundary.
//!
//! `SPACEBOT_CRASH_SEED` sets the seed of the random kills (printed), `SPACEBOT_CRASH_RANDOM` their
//! number per backend (default 50).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod crash_support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crash_support::failpoint::MARKER;
use crash_support::verify::{Counts, verify};
use crash_support::workload::{CHILD_AT, CHILD_BACKEND, CHILD_DIR, WRITES, child_main};

/// Random kills per backend, unless `SPACEBOT_CRASH_RANDOM` says otherwise.
const RANDOM_KILLS: u64 = 50;

/// The child process: runs the workload when `SPACEBOT_CRASH_CHILD_DIR` is set.
#[test]
#[ignore = "the child process of the crash tests (run by them with SPACEBOT_CRASH_CHILD_DIR set)"]
fn crash_child() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let backend = std::env::var(CHILD_BACKEND).expect("the backend");
    let at = std::env::var(CHILD_AT).ok().map(|k| k.parse().expect("K"));
    child_main(Path::new(&dir), &backend, at);
}

fn spawn_child(dir: &Path, backend: &str, at: Option<u64>, stdout: Stdio, log: &str) -> Child {
    std::fs::create_dir_all(dir).unwrap();
    let stderr = std::fs::File::create(dir.join(log)).unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "crash_child",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
        "--quiet",
    ])
    .env(CHILD_DIR, dir)
    .env(CHILD_BACKEND, backend)
    .env_remove(CHILD_AT)
    .stdout(stdout)
    .stderr(stderr);
    if let Some(k) = at {
        cmd.env(CHILD_AT, k.to_string());
    }
    cmd.spawn().unwrap()
}

/// How a run ended.
#[derive(Debug)]
enum Ended {
    /// Killed at the marker (or after the delay).
    Killed,
    /// Ran to the end: its write count.
    Finished(u64),
    /// Exited with an error; the end of its stderr.
    Failed(String),
}

/// The panic message of a failed child, from its stderr.
fn stderr_tail(dir: &Path, log: &str) -> String {
    let text = std::fs::read_to_string(dir.join(log)).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    match lines.iter().position(|l| l.contains("panicked at")) {
        Some(at) => lines[at..(at + 2).min(lines.len())].join(" "),
        None => lines[lines.len().saturating_sub(3)..].join(" "),
    }
}

/// Runs a child, killing it when it prints the failpoint marker; else waits for its end.
fn run_child(dir: &Path, backend: &str, at: Option<u64>, log: &str) -> Ended {
    let mut child = spawn_child(dir, backend, at, Stdio::piped(), log);
    let stdout = child.stdout.take().unwrap();
    let mut writes = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if line.contains(MARKER) {
            child.kill().unwrap();
            child.wait().unwrap();
            return Ended::Killed;
        }
        if let Some(rest) = line.split_once(WRITES).map(|(_, r)| r.trim()) {
            writes = rest.split_whitespace().next().and_then(|n| n.parse().ok());
        }
    }
    let status = child.wait().unwrap();
    match (status.success(), writes) {
        (true, Some(n)) => Ended::Finished(n),
        _ => Ended::Failed(format!("{status}\n{}", stderr_tail(dir, log))),
    }
}

/// Runs a child without a failpoint and kills it after `delay` (if it is still running).
fn run_child_killed_after(dir: &Path, backend: &str, delay: Duration) {
    let mut child = spawn_child(dir, backend, None, Stdio::null(), "killed.log");
    std::thread::sleep(delay);
    let _ = child.kill();
    child.wait().unwrap();
}

/// splitmix64: a small seeded generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One kill's result, kept for the report.
struct Outcome {
    label: String,
    counts: Counts,
    symptoms: Vec<String>,
}

/// After a kill: restarts the child on the same directory until every job is answered, then
/// checks and counts.
fn restart_and_check(rt: &tokio::runtime::Runtime, dir: &Path, backend: &str) -> Outcome {
    let mut outcome = Outcome {
        label: String::new(),
        counts: Counts::default(),
        symptoms: Vec::new(),
    };
    match run_child(dir, backend, None, "restart.log") {
        Ended::Finished(_) => {}
        Ended::Killed => unreachable!("no failpoint in a restart"),
        Ended::Failed(why) => {
            outcome.counts.restarts_failed += 1;
            outcome
                .symptoms
                .push(format!("the restart did not finish: {why}"));
        }
    }
    let (counts, symptoms) = rt.block_on(verify(dir, backend));
    outcome.counts.add(&counts);
    outcome.symptoms.extend(symptoms);
    outcome
}

fn row(name: &str, sweep: u64, random: u64) -> String {
    format!(
        "| {name:<44} | {sweep:>10} | {random:>10} | {:>6} |",
        sweep + random
    )
}

/// The whole crash test of one backend.
fn crash_test(backend: &str) {
    let started = Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // `SPACEBOT_CRASH_KEEP` keeps the run directories (their paths are printed).
    let keep = std::env::var_os("SPACEBOT_CRASH_KEEP").is_some();
    let temp = tempfile::tempdir().unwrap();
    let (base, _temp) = if keep {
        let path = temp.keep();
        println!("run directories kept under {}", path.display());
        (path, None)
    } else {
        (temp.path().to_path_buf(), Some(temp))
    };

    // The dry run: how many writes a full run makes, and how long it takes.
    let dry = base.join("dry");
    let t = Instant::now();
    let n = match run_child(&dry, backend, None, "dry.log") {
        Ended::Finished(n) => n,
        other => panic!("{backend}: the dry run did not finish: {other:?}"),
    };
    let dry_time = t.elapsed();
    assert!(n > 0, "{backend}: the dry run wrote nothing");
    let (dry_counts, dry_symptoms) = rt.block_on(verify(&dry, backend));

    let mut sweep = Counts::default();
    let mut random = Counts::default();
    let mut failing: Vec<Outcome> = Vec::new();
    // The run without a kill must pass its own checks too.
    sweep.add(&dry_counts);
    if dry_counts.failures() > 0 {
        failing.push(Outcome {
            label: "dry run (no kill)".into(),
            counts: dry_counts,
            symptoms: dry_symptoms,
        });
    }
    let mut not_killed = 0u64;

    // A kill at every write boundary (or only at those listed in `SPACEBOT_CRASH_ONLY`, to replay a
    // failing run: `SPACEBOT_CRASH_ONLY=17,101`; the random kills are skipped then).
    let only: Option<Vec<u64>> = std::env::var("SPACEBOT_CRASH_ONLY")
        .ok()
        .map(|s| s.split(',').filter_map(|k| k.trim().parse().ok()).collect());
    let ks: Vec<u64> = only.clone().unwrap_or_else(|| (1..=n).collect());
    for (i, k) in ks.into_iter().enumerate() {
        let dir = base.join(format!("k{k}.{i}"));
        if !matches!(
            run_child(&dir, backend, Some(k), "killed.log"),
            Ended::Killed
        ) {
            // This run made fewer writes than the dry run (the order of writes of concurrent
            // agents may vary): it is checked all the same.
            not_killed += 1;
        }
        let mut outcome = restart_and_check(&rt, &dir, backend);
        outcome.label = format!("K={k}");
        sweep.add(&outcome.counts);
        if outcome.counts.failures() > 0 {
            failing.push(outcome);
        }
        if !keep {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    // Random kills: a random K, or a random delay (a kill anywhere, also inside a write).
    let seed = std::env::var("SPACEBOT_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_C0DE_u64);
    let kills = std::env::var("SPACEBOT_CRASH_RANDOM")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(RANDOM_KILLS);
    let kills = if only.is_some() { 0 } else { kills };
    let mut rng = Rng(seed ^ backend.len() as u64);
    let max_delay = u64::try_from(dry_time.as_micros()).unwrap_or(u64::MAX);
    for i in 0..kills {
        let dir = base.join(format!("r{i}"));
        let label = if i % 2 == 0 {
            let k = rng.below(n) + 1;
            if !matches!(
                run_child(&dir, backend, Some(k), "killed.log"),
                Ended::Killed
            ) {
                not_killed += 1;
            }
            format!("random #{i}: K={k}")
        } else {
            let delay = Duration::from_micros(rng.below(max_delay));
            run_child_killed_after(&dir, backend, delay);
            format!("random #{i}: after {delay:?}")
        };
        let mut outcome = restart_and_check(&rt, &dir, backend);
        outcome.label = label;
        random.add(&outcome.counts);
        if outcome.counts.failures() > 0 {
            failing.push(outcome);
        }
        if !keep {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    let mut report = vec![
        format!(
            "crash test on {backend}: N = {n} store writes in a full run (dry run {:.2} s); \
             seed {seed}; {} runs ended before their failpoint",
            dry_time.as_secs_f64(),
            not_killed
        ),
        format!(
            "| {:<44} | {:>10} | {:>10} | {:>6} |",
            "kills",
            format!("each K={n}"),
            format!("random={kills}"),
            "total"
        ),
        row(
            "acknowledged envelopes lost",
            sweep.acked_lost,
            random.acked_lost,
        ),
        row(
            "tasks duplicated",
            sweep.tasks_duplicated,
            random.tasks_duplicated,
        ),
        row(
            "notices lost (task not ended/not answered)",
            sweep.notices_lost,
            random.notices_lost,
        ),
        row(
            "notices applied twice",
            sweep.notices_twice,
            random.notices_twice,
        ),
        row(
            "user messages never answered",
            sweep.never_answered,
            random.never_answered,
        ),
        row(
            "restarts that did not finish",
            sweep.restarts_failed,
            random.restarts_failed,
        ),
        row(
            "stores refused to open or read after restart",
            sweep.stores_refused,
            random.stores_refused,
        ),
        row(
            "replies delivered more than once (allowed)",
            sweep.replies_repeated,
            random.replies_repeated,
        ),
        format!("{backend}: {:.1} s in all", started.elapsed().as_secs_f64()),
    ];
    for f in failing.iter().take(20) {
        report.push(format!("  {}: {:?}", f.label, f.symptoms));
    }
    let report = report.join("\n");
    println!("{report}");
    // The gate: no kill, before any write or at any time, loses an acknowledged envelope,
    // duplicates a task, loses or repeats a notice, leaves a job unanswered, a restart unfinished
    // or a store that will not open. Only repeated replies are allowed (at-least-once outbound).
    let mut total = sweep;
    total.add(&random);
    assert_eq!(
        total.failures(),
        0,
        "{backend}: the runtime lost or repeated work after a kill\n{report}"
    );
}

#[test]
fn sigkill_at_every_write_boundary_sqlite() {
    crash_test("sqlite");
}

#[cfg(feature = "redb")]
#[test]
fn sigkill_at_every_write_boundary_redb() {
    crash_test("redb");
}
