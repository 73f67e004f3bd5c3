//! A database of its own for a test, on the PostgreSQL server of this machine
//! (127.0.0.1:5432, trust authentication), dropped when the test ends; never another
//! database's data.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The server every test database is made on.
const SERVER: &str = "postgres://postgres@127.0.0.1:5432";

pub(crate) struct Database {
    name: String,
}

impl Database {
    /// A new, empty database.
    ///
    /// # Panics
    ///
    /// When the server does not answer, with a message that says what the tests need.
    pub(crate) fn create() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "tower_batch_lock_test_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        psql(&format!("CREATE DATABASE {name}"));
        Self { name }
    }

    /// The name of this database.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The URL of this database.
    pub(crate) fn url(&self) -> String {
        format!("{SERVER}/{}", self.name)
    }

    /// The keys under `prefix` of the default table that a request holds or a waiter
    /// reserves or claims now (rows past every end wait for the sweep, and count for
    /// nothing).
    // Read by `stores`, which needs Redis too.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn live_keys(&self, prefix: &str) -> Vec<String> {
        let keys = self.query(&format!(
            "SELECT key FROM tower_batch_lock.locks WHERE starts_with(key, '{prefix}') AND \
             ((owner IS NOT NULL AND ends > clock_timestamp()) \
              OR EXISTS (SELECT 1 FROM unnest(readers) x WHERE x.ends > clock_timestamp()) \
              OR EXISTS (SELECT 1 FROM unnest(line) q WHERE q.ends > clock_timestamp())) \
             UNION SELECT k FROM tower_batch_lock.locks_claims, unnest(keys) k \
             WHERE starts_with(k, '{prefix}') AND ends > clock_timestamp() \
             ORDER BY 1"
        ));
        keys.lines().map(str::to_owned).collect()
    }

    /// The tickets of the live reservations on `key` (a lock key, with its prefix), in
    /// line order.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn line(&self, key: &str) -> Vec<u128> {
        let tickets = self.query(&format!(
            "SELECT q.ticket FROM tower_batch_lock.locks, unnest(line) q \
             WHERE key = '{key}' AND q.ends > clock_timestamp() ORDER BY q.ticket"
        ));
        tickets.lines().map(|t| t.parse().unwrap()).collect()
    }

    /// How many live claims (big waiters' places in line) name `key` (a lock key, with its
    /// prefix).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn claims_on(&self, key: &str) -> usize {
        self.query(&format!(
            "SELECT count(*) FROM tower_batch_lock.locks_claims \
             WHERE '{key}' = ANY(keys) AND ends > clock_timestamp()"
        ))
        .parse()
        .unwrap()
    }

    /// Runs `sql` in this database, and gives what it printed (unaligned, tuples only).
    pub(crate) fn query(&self, sql: &str) -> String {
        super::pg_server::psql(&self.url(), sql)
    }
}

impl Drop for Database {
    fn drop(&mut self) {
        // FORCE: the store's pooled and listening connections may still be open.
        psql(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ));
    }
}

fn psql(sql: &str) {
    super::pg_server::psql(&format!("{SERVER}/postgres"), sql);
}
