//! [`PostgresGuard`]: what a transaction of yours needs to check, where it writes, that
//! its request still holds its locks.

use std::fmt;

/// What a transaction in the locks' database needs to state "this request still holds
/// these keys" before it writes the data they protect: the keys of a [`Lease`](crate::Lease) as the
/// store keeps them (prefix included) and the request's owner token, for the schema's
/// guard function, whose call [`Postgres::guard_sql`](crate::store::Postgres::guard_sql) gives
/// ([`Lease::postgres_guard`](crate::Lease::postgres_guard) makes one).
///
/// The guard fails the transaction (SQLSTATE `TBL01`) unless the request holds every key
/// now, and holds their lock rows until the transaction ends: a request whose lease ran
/// out (a pause past the TTL, and another request was granted the keys) cannot commit,
/// and no other request is granted the keys between the check and the commit. That is
/// what a lease alone cannot promise (see the guide's chapter on safety).
///
/// With tokio-postgres (or deadpool-postgres, whose clients are tokio-postgres's):
///
/// ```no_run
/// use tower_batch_lock::{tokio_postgres, Lease};
///
/// /// `guard_sql`: `Postgres::guard_sql` of the locks' store.
/// async fn sell(
///     client: &mut tokio_postgres::Client,
///     guard_sql: &str,
///     lease: &Lease,
///     sku: &str,
/// ) -> Result<bool, tokio_postgres::Error> {
///     let guard = lease.postgres_guard();
///     let tx = client.transaction().await?;
///     let checked = tx.execute(guard_sql, &[&guard.keys, &guard.owner]).await;
///     if let Err(error) = checked {
///         if error.code().map(|code| code.code()) == Some("TBL01") {
///             return Ok(false); // The lease ran out: nothing is written.
///         }
///         return Err(error);
///     }
///     tx.execute("UPDATE stock SET qty = qty - 1 WHERE sku = $1", &[&sku]).await?;
///     tx.commit().await?;
///     Ok(true)
/// }
/// # let _ = sell;
/// ```
///
/// With sqlx, the same statement, bound the same way:
/// `sqlx::query(&guard_sql).bind(&guard.keys).bind(&guard.owner).execute(&mut *tx)`.
///
/// The owner token is a capability (whoever presents it re-enters the request's keys):
/// give it to the locks' database only. `Debug` does not show it.
#[derive(Clone)]
pub struct PostgresGuard {
    /// The lease's keys (this layer's), as the store keeps them: `text[]`.
    pub keys: Vec<String>,
    /// The request's owner token, 32 hex digits: `text`.
    pub owner: String,
}

impl fmt::Debug for PostgresGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresGuard")
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}
