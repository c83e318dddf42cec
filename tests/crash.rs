//! The crash test of the whole runtime: an `Organization` with agents (a delegation over two hops,
//! a mirrored conversation, a delivery to a stopped agent, a child agent) on SQLite (both layouts:
//! the organization's one database and one database per agent) and on redb,
//! killed with SIGKILL before every store write in turn, then at random, and restarted on the same
//! directory until every job is answered. After each restart the stores, the acknowledgements and
//! the replies are checked and counted; a table per backend is printed.
//!
//! The child is this test binary again (`crash_child`, with `SPACEBOT_CRASH_CHILD_DIR` set). Its
//! stores are wrapped by a failpoint (`crash_support/failpoint.rs`) that counts every write and,
//! with `SPACEBOT_CRASH_AT=K`, prints `CRASHPOINT K` and blocks before write K: the parent kills it
//! there, so the kill lands exactly at that boundary.
//!
//! A second, smaller sweep runs the budget workload (`Workload::Budget`, see
//! `crash_support/workload.rs`): a conversation budget spent by an exchange, then a restart, then
//! the retrigger of the same exchange trying the peer again (it must be refused); and kills between
//! a task's claim and its model call, in sequences of 1, 3, 9 and 10 kills in a row on one
//! directory (`SPACEBOT_CRASH_AFTER_CLAIM`: the child stops at its first write or model call after
//! a claim), after which a task's failed attempts may not outnumber its model's real runs, and a
//! failed task's error must say what happened (10 is the task's recovery allowance: it fails then,
//! saying its process ended 10 times).
//!
//! A third sweep runs the notes workload (`Workload::Notes`): turns that read a shared note and
//! write it back with a line appended, killed at every write boundary; after each restart the
//! note's history may hold no line written twice (a turn's keyed write applied again) and must hold
//! every acknowledged write.
//!
//! A fourth sweep runs the limits workload (`Workload::Limits`): one request under a limit of model
//! calls fanned out over two hops to two workers, killed at every write boundary (between a
//! reservation and its settlement among them); after each restart the model calls made, counted by
//! the model itself, may not exceed the limit, and the user must have been told.
//!
//! `SPACEBOT_CRASH_SEED` sets the seed of the random kills (printed), `SPACEBOT_CRASH_RANDOM` their
//! number per backend (default 50 for the organization, 16 for the budget workload).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod crash_support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crash_support::failpoint::MARKER;
use crash_support::verify::{Counts, verify};
use crash_support::workload::{
    CHILD_AFTER_CLAIM, CHILD_AT, CHILD_BACKEND, CHILD_DIR, CHILD_WORKLOAD, WRITES, Workload,
    child_main,
};

/// Random kills per backend, unless `SPACEBOT_CRASH_RANDOM` says otherwise.
const RANDOM_KILLS: u64 = 32;
/// Random kills per backend of the budget workload.
const RANDOM_KILLS_BUDGET: u64 = 16;
/// Random kills per backend of the notes workload.
const RANDOM_KILLS_NOTES: u64 = 16;
/// Random kills per backend of the limits workload.
const RANDOM_KILLS_LIMITS: u64 = 12;
/// The claim-kill sequences of the budget workload: kills in a row between a claim and its model
/// call, on one directory, before the restart that runs to the end. 3 is the task's attempts (a
/// kill counted as an attempt would fail it 3/3 with its model never run), 9 and 10 are just under
/// and at its recovery allowance (3 x 3 attempts, at least 10).
const CLAIM_KILLS: [u32; 4] = [1, 3, 9, 10];

/// Where a child stops.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// Runs to the end.
    None,
    /// Before write K.
    At(u64),
    /// At the first write or model call after a claim.
    AfterClaim,
}

/// The child process: runs the workload when `SPACEBOT_CRASH_CHILD_DIR` is set.
#[test]
#[ignore = "the child process of the crash tests (run by them with SPACEBOT_CRASH_CHILD_DIR set)"]
fn crash_child() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let backend = std::env::var(CHILD_BACKEND).expect("the backend");
    let at = std::env::var(CHILD_AT).ok().map(|k| k.parse().expect("K"));
    let workload = std::env::var(CHILD_WORKLOAD).map_or(Workload::Org, |w| Workload::parse(&w));
    let after_claim = std::env::var_os(CHILD_AFTER_CLAIM).is_some();
    child_main(Path::new(&dir), &backend, workload, at, after_claim);
}

/// What a run of the gate works on: a backend and a workload.
#[derive(Debug, Clone, Copy)]
struct Gate {
    backend: &'static str,
    workload: Workload,
}

fn spawn_child(dir: &Path, gate: Gate, kill: Kill, stdout: Stdio, log: &str) -> Child {
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
    .env(CHILD_BACKEND, gate.backend)
    .env(CHILD_WORKLOAD, gate.workload.as_str())
    .env_remove(CHILD_AT)
    .env_remove(CHILD_AFTER_CLAIM)
    .stdout(stdout)
    .stderr(stderr);
    match kill {
        Kill::None => {}
        Kill::At(k) => {
            cmd.env(CHILD_AT, k.to_string());
        }
        Kill::AfterClaim => {
            cmd.env(CHILD_AFTER_CLAIM, "1");
        }
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
fn run_child(dir: &Path, gate: Gate, kill: Kill, log: &str) -> Ended {
    let mut child = spawn_child(dir, gate, kill, Stdio::piped(), log);
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
fn run_child_killed_after(dir: &Path, gate: Gate, delay: Duration) {
    let mut child = spawn_child(dir, gate, Kill::None, Stdio::null(), "killed.log");
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
fn restart_and_check(rt: &tokio::runtime::Runtime, dir: &Path, gate: Gate) -> Outcome {
    let mut outcome = Outcome {
        label: String::new(),
        counts: Counts::default(),
        symptoms: Vec::new(),
    };
    match run_child(dir, gate, Kill::None, "restart.log") {
        Ended::Finished(_) => {}
        Ended::Killed => unreachable!("no failpoint in a restart"),
        Ended::Failed(why) => {
            outcome.counts.restarts_failed += 1;
            outcome
                .symptoms
                .push(format!("the restart did not finish: {why}"));
        }
    }
    let (counts, symptoms) = rt.block_on(verify(dir, gate.backend, gate.workload));
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

/// The whole crash test of one backend and workload.
fn crash_test(gate: Gate) {
    let Gate { backend, workload } = gate;
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
    let n = match run_child(&dry, gate, Kill::None, "dry.log") {
        Ended::Finished(n) => n,
        other => panic!("{backend}/{workload:?}: the dry run did not finish: {other:?}"),
    };
    let dry_time = t.elapsed();
    assert!(n > 0, "{backend}/{workload:?}: the dry run wrote nothing");
    let (dry_counts, dry_symptoms) = rt.block_on(verify(&dry, backend, workload));

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
            run_child(&dir, gate, Kill::At(k), "killed.log"),
            Ended::Killed
        ) {
            // This run made fewer writes than the dry run (the order of writes of concurrent
            // agents may vary): it is checked all the same.
            not_killed += 1;
        }
        let mut outcome = restart_and_check(&rt, &dir, gate);
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
        .unwrap_or(match workload {
            Workload::Org => RANDOM_KILLS,
            Workload::Budget => RANDOM_KILLS_BUDGET,
            Workload::Notes => RANDOM_KILLS_NOTES,
            Workload::Limits => RANDOM_KILLS_LIMITS,
        });
    let kills = if only.is_some() { 0 } else { kills };
    let mut rng = Rng(seed ^ backend.len() as u64 ^ ((workload as u64) << 8));
    let max_delay = u64::try_from(dry_time.as_micros()).unwrap_or(u64::MAX);
    for i in 0..kills {
        let dir = base.join(format!("r{i}"));
        let label = if i % 2 == 0 {
            let k = rng.below(n) + 1;
            if !matches!(
                run_child(&dir, gate, Kill::At(k), "killed.log"),
                Ended::Killed
            ) {
                not_killed += 1;
            }
            format!("random #{i}: K={k}")
        } else {
            let delay = Duration::from_micros(rng.below(max_delay));
            run_child_killed_after(&dir, gate, delay);
            format!("random #{i}: after {delay:?}")
        };
        let mut outcome = restart_and_check(&rt, &dir, gate);
        outcome.label = label;
        random.add(&outcome.counts);
        if outcome.counts.failures() > 0 {
            failing.push(outcome);
        }
        if !keep {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    // Kills between a claim and its model call, several in a row on one directory (counted with
    // the random kills' column: "claim kills" says how many).
    let sequences: &[u32] = match workload {
        Workload::Budget if only.is_none() => &CLAIM_KILLS,
        _ => &[],
    };
    for &times in sequences {
        let dir = base.join(format!("claims{times}"));
        let mut killed = 0u64;
        for _ in 0..times {
            match run_child(&dir, gate, Kill::AfterClaim, "killed.log") {
                Ended::Killed => killed += 1,
                // No claim left to cut (the task ended): the sequence is over.
                _ => break,
            }
        }
        let mut outcome = restart_and_check(&rt, &dir, gate);
        if killed < u64::from(times) {
            outcome.counts.restarts_failed += 1;
            outcome.symptoms.push(format!(
                "only {killed} of {times} runs were killed after a claim"
            ));
        }
        outcome.counts.claim_kills += killed;
        outcome.label = format!("{times} kills after a claim");
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
            "crash test on {backend} ({} workload): N = {n} store writes in a full run (dry run \
             {:.2} s); seed {seed}; {} runs ended before their failpoint",
            workload.as_str(),
            dry_time.as_secs_f64(),
            not_killed
        ),
        format!(
            "| {:<44} | {:>10} | {:>10} | {:>6} |",
            "kills",
            format!("each K={n}"),
            if sequences.is_empty() {
                format!("random={kills}")
            } else {
                format!("random={kills}+claims")
            },
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
    ];
    if workload == Workload::Budget {
        report.extend([
            row(
                "spent conversation budgets granted again",
                sweep.budget_regranted,
                random.budget_regranted,
            ),
            row(
                "attempts counted beyond the model's runs",
                sweep.attempts_overcounted,
                random.attempts_overcounted,
            ),
            row(
                "failed tasks with an untrue error",
                sweep.errors_untrue,
                random.errors_untrue,
            ),
            row(
                "kills between a claim and its model call",
                sweep.claim_kills,
                random.claim_kills,
            ),
        ]);
    }
    if workload == Workload::Notes {
        report.extend([
            row(
                "note lines written twice (keyed writes)",
                sweep.notes_twice,
                random.notes_twice,
            ),
            row(
                "acknowledged note writes lost",
                sweep.notes_lost,
                random.notes_lost,
            ),
        ]);
    }
    if workload == Workload::Limits {
        report.push(row(
            "model calls beyond the request's limit",
            sweep.overspent,
            random.overspent,
        ));
    }
    report.push(format!(
        "{backend} ({} workload): {:.1} s in all",
        workload.as_str(),
        started.elapsed().as_secs_f64()
    ));
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
        "{backend} ({} workload): the runtime lost or repeated work after a kill\n{report}",
        workload.as_str()
    );
}

#[test]
fn sigkill_at_every_write_boundary_sqlite() {
    crash_test(Gate {
        backend: "sqlite",
        workload: Workload::Org,
    });
}

/// The SQLite gate on the per-agent layout (one database per agent); the gate above runs on the
/// default, the organization's one database.
#[test]
fn sigkill_at_every_write_boundary_sqlite_per_agent() {
    crash_test(Gate {
        backend: "sqlite_per_agent",
        workload: Workload::Org,
    });
}

#[cfg(feature = "redb")]
#[test]
fn sigkill_at_every_write_boundary_redb() {
    crash_test(Gate {
        backend: "redb",
        workload: Workload::Org,
    });
}

/// The budget workload: a restart between a spent conversation budget and the retrigger of its
/// exchange, and kills between a task's claim and its model call.
#[test]
fn sigkill_between_a_spent_budget_and_its_retrigger_and_before_model_calls_sqlite() {
    crash_test(Gate {
        backend: "sqlite",
        workload: Workload::Budget,
    });
}

#[cfg(feature = "redb")]
#[test]
fn sigkill_between_a_spent_budget_and_its_retrigger_and_before_model_calls_redb() {
    crash_test(Gate {
        backend: "redb",
        workload: Workload::Budget,
    });
}

/// The notes workload: turns writing a shared note, killed at every write boundary.
#[test]
fn sigkill_around_shared_note_writes_sqlite() {
    crash_test(Gate {
        backend: "sqlite",
        workload: Workload::Notes,
    });
}

#[cfg(feature = "redb")]
#[test]
fn sigkill_around_shared_note_writes_redb() {
    crash_test(Gate {
        backend: "redb",
        workload: Workload::Notes,
    });
}

/// The limits workload: a request's limit of model calls, killed at every write boundary
/// (reservations and settlements among them). SQLite only: the ledger's records go through the
/// same `RecordStore` contract on every backend, and the other workloads kill redb's.
#[test]
fn sigkill_never_overspends_a_request_limit_sqlite() {
    crash_test(Gate {
        backend: "sqlite",
        workload: Workload::Limits,
    });
}
