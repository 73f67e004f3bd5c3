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
#[cfg(feature = "redis")]
mod server;
#[cfg(feature = "redis")]
pub(crate) mod stores;

#[cfg(feature = "redis")]
pub(crate) use server::{lock_value, LockValue, Observer, RedisServer};

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
