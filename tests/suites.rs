//! The scenario suites (`tests/scenarios/*.rs`) on every backend: in memory, SQLite and redb, each
//! in a fresh temporary directory, and PostgreSQL (feature `postgres`), each in a fresh schema of
//! the database at `DATABASE_URL`. One binary, so the suites link once.
//!
//! Without `DATABASE_URL` the PostgreSQL scenarios start a throwaway server where the server
//! binaries are installed; where neither is at hand they are compiled as ignored, with the reason
//! (`cfg(spacebot_pg)`, set by the build script), so the run reports them as not run. Under
//! `SPACEBOT_REQUIRE_POSTGRES=1` (CI) they always run, and fail without a server. See the README.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod scenarios;

use std::sync::{Arc, Mutex};

use scenarios::support::OpenStores;
use spacebot::Stores;

/// The backends every scenario runs on.
#[derive(Debug, Clone, Copy)]
enum Backend {
    Memory,
    Sqlite,
    #[cfg(feature = "redb")]
    Redb,
    #[cfg(feature = "postgres")]
    Postgres,
}

/// Whether `backend` can run here: PostgreSQL needs `DATABASE_URL` (without it this says so on
/// stderr, or fails the test under `SPACEBOT_REQUIRE_POSTGRES=1`).
fn available(backend: Backend) -> bool {
    match backend {
        #[cfg(feature = "postgres")]
        Backend::Postgres => database_url().is_some(),
        _ => true,
    }
}

/// The PostgreSQL database the scenarios run on: `DATABASE_URL`, or a throwaway server started
/// from the installed binaries (see `spacebot::testing::external::database_url`).
#[cfg(feature = "postgres")]
fn database_url() -> Option<String> {
    spacebot::testing::external::database_url()
}

/// The stores of `backend`, and the directory that holds them (kept for the test's duration);
/// `None` when the backend cannot run here (see [`available`]). A PostgreSQL schema is dropped
/// with the last clone of its stores.
async fn open(backend: Backend) -> Option<(Stores, Option<tempfile::TempDir>)> {
    if !available(backend) {
        return None;
    }
    Some(match backend {
        Backend::Memory => (Stores::memory(), None),
        Backend::Sqlite => {
            let dir = tempfile::tempdir().unwrap();
            let stores = spacebot::sqlite::open(dir.path()).await.unwrap();
            (stores, Some(dir))
        }
        #[cfg(feature = "redb")]
        Backend::Redb => {
            let dir = tempfile::tempdir().unwrap();
            let stores = spacebot::redb::open(dir.path()).unwrap();
            (stores, Some(dir))
        }
        #[cfg(feature = "postgres")]
        Backend::Postgres => {
            let url = database_url()?;
            // A small pool: the scenarios run in parallel against one server.
            let stores = spacebot::postgres::PgOptions::new()
                .max_connections(5)
                .temporary(&url)
                .await
                .unwrap();
            (stores.stores(), None)
        }
    })
}

/// Opens fresh stores of `backend` on every call; the directories live as long as the opener.
fn opener(backend: Backend) -> OpenStores {
    let dirs: Arc<Mutex<Vec<tempfile::TempDir>>> = Arc::default();
    Arc::new(move || {
        let dirs = dirs.clone();
        Box::pin(async move {
            let (stores, dir) = open(backend)
                .await
                .expect("the scenario checked that its backend is available");
            dirs.lock().unwrap().extend(dir);
            stores
        })
    })
}

/// `on_every_backend!(suite: a, b)` runs `scenarios::suite::a(stores)` and `b` on every backend,
/// as `suite::memory::a`, `suite::sqlite::a`, `suite::redb::a`, `suite::postgres::a`. The scenarios listed after `fresh:`
/// take an [`OpenStores`] instead, to build several organizations. The scenarios run on Tokio's
/// current-thread runtime unless the suite names another test attribute (`suite #[attr]: ...`).
macro_rules! on_every_backend {
    ($suite:ident $(#[$test:meta])?: $($name:ident),* $(,)? $(; fresh: $($fresh:ident),* $(,)?)?) => {
        on_every_backend!(@suite $suite, [$($test)?], [$($name),*], [$($($fresh),*)?]);
    };
    (@suite $suite:ident, [], $names:tt, $fresh:tt) => {
        on_every_backend!(@suite $suite, [tokio::test], $names, $fresh);
    };
    (@suite $suite:ident, [$test:meta], $names:tt, $fresh:tt) => {
        mod $suite {
            on_every_backend!(@backend $suite, memory, Memory, $test, [cfg_attr(any(), ignore)], $names, $fresh);
            on_every_backend!(@backend $suite, sqlite, Sqlite, $test, [cfg_attr(any(), ignore)], $names, $fresh);
            #[cfg(feature = "redb")]
            on_every_backend!(@backend $suite, redb, Redb, $test, [cfg_attr(any(), ignore)], $names, $fresh);
            #[cfg(feature = "postgres")]
            on_every_backend!(@backend $suite, postgres, Postgres, $test,
                [cfg_attr(not(spacebot_pg), ignore = "no PostgreSQL here: set DATABASE_URL or install the server (initdb, pg_ctl); see README")],
                $names, $fresh);
        }
    };
    (@backend $suite:ident, $module:ident, $backend:ident, $test:meta, [$attr:meta], [$($name:ident),*], [$($fresh:ident),*]) => {
        mod $module {
            $(
                #[$test]
                #[$attr]
                async fn $name() {
                    let Some((stores, _dir)) = crate::open(crate::Backend::$backend).await else {
                        return;
                    };
                    crate::scenarios::$suite::$name(stores).await;
                }
            )*
            $(
                #[$test]
                #[$attr]
                async fn $fresh() {
                    if !crate::available(crate::Backend::$backend) {
                        return;
                    }
                    crate::scenarios::$suite::$fresh(crate::opener(crate::Backend::$backend)).await;
                }
            )*
        }
    };
}

on_every_backend!(junctions #[tokio::test(flavor = "multi_thread", worker_threads = 2)]:
    conversation_budget_bounds_the_whole_exchange,
    a_task_arriving_mid_turn_gets_its_own_turn,
    a_user_message_steering_a_task_is_answered_to_the_user,
    an_announce_cannot_open_an_exchange_over_a_one_way_link,
    a_disabled_link_carries_nothing,
    deliveries_racing_a_start_are_all_answered,
    a_hung_worker_does_not_block_the_board,
    tool_calls_per_response_are_capped,
    a_streaming_outbound_gets_deltas_then_the_reply,
    usage_is_summed_across_a_two_hop_delegation,
    an_executor_that_gives_up_fails_the_task_at_once,
    a_store_error_at_the_start_of_a_turn_is_retried,
    a_message_delivered_again_with_its_key_is_answered_once,
    wait_idle_waits_for_the_task_loop,
    a_failed_outcome_write_is_retried_with_the_result_kept,
    a_result_after_a_restart_is_answered_to_the_user,
    an_internal_task_stays_open_across_a_restart,
    a_notice_is_marked_sent_before_the_delegator_answers_it,
    a_conversation_goes_on_after_a_restart,
    a_panicking_model_ends_only_its_own_agent,
    two_runners_carry_delegation_round_trips,
    a_chain_driven_by_waiting_for_replies_is_answered,
    a_spent_conversation_budget_stays_spent_across_a_restart,
    a_failed_mark_sent_does_not_leave_a_delivered_notice_in_the_outbox,
    a_claim_cut_before_the_model_call_uses_no_attempt,
);

on_every_backend!(agent:
    delivery_to_a_stopped_agent_is_persisted_and_handed_over_once,
    a_full_queue_refuses_with_queue_full,
    unknown_and_ended_targets_are_typed_errors,
    internal_messages_are_policy_checked_and_stamped,
    a_child_result_wakes_the_parent,
    a_failed_child_and_an_undeliverable_result_are_reported,
    tool_errors_go_back_to_the_model,
    the_round_limit_stops_a_looping_model,
    steering_answers_the_merged_backlog_then_the_interrupted_message,
    cancelling_a_turn_keeps_what_is_queued,
    stopping_an_agent_persists_its_queue_for_the_next_start,
    after_a_steer_the_interrupted_message_waits_for_the_merged_answer,
    a_parent_and_its_child_may_always_message_each_other,
    a_handed_over_delivery_stays_stored_until_it_was_processed,
    deliveries_to_a_stopped_agent_are_handed_over_in_order,
    a_parent_with_a_full_queue_gets_its_childrens_results_in_order,
    a_turn_kept_steered_stops_at_four_times_the_round_limit,
);

on_every_backend!(offers:
    every_agent_is_offered_only_the_tools_its_links_allow,
    a_woken_delegator_sees_its_call_and_result_before_the_notice,
    the_task_text_a_worker_gets_comes_from_prompts,
);

on_every_backend!(delegation_roundtrip:
    round_trip_from_user_to_target_and_back,
    a_failing_worker_is_requeued_until_max_attempts_then_the_notice_says_failed,
    a_custom_executor_runs_the_task_and_the_delegator_gets_its_result,
    custom_executor_errors_requeue_then_succeed,
    an_expired_lease_is_requeued_and_the_task_runs_again,
    a_crashed_worker_frees_its_slot_and_the_task_runs_again_after_its_lease,
    a_stale_worker_cannot_complete_a_task_claimed_again_after_its_lease_expired,
    multi_hop_waits_resumes_with_the_child_result_and_bubbles_up,
    fan_out_each_delegation_comes_back_independently,
    a_notice_delivered_twice_is_applied_once,
    a_notice_delivered_twice_while_the_delegator_works_is_applied_once,
    a_retrigger_interrupted_by_a_steer_is_still_answered,
    a_stopped_delegator_gets_its_notice_when_it_starts,
    a_long_result_is_quoted_in_part_and_kept_whole_on_the_task,
    a_long_task_turn_renews_its_lease_at_every_checkpoint,
);

on_every_backend!(delegation_policies:
    unknown_agent_lists_the_agents_the_delegator_may_reach,
    unknown_agent_comes_back_to_the_model_as_a_tool_result_it_can_act_on,
    no_link_is_refused,
    a_disabled_link_is_refused,
    a_one_way_link_is_refused_in_the_wrong_direction,
    self_delegation_and_empty_messages_are_refused,
    a_cycle_is_refused_with_the_chain,
    a_chain_deeper_than_the_limit_is_refused,
    too_many_rounds_are_refused,
    only_a_task_in_progress_may_delegate_and_nothing_is_left_behind,
    a_delegation_from_a_task_that_does_not_exist_is_an_error,
    the_send_tool_reports_denials_as_tool_errors,
    approval_always_holds_the_task_until_the_target_approves_it,
    the_send_tool_says_when_a_task_waits_for_approval,
    approval_unless_superior_lets_superiors_through_and_holds_peers,
    boards_own_board_and_superiors_read_subordinates,
    cancelling_a_delegated_task_notifies_the_delegator,
);

on_every_backend!(delegation_adversarial:
    a_model_that_re_delegates_on_every_result_stops_at_the_round_limit,
    three_models_delegating_in_a_circle_end_with_cycle_errors,
);

on_every_backend!(conversation_mirrored:
    both_link_channels_exist_from_the_start,
    a_send_wakes_the_peer_and_replies_mirror_back,
    on_a_one_way_link_only_from_opens_and_the_other_side_may_answer,
    unlinked_agents_cannot_open_a_conversation,
    conclusion_closes_both_sides_and_retriggers_initiated_from_only,
    reopening_keeps_history_budget_rules_and_initiated_from,
    the_budget_severs_a_conversation_nobody_concludes,
    an_answer_after_the_end_is_kept_but_neither_delivered_nor_leaked,
    stopping_an_agent_severs_its_conversations,
    nebula_multi_hop_in_mirrored_mode,
    an_answer_to_a_notice_in_a_conversations_channel_goes_to_the_peer;
    fresh: concurrent_handshakes_between_one_pair_end_in_one_conversation,
);

on_every_backend!(conversation_group:
    a_members_output_reaches_every_other_member,
    checkpoint_content_tool_chatter_and_empty_output_never_cross,
    the_rules_reach_every_member_exactly_once_at_creation,
    only_the_initiator_closes_and_a_non_matching_close_closes_nothing,
    the_initiators_close_delivers_the_final_message_and_wakes_its_origin,
    any_member_may_sever_and_the_link_and_all_memberships_go_at_once,
    a_members_session_end_severs_the_group,
    a_failed_delivery_to_one_member_does_not_stop_the_others,
    opening_a_group_that_is_already_open_continues_it_with_a_clear_answer,
    a_group_needs_a_link_the_opener_may_start_with_each_member,
);

/// A data directory opens again right after a shutdown: deliver a message, get the reply, shut the
/// organization down, drop every handle, open the same directory at once (SQLite and redb, on both
/// Tokio runtimes, ten rounds each).
mod reopen {
    use std::path::Path;
    use std::sync::Arc;

    use crate::scenarios::junctions::{CHIEF_AND_LEAD, chain_model};
    use spacebot::testing::{FnLlm, OrgHarness};
    use spacebot::{AgentId, InboundMessage, Stores};

    #[derive(Clone, Copy, Debug)]
    enum Kind {
        Sqlite,
        #[cfg(feature = "redb")]
        Redb,
    }

    async fn open(kind: Kind, dir: &Path) -> Stores {
        match kind {
            Kind::Sqlite => spacebot::sqlite::open(dir).await,
            #[cfg(feature = "redb")]
            Kind::Redb => spacebot::redb::open(dir),
        }
        .unwrap_or_else(|e| panic!("{kind:?}: the directory opens again after a shutdown: {e}"))
    }

    /// One round: a delegation there and back (the chief's task loop, the lead's worker), then
    /// a shutdown and every handle dropped.
    async fn round(kind: Kind, dir: &Path, n: usize) {
        let llm = Arc::new(FnLlm::new(|req| Ok(chain_model(req))));
        let stores = open(kind, dir).await;
        let mut h = OrgHarness::builder(CHIEF_AND_LEAD)
            .stores(stores)
            .llm(llm)
            .build()
            .await;
        h.org.start_all().await.unwrap();
        h.org
            .deliver(
                "chief",
                InboundMessage::new("portal", "u1", format!("go {n}")),
            )
            .await
            .unwrap();
        let mut fin = h.reply().await;
        while !fin.content.starts_with("FINAL") {
            fin = h.reply().await;
        }
        h.org.shutdown().await.unwrap();
        drop(h);
    }

    async fn rounds(kind: Kind) {
        let dir = tempfile::tempdir().unwrap();
        for n in 0..10 {
            round(kind, dir.path(), n).await;
        }
        // And the data is all there.
        let stores = open(kind, dir.path()).await;
        let lead = AgentId::parse("lead").unwrap();
        let tasks = stores
            .tasks
            .list(&lead, &spacebot::task::TaskFilter::default())
            .await
            .unwrap();
        assert_eq!(tasks.len(), 10, "one task a round");
    }

    /// `Stores::close` releases the directory at once, even while clones of the stores live;
    /// those clones then fail with a named error.
    async fn close_releases(kind: Kind) {
        let dir = tempfile::tempdir().unwrap();
        let a = AgentId::parse("a").unwrap();
        let stores = open(kind, dir.path()).await;
        let kept = stores.clone();
        assert!(
            stores
                .deliveries
                .mark_applied(&a, "k1", spacebot::Timestamp(1))
                .await
                .unwrap()
        );
        stores.close().await;
        let again = open(kind, dir.path()).await;
        assert!(again.deliveries.is_applied(&a, "k1").await.unwrap());
        let e = kept
            .deliveries
            .mark_applied(&a, "k2", spacebot::Timestamp(2))
            .await
            .unwrap_err();
        assert!(
            matches!(e, spacebot::StoreError::Backend { .. }),
            "{kind:?}: {e}"
        );
    }

    #[tokio::test]
    async fn stores_close_releases_the_directory() {
        close_releases(Kind::Sqlite).await;
        #[cfg(feature = "redb")]
        close_releases(Kind::Redb).await;
    }

    #[tokio::test]
    async fn sqlite_current_thread() {
        rounds(Kind::Sqlite).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_multi_thread() {
        rounds(Kind::Sqlite).await;
    }

    #[cfg(feature = "redb")]
    #[tokio::test]
    async fn redb_current_thread() {
        rounds(Kind::Redb).await;
    }

    #[cfg(feature = "redb")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redb_multi_thread() {
        rounds(Kind::Redb).await;
    }
}

on_every_backend!(governance #[tokio::test(flavor = "multi_thread", worker_threads = 2)]:
    a_fanned_out_request_spends_at_most_its_token_limit,
    without_limits_the_tree_runs_and_nothing_is_recorded,
    a_message_limit_holds_across_a_restart,
    the_settlement_of_a_requests_last_call_is_stored,
    a_limited_turns_input_and_reservation_are_stored_before_its_call,
    a_shutdown_waits_for_the_settlement_left_behind,
    open_tasks_of_a_stopped_request_fail_at_once,
    a_cost_limit_binds_with_the_price_table,
    a_call_kept_out_by_an_open_reservation_waits_for_it,
    a_claim_to_tell_left_by_a_crash_is_told_again,
    period_limits_roll_with_the_clock,
    an_agents_own_period_limits_bind_it_alone,
    period_limits_set_at_run_time_hold_across_a_restart,
    an_operator_raises_a_request_limit_and_resumes_it,
);

/// Governance as a property, in memory: random trees, parallel workers, steering, limits.
#[test]
fn governance_random_trees_never_overspend_and_always_end() {
    scenarios::governance_props::random_trees_never_overspend_and_always_end();
}

on_every_backend!(context:
    a_small_window_is_never_overflowed,
    compaction_keeps_tool_calls_with_their_results,
    without_compaction_older_history_is_left_out,
    a_summary_survives_a_restart,
    an_oversized_message_fails_only_against_a_known_window,
    records_appended_between_turns_are_all_sent,
);

/// Deferred syncing on SQLite (the default): what the application is answered for is on the disk
/// when the call returns; the runtime's own writes of the exchange that follows wait for the next
/// such write.
mod deferred_sync {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use crate::scenarios::junctions::{CHIEF_AND_LEAD, chain_model};
    use spacebot::limits::Limits;
    use spacebot::sqlite::{SqliteOptions, SqliteStores};
    use spacebot::testing::{FnLlm, OrgHarness};
    use spacebot::{AgentId, InboundMessage};

    /// Runs one delegation there and back on fresh SQLite stores whose deferred commits are never
    /// synced by the clock, under `limits`; answers the syncs counted at each model call, and
    /// the writer's counters before the delivery, when it returned, and at the end.
    async fn exchange(limits: Option<Limits>) -> (Vec<u64>, [spacebot::sqlite::WriteStats; 3]) {
        let sqlite = SqliteStores::temporary_with(
            SqliteOptions::new().sync_delay(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (watched, log) = (sqlite.clone(), seen.clone());
        let llm = Arc::new(FnLlm::new(move |req| {
            log.lock()
                .unwrap()
                .push(watched.instance_write_stats().syncs);
            Ok(chain_model(req))
        }));
        let mut h = OrgHarness::builder(CHIEF_AND_LEAD)
            .stores(sqlite.stores())
            .llm(llm)
            .build()
            .await;
        h.org.start_all().await.unwrap();
        let (chief, lead) = (
            AgentId::parse("chief").unwrap(),
            AgentId::parse("lead").unwrap(),
        );
        h.org.wait_idle(&chief).await.unwrap();
        h.org.wait_idle(&lead).await.unwrap();
        let before = sqlite.instance_write_stats();
        let mut message = InboundMessage::new("portal", "u1", "go");
        if let Some(limits) = limits {
            message = message.with_limits(limits);
        }
        h.org.deliver("chief", message).await.unwrap();
        let returned = sqlite.instance_write_stats();
        let mut reply = h.reply().await;
        while !reply.content.starts_with("FINAL") {
            reply = h.reply().await;
        }
        h.org.wait_idle(&chief).await.unwrap();
        h.org.wait_idle(&lead).await.unwrap();
        let end = sqlite.instance_write_stats();
        h.org.shutdown().await.unwrap();
        let calls = seen.lock().unwrap().clone();
        (calls, [before, returned, end])
    }

    /// With and without request limits (the reservations and settlements are the runtime's own
    /// writes too).
    #[tokio::test]
    async fn a_delivery_is_synced_before_it_returns_and_the_exchange_after_it_is_not() {
        let limits = Limits {
            model_calls: Some(10),
            ..Limits::NONE
        };
        for limits in [None, Some(limits)] {
            let limited = limits.is_some();
            let (calls, [before, returned, end]) = exchange(limits).await;
            assert!(
                returned.synced > before.commits,
                "limited {limited}: the delivery's commit was not synced when deliver returned: \
                 {before:?} -> {returned:?}"
            );
            assert_eq!(
                calls.len(),
                3,
                "limited {limited}: three model calls: {calls:?}"
            );
            // The delegation, the worker's turn, the result and the delegator's answer: many
            // commits, no sync of their own.
            assert!(
                end.commits - before.commits >= 10,
                "limited {limited}: {before:?} -> {end:?}"
            );
            // Whatever `deliver` wrote is synced before it returns (the delivery, and under
            // limits the request's limits); nothing after it is.
            assert_eq!(
                end.syncs, returned.syncs,
                "limited {limited}: {before:?} -> {returned:?} -> {end:?}"
            );
        }
    }
}
