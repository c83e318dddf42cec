//! The junction scenarios (`tests/scenarios/junctions.rs`) on every backend: in memory, SQLite and
//! redb, each in a fresh temporary directory.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod scenarios;

use scenarios::junctions;
use spacebot::Stores;

/// The backends every scenario runs on.
#[derive(Debug, Clone, Copy)]
enum Backend {
    Memory,
    Sqlite,
    #[cfg(feature = "redb")]
    Redb,
}

/// The stores of `backend`, and the directory that holds them (kept for the test's duration).
async fn open(backend: Backend) -> (Stores, Option<tempfile::TempDir>) {
    match backend {
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
    }
}

macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        mod memory {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let (stores, _dir) = super::open(super::Backend::Memory).await;
                super::junctions::$name(stores).await;
            }
        )*}
        mod sqlite {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let (stores, _dir) = super::open(super::Backend::Sqlite).await;
                super::junctions::$name(stores).await;
            }
        )*}
        #[cfg(feature = "redb")]
        mod redb {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let (stores, _dir) = super::open(super::Backend::Redb).await;
                super::junctions::$name(stores).await;
            }
        )*}
    };
}

on_every_backend!(
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
);
