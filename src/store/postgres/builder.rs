//! [`Postgres`]: the public builder of the store in a PostgreSQL database.

use std::{fmt, str::FromStr, sync::Arc};

use deadpool_postgres::{ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::{
    tls::{MakeTlsConnect, TlsConnect},
    NoTls, Socket,
};

use super::{listen, schema::Names, tls::Connector, PostgresStore};
use crate::store::handle::Store;

/// Connections of the pool the store makes from a URL.
const POOL_SIZE: usize = 16;

/// Locks in a PostgreSQL database, shared by every process that uses the same table: built
/// from a URL (a pool of its own) or from your deadpool-postgres pool.
///
/// ```no_run
/// use tower_batch_lock::{store::Postgres, Locks};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let url = "postgres://app@127.0.0.1/app";
/// // A pool of its own, and waiting requests woken by every process's releases.
/// let locks = Locks::new(Postgres::url(url).build()?);
/// # drop(locks);
/// # Ok(())
/// # }
/// ```
///
/// Nothing connects until the first request (or [`Locks::check`](crate::Locks::check)),
/// which makes the schema if it is missing (unless [`create_schema(false)`](Self::create_schema)).
///
/// # Data model
///
/// One row a lock key in the table `tower_batch_lock.locks` ([`schema`](Self::schema),
/// [`table`](Self::table)): the exclusive holds (one owner, its hold ids, their end), the
/// shared holds (owner, hold, end each), and the reservations of the waiters in line
/// (ticket and end, in ticket order). A waiter with a big exclusive batch (64 keys or
/// more) keeps its place in line apart, as one row of `locks_claims` (its ticket, its keys
/// and its end): a *claim*, which keeps later arrivals out of the keys it names as a
/// reservation does, and writes no key's row. A waiter in line for one key alone,
/// exclusively, keeps beside its reservation what a grant needs (its owner, hold and ttl),
/// as one row of `locks_turns`, so that the call that frees the key can grant it (below).
/// Every call is one statement, a function of the schema, so that a batch of any size costs
/// one round trip:
///
/// - *acquire* inserts the free keys' rows in one `INSERT … ON CONFLICT DO UPDATE … WHERE
///   false`, which also locks the rows that were there, in key order (so two batches never
///   wait for each other crosswise: no deadlock); a batch of free keys is granted there.
///   Otherwise it asks whether a locked row keeps it out (stopping at the first), counts
///   and names them only when one does, and either gives them its hold
///   (one `UPDATE` for the rows nobody holds) or, refused, deletes the rows it inserted (a
///   waiter in line turns them into its reservations, and reserves the others). A batch of
///   64 keys or more (not a waiter's retry, nor any for a second after the store refused
///   a batch) first inserts its rows with `ON CONFLICT DO NOTHING`, which locks no row
///   that is there: granted if every key was free; otherwise it undoes those inserts
///   (a subtransaction rolled back, so that it keeps no row while it waits for others).
///   Every batch of that size then looks without locking (the same probe, counting only
///   when a key keeps it out), and is refused without locking any row when it is kept out
///   (a waiter in line reserves or claims its batch first, and asks the probe once more);
///   a claim's retry (its probe found it free) locks at once. Before all of that, a batch
///   that an earlier waiter's claim keeps out of a key (one its owner does not hold) is
///   refused at once, with those keys named, without a look at the rows; and a batch
///   that waited for rows asks the claims again once it has them (a claim locks no row).
///   A grant ends its own waiter's claim.
///   Nobody sees part of a batch: the statement is one transaction.
/// - *release* deletes the rows that hold this hold alone, frees those that a waiter
///   reserves in one `UPDATE` (both index scans: in key order), and takes the hold off the
///   others; a row stays while a waiter reserves it. The waiters it wakes are the first in
///   line on the rows it freed (but those that an earlier claim keeps out of that key),
///   and those of the claims that name one of its keys and are behind no live claim (a
///   claim is behind the earlier live claims that shared a key with it when it was made:
///   those keep its waiter out).
/// - A release that frees a key whose first waiter has a turn (a waiter of that key alone)
///   grants the key to that waiter in its own statement (a *hand-over*: the waiter's hold,
///   a fencing token from the sequence, and a commit that waits as a grant's does), and
///   names the grant in its wake-up; the waiter, here or in another process, is granted
///   without a call of its own. Where its own attempt crossed the hand-over (it polled, or
///   its wake-up was lost), that attempt finds its owner's handed hold and takes it over;
///   where it gave up meanwhile, its withdrawal releases the key to the next in line. A
///   waiter believes a hand-over only when it names the hold of one of its refused
///   attempts, which the database alone knows besides it: anybody connected may `NOTIFY`
///   the channel, and a forged hand-over grants nothing.
///   A hot key so costs a grant one statement, the release, where the woken waiter's
///   attempt ran as its holder's client sent its next request, whose refused attempt wrote
///   the same row: the bench's hot sku with 64 clients granted 0.75-0.77x what one client
///   did, and 0.89 and 0.93x with hand-overs in two runs of three (0.79 in the third;
///   `contention`, PostgreSQL). A waiter whose process dies after it was handed its key
///   keeps it for its ttl, as a holder that dies does.
/// - A row's line of reservations is kept in ticket order, and its common changes (a
///   grant in line takes the head, a reservation of the latest ticket goes at the end, a
///   release leaves it as it is) and the question whether a row keeps a batch out are
///   expressions in the statement; a walk over the line runs only for the rest, and drops
///   the entries that ended (every reader skips them until then).
/// - The table leaves half of each page free (`fillfactor = 50`), so that the row versions
///   of contended keys are written in their own page, without new index entries, and
///   pruned there (HOT updates).
/// - The functions plan their queries once a connection (generic plans: `plan_cache_mode`
///   is theirs), where PL/pgSQL planned them again at every call for its few keys (a
///   waiter's refused attempt of one key spent nearly half its time planning); such a
///   plan finds rows by the key's index, whatever the table's size when it was made.
/// - Times are the database's clock (`clock_timestamp()`), never a client's.
/// - A key, with its prefix, is at most about 2,700 bytes: the table's primary key (a
///   B-tree) takes no longer entry, and the store fails (503) on one. The layer's
///   [`max_key_len`](crate::Locks::max_key_len) is 256 by default; keep it below that.
///   A key holds no NUL character, which `text` cannot hold: the layer refuses one (400)
///   on every store.
/// - Fencing tokens come from a sequence, `locks_fence`: it never goes backwards, across
///   restarts and crashes (a crash may skip values). A token is larger than those of
///   every earlier grant that shared a key with it; grants of unrelated keys at the same
///   moment take tokens in the order they reached the sequence. The sequence starts at the
///   database clock's floor ([`FencingToken`](crate::FencingToken)), so a schema made
///   again starts above the tokens of the one dropped; it is not raised to the clock at
///   each grant, as the Redis stores' counters are, but at the first grant on another
///   server than the last grant's (another system identifier or timeline: **a promoted
///   replica that was behind**, a point-in-time recovery, a dump restored into a new
///   cluster), without an operator: to the clock's floor, above every token handed out
///   before, while the store counted fewer than 1,024 grants a millisecond. **After
///   restoring a copy of the database's files** (which starts no new timeline), run
///   `SELECT tower_batch_lock.locks_raise_fence()` (your schema and table) before the
///   first grant. Each grant reads the server's identity for it
///   (`pg_control_system()`, `pg_current_wal_lsn()`), which PostgreSQL lets every role do;
///   where `EXECUTE` on them is revoked, grants go on without the automatic raise.
/// - A grant's transaction, and a renewal's, commit as the connection's
///   `synchronous_commit` says (`on` by default: after the WAL is on disk), so that no
///   crash hands a fencing token out twice. A call that grants nothing (a release, a
///   withdrawal, a refused attempt, which may have written its place in line) commits
///   without waiting for the disk or a standby (`synchronous_commit = off` for that
///   transaction alone). A transaction keeps its row locks until its commit has waited,
///   so every call on a contended key waited for the disk of the one before it: with
///   pgbench, 8 clients on one key made 1.3-1.6 times the calls a second this way. A crash
///   or a failover may lose the last of those (after a crash, up to three times
///   `wal_writer_delay`, 600 ms by default): a key whose release was lost stays held to its
///   ttl, a withdrawn waiter's lost withdrawal keeps its place in line to its deadline, and
///   a waiter whose place in line was lost takes it again at its next attempt. Nobody is
///   let in.
/// - A release (or a withdrawal) that lets a waiter in line in `NOTIFY`s the channel
///   `tower_batch_lock.locks` (the table's name) with the keys' wake-up slots and the
///   waiters first in line; every process built with a listener ([`Postgres::url`],
///   [`Postgres::wakeups`]) wakes those. A notification is a hint: without one, waiters
///   poll. Other releases notify nobody: `NOTIFY` serializes the commits of the
///   transactions that send one, which the uncontended path must not pay; waiters in no
///   line (`Wait::fair(false)`) poll for other processes' releases.
/// - Under contention, a small waiting batch rewrites its rows to reserve them and its
///   grant rewrites them again, as row versions that a big batch's statement holds the
///   locks of while it runs; a big one claims its batch in one row. The bench's
///   `contention` section (`docs/bench`) measures it beside memory and Redis.
/// - An acquire waits at most 500 ms for rows that another transaction keeps (a big
///   batch's statement, or your transaction under its guard, `Lease::postgres_guard`);
///   then the request is refused as contended: it waits on, or gets 409, never 503.
/// - Rows that nobody holds or reserves any more (their holder crashed) keep nobody out,
///   are taken over by the next request for their key, and are deleted by a sweep every
///   30 s (`SKIP LOCKED`: it never waits for a call), with expired idempotent answers
///   (`locks_answers`), and the claims and turns whose waiters' deadlines passed.
///
/// [`schema_sql`](Self::schema_sql) gives the SQL, for those who run their own
/// migrations. The schema has a version (`locks_version()`), which the store checks on
/// first use: a later release that changes the schema says so, and ships its migration.
///
/// # Running it
///
/// - **Version.** PostgreSQL 12 or later. [`Locks::check`](crate::Locks::check) says so
///   at start-up.
/// - **Rights.** To make the schema: `CREATE` on the database (or make it yourself with
///   [`schema_sql`](Self::schema_sql) and `create_schema(false)`); then `USAGE` on the
///   schema, `EXECUTE` on its functions, which write the table and the sequence.
/// - **Connection poolers.** Every call is one statement in a transaction of its own, and
///   the store keeps no session state (its settings are the functions' own, or last a
///   transaction), so transaction pooling suits it. By default it prepares each statement
///   once a connection (a named prepared statement), which PgBouncer keeps apart by server
///   connection only from 1.21 (`max_prepared_statements`, on by default from 1.24); behind
///   a pooler in transaction mode that does not, or when unsure, set
///   [`transaction_pooling`](Self::transaction_pooling), which sends every call unnamed,
///   with its types, in one round trip (tested behind PgBouncer 1.18 in transaction mode:
///   `postgres::behind_pgbouncer_*`). The
///   listener needs a session of its own (`LISTEN` does not survive transaction pooling):
///   point [`wakeups`](Self::wakeups) at the server itself or at a session-pooled entry;
///   without it, waiters poll. Advisory locks, the usual alternative, break behind
///   transaction pooling: they belong to a session.
/// - **Failover.** A grant lives in the database: it survives a restart and a crash (its
///   commit waits for its WAL), and a failover to a synchronous replica
///   (`synchronous_standby_names` set, and `synchronous_commit` at `remote_write`, `on` or
///   `remote_apply`). Keep `synchronous_commit` at `on` (the default) or one of those for
///   the store's connections: with `off`, a crash can lose grants and hand their fencing
///   tokens out again, and with `local`, a failover can. A release or a withdrawal may be
///   lost (above), which costs time, never a second holder. A failover to an asynchronous
///   replica that had not received a grant loses that grant: another request can then be
///   granted the same keys while the first still runs. A failover to a synchronous replica
///   can too, for a grant whose wait for it was cancelled (`pg_cancel_backend`): that
///   grant committed on the primary alone, with a warning, and the store handed out its
///   token. Fencing tokens come from the sequence, which the replica has as of its last
///   replay: its first grant raises it (a new timeline, above), so that tokens keep
///   growing; check them at the resource.
/// - **Isolation.** The functions expect READ COMMITTED, PostgreSQL's default. Under a
///   stricter `default_transaction_isolation` (set on the database or the role), an
///   attempt that waited for a row another transaction changed is refused by the server
///   (`40001`), as one that meets a deadlock is (`40P01`, with a `deadlock_timeout` below
///   the functions' 500 ms row wait): both count as contention (409, or the wait goes on),
///   never a failed store. Releases and renewals are retried in such a case; keep the
///   default for the store's connections.
/// - **A server gone silent** (a host gone, an address moved to a new primary, without a
///   reset): a connection whose call got no answer within the
///   [`store_timeout`](crate::Locks::store_timeout) stays out of the pool until a round
///   trip queued behind that call answers, and is given up if none does within 5 s (a
///   busy server's connection goes back), so the next calls connect again (to the server
///   that answers now) rather than queue behind it. The store's own connections (the
///   pool built from a URL, the listener) set TCP keepalives, over any the URL gives, so
///   that an idle one to a vanished server is given up in about 25 s (probes after 10 s
///   idle, every 5 s, 3 of them); set them on a pool you pass to [`Postgres::pool`]
///   (`keepalives_idle` and the like in its URL). [`Locks::check`](crate::Locks::check)
///   asks the server each time.
/// - **WAL and checkpoints.** Every grant and release writes its rows, and their WAL:
///   about 300 bytes a key for a cycle (a 2,000-key batch acquired and released, 575 KB;
///   a 3-key one, 0.9 KB; `pg_stat_wal` under the bench's `contention` section). Amid 16
///   retail and 4 purchase clients that came to 9.5 MB/s, at which the server, with the
///   default `max_wal_size` (1 GB; a checkpoint starts well before it fills), logged
///   `checkpoint starting: wal` 84 s into a run: the checkpoint's writes (and the full
///   page images of the pages first changed after it) took a round of that workload from
///   a p99 of 0.3 s to 1.3 s on a 2-core machine; in 2 of 9 runs, at the same point of
///   the run, 19 waiters passed their 2 s bound (409). Size `max_wal_size` and
///   `checkpoint_timeout` for the lock traffic as for any busy table (`log_checkpoints`
///   says how often they come).
/// - **TLS.** Without [`tls`](Self::tls), the store's own connections (the pool built
///   from a URL, and the connection that listens for releases) do not use TLS. With it,
///   they do as the URL's `sslmode` says (`prefer` by default; `require` to refuse a
///   server without TLS). A pool you pass to [`Postgres::pool`] keeps its own connector;
///   `tls` then serves the listener.
#[derive(Clone)]
pub struct Postgres {
    source: Source,
    /// Where to listen for other processes' releases.
    wakeups: Option<tokio_postgres::Config>,
    names: Names,
    create: bool,
    transaction_pooling: bool,
    /// How the store's own connections connect, where not without TLS.
    tls: Option<Connector>,
}

#[derive(Clone)]
enum Source {
    Url(String),
    Pool(Pool),
}

impl fmt::Debug for Postgres {
    // By hand: URLs may carry passwords.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match self.source {
            Source::Url(_) => "url",
            Source::Pool(_) => "pool",
        };
        f.debug_struct("Postgres")
            .field("source", &source)
            .field("wakeups", &self.wakeups.is_some())
            .field("table", &self.names.qualified())
            .field("create_schema", &self.create)
            .field("transaction_pooling", &self.transaction_pooling)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Postgres {
    /// The database at `url` (`postgres://user:password@host:port/database`, or the
    /// `key=value` form), with a pool of its own of 16 connections, and a connection of its
    /// own that listens for every process's releases.
    pub fn url(url: impl Into<String>) -> Self {
        Self {
            source: Source::Url(url.into()),
            wakeups: None,
            names: default_names(),
            create: true,
            transaction_pooling: false,
            tls: None,
        }
    }

    /// The database behind `pool`. Without [`wakeups`](Self::wakeups), waiting requests
    /// wake at once for this process's releases and poll for other processes': a waiter in
    /// line (fair waiting, the default) after 100-200 ms, then less and less often, down
    /// to every 1-2 s, so that a key handed to it by another process waits for its next
    /// poll; one in no line every 5 to 100 ms.
    pub fn pool(pool: Pool) -> Self {
        Self {
            source: Source::Pool(pool),
            wakeups: None,
            names: default_names(),
            create: true,
            transaction_pooling: false,
            tls: None,
        }
    }

    /// Listens at `url` (the same database) for every process's releases, to wake waiting
    /// requests at once; over TLS with the connector of [`tls`](Self::tls).
    ///
    /// # Errors
    ///
    /// When `url` is not a valid PostgreSQL URL.
    pub fn wakeups(mut self, url: &str) -> Result<Self, tokio_postgres::Error> {
        self.wakeups = Some(tokio_postgres::Config::from_str(url)?);
        Ok(self)
    }

    /// The schema of the store's table, sequence and functions (`tower_batch_lock` by
    /// default).
    ///
    /// # Panics
    ///
    /// Unless `schema` is a lowercase SQL identifier of at most 40 bytes (letters, digits
    /// and `_`, not starting with a digit), and `schema.table` at most 63 bytes with the
    /// table as set (see [`table`](Self::table)).
    pub fn schema(mut self, schema: &str) -> Self {
        assert!(Names::valid(schema), "not a usable schema name: {schema:?}");
        self.names.schema = schema.to_owned();
        self.names.assert_fits();
        self
    }

    /// The table of the locks (`locks` by default); the sequence, the answers table and
    /// the functions are named after it.
    ///
    /// # Panics
    ///
    /// Unless `table` is a lowercase SQL identifier of at most 40 bytes, and
    /// `schema.table` at most 63 bytes with the schema as set: that is the channel of the
    /// store's notifications, and PostgreSQL takes no longer one.
    pub fn table(mut self, table: &str) -> Self {
        assert!(Names::valid(table), "not a usable table name: {table:?}");
        self.names.table = table.to_owned();
        self.names.assert_fits();
        self
    }

    /// Whether the store makes its schema on first use where it is missing (the default),
    /// or fails (`false`), for databases whose schema only migrations change.
    pub fn create_schema(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// Whether the connections go through a pooler in transaction mode, such as PgBouncer
    /// with `pool_mode = transaction` (off by default). Then every call goes as an unnamed
    /// statement with its parameters' types, in one round trip, where the store otherwise
    /// prepares each of its statements once a connection: a pooler in transaction mode
    /// may send a named statement's execution to another server connection than the one
    /// that prepared it (PgBouncer before 1.21, or with `max_prepared_statements = 0`, the
    /// default before 1.24).
    /// The listener needs a session of its own, which such a pooler does not keep: with a
    /// URL and no [`wakeups`](Self::wakeups), this store does not listen, and its waiters
    /// poll for other processes' releases.
    pub fn transaction_pooling(mut self, pooled: bool) -> Self {
        self.transaction_pooling = pooled;
        self
    }

    /// Connects the store's own connections with `tls`, a TLS connector for
    /// tokio-postgres (`postgres_openssl::MakeTlsConnector`, `postgres_native_tls`'s or
    /// `tokio_postgres_rustls`'s): the pool built from a [`url`](Self::url), and the
    /// connection that listens for releases. Whether TLS is required is the URL's
    /// `sslmode` (`require`); the connector says which certificates it trusts.
    ///
    /// ```no_run
    /// // Cargo.toml: postgres-openssl = "0.5", openssl = "0.10"
    /// use openssl::ssl::{SslConnector, SslMethod};
    /// use postgres_openssl::MakeTlsConnector;
    /// use tower_batch_lock::{store::Postgres, Locks};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let tls = MakeTlsConnector::new(SslConnector::builder(SslMethod::tls())?.build());
    /// let url = "postgres://app@db.internal/app?sslmode=require";
    /// let locks = Locks::new(Postgres::url(url).tls(tls).build()?);
    /// # drop(locks);
    /// # Ok(())
    /// # }
    /// ```
    pub fn tls<T>(mut self, tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send + Sync + 'static,
        T::TlsConnect: Send + Sync,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        self.tls = Some(Connector::new(tls));
        self
    }

    /// The SQL that makes the store's schema as configured: safe to run again, for your
    /// migrations.
    pub fn schema_sql(&self) -> String {
        self.names.sql()
    }

    /// The call of the schema's guard function, for your transactions that write the data
    /// the locks protect: `SELECT tower_batch_lock.locks_guard($1::text[], $2::text::uuid)`
    /// with the keys and the owner of a [`PostgresGuard`](crate::store::PostgresGuard).
    pub fn guard_sql(&self) -> String {
        let table = self.names.qualified();
        format!("SELECT {table}_guard($1::text[], $2::text::uuid)")
    }

    /// The store. The listener starts at once when this is called inside a Tokio
    /// runtime, and otherwise when the first request waits.
    ///
    /// # Errors
    ///
    /// When a URL is not a valid PostgreSQL URL. Nothing connects yet.
    pub fn build(self) -> Result<Store, tokio_postgres::Error> {
        let connector = self.tls.unwrap_or_else(|| Connector::new(NoTls));
        let (pool, listener) = match self.source {
            Source::Pool(pool) => (pool, self.wakeups),
            Source::Url(url) => {
                let mut config = tokio_postgres::Config::from_str(&url)?;
                listen::keep_alive(&mut config);
                let manager = connector.manager(
                    config.clone(),
                    ManagerConfig {
                        recycling_method: RecyclingMethod::Fast,
                    },
                );
                let pool = Pool::builder(manager)
                    .max_size(POOL_SIZE)
                    .build()
                    // Only timeouts without a runtime fail to build, and none are set.
                    .expect("a pool without timeouts builds");
                // Behind a pooler in transaction mode, `LISTEN` would hear nothing.
                let own = (!self.transaction_pooling).then_some(config);
                (pool, self.wakeups.or(own))
            }
        };
        let store = PostgresStore::new(
            pool,
            self.names,
            self.create,
            listener.map(|config| (config, connector)),
            self.transaction_pooling,
        );
        Ok(Store::of(Arc::new(store)))
    }
}

fn default_names() -> Names {
    Names {
        schema: "tower_batch_lock".to_owned(),
        table: "locks".to_owned(),
    }
}
