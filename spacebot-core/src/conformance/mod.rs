//! The storage conformance suite.
//!
//! One public async function per behaviour of each store trait's "# Contract", over `&dyn` stores:
//! [`link_store_create_get_delete`], [`task_store_claim_order`],
//! [`task_store_outbox_written_with_terminal_transition`], ... Every backend runs all of them
//! against itself, so every backend agrees with the contract and with the others.
//!
//! Each function first checks that the store holds nothing for the agents, keys and ids it uses,
//! so hand each one a **fresh, empty store**. A function returns `Ok(())` when the store behaved,
//! or a [`ConformanceError`] that names the check, what was expected, what was found, and where in
//! the suite the check is.
//!
//! # Running the suite against a backend
//!
//! One macro per store trait generates one `#[tokio::test]` per suite function, given an
//! expression that evaluates to a future of a fresh store (it is evaluated once per test):
//!
//! ```ignore
//! // In the backend crate's tests/conformance.rs
//! spacebot_core::link_store_conformance!(async { MyLinkStore::open_in_memory().await.unwrap() });
//! spacebot_core::task_store_conformance!(async {
//!     let dir = tempfile::tempdir().unwrap();
//!     MyTaskStore::open(dir.keep()).await.unwrap()
//! });
//! // Or every store at once, from a fresh `Stores` bundle:
//! spacebot_core::all_store_conformance!(async { my_backend::open_stores().await.unwrap() });
//! ```
//!
//! The macros are [`link_store_conformance!`](crate::link_store_conformance),
//! [`task_store_conformance!`](crate::task_store_conformance),
//! [`channel_store_conformance!`](crate::channel_store_conformance),
//! [`delivery_store_conformance!`](crate::delivery_store_conformance),
//! [`conversation_store_conformance!`](crate::conversation_store_conformance),
//! [`record_store_conformance!`](crate::record_store_conformance) and
//! [`all_store_conformance!`](crate::all_store_conformance). Each generates a module (named after
//! the macro, or the name given as a first argument: `task_store_conformance!(on_disk, async {..})`)
//! that imports everything from the calling module, so the constructor may use the caller's items.
//!
//! The calling crate needs, as dev-dependencies, `spacebot-core` with the `conformance` feature and
//! `tokio` with the `macros` and `rt-multi-thread` features. The tests run on a multi-threaded
//! runtime.
//!
//! A durable [`RecordStore`](crate::RecordStore) also runs [`record_store_survives_reopen`]
//! (records, versions and effect keys kept across a reopen), which the macros cannot generate: it
//! needs a way to open the same store again.
//!
//! The [`Placement`](crate::Placement) of an organization spread over several processes has its
//! own checks (`placement_*`), run with [`placement_conformance!`](crate::placement_conformance).
//!
//! # Concurrency checks
//!
//! Checks such as [`task_store_concurrent_claims`] issue many operations at once as futures
//! polled together ([`futures::future::join_all`]); a backend whose async methods hand their work
//! to other threads (sqlx's SQLite driver, `spawn_blocking`) then runs them truly in parallel. A
//! backend that blocks inside `poll` serializes them and so is not raced by these checks; do not
//! block inside async methods.

mod channel;
mod conversation;
mod delivery;
mod link;
mod placement;
mod records;
mod support;
mod task;

pub use channel::*;
pub use conversation::*;
pub use delivery::*;
pub use link::*;
pub use placement::*;
pub use records::*;
pub use support::ConformanceError;
pub use task::*;

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_module {
    ($module:ident, $make:expr, |$s:ident| $access:expr, [$($test:ident),* $(,)?]) => {
        #[allow(unused_imports)]
        mod $module {
            use super::*;
            $(
                #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() -> ::std::result::Result<(), $crate::conformance::ConformanceError> {
                    let $s = $make.await;
                    $crate::conformance::$test($access).await
                }
            )*
        }
    };
}

/// Generates one `#[tokio::test]` per [`LinkStore`](crate::LinkStore) conformance function, given
/// an expression evaluating to a future of a fresh store. See the [module docs](crate::conformance).
///
/// The calling crate needs `tokio` (features `macros`, `rt-multi-thread`) as a dev-dependency.
#[macro_export]
macro_rules! link_store_conformance {
    ($module:ident, $make:expr) => {
        $crate::__link_store_tests!($module, $make, |store| &store);
    };
    ($make:expr) => {
        $crate::link_store_conformance!(link_store_conformance, $make);
    };
}

/// Generates one `#[tokio::test]` per [`TaskStore`](crate::TaskStore) conformance function, given
/// an expression evaluating to a future of a fresh store. See the [module docs](crate::conformance).
///
/// The calling crate needs `tokio` (features `macros`, `rt-multi-thread`) as a dev-dependency.
#[macro_export]
macro_rules! task_store_conformance {
    ($module:ident, $make:expr) => {
        $crate::__task_store_tests!($module, $make, |store| &store);
    };
    ($make:expr) => {
        $crate::task_store_conformance!(task_store_conformance, $make);
    };
}

/// Generates one `#[tokio::test]` per [`ChannelStore`](crate::ChannelStore) conformance function,
/// given an expression evaluating to a future of a fresh store. See the
/// [module docs](crate::conformance).
///
/// The calling crate needs `tokio` (features `macros`, `rt-multi-thread`) as a dev-dependency.
#[macro_export]
macro_rules! channel_store_conformance {
    ($module:ident, $make:expr) => {
        $crate::__channel_store_tests!($module, $make, |store| &store);
    };
    ($make:expr) => {
        $crate::channel_store_conformance!(channel_store_conformance, $make);
    };
}

/// Generates one `#[tokio::test]` per [`DeliveryStore`](crate::DeliveryStore) conformance
/// function, given an expression evaluating to a future of a fresh store. See the
/// [module docs](crate::conformance).
///
/// The calling crate needs `tokio` (features `macros`, `rt-multi-thread`) as a dev-dependency.
#[macro_export]
macro_rules! delivery_store_conformance {
    ($module:ident, $make:expr) => {
        $crate::__delivery_store_tests!($module, $make, |store| &store);
    };
    ($make:expr) => {
        $crate::delivery_store_conformance!(delivery_store_conformance, $make);
    };
}

/// Generates one `#[tokio::test]` per [`ConversationStore`](crate::ConversationStore) conformance
/// function, given an expression evaluating to a future of a fresh store. See the
/// [module docs](crate::conformance).
///
/// The calling crate needs `tokio` (features `macros`, `rt-multi-thread`) as a dev-dependency.
#[macro_export]
macro_rules! conversation_store_conformance {
    ($module:ident, $make:expr) => {
        $crate::__conversation_store_tests!($module, $make, |store| &store);
    };
    ($make:expr) => {
        $crate::conversation_store_conformance!(conversation_store_conformance, $make);
    };
}

/// Generates one `#[tokio::test]` per [`RecordStore`](crate::RecordStore) conformance function,
/// given an expression evaluating to a future of a fresh store. See the
/// [module docs](crate::conformance).
///
/// The calling crate needs `tokio` (features `macros`, `rt-multi-thread`) as a dev-dependency.
#[macro_export]
macro_rules! record_store_conformance {
    ($module:ident, $make:expr) => {
        $crate::__record_store_tests!($module, $make, |store| &store);
    };
    ($make:expr) => {
        $crate::record_store_conformance!(record_store_conformance, $make);
    };
}

/// Generates the whole suite (every store's tests, one `#[tokio::test]` each) given an expression
/// evaluating to a future of a fresh [`Stores`](crate::Stores) bundle, built anew for every test.
/// It includes the checks that need two stores of the bundle at once (`stores_*`, such as
/// [`stores_commit_appends_records_in_order`](crate::conformance::stores_commit_appends_records_in_order):
/// a delivery store's commit writes to the bundle's channel store). See the
/// [module docs](crate::conformance).
///
/// The calling crate needs `tokio` (features `macros`, `rt-multi-thread`) as a dev-dependency.
#[macro_export]
macro_rules! all_store_conformance {
    ($module:ident, $make:expr) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $crate::__link_store_tests!(links, $make, |stores| &*stores.links);
            $crate::__task_store_tests!(tasks, $make, |stores| &*stores.tasks);
            $crate::__channel_store_tests!(channels, $make, |stores| &*stores.channels);
            $crate::__delivery_store_tests!(deliveries, $make, |stores| &*stores.deliveries);
            $crate::__conversation_store_tests!(conversations, $make, |stores| &*stores
                .conversations);
            $crate::__record_store_tests!(records, $make, |stores| &*stores.records);
            $crate::__turn_commit_tests!(commits, $make, |stores| &stores);
        }
    };
    ($make:expr) => {
        $crate::all_store_conformance!(all_store_conformance, $make);
    };
}
