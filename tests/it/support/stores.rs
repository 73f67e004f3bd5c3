//! One lock store seen by two processes: two `Locks` handles on memory, one real Redis, or
//! Redlock over three real masters, with the servers behind it to look at from outside.

use std::time::Duration;

use tower_batch_lock::{store, Locks};

use super::{Observer, RedisServer};

pub(crate) struct Store {
    pub(crate) name: &'static str,
    /// Two handles on the store: two processes (the memory store is one process's only).
    pub(crate) locks: [Locks; 2],
    /// The Redis servers behind it (none for memory).
    pub(crate) servers: Vec<RedisServer>,
}

impl Store {
    pub(crate) fn memory() -> Self {
        let locks = listing(Locks::new(store::Store::isolated_memory()));
        Self {
            name: "memory",
            locks: [locks.clone(), locks],
            servers: Vec::new(),
        }
    }

    pub(crate) fn redis() -> Self {
        let server = RedisServer::start();
        let handle = || {
            listing(Locks::new(
                store::Redis::url(server.url())
                    .build()
                    .expect("a valid URL"),
            ))
        };
        Self {
            name: "redis",
            locks: [handle(), handle()],
            servers: vec![server],
        }
    }

    pub(crate) fn redlock() -> Self {
        let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
        let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
        // A generous node timeout: the masters share two cores with the whole suite, and a
        // master's first connection under that load took more than 500 ms once (a waiter
        // then got 503 instead of its place in line). No test here fails a master.
        let handle = || {
            let store = store::Redlock::new(&urls)
                .node_timeout(Duration::from_millis(1500))
                .build()
                .expect("valid URLs");
            listing(Locks::new(store))
        };
        Self {
            name: "redlock",
            locks: [handle(), handle()],
            servers,
        }
    }

    pub(crate) fn all() -> [Self; 3] {
        [Self::memory(), Self::redis(), Self::redlock()]
    }

    /// The servers, looked at from outside the crate.
    pub(crate) fn observers(&self) -> Vec<Observer> {
        self.servers.iter().map(Observer::of).collect()
    }
}

/// `locks`, listing its held batches from the start (the first look starts the list), for
/// the checks that none is left.
fn listing(locks: Locks) -> Locks {
    assert!(locks.held_batches().is_empty());
    locks
}
