//! Where locks live: in this process's memory, in one Redis, on several independent Redis
//! masters (Redlock), on a Redis Cluster, or in a PostgreSQL database.
//!
//! Each store is built one way, and [`Locks::new`](crate::Locks::new) takes it:
//!
//! | store | built with | for |
//! | --- | --- | --- |
//! | the process-wide memory store | [`Locks::memory`](crate::Locks::memory) | one process; what [`LockLayer::new`](crate::LockLayer::new) uses |
//! | a memory store of its own | [`Store::isolated_memory`] | tests that must not see each other's locks |
//! | one Redis | [`Redis`] (feature `redis`) | every process that shares a Redis |
//! | several independent masters | [`Redlock`] (feature `redis`) | locks that outlive the loss of any minority of the masters |
//! | a Redis Cluster | `RedisCluster` (feature `cluster`) | every process that shares a cluster, each batch spread over the masters of its keys |
//! | a PostgreSQL database | `Postgres` (feature `postgres`) | every process that shares a database, with no Redis |
//!
//! ```
//! use tower_batch_lock::{store::Store, Locks};
//!
//! let locks = Locks::new(Store::isolated_memory());
//! # drop(locks);
//! ```
//!
//! Every store has the same semantics (all or nothing, owner-only release, re-entry,
//! TTLs, fair waiting, fencing tokens); the builders' docs say what each adds or assumes.
//! Their executable statement is the repository's `tests/it/spec.rs`: a reference model,
//! and random sequences of operations from several owners whose every answer each store
//! must give as the model does.
//!
//! An acquisition whose answer is lost or late (a stalled store, a timeout, a request
//! dropped while its call was in flight) is released at once, and again until the store
//! answers (for at most a TTL); then again 0.25, 1.25 and 3.25 s later, since its command
//! may still be queued on a connection given up, and runs when its store runs again. A
//! grant of it that lands in those seconds is ended within them (about a second after it
//! landed, in `wire::a_grant_that_lands_after_its_release_*`). One that lands later still
//! (a packet delayed for longer) holds its keys for no one, unrenewed: **at most one
//! TTL**, on every store, and requests are refused them as if a crashed process held them.
//! A fair waiter's refused attempt whose answer never came is treated the same way: its
//! withdrawal is sent again on that schedule, so a place in line that lands after the
//! waiter left is ended within seconds (`wire::a_reservation_that_lands_after_*`), or at
//! the latest at the end of the waiter's wait.

/// The start of every name a store keeps for itself beside the locks (Redis's claims
/// registry and release channel): no lock prefix may reach it.
pub(crate) const OWN_NAMES: &str = "tower-batch-lock:";

pub(crate) mod call;
#[cfg(feature = "cluster")]
mod cluster;
pub(crate) mod contract;
pub(crate) mod error;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod failing;
#[cfg(feature = "redis")]
mod fanout;
pub(crate) mod handle;
pub(crate) mod late;
mod line;
pub(crate) mod memory;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod message;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
mod redlock;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod refusals;
pub(crate) mod wake;

#[cfg(feature = "cluster")]
pub use cluster::RedisCluster;
pub use error::StoreError;
pub use handle::Store;
#[cfg(feature = "postgres")]
pub use postgres::{builder::Postgres, guard::PostgresGuard};
#[cfg(feature = "redis")]
pub use redis::builder::Redis;
#[cfg(feature = "redis")]
pub use redlock::Redlock;
