//! The integration tests: one binary, a module per subject, linked once. `support` is what
//! the modules share; `orders_app` is the `orders` example, which `orders` and `malformed`
//! drive. Modules that need Redis (or another feature) are compiled with it only.
//!
//! The statement of the semantics every store keeps is `spec`: a reference model, and
//! random sequences of operations that each store must answer as the model does.
//!
//! Which tests prove the properties of DESIGN.md (`mod::test`, `*` for several):
//!
//! 1. **No overlap**: `redis::intersecting_batches_never_overlap_across_processes`,
//!    `redlock::overlapping_batches_never_run_together_*`,
//!    `cluster::overlapping_batches_never_run_together_across_two_processes`,
//!    `orders::*_racing_orders_*_never_oversell` (beside controls that lose updates),
//!    `wire::*` (under latency, a stall, lost replies and resets between service and Redis);
//!    for readers and writers, `shared::*` (on every store: readers overlap, a writer
//!    overlaps nobody, mixed batches all or nothing),
//!    `redis::shared_holds_and_the_previous_versions_locks_keep_each_other_out` (a rolling
//!    upgrade, both ways), `orders::*_quotes_and_orders_*_take_turns*` (beside a control
//!    whose quotes read under a working order) and
//!    `orders::*_quotes_of_the_same_skus_run_together*`.
//! 2. **All or nothing**: `redis::a_big_batch_with_one_held_key_is_refused_and_writes_nothing`,
//!    `redis::a_frozen_server_*`, `redis::an_acquisition_stalled_on_the_server_*`,
//!    `redis::an_acquisition_sent_just_before_the_server_froze_*`,
//!    `redlock::after_a_failed_quorum_no_master_keeps_any_key_of_the_batch`,
//!    `redlock::an_acquisition_slower_than_its_validity_fails_and_rolls_back`,
//!    `cluster::a_refused_batch_leaves_nothing_on_any_master`,
//!    `reentrant::a_handler_locks_more_keys_all_or_nothing_*`,
//!    `waiting::a_waiting_request_holds_none_of_its_batch`.
//! 3. **Owner only**: `redis::a_late_release_never_deletes_the_next_owners_key`,
//!    `redis::a_foreign_value_under_a_lock_key_is_never_released`,
//!    `operator::redis::redis_foreign_values_show_and_stay`,
//!    `reentrant::a_forged_or_malformed_owner_header_never_reenters`,
//!    `reentrant::a_propagated_owner_reenters_downstream_only_from_a_trusted_caller`.
//! 4. **Cancellation**: `layer::dropping_the_response_future_releases_the_keys`,
//!    `redis::a_dropped_request_future_releases_its_keys_within_milliseconds`,
//!    `redis::a_client_that_hangs_up_over_tcp_releases_its_keys`,
//!    `redlock::a_dropped_request_releases_its_keys_on_every_master_within_milliseconds`,
//!    `waiting::a_client_that_drops_a_held_body_midway_releases_its_keys_promptly`,
//!    `fairness::a_waiter_that_gives_up_or_is_dropped_withdraws_its_reservations_at_once`.
//! 5. **Crash liveness**: `redis::a_killed_process_blocks_others_only_until_the_ttl`,
//!    `redis::a_leaked_holder_blocks_others_only_until_the_ttl`,
//!    `idempotency::a_killed_processs_key_is_free_again_after_its_ttl`; a killed reader
//!    beside a living one: `shared::*` (`a_killed_reader_takes_only_its_own_hold`).
//! 6. **Lease**: `waiting::a_renewed_lease_outlives_its_ttl_and_never_its_release`,
//!    `waiting::a_lost_lease_*`, `defaults::a_handler_slower_than_the_ttl_keeps_its_keys_*`,
//!    `defaults::renewal_ends_at_max_hold`,
//!    `redlock::the_lease_expires_at_the_validity_deadline_before_any_master_lets_go`,
//!    `redlock::a_master_kept_out_for_a_ttl_before_rejoining_keeps_exclusion`,
//!    `cluster::a_lease_on_every_master_renews_and_an_operator_sees_and_frees_it`.
//! 7. **Fencing**: `postgres::a_server_killed_under_load_*` (the sequence across a crash),
//!    `postgres::fencing_tokens_keep_growing_across_a_failover_*` (a promoted replica),
//!    `waiting::fencing_tokens_strictly_increase_per_key_*` (across processes,
//!    in memory), `redlock::fencing_tokens_increase_across_grants_even_when_*` (masters'
//!    counters apart, then all lost), `fencing::*` (one Redis restarted without its data,
//!    every Redlock master restarted empty, a cluster's counter failed over to a replica
//!    that missed counts, a memory store made anew), and the token order in
//!    `redlock::overlapping_*` and `cluster::*` under load and resharding.
//! 8. **Quorum**: `redlock::a_minority_killed_keeps_granting_and_a_majority_killed_*`,
//!    `redlock::a_frozen_master_*`, `redlock::a_frozen_majority_*`,
//!    `redlock::masters_restarted_empty_lose_a_lock_only_once_they_are_a_majority`,
//!    `defaults::check_needs_a_majority_of_the_redlock_masters`.
//! 9. **Clear errors**: `malformed::*`, `fuzz::*` (and the `fuzz` unit tests of
//!    `src/keys`), `layer::key_limits_are_4xx_naming_the_limit`,
//!    `layer::the_json_extractor_refuses_bad_bodies_with_problems`, `extractors::*`,
//!    `layer::requests_without_keys_are_refused_unless_the_route_lets_them_pass_unlocked`,
//!    `redis::a_store_outage_is_logged_once_not_once_per_request`.
//!
//! `examples::*` runs each small example on the store it is for. PostgreSQL runs the spec,
//! `fairness::*` and `idempotency::*` (over `Store::all()`), `shared::shared_holds_on_postgres`
//! and `postgres::*` (a refused batch writes nothing, wake-ups by `NOTIFY`, the schema and
//! its version, dead rows swept, a server killed under load).
//! 10. **Fairness**: `fairness::*`,
//!     `idempotency::a_request_with_a_key_does_not_jump_the_line_of_an_earlier_waiter`,
//!     `cluster::a_waiter_keeps_its_place_on_the_masters_that_granted_part_of_its_batch`;
//!     a writer behind a stream of readers, and upgrades that never wait: `shared::*`,
//!     `orders::*_quotes_and_orders_*_take_turns*` (quotes sent while an order waits for
//!     earlier quotes go after it); a place in line that outlives its holder:
//!     `fairness::a_holders_process_killed_leaves_its_waiters_place_in_line`; an owner
//!     passes only what it holds: `fairness::an_owner_with_a_held_key_is_kept_out_of_another_by_an_earlier_waiter`;
//!     Redlock's rollback keeps the place:
//!     `redlock::a_waiter_refused_by_a_majority_keeps_its_place_on_the_master_that_granted`.
//! 11. **Nothing stuck**: `fairness::a_killed_waiters_reservations_last_to_its_deadline`
//!     (reservations), `idempotency::a_killed_processs_key_is_free_again_after_its_ttl`
//!     (in-flight markers), `redis::a_killed_process_blocks_others_only_until_the_ttl`.
//! 12. **Bounded stall**: `redis::a_big_batch_goes_in_steps_all_or_nothing_and_keeps_its_place_in_line`
//!     (one Redis, steps of 100 keys: no call carries more, a refusal at a later step leaves
//!     nothing, a waiter reserves its whole batch), and the step count of
//!     `cluster::a_batch_of_3000_keys_is_spread_over_every_master_and_released_from_all`.
//! 13. **Contention**: `waiting::script_calls_per_grant_do_not_grow_with_the_waiters` (a
//!     release wakes the first in line), `waiting::a_woken_waiter_probes_what_blocked_it_not_its_whole_batch`,
//!     `redis::a_probe_stops_at_the_first_key_in_the_way_wherever_it_is`,
//!     `redlock::a_granted_waiters_place_is_withdrawn_only_where_a_master_refused`,
//!     `waiting::beyond_max_waiters_a_request_is_refused_at_once_with_503`; the figures per
//!     store and load: the bench's `contention` section.
//! 14. **Guarded writes** (a holder past its lease cannot overwrite the next holder's write
//!     where the data is guarded): `orders::binary::a_stopped_holder_cannot_overwrite_the_next_sale_on_*`
//!     (one Redis, Redlock, PostgreSQL: a process stopped with `SIGSTOP` past its lease),
//!     `fenced::*`.

mod support;

/// The `orders` example (its router, its store), which `orders` and `malformed` drive.
#[allow(dead_code, unreachable_pub)] // its `main` and what only `main` calls; `pub` items
#[path = "../../examples/orders.rs"]
mod orders_app;

#[cfg(feature = "cluster")]
mod cluster;
#[cfg(feature = "redis")]
mod defaults;
// The examples share the memory example's routes, each by including it.
#[allow(clippy::duplicate_mod)]
mod examples;
mod extractors;
#[cfg(feature = "redis")]
mod fairness;
#[cfg(feature = "redis")]
mod fenced;
#[cfg(feature = "redis")]
mod fencing;
mod fuzz;
#[cfg(all(feature = "idempotency", feature = "redis"))]
mod idempotency;
mod layer;
mod lease;
mod malformed;
#[cfg(all(feature = "redis", feature = "metrics"))]
mod metrics;
mod operator;
mod orders;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
mod redlock;
#[cfg(feature = "redis")]
mod reentrant;
#[cfg(feature = "redis")]
mod replicas;
mod routing;
mod settings;
#[cfg(feature = "cluster")]
mod shared;
mod snippets;
#[cfg(feature = "redis")]
mod spec;
mod tracing;
#[cfg(feature = "redis")]
mod waiting;
#[cfg(feature = "redis")]
mod wire;
