//! Shared holds: quotes that read the same hot SKUs, held shared and held exclusively, and an
//! order of those SKUs behind a continuous stream of shared quotes.
//!
//! 16 clients post quotes back to back on keep-alive connections ([`crate::load`]), each
//! naming all 50 SKUs of a hot set and holding them 2 ms (a sleep); every quote waits for
//! busy keys ([`Wait::up_to`], fair). The same route runs with the keys held shared
//! ([`LockLayer::shared`](tower_batch_lock::LockLayer::shared)) and held exclusively, the two
//! taking turns, on memory and on one Redis: held shared, the quotes run side by side;
//! held exclusively, one at a time.
//!
//! Then, while the shared quotes stream on, orders of the same 50 SKUs (exclusive) go out
//! one after the other, each on a connection of its own: with fair waiting, an order's
//! reservation keeps the quotes that come after it out, so it is granted once the quotes
//! that hold the SKUs end, however many keep coming. Time to grant: from sending an order
//! until its handler starts.
//!
//! Each store gets a server of its own, and Redis is flushed before its turn. The server
//! and the orders run on the section's runtime; the quote clients on a thread and runtime
//! of their own ([`http::drive`]).

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{extract::State, routing::post, Router};
use redis::aio::MultiplexedConnection;
use serde::Deserialize;
use serde_json::{json, Value};
use tower_batch_lock::{keys, store::Redis, Locks, Wait};

use crate::{
    http,
    load::{self, Load, Outcome, Requests},
    progress,
    redis_info::{command_stats, connect, reset_stats, sum},
    stats::{self, human, percentile},
    support::RedisServer,
    target::Target,
};

/// The hot set: every quote and every order names all of it.
const SKUS: u32 = 50;
const CLIENTS: usize = 16;
/// What a handler does while it holds the keys.
const WORK: Duration = Duration::from_millis(2);
/// How long a quote waits for its keys: well above the line of 16 exclusive quotes (a
/// p99 of about half a second on Redis), so that every quote is served.
const QUOTE_WAIT: Duration = Duration::from_secs(2);
/// How long an order waits for its keys before it is refused (and counted as not granted).
const ORDER_WAIT: Duration = Duration::from_secs(1);
const TTL: Duration = Duration::from_secs(30);
/// Bounds a run's quotes whatever its length.
const MAX_QUOTES: u64 = 500_000;
/// The first order goes out once the quote stream has settled.
const FIRST_ORDER: Duration = Duration::from_millis(200);
/// The pause between an order's answer and the next order.
const ORDER_GAP: Duration = Duration::from_millis(50);

const SHARED: Hold = Hold {
    name: "shared",
    path: "/quotes/shared",
};
const EXCLUSIVE: Hold = Hold {
    name: "exclusive",
    path: "/quotes/exclusive",
};
const ORDER_PATH: &str = "/orders";

/// How a quote route holds its keys.
#[derive(Debug, Clone, Copy)]
struct Hold {
    name: &'static str,
    path: &'static str,
}

/// How long a section's parts run.
struct Plan {
    runs_per_mode: usize,
    run: Duration,
    warmup: Duration,
    orders: usize,
    /// How long the quotes stream while orders go out.
    stream: Duration,
}

#[derive(Deserialize)]
struct Quote {
    skus: Vec<u32>,
}

/// When the running order's handler started.
type Granted = Arc<Mutex<Option<Instant>>>;

pub(crate) async fn run(server: &RedisServer, quick: bool) -> Result<Value, String> {
    let plan = if quick {
        Plan {
            runs_per_mode: 1,
            run: Duration::from_millis(400),
            warmup: Duration::from_millis(100),
            orders: 5,
            stream: Duration::from_millis(1_600),
        }
    } else {
        Plan {
            runs_per_mode: 2,
            run: Duration::from_millis(1_500),
            warmup: Duration::from_millis(300),
            orders: 30,
            // On Redis an order took about 400 ms to be granted in a short run: time for ten.
            stream: Duration::from_secs(6),
        }
    };
    let mut throughput = Vec::new();
    let mut ratios = Vec::new();
    let mut orders = Vec::new();
    for (index, store) in ["memory", "Redis"].into_iter().enumerate() {
        let (locks, redis) = if store == "memory" {
            let memory = tower_batch_lock::store::Store::isolated_memory();
            (Locks::new(memory), None)
        } else {
            redis::cmd("FLUSHALL")
                .query::<()>(&mut server.connection())
                .map_err(|e| e.to_string())?;
            let stats = connect(&server.url()).await?;
            let locks = Redis::url(server.url())
                .build()
                .map_err(|e| e.to_string())?;
            (Locks::new(locks), Some(stats))
        };
        let label = format!("shared {}/2 {store}", index + 1);
        let figures = on_store(locks, redis, &plan, &label)
            .await
            .map_err(|error| format!("{store}: {error}"))?;
        for (hold, runs) in &figures.quotes {
            throughput.push(quote_case(store, *hold, runs));
        }
        let per_second =
            |runs: &[Run]| Some(runs.iter().map(|r| ok_per_second(&r.outcome)).collect());
        let [(_, shared), (_, exclusive)] = &figures.quotes;
        ratios.push(json!({
            "store": store,
            "shared_over_exclusive": http::paired_ratio(per_second(shared), per_second(exclusive))
                .map(|r| stats::round(r, 3)),
        }));
        orders.push(order_case(store, &figures.orders, &figures.stream));
    }
    let targets: Vec<Value> = orders
        .iter()
        .map(|case| {
            Target::holds(
                &format!(
                    "shared, {}: every order granted behind a stream of shared quotes",
                    case["store"].as_str().unwrap_or("?")
                ),
                case["orders"].as_u64() > Some(0) && case["granted"] == case["orders"],
            )
            .to_json()
        })
        .collect();
    Ok(json!({
        "method": format!(
            "axum on 127.0.0.1:0 in the bench process; {CLIENTS} clients (keep-alive connections, on a thread and runtime of their own) post quotes back to back, each naming all {SKUS} skus of a hot set (keys::json) and holding them {} ms (a sleep), waiting up to {} s for busy keys (Wait::up_to, fair); the route holds its keys shared (LockLayer::shared) or exclusively, {} runs of {} s each (each after a warm-up of {} s), the two taking turns; quotes/s counts 2xx, latencies cover every answer; ratio: median of the paired runs' ratios; on Redis, Redis's time in scripts from INFO commandstats (fcall + evalsha + eval) over each run. Then the shared quotes stream for {} s while orders of the same {SKUS} skus (exclusive, waiting up to {} s, fair) go out one at a time on a connection of their own, from {} ms on, {} ms after the previous answer, at most {}, none later than its wait before the stream ends; time to grant = from sending an order (connection open) until its handler starts. A server per store; Redis (Redis::url, pub/sub wake-ups) flushed before its turn",
            WORK.as_millis(),
            QUOTE_WAIT.as_secs(),
            plan.runs_per_mode,
            plan.run.as_secs_f64(),
            plan.warmup.as_secs_f64(),
            plan.stream.as_secs_f64(),
            ORDER_WAIT.as_secs(),
            FIRST_ORDER.as_millis(),
            ORDER_GAP.as_millis(),
            plan.orders,
        ),
        "skus": SKUS,
        "clients": CLIENTS,
        "work_ms": WORK.as_millis(),
        "runs_per_mode": plan.runs_per_mode,
        "run_seconds": plan.run.as_secs_f64(),
        "stream_seconds": plan.stream.as_secs_f64(),
        "quotes": throughput,
        "ratios": ratios,
        "orders": orders,
        "targets": targets,
    }))
}

/// One store's outcomes: each mode's quote runs, and the orders behind the quote stream
/// with the stream's own outcome.
struct Figures {
    /// Shared, then exclusive.
    quotes: [(Hold, Vec<Run>); 2],
    orders: Vec<Answer>,
    stream: Outcome,
}

/// An order's status and time to grant (a transport error has neither).
type Answer = Result<(u16, Option<Duration>), String>;

/// A run of quotes, and on Redis the time Redis spent in scripts meanwhile.
struct Run {
    outcome: Outcome,
    /// The `usec` and `calls` of `fcall`, `evalsha` and `eval` (`INFO commandstats`).
    scripts: Option<(u64, u64)>,
}

/// The quote runs and the orders on `locks`; `redis`, a connection to the Redis behind
/// them, for its command statistics.
async fn on_store(
    locks: Locks,
    redis: Option<MultiplexedConnection>,
    plan: &Plan,
    label: &str,
) -> Result<Figures, String> {
    let locks = locks.ttl(TTL).wait(Wait::up_to(QUOTE_WAIT));
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
    let figures = measure(addr, redis, plan, label, &granted).await;
    let _ = stop.send(());
    // Every client has hung up by now; a server that still does not stop is stuck.
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .map_err(|_| "the server did not shut down".to_owned())?
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    figures
}

fn app(locks: &Locks, granted: Granted) -> Router {
    let skus = keys::json(|quote: Quote| quote.skus.into_iter().map(|sku| format!("sku:{sku}")));
    let order_wait = Wait::up_to(ORDER_WAIT);
    Router::new()
        .route(
            SHARED.path,
            post(work).layer(locks.layer(skus.clone()).shared()),
        )
        .route(EXCLUSIVE.path, post(work).layer(locks.layer(skus.clone())))
        .route(
            ORDER_PATH,
            post(order).layer(locks.layer(skus).wait(order_wait)),
        )
        .with_state(granted)
}

async fn work() -> &'static str {
    tokio::time::sleep(WORK).await;
    "ok"
}

async fn order(State(granted): State<Granted>) -> &'static str {
    *granted.lock().unwrap() = Some(Instant::now());
    work().await
}

fn quote_body() -> String {
    json!({ "skus": (0..SKUS).collect::<Vec<_>>() }).to_string()
}

fn quotes(hold: Hold, duration: Duration) -> Load {
    Load {
        path: hold.path.to_owned(),
        requests: Requests::Json(quote_body),
        connections: CLIENTS,
        duration,
        max_requests: MAX_QUOTES,
    }
}

async fn measure(
    addr: SocketAddr,
    mut redis: Option<MultiplexedConnection>,
    plan: &Plan,
    label: &str,
    granted: &Granted,
) -> Result<Figures, String> {
    let mut quoted = [(SHARED, Vec::new()), (EXCLUSIVE, Vec::new())];
    let total = plan.runs_per_mode * quoted.len() + 1;
    for rep in 0..plan.runs_per_mode {
        for (index, (hold, runs)) in quoted.iter_mut().enumerate() {
            progress::begin(
                format!(
                    "{label} {}/{total} quotes held {} (run {}/{})",
                    rep * 2 + index + 1,
                    hold.name,
                    rep + 1,
                    plan.runs_per_mode
                ),
                "quotes",
                MAX_QUOTES,
            );
            // Scripts loaded and subscriptions open before the measured run.
            http::drive(addr, quotes(*hold, plan.warmup)).await?;
            if let Some(redis) = &mut redis {
                reset_stats(redis).await?;
            }
            let outcome = http::drive(addr, quotes(*hold, plan.run)).await?;
            check(&outcome)?;
            let scripts = match &mut redis {
                Some(redis) => Some(sum(
                    &command_stats(redis).await?,
                    &["fcall", "evalsha", "eval"],
                )),
                None => None,
            };
            progress::end(&format!(
                "{:.0} quotes/s, p99 {}",
                ok_per_second(&outcome),
                p99_text(&outcome)
            ));
            runs.push(Run { outcome, scripts });
        }
    }

    progress::begin(
        format!("{label} {total}/{total} orders behind shared quotes"),
        "quotes",
        MAX_QUOTES,
    );
    let stream_ends = Instant::now() + plan.stream;
    let (stream, orders) = tokio::join!(
        http::drive(addr, quotes(SHARED, plan.stream)),
        orders(addr, plan.orders, stream_ends, granted)
    );
    let stream = stream?;
    check(&stream)?;
    let grants = grant_times(&orders);
    let quantile = |p| {
        grants
            .first()
            .map_or("–".to_owned(), |_| human(percentile(&grants, p)))
    };
    progress::end(&format!(
        "orders granted {}/{}, time to grant p50 {} p99 {}",
        grants.len(),
        orders.len(),
        quantile(0.5),
        quantile(0.99),
    ));
    Ok(Figures {
        quotes: quoted,
        orders,
        stream,
    })
}

/// Orders of the hot set, one at a time, at most `count`, none sent later than its wait
/// before `stream_ends`: every order waits behind quotes that keep coming.
async fn orders(
    addr: SocketAddr,
    count: usize,
    stream_ends: Instant,
    granted: &Granted,
) -> Vec<Answer> {
    let request = load::post_json(ORDER_PATH, &quote_body());
    tokio::time::sleep(FIRST_ORDER).await;
    let mut answers = Vec::with_capacity(count);
    while answers.len() < count && Instant::now() + ORDER_WAIT + ORDER_GAP < stream_ends {
        granted.lock().unwrap().take();
        // The wait, then time enough for the grant and the work, or the refusal.
        let answer = load::once(addr, &request, ORDER_WAIT + Duration::from_secs(5)).await;
        answers.push(match answer {
            Ok((sent, status)) => {
                let at = granted.lock().unwrap().take();
                let grant = at
                    .filter(|_| (200..300).contains(&status))
                    .map(|at| at.saturating_duration_since(sent));
                Ok((status, grant))
            }
            Err(error) => Err(error.to_string()),
        });
        tokio::time::sleep(ORDER_GAP).await;
    }
    answers
}

/// The granted orders' times to grant, sorted.
fn grant_times(orders: &[Answer]) -> Vec<Duration> {
    let mut grants: Vec<Duration> = orders
        .iter()
        .filter_map(|answer| answer.as_ref().ok()?.1)
        .collect();
    grants.sort_unstable();
    grants
}

/// A status other than 2xx, 409 and 5xx means the route refuses what the clients send: the
/// figures would mean nothing.
fn check(outcome: &Outcome) -> Result<(), String> {
    let refused = outcome
        .statuses
        .keys()
        .find(|&&s| !(200..300).contains(&s) && s != 409 && s < 500);
    match refused {
        Some(status) => Err(format!("a quote got {status}")),
        None => Ok(()),
    }
}

fn ok_per_second(outcome: &Outcome) -> f64 {
    let ok: u64 = outcome.statuses.range(200..300).map(|(_, n)| n).sum();
    ok as f64 / outcome.elapsed.as_secs_f64()
}

fn p99_text(outcome: &Outcome) -> String {
    let mut latencies = outcome.latencies.clone();
    latencies.sort_unstable();
    latencies
        .first()
        .map_or("–".to_owned(), |_| human(percentile(&latencies, 0.99)))
}

fn quote_case(store: &str, hold: Hold, runs: &[Run]) -> Value {
    let outcomes: Vec<&Outcome> = runs.iter().map(|r| &r.outcome).collect();
    let per_second: Vec<f64> = outcomes.iter().map(|o| ok_per_second(o)).collect();
    let mut latencies: Vec<Duration> = outcomes
        .iter()
        .flat_map(|o| o.latencies.iter().copied())
        .collect();
    latencies.sort_unstable();
    let count = |statuses: &dyn Fn(u16) -> bool| -> u64 {
        outcomes
            .iter()
            .flat_map(|o| &o.statuses)
            .filter(|(s, _)| statuses(**s))
            .map(|(_, n)| n)
            .sum()
    };
    let ok = count(&|s| (200..300).contains(&s));
    // Redis's share of the work: how many scripts a quote took (a waiter tries again at
    // every release it hears of), how long each ran, and how busy that kept Redis.
    let scripts = runs
        .iter()
        .map(|r| r.scripts)
        .try_fold((0, 0), |(usec, calls), run| {
            run.map(|(u, c)| (usec + u, calls + c))
        })
        .map(|(usec, calls)| {
            let seconds: f64 = outcomes.iter().map(|o| o.elapsed.as_secs_f64()).sum();
            json!({
                "calls_per_quote": stats::round(calls as f64 / ok.max(1) as f64, 2),
                "us_per_call": stats::round(usec as f64 / calls.max(1) as f64, 1),
                "busy": stats::round(usec as f64 / 1e6 / seconds, 3),
            })
        });
    json!({
        "store": store,
        "mode": hold.name,
        "quotes_per_second": stats::round(http::median(per_second.clone()), 1),
        "quotes_per_second_runs": per_second.iter().map(|r| stats::round(*r, 1)).collect::<Vec<_>>(),
        "p50_ms": latencies.first().map(|_| stats::ms(percentile(&latencies, 0.5))),
        "p99_ms": latencies.first().map(|_| stats::ms(percentile(&latencies, 0.99))),
        "ok": ok,
        "conflict_409": count(&|s| s == 409),
        "unavailable_5xx": count(&|s| s >= 500),
        "transport_errors": outcomes.iter().map(|o| o.errors).sum::<u64>(),
        "redis_scripts": scripts,
    })
}

fn order_case(store: &str, orders: &[Answer], stream: &Outcome) -> Value {
    let grants = grant_times(orders);
    let quantile = |p: f64| grants.first().map(|_| stats::ms(percentile(&grants, p)));
    let mut statuses = std::collections::BTreeMap::<String, u64>::new();
    for (status, _) in orders.iter().flatten() {
        *statuses.entry(status.to_string()).or_default() += 1;
    }
    json!({
        "store": store,
        "orders": orders.len(),
        "granted": grants.len(),
        "statuses": statuses,
        "transport_errors": orders.iter().filter(|a| a.is_err()).count(),
        "grant_ms": orders
            .iter()
            .map(|a| a.as_ref().ok().and_then(|(_, grant)| grant.map(stats::ms)))
            .collect::<Vec<_>>(),
        "grant_p50_ms": quantile(0.5),
        "grant_p99_ms": quantile(0.99),
        "grant_max_ms": quantile(1.0),
        "stream_quotes_per_second": stats::round(ok_per_second(stream), 1),
        "stream_409": stream.statuses.get(&409).copied().unwrap_or(0),
    })
}
