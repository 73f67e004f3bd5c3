//! Lock every resource a request touches, as one all-or-nothing batch, before the handler
//! runs.
//!
//! [`LockLayer`] reads lock keys out of each request with a [`KeyExtractor`] (path
//! parameters, a header, ids in a JSON body), acquires all of them in one step or none of
//! them, runs the inner service, and releases them when the response is ready or the
//! request is dropped. A request whose keys are held elsewhere gets `409 Conflict` (or
//! `423 Locked`) with a `Retry-After`, and never reaches the handler.
//!
//! ```
//! use axum::{body::Body, routing::put, Router};
//! use http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_batch_lock::{keys, Locks};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let locks = Locks::memory();
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
//! # Stores
//!
//! Each store is built one way; [`Locks::new`] takes it, and [`store`] says what each
//! promises:
//!
//! - [`Locks::memory`] (what [`LockLayer::new`] uses too): one process; and
//!   [`store::Store::isolated_memory`], a store of its own, for tests.
//! - [`store::Redis`] (feature `redis`, on by default): every process that shares a Redis.
//! - [`store::Redlock`] (feature `redis`): every process that shares a majority of several
//!   independent Redis masters, so that the locks outlive any minority of them.
//! - `store::RedisCluster` (feature `cluster`): every process that shares a Redis
//!   Cluster, each batch spread over the masters that serve its keys.
//!
//! # Responses
//!
//! | situation | status |
//! | --- | --- |
//! | all keys acquired | the inner service's |
//! | a key is held by another request | 409 ([`Locks::contention_status`]), `Retry-After` |
//! | the store is unreachable or slow ([`Locks::store_timeout`]) | 503, `Retry-After` |
//! | the extractor refuses the request | its own 4xx (see [`keys::json`]) |
//! | more keys than [`Locks::max_keys`] | 413 |
//! | an empty key, or one longer than [`Locks::max_key_len`] | 400 |
//! | the lease is lost while the handler runs, with [`OnLostLease::Cancel`] | 503 |
//!
//! Every refusal is an `application/problem+json` document ([`Rejection`]).
//!
//! # Waiting, leases and fencing
//!
//! - [`Locks::wait`] / [`LockLayer::wait`]: wait up to a bound for busy keys ([`Wait`]),
//!   woken by their release instead of polling, and served in order of arrival: a waiter
//!   reserves its batch against later requests, so that a batch of thousands of keys is not
//!   starved by a stream of small ones ([`Wait::fair`]).
//! - [`Lease`]: the handler's view of its locks, taken like any axum extractor
//!   (`lease: Lease`, or `Option<Lease>` where a request may name no keys).
//! - [`Locks::renew_lease`]: extend the lease while the handler runs; the handler's
//!   [`Lease`] reports a lost lease ([`Lease::lost`]), and [`Locks::on_lost_lease`] can
//!   cancel the handler.
//! - [`Lease::fencing_token`]: a [`FencingToken`] that grows with every grant, for
//!   resources that must refuse a stale holder's writes.
//! - [`Locks::hold_until_body_end`]: keep the keys until a streaming body has been sent.
//!
//! # Idempotent requests
//!
//! [`Locks::idempotency`] (feature `idempotency`, on by default) is a layer that stores the
//! first answer to each `Idempotency-Key` header on the same store as the locks, and
//! replays it to retries on any process, so that a retried `POST` never runs twice; see
//! [`idempotency::Idempotency`].
//!
//! # Dependencies
//!
//! With the `redis` feature, the crate re-exports the two crates whose types its API takes
//! and returns, [`redis`] and [`deadpool_redis`]: build a pool for [`store::Redis::pool`] with
//! `tower_batch_lock::deadpool_redis`, and name [`redis::RedisError`] through
//! `tower_batch_lock::redis`, and the versions always match this crate's.
//!
//! # Re-entrant locks
//!
//! A request has one owner, shared by every layer on it: keys an outer layer holds are
//! entered again by an inner one instead of contended, and freed with their last hold. The
//! handler can lock more keys for the same owner with [`Lease::lock`] ([`HeldKeys`]), and a
//! trusted downstream service can re-enter them ([`Locks::trust_owner_header`]).

mod acquire;
#[cfg(feature = "admin")]
pub mod admin;
mod backoff;
mod guard;
#[cfg(feature = "idempotency")]
pub mod idempotency;
mod inspect;
pub mod keys;
mod lease;
mod locks;
mod middleware;
mod observe;
mod outage;
mod owner;
mod registry;
mod rejection;
mod request;
mod retry_after;
pub mod store;
mod wait;

/// The pool crate of [`store::Redis::pool`], at the version this crate is built with: a
/// pool made with `tower_batch_lock::deadpool_redis::Config` is always the `Pool` it takes.
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
pub use store::contract::{FencingToken, KeyStatus};
pub use wait::Wait;

// The README's examples compile as doctests, so its quickstart stays true; with the
// features they use, as the README's test command (`--all-features`) builds them.
#[cfg(all(doctest, feature = "cluster", feature = "idempotency"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
