//! The `orders` example, driven the way its users drive it: its router called in-process
//! with `oneshot`, on the memory store and on real `redis-server` processes (two app
//! instances with their own pools standing for two server processes), and the compiled
//! binary itself over TCP.
//!
//! The race tests have a control: the same race through the same routes without the lock
//! layer must lose updates, which shows that the race tests can fail.

use std::{
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{body::Body, Router};
use http::{header, HeaderMap, HeaderName, Method, Request, StatusCode};
use serde_json::{json, Value};
use tokio::{sync::Barrier, task::JoinHandle};
use tower_batch_lock::{store, Locks, Wait};

use crate::orders_app::{self as orders, Store};
use crate::support::{self, http::within};

/// How long a racing order works inside its locks.
const WORK_DELAY: Duration = Duration::from_millis(30);

// ---------------------------------------------------------------------------------------
// Driving the router

struct Reply {
    status: StatusCode,
    content_type: String,
    retry_after: Option<u64>,
    body: Value,
}

impl Reply {
    /// The `detail` of a problem document, after checking that it is one.
    fn problem_detail(&self) -> &str {
        assert_eq!(
            self.content_type, "application/problem+json",
            "a {} should be a problem document: {}",
            self.status, self.body
        );
        assert_eq!(self.body["status"], self.status.as_u16(), "{}", self.body);
        let detail = self.body["detail"].as_str().unwrap_or_default();
        assert!(
            detail.len() > 10,
            "a problem needs a readable detail: {}",
            self.body
        );
        detail
    }
}

/// [`support::http::send`], with the body read as JSON where it is JSON.
async fn send(app: &Router, request: Request<Body>) -> Reply {
    let reply = support::http::send(app, request).await;
    let content_type = header_text(&reply.headers, header::CONTENT_TYPE).unwrap_or_default();
    let retry_after = header_text(&reply.headers, header::RETRY_AFTER)
        .map(|secs| secs.parse().expect("Retry-After in seconds"));
    let body = serde_json::from_slice(&reply.body).unwrap_or_else(|_| Value::String(reply.text()));
    Reply {
        status: reply.status,
        content_type,
        retry_after,
        body,
    }
}

fn header_text(headers: &HeaderMap, name: HeaderName) -> Option<String> {
    let value = headers.get(name)?;
    Some(value.to_str().expect("a text header").to_owned())
}

fn json_request(method: Method, uri: &str, body: &Value) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

async fn get(app: &Router, uri: &str) -> Reply {
    send(app, Request::get(uri).body(Body::empty()).unwrap()).await
}

async fn put_stock(app: &Router, sku: &str, qty: u64) {
    let uri = format!("/stock/{sku}");
    let reply = send(app, json_request(Method::PUT, &uri, &json!({ "qty": qty }))).await;
    assert_eq!(reply.status, StatusCode::OK, "PUT {uri}: {}", reply.body);
    assert_eq!(reply.body, json!({ "sku": sku, "qty": qty }));
}

/// The stock level of `sku`; `None` for a 404.
async fn stock(app: &Router, sku: &str) -> Option<u64> {
    let reply = get(app, &format!("/stock/{sku}")).await;
    match reply.status {
        StatusCode::OK => Some(reply.body["qty"].as_u64().expect("a numeric qty")),
        StatusCode::NOT_FOUND => {
            reply.problem_detail();
            None
        }
        other => panic!("GET /stock/{sku}: {other} {}", reply.body),
    }
}

async fn post_order(app: &Router, order: &Value) -> Reply {
    send(app, json_request(Method::POST, "/orders", order)).await
}

async fn post_quote(app: &Router, quote: &Value) -> Reply {
    send(app, json_request(Method::POST, "/quotes", quote)).await
}

fn order<S: AsRef<str>>(order_id: &str, items: &[(S, u64)]) -> Value {
    json!({ "order_id": order_id, "items": lines(items) })
}

/// The body of a quote, without the `order_id` it may have.
fn quote<S: AsRef<str>>(items: &[(S, u64)]) -> Value {
    json!({ "items": lines(items) })
}

fn lines<S: AsRef<str>>(items: &[(S, u64)]) -> Vec<Value> {
    items
        .iter()
        .map(|(sku, qty)| json!({ "sku": sku.as_ref(), "qty": qty }))
        .collect()
}

fn memory_app(work_delay: Duration) -> Router {
    memory_app_waiting(work_delay, Wait::none())
}

/// With `LOCK_WAIT_MS`, as `main` sets it: busy locks are waited for as `wait` says.
fn memory_app_waiting(work_delay: Duration, wait: Wait) -> Router {
    let locks = Locks::new(store::Store::isolated_memory()).wait(wait);
    orders::app(Store::memory(), Some(locks), work_delay)
}

/// One instance of the service on `server`, with its own pool: a process of its own, as
/// far as Redis can tell. `locked: false` leaves the lock layer out (the control).
#[cfg(feature = "redis")]
fn redis_app(server: &support::RedisServer, work_delay: Duration, locked: bool) -> Router {
    let pool = server.pool();
    let locks = locked.then(|| redis_locks(&pool));
    orders::app(Store::redis(pool), locks, work_delay)
}

/// `REDIS_URLS`: one instance of the service that locks with Redlock over `masters`, and
/// keeps its data in the first; busy locks are waited for as `wait` says.
#[cfg(feature = "redis")]
fn redlock_app(masters: &[support::RedisServer], work_delay: Duration, wait: Wait) -> Router {
    let urls: Vec<String> = masters.iter().map(support::RedisServer::url).collect();
    // A generous per-master timeout: on a loaded two-core machine a debug build can starve
    // a task past the 100 ms default, and the tests of the example are about what the
    // locks keep apart, not about how fast a master must answer (the `redlock` module
    // covers that).
    let locks = Locks::new(
        store::Redlock::new(&urls)
            .node_timeout(Duration::from_secs(1))
            .build()
            .expect("valid URLs"),
    );
    orders::app(
        Store::redis(masters[0].pool()),
        Some(locks.wait(wait)),
        work_delay,
    )
}

/// [`redis_app`] with `LOCK_WAIT_MS`, as `main` sets it: busy locks are waited for as
/// `wait` says.
#[cfg(feature = "redis")]
fn redis_app_waiting(server: &support::RedisServer, work_delay: Duration, wait: Wait) -> Router {
    let pool = server.pool();
    let locks = redis_locks(&pool).wait(wait);
    orders::app(Store::redis(pool), Some(locks), work_delay)
}

#[cfg(feature = "redis")]
fn redis_locks(pool: &deadpool_redis::Pool) -> Locks {
    Locks::new(store::Redis::pool(pool.clone()).build().unwrap())
}

// ---------------------------------------------------------------------------------------
// 1. The flows of the README, on both stores

async fn basic_flows(app: &Router) {
    assert_eq!(stock(app, "apple").await, None, "no stock level yet");
    put_stock(app, "apple", 10).await;
    put_stock(app, "pear", 4).await;
    assert_eq!(stock(app, "apple").await, Some(10));

    // Duplicate SKUs are summed: the order takes 5 apples.
    let first = order("o-1", &[("apple", 3), ("pear", 1), ("apple", 2)]);
    let placed = post_order(app, &first).await;
    assert_eq!(placed.status, StatusCode::CREATED, "{}", placed.body);
    let fence = placed.body["fence"].as_u64();
    assert!(
        fence.is_some_and(|f| f > 0),
        "a 201 carries its fencing token: {}",
        placed.body
    );
    let expected = json!({
        "order_id": "o-1",
        "items": [{ "sku": "apple", "qty": 5 }, { "sku": "pear", "qty": 1 }],
        "fence": fence,
    });
    assert_eq!(placed.body, expected);
    assert_eq!(stock(app, "apple").await, Some(5));
    assert_eq!(stock(app, "pear").await, Some(3));

    // A replay answers the stored order and takes nothing again.
    let replay = post_order(app, &first).await;
    assert_eq!(replay.status, StatusCode::OK, "{}", replay.body);
    assert_eq!(replay.body, expected);
    assert_eq!(stock(app, "apple").await, Some(5));
    assert_eq!(stock(app, "pear").await, Some(3));

    // Not enough apples: nothing is taken, not even the pear, and no order is stored.
    let short = post_order(app, &order("o-2", &[("pear", 1), ("apple", 6)])).await;
    assert_eq!(short.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(short.problem_detail().contains("apple"), "{}", short.body);
    assert_eq!(stock(app, "apple").await, Some(5));
    assert_eq!(stock(app, "pear").await, Some(3));
    assert_eq!(get(app, "/orders/o-2").await.status, StatusCode::NOT_FOUND);

    // A SKU without a stock level has none.
    let unknown = post_order(app, &order("o-3", &[("pear", 1), ("kiwi", 1)])).await;
    assert_eq!(unknown.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        unknown.problem_detail().contains("kiwi"),
        "{}",
        unknown.body
    );
    assert_eq!(stock(app, "pear").await, Some(3));

    // An order that makes no sense is refused by the handler, also as a problem.
    let empty = post_order(app, &json!({ "order_id": "o-4", "items": [] })).await;
    assert_eq!(empty.status, StatusCode::UNPROCESSABLE_ENTITY);
    empty.problem_detail();

    let stored = get(app, "/orders/o-1").await;
    assert_eq!(stored.status, StatusCode::OK);
    assert_eq!(stored.body, expected);
    let missing = get(app, "/orders/nope").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    missing.problem_detail();
}

/// `POST /orders` with an `Idempotency-Key`: a retry gets the first answer, 201 and all,
/// and takes nothing again; the key with another order is 422.
async fn idempotent_orders(app: &Router) {
    put_stock(app, "plum", 5).await;
    let with_key = |key: &str, order: &Value| {
        let mut request = json_request(Method::POST, "/orders", order);
        request
            .headers_mut()
            .insert("idempotency-key", key.parse().unwrap());
        request
    };
    let first_order = order("o-10", &[("plum", 2)]);
    let first = support::http::send(app, with_key("\"k-10\"", &first_order)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    let retry = support::http::send(app, with_key("\"k-10\"", &first_order)).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the first answer, not the 200 of a replay"
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(stock(app, "plum").await, Some(3), "taken once");

    let other = send(app, with_key("\"k-10\"", &order("o-11", &[("plum", 1)]))).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        other.problem_detail().contains("Idempotency-Key"),
        "{}",
        other.body
    );
    assert_eq!(stock(app, "plum").await, Some(3));
}

/// `POST /quotes`, after [`basic_flows`] (5 apples and 3 pears in stock): whether an order
/// would go through, and the levels it would take from; with or without an `order_id`. A
/// quote takes nothing and stores nothing, and the idempotency layer leaves it alone.
async fn quote_flows(app: &Router) {
    // Duplicate SKUs are summed, as in an order: 5 apples of 5.
    let quoted = post_quote(app, &quote(&[("apple", 2), ("pear", 3), ("apple", 3)])).await;
    assert_eq!(quoted.status, StatusCode::OK, "{}", quoted.body);
    let levels = json!({ "apple": 5, "pear": 3 });
    assert_eq!(quoted.body, json!({ "available": true, "levels": levels }));

    // Too many apples, and a SKU without a stock level: still a 200, not available. The
    // `order_id` of a placed order changes nothing: a quote neither reads nor locks it.
    let short = post_quote(app, &order("o-1", &[("apple", 6), ("kiwi", 1)])).await;
    assert_eq!(short.status, StatusCode::OK, "{}", short.body);
    let levels = json!({ "apple": 5, "kiwi": 0 });
    assert_eq!(short.body, json!({ "available": false, "levels": levels }));
    assert_eq!(stock(app, "apple").await, Some(5), "a quote takes nothing");
    assert_eq!(stock(app, "kiwi").await, None, "a quote writes nothing");

    // With an `Idempotency-Key`: no answer is stored for it, so the same key runs again,
    // with the same quote or another one.
    for (qty, available) in [(1, true), (1, true), (4, false)] {
        let mut request = json_request(Method::POST, "/quotes", &quote(&[("pear", qty)]));
        request
            .headers_mut()
            .insert("idempotency-key", "\"k-q\"".parse().unwrap());
        let reply = support::http::send(app, request).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert!(!reply.headers.contains_key("idempotent-replayed"));
        let body: Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(body["available"], available, "{body}");
    }
}

#[tokio::test]
async fn memory_basic_flows() {
    let app = memory_app(Duration::ZERO);
    basic_flows(&app).await;
    quote_flows(&app).await;
    idempotent_orders(&app).await;
}

/// The orders' fences never go back, even when the Redis that keeps the locks (and here
/// the data) restarts without them: the next order's fence is larger than every earlier one.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_order_fences_never_go_back_across_a_restart_without_data() {
    let mut server = support::RedisServer::start();
    let place = |app: Router, id: String| async move {
        put_stock(&app, "apple", 5).await;
        let placed = post_order(&app, &order(&id, &[("apple", 1)])).await;
        assert_eq!(placed.status, StatusCode::CREATED, "{}", placed.body);
        placed.body["fence"].as_u64().expect("a fence")
    };
    let app = redis_app(&server, Duration::ZERO, true);
    let mut before = Vec::new();
    for i in 0..5 {
        before.push(place(app.clone(), format!("before-{i}")).await);
    }
    assert!(before.windows(2).all(|w| w[0] < w[1]), "{before:?}");

    // Nothing is kept on disk: the counter is gone with the stock.
    server.restart();
    let app = redis_app(&server, Duration::ZERO, true);
    let mut after = None;
    // The pools reconnect on their own: a few attempts at most.
    for attempt in 0..50 {
        let stocked = send(
            &app,
            json_request(Method::PUT, "/stock/apple", &json!({ "qty": 5 })),
        );
        if stocked.await.status != StatusCode::OK {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let placed = post_order(&app, &order(&format!("after-{attempt}"), &[("apple", 1)])).await;
        if placed.status == StatusCode::CREATED {
            after = placed.body["fence"].as_u64();
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = after.expect("an order placed after the restart");
    assert!(after > before[4], "{after} after {before:?}");
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_basic_flows() {
    let server = support::RedisServer::start();
    let app = redis_app(&server, Duration::ZERO, true);
    basic_flows(&app).await;
    quote_flows(&app).await;
    idempotent_orders(&app).await;

    assert_eq!(server.keys("lock:?*"), Vec::<String>::new(), "locks left");
    let mut data = server.keys("*");
    data.sort();
    assert_eq!(
        data,
        [
            "idempotency:lock:", // the in-flight locks' fencing counter
            "idempotency:lock:done:0::k-10",
            "lock:", // the fencing counter
            "orders:order:o-1",
            "orders:order:o-10",
            "orders:order:o-10:fence{orders:order:o-10}", // the last fencing token that wrote it
            "orders:order:o-1:fence{orders:order:o-1}",
            "orders:stock:apple",
            "orders:stock:apple:fence{orders:stock:apple}",
            "orders:stock:pear",
            "orders:stock:pear:fence{orders:stock:pear}",
            "orders:stock:plum",
            "orders:stock:plum:fence{orders:stock:plum}",
        ],
        "the data lives under `orders:`, apart from the locks and the stored answers \
         (none for quotes)"
    );
}

/// `REDIS_CLUSTER_URLS`: the locks and the data on a Redis Cluster (three masters with a
/// replica each), given by one of its nodes.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_basic_flows() {
    let (_serial, cluster) = support::cluster::Cluster::start_in_turn().await;
    let urls = &cluster.urls()[..1];
    let client = redis::cluster::ClusterClient::new(urls.to_vec()).unwrap();
    let data = client.get_async_connection().await.unwrap();
    let locks = Locks::new(store::RedisCluster::new(urls).build().unwrap());
    let app = orders::app(Store::redis_cluster(data), Some(locks), Duration::ZERO);
    basic_flows(&app).await;
    quote_flows(&app).await;
    idempotent_orders(&app).await;

    assert!(
        cluster.empty(),
        "locks left: {:?}",
        cluster.locks_on_masters()
    );
    // The data is spread over the masters, under `orders:`, apart from the locks.
    let mut data = Vec::new();
    for port in cluster.masters() {
        data.extend(cluster.cmd::<Vec<String>>(port, redis::cmd("KEYS").arg("orders:*")));
    }
    data.sort();
    assert_eq!(
        data,
        [
            "orders:order:o-1",
            "orders:order:o-10",
            "orders:order:o-10:fence{orders:order:o-10}", // in its key's slot
            "orders:order:o-1:fence{orders:order:o-1}",
            "orders:stock:apple",
            "orders:stock:apple:fence{orders:stock:apple}",
            "orders:stock:pear",
            "orders:stock:pear:fence{orders:stock:pear}",
            "orders:stock:plum",
            "orders:stock:plum:fence{orders:stock:plum}",
        ]
    );
}

/// A stock update waits for (here: is refused during) an order of the same SKU, also for
/// SKUs with `/` or `%`, which arrive percent-encoded in the path: both routes must lock
/// the same key. So does a quote of those SKUs, which must not read what the order is
/// about to change.
#[tokio::test]
async fn memory_stock_updates_and_orders_of_one_sku_exclude_each_other() {
    let app = memory_app(Duration::from_millis(1_000));
    let skus = ["apple", "a/b", "50%"];
    let paths = ["apple", "a%2Fb", "50%25"];
    for path in paths {
        let reply = send(
            &app,
            json_request(Method::PUT, &format!("/stock/{path}"), &json!({ "qty": 5 })),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    }
    let items: Vec<(&str, u64)> = skus.iter().map(|&sku| (sku, 1)).collect();
    let working = order("slow", &items);
    let slow = {
        let app = app.clone();
        tokio::spawn(async move { post_order(&app, &working).await })
    };
    // The order holds its locks for a second; look well inside that.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for path in paths {
        let update = json_request(
            Method::PUT,
            &format!("/stock/{path}"),
            &json!({ "qty": 50 }),
        );
        let reply = send(&app, update).await;
        assert_eq!(
            reply.status,
            StatusCode::CONFLICT,
            "PUT /stock/{path}: {}",
            reply.body
        );
        reply.problem_detail();
        assert!(reply.retry_after.is_some(), "a 409 says when to retry");
    }
    let quoted = post_quote(&app, &quote(&items)).await;
    assert_eq!(quoted.status, StatusCode::CONFLICT, "{}", quoted.body);
    quoted.problem_detail();
    assert!(quoted.retry_after.is_some(), "a 409 says when to retry");
    let placed = within(Duration::from_secs(5), "the slow order", slow)
        .await
        .unwrap();
    assert_eq!(placed.status, StatusCode::CREATED, "{}", placed.body);
    for (sku, path) in skus.iter().zip(paths) {
        assert_eq!(stock(&app, path).await, Some(4), "{sku}");
    }
}

// ---------------------------------------------------------------------------------------
// 2. Racing orders never oversell, and without the locks they do

const RACE_SKUS: usize = 4;
const RACE_STOCK: u64 = 40;
const RACE_ORDERS: usize = 48;
/// A client retries a 409 until this long after the start, or this many times.
const RACE_RETRY_FOR: Duration = Duration::from_secs(6);
const RACE_MAX_ATTEMPTS: usize = 300;

struct RacedOrder {
    items: Vec<(String, u64)>,
    /// The status of every attempt, the final one last.
    attempts: Vec<StatusCode>,
}

impl RacedOrder {
    fn status(&self) -> StatusCode {
        *self.attempts.last().expect("at least one attempt")
    }
}

struct Race {
    orders: Vec<RacedOrder>,
    /// The final stock level of each SKU, `race-0`, `race-1`, ...
    stock: Vec<u64>,
}

fn race_sku(k: usize) -> String {
    format!("race-{}", k % RACE_SKUS)
}

/// Order `i` takes 1 to 3 units of each of two neighbouring SKUs, so every SKU is wanted
/// by half the orders, and the orders want more (about 48 units of each) than there is.
fn race_items(i: usize) -> Vec<(String, u64)> {
    vec![
        (race_sku(i), 1 + i as u64 % 3),
        (race_sku(i + 1), 1 + (i / 3) as u64 % 3),
    ]
}

/// A small deterministic jitter, so that retrying clients do not move in lockstep.
struct Jitter(u64);

impl Jitter {
    fn millis(&mut self, from: u64, to: u64) -> Duration {
        // xorshift64
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        Duration::from_millis(from + self.0 % (to - from))
    }
}

/// Stocks the race SKUs, then sends all the orders at once, round-robin over `apps`.
async fn race(apps: &[Router]) -> Race {
    for k in 0..RACE_SKUS {
        put_stock(&apps[0], &race_sku(k), RACE_STOCK).await;
    }
    let start = Arc::new(Barrier::new(RACE_ORDERS));
    let clients: Vec<_> = (0..RACE_ORDERS)
        .map(|i| tokio::spawn(race_client(apps[i % apps.len()].clone(), i, start.clone())))
        .collect();
    let mut orders = Vec::with_capacity(RACE_ORDERS);
    for client in clients {
        let raced = within(Duration::from_secs(15), "racing client", client).await;
        orders.push(raced.expect("the client does not panic"));
    }
    let mut stock_levels = Vec::with_capacity(RACE_SKUS);
    for k in 0..RACE_SKUS {
        stock_levels.push(stock(&apps[0], &race_sku(k)).await.expect("stocked"));
    }
    Race {
        orders,
        stock: stock_levels,
    }
}

/// Sends order `i` when every client is ready; retries it after a short pause while it
/// meets a held lock (409), within bounds.
async fn race_client(app: Router, i: usize, start: Arc<Barrier>) -> RacedOrder {
    let items = race_items(i);
    let body = order(&format!("race-{i}"), &items);
    let mut jitter = Jitter(0x9E37_79B9_7F4A_7C15 ^ i as u64);
    start.wait().await;
    let deadline = Instant::now() + RACE_RETRY_FOR;
    let mut attempts = Vec::new();
    while attempts.len() < RACE_MAX_ATTEMPTS {
        let status = post_order(&app, &body).await.status;
        attempts.push(status);
        if status != StatusCode::CONFLICT || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(jitter.millis(5, 25)).await;
    }
    RacedOrder { items, attempts }
}

/// Whether every SKU's final stock is its initial stock minus what the 201 orders took,
/// and never below zero.
fn stock_adds_up(race: &Race) -> Result<(), String> {
    for (k, &left) in race.stock.iter().enumerate() {
        let sku = race_sku(k);
        let sold: u64 = race
            .orders
            .iter()
            .filter(|o| o.status() == StatusCode::CREATED)
            .flat_map(|o| &o.items)
            .filter(|(s, _)| *s == sku)
            .map(|(_, qty)| qty)
            .sum();
        let Some(expected) = RACE_STOCK.checked_sub(sold) else {
            return Err(format!(
                "{sku} oversold: the 201 orders took {sold} of {RACE_STOCK} (stock says {left})"
            ));
        };
        if left != expected {
            return Err(format!(
                "{sku}: the 201 orders took {sold} of {RACE_STOCK}, so {expected} should be \
                 left, but the stock says {left}: an update was lost"
            ));
        }
    }
    Ok(())
}

/// How many attempts got `status`.
fn attempts_with(race: &Race, status: StatusCode) -> usize {
    let attempts = race.orders.iter().flat_map(|o| &o.attempts);
    attempts.filter(|&&s| s == status).count()
}

/// How many orders ended with `status`.
fn orders_with(race: &Race, status: StatusCode) -> usize {
    race.orders.iter().filter(|o| o.status() == status).count()
}

fn assert_no_overselling(race: &Race) {
    let expected = [
        StatusCode::CREATED,
        StatusCode::CONFLICT,
        StatusCode::UNPROCESSABLE_ENTITY,
    ];
    for raced in &race.orders {
        for status in &raced.attempts {
            assert!(expected.contains(status), "an attempt got {status}");
        }
        // Stock only goes down, so an order refused for stock still lacks it at the end.
        if raced.status() == StatusCode::UNPROCESSABLE_ENTITY {
            let lacking = raced.items.iter().any(|(sku, qty)| {
                let k: usize = sku["race-".len()..].parse().unwrap();
                race.stock[k] < *qty
            });
            assert!(lacking, "{:?} got 422 with stock left", raced.items);
        }
    }
    if let Err(problem) = stock_adds_up(race) {
        panic!("with the locks: {problem}");
    }
    let conflicts = attempts_with(race, StatusCode::CONFLICT);
    assert!(
        conflicts > 0,
        "no order ever met a held lock: nothing raced"
    );
    let placed = orders_with(race, StatusCode::CREATED);
    assert!(placed >= 10, "only {placed} of {RACE_ORDERS} orders placed");
    eprintln!(
        "race: {placed} placed, {} refused for stock, {} gave up; {conflicts} 409s in {} attempts",
        orders_with(race, StatusCode::UNPROCESSABLE_ENTITY),
        orders_with(race, StatusCode::CONFLICT),
        race.orders.iter().map(|o| o.attempts.len()).sum::<usize>(),
    );
}

fn assert_updates_lost(race: &Race) {
    assert_eq!(
        attempts_with(race, StatusCode::CONFLICT),
        0,
        "nothing locks, so nothing conflicts"
    );
    let problem = stock_adds_up(race)
        .expect_err("without the locks the race should lose updates; the race test is blind");
    eprintln!("control, as expected: {problem}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_racing_orders_never_oversell() {
    let race = race(&[memory_app(WORK_DELAY)]).await;
    assert_no_overselling(&race);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_control_without_locks_loses_updates() {
    let app = orders::app(Store::memory(), None, WORK_DELAY);
    assert_updates_lost(&race(&[app]).await);
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_racing_orders_on_two_instances_never_oversell() {
    let server = support::RedisServer::start();
    let apps = [
        redis_app(&server, WORK_DELAY, true),
        redis_app(&server, WORK_DELAY, true),
    ];
    let race = race(&apps).await;
    assert_no_overselling(&race);
    assert_eq!(server.keys("lock:?*"), Vec::<String>::new(), "locks left");
}

/// `REDIS_URLS`: two instances lock with Redlock over three masters and keep their data
/// in the first.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redlock_racing_orders_on_two_instances_never_oversell() {
    let masters: Vec<_> = (0..3).map(|_| support::RedisServer::start()).collect();
    let apps = [
        redlock_app(&masters, WORK_DELAY, Wait::none()),
        redlock_app(&masters, WORK_DELAY, Wait::none()),
    ];
    let race = race(&apps).await;
    assert_no_overselling(&race);
    let released = within(Duration::from_secs(2), "every master released", async {
        while masters.iter().any(|m| !m.keys("lock:?*").is_empty()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    released.await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_control_without_locks_loses_updates() {
    let server = support::RedisServer::start();
    let apps = [
        redis_app(&server, WORK_DELAY, false),
        redis_app(&server, WORK_DELAY, false),
    ];
    assert_updates_lost(&race(&apps).await);
}

// ---------------------------------------------------------------------------------------
// 3. Quotes hold their SKUs shared: together, never beside an order

/// How long each quote and order of this section works inside its locks.
const TURN_WORK: Duration = Duration::from_millis(400);
/// A request of this section sent "meanwhile" goes out this long after the one it follows,
/// well inside that one's work.
const TURN_STEP: Duration = Duration::from_millis(150);
/// `LOCK_WAIT_MS` of this section's waiting apps.
const TURN_WAIT: Wait = Wait::up_to(Duration::from_secs(5));
const QUOTE_SKUS: [&str; 3] = ["q-a", "q-b", "q-c"];
const QUOTE_STOCK: u64 = 10;
/// How many quotes go out at once.
const QUOTES: usize = 6;

/// One of each quote SKU.
fn quote_items() -> Vec<(&'static str, u64)> {
    QUOTE_SKUS.iter().map(|&sku| (sku, 1)).collect()
}

/// A quote's answer when every quote SKU has `level` in stock.
fn quoted_at(level: u64) -> Value {
    let levels: serde_json::Map<String, Value> = QUOTE_SKUS
        .iter()
        .map(|&sku| (sku.to_owned(), json!(level)))
        .collect();
    json!({ "available": true, "levels": levels })
}

async fn stock_quote_skus(app: &Router) {
    for sku in QUOTE_SKUS {
        put_stock(app, sku, QUOTE_STOCK).await;
    }
}

/// `count` requests from `request`, sent together once all are ready, round-robin over
/// `apps`: their answers, and how long all of them took.
async fn burst<F, Fut>(apps: &[Router], count: usize, request: F) -> (Vec<Reply>, Duration)
where
    F: Fn(Router, usize) -> Fut,
    Fut: Future<Output = Reply> + Send + 'static,
{
    let start = Arc::new(Barrier::new(count + 1));
    let sent: Vec<_> = (0..count)
        .map(|i| {
            let (start, reply) = (start.clone(), request(apps[i % apps.len()].clone(), i));
            tokio::spawn(async move {
                start.wait().await;
                reply.await
            })
        })
        .collect();
    start.wait().await;
    let started = Instant::now();
    let mut replies = Vec::with_capacity(count);
    for reply in sent {
        replies.push(
            within(Duration::from_secs(10), "a request", reply)
                .await
                .unwrap(),
        );
    }
    (replies, started.elapsed())
}

/// `QUOTES` quotes of the same SKUs at once all answer 200 in little more than the time of
/// one: they hold the SKUs together. The same burst of orders, which hold them
/// exclusively, is refused but for the first (nothing waits here), which shows that the
/// burst does collide.
async fn quotes_run_together(apps: &[Router]) {
    stock_quote_skus(&apps[0]).await;
    let (quoted, took) = burst(apps, QUOTES, |app, _| async move {
        post_quote(&app, &quote(&quote_items())).await
    })
    .await;
    for reply in &quoted {
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        assert_eq!(reply.body, quoted_at(QUOTE_STOCK));
    }
    // One after the other they would take `QUOTES` times as long.
    assert!(
        took < TURN_WORK * 3,
        "{QUOTES} quotes of {TURN_WORK:?} of work each took {took:?}: they did not run together"
    );
    eprintln!("{QUOTES} quotes of {TURN_WORK:?} of work each, at once: {took:?} in all");

    let (ordered, _) = burst(apps, QUOTES, |app, i| async move {
        post_order(&app, &order(&format!("burst-{i}"), &quote_items())).await
    })
    .await;
    let placed = ordered
        .iter()
        .filter(|r| r.status == StatusCode::CREATED)
        .count();
    let refused = ordered
        .iter()
        .filter(|r| r.status == StatusCode::CONFLICT)
        .count();
    assert_eq!(placed + refused, QUOTES, "orders answered otherwise");
    assert!(
        placed >= 1 && refused >= 1,
        "of {QUOTES} orders at once, {placed} were placed and {refused} refused"
    );
    eprintln!("{QUOTES} orders at once: {placed} placed, {refused} refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_quotes_of_the_same_skus_run_together() {
    quotes_run_together(&[memory_app(TURN_WORK)]).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_quotes_of_the_same_skus_run_together_on_two_instances() {
    let server = support::RedisServer::start();
    let apps = [
        redis_app(&server, TURN_WORK, true),
        redis_app(&server, TURN_WORK, true),
    ];
    quotes_run_together(&apps).await;
    assert_eq!(server.keys("lock:?*"), Vec::<String>::new(), "locks left");
}

/// A request's answer, and when it came.
struct Answered {
    reply: Reply,
    at: Instant,
}

fn spawn_timed<Fut>(request: Fut) -> JoinHandle<Answered>
where
    Fut: Future<Output = Reply> + Send + 'static,
{
    tokio::spawn(async move {
        let reply = request.await;
        Answered {
            reply,
            at: Instant::now(),
        }
    })
}

fn spawn_quote(app: &Router) -> JoinHandle<Answered> {
    let app = app.clone();
    spawn_timed(async move { post_quote(&app, &quote(&quote_items())).await })
}

fn spawn_order(app: &Router, order_id: &str) -> JoinHandle<Answered> {
    let (app, body) = (app.clone(), order(order_id, &quote_items()));
    spawn_timed(async move { post_order(&app, &body).await })
}

async fn answered(request: JoinHandle<Answered>) -> Answered {
    within(Duration::from_secs(15), "a quote or an order", request)
        .await
        .unwrap()
}

/// An order of one of each quote SKU, and quotes of them sent while it works: the order's
/// answer and theirs.
async fn quotes_during_an_order(apps: &[Router]) -> (Answered, Vec<Answered>) {
    stock_quote_skus(&apps[0]).await;
    let order = spawn_order(&apps[0], "turn-1");
    tokio::time::sleep(TURN_STEP).await;
    let quotes: Vec<_> = (1..=3)
        .map(|i| spawn_quote(&apps[i % apps.len()]))
        .collect();
    let order = answered(order).await;
    let mut answers = Vec::with_capacity(quotes.len());
    for quote in quotes {
        answers.push(answered(quote).await);
    }
    (order, answers)
}

/// Orders and quotes of the same SKUs take turns (`TURN_WAIT` on `apps`): a quote sent
/// while an order works waits for it and sees what it left, never the levels it was about
/// to change; an order sent while quotes work waits for them and is then granted; and
/// quotes sent while that order waits do not jump it (a waiting exclusive request keeps
/// later shared ones out), so they see what it left too.
async fn quotes_and_orders_take_turns(apps: &[Router]) {
    let (first, quotes) = quotes_during_an_order(apps).await;
    assert_eq!(
        first.reply.status,
        StatusCode::CREATED,
        "{}",
        first.reply.body
    );
    for quote in &quotes {
        assert_eq!(quote.reply.status, StatusCode::OK, "{}", quote.reply.body);
        assert_eq!(
            quote.reply.body,
            quoted_at(QUOTE_STOCK - 1),
            "after the order"
        );
        assert!(
            quote.at > first.at,
            "a quote answered before the order it waited for"
        );
    }

    let holding: Vec<_> = (0..3).map(|i| spawn_quote(&apps[i % apps.len()])).collect();
    tokio::time::sleep(TURN_STEP).await;
    let second = spawn_order(&apps[1 % apps.len()], "turn-2");
    tokio::time::sleep(TURN_STEP).await;
    let later: Vec<_> = (0..3).map(|i| spawn_quote(&apps[i % apps.len()])).collect();
    let mut holding_ended = Vec::new();
    for quote in holding {
        let quote = answered(quote).await;
        assert_eq!(quote.reply.status, StatusCode::OK, "{}", quote.reply.body);
        assert_eq!(
            quote.reply.body,
            quoted_at(QUOTE_STOCK - 1),
            "before the order"
        );
        holding_ended.push(quote.at);
    }
    let second = answered(second).await;
    assert_eq!(
        second.reply.status,
        StatusCode::CREATED,
        "the order waited for the quotes: {}",
        second.reply.body
    );
    assert!(
        holding_ended.iter().all(|&at| at < second.at),
        "the order answered before the quotes that held its SKUs"
    );
    for quote in later {
        let quote = answered(quote).await;
        assert_eq!(quote.reply.status, StatusCode::OK, "{}", quote.reply.body);
        assert_eq!(
            quote.reply.body,
            quoted_at(QUOTE_STOCK - 2),
            "a quote sent while the order waited went before it"
        );
        assert!(
            quote.at > second.at,
            "a quote answered before the order it waited for"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_quotes_and_orders_of_the_same_skus_take_turns() {
    quotes_and_orders_take_turns(&[memory_app_waiting(TURN_WORK, TURN_WAIT)]).await;
}

/// The control: without the locks, quotes sent while an order works read the levels it is
/// about to change, and answer with them after it is placed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_control_without_locks_quotes_read_under_a_working_order() {
    let app = orders::app(Store::memory(), None, TURN_WORK);
    let (order, quotes) = quotes_during_an_order(&[app]).await;
    assert_eq!(
        order.reply.status,
        StatusCode::CREATED,
        "{}",
        order.reply.body
    );
    for quote in &quotes {
        assert_eq!(quote.reply.body, quoted_at(QUOTE_STOCK), "before the order");
        assert!(quote.at > order.at, "answered after the order was placed");
    }
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_quotes_and_orders_of_the_same_skus_take_turns_on_two_instances() {
    let server = support::RedisServer::start();
    let apps = [
        redis_app_waiting(&server, TURN_WORK, TURN_WAIT),
        redis_app_waiting(&server, TURN_WORK, TURN_WAIT),
    ];
    quotes_and_orders_take_turns(&apps).await;
    assert_eq!(server.keys("lock:?*"), Vec::<String>::new(), "locks left");
}

/// `REDIS_URLS`: the same turns with the locks on three Redlock masters, where each
/// master keeps its own holds and reservations.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redlock_quotes_and_orders_of_the_same_skus_take_turns_on_two_instances() {
    let masters: Vec<_> = (0..3).map(|_| support::RedisServer::start()).collect();
    let apps = [
        redlock_app(&masters, TURN_WORK, TURN_WAIT),
        redlock_app(&masters, TURN_WORK, TURN_WAIT),
    ];
    quotes_and_orders_take_turns(&apps).await;
}

// ---------------------------------------------------------------------------------------
// 4. An order of 3,000 SKUs

const BIG: usize = 3_000;

fn big_sku(i: usize) -> String {
    format!("big-{i}")
}

fn big_order(order_id: &str) -> Value {
    let items: Vec<Value> = (0..BIG)
        .map(|i| json!({ "sku": big_sku(i), "qty": 1 }))
        .collect();
    json!({ "order_id": order_id, "items": items })
}

/// Sets every big SKU's stock to 5 with one MSET, as a bulk import would.
#[cfg(feature = "redis")]
fn stock_big_skus(server: &support::RedisServer) {
    let mut mset = redis::cmd("MSET");
    for i in 0..BIG {
        mset.arg(format!("orders:stock:{}", big_sku(i))).arg(5);
    }
    let () = mset.query(&mut server.connection()).expect("MSET");
}

#[cfg(feature = "redis")]
fn big_stock_levels(server: &support::RedisServer) -> Vec<Option<u64>> {
    let keys: Vec<String> = (0..BIG)
        .map(|i| format!("orders:stock:{}", big_sku(i)))
        .collect();
    redis::cmd("MGET")
        .arg(keys)
        .query(&mut server.connection())
        .expect("MGET")
}

#[tokio::test]
async fn memory_order_of_3000_skus_succeeds() {
    let app = memory_app(Duration::ZERO);
    for i in 0..BIG {
        put_stock(&app, &big_sku(i), 5).await;
    }
    let placed = post_order(&app, &big_order("big")).await;
    assert_eq!(placed.status, StatusCode::CREATED, "{}", placed.body);
    assert_eq!(placed.body["items"].as_array().unwrap().len(), BIG);
    for i in [0, 1, BIG / 2, BIG - 1] {
        assert_eq!(stock(&app, &big_sku(i)).await, Some(4));
    }
}

/// While the order works, its 3,001 locks (3,000 SKUs and the order) are all in Redis at
/// once. The free ones come with plain pipelined `SET`s, and they go in steps of 1,000 keys
/// (the default step), so that no script stalls Redis for long: once the batch was seen
/// whole, every look from outside sees whole steps released, never part of one.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_order_of_3000_skus_locks_them_all_in_one_batch() {
    let server = Arc::new(support::RedisServer::start());
    stock_big_skus(&server);
    let app = redis_app(&server, Duration::from_millis(400), true);

    let request = tokio::spawn(async move { post_order(&app, &big_order("big")).await });
    let watcher = {
        let server = server.clone();
        tokio::task::spawn_blocking(move || {
            let (mut seen, deadline) = (Vec::new(), Instant::now() + Duration::from_secs(10));
            // Until the batch has come and gone.
            while Instant::now() < deadline
                && !(seen.contains(&(BIG + 1)) && seen.last() == Some(&0))
            {
                seen.push(server.keys("lock:?*").len());
                std::thread::sleep(Duration::from_millis(10));
            }
            seen
        })
    };
    let placed = within(Duration::from_secs(10), "the big order", request)
        .await
        .unwrap();
    let seen = watcher.await.unwrap();

    assert_eq!(placed.status, StatusCode::CREATED, "{}", placed.body);
    assert_eq!(placed.body["items"].as_array().unwrap().len(), BIG);
    let whole = seen.iter().position(|&n| n == BIG + 1);
    assert!(
        whole.is_some(),
        "the order's {} locks were never seen held together: {seen:?}",
        BIG + 1
    );
    // Sorted, the 3,001 keys are released in three steps of 1,000 and a last one of 1: a
    // look sees 3,001, 2,001, 1,001, 1 or none.
    assert!(
        seen[whole.unwrap()..].iter().all(|&n| n % 1000 <= 1),
        "part of a step was visible: lock counts seen {seen:?}"
    );
    assert!(big_stock_levels(&server).iter().all(|&l| l == Some(4)));
    assert_eq!(server.keys("lock:?*"), Vec::<String>::new(), "locks left");
}

/// One SKU of the 3,000 is held by another instance's order: the big order is refused
/// whole, takes no lock and no stock, and goes through once the other order is done.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_order_of_3000_skus_with_one_held_sku_is_refused_whole() {
    let server = support::RedisServer::start();
    stock_big_skus(&server);
    let holder_app = redis_app(&server, Duration::from_millis(1_500), true);
    let app = redis_app(&server, Duration::ZERO, true);

    let held = big_sku(1_234);
    let holder_order = order("holder", &[(held.as_str(), 1)]);
    let holder = tokio::spawn(async move { post_order(&holder_app, &holder_order).await });
    let holder_locks = vec!["lock:order:holder".to_owned(), format!("lock:sku:{held}")];
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.keys("lock:?*").len() < 2 {
        assert!(Instant::now() < deadline, "the holder never took its locks");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let refused = post_order(&app, &big_order("big")).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.body);
    refused.problem_detail();
    assert!(refused.retry_after.is_some(), "a 409 says when to retry");
    assert_eq!(
        refused.body["conflicting_keys"],
        json!([format!("sku:{held}")])
    );
    let mut left = server.keys("lock:?*");
    left.sort();
    assert_eq!(left, holder_locks, "only the holder's locks may remain");
    assert!(
        big_stock_levels(&server).iter().all(|&l| l == Some(5)),
        "the refused order took stock"
    );
    assert_eq!(get(&app, "/orders/big").await.status, StatusCode::NOT_FOUND);

    let held_done = within(Duration::from_secs(5), "the holder", holder)
        .await
        .unwrap();
    assert_eq!(held_done.status, StatusCode::CREATED, "{}", held_done.body);
    assert_eq!(server.keys("lock:?*"), Vec::<String>::new(), "locks left");

    let placed = post_order(&app, &big_order("big")).await;
    assert_eq!(placed.status, StatusCode::CREATED, "{}", placed.body);
    let levels = big_stock_levels(&server);
    assert_eq!(
        levels[1_234],
        Some(3),
        "the holder's unit and the big order's"
    );
    assert_eq!(levels.iter().filter(|&&l| l == Some(4)).count(), BIG - 1);
}

// ---------------------------------------------------------------------------------------
// 5. Bad bodies: see the `malformed` module, which sends a corpus of them through this router

// ---------------------------------------------------------------------------------------
// 6. The real binary

#[cfg(feature = "redis")]
mod binary {
    use std::{net::SocketAddr, path::PathBuf, process::Stdio, time::Duration};

    use tokio::{
        io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
        net::TcpStream,
        process::{Child, Command},
    };

    use super::within;
    use crate::support::RedisServer;

    /// Builds the example with the profile this test was built with, and returns its path.
    ///
    /// `cargo test` builds examples, but `cargo test --test it` does not, and a binary
    /// left over from an older build would test old code: so build it (a no-op when it is
    /// fresh). Cargo does not hold the build lock while tests run.
    async fn build_example() -> PathBuf {
        let test_exe = std::env::current_exe().expect("the test's path");
        // target/<profile dir>/deps/orders-<hash>
        let profile_dir = test_exe.parent().and_then(|deps| deps.parent());
        let profile: Vec<String> = match profile_dir
            .and_then(|d| d.file_name())
            .and_then(|n| n.to_str())
        {
            Some("debug") | None => vec![],
            Some("release") => vec!["--release".into()],
            Some(other) => vec!["--profile".into(), other.into()],
        };
        // With the cluster and PostgreSQL where this build has them, for
        // `REDIS_CLUSTER_URLS` and `DATABASE_URL`.
        let mut features = vec!["redis", "admin"];
        features.extend(cfg!(feature = "cluster").then_some("cluster"));
        features.extend(cfg!(feature = "postgres").then_some("postgres"));
        let build = Command::new(env!("CARGO"))
            .args([
                "build",
                "--example",
                "orders",
                "--features",
                &features.join(","),
            ])
            .args(["--message-format", "json-render-diagnostics"])
            .args(profile)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .output();
        // Usually a second; longer only when another build holds the lock.
        let output = within(Duration::from_secs(300), "build of the example", build)
            .await
            .expect("run cargo");
        assert!(
            output.status.success(),
            "cargo build --example orders failed"
        );
        let stdout = String::from_utf8(output.stdout).expect("UTF-8 from cargo");
        stdout
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "orders")
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .expect("cargo reports the example's executable")
    }

    /// One HTTP/1.1 request on a fresh connection; the status and the body.
    async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
        let exchange = async {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            let request = format!(
                "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            stream.write_all(request.as_bytes()).await.expect("send");
            let mut response = String::new();
            stream.read_to_string(&mut response).await.expect("read");
            response
        };
        let response = within(Duration::from_secs(5), "HTTP response", exchange).await;
        let status = response
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
        let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        (status, body.to_owned())
    }

    /// The running example, and its admin port; killed when dropped, whatever the test
    /// did (`kill_on_drop`).
    struct Example(Child, SocketAddr);

    /// The address in a log line of the example's after `prefix`, such as
    /// `orders listening on http://127.0.0.1:41234, …`.
    fn address_after(line: &str, prefix: &str) -> Option<SocketAddr> {
        let rest = &line[line.find(prefix)? + prefix.len()..];
        let end = rest.find([',', ' ']).unwrap_or(rest.len());
        rest[..end].parse().ok()
    }

    impl Example {
        /// Builds and starts the example with `env` (over a clean slate of its variables)
        /// on ports the system picks (the example binds port 0 and logs where it listens:
        /// a port picked here and freed for it could be taken by another test first), waits
        /// until it listens, and gives back its address and its start-up log line.
        async fn start(env: &[(&str, &str)]) -> (Self, SocketAddr, String) {
            let binary = build_example().await;
            let mut command = Command::new(&binary);
            for variable in [
                "REDIS_URL",
                "REDIS_URLS",
                "REDIS_CLUSTER_URLS",
                "DATABASE_URL",
                "WORK_DELAY_MS",
                "LOCK_TTL_MS",
                "LOCK_WAIT_MS",
            ] {
                command.env_remove(variable);
            }
            command
                .env("ORDERS_ADDR", "127.0.0.1:0")
                .env("ADMIN_ADDR", "127.0.0.1:0")
                .env("RUST_LOG", "info");
            command.envs(env.iter().copied());
            let mut child = command
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
            let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
            // The example logs where it listens once it does, the orders' port first.
            let (started, addr, admin) = within(Duration::from_secs(10), "listening", async {
                let (mut start_up, mut admin) = (None, None);
                while let Some(line) = lines.next_line().await.expect("read the log") {
                    if let Some(addr) = address_after(&line, "orders listening on http://") {
                        start_up = Some((line.clone(), addr));
                    }
                    admin = admin.or_else(|| address_after(&line, "admin (metrics) on http://"));
                    if let (Some((line, addr)), Some(admin)) = (&start_up, admin) {
                        return (line.clone(), *addr, admin);
                    }
                }
                panic!(
                    "the example exited before listening: {:?}",
                    child.wait().await
                )
            })
            .await;
            // The rest of its log is read and dropped, so that its writes never fail.
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            (Self(child, admin), addr, started)
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_binary_serves_orders_on_redis() {
        let server = RedisServer::start();
        let url = server.url();
        let (_example, addr, first_line) = Example::start(&[
            ("REDIS_URL", url.as_str()),
            ("LOCK_TTL_MS", "3000"),
            ("LOCK_WAIT_MS", "200"),
        ])
        .await;
        assert!(
            first_line.contains(&addr.to_string()) && first_line.contains("Redis"),
            "the start-up line should say where and on what: {first_line:?}"
        );

        assert_eq!(
            http(addr, "PUT", "/stock/apple", r#"{"qty": 3}"#).await.0,
            200
        );
        let order = r#"{"order_id": "smoke", "items": [{"sku": "apple", "qty": 2}]}"#;
        let (status, body) = http(addr, "POST", "/orders", order).await;
        assert_eq!(status, 201, "{body}");
        assert!(body.contains(r#""fence":"#), "{body}");
        assert_eq!(http(addr, "POST", "/orders", order).await.0, 200);
        let (status, body) = http(addr, "GET", "/stock/apple", "").await;
        assert_eq!((status, body.as_str()), (200, r#"{"sku":"apple","qty":1}"#));
        assert_eq!(http(addr, "GET", "/orders/nope", "").await.0, 404);

        // The admin port: the layer's metrics, labelled by route, and the operator's view.
        let admin = _example.1;
        let (status, metrics) = http(admin, "GET", "/metrics", "").await;
        assert_eq!(status, 200);
        let granted = r#"tower_batch_lock_acquisitions_total{layer="/orders",mode="exclusive",outcome="granted"} 2"#;
        assert!(metrics.contains(granted), "{metrics}");
        let (status, held) = http(admin, "GET", "/admin/locks/held", "").await;
        assert_eq!(
            (status, held.as_str()),
            (200, r#"{"batches":[]}"#),
            "nothing is held"
        );
        let (status, apple) = http(admin, "GET", "/admin/locks?key=sku:apple", "").await;
        assert_eq!(status, 200, "{apple}");
        assert!(apple.contains("free"), "{apple}");

        let mut data = server.keys("*");
        data.sort();
        // `lock:` itself is the namespace's fencing counter, never a lock.
        let fenced = [
            "orders:order:smoke",
            "orders:order:smoke:fence{orders:order:smoke}",
            "orders:stock:apple",
            "orders:stock:apple:fence{orders:stock:apple}",
        ];
        assert_eq!(data, [&["lock:"][..], &fenced].concat());
    }

    /// The paused holder: instance A (a 400 ms TTL, 1.5 s of work) is granted `pz1` (stock
    /// 10) and reads it; A's process is stopped (`SIGSTOP`) for 1.5 s, past its lease,
    /// which it cannot renew; instance B is granted the SKU and sells one (9); A resumes,
    /// and its write of what it computed (9) is refused: its fencing token is older than
    /// B's. A answers 409, B 201, and the stock reads 10 less the orders answered 201.
    /// (With a plain write, both answered 201 and the stock read 9.)
    async fn a_stopped_holder_cannot_overwrite_the_next_sale(
        env: &[(&str, &str)],
        holds_the_sku: impl FnMut() -> bool,
    ) {
        let a_env = [env, &[("LOCK_TTL_MS", "400"), ("WORK_DELAY_MS", "1500")]].concat();
        let (a, a_addr, _) = Example::start(&a_env).await;
        let b_env = [env, &[("LOCK_WAIT_MS", "3000")]].concat();
        let (_b, b_addr, _) = Example::start(&b_env).await;
        let put = http(b_addr, "PUT", "/stock/pz1", r#"{"qty": 10}"#).await;
        assert_eq!(put.0, 200, "{}", put.1);

        let order =
            |id: &str| format!(r#"{{"order_id": "{id}", "items": [{{"sku": "pz1", "qty": 1}}]}}"#);
        let a_order = order("a-1");
        let a_sale = tokio::spawn(async move { http(a_addr, "POST", "/orders", &a_order).await });
        // A holds the SKU on every lock server (on a busy machine, that may take a
        // while), and has had the time to learn it and read the stock.
        let held = crate::support::http::poll_every(
            Duration::from_millis(10),
            Duration::from_secs(5),
            holds_the_sku,
        )
        .await;
        assert!(held.is_some(), "A was never granted the SKU");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let pid = a.0.id().expect("A runs").to_string();
        let signal = |name: &str| {
            let sent = std::process::Command::new("kill")
                .args([name, &pid])
                .status();
            assert!(sent.unwrap().success(), "kill {name} {pid}");
        };
        signal("-STOP");
        let b_sale = http(b_addr, "POST", "/orders", &order("b-1")).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        signal("-CONT");
        let a_sale = a_sale.await.unwrap();

        assert_eq!(
            b_sale.0, 201,
            "B sells once A's lease ran out: {}",
            b_sale.1
        );
        assert_eq!(a_sale.0, 409, "A's stale write is refused: {}", a_sale.1);
        let sold = [&a_sale, &b_sale].iter().filter(|(s, _)| *s == 201).count();
        let (_, stock) = http(b_addr, "GET", "/stock/pz1", "").await;
        assert_eq!(stock, format!(r#"{{"sku":"pz1","qty":{}}}"#, 10 - sold));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopped_holder_cannot_overwrite_the_next_sale_on_redis() {
        let server = RedisServer::start();
        let url = server.url();
        let env = [("REDIS_URL", url.as_str())];
        let held = || !server.keys("lock:sku:pz1").is_empty();
        a_stopped_holder_cannot_overwrite_the_next_sale(&env, held).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopped_holder_cannot_overwrite_the_next_sale_on_redlock() {
        let masters: Vec<_> = (0..3).map(|_| RedisServer::start()).collect();
        let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
        let urls = urls.join(",");
        let env = [("REDIS_URLS", urls.as_str())];
        let held = || masters.iter().all(|m| !m.keys("lock:sku:pz1").is_empty());
        a_stopped_holder_cannot_overwrite_the_next_sale(&env, held).await;
    }

    /// On a cluster, A's write spans slots: its check of every fence finds B's token.
    #[cfg(feature = "cluster")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopped_holder_cannot_overwrite_the_next_sale_on_cluster() {
        let (_serial, cluster) = crate::support::cluster::Cluster::start_in_turn().await;
        let urls = cluster.urls().join(",");
        let env = [("REDIS_CLUSTER_URLS", urls.as_str())];
        let held = || {
            let locks = cluster.locks_on_masters();
            locks.iter().any(|keys| keys.contains("lock:sku:pz1"))
        };
        a_stopped_holder_cannot_overwrite_the_next_sale(&env, held).await;
    }

    /// In PostgreSQL, the guard of A's transaction finds its lease gone, and fails it.
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopped_holder_cannot_overwrite_the_next_sale_on_postgres() {
        let db = crate::support::postgres::Database::create();
        let url = db.url();
        let held = || {
            let rows = db.query(
                "SELECT count(*) FROM tower_batch_lock.locks \
                 WHERE key = 'lock:sku:pz1' AND ends > clock_timestamp()",
            );
            rows == "1"
        };
        a_stopped_holder_cannot_overwrite_the_next_sale(&[("DATABASE_URL", &url)], held).await;
    }

    /// `DATABASE_URL`: the locks, the data and the idempotency answers in one PostgreSQL
    /// database, shared by two instances.
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_binary_serves_orders_on_postgres() {
        let db = crate::support::postgres::Database::create();
        let env = [("DATABASE_URL", db.url())];
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (_one, one, first_line) = Example::start(&env).await;
        let (_two, two, _) = Example::start(&env).await;
        assert!(first_line.contains("PostgreSQL"), "{first_line:?}");
        assert_eq!(
            http(one, "PUT", "/stock/apple", r#"{"qty": 3}"#).await.0,
            200
        );
        let order = r#"{"order_id": "pg-1", "items": [{"sku": "apple", "qty": 2}]}"#;
        let (status, body) = http(two, "POST", "/orders", order).await;
        assert_eq!(status, 201, "{body}");
        assert!(body.contains(r#""fence":"#), "{body}");
        // Placed before: answered again, nothing taken twice.
        assert_eq!(http(one, "POST", "/orders", order).await.0, 200);
        assert_eq!(
            db.query("SELECT sku || '=' || qty FROM orders.stock"),
            "apple=1"
        );
        assert_eq!(db.query("SELECT count(*) FROM orders.orders"), "1");
        let live =
            db.query("SELECT count(*) FROM tower_batch_lock.locks WHERE ends > clock_timestamp()");
        assert_eq!(live, "0", "every lock released");
    }

    /// `REDIS_URLS`: the locks on three Redlock masters, the data in the first.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_binary_serves_orders_on_redlock() {
        let masters: Vec<_> = (0..3).map(|_| RedisServer::start()).collect();
        let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
        let urls = urls.join(",");
        let (_example, addr, first_line) =
            Example::start(&[("REDIS_URLS", urls.as_str()), ("LOCK_TTL_MS", "3000")]).await;
        assert!(
            first_line.contains("3 Redlock masters"),
            "the start-up line should say the locks are on Redlock: {first_line:?}"
        );

        assert_eq!(
            http(addr, "PUT", "/stock/apple", r#"{"qty": 3}"#).await.0,
            200
        );
        let order = r#"{"order_id": "smoke", "items": [{"sku": "apple", "qty": 2}]}"#;
        let (status, body) = http(addr, "POST", "/orders", order).await;
        assert_eq!(status, 201, "{body}");
        assert!(body.contains(r#""fence":"#), "{body}");
        let (status, body) = http(addr, "GET", "/stock/apple", "").await;
        assert_eq!((status, body.as_str()), (200, r#"{"sku":"apple","qty":1}"#));

        let mut data = masters[0].keys("orders:*");
        data.sort();
        let fenced = [
            "orders:order:smoke",
            "orders:order:smoke:fence{orders:order:smoke}",
            "orders:stock:apple",
            "orders:stock:apple:fence{orders:stock:apple}",
        ];
        assert_eq!(data, fenced);
        for master in &masters[1..] {
            assert_eq!(
                master.keys("orders:*"),
                Vec::<String>::new(),
                "data off the first"
            );
        }
        // A response waits for a majority of the masters to release; the rest follow.
        for master in &masters {
            let released = within(Duration::from_secs(2), "the release", async {
                while !master.keys("lock:?*").is_empty() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            });
            released.await;
        }
    }
}
