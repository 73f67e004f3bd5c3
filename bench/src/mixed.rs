//! A mixed load: many small orders and, now and then, a purchase order of the whole
//! catalogue, with fair waiting on and off, on each store.
//!
//! 32 retail clients send orders of 1-3 random skus of a catalogue of 3,000, back to back
//! on keep-alive connections ([`crate::load`]); every 1.5 s a purchase order names all
//! 3,000, on a connection of its own. Every request waits up to 4 s for its keys and holds
//! them for 5 ms of work. Without fair waiting a purchase order gets its keys only at a
//! moment when no retail order holds any of them, which hardly ever comes; with it, its
//! reservations hold back the retail orders that come after it, and it is granted once
//! those before it end. The question is how soon, and what that costs the retail clients.
//! On memory and Redis the retail load also runs alone, with fair waiting and no purchase
//! order, just before the runs with them: what purchase orders cost the retail p99 is a
//! ratio against that run, not against a figure from another day.
//!
//! Each case gets a server, a store and empty Redis servers (or an empty lock table) of its
//! own, so that no case inherits another's locks or reservations. The server runs in this process on
//! 127.0.0.1:0; the clients run on a thread and runtime of their own.

use std::{
    collections::{BTreeMap, HashMap},
    io,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tower_batch_lock::store::Redis;

use axum::{
    extract::{Path, State},
    routing::post,
    Router,
};
use serde::Deserialize;
use serde_json::{json, Value};
use tower_batch_lock::{keys, Locks, Wait};

use crate::{
    load::{self, Load, Outcome, Requests},
    progress,
    stats::{self, human, percentile},
    support::RedisServer,
    target::Target,
};

const CATALOGUE: u32 = 3_000;
const RETAIL_CLIENTS: usize = 32;
/// A retail order names 1 to this many skus.
const RETAIL_SKUS: u32 = 3;
/// What a handler does while it holds the keys.
const WORK: Duration = Duration::from_millis(5);
const WAIT_BOUND: Duration = Duration::from_secs(4);
const TTL: Duration = Duration::from_secs(30);
const PURCHASE_EVERY: Duration = Duration::from_millis(1_500);
/// The first purchase order goes out once the retail load has settled.
const FIRST_PURCHASE: Duration = Duration::from_millis(500);
/// The retail load goes on this long after the last purchase order's wait could have
/// ended: every purchase order waits under the full load, the last one too.
const SLACK: Duration = Duration::from_millis(500);
/// Bounds a run's retail orders whatever its length (32 clients holding keys 5 ms each
/// cannot place more than 6,400 a second).
const MAX_RETAIL: u64 = 500_000;
/// Redlock's per-master timeout here. The default, 100 ms, is many times a 3,000-key script
/// on a master with a core of its own; here three masters, the server and 32 clients share
/// two cores, a 3,000-key script alone takes 20 ms or more, and a purchase order's attempt
/// under load overran 100 ms on most masters (503 for 5 of 6 in one run).
const REDLOCK_NODE_TIMEOUT: Duration = Duration::from_millis(500);

#[derive(Deserialize)]
struct Order {
    skus: Vec<u32>,
}

/// When each purchase order's handler started, by purchase order number.
type Granted = Arc<Mutex<HashMap<u32, Instant>>>;

/// A store, named by the Redis servers behind it (none is memory, one is Redis, more is
/// Redlock) or by its PostgreSQL.
struct Store<'a> {
    name: &'static str,
    servers: Vec<&'a RedisServer>,
    postgres: Option<&'a str>,
    /// Whether the retail load also runs alone, as the baseline of its p99 under purchase
    /// orders. Redlock does without: the target is on Redis, and memory is cheap.
    retail_alone: bool,
}

impl Store<'_> {
    /// An empty store: a new memory store, or new handles on flushed Redis servers or on
    /// an emptied lock table.
    async fn empty(&self) -> Result<Locks, String> {
        if let Some(url) = self.postgres {
            let mut stores = crate::postgres::empty_stores(url, 1).await?;
            return stores.pop().ok_or_else(|| "no store".to_owned());
        }
        for server in &self.servers {
            redis::cmd("FLUSHALL")
                .query::<()>(&mut server.connection())
                .map_err(|e| e.to_string())?;
        }
        let urls: Vec<String> = self.servers.iter().map(|s| s.url()).collect();
        match urls.as_slice() {
            [] => Ok(Locks::new(tower_batch_lock::store::Store::isolated_memory())),
            [url] => Redis::url(url).build().map(Locks::new),
            urls => tower_batch_lock::store::Redlock::new(urls)
                .node_timeout(REDLOCK_NODE_TIMEOUT)
                .build()
                .map(Locks::new),
        }
        .map_err(|e| e.to_string())
    }
}

/// `postgres`: the URL of the bench's PostgreSQL.
pub(crate) async fn run(
    server: &RedisServer,
    postgres: &str,
    quick: bool,
) -> Result<Value, String> {
    let (purchases, warmup) = if quick {
        (2, Duration::from_millis(100))
    } else {
        (6, Duration::from_millis(300))
    };
    let length = FIRST_PURCHASE + PURCHASE_EVERY * (purchases - 1) + WAIT_BOUND + SLACK;
    // Three independent masters, as Redlock wants them.
    let trio: Vec<RedisServer> =
        tokio::task::spawn_blocking(|| (0..3).map(|_| RedisServer::start()).collect::<Vec<_>>())
            .await
            .map_err(|e| e.to_string())?;
    let stores = [
        Store {
            name: "memory",
            servers: vec![],
            postgres: None,
            retail_alone: true,
        },
        Store {
            name: "Redis",
            servers: vec![server],
            postgres: None,
            retail_alone: true,
        },
        Store {
            name: "Redlock (3 masters)",
            servers: trio.iter().collect(),
            postgres: None,
            retail_alone: false,
        },
        Store {
            name: "PostgreSQL",
            servers: vec![],
            postgres: Some(postgres),
            retail_alone: false,
        },
    ];
    // On each store the retail load alone (where it runs), then fair and not fair, back to
    // back, so that each ratio compares runs next to each other, on the same moment of the
    // machine.
    let total = stores.len() * 2 + stores.iter().filter(|s| s.retail_alone).count();
    let mut cases = Vec::new();
    for store in &stores {
        let alone = store.retail_alone.then_some((true, 0));
        for (fair, orders) in alone
            .into_iter()
            .chain([(true, purchases), (false, purchases)])
        {
            let label = format!(
                "mixed {}/{total} {}, fair waiting {}{}",
                cases.len() + 1,
                store.name,
                if fair { "on" } else { "off" },
                if orders == 0 {
                    ", no purchase orders"
                } else {
                    ""
                }
            );
            let locks = store.empty().await?;
            let figures = case(locks, fair, orders, warmup, length, label)
                .await
                .map_err(|error| format!("{}, fair {fair}: {error}", store.name))?;
            let mut case =
                json!({ "store": store.name, "fair": fair, "retail_alone": orders == 0 });
            if let (Value::Object(case), Value::Object(figures)) = (&mut case, figures) {
                case.extend(figures);
            }
            cases.push(case);
        }
    }
    let retail_p99_ratios: Vec<Value> = stores
        .iter()
        .filter(|store| store.retail_alone)
        .map(|store| {
            let ratio = retail_p99_ratio(&cases, store.name).map(|r| stats::round(r, 3));
            json!({ "store": store.name, "with_purchase_orders_over_without": ratio })
        })
        .collect();
    let targets = targets(&stores, &cases);
    Ok(json!({
        "method": format!(
            "axum on 127.0.0.1:0 in the bench process; {RETAIL_CLIENTS} retail clients (keep-alive connections) post orders of 1-{RETAIL_SKUS} random skus of {CATALOGUE} back to back; a purchase order of all {CATALOGUE} every {} s from {} s on, each on a connection of its own; keys from keys::json; every request waits up to {} s (Wait::up_to, fair or not) and holds its keys {} ms (a sleep); the clients on a thread and runtime of their own; time to grant = from sending a purchase order (connection already open) until its handler starts; retail requests/s counts 2xx answers, retail latencies cover every answer; a new store per case, its Redis servers flushed (PostgreSQL: Postgres::url on a server of the bench's own, its lock table emptied); on memory and Redis the same retail load also runs alone (fair, no purchase order, same length), just before the runs with them: retail p99 ratio = p99 with purchase orders (fair) / p99 of that run",
            PURCHASE_EVERY.as_secs_f64(),
            FIRST_PURCHASE.as_secs_f64(),
            WAIT_BOUND.as_secs(),
            WORK.as_millis(),
        ),
        "catalogue": CATALOGUE,
        "retail_clients": RETAIL_CLIENTS,
        "retail_skus_max": RETAIL_SKUS,
        "work_ms": WORK.as_millis(),
        "wait_seconds": WAIT_BOUND.as_secs(),
        "redlock_node_timeout_ms": REDLOCK_NODE_TIMEOUT.as_millis() as u64,
        "purchase_every_seconds": PURCHASE_EVERY.as_secs_f64(),
        "purchase_orders_per_run": purchases,
        "run_seconds": length.as_secs_f64(),
        "cases": cases,
        "retail_p99_ratios": retail_p99_ratios,
        "targets": targets.iter().map(Target::to_json).collect::<Vec<_>>(),
    }))
}

/// One run against `locks`: a warm-up of retail orders alone (Redis scripts loaded,
/// pub/sub subscribed), then the retail load with `purchases` purchase orders.
async fn case(
    locks: Locks,
    fair: bool,
    purchases: u32,
    warmup: Duration,
    length: Duration,
    label: String,
) -> Result<Value, String> {
    let locks = locks.ttl(TTL).wait(Wait::up_to(WAIT_BOUND).fair(fair));
    let granted = Granted::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let app = app(&locks, granted.clone());
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
    });

    progress::begin(label, "retail orders", MAX_RETAIL);
    let retail = Load {
        path: "/orders".to_owned(),
        requests: Requests::Json(retail_order),
        connections: RETAIL_CLIENTS,
        duration: warmup,
        max_requests: MAX_RETAIL,
    };
    drive(addr, retail.clone(), 0).await?;
    let (retail, answers) = drive(
        addr,
        Load {
            duration: length,
            ..retail
        },
        purchases,
    )
    .await?;
    let _ = stop.send(());
    // Every client has hung up by now; a server that still does not stop is stuck.
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .map_err(|_| "the server did not shut down".to_owned())?
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;

    let granted = std::mem::take(&mut *granted.lock().unwrap());
    let case = summarize(retail, &answers, &granted)?;
    progress::end(&format!(
        "{:.0} retail orders/s, purchase orders granted {}/{purchases}, time to grant p50 {} max {}",
        case["retail_requests_per_second"].as_f64().unwrap_or(0.0),
        case["purchase_granted"],
        ms_text(&case["purchase_grant_p50_ms"]),
        ms_text(&case["purchase_grant_max_ms"]),
    ));
    Ok(case)
}

fn app(locks: &Locks, granted: Granted) -> Router {
    let layer = locks.layer(keys::json(|order: Order| {
        order.skus.into_iter().map(|sku| format!("sku:{sku}"))
    }));
    Router::new()
        .route("/orders", post(work).layer(layer.clone()))
        .route("/purchase-orders/{number}", post(purchase).layer(layer))
        .with_state(granted)
}

async fn work() -> &'static str {
    tokio::time::sleep(WORK).await;
    "ok"
}

async fn purchase(State(granted): State<Granted>, Path(number): Path<u32>) -> &'static str {
    granted.lock().unwrap().insert(number, Instant::now());
    work().await
}

fn retail_order() -> String {
    let skus: Vec<u32> = (0..fastrand::u32(1..=RETAIL_SKUS))
        .map(|_| fastrand::u32(..CATALOGUE))
        .collect();
    json!({ "skus": skus }).to_string()
}

/// When each purchase order went out, and its status.
type Answers = Vec<io::Result<(Instant, u16)>>;

/// The clients on a thread and a runtime of their own, as other processes would be: the
/// retail load and, alongside, `purchases` purchase orders on their schedule.
async fn drive(
    addr: SocketAddr,
    retail: Load,
    purchases: u32,
) -> Result<(Outcome, Answers), String> {
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        Ok(runtime.block_on(async {
            tokio::join!(
                load::drive(addr, retail, progress::tick),
                purchase_orders(addr, purchases)
            )
        }))
    })
    .await
    .map_err(|e| e.to_string())?
}

async fn purchase_orders(addr: SocketAddr, count: u32) -> Answers {
    let start = tokio::time::Instant::now();
    let body = json!({ "skus": (0..CATALOGUE).collect::<Vec<_>>() }).to_string();
    let orders: Vec<_> = (0..count)
        .map(|number| {
            let request = load::post_json(&format!("/purchase-orders/{number}"), &body);
            tokio::spawn(async move {
                tokio::time::sleep_until(start + FIRST_PURCHASE + PURCHASE_EVERY * number).await;
                // The wait, then time enough for the grant and the work, or the refusal.
                load::once(addr, &request, WAIT_BOUND + Duration::from_secs(5)).await
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(orders.len());
    for order in orders {
        answers.push(order.await.unwrap_or_else(|e| Err(io::Error::other(e))));
    }
    answers
}

fn summarize(
    mut retail: Outcome,
    answers: &Answers,
    granted: &HashMap<u32, Instant>,
) -> Result<Value, String> {
    // A 4xx other than 409 means the routes refuse what the clients send (a bad body, a
    // missing content type): the figures would mean nothing. A 5xx (a store that did not
    // answer in time) is a result, and is reported.
    let refused = |status: &u16| (400..500).contains(status) && *status != 409;
    let mut purchase_statuses = BTreeMap::<u16, u64>::new();
    let mut grants = Vec::new();
    let mut grant_ms = Vec::new();
    let mut purchase_errors = 0;
    for (number, answer) in (0..).zip(answers) {
        let grant = match answer {
            Ok((sent, status)) => {
                *purchase_statuses.entry(*status).or_default() += 1;
                granted
                    .get(&number)
                    .filter(|_| (200..300).contains(status))
                    .map(|at| at.saturating_duration_since(*sent))
            }
            Err(_) => {
                purchase_errors += 1;
                None
            }
        };
        grants.extend(grant);
        grant_ms.push(grant.map(stats::ms));
    }
    if let Some(status) = retail
        .statuses
        .keys()
        .chain(purchase_statuses.keys())
        .find(|s| refused(s))
    {
        return Err(format!("the route answered {status}"));
    }
    grants.sort_unstable();
    retail.latencies.sort_unstable();
    let quantile = |sorted: &[Duration], p: f64| {
        (!sorted.is_empty()).then(|| stats::ms(percentile(sorted, p)))
    };
    let retail_ok: u64 = retail.statuses.range(200..300).map(|(_, n)| n).sum();
    let unavailable =
        |statuses: &BTreeMap<u16, u64>| -> u64 { statuses.range(500..600).map(|(_, n)| n).sum() };
    let by_status = |statuses: &BTreeMap<u16, u64>| {
        statuses
            .iter()
            .map(|(status, n)| (status.to_string(), json!(n)))
            .collect::<serde_json::Map<_, _>>()
    };
    Ok(json!({
        "purchase_orders": answers.len(),
        "purchase_granted": grants.len(),
        "purchase_5xx": unavailable(&purchase_statuses),
        "purchase_statuses": by_status(&purchase_statuses),
        "purchase_transport_errors": purchase_errors,
        "purchase_grant_ms": grant_ms,
        "purchase_grant_p50_ms": quantile(&grants, 0.5),
        "purchase_grant_max_ms": quantile(&grants, 1.0),
        "retail_seconds": stats::round(retail.elapsed.as_secs_f64(), 3),
        "retail_requests_per_second": stats::round(retail_ok as f64 / retail.elapsed.as_secs_f64(), 1),
        "retail_p50_ms": quantile(&retail.latencies, 0.5),
        "retail_p99_ms": quantile(&retail.latencies, 0.99),
        "retail_ok": retail_ok,
        "retail_409": retail.statuses.get(&409).copied().unwrap_or(0),
        "retail_5xx": unavailable(&retail.statuses),
        "retail_statuses": by_status(&retail.statuses),
        "retail_transport_errors": retail.errors,
    }))
}

fn ms_text(ms: &Value) -> String {
    ms.as_f64().map_or("–".to_owned(), |ms| {
        human(Duration::from_secs_f64(ms / 1e3))
    })
}

/// The case of `store` with purchase orders, fair or not, or the retail load alone.
fn find<'a>(cases: &'a [Value], store: &str, fair: bool, alone: bool) -> Option<&'a Value> {
    cases
        .iter()
        .find(|c| c["store"] == store && c["fair"] == fair && c["retail_alone"] == alone)
}

/// Retail p99 with purchase orders (fair) over retail p99 alone, on `store`.
fn retail_p99_ratio(cases: &[Value], store: &str) -> Option<f64> {
    let p99 = |alone: bool| find(cases, store, true, alone)?["retail_p99_ms"].as_f64();
    Some(p99(false)? / p99(true)?)
}

fn targets(stores: &[Store<'_>], cases: &[Value]) -> Vec<Target> {
    let mut targets = Vec::new();
    for store in stores {
        let name = store.name;
        let case = |fair: bool| find(cases, name, fair, false);
        let fair = case(true);
        let figure = |field: &str| fair.and_then(|c| c[field].as_f64());
        let rps =
            |case: Option<&Value>| case.and_then(|c| c["retail_requests_per_second"].as_f64());
        targets.extend([
            Target::holds(
                &format!("mixed, {name}, fair: every purchase order granted"),
                fair.is_some_and(|c| {
                    c["purchase_orders"].as_u64() > Some(0)
                        && c["purchase_granted"] == c["purchase_orders"]
                }),
            ),
            Target::at_most(
                &format!("mixed, {name}, fair: purchase order time to grant, max (ms)"),
                figure("purchase_grant_max_ms"),
                1_000.0,
            ),
            Target::below(
                &format!("mixed, {name}, fair: purchase order time to grant, p50 (ms)"),
                figure("purchase_grant_p50_ms"),
                200.0,
            ),
            Target::at_least(
                &format!("mixed, {name}: retail requests/s, fair / not fair"),
                rps(fair).zip(rps(case(false))).map(|(on, off)| on / off),
                0.8,
            ),
        ]);
        if store.retail_alone {
            targets.push(Target::at_most(
                &format!("mixed, {name}, fair: retail p99 with purchase orders / without"),
                retail_p99_ratio(cases, name),
                1.5,
            ));
        }
    }
    targets
}
