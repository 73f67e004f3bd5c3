//! Cost of one uncontended acquire + release of a batch of n keys on one local Redis: the
//! crate through its public API, four ways peers do it, and Redis's own time for the crate's
//! commands (the floor).
//!
//! - `tower-batch-lock`: a tower service behind `locks.layer(extractor)`, called with
//!   `oneshot`; the extractor, a closure over the request head, names the n keys. Below 64
//!   keys one `FCALL` acquires the batch; from 64 keys a pipeline of plain `SET PX NX` takes
//!   its free keys and one `FCALL` counts the grant. One `FCALL` a thousand keys releases
//!   it, and the response waits for the release.
//! - `pipelined SETNX`: round trip 1, a pipeline of n `SETNX key token`; round trip 2, a
//!   pipeline of n `EXPIRE key 30`; release, one `DEL` of all n keys. (Not even safe: a
//!   crash between the two round trips leaves keys that never expire, and the release
//!   deletes keys whoever holds them.)
//! - `naive SET NX PX`: n sequential `SET key token NX PX 30000` round trips, and n
//!   sequential `DEL key` round trips to release: a lock per resource, taken one by one.
//! - `node-redlock's scripts` and `redislock's ObtainMulti`: the batch algorithms of two
//!   libraries in other languages (node-redlock 5 without retries, bsm/redislock for Go), each
//!   an acquire script and a release script over the whole batch (`bench/scripts/`, written
//!   for this bench from the libraries' descriptions), loaded with `SCRIPT LOAD` and run with
//!   `EVALSHA` by this bench's client (the crate's store calls its own as functions, with
//!   `FCALL`, on the same connection type): the same client,
//!   Redis and run for all, so that only the algorithms differ. redislock's scripts `unpack`
//!   the whole batch, which Lua refuses near 8,000 values: above about 4,000 keys they fail,
//!   and the case records the error.
//! - `pipelined SET NX PX, checked MGET + DEL in Lua`: the minimal safe batch, the crate's
//!   algorithm with nothing but its locking: a pipeline of one plain `SET key token PX ttl
//!   NX` a key (the cheapest way Redis 7 has to take a key with a TTL), and a release script
//!   that reads the values with one `MGET` and deletes the keys holding the owner's value
//!   with one `DEL` (a thousand keys a command). No re-entry, reservations, fencing token or
//!   release message: what any batch whose keys expire on their own and whose release
//!   checks its owner must at least do, node-redlock's and the crate's alike.
//! - Redis's time: `CONFIG RESETSTAT` before each case's measured rounds, then the `usec`
//!   of its commands in `INFO commandstats` (the crate's: `fcall` and `set`), divided by the
//!   rounds; and Redis's CPU time (`INFO cpu`, its main thread, before and after), which
//!   also counts reading and parsing commands and writing replies, where commandstats
//!   counts only running them: for plain commands, one per key, that is most of their
//!   cost. The crate's CPU time is the `floor`: no client can beat it.
//! - `longest call`: at 3,000 keys and more, a few more cycles of the crate and of the
//!   pipelined baseline with Redis's SLOWLOG on: the longest single script, or `DEL`, during
//!   which Redis serves no one else.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    sync::{Arc, LazyLock},
    time::{Duration, Instant},
};
use tower_batch_lock::store::Redis;

use axum::body::Body;
use deadpool_redis::Pool;
use http::{request::Parts, Request, Response, StatusCode};
use redis::{aio::MultiplexedConnection, Script};
use serde_json::{json, Value};
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_batch_lock::Locks;

use crate::{
    progress,
    redis_info::{command_stats, main_thread_cpu, redis_error, reset_stats, sum},
    stats::{self, count, human, Budget, Summary},
    target::Target,
};

/// The batch sizes the issue asks for.
pub(crate) const SIZES: [usize; 7] = [1, 10, 100, 1_000, 3_000, 10_000, 100_000];

pub(crate) const CRATE: &str = "tower-batch-lock";
pub(crate) const PIPELINED: &str = "pipelined SETNX + EXPIRE";
pub(crate) const NAIVE: &str = "naive SET NX PX loop";
pub(crate) const NODE_REDLOCK: &str = "node-redlock's scripts";
pub(crate) const REDISLOCK: &str = "redislock's ObtainMulti";
pub(crate) const MINIMAL: &str = "pipelined SET NX PX, checked MGET + DEL in Lua";
pub(crate) const FLOOR: &str = "floor: Redis's CPU time for our commands";

const TTL: Duration = Duration::from_secs(30);

/// The sizes at which the longest single call is measured: where one call takes long
/// enough to keep other clients waiting.
const LONGEST_SIZES: [usize; 3] = [3_000, 10_000, 100_000];
/// The cycles run with the SLOWLOG on, after the measured rounds.
const LONGEST_CYCLES: u64 = 3;

/// A peer's two scripts over the whole batch.
struct PeerScripts {
    acquire: Script,
    release: Script,
}

static NODE_REDLOCK_SCRIPTS: LazyLock<PeerScripts> = LazyLock::new(|| PeerScripts {
    acquire: Script::new(include_str!("../scripts/node-redlock-acquire.lua")),
    release: Script::new(include_str!("../scripts/node-redlock-release.lua")),
});

/// The minimal safe batch's release; it takes its keys with plain `SET`s.
static MINIMAL_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/minimal-release.lua")));

static REDISLOCK_SCRIPTS: LazyLock<PeerScripts> = LazyLock::new(|| PeerScripts {
    acquire: Script::new(include_str!("../scripts/redislock-obtain.lua")),
    release: Script::new(include_str!("../scripts/redislock-release.lua")),
});

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Algorithm {
    Crate,
    Pipelined,
    NodeRedlock,
    Redislock,
    Minimal,
    Naive,
}

impl Algorithm {
    fn name(self) -> &'static str {
        match self {
            Self::Crate => CRATE,
            Self::Pipelined => PIPELINED,
            Self::NodeRedlock => NODE_REDLOCK,
            Self::Redislock => REDISLOCK,
            Self::Minimal => MINIMAL,
            Self::Naive => NAIVE,
        }
    }

    fn scripts(self) -> Option<&'static PeerScripts> {
        match self {
            Self::NodeRedlock => Some(&NODE_REDLOCK_SCRIPTS),
            Self::Redislock => Some(&REDISLOCK_SCRIPTS),
            _ => None,
        }
    }

    /// The commands whose server time is this algorithm's. Redis 7 also counts the
    /// commands a script calls under their own names, so the scripted algorithms' are
    /// `fcall` (the crate's functions), or `evalsha` and `eval`, alone; the crate's also
    /// `set`, for the plain `SET`s that take a big batch's free keys (which also counts
    /// the `SET`s its scripts call, once more: against the crate).
    fn commands(self) -> &'static [&'static str] {
        match self {
            Self::Crate => &["fcall", "set"],
            Self::NodeRedlock | Self::Redislock => &["evalsha", "eval"],
            Self::Minimal => &["set", "evalsha", "eval"],
            Self::Pipelined => &["setnx", "expire", "del"],
            Self::Naive => &["set", "del"],
        }
    }

    /// The command whose single calls keep Redis busy longest in a cycle, for the SLOWLOG;
    /// none for the naive loop, whose every command names one key.
    fn longest_command(self) -> Option<&'static str> {
        match self {
            Self::Crate => Some("fcall"),
            Self::NodeRedlock | Self::Redislock => Some("evalsha"),
            Self::Pipelined => Some("del"),
            // A bound on the others, not a library: its calls are not compared.
            Self::Minimal | Self::Naive => None,
        }
    }

    /// Which call of a cycle a SLOWLOG entry's arguments are, if it is one of those
    /// [`Self::longest_command`] reports.
    fn call_kind(self, args: &[String]) -> Option<&'static str> {
        let command = args.first()?.to_ascii_lowercase();
        match self {
            // The crate's scripts take a big batch in steps (`Redis::step_keys`), each a
            // call of its own: their function's names tell them apart.
            Self::Crate if command == "fcall" => crate::http::crate_call(args.get(1)?),
            Self::Pipelined if command == "del" => Some("DEL"),
            // A peer's two scripts both name the batch alone: their hashes tell them apart.
            Self::NodeRedlock | Self::Redislock if command == "evalsha" => {
                let (scripts, sha) = (self.scripts()?, args.get(1)?);
                if *sha == scripts.acquire.get_hash() {
                    Some("acquire")
                } else if *sha == scripts.release.get_hash() {
                    Some("release")
                } else {
                    None
                }
            }
            _ => None,
        }
    }

    fn budget(self, keys: usize, quick: bool) -> Budget {
        let time = if quick {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(3)
        };
        match self {
            // 2 n round trips a cycle: the 100,000-key cycle alone takes seconds.
            Self::Naive if keys >= 100_000 => Budget {
                min: 1,
                max: 1,
                time,
            },
            Self::Naive if keys >= 10_000 => Budget {
                min: 1,
                max: 3,
                time,
            },
            _ => Budget {
                min: 3,
                max: 5_000,
                time,
            },
        }
    }

    fn warmup(self, keys: usize) -> u64 {
        match (self, keys) {
            (Self::Naive, 10_000..) => 0,
            (_, ..=100) => 50,
            (_, ..=3_000) => 3,
            _ => 1,
        }
    }
}

/// Runs every size with every algorithm, smallest first.
pub(crate) async fn run(pool: &Pool, quick: bool) -> Result<Value, String> {
    let algorithms = [
        Algorithm::Crate,
        Algorithm::Pipelined,
        Algorithm::NodeRedlock,
        Algorithm::Redislock,
        Algorithm::Minimal,
        Algorithm::Naive,
    ];
    let total = SIZES.len() * algorithms.len();
    let mut cases = Vec::new();
    let mut index = 0;
    for keys in SIZES {
        for algorithm in algorithms {
            index += 1;
            if quick && algorithm == Algorithm::Naive && keys >= 100_000 {
                continue;
            }
            let label = format!(
                "batch {index}/{total} {}, {} keys",
                algorithm.name(),
                count(keys as u64)
            );
            let budget = algorithm.budget(keys, quick);
            progress::begin(label, "rounds", budget.max);
            let case = match measure(pool, algorithm, keys, budget).await {
                Ok(case) => case,
                Err(error) => {
                    progress::end(&format!("FAILED: {error}"));
                    cases.push(json!({
                        "algorithm": algorithm.name(),
                        "keys": keys,
                        "error": error,
                    }));
                    continue;
                }
            };
            progress::end(&format!(
                "median {} a cycle, {:.2} µs a key, {} rounds",
                human(case.summary.median),
                per_key_us(case.summary.median, keys),
                case.summary.rounds
            ));
            cases.push(case.to_json(algorithm, keys));
        }
    }
    let targets = targets(&cases);
    let (node_redlock, redislock) = (over(&cases, NODE_REDLOCK), over(&cases, REDISLOCK));
    let minimal = over(&cases, MINIMAL);
    let minimal_over_node_redlock = find(&cases, MINIMAL, 3_000)
        .zip(find(&cases, NODE_REDLOCK, 3_000))
        .map(|((cycle, time), (their_cycle, their_time))| (cycle / their_cycle, time / their_time));
    let minimal_cpu_over_node_redlock = cpu(&cases, MINIMAL)
        .zip(cpu(&cases, NODE_REDLOCK))
        .map(|(cpu, theirs)| cpu / theirs);
    Ok(json!({
        "method": {
            CRATE: "a tower service behind Locks::new(Redis::pool(pool).build().unwrap()).max_keys(100_000).store_timeout(30 s).layer(closure naming n keys), called with oneshot; a batch of fewer than 64 keys: one FCALL acquires; of 64 or more: a pipeline of SET key value PX ttl NX GET takes the free keys, then one FCALL counts the grant (and takes the keys that were not free, in steps of 1,000); one FCALL a 1,000 keys releases; the response waits for the release; the pool's response timeout is 30 s (redis-rs's default, 500 ms, is shorter than one 100,000-key script)",
            PIPELINED: "pipeline of n SETNX, then a pipeline of n EXPIRE, then one DEL of all n keys, on one multiplexed connection shared by the case's cycles",
            NAIVE: "n sequential SET key token NX PX 30000 round trips, then n sequential DEL round trips, on one multiplexed connection shared by the case's cycles",
            NODE_REDLOCK: "node-redlock 5's batch algorithm, retryCount 0: acquire, one EVALSHA over the n keys (EXISTS of every key, 0 if any exists, else SET key value PX 30000 for each); release, one EVALSHA (GET of each key, DEL where it holds the value); scripts in bench/scripts/, loaded with SCRIPT LOAD when the case starts, run on one multiplexed connection shared by the case's cycles",
            REDISLOCK: "bsm/redislock's ObtainMulti: acquire, one EVALSHA over the n keys (one MSETNX of every key to the token through unpack of 2n values, then PEXPIRE 30000 of each key); release, one EVALSHA (one MGET of the batch through unpack, then, every key holding the token, one DEL of the batch); loaded and run as node-redlock's; the scripts fail where Lua's unpack does (near 8,000 values: batches above about 4,000 keys), and those cases record the error instead of a time; redislock's re-entry path, taken when MSETNX refuses, is left out (an uncontended batch never takes it)",
            MINIMAL: "the minimal safe batch: acquire, one pipeline of SET key token PX 30000 NX for each key; release, one EVALSHA of MGET of the keys and DEL of those holding the owner's value, a thousand keys a command (bench/scripts/minimal-release.lua, loaded with SCRIPT LOAD when the case starts); on one multiplexed connection shared by the case's cycles; no re-entry, reservations, fencing or release message: what a batch whose keys expire on their own and whose release checks its owner must at least do, and so a bound on the cycle and the Redis time that the crate and the peers' scripts can reach",
            FLOOR: "server_cpu_ms of the crate's cycles (see there): the time Redis's main thread spends on our commands, which no client can beat; \"3,000 keys: crate / floor\" is the crate's median cycle over it",
            "server_ms": "CONFIG RESETSTAT, then INFO commandstats usec of fcall (the crate's functions) and set (the plain SETs that take a big batch's free keys; Redis also counts there the SETs the scripts call, counted twice, against the crate) over the crate's measured cycles, divided by the cycles; server_ms of the baselines: the same for their own commands (the peers': evalsha + eval)",
            "server_cpu_ms": "INFO cpu, used_cpu_user_main_thread + used_cpu_sys_main_thread, after the measured rounds minus before, divided by the rounds: Redis's CPU time per cycle on the thread that runs the commands, with reading, parsing and replies, which commandstats leaves out (and with the event loop's own upkeep meanwhile)",
            "longest_call_us": "at 3,000 keys and more, after the measured rounds, longest_call_cycles more cycles of the crate, the pipelined baseline and the peers' scripts, each after SLOWLOG RESET and followed by SLOWLOG GET 128, with slowlog-log-slower-than a tenth of the mean time of one script call (fcall for the crate, evalsha for the peers, del for the pipelined baseline) in the measured rounds (restored afterwards): the largest duration of each call, the crate's and the peers' acquire and release scripts (told apart by their function names or hashes; the crate's take a batch of more than 1,000 keys in steps, a call each) and the baseline's DEL. Not 0: Redis 7 logs the commands a script calls too, which slows the scripts down and pushes their own entries out of the log",
            "pool_pings_per_cycle": "INFO commandstats calls of ping per cycle: deadpool-redis checks a connection with UNWATCH + PING, one round trip, each time the pool hands it out; the baselines take one multiplexed connection out of the pool per case and share it",
        },
        "ttl_ms": TTL.as_millis() as u64,
        "longest_call_cycles": LONGEST_CYCLES,
        "sizes": SIZES,
        "cases": cases,
        "ratios_at_3000_keys": {
            "cycle_crate_over_node_redlock": node_redlock.0.map(|r| stats::round(r, 3)),
            "redis_time_crate_over_node_redlock": node_redlock.1.map(|r| stats::round(r, 3)),
            "cycle_crate_over_redislock": redislock.0.map(|r| stats::round(r, 3)),
            "redis_time_crate_over_redislock": redislock.1.map(|r| stats::round(r, 3)),
            "redis_time_crate_over_minimal": minimal.1.map(|r| stats::round(r, 3)),
            "cycle_crate_over_minimal": minimal.0.map(|r| stats::round(r, 3)),
            "redis_cpu_crate_over_node_redlock": cpu_over(&cases, NODE_REDLOCK).map(|r| stats::round(r, 3)),
            "redis_cpu_crate_over_minimal": cpu_over(&cases, MINIMAL).map(|r| stats::round(r, 3)),
            "cycle_minimal_over_node_redlock": minimal_over_node_redlock.map(|r| stats::round(r.0, 3)),
            "redis_time_minimal_over_node_redlock": minimal_over_node_redlock.map(|r| stats::round(r.1, 3)),
            "redis_cpu_minimal_over_node_redlock": minimal_cpu_over_node_redlock.map(|r| stats::round(r, 3)),
        },
        "targets": targets.iter().map(Target::to_json).collect::<Vec<_>>(),
    }))
}

struct Case {
    summary: Summary,
    /// Redis's time per cycle for this algorithm's commands, from `INFO commandstats`.
    server: Duration,
    /// Calls per cycle of those commands.
    server_calls: f64,
    /// Redis's CPU time per cycle (`INFO cpu`, main thread): parsing and replies included,
    /// which `INFO commandstats` leaves out.
    cpu: Duration,
    /// The pool's connection checks per cycle, each a round trip of its own.
    pings: f64,
    /// The longest single call of each kind, in microseconds, where measured.
    longest: BTreeMap<&'static str, u64>,
}

impl Case {
    fn to_json(&self, algorithm: Algorithm, keys: usize) -> Value {
        let mut case = json!({
            "algorithm": algorithm.name(),
            "keys": keys,
            "per_key_us": per_key_us(self.summary.median, keys),
            "server_ms": stats::ms(self.server),
            "server_per_key_us": per_key_us(self.server, keys),
            "server_calls_per_cycle": stats::round(self.server_calls, 2),
            "server_cpu_ms": stats::ms(self.cpu),
            "server_cpu_per_key_us": per_key_us(self.cpu, keys),
            "pool_pings_per_cycle": stats::round(self.pings, 2),
        });
        if !self.longest.is_empty() {
            merge(&mut case, json!({ "longest_call_us": self.longest }));
        }
        merge(&mut case, self.summary.to_json());
        case
    }
}

fn per_key_us(duration: Duration, keys: usize) -> f64 {
    stats::round(duration.as_secs_f64() * 1e6 / keys as f64, 4)
}

fn merge(into: &mut Value, from: Value) {
    if let (Value::Object(into), Value::Object(from)) = (into, from) {
        into.extend(from);
    }
}

async fn measure(
    pool: &Pool,
    algorithm: Algorithm,
    keys: usize,
    budget: Budget,
) -> Result<Case, String> {
    let cycle = Cycle::new(pool, algorithm, keys).await?;
    for _ in 0..algorithm.warmup(keys) {
        cycle.run().await?;
    }
    // Held out of the pool for the whole case, so that its own checkouts (which ping) do
    // not count among the cycles'.
    let mut stats_conn = pool.get().await.map_err(|e| e.to_string())?;
    reset_stats(&mut stats_conn).await?;
    let cpu_before = main_thread_cpu(&mut stats_conn).await?;
    let samples = stats::rounds(budget, |_| cycle.run()).await?;
    let cpu = main_thread_cpu(&mut stats_conn).await? - cpu_before;
    let stats = command_stats(&mut stats_conn).await?;
    let (usec, calls) = sum(&stats, algorithm.commands());
    // deadpool-redis pings a pooled connection (UNWATCH + PING, one round trip) each time it
    // hands it out again: count those round trips too.
    let (_, pings) = sum(&stats, &["ping"]);
    let longest = match algorithm.longest_command() {
        Some(command) if LONGEST_SIZES.contains(&keys) => {
            let (usec, calls) = sum(&stats, &[command]);
            let threshold = (usec / calls.max(1) / 10).max(1);
            longest_calls(&cycle, &mut stats_conn, threshold).await?
        }
        _ => BTreeMap::new(),
    };
    drop(stats_conn);
    check_clean(pool).await?;
    let rounds = samples.len() as f64;
    Ok(Case {
        summary: Summary::of(samples),
        server: Duration::from_secs_f64(usec as f64 / 1e6 / rounds),
        server_calls: calls as f64 / rounds,
        cpu: Duration::from_secs_f64(cpu / rounds),
        pings: pings as f64 / rounds,
        longest,
    })
}

/// A SLOWLOG entry: id, start (Unix seconds), duration (µs), arguments (at most 32, each
/// cut at 128 bytes), client address, client name.
type SlowlogEntry = (u64, u64, u64, Vec<String>, String, String);

/// The longest single call of each kind over [`LONGEST_CYCLES`] more cycles, in µs, from
/// Redis's SLOWLOG, logging calls of at least `threshold_us`. Not 0: Redis 7 logs every
/// command a script calls too, which slows the script down by about a quarter and pushes
/// its own entry out of the 128 entries the log keeps by default.
async fn longest_calls(
    cycle: &Cycle,
    conn: &mut deadpool_redis::Connection,
    threshold_us: u64,
) -> Result<BTreeMap<&'static str, u64>, String> {
    let (_, before): (String, i64) = redis::cmd("CONFIG")
        .arg("GET")
        .arg("slowlog-log-slower-than")
        .query_async(conn)
        .await
        .map_err(redis_error)?;
    set_slowlog_threshold(conn, threshold_us as i64).await?;
    let longest = slowlog_cycles(cycle, conn).await;
    // Restored even when a cycle failed: the server outlives the case.
    set_slowlog_threshold(conn, before).await?;
    longest
}

async fn set_slowlog_threshold(
    conn: &mut deadpool_redis::Connection,
    micros: i64,
) -> Result<(), String> {
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(micros)
        .query_async(conn)
        .await
        .map_err(redis_error)
}

/// Each cycle's log is read on its own, before the next cycle's calls can push it out.
async fn slowlog_cycles(
    cycle: &Cycle,
    conn: &mut deadpool_redis::Connection,
) -> Result<BTreeMap<&'static str, u64>, String> {
    let mut longest = BTreeMap::new();
    for _ in 0..LONGEST_CYCLES {
        redis::cmd("SLOWLOG")
            .arg("RESET")
            .query_async::<()>(conn)
            .await
            .map_err(redis_error)?;
        cycle.run().await?;
        let entries: Vec<SlowlogEntry> = redis::cmd("SLOWLOG")
            .arg("GET")
            .arg(128)
            .query_async(conn)
            .await
            .map_err(redis_error)?;
        for (_, _, micros, args, _, _) in entries {
            if let Some(kind) = cycle.algorithm.call_kind(&args) {
                let max = longest.entry(kind).or_insert(0);
                *max = micros.max(*max);
            }
        }
    }
    Ok(longest)
}

/// One acquire + release cycle of one algorithm, set up once per case.
struct Cycle {
    algorithm: Algorithm,
    /// The baselines' connection: one multiplexed connection taken out of the pool once, as
    /// the crate's Redis store does, so that no cycle pays for a checkout.
    conn: MultiplexedConnection,
    /// The keys as stored, for the baselines.
    stored: Arc<[String]>,
    /// The crate's service, for [`Algorithm::Crate`].
    service: Option<BatchService>,
}

pub(crate) type BatchService =
    tower::util::BoxCloneSyncService<Request<Body>, Response<Body>, Infallible>;

/// A service that locks `names` through `locks.layer(..)`, as users write it, around a
/// handler that does nothing.
pub(crate) fn layered(locks: &Locks, names: Arc<[String]>) -> BatchService {
    let extractor = move |_: &Parts| Ok::<_, Infallible>(names.to_vec());
    let service = ServiceBuilder::new()
        .layer(locks.layer(extractor))
        .service(service_fn(|_: Request<Body>| async {
            Ok::<_, Infallible>(Response::new(Body::empty()))
        }))
        .map_response(|response| response.map(Body::new));
    tower::util::BoxCloneSyncService::new(service)
}

/// One request through `service`: lock, run the handler, release.
pub(crate) async fn call(service: BatchService) -> Result<(), String> {
    let response = service
        .oneshot(Request::new(Body::empty()))
        .await
        .unwrap_or_else(|never| match never {});
    if response.status() == StatusCode::OK {
        return Ok(());
    }
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    Err(format!(
        "the layer answered {status}: {}",
        String::from_utf8_lossy(&body)
    ))
}

impl Cycle {
    async fn new(pool: &Pool, algorithm: Algorithm, keys: usize) -> Result<Self, String> {
        let names: Arc<[String]> = (0..keys).map(|i| format!("bench:{i:06}")).collect();
        // The crate stores `lock:` + name; the baselines store the very same keys.
        let stored = names.iter().map(|name| format!("lock:{name}")).collect();
        let service = (algorithm == Algorithm::Crate).then(|| {
            // A 100,000-key script runs for most of a second: more than the default 2 s
            // `backend_timeout` leaves room for on a busy 2-core machine.
            let locks = Locks::new(Redis::pool(pool.clone()).build().unwrap())
                .ttl(TTL)
                .max_keys(100_000)
                .store_timeout(Duration::from_secs(30));
            layered(&locks, names)
        });
        let pooled = pool.get().await.map_err(|e| e.to_string())?;
        let mut conn = deadpool_redis::Connection::take(pooled);
        if let Some(scripts) = algorithm.scripts() {
            for script in [&scripts.acquire, &scripts.release] {
                script.load_async(&mut conn).await.map_err(redis_error)?;
            }
        }
        if algorithm == Algorithm::Minimal {
            MINIMAL_RELEASE
                .load_async(&mut conn)
                .await
                .map_err(redis_error)?;
        }
        Ok(Self {
            algorithm,
            conn,
            stored,
            service,
        })
    }

    async fn run(&self) -> Result<Duration, String> {
        let started = Instant::now();
        match self.algorithm {
            Algorithm::Crate => self.through_layer().await?,
            Algorithm::Pipelined => self.pipelined().await?,
            Algorithm::NodeRedlock | Algorithm::Redislock => self.scripted().await?,
            Algorithm::Minimal => self.minimal().await?,
            Algorithm::Naive => self.naive().await?,
        }
        Ok(started.elapsed())
    }

    async fn through_layer(&self) -> Result<(), String> {
        let service = self
            .service
            .clone()
            .expect("the crate's case has a service");
        call(service).await
    }

    async fn pipelined(&self) -> Result<(), String> {
        let mut conn = self.conn.clone();
        let token = token();
        let mut setnx = redis::pipe();
        for key in self.stored.iter() {
            setnx.cmd("SETNX").arg(key).arg(&token);
        }
        let set: Vec<bool> = setnx.query_async(&mut conn).await.map_err(redis_error)?;
        if set.iter().any(|set| !set) {
            return Err("an uncontended SETNX found its key taken".to_owned());
        }
        let mut expire = redis::pipe();
        for key in self.stored.iter() {
            expire.cmd("EXPIRE").arg(key).arg(TTL.as_secs()).ignore();
        }
        let () = expire.query_async(&mut conn).await.map_err(redis_error)?;
        let deleted: usize = redis::cmd("DEL")
            .arg(&*self.stored)
            .query_async(&mut conn)
            .await
            .map_err(redis_error)?;
        if deleted != self.stored.len() {
            return Err(format!("DEL deleted {deleted} of {}", self.stored.len()));
        }
        Ok(())
    }

    /// A peer's cycle: its acquire script over the batch, then its release script, each
    /// answering how many keys it took or freed.
    async fn scripted(&self) -> Result<(), String> {
        let scripts = self
            .algorithm
            .scripts()
            .expect("a peer's case has its scripts");
        let mut conn = self.conn.clone();
        let token = token();
        let n = self.stored.len();
        let taken: usize = scripts
            .acquire
            .key(&*self.stored)
            .arg(&token)
            .arg(TTL.as_millis() as u64)
            .invoke_async(&mut conn)
            .await
            .map_err(redis_error)?;
        if taken != n {
            return Err(format!("an uncontended acquire took {taken} of {n} keys"));
        }
        self.release(&scripts.release, &mut conn, &token).await
    }

    /// The minimal safe batch: a pipeline of `SET NX PX`, then the checked release script.
    async fn minimal(&self) -> Result<(), String> {
        let mut conn = self.conn.clone();
        let token = token();
        let mut set = redis::pipe();
        for key in self.stored.iter() {
            set.cmd("SET")
                .arg(key)
                .arg(&token)
                .arg("PX")
                .arg(TTL.as_millis() as u64)
                .arg("NX");
        }
        let set: Vec<Option<String>> = set.query_async(&mut conn).await.map_err(redis_error)?;
        if set.iter().any(Option::is_none) {
            return Err("an uncontended SET NX found its key taken".to_owned());
        }
        self.release(&MINIMAL_RELEASE, &mut conn, &token).await
    }

    /// A release script over the batch, which answers how many keys it freed: all of them.
    async fn release(
        &self,
        script: &Script,
        conn: &mut MultiplexedConnection,
        token: &str,
    ) -> Result<(), String> {
        let n = self.stored.len();
        let released: usize = script
            .key(&*self.stored)
            .arg(token)
            .invoke_async(conn)
            .await
            .map_err(redis_error)?;
        if released != n {
            return Err(format!("the release freed {released} of {n} keys"));
        }
        Ok(())
    }

    async fn naive(&self) -> Result<(), String> {
        let mut conn = self.conn.clone();
        let token = token();
        let ttl = TTL.as_millis() as u64;
        let n = self.stored.len() as u64;
        for (i, key) in self.stored.iter().enumerate() {
            let set: Option<String> = redis::cmd("SET")
                .arg(key)
                .arg(&token)
                .arg("NX")
                .arg("PX")
                .arg(ttl)
                .query_async(&mut conn)
                .await
                .map_err(redis_error)?;
            if set.is_none() {
                return Err("an uncontended SET NX found its key taken".to_owned());
            }
            if i % 1_000 == 999 {
                progress::within(i as u64 + 1, 2 * n, "round trips");
            }
        }
        for (i, key) in self.stored.iter().enumerate() {
            let _: usize = redis::cmd("DEL")
                .arg(key)
                .query_async(&mut conn)
                .await
                .map_err(redis_error)?;
            if i % 1_000 == 999 {
                progress::within(n + i as u64 + 1, 2 * n, "round trips");
            }
        }
        Ok(())
    }
}

/// An owner token like the crate's: 128 random bits from the OS, as 32 hex digits.
fn token() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Every cycle released what it took: only the fencing counter may be left.
async fn check_clean(pool: &Pool) -> Result<(), String> {
    let mut conn = pool.get().await.map_err(|e| e.to_string())?;
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("lock:bench:*")
        .query_async(&mut conn)
        .await
        .map_err(redis_error)?;
    if left.is_empty() {
        Ok(())
    } else {
        Err(format!("{} keys were left locked", left.len()))
    }
}

/// The median of `algorithm` at `keys`, and its server time, from the cases' JSON.
fn find(cases: &[Value], algorithm: &str, keys: usize) -> Option<(f64, f64)> {
    let case = cases
        .iter()
        .find(|c| c["algorithm"] == algorithm && c["keys"] == keys)?;
    Some((case["median_ms"].as_f64()?, case["server_ms"].as_f64()?))
}

/// Redis's CPU time per cycle of `algorithm` at 3,000 keys (ms).
fn cpu(cases: &[Value], algorithm: &str) -> Option<f64> {
    cases
        .iter()
        .find(|c| c["algorithm"] == algorithm && c["keys"] == 3_000)?["server_cpu_ms"]
        .as_f64()
}

/// Redis's CPU time per cycle, ours over `theirs`, at 3,000 keys.
fn cpu_over(cases: &[Value], theirs: &str) -> Option<f64> {
    Some(cpu(cases, CRATE)? / cpu(cases, theirs)?)
}

/// Ours over `theirs` at 3,000 keys: the cycle's median, and Redis's time per cycle.
fn over(cases: &[Value], theirs: &str) -> (Option<f64>, Option<f64>) {
    find(cases, CRATE, 3_000)
        .zip(find(cases, theirs, 3_000))
        .map(|((ours, our_server), (theirs, their_server))| {
            (ours / theirs, our_server / their_server)
        })
        .unzip()
}

fn targets(cases: &[Value]) -> Vec<Target> {
    let crate_3k = find(cases, CRATE, 3_000);
    let node_redlock = over(cases, NODE_REDLOCK);
    let crate_1k = find(cases, CRATE, 1_000);
    let crate_100k = find(cases, CRATE, 100_000);
    vec![
        Target::at_most(
            "3,000 keys: crate / floor",
            crate_3k
                .zip(cpu(cases, CRATE))
                .map(|((median, _), floor)| median / floor),
            1.5,
        ),
        Target::at_most(
            "3,000-key cycle: crate / pipelined SETNX+EXPIRE baseline",
            over(cases, PIPELINED).0,
            1.0,
        ),
        Target::at_most(
            "3,000-key cycle: crate / node-redlock's scripts",
            node_redlock.0,
            0.7,
        ),
        Target::at_most(
            "Redis time per 3,000-key cycle: crate / node-redlock's",
            node_redlock.1,
            0.6,
        ),
        Target::at_most(
            "Redis CPU time per 3,000-key cycle (INFO cpu): crate / node-redlock's",
            cpu_over(cases, NODE_REDLOCK),
            0.6,
        ),
        Target::holds(
            "100,000 keys in one batch without error",
            crate_100k.is_some(),
        ),
        Target::at_most(
            "cost per key, 100,000 vs 1,000 keys (larger / smaller)",
            crate_1k.zip(crate_100k).map(|((small, _), (large, _))| {
                let (small, large) = (small / 1e3, large / 1e5);
                small.max(large) / small.min(large)
            }),
            2.0,
        ),
    ]
}
