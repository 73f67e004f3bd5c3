//! The PostgreSQL store, driven through the layer: two `Locks` on one database are two
//! processes. Each test has a database of its own on the local server, dropped at its end
//! (`support::postgres`); the semantics every store shares are checked by `spec`.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use futures_util::StreamExt;
use http::StatusCode;
use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
use postgres_openssl::MakeTlsConnector;
use tower_batch_lock::{
    store::Postgres,
    tokio_postgres::{self, error::SqlState, AsyncMessage, NoTls},
    KeyStatus, Lease, Locks, Wait,
};

use crate::support::{
    clock_floor,
    handlers::{counting_handler, gated_handler, hold, Gate},
    http::{batch, batch_router, fence_router, poll_every, send, Fence},
    pg_server::{PgBouncer, PgServer},
    postgres::Database,
    proxy::{Fault, Proxy},
};

fn locks(db: &Database) -> Locks {
    Locks::new(Postgres::url(db.url()).build().unwrap()).ttl(Duration::from_secs(10))
}

/// The lock rows of the default table, as `key` sorted.
fn rows(db: &Database) -> Vec<String> {
    let keys = db.query("SELECT key FROM tower_batch_lock.locks ORDER BY key");
    keys.lines().map(str::to_owned).collect()
}

/// A transaction of its own that keeps the row of `lock:k` (as a user's guarded
/// transaction that runs long would) until its client sends `COMMIT`.
async fn keep_row_of_k(db: &Database) -> tokio_postgres::Client {
    keep_row(db, "lock:k").await
}

/// [`keep_row_of_k`] for the row of `key`.
async fn keep_row(db: &Database, key: &str) -> tokio_postgres::Client {
    let (keeper, connection) = tokio_postgres::connect(&db.url(), NoTls).await.unwrap();
    tokio::spawn(connection);
    keeper
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM tower_batch_lock.locks WHERE key = '{key}' FOR UPDATE"
        ))
        .await
        .unwrap();
    keeper
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_intersecting_batch_of_another_process_is_refused_and_writes_nothing() {
    let db = Database::create();
    let (one, other) = (locks(&db), locks(&db));
    one.check().await.expect("the store makes its schema");
    let gate = Gate::new();
    let holder = batch_router(&one, gated_handler(&gate));
    let held = tokio::spawn(async move { send(&holder, batch(&["x", "y"])).await });
    gate.wait_entered().await;
    assert_eq!(rows(&db), ["lock:x", "lock:y"]);

    let runs = Arc::new(AtomicUsize::new(0));
    let contender = batch_router(&other, counting_handler(&runs));
    let refused = send(&contender, batch(&["y", "z"])).await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["y"])
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(rows(&db), ["lock:x", "lock:y"], "no row for lock:z");
    // Disjoint keys go at once.
    assert_eq!(
        send(&contender, batch(&["p", "q"])).await.status,
        StatusCode::OK
    );

    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert_eq!(
        send(&contender, batch(&["y", "z"])).await.status,
        StatusCode::OK
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert!(rows(&db).is_empty(), "{:?}", rows(&db));
}

/// A release in one process notifies the channel, and the waiter of another process,
/// first in line, is woken by it and granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_in_another_process_is_woken_by_the_release_notification() {
    let db = Database::create();
    let (first, second) = (
        locks(&db),
        locks(&db).wait(Wait::up_to(Duration::from_secs(5))),
    );
    first.check().await.unwrap();
    let (_listener, mut heard) = listen(&db).await;

    let gate = Gate::new();
    let holder = batch_router(&first, gated_handler(&gate));
    let held = tokio::spawn(async move { send(&holder, batch(&["a", "b"])).await });
    gate.wait_entered().await;
    let waiter = batch_router(&second, counting_handler(&Arc::default()));
    let waiting = tokio::spawn(async move {
        let reply = send(&waiter, batch(&["b", "c"])).await;
        (reply, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the waiter waits for `b`");
    let waiters =
        db.query("SELECT count(*) FROM tower_batch_lock.locks, unnest(line) WHERE key = 'lock:b'");
    assert_eq!(waiters, "1", "the waiter reserved `b`");
    let released = Instant::now();
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let (reply, granted) = waiting.await.unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    eprintln!("granted {:?} after the release", granted - released);
    let message = tokio::time::timeout(Duration::from_secs(2), heard.recv())
        .await
        .expect("the release notified the channel")
        .unwrap();
    assert!(
        message.contains(",#"),
        "the release names the waiter first in line: {message}"
    );
    assert!(rows(&db).is_empty(), "{:?}", rows(&db));
}

/// The payloads of the release notifications on the default table's channel, as a
/// process's listener hears them while the returned client lives.
async fn listen(
    db: &Database,
) -> (
    tokio_postgres::Client,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let config: tokio_postgres::Config = db.url().parse().unwrap();
    let (client, mut connection) = config.connect(NoTls).await.unwrap();
    let (sender, heard) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(n) = message {
                let _ = sender.send(n.payload().to_owned());
            }
        }
    });
    client
        .batch_execute("LISTEN \"tower_batch_lock.locks\"")
        .await
        .unwrap();
    (client, heard)
}

/// The ticket of the waiter whose refused attempt left its turn on `key` (a turn not
/// handed over yet: there is one at a time), once there is one; at most 5 s.
async fn waiting_turn(db: &Database, key: &str) -> String {
    let turn = format!(
        "SELECT ticket FROM tower_batch_lock.locks_turns WHERE key = '{key}' AND token IS NULL"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ticket = db.query(&turn);
        if !ticket.is_empty() {
            assert!(
                !ticket.contains('\n'),
                "one waiter's turn on {key}: {ticket}"
            );
            return ticket;
        }
        assert!(
            Instant::now() < deadline,
            "no waiter left its turn on {key}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A waiter in line for one key alone is granted it by its holder's release, in the
/// release's own statement (a hand-over: its refused attempt left its turn in
/// `locks_turns`), whether it waits in the releasing process or in another: the release
/// names the grant (`#<ticket>:<token>:<hold>`), the waiter answers with that token (or a
/// later one, when a poll of its own crossed the hand-over), after the holder's, and its
/// guard releases the hold it was handed: no row is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_of_one_key_is_handed_it_by_the_release_in_either_process() {
    let db = Database::create();
    let holding = locks(&db);
    holding.check().await.unwrap();
    let waits = Wait::up_to(Duration::from_secs(5));
    for (process, waiting) in [
        ("same", holding.clone().wait(waits)),
        ("other", locks(&db).wait(waits)),
    ] {
        let gate = Gate::new();
        let holder = batch_router(&holding, gated_handler(&gate));
        let held = tokio::spawn(async move { send(&holder, batch(&["k"])).await });
        gate.wait_entered().await;
        let holders_token = gate.lease().fencing_token().get();
        let (_listener, mut heard) = listen(&db).await;
        let waiter = fence_router(&waiting);
        let waiting = tokio::spawn(async move { send(&waiter, batch(&["k"])).await });
        waiting_turn(&db, "lock:k").await;
        gate.open();
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
        let reply = waiting.await.unwrap();
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "{process}: {:?}",
            reply.problem()
        );
        let token: u64 = std::str::from_utf8(&reply.body).unwrap().parse().unwrap();
        let message = tokio::time::timeout(Duration::from_secs(2), heard.recv())
            .await
            .expect("the release notified the channel")
            .unwrap();
        let handed: u64 = message
            .split(",#")
            .nth(1)
            .and_then(|head| head.split(':').nth(1))
            .unwrap_or_else(|| panic!("{process}: no hand-over named in {message}"))
            .parse()
            .unwrap();
        assert!(
            holders_token < handed && handed <= token,
            "{process}: holder {holders_token}, handed {handed}, answered {token}"
        );
        assert!(rows(&db).is_empty(), "{process}: {:?}", rows(&db));
    }
}

/// A key handed over is held a whole TTL from the hand-over, as the waiter counts it (from
/// its refused attempt, before): the release, which waited 300 ms for another row of its
/// batch first (a user's transaction kept it), counted it from its own start.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_handed_over_after_the_release_waited_is_held_a_whole_ttl() {
    let db = Database::create();
    let locks = locks(&db).wait(Wait::up_to(Duration::from_secs(5)));
    let (holders, waiters) = (Gate::new(), Gate::new());
    let holder = batch_router(&locks, gated_handler(&holders));
    let held = tokio::spawn(async move { send(&holder, batch(&["a", "k"])).await });
    holders.wait_entered().await;
    let waiter = batch_router(&locks, gated_handler(&waiters));
    let waiting = tokio::spawn(async move { send(&waiter, batch(&["k"])).await });
    waiting_turn(&db, "lock:k").await;
    // The release frees `a` first, whose row a transaction keeps for 300 ms (the release
    // waits up to 500 ms for it), then hands `k` over.
    let keeper = keep_row(&db, "lock:a").await;
    holders.open();
    tokio::time::sleep(Duration::from_millis(300)).await;
    keeper.batch_execute("COMMIT").await.unwrap();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    waiters.wait_entered().await;
    let ttl = locks.inspect(["k"]).await.unwrap()[0].ttl().unwrap();
    assert!(
        ttl > Duration::from_millis(9_750),
        "the key handed over ends in {ttl:?} of its 10 s"
    );
    waiters.open();
    assert_eq!(waiting.await.unwrap().status, StatusCode::OK);
}

/// A hand-over is believed only when it names the hold of one of the waiter's refused
/// attempts, which the database and the waiter alone know: a notification that anybody
/// connected to the database may send, naming the waiter's ticket with another hold,
/// grants nothing; the waiter waits on, and its holder's release grants it the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forged_hand_over_grants_nothing() {
    let db = Database::create();
    let holding = locks(&db);
    holding.check().await.unwrap();
    let waiting = locks(&db).wait(Wait::up_to(Duration::from_secs(5)));
    let gate = Gate::new();
    let holder = batch_router(&holding, gated_handler(&gate));
    let held = tokio::spawn(async move { send(&holder, batch(&["k"])).await });
    gate.wait_entered().await;
    let holders_token = gate.lease().fencing_token().get();
    let waiter = fence_router(&waiting);
    let waiting = tokio::spawn(async move { send(&waiter, batch(&["k"])).await });
    let ticket = waiting_turn(&db, "lock:k").await;
    db.query(&format!(
        "NOTIFY \"tower_batch_lock.locks\", '1,@1,#{ticket}:999999:42'"
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "a forged hand-over granted the waiter"
    );
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let reply = waiting.await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.problem());
    let token: u64 = std::str::from_utf8(&reply.body).unwrap().parse().unwrap();
    assert!(token > holders_token && token != 999_999, "{token}");
    assert!(rows(&db).is_empty(), "{:?}", rows(&db));
}

/// A waiter handed its key whose own attempt crossed the hand-over (it polled, or its
/// wake-up was lost) is granted by that attempt, under the attempt's hold, and nothing of
/// the handed hold is left; its release hands the key to the next waiter, who gives up
/// without taking it: its withdrawal frees the key. Called as the store calls them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handed_key_is_taken_by_the_waiters_own_attempt_or_freed_by_its_withdrawal() {
    let db = database_with_schema().await;
    let owner = |n: u8| format!("00000000-0000-0000-0000-0000000000{n:02x}");
    let acquire = |n: u8, hold: u32, ticket: u32| {
        db.query(&format!(
            "SELECT coalesce(token::text, 'refused') FROM tower_batch_lock.locks_acquire(\
             ARRAY['lock:k'], 'x', '{}', {hold}, 10000, 1, {ticket}, 30000, false)",
            owner(n)
        ))
    };
    let release = |n: u8, hold: u32| {
        db.query(&format!(
            "SELECT released, heads FROM tower_batch_lock.locks_release(\
             ARRAY['lock:k'], '{}', {hold}, 'm')",
            owner(n)
        ))
    };
    let held = || db.query("SELECT owner, holds FROM tower_batch_lock.locks WHERE key = 'lock:k'");
    let first: u64 = acquire(1, 10, 1).parse().expect("granted");
    assert_eq!(acquire(2, 20, 2), "refused");
    assert_eq!(acquire(3, 30, 3), "refused");
    assert_eq!(
        db.query(
            "SELECT string_agg(ticket || ':' || hold, ',' ORDER BY ticket) \
                  FROM tower_batch_lock.locks_turns WHERE token IS NULL"
        ),
        "2:20,3:30"
    );

    // The release hands the key to waiter 2, under the hold of its refused attempt.
    let handed = release(1, 10);
    let token: u64 = handed
        .strip_prefix("1|{2:")
        .and_then(|rest| rest.strip_suffix(":20}"))
        .unwrap_or_else(|| panic!("handed to 2: {handed}"))
        .parse()
        .unwrap();
    assert!(token > first);
    assert_eq!(held(), format!("{}|{{20}}", owner(2)));
    // Its own attempt crossed that: granted, under its own hold, with a later token.
    let taken: u64 = acquire(2, 21, 2).parse().expect("granted");
    assert!(taken > token);
    assert_eq!(held(), format!("{}|{{21}}", owner(2)));
    // Its release hands the key to waiter 3, and leaves nothing of hold 20.
    let next = release(2, 21);
    assert!(
        next.starts_with("1|{3:") && next.ends_with(":30}"),
        "{next}"
    );
    assert_eq!(held(), format!("{}|{{30}}", owner(3)));
    // Waiter 3 gives up without taking it: the key is free, no turn is left.
    assert_eq!(
        db.query(
            "SELECT withdrawn, heads FROM tower_batch_lock.locks_withdraw(ARRAY['lock:k'], 3, 'm')"
        ),
        "1|{}"
    );
    assert!(rows(&db).is_empty(), "{:?}", rows(&db));
    assert_eq!(
        db.query("SELECT count(*) FROM tower_batch_lock.locks_turns"),
        "0"
    );
}

/// The operator's view and `force_release`, and the idempotency answers, on the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_sees_a_held_batch_and_frees_it() {
    let db = Database::create();
    let locks = locks(&db);
    let gate = Gate::new();
    let holder = batch_router(&locks, gated_handler(&gate));
    let held = tokio::spawn(async move { send(&holder, batch(&["m", "n"])).await });
    gate.wait_entered().await;
    let seen = locks.inspect(["m", "n", "o"]).await.unwrap();
    let statuses: Vec<KeyStatus> = seen.iter().map(|k| k.status()).collect();
    assert_eq!(
        statuses,
        [KeyStatus::Held, KeyStatus::Held, KeyStatus::Free]
    );
    assert!(seen[0]
        .ttl()
        .is_some_and(|ttl| ttl <= Duration::from_secs(10)));
    assert_eq!(locks.force_release(["m", "n"], "test").await.unwrap(), 2);
    assert!(rows(&db).is_empty());
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
}

/// A proxy to the local server, and locks on `db` through it with `store_timeout`, their
/// schema made.
async fn behind_a_proxy(db: &Database, store_timeout: Duration) -> (Proxy, Locks) {
    let proxy = Proxy::start(5432).await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/{}",
        proxy.port(),
        db.name()
    );
    let locks = Locks::new(Postgres::url(url).build().unwrap()).store_timeout(store_timeout);
    locks.check().await.unwrap();
    (proxy, locks)
}

/// A connection whose call got no answer in time is given up, not given back to the pool,
/// where the next call queued behind the statement still on it: with a server gone silent
/// without closing its connections (a host gone, an address moved in a failover), every
/// call got 503 until the kernel gave the connection up, minutes later. And
/// `Locks::check` asks the server, where a pooled connection answered it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_gone_silent_is_given_up_with_its_call_and_the_next_call_connects_again() {
    let db = Database::create();
    let (proxy, locks) = behind_a_proxy(&db, Duration::from_millis(300)).await;
    // The connections open now go silent; new ones pass.
    proxy.hold_open();
    assert!(
        locks.check().await.is_err(),
        "the check answered without the server"
    );
    let give_up = Instant::now() + Duration::from_secs(3);
    while locks.inspect(["k"]).await.is_err() {
        assert!(
            Instant::now() < give_up,
            "every call after the silent connection got no answer"
        );
    }
    proxy.release_held();
}

/// A busy server is not a down one: a connection whose call outlived the store's timeout
/// but whose server answers soon after goes back to the pool, rather than being given up
/// for a new one at every timeout (connections the server must make, under the very load
/// that made it slow).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_call_answers_late_is_kept_not_made_again() {
    let db = Database::create();
    let (proxy, locks) = behind_a_proxy(&db, Duration::from_millis(150)).await;
    let sessions = || -> u64 {
        let sql = format!(
            "SELECT sessions FROM pg_stat_database WHERE datname = '{}'",
            db.name()
        );
        db.query(&sql).parse().unwrap()
    };
    let before = sessions();
    // Every round trip takes 200 ms: each call times out, and its connection answers
    // 50 ms later.
    proxy.set(Fault::Latency(Duration::from_millis(100)));
    for _ in 0..10 {
        assert!(locks.inspect(["k"]).await.is_err());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let made = sessions() - before;
    assert!(made <= 3, "{made} connections made for 10 slow calls");
    proxy.set(Fault::None);
}

/// Behind PgBouncer in transaction mode, where each transaction may run on another of its
/// server connections, a store with `transaction_pooling` answers as on the server: a
/// batch held by one process and refused to the other, waiters granted in turn (one
/// listening at the server itself, the other polling), the operator's view, and nothing
/// left. Without the setting, statements prepared on one server
/// connection meet another: calls fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn behind_pgbouncer_in_transaction_mode_every_call_works() {
    let db = Database::create();
    let bouncer = PgBouncer::start();
    let url = bouncer.url(db.name());
    let pooled = Postgres::url(&url).transaction_pooling(true);
    let one = Locks::new(pooled.clone().wakeups(&db.url()).unwrap().build().unwrap());
    let other = Locks::new(pooled.build().unwrap());
    one.check()
        .await
        .expect("the store makes its schema through the pooler");

    let gate = Gate::new();
    let holder = batch_router(&one, gated_handler(&gate));
    let held = tokio::spawn(async move { send(&holder, batch(&["x", "y"])).await });
    gate.wait_entered().await;
    let refused = send(
        &batch_router(&other, counting_handler(&Arc::default())),
        batch(&["y", "z"]),
    )
    .await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["y"])
    );
    let seen = other.inspect(["x", "z"]).await.unwrap();
    assert_eq!(seen[0].status(), KeyStatus::Held);
    assert_eq!(seen[1].status(), KeyStatus::Free);

    // Waiters of both processes on the held keys, and more than the pooler's 4 server
    // connections at once.
    let runs = Arc::new(AtomicUsize::new(0));
    let mut waiters = Vec::new();
    for i in 0..12 {
        let store = if i % 2 == 0 { &one } else { &other };
        let waiting = store.clone().wait(Wait::up_to(Duration::from_secs(10)));
        let app = batch_router(&waiting, counting_handler(&runs));
        let keys = [["x", "q"], ["y", "r"], ["x", "y"]][i % 3];
        waiters.push(tokio::spawn(async move { send(&app, batch(&keys)).await }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    for waiter in waiters {
        assert_eq!(waiter.await.unwrap().status, StatusCode::OK);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 12);
    assert!(rows(&db).is_empty(), "{:?}", rows(&db));

    // The same pooler without the setting: a statement prepared on one server connection
    // is executed on another.
    let prepared = Locks::new(Postgres::url(&url).build().unwrap());
    let app = batch_router(&prepared, counting_handler(&Arc::default()));
    let mut statuses = Vec::new();
    for round in 0..4 {
        let sent = (0..8).map(|i| {
            let app = app.clone();
            async move { send(&app, batch(&[&format!("p{round}-{i}")])).await.status }
        });
        statuses.extend(futures_util::future::join_all(sent).await);
    }
    assert!(
        statuses.contains(&StatusCode::SERVICE_UNAVAILABLE),
        "{statuses:?}"
    );
}

/// The schema goes where it is told, once, with a version; a store that may not make it
/// says what is missing; a table of another version is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_schema_is_made_once_where_configured_and_its_version_is_checked() {
    let db = Database::create();
    let forbidden = Locks::new(
        Postgres::url(db.url())
            .schema("app_locks")
            .create_schema(false)
            .build()
            .unwrap(),
    );
    let missing = forbidden.check().await.unwrap_err().to_string();
    assert!(missing.contains("app_locks.locks is missing"), "{missing}");

    // Several processes at once make it once.
    let stores: Vec<Locks> = (0..4)
        .map(|_| {
            Locks::new(
                Postgres::url(db.url())
                    .schema("app_locks")
                    .table("batch_locks")
                    .build()
                    .unwrap(),
            )
        })
        .collect();
    let checks = futures_util::future::join_all(stores.iter().map(Locks::check)).await;
    assert!(checks.iter().all(Result::is_ok), "{checks:?}");
    assert_eq!(
        db.query("SELECT app_locks.batch_locks_version()"),
        "1",
        "the schema has its version"
    );
    let app = batch_router(&stores[0], counting_handler(&Arc::default()));
    assert_eq!(send(&app, batch(&["k"])).await.status, StatusCode::OK);

    // The SQL for migrations is what the store runs: running it again changes nothing.
    let sql = Postgres::url(db.url())
        .schema("app_locks")
        .table("batch_locks")
        .schema_sql();
    db.query(&sql);
    db.query(
        "CREATE OR REPLACE FUNCTION app_locks.batch_locks_version() RETURNS int \
         LANGUAGE sql AS 'SELECT 2'",
    );
    let newer = Locks::new(
        Postgres::url(db.url())
            .schema("app_locks")
            .table("batch_locks")
            .build()
            .unwrap(),
    );
    let refused = newer.check().await.unwrap_err().to_string();
    assert!(refused.contains("schema version 2"), "{refused}");
}

/// Rows nobody holds or reserves any more (a holder that died) keep nobody out, and go
/// with the sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rows_of_a_dead_holder_keep_nobody_out_and_are_swept() {
    let db = Database::create();
    let locks = locks(&db);
    locks.check().await.unwrap();
    // As a crashed process leaves them: held until a moment ago, never released.
    db.query(
        "INSERT INTO tower_batch_lock.locks (key, owner, holds, modes, ends) \
         SELECT 'lock:' || i, gen_random_uuid(), ARRAY[1::bigint], 'x', \
                clock_timestamp() - interval '1 ms' FROM generate_series(1, 1500) i",
    );
    let app = batch_router(&locks, counting_handler(&Arc::default()));
    assert_eq!(send(&app, batch(&["1", "2"])).await.status, StatusCode::OK);
    assert_eq!(
        db.query("SELECT tower_batch_lock.locks_sweep(1000)"),
        "1000",
        "a sweep takes a batch at a time"
    );
    assert_eq!(db.query("SELECT tower_batch_lock.locks_sweep(1000)"), "498");
    assert!(rows(&db).is_empty());
}

/// No statement of the store runs a plan that sequential scans were turned off for: the
/// functions set `enable_seqscan = off` (a table is read by its key), which prices a
/// query that still scans at ten billion (from PostgreSQL 18, counts it as disabled) and
/// leaves it a slow plan; up to 17, above any `jit_above_cost` too, so that it was also
/// compiled by JIT at each call, 10-20 ms (it happened twice, and only the bench saw it).
/// `auto_explain` logs the plan of every statement, nested ones included, and
/// `pg_stat_statements` counts what was compiled (with the server's default JIT settings,
/// where this server has JIT), over grants, a renewal, waiters in line (with reservations
/// and with a claim), a hand-over, one that gives up, releases, `inspect` and
/// `force_release`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_statement_of_the_store_runs_a_disabled_scan_or_is_compiled_by_jit() {
    let server = PgServer::start_with_settings(
        "shared_preload_libraries = 'pg_stat_statements, auto_explain'\n\
         pg_stat_statements.track = all\n\
         auto_explain.log_min_duration = 0\n\
         auto_explain.log_nested_statements = on",
    );
    server.query("CREATE EXTENSION pg_stat_statements");
    let jitted = |like: &str| {
        server.query(&format!(
            "SELECT coalesce(sum(jit_functions), 0) FROM pg_stat_statements \
             WHERE query LIKE '{like}'"
        ))
    };
    // The log shows a disabled scan, or the test proves nothing; JIT compiles it, or
    // that half proves nothing.
    server.query("CREATE TABLE scan_probe (x int)");
    server.query("SET enable_seqscan = off; SELECT count(*) FROM scan_probe");
    let with_jit = jitted("%FROM scan_probe%") != "0";
    assert_eq!(disabled_plans(&server.log()).len(), 1, "{}", server.log());
    let locks = Locks::new(Postgres::url(server.url()).build().unwrap())
        .ttl(Duration::from_millis(900))
        .wait(Wait::up_to(Duration::from_secs(5)));
    locks.check().await.unwrap();
    server.query("SELECT pg_stat_statements_reset()");
    let logged_before = server.log().len();

    let gate = Gate::new();
    let app = batch_router(&locks, gated_handler(&gate));
    let held = tokio::spawn({
        let app = app.clone();
        async move { send(&app, batch(&["a", "b"])).await }
    });
    gate.wait_entered().await;
    let counted = batch_router(&locks, counting_handler(&Arc::default()));
    let many: Vec<String> = (0..100)
        .map(|i| format!("m{i}"))
        .chain(["a".into()])
        .collect();
    let waiters: Vec<_> = [vec!["b".to_owned()], vec!["b".into(), "c".into()], many]
        .into_iter()
        .map(|keys| {
            let app = counted.clone();
            tokio::spawn(async move { send(&app, batch(&keys)).await })
        })
        .collect();
    let impatient = batch_router(
        &locks.clone().wait(Wait::up_to(Duration::from_millis(100))),
        counting_handler(&Arc::default()),
    );
    assert_eq!(
        send(&impatient, batch(&["a"])).await.status,
        StatusCode::CONFLICT
    );
    // Past a third of the TTL: renewed.
    tokio::time::sleep(Duration::from_millis(400)).await;
    locks.inspect(["a", "b", "z"]).await.unwrap();
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    for waiter in waiters {
        assert_eq!(waiter.await.unwrap().status, StatusCode::OK);
    }
    let (gate, held) = hold(&locks, "z").await;
    locks.force_release(["z"], "a test").await.unwrap();
    gate.open();
    held.await.unwrap();

    let log = server
        .log()
        .get(logged_before..)
        .unwrap_or_default()
        .to_owned();
    let plans = log.matches("Query Text:").count();
    assert!(plans > 20, "auto_explain logged {plans} plans");
    let disabled = disabled_plans(&log);
    assert!(
        disabled.is_empty(),
        "disabled scans: {}",
        disabled.join("\n")
    );
    let compiled = server.query(
        "SELECT coalesce(string_agg(jit_functions || ' in ' || query, ' | '), '') \
         FROM pg_stat_statements WHERE jit_functions > 0",
    );
    assert_eq!(compiled, "", "compiled by JIT");
    eprintln!(
        "postgres: {plans} plans logged, none with a disabled scan; {}",
        if with_jit {
            "none compiled by JIT"
        } else {
            "this server has no JIT"
        }
    );
}

/// The plans in `log` (`auto_explain`'s) with a node that the planner took though it was
/// turned off: priced at ten billion or more up to PostgreSQL 17, marked `Disabled` from
/// 18.
fn disabled_plans(log: &str) -> Vec<&str> {
    let disabled = |line: &str| {
        let cost = line
            .split("cost=")
            .nth(1)
            .and_then(|c| c.split("..").next());
        line.contains("Disabled: true")
            || cost
                .and_then(|c| c.parse::<f64>().ok())
                .is_some_and(|c| c >= 1e10)
    };
    log.split("Query Text:")
        .skip(1)
        .filter(|plan| plan.lines().any(disabled))
        .collect()
}

/// Of two grants that meet a new server at once (the fenced-on row names another), one
/// raises the fencing sequence, and the other waits for its commit and takes the next
/// token. Two raises could each read the sequence before the other's `setval`, and set it
/// back below a token just handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_grants_that_meet_a_new_server_one_raises_the_fence() {
    let db = Database::create();
    locks(&db).check().await.unwrap();
    db.query(
        "INSERT INTO tower_batch_lock.locks_fenced_on (server) VALUES ('another') \
         ON CONFLICT (id) DO UPDATE SET server = excluded.server",
    );
    let connect = || async {
        let (client, connection) = tokio_postgres::connect(&db.url(), NoTls).await.unwrap();
        tokio::spawn(connection);
        client
    };
    let (first_grant, second_grant) = (connect().await, connect().await);
    let granted = "SELECT tower_batch_lock.locks_granted(NULL)";
    first_grant.batch_execute("BEGIN").await.unwrap();
    let first: i64 = first_grant.query_one(granted, &[]).await.unwrap().get(0);
    let second = tokio::spawn(async move {
        let row = second_grant.query_one(granted, &[]).await.unwrap();
        row.get::<_, i64>(0)
    });
    // A raise of its own would take the clock's floor of a later moment: far above.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the second grant did not wait for the first"
    );
    first_grant.batch_execute("COMMIT").await.unwrap();
    assert_eq!(second.await.unwrap(), first + 1);
}

/// A failover to a replica that was behind (asynchronous replication): its fencing
/// sequence is where the replica last replayed it, behind tokens the primary handed out
/// since, and the first grant on it (a new timeline) raises it first, without an operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_growing_across_a_failover_to_a_replica_that_was_behind() {
    let primary = PgServer::start();
    let replica = PgServer::standby_of(&primary);
    let on_primary = Locks::new(Postgres::url(primary.url()).build().unwrap());
    let app = fence_router(&on_primary);
    let first = send(&app, batch(&["f"])).await.fence();
    // The replica has replayed the schema and the first grant, then stops following.
    // The insert position: the release, committed lazily, may not be written out yet.
    let written = primary.query("SELECT pg_current_wal_insert_lsn()");
    let caught_up = poll_every(Duration::from_millis(50), Duration::from_secs(10), || {
        replica.query(&format!("SELECT pg_last_wal_replay_lsn() >= '{written}'")) == "t"
    })
    .await;
    assert!(caught_up.is_some(), "the replica never replayed {written}");
    replica.stop();
    // More grants than the sequence logs ahead (32): the replica has none of them.
    let mut last = first;
    for _ in 0..100 {
        let token = send(&app, batch(&["f"])).await.fence();
        assert!(token > last);
        last = token;
    }
    primary.kill();
    replica.run();
    replica.promote();

    let on_replica = Locks::new(Postgres::url(replica.url()).build().unwrap());
    let after = send(&fence_router(&on_replica), batch(&["f"]))
        .await
        .fence();
    eprintln!("postgres failover: tokens {first}..{last} on the primary, {after} on the replica");
    assert!(
        after > last,
        "token {after} after {last}: the fence went backwards"
    );
}

/// PostgreSQL killed under load (a crash: no checkpoint) and started again: requests get
/// only 503 while it is down, never a hang or another error; grants resume by themselves
/// once it is back; fencing tokens keep growing across the crash (the sequence replays from
/// the WAL, and may skip, never repeat); and no lock is left once the dust settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_killed_under_load_answers_503_then_grants_again_with_larger_tokens() {
    let server = Arc::new(PgServer::start());
    let locks = Locks::new(Postgres::url(server.url()).build().unwrap())
        .ttl(Duration::from_secs(3))
        .store_timeout(Duration::from_millis(500));
    locks.check().await.unwrap();
    let app = batch_router(&locks, |lease: Lease| async move {
        lease.fencing_token().get().to_string()
    });
    // Every answer: its status, its token when granted, when it was sent and answered.
    type Answer = (StatusCode, Option<u64>, Instant, Instant);
    let answers: Arc<std::sync::Mutex<Vec<Answer>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load: Vec<_> = (0..8)
        .map(|client| {
            let (app, answers, stop) = (app.clone(), answers.clone(), stop.clone());
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(30);
                for i in 0..20_000 {
                    if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
                        break;
                    }
                    let key = format!("k{}", (client * 7 + i) % 40);
                    let sent = Instant::now();
                    let reply = send(&app, batch(&[key])).await;
                    let token =
                        (reply.status == StatusCode::OK).then(|| reply.text().parse().unwrap());
                    answers
                        .lock()
                        .unwrap()
                        .push((reply.status, token, sent, Instant::now()));
                    if reply.status != StatusCode::OK {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let killed = Instant::now();
    let victim = server.clone();
    tokio::task::spawn_blocking(move || victim.kill())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (back, restarting) = (server.clone(), Instant::now());
    tokio::task::spawn_blocking(move || back.run())
        .await
        .unwrap();
    let restarted = Instant::now();
    // Grants resume by themselves.
    let resumed = crate::support::http::poll_every(
        Duration::from_millis(50),
        Duration::from_secs(10),
        || {
            let answers = answers.lock().unwrap();
            answers
                .iter()
                .any(|(status, _, sent, _)| *status == StatusCode::OK && *sent > restarted)
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    for client in load {
        client.await.unwrap();
    }
    let answers = std::mem::take(&mut *answers.lock().unwrap());
    assert!(resumed.is_some(), "no grant within 10 s of the restart");
    let others: Vec<_> = answers
        .iter()
        .filter(|(status, ..)| ![200, 409, 503].contains(&status.as_u16()))
        .collect();
    assert!(
        others.is_empty(),
        "answers other than 200, 409 and 503: {others:?}"
    );
    let down = answers.iter().filter(|(_, _, sent, _)| {
        *sent > killed + Duration::from_millis(100) && *sent < restarting
    });
    let statuses: Vec<u16> = down.map(|(status, ..)| status.as_u16()).collect();
    assert!(!statuses.is_empty(), "requests were sent while it was down");
    assert!(
        statuses.iter().all(|&status| status == 503),
        "while it was down: {statuses:?}"
    );
    let before = answers
        .iter()
        .filter(|(_, _, _, answered)| *answered < killed)
        .filter_map(|(_, token, ..)| *token)
        .max()
        .expect("grants before the kill");
    let after = answers
        .iter()
        .filter(|(_, _, sent, _)| *sent > restarted)
        .filter_map(|(_, token, ..)| *token)
        .min()
        .expect("grants after the restart");
    eprintln!(
        "{} answers; last token before the crash {before}, first after {after}",
        answers.len()
    );
    assert!(after > before, "tokens went back: {before} then {after}");
    // Holds granted just before the crash end by their TTL at the latest.
    let settled = crate::support::http::poll_every(
        Duration::from_millis(100),
        Duration::from_secs(6),
        || {
            server
                .query("SELECT count(*) FROM tower_batch_lock.locks WHERE ends > clock_timestamp()")
                == "0"
        },
    )
    .await;
    assert!(settled.is_some(), "a lock outlived its TTL");
}

/// A big batch (it looks before it locks) with one key held: refused, it writes nothing;
/// waiting, it claims its whole batch (one row of the claims table, and no write to its
/// keys' rows), is granted when the key is released, and leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_big_batch_with_one_held_key_is_refused_or_waits_in_line_for_it() {
    let db = Database::create();
    let (one, other) = (locks(&db), locks(&db));
    let gate = Gate::new();
    let holder = batch_router(&one, gated_handler(&gate));
    let held = tokio::spawn(async move { send(&holder, batch(&["k42"])).await });
    gate.wait_entered().await;
    let keys: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();

    let app = batch_router(&other, counting_handler(&Arc::default()));
    let refused = send(&app, batch(&keys)).await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["k42"])
    );
    assert_eq!(rows(&db), ["lock:k42"], "the refused batch wrote nothing");

    let waiting = other.clone().wait(Wait::up_to(Duration::from_secs(5)));
    let app = batch_router(&waiting, counting_handler(&Arc::default()));
    let request = batch(&keys);
    let waiter = tokio::spawn(async move { send(&app, request).await });
    let claimed =
        crate::support::http::poll_every(Duration::from_millis(20), Duration::from_secs(3), || {
            db.query("SELECT string_agg(cardinality(keys)::text, ',') FROM tower_batch_lock.locks_claims")
                == "100"
        })
        .await;
    assert!(claimed.is_some(), "the waiter claimed its whole batch");
    assert_eq!(rows(&db), ["lock:k42"], "the waiter wrote no row");
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert_eq!(waiter.await.unwrap().status, StatusCode::OK);
    assert!(rows(&db).is_empty(), "{:?}", rows(&db));
    assert_eq!(
        db.query("SELECT count(*) FROM tower_batch_lock.locks_claims"),
        "0",
        "the grant ended the claim"
    );
}

/// Big batches that overlap, from two processes at once, each first trying its keys as new
/// rows: one that finds a row undoes what it inserted before it waits for anyone, so that
/// no two wait for each other crosswise (which PostgreSQL would end with a deadlock error,
/// or the lock timeout): every batch is granted in turn, none answers 503, and no row
/// stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_big_batches_of_two_processes_are_all_granted_in_turn() {
    let db = Database::create();
    let stores = [locks(&db), locks(&db)];
    stores[0].check().await.expect("the store makes its schema");
    let mut requests = Vec::new();
    for round in 0..6 {
        for (i, store) in stores.iter().enumerate() {
            let waiting = store.clone().wait(Wait::up_to(Duration::from_secs(20)));
            let app = batch_router(&waiting, counting_handler(&Arc::default()));
            // 300 keys of 400, every batch in a different order of the same keys
            // before the layer sorts them: any two share 200 or more.
            let keys: Vec<String> = (0..400)
                .map(|k| (k * 7 + round * 31 + i * 13) % 400)
                .filter(|k| (k + round + i) % 4 != 0)
                .map(|k| format!("k{k}"))
                .collect();
            requests.push(tokio::spawn(async move { send(&app, batch(&keys)).await }));
        }
    }
    for request in requests {
        assert_eq!(request.await.unwrap().status, StatusCode::OK);
    }
    assert!(rows(&db).is_empty(), "{:?}", rows(&db));
}

/// A transaction that keeps a lock row longer than the acquire function waits for rows (a
/// user's guarded transaction that runs long) makes a request for that key wait, or get
/// 409 at once without a wait: never 503. (A row wait used to run into the store timeout,
/// 2 s, and answer 503.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_kept_by_a_long_transaction_makes_requests_wait_not_fail() {
    let db = Database::create();
    let locks = locks(&db);
    locks.check().await.expect("the store makes its schema");
    // A row for the key that holds nothing, kept by a transaction of its own.
    db.query("INSERT INTO tower_batch_lock.locks (key) VALUES ('lock:k')");
    let client = keep_row_of_k(&db).await;

    let runs = Arc::new(AtomicUsize::new(0));
    let now = batch_router(&locks.clone().wait(Wait::none()), counting_handler(&runs));
    let started = Instant::now();
    let refused = send(&now, batch(&["k"])).await;
    assert_eq!(
        refused.status,
        StatusCode::CONFLICT,
        "{:?}",
        refused.problem()
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );

    let patient = locks.clone().wait(Wait::up_to(Duration::from_secs(8)));
    let waiting = batch_router(&patient, counting_handler(&runs));
    let waiter = tokio::spawn(async move { send(&waiting, batch(&["k"])).await });
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(!waiter.is_finished(), "the waiter waits for the row");
    client.batch_execute("COMMIT").await.unwrap();
    let granted = waiter.await.unwrap();
    assert_eq!(granted.status, StatusCode::OK, "{:?}", granted.problem());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// On a database whose default isolation is stricter than READ COMMITTED, an attempt
/// that waited for a row another transaction changed is refused by the server (40001):
/// that is contention, answered 409, not a failed store.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_changed_under_a_stricter_isolation_is_contention_not_a_failure() {
    let db = Database::create();
    db.query(&format!(
        "ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'",
        db.name()
    ));
    let locks = locks(&db).wait(Wait::none());
    locks.check().await.expect("the store makes its schema");
    db.query("INSERT INTO tower_batch_lock.locks (key) VALUES ('lock:k')");
    let (changer, connection) = tokio_postgres::connect(&db.url(), NoTls).await.unwrap();
    tokio::spawn(connection);
    changer
        .batch_execute("BEGIN; UPDATE tower_batch_lock.locks SET line = NULL WHERE key = 'lock:k'")
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = batch_router(&locks, counting_handler(&runs));
    let attempt = tokio::spawn(async move { send(&app, batch(&["k"])).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    changer.batch_execute("COMMIT").await.unwrap();
    let refused = attempt.await.unwrap();
    assert_eq!(
        refused.status,
        StatusCode::CONFLICT,
        "{:?}",
        refused.problem()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// Every call that waits for a row another transaction keeps (a user's guarded
/// transaction that runs long) gives up after 500 ms, as an acquisition does: a release,
/// a renewal, a withdrawal and a forced release. Without a bound the statement waited on
/// the server past the store's timeout, and the pooled connection with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_call_waits_for_a_kept_row_at_most_half_a_second() {
    let db = database_with_schema().await;
    let owner = "00000000-0000-0000-0000-00000000000a";
    db.query(&format!(
        "INSERT INTO tower_batch_lock.locks (key, owner, holds, modes, ends) \
         VALUES ('lock:k', '{owner}', '{{1}}', 'x', clock_timestamp() + interval '1 hour')"
    ));
    let keeper = keep_row_of_k(&db).await;
    let (caller, connection) = tokio_postgres::connect(&db.url(), NoTls).await.unwrap();
    tokio::spawn(connection);
    let f = "tower_batch_lock.locks";
    for call in [
        format!("SELECT * FROM {f}_release(ARRAY['lock:k'], '{owner}', 1, 'm')"),
        format!("SELECT {f}_extend(ARRAY['lock:k'], '{owner}', 1, 10000)"),
        format!("SELECT * FROM {f}_withdraw(ARRAY['lock:k'], 7, 'm')"),
        format!("SELECT {f}_force_release(ARRAY['lock:k'], 'm')"),
    ] {
        let started = Instant::now();
        let error = tokio::time::timeout(Duration::from_secs(3), caller.batch_execute(&call))
            .await
            .unwrap_or_else(|_| panic!("{call}: still waiting for the row after 3 s"))
            .unwrap_err();
        assert_eq!(
            error.code(),
            Some(&SqlState::LOCK_NOT_AVAILABLE),
            "{call}: {error}"
        );
        assert!(
            started.elapsed() < Duration::from_millis(1_500),
            "{call}: {:?}",
            started.elapsed()
        );
    }
    keeper.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        db.query("SELECT count(*) FROM tower_batch_lock.locks WHERE holds = '{1}'"),
        "1",
        "nothing changed"
    );
}

/// A waiter whose withdrawal fails (its row kept by another transaction past the 500 ms a
/// call waits for it) withdraws again until the store answers: its place in line is gone
/// once the row is free, not at its deadline, and the key's next release has nobody gone
/// to hand the key to.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_withdrawal_is_retried_until_the_store_answers() {
    let db = Database::create();
    let locks = locks(&db);
    let (gate, held) = hold(&locks, "k").await;
    let patient = locks.clone().wait(Wait::up_to(Duration::from_secs(20)));
    let app = batch_router(&patient, counting_handler(&Arc::default()));
    let waiter = tokio::spawn(async move { send(&app, batch(&["k"])).await });
    waiting_turn(&db, "lock:k").await;

    let keeper = keep_row_of_k(&db).await;
    // Its client leaves: the withdrawal waits for the row, and gives up after 500 ms.
    waiter.abort();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    keeper.batch_execute("COMMIT").await.unwrap();

    let turns = "SELECT count(*) FROM tower_batch_lock.locks_turns";
    let line =
        "SELECT coalesce(cardinality(line), 0) FROM tower_batch_lock.locks WHERE key = 'lock:k'";
    let freed = Instant::now();
    while db.query(turns) != "0" || db.query(line) != "0" {
        assert!(
            freed.elapsed() < Duration::from_secs(3),
            "the place stayed: {} turns, a line of {}",
            db.query(turns),
            db.query(line)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert!(rows(&db).is_empty(), "{:?}", rows(&db));
}

/// A database of its own, with the store's schema made in it (for tests that call the
/// schema's functions as the store does).
async fn database_with_schema() -> Database {
    let db = Database::create();
    locks(&db)
        .check()
        .await
        .expect("the store makes its schema");
    db
}

/// The functions of the schema, called as the store calls them, on 100 keys.
const KEYS_100: &str = "(SELECT array_agg('lock:k' || lpad(i::text, 3, '0') ORDER BY i) \
                        FROM generate_series(0, 99) i)";

/// The keys `lock:k<from>` to `lock:k<to>` (three digits), sorted, as an SQL array: those
/// of [`KEYS_100`] from 0 to 99.
fn key_range(from: u32, to: u32) -> String {
    format!(
        "(SELECT array_agg('lock:k' || lpad(i::text, 3, '0') ORDER BY i) \
         FROM generate_series({from}, {to}) i)"
    )
}

/// Claims, as the store calls the functions: a big waiter's claim keeps later arrivals out
/// of its keys, held or free (a small one in no line, a later small waiter, which reserves
/// its key, and a later big waiter, which claims), and nobody out of the keys it does not
/// name; an owner that holds a key passes the claims on that key, and only on it (for its
/// attempt and its probe); a release wakes the earliest claim's waiter and not a later one
/// that an earlier claim overlaps; the first is granted from under its claim, which ends;
/// its release wakes the next claim's waiter and the small waiter; a withdrawal ends a
/// claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_keeps_later_arrivals_out_and_a_release_wakes_its_waiter_first() {
    let db = database_with_schema().await;
    let acquire =
        |keys: &str, owner: u8, hold: u8, ticket: &str, reserve: u32, free_first: bool| {
            db.query(&format!(
                "SELECT coalesce(token::text, 'refused ' || conflicts || ' ' || named::text) \
             FROM tower_batch_lock.locks_acquire({keys}, 'x', \
               '00000000-0000-0000-0000-0000000000{owner:02x}', {hold}, 10000, 3, \
               {ticket}, {reserve}, {free_first})"
            ))
        };
    let claims = || {
        db.query("SELECT string_agg(ticket || ':' || cardinality(keys), ',' ORDER BY ticket) FROM tower_batch_lock.locks_claims")
    };
    let one = |k: &str| format!("ARRAY['lock:{k}']");
    let later_100 = key_range(50, 149);

    assert!(!acquire(&one("k050"), 1, 1, "NULL", 0, true).starts_with("refused"));
    assert_eq!(
        acquire(KEYS_100, 2, 2, "5", 30000, true),
        "refused 1 {lock:k050}"
    );
    assert_eq!(claims(), "5:100");
    assert_eq!(rows(&db), ["lock:k050"], "a claim writes no key's row");
    assert_eq!(
        acquire(&one("k001"), 3, 3, "NULL", 0, true),
        "refused 1 {lock:k001}"
    );
    assert_eq!(
        acquire(&one("k001"), 4, 4, "7", 30000, true),
        "refused 1 {lock:k001}"
    );
    assert_eq!(
        db.line("lock:k001"),
        [7],
        "the small waiter reserved its key"
    );
    assert_eq!(
        acquire(&later_100, 5, 5, "9", 30000, true),
        "refused 50 {lock:k050,lock:k051,lock:k052}"
    );
    assert_eq!(claims(), "5:100,9:100");
    // The holder of k050 (owner 1), arrived with ticket 6 (after the first claim), asks for
    // k050 and k051 again.
    let two = "ARRAY['lock:k050', 'lock:k051']";
    assert_eq!(acquire(two, 1, 8, "6", 0, true), "refused 1 {lock:k051}");
    let probe = |owner: u8| {
        db.query(&format!(
            "SELECT tower_batch_lock.locks_probe({two}, 'x', \
             '00000000-0000-0000-0000-0000000000{owner:02x}', 6)"
        ))
    };
    assert_eq!((probe(1), probe(7)), ("1".to_owned(), "0".to_owned()));
    let release = |keys: &str, owner: u8, hold: u8| {
        db.query(&format!(
            "SELECT released || ' ' || heads::text FROM tower_batch_lock.locks_release({keys}, \
             '00000000-0000-0000-0000-0000000000{owner:02x}', {hold}, 'm')"
        ))
    };
    assert!(!acquire(&one("k200"), 6, 6, "NULL", 0, true).starts_with("refused"));
    assert_eq!(release(&one("k200"), 6, 6), "1 {}", "no claim names k200");
    assert_eq!(release(&one("k050"), 1, 1), "1 {5}");
    assert!(!acquire(KEYS_100, 2, 2, "5", 30000, false).starts_with("refused"));
    assert_eq!(claims(), "9:100", "the grant ended its claim");
    assert_eq!(release(KEYS_100, 2, 2), "100 {7,9}");
    assert_eq!(
        rows(&db),
        ["lock:k001"],
        "only the reserved key keeps a row"
    );
    assert_eq!(
        db.query(&format!(
            "SELECT withdrawn || ' ' || heads::text \
             FROM tower_batch_lock.locks_withdraw({later_100}, 9, 'm')"
        )),
        "100 {}"
    );
    assert_eq!(claims(), "");
}

/// A small waiter's withdrawal wakes the big waiter whose claim it kept out of a free key
/// (its reservation came first there), as a release does; and a claim's waiter granted by
/// any way, inserts first included, ends its claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_small_waiters_withdrawal_wakes_the_claim_it_kept_out() {
    let db = database_with_schema().await;
    let acquire = |keys: &str, owner: u8, ticket: &str, reserve: u32, free_first: bool| {
        db.query(&format!(
            "SELECT coalesce(token::text, 'refused ' || named::text) \
             FROM tower_batch_lock.locks_acquire({keys}, 'x', \
               '00000000-0000-0000-0000-0000000000{owner:02x}', {owner}, 10000, 3, \
               {ticket}, {reserve}, {free_first})"
        ))
    };
    let big = key_range(1, 100);
    assert!(!acquire("ARRAY['lock:k000']", 1, "NULL", 0, true).starts_with("refused"));
    let small = "ARRAY['lock:k000', 'lock:k001']";
    assert_eq!(acquire(small, 2, "1", 30000, true), "refused {lock:k000}");
    assert_eq!(acquire(&big, 3, "2", 30000, true), "refused {lock:k001}");
    assert_eq!(
        db.query(&format!(
            "SELECT withdrawn || ' ' || heads::text \
             FROM tower_batch_lock.locks_withdraw({small}, 1, 'm')"
        )),
        "2 {2}"
    );
    assert!(!acquire(&big, 3, "2", 30000, true).starts_with("refused"));
    assert_eq!(
        db.query("SELECT count(*) FROM tower_batch_lock.locks_claims"),
        "0",
        "the grant ended the claim"
    );
}

/// A release leaves asleep the waiters first in line on its keys that an earlier claim
/// keeps out of them (they would only probe and sleep again), and wakes the claim's
/// waiter: with one such key, and with ten (where the claims are hashed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_leaves_asleep_a_waiter_that_an_earlier_claim_keeps_out() {
    for held in [1, 10] {
        let db = database_with_schema().await;
        let acquire = |keys: &str, owner: u8, ticket: &str, reserve: u32| {
            db.query(&format!(
                "SELECT token IS NOT NULL FROM tower_batch_lock.locks_acquire({keys}, 'x', \
                 '00000000-0000-0000-0000-0000000000{owner:02x}', {owner}, 10000, 3, \
                 {ticket}, {reserve}, true)"
            ))
        };
        assert_eq!(acquire(&key_range(0, held - 1), 1, "NULL", 0), "t");
        assert_eq!(
            acquire(&key_range(0, 99), 2, "2", 30000),
            "f",
            "the big waiter claims"
        );
        assert_eq!(
            acquire(&key_range(0, held - 1), 3, "3", 30000),
            "f",
            "the small one reserves"
        );
        assert_eq!(db.line("lock:k000"), [3]);
        assert_eq!(
            db.query(&format!(
                "SELECT released || ' ' || heads::text FROM tower_batch_lock.locks_release(\
                 {}, '00000000-0000-0000-0000-000000000001', 1, 'm')",
                key_range(0, held - 1)
            )),
            format!("{held} {{2}}")
        );
    }
}

/// A big waiter's retry that one key keeps out (an earlier arrival holds it) takes nothing
/// and keeps its place: refused, with that key named, and its claim as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiters_retry_refused_by_one_held_key_takes_nothing_and_keeps_its_place() {
    let db = database_with_schema().await;
    db.query(&format!(
        "SELECT tower_batch_lock.locks_claim({KEYS_100}, 2, clock_timestamp(), 30000)"
    ));
    // An earlier arrival (ticket 1) takes one of the keys.
    let other = "00000000-0000-0000-0000-0000000000d1";
    let taken = db.query(&format!(
        "SELECT token IS NOT NULL FROM tower_batch_lock.locks_acquire(\
         ARRAY['lock:k050'], 'x', '{other}', 1, 10000, 10, 1, 30000, true)"
    ));
    assert_eq!(taken, "t");
    let waiter = "00000000-0000-0000-0000-0000000000d2";
    let refused = db.query(&format!(
        "SELECT token IS NULL, conflicts, named FROM tower_batch_lock.locks_acquire(\
         {KEYS_100}, 'x', '{waiter}', 7, 10000, 100, 2, 30000, false)"
    ));
    assert_eq!(refused, "t|1|{lock:k050}");
    assert_eq!(rows(&db), ["lock:k050"]);
    assert_eq!(
        db.query(
            "SELECT ticket, cardinality(keys), ends > clock_timestamp() \
             FROM tower_batch_lock.locks_claims"
        ),
        "2|100|t"
    );
}

/// A withdrawal takes off its waiter's live entries only: an entry that ended (a line keeps
/// it until a change walks the line) keeps nobody out, and taking it off would wake the
/// waiter first in line for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_withdrawal_of_an_ended_entry_wakes_nobody() {
    let db = database_with_schema().await;
    db.query(
        "INSERT INTO tower_batch_lock.locks (key, line) VALUES ('lock:k', ARRAY[\
           ROW(1, clock_timestamp() + interval '30 s')::tower_batch_lock.locks_place, \
           ROW(2, clock_timestamp() - interval '1 s')::tower_batch_lock.locks_place])",
    );
    let ended = db.query(
        "SELECT withdrawn, heads FROM tower_batch_lock.locks_withdraw(ARRAY['lock:k'], 2, 'm')",
    );
    assert_eq!(ended, "0|{}");
    let live = db.query(
        "SELECT withdrawn, heads FROM tower_batch_lock.locks_withdraw(ARRAY['lock:k'], 1, 'm')",
    );
    assert_eq!(live, "1|{}");
}

/// The common changes of a line, made without a walk over it (`locks_head`, `locks_without`
/// and `locks_with`: a look at its first or last entry), keep what the walk
/// (`locks_requeue`) keeps: 3,000 random lines of 0 to 8 entries, about a third of them
/// ended, each given a head, a waiter's entry taken out (its own first in half the cases)
/// and one put in (the latest ticket in a third): the same live entries in the same order,
/// the line still in ticket order, and the first live entry as the head.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lines_common_changes_keep_what_its_walk_keeps() {
    let db = database_with_schema().await;
    // A line's live entries in order, and whether its tickets rise.
    let helpers = "CREATE FUNCTION pg_temp.live(x tower_batch_lock.locks_place[], at timestamptz) \
         RETURNS tower_batch_lock.locks_place[] LANGUAGE sql AS $$ \
           SELECT array_agg(ROW(q.ticket, q.ends)::tower_batch_lock.locks_place ORDER BY q.o) \
           FROM unnest(x) WITH ORDINALITY q(ticket, ends, o) WHERE q.ends > at $$; \
         CREATE FUNCTION pg_temp.in_order(x tower_batch_lock.locks_place[]) \
         RETURNS boolean LANGUAGE sql AS $$ \
           SELECT coalesce(bool_and(e.ticket > e.before), true) FROM ( \
             SELECT q.ticket, lag(q.ticket) OVER (ORDER BY q.o) AS before \
             FROM unnest(x) WITH ORDINALITY q(ticket, ends, o)) e $$;";
    let answer = db.query(&format!(
        "{helpers} WITH cases AS ( \
           SELECT c, n.at, \
             (SELECT array_agg(ROW(t.ticket, t.ends)::tower_batch_lock.locks_place \
                               ORDER BY t.ticket) \
              FROM (SELECT DISTINCT ON (r.ticket) r.ticket, r.ends FROM ( \
                      SELECT (1000 + floor(random() * 40))::numeric AS ticket, \
                             n.at + (CASE WHEN random() < 0.3 THEN -1 ELSE 1 END) \
                               * (1 + floor(random() * 1000)) * interval '1 ms' AS ends \
                      FROM generate_series(1, c % 9)) r ORDER BY r.ticket) t) AS line, \
             n.at + (1 + floor(random() * 1000)) * interval '1 ms' AS till \
           FROM generate_series(1, 3000) c, (SELECT clock_timestamp() AS at) n), \
         asked AS ( \
           SELECT cases.*, \
             CASE WHEN c % 2 = 0 THEN (line[1]).ticket WHEN c % 11 = 0 THEN NULL \
                  ELSE (1000 + floor(random() * 44))::numeric END AS out, \
             CASE WHEN c % 3 = 0 THEN 1100::numeric \
                  ELSE (1000 + floor(random() * 44))::numeric END AS put \
           FROM cases), \
         changed AS ( \
           SELECT asked.*, \
             tower_batch_lock.locks_without(line, out, at) AS fast_out, \
             tower_batch_lock.locks_requeue(line, out, NULL, at) AS walk_out, \
             tower_batch_lock.locks_with(line, put, till, at) AS fast_put, \
             tower_batch_lock.locks_requeue(line, put, till, at) AS walk_put \
           FROM asked) \
         SELECT \
           count(*) FILTER (WHERE tower_batch_lock.locks_head(line, at) IS DISTINCT FROM \
             (SELECT q.ticket FROM unnest(line) WITH ORDINALITY q(ticket, ends, o) \
              WHERE q.ends > at ORDER BY q.o LIMIT 1)), \
           count(*) FILTER (WHERE pg_temp.live(fast_out, at) \
             IS DISTINCT FROM pg_temp.live(walk_out, at) OR NOT pg_temp.in_order(fast_out)), \
           count(*) FILTER (WHERE pg_temp.live(fast_put, at) \
             IS DISTINCT FROM pg_temp.live(walk_put, at) OR NOT pg_temp.in_order(fast_put)), \
           count(*) FILTER (WHERE out IS NOT NULL AND (line[1]).ticket = out) > 500, \
           count(*) FILTER (WHERE (line[cardinality(line)]).ticket < put) > 500 \
         FROM changed"
    ));
    assert_eq!(answer, "0|0|0|t|t");
}

/// A release frees the keys whose lines are live for their waiters, wakes the first, and
/// deletes the rows whose reservations have all ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_keeps_the_live_lines_and_deletes_the_rows_of_ended_ones() {
    let db = database_with_schema().await;
    let owner = "00000000-0000-0000-0000-0000000000a0";
    let acquired = db.query(&format!(
        "SELECT token IS NOT NULL FROM tower_batch_lock.locks_acquire(\
         {KEYS_100}, 'x', '{owner}', 1, 10000, 100, NULL, 0, true)"
    ));
    assert_eq!(acquired, "t");
    // Ticket 5 waits on the first half for 30 s; ticket 6's wait on the rest has ended.
    db.query(&format!(
        "SELECT tower_batch_lock.locks_reserve(({KEYS_100})[1:50], 5, clock_timestamp(), \
           30000); \
         SELECT tower_batch_lock.locks_reserve(({KEYS_100})[51:100], 6, \
           clock_timestamp() - interval '1 s', 10)"
    ));
    let released = db.query(&format!(
        "SELECT released, heads FROM tower_batch_lock.locks_release(\
         {KEYS_100}, '{owner}', 1, 'm')"
    ));
    assert_eq!(released, "100|{5}");
    let rows = db.query(
        "SELECT count(*), count(*) FILTER (WHERE owner IS NULL AND line IS NOT NULL) \
         FROM tower_batch_lock.locks",
    );
    assert_eq!(rows, "50|50");
}

/// A grant's transaction commits as the session says (its fencing token must never be
/// handed out again after a crash: here the session asks for `remote_write`, which a grant
/// keeps), and so does a release that hands a key to a waiter (a grant too); a refusal (in
/// line or not), a release and a withdrawal commit without waiting for the disk (a crash
/// may lose them, which costs time, never safety).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_commits_as_the_session_says_and_a_refusal_or_a_release_lazily() {
    let db = database_with_schema().await;
    let (holder, waiter, other) = (
        "00000000-0000-0000-0000-0000000000c0",
        "00000000-0000-0000-0000-0000000000c1",
        "00000000-0000-0000-0000-0000000000c2",
    );
    // The setting as each call leaves it to its transaction's commit.
    let call = |select: &str, function: &str| {
        db.query(&format!(
            "SET synchronous_commit = remote_write; \
             SELECT {select}, current_setting('synchronous_commit') \
             FROM tower_batch_lock.locks_{function} c"
        ))
    };
    let granted = format!("acquire({KEYS_100}, 'x', '{holder}', 1, 10000, 100, NULL, 0, true)");
    assert_eq!(call("c.token IS NOT NULL", &granted), "t|remote_write");
    let outside = format!("acquire({KEYS_100}, 'x', '{other}', 3, 10000, 100, NULL, 0, true)");
    assert_eq!(call("c.conflicts", &outside), "100|off");
    let waits = format!("acquire({KEYS_100}, 'x', '{waiter}', 2, 10000, 100, 9, 30000, true)");
    assert_eq!(call("c.conflicts", &waits), "100|off");
    let release = format!("release({KEYS_100}, '{holder}', 1, 'm')");
    assert_eq!(call("c.released", &release), "100|off");
    let retry = format!("acquire({KEYS_100}, 'x', '{waiter}', 2, 10000, 100, 9, 30000, false)");
    assert_eq!(call("c.token IS NOT NULL", &retry), "t|remote_write");
    let queued =
        format!("acquire(ARRAY['lock:k000'], 'x', '{other}', 4, 10000, 1, 10, 30000, true)");
    assert_eq!(call("c.conflicts", &queued), "1|off");
    // Waiter 9's release hands lock:k000 to waiter 10 (a turn: one key): a grant.
    let hands_over = format!("release({KEYS_100}, '{waiter}', 2, 'm')");
    assert_eq!(call("c.released", &hands_over), "100|remote_write");
    // Waiter 10 gives up without taking it: its withdrawal releases it.
    let withdrawn = "withdraw(ARRAY['lock:k000'], 10, 'm')";
    assert_eq!(call("c.withdrawn", withdrawn), "1|off");
}

/// The functions on a request's path keep one plan a connection (generic plans), made for
/// any number of keys and any size of the table: a plan made while the table was a few
/// rows, that read it whole and compared each row with each key, stayed until the
/// connection closed (a renewal of 20,000 keys took 4.7 s once the table had grown). On a
/// table of a few rows, as the first calls of a connection find it, each of them finds its
/// rows by the key's index.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_functions_on_a_requests_path_find_rows_by_index_on_a_table_of_a_few_rows() {
    let db = database_with_schema().await;
    let (holder, waiter) = (
        "00000000-0000-0000-0000-0000000000d0",
        "00000000-0000-0000-0000-0000000000d1",
    );
    let f = "tower_batch_lock.locks";
    // One connection, one transaction: the plans are made here, on a table of 100 rows
    // at most, and the transaction's own scans of it are counted. The probe comes first,
    // so that it, not the acquire, plans the helper that both call.
    let out = db.query(&format!(
        "SELECT {f}_probe(ARRAY['lock:k000'], 'x', '{waiter}', 9); \
         SELECT c.token IS NOT NULL FROM {f}_acquire({KEYS_100}, 'x', '{holder}', 1, 10000, \
         100, NULL, 0, true) c; \
         SELECT c.conflicts FROM {f}_acquire(ARRAY['lock:k000'], 'x', '{waiter}', 2, 10000, \
         1, 9, 30000, true) c; \
         SELECT {f}_probe(ARRAY['lock:k000'], 'x', '{waiter}', 9); \
         SELECT {f}_extend({KEYS_100}, '{holder}', 1, 20000); \
         SELECT {f}_guard({KEYS_100}, '{holder}'); \
         SELECT c.withdrawn FROM {f}_withdraw(ARRAY['lock:k000'], 9, 'm') c; \
         SELECT c.released FROM {f}_release({KEYS_100}, '{holder}', 1, 'm') c; \
         SELECT c.token IS NOT NULL FROM {f}_acquire({KEYS_100}, 'x', '{holder}', 3, \
         10000, 100, NULL, 0, true) c; \
         SELECT c.released FROM {f}_force_release({KEYS_100}, 'm') c; \
         SELECT seq_scan FROM pg_stat_xact_user_tables \
         WHERE schemaname = 'tower_batch_lock' AND relname = 'locks'"
    ));
    let answers: Vec<&str> = out.lines().collect();
    // Each call did what it does (the guard prints nothing), then the table's scans.
    assert_eq!(
        answers,
        ["1", "t", "1", "0", "t", "", "1", "100", "t", "100", "0"],
        "{out}"
    );
}

/// `schema.table` is the channel of the store's notifications, which PostgreSQL takes up to
/// 63 bytes: names longer together are refused when set, whatever the order, and names of
/// exactly 63 make a working store.
#[tokio::test]
async fn a_schema_and_table_too_long_together_are_refused_when_set() {
    let schema = "s".repeat(40);
    let long = std::panic::catch_unwind(|| {
        Postgres::url("postgres://x@127.0.0.1/x")
            .schema(&schema)
            .table(&"t".repeat(23))
    });
    assert!(long.is_err(), "a 64-byte channel was taken");
    let other_order = std::panic::catch_unwind(|| {
        Postgres::url("postgres://x@127.0.0.1/x")
            .table(&"t".repeat(23))
            .schema(&schema)
    });
    assert!(other_order.is_err(), "a 64-byte channel was taken");

    let db = Database::create();
    let locks = Locks::new(
        Postgres::url(db.url())
            .schema(&schema)
            .table(&"t".repeat(22))
            .build()
            .unwrap(),
    );
    locks.check().await.unwrap();
    let app = batch_router(&locks, counting_handler(&Arc::default()));
    assert_eq!(send(&app, batch(&["k"])).await.status, StatusCode::OK);
}

/// Fencing tokens start at the database clock's floor (the milliseconds since 2025 times
/// 1024, as every store's counter), and after a restore that set the sequence back, the
/// documented `raise_fence` puts the next token above every one handed out before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fencing_tokens_start_at_the_clock_and_are_raised_above_a_restored_sequence() {
    let db = Database::create();
    let locks = locks(&db);
    let app = batch_router(&locks, |lease: Lease| async move {
        lease.fencing_token().get().to_string()
    });
    let token = |reply: crate::support::http::Reply| -> u64 {
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.problem());
        reply.text().parse().unwrap()
    };
    let floor = clock_floor();
    let first = token(send(&app, batch(&["k"])).await);
    assert!(first >= floor, "{first} below the clock's floor {floor}");
    let second = token(send(&app, batch(&["k"])).await);
    assert!(second > first);

    // A restore from a backup taken before those grants: the sequence goes back.
    db.query("ALTER SEQUENCE tower_batch_lock.locks_fence RESTART WITH 1");
    let raised: u64 = db
        .query("SELECT tower_batch_lock.locks_raise_fence()")
        .parse()
        .unwrap();
    assert!(raised > second, "raised to {raised}, below {second}");
    let third = token(send(&app, batch(&["k"])).await);
    assert!(third > second, "{third} after {second}");
    // Raising again never lowers it.
    let again: u64 = db
        .query("SELECT tower_batch_lock.locks_raise_fence()")
        .parse()
        .unwrap();
    assert!(again >= third, "{again} below {third}");
}

/// A server that takes TCP connections over TLS only: a store without a connector cannot
/// connect to it; with [`Postgres::tls`], the pool and the listener of each process connect
/// over TLS, and a waiter in one process is granted the keys that a holder in the other
/// released.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_tls_connector_the_pool_and_the_listener_connect_over_tls() {
    let server = PgServer::start_tls();
    let plain = Locks::new(Postgres::url(server.url()).build().unwrap());
    assert!(plain.check().await.is_err(), "the server refuses plain TCP");

    // The server's certificate is self-signed: this test does not check it.
    let tls = || {
        let mut builder = SslConnector::builder(SslMethod::tls()).unwrap();
        builder.set_verify(SslVerifyMode::NONE);
        MakeTlsConnector::new(builder.build())
    };
    let url = format!("{}?sslmode=require", server.url());
    let store = || Postgres::url(&url).tls(tls()).build().unwrap();
    let (first, second) = (
        Locks::new(store()),
        Locks::new(store()).wait(Wait::up_to(Duration::from_secs(5))),
    );
    first.check().await.unwrap();
    second.check().await.unwrap();
    let listening_over_tls = poll_every(Duration::from_millis(20), Duration::from_secs(5), || {
        server.query(
            "SELECT count(*) FROM pg_stat_activity JOIN pg_stat_ssl USING (pid) \
             WHERE ssl AND query LIKE 'LISTEN%'",
        ) == "2"
    })
    .await;
    assert!(
        listening_over_tls.is_some(),
        "each process listens over TLS"
    );

    let (gate, held) = hold(&first, "tls:1").await;
    let waiter = batch_router(&second, counting_handler(&Arc::default()));
    let waiting = tokio::spawn(async move { send(&waiter, batch(&["tls:1"])).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the waiter waits for the key");
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert_eq!(waiting.await.unwrap().status, StatusCode::OK);
    let plain_clients = server.query(
        "SELECT count(*) FROM pg_stat_activity JOIN pg_stat_ssl USING (pid) \
         WHERE backend_type = 'client backend' AND NOT ssl AND client_addr IS NOT NULL",
    );
    assert_eq!(plain_clients, "0", "every TCP connection uses TLS");
}
