//! The idempotency layer on every store, across two routers (two processes): a request
//! with an `Idempotency-Key` runs once, its retries get its answer, and everything else a
//! client can send gets the draft's answer.

use std::{
    convert::Infallible,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};
use tower_batch_lock::store::Redis;

use axum::{
    body::Body,
    http::{header, Request, StatusCode},
    response::{IntoResponse, Response},
    routing::{post, MethodRouter},
    Router,
};
use bytes::Bytes;
use tower_batch_lock::{idempotency::Idempotency, keys, Locks, OnLostLease, Wait};

use tokio::task::JoinHandle;

use crate::support::{
    handlers::{gated_handler, Gate},
    http::{header_keys, poll_every, post_keys, send, within, Reply},
    logs::warnings_logged,
    stores::Store,
    Rng,
};

impl Store {
    /// Waits (up to 3 s) until no in-flight lock is left, then checks it: a run whose
    /// client went away releases its lock just after it stored its answer, which a retry
    /// may already have been given.
    async fn settle_runs(&self) {
        let no_run = || {
            self.locks.iter().all(|l| l.held_batches().is_empty())
                && self.left_under("idempotency:lock:run:").is_empty()
        };
        poll_every(Duration::from_millis(10), Duration::from_secs(3), no_run).await;
        self.assert_no_run_left();
    }

    /// Checks that no in-flight lock is left: none held by either handle, and none on
    /// any server (only answers and the fencing counter stay).
    fn assert_no_run_left(&self) {
        for locks in &self.locks {
            let held = locks.held_batches();
            assert!(
                held.is_empty(),
                "{}: batches still held: {held:?}",
                self.name
            );
        }
        let left = self.left_under("idempotency:lock:run:");
        assert!(
            left.is_empty(),
            "{}: in-flight locks left: {left:?}",
            self.name
        );
    }
}

/// The orders service's database: how many orders it created.
#[derive(Default)]
struct Orders {
    created: AtomicUsize,
}

/// `POST /orders`: creates an order (after the gate, if there is one) and answers 201 with
/// its number and a `Location`.
fn create_order(orders: &Arc<Orders>, gate: Option<&Arc<Gate>>) -> MethodRouter {
    let (orders, gate) = (orders.clone(), gate.cloned());
    post(move |body: Bytes| {
        let (orders, gate) = (orders.clone(), gate.clone());
        async move {
            if let Some(gate) = gate {
                gate.pass().await;
            }
            let n = orders.created.fetch_add(1, Ordering::SeqCst) + 1;
            let body = format!(
                r#"{{"order":{n},"request":{}}}"#,
                String::from_utf8_lossy(&body)
            );
            (
                StatusCode::CREATED,
                [
                    (header::LOCATION, format!("/orders/{n}")),
                    (header::CONTENT_TYPE, "application/json".to_owned()),
                ],
                body,
            )
        }
    })
}

/// [`create_order`] at `/orders`, behind `idempotency`.
fn orders_router(
    idempotency: Idempotency,
    orders: &Arc<Orders>,
    gate: Option<&Arc<Gate>>,
) -> Router {
    Router::new().route("/orders", create_order(orders, gate).layer(idempotency))
}

fn order(key: Option<&str>, body: &str) -> Request<Body> {
    let mut request = Request::post("/orders").header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.body(Body::from(body.to_owned())).unwrap()
}

/// Sends an order with `key` to `app` in a task of its own, once its handler passed into
/// `gate`.
async fn order_entered(app: &Router, key: &'static str, gate: &Gate) -> JoinHandle<Reply> {
    let app = app.clone();
    let sent = tokio::spawn(async move { send(&app, order(Some(key), "{}")).await });
    gate.wait_entered().await;
    sent
}

/// The answer to a retry of the order with `key`, once its first run stored one (the
/// retries before get 409); within 5 s.
async fn stored_answer(app: &Router, key: &'static str) -> Reply {
    within(Duration::from_secs(5), "the answer is stored", async {
        loop {
            let reply = send(app, order(Some(key), "{}")).await;
            if reply.status != StatusCode::CONFLICT {
                return reply;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

/// Lets a run wait at `gate` go on: it was cancelled, so it creates no order.
async fn assert_cancelled(gate: &Gate, orders: &Orders) {
    gate.open();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        orders.created.load(Ordering::SeqCst),
        0,
        "the cancelled run went on without its lock"
    );
}

/// Locks on a memory store of their own that wait for nothing, and cancel a handler whose
/// lease (300 ms, renewed every 100 ms) is lost.
fn cancelling_locks() -> Locks {
    Locks::new(tower_batch_lock::store::Store::isolated_memory())
        .ttl(Duration::from_millis(300))
        .wait(Wait::none())
        .on_lost_lease(OnLostLease::Cancel)
}

fn assert_replay_of(first: &Reply, retry: &Reply) {
    assert_eq!(retry.status, first.status);
    assert_eq!(retry.body, first.body, "the replayed body is the first one");
    assert_eq!(
        retry.headers[header::LOCATION],
        first.headers[header::LOCATION]
    );
    assert_eq!(
        retry.headers[header::CONTENT_TYPE],
        first.headers[header::CONTENT_TYPE]
    );
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert!(first.headers.get("idempotent-replayed").is_none());
}

// ---------------------------------------------------------------------------------------
// Duplicates run once
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_in_flight_gets_409_and_a_retry_after_it_gets_the_first_answer() {
    for store in Store::all() {
        let orders = Arc::new(Orders::default());
        let gate = Gate::new();
        let [a, b] = &store.locks;
        let first_app = orders_router(a.idempotency(), &orders, Some(&gate));
        let other_app = orders_router(b.idempotency(), &orders, None);
        let key = "\"8e03978e-40d5-43e8-bc93-6894a57f9324\"";

        let first = tokio::spawn({
            let app = first_app.clone();
            async move { send(&app, order(Some(key), r#"{"sku":"s1"}"#)).await }
        });
        gate.wait_entered().await;
        // The same request on the other process, while the first runs.
        let duplicate = send(&other_app, order(Some(key), r#"{"sku":"s1"}"#)).await;
        assert_eq!(duplicate.status, StatusCode::CONFLICT, "{}", store.name);
        let problem = duplicate.problem();
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .contains("still being processed"),
            "{problem}"
        );
        assert!(duplicate.retry_after() >= 1);

        gate.open();
        let first = first.await.unwrap();
        assert_eq!(
            first.status,
            StatusCode::CREATED,
            "{}: {first:?}",
            store.name
        );

        // Retries on the other process, and on the first, get the first answer.
        for app in [&other_app, &first_app] {
            let retry = send(app, order(Some(key), r#"{"sku":"s1"}"#)).await;
            assert_replay_of(&first, &retry);
        }
        // The bare form of the same key is the same key.
        let bare = send(
            &other_app,
            order(Some(&key[1..key.len() - 1]), r#"{"sku":"s1"}"#),
        )
        .await;
        assert_replay_of(&first, &bare);
        assert_eq!(orders.created.load(Ordering::SeqCst), 1, "{}", store.name);
        store.assert_no_run_left();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_duplicates_on_two_processes_creates_one_order() {
    for store in Store::all() {
        let orders = Arc::new(Orders::default());
        let apps: Vec<Router> = store
            .locks
            .iter()
            .map(|locks| orders_router(locks.idempotency(), &orders, None))
            .collect();
        for round in 0..5 {
            let key = format!("burst-{round}");
            let body = format!(r#"{{"round":{round}}}"#);
            let replies = futures_util::future::join_all((0..16).map(|i| {
                let app = apps[i % 2].clone();
                let request = order(Some(&key), &body);
                async move { send(&app, request).await }
            }))
            .await;
            assert!(
                replies
                    .iter()
                    .all(|r| r.status == StatusCode::CREATED || r.status == StatusCode::CONFLICT),
                "{}: {replies:?}",
                store.name
            );
            // A retry after the burst: it runs if no copy did (on Redlock, racing copies
            // can split the masters so that none has a majority), and is answered with the
            // one order otherwise.
            let last = send(&apps[0], order(Some(&key), &body)).await;
            assert_eq!(last.status, StatusCode::CREATED, "{}", store.name);
            // Every 201 is the one order's answer, however many were replays.
            let created = replies.iter().filter(|r| r.status == StatusCode::CREATED);
            assert!(
                created.into_iter().all(|r| r.body == last.body),
                "{}",
                store.name
            );
            assert_eq!(
                orders.created.load(Ordering::SeqCst),
                round + 1,
                "{}: round {round}",
                store.name
            );
        }
        store.assert_no_run_left();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_duplicate_gets_the_first_answer_when_it_is_done() {
    for store in [Store::memory(), Store::redis()] {
        let orders = Arc::new(Orders::default());
        let gate = Gate::new();
        let [a, b] = &store.locks;
        let first_app = orders_router(a.idempotency(), &orders, Some(&gate));
        let waiting_app = orders_router(
            b.idempotency().wait(Wait::up_to(Duration::from_secs(5))),
            &orders,
            None,
        );
        let first = tokio::spawn({
            let app = first_app.clone();
            async move { send(&app, order(Some("w"), "{}")).await }
        });
        gate.wait_entered().await;
        let waiting = tokio::spawn({
            let app = waiting_app.clone();
            async move { send(&app, order(Some("w"), "{}")).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !waiting.is_finished(),
            "{}: the duplicate waits",
            store.name
        );
        gate.open();
        let first = first.await.unwrap();
        let waited = waiting.await.unwrap();
        assert_replay_of(&first, &waited);
        assert_eq!(orders.created.load(Ordering::SeqCst), 1);
    }
}

// ---------------------------------------------------------------------------------------
// What clients can get wrong
// ---------------------------------------------------------------------------------------

/// A key as long as the layer's `max_key_len` allows is taken, whatever that limit: its
/// in-flight lock, whose key is the client's with the scope around it, follows the limit.
/// (It had a fixed 4,096 bytes: a longer key that the layer took got a 400 naming a lock
/// key.)
#[tokio::test]
async fn a_key_up_to_a_raised_max_key_len_is_taken() {
    let orders = Arc::new(Orders::default());
    let locks = Locks::new(tower_batch_lock::store::Store::isolated_memory());
    let app = orders_router(locks.idempotency().max_key_len(6_000), &orders, None);
    let key = "k".repeat(5_000);
    let first = send(&app, order(Some(&key), "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.problem());
    let again = send(&app, order(Some(&key), "{}")).await;
    assert_eq!((again.status, again.body), (first.status, first.body));
    assert_eq!(orders.created.load(Ordering::SeqCst), 1);
    let longer = send(&app, order(Some(&"k".repeat(6_001)), "{}")).await;
    assert_eq!(longer.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_key_reused_for_another_request_is_422_and_a_missing_or_bad_key_400() {
    for store in [Store::memory(), Store::redis()] {
        let orders = Arc::new(Orders::default());
        let [a, b] = &store.locks;
        let app = orders_router(a.idempotency().required(true), &orders, None);
        let other = orders_router(b.idempotency().required(true), &orders, None);

        let first = send(&app, order(Some("k1"), r#"{"sku":"s1"}"#)).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let reused = send(&other, order(Some("k1"), r#"{"sku":"s2"}"#)).await;
        assert_eq!(
            reused.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{}",
            store.name
        );
        assert!(reused.problem()["detail"]
            .as_str()
            .unwrap()
            .contains("different request"));
        // Another path or method with the same key is another request too.
        let elsewhere = Router::new()
            .route("/carts", post(|| async { "ok" }))
            .route("/orders", axum::routing::put(|| async { "ok" }))
            .layer(b.idempotency());
        for request in [
            Request::post("/carts")
                .header("idempotency-key", "k1")
                .body(Body::from(r#"{"sku":"s1"}"#)),
            Request::put("/orders")
                .header("idempotency-key", "k1")
                .body(Body::from(r#"{"sku":"s1"}"#)),
        ] {
            let reply = send(&elsewhere, request.unwrap()).await;
            assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{reply:?}");
        }

        let missing = send(&app, order(None, "{}")).await;
        assert_eq!(missing.status, StatusCode::BAD_REQUEST);
        assert!(missing.problem()["detail"]
            .as_str()
            .unwrap()
            .contains("needs an Idempotency-Key"));
        let long = "x".repeat(256);
        for bad in ["\"unterminated", "two words", "\"\"", long.as_str()] {
            let reply = send(&app, order(Some(bad), "{}")).await;
            assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad}: {reply:?}");
            reply.problem();
        }
        let twice = Request::post("/orders")
            .header("idempotency-key", "a")
            .header("idempotency-key", "b")
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&app, twice).await.status, StatusCode::BAD_REQUEST);
        // None of these ran.
        assert_eq!(orders.created.load(Ordering::SeqCst), 1);

        // Without `required`, a request without a key runs, every time.
        let optional = orders_router(a.idempotency(), &orders, None);
        for _ in 0..2 {
            let reply = send(&optional, order(None, "{}")).await;
            assert_eq!(reply.status, StatusCode::CREATED);
            assert!(reply.headers.get("idempotent-replayed").is_none());
        }
        assert_eq!(orders.created.load(Ordering::SeqCst), 3);
        store.assert_no_run_left();
    }
}

#[tokio::test]
async fn scoped_keys_of_two_clients_never_meet() {
    let store = Store::redis();
    let orders = Arc::new(Orders::default());
    let by_account = |parts: &http::request::Parts| {
        parts
            .headers
            .get("x-account")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let app = orders_router(
        store.locks[0].idempotency().scope(by_account),
        &orders,
        None,
    );
    let as_account = |account: &str| {
        let mut request = order(Some("same-key"), "{}");
        request
            .headers_mut()
            .insert("x-account", account.parse().unwrap());
        request
    };
    let alice = send(&app, as_account("alice")).await;
    let bob = send(&app, as_account("bob")).await;
    assert_eq!(
        (alice.status, bob.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_ne!(alice.body, bob.body, "each client's request ran");
    assert_replay_of(&alice, &send(&app, as_account("alice")).await);
    assert_replay_of(&bob, &send(&app, as_account("bob")).await);
    assert_eq!(orders.created.load(Ordering::SeqCst), 2);
}

// ---------------------------------------------------------------------------------------
// What is stored
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_large_answer_is_replayed_byte_for_byte_and_one_over_the_limit_is_not_run_again() {
    for store in [Store::memory(), Store::redis()] {
        let runs = Arc::new(AtomicUsize::new(0));
        let mut rng = Rng::seeded(7);
        let large: Bytes = (0..700 * 1024).map(|_| rng.below(256) as u8).collect();
        let answer = {
            let (runs, large) = (runs.clone(), large.clone());
            move || {
                let (runs, large) = (runs.clone(), large.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    large
                }
            }
        };
        let [a, b] = &store.locks;
        let app = Router::new().route("/export", post(answer.clone()).layer(a.idempotency()));
        let other = Router::new().route("/export", post(answer.clone()).layer(b.idempotency()));
        let export = |key: &str| {
            Request::post("/export")
                .header("idempotency-key", key)
                .body(Body::empty())
                .unwrap()
        };
        let first = send(&app, export("big")).await;
        assert_eq!(
            first.body, large,
            "{}: the first answer is whole",
            store.name
        );
        let retry = send(&other, export("big")).await;
        assert_eq!(retry.status, StatusCode::OK);
        assert_eq!(
            retry.body, large,
            "{}: the replay is byte for byte",
            store.name
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1);

        // Over the limit: the first request gets all of it, its retries a 409 that says
        // why, and the handler does not run again.
        let small_limit = Router::new().route(
            "/export",
            post(answer).layer(a.idempotency().max_answer(100 * 1024)),
        );
        let first = send(&small_limit, export("too-big")).await;
        assert_eq!(first.body, large);
        let retry = send(&small_limit, export("too-big")).await;
        assert_eq!(retry.status, StatusCode::UNPROCESSABLE_ENTITY);
        let problem = retry.problem();
        assert_eq!(problem["limit"], "idempotency_answer_size", "{problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains("status 200"),
            "{problem}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        store.assert_no_run_left();
    }
}

#[tokio::test]
async fn a_failed_request_is_replayed_unless_it_says_to_try_again() {
    let store = Store::redis();
    let runs = Arc::new(AtomicUsize::new(0));
    // Each run answers with the status in `x-answer`, and says which run it was.
    let handler = {
        let runs = runs.clone();
        move |request: Request<Body>| {
            let runs = runs.clone();
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let status: u16 = request.headers()["x-answer"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                (StatusCode::from_u16(status).unwrap(), format!("run {run}")).into_response()
            }
        }
    };
    let with = |idempotency: Idempotency| {
        Router::new().route("/pay", post(handler.clone()).layer(idempotency))
    };
    let default = with(store.locks[0].idempotency());
    let successes_only = with(
        store.locks[0]
            .idempotency()
            .store_if(|r| r.status.is_success()),
    );
    let pay = |key: &str, status: u16| {
        Request::post("/pay")
            .header("idempotency-key", key)
            .header("x-answer", status.to_string())
            .body(Body::empty())
            .unwrap()
    };
    let twice = |app: Router, key: &'static str, status: u16| async move {
        let first = send(&app, pay(key, status)).await;
        let retry = send(&app, pay(key, status)).await;
        assert_eq!(first.status.as_u16(), status);
        (first.text(), retry)
    };

    // A 500 may have done half its work: it is replayed, not run again.
    let (first, retry) = twice(default.clone(), "e500", 500).await;
    assert_eq!((first.as_str(), retry.text().as_str()), ("run 1", "run 1"));
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    // A 422 of the handler is an answer like any other.
    let (_, retry) = twice(default.clone(), "e422", 422).await;
    assert_eq!(
        (retry.status, retry.text().as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, "run 2")
    );
    // 503 and 429 say "try again": the retry runs.
    for (key, status) in [("e503", 503), ("e429", 429)] {
        let (first, retry) = twice(default.clone(), key, status).await;
        assert_ne!(first, retry.text(), "{status}: the retry ran again");
        assert!(retry.headers.get("idempotent-replayed").is_none());
    }
    // With `store_if`, what it refuses runs again.
    let (first, retry) = twice(successes_only, "e500-not-kept", 500).await;
    assert_ne!(first, retry.text());
    assert_eq!(runs.load(Ordering::SeqCst), 8);
    store.assert_no_run_left();
}

#[tokio::test]
async fn a_body_that_fails_half_way_is_not_stored() {
    let store = Store::memory();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move || {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let chunks: [Result<Bytes, std::io::Error>; 2] = [
                    Ok(Bytes::from_static(b"part")),
                    Err(std::io::Error::other("broken")),
                ];
                Response::new(Body::from_stream(futures_util::stream::iter(chunks)))
            }
        }
    };
    let app = Router::new().route("/", post(handler).layer(store.locks[0].idempotency()));
    for _ in 0..2 {
        let request = Request::post("/")
            .header("idempotency-key", "k")
            .body(Body::empty());
        let response = tower::ServiceExt::oneshot(app.clone(), request.unwrap())
            .await
            .unwrap();
        let read = http_body_util::BodyExt::collect(response.into_body()).await;
        assert!(
            read.is_err(),
            "the client sees the body fail, as without the layer"
        );
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "nothing was stored: the retry ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_whose_client_went_away_still_stores_its_answer() {
    for store in [Store::memory(), Store::redis()] {
        let orders = Arc::new(Orders::default());
        let gate = Gate::new();
        let app = orders_router(store.locks[0].idempotency(), &orders, Some(&gate));
        let first = order_entered(&app, "gone", &gate).await;
        // The client goes away while the handler runs: hyper drops the request's future.
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        gate.open();
        // The handler finished, and its answer is the retry's.
        let retry = stored_answer(&app, "gone").await;
        assert_eq!(retry.status, StatusCode::CREATED, "{}", store.name);
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        assert_eq!(orders.created.load(Ordering::SeqCst), 1, "{}", store.name);
        store.settle_runs().await;
    }
}

/// [`orders_router`] inside a lock layer of `locks` on `product:7`: a lock layer around the
/// idempotency layer.
fn product_locked_orders(locks: &Locks, orders: &Arc<Orders>, gate: &Arc<Gate>) -> Router {
    orders_router(locks.idempotency(), orders, Some(gate)).route_layer(locks.layer(product))
}

/// The one product every order of these tests locks.
fn product(_: &http::request::Parts) -> Result<[&'static str; 1], tower_batch_lock::Rejection> {
    Ok(["product:7"])
}

/// Another order (another key), sent while a first one runs; within 3 s.
async fn another_order(app: &Router) -> Reply {
    let another = send(app, order(Some("another"), "{}"));
    within(
        Duration::from_secs(3),
        "another order while the first runs",
        another,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_layer_around_keeps_its_keys_while_a_request_whose_client_went_away_runs() {
    for store in [Store::memory(), Store::redis()] {
        // A short TTL: the keys outlive it only if their renewal goes on.
        let locks = store.locks[0]
            .clone()
            .ttl(Duration::from_millis(300))
            .wait(Wait::none());
        let orders = Arc::new(Orders::default());
        let gate = Gate::new();
        let app = product_locked_orders(&locks, &orders, &gate);
        let first = order_entered(&app, "went-away", &gate).await;
        // The client goes away; its handler goes on in the idempotency layer's task, and
        // still holds the product past several TTLs: another order for it is refused.
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let other = another_order(&app).await;
        assert_eq!(other.status, StatusCode::CONFLICT, "{}", store.name);
        gate.open();
        // The run ends and stores its answer; then the product is free again.
        let retry = stored_answer(&app, "went-away").await;
        assert_eq!(retry.status, StatusCode::CREATED, "{}", store.name);
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        gate.open();
        let other = send(&app, order(Some("another"), "{}")).await;
        assert_eq!(other.status, StatusCode::CREATED, "{}", store.name);
        assert_eq!(orders.created.load(Ordering::SeqCst), 2, "{}", store.name);
        store.settle_runs().await;
    }
}

/// The same when the request is dropped at its first poll, before the idempotency
/// layer's task has run at all: the run counts from its spawn.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_layer_around_keeps_its_keys_for_a_run_dropped_before_it_started() {
    let locks = Locks::new(tower_batch_lock::store::Store::isolated_memory()).wait(Wait::none());
    let orders = Arc::new(Orders::default());
    let gate = Gate::new();
    let app = product_locked_orders(&locks, &orders, &gate);
    let first = tower::ServiceExt::oneshot(app.clone(), order(Some("at-once"), "{}"));
    assert!(futures_util::FutureExt::now_or_never(first).is_none());
    gate.wait_entered().await;
    let other = another_order(&app).await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    gate.open();
}

/// A lock layer around the idempotency layer whose client left, and which then loses
/// its lease where that cancels, cancels the run that goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_layer_around_whose_client_left_cancels_the_run_when_it_loses_its_lease() {
    let locks = cancelling_locks();
    let orders = Arc::new(Orders::default());
    let gate = Gate::new();
    let app = product_locked_orders(&locks, &orders, &gate);
    let first = order_entered(&app, "left-then-lost", &gate).await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    assert_eq!(locks.force_release(["product:7"], "test").await.unwrap(), 1);
    // The next renewal (every 100 ms) finds the product gone, and cancels the run.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_cancelled(&gate, &orders).await;
}

/// A layer between a lock layer and the idempotency layer that answers for the run (a
/// timeout) leaves the run going on: the lock layer keeps its keys until it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_layer_around_a_timeout_keeps_its_keys_until_the_run_ends() {
    let locks = Locks::new(tower_batch_lock::store::Store::isolated_memory()).wait(Wait::none());
    let orders = Arc::new(Orders::default());
    let gate = Gate::new();
    let timeout = axum::middleware::from_fn(
        |request: axum::extract::Request, next: axum::middleware::Next| async move {
            match tokio::time::timeout(Duration::from_millis(100), next.run(request)).await {
                Ok(response) => response,
                Err(_) => StatusCode::REQUEST_TIMEOUT.into_response(),
            }
        },
    );
    let app = Router::new()
        .route(
            "/orders",
            create_order(&orders, Some(&gate)).layer(locks.idempotency()),
        )
        .route_layer(timeout)
        .route_layer(locks.layer(product));
    let first = send(&app, order(Some("timed-out"), "{}")).await;
    assert_eq!(first.status, StatusCode::REQUEST_TIMEOUT);
    let other = another_order(&app).await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    gate.open();
    let freed = poll_every(Duration::from_millis(10), Duration::from_secs(3), || {
        orders.created.load(Ordering::SeqCst) == 1
    });
    assert!(freed.await.is_some(), "the run never finished");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_layer_around_that_loses_its_lease_and_cancels_cancels_the_run() {
    let locks = cancelling_locks();
    let orders = Arc::new(Orders::default());
    let gate = Gate::new();
    let app = product_locked_orders(&locks, &orders, &gate);
    let first = order_entered(&app, "lost", &gate).await;
    let ended = locks.force_release(["product:7"], "test").await.unwrap();
    assert_eq!(ended, 1);
    // The next renewal finds the product gone: the layer answers 503 and cancels its
    // inner service, the idempotency layer's run in a task of its own included.
    let first = within(Duration::from_secs(3), "the cancelled answer", first).await;
    assert_eq!(first.unwrap().status, StatusCode::SERVICE_UNAVAILABLE);
    assert_cancelled(&gate, &orders).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_slower_than_max_hold_keeps_its_retries_out_and_is_not_cancelled() {
    for store in [Store::memory(), Store::redis()] {
        // Locks that give a hung handler's keys up fast, and cancel it then: settings for
        // the resources' locks, which the in-flight lock must not take.
        let locks = store.locks[0]
            .clone()
            .ttl(Duration::from_millis(300))
            .max_hold(Duration::from_millis(400))
            .on_lost_lease(OnLostLease::Cancel);
        let orders = Arc::new(Orders::default());
        let gate = Gate::new();
        let app = orders_router(locks.idempotency(), &orders, Some(&gate));
        let first = order_entered(&app, "slow", &gate).await;
        // Past max_hold and a TTL more: the retry still finds the first running.
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        let retry = send(&app, order(Some("slow"), "{}")).await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{}", store.name);
        gate.open();
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{}", store.name);
        let retry = send(&app, order(Some("slow"), "{}")).await;
        assert_replay_of(&first, &retry);
        assert_eq!(orders.created.load(Ordering::SeqCst), 1, "{}", store.name);
        store.settle_runs().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_whose_handler_panicked_is_answered_500_and_not_run_again() {
    for store in [Store::memory(), Store::redis()] {
        let orders = Arc::new(Orders::default());
        let panicking = post({
            let orders = orders.clone();
            move || {
                let orders = orders.clone();
                async move {
                    let n = orders.created.fetch_add(1, Ordering::SeqCst) + 1;
                    // The first run panics after its order was made, before it answers.
                    assert!(n > 1, "the handler fails after its work");
                    StatusCode::CREATED
                }
            }
        });
        let app = Router::new().route("/orders", panicking.layer(store.locks[0].idempotency()));
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, order(Some("crash"), "{}")).await }
        });
        let panicked = first.await.unwrap_err();
        assert!(panicked.is_panic(), "the panic goes on: {panicked:?}");
        let retry = send(&app, order(Some("crash"), "{}")).await;
        assert_eq!(
            retry.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{}",
            store.name
        );
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        let detail = retry.problem()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("new key"), "{detail}");
        assert_eq!(orders.created.load(Ordering::SeqCst), 1, "{}", store.name);
        store.settle_runs().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_the_store_could_not_take_at_once_is_stored_when_it_can() {
    let mut store = Store::redis();
    let locks = store.locks[0]
        .clone()
        .store_timeout(Duration::from_millis(200))
        .ttl(Duration::from_secs(5));
    let orders = Arc::new(Orders::default());
    let gate = Gate::new();
    let app = orders_router(locks.idempotency(), &orders, Some(&gate));
    let first = order_entered(&app, "later", &gate).await;
    let logged_before = warnings_logged().len();
    // The store goes down as the handler finishes (a failover, say), and is back a second
    // later, empty: the answer must still get there.
    store.servers[0].kill();
    gate.open();
    tokio::time::sleep(Duration::from_secs(1)).await;
    store.servers[0].restart();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    // Its attempts meanwhile (50 ms to 1 s apart) are logged with the store's outage, once
    // (unless a release or an extension started the outage first), not each.
    let logged = warnings_logged();
    let attempts = logged[logged_before..]
        .lines()
        .filter(|line| line.contains("could not store an idempotent answer"))
        .count();
    assert!(attempts <= 1, "{}", &logged[logged_before..]);
    let retry = send(&app, order(Some("later"), "{}")).await;
    assert_replay_of(&first, &retry);
    assert_eq!(orders.created.load(Ordering::SeqCst), 1);
    store.assert_no_run_left();
}

#[tokio::test]
async fn an_answer_this_version_cannot_read_is_503_and_runs_nothing() {
    let store = Store::redis();
    let orders = Arc::new(Orders::default());
    let app = orders_router(store.locks[0].idempotency(), &orders, None);
    let _: () = redis::cmd("SET")
        .arg("idempotency:lock:done:0::odd")
        .arg(b"TBI1\xff\xff not an answer".as_slice())
        .query(&mut store.servers[0].connection())
        .unwrap();
    let reply = send(&app, order(Some("odd"), "{}")).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    reply.problem();
    assert_eq!(orders.created.load(Ordering::SeqCst), 0);
}

// ---------------------------------------------------------------------------------------
// Next to the resources' locks
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_refusal_by_the_resource_locks_inside_is_not_stored() {
    let store = Store::redis();
    let [a, b] = &store.locks;
    let orders = Arc::new(Orders::default());
    let gate = Gate::new();
    // The sku locks inside, the idempotency layer outside (added last).
    let app = |locks: &Locks, gate: Option<&Arc<Gate>>| {
        let create = create_order(&orders, gate)
            .layer::<_, Infallible>(locks.layer(header_keys))
            .layer(locks.idempotency());
        Router::new().route("/orders", create)
    };
    let busy = app(a, Some(&gate));
    let retail = app(b, None);
    let holder = tokio::spawn({
        let busy = busy.clone();
        let mut request = order(Some("holder"), "{}");
        request
            .headers_mut()
            .insert("x-keys", "sku-1".parse().unwrap());
        async move { send(&busy, request).await }
    });
    gate.wait_entered().await;
    let mut request = order(Some("po-7"), "{}");
    request
        .headers_mut()
        .insert("x-keys", "sku-1,sku-2".parse().unwrap());
    let refused = send(&retail, request).await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert!(
        refused.problem()["detail"]
            .as_str()
            .unwrap()
            .contains("resource"),
        "the sku lock's own 409, not the idempotency layer's"
    );
    gate.open();
    assert_eq!(holder.await.unwrap().status, StatusCode::CREATED);
    // The retry runs, now that the sku is free.
    let mut request = order(Some("po-7"), "{}");
    request
        .headers_mut()
        .insert("x-keys", "sku-1,sku-2".parse().unwrap());
    let retried = send(&retail, request).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert!(retried.headers.get("idempotent-replayed").is_none());
    assert_eq!(orders.created.load(Ordering::SeqCst), 2);
    store.assert_no_run_left();
    // `lock:` alone is the fencing counter.
    let left = store.servers[0].keys("lock:?*");
    assert!(left.is_empty(), "sku locks left: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_with_a_key_does_not_jump_the_line_of_an_earlier_waiter() {
    for store in [Store::memory(), Store::redis()] {
        let [a, b] = &store.locks;
        let orders = Arc::new(Orders::default());
        let gate = Gate::new();
        // A request holds `a`.
        let holder_app = Router::new().route(
            "/hold",
            post(gated_handler(&gate)).layer(a.layer(header_keys)),
        );
        let holder = tokio::spawn(async move { send(&holder_app, post_keys("/hold", "a")).await });
        gate.wait_entered().await;
        // A waiter in line for `a` and `b` reserves both; `b` is free.
        let waiting = b.clone().wait(Wait::up_to(Duration::from_secs(5)));
        let waiter_app = Router::new().route(
            "/wait",
            post(|| async { "waited" }).layer(waiting.layer(header_keys)),
        );
        let waiter =
            tokio::spawn(async move { send(&waiter_app, post_keys("/wait", "a,b")).await });
        within(Duration::from_secs(5), "the waiter reserves `b`", async {
            while a.inspect(["b"]).await.unwrap()[0].waiters() == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;

        // An order for `b` with an Idempotency-Key, which does not wait: the waiter came
        // first, and its reservation keeps the order out as it keeps out any request.
        let create = create_order(&orders, None)
            .layer::<_, Infallible>(a.layer(header_keys))
            .layer(a.idempotency());
        let app = Router::new().route("/orders", create);
        let mut request = order(Some("late"), "{}");
        request.headers_mut().insert("x-keys", "b".parse().unwrap());
        let late = send(&app, request).await;
        assert_eq!(
            late.status,
            StatusCode::CONFLICT,
            "{}: {late:?}",
            store.name
        );
        assert_eq!(orders.created.load(Ordering::SeqCst), 0);

        gate.open();
        assert_eq!(holder.await.unwrap().status, StatusCode::OK);
        assert_eq!(waiter.await.unwrap().text(), "waited");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_that_share_a_trusted_owner_still_run_once() {
    const OWNER: &str = "0123456789abcdef0123456789abcdef";
    let trusting = Locks::new(tower_batch_lock::store::Store::isolated_memory())
        .trust_owner_header(
            http::HeaderName::from_static("x-lock-owner"),
            |_: &http::request::Parts| true,
        );
    let orders = Arc::new(Orders::default());
    let gate = Gate::new();
    // The owner header reaches the in-flight lock directly, and through an outer lock
    // layer that takes the owner (and so re-enters its own key `x`) for both requests.
    let direct = orders_router(trusting.idempotency(), &orders, Some(&gate));
    let nested = direct.clone().route_layer(
        trusting.layer(|_: &http::request::Parts| Ok::<_, tower_batch_lock::Rejection>(["x"])),
    );
    for (app, key) in [(direct, "direct"), (nested, "nested")] {
        let with_owner = || {
            let mut request = order(Some(key), "{}");
            request
                .headers_mut()
                .insert("x-lock-owner", OWNER.parse().unwrap());
            request
        };
        let first = tokio::spawn({
            let (app, request) = (app.clone(), with_owner());
            async move { send(&app, request).await }
        });
        gate.wait_entered().await;
        let duplicate = send(&app, with_owner()).await;
        assert_eq!(
            duplicate.status,
            StatusCode::CONFLICT,
            "{key}: {duplicate:?}"
        );
        gate.open();
        assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    }
    assert_eq!(orders.created.load(Ordering::SeqCst), 2);
}

// ---------------------------------------------------------------------------------------
// A process that dies mid-request
// ---------------------------------------------------------------------------------------

/// The environment variable that turns [`dying_process`] into a client process.
const DYING_URL: &str = "TOWER_BATCH_LOCK_TEST_IDEMPOTENCY_URL";

/// The TTL of the dying process's in-flight lock.
const DYING_TTL: Duration = Duration::from_millis(1500);

/// Not a test: the process that [`a_killed_processs_key_is_free_again_after_its_ttl`]
/// starts and kills. It runs a request with key `k` whose handler never finishes.
#[tokio::test]
#[ignore = "a child process of another test"]
async fn dying_process() {
    let Ok(url) = std::env::var(DYING_URL) else {
        return;
    };
    let locks = Locks::new(Redis::url(&url).build().unwrap()).ttl(DYING_TTL);
    let app = Router::new().route(
        "/orders",
        post(std::future::pending::<()>).layer(locks.idempotency()),
    );
    let _ = tower::ServiceExt::oneshot(app, order(Some("k"), "{}")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_processs_key_is_free_again_after_its_ttl() {
    let store = Store::redis();
    let server = &store.servers[0];
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "idempotency::dying_process",
            "--ignored",
            "--nocapture",
        ])
        .env(DYING_URL, server.url())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start the dying process");
    let running = poll_every(Duration::from_millis(10), Duration::from_secs(20), || {
        !server.keys("idempotency:lock:run:*").is_empty()
    })
    .await;
    assert!(running.is_some(), "the child process never took the key");
    // Past its first TTL: renewed, the lock outlives it while the process lives.
    tokio::time::sleep(DYING_TTL + Duration::from_millis(300)).await;
    let orders = Arc::new(Orders::default());
    let app = orders_router(store.locks[0].idempotency(), &orders, None);
    let busy = send(&app, order(Some("k"), "{}")).await;
    assert_eq!(
        busy.status,
        StatusCode::CONFLICT,
        "the living process holds the key"
    );

    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    let ran = within(Duration::from_secs(10), "a retry runs", async {
        loop {
            let reply = send(&app, order(Some("k"), "{}")).await;
            if reply.status == StatusCode::CREATED {
                return reply;
            }
            assert_eq!(reply.status, StatusCode::CONFLICT);
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    })
    .await;
    let took = killed.elapsed();
    eprintln!("a killed process's key ran again {took:?} after the kill");
    assert!(took <= DYING_TTL + Duration::from_millis(1500), "{took:?}");
    assert!(ran.headers.get("idempotent-replayed").is_none());
    assert_eq!(orders.created.load(Ordering::SeqCst), 1);
    store.assert_no_run_left();
}

/// A body the lock layer's extractor refuses (400) is not kept by the idempotency layer
/// around it: the corrected request, with the same key, runs.
#[tokio::test]
async fn a_request_the_lock_layers_extractor_refuses_is_not_stored_and_its_correction_runs() {
    #[derive(serde::Deserialize)]
    struct NewOrder {
        skus: Vec<String>,
    }
    let locks = Locks::new(tower_batch_lock::store::Store::isolated_memory());
    let orders = Arc::new(Orders::default());
    let sku_keys =
        keys::json(|order: NewOrder| order.skus.into_iter().map(|sku| format!("sku:{sku}")));
    let create = create_order(&orders, None)
        .layer::<_, Infallible>(locks.layer(sku_keys))
        .layer(locks.idempotency());
    let app = Router::new().route("/orders", create);

    let malformed = send(&app, order(Some("po-8"), r#"{"skus": ["a", 7]}"#)).await;
    assert_eq!(malformed.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(orders.created.load(Ordering::SeqCst), 0);
    let corrected = send(&app, order(Some("po-8"), r#"{"skus": ["a", "b"]}"#)).await;
    assert_eq!(
        corrected.status,
        StatusCode::CREATED,
        "{}",
        corrected.text()
    );
    assert_eq!(orders.created.load(Ordering::SeqCst), 1);
    // And that answer is the one kept: its retry is replayed, not run again.
    let retry = send(&app, order(Some("po-8"), r#"{"skus": ["a", "b"]}"#)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(orders.created.load(Ordering::SeqCst), 1);
}

/// A request whose extractor finds no key gets a 400 problem by default, and the
/// idempotency layer around it keeps nothing: the request with the key added runs.
#[tokio::test]
async fn a_request_that_names_no_resource_gets_400_and_is_not_stored() {
    let locks = Locks::new(tower_batch_lock::store::Store::isolated_memory());
    let orders = Arc::new(Orders::default());
    let create = create_order(&orders, None)
        .layer::<_, Infallible>(locks.layer(keys::header("x-sku", "sku")))
        .layer(locks.idempotency());
    let app = Router::new().route("/orders", create);

    let unnamed = send(&app, order(Some("po-9"), "{}")).await;
    assert_eq!(unnamed.status, StatusCode::BAD_REQUEST);
    assert_eq!(unnamed.problem()["limit"], "no_keys");
    let mut named = order(Some("po-9"), "{}");
    named.headers_mut().insert("x-sku", "a".parse().unwrap());
    assert_eq!(send(&app, named).await.status, StatusCode::CREATED);
    assert_eq!(orders.created.load(Ordering::SeqCst), 1);
}
