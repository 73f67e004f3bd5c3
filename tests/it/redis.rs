//! The Redis store, driven through the layer the way users drive it: an axum `Router`
//! called with `oneshot` (or served over a real TCP listener), against real `redis-server`
//! processes started by `support` on free loopback ports.
//!
//! Every test starts its own server, uses short TTLs, and bounds every wait.

use std::{
    collections::BTreeSet,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};
use tower_batch_lock::store::Redis;

use axum::{
    body::Body,
    routing::{post, put},
    Extension, Router,
};
use http::{Request, StatusCode};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    sync::Barrier,
};
use tower::{Service, ServiceExt};
use tower_batch_lock::{keys, Lease, Locks, Wait};

use crate::support::{
    handlers::{counting_handler, gated_handler, hold, ledger_handler, Gate, Ledger},
    http::{
        batch, batch_router, header_keys, poll_every, post_keys, required_header_keys, send,
        within, Reply,
    },
    Observer, RedisServer, Rng, CLAIMS,
};

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// `POST path` locking `keys`.
fn header_request(path: &str, keys: &[String]) -> Request<Body> {
    post_keys(path, &keys.join(","))
}

/// Polls every 5 ms: see [`poll_every`].
async fn eventually(limit: Duration, check: impl FnMut() -> bool) -> Option<Duration> {
    poll_every(Duration::from_millis(5), limit, check).await
}

fn gated_router(locks: &Locks, gate: &Arc<Gate>) -> Router {
    batch_router(locks, gated_handler(gate))
}

fn counting_router(locks: &Locks, runs: &Arc<AtomicUsize>) -> Router {
    batch_router(locks, counting_handler(runs))
}

// ---------------------------------------------------------------------------------------
// 1. No overlap across processes; parallelism preserved
// ---------------------------------------------------------------------------------------

fn ledger_router(locks: &Locks, ledger: &Arc<Ledger>) -> Router {
    Router::new().route(
        "/work",
        post(ledger_handler(ledger)).layer(locks.layer(required_header_keys)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn intersecting_batches_never_overlap_across_processes() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    // Two "processes": two handles on two pools, sharing only the server.
    let ledger = Arc::new(Ledger::default());
    let apps = [
        ledger_router(
            &Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10)),
            &ledger,
        ),
        ledger_router(
            &Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10)),
            &ledger,
        ),
    ];

    const REQUESTS: usize = 200;
    const KEYS: u64 = 40;
    const ATTEMPTS: usize = 200;
    let started = Instant::now();
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let app = apps[i % 2].clone();
            tokio::spawn(async move {
                let mut rng = Rng::seeded(i as u64 + 1);
                let size = 1 + rng.below(4);
                let keys: Vec<String> =
                    (0..size).map(|_| format!("r{}", rng.below(KEYS))).collect();
                let mut conflicts = 0;
                for _ in 0..ATTEMPTS {
                    let reply = send(&app, header_request("/work", &keys)).await;
                    match reply.status {
                        StatusCode::OK => return (true, conflicts),
                        StatusCode::CONFLICT => {
                            assert!(reply.retry_after() >= 1);
                            conflicts += 1;
                            let pause = 1 + rng.below(4);
                            tokio::time::sleep(Duration::from_millis(pause)).await;
                        }
                        other => panic!("unexpected {other}: {}", reply.text()),
                    }
                }
                (false, conflicts)
            })
        })
        .collect();
    let outcomes = within(
        Duration::from_secs(20),
        "all requests finished",
        futures_util::future::join_all(tasks),
    )
    .await;
    let elapsed = started.elapsed();

    let granted = outcomes.iter().filter(|o| o.as_ref().unwrap().0).count();
    let conflicts: usize = outcomes.iter().map(|o| o.as_ref().unwrap().1).sum();
    eprintln!("no-overlap: {granted}/{REQUESTS} granted, {conflicts} 409s on the way, {elapsed:?}");
    assert_eq!(
        ledger.overlaps.load(Ordering::SeqCst),
        0,
        "two holders were inside the same key at once"
    );
    let visits = ledger.visits.lock().unwrap();
    assert_eq!(visits.len(), granted);
    assert!(granted >= REQUESTS * 9 / 10, "only {granted} granted");
    assert!(conflicts > 0, "the key sets were meant to contend");

    let mut disjoint_overlaps = 0;
    for (i, a) in visits.iter().enumerate() {
        for b in &visits[i + 1..] {
            let intersect = a.keys.iter().any(|k| b.keys.contains(k));
            let overlap = a.enter < b.exit && b.enter < a.exit;
            assert!(
                !(intersect && overlap),
                "intersecting batches overlapped in time: {a:?} and {b:?}"
            );
            if overlap && !intersect {
                disjoint_overlaps += 1;
            }
        }
    }
    assert!(
        disjoint_overlaps > 0,
        "disjoint batches never ran at the same time: the layer serialised everything"
    );
    eprintln!("no-overlap: {disjoint_overlaps} overlapping pairs of disjoint batches");
    assert!(observer.locks().is_empty(), "{:?}", observer.locks());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn disjoint_batches_run_together_and_an_intersecting_one_waits_its_turn() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let one = Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));
    let other =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));

    // Both handlers must be inside at once to pass the barrier: disjoint keys in parallel.
    let barrier = Arc::new(Barrier::new(2));
    let router = |locks: &Locks| {
        let barrier = barrier.clone();
        batch_router(locks, move || {
            let barrier = barrier.clone();
            async move {
                match tokio::time::timeout(Duration::from_secs(5), barrier.wait()).await {
                    Ok(_) => StatusCode::OK,
                    Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
                }
            }
        })
    };
    let (a, b) = (router(&one), router(&other));
    let (ra, rb) = tokio::join!(send(&a, batch(&["p", "q"])), send(&b, batch(&["r", "s"])));
    assert_eq!((ra.status, rb.status), (StatusCode::OK, StatusCode::OK));

    // An intersecting batch through the other process is refused while the first holds.
    let gate = Gate::new();
    let holder = gated_router(&one, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["x", "y"])).await });
    gate.wait_entered().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let contender = counting_router(&other, &runs);
    let refused = send(&contender, batch(&["y", "z"])).await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["y"])
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(
        observer.locks(),
        BTreeSet::from(["lock:x".to_owned(), "lock:y".to_owned()]),
        "the refused batch wrote nothing (no lock:z)"
    );

    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert_eq!(
        send(&contender, batch(&["y", "z"])).await.status,
        StatusCode::OK
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(observer.locks().is_empty());
}

/// The acquire script of version 0.1, which kept a lock key as a hash of hold id -> owner
/// token: processes of both versions share one Redis during a rolling upgrade.
const PREVIOUS_ACQUIRE: &str = r"
local owner, hold, ttl, report = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local named, conflicts, earliest, fresh = {}, 0, -1, {}
for i = 2, #KEYS do
  local owners = redis.pcall('HVALS', KEYS[i])
  local foreign = owners.err ~= nil
  for _, other in ipairs(foreign and {} or owners) do
    if other ~= owner then foreign = true break end
  end
  if foreign then
    conflicts = conflicts + 1
    if #named < report then named[#named + 1] = KEYS[i] end
    local left = redis.call('PTTL', KEYS[i])
    if left >= 0 and (earliest < 0 or left < earliest) then earliest = left end
  else
    fresh[i] = #owners == 0
  end
end
if conflicts > 0 then return {0, conflicts, earliest, named} end
for i = 2, #KEYS do
  redis.call('HSET', KEYS[i], hold, owner)
  if fresh[i] or redis.call('PTTL', KEYS[i]) < ttl then
    redis.call('PEXPIRE', KEYS[i], ttl)
  end
end
return {1, redis.call('INCR', KEYS[1]), -1, {}}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn locks_of_the_previous_version_and_this_one_keep_each_other_out() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));
    let runs = Arc::new(AtomicUsize::new(0));

    // A key the previous version holds: refused, waiting or not, and left as it was.
    let old_owner = "0123456789abcdef0123456789abcdef";
    observer.cmd::<()>(
        redis::cmd("HSET")
            .arg("lock:doc:1")
            .arg("00000000000000aa")
            .arg(old_owner),
    );
    observer.cmd::<()>(redis::cmd("PEXPIRE").arg("lock:doc:1").arg(10_000));
    for locks in [
        locks.clone(),
        locks.clone().wait(Wait::up_to(Duration::from_millis(100))),
    ] {
        let refused = send(&counting_router(&locks, &runs), batch(&["doc:1", "doc:2"])).await;
        assert_eq!(refused.status, StatusCode::CONFLICT);
        assert_eq!(
            refused.problem()["conflicting_keys"],
            serde_json::json!(["doc:1"])
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let fields: Vec<String> = observer.cmd(redis::cmd("HGETALL").arg("lock:doc:1"));
    assert_eq!(fields, ["00000000000000aa", old_owner]);
    assert!(
        observer.pttl("lock:doc:1") > 9_000,
        "its TTL was not touched"
    );
    assert_eq!(
        observer.all_keys().len(),
        1,
        "the waiter withdrew: {:?}",
        observer.all_keys()
    );

    // Values that only look like this version's: foreign, so refused, by a waiter in line
    // too, and left alone.
    let looks_like_holds = "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx:foreign";
    // The shape of a shared hold (64 bytes, its separators in place), not its characters.
    let looks_shared = format!("*{}:{}/{}", "z".repeat(32), "z".repeat(16), "z".repeat(13));
    let waiting = locks.clone().wait(Wait::up_to(Duration::from_millis(50)));
    for (key, value) in [
        ("doc:3", "|1/2|garbage"),
        ("doc:4", ""),
        ("doc:5", "x:y"),
        ("doc:7", looks_like_holds),
        ("doc:8", &looks_shared),
    ] {
        observer.set(&format!("lock:{key}"), value);
        for locks in [&locks, &waiting] {
            // Exclusive or shared: refused, and the value left as it was.
            let readers = Router::new().route(
                "/batch",
                post(counting_handler(&runs))
                    .layer(locks.layer(keys::json(|keys: Vec<String>| keys)).shared()),
            );
            for app in [counting_router(locks, &runs), readers] {
                let refused = send(&app, batch(&[key])).await;
                assert_eq!(refused.status, StatusCode::CONFLICT, "{value:?}");
                let now: String = observer.cmd(redis::cmd("GET").arg(format!("lock:{key}")));
                assert_eq!(now, value);
            }
        }
    }

    // A key this version holds: the previous version's script refuses it too.
    let gate = Gate::new();
    let holder = gated_router(&locks, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["doc:6"])).await });
    gate.wait_entered().await;
    let (granted, conflicts, _, named): (i64, i64, i64, Vec<String>) =
        redis::Script::new(PREVIOUS_ACQUIRE)
            .key("lock:")
            .key("lock:doc:6")
            .arg(old_owner)
            .arg("00000000000000bb")
            .arg(10_000)
            .arg(20)
            .invoke(&mut observer.connection())
            .unwrap();
    assert_eq!(
        (granted, conflicts, named),
        (0, 1, vec!["lock:doc:6".to_owned()])
    );
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert_eq!(observer.get("lock:doc:6"), None);
}

/// A script of the previous version of the string format (before shared holds), as it ran
/// on one Redis: its value format and body (`previous/`, frozen), behind the prelude and
/// clock it shared with this version.
fn previous_script(body: &str) -> redis::Script {
    one_redis_script(include_str!("previous/value.lua"), body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_holds_and_the_previous_versions_locks_keep_each_other_out() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));
    let gate = Gate::new();
    let readers = Router::new().route(
        "/batch",
        post(gated_handler(&gate))
            .layer(locks.layer(keys::json(|keys: Vec<String>| keys)).shared()),
    );
    let acquire = previous_script(include_str!("previous/acquire.lua"));
    let release = previous_script(include_str!("previous/release.lua"));
    let (owner, hold) = ("0123456789abcdef0123456789abcdef", "00000000000000aa");
    let previous_acquire = |key: &str| -> (i64, i64, i64, Vec<String>) {
        acquire
            .key("lock:")
            .key(key)
            .arg(owner)
            .arg(hold)
            .arg(10_000)
            .arg(20)
            .arg("")
            .arg(0)
            .invoke(&mut observer.connection())
            .unwrap()
    };
    let previous_release = |key: &str| -> i64 {
        release
            .key(key)
            .arg(owner)
            .arg(hold)
            .arg("tower-batch-lock:released")
            .arg("*")
            .invoke(&mut observer.connection())
            .unwrap()
    };

    // A key the previous version holds: this version's readers are refused, take nothing,
    // and leave it for the previous version to release.
    assert_eq!(previous_acquire("lock:p:1").0, 1);
    let held = observer.get("lock:p:1");
    let refused = send(&readers, batch(&["p:1", "p:2"])).await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["p:1"])
    );
    assert_eq!(observer.get("lock:p:1"), held);
    assert_eq!(observer.get("lock:p:2"), None);
    assert_eq!(previous_release("lock:p:1"), 1);
    assert!(observer.locks().is_empty(), "{:?}", observer.locks());

    // A key this version's readers hold: foreign to the previous version, which neither
    // acquires nor releases it.
    let reading = tokio::spawn(async move { send(&readers, batch(&["p:3"])).await });
    gate.wait_entered().await;
    let shared = observer.get("lock:p:3").expect("the reader's hold");
    assert!(shared.starts_with('*'), "{shared:?}");
    let (granted, conflicts, _, named) = previous_acquire("lock:p:3");
    assert_eq!(
        (granted, conflicts, named),
        (0, 1, vec!["lock:p:3".to_owned()])
    );
    assert_eq!(previous_release("lock:p:3"), 0);
    assert_eq!(observer.get("lock:p:3"), Some(shared));
    gate.open();
    assert_eq!(reading.await.unwrap().status, StatusCode::OK);
    assert!(observer.locks().is_empty(), "{:?}", observer.locks());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_that_refuses_writes_is_unavailable_not_contention() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap());
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);

    // Writes need a replica that this server does not have: every write is refused.
    observer.cmd::<()>(
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("min-replicas-to-write")
            .arg(1),
    );
    let refused = send(&app, batch(&["doc:1", "doc:2"])).await;
    assert_unavailable(&refused);
    // A batch big enough for plain `SET`s too.
    let big: Vec<String> = (0..100).map(|i| format!("doc:{i}")).collect();
    assert_unavailable(&send(&app, batch(&big)).await);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    observer.cmd::<()>(
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("min-replicas-to-write")
            .arg(0),
    );
    assert!(observer.locks().is_empty(), "{:?}", observer.locks());
    assert_eq!(
        send(&app, batch(&["doc:1", "doc:2"])).await.status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_out_of_memory_takes_no_new_hold_and_still_frees_the_held_ones() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(30));
    let gate = Gate::new();
    let holder = gated_router(&locks, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["oom:1", "oom:2"])).await });
    gate.wait_entered().await;

    // Any memory in use is over a limit of one byte (the policy is noeviction).
    let limit = |bytes: u64| {
        observer.cmd::<()>(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(bytes));
    };
    limit(1);
    let runs = Arc::new(AtomicUsize::new(0));
    let refused = send(&counting_router(&locks, &runs), batch(&["oom:3"])).await;
    assert_unavailable(&refused);
    // A batch big enough for plain `SET`s too: refused whole, nothing taken.
    let big: Vec<String> = (0..100).map(|i| format!("oom:b{i}")).collect();
    assert_unavailable(&send(&counting_router(&locks, &runs), batch(&big)).await);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(
        observer.locks(),
        BTreeSet::from(["lock:oom:1".to_owned(), "lock:oom:2".to_owned()])
    );

    // The release frees memory: Redis runs it, and the keys go long before their ttl.
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let freed = poll_every(Duration::from_millis(20), Duration::from_secs(3), || {
        observer.locks().is_empty()
    })
    .await;
    limit(0);
    assert!(freed.is_some(), "{:?}", observer.locks());
}

/// A script of the crate's Redis store, as the store builds it.
fn crate_script(body: &str) -> redis::Script {
    one_redis_script(
        include_str!("../../src/store/redis/scripts/value.lua"),
        body,
    )
}

/// A script as a store on one Redis builds it: the prelude of one Redis, the clock and
/// fencing counter, the value format `value`, the claims, the body.
fn one_redis_script(value: &str, body: &str) -> redis::Script {
    redis::Script::new(
        &[
            &format!("local CLAIMS = '{CLAIMS}'\n"),
            include_str!("../../src/store/redis/scripts/single.lua"),
            include_str!("../../src/store/redis/scripts/clock.lua"),
            value,
            include_str!("../../src/store/redis/scripts/claims.lua"),
            body,
        ]
        .concat(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_acquisition_run_twice_is_one_hold() {
    // The store runs a script again when the connection broke before its answer: the same
    // hold twice must be one hold, which one release ends.
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let acquire = crate_script(include_str!("../../src/store/redis/scripts/acquire.lua"));
    let release = crate_script(include_str!("../../src/store/redis/scripts/release.lua"));
    let (owner, hold) = ("0123456789abcdef0123456789abcdef", "00000000000000aa");
    for _ in 0..2 {
        // A grant answers its fencing token, a refusal a list.
        let token: redis::Value = acquire
            .key("lock:")
            .key("lock:doc:1")
            .arg(owner)
            .arg(hold)
            .arg(10_000)
            .arg(20)
            .arg("")
            .arg(0)
            .arg("x")
            .arg("1")
            .invoke(&mut observer.connection())
            .unwrap();
        assert!(
            matches!(token, redis::Value::Int(token) if token > 0),
            "{token:?}"
        );
    }
    assert_eq!(observer.lock("lock:doc:1").unwrap().holds, [hold]);
    // How many keys had the hold, then the waiters it let in (none here).
    let released: Vec<i64> = release
        .key("lock:doc:1")
        .arg(owner)
        .arg(hold)
        .arg("tower-batch-lock:released")
        .arg("*")
        .invoke(&mut observer.connection())
        .unwrap();
    assert_eq!(released, [1]);
    assert!(observer.locks().is_empty(), "{:?}", observer.locks());
}

/// A waiter's retry reads its keys rather than send `SET NX GET` a key (its reservations are
/// on every one): it finds what that `SET` would have found, and takes a key that reads as
/// none with `SET NX`, leaving a key of another type alone.
#[test]
fn a_retry_that_reads_its_keys_first_decides_as_one_that_sets_them() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let acquire = crate_script(include_str!("../../src/store/redis/scripts/acquire.lua"));
    let reserve = crate_script(include_str!("../../src/store/redis/scripts/reserve.lua"));
    let ticket = format!("{}{:020}", "0061420580338024", 7);
    let retry = |keys: &[&str]| retry_in_line(&acquire, &observer, keys, &ticket);
    // Reserved by the waiter, free, another owner's, a hash.
    let _: Vec<i64> = reserve
        .key("lock:a")
        .arg(&ticket)
        .arg(5_000)
        .invoke(&mut observer.connection())
        .unwrap();
    observer.set(
        "lock:c",
        "fedcba9876543210fedcba9876543210:00000000000000cc",
    );
    observer.cmd::<()>(redis::cmd("HSET").arg("lock:d").arg("f").arg("v"));
    let refused = retry(&["lock:a", "lock:b", "lock:c", "lock:d"]);
    let redis::Value::Array(parts) = refused else {
        panic!("refused with a list: {refused:?}")
    };
    assert_eq!(parts[0], redis::Value::Int(2), "two keys kept it out");
    let named: Vec<String> = redis::from_redis_value(parts[2].clone()).unwrap();
    assert_eq!(named, ["lock:c", "lock:d"]);
    // Nothing taken: the waiter's reservation on every key of ours (the free one too, and
    // behind the other owner's hold), the hash as it was.
    for (key, holds) in [
        ("lock:a", vec![]),
        ("lock:b", vec![]),
        ("lock:c", vec!["00000000000000cc"]),
    ] {
        let value = observer.lock(key).expect(key);
        assert_eq!(value.holds, holds, "{key}");
        assert_eq!(
            value.reservations,
            [ticket.parse::<u128>().unwrap()],
            "{key}"
        );
    }
    let hash: Vec<String> = observer.cmd(redis::cmd("HGETALL").arg("lock:d"));
    assert_eq!(hash, ["f", "v"]);

    // Without the keys of others: granted, the free key taken, the line's entry gone.
    observer.cmd::<()>(redis::cmd("DEL").arg("lock:b"));
    let granted = retry(&["lock:a", "lock:b"]);
    assert!(
        matches!(granted, redis::Value::Int(token) if token > 0),
        "{granted:?}"
    );
    for key in ["lock:a", "lock:b"] {
        let value = observer.lock(key).expect(key);
        assert_eq!(value.holds, [RETRY_HOLD], "{key}");
        assert!(value.reservations.is_empty(), "{key}: {value:?}");
    }
}

/// The hold id of [`retry_in_line`]'s owner.
const RETRY_HOLD: &str = "00000000000000bb";

/// A waiter's retry of `keys` through the acquire script `acquire` on `observer`'s server,
/// standing in line at `ticket`: it reads its keys first, and reserves them for 5 s when
/// it is refused (a 10 s hold, exclusive, counted, up to 20 conflicts named).
fn retry_in_line(
    acquire: &redis::Script,
    observer: &Observer,
    keys: &[&str],
    ticket: &str,
) -> redis::Value {
    let mut call = acquire.key("lock:");
    for key in keys {
        call.key(*key);
    }
    call.arg("0123456789abcdef0123456789abcdef")
        .arg(RETRY_HOLD)
        .arg(10_000)
        .arg(20)
        .arg(ticket)
        .arg(5_000)
        .arg("x")
        .arg("1")
        .arg("tower-batch-lock:released")
        .arg("1")
        .invoke(&mut observer.connection())
        .unwrap()
}

/// A probe answers how many keys, from the first, would not keep its waiter out, wherever
/// the first that would is among the short reads it starts with (16 keys, then three times
/// as many as so far): a key held by another owner, one an earlier waiter reserved, one an
/// earlier waiter's claim names; free keys, with no value, pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_probe_stops_at_the_first_key_in_the_way_wherever_it_is() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let probe = crate_script(include_str!("../../src/store/redis/scripts/probe.lua"));
    let reserve = crate_script(include_str!("../../src/store/redis/scripts/reserve.lua"));
    let keys: Vec<String> = (0..300).map(|i| format!("lock:p:{i:03}")).collect();
    let ticket = |n: u64| format!("{}{n:020}", "0061420580338024");
    let free_from_first = || -> usize {
        let mut call = probe.prepare_invoke();
        for key in &keys {
            call.key(key);
        }
        call.arg("0123456789abcdef0123456789abcdef")
            .arg(ticket(7))
            .arg("x")
            .invoke(&mut observer.connection())
            .unwrap()
    };
    assert_eq!(free_from_first(), 300, "every key free");
    let other = "fedcba9876543210fedcba9876543210:00000000000000cc";
    for at in [0, 15, 16, 63, 64, 255, 256, 299] {
        observer.set(&keys[at], other);
        assert_eq!(free_from_first(), at, "held by another owner at {at}");
        observer.cmd::<()>(redis::cmd("DEL").arg(&keys[at]));
    }
    let _: Vec<i64> = reserve
        .key(&keys[100])
        .arg(ticket(3))
        .arg(5_000)
        .invoke(&mut observer.connection())
        .unwrap();
    assert_eq!(free_from_first(), 100, "reserved by an earlier waiter");
    observer.cmd::<()>(redis::cmd("DEL").arg(&keys[100]));
    let claim = format!("{CLAIMS}:{}", ticket(5));
    observer.cmd::<()>(redis::cmd("SADD").arg(&claim).arg(&keys[150]));
    observer.cmd::<()>(redis::cmd("PEXPIRE").arg(&claim).arg(5_000));
    observer.cmd::<()>(redis::cmd("ZADD").arg(CLAIMS).arg(i64::MAX).arg(ticket(5)));
    assert_eq!(free_from_first(), 150, "named by an earlier claim");
}

/// A long line (a hot key's) is changed where it changes, not read whole: what it keeps is
/// what a whole read keeps, but for ended entries behind a live head (which keep nobody
/// out), and the end it gives the key is never earlier than its latest reservation's (but
/// by what `PTTL` counted down while the script ran).
/// Random lines of 5 to 80 entries, a quarter of them ended, each changed one way: by
/// nothing (a release), a waiter's entry cut out (a grant, a withdrawal), a new one put in
/// its place (a reservation), or one cut out and put back with a new end (a renewal). The
/// key's end comes back with them, for holds that keep none of their own; a key without a
/// ttl (another program's doing) is read whole.
#[test]
fn a_long_line_changed_in_place_keeps_what_a_whole_read_keeps() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let check = crate_script(
        r#"
        math.randomseed(tonumber(ARGV[1]))
        local failures, base = {}, now()
        -- Redis's clock as it moves during the script (`now()` keeps its first reading).
        local function clock_ms()
          local t = redis.call('TIME')
          return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        end
        -- The live entries of `queue`, and whether its first entry is live.
        local function live(queue)
          local kept = {}
          for at, u in entries(queue) do
            if u > base then kept[#kept + 1] = string.sub(queue, at, at + ENTRY_LEN - 1) end
          end
          return table.concat(kept), queue == '' or entry_until(queue, 1) > base
        end
        for case = 1, tonumber(ARGV[2]) do
          local parts, tickets, t, latest = {}, {}, 0, 0
          for k = 1, math.random(WHOLE_LINE + 1, 80) do
            -- Even tickets, so that an odd one falls between two.
            t = t + 2 * math.random(1, 3)
            tickets[k] = string.format('%036d', t)
            local ends = base + math.random(1, 5000)
            if math.random() < 0.25 then ends = base - math.random(0, 1000) end
            if ends > latest then latest = ends end
            parts[k] = entry(tickets[k], ends)
          end
          local queue = table.concat(parts)
          -- The key lives until its latest reservation, as `write` leaves it; or, as only
          -- another program leaves a key, for ever: then the line is read whole.
          local forever, set_at = math.random() < 0.125, clock_ms()
          if forever then
            redis.call('SET', KEYS[1], queue)
          else
            redis.call('SET', KEYS[1], queue, 'PX', math.max(latest - base, 1))
          end
          local how, ticket, till = math.random(1, 5), nil, nil
          if how == 2 or how == 4 then ticket = tickets[math.random(1, #tickets)] end
          if how == 3 then ticket = string.format('%036d', 2 * math.random(0, t) + 1) end
          if how == 5 then ticket = string.format('%036d', t + 1) end
          if how >= 3 then till = base + math.random(1, 5000) end
          local whole, exact = requeue_whole(queue, ticket, till)
          local kept, bound, key_end = requeue(KEYS[1], queue, ticket, till)
          local pttl = redis.call('PTTL', KEYS[1])
          local alive, head_live = live(kept)
          -- The key's end comes from PTTL, which counts down as the script runs (it ends
          -- where it did, the SET that writes it counting from the same moment), in whole
          -- milliseconds.
          local slack = clock_ms() - set_at + 1
          local wrong = bound < exact - slack or (kept == '') ~= (whole == '')
          if forever then
            wrong = wrong or kept ~= whole or bound ~= exact or key_end ~= nil
          else
            wrong = wrong or key_end == nil or math.abs(key_end - (base + pttl)) > slack
          end
          if wrong or alive ~= whole or not head_live then
            failures[#failures + 1] = case .. ' (' .. how .. (forever and ', no ttl' or '')
              .. '): ' .. #queue / ENTRY_LEN
              .. ' entries, kept ' .. #kept / ENTRY_LEN .. ', ' .. #alive / ENTRY_LEN
              .. ' live against ' .. #whole / ENTRY_LEN .. ', end ' .. bound .. ' against ' .. exact
          end
        end
        redis.call('DEL', KEYS[1])
        return failures
        "#,
    );
    let mut rng = Rng::seeded(35);
    for _ in 0..5 {
        let failures: Vec<String> = check
            .key("lock:line")
            .arg(rng.below(1 << 30))
            .arg(400)
            .invoke(&mut observer.connection())
            .unwrap();
        assert!(failures.is_empty(), "{failures:#?}");
    }
}

/// A waiter's retry that reads its keys first, kept out of a free key by an earlier waiter's
/// claim, puts its reservation on that key too, as on every other key of its batch: it
/// stays in line there for when the claim ends.
#[test]
fn a_retry_reserves_a_free_key_that_an_earlier_claim_names() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let acquire = crate_script(include_str!("../../src/store/redis/scripts/acquire.lua"));
    let (earlier, ticket) = (
        format!("{}{:020}", "0061420580338024", 3),
        format!("{}{:020}", "0061420580338024", 7),
    );
    observer.claim(&earlier, &["lock:e"]);
    let refused = retry_in_line(&acquire, &observer, &["lock:e"], &ticket);
    let redis::Value::Array(parts) = refused else {
        panic!("refused with a list: {refused:?}")
    };
    assert_eq!(parts[0], redis::Value::Int(1), "one key kept it out");
    let value = observer
        .lock("lock:e")
        .expect("the waiter's reservation on `e`");
    assert!(value.holds.is_empty(), "{value:?}");
    assert_eq!(value.reservations, [ticket.parse::<u128>().unwrap()]);
}

/// The owner and hold that the release tests' keys are held by.
const HOLDER: (&str, &str) = ("fedcba9876543210fedcba9876543210", "00000000000000cc");

/// Puts [`HOLDER`]'s hold on `keys`, for 10 s, as a grant writes it.
fn hold_by_holder(observer: &Observer, keys: &[&str]) {
    for key in keys {
        let value = format!("{}:{}", HOLDER.0, HOLDER.1);
        observer.cmd::<()>(redis::cmd("SET").arg(key).arg(value).arg("PX").arg(10_000));
    }
}

/// Runs the release script for [`HOLDER`] on `keys`: how many keys had the hold, and the
/// tickets of the waiters it wakes, sorted.
fn release_by_holder(observer: &Observer, keys: &[&str]) -> (redis::Value, Vec<String>) {
    let release = crate_script(include_str!("../../src/store/redis/scripts/release.lua"));
    let mut call = release.prepare_invoke();
    for key in keys {
        call.key(*key);
    }
    let released: Vec<redis::Value> = call
        .arg(HOLDER.0)
        .arg(HOLDER.1)
        .arg("tower-batch-lock:released")
        .arg("")
        .invoke(&mut observer.connection())
        .unwrap();
    let mut heads: Vec<String> = released[1..]
        .iter()
        .map(|head| redis::from_redis_value(head.clone()).unwrap())
        .collect();
    heads.sort();
    (released[0].clone(), heads)
}

/// A release wakes the claim first in line on a key it frees, unless an earlier claim names
/// a key that claim names too: that waiter could only probe and find the earlier one in
/// its way, and is woken when that claim's keys are freed.
#[test]
fn a_release_leaves_asleep_a_claims_waiter_that_an_earlier_claim_keeps_out() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let ticket = |n: u64| format!("{}{n:020}", "0061420580338024");
    // `earlier` names b; `free_to_go` names c alone; `kept_out` names a, and b after
    // `earlier`.
    let (earlier, free_to_go, kept_out) = (ticket(1), ticket(2), ticket(3));
    observer.claim(&earlier, &["lock:b"]);
    observer.claim(&free_to_go, &["lock:c"]);
    observer.claim(&kept_out, &["lock:a", "lock:b"]);
    hold_by_holder(&observer, &["lock:a", "lock:c"]);
    let (released, heads) = release_by_holder(&observer, &["lock:a", "lock:c"]);
    assert_eq!(released, redis::Value::Int(2));
    assert_eq!(heads, [free_to_go]);
}

/// A release wakes, on a key with a line, the earlier of its first reservation and the
/// earliest claim that names it; on a key without one, a claim that names it. A claim
/// later than a key's first reservation, or that names no key freed, sleeps on.
#[test]
fn a_release_wakes_on_each_key_the_earliest_of_its_line_and_its_claims() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let reserve = crate_script(include_str!("../../src/store/redis/scripts/reserve.lua"));
    let ticket = |n: u64| format!("{}{n:020}", "0061420580338024");
    // `elsewhere` names a key that stays held; `behind_line` names `a`, after the
    // reservation there; `on_free_key` names `c`, which has no line.
    let (elsewhere, reserved, behind_line, on_free_key) =
        (ticket(1), ticket(4), ticket(5), ticket(6));
    observer.claim(&elsewhere, &["lock:d"]);
    observer.claim(&behind_line, &["lock:a"]);
    observer.claim(&on_free_key, &["lock:c"]);
    hold_by_holder(&observer, &["lock:a", "lock:c", "lock:d"]);
    let blockers: Vec<i64> = reserve
        .key("lock:a")
        .arg(&reserved)
        .arg(10_000)
        .invoke(&mut observer.connection())
        .unwrap();
    assert_eq!(blockers, [1], "the reservation waits behind the hold");
    let (released, heads) = release_by_holder(&observer, &["lock:a", "lock:c"]);
    assert_eq!(released, redis::Value::Int(2));
    assert_eq!(heads, [reserved, on_free_key]);
}

/// Two waiters of two processes that drew the same milliseconds and the same bits below
/// them still have two places in line: the withdrawal of one leaves the other's. (Tickets
/// were numbers with 10 random bits: two such waiters shared one place, once in 1,024
/// arrivals in the same millisecond.)
#[test]
fn two_waiters_whose_tickets_share_their_time_keep_two_places() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let reserve = crate_script(include_str!("../../src/store/redis/scripts/reserve.lua"));
    let withdraw = crate_script(include_str!("../../src/store/redis/scripts/withdraw.lua"));
    // As `Ticket::as_arg` writes them: the time part, then 20 random digits.
    let time = "0061420580338024";
    let (first, second) = (format!("{time}{:020}", 7), format!("{time}{:020}", 9));
    // The positions of the keys that keep each waiter out: none for the first; the
    // second is behind the first.
    for (ticket, blockers) in [(&first, vec![]), (&second, vec![1])] {
        let found: Vec<i64> = reserve
            .key("lock:k")
            .arg(ticket)
            .arg(10_000)
            .invoke(&mut observer.connection())
            .unwrap();
        assert_eq!(found, blockers);
    }
    let line = |observer: &Observer| observer.lock("lock:k").unwrap().reservations;
    assert_eq!(line(&observer).len(), 2, "{:?}", observer.get("lock:k"));
    let withdrawn: Vec<redis::Value> = withdraw
        .key("lock:k")
        .arg(&first)
        .arg("tower-batch-lock:released")
        .arg("")
        .invoke(&mut observer.connection())
        .unwrap();
    assert_eq!(withdrawn[0], redis::Value::Int(1));
    assert_eq!(line(&observer), [second.parse::<u128>().unwrap()]);
}

// ---------------------------------------------------------------------------------------
// 12. Bounded stall: big batches in steps
// ---------------------------------------------------------------------------------------

/// The largest number of keys any script call carried since `SLOWLOG RESET`:
/// `FCALL function numkeys ...`.
fn most_keys_a_call(observer: &Observer) -> usize {
    observer
        .logged_commands(false)
        .iter()
        .filter(|command| command[0] == "fcall")
        .filter_map(|command| command.get(2)?.parse().ok())
        .max()
        .unwrap_or(0)
}

/// How many plain `SET key value PX ttl NX` were sent since `SLOWLOG RESET`.
fn plain_sets(observer: &Observer) -> usize {
    observer
        .logged_commands(false)
        .iter()
        .filter(|command| command[0] == "set" && command.last().is_some_and(|a| a == "NX"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_big_batch_goes_in_steps_all_or_nothing_and_keeps_its_place_in_line() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    observer.log_every_command();
    let store = || Redis::pool(server.pool()).step_keys(100).build().unwrap();
    let locks = Locks::new(store()).ttl(Duration::from_secs(10));
    let keys: Vec<String> = (0..1000).map(|i| format!("s:{i:04}")).collect();
    let runs = Arc::new(AtomicUsize::new(0));

    // Granted (its keys are free: plain `SET`s take them, and one script call counts the
    // grant) and released in steps of at most 100 keys.
    observer.cmd::<()>(redis::cmd("SLOWLOG").arg("RESET"));
    let granted = send(&counting_router(&locks, &runs), batch(&keys)).await;
    assert_eq!(granted.status, StatusCode::OK);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(observer.locks().is_empty(), "{:?}", observer.locks());
    let most = most_keys_a_call(&observer);
    assert!(
        (90..=101).contains(&most),
        "the largest call carried {most} keys"
    );

    // A key of the second step held elsewhere: refused, and the step before it undone.
    let gate = Gate::new();
    let holder = gated_router(&locks, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["s:0150"])).await });
    gate.wait_entered().await;
    let refused = send(&counting_router(&locks, &runs), batch(&keys)).await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["s:0150"])
    );
    assert_eq!(
        observer.locks(),
        BTreeSet::from(["lock:s:0150".to_owned()]),
        "nothing of the refused batch is left"
    );

    // A waiter kept out at its second step keeps its place on every key of the batch (in
    // its claim), those of the step it undid and those it never tried, and gets in after
    // the holder.
    let waiting = Locks::new(store())
        .ttl(Duration::from_secs(10))
        .wait(Wait::up_to(Duration::from_secs(5)));
    let waiter = {
        let (app, keys) = (counting_router(&waiting, &runs), keys.clone());
        tokio::spawn(async move { send(&app, batch(&keys)).await })
    };
    let reserved = |key: &str| !observer.claims_on(key).is_empty();
    let line = poll_every(Duration::from_millis(10), Duration::from_secs(5), || {
        reserved("lock:s:0000") && reserved("lock:s:0500") && reserved("lock:s:0999")
    })
    .await;
    assert!(line.is_some(), "the waiter reserved its whole batch");
    observer.cmd::<()>(redis::cmd("SLOWLOG").arg("RESET"));
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert_eq!(waiter.await.unwrap().status, StatusCode::OK);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert!(observer.locks().is_empty(), "{:?}", observer.locks());
    // A waiter's retry goes to the script alone (its place in line may be kept in the
    // keys): the script took them all, in steps of 100 keys and the counter.
    let most = most_keys_a_call(&observer);
    assert!(
        (100..=101).contains(&most),
        "the largest call carried {most} keys"
    );
}

/// A waiter refused at one step of its batch learns what keeps it out in the steps it did
/// not try too (the reservation of those steps reads them): its next attempt waits for
/// all of them, rather than take the first steps again only to be refused at a later one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_refused_at_one_step_learns_of_what_keeps_it_out_in_later_steps() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let store = || Redis::pool(server.pool()).step_keys(10).build().unwrap();
    let locks = Locks::new(store()).ttl(Duration::from_secs(10));
    let keys: Vec<String> = (0..60).map(|i| format!("s:{i:04}")).collect();
    let runs = Arc::new(AtomicUsize::new(0));

    // One key held in the first step, one in the last (a batch too small for a plain
    // pass, which would have read them all).
    let gate = Gate::new();
    let holder = gated_router(&locks, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["s:0005", "s:0055"])).await });
    gate.wait_entered().await;
    let waiting = Locks::new(store())
        .ttl(Duration::from_secs(10))
        .wait(Wait::up_to(Duration::from_millis(300)));
    let refused = send(&counting_router(&waiting, &runs), batch(&keys)).await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["s:0005", "s:0055"])
    );
    assert!(
        refused.problem()["detail"]
            .as_str()
            .is_some_and(|detail| detail.starts_with("2 of the 60")),
        "{}",
        refused.problem()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert!(observer.locks().is_empty(), "{:?}", observer.locks());
}

// ---------------------------------------------------------------------------------------
// 2. All or nothing, for big batches
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_big_batch_with_one_held_key_is_refused_and_writes_nothing() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));

    // "sku:999" sorts last among sku:0..sku:2999, so a script that wrote as it went would
    // have written the other 2,999 keys before finding the conflict.
    let gate = Gate::new();
    let holder = gated_router(&locks, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["sku:999"])).await });
    gate.wait_entered().await;
    let token = observer.get("lock:sku:999").expect("the holder's key");
    assert_eq!(token.len(), 32, "a 128-bit owner token in hex: {token}");

    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    let skus: Vec<String> = (0..3_000).map(|i| format!("sku:{i}")).collect();
    assert_eq!(skus.iter().max().unwrap(), "sku:999");
    let started = Instant::now();
    let refused = send(&app, batch(&skus)).await;
    eprintln!(
        "all-or-nothing: 3,000-key batch refused in {:?}",
        started.elapsed()
    );

    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
    let problem = refused.problem();
    assert_eq!(problem["conflicting_keys"], serde_json::json!(["sku:999"]));
    assert_eq!(
        problem["detail"],
        "1 of the 3000 resources this request locks is held by another request"
    );
    let retry_after = refused.retry_after();
    assert!(
        (1..=10).contains(&retry_after),
        "Retry-After: {retry_after}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler ran");
    assert_eq!(
        observer.locks(),
        BTreeSet::from(["lock:sku:999".to_owned()]),
        "none of the other 2,999 keys may exist"
    );
    assert_eq!(
        observer.get("lock:sku:999"),
        Some(token),
        "the holder's key is intact"
    );

    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert!(observer.locks().is_empty());

    // Now the whole batch is free: granted, every key written, all released.
    let started = Instant::now();
    let granted = send(&app, batch(&skus)).await;
    eprintln!(
        "all-or-nothing: 3,000-key batch granted and released in {:?}",
        started.elapsed()
    );
    assert_eq!(granted.status, StatusCode::OK, "{}", granted.text());
    assert!(observer.locks().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_big_batch_takes_its_free_keys_with_plain_sets_and_leaves_the_rest_to_the_script() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    observer.log_every_command();
    let locks =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));
    let keys: Vec<String> = (0..200).map(|i| format!("p:{i:03}")).collect();

    // Granted, every key taken with a plain `SET` and written as the script writes it,
    // under one ttl; and each grant's fencing token is above the one before.
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let app = {
        let (tokens, observer) = (tokens.clone(), observer.clone());
        batch_router(&locks, move |Extension(lease): Extension<Lease>| {
            let (tokens, observer) = (tokens.clone(), observer.clone());
            async move {
                let values: BTreeSet<Option<String>> = ["lock:p:000", "lock:p:199"]
                    .iter()
                    .map(|key| observer.cmd(redis::cmd("GET").arg(key)))
                    .collect();
                let ttl: i64 = observer.cmd(redis::cmd("PTTL").arg("lock:p:150"));
                tokens
                    .lock()
                    .unwrap()
                    .push((lease.fencing_token(), values, ttl));
            }
        })
    };
    for _ in 0..2 {
        observer.cmd::<()>(redis::cmd("SLOWLOG").arg("RESET"));
        assert_eq!(send(&app, batch(&keys)).await.status, StatusCode::OK);
        assert!(observer.locks().is_empty(), "{:?}", observer.locks());
        assert_eq!(plain_sets(&observer), 200);
    }
    let seen = tokens.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    for (_, values, ttl) in &seen {
        assert_eq!(values.len(), 1, "one value for the batch: {values:?}");
        let value = values.first().unwrap().clone().expect("held");
        assert_eq!(
            value.len(),
            32 + 1 + 16,
            "owner:hold, as the script writes: {value}"
        );
        assert!((9_000..=10_000).contains(ttl), "pttl {ttl}");
    }
    assert!(seen[1].0 > seen[0].0, "fencing tokens {:?}", seen);

    // A key of another type in the middle of the batch: the plain `SET` cannot take it,
    // and the script finds it foreign. Refused, and nothing of the batch is left.
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    observer.cmd::<()>(redis::cmd("HSET").arg("lock:p:100").arg("f").arg("v"));
    observer.cmd::<()>(redis::cmd("SLOWLOG").arg("RESET"));
    let refused = send(&app, batch(&keys)).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["p:100"])
    );
    assert_eq!(plain_sets(&observer), 200);
    assert_eq!(
        observer.locks(),
        BTreeSet::from(["lock:p:100".to_owned()]),
        "nothing of the refused batch is left"
    );
    let field: String = observer.cmd(redis::cmd("HGET").arg("lock:p:100").arg("f"));
    assert_eq!(field, "v", "the foreign key is intact");
    observer.cmd::<()>(redis::cmd("DEL").arg("lock:p:100"));

    // For a while after a refusal, big batches go to the script alone, which refuses
    // without showing anyone the keys it would have taken.
    observer.cmd::<()>(redis::cmd("SLOWLOG").arg("RESET"));
    assert_eq!(send(&app, batch(&keys)).await.status, StatusCode::OK);
    assert_eq!(plain_sets(&observer), 0);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(observer.locks().is_empty(), "{:?}", observer.locks());

    // Refused there, the script reads the batch's values, and writes none of its keys.
    let other = "fedcba9876543210fedcba9876543210:00000000000000cc";
    observer.set("lock:p:150", other);
    observer.cmd::<()>(redis::cmd("SLOWLOG").arg("RESET"));
    assert_eq!(send(&app, batch(&keys)).await.status, StatusCode::CONFLICT);
    let writes: Vec<Vec<String>> = observer
        .logged_commands(true)
        .into_iter()
        .filter(|command| matches!(command[0].as_str(), "set" | "del" | "unlink"))
        .collect();
    assert!(writes.is_empty(), "the refused script wrote: {writes:?}");
    assert_eq!(
        observer.locks(),
        BTreeSet::from(["lock:p:150".to_owned()]),
        "nothing of the refused batch is left"
    );
}

/// Retail orders of up to 40 keys and purchase orders of 360 draws (about 270 keys) out of
/// the same 600, from two processes at once, each retried on 409: a purchase order that is
/// refused must not keep the others out for longer than its script would have (a plain
/// pass that keeps taking keys it then gives back starved most of them, when it was sent
/// on every attempt: 47-71 of 270 retail orders got through, and 5 of 30 purchase orders).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn purchase_orders_amid_retail_orders_all_get_through() {
    let server = RedisServer::start();
    let ledger = Arc::new(Ledger::default());
    let process = || {
        let locks =
            Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));
        batch_router(&locks, ledger_handler(&ledger))
    };
    let apps = [process(), process()];
    let orders: Vec<_> = (0..300)
        .map(|i| {
            let app = apps[i % 2].clone();
            tokio::spawn(async move {
                let mut rng = Rng::seeded(i as u64);
                let draws = if i.is_multiple_of(10) {
                    360
                } else {
                    1 + rng.below(40)
                };
                let keys: Vec<String> = (0..draws)
                    .map(|_| format!("sku:{}", rng.below(600)))
                    .collect();
                // Bounded: an order that keeps meeting others gives up.
                for _ in 0..200 {
                    match send(&app, batch(&keys)).await.status {
                        StatusCode::CONFLICT => tokio::time::sleep(Duration::from_millis(2)).await,
                        status => return status,
                    }
                }
                StatusCode::CONFLICT
            })
        })
        .collect();
    let mut granted = 0;
    for order in orders {
        let status = within(Duration::from_secs(60), "an order", order)
            .await
            .unwrap();
        granted += usize::from(status == StatusCode::OK);
    }
    // Every one, when they ran alone on this machine; 272 with the whole suite beside them
    // on two cores. A plain pass on every attempt let 52-76 through, alone.
    assert!(granted >= 200, "only {granted} of 300 orders got through");
    assert_eq!(ledger.overlaps.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_keys_are_granted_in_one_batch_and_released_fully() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));

    let seen = Arc::new(Mutex::new(None));
    let app = {
        let (seen, observer) = (seen.clone(), observer.clone());
        batch_router(&locks, move |Extension(lease): Extension<Lease>| {
            let (seen, observer) = (seen.clone(), observer.clone());
            async move {
                let entered = Instant::now();
                let tokens: Vec<Option<String>> = ["lock:k0", "lock:k5000", "lock:k9999"]
                    .iter()
                    .map(|key| observer.get(key))
                    .collect();
                let dbsize = observer.dbsize();
                let phase = (entered, Instant::now());
                *seen.lock().unwrap() = Some((lease.keys().len(), dbsize, tokens, phase));
            }
        })
    };
    let keys: Vec<String> = (0..10_000).map(|i| format!("k{i}")).collect();
    let started = Instant::now();
    let reply = send(&app, batch(&keys)).await;
    let done = Instant::now();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());

    let (leased, dbsize, tokens, (entered, left)) =
        seen.lock().unwrap().take().expect("the handler ran");
    eprintln!(
        "10,000-key batch: request to handler (JSON, normalize, acquire) {:?}, \
         handler to response (release) {:?}, in all {:?}",
        entered - started,
        done - left,
        done - started
    );
    assert_eq!(leased, 10_000);
    assert_eq!(
        dbsize, 10_000,
        "every key was written while the handler ran"
    );
    let first = tokens[0].clone().expect("lock:k0 held");
    assert!(
        tokens.iter().all(|t| t.as_ref() == Some(&first)),
        "{tokens:?}"
    );
    assert_eq!(observer.dbsize(), 0, "every key was released");

    // One more than the limit: 413, and nothing written.
    let mut too_many = keys.clone();
    too_many.push("k10000".to_owned());
    let refused = send(&app, batch(&too_many)).await;
    assert_eq!(refused.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(refused.problem()["limit"], "max_keys");
    assert_eq!(observer.dbsize(), 0);
}

// ---------------------------------------------------------------------------------------
// 3. Owner only
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_release_never_deletes_the_next_owners_key() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    // A's lease is short, unrenewed, and its handler outlives it; B's lease is long.
    let short = Locks::new(Redis::pool(server.pool()).build().unwrap())
        .ttl(Duration::from_millis(300))
        .renew_lease(false);
    let long = Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));

    let (gate_a, gate_b) = (Gate::new(), Gate::new());
    let app_a = gated_router(&short, &gate_a);
    let app_b = gated_router(&long, &gate_b);

    let a = tokio::spawn(async move { send(&app_a, batch(&["acct:1"])).await });
    gate_a.wait_entered().await;
    let token_a = observer.get("lock:acct:1").expect("A holds the key");
    let pttl = observer.pttl("lock:acct:1");
    assert!((1..=300).contains(&pttl), "PTTL {pttl}");

    let expired = eventually(Duration::from_secs(2), || {
        observer.get("lock:acct:1").is_none()
    })
    .await;
    assert!(
        expired.is_some(),
        "A's key did not expire with its 300 ms TTL"
    );

    let b = tokio::spawn(async move { send(&app_b, batch(&["acct:1"])).await });
    gate_b.wait_entered().await;
    let token_b = observer.get("lock:acct:1").expect("B holds the key");
    assert_ne!(token_a, token_b);

    // A finishes: the layer awaits A's release before it answers.
    gate_a.open();
    assert_eq!(a.await.unwrap().status, StatusCode::OK);
    assert_eq!(
        observer.get("lock:acct:1"),
        Some(token_b.clone()),
        "A's release deleted B's lock"
    );
    assert!(
        observer.pttl("lock:acct:1") > 5_000,
        "B's TTL was not touched"
    );

    gate_b.open();
    assert_eq!(b.await.unwrap().status, StatusCode::OK);
    assert!(observer.locks().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_foreign_value_under_a_lock_key_is_never_released() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));

    // Someone else's value, without a TTL: contention, and Retry-After still >= 1.
    observer.set("lock:doc:1", "someone-else");
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    let refused = send(&app, batch(&["doc:1", "doc:2"])).await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["doc:1"])
    );
    assert!(refused.retry_after() >= 1);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(observer.get("lock:doc:1").as_deref(), Some("someone-else"));
    assert_eq!(
        observer.pttl("lock:doc:1"),
        -1,
        "its (absent) TTL is untouched"
    );
    assert_eq!(observer.get("lock:doc:2"), None);

    // A key we hold is overwritten by someone else while the handler runs: our release
    // must leave their value alone, and still release the key that is ours.
    let gate = Gate::new();
    let holder = gated_router(&locks, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["doc:3", "doc:4"])).await });
    gate.wait_entered().await;
    let ours = observer.get("lock:doc:3").unwrap();
    observer.set("lock:doc:3", "intruder");
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert_eq!(observer.get("lock:doc:3").as_deref(), Some("intruder"));
    assert_ne!(ours, "intruder");
    assert_eq!(observer.get("lock:doc:4"), None, "our own key was released");
    assert_eq!(observer.get("lock:doc:1").as_deref(), Some("someone-else"));
}

// ---------------------------------------------------------------------------------------
// 4. Cancellation
// ---------------------------------------------------------------------------------------

/// How long after `drop` the keys stayed in Redis; they live 10 s otherwise.
async fn released_after_drop(observer: &Observer) -> Duration {
    eventually(Duration::from_secs(3), || observer.locks().is_empty())
        .await
        .unwrap_or_else(|| panic!("keys still held 3 s after the drop: {:?}", observer.locks()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dropped_request_future_releases_its_keys_within_milliseconds() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));
    let gate = Gate::new();
    let app = gated_router(&locks, &gate);
    let keys = ["c:1", "c:2", "c:3"];

    // A timeout around the request, as a client deadline would be.
    let request = app.clone().oneshot(batch(&keys));
    let deadline = tokio::time::timeout(Duration::from_millis(200), async {
        let response = request.await;
        panic!(
            "the gated handler answered: {:?}",
            response.map(|r| r.status())
        );
    });
    let (timed_out, ()) = tokio::join!(deadline, gate.wait_entered());
    assert!(timed_out.is_err());
    let took = released_after_drop(&observer).await;
    eprintln!("cancellation (timeout): keys gone {took:?} after the drop");
    assert!(took < Duration::from_millis(500), "took {took:?}");

    // An aborted task.
    let task = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, batch(&keys)).await })
    };
    gate.wait_entered().await;
    assert_eq!(observer.locks().len(), 3);
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    let took = released_after_drop(&observer).await;
    eprintln!("cancellation (abort): keys gone {took:?} after the drop");
    assert!(took < Duration::from_millis(500), "took {took:?}");

    // Nothing stayed behind to block the next request.
    let runs = Arc::new(AtomicUsize::new(0));
    let next = counting_router(&locks, &runs);
    assert_eq!(send(&next, batch(&keys)).await.status, StatusCode::OK);
    assert_eq!(gate.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_hangs_up_over_tcp_releases_its_keys() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));
    let gate = Gate::new();
    let app = gated_router(&locks, &gate);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let serving = tokio::spawn(async move { axum::serve(listener, app).await });

    let body = r#"["tcp:1","tcp:2"]"#;
    let mut client = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!(
        "POST /batch HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    client.write_all(request.as_bytes()).await.unwrap();
    gate.wait_entered().await;
    assert_eq!(observer.locks().len(), 2);
    drop(client);
    let took = released_after_drop(&observer).await;
    eprintln!("cancellation (client hung up): keys gone {took:?} after the hang-up");
    assert!(took < Duration::from_millis(500), "took {took:?}");

    // The server still answers a well-behaved client on the same keys.
    let mut client = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!(
        "POST /batch HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    client.write_all(request.as_bytes()).await.unwrap();
    gate.wait_entered().await;
    gate.open();
    let mut response = String::new();
    within(
        Duration::from_secs(5),
        "the response",
        client.read_to_string(&mut response),
    )
    .await
    .unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(observer.locks().is_empty());
    serving.abort();
}

// ---------------------------------------------------------------------------------------
// 5. Crash liveness
// ---------------------------------------------------------------------------------------

/// Asks for `keys` every 20 ms until granted; how long that took after `since`, having
/// checked that the first attempts were refused.
async fn granted_after(app: &Router, keys: &[&str], since: Instant) -> Duration {
    let first = send(app, batch(keys)).await;
    assert_eq!(first.status, StatusCode::CONFLICT, "the key was not held");
    assert!(first.retry_after() >= 1);
    for _ in 0..150 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let reply = send(app, batch(keys)).await;
        match reply.status {
            StatusCode::OK => return since.elapsed(),
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}: {}", reply.text()),
        }
    }
    panic!("the key was never freed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leaked_holder_blocks_others_only_until_the_ttl() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let ttl = Duration::from_millis(300);
    // Without renewal: a leaked holder's renewal would go on until `max_hold`
    // (the `defaults` module), as a hung handler's does.
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap())
        .ttl(ttl)
        .renew_lease(false);
    let gate = Gate::new();
    let holder = gated_router(&locks, &gate);

    let sent = Instant::now();
    let mut in_flight = Box::pin(holder.oneshot(batch(&["leak:1"])));
    tokio::select! {
        () = gate.wait_entered() => {}
        _ = &mut in_flight => panic!("the gated handler answered"),
    }
    // The future is never dropped, so its guard never releases: only the TTL frees the key.
    std::mem::forget(in_flight);
    assert!(observer.get("lock:leak:1").is_some());

    let runs = Arc::new(AtomicUsize::new(0));
    let other = counting_router(&locks, &runs);
    let free_after = granted_after(&other, &["leak:1"], sent).await;
    eprintln!("crash liveness (leaked future): free {free_after:?} after the holder's request");
    assert!(
        free_after >= ttl - Duration::from_millis(50),
        "{free_after:?}"
    );
    assert!(
        free_after < ttl + Duration::from_millis(700),
        "{free_after:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(observer.locks().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_process_blocks_others_only_until_the_ttl() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let ttl = Duration::from_millis(300);

    // The "process": its own runtime and pool, on its own thread. Dropping the runtime
    // kills every task at once, the release spawned from the guard's drop included.
    let gate = Gate::new();
    let sent = Instant::now();
    let process = {
        let (pool, gate) = (server.pool(), gate.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let holder = gated_router(
                &Locks::new(Redis::pool(pool).build().unwrap()).ttl(ttl),
                &gate,
            );
            runtime.spawn(async move { send(&holder, batch(&["crash:1"])).await });
            runtime.block_on(gate.wait_entered());
            drop(runtime);
        })
    };
    within(Duration::from_secs(5), "the process died", async {
        while !process.is_finished() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    process.join().unwrap();
    assert!(
        observer.get("lock:crash:1").is_some(),
        "the killed process released its key: nothing to test"
    );

    let runs = Arc::new(AtomicUsize::new(0));
    let survivor = counting_router(
        &Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(ttl),
        &runs,
    );
    let free_after = granted_after(&survivor, &["crash:1"], sent).await;
    eprintln!("crash liveness (killed runtime): free {free_after:?} after the holder's request");
    assert!(
        free_after >= ttl - Duration::from_millis(50),
        "{free_after:?}"
    );
    assert!(
        free_after < ttl + Duration::from_millis(700),
        "{free_after:?}"
    );
    assert!(observer.locks().is_empty());
}

// ---------------------------------------------------------------------------------------
// 6. Outage
// ---------------------------------------------------------------------------------------

const STORE_TIMEOUT: Duration = Duration::from_millis(300);

fn assert_unavailable(reply: &Reply) {
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.text()
    );
    let problem = reply.problem();
    assert_eq!(
        problem["detail"],
        "the lock service is unavailable; try again later"
    );
    assert!(reply.retry_after() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_server_gives_503_fast_and_the_layer_recovers_after_a_restart() {
    let mut server = RedisServer::start();
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap())
        .ttl(Duration::from_secs(5))
        .store_timeout(STORE_TIMEOUT);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    // An idle connection in the pool, so the next request finds a dead one.
    assert_eq!(send(&app, batch(&["o:1"])).await.status, StatusCode::OK);

    server.kill();
    for _ in 0..3 {
        let started = Instant::now();
        let reply = send(&app, batch(&["o:1", "o:2"])).await;
        let took = started.elapsed();
        eprintln!("outage (killed): 503 in {took:?}");
        assert_unavailable(&reply);
        assert!(
            took < STORE_TIMEOUT + Duration::from_millis(500),
            "{took:?}"
        );
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran without its locks"
    );

    server.restart();
    let observer = Observer::of(&server);
    let mut status = StatusCode::SERVICE_UNAVAILABLE;
    for _ in 0..20 {
        status = send(&app, batch(&["o:1", "o:2"])).await.status;
        if status == StatusCode::OK {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        status,
        StatusCode::OK,
        "the layer did not recover after a restart"
    );
    assert!(observer.locks().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_server_gives_503_within_the_store_timeout_and_leaves_no_key() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap())
        .ttl(Duration::from_secs(5))
        .store_timeout(STORE_TIMEOUT);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    assert_eq!(send(&app, batch(&["f:1"])).await.status, StatusCode::OK);

    server.pause();
    let started = Instant::now();
    let reply = send(&app, batch(&["f:1", "f:2"])).await;
    let took = started.elapsed();
    server.resume();
    eprintln!("outage (SIGSTOP): 503 in {took:?}");
    assert_unavailable(&reply);
    assert!(
        took >= STORE_TIMEOUT - Duration::from_millis(10),
        "{took:?}"
    );
    assert!(
        took < STORE_TIMEOUT + Duration::from_millis(500),
        "{took:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Whatever the frozen server had queued runs now; a second after the resume (well
    // under the 5 s TTL), nothing may hold a key.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        observer.locks().is_empty(),
        "left behind: {:?}",
        observer.locks()
    );
    assert_eq!(
        send(&app, batch(&["f:1", "f:2"])).await.status,
        StatusCode::OK
    );
    assert!(observer.locks().is_empty());
}

/// The ambiguous case: the acquisition reached the server and then stalled there, so the
/// layer cannot know whether it will apply. `CLIENT PAUSE .. WRITE` holds the script
/// (a write) while reads such as the pool's health check go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_acquisition_stalled_on_the_server_leaves_no_key_once_it_runs() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap())
        .ttl(Duration::from_secs(10))
        .store_timeout(STORE_TIMEOUT);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    assert_eq!(send(&app, batch(&["s:1"])).await.status, StatusCode::OK);

    observer.cmd::<()>(redis::cmd("CLIENT").arg("PAUSE").arg(700).arg("WRITE"));
    let started = Instant::now();
    let reply = send(&app, batch(&["s:1", "s:2"])).await;
    let took = started.elapsed();
    eprintln!("outage (CLIENT PAUSE WRITE): 503 in {took:?}");
    assert_unavailable(&reply);
    assert!(
        took < STORE_TIMEOUT + Duration::from_millis(500),
        "{took:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // The pause ends 700 ms after it began. Whether the stalled script runs then or not
    // (Redis drops a paused client's command when the client hangs up first), a second
    // later (far below the 10 s TTL) no key may be held.
    tokio::time::sleep(Duration::from_millis(1_400)).await;
    let left = observer.locks();
    let pttl: Vec<i64> = left.iter().map(|k| observer.pttl(k)).collect();
    eprintln!("outage (CLIENT PAUSE WRITE): 1.7 s after the request, left {left:?}, PTTL {pttl:?}");
    assert!(
        left.is_empty(),
        "an ambiguous acquisition left {left:?} (PTTL {pttl:?} ms) to expire with its TTL"
    );
    assert_eq!(
        send(&app, batch(&["s:1", "s:2"])).await.status,
        StatusCode::OK
    );
}

/// The ambiguous case for real: the acquisition is on the wire when the server freezes,
/// and it runs when the server thaws, long after the layer answered 503. The pool's
/// `post_create` hook freezes the server (SIGSTOP) right after connecting, so the script
/// is sent to a frozen server, deterministically.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_acquisition_sent_just_before_the_server_froze_is_released_after_it_thaws() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    // Load the scripts through another pool, so the frozen FCALL finds them.
    let runs = Arc::new(AtomicUsize::new(0));
    let warm = counting_router(
        &Locks::new(Redis::pool(server.pool()).build().unwrap()),
        &runs,
    );
    assert_eq!(send(&warm, batch(&["z:0"])).await.status, StatusCode::OK);
    let sets_before = observer.calls(&["set"]);

    let info: String = observer.cmd(redis::cmd("INFO").arg("server"));
    let pid = info
        .lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .unwrap()
        .trim()
        .to_owned();
    let frozen = Arc::new(AtomicUsize::new(0));
    let pool = {
        let frozen = frozen.clone();
        deadpool_redis::Config::from_url(server.url())
            .builder()
            .unwrap()
            .runtime(deadpool_redis::Runtime::Tokio1)
            .post_create(deadpool_redis::Hook::sync_fn(move |_, _| {
                if frozen.fetch_add(1, Ordering::SeqCst) == 0 {
                    let stopped = std::process::Command::new("kill")
                        .args(["-STOP", &pid])
                        .status();
                    assert!(stopped.is_ok_and(|s| s.success()));
                }
                Ok(())
            }))
            .build()
            .unwrap()
    };
    let locks = Locks::new(Redis::pool(pool).build().unwrap())
        .ttl(Duration::from_secs(10))
        .store_timeout(STORE_TIMEOUT);
    let app = counting_router(&locks, &runs);
    let started = Instant::now();
    let reply = send(&app, batch(&["z:1", "z:2"])).await;
    let took = started.elapsed();
    assert_eq!(
        frozen.load(Ordering::SeqCst),
        1,
        "the hook did not freeze the server"
    );
    eprintln!("outage (frozen after send): 503 in {took:?}");
    // The server stays frozen for longer than the store timeout, as in a long stall.
    tokio::time::sleep(Duration::from_millis(700)).await;
    server.resume();
    assert_unavailable(&reply);
    assert!(
        took < STORE_TIMEOUT + Duration::from_millis(500),
        "{took:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran without its locks"
    );

    // Within a second of the thaw, far below the 10 s TTL, the stalled script has run and
    // the cleanup must have followed it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        // Two keys, and the fencing counter.
        observer.calls(&["set"]),
        sets_before + 3,
        "the stalled acquisition never ran: the test proves nothing"
    );
    let left = observer.locks();
    let pttl: Vec<i64> = left.iter().map(|k| observer.pttl(k)).collect();
    eprintln!("outage (frozen after send): 1 s after the thaw, left {left:?}, PTTL {pttl:?}");
    assert!(
        left.is_empty(),
        "an acquisition whose outcome was unknown left {left:?} held (PTTL {pttl:?} ms) \
         until its TTL"
    );
    assert_eq!(
        send(&app, batch(&["z:1", "z:2"])).await.status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_that_cannot_connect_gives_503_fast() {
    let closed_port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let pool = deadpool_redis::Config::from_url(format!("redis://127.0.0.1:{closed_port}/"))
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let locks =
        Locks::new(Redis::pool(pool).build().unwrap()).store_timeout(Duration::from_secs(2));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    let started = Instant::now();
    let reply = send(&app, batch(&["n:1"])).await;
    let took = started.elapsed();
    eprintln!("outage (closed port): 503 in {took:?}");
    assert_unavailable(&reply);
    assert!(
        took < Duration::from_millis(500),
        "{took:?}: a refused connection is no wait"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

// ---------------------------------------------------------------------------------------
// 7. A server without the crate's functions
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_functions_load_again_after_function_flush() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    assert_eq!(send(&app, batch(&["ns:1"])).await.status, StatusCode::OK);

    // Acquire after a flush.
    observer.cmd::<()>(redis::cmd("FUNCTION").arg("FLUSH"));
    let reply = send(&app, batch(&["ns:1", "ns:2"])).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert!(observer.locks().is_empty());

    // Release after a flush that happened while the handler held the keys.
    let gate = Gate::new();
    let holder = gated_router(&locks, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["ns:3"])).await });
    gate.wait_entered().await;
    observer.cmd::<()>(redis::cmd("FUNCTION").arg("FLUSH"));
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert!(
        observer.locks().is_empty(),
        "the release did not load its function again: {:?}",
        observer.locks()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

// ---------------------------------------------------------------------------------------
// 8. Namespacing
// ---------------------------------------------------------------------------------------

const AWKWARD_KEYS: [&str; 10] = [
    "victim",
    "with space",
    "{braces}",
    "line\nbreak",
    "star*",
    "*",
    "ключ",
    "日本語",
    "tab\tand\"quote'",
    "?[a-z]",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_keys_live_only_under_the_prefix() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    observer.set("victim", "precious");

    let snapshot = Arc::new(Mutex::new(None));
    let handler = |snapshot: &Arc<Mutex<Option<BTreeSet<String>>>>, observer: &Observer| {
        let (snapshot, observer) = (snapshot.clone(), observer.clone());
        move |Extension(lease): Extension<Lease>| {
            let (snapshot, observer) = (snapshot.clone(), observer.clone());
            async move {
                *snapshot.lock().unwrap() = Some(observer.all_keys());
                lease
                    .keys()
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
                    .join("\u{0}")
            }
        }
    };

    for prefix in ["lock:", "tenant-a/"] {
        let locks = Locks::new(Redis::pool(server.pool()).build().unwrap())
            .ttl(Duration::from_secs(10))
            .prefix(prefix);
        let app = batch_router(&locks, handler(&snapshot, &observer));
        let reply = send(&app, batch(&AWKWARD_KEYS)).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());

        let mut expected: BTreeSet<String> = AWKWARD_KEYS
            .iter()
            .map(|k| format!("{prefix}{k}"))
            .collect();
        let seen = snapshot.lock().unwrap().take().expect("the handler ran");
        expected.insert("victim".to_owned());
        assert_eq!(
            seen, expected,
            "keys stored while the handler ran ({prefix})"
        );

        let mut sorted = AWKWARD_KEYS.to_vec();
        sorted.sort_unstable();
        assert_eq!(
            reply.text(),
            sorted.join("\u{0}"),
            "the lease lists keys without the prefix"
        );

        assert_eq!(
            observer.all_keys(),
            BTreeSet::from(["victim".to_owned()]),
            "after the request ({prefix})"
        );
    }
    assert_eq!(observer.get("victim").as_deref(), Some("precious"));
    assert_eq!(observer.pttl("victim"), -1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_victim_key_is_not_read_by_the_scripts() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    observer.cmd::<()>(
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg("allkeys-lfu"),
    );
    observer.set("victim", "precious");
    let frequency = || observer.cmd::<i64>(redis::cmd("OBJECT").arg("FREQ").arg("victim"));
    let before = frequency();
    let locks =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    for _ in 0..3 {
        assert_eq!(send(&app, batch(&["victim"])).await.status, StatusCode::OK);
    }
    assert_eq!(frequency(), before, "a lock request read the key `victim`");
    // Sanity: one GET moves the counter (from the initial 5, the first hit always counts).
    assert_eq!(observer.get("victim").as_deref(), Some("precious"));
    assert!(
        frequency() > before,
        "OBJECT FREQ does not see reads: the check above is void"
    );
    assert!(observer.locks().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefixes_are_separate_namespaces_and_conflicts_are_named_without_them() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let tenant = Locks::new(Redis::pool(server.pool()).build().unwrap())
        .ttl(Duration::from_secs(10))
        .prefix("tenant-a/");
    let default =
        Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10));

    let gate = Gate::new();
    let holder = gated_router(&tenant, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["{braces}", "ключ"])).await });
    gate.wait_entered().await;

    let runs = Arc::new(AtomicUsize::new(0));
    let same_namespace = counting_router(&tenant, &runs);
    let refused = send(&same_namespace, batch(&["ключ", "other"])).await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["ключ"])
    );

    let other_namespace = counting_router(&default, &runs);
    let reply = send(&other_namespace, batch(&["{braces}", "ключ"])).await;
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "another prefix is another namespace"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert!(observer.all_keys().is_empty(), "{:?}", observer.all_keys());
}

// ---------------------------------------------------------------------------------------
// 9. Sequential requests
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sequential_requests_never_meet_their_own_previous_keys() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let runs = Arc::new(AtomicUsize::new(0));
    let router = |locks: Locks| {
        let runs = runs.clone();
        Router::new().route(
            "/orders/{id}",
            put(move |Extension(lease): Extension<Lease>| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    lease.keys().collect::<Vec<_>>().join(",")
                }
            })
            .layer(locks.layer(keys::path("order"))),
        )
    };
    // Two processes, alternately, as a client behind a load balancer would see them.
    let apps = [
        router(
            Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10)),
        ),
        router(
            Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(10)),
        ),
    ];
    let started = Instant::now();
    for i in 0..50 {
        let request = Request::put("/orders/7").body(Body::empty()).unwrap();
        let reply = send(&apps[i % 2], request).await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "request {i}: {}",
            reply.text()
        );
        assert_eq!(reply.text(), "order:7");
    }
    eprintln!("sequential: 50 requests in {:?}", started.elapsed());
    assert_eq!(runs.load(Ordering::SeqCst), 50);
    assert!(observer.locks().is_empty());

    // The same through one service driven with ready().call().
    let mut service = apps[0].clone();
    for i in 0..10 {
        let request = Request::put("/orders/7").body(Body::empty()).unwrap();
        let response = ServiceExt::<Request<Body>>::ready(&mut service)
            .await
            .unwrap()
            .call(request)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK, "request {i}");
    }
    assert!(observer.locks().is_empty());
}

// ---------------------------------------------------------------------------------------
// 10. The lease
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lease_lists_the_keys_and_expires_about_a_ttl_from_now() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let ttl = Duration::from_secs(2);
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(ttl);

    let seen = Arc::new(Mutex::new(None));
    let app = {
        let (seen, observer) = (seen.clone(), observer.clone());
        batch_router(&locks, move |Extension(lease): Extension<Lease>| {
            let (seen, observer) = (seen.clone(), observer.clone());
            async move {
                let now = Instant::now();
                let remaining = lease.expires_at().saturating_duration_since(now);
                let keys: Vec<String> = lease.keys().map(str::to_owned).collect();
                let pttl = keys
                    .iter()
                    .map(|k| observer.pttl(&format!("lock:{k}")))
                    .min()
                    .unwrap();
                *seen.lock().unwrap() = Some((keys, remaining, pttl, now.elapsed()));
            }
        })
    };
    let sent = Instant::now();
    let reply = send(&app, batch(&["b", "a", "b", "c"])).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let round_trip = sent.elapsed();

    let (keys, remaining, pttl, pttl_took) = seen.lock().unwrap().take().expect("the handler ran");
    assert_eq!(
        keys,
        ["a", "b", "c"],
        "sorted, deduplicated, without the prefix"
    );
    assert!(remaining <= ttl, "{remaining:?}");
    assert!(
        remaining >= ttl - round_trip,
        "{remaining:?} after {round_trip:?}"
    );
    // The lease never promises more than the store keeps: the store's expiry is not earlier.
    let store_left = Duration::from_millis(u64::try_from(pttl).unwrap()) + pttl_took;
    assert!(
        store_left + Duration::from_millis(2) >= remaining,
        "the store expires at +{store_left:?}, the lease at +{remaining:?}"
    );
    assert!(observer.locks().is_empty());
}

/// redis-rs gives up on a reply after 500 ms by default; a batch that Redis takes longer
/// over (here: a script held 1.5 s by `CLIENT PAUSE`) must still be granted within the
/// layer's own store timeout.
#[tokio::test]
async fn a_slow_script_is_bounded_by_the_store_timeout_not_by_the_clients_default() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let runs = Arc::new(AtomicUsize::new(0));
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap())
        .store_timeout(Duration::from_secs(3));
    let app = counting_router(&locks, &runs);
    // Load the scripts and open the shared connection first.
    assert_eq!(send(&app, batch(&["warm"])).await.status, StatusCode::OK);

    observer.cmd::<()>(redis::cmd("CLIENT").arg("PAUSE").arg(1500).arg("WRITE"));
    let started = Instant::now();
    let reply = send(&app, batch(&["slow:1", "slow:2"])).await;
    let took = started.elapsed();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert!(
        took >= Duration::from_millis(700),
        "the pause did not hold the script: {took:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert!(observer.locks().is_empty(), "{:?}", observer.locks());
}

/// While the store is down, every request gets its 503, and the log gets one error when
/// the outage starts, not one per request (a summary follows every 10 s, and a line at
/// the first answer 10 s after the last failure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_is_logged_once_not_once_per_request() {
    crate::support::logs::errors_logged();
    let mut server = RedisServer::start();
    let locks = Locks::new(Redis::url(server.url()).build().unwrap())
        .store_timeout(Duration::from_millis(300));
    let app = batch_router(&locks, || async { "ok" });
    // Thirteen keys: a count no other test uses, to find this test's lines in the log.
    let keys: Vec<String> = (0..13).map(|i| format!("outage-{i}")).collect();
    assert_eq!(send(&app, batch(&keys)).await.status, StatusCode::OK);

    server.kill();
    for _ in 0..20 {
        let refused = send(&app, batch(&keys)).await;
        assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(refused.retry_after() >= 1);
    }
    let logged = crate::support::logs::errors_logged();
    let started = logged
        .lines()
        .filter(|l| l.contains("the lock store failed") && l.contains("keys=13"))
        .count();
    assert_eq!(started, 1, "{logged}");

    server.restart();
    // The pool reconnects on its own: a few attempts at most.
    let mut answered = false;
    for _ in 0..100 {
        if send(&app, batch(&keys)).await.status == StatusCode::OK {
            answered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(answered, "the store never answered again");
}

/// Releases that fail while the store is down (retried until their keys expire) count in
/// its outage: one error, not a warning per release and attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_that_fail_in_an_outage_are_logged_with_it_not_once_per_attempt() {
    let logged_before = crate::support::logs::warnings_logged().len();
    let mut server = RedisServer::start();
    let locks = Locks::new(Redis::url(server.url()).build().unwrap())
        .ttl(Duration::from_secs(2))
        .store_timeout(Duration::from_millis(300));
    let gate = Gate::new();
    let app = batch_router(&locks, gated_handler(&gate));
    // Twenty-three keys: a count no other test uses, to find this test's lines in the log.
    let keys: Vec<String> = (0..23).map(|i| format!("release-outage-{i}")).collect();
    let request = tokio::spawn(async move { send(&app, batch(&keys)).await });
    gate.wait_entered().await;

    server.kill();
    gate.open();
    assert_eq!(request.await.unwrap().status, StatusCode::OK);
    // The release is retried, 50 ms to 1 s apart, until its keys would have expired.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let logged = crate::support::logs::warnings_logged();
    let lines: Vec<&str> = logged[logged_before..]
        .lines()
        .filter(|l| l.ends_with(" keys=23") || l.contains(" keys=23 "))
        .collect();
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0].contains("the lock store failed"), "{}", lines[0]);
}

/// A release listener whose server went away says so once, not at each attempt to
/// subscribe again (100 ms to 5 s apart: a line every 5 s for as long as the server is
/// away), and subscribes again when the server is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_whose_server_went_away_says_so_once_and_subscribes_again() {
    let logged_before = crate::support::logs::warnings_logged().len();
    let mut server = RedisServer::start();
    let subscribers = |server: &RedisServer| -> i64 {
        let counts: (String, i64) = Observer::of(server).cmd(
            redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg("tower-batch-lock:released"),
        );
        counts.1
    };
    let _locks = Locks::new(Redis::url(server.url()).build().unwrap());
    let subscribed = poll_every(Duration::from_millis(20), Duration::from_secs(3), || {
        subscribers(&server) == 1
    });
    assert!(subscribed.await.is_some(), "the listener never subscribed");

    server.kill();
    // Attempts about 0.1, 0.3, 0.7, 1.5 and 3.1 s after the loss.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let at = format!("at=127.0.0.1:{}", server.port());
    let logged = crate::support::logs::warnings_logged();
    let lines: Vec<&str> = logged[logged_before..]
        .lines()
        .filter(|line| line.contains(&at))
        .collect();
    assert_eq!(lines.len(), 1, "{lines:#?}");

    server.restart();
    let again = poll_every(Duration::from_millis(50), Duration::from_secs(8), || {
        subscribers(&server) == 1
    });
    assert!(again.await.is_some(), "the listener never subscribed again");
}

/// A 5 s stall under 64 clients: each caller that times out retires the shared connection,
/// and the next connection is made by one caller while the others wait for it, not by each
/// of them (the pool's bound, 8 here, does not count connections taken out of it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stall_under_load_opens_a_few_connections_not_one_a_caller() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let received = || -> u64 {
        let info: String = observer.cmd(redis::cmd("INFO").arg("stats"));
        let field = info
            .lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"));
        field.unwrap().trim().parse().unwrap()
    };
    let pool = server.pool_of(8);
    let locks =
        Locks::new(Redis::pool(pool).build().unwrap()).store_timeout(Duration::from_millis(300));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    assert_eq!(send(&app, batch(&["s:warm"])).await.status, StatusCode::OK);

    let before = received();
    let stop_at = Instant::now() + Duration::from_secs(7);
    let clients: Vec<_> = (0..64)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move {
                let mut sent = 0;
                while Instant::now() < stop_at && sent < 10_000 {
                    send(&app, batch(&[format!("s:{i}")])).await;
                    sent += 1;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.pause();
    tokio::time::sleep(Duration::from_secs(5)).await;
    server.resume();
    for client in clients {
        client.await.unwrap();
    }
    // The observer's own connections: one for each `received()`.
    let opened = received() - before - 1;
    eprintln!("a 5 s stall under 64 clients opened {opened} connections");
    assert!(
        opened <= 8 + 4,
        "{opened} connections opened for a 5 s stall"
    );
    assert_eq!(send(&app, batch(&["s:after"])).await.status, StatusCode::OK);
}

/// The ACL rules that `store::Redis`'s docs list, read from its source.
fn documented_acl_rules() -> Vec<String> {
    let source = include_str!("../../src/store/redis/builder.rs");
    let start = source
        .find("**ACL.** The user needs")
        .expect("the docs list the ACL");
    let bullet = &source[start..];
    let bullet = &bullet[..bullet.find("/// - **").expect("another item follows")];
    bullet
        .split(|c: char| c.is_whitespace() || c == '`' || c == '(' || c == ')')
        .filter(|word| word.starts_with('+') || word.starts_with('~') || word.starts_with('&'))
        .map(str::to_owned)
        .collect()
}

/// A Redis user with the documented rules and nothing more serves every part of the crate
/// that runs on one Redis: the check, grants, renewal, waiting (woken by a release, which
/// is announced), the operator's view and forced release, and the idempotency layer; and
/// nothing is left behind. Each rule but those for `replicas` is needed: without any one,
/// this fails (tried one by one when the list was written).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_user_with_the_documented_acl_rules_serves_everything() {
    let server = RedisServer::start();
    let rules = documented_acl_rules();
    assert!(rules.len() > 10, "{rules:?}");
    serve_everything_as(&server, "locker", &rules).await;
}

/// Makes a user `name` with `rules` alone, and runs every part of the crate as it.
async fn serve_everything_as(server: &RedisServer, name: &str, rules: &[String]) {
    let mut setuser = redis::cmd("ACL");
    setuser
        .arg("SETUSER")
        .arg(name)
        .arg("on")
        .arg(">secret")
        .arg("resetkeys")
        .arg("resetchannels")
        .arg("-@all");
    for rule in rules {
        setuser.arg(rule);
    }
    Observer::of(server).cmd::<()>(&mut setuser);
    let url = format!("redis://{name}:secret@127.0.0.1:{}/", server.port());
    // A short TTL, renewed while the holder holds on for longer.
    let locks = Locks::new(Redis::url(&url).build().unwrap())
        .prefix(format!("lock:{name}:"))
        .ttl(Duration::from_millis(300))
        .wait(Wait::up_to(Duration::from_secs(5)));

    locks.check().await.expect("the check runs as the user");
    let observer = Observer::of(server);
    let subscribed = poll_every(Duration::from_millis(20), Duration::from_secs(2), || {
        let counts: Vec<redis::Value> = observer.cmd(
            redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg("tower-batch-lock:released"),
        );
        counts.get(1) != Some(&redis::Value::Int(0))
    })
    .await;
    assert!(
        subscribed.is_some(),
        "the store listens for releases as the user"
    );
    // And announces them, for other processes' waiters.
    let mut listener = observer.connection();
    let announced = std::thread::spawn(move || {
        let mut pubsub = listener.as_pubsub();
        pubsub.subscribe("tower-batch-lock:released").unwrap();
        pubsub
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        pubsub.get_message().is_ok()
    });
    let (gate, held) = hold(&locks, "a").await;
    let (other_gate, other_held) = hold(&locks, "c").await;
    // A held key and a free one: the script reads them differently.
    let states = locks
        .inspect(["a", "free"])
        .await
        .expect("inspect runs as the user");
    assert_eq!(states.len(), 2);
    // Waiters with a batch big enough to keep their place in line with a claim: one is
    // granted after the holder, one gives up (and withdraws) before.
    let big: String = std::iter::once("a".to_owned())
        .chain((0..63).map(|i| format!("more:{i:02}")))
        .collect::<Vec<_>>()
        .join(",");
    let waiter_app = Router::new().route("/", post(|| async {}).layer(locks.layer(header_keys)));
    let waiter = tokio::spawn({
        let big = big.clone();
        async move { send(&waiter_app, post_keys("/", &big)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let quitter = locks.clone().wait(Wait::up_to(Duration::from_millis(200)));
    let quitter_app = Router::new().route("/", post(|| async {}).layer(quitter.layer(header_keys)));
    let gave_up = send(&quitter_app, post_keys("/", &big)).await;
    assert_eq!(gave_up.status, StatusCode::CONFLICT, "{}", gave_up.text());
    // A later claim that the first keeps out (they share the 63 keys): the release of its
    // other key asks whether an earlier claim keeps it out, and leaves it asleep.
    let later_app = Router::new().route("/", post(|| async {}).layer(locks.layer(header_keys)));
    let later = tokio::spawn({
        let keys = big.replacen('a', "c", 1);
        async move { send(&later_app, post_keys("/", &keys)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    other_gate.open();
    assert_eq!(other_held.await.unwrap().status, StatusCode::OK);
    // Released at once (a failed release would leave it until its TTL, 200 ms or more
    // away: it is renewed every third of it).
    let released = poll_every(Duration::from_millis(5), Duration::from_millis(100), || {
        observer.get(&format!("lock:{name}:c")).is_none()
    })
    .await;
    assert!(released.is_some(), "released as the user");
    assert!(!gate.lease().is_lost(), "renewed as the user");
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let woken = waiter.await.unwrap();
    assert_eq!(woken.status, StatusCode::OK, "{}", woken.text());
    let woken = later.await.unwrap();
    assert_eq!(woken.status, StatusCode::OK, "{}", woken.text());
    assert!(
        announced.join().unwrap(),
        "a release is announced as the user"
    );

    let freed = locks.force_release(["none"], "the ACL test").await;
    assert_eq!(freed.expect("force_release runs as the user"), 0);
    // Every release ran (a failed one would leave its key until the TTL); the prefix
    // alone is the namespace's fencing counter.
    let prefix = format!("lock:{name}:");
    let mut left = observer.under(&prefix);
    left.remove(&prefix);
    left.extend(observer.under(CLAIMS));
    assert!(left.is_empty(), "left behind: {left:?}");

    #[cfg(feature = "idempotency")]
    {
        let app = Router::new().route(
            "/orders",
            post(|| async { "created" })
                .layer(locks.layer(header_keys))
                .layer(locks.idempotency()),
        );
        let order = || {
            Request::post("/orders")
                .header("x-keys", "b")
                .header("idempotency-key", "\"acl-1\"")
                .body(Body::empty())
                .unwrap()
        };
        let first = send(&app, order()).await;
        assert_eq!(first.status, StatusCode::OK, "{}", first.text());
        let replayed = send(&app, order()).await;
        assert_eq!(replayed.headers["idempotent-replayed"], "true");
    }
    // No command was refused anywhere (a script refused a command midway keeps the writes
    // before it, and its caller only logs the failure: a release that frees its keys and
    // fails to wake anyone, as when the rule for the claims' overlap was missing).
    let refused = observer.refused_commands();
    assert!(refused.is_empty(), "{refused:?}");
}
