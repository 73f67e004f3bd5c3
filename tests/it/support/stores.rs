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
    /// The database behind it, for PostgreSQL.
    #[cfg(feature = "postgres")]
    pub(crate) database: Option<super::postgres::Database>,
}

impl Store {
    pub(crate) fn memory() -> Self {
        let locks = listing(Locks::new(store::Store::isolated_memory()));
        Self {
            name: "memory",
            locks: [locks.clone(), locks],
            servers: Vec::new(),
            #[cfg(feature = "postgres")]
            database: None,
        }
    }

    pub(crate) fn redis() -> Self {
        let server = RedisServer::start();
        Self {
            name: "redis",
            locks: [redis_handle(&server), redis_handle(&server)],
            servers: vec![server],
            #[cfg(feature = "postgres")]
            database: None,
        }
    }

    pub(crate) fn redlock() -> Self {
        let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
        Self {
            name: "redlock",
            locks: [redlock_handle(&servers), redlock_handle(&servers)],
            servers,
            #[cfg(feature = "postgres")]
            database: None,
        }
    }

    /// PostgreSQL: a database of its own on the local server.
    #[cfg(feature = "postgres")]
    pub(crate) fn postgres() -> Self {
        let database = super::postgres::Database::create();
        Self {
            name: "postgres",
            locks: [postgres_handle(&database), postgres_handle(&database)],
            servers: Vec::new(),
            database: Some(database),
        }
    }

    /// Every store: memory, one Redis, Redlock, and PostgreSQL with its feature.
    pub(crate) fn all() -> Vec<Self> {
        let stores = vec![Self::memory(), Self::redis(), Self::redlock()];
        #[cfg(feature = "postgres")]
        let stores = stores.into_iter().chain([Self::postgres()]).collect();
        stores
    }

    /// The keys under `prefix` that the servers behind the store still keep (on Redis,
    /// every key but the fencing counter; in PostgreSQL, those with a live hold or
    /// reservation); none for memory.
    pub(crate) fn left_under(&self, prefix: &str) -> Vec<String> {
        #[allow(unused_mut)]
        let mut left: Vec<String> = self
            .observers()
            .iter()
            .flat_map(|o| o.under(prefix))
            .collect();
        #[cfg(feature = "postgres")]
        if let Some(database) = &self.database {
            left.extend(database.live_keys(prefix));
        }
        left
    }

    /// The tickets of the waiters that reserved `key`, in line order, on the first master
    /// or in the table (`None` for the memory store, which cannot be looked into).
    pub(crate) fn line(&self, key: &str) -> Option<Vec<u128>> {
        #[cfg(feature = "postgres")]
        if let Some(database) = &self.database {
            return Some(database.line(key));
        }
        let observer = self.observers().into_iter().next()?;
        Some(
            observer
                .lock(key)
                .map(|v| v.reservations)
                .unwrap_or_default(),
        )
    }

    /// How many waiters stand in line for `key`, on the first master or in the database: by
    /// a reservation, or by a claim (`None` for the memory store).
    pub(crate) fn in_line(&self, key: &str) -> Option<usize> {
        let reserved = self.line(key)?.len();
        #[cfg(feature = "postgres")]
        if let Some(database) = &self.database {
            return Some(reserved + database.claims_on(key));
        }
        let claims = self
            .observers()
            .first()
            .map_or(0, |o| o.claims_on(key).len());
        Some(reserved + claims)
    }

    /// The servers, looked at from outside the crate.
    pub(crate) fn observers(&self) -> Vec<Observer> {
        self.servers.iter().map(Observer::of).collect()
    }

    /// A third handle on the store: another process, whose store has refused nothing yet
    /// (the memory store's, which is one process's only, for memory).
    pub(crate) fn another_process(&self) -> Locks {
        #[cfg(feature = "postgres")]
        if let Some(database) = &self.database {
            return postgres_handle(database);
        }
        match self.servers.as_slice() {
            [] => self.locks[0].clone(),
            [server] => redis_handle(server),
            masters => redlock_handle(masters),
        }
    }
}

/// A handle on one Redis.
fn redis_handle(server: &RedisServer) -> Locks {
    listing(Locks::new(
        store::Redis::url(server.url())
            .build()
            .expect("a valid URL"),
    ))
}

/// A handle on Redlock over `masters`.
fn redlock_handle(masters: &[RedisServer]) -> Locks {
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    // A generous node timeout: the masters share two cores with the whole suite, and a
    // master's first connection under that load took more than 500 ms once (a waiter
    // then got 503 instead of its place in line). No test here fails a master.
    let store = store::Redlock::new(&urls)
        .node_timeout(Duration::from_millis(1500))
        .build()
        .expect("valid URLs");
    listing(Locks::new(store))
}

/// A handle on PostgreSQL, in `database`.
#[cfg(feature = "postgres")]
fn postgres_handle(database: &super::postgres::Database) -> Locks {
    listing(Locks::new(
        store::Postgres::url(database.url())
            .build()
            .expect("a valid URL"),
    ))
}

/// `locks`, listing its held batches from the start (the first look starts the list), for
/// the checks that none is left.
fn listing(locks: Locks) -> Locks {
    assert!(locks.held_batches().is_empty());
    locks
}
