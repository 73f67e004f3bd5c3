//! The PostgreSQL store's batch cycle (acquire + release through the layer) beside what
//! the field does in the same database, in the same run: (a) the minimal lock-table batch,
//! `INSERT … SELECT unnest(…) ON CONFLICT DO NOTHING` and a checked `DELETE … = ANY(…)`;
//! (b) session advisory locks over the same keys (`pg_try_advisory_lock` a key, then
//! `pg_advisory_unlock`), which have no lease, no fencing and no queue; (c) one statement a
//! key, as ShedLock and Spring's `JdbcLockRegistry` take them. For 1, 100 and 3,000 keys,
//! in rounds that alternate the four, on a server the bench starts itself. And what the
//! guard of a write in that database costs (issue 38): a transaction with and without it.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{body::Body, routing::post, Router};
use http::{request::Parts, Request};
use serde_json::{json, Value};
use tower::ServiceExt;
use tower_batch_lock::{
    store::Postgres,
    tokio_postgres::{self, Client, NoTls},
    Lease, Locks, Rejection,
};

use crate::{
    progress,
    stats::{self, Summary},
    target::Target,
};

/// The sizes measured: a retail order, a middling batch, a purchase order.
const SIZES: [usize; 3] = [1, 100, 3_000];

pub(crate) async fn run(url: &str, quick: bool) -> Result<Value, String> {
    let client = connect(url).await?;
    client
        .batch_execute(
            "DROP TABLE IF EXISTS bench_minimal;
             CREATE TABLE bench_minimal (key text COLLATE \"C\" PRIMARY KEY, owner text NOT NULL);",
        )
        .await
        .map_err(pg_error)?;
    let locks = Locks::new(Postgres::url(url).build().map_err(pg_error)?);
    locks.check().await.map_err(|e| e.to_string())?;
    let mut cases = Vec::new();
    let mut targets = Vec::new();
    for size in SIZES {
        let keys: Vec<String> = (0..size).map(|i| format!("lock:bench:{i}")).collect();
        let app = layer_app(&locks, &keys);
        // A hundred rounds at every size: at 3,000 keys, ten rounds gave ratios from 1.10
        // to 1.70 in three runs of one session. The statement a key, a round trip a key,
        // runs in fewer: 20 rounds at 100 keys, 2 at 3,000.
        let rounds = if quick { 10 } else { 100 }
            .min(300_000 / size)
            .max(if quick { 3 } else { 10 });
        let per_key_rounds = if size < 100 {
            rounds
        } else {
            (2_000 / size).max(2)
        };
        let mut times: [Vec<Duration>; 4] = Default::default();
        progress::begin(format!("postgres: {size} keys"), "rounds", rounds as u64);
        for round in 0..rounds {
            let owner = format!("bench-{round}");
            times[0].push(crate_cycle(&app).await?);
            times[1].push(minimal(&client, &keys, &owner).await?);
            times[2].push(advisory(&client, &keys).await?);
            if round < per_key_rounds {
                times[3].push(per_key(&client, &keys, &owner).await?);
            }
            progress::tick(round as u64 + 1);
        }
        let [ours, minimal, advisory, per_key] = times.map(Summary::of);
        let ratio = |other: &Summary| stats::ms(ours.median) / stats::ms(other.median);
        progress::end(&format!(
            "crate {:.3} ms, minimal {:.3} ms (x{:.2}), advisory {:.3} ms, a statement a key {:.3} ms (x{:.3})",
            stats::ms(ours.median),
            stats::ms(minimal.median),
            ratio(&minimal),
            stats::ms(advisory.median),
            stats::ms(per_key.median),
            ratio(&per_key),
        ));
        match size {
            1 => targets.push(Target::at_most(
                "postgres, 1-key cycle / the minimal lock-table batch",
                Some(ratio(&minimal)),
                1.5,
            )),
            3_000 => targets.extend([
                Target::at_most(
                    "postgres, 3,000-key cycle / the minimal lock-table batch",
                    Some(ratio(&minimal)),
                    1.3,
                ),
                Target::at_most(
                    "postgres, 3,000-key cycle / one statement a key",
                    Some(ratio(&per_key)),
                    0.05,
                ),
            ]),
            _ => {}
        }
        cases.push(json!({
            "keys": size,
            "crate": ours.to_json(),
            "minimal_batch": minimal.to_json(),
            "advisory_locks": advisory.to_json(),
            "statement_per_key": per_key.to_json(),
            "over_minimal": stats::round(ratio(&minimal), 3),
            "over_advisory": stats::round(ratio(&advisory), 3),
            "over_statement_per_key": stats::round(ratio(&per_key), 4),
        }));
    }
    let guard = guarded_write_cost(&locks, url, quick).await?;
    Ok(json!({
        "guarded_write": guard,
        "method": "one client connection for the baselines and the crate's own pool (Postgres::url), on a PostgreSQL the bench starts (initdb, default settings, fsync on) on a free loopback port; each round runs the four one after another on the same keys, free at the start, every statement prepared beforehand (as the store prepares its calls once a connection): the crate's cycle is a POST through LockLayer (keys from a closure) to a handler that returns at once, acquire + release; minimal: INSERT INTO bench_minimal SELECT unnest($1), $2 ON CONFLICT DO NOTHING, then DELETE WHERE key = ANY($1) AND owner = $2 (a logged table with a primary key, as the store's); advisory: SELECT pg_try_advisory_lock(hashtext(k)) over unnest($1), then pg_advisory_unlock; a statement a key: the minimal INSERT and DELETE once per key, each its own round trip (20 rounds at 100 keys, 2 at 3,000; the others 100 rounds at every size); times are the medians",
        "server_version": client
            .query_one("SHOW server_version", &[])
            .await
            .map_err(pg_error)?
            .get::<_, String>(0),
        "cases": cases,
        "targets": targets.iter().map(Target::to_json).collect::<Vec<_>>(),
    }))
}

/// What the guard adds to a write in the locks' database: a handler under a one-key lease
/// runs `BEGIN; UPDATE …; COMMIT` plainly, or with the guard's `SELECT` first, in rounds
/// that alternate the two; measured is the transaction's time inside the handler.
async fn guarded_write_cost(locks: &Locks, url: &str, quick: bool) -> Result<Value, String> {
    let client = Arc::new(connect(url).await?);
    client
        .batch_execute(
            "DROP TABLE IF EXISTS bench_stock;
             CREATE TABLE bench_stock (sku text PRIMARY KEY, qty bigint NOT NULL);
             INSERT INTO bench_stock VALUES ('apple', 0);",
        )
        .await
        .map_err(pg_error)?;
    let guard_sql = Arc::new(Postgres::url(url).guard_sql());
    let times: Arc<Mutex<[Vec<Duration>; 2]>> = Arc::default();
    let app = |guarded: bool| {
        let (client, guard_sql, times) = (client.clone(), guard_sql.clone(), times.clone());
        let write = move |lease: Lease| async move {
            let started = Instant::now();
            let written: Result<(), tokio_postgres::Error> = async {
                client.batch_execute("BEGIN").await?;
                if guarded {
                    let held = lease.postgres_guard();
                    client
                        .execute(&*guard_sql, &[&held.keys, &held.owner])
                        .await?;
                }
                client
                    .execute(
                        "UPDATE bench_stock SET qty = qty + 1 WHERE sku = 'apple'",
                        &[],
                    )
                    .await?;
                client.batch_execute("COMMIT").await
            }
            .await;
            times.lock().unwrap()[usize::from(guarded)].push(started.elapsed());
            written.map_err(|e| (http::StatusCode::INTERNAL_SERVER_ERROR, pg_error(e)))
        };
        let extract = |_: &Parts| Ok::<_, Rejection>(["bench:apple"]);
        Router::new().route("/", post(write).layer(locks.layer(extract)))
    };
    let (plain, guarded) = (app(false), app(true));
    let rounds = if quick { 20 } else { 300 };
    for _ in 0..rounds {
        crate_cycle(&plain).await?;
        crate_cycle(&guarded).await?;
    }
    let [plain, guarded] = std::mem::take(&mut *times.lock().unwrap()).map(Summary::of);
    let ratio = stats::ms(guarded.median) / stats::ms(plain.median);
    progress::note(&format!(
        "postgres: a guarded write {:.3} ms vs a plain one {:.3} ms (x{ratio:.2})",
        stats::ms(guarded.median),
        stats::ms(plain.median)
    ));
    Ok(json!({
        "statements": {"plain": 3, "guarded": 4},
        "plain": plain.to_json(),
        "guarded": guarded.to_json(),
        "median_ratio": stats::round(ratio, 3),
    }))
}

/// A router that locks `keys` for every request, and answers at once.
fn layer_app(locks: &Locks, keys: &[String]) -> Router {
    // The layer adds its prefix: name the keys without it.
    let names: Vec<String> = keys
        .iter()
        .map(|key| key.trim_start_matches("lock:").to_owned())
        .collect();
    let extract = move |_: &Parts| Ok::<_, Rejection>(names.clone());
    Router::new().route("/", post(|| async {}).layer(locks.layer(extract)))
}

async fn crate_cycle(app: &Router) -> Result<Duration, String> {
    let request = Request::post("/").body(Body::empty()).unwrap();
    let started = Instant::now();
    let response = app
        .clone()
        .oneshot(request)
        .await
        .map_err(|e| e.to_string())?;
    let elapsed = started.elapsed();
    if !response.status().is_success() {
        return Err(format!("the crate's cycle answered {}", response.status()));
    }
    Ok(elapsed)
}

async fn minimal(client: &Client, keys: &[String], owner: &str) -> Result<Duration, String> {
    let insert = "INSERT INTO bench_minimal SELECT unnest($1::text[]), $2 ON CONFLICT DO NOTHING";
    let delete = "DELETE FROM bench_minimal WHERE key = ANY($1::text[]) AND owner = $2";
    let (insert, delete) = (
        prepared(client, insert).await?,
        prepared(client, delete).await?,
    );
    let started = Instant::now();
    let taken = client
        .execute(&insert, &[&keys, &owner])
        .await
        .map_err(pg_error)?;
    let released = client
        .execute(&delete, &[&keys, &owner])
        .await
        .map_err(pg_error)?;
    let elapsed = started.elapsed();
    check(taken, released, keys.len(), "the minimal batch")?;
    Ok(elapsed)
}

async fn advisory(client: &Client, keys: &[String]) -> Result<Duration, String> {
    let lock = prepared(
        client,
        "SELECT count(*) FILTER (WHERE pg_try_advisory_lock(hashtext(k))) FROM unnest($1::text[]) k",
    )
    .await?;
    let unlock = prepared(
        client,
        "SELECT count(*) FILTER (WHERE pg_advisory_unlock(hashtext(k))) FROM unnest($1::text[]) k",
    )
    .await?;
    let started = Instant::now();
    let taken: i64 = client
        .query_one(&lock, &[&keys])
        .await
        .map_err(pg_error)?
        .get(0);
    let released: i64 = client
        .query_one(&unlock, &[&keys])
        .await
        .map_err(pg_error)?
        .get(0);
    let elapsed = started.elapsed();
    check(
        taken as u64,
        released as u64,
        keys.len(),
        "the advisory locks",
    )?;
    Ok(elapsed)
}

async fn per_key(client: &Client, keys: &[String], owner: &str) -> Result<Duration, String> {
    let insert = "INSERT INTO bench_minimal VALUES ($1, $2) ON CONFLICT DO NOTHING";
    let delete = "DELETE FROM bench_minimal WHERE key = $1 AND owner = $2";
    let (insert, delete) = (
        prepared(client, insert).await?,
        prepared(client, delete).await?,
    );
    let started = Instant::now();
    let (mut taken, mut released) = (0, 0);
    for key in keys {
        taken += client
            .execute(&insert, &[key, &owner])
            .await
            .map_err(pg_error)?;
    }
    for key in keys {
        released += client
            .execute(&delete, &[key, &owner])
            .await
            .map_err(pg_error)?;
    }
    let elapsed = started.elapsed();
    check(taken, released, keys.len(), "a statement a key")?;
    Ok(elapsed)
}

/// `sql`, prepared (outside the time measured), as the store prepares its own calls once
/// per connection: a statement prepared anew costs a round trip more.
async fn prepared(client: &Client, sql: &str) -> Result<tokio_postgres::Statement, String> {
    client.prepare(sql).await.map_err(pg_error)
}

/// Every key was taken and released: a baseline that did less would flatter itself.
fn check(taken: u64, released: u64, keys: usize, what: &str) -> Result<(), String> {
    if taken != keys as u64 || released != keys as u64 {
        return Err(format!(
            "{what} took {taken} and released {released} of {keys} keys"
        ));
    }
    Ok(())
}

/// `count` stores on the PostgreSQL at `url` (as `count` processes would have), over a lock
/// table made and emptied: a case inherits no locks or reservations of the one before.
pub(crate) async fn empty_stores(url: &str, count: usize) -> Result<Vec<Locks>, String> {
    let stores: Vec<Locks> = (0..count)
        .map(|_| Postgres::url(url).build().map(Locks::new))
        .collect::<Result<_, _>>()
        .map_err(pg_error)?;
    if let Some(first) = stores.first() {
        first.check().await.map_err(|e| e.to_string())?;
    }
    connect(url)
        .await?
        .batch_execute("TRUNCATE tower_batch_lock.locks")
        .await
        .map_err(pg_error)?;
    Ok(stores)
}

pub(crate) async fn connect(url: &str) -> Result<Client, String> {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(pg_error)?;
    tokio::spawn(connection);
    Ok(client)
}

pub(crate) fn pg_error(error: tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("PostgreSQL: {}", db.message()),
        None => error.to_string(),
    }
}
