//! Requests per second and latency through axum: bare, with the layer (memory; Redis with
//! 1 and 100 keys), and with a hand-written handler that does the same Redis work itself.
//!
//! The server runs in this process on 127.0.0.1:0 (a multi-threaded runtime); the load
//! generator ([`crate::load`]) runs on a thread and runtime of its own. Each request names
//! its keys in the `x-key` header: a value of its own (uncontended) or one shared value
//! (contended: one request at a time gets the keys, the others get 409). Every case runs
//! `REPS` times, the cases taking turns, so that a slow moment of the machine does not land
//! on one case alone; requests per second is the median of the runs, the latency
//! percentiles are over every request of every run.
//!
//! Then the same with a metrics recorder: a global recorder cannot be uninstalled, so it is
//! installed (metrics-exporter-prometheus, as an application would) only once every figure
//! without one is taken, and the memory layer runs again, taking turns with bare axum.

use std::{net::SocketAddr, sync::Arc, time::Duration};
use tower_batch_lock::store::{Redis, Store};

use axum::{
    extract::State,
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use deadpool_redis::Pool;
use http::{request::Parts, HeaderMap, StatusCode};
use redis::aio::MultiplexedConnection;
use serde_json::{json, Value};
use tower::limit::ConcurrencyLimitLayer;
use tower_batch_lock::Locks;

use crate::{
    load::{self, Load, Outcome, Requests},
    progress,
    stats::{self, percentile},
    target::Target,
};

/// Concurrent keep-alive connections of the load generator.
pub(crate) const CONNECTIONS: usize = 16;
/// A run stops at whichever comes first: its duration or this many requests.
pub(crate) const MAX_REQUESTS: u64 = 1_000_000;
const TTL: Duration = Duration::from_secs(30);
/// tower's `ConcurrencyLimitLayer` in the in-process loop: the anchor of the layer's own
/// cost. The loop sends one request at a time, so the limit is never reached and the
/// figure is the permit's bookkeeping alone.
const CONCURRENCY_LIMIT: usize = 1_024;

#[derive(Debug, Clone, Copy)]
struct Route {
    path: &'static str,
    name: &'static str,
    /// Whether the route locks anything (bare axum has nothing to contend for).
    locks: bool,
}

const BARE: Route = Route {
    path: "/bare",
    name: "bare axum",
    locks: false,
};

const MEMORY: Route = Route {
    path: "/memory/1",
    name: "layer, memory, 1 key",
    locks: true,
};

/// How often the recorder's upkeep runs: the exporter's own default.
const UPKEEP: Duration = Duration::from_secs(5);

const ROUTES: [Route; 6] = [
    BARE,
    MEMORY,
    Route {
        path: "/redis/1",
        name: "layer, Redis, 1 key",
        locks: true,
    },
    Route {
        path: "/hand/1",
        name: "hand-written, Redis, 1 key",
        locks: true,
    },
    Route {
        path: "/redis/100",
        name: "layer, Redis, 100 keys",
        locks: true,
    },
    Route {
        path: "/hand/100",
        name: "hand-written, Redis, 100 keys",
        locks: true,
    },
];

pub(crate) async fn run(pool: &Pool, quick: bool) -> Result<Value, String> {
    let (reps, duration, warmup) = if quick {
        (1, Duration::from_millis(400), Duration::from_millis(100))
    } else {
        (5, Duration::from_secs(2), Duration::from_millis(300))
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let pool = pool.clone();
    let pooled = pool.get().await.map_err(|e| e.to_string())?;
    let mut conn = deadpool_redis::Connection::take(pooled);
    // The store's check loads the crate's functions, which the hand-written handler calls.
    Locks::new(
        Redis::pool(pool.clone())
            .build()
            .map_err(|e| e.to_string())?,
    )
    .check()
    .await
    .map_err(|e| e.to_string())?;
    let [acquire, release] = crate_functions(&mut conn).await?;
    let hand = Hand {
        conn,
        acquire: acquire.into(),
        release: release.into(),
    };
    let server = tokio::spawn(async move {
        axum::serve(listener, app(pool, hand))
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
    });

    // Every route uncontended, then the locking ones contended: the routes a target
    // compares run next to each other.
    let cases: Vec<(Route, bool)> = ROUTES
        .iter()
        .map(|route| (*route, false))
        .chain(
            ROUTES
                .iter()
                .filter(|route| route.locks)
                .map(|route| (*route, true)),
        )
        .collect();
    let outcomes = measure(addr, &cases, reps, duration, warmup, "").await?;
    check_statuses(&cases, &outcomes)?;
    let in_process_plain = in_process(quick, "").await?;

    // From here on every request records: the recorder is global and stays.
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("could not install the metrics recorder: {e}"))?;
    // What the exporter's HTTP listener would do in an application: without upkeep its
    // histograms keep every sample until the next render.
    let upkeep = tokio::spawn({
        let recorder = recorder.clone();
        async move {
            let mut every = tokio::time::interval(UPKEEP);
            loop {
                every.tick().await;
                recorder.run_upkeep();
            }
        }
    });
    let in_process_recorded = in_process(quick, ", metrics recorder installed").await?;
    let recorded_cases = [(BARE, false), (MEMORY, false)];
    let recorded = measure(
        addr,
        &recorded_cases,
        reps,
        duration,
        warmup,
        ", metrics recorder installed",
    )
    .await?;
    upkeep.abort();
    let _ = stop.send(());
    let _ = server.await;
    check_statuses(&recorded_cases, &recorded)?;
    let rendered = recorder.render();
    if !rendered.contains("tower_batch_lock_acquisitions_total") {
        return Err(format!(
            "the recorder saw no tower_batch_lock_acquisitions_total; it rendered:\n{rendered}"
        ));
    }
    let granted_recorded = granted(&rendered, MEMORY.path);

    let mut results: Vec<Value> = cases
        .iter()
        .zip(outcomes)
        .map(|((route, contended), outcomes)| summarize(route, *contended, false, outcomes))
        .collect();
    let [bare_recorded, memory_recorded]: [Vec<Outcome>; 2] = recorded
        .try_into()
        .map_err(|_| "two recorded cases".to_owned())?;
    let bare_recorded_runs: Vec<f64> = bare_recorded.iter().map(Outcome::per_second).collect();
    let mut memory_recorded = summarize(&MEMORY, false, true, memory_recorded);
    memory_recorded["bare_axum_requests_per_second_runs"] = json!(bare_recorded_runs
        .iter()
        .map(|r| stats::round(*r, 1))
        .collect::<Vec<_>>());
    memory_recorded["bare_axum_requests_per_second"] =
        json!(stats::round(median(bare_recorded_runs), 1));
    memory_recorded["granted_counted_by_recorder"] = json!(granted_recorded);
    results.push(memory_recorded);
    let targets = targets(&results, &in_process_plain, &in_process_recorded);
    Ok(json!({
        "method": format!(
            "axum on 127.0.0.1:0 in the bench process (multi-threaded runtime); a hand-written HTTP/1.1 load generator on its own thread, {CONNECTIONS} keep-alive connections, GET with an x-key header; {reps} runs of {} s per case, cases taking turns; requests/s = median of the runs, latencies over all requests; a target's ratio = median of the ratios of runs that went back to back; the hand-written handler runs the crate's own acquire and release scripts (read from src/store/redis/scripts/) with EVALSHA, on one multiplexed connection shared by all requests, as the crate's Redis store does. The case with a metrics recorder runs after every other case (a global recorder cannot be uninstalled): metrics-exporter-prometheus's recorder, with upkeep every {} s, bare axum and the memory layer taking turns again; its target pairs those runs",
            duration.as_secs_f64(),
            UPKEEP.as_secs()
        ),
        "connections": CONNECTIONS,
        "runs_per_case": reps,
        "run_seconds": duration.as_secs_f64(),
        "cases": results,
        "in_process": in_process_json(&in_process_plain, &in_process_recorded),
        "targets": targets.iter().map(Target::to_json).collect::<Vec<_>>(),
    }))
}

/// Runs every case `reps` times, the cases taking turns; the outcomes by case, in run order.
async fn measure(
    addr: SocketAddr,
    cases: &[(Route, bool)],
    reps: usize,
    duration: Duration,
    warmup: Duration,
    suffix: &str,
) -> Result<Vec<Vec<Outcome>>, String> {
    let mut outcomes: Vec<Vec<Outcome>> = cases.iter().map(|_| Vec::new()).collect();
    let total = cases.len() * reps;
    let mut run = 0;
    for rep in 0..reps {
        for (index, (route, contended)) in cases.iter().enumerate() {
            run += 1;
            let mode = if *contended {
                "contended"
            } else {
                "uncontended"
            };
            let load = Load {
                path: route.path.to_owned(),
                requests: if *contended {
                    Requests::SharedKey
                } else {
                    Requests::OwnKey
                },
                connections: CONNECTIONS,
                duration,
                max_requests: MAX_REQUESTS,
            };
            progress::begin(
                format!(
                    "http {run}/{total} {}{suffix}, {mode} (run {}/{reps})",
                    route.name,
                    rep + 1
                ),
                "requests",
                MAX_REQUESTS,
            );
            drive(
                addr,
                Load {
                    duration: warmup,
                    ..load.clone()
                },
            )
            .await?;
            let outcome = drive(addr, load).await?;
            progress::end(&format!(
                "{:.0} requests/s, statuses {:?}, {} errors",
                outcome.per_second(),
                outcome.statuses,
                outcome.errors
            ));
            outcomes[index].push(outcome);
        }
    }
    Ok(outcomes)
}

/// The grants the recorder counted on the layer labelled `layer`, from its rendered text.
fn granted(rendered: &str, layer: &str) -> Option<u64> {
    let series =
        format!("tower_batch_lock_acquisitions_total{{layer=\"{layer}\",outcome=\"granted\"}} ");
    rendered
        .lines()
        .find_map(|line| line.strip_prefix(&series)?.trim().parse().ok())
}

/// Every request was answered, with 200, or 409 under contention: anything else means a
/// route is broken, and its figures would mean nothing.
fn check_statuses(cases: &[(Route, bool)], outcomes: &[Vec<Outcome>]) -> Result<(), String> {
    for ((route, contended), outcomes) in cases.iter().zip(outcomes) {
        for outcome in outcomes {
            let unexpected: Vec<_> = outcome
                .statuses
                .iter()
                .filter(|(status, _)| **status != 200 && !(*contended && **status == 409))
                .collect();
            if !unexpected.is_empty() || outcome.errors > 0 {
                return Err(format!(
                    "{} ({}): unexpected statuses {unexpected:?}, {} transport errors",
                    route.name,
                    if *contended {
                        "contended"
                    } else {
                        "uncontended"
                    },
                    outcome.errors
                ));
            }
        }
    }
    Ok(())
}

/// What the memory layer costs a request without the network, next to what tower's
/// `ConcurrencyLimit` costs: bare axum, the limited route and the layered route called with
/// `oneshot` in a loop, on one task, taking turns. Whether a metrics recorder is installed is
/// up to the caller.
async fn in_process(quick: bool, suffix: &str) -> Result<InProcess, String> {
    let (reps, limit) = if quick {
        (1, Duration::from_millis(200))
    } else {
        (5, Duration::from_secs(1))
    };
    let memory = Locks::new(Store::isolated_memory()).ttl(TTL);
    let routers = [
        ("bare axum", Router::new().route("/", get(ok))),
        (
            "tower ConcurrencyLimit",
            Router::new().route(
                "/",
                get(ok).layer(ConcurrencyLimitLayer::new(CONCURRENCY_LIMIT)),
            ),
        ),
        (
            "layer, memory, 1 key",
            Router::new().route("/", get(ok).layer(memory.layer(one_key))),
        ),
    ];
    // Finalized as `axum::serve` does (`into_make_service` calls `with_state`): an
    // unfinalized router would build each route's layers again for every request.
    let routers = routers.map(|(name, router)| (name, router.with_state::<()>(())));
    let mut per_request: Vec<Vec<f64>> = vec![Vec::new(); routers.len()];
    for rep in 0..reps {
        for (index, (name, router)) in routers.iter().enumerate() {
            progress::begin(
                format!("http in-process {name}{suffix} (run {}/{reps})", rep + 1),
                "requests",
                1_000_000,
            );
            let started = std::time::Instant::now();
            let mut done = 0u64;
            while started.elapsed() < limit && done < 1_000_000 {
                let request = http::Request::get("/")
                    .header("x-key", done.to_string())
                    .body(axum::body::Body::empty())
                    .expect("a valid request");
                let response = tower::ServiceExt::oneshot(router.clone(), request)
                    .await
                    .unwrap_or_else(|never| match never {});
                if response.status() != StatusCode::OK {
                    return Err(format!("{name} answered {}", response.status()));
                }
                done += 1;
                if done.is_multiple_of(10_000) {
                    progress::tick(done);
                }
            }
            let ns = started.elapsed().as_secs_f64() * 1e9 / done as f64;
            progress::end(&format!("{ns:.0} ns a request"));
            per_request[index].push(ns);
        }
    }
    // What a route adds is taken round by round, against bare axum's run just before it:
    // bare axum's own time moves between rounds (0.86 us in one run, 1.08 us in another),
    // and a difference of medians taken from different rounds moved with it.
    let adds = |route: usize| {
        let rounds = per_request[route].iter().zip(&per_request[0]);
        median(rounds.map(|(route, bare)| route - bare).collect())
    };
    Ok(InProcess {
        bare_ns: median(per_request[0].clone()),
        concurrency_limit_ns: median(per_request[1].clone()),
        layer_ns: median(per_request[2].clone()),
        concurrency_limit_adds_ns: adds(1),
        layer_adds_ns: adds(2),
    })
}

/// Nanoseconds a request, each the median of its rounds; and what a route adds, the
/// median of its rounds' differences with bare axum.
struct InProcess {
    bare_ns: f64,
    concurrency_limit_ns: f64,
    layer_ns: f64,
    concurrency_limit_adds_ns: f64,
    layer_adds_ns: f64,
}

impl InProcess {
    /// What the layer adds to a request, over bare axum, in nanoseconds.
    fn layer_adds_ns(&self) -> f64 {
        self.layer_adds_ns
    }

    /// The same in microseconds, for the targets.
    fn layer_adds_us(&self) -> f64 {
        stats::round(self.layer_adds_ns() / 1e3, 2)
    }

    fn to_json(&self) -> Value {
        let ns = |value: f64| stats::round(value, 0);
        let layer_adds = self.layer_adds_ns();
        let limit_adds = self.concurrency_limit_adds_ns;
        json!({
            "bare_ns_per_request": ns(self.bare_ns),
            "layer_memory_ns_per_request": ns(self.layer_ns),
            "layer_adds_ns": ns(layer_adds),
            "concurrency_limit_ns_per_request": ns(self.concurrency_limit_ns),
            "concurrency_limit_adds_ns": ns(limit_adds),
            // A limit that measured no slower than bare axum leaves nothing to divide by.
            "layer_adds_over_concurrency_limit_adds":
                (limit_adds > 0.0).then(|| stats::round(layer_adds / limit_adds, 2)),
        })
    }
}

fn in_process_json(plain: &InProcess, recorded: &InProcess) -> Value {
    let mut figures = plain.to_json();
    figures["method"] = json!(format!(
        "Router::oneshot in a loop on one task, no network, each router finalized with with_state(()) as axum::serve does; bare axum, the route behind tower's ConcurrencyLimitLayer (limit {CONCURRENCY_LIMIT}, never reached: one request at a time) and the route behind the memory layer taking turns, five rounds, the median of each route's rounds; a route's added cost = the median over the rounds of its time minus bare axum's in the same round; then, once a metrics recorder (metrics-exporter-prometheus) is installed, all three again"
    ));
    figures["concurrency_limit"] = json!(CONCURRENCY_LIMIT);
    figures["with_recorder"] = recorded.to_json();
    figures
}

/// The generator on a thread and a runtime of its own, as a separate client would be.
pub(crate) async fn drive(addr: SocketAddr, load: Load) -> Result<Outcome, String> {
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        Ok(runtime.block_on(load::drive(addr, load, progress::tick)))
    })
    .await
    .map_err(|e| e.to_string())?
}

fn summarize(route: &Route, contended: bool, recorder: bool, outcomes: Vec<Outcome>) -> Value {
    let runs: Vec<f64> = outcomes.iter().map(Outcome::per_second).collect();
    let median_rps = median(runs.clone());
    let mut latencies = Vec::new();
    let mut statuses = std::collections::BTreeMap::<u16, u64>::new();
    let mut errors = 0;
    for outcome in outcomes {
        latencies.extend(outcome.latencies);
        errors += outcome.errors;
        for (status, n) in outcome.statuses {
            *statuses.entry(status).or_default() += n;
        }
    }
    latencies.sort_unstable();
    let (p50, p99) = if latencies.is_empty() {
        (Value::Null, Value::Null)
    } else {
        (
            json!(stats::ms(percentile(&latencies, 0.5))),
            json!(stats::ms(percentile(&latencies, 0.99))),
        )
    };
    let name = if recorder {
        format!("{}, metrics recorder installed", route.name)
    } else {
        route.name.to_owned()
    };
    json!({
        "route": name,
        "path": route.path,
        "contended": contended,
        "metrics_recorder": recorder,
        "requests_per_second": stats::round(median_rps, 1),
        "requests_per_second_runs": runs.iter().map(|r| stats::round(*r, 1)).collect::<Vec<_>>(),
        "p50_ms": p50,
        "p99_ms": p99,
        "requests": latencies.len(),
        "ok": statuses.get(&200).copied().unwrap_or(0),
        "conflict_409": statuses.get(&409).copied().unwrap_or(0),
        "other_statuses": statuses.iter().filter(|(s, _)| **s != 200 && **s != 409).map(|(s, n)| (s.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
        "transport_errors": errors,
    })
}

pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The uncontended case of `path`, with or without a metrics recorder.
fn uncontended<'a>(results: &'a [Value], path: &str, recorder: bool) -> Option<&'a Value> {
    results
        .iter()
        .find(|r| r["path"] == path && r["contended"] == false && r["metrics_recorder"] == recorder)
}

/// Requests per second of each run of `field` of a case, in run order.
fn runs(case: &Value, field: &str) -> Option<Vec<f64>> {
    case[field].as_array()?.iter().map(Value::as_f64).collect()
}

/// The median, over the runs, of each run's ratio: two routes that ran back to back saw
/// the same machine, so a slow moment weighs on both sides of a ratio alike.
pub(crate) fn paired_ratio(ours: Option<Vec<f64>>, theirs: Option<Vec<f64>>) -> Option<f64> {
    let (ours, theirs) = (ours?, theirs?);
    let ratios: Vec<f64> = ours.iter().zip(&theirs).map(|(o, t)| o / t).collect();
    (!ratios.is_empty()).then(|| median(ratios))
}

fn targets(results: &[Value], in_process: &InProcess, with_recorder: &InProcess) -> Vec<Target> {
    let case_runs = |path: &str| runs(uncontended(results, path, false)?, RUNS);
    let ratio = |ours: &str, theirs: &str| paired_ratio(case_runs(ours), case_runs(theirs));
    // The bare runs that took turns with the recorded ones, not those before the recorder.
    let recorded = uncontended(results, MEMORY.path, true);
    let recorded_ratio = paired_ratio(
        recorded.and_then(|case| runs(case, RUNS)),
        recorded.and_then(|case| runs(case, "bare_axum_requests_per_second_runs")),
    );
    vec![
        Target::at_least(
            "HTTP, Redis, 1 key: layer / hand-written requests/s",
            ratio("/redis/1", "/hand/1"),
            0.97,
        ),
        Target::at_least(
            "HTTP, memory, 1 key: layer / bare axum requests/s",
            ratio("/memory/1", "/bare"),
            0.95,
        ),
        Target::at_least(
            "HTTP, memory, 1 key, with a recorder: layer / bare axum requests/s",
            recorded_ratio,
            0.95,
        ),
        Target::at_most(
            "in process, memory, 1 key: the layer adds (µs a request)",
            Some(in_process.layer_adds_us()),
            1.0,
        ),
        Target::at_most(
            "in process, memory, 1 key, with a recorder: the layer adds (µs a request)",
            Some(with_recorder.layer_adds_us()),
            1.5,
        ),
    ]
}

const RUNS: &str = "requests_per_second_runs";

#[derive(Clone)]
struct Hand {
    /// One multiplexed connection shared by every request, as the crate's Redis store has.
    conn: MultiplexedConnection,
    /// The names of the crate's acquire and release functions ([`crate_functions`]).
    acquire: Arc<str>,
    release: Arc<str>,
}

fn app(pool: Pool, hand: Hand) -> Router {
    let memory = Locks::new(Store::isolated_memory()).ttl(TTL);
    let redis = Locks::new(Redis::pool(pool.clone()).build().unwrap()).ttl(TTL);
    Router::new()
        .route("/bare", get(ok))
        .route("/memory/1", get(ok).layer(memory.layer(one_key)))
        .route("/redis/1", get(ok).layer(redis.layer(one_key)))
        .route("/redis/100", get(ok).layer(redis.layer(hundred_keys)))
        .route("/hand/1", get(hand_one))
        .route("/hand/100", get(hand_hundred))
        .with_state(hand)
}

pub(crate) async fn ok() -> &'static str {
    "ok"
}

pub(crate) type BadRequest = (StatusCode, &'static str);

fn key_header(headers: &HeaderMap) -> Result<String, BadRequest> {
    headers
        .get("x-key")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
        .ok_or((StatusCode::BAD_REQUEST, "x-key header missing"))
}

pub(crate) fn one_key(parts: &Parts) -> Result<[String; 1], BadRequest> {
    Ok([format!("k:{}", key_header(&parts.headers)?)])
}

pub(crate) fn hundred_keys(parts: &Parts) -> Result<Vec<String>, BadRequest> {
    let key = key_header(&parts.headers)?;
    Ok((0..100).map(|i| format!("k:{key}:{i}")).collect())
}

async fn hand_one(State(hand): State<Hand>, headers: HeaderMap) -> Response {
    hand.locked(&headers, 1).await
}

async fn hand_hundred(State(hand): State<Hand>, headers: HeaderMap) -> Response {
    hand.locked(&headers, 100).await
}

/// The names of the crate's acquire and release functions on the server behind `conn`
/// (`FUNCTION LIST`), once a check of the crate's store loaded its library: the
/// hand-written handler calls the very functions the layer calls, so that it always does
/// the same Redis work.
pub(crate) async fn crate_functions(
    conn: &mut MultiplexedConnection,
) -> Result<[String; 2], String> {
    let listed: redis::Value = redis::cmd("FUNCTION")
        .arg("LIST")
        .arg("LIBRARYNAME")
        .arg("tower_batch_lock_*")
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    let mut names = Vec::new();
    function_names(&listed, &mut names);
    let named = |call: &str| {
        let mut found = names.iter().filter(|name| crate_call(name) == Some(call));
        match (found.next(), found.next()) {
            (Some(name), None) => Ok(name.clone()),
            _ => Err(format!("not one {call} function of the crate's: {names:?}")),
        }
    };
    Ok([named("acquire")?, named("release")?])
}

/// Which of the crate's functions `name` calls, if it is the acquire or the release: the
/// batch section tells the calls in its SLOWLOG apart by it.
pub(crate) fn crate_call(name: &str) -> Option<&'static str> {
    // `tower_batch_lock_<hash>_<call>`.
    let (_hash, call) = name.strip_prefix("tower_batch_lock_")?.split_once('_')?;
    ["acquire", "release"]
        .into_iter()
        .find(|kind| *kind == call)
}

/// Every string in a `FUNCTION LIST` reply (names, flags, descriptions).
fn function_names(value: &redis::Value, names: &mut Vec<String>) {
    match value {
        redis::Value::BulkString(bytes) => names.extend(String::from_utf8(bytes.clone())),
        redis::Value::SimpleString(text) => names.push(text.clone()),
        redis::Value::Array(values) | redis::Value::Set(values) => {
            values.iter().for_each(|value| function_names(value, names))
        }
        redis::Value::Map(pairs) => pairs.iter().for_each(|(key, value)| {
            function_names(key, names);
            function_names(value, names);
        }),
        _ => {}
    }
}

impl Hand {
    /// What a careful handler writes without the layer: acquire every key in one script,
    /// answer 409 if any is held, do the work, release in one script, on the connection all
    /// requests share: the layer's round trips.
    async fn locked(&self, headers: &HeaderMap, keys: usize) -> Response {
        let key = match key_header(headers) {
            Ok(key) => key,
            Err(bad) => return bad.into_response(),
        };
        let mut keys: Vec<String> = if keys == 1 {
            vec![format!("hand:k:{key}")]
        } else {
            (0..keys).map(|i| format!("hand:k:{key}:{i}")).collect()
        };
        keys.sort_unstable();
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let hold = format!("{:016x}", fastrand::u64(..));
        let mut conn = self.conn.clone();
        // KEYS: the fencing counter, then the batch. ARGV: owner token, hold id, ttl in
        // milliseconds, how many conflicts to name, ticket ('' for none), reservation ttl,
        // modes ('x': the whole batch exclusive), '1' to count the grant, the release
        // channel (used only to wake a reader next in line).
        // A grant answers its fencing token, a refusal a list.
        let acquired: redis::RedisResult<redis::Value> = redis::cmd("FCALL")
            .arg(&*self.acquire)
            .arg(keys.len() + 1)
            .arg("hand:")
            .arg(&keys)
            .arg(&owner)
            .arg(&hold)
            .arg(TTL.as_millis() as u64)
            .arg(20)
            // A request that does not wait: in no line, reserving nothing.
            .arg("")
            .arg(0)
            // Exclusive, and counting the grant, as the layer's one-step batches do.
            .arg("x")
            .arg("1")
            .arg("hand:released")
            .query_async(&mut conn)
            .await;
        match acquired {
            Ok(redis::Value::Int(_)) => {}
            Ok(_) => return (StatusCode::CONFLICT, "held").into_response(),
            Err(_) => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
        }
        let response = ok().await.into_response();
        // KEYS: the batch. ARGV: owner token, hold id, channel, wake-up slots. It answers
        // how many keys had the hold, then the waiters it let in.
        let released: redis::RedisResult<redis::Value> = redis::cmd("FCALL")
            .arg(&*self.release)
            .arg(keys.len())
            .arg(&keys)
            .arg(&owner)
            .arg(&hold)
            .arg("hand:released")
            .arg("*")
            .query_async(&mut conn)
            .await;
        match released {
            Ok(_) => response,
            Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        }
    }
}
