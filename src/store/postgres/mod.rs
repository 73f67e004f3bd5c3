//! PostgreSQL: the store whose locks are rows of a table, written only by the functions of
//! `schema.sql`, one statement a call; `builder.rs` holds the public
//! [`Postgres`](builder::Postgres), `guard.rs` the guard for users' own transactions,
//! `schema.rs` the names and the first-use check, `failure.rs` what a failed call means,
//! `listen.rs` the wake-ups through `LISTEN`/`NOTIFY` and the sweeping of dead rows.

use std::{
    fmt,
    sync::{Arc, OnceLock},
    time::Duration,
};

#[cfg(feature = "idempotency")]
use bytes::Bytes;
use deadpool_postgres::{Object, Pool};
use tokio::sync::OnceCell;
use tokio_postgres::{error::SqlState, types::Type, Row};

#[cfg(feature = "idempotency")]
use super::contract::{AnswerStore, StoredAnswer};
use super::{
    contract::{
        Acquire, AcquireRequest, Contention, FencingToken, Holder, KeyStatus, KeyView, Keys, Line,
        LockStore, Reply, Ticket,
    },
    error::StoreError,
    message::{release_message, wake_heads},
    refusals::LastRefusal,
    wake::{slots_of, Wakeups},
};
use failure::failed;
use schema::Names;

pub(super) mod builder;
mod failure;
pub(super) mod guard;
mod listen;
mod schema;
mod tls;

/// A statement of the store: its SQL, and the types of its parameters as the client sends
/// them (the SQL casts some further: an owner goes as text, and is a `uuid` in the call).
#[derive(Debug)]
struct Call {
    sql: String,
    types: Vec<Type>,
}

/// The statements of the store, built once from its names.
#[derive(Debug)]
struct Statements {
    acquire: Call,
    probe: Call,
    extend: Call,
    release: Call,
    withdraw: Call,
    force_release: Call,
    inspect: Call,
    #[cfg(feature = "idempotency")]
    load_answer: Call,
    #[cfg(feature = "idempotency")]
    store_answer: Call,
}

impl Statements {
    fn new(names: &Names) -> Self {
        use Type as T;
        let call = |columns: &str, name: &str, args: &str, types: &[Type]| Call {
            sql: names.call(columns, name, args),
            types: types.to_vec(),
        };
        Self {
            acquire: call(
                "token, conflicts, earliest_ms, named, upgrade",
                "acquire",
                "$1::text[], $2::text, $3::text::uuid, $4::bigint, $5::bigint, $6::int, \
                 $7::text::numeric, $8::bigint, $9::boolean",
                &[
                    T::TEXT_ARRAY,
                    T::TEXT,
                    T::TEXT,
                    T::INT8,
                    T::INT8,
                    T::INT4,
                    T::TEXT,
                    T::INT8,
                    T::BOOL,
                ],
            ),
            probe: call(
                "*",
                "probe",
                "$1::text[], $2::text, $3::text::uuid, $4::text::numeric",
                &[T::TEXT_ARRAY, T::TEXT, T::TEXT, T::TEXT],
            ),
            extend: call(
                "*",
                "extend",
                "$1::text[], $2::text::uuid, $3::bigint, $4::bigint",
                &[T::TEXT_ARRAY, T::TEXT, T::INT8, T::INT8],
            ),
            release: call(
                "released, heads",
                "release",
                "$1::text[], $2::text::uuid, $3::bigint, $4::text",
                &[T::TEXT_ARRAY, T::TEXT, T::INT8, T::TEXT],
            ),
            withdraw: call(
                "withdrawn, heads",
                "withdraw",
                "$1::text[], $2::text::numeric, $3::text",
                &[T::TEXT_ARRAY, T::TEXT, T::TEXT],
            ),
            force_release: call(
                "released, heads",
                "force_release",
                "$1::text[], $2::text",
                &[T::TEXT_ARRAY, T::TEXT],
            ),
            inspect: call(
                "state, left_ms, holds, waiters",
                "inspect",
                "$1::text[]",
                &[T::TEXT_ARRAY],
            ),
            #[cfg(feature = "idempotency")]
            load_answer: call("*", "load_answer", "$1::text", &[T::TEXT]),
            #[cfg(feature = "idempotency")]
            store_answer: call(
                "*",
                "store_answer",
                "$1::text, $2::bytea, $3::bigint",
                &[T::TEXT, T::BYTEA, T::INT8],
            ),
        }
    }
}

/// Locks in one PostgreSQL database.
pub(crate) struct PostgresStore {
    pool: Pool,
    names: Names,
    statements: Statements,
    /// Whether the store may make its schema where it is missing.
    create: bool,
    /// Set once the schema was found (or made) in this version.
    ready: OnceCell<()>,
    wakeups: Arc<Wakeups>,
    /// Where to listen for other processes' releases, if anywhere, and how to connect.
    listener: Option<(tokio_postgres::Config, tls::Connector)>,
    /// Set once the listener and the sweeper run.
    started: OnceLock<()>,
    /// When this store last refused a batch: big ones skip their inserts first for a while
    /// after.
    last_refusal: LastRefusal,
    /// Whether the pool's connections go through a pooler in transaction mode: no named
    /// prepared statements ([`Postgres::transaction_pooling`](builder::Postgres::transaction_pooling)).
    unprepared: bool,
}

impl fmt::Debug for PostgresStore {
    // By hand: the listener's configuration holds the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("pool", &self.pool.status())
            .field("table", &self.names.qualified())
            .field("listens", &self.listener.is_some())
            .field("unprepared", &self.unprepared)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    fn new(
        pool: Pool,
        names: Names,
        create: bool,
        listener: Option<(tokio_postgres::Config, tls::Connector)>,
        unprepared: bool,
    ) -> Self {
        let store = Self {
            pool,
            statements: Statements::new(&names),
            names,
            create,
            ready: OnceCell::new(),
            wakeups: Arc::new(Wakeups::new()),
            listener,
            started: OnceLock::new(),
            last_refusal: LastRefusal::default(),
            unprepared,
        };
        // Built inside a runtime (the usual case), listen now, so that the first waiter
        // already hears of releases; otherwise on first use.
        if tokio::runtime::Handle::try_current().is_ok() {
            store.start();
        }
        store
    }

    /// Starts the listener for other processes' releases and the sweeper of dead rows,
    /// once; both end with the store.
    fn start(&self) {
        self.started.get_or_init(|| {
            let alive = Arc::downgrade(&self.wakeups);
            if let Some((config, connector)) = &self.listener {
                tokio::spawn(listen::listen_for_releases(
                    config.clone(),
                    connector.clone(),
                    self.names.channel(),
                    alive.clone(),
                ));
            }
            let sweep = self.names.call("*", "sweep", "$1::int");
            let at = self.names.qualified();
            tokio::spawn(listen::sweep(self.pool.clone(), sweep, at, alive));
        });
    }

    /// A connection, once the schema is known to be there, for a call: see [`Calling`].
    async fn client(&self) -> Result<Calling, StoreError> {
        let client = Calling(Some(self.pool.get().await.map_err(|error| {
            StoreError::not_sent(error).context("could not get a PostgreSQL connection")
        })?));
        self.ready
            .get_or_try_init(|| schema::prepare(client.get(), &self.names, self.create))
            .await?;
        Ok(client)
    }

    /// Runs `call` with `params` and gives its one row. `writes`: whether a call that
    /// failed may have written.
    async fn call(
        &self,
        call: &Call,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        writes: bool,
    ) -> Result<Row, StoreError> {
        one(self
            .query(call, params)
            .await?
            .map_err(|e| failed(e, writes))?)
    }

    /// Runs `call` with `params`: the store's error when it could not be sent, the
    /// server's answer otherwise. The statement is prepared once a connection, or, behind
    /// a pooler in transaction mode, sent with its parameters' types in one round trip
    /// (an unnamed statement, which is one transaction's: a named one may be sent to
    /// another server connection than the one that prepared it).
    async fn query(
        &self,
        call: &Call,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Result<Vec<Row>, tokio_postgres::Error>, StoreError> {
        let calling = self.client().await?;
        let client = calling.get();
        let answer = if self.unprepared {
            let typed: Vec<_> = params
                .iter()
                .copied()
                .zip(call.types.iter().cloned())
                .collect();
            client.query_typed(&call.sql, &typed).await
        } else {
            match client.prepare_typed_cached(&call.sql, &call.types).await {
                Ok(statement) => client.query(&statement, params).await,
                Err(error) => {
                    calling.answered();
                    return Err(failed(error, false));
                }
            }
        };
        calling.answered();
        Ok(answer)
    }

    /// Frees keys for others with `sql` (release, withdraw, force_release), whose last
    /// argument is the release message: wakes this process's waiters at once, and gives
    /// how many keys the call changed.
    async fn free(
        &self,
        call: &Call,
        keys: &Keys,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<usize, StoreError> {
        let slots = slots_of(keys);
        let message = release_message(&slots, self.wakeups.tag());
        let mut all: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params.to_vec();
        all.push(&message);
        let row = self.call(call, &all, true).await?;
        let (count, heads): (i32, Vec<String>) = (row.get(0), row.get(1));
        self.wakeups.wake_slots(slots);
        wake_heads(&self.wakeups, heads.iter().map(String::as_str));
        Ok(usize::try_from(count).unwrap_or(0))
    }
}

impl PostgresStore {
    /// One attempt of [`LockStore::acquire`]: one call of the schema's acquire function.
    async fn acquire_call(&self, request: &AcquireRequest) -> Result<Acquire, StoreError> {
        let keys: &[String] = &request.keys;
        let reserve = match request.line {
            Line::At(_) => millis(request.reserve),
            Line::Outside | Line::Holder(_) => 0,
        };
        let report = i32::try_from(request.report).unwrap_or(i32::MAX);
        let answer = self
            .query(
                &self.statements.acquire,
                &[
                    &keys,
                    &request.modes.script_arg(),
                    &request.holder.owner.as_hex(),
                    &hold_id(request.holder),
                    &millis(request.ttl),
                    &report,
                    &ticket_arg(request.line),
                    &reserve,
                    // A retry in line finds its own reservations on every key.
                    &(!request.retry && !self.last_refusal.recent()),
                ],
            )
            .await?;
        let rows = match answer {
            Ok(rows) => rows,
            // Another transaction kept one of the rows past the function's lock
            // timeout (a big batch's statement, a user's guarded transaction), or the
            // server broke a deadlock with it (a `deadlock_timeout` below that lock
            // timeout), or a stricter isolation than the store's READ COMMITTED (set on
            // the database or the role) refused a row changed meanwhile: the keys are
            // busy, which is contention, not a failed store. The statement rolled back:
            // nothing taken, and no reservation made that was not there (a waiter's
            // first attempt makes them when it tries again).
            Err(error)
                if error.code().is_some_and(|code| {
                    [
                        SqlState::LOCK_NOT_AVAILABLE,
                        SqlState::T_R_DEADLOCK_DETECTED,
                        SqlState::T_R_SERIALIZATION_FAILURE,
                    ]
                    .contains(code)
                }) =>
            {
                return Ok(Acquire::Held(Contention {
                    keys: Vec::new(),
                    total: 1,
                    earliest_expiry: None,
                    upgrade: false,
                    may_reserve_later: false,
                    counted: true,
                }));
            }
            Err(error) => return Err(failed(error, true)),
        };
        let row = one(rows)?;
        if let Some(token) = row.get::<_, Option<i64>>(0) {
            let token = u64::try_from(token)
                .map_err(|_| StoreError::unknown(format!("the fencing sequence gave {token}")))?;
            return Ok(Acquire::Granted(FencingToken::new(token)));
        }
        let conflicts: i32 = row.get(1);
        Ok(Acquire::Held(Contention {
            keys: row.get(3),
            total: usize::try_from(conflicts).unwrap_or(1),
            earliest_expiry: from_millis(row.get(2)),
            upgrade: row.get(4),
            may_reserve_later: false,
            counted: true,
        }))
    }
}

/// How long a connection whose call was dropped unanswered may take to answer a round
/// trip queued behind it, before it is given up.
const UNANSWERED_GRACE: Duration = Duration::from_secs(5);

/// A pooled connection with a call on it. Dropped before the call was answered (the
/// store's timeout, a request that went away), it does not go back to the pool at once,
/// where the next call would queue behind the statement still on it: a round trip queued
/// behind that statement tells, in the background, whether the server answers within
/// [`UNANSWERED_GRACE`] (a busy server: the connection goes back) or not (a server gone
/// silent without closing its connections, a host gone or an address moved in a failover:
/// the connection is given up, where every connection of the pool would have hung, and
/// every call got 503, until the kernel gave up on them, minutes later). Meanwhile the
/// pool makes new connections, which find the server that answers now.
struct Calling(Option<Object>);

impl Calling {
    fn get(&self) -> &Object {
        self.0
            .as_ref()
            .expect("a connection is taken out at its answer only")
    }

    /// The call was answered: the connection goes back to the pool.
    fn answered(mut self) {
        drop(self.0.take());
    }
}

impl Drop for Calling {
    fn drop(&mut self) {
        let Some(unanswered) = self.0.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            drop(Object::take(unanswered));
            return;
        };
        runtime.spawn(async move {
            let answered = tokio::time::timeout(UNANSWERED_GRACE, unanswered.simple_query(""));
            if !matches!(answered.await, Ok(Ok(_))) {
                drop(Object::take(unanswered));
            }
        });
    }
}

/// The one row of a call's answer.
fn one(rows: Vec<Row>) -> Result<Row, StoreError> {
    rows.into_iter()
        .next()
        .ok_or_else(|| StoreError::unknown("a call of the lock schema gave no row"))
}

/// A hold id as the table keeps it: the same 64 bits, as PostgreSQL's signed `bigint`.
fn hold_id(holder: Holder) -> i64 {
    i64::from_ne_bytes(holder.hold.to_ne_bytes())
}

/// Milliseconds, at least 1, as PostgreSQL's `bigint`.
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis())
        .unwrap_or(i64::MAX)
        .max(1)
}

/// Milliseconds the functions gave (a remaining time), as a duration; none for NULL.
fn from_millis(ms: Option<i64>) -> Option<Duration> {
    ms.and_then(|ms| u64::try_from(ms).ok())
        .map(Duration::from_millis)
}

/// Where a caller stands in line, as the functions read it (see `keeps_out`).
fn ticket_arg(line: Line) -> Option<String> {
    match line {
        Line::Outside => None,
        Line::At(ticket) | Line::Holder(ticket) => Some(ticket.as_arg()),
    }
}

impl LockStore for PostgresStore {
    /// Through `NOTIFY`, when it listens.
    fn announces_releases(&self) -> bool {
        self.listener.is_some()
    }

    fn acquire<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, Acquire> {
        Box::pin(async move {
            let answer = self.acquire_call(request).await;
            self.last_refusal.note(&answer);
            answer
        })
    }

    /// A probe reads the rows of the keys that blocked a waiter, and stops at the first
    /// that still does: a woken waiter of 2,000 keys blocked by one retail order reads one
    /// row, where an attempt writes 2,000.
    fn probes(&self) -> bool {
        true
    }

    /// Every attempt is one statement.
    fn whole_attempts(&self, _keys: usize) -> bool {
        true
    }

    fn probe<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, usize> {
        Box::pin(async move {
            let keys: &[String] = &request.keys;
            let row = self
                .call(
                    &self.statements.probe,
                    &[
                        &keys,
                        &request.modes.script_arg(),
                        &request.holder.owner.as_hex(),
                        &ticket_arg(request.line),
                    ],
                    false,
                )
                .await?;
            Ok(usize::try_from(row.get::<_, i32>(0)).unwrap_or(0))
        })
    }

    fn extend<'a>(&'a self, keys: &'a Keys, holder: Holder, ttl: Duration) -> Reply<'a, bool> {
        Box::pin(async move {
            let keys: &[String] = keys;
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [
                &keys,
                &holder.owner.as_hex(),
                &hold_id(holder),
                &millis(ttl),
            ];
            let row = self.call(&self.statements.extend, &params, true).await?;
            Ok(row.get(0))
        })
    }

    fn release<'a>(&'a self, keys: &'a Keys, holder: Holder) -> Reply<'a, usize> {
        Box::pin(async move {
            let list: &[String] = keys;
            let (owner, hold) = (holder.owner.as_hex(), hold_id(holder));
            self.free(&self.statements.release, keys, &[&list, &owner, &hold])
                .await
        })
    }

    fn withdraw<'a>(&'a self, keys: &'a Keys, ticket: Ticket) -> Reply<'a, usize> {
        Box::pin(async move {
            let list: &[String] = keys;
            let ticket = ticket.as_arg();
            self.free(&self.statements.withdraw, keys, &[&list, &ticket])
                .await
        })
    }

    fn inspect<'a>(&'a self, keys: &'a Keys) -> Reply<'a, Vec<KeyView>> {
        Box::pin(async move {
            let list: &[String] = keys;
            let rows = self
                .query(&self.statements.inspect, &[&list])
                .await?
                .map_err(|e| failed(e, false))?;
            let count = |n: i32| usize::try_from(n).unwrap_or(0);
            Ok(rows
                .iter()
                .map(|row| KeyView {
                    status: match row.get::<_, i32>(0) {
                        1 => KeyStatus::Held,
                        3 => KeyStatus::Shared,
                        _ => KeyStatus::Free,
                    },
                    ttl: from_millis(row.get(1)),
                    holds: count(row.get(2)),
                    waiters: count(row.get(3)),
                })
                .collect())
        })
    }

    fn force_release<'a>(&'a self, keys: &'a Keys) -> Reply<'a, usize> {
        Box::pin(async move {
            let list: &[String] = keys;
            self.free(&self.statements.force_release, keys, &[&list])
                .await
        })
    }

    /// PostgreSQL 12 or later, the schema in this version (made if allowed), and a round
    /// trip to the server: a pooled connection that is there says nothing of a server
    /// that stopped answering.
    fn check(&self) -> Reply<'_, ()> {
        Box::pin(async move {
            let calling = self.client().await?;
            calling
                .get()
                .simple_query("")
                .await
                .map_err(|error| failed(error, false))?;
            calling.answered();
            Ok(())
        })
    }

    fn wakeups(&self) -> &Wakeups {
        self.start();
        &self.wakeups
    }
}

#[cfg(feature = "idempotency")]
impl AnswerStore for PostgresStore {
    fn load_answer<'a>(&'a self, key: &'a str) -> Reply<'a, Option<Bytes>> {
        Box::pin(async move {
            let row = self
                .call(&self.statements.load_answer, &[&key], false)
                .await?;
            Ok(row.get::<_, Option<Vec<u8>>>(0).map(Bytes::from))
        })
    }

    fn store_answer<'a>(&'a self, answer: &'a StoredAnswer) -> Reply<'a, bool> {
        Box::pin(async move {
            let (key, bytes): (&str, &[u8]) = (&answer.key, &answer.bytes);
            let row = self
                .call(
                    &self.statements.store_answer,
                    &[&key, &bytes, &millis(answer.retention)],
                    true,
                )
                .await?;
            Ok(row.get::<_, Option<bool>>(0).unwrap_or(false))
        })
    }
}
