//! What the parent checks in a run directory once the restarted child finished: the stores, the
//! acknowledgements and the replies, counted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use spacebot::task::TaskFilter;
use spacebot::{ChannelId, ChannelRecord, RecordKind, StoreError, Stores, Task, TaskStatus};

use super::workload::{
    AGAIN, BUDGET, BUDGET_JOBS, JOBS, LIMIT_CALLS, LIMITS_JOBS, NOTE, NOTE_START, NOTES_JOBS,
    Workload, id, job_ids, read_acks, read_model_calls, read_model_runs, read_replies, try_open,
};

/// The counts of one run (or a sum of runs).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Acknowledged envelopes never answered, never turned into a task, or still pending.
    pub acked_lost: u64,
    /// Tasks beyond the first for one cause on one board.
    pub tasks_duplicated: u64,
    /// Delegated tasks not ended, notices not delivered, or not answered by the delegator.
    pub notices_lost: u64,
    /// Notices answered (or recorded) more than once.
    pub notices_twice: u64,
    /// Jobs without a final answer.
    pub never_answered: u64,
    /// Restarted runs that did not finish (a timeout or a panic in the child).
    pub restarts_failed: u64,
    /// Runs whose stores could not be opened or read after the restart.
    pub stores_refused: u64,
    /// Replies delivered more than once (allowed: at-least-once outbound).
    pub replies_repeated: u64,
    /// A spent conversation budget granted again: a second conversation for one exchange, more
    /// messages to the peer than the budget, or the retrigger's message reaching the peer.
    pub budget_regranted: u64,
    /// Tasks whose failed attempts outnumber the model runs that did not complete them (a kill
    /// between a claim and its model call counted as an attempt).
    pub attempts_overcounted: u64,
    /// Failed tasks whose error text is not true (says the task runs again, or names a cause that
    /// its counts do not show).
    pub errors_untrue: u64,
    /// Kills before a claim's model call (the claim-kill sequences; not a failure).
    pub claim_kills: u64,
    /// Shared-note lines written more than once (a turn's keyed write applied twice).
    pub notes_twice: u64,
    /// Acknowledged shared-note writes missing from the note, or versions that are not their
    /// predecessor plus one line.
    pub notes_lost: u64,
    /// Model calls made beyond the request's limit (the limits workload).
    pub overspent: u64,
}

impl Counts {
    pub fn add(&mut self, o: &Counts) {
        self.acked_lost += o.acked_lost;
        self.tasks_duplicated += o.tasks_duplicated;
        self.notices_lost += o.notices_lost;
        self.notices_twice += o.notices_twice;
        self.never_answered += o.never_answered;
        self.restarts_failed += o.restarts_failed;
        self.stores_refused += o.stores_refused;
        self.replies_repeated += o.replies_repeated;
        self.budget_regranted += o.budget_regranted;
        self.attempts_overcounted += o.attempts_overcounted;
        self.errors_untrue += o.errors_untrue;
        self.claim_kills += o.claim_kills;
        self.notes_twice += o.notes_twice;
        self.notes_lost += o.notes_lost;
        self.overspent += o.overspent;
    }

    /// Everything that must be 0.
    pub fn failures(&self) -> u64 {
        self.acked_lost
            + self.tasks_duplicated
            + self.notices_lost
            + self.notices_twice
            + self.never_answered
            + self.restarts_failed
            + self.stores_refused
            + self.budget_regranted
            + self.attempts_overcounted
            + self.errors_untrue
            + self.notes_twice
            + self.notes_lost
            + self.overspent
    }
}

fn completed(record: &ChannelRecord, number: u64) -> bool {
    record.record.kind == RecordKind::System
        && record
            .record
            .content
            .contains(&format!("completed task #{number}:"))
}

async fn history(
    stores: &Stores,
    owner: &str,
    channel: ChannelId,
) -> Result<Vec<ChannelRecord>, StoreError> {
    stores.channels.history(&id(owner), &channel, None).await
}

async fn board(stores: &Stores, agent: &str) -> Result<Vec<Task>, StoreError> {
    stores.tasks.list(&id(agent), &TaskFilter::default()).await
}

/// How many times task `number` of `target`, delegated by `delegator`, is recorded as completed in
/// both link channels (each must show it exactly once).
async fn link_records(
    stores: &Stores,
    delegator: &str,
    target: &str,
    number: u64,
    counts: &mut Counts,
    symptoms: &mut Vec<String>,
) -> Result<(), StoreError> {
    for (owner, peer) in [(delegator, target), (target, delegator)] {
        let n = history(stores, owner, ChannelId::link(&id(owner), &id(peer)))
            .await?
            .iter()
            .filter(|r| completed(r, number))
            .count();
        match n {
            1 => {}
            0 => {
                counts.notices_lost += 1;
                symptoms.push(format!(
                    "the notice of {target}#{number} is not recorded in {owner}'s link channel"
                ));
            }
            _ => {
                counts.notices_twice += 1;
                symptoms.push(format!(
                    "the notice of {target}#{number} is recorded {n} times in {owner}'s link channel"
                ));
            }
        }
    }
    Ok(())
}

/// Tasks beyond the first for one cause on one board.
fn duplicates(tasks: &[Task], board: &str, counts: &mut Counts, symptoms: &mut Vec<String>) {
    let mut by_cause: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for t in tasks {
        let cause = t
            .metadata
            .cause
            .as_ref()
            .map_or_else(|| format!("none-{}", t.number), |c| c.to_string());
        by_cause.entry(cause).or_default().push(t.number);
    }
    for (cause, numbers) in by_cause {
        if numbers.len() > 1 {
            counts.tasks_duplicated += numbers.len() as u64 - 1;
            symptoms.push(format!(
                "{} tasks on {board}'s board for cause {cause}: {numbers:?}",
                numbers.len()
            ));
        }
    }
}

/// Tasks beyond the first for one job on one board (each job is delivered with its key, so a
/// re-delivery after a kill must not delegate it again).
fn per_job(tasks: &[Task], board: &str, counts: &mut Counts, symptoms: &mut Vec<String>) {
    let mut by_job: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for t in tasks {
        for job in job_ids(&format!("{} {}", t.title, t.description)) {
            by_job.entry(job).or_default().push(t.number);
        }
    }
    for (job, numbers) in by_job {
        if numbers.len() > 1 {
            counts.tasks_duplicated += numbers.len() as u64 - 1;
            symptoms.push(format!(
                "{} tasks on {board}'s board for {job}: {numbers:?}",
                numbers.len()
            ));
        }
    }
}

/// Checks the run directory `dir` (stores under `dir/data`) of `workload`.
pub async fn verify(dir: &Path, backend: &str, workload: Workload) -> (Counts, Vec<String>) {
    let mut counts = Counts::default();
    let mut symptoms = Vec::new();
    let checked = match workload {
        Workload::Org => check(dir, backend, &mut counts, &mut symptoms).await,
        Workload::Budget => check_budget(dir, backend, &mut counts, &mut symptoms).await,
        Workload::Notes => check_notes(dir, backend, &mut counts, &mut symptoms).await,
        Workload::Limits => check_limits(dir, backend, &mut counts, &mut symptoms).await,
    };
    if let Err(e) = checked {
        counts.stores_refused += 1;
        symptoms.push(format!("the stores could not be opened or read: {e}"));
    }
    (counts, symptoms)
}

async fn check(
    dir: &Path,
    backend: &str,
    counts: &mut Counts,
    symptoms: &mut Vec<String>,
) -> Result<(), StoreError> {
    let replies = read_replies(dir);
    let acks = read_acks(dir);
    let stores = try_open(backend, &dir.join("data")).await?;

    // Every job answered.
    let finals: BTreeSet<String> = replies.iter().flat_map(|r| r.finals()).collect();
    for job in JOBS {
        if !finals.contains(job) {
            counts.never_answered += 1;
            symptoms.push(format!("{job} was never answered"));
        }
    }
    // Replies repeated (reported).
    let mut by_key: BTreeMap<String, u64> = BTreeMap::new();
    for r in &replies {
        *by_key.entry(r.key()).or_default() += 1;
    }
    counts.replies_repeated = by_key.values().map(|n| n - 1).sum();

    let lead_board = board(&stores, "lead").await?;
    let worker_board = board(&stores, "worker").await?;
    duplicates(&lead_board, "lead", counts, symptoms);
    duplicates(&worker_board, "worker", counts, symptoms);
    per_job(&lead_board, "lead", counts, symptoms);
    per_job(&worker_board, "worker", counts, symptoms);

    // Acknowledged envelopes: answered or delegated, and not left pending.
    let answered_ids: BTreeSet<&str> = replies
        .iter()
        .flat_map(|r| r.in_reply_to.iter().map(String::as_str))
        .collect();
    let causes: BTreeSet<String> = lead_board
        .iter()
        .filter_map(|t| t.metadata.cause.as_ref().map(ToString::to_string))
        .collect();
    let mut pending = BTreeSet::new();
    for agent in ["chief", "lead", "worker", "ann", "bob", "late"] {
        for e in stores.deliveries.pending(&id(agent)).await? {
            pending.insert(e.id.to_string());
        }
    }
    for (verb, job, envelope) in &acks {
        if verb != "ack" {
            continue;
        }
        // A job delivered again with its key after a kill: one of its envelopes is answered, the
        // others are consumed unanswered (and must not stay pending).
        let handled = answered_ids.contains(envelope.as_str())
            || causes.contains(envelope)
            || finals.contains(job.as_str());
        if !handled || pending.contains(envelope) {
            counts.acked_lost += 1;
            symptoms.push(format!(
                "acknowledged envelope {envelope} ({job}) {}",
                if handled {
                    "is still pending"
                } else {
                    "was neither answered nor delegated"
                }
            ));
        }
    }

    // Notices of the lead's tasks: ended, recorded once per link side, answered once by the chief.
    let chief_portal = history(&stores, "chief", ChannelId::new("portal:u1")).await?;
    let chief_answered: BTreeSet<&str> = replies
        .iter()
        .filter(|r| r.agent == "chief")
        .flat_map(|r| r.in_reply_to.iter().map(String::as_str))
        .collect();
    for t in &lead_board {
        if t.status != TaskStatus::Done {
            counts.notices_lost += 1;
            symptoms.push(format!("lead#{} ended as {}", t.number, t.status));
            continue;
        }
        link_records(&stores, "chief", "lead", t.number, counts, symptoms).await?;
        let retriggers: BTreeSet<String> = chief_portal
            .iter()
            .filter(|r| completed(r, t.number))
            .filter_map(|r| r.record.metadata.get("envelope"))
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        let answers = retriggers
            .iter()
            .filter(|e| chief_answered.contains(e.as_str()))
            .count();
        match answers {
            1 => {}
            0 => {
                counts.notices_lost += 1;
                symptoms.push(format!(
                    "the chief never answered the notice of lead#{}",
                    t.number
                ));
            }
            n => {
                counts.notices_twice += 1;
                symptoms.push(format!(
                    "the chief answered the notice of lead#{} {n} times (envelopes {retriggers:?})",
                    t.number
                ));
            }
        }
    }
    // Notices of the worker's tasks: ended, recorded once per link side, applied to the parent.
    for t in &worker_board {
        if t.status != TaskStatus::Done {
            counts.notices_lost += 1;
            symptoms.push(format!("worker#{} ended as {}", t.number, t.status));
            continue;
        }
        link_records(&stores, "lead", "worker", t.number, counts, symptoms).await?;
        let applied = t.metadata.parent_task.as_ref().is_some_and(|p| {
            lead_board.iter().any(|l| {
                l.number == p.number
                    && l.metadata
                        .children
                        .iter()
                        .any(|c| c.task == t.task_ref() && c.ended.is_some())
            })
        });
        if !applied {
            counts.notices_lost += 1;
            symptoms.push(format!(
                "the end of worker#{} is not applied to its parent task",
                t.number
            ));
        }
    }
    for agent in ["lead", "worker"] {
        let outbox = stores.tasks.outbox_pending(&id(agent)).await?;
        if !outbox.is_empty() {
            counts.notices_lost += outbox.len() as u64;
            symptoms.push(format!(
                "{agent}'s outbox still holds {:?}",
                outbox.iter().map(|n| &n.key).collect::<Vec<_>>()
            ));
        }
    }
    Ok(())
}

/// Every job answered, and replies repeated counted.
fn answered(
    replies: &[super::workload::ReplyLine],
    jobs: &[&str],
    counts: &mut Counts,
    symptoms: &mut Vec<String>,
) -> BTreeSet<String> {
    let finals: BTreeSet<String> = replies.iter().flat_map(|r| r.finals()).collect();
    for job in jobs {
        if !finals.contains(*job) {
            counts.never_answered += 1;
            symptoms.push(format!("{job} was never answered"));
        }
    }
    let mut by_key: BTreeMap<String, u64> = BTreeMap::new();
    for r in replies {
        *by_key.entry(r.key()).or_default() += 1;
    }
    counts.replies_repeated = by_key.values().map(|n| n - 1).sum();
    finals
}

/// The failed attempts of `task` against the model runs of its channel: each failed attempt is a
/// run of the model that did not complete the task (a kill between the claim and the model call
/// is no attempt). A failed task's error must be true: given up after its recovery allowance
/// (and saying how many times), or after its attempts, never "runs again".
fn attempts_and_error(
    t: &Task,
    runs: &BTreeMap<String, u32>,
    counts: &mut Counts,
    symptoms: &mut Vec<String>,
) {
    let channel = format!("task:{}", t.task_ref());
    let ran = runs.get(&channel).copied().unwrap_or(0);
    // Runs that did not complete the task: all of them, unless it is done (the last one did).
    let unfinished = if t.status == TaskStatus::Done {
        ran.saturating_sub(1)
    } else {
        ran
    };
    if t.status == TaskStatus::Done && ran == 0 {
        counts.attempts_overcounted += 1;
        symptoms.push(format!("{} is done but its model never ran", t.task_ref()));
    }
    if t.attempts > unfinished {
        counts.attempts_overcounted += 1;
        symptoms.push(format!(
            "{} ended {} with attempts {}/{} but its model ran {ran} times ({unfinished} not \
             completing it; {} recoveries)",
            t.task_ref(),
            t.status,
            t.attempts,
            t.max_attempts,
            t.metadata.recoveries
        ));
    }
    if t.status != TaskStatus::Failed {
        return;
    }
    let error = t.error.clone().unwrap_or_default();
    let allowance = t.recovery_allowance();
    let true_text = if t.metadata.recoveries >= allowance {
        error.contains("process ended")
            && error.contains(&format!("{} times", t.metadata.recoveries))
    } else {
        t.attempts >= t.max_attempts && ran >= t.attempts
    };
    if !true_text || error.contains("runs again") {
        counts.errors_untrue += 1;
        symptoms.push(format!(
            "{} failed with attempts {}/{}, {} recoveries (allowance {allowance}), {ran} model \
             runs, and the error {error:?}",
            t.task_ref(),
            t.attempts,
            t.max_attempts,
            t.metadata.recoveries
        ));
    }
}

/// The budget workload's checks: job answered, acknowledgement handled, c's task once and ended,
/// its notice recorded and answered, one conversation of a and b whose budget was never granted
/// again, attempts no more than the model runs, failed tasks' errors true.
async fn check_budget(
    dir: &Path,
    backend: &str,
    counts: &mut Counts,
    symptoms: &mut Vec<String>,
) -> Result<(), StoreError> {
    let replies = read_replies(dir);
    let acks = read_acks(dir);
    let runs = read_model_runs(dir);
    let stores = try_open(backend, &dir.join("data")).await?;
    let finals = answered(&replies, &BUDGET_JOBS, counts, symptoms);

    let c_board = board(&stores, "c").await?;
    duplicates(&c_board, "c", counts, symptoms);
    per_job(&c_board, "c", counts, symptoms);

    // The acknowledged envelope: answered or delegated, not left pending.
    let answered_ids: BTreeSet<&str> = replies
        .iter()
        .flat_map(|r| r.in_reply_to.iter().map(String::as_str))
        .collect();
    let causes: BTreeSet<String> = c_board
        .iter()
        .filter_map(|t| t.metadata.cause.as_ref().map(ToString::to_string))
        .collect();
    let mut pending = BTreeSet::new();
    for agent in ["a", "b", "c"] {
        for e in stores.deliveries.pending(&id(agent)).await? {
            pending.insert(e.id.to_string());
        }
    }
    for (verb, job, envelope) in &acks {
        if verb != "ack" {
            continue;
        }
        let handled = answered_ids.contains(envelope.as_str())
            || causes.contains(envelope)
            || finals.contains(job.as_str());
        if !handled || pending.contains(envelope) {
            counts.acked_lost += 1;
            symptoms.push(format!(
                "acknowledged envelope {envelope} ({job}) lost or pending"
            ));
        }
    }

    // c's task: ended; done ones recorded once per link side and their notice answered once.
    let a_portal = history(&stores, "a", ChannelId::new("portal:u1")).await?;
    let a_answered: BTreeSet<&str> = replies
        .iter()
        .filter(|r| r.agent == "a")
        .flat_map(|r| r.in_reply_to.iter().map(String::as_str))
        .collect();
    if c_board.is_empty() && !finals.is_empty() {
        counts.notices_lost += 1;
        symptoms.push("job-6 was answered but c's board is empty".into());
    }
    for t in &c_board {
        attempts_and_error(t, &runs, counts, symptoms);
        match t.status {
            TaskStatus::Done => {}
            TaskStatus::Failed => continue,
            other => {
                counts.notices_lost += 1;
                symptoms.push(format!("c#{} ended as {other}", t.number));
                continue;
            }
        }
        link_records(&stores, "a", "c", t.number, counts, symptoms).await?;
        let retriggers: BTreeSet<String> = a_portal
            .iter()
            .filter(|r| completed(r, t.number))
            .filter_map(|r| r.record.metadata.get("envelope"))
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        let answers = retriggers
            .iter()
            .filter(|e| a_answered.contains(e.as_str()))
            .count();
        if answers != 1 {
            if answers == 0 {
                counts.notices_lost += 1;
            } else {
                counts.notices_twice += 1;
            }
            symptoms.push(format!(
                "a answered the notice of c#{} {answers} times (envelopes {retriggers:?})",
                t.number
            ));
        }
    }
    let outbox = stores.tasks.outbox_pending(&id("c")).await?;
    if !outbox.is_empty() {
        counts.notices_lost += outbox.len() as u64;
        symptoms.push(format!(
            "c's outbox still holds {:?}",
            outbox.iter().map(|n| &n.key).collect::<Vec<_>>()
        ));
    }

    // The budget: one conversation of a and b, severed with its budget spent; at most the budget's
    // messages from a reached b, and never the one a sent when c's result woke it.
    let (a, b) = (id("a"), id("b"));
    let filter = spacebot::conversation::ConversationFilter {
        member: Some(a.clone()),
        statuses: Vec::new(),
    };
    let conversations: Vec<_> = stores
        .conversations
        .list(&filter)
        .await?
        .into_iter()
        .filter(|c| c.member(&b).is_some())
        .collect();
    if conversations.len() > 1 {
        counts.budget_regranted += 1;
        symptoms.push(format!(
            "{} conversations of a and b for one exchange: {:?}",
            conversations.len(),
            conversations
                .iter()
                .map(|c| format!("{} {} budget left {}", c.id, c.status, c.budget_remaining))
                .collect::<Vec<_>>()
        ));
    }
    let to_b: Vec<ChannelRecord> = history(&stores, "b", ChannelId::link(&b, &a))
        .await?
        .into_iter()
        .filter(|r| r.record.kind == RecordKind::User && r.record.author.as_str() == "agent a")
        .collect();
    let envelopes: BTreeSet<String> = to_b
        .iter()
        .map(|r| {
            r.record
                .metadata
                .get("envelope")
                .and_then(|v| v.as_str())
                .map_or_else(|| format!("record {}", r.seq), str::to_string)
        })
        .collect();
    if envelopes.len() as u64 > u64::from(BUDGET) {
        counts.budget_regranted += 1;
        symptoms.push(format!(
            "{} messages from a reached b, over the budget of {BUDGET}",
            envelopes.len()
        ));
    }
    if let Some(again) = to_b.iter().find(|r| r.record.content.contains(AGAIN)) {
        counts.budget_regranted += 1;
        symptoms.push(format!(
            "a's message after the spent budget reached b: {:?}",
            again.record.content
        ));
    }
    Ok(())
}

/// The notes workload's checks: every job answered; the note's history starts with its first text
/// and each later version is its predecessor plus one job's line; no job's line written twice
/// (each turn's path is the same when it runs again, so a second line of one job is its keyed
/// write applied twice); every answered job's line in the note (its write was acknowledged).
async fn check_notes(
    dir: &Path,
    backend: &str,
    counts: &mut Counts,
    symptoms: &mut Vec<String>,
) -> Result<(), StoreError> {
    let replies = read_replies(dir);
    let finals = answered(&replies, &NOTES_JOBS, counts, symptoms);
    let stores = try_open(backend, &dir.join("data")).await?;
    let history = stores
        .records
        .history(spacebot::notes::NOTES_NAMESPACE, NOTE)
        .await?;
    let texts: Vec<String> = history
        .iter()
        .map(|r| r.value["text"].as_str().unwrap_or_default().to_string())
        .collect();
    if texts.first().map(String::as_str) != Some(NOTE_START) {
        counts.notes_lost += 1;
        symptoms.push(format!("the note's first version is {:?}", texts.first()));
    }
    let mut written: BTreeMap<String, u64> = BTreeMap::new();
    for pair in texts.windows(2) {
        match pair[1].strip_prefix(&format!("{}\n", pair[0])) {
            Some(line) if !line.contains('\n') => {
                *written.entry(line.to_string()).or_default() += 1
            }
            _ => {
                counts.notes_lost += 1;
                symptoms.push(format!(
                    "version {:?} does not extend {:?} by one line",
                    pair[1], pair[0]
                ));
            }
        }
    }
    for (line, times) in &written {
        if *times > 1 {
            counts.notes_twice += times - 1;
            symptoms.push(format!("{line} written {times} times"));
        }
    }
    for job in &finals {
        if !written.contains_key(job) {
            counts.notes_lost += 1;
            symptoms.push(format!(
                "{job} was answered but its line is not in the note"
            ));
        }
    }
    stores.close().await;
    Ok(())
}

/// The limits workload's checks: the model calls made (logged before each answer) never exceed
/// the request's limit; the user was told (an answer or a failure); the acknowledged envelope is
/// not left pending; every task of the tree ended; no task was delegated twice.
async fn check_limits(
    dir: &Path,
    backend: &str,
    counts: &mut Counts,
    symptoms: &mut Vec<String>,
) -> Result<(), StoreError> {
    let calls = read_model_calls(dir);
    if calls > LIMIT_CALLS {
        counts.overspent += calls - LIMIT_CALLS;
        symptoms.push(format!(
            "{calls} model calls made under a limit of {LIMIT_CALLS}"
        ));
    }
    let replies = read_replies(dir);
    let mut by_key: BTreeMap<String, u64> = BTreeMap::new();
    for r in &replies {
        *by_key.entry(r.key()).or_default() += 1;
    }
    counts.replies_repeated = by_key.values().map(|n| n - 1).sum();
    let stores = try_open(backend, &dir.join("data")).await?;
    for (verb, job, envelope) in read_acks(dir) {
        if verb != "ack" || !LIMITS_JOBS.contains(&job.as_str()) {
            continue;
        }
        if !replies.iter().any(|r| r.tells_limits_job(&envelope)) {
            counts.never_answered += 1;
            symptoms.push(format!("{job} ({envelope}): the user was never told"));
        }
        let pending = stores.deliveries.pending(&id("chief")).await?;
        if pending.iter().any(|e| e.id.to_string() == envelope) {
            counts.acked_lost += 1;
            symptoms.push(format!("{job} ({envelope}) still pending"));
        }
    }
    for board in ["lead", "w1", "w2"] {
        let tasks = self::board(&stores, board).await?;
        duplicates(&tasks, board, counts, symptoms);
        for t in &tasks {
            if !t.status.is_terminal() {
                counts.notices_lost += 1;
                symptoms.push(format!("{board}#{} left {:?}", t.number, t.status));
            }
        }
    }
    Ok(())
}
