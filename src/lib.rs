//! Lock every resource a request touches, as one all-or-nothing batch, before the handler
//! runs.
//!
//! [`LockLayer`] reads lock keys out of each request with a [`KeyExtractor`] (path
//! parameters, a header, ids in a JSON body), acquires all of them in one step or none of
//! them, runs the inner service, and releases them when the response is ready or the
//! request is dropped (with an idempotency layer inside, which finishes a request whose
//! client left, when that run ends). A request whose keys are held elsewhere gets `409 Conflict` (or
//! `423 Locked`) with a `Retry-After`, and never reaches the handler.
//!
//! ```
//! use std::time::Duration;
//! use axum::{body::Body, routing::put, Router};
//! use axum::http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_batch_lock::{keys, Locks, Wait};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // One process: the in-memory store. Busy keys are waited for, up to 250 ms.
//! let locks = Locks::memory().wait(Wait::up_to(Duration::from_millis(250)));
//! let app = Router::new().route(
//!     "/orders/{id}",
//!     put(|| async { "updated" }).layer(locks.layer(keys::path("order"))),
//! );
//!
//! let response = app
//!     .oneshot(Request::put("/orders/42").body(Body::empty()).unwrap())
//!     .await
//!     .unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! # }
//! ```
//!
//! This page is the guide; each section links to the item that says the rest.
//!
//! # Stores
//!
//! Each store is built one way; [`Locks::new`] takes it, and [`store`] says what each
//! promises and assumes:
//!
//! - [`Locks::memory`] (what [`LockLayer::new`] uses too): one process; and
//!   [`store::Store::isolated_memory`], a store of its own, for tests.
//! - [`store::Redis`] (feature `redis`, on by default): every process that shares a Redis.
//! - [`store::Redlock`] (feature `redis`): every process that shares a majority of several
//!   independent Redis masters, so that the locks outlive any minority of them.
//! - `store::RedisCluster` (feature `cluster`): every process that shares a Redis
//!   Cluster, each batch spread over the masters that serve its keys.
//! - `store::Postgres` (feature `postgres`): every process that shares a PostgreSQL
//!   database, with no Redis at all.
//!
//! [`Locks::check`] tells whether the store can serve locks: call it in `main` before
//! serving, and from a readiness probe.
//!
//! # Keys
//!
//! A [`KeyExtractor`] reads the keys of each request, each naming one resource with its
//! kind in front (`order:42`, `sku:ab-12`): [`keys::path`], [`keys::header`],
//! [`keys::query`], [`keys::json`] for ids in a JSON body, [`keys::from_parts`] and
//! [`keys::from_request`] for any axum extractor, [`keys::all`] to combine them, or a
//! closure over the request head. The layer puts its namespace in front
//! ([`Locks::prefix`], `lock:` by default), removes duplicates, sorts them, and enforces
//! [`Locks::max_keys`] and [`Locks::max_key_len`]. The [`keys`] module has the details.
//!
//! # Shared holds
//!
//! A key is held exclusively unless marked shared. Reads that must see a consistent set of
//! resources (a quote, an availability check or a report over 3,000 SKUs) hold them
//! **shared**: any number of shared holds on a key together, no exclusive one meanwhile. A
//! route whose keys are all read says so once, with [`LockLayer::shared`]; an extractor
//! marks single keys with [`keys::Key::shared`] (a purchase order writes its SKUs and
//! reads the price list). A batch that mixes modes is still all or nothing.
//!
//! ```
//! use axum::{routing::post, Router};
//! use serde::Deserialize;
//! use tower_batch_lock::{keys::{self, Key}, Locks};
//!
//! #[derive(Deserialize)]
//! struct Order { skus: Vec<String> }
//!
//! let locks = Locks::memory();
//! let sku_keys = |order: Order| order.skus.into_iter().map(|sku| format!("sku:{sku}"));
//! let app: Router = Router::new()
//!     // Quotes read the SKUs together; orders write them, one at a time.
//!     .route("/quotes", post(|| async {}).layer(locks.layer(keys::json(sku_keys)).shared()))
//!     .route(
//!         "/orders",
//!         post(|| async {}).layer(locks.layer(keys::json(move |order: Order| {
//!             sku_keys(order)
//!                 .map(Key::from)
//!                 .chain([Key::shared("price-list")])
//!         }))),
//!     );
//! ```
//!
//! - **Fairness between modes.** With [`Locks::wait`], a waiter's reservations keep every
//!   later request out, readers included: a writer behind a stream of readers is granted
//!   once the readers that were there before it end, and a reader behind a waiting writer
//!   queues after it.
//! - **Leases.** Each shared hold has its own TTL and renewal: renewing one extends only
//!   that hold, a key lives as long as its longest hold, and a reader that dies takes only
//!   its own hold with it, within its TTL.
//! - **Fencing.** Every grant, shared or exclusive, gets a [`FencingToken`] larger than all
//!   before it on its keys.
//! - **Re-entry and upgrades.** An owner is never kept out of its own keys: holding a key
//!   exclusively, it takes it shared freely; holding it shared, it takes it exclusively
//!   only while no one else holds it, and is refused at once otherwise (two readers
//!   waiting to upgrade would wait for each other). When the exclusive hold ends, the key
//!   is shared again, with the owner's shared holds. [`Mode`] says the rest.
//!
//! The operator's view shows a shared key as [`KeyStatus::Shared`] with its number of
//! holds, and the metrics carry a `mode` label.
//!
//! # What clients see
//!
//! | situation | status | body and headers |
//! | --- | --- | --- |
//! | every key acquired | the handler's | a [`Lease`] is in the request's extensions |
//! | a path no route matches, under [`Router::layer`](axum::Router::layer) | the router's fallback's (404) | nothing locked ([where to put the layer](LockLayer#where-to-put-it)) |
//! | a method the route does not serve | 405 under a method router's `route_layer`; elsewhere the layer reads the keys first | ([where to put the layer](LockLayer#where-to-put-it)) |
//! | a key is held by another request in a mode that excludes this one's, or reserved by a waiter that came earlier (after [waiting](Locks::wait)), or an upgrade beside other readers | 409 ([`Locks::contention_status`] for 423) | names up to 20 conflicting keys ([`Locks::max_named_conflicts`]); `Retry-After` ([`Locks::retry_after`]) |
//! | the store is unreachable or slower than [`Locks::store_timeout`] (2 s) | 503 | no internal details (those are logged once per outage: an error when it starts, a summary every 10 s, a warning at the first answer 10 s after the last failure, so that a store failing only some calls logs one outage); `Retry-After: 1` |
//! | the request names no key | 400, `"limit": "no_keys"` | unless [`Locks::require_keys(false)`](Locks::require_keys) lets it pass unlocked |
//! | more than [`Locks::max_keys`] (10,000) distinct keys | 413, `"limit": "max_keys"` | |
//! | an empty key | 400, `"limit": "empty_key"` | |
//! | a key with a NUL character (U+0000), which PostgreSQL's `text` cannot hold: refused on every store | 400, `"limit": "nul_in_key"` | |
//! | a key over [`Locks::max_key_len`] (256 bytes) | 400, `"limit": "max_key_len"` | |
//! | the extractor refuses the request (no JSON content type, a body over its cap, a body that is not JSON or does not fit the type, a header that is not UTF-8) | 415 / 413 / 400 / 422 / 400 | the parser's message, naming the field (`items[2].sku: invalid type: ...`) |
//! | [`keys::path`] on a route without that parameter, or outside an axum router | 500 | one error logged, naming the route and its parameters |
//! | a handler takes [`Lease`], but the route has no lock layer or passed the request unlocked | 500 | an error logged (take `Option<Lease>` there) |
//! | the lease is lost while the handler runs, with [`OnLostLease::Cancel`] | 503 | the handler's future is dropped |
//!
//! Every refusal is an `application/problem+json` document
//! ([RFC 9457](https://www.rfc-editor.org/rfc/rfc9457)), a [`Rejection`], unless
//! [`Locks::refusal_response`] builds the layer's refusals itself.
//!
//! # Waiting and fairness
//!
//! By default a request whose keys are busy is refused at once. [`Locks::wait`] (or
//! [`LockLayer::wait`] for one route) lets it wait up to a bound, woken by the release of a
//! key it wants instead of polling, and served in order of arrival: a waiter reserves its
//! whole batch against later requests, so that a batch of thousands of keys is granted as
//! soon as the holds that were there before it end, however many small requests keep
//! coming. [`Wait`] explains reservations and their limits.
//!
//! # Released before the response
//!
//! A response is sent once its keys are released (or once its body has ended, with
//! [`Locks::hold_until_body_end`]): the release's round trip is on the response's path,
//! so that a client's next request never finds the keys of its previous one still held.
//! The cost: a store that stalls delays responses whose work is done, by up to
//! [`Locks::store_timeout`] in all (the handler's holds are released with the layer's, at
//! once); the release then goes on in the background, and the keys expire with their TTL
//! if it never lands.
//!
//! # Leases and fencing
//!
//! - [`Lease`]: the handler's view of its locks, taken like any axum extractor
//!   (`lease: Lease`, or `Option<Lease>` where a request may pass unlocked).
//! - [`Locks::renew_lease`] (on by default): the lease is extended every third of the TTL
//!   while the handler runs, up to [`Locks::max_hold`]; a lost lease is reported
//!   ([`Lease::lost`]), and [`Locks::on_lost_lease`] can cancel the handler.
//! - [`Lease::fencing_token`]: a [`FencingToken`] that grows with every grant sharing a key,
//!   for resources that must refuse a stale holder's writes.
//! - [`Locks::hold_until_body_end`]: keep the keys until a streaming body has been sent.
//!
//! # Safety: what a lease guarantees, and what your data must do
//!
//! While a lease is not lost, and the store keeps its data, no other request holds any of
//! its keys in a mode that excludes it. What a lease cannot do is stop its own holder:
//! a process that pauses longer than the TTL (a garbage-collection pause, a stopped VM, a
//! slow disk, a thread blocked by synchronous work) cannot renew, and does not learn that
//! it lost its keys until it looks again. Meanwhile the next request is granted them and
//! writes; the first resumes and writes over it. No lease-based lock prevents that alone:
//! a store that loses a lock (a failover, a restart without persistence) does the same.
//!
//! The story, as the `orders` example lived it before it guarded its writes: instance A
//! (a 400 ms TTL) is granted SKU `pz1` (stock 10) and reads it; A's process is stopped
//! for 1.5 s; B is granted the SKU and sells one (9); A resumes and writes what it
//! computed (9). Both orders answered 201, and the stock reads 9 where it must read 8.
//!
//! What closes it is where the data is written. Every grant on a key carries a
//! [fencing token](Lease::fencing_token) larger than every earlier grant's on that key;
//! data that keeps the last token that wrote it refuses a write with a smaller one. A's
//! write comes with A's token, older than B's: refused. The example now answers A 409
//! (nothing taken), B 201, and the stock reads 9: 10 less the orders answered 201.
//!
//! - **Data in Redis:** [`fenced::set`] writes keys with the lease's token, all or none,
//!   and refuses them when a later token wrote one (feature `redis`); on a Redis Cluster,
//!   `fenced::set_across_slots` does it for keys of many slots (feature `cluster`: each slot
//!   all or none, and the whole write too unless the lease runs out during it).
//! - **Data in the locks' PostgreSQL database** (`store::Postgres`, feature `postgres`):
//!   begin the transaction that writes with the schema's guard,
//!   `SELECT tower_batch_lock.locks_guard($1, $2)` with the keys and owner of
//!   `Lease::postgres_guard`. It fails the transaction (SQLSTATE `TBL01`) unless the
//!   request still holds its keys, and holds their rows until the commit, so that no later
//!   holder is granted them in between: a stale write cannot commit (`PostgresGuard` shows
//!   it with tokio-postgres and sqlx). The `orders` example does this with `DATABASE_URL`.
//! - **Data in another SQL database:** keep the token in a column and make it part of the
//!   write: `UPDATE stock SET qty = $1, fence = $2 WHERE sku = $3 AND fence <= $2`; no row
//!   updated means a later holder wrote: roll back and answer 409.
//! - **What you must do:** guard each piece of data with one lock key that every writer of
//!   it takes (`sku:{sku}` for the stock of `sku`): tokens compare only between grants
//!   that share a key. Carry the token of the request's lease into the write. Treat a
//!   refused write as a conflict, with nothing half done. [`Lease::lost`] tells a handler
//!   that its locks are gone, to stop early; it narrows the window, but only the guarded
//!   write closes it.
//!
//! # Re-entrant locks
//!
//! A request has one owner, shared by every layer on it: keys an outer layer holds are
//! entered again by an inner one instead of contended, and freed with their last hold. The
//! handler can lock more keys for the same owner with [`Lease::lock`] ([`HeldKeys`]), all or
//! nothing, and a trusted downstream service can re-enter them
//! ([`Locks::trust_owner_header`]).
//!
//! # Idempotent requests
//!
//! [`Locks::idempotency`] (feature `idempotency`, on by default) is a layer that stores the
//! first answer to each `Idempotency-Key` header on the same store as the locks, and
//! replays it to retries on any process, so that a retried `POST` never creates a second
//! order; see [`idempotency::Idempotency`] for what is stored and what is not, and why it
//! goes outside the lock layer: `post(create).layer(locks.layer(skus)).layer(locks.idempotency())`.
//!
//! # Metrics
//!
//! With the `metrics` feature (on by default) the layer records through the
//! [`metrics`](https://docs.rs/metrics) facade; the application installs the recorder it
//! exports with, and without one recording costs next to nothing. Install it before the
//! first request, as exporters' setups do: a layer registers each of its series with the
//! recorder once, on first use, and keeps the handle. Every metric carries a
//! `layer` label: [`Locks::metrics_label`], else the route the request matched
//! (`/orders/{id}`), else `unnamed`. Where readers and writers differ (acquisitions, their
//! time, waiting), a `mode` label says how the batch was held: `exclusive`, `shared`, or
//! `mixed` (some keys of each; see [`Mode`]). Label values are never keys: those are
//! unbounded, and may be secrets.
//!
//! | metric | kind | labels | what |
//! | --- | --- | --- | --- |
//! | `tower_batch_lock_acquisitions_total` | counter | `layer`, `mode`, `outcome` | one per request that reached the layer with keys or with input it refused: `granted`, `contended` (409/423), `unavailable` (503), `rejected` (bad input), `abandoned` (dropped before its answer: its client went away or a timeout around the layer fired, most often while it waited) |
//! | `tower_batch_lock_acquire_seconds` | histogram | `layer`, `mode`, `outcome` | from the keys being known to the grant or the refusal, waiting included |
//! | `tower_batch_lock_wait_seconds` | histogram | `layer`, `mode` | how long a request that waited did so |
//! | `tower_batch_lock_keys` | histogram | `layer` | keys per batch, after deduplication |
//! | `tower_batch_lock_hold_seconds` | histogram | `layer` | from the grant to the release |
//! | `tower_batch_lock_held_batches` | gauge | `layer` | batches this process holds now |
//! | `tower_batch_lock_waiting_requests` | gauge | `layer`, `mode` | requests of this process waiting now |
//! | `tower_batch_lock_lost_leases_total` | counter | `layer` | leases lost while held |
//! | `tower_batch_lock_release_failures_total` | counter | `layer`, `result` | releases that failed and were `retried`, or `gave_up` (the keys then expire with their TTL) |
//! | `tower_batch_lock_store_connections_total` | counter | | connections the Redis stores made for their shared use: one each at the start, then one for each that failed or stalled (a stall under load makes one, not one for each caller that gave up) |
//! | `tower_batch_lock_node_errors_total` | counter | `store`, `node` (`host:port`), `call` | a Redlock or cluster node that did not answer a call in time, or failed it |
//!
//! A handler's own [`Lease::lock`] acquisitions count only in the lost-lease and
//! release-failure metrics, as `unnamed`. With `metrics-exporter-prometheus`, the
//! histograms are exported as summaries unless you give them buckets; a `/metrics` route
//! on an admin port renders them (see `examples/metrics.rs`):
//!
//! ```
//! // Cargo.toml: metrics = "0.24", metrics-exporter-prometheus = "0.18"
//! use axum::{routing::get, Router};
//! use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let prometheus = PrometheusBuilder::new()
//!     // Seconds: from a fraction of a millisecond (memory) to the store timeout.
//!     .set_buckets_for_metric(
//!         Matcher::Suffix("_seconds".to_owned()),
//!         &[0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5],
//!     )?
//!     // Keys per batch: one key to purchase orders of thousands.
//!     .set_buckets_for_metric(
//!         Matcher::Full("tower_batch_lock_keys".to_owned()),
//!         &[1.0, 10.0, 100.0, 1_000.0, 3_000.0, 10_000.0],
//!     )?
//!     .build_recorder();
//! let handle = prometheus.handle();
//! metrics::set_global_recorder(prometheus)?;
//! let admin: Router = Router::new().route("/metrics", get(move || async move { handle.render() }));
//! # drop(admin);
//! # Ok(())
//! # }
//! ```
//!
//! # The operator's view
//!
//! [`Locks::inspect`] shows what the store holds for some keys (held or free, time left,
//! holds, waiters; never who holds them), [`Locks::held_batches`] the batches this process
//! holds (from its first call, or from `admin::router`, on: requests keep no list before
//! someone asks), and [`Locks::force_release`] frees a stuck lock; the `admin` feature
//! serves them as JSON routes for an admin port (`admin::router`).
//!
//! # Production checklist
//!
//! - **Choose the store** for how many processes share the locks, and what losing a Redis
//!   may cost ([`store`]); on Redis, `maxmemory-policy noeviction` on the locks' server.
//! - **Set the TTL above the slowest handler** ([`Locks::ttl`], 30 s by default), with
//!   renewal on (the default) and [`Locks::max_hold`] as the upper bound of a hung handler.
//! - **Wait where batches are large.** Purchase orders of thousands of keys among retail
//!   orders of a few: a wait of a few hundred milliseconds ([`Locks::wait`]) grants them in
//!   order; without it they bounce with 409 for as long as any one key is busy.
//! - **Bound the store's time** ([`Locks::store_timeout`]) below the clients' own timeout,
//!   and send [`Locks::check`] from the readiness probe.
//! - **Fence the resource.** A lease cannot stop a holder that stalls past it; pass
//!   [`Lease::fencing_token`] to the database and let it refuse smaller tokens.
//! - **Keep keys out of sight.** Keys are namespaced ([`Locks::prefix`]) and limited in
//!   number and length; set [`Locks::max_named_conflicts`] to 0 where clients must not learn
//!   which keys are busy.
//! - **Idempotency outside, locks inside** (the idempotency layer the later `.layer(..)`),
//!   for order APIs that clients retry.
//! - **Watch** `tower_batch_lock_acquisitions_total{outcome="unavailable"}`, lost leases and
//!   release failures; give the histograms buckets.
//!
//! # Dependencies
//!
//! With the `redis` feature, the crate re-exports the two crates whose types its API takes
//! and returns, [`redis`] and [`deadpool_redis`]: build a pool for [`store::Redis::pool`]
//! with `tower_batch_lock::deadpool_redis`, and name [`redis::RedisError`] through
//! `tower_batch_lock::redis`, and the versions always match this crate's. With the
//! `postgres` feature, it re-exports `deadpool_postgres` and `tokio_postgres` the same way.

// docs.rs (nightly) marks each item with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

// First: rustdoc lists `Locks`'s methods module by module in this order, and its page
// starts with how to make one (`memory`, `new`), not with `idempotency` or `inspect`.
mod locks;

mod acquire;
#[cfg(feature = "admin")]
pub mod admin;
mod backoff;
mod duration;
#[cfg(feature = "redis")]
pub mod fenced;
mod guard;
#[cfg(feature = "idempotency")]
pub mod idempotency;
mod inspect;
pub mod keys;
mod lease;
mod log_once;
mod middleware;
mod observe;
mod outage;
mod owner;
mod registry;
mod rejection;
mod request;
mod retry_after;
pub mod store;
mod unrouted;
mod wait;

/// The pool crate of [`store::Redis::pool`], at the version this crate is built with: a
/// pool made with `tower_batch_lock::deadpool_redis::Config` is always the `Pool` it takes.
/// The pool crate of `store::Postgres::pool`, at the version this crate is built with.
#[cfg(feature = "postgres")]
pub use deadpool_postgres;
#[cfg(feature = "redis")]
pub use deadpool_redis;
pub use inspect::KeyState;
pub use keys::extractor::KeyExtractor;
pub use lease::{HeldKeys, Lease};
pub use locks::{Locks, OnLostLease};
pub use middleware::{LockLayer, LockService, ResponseBody, ResponseFuture};
/// The Redis client crate, at the version this crate is built with: the
/// [`RedisError`](redis::RedisError) of the Redis stores' builders.
#[cfg(feature = "redis")]
pub use redis;
pub use registry::HeldBatch;
pub use rejection::Rejection;
pub use retry_after::RetryAfter;
pub use store::contract::{FencingToken, KeyStatus, Mode};
/// The PostgreSQL client crate, at the version this crate is built with: the error of
/// `store::Postgres`'s builder.
#[cfg(feature = "postgres")]
pub use tokio_postgres;
pub use wait::Wait;

// The README's examples compile as doctests, so its quickstart stays true; with the
// features they use, as the README's test command (`--all-features`) builds them.
#[cfg(all(doctest, feature = "cluster", feature = "idempotency"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
