//! Contention (issue 35, item 5): what a grant costs the store, and how many grants a second
//! each store gives, as waiters pile up behind busy keys.
//!
//! A catalogue of 3,000 skus. *Retail* clients post orders of 3 random distinct skus back to
//! back; *purchase* clients post orders of 2,000 random distinct skus back to back; each
//! order holds an exclusive lock on every sku it names (`keys::json`) for 2 ms of work, and
//! waits up to 2 s for busy keys (`Wait::up_to`, fair, the default). The levels go from 4
//! purchase clients alone (the most purchase orders a store grants: they overlap, and so
//! run one after another) and 16 retail clients alone, through 1, 2 and 4 purchase clients
//! beside them, to 64 + 4, and then to a *hot sku*: 1, 8, 64 and 256 clients ordering the
//! same single sku.
//!
//! The stores: memory (one store, one server), and on one Redis, on Redlock over three
//! masters and on a Redis Cluster of three masters, *two* stores, each behind an axum
//! server of its own, the clients split between them, as two processes would be: a release
//! in one must wake the waiters of the other. Each level runs a fixed time on fresh stores
//! over flushed Redis servers, after a short warm-up (connections open, subscriptions made).
//!
//! Redis's side, summed over every master: `CONFIG RESETSTAT` after the warm-up, then the
//! calls of the lock's commands (`INFO commandstats`: its scripts and the plain `SET`s that
//! take a big batch's free keys) and the CPU time of Redis's main thread (`INFO cpu`, after
//! minus before), each divided by the grants. The same orders sent one at a time (1, 3 and
//! 2,000 skus) give each store's uncontended figures: contention's cost is the ratio of a
//! level's work to what its grants would have cost uncontended. The orders of a level's
//! sizes are sent one at a time again just before it, and its ratios divide by those, the
//! nearest measure of the same work: Redis's CPU time for the same uncontended orders
//! moves on a shared machine (2.26-3.31 ms for a 2,000-sku order between runs minutes
//! apart; one Redis's 1-sku order 0.48 ms of CPU at the start of a store's levels and
//! 0.24 at its hot levels, in one run), and a ratio over a figure taken minutes earlier
//! read that drift as much as the code. It takes out the drift between the two terms, not
//! the noise of either: the runs beside the levels spread about as widely as single runs.
//!
//! The grants/s targets divide a level by another (a store by memory at 16 + 4, 64 clients
//! by 1 on a hot sku): those levels run three rounds, and a target reads the median of the
//! rounds' ratios (`ROUNDS_LEVELS`).

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{routing::post, Router};
use redis::aio::MultiplexedConnection;
use serde::Deserialize;
use serde_json::{json, Value};
use tower_batch_lock::{
    keys,
    store::{Redis, RedisCluster, Redlock},
    Locks, Wait,
};

use crate::{
    cluster::{CLUSTER, ONE_REDIS},
    cluster_support::Cluster,
    load::{self, Load, Outcome, Requests},
    progress,
    redis_info::{command_stats, connect, main_thread_cpu, redis_error, reset_stats, sum},
    stats::{self, percentile},
    support::RedisServer,
    target::Target,
};

const CATALOGUE: u32 = 3_000;
const RETAIL_SKUS: usize = 3;
const PURCHASE_SKUS: usize = 2_000;
/// The sku every client of the hot levels orders.
const HOT_SKU: u32 = 0;
/// What a handler does while it holds the keys.
const WORK: Duration = Duration::from_millis(2);
const WAIT_BOUND: Duration = Duration::from_secs(2);
const TTL: Duration = Duration::from_secs(30);
/// Redlock's and the cluster's per-master timeout. Redlock's default, 100 ms, is many times
/// a 1,000-key step on a master with a core of its own; here six Redis servers, two axum
/// servers and up to 68 clients share two cores, and the `mixed` section saw 2,000-key and
/// larger attempts overrun 100 ms under load (503s with every server up). 500 ms is the
/// cluster's default.
const NODE_TIMEOUT: Duration = Duration::from_millis(500);
/// Bounds each load's requests whatever the run's length (64 clients holding a key 2 ms
/// each cannot be granted more than 32,000 a second, and the hot sku not 500).
const MAX_REQUESTS: u64 = 1_000_000;
/// Time for the releases of the last answered requests to reach Redis before its figures
/// are read: the guard releases once the response has gone out.
const SETTLE: Duration = Duration::from_millis(100);

/// The lock's own commands: its scripts, however called, and the plain `SET`s that take a
/// big batch's free keys. (Redis also counts under `set` the `SET`s a script calls: counted
/// twice, against the crate, in the uncontended figures as in the contended ones.)
const LOCK_COMMANDS: [&str; 5] = ["fcall", "fcall_ro", "evalsha", "eval", "set"];
/// The lock's scripts alone: with the `SET`s left out, what a waiter's attempts cost.
const SCRIPT_COMMANDS: [&str; 4] = ["fcall", "fcall_ro", "evalsha", "eval"];

/// What the small orders of a level name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Small {
    /// 3 random distinct skus of the catalogue.
    Retail,
    /// The hot sku alone.
    Hot,
}

impl Small {
    fn skus(self) -> usize {
        match self {
            Self::Retail => RETAIL_SKUS,
            Self::Hot => 1,
        }
    }

    fn body(self) -> fn() -> String {
        match self {
            Self::Retail => retail_order,
            Self::Hot => hot_order,
        }
    }
}

/// A level of contention: how many clients send small orders and how many send purchase
/// orders, all back to back.
#[derive(Debug, Clone, Copy)]
struct Level {
    name: &'static str,
    small: Small,
    clients: usize,
    purchase: usize,
}

const RETAIL_ALONE: &str = "16 retail";
const MIXED_TARGET: &str = "16 retail + 4 purchase";
const HOT_ONE: &str = "hot sku, 1 client";
const HOT_MANY: &str = "hot sku, 64 clients";
/// Past the issue's levels, which its targets are set at: how a grant's cost grows with the
/// line (on Redis a hot key's line is part of its value).
const HOT_MOST: &str = "hot sku, 256 clients";
/// The levels that the grants/s targets divide, run again after the section's pass, the
/// stores taking turns, and compared round by round (the median of the rounds' ratios): a
/// single 8 s level moves by a tenth between runs of the same code on a 2-core machine that
/// runs the servers and the clients too (one Redis at 16 + 4 read 0.40-0.50 of memory's
/// grants; PostgreSQL's hot sku with one client 219-258 grants/s within one session), and
/// in the pass a store's levels run minutes after memory's.
const ROUNDS_LEVELS: [&str; 3] = [MIXED_TARGET, HOT_ONE, HOT_MANY];

const LEVELS: [Level; 10] = [
    // The purchase orders alone: every two share about 1,333 skus, so they run one after
    // another, and this is the most the mixed levels could grant of them.
    Level {
        name: "4 purchase alone",
        small: Small::Retail,
        clients: 0,
        purchase: 4,
    },
    Level {
        name: RETAIL_ALONE,
        small: Small::Retail,
        clients: 16,
        purchase: 0,
    },
    Level {
        name: "16 retail + 1 purchase",
        small: Small::Retail,
        clients: 16,
        purchase: 1,
    },
    Level {
        name: "16 retail + 2 purchase",
        small: Small::Retail,
        clients: 16,
        purchase: 2,
    },
    Level {
        name: MIXED_TARGET,
        small: Small::Retail,
        clients: 16,
        purchase: 4,
    },
    Level {
        name: "64 retail + 4 purchase",
        small: Small::Retail,
        clients: 64,
        purchase: 4,
    },
    Level {
        name: HOT_ONE,
        small: Small::Hot,
        clients: 1,
        purchase: 0,
    },
    Level {
        name: "hot sku, 8 clients",
        small: Small::Hot,
        clients: 8,
        purchase: 0,
    },
    Level {
        name: HOT_MANY,
        small: Small::Hot,
        clients: 64,
        purchase: 0,
    },
    Level {
        name: HOT_MOST,
        small: Small::Hot,
        clients: 256,
        purchase: 0,
    },
];

/// The uncontended runs: orders of each size, one at a time, at most `count` or for `time`.
#[derive(Clone, Copy)]
struct Single {
    skus: usize,
    body: fn() -> String,
    count: u64,
    time: Duration,
}

/// How long the section's parts run.
struct Plan {
    run: Duration,
    warmup: Duration,
    singles: [Single; 3],
    /// How many times the levels that the grants/s targets compare run (`ROUNDS_LEVELS`).
    rounds: usize,
}

impl Plan {
    fn new(quick: bool) -> Self {
        // A 2,000-sku order takes tens of milliseconds on a Redis store: a few dozen fit.
        let single = |skus, body, count, time: f64| Single {
            skus,
            body,
            count,
            time: Duration::from_secs_f64(if quick { time / 4.0 } else { time }),
        };
        Self {
            run: Duration::from_secs(if quick { 2 } else { 8 }),
            warmup: Duration::from_millis(if quick { 100 } else { 300 }),
            singles: [
                single(1, hot_order, 2_000, 2.0),
                single(RETAIL_SKUS, retail_order, 2_000, 2.0),
                single(PURCHASE_SKUS, purchase_order, 200, 3.0),
            ],
            rounds: if quick { 1 } else { 3 },
        }
    }

    /// The uncontended runs just before `level`: the sizes its grants have, for half as
    /// long as the store's first ones.
    fn beside(&self, level: &Level) -> Vec<Single> {
        let sizes = [
            (level.clients > 0).then(|| level.small.skus()),
            (level.purchase > 0).then_some(PURCHASE_SKUS),
        ];
        self.singles
            .iter()
            .filter(|single| sizes.contains(&Some(single.skus)))
            .map(|single| Single {
                count: single.count / 2,
                time: single.time / 2,
                ..*single
            })
            .collect()
    }
}

const MEMORY: &str = "memory";
const REDLOCK: &str = "Redlock, 3 masters";
const POSTGRES: &str = "PostgreSQL";

/// A store under test, named by the Redis servers behind it.
struct Store {
    name: &'static str,
    /// Every master's URL: flushed before each case, and read for Redis's figures.
    masters: Vec<String>,
    /// The URLs its stores are built from (a cluster's: any of its nodes).
    urls: Vec<String>,
}

impl Store {
    /// The stores of one case: new handles over empty servers. On Redis, two, each to sit
    /// behind a server of its own, as two processes would.
    async fn handles(&self) -> Result<Vec<Locks>, String> {
        for url in &self.masters {
            redis::cmd("FLUSHALL")
                .query_async::<()>(&mut connect(url).await?)
                .await
                .map_err(redis_error)?;
        }
        let configure = |locks: Locks| locks.ttl(TTL).wait(Wait::up_to(WAIT_BOUND));
        if self.name == MEMORY {
            let memory = tower_batch_lock::store::Store::isolated_memory();
            return Ok(vec![configure(Locks::new(memory))]);
        }
        if self.name == POSTGRES {
            // Empty, as the Redis servers are flushed.
            let handles = crate::postgres::empty_stores(&self.urls[0], 2).await?;
            return Ok(handles.into_iter().map(configure).collect());
        }
        (0..2)
            .map(|_| {
                let store = match self.name {
                    ONE_REDIS => Redis::url(&self.urls[0]).build(),
                    REDLOCK => Redlock::new(&self.urls).node_timeout(NODE_TIMEOUT).build(),
                    _ => RedisCluster::new(&self.urls)
                        .node_timeout(NODE_TIMEOUT)
                        .build(),
                };
                store.map(|store| configure(Locks::new(store)))
            })
            .collect::<Result<_, _>>()
            .map_err(redis_error)
    }
}

/// `postgres`: the URL of the bench's PostgreSQL; `only`: the cases to run, by part of their
/// "store, level" (none: all).
pub(crate) async fn run(
    server: &RedisServer,
    postgres: &str,
    quick: bool,
    only: &[String],
) -> Result<Value, String> {
    let plan = Plan::new(quick);
    progress::note(
        "starting three Redis masters and a Redis Cluster of three on free loopback ports",
    );
    let (trio, cluster) = tokio::task::spawn_blocking(|| {
        let trio: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
        (trio, Cluster::start_with(0))
    })
    .await
    .map_err(|e| format!("the Redis servers did not start: {e}"))?;
    let masters: Vec<String> = cluster
        .masters()
        .iter()
        .map(|port| format!("redis://127.0.0.1:{port}/"))
        .collect();
    let trio: Vec<String> = trio.iter().map(RedisServer::url).collect();
    let stores = [
        Store {
            name: MEMORY,
            masters: vec![],
            urls: vec![],
        },
        Store {
            name: ONE_REDIS,
            masters: vec![server.url()],
            urls: vec![server.url()],
        },
        Store {
            name: REDLOCK,
            masters: trio.clone(),
            urls: trio,
        },
        Store {
            name: CLUSTER,
            masters,
            urls: cluster.urls(),
        },
        Store {
            name: POSTGRES,
            masters: vec![],
            urls: vec![postgres.to_owned()],
        },
    ];

    let chosen = |store: &Store, level: &Level| {
        let case = format!("{}, {}", store.name, level.name);
        only.is_empty() || only.iter().any(|text| case.contains(text.as_str()))
    };
    let mut singles = Vec::new();
    let mut cases = Vec::new();
    let total = stores
        .iter()
        .map(|store| LEVELS.iter().filter(|l| chosen(store, l)).count())
        .sum::<usize>();
    for store in &stores {
        if !LEVELS.iter().any(|level| chosen(store, level)) {
            continue;
        }
        let mut stats = Vec::new();
        for url in &store.masters {
            stats.push(connect(url).await?);
        }
        let uncontended = if stats.is_empty() {
            Vec::new()
        } else {
            let label = format!("contention {}", store.name);
            uncontended(store, &mut stats, &plan.singles, plan.warmup, &label).await?
        };
        singles.extend(uncontended.iter().map(|u| u.to_json(store.name)));
        for level in LEVELS.iter().filter(|level| chosen(store, level)) {
            let label = format!(
                "contention {}/{total} {}, {}",
                cases.len() + 1,
                store.name,
                level.name
            );
            let case = case(store, &mut stats, level, &plan, label)
                .await
                .map_err(|error| format!("{}, {}: {error}", store.name, level.name))?;
            cases.push(case);
        }
    }
    // Later rounds of the compared levels: level by level, every store in turn, with no
    // uncontended runs beside them nor Redis's figures (the pass has those).
    let mut rounds = Vec::new();
    for round in 2..=plan.rounds {
        for level in LEVELS.iter().filter(|l| ROUNDS_LEVELS.contains(&l.name)) {
            for store in stores.iter().filter(|store| chosen(store, level)) {
                let label = format!(
                    "contention round {round}/{}: {}, {}",
                    plan.rounds, store.name, level.name
                );
                let mut case =
                    case(store, &mut [], level, &plan, label)
                        .await
                        .map_err(|error| {
                            format!("{}, {}, round {round}: {error}", store.name, level.name)
                        })?;
                case["round"] = json!(round);
                rounds.push(case);
            }
        }
    }
    drop(cluster);
    let targets = targets(&stores, &cases, &rounds);
    Ok(json!({
        "method": format!(
            "axum on 127.0.0.1:0 in the bench process; orders posted back to back on keep-alive connections (the clients on a thread and runtime of their own); retail orders name {RETAIL_SKUS} random distinct skus of {CATALOGUE}, purchase orders {PURCHASE_SKUS} random distinct ones, hot orders sku {HOT_SKU} alone; keys::json, an exclusive lock a sku, held {} ms (a sleep), each request waiting up to {} s (Wait::up_to, fair), ttl {} s; memory: one store behind one server; one Redis (Redis::url), Redlock over 3 masters, a Redis Cluster of 3 masters without replicas (node timeout {} ms for both) and PostgreSQL (Postgres::url, a server of the bench's own, the lock table truncated before each level): two stores, each behind a server of its own, the clients split between them; each level {} s after a warm-up of {} s of its small orders, on new stores over flushed servers; grants/s = 2xx answers / the load's time; latencies cover every answer; calls/grant = INFO commandstats calls of {} summed over every master (CONFIG RESETSTAT after the warm-up) / grants; CPU ms/grant = INFO cpu used_cpu_user_main_thread + used_cpu_sys_main_thread, after minus before, summed over every master / grants; commands_per_grant and command_usec_per_grant = every command's INFO commandstats calls and usec (the commands a script calls too, also counted in its own), summed over every master / grants; uncontended: the same orders (1, {RETAIL_SKUS} and {PURCHASE_SKUS} skus) one at a time through one store and server, on new stores over flushed servers, first for each store, and then again (half as many, or for half as long) just before each level, of the sizes its grants have (the case's `uncontended`); ÷ uncontended = the level's calls (CPU) / what its grants, each at its size, cost in the uncontended run just before it; the grants/s targets (a store over memory at {MIXED_TARGET}, {HOT_MANY} over {HOT_ONE}): the median over `rounds` rounds of each round's ratio, the first round the section's pass, each later one ({}) the same levels again after the pass, level by level, the stores taking turns (`later_rounds`)",
            WORK.as_millis(),
            WAIT_BOUND.as_secs(),
            TTL.as_secs(),
            NODE_TIMEOUT.as_millis(),
            plan.run.as_secs_f64(),
            plan.warmup.as_secs_f64(),
            LOCK_COMMANDS.join(" + "),
            ROUNDS_LEVELS.join(", "),
        ),
        "catalogue": CATALOGUE,
        "retail_skus": RETAIL_SKUS,
        "purchase_skus": PURCHASE_SKUS,
        "work_ms": WORK.as_millis() as u64,
        "wait_ms": WAIT_BOUND.as_millis() as u64,
        "node_timeout_ms": NODE_TIMEOUT.as_millis() as u64,
        "run_seconds": plan.run.as_secs_f64(),
        "stores": stores.iter().map(|s| s.name).collect::<Vec<_>>(),
        "levels": LEVELS.iter().map(|l| json!({
            "level": l.name,
            "hot": l.small == Small::Hot,
            "clients": l.clients,
            "purchase_clients": l.purchase,
        })).collect::<Vec<_>>(),
        "uncontended": singles,
        "cases": cases,
        "rounds": plan.rounds,
        "round_levels": ROUNDS_LEVELS,
        "later_rounds": rounds,
        "targets": targets.iter().map(Target::to_json).collect::<Vec<_>>(),
    }))
}

#[derive(Deserialize)]
struct Order {
    skus: Vec<u32>,
}

fn app(locks: &Locks) -> Router {
    let skus = keys::json(|order: Order| order.skus.into_iter().map(|sku| format!("sku:{sku}")));
    Router::new().route("/orders", post(work).layer(locks.layer(skus)))
}

async fn work() -> &'static str {
    tokio::time::sleep(WORK).await;
    "ok"
}

fn retail_order() -> String {
    let mut skus = Vec::with_capacity(RETAIL_SKUS);
    while skus.len() < RETAIL_SKUS {
        let sku = fastrand::u32(..CATALOGUE);
        if !skus.contains(&sku) {
            skus.push(sku);
        }
    }
    json!({ "skus": skus }).to_string()
}

fn purchase_order() -> String {
    let mut skus: Vec<u32> = (0..CATALOGUE).collect();
    fastrand::shuffle(&mut skus);
    skus.truncate(PURCHASE_SKUS);
    json!({ "skus": skus }).to_string()
}

fn hot_order() -> String {
    json!({ "skus": [HOT_SKU] }).to_string()
}

/// One axum server per store, in this process.
struct Servers {
    addrs: Vec<SocketAddr>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Servers {
    async fn start(handles: &[Locks]) -> Result<Self, String> {
        let mut servers = Self {
            addrs: Vec::new(),
            stops: Vec::new(),
            tasks: Vec::new(),
        };
        for locks in handles {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|e| e.to_string())?;
            servers
                .addrs
                .push(listener.local_addr().map_err(|e| e.to_string())?);
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let app = app(locks);
            servers.stops.push(stop);
            servers.tasks.push(tokio::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stopped.await;
                    })
                    .await
            }));
        }
        Ok(servers)
    }

    async fn stop(self) -> Result<(), String> {
        for stop in self.stops {
            let _ = stop.send(());
        }
        for task in self.tasks {
            // Every client has hung up by now; a server that still does not stop is stuck.
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .map_err(|_| "a server did not shut down".to_owned())?
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// Which clients a load stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Small,
    Purchase,
}

/// The loads of `level` over `addrs`, each side's clients split between the servers (the
/// first takes the odd one); `purchase`: whether the purchase clients run too.
fn loads(
    level: &Level,
    addrs: &[SocketAddr],
    duration: Duration,
    purchase: bool,
) -> Vec<(Side, SocketAddr, Load)> {
    let sides = [
        (Side::Small, level.clients, level.small.body()),
        (
            Side::Purchase,
            if purchase { level.purchase } else { 0 },
            purchase_order as fn() -> String,
        ),
    ];
    let mut loads = Vec::new();
    for (side, clients, body) in sides {
        for (index, addr) in addrs.iter().enumerate() {
            let share = clients / addrs.len() + usize::from(index < clients % addrs.len());
            if share > 0 {
                let load = Load {
                    path: "/orders".to_owned(),
                    requests: Requests::Json(body),
                    connections: share,
                    duration,
                    max_requests: MAX_REQUESTS,
                };
                loads.push((side, *addr, load));
            }
        }
    }
    loads
}

/// Drives every load at once, on a thread and runtime of their own, as other processes
/// would; the progress line shows the requests answered by all of them.
async fn drive(loads: Vec<(Side, SocketAddr, Load)>) -> Result<Vec<(Side, Outcome)>, String> {
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let answered: Arc<[AtomicU64]> = loads.iter().map(|_| AtomicU64::new(0)).collect();
        runtime.block_on(async {
            let runs: Vec<_> = loads
                .into_iter()
                .enumerate()
                .map(|(index, (side, addr, load))| {
                    let answered = answered.clone();
                    let tick = move |n: u64| {
                        answered[index].store(n, Ordering::Relaxed);
                        progress::tick(answered.iter().map(|a| a.load(Ordering::Relaxed)).sum());
                    };
                    (side, tokio::spawn(load::drive(addr, load, tick)))
                })
                .collect();
            let mut outcomes = Vec::with_capacity(runs.len());
            for (side, run) in runs {
                outcomes.push((side, run.await.map_err(|e| e.to_string())?));
            }
            Ok(outcomes)
        })
    })
    .await
    .map_err(|e| e.to_string())?
}

/// One side's outcomes as one: its loads ran side by side, so its time is the longest.
fn merge(outcomes: &[(Side, Outcome)], side: Side) -> Outcome {
    let mut merged = Outcome::default();
    for (_, outcome) in outcomes.iter().filter(|(s, _)| *s == side) {
        merged.elapsed = merged.elapsed.max(outcome.elapsed);
        merged.latencies.extend(&outcome.latencies);
        merged.errors += outcome.errors;
        for (status, n) in &outcome.statuses {
            *merged.statuses.entry(*status).or_default() += n;
        }
    }
    merged
}

/// A status other than 2xx, 409, 423 and 5xx means the route refuses what the clients
/// send: the figures would mean nothing. A 5xx (a store that did not answer in time) is a
/// result, and is reported.
fn check(outcome: &Outcome) -> Result<(), String> {
    match outcome
        .statuses
        .keys()
        .find(|&&s| (400..500).contains(&s) && s != 409 && s != 423)
    {
        Some(status) => Err(format!("an order got {status}")),
        None => Ok(()),
    }
}

fn count(outcome: &Outcome, statuses: std::ops::RangeInclusive<u16>) -> u64 {
    outcome.statuses.range(statuses).map(|(_, n)| n).sum()
}

/// Redis's work over a run, summed over every master.
#[derive(Debug, Default)]
struct Work {
    /// Calls of [`LOCK_COMMANDS`].
    calls: u64,
    /// Calls of [`SCRIPT_COMMANDS`].
    scripts: u64,
    /// CPU time of the masters' main threads, ms.
    cpu_ms: f64,
    /// Every command's calls, nested ones too (Redis 7 counts the commands a script calls
    /// under their own names as well) and their time (µs, `usec`): where the work goes.
    by_command: BTreeMap<String, (u64, f64)>,
}

/// Resets every master's command statistics, and returns their CPU time so far (s).
async fn reset(stats: &mut [MultiplexedConnection]) -> Result<f64, String> {
    let mut cpu = 0.0;
    for conn in stats {
        reset_stats(conn).await?;
        cpu += main_thread_cpu(conn).await?;
    }
    Ok(cpu)
}

/// The masters' work since [`reset`], which returned `cpu_before`.
async fn work_since(stats: &mut [MultiplexedConnection], cpu_before: f64) -> Result<Work, String> {
    tokio::time::sleep(SETTLE).await;
    let mut work = Work::default();
    let mut cpu = 0.0;
    for conn in stats {
        cpu += main_thread_cpu(conn).await?;
        let commands = command_stats(conn).await?;
        work.calls += sum(&commands, &LOCK_COMMANDS).1;
        work.scripts += sum(&commands, &SCRIPT_COMMANDS).1;
        for (command, fields) in commands {
            if !["info", "config|resetstat"].contains(&command.as_str()) {
                let field = |name| fields.get(name).copied().unwrap_or(0.0);
                let entry = work.by_command.entry(command).or_default();
                entry.0 += field("calls") as u64;
                entry.1 += field("usec");
            }
        }
    }
    work.cpu_ms = (cpu - cpu_before) * 1e3;
    Ok(work)
}

/// A store's orders of one size, one at a time: what a grant costs Redis uncontended.
struct Uncontended {
    skus: usize,
    grants: u64,
    per_second: f64,
    calls_per_grant: f64,
    scripts_per_grant: f64,
    cpu_ms_per_grant: f64,
    by_command: BTreeMap<String, (u64, f64)>,
}

impl Uncontended {
    /// The figures of a store's first uncontended runs, with where the work went.
    fn to_json(&self, store: &str) -> Value {
        let grants = self.grants.max(1) as f64;
        let mut figures = self.brief();
        figures["store"] = json!(store);
        figures["cpu_us_per_key"] = json!(stats::round(
            self.cpu_ms_per_grant * 1e3 / self.skus as f64,
            3
        ));
        figures["commands_per_grant"] = per_command(&self.by_command, grants, |(n, _)| n as f64);
        figures["command_usec_per_grant"] = per_command(&self.by_command, grants, |(_, usec)| usec);
        figures
    }

    /// The figures a level's ratios divide by.
    fn brief(&self) -> Value {
        json!({
            "skus": self.skus,
            "grants": self.grants,
            "grants_per_second": stats::round(self.per_second, 1),
            "calls_per_grant": stats::round(self.calls_per_grant, 3),
            "script_calls_per_grant": stats::round(self.scripts_per_grant, 3),
            "cpu_ms_per_grant": stats::round(self.cpu_ms_per_grant, 4),
        })
    }
}

/// The orders of each of `singles` one at a time, through one store and one server, after
/// a warm-up of five orders or `warmup`; `label` names the run in the progress lines.
async fn uncontended(
    store: &Store,
    stats: &mut [MultiplexedConnection],
    singles: &[Single],
    warmup: Duration,
    label: &str,
) -> Result<Vec<Uncontended>, String> {
    let handles = store.handles().await?;
    let servers = Servers::start(&handles[..1]).await?;
    let addr = servers.addrs[0];
    let mut figures = Vec::new();
    for single in singles {
        progress::begin(
            format!(
                "{label}, uncontended: {}-sku orders one at a time",
                stats::count(single.skus as u64)
            ),
            "requests",
            single.count,
        );
        let load = |count, time| Load {
            path: "/orders".to_owned(),
            requests: Requests::Json(single.body),
            connections: 1,
            duration: time,
            max_requests: count,
        };
        // Connections open and scripts loaded before the measured run.
        drive(vec![(Side::Small, addr, load(5, warmup))]).await?;
        let cpu_before = reset(stats).await?;
        let outcomes = drive(vec![(Side::Small, addr, load(single.count, single.time))]).await?;
        let work = work_since(stats, cpu_before).await?;
        let outcome = merge(&outcomes, Side::Small);
        check(&outcome)?;
        let grants = count(&outcome, 200..=299);
        if grants == 0 || grants != outcome.requests() || outcome.errors > 0 {
            return Err(format!(
                "{}-sku orders one at a time: {grants} of {} granted, {} transport errors",
                single.skus,
                outcome.requests(),
                outcome.errors
            ));
        }
        let per_grant = |total: f64| total / grants as f64;
        let figure = Uncontended {
            skus: single.skus,
            grants,
            per_second: grants as f64 / outcome.elapsed.as_secs_f64(),
            calls_per_grant: per_grant(work.calls as f64),
            scripts_per_grant: per_grant(work.scripts as f64),
            cpu_ms_per_grant: per_grant(work.cpu_ms),
            by_command: work.by_command,
        };
        progress::end(&format!(
            "{:.0} grants/s, {:.2} calls and {:.3} ms of Redis CPU a grant",
            figure.per_second, figure.calls_per_grant, figure.cpu_ms_per_grant
        ));
        figures.push(figure);
    }
    servers.stop().await?;
    Ok(figures)
}

/// One level on one store: on Redis its orders one at a time first (what its ratios divide
/// by), then a warm-up of its small orders, then the level's clients for the run's length.
async fn case(
    store: &Store,
    stats: &mut [MultiplexedConnection],
    level: &Level,
    plan: &Plan,
    label: String,
) -> Result<Value, String> {
    let beside = if stats.is_empty() {
        Vec::new()
    } else {
        uncontended(store, stats, &plan.beside(level), plan.warmup, &label).await?
    };
    let handles = store.handles().await?;
    let servers = Servers::start(&handles).await?;
    progress::begin(label, "requests", MAX_REQUESTS);
    drive(loads(level, &servers.addrs, plan.warmup, false)).await?;
    let cpu_before = reset(stats).await?;
    let outcomes = drive(loads(level, &servers.addrs, plan.run, true)).await?;
    let work = if stats.is_empty() {
        None
    } else {
        Some(work_since(stats, cpu_before).await?)
    };
    servers.stop().await?;

    let (mut small, purchase) = (
        merge(&outcomes, Side::Small),
        merge(&outcomes, Side::Purchase),
    );
    check(&small)?;
    check(&purchase)?;
    small.latencies.sort_unstable();
    let ok = |outcome: &Outcome| count(outcome, 200..=299);
    let per_second = |outcome: &Outcome| {
        (outcome.elapsed > Duration::ZERO)
            .then(|| stats::round(ok(outcome) as f64 / outcome.elapsed.as_secs_f64(), 1))
    };
    let both = |figure: &dyn Fn(&Outcome) -> u64| figure(&small) + figure(&purchase);
    let latency =
        |p: f64| (!small.latencies.is_empty()).then(|| stats::ms(percentile(&small.latencies, p)));
    let mut statuses = BTreeMap::<String, u64>::new();
    for outcome in [&small, &purchase] {
        for (status, n) in &outcome.statuses {
            *statuses.entry(status.to_string()).or_default() += n;
        }
    }
    let redis = work.map(|work| redis_figures(&work, level, ok(&small), ok(&purchase), &beside));
    let case = json!({
        "store": store.name,
        "level": level.name,
        "retail_per_second": per_second(&small),
        "purchase_per_second": per_second(&purchase),
        "retail_ok": ok(&small),
        "purchase_ok": ok(&purchase),
        "conflicts_409_423": both(&|o| count(o, 409..=409) + count(o, 423..=423)),
        "unavailable_5xx": both(&|o| count(o, 500..=599)),
        "transport_errors": both(&|o| o.errors),
        "retail_p50_ms": latency(0.5),
        "retail_p99_ms": latency(0.99),
        "statuses": statuses,
        "redis": redis,
        "uncontended": beside.iter().map(Uncontended::brief).collect::<Vec<_>>(),
    });
    progress::end(&format!(
        "{} retail and {} purchase grants/s, p99 {} ms, {} refused, {} 5xx{}",
        case["retail_per_second"],
        case["purchase_per_second"],
        case["retail_p99_ms"],
        case["conflicts_409_423"],
        case["unavailable_5xx"],
        case["redis"].as_object().map_or(String::new(), |r| format!(
            ", {} calls and {} ms of Redis CPU a grant",
            r["calls_per_grant"], r["cpu_ms_per_grant"]
        )),
    ));
    Ok(case)
}

/// A level's Redis work per grant, and over what its grants would have cost uncontended,
/// each at its own size.
fn redis_figures(
    work: &Work,
    level: &Level,
    small_ok: u64,
    purchase_ok: u64,
    uncontended: &[Uncontended],
) -> Value {
    let grants = (small_ok + purchase_ok) as f64;
    let keys =
        (small_ok as usize * level.small.skus() + purchase_ok as usize * PURCHASE_SKUS) as f64;
    let single = |skus: usize| uncontended.iter().find(|u| u.skus == skus);
    // What `grants` orders of `skus` cost uncontended (nothing for none: a level's side
    // without clients has no uncontended run beside it).
    let cost = |grants: u64, skus: usize, figure: fn(&Uncontended) -> f64| match grants {
        0 => Some(0.0),
        _ => single(skus).map(|u| grants as f64 * figure(u)),
    };
    let expected = |figure: fn(&Uncontended) -> f64| {
        Some(
            cost(small_ok, level.small.skus(), figure)? + cost(purchase_ok, PURCHASE_SKUS, figure)?,
        )
        .filter(|e| *e > 0.0)
    };
    let over = |measured: f64, figure: fn(&Uncontended) -> f64| {
        expected(figure).map(|e| stats::round(measured / e, 3))
    };
    let per = |total: f64, by: f64| (by > 0.0).then(|| total / by);
    json!({
        "calls": work.calls,
        "cpu_ms": stats::round(work.cpu_ms, 3),
        "calls_per_grant": per(work.calls as f64, grants).map(|c| stats::round(c, 3)),
        "script_calls_per_grant": per(work.scripts as f64, grants).map(|c| stats::round(c, 3)),
        "cpu_ms_per_grant": per(work.cpu_ms, grants).map(|c| stats::round(c, 4)),
        "cpu_us_per_key": per(work.cpu_ms * 1e3, keys).map(|c| stats::round(c, 3)),
        "calls_over_uncontended": over(work.calls as f64, |u| u.calls_per_grant),
        "script_calls_over_uncontended": over(work.scripts as f64, |u| u.scripts_per_grant),
        "cpu_over_uncontended": over(work.cpu_ms, |u| u.cpu_ms_per_grant),
        "commands_per_grant": per_command(&work.by_command, grants, |(n, _)| n as f64),
        "command_usec_per_grant": per_command(&work.by_command, grants, |(_, usec)| usec),
    })
}

/// One figure of each command's work (calls, or µs), per grant (none without a grant).
fn per_command(
    by_command: &BTreeMap<String, (u64, f64)>,
    grants: f64,
    figure: fn((u64, f64)) -> f64,
) -> Value {
    by_command
        .iter()
        .map(|(c, work)| {
            let per_grant = (grants > 0.0).then(|| stats::round(figure(*work) / grants, 2));
            (c.clone(), json!(per_grant))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn find<'a>(cases: &'a [Value], store: &str, level: &str) -> Option<&'a Value> {
    cases
        .iter()
        .find(|c| c["store"] == store && c["level"] == level)
}

/// The largest of `field` (under `redis`) over `store`'s cases at `levels`.
fn worst(cases: &[Value], store: &str, levels: &[&str], field: &str) -> Option<f64> {
    levels
        .iter()
        .map(|level| find(cases, store, level)?["redis"][field].as_f64())
        .try_fold(f64::MIN, |worst, ratio| Some(worst.max(ratio?)))
}

/// The median over the rounds of `ratio` of each round's cases (the pass's, then each later
/// round's): `None` if a round lacks a figure.
fn median_over_rounds(
    cases: &[Value],
    rounds: &[Value],
    ratio: impl Fn(&dyn Fn(&str, &str, &str) -> Option<f64>) -> Option<f64>,
) -> Option<f64> {
    let later = rounds.iter().filter_map(|case| case["round"].as_u64());
    let last = later.max().unwrap_or(1);
    let ratios = (1..=last)
        .map(|round| {
            let figure = |store: &str, level: &str, field: &str| {
                let case = if round == 1 {
                    find(cases, store, level)
                } else {
                    rounds
                        .iter()
                        .find(|c| c["round"] == round && c["store"] == store && c["level"] == level)
                };
                case?[field].as_f64()
            };
            ratio(&figure)
        })
        .collect::<Option<Vec<f64>>>()?;
    Some(crate::http::median(ratios))
}

fn targets(stores: &[Store], cases: &[Value], rounds: &[Value]) -> Vec<Target> {
    let mut targets = Vec::new();
    for (store, at_least) in [
        (ONE_REDIS, 0.5),
        (REDLOCK, 0.4),
        (CLUSTER, 0.4),
        (POSTGRES, 0.4),
    ] {
        for (side, field) in [
            ("retail", "retail_per_second"),
            ("purchase", "purchase_per_second"),
        ] {
            let ratio = median_over_rounds(cases, rounds, |figure| {
                Some(figure(store, MIXED_TARGET, field)? / figure(MEMORY, MIXED_TARGET, field)?)
            });
            targets.push(Target::at_least(
                &format!("contention, {MIXED_TARGET}: {side} grants/s, {store} / memory"),
                ratio,
                at_least,
            ));
        }
    }
    for store in stores {
        let ran = LEVELS
            .iter()
            .all(|l| find(cases, store.name, l.name).is_some());
        targets.push(Target::holds(
            &format!("contention, {}: no 5xx at any level", store.name),
            ran && cases
                .iter()
                .chain(rounds)
                .filter(|c| c["store"] == store.name)
                .all(|c| c["unavailable_5xx"].as_u64() == Some(0)),
        ));
    }
    let issues = || LEVELS.iter().filter(|l| l.name != HOT_MOST);
    let names = |hot: bool, purchase: bool| -> Vec<&str> {
        issues()
            .filter(|l| (l.small == Small::Hot) == hot && (l.purchase > 0) == purchase)
            .map(|l| l.name)
            .collect()
    };
    let calls = "calls_over_uncontended";
    targets.extend([
        Target::at_most(
            &format!("contention, {ONE_REDIS}, {RETAIL_ALONE}: lock calls (scripts + SET) per grant / uncontended"),
            worst(cases, ONE_REDIS, &[RETAIL_ALONE], calls),
            1.5,
        ),
        Target::at_most(
            &format!("contention, {ONE_REDIS}, hot sku (worst level to 64 clients): lock calls (scripts + SET) per grant / uncontended"),
            worst(cases, ONE_REDIS, &names(true, false), calls),
            3.0,
        ),
        Target::at_most(
            &format!("contention, {ONE_REDIS}, retail + purchase (worst level): lock calls (scripts + SET) per grant / uncontended"),
            worst(cases, ONE_REDIS, &names(false, true), calls),
            4.0,
        ),
    ]);
    let every: Vec<&str> = issues().map(|l| l.name).collect();
    for store in [ONE_REDIS, REDLOCK, CLUSTER] {
        targets.push(Target::at_most(
            &format!("contention, {store} (worst level to 64 clients): Redis CPU per granted key / uncontended"),
            worst(cases, store, &every, "cpu_over_uncontended"),
            2.0,
        ));
    }
    for store in stores {
        let name = store.name;
        targets.push(Target::at_least(
            &format!("contention, {name}: hot sku grants/s, 64 clients / 1 client"),
            median_over_rounds(cases, rounds, |figure| {
                let grants = |level| figure(name, level, "retail_per_second");
                Some(grants(HOT_MANY)? / grants(HOT_ONE)?)
            }),
            0.9,
        ));
    }
    targets
}
