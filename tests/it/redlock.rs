//! The Redlock store, driven through the layer: axum routers called with `oneshot`, on 3
//! or 5 real `redis-server` masters started by `support` on free loopback ports, which the
//! tests kill, freeze (SIGSTOP), slow down (`CLIENT PAUSE`) and restart empty.
//!
//! Every test starts its own masters, uses short TTLs, and bounds every wait.

use std::{
    collections::BTreeSet,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use axum::{body::Body, Router};
use http::{Request, StatusCode};
use tower_batch_lock::{store::Redlock, Locks, Wait};

use crate::support::{
    clock_floor,
    handlers::{counting_handler, gated_handler, ledger_handler, Gate, Ledger},
    http::{batch, batch_router, fence_router, poll_every, send, within, Fence, Reply},
    LockValue, Observer, RedisServer, Rng,
};

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// The node timeout of most tests: long enough for a loaded CI machine, short enough that
/// waiting for it shows.
const NODE_TIMEOUT: Duration = Duration::from_millis(200);

/// Independent masters, each a `redis-server` of its own.
struct Masters {
    servers: Vec<RedisServer>,
}

impl Masters {
    fn start(count: usize) -> Self {
        Self {
            servers: (0..count).map(|_| RedisServer::start()).collect(),
        }
    }

    fn urls(&self) -> Vec<String> {
        self.servers.iter().map(RedisServer::url).collect()
    }

    /// A `Locks` of its own on these masters: one "process".
    fn locks(&self, node_timeout: Duration) -> Locks {
        Locks::new(
            Redlock::new(self.urls())
                .node_timeout(node_timeout)
                .build()
                .expect("valid Redlock URLs"),
        )
    }

    fn cmd<T: redis::FromRedisValue>(&self, master: usize, cmd: &mut redis::Cmd) -> T {
        cmd.query(&mut self.servers[master].connection()).unwrap()
    }

    /// The lock keys on one master (not its fencing counter, `lock:` itself).
    fn locks_on(&self, master: usize) -> BTreeSet<String> {
        self.cmd::<Vec<String>>(master, redis::cmd("KEYS").arg("lock:?*"))
            .into_iter()
            .collect()
    }

    /// The lock keys on every master, one set per master.
    fn all_locks(&self) -> Vec<BTreeSet<String>> {
        (0..self.servers.len()).map(|m| self.locks_on(m)).collect()
    }

    fn empty(&self) -> bool {
        self.all_locks().iter().all(BTreeSet::is_empty)
    }

    /// What a response promises of its release: a majority of the masters hold none of its
    /// keys any more, and the others follow within moments (their release may still run).
    async fn assert_released(&self) {
        let locks = self.all_locks();
        let free = locks.iter().filter(|l| l.is_empty()).count();
        assert!(
            free > self.servers.len() / 2,
            "not released by a majority: {locks:?}"
        );
        let all = eventually(Duration::from_secs(1), || self.empty()).await;
        assert!(
            all.is_some(),
            "not released everywhere: {:?}",
            self.all_locks()
        );
    }

    fn set(&self, master: usize, key: &str, value: &str) {
        self.cmd::<()>(master, redis::cmd("SET").arg(key).arg(value));
    }

    /// The fencing counter of the default namespace on one master.
    fn counter(&self, master: usize) -> u64 {
        self.cmd::<Option<u64>>(master, redis::cmd("GET").arg("lock:"))
            .unwrap_or(0)
    }

    fn pttl(&self, master: usize, key: &str) -> i64 {
        self.cmd(master, redis::cmd("PTTL").arg(key))
    }
}

/// A route whose handler counts its runs.
fn counting_router(locks: &Locks, runs: &Arc<AtomicUsize>) -> Router {
    batch_router(locks, counting_handler(runs))
}

/// Sends and times a request.
async fn timed(app: &Router, request: Request<Body>) -> (Reply, Duration) {
    let started = Instant::now();
    let reply = send(app, request).await;
    (reply, started.elapsed())
}

/// Polls every 10 ms, so that checks of every master do not load them: see
/// [`poll_every`].
async fn eventually(limit: Duration, check: impl FnMut() -> bool) -> Option<Duration> {
    poll_every(Duration::from_millis(10), limit, check).await
}

fn assert_unavailable(reply: &Reply) {
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.text()
    );
    assert_eq!(
        reply.problem()["detail"],
        "the lock service is unavailable; try again later"
    );
}

fn gated_router(locks: &Locks, gate: &Arc<Gate>) -> Router {
    batch_router(locks, gated_handler(gate))
}

// ---------------------------------------------------------------------------------------
// Mutual exclusion, and fencing tokens in the order of the critical sections
// ---------------------------------------------------------------------------------------

fn ledger_router(locks: &Locks, ledger: &Arc<Ledger>) -> Router {
    batch_router(locks, ledger_handler(ledger))
}

/// Two "processes" (two `Locks` on their own pools) send `requests` random, overlapping
/// batches to the same masters at once, retrying on 409. (A node timeout of 1 s: a debug
/// build on two busy cores can starve a task for longer than the usual 200 ms.)
async fn two_routers_never_overlap(masters: &Masters, requests: usize) {
    let ledger = Arc::new(Ledger::default());
    let ttl = Duration::from_secs(10);
    let apps = [
        ledger_router(&masters.locks(Duration::from_secs(1)).ttl(ttl), &ledger),
        ledger_router(&masters.locks(Duration::from_secs(1)).ttl(ttl), &ledger),
    ];
    const KEYS: u64 = 30;
    let started = Instant::now();
    let tasks: Vec<_> = (0..requests)
        .map(|i| {
            let app = apps[i % 2].clone();
            tokio::spawn(async move {
                let mut rng = Rng::seeded(i as u64 + 1);
                let size = 1 + rng.below(4);
                let keys: Vec<String> =
                    (0..size).map(|_| format!("r{}", rng.below(KEYS))).collect();
                let mut conflicts = 0;
                for _ in 0..300 {
                    let reply = send(&app, batch(&keys)).await;
                    match reply.status {
                        StatusCode::OK => return (true, conflicts),
                        StatusCode::CONFLICT => {
                            conflicts += 1;
                            tokio::time::sleep(Duration::from_millis(1 + rng.below(4))).await;
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
    let granted = outcomes.iter().filter(|o| o.as_ref().unwrap().0).count();
    let conflicts: usize = outcomes.iter().map(|o| o.as_ref().unwrap().1).sum();
    eprintln!(
        "redlock exclusion ({} masters): {granted}/{requests} granted, {conflicts} 409s, {:?}",
        masters.servers.len(),
        started.elapsed()
    );
    assert_eq!(
        ledger.overlaps.load(Ordering::SeqCst),
        0,
        "two holders were inside the same key at once"
    );
    assert!(granted >= requests * 9 / 10, "only {granted} granted");
    assert!(conflicts > 0, "the key sets were meant to contend");

    let visits = std::mem::take(&mut *ledger.visits.lock().unwrap());
    let mut disjoint_overlaps = 0;
    for (i, a) in visits.iter().enumerate() {
        for b in &visits[i + 1..] {
            let intersect = a.keys.iter().any(|k| b.keys.contains(k));
            let overlap = a.enter < b.exit && b.enter < a.exit;
            assert!(!(intersect && overlap), "overlapped: {a:?} and {b:?}");
            if intersect {
                // The later critical section carries the larger token.
                let (first, second) = if a.exit <= b.enter { (a, b) } else { (b, a) };
                assert!(
                    first.fence < second.fence,
                    "fencing tokens out of order: {first:?} then {second:?}"
                );
            } else if overlap {
                disjoint_overlaps += 1;
            }
        }
    }
    assert!(disjoint_overlaps > 0, "disjoint batches never ran together");
    let released = eventually(Duration::from_secs(2), || masters.empty()).await;
    assert!(released.is_some(), "left behind: {:?}", masters.all_locks());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_batches_never_run_together_across_two_routers_on_three_masters() {
    two_routers_never_overlap(&Masters::start(3), 120).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_batches_never_run_together_across_two_routers_on_five_masters() {
    two_routers_never_overlap(&Masters::start(5), 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_batch_is_on_every_master_and_an_intersecting_one_is_refused_by_name() {
    let masters = Masters::start(3);
    let (one, other) = (masters.locks(NODE_TIMEOUT), masters.locks(NODE_TIMEOUT));
    let gate = Gate::new();
    let holder = gated_router(&one, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["x", "y"])).await });
    gate.wait_entered().await;
    let expected = BTreeSet::from(["lock:x".to_owned(), "lock:y".to_owned()]);
    // The third master's grant is not waited for, but it is not long behind.
    let everywhere = eventually(Duration::from_secs(1), || {
        masters.all_locks().iter().all(|l| *l == expected)
    })
    .await;
    assert!(everywhere.is_some(), "{:?}", masters.all_locks());
    // The same single hold of one owner everywhere.
    let holds: BTreeSet<String> = (0..3)
        .map(|m| masters.cmd(m, redis::cmd("GET").arg("lock:x")))
        .collect();
    assert_eq!(
        holds.len(),
        1,
        "one hold, of one owner, on every master: {holds:?}"
    );
    let value = LockValue::parse(holds.first().unwrap()).unwrap();
    assert_eq!(value.holds.len(), 1, "{holds:?}");

    let runs = Arc::new(AtomicUsize::new(0));
    let contender = counting_router(&other, &runs);
    let refused = send(&contender, batch(&["y", "z"])).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["y"])
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert!(
        masters.all_locks().iter().all(|l| *l == expected),
        "the refused batch left a key: {:?}",
        masters.all_locks()
    );

    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    masters.assert_released().await;
    assert_eq!(
        send(&contender, batch(&["y", "z"])).await.status,
        StatusCode::OK
    );
    masters.assert_released().await;
}

// ---------------------------------------------------------------------------------------
// Masters down, frozen, slow
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_minority_killed_keeps_granting_and_a_majority_killed_answers_503_fast() {
    let mut masters = Masters::start(5);
    let locks = masters.locks(NODE_TIMEOUT).ttl(Duration::from_secs(5));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    // Idle connections in every pool, so that the dead masters' are found dead.
    assert_eq!(send(&app, batch(&["k:0"])).await.status, StatusCode::OK);

    masters.servers[0].kill();
    masters.servers[1].kill();
    for i in 1..=5 {
        let (reply, took) = timed(&app, batch(&[format!("k:{i}"), "k:shared".to_owned()])).await;
        eprintln!(
            "redlock, 2 of 5 masters killed: {} in {took:?}",
            reply.status
        );
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert!(
            took < NODE_TIMEOUT,
            "a refused connection is no wait: {took:?}"
        );
    }
    let gate = Gate::new();
    let holder = gated_router(&locks, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["k:held"])).await });
    gate.wait_entered().await;
    let on_live = eventually(Duration::from_secs(1), || {
        (2..5).all(|m| masters.locks_on(m) == BTreeSet::from(["lock:k:held".to_owned()]))
    })
    .await;
    assert!(
        on_live.is_some(),
        "{:?}",
        (2..5).map(|m| masters.locks_on(m)).collect::<Vec<_>>()
    );
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);

    masters.servers[2].kill();
    let before = runs.load(Ordering::SeqCst);
    for _ in 0..3 {
        let (reply, took) = timed(&app, batch(&["k:1", "k:2"])).await;
        eprintln!("redlock, 3 of 5 masters killed: 503 in {took:?}");
        assert_unavailable(&reply);
        assert!(took < NODE_TIMEOUT, "{took:?}: not within the node timeout");
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        before,
        "the handler ran without a majority"
    );
    assert!(
        masters.locks_on(3).is_empty() && masters.locks_on(4).is_empty(),
        "a failed quorum left keys on the live masters"
    );

    // Back to a majority (restarted empty): granted again.
    masters.servers[0].restart();
    let mut status = StatusCode::SERVICE_UNAVAILABLE;
    for _ in 0..20 {
        status = send(&app, batch(&["k:1", "k:2"])).await.status;
        if status == StatusCode::OK {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        status,
        StatusCode::OK,
        "no recovery once a majority is back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_master_holds_no_request_up_beyond_the_node_timeout() {
    let masters = Masters::start(3);
    let locks = masters.locks(NODE_TIMEOUT).ttl(Duration::from_secs(5));
    let entered = Arc::new(Mutex::new(None));
    let app = {
        let entered = entered.clone();
        batch_router(&locks, move || {
            let entered = entered.clone();
            async move { *entered.lock().unwrap() = Some(Instant::now()) }
        })
    };
    assert_eq!(send(&app, batch(&["f:0"])).await.status, StatusCode::OK);

    masters.servers[2].pause();
    let mut slowest = Duration::ZERO;
    for i in 1..=5 {
        let sent = Instant::now();
        let reply = send(&app, batch(&[format!("f:{i}"), "f:shared".to_owned()])).await;
        let took = sent.elapsed();
        let to_handler = entered.lock().unwrap().take().expect("the handler ran") - sent;
        eprintln!("redlock, 1 of 3 masters frozen: 200 in {took:?}, handler after {to_handler:?}");
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        // The acquisition does not wait for the frozen master at all once two granted; the
        // release waits for it at most the node timeout.
        assert!(to_handler < NODE_TIMEOUT / 2, "{to_handler:?}");
        slowest = slowest.max(took);
    }
    masters.servers[2].resume();
    assert!(
        slowest < NODE_TIMEOUT + Duration::from_millis(150),
        "a request was held up {slowest:?} by a frozen master (node timeout {NODE_TIMEOUT:?})"
    );
    // What the frozen master had queued runs now, and the background releases follow.
    let cleaned = eventually(Duration::from_secs(3), || masters.empty()).await;
    assert!(cleaned.is_some(), "left behind: {:?}", masters.all_locks());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_majority_answers_503_within_the_node_timeout_and_leaves_no_key() {
    let masters = Masters::start(5);
    let locks = masters.locks(NODE_TIMEOUT).ttl(Duration::from_secs(10));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    assert_eq!(send(&app, batch(&["z:0"])).await.status, StatusCode::OK);

    for m in 0..3 {
        masters.servers[m].pause();
    }
    let (reply, took) = timed(&app, batch(&["z:1", "z:2"])).await;
    let live_after = (masters.locks_on(3), masters.locks_on(4));
    for m in 0..3 {
        masters.servers[m].resume();
    }
    eprintln!("redlock, 3 of 5 masters frozen: 503 in {took:?}");
    assert_unavailable(&reply);
    assert!(took >= NODE_TIMEOUT - Duration::from_millis(10), "{took:?}");
    assert!(took < NODE_TIMEOUT + Duration::from_millis(150), "{took:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(
        live_after.0.is_empty() && live_after.1.is_empty(),
        "the live masters kept keys of a failed quorum: {live_after:?}"
    );
    // The frozen masters run the acquisition they had queued when they thaw; the
    // background release follows it, long before the 10 s TTL.
    let cleaned = eventually(Duration::from_secs(3), || masters.empty()).await;
    assert!(cleaned.is_some(), "left behind: {:?}", masters.all_locks());
    assert_eq!(
        send(&app, batch(&["z:1", "z:2"])).await.status,
        StatusCode::OK
    );
}

// ---------------------------------------------------------------------------------------
// All or nothing, on every master
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_failed_quorum_no_master_keeps_any_key_of_the_batch() {
    let mut masters = Masters::start(3);
    let locks = masters.locks(NODE_TIMEOUT).ttl(Duration::from_secs(10));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    let skus: Vec<String> = (0..3_000).map(|i| format!("sku:{i}")).collect();

    // Someone else holds one key on two masters: the third grants all 3,000 keys, and
    // must give them all back.
    masters.set(0, "lock:sku:999", "someone-else");
    masters.set(1, "lock:sku:999", "someone-else");
    let (refused, took) = timed(&app, batch(&skus)).await;
    let left = masters.all_locks();
    eprintln!("redlock, 3,000 keys refused by 2 of 3 masters: 409 in {took:?}");
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
    assert_eq!(
        refused.problem()["conflicting_keys"],
        serde_json::json!(["sku:999"])
    );
    let foreign = BTreeSet::from(["lock:sku:999".to_owned()]);
    assert_eq!(left, [foreign.clone(), foreign.clone(), BTreeSet::new()]);

    // One master refuses, one is down, one grants: still contention (a majority
    // answered), still nothing left.
    masters.set(2, "lock:sku:999", "someone-else");
    masters.cmd::<()>(0, redis::cmd("DEL").arg("lock:sku:999"));
    masters.cmd::<()>(1, redis::cmd("DEL").arg("lock:sku:999"));
    masters.servers[1].kill();
    let refused = send(&app, batch(&skus)).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
    assert!(
        masters.locks_on(0).is_empty(),
        "{} keys left",
        masters.locks_on(0).len()
    );
    assert_eq!(masters.locks_on(2), foreign);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_acquisition_slower_than_its_validity_fails_and_rolls_back() {
    let mut masters = Masters::start(3);
    // validity = 300 - (3 + 2) = 295 ms; the node timeout lets a master answer in 1 s.
    let ttl = Duration::from_millis(300);
    let locks = masters
        .locks(Duration::from_secs(1))
        .ttl(ttl)
        .store_timeout(Duration::from_secs(3));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    assert_eq!(send(&app, batch(&["v:0"])).await.status, StatusCode::OK);
    masters.servers[2].kill();
    let pause = |master: usize, ms: u64| {
        masters.cmd::<()>(
            master,
            redis::cmd("CLIENT").arg("PAUSE").arg(ms).arg("WRITE"),
        );
    };

    // Control: the two live masters grant after 100 and 150 ms, within the validity.
    pause(0, 100);
    pause(1, 150);
    let (reply, took) = timed(&app, batch(&["v:1", "v:2"])).await;
    eprintln!(
        "redlock, majority after ~150 ms of a 295 ms validity: {} in {took:?}",
        reply.status
    );
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // The majority completes after ~400 ms: the masters grant (their scripts run when the
    // pause ends), and the layer must take it all back and answer 503. Without a rollback,
    // master 0's keys would live until ~550 ms and master 1's until ~700 ms.
    pause(0, 250);
    pause(1, 400);
    let (reply, took) = timed(&app, batch(&["v:1", "v:2"])).await;
    let left = (masters.locks_on(0), masters.locks_on(1));
    let pttl = masters.pttl(1, "lock:v:1");
    eprintln!(
        "redlock, majority after ~400 ms of a 295 ms validity: {} in {took:?}, left {left:?}",
        reply.status
    );
    assert_unavailable(&reply);
    assert!(
        took >= Duration::from_millis(390),
        "{took:?}: the masters were not slow"
    );
    assert!(took < Duration::from_millis(900), "{took:?}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the handler ran on an expired lock"
    );
    assert!(
        left.0.is_empty() && left.1.is_empty(),
        "a grant that came too late was not rolled back: {left:?} (PTTL {pttl})"
    );
}

// ---------------------------------------------------------------------------------------
// The lease: validity, renewal, restarts
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lease_expires_at_the_validity_deadline_before_any_master_lets_go() {
    let masters = Masters::start(3);
    let ttl = Duration::from_secs(2);
    let drift = ttl / 100 + Duration::from_millis(2);
    let locks = masters.locks(NODE_TIMEOUT).ttl(ttl);
    let gate = Gate::new();
    let app = gated_router(&locks, &gate);
    let sent = Instant::now();
    let held = tokio::spawn(async move { send(&app, batch(&["l:1"])).await });
    gate.wait_entered().await;
    let lease = gate.lease();
    let now = Instant::now();
    let remaining = lease.expires_at().saturating_duration_since(now);
    assert!(
        remaining <= ttl - drift,
        "{remaining:?}: not shortened by the drift"
    );
    assert!(
        remaining + now.duration_since(sent) >= ttl - drift,
        "{remaining:?} after {:?}",
        now.duration_since(sent)
    );
    eventually(Duration::from_secs(1), || {
        (0..3).all(|m| masters.pttl(m, "lock:l:1") > 0)
    })
    .await
    .expect("the key on every master");
    for m in 0..3 {
        let store_left = Duration::from_millis(masters.pttl(m, "lock:l:1") as u64);
        assert!(
            store_left + now.elapsed() + Duration::from_millis(2) >= remaining,
            "master {m} lets go at +{store_left:?}, the lease says +{remaining:?}"
        );
    }
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
}

/// Masters restarted empty (no persistence) while a lock is held. What the crate
/// promises: the lock excludes others while a majority of the masters still hold it;
/// once restarts have cost it its majority, another request can get the keys while the
/// holder still runs (Redlock's documented limit), and the holder learns at its next
/// renewal that its lease is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn masters_restarted_empty_lose_a_lock_only_once_they_are_a_majority() {
    let mut masters = Masters::start(3);
    let ttl = Duration::from_millis(900);
    let holding = masters.locks(NODE_TIMEOUT).ttl(ttl).renew_lease(true);
    let other = masters.locks(NODE_TIMEOUT).ttl(ttl);
    let gate = Gate::new();
    let holder = gated_router(&holding, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["r:1", "r:2"])).await });
    gate.wait_entered().await;
    let lease = gate.lease();
    let runs = Arc::new(AtomicUsize::new(0));
    let contender = counting_router(&other, &runs);

    // One master restarted empty: two still hold the keys, so the lock still excludes,
    // and renewals (every 300 ms) still find a majority.
    masters.servers[0].restart();
    let refused = send(&contender, batch(&["r:2", "r:3"])).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
    tokio::time::sleep(ttl * 2 / 3).await;
    assert!(
        !lease.is_lost(),
        "one empty master out of three lost the lease"
    );
    let refused = send(&contender, batch(&["r:2", "r:3"])).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
    assert!(
        masters.locks_on(0).is_empty(),
        "the restarted master is empty"
    );

    // A second master restarted empty: the holder has lost its majority. Another request
    // is granted while the holder's handler still runs: the documented limit.
    masters.servers[1].restart();
    let restarted = Instant::now();
    let granted = send(&contender, batch(&["r:2", "r:3"])).await;
    assert_eq!(
        granted.status,
        StatusCode::OK,
        "two empty masters of three grant the batch: {}",
        granted.text()
    );
    // The holder is told at its next renewal, within a third of the TTL (plus a retry).
    within(ttl, "the holder learned its lease is lost", lease.lost()).await;
    eprintln!(
        "redlock, 2 of 3 masters restarted empty: lease lost {:?} after",
        restarted.elapsed()
    );
    assert!(lease.is_lost());
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
}

/// antirez's *delayed restarts*: a crashed master rejoins only after a TTL. Then no
/// second failure can hand the keys to another request while the holder believes its
/// lease valid: the holder learns it lost its majority before its keys expire anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_kept_out_for_a_ttl_before_rejoining_keeps_exclusion() {
    let mut masters = Masters::start(3);
    let ttl = Duration::from_millis(600);
    let holding = masters.locks(NODE_TIMEOUT).ttl(ttl).renew_lease(true);
    let other = masters.locks(NODE_TIMEOUT).ttl(ttl);
    let gate = Gate::new();
    let holder = gated_router(&holding, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["d:1"])).await });
    gate.wait_entered().await;
    let lease = gate.lease();
    let runs = Arc::new(AtomicUsize::new(0));
    let contender = counting_router(&other, &runs);

    masters.servers[0].kill();
    tokio::time::sleep(ttl + Duration::from_millis(50)).await;
    masters.servers[0].restart();
    assert!(
        !lease.is_lost(),
        "the lease is renewed on the two other masters"
    );
    assert_eq!(
        send(&contender, batch(&["d:1"])).await.status,
        StatusCode::CONFLICT
    );

    // A second master crashes and stays out: nobody has a majority for `d:1` now.
    masters.servers[1].kill();
    let crashed = Instant::now();
    let mut lost_at = None;
    let mut granted_at = None;
    while crashed.elapsed() < ttl * 4 && granted_at.is_none() {
        if lost_at.is_none() && lease.is_lost() {
            lost_at = Some(Instant::now());
        }
        match send(&contender, batch(&["d:1"])).await.status {
            StatusCode::OK => granted_at = Some(Instant::now()),
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let lost_at = lost_at.expect("the holder never learned it lost its majority");
    let granted_at = granted_at.expect("the keys never became free");
    eprintln!(
        "redlock, delayed restart then a second crash: lease lost after {:?}, the keys granted \
         to another after {:?}",
        lost_at - crashed,
        granted_at - crashed
    );
    assert!(
        lost_at < granted_at,
        "another request got the keys while the lease looked valid"
    );
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
}

// ---------------------------------------------------------------------------------------
// Fencing tokens
// ---------------------------------------------------------------------------------------

/// The masters' counters drift apart: a master that grants what the others refuse, or whose
/// counter runs ahead of the clock, counts ahead of them. The token of a grant is the
/// largest granting counter, after a majority has been brought up to it; without that, the
/// second grant below would carry a smaller token than the first. Masters that restart
/// empty count again from their clocks, above every token handed out before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fencing_tokens_increase_across_grants_even_when_master_counters_drift_apart() {
    let mut masters = Masters::start(3);
    let locks = masters.locks(NODE_TIMEOUT).ttl(Duration::from_secs(10));
    let app = fence_router(&locks);

    // Master 0 runs 200 ms ahead of the clock, and grants `x` five times, which the two
    // others refuse.
    let ahead = clock_floor() + 200 * 1024;
    masters.set(0, "lock:", &ahead.to_string());
    masters.set(1, "lock:x", "someone-else");
    masters.set(2, "lock:x", "someone-else");
    for _ in 0..5 {
        assert_eq!(send(&app, batch(&["x"])).await.status, StatusCode::CONFLICT);
    }
    assert_eq!(
        (masters.counter(0), masters.counter(1), masters.counter(2)),
        (ahead + 5, 0, 0)
    );

    // Granted by masters 0 and 1 (master 2 refuses `c`): the token of master 0.
    masters.set(2, "lock:c", "someone-else");
    let first = send(&app, batch(&["k", "c"])).await.fence();
    assert_eq!(first, ahead + 6);
    assert!(
        masters.counter(1) >= first,
        "master 1 was not brought up to the token"
    );

    // Granted by masters 1 and 2 (master 0 refuses `a`): it shares `k` with the first,
    // and its token must be larger, though master 2 counts from the clock, behind.
    masters.set(0, "lock:a", "someone-else");
    let second = send(&app, batch(&["k", "a"])).await.fence();
    assert!(second > first, "token {second} after token {first}");

    let third = send(&app, batch(&["k"])).await.fence();
    assert!(third > second, "token {third} after token {second}");

    // Every master loses its counter: two restart empty, the third is gone. Once the
    // clock has passed the last token (here, 200 ms: the counters ran that far ahead; a
    // counter that counts about as fast as the clock is never far ahead of it), the tokens
    // count on from the clock, above every token before.
    masters.servers[1].restart();
    masters.servers[2].restart();
    masters.servers[0].kill();
    let caught_up = poll_every(Duration::from_millis(10), Duration::from_secs(2), || {
        clock_floor() > third
    })
    .await;
    assert!(caught_up.is_some(), "the clock did not pass {third}");
    let after_restarts = send(&app, batch(&["k"])).await.fence();
    eprintln!(
        "redlock fencing: {first}, {second}, {third}; after every master lost its counter: \
         {after_restarts}"
    );
    assert!(after_restarts > third, "{after_restarts} after {third}");
}

// ---------------------------------------------------------------------------------------
// Cancellation and waiting
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dropped_request_releases_its_keys_on_every_master_within_milliseconds() {
    let masters = Masters::start(3);
    let locks = masters.locks(NODE_TIMEOUT).ttl(Duration::from_secs(10));
    let gate = Gate::new();
    let app = gated_router(&locks, &gate);
    let task = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, batch(&["c:1", "c:2"])).await })
    };
    gate.wait_entered().await;
    eventually(Duration::from_secs(1), || {
        masters.all_locks().iter().all(|l| l.len() == 2)
    })
    .await
    .expect("the keys on every master");
    task.abort();
    let took = eventually(Duration::from_secs(3), || masters.empty())
        .await
        .unwrap_or_else(|| panic!("still held: {:?}", masters.all_locks()));
    eprintln!("redlock, cancellation: keys gone from every master {took:?} after the drop");
    assert!(took < Duration::from_millis(500), "{took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_in_the_same_process_gets_the_keys_when_they_are_released() {
    let masters = Masters::start(3);
    let locks = masters
        .locks(NODE_TIMEOUT)
        .ttl(Duration::from_secs(10))
        .wait(Wait::up_to(Duration::from_secs(5)));
    let gate = Gate::new();
    let holder = gated_router(&locks, &gate);
    let held = tokio::spawn(async move { send(&holder, batch(&["w:1"])).await });
    gate.wait_entered().await;

    let runs = Arc::new(AtomicUsize::new(0));
    let waiter = counting_router(&locks, &runs);
    let waiting = tokio::spawn(async move { timed(&waiter, batch(&["w:1", "w:2"])).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the waiter got a held key");
    let released = Instant::now();
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let (reply, _) = waiting.await.unwrap();
    let after = released.elapsed();
    eprintln!("redlock, waiter in the same process: granted {after:?} after the release");
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert!(after < Duration::from_millis(500), "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_big_batch_goes_to_every_master_in_steps() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let observers: Vec<Observer> = servers.iter().map(Observer::of).collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let store = Redlock::new(&urls)
        .node_timeout(Duration::from_millis(1500))
        .step_keys(100)
        .build()
        .unwrap();
    let locks = Locks::new(store);
    let runs = Arc::new(AtomicUsize::new(0));
    let keys: Vec<String> = (0..1000).map(|i| format!("r:{i:04}")).collect();
    let before: Vec<u64> = observers.iter().map(Observer::script_calls).collect();

    let reply = send(&batch_router(&locks, counting_handler(&runs)), batch(&keys)).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    for (observer, before) in observers.iter().zip(before) {
        // The free keys go with plain `SET`s, then one script call counts the grant; ten
        // steps of 100 keys release them (and perhaps a late one). The answer waits for a
        // majority's release: the last master's may still be under way.
        let stepped = poll_every(Duration::from_millis(20), Duration::from_secs(3), || {
            observer.script_calls() - before >= 11
        })
        .await;
        let calls = observer.script_calls() - before;
        assert!(
            stepped.is_some(),
            "{calls} script calls on a master for 1,000 keys"
        );
        let left = poll_every(Duration::from_millis(20), Duration::from_secs(3), || {
            observer.locks().is_empty()
        })
        .await;
        assert!(left.is_some(), "{:?}", observer.locks());
    }
}

// ---------------------------------------------------------------------------------------
// Fairness: a waiter keeps its place on every master
// ---------------------------------------------------------------------------------------

/// A waiter in line whose batch a minority of masters granted and a majority refused keeps
/// its place on every master: the granting master reserves the key for it before the
/// rollback releases it (it used to release it without, leaving the key free there for
/// anyone), and that release does not wake it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_refused_by_a_majority_keeps_its_place_on_the_master_that_granted() {
    let masters = Masters::start(3);
    let locks = masters
        .locks(NODE_TIMEOUT)
        .wait(Wait::up_to(Duration::from_secs(3)));
    // Another owner's hold, on two masters of three.
    let other = "0123456789abcdef0123456789abcdef:00000000000000aa";
    for master in [0, 1] {
        masters.cmd::<()>(
            master,
            redis::cmd("SET")
                .arg("lock:k")
                .arg(other)
                .arg("PX")
                .arg(2_000),
        );
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    let waiter = tokio::spawn(async move { send(&app, batch(&["k"])).await });
    let reserved = poll_every(Duration::from_millis(10), Duration::from_secs(2), || {
        (0..3).all(|master| {
            Observer::of(&masters.servers[master])
                .lock("lock:k")
                .is_some_and(|value| value.reservations.len() == 1)
        })
    })
    .await;
    assert!(
        reserved.is_some(),
        "the waiter is not in line on every master: {:?}",
        (0..3)
            .map(|m| Observer::of(&masters.servers[m]).get("lock:k"))
            .collect::<Vec<_>>()
    );
    // The other owner's hold expires: the waiter is granted.
    let reply = within(Duration::from_secs(5), "the waiter", waiter).await;
    assert_eq!(reply.unwrap().status, StatusCode::OK);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    masters.assert_released().await;
    // Each refused attempt was granted by the third master and rolled back there; that
    // release does not wake the waiter, which otherwise took it for its turn and tried
    // again at once, over and over until the hold expired (3,864 scripts on that master,
    // measured with the wake-up sent). It waited for its polls: 13 scripts.
    let scripts = Observer::of(&masters.servers[2]).calls(&["fcall"]);
    assert!(
        scripts <= 60,
        "{scripts} script calls on the master that granted"
    );
}

/// How many times each master was asked to withdraw a waiter's place since it began to log
/// every command.
fn withdrawals(masters: &Masters) -> Vec<usize> {
    masters
        .servers
        .iter()
        .map(|server| {
            Observer::of(server)
                .logged_commands(false)
                .iter()
                .filter(|command| command[0] == "fcall" && command[1].ends_with("_withdraw"))
                .count()
        })
        .collect()
}

/// A waiter that a majority granted has its place in line withdrawn where a master refused
/// it, and nowhere else: a master that grants after the majority did ended the place there
/// itself, as every grant does (a withdrawal there read the whole batch for nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_granted_waiters_place_is_withdrawn_only_where_a_master_refused() {
    let masters = Masters::start(3);
    // A master past its node timeout would rightly get a withdrawal too: a longer one than
    // most tests', so that a loaded machine cannot make one of the granting masters fail.
    let locks = masters
        .locks(Duration::from_secs(2))
        .wait(Wait::up_to(Duration::from_secs(3)));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_router(&locks, &runs);
    for server in &masters.servers {
        Observer::of(server).log_every_command();
    }
    // Every master grants: the last to answer comes after the majority, every time. Each
    // request waits until every master has let the last one go (a response only waits for
    // a majority), so that none refuses it.
    let keys: Vec<String> = (0..100).map(|i| format!("k{i:03}")).collect();
    for _ in 0..5 {
        assert_eq!(send(&app, batch(&keys)).await.status, StatusCode::OK);
        masters.assert_released().await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(withdrawals(&masters), [0, 0, 0], "withdrawn where granted");

    // Another owner's hold on the third master: it refuses, and keeps the waiter's place
    // (a reservation behind that hold) until the withdrawal that the grant sends there.
    let other = "0123456789abcdef0123456789abcdef:00000000000000aa";
    masters.cmd::<()>(
        2,
        redis::cmd("SET")
            .arg("lock:k")
            .arg(other)
            .arg("PX")
            .arg(5_000),
    );
    assert_eq!(send(&app, batch(&["k"])).await.status, StatusCode::OK);
    let withdrawn = poll_every(Duration::from_millis(10), Duration::from_secs(2), || {
        Observer::of(&masters.servers[2])
            .lock("lock:k")
            .is_some_and(|value| value.reservations.is_empty())
    })
    .await;
    assert!(
        withdrawn.is_some(),
        "the waiter's place is left on the master that refused: {:?}",
        Observer::of(&masters.servers[2]).get("lock:k")
    );
    assert_eq!(withdrawals(&masters), [0, 0, 1]);
    assert_eq!(runs.load(Ordering::SeqCst), 6);
}
