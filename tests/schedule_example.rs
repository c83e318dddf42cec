//! The schedule example (`examples/schedule.rs`, a behaviour written against the public API only)
//! runs: every tick is answered once, and a tick handed over again after a restart is not.

#[allow(dead_code)]
#[path = "../examples/schedule.rs"]
mod schedule;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schedule_example_wakes_its_agent_once_per_tick() {
    let dir = tempfile::tempdir().unwrap();
    let reports = schedule::run(dir.path(), 3).await.unwrap();
    assert_eq!(reports.len(), 3, "{reports:?}");
    let slots: Vec<&str> = reports
        .iter()
        .map(|r| r.split_whitespace().nth(3).unwrap_or_default())
        .collect();
    let mut distinct = slots.clone();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        3,
        "one report per tick, each its own slot: {reports:?}"
    );
}
