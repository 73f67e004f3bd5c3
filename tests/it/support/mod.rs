//! What the test modules share: driving a router and reading its answers ([`http`]),
//! handlers that report what they saw ([`handlers`]), the crate's logs ([`logs`]),
//! reproducible randomness ([`Rng`]), and, with the `redis` feature, real `redis-server`
//! processes and a view of them from outside the crate ([`RedisServer`], [`Observer`]).
//!
//! The benches include this module too, and use a small part of it.

#[cfg(feature = "cluster")]
pub(crate) mod cluster;
pub(crate) mod handlers;
pub(crate) mod http;
pub(crate) mod logs;
#[cfg(feature = "postgres")]
pub(crate) mod pg_server;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) mod proxy;
#[cfg(feature = "redis")]
mod server;
#[cfg(feature = "redis")]
pub(crate) mod stores;

#[cfg(feature = "redis")]
pub(crate) use server::{lock_value, LockValue, Observer, RedisServer, CLAIMS};

/// The least fencing token a counter floored by this machine's clock gives now: its
/// milliseconds since 2025-01-01T00:00:00Z, times 1024. The stores floor their counters so
/// (Redis and PostgreSQL by their own clocks, here the same machine's), and tests compare
/// tokens with it.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn clock_floor() -> u64 {
    let since_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    (u64::try_from(since_unix.as_millis()).unwrap() - 1_735_689_600_000) * 1024
}

/// xorshift64: reproducible key sets without a dependency.
#[cfg(feature = "redis")]
pub(crate) struct Rng(u64);

#[cfg(feature = "redis")]
impl Rng {
    pub(crate) fn seeded(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}
