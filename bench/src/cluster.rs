//! The 3,000-key cycle and HTTP requests on a Redis Cluster of three masters next to one
//! Redis, in the same run, and Redis's own time on every node (issue 11, item 7).
//!
//! - **The cluster**: three masters without replicas (the tests' harness,
//!   `tests/it/support/cluster.rs`, with `start_with(0)`), on free loopback ports: on a small
//!   machine, replicas would take CPU from the masters and the client while they apply the
//!   stream. The one Redis is the bench's own server, as in the other sections.
//! - **The cycle**: as the `batch` section's crate case, a tower service behind
//!   `locks.layer(closure naming 3,000 keys)` called with `oneshot`, the response waiting for
//!   the release; on one Redis (`Locks::new(Redis::pool(pool).build().unwrap())`) and on the cluster (`RedisCluster`).
//!   The two take turns round by round, the first of each round swapping, so that a slow
//!   moment of the machine lands on both.
//! - **Redis's own time**: `CONFIG RESETSTAT` on every node before the measured rounds,
//!   `INFO commandstats` after, divided by the rounds. On one Redis, `fcall` (the crate's
//!   functions) + `evalsha` + `eval` + `set` (the plain `SET`s that take a big batch's free
//!   keys; Redis 7 counts the commands a script calls in the script's time and under their
//!   own names too, so a script's `SET`s count twice, against the crate). On a master, the
//!   same + `spublish`: the cluster store sends the release's `SPUBLISH` on its own, to the
//!   master of its channel, and counts a grant with a script (`EVALSHA`) on the counter's.
//! - **HTTP**: axum in this process, the layer on one Redis and on the cluster, 1 and 100
//!   keys a request (a key set of its own per request: uncontended), driven by the `http`
//!   section's load generator; the four routes take turns run by run.

use std::{
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};
use tower_batch_lock::store::Redis;

use axum::{routing::get, Router};
use deadpool_redis::Pool;
use redis::aio::MultiplexedConnection;
use serde_json::{json, Value};
use tower_batch_lock::{store::RedisCluster, Locks};

use crate::{
    batch,
    cluster_support::Cluster,
    http,
    load::{Load, Outcome, Requests},
    progress,
    redis_info::{command_stats, connect, redis_error, reset_stats, sum, CommandStats},
    stats::{self, count, human, percentile, Summary},
    support::RedisServer,
    target::Target,
};

/// The batch of the target: a 3,000-sku order.
const KEYS: usize = 3_000;
const MASTERS: usize = 3;
const TTL: Duration = Duration::from_secs(30);
/// Generous: the machine may be busy with other work; the bench measures speed, not how
/// the store fails.
const BACKEND_TIMEOUT: Duration = Duration::from_secs(30);
const NODE_TIMEOUT: Duration = Duration::from_secs(5);

/// The crate's scripts, however they are called.
const SCRIPT_COMMANDS: [&str; 3] = ["fcall", "evalsha", "eval"];
/// The lock's own commands on one Redis: its scripts, and the plain `SET`s that take a big
/// batch's free keys; everything else runs inside its scripts. (Redis also counts under
/// `set` the `SET`s a script calls, such as the fencing counter's: counted twice, against
/// the crate.)
const ONE_REDIS_COMMANDS: [&str; 4] = ["fcall", "evalsha", "eval", "set"];
/// The lock's own commands on a cluster master: the same, and the release's `SPUBLISH`.
const MASTER_COMMANDS: [&str; 5] = ["fcall", "evalsha", "eval", "set", "spublish"];

pub(crate) const ONE_REDIS: &str = "one Redis";
pub(crate) const CLUSTER: &str = "Redis Cluster, 3 masters";

pub(crate) async fn run(server: &RedisServer, pool: &Pool, quick: bool) -> Result<Value, String> {
    progress::note("starting a Redis Cluster of three masters on free loopback ports");
    let cluster = tokio::task::spawn_blocking(|| Cluster::start_with(0))
        .await
        .map_err(|e| format!("the cluster did not start: {e}"))?;
    let masters = cluster.masters();
    if masters.len() != MASTERS {
        return Err(format!("expected {MASTERS} masters, found {masters:?}"));
    }
    let one = Locks::new(Redis::pool(pool.clone()).build().unwrap())
        .ttl(TTL)
        .max_keys(KEYS)
        .store_timeout(BACKEND_TIMEOUT);
    let clustered = RedisCluster::new(cluster.urls())
        .node_timeout(NODE_TIMEOUT)
        .build()
        .map_err(redis_error)?;
    let clustered = Locks::new(clustered)
        .ttl(TTL)
        .max_keys(KEYS)
        .store_timeout(BACKEND_TIMEOUT);

    let cycle = cycle(server, &cluster, &masters, &one, &clustered, quick).await?;
    let http = http_cases(&one, &clustered, quick).await?;
    if !cluster.empty() {
        return Err("locks were left on the cluster's masters".to_owned());
    }
    let targets = targets(&cycle);
    Ok(json!({
        "method": {
            "cluster": "three masters without replicas (tests/it/support/cluster.rs, Cluster::start_with(0)) on free loopback ports, Redis's defaults but --save \"\" --appendonly no --cluster-node-timeout 1000; the one Redis is the bench's own server",
            "cycle": format!("a tower service behind locks.layer(closure naming {KEYS} keys), called with oneshot, the response waiting for the release (as the batch section's crate case); Locks::new(Redis::pool(pool).build().unwrap()) and RedisCluster::new(urls).node_timeout(5 s).build(), both with ttl 30 s and backend_timeout 30 s; the two take turns round by round, the first of each round swapping; ratio = cluster / one Redis"),
            "server_ms": "CONFIG RESETSTAT on every node before the measured rounds, INFO commandstats after, divided by the rounds: on one Redis fcall + evalsha + eval (its functions run INCR and PUBLISH inside, counted in the script's time) + set (the plain SETs that take the batch's free keys; the SETs its functions call are counted there once more, against one Redis); on a master the same + spublish (the cluster store sends the release's SPUBLISH on its own, and counts the grant with a script); busiest master = the master with the largest such time",
            "batch_keys": "how many of the batch's keys each master serves (CLUSTER KEYSLOT of each stored key, against each master's slot ranges in CLUSTER NODES)",
            "http": format!("axum on 127.0.0.1:0 in the bench process, the http section's load generator ({} keep-alive connections, GET with an x-key header of its own per request: uncontended); the four routes take turns run by run; requests/s = median of the runs; ratio = median of the per-run ratios cluster / one Redis", http::CONNECTIONS),
        },
        "keys": KEYS,
        "masters": MASTERS,
        "replicas_per_master": 0,
        "cycle": cycle,
        "http": http,
        "targets": targets.iter().map(Target::to_json).collect::<Vec<_>>(),
    }))
}

/// The 3,000-key cycle on both stores, taking turns, with every node's Redis time.
async fn cycle(
    server: &RedisServer,
    cluster: &Cluster,
    masters: &[u16],
    one: &Locks,
    clustered: &Locks,
    quick: bool,
) -> Result<Value, String> {
    let names: Arc<[String]> = (0..KEYS).map(|i| format!("bench:{i:06}")).collect();
    let services = [
        batch::layered(one, names.clone()),
        batch::layered(clustered, names.clone()),
    ];
    let (warmup, min, max, time) = if quick {
        (2, 3, 20, Duration::from_secs(1))
    } else {
        (10, 20, 1_000, Duration::from_secs(12))
    };
    // The first calls load the scripts on every node and open the pools.
    for _ in 0..warmup {
        for service in &services {
            batch::call(service.clone()).await?;
        }
    }

    let mut one_stats = connect(&server.url()).await?;
    let mut master_stats = Vec::new();
    for port in masters {
        master_stats.push(connect(&node_url(*port)).await?);
    }
    reset_stats(&mut one_stats).await?;
    for conn in &mut master_stats {
        reset_stats(conn).await?;
    }

    progress::begin(
        format!(
            "cluster 1/2 {}-key cycle, one Redis and three masters taking turns",
            count(KEYS as u64)
        ),
        "rounds",
        max,
    );
    let started = Instant::now();
    let mut samples: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for round in 0..max {
        if round >= min && started.elapsed() >= time {
            break;
        }
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for which in order {
            let began = Instant::now();
            batch::call(services[which].clone()).await?;
            samples[which].push(began.elapsed());
        }
        if round == 0 {
            let per_round = started.elapsed().max(Duration::from_micros(1));
            let fits = (time.as_secs_f64() / per_round.as_secs_f64()) as u64;
            progress::replan(fits.clamp(min, max));
        }
        progress::tick(round + 1);
    }
    let rounds = samples[0].len() as f64;

    let one_node = node_json(
        ONE_REDIS,
        None,
        &command_stats(&mut one_stats).await?,
        &ONE_REDIS_COMMANDS,
        rounds,
    );
    let mut masters_stats = Vec::new();
    for conn in &mut master_stats {
        masters_stats.push(command_stats(conn).await?);
    }
    // After the stats were read: CLUSTER KEYSLOT is not the lock's work.
    let keys_by_master = batch_keys(&mut master_stats[0], cluster, masters, &names).await?;
    let mut nodes = Vec::new();
    for ((port, stats), keys) in masters.iter().zip(&masters_stats).zip(keys_by_master) {
        let mut node = node_json(
            &format!("master 127.0.0.1:{port}"),
            Some(cluster.slots_of(*port)),
            stats,
            &MASTER_COMMANDS,
            rounds,
        );
        node["batch_keys"] = json!(keys);
        nodes.push(node);
    }
    check_one_clean(&mut one_stats).await?;

    let [one_samples, cluster_samples] = samples;
    let one_case = case_json(one_samples);
    let cluster_case = case_json(cluster_samples);
    let ratio = |field: &str| {
        let (ours, theirs) = (cluster_case[field].as_f64()?, one_case[field].as_f64()?);
        Some(stats::round(ours / theirs, 3))
    };
    let (median_ratio, p90_ratio) = (ratio("median_ms"), ratio("p90_ms"));
    let one_ms = one_node["server_ms"].as_f64().unwrap_or(0.0);
    let busiest = nodes
        .iter()
        .filter_map(|n| n["server_ms"].as_f64())
        .fold(0.0, f64::max);
    let all_masters: f64 = nodes.iter().filter_map(|n| n["server_ms"].as_f64()).sum();
    let of_one = |ms: f64| (one_ms > 0.0).then(|| stats::round(ms / one_ms, 3));
    progress::end(&format!(
        "median {} on one Redis, {} on the cluster ({}x); busiest master's Redis time {:.3} ms vs {:.3} ms ({}x)",
        human(Duration::from_secs_f64(
            one_case["median_ms"].as_f64().unwrap_or(0.0) / 1e3
        )),
        human(Duration::from_secs_f64(
            cluster_case["median_ms"].as_f64().unwrap_or(0.0) / 1e3
        )),
        median_ratio.map_or("?".to_owned(), |r| r.to_string()),
        busiest,
        one_ms,
        of_one(busiest).map_or("?".to_owned(), |r| r.to_string()),
    ));
    Ok(json!({
        "warmup_rounds": warmup,
        ONE_REDIS: one_case,
        CLUSTER: cluster_case,
        "median_ratio": median_ratio,
        "p90_ratio": p90_ratio,
        "nodes": std::iter::once(one_node).chain(nodes).collect::<Vec<_>>(),
        "busiest_master_server_ms": stats::round(busiest, 6),
        "busiest_master_ratio": of_one(busiest),
        "all_masters_server_ms": stats::round(all_masters, 6),
        "all_masters_ratio": of_one(all_masters),
    }))
}

fn case_json(mut samples: Vec<Duration>) -> Value {
    samples.sort_unstable();
    let p90 = percentile(&samples, 0.9);
    let mut case = Summary::of(samples).to_json();
    case["p90_ms"] = json!(stats::ms(p90));
    case
}

/// One node's Redis time per cycle for `commands`, and the calls per cycle of each command
/// it served (the pool's connection checks, `ping`, included: each is a round trip).
fn node_json(
    name: &str,
    slots: Option<u64>,
    stats: &CommandStats,
    commands: &[&str],
    rounds: f64,
) -> Value {
    let (usec, _) = sum(stats, commands);
    let (script_usec, _) = sum(stats, &SCRIPT_COMMANDS);
    let calls: serde_json::Map<String, Value> = commands
        .iter()
        .chain(&["ping"])
        .map(|command| {
            let (_, calls) = sum(stats, &[command]);
            (
                (*command).to_owned(),
                json!(stats::round(calls as f64 / rounds, 2)),
            )
        })
        .collect();
    // Every command the node served, nested ones too (Redis 7 counts the commands a script
    // calls under their own names as well as in the script's time): where the time goes.
    let all: serde_json::Map<String, Value> = stats
        .iter()
        .filter(|(command, _)| !["info", "config|resetstat", "config"].contains(&command.as_str()))
        .map(|(command, fields)| {
            let per_cycle = |field: &str| fields.get(field).copied().unwrap_or(0.0) / rounds;
            (
                command.clone(),
                json!({
                    "calls": stats::round(per_cycle("calls"), 2),
                    "usec": stats::round(per_cycle("usec"), 1),
                }),
            )
        })
        .collect();
    json!({
        "node": name,
        "slots": slots,
        "commandstats_per_cycle": all,
        "server_ms": stats::round(usec as f64 / 1e3 / rounds, 6),
        "script_ms": stats::round(script_usec as f64 / 1e3 / rounds, 6),
        "calls_per_cycle": calls,
    })
}

/// How many of `names` (as stored, under `lock:`) each master serves.
async fn batch_keys(
    conn: &mut MultiplexedConnection,
    cluster: &Cluster,
    masters: &[u16],
    names: &[String],
) -> Result<Vec<usize>, String> {
    let mut pipe = redis::pipe();
    for name in names {
        pipe.cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(format!("lock:{name}"));
    }
    let slots: Vec<u16> = pipe.query_async(conn).await.map_err(redis_error)?;
    Ok(masters
        .iter()
        .map(|port| {
            let nodes: String = cluster.cmd(*port, redis::cmd("CLUSTER").arg("NODES"));
            let ranges = own_ranges(&nodes);
            slots
                .iter()
                .filter(|slot| ranges.iter().any(|(a, b)| (a..=b).contains(slot)))
                .count()
        })
        .collect())
}

/// The slot ranges of the node that answered `CLUSTER NODES` (its `myself` line).
fn own_ranges(nodes: &str) -> Vec<(u16, u16)> {
    let Some(line) = nodes.lines().find(|l| l.contains("myself")) else {
        return Vec::new();
    };
    line.split(' ')
        .skip(8)
        .filter(|range| !range.starts_with('['))
        .filter_map(|range| match range.split_once('-') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => range.parse().ok().map(|slot| (slot, slot)),
        })
        .collect()
}

/// Every cycle on one Redis released what it took.
async fn check_one_clean(conn: &mut MultiplexedConnection) -> Result<(), String> {
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("lock:bench:*")
        .query_async(conn)
        .await
        .map_err(redis_error)?;
    if left.is_empty() {
        Ok(())
    } else {
        Err(format!("{} keys were left locked on one Redis", left.len()))
    }
}

#[derive(Debug, Clone, Copy)]
struct Route {
    path: &'static str,
    store: &'static str,
    keys: usize,
}

const ROUTES: [Route; 4] = [
    Route {
        path: "/one/1",
        store: ONE_REDIS,
        keys: 1,
    },
    Route {
        path: "/cluster/1",
        store: CLUSTER,
        keys: 1,
    },
    Route {
        path: "/one/100",
        store: ONE_REDIS,
        keys: 100,
    },
    Route {
        path: "/cluster/100",
        store: CLUSTER,
        keys: 100,
    },
];

/// Requests per second through axum with the layer on each store, 1 and 100 keys.
async fn http_cases(one: &Locks, clustered: &Locks, quick: bool) -> Result<Value, String> {
    let (reps, duration, warmup) = if quick {
        (1, Duration::from_millis(400), Duration::from_millis(100))
    } else {
        (3, Duration::from_secs(2), Duration::from_millis(300))
    };
    let app = Router::new()
        .route("/one/1", get(http::ok).layer(one.layer(http::one_key)))
        .route(
            "/one/100",
            get(http::ok).layer(one.layer(http::hundred_keys)),
        )
        .route(
            "/cluster/1",
            get(http::ok).layer(clustered.layer(http::one_key)),
        )
        .route(
            "/cluster/100",
            get(http::ok).layer(clustered.layer(http::hundred_keys)),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
    });
    let outcomes = measure(addr, reps, duration, warmup).await;
    let _ = stop.send(());
    let _ = server.await;
    let outcomes = outcomes?;

    let mut cases = Vec::new();
    for (route, outcomes) in ROUTES.iter().zip(&outcomes) {
        for outcome in outcomes {
            let unexpected: Vec<_> = outcome
                .statuses
                .iter()
                .filter(|(s, _)| **s != 200)
                .collect();
            if !unexpected.is_empty() || outcome.errors > 0 {
                return Err(format!(
                    "HTTP {} keys on {}: unexpected statuses {unexpected:?}, {} transport errors",
                    route.keys, route.store, outcome.errors
                ));
            }
        }
        let runs: Vec<f64> = outcomes.iter().map(Outcome::per_second).collect();
        let mut latencies: Vec<Duration> = outcomes
            .iter()
            .flat_map(|o| o.latencies.iter().copied())
            .collect();
        latencies.sort_unstable();
        cases.push(json!({
            "store": route.store,
            "keys": route.keys,
            "requests_per_second": stats::round(http::median(runs.clone()), 1),
            "requests_per_second_runs": runs.iter().map(|r| stats::round(*r, 1)).collect::<Vec<_>>(),
            "p50_ms": latencies.first().map(|_| stats::ms(percentile(&latencies, 0.5))),
            "p99_ms": latencies.first().map(|_| stats::ms(percentile(&latencies, 0.99))),
            "requests": latencies.len(),
        }));
    }
    let runs_of = |store: &str, keys: usize| -> Option<Vec<f64>> {
        let case = cases
            .iter()
            .find(|c| c["store"] == store && c["keys"] == keys)?;
        case["requests_per_second_runs"]
            .as_array()?
            .iter()
            .map(Value::as_f64)
            .collect()
    };
    let ratios: Vec<Value> = [1, 100]
        .iter()
        .map(|&keys| {
            json!({
                "keys": keys,
                "cluster_over_one_redis": http::paired_ratio(runs_of(CLUSTER, keys), runs_of(ONE_REDIS, keys))
                    .map(|r| stats::round(r, 3)),
            })
        })
        .collect();
    Ok(json!({
        "runs_per_case": reps,
        "run_seconds": duration.as_secs_f64(),
        "cases": cases,
        "ratios": ratios,
    }))
}

/// Every route `reps` times, the routes taking turns; the outcomes by route.
async fn measure(
    addr: SocketAddr,
    reps: usize,
    duration: Duration,
    warmup: Duration,
) -> Result<Vec<Vec<Outcome>>, String> {
    let mut outcomes: Vec<Vec<Outcome>> = ROUTES.iter().map(|_| Vec::new()).collect();
    let total = ROUTES.len() * reps;
    let mut run = 0;
    for rep in 0..reps {
        for (index, route) in ROUTES.iter().enumerate() {
            run += 1;
            let load = Load {
                path: route.path.to_owned(),
                requests: Requests::OwnKey,
                connections: http::CONNECTIONS,
                duration,
                max_requests: http::MAX_REQUESTS,
            };
            progress::begin(
                format!(
                    "cluster 2/2 http {run}/{total} layer, {}, {} keys (run {}/{reps})",
                    route.store,
                    route.keys,
                    rep + 1
                ),
                "requests",
                http::MAX_REQUESTS,
            );
            http::drive(
                addr,
                Load {
                    duration: warmup,
                    ..load.clone()
                },
            )
            .await?;
            let outcome = http::drive(addr, load).await?;
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

fn node_url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}/")
}

fn targets(cycle: &Value) -> Vec<Target> {
    vec![
        Target::at_most(
            "cluster, 3,000 keys: busiest master's Redis time / one Redis's",
            cycle["busiest_master_ratio"].as_f64(),
            0.45,
        ),
        Target::at_most(
            "cluster, 3,000-key cycle: three masters / one Redis (median)",
            cycle["median_ratio"].as_f64(),
            1.0,
        ),
    ]
}
