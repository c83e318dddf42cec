//! The junction scenarios on the in-memory stores (the facade runs them on every backend).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

extern crate spacebot_core as spacebot;

#[path = "../../tests/scenarios/junctions.rs"]
mod junctions;

use spacebot_core::Stores;

macro_rules! memory {
    ($($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            junctions::$name(Stores::memory()).await;
        }
    )*};
}

memory!(
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
);
