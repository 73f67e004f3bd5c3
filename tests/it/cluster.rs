//! The Redis Cluster store, driven through the layer, on a real cluster of three masters
//! with a replica each that every test starts itself (`support::cluster`): batches spread
//! over every master, refusals that leave nothing behind, two "processes" that never
//! overlap, a resharding and a failover under bounded load.

use std::{
    collections::BTreeSet,
    sync::{atomic::Ordering, Arc},
    time::{Duration, Instant},
};

use http::StatusCode;
use tower_batch_lock::{store::RedisCluster, KeyState, Locks, Wait};

use crate::support::{
    cluster::Cluster,
    handlers::{counting_handler, gated_handler, hold, ledger_handler, Gate, Ledger},
    http::{batch, batch_router, poll_every, send, within, Reply},
    proxy::{Fault, Proxy},
    Rng,
};

/// A `Locks` of its own on the cluster: one "process".
fn locks(cluster: &Cluster) -> Locks {
    locks_with(cluster, |store| store)
}

/// As [`locks`], with the store set further by `set`.
fn locks_with(cluster: &Cluster, set: impl FnOnce(RedisCluster) -> RedisCluster) -> Locks {
    let store = RedisCluster::new(cluster.urls())
        .node_timeout(Duration::from_secs(1))
        .retry_for(Duration::from_secs(2));
    Locks::new(set(store).build().expect("valid cluster URLs"))
        .ttl(Duration::from_secs(10))
        .store_timeout(Duration::from_secs(3))
}

/// Lets the request that `gate` holds up go on: it answers 200, and leaves no key behind.
async fn let_finish(cluster: &Cluster, gate: &Gate, request: tokio::task::JoinHandle<Reply>) {
    gate.open();
    let reply = within(Duration::from_secs(10), "the response", request)
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    assert_emptied(cluster).await;
}

fn keys(prefix: &str, count: usize) -> Vec<String> {
    (0..count).map(|i| format!("{prefix}{i}")).collect()
}

/// Waits until no master holds a lock key, or fails naming what is left.
async fn assert_emptied(cluster: &Cluster) {
    let emptied = poll_every(Duration::from_millis(20), Duration::from_secs(3), || {
        cluster.empty()
    })
    .await;
    assert!(
        emptied.is_some(),
        "left behind: {:?}",
        cluster.locks_on_masters()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_3000_keys_is_spread_over_every_master_and_released_from_all() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let locks = locks(&cluster);
    let gate = Gate::new();
    let app = batch_router(&locks, gated_handler(&gate));
    let batch_keys = keys("sku:", 3000);
    let script_calls = || {
        ["fcall", "evalsha", "eval"]
            .iter()
            .map(|command| cluster.calls_of(command))
            .sum::<u64>()
    };
    let (calls_before, sets_before) = (script_calls(), cluster.calls_of("set"));

    let request = tokio::spawn({
        let app = app.clone();
        let batch_keys = batch_keys.clone();
        async move { send(&app, batch(&batch_keys)).await }
    });
    within(
        Duration::from_secs(10),
        "the batch to be granted",
        gate.wait_entered(),
    )
    .await;
    let on_masters = cluster.locks_on_masters();
    assert_eq!(on_masters.len(), 3);
    assert!(
        on_masters.iter().all(|keys| keys.len() > 500),
        "every master serves part of the batch: {:?}",
        on_masters.iter().map(BTreeSet::len).collect::<Vec<_>>()
    );
    let held: BTreeSet<String> = on_masters.into_iter().flatten().collect();
    let wanted: BTreeSet<String> = batch_keys.iter().map(|k| format!("lock:{k}")).collect();
    assert_eq!(held, wanted);
    // Every key was free: each master took its group with plain `SET`s, and no script but
    // the one that counts the grant ran (its `EVALSHA`, and `EVAL` where the counter's
    // master did not have it cached; its `SET` of the counter is the 3,001st).
    assert_eq!(cluster.calls_of("set") - sets_before, 3001);
    let calls = script_calls() - calls_before;
    assert!((1..=2).contains(&calls), "{calls} script calls");

    let_finish(&cluster, &gate, request).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_batch_leaves_nothing_on_any_master() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let (first, second) = (locks(&cluster), locks(&cluster));
    let gate = Gate::new();
    let holder = batch_router(&first, gated_handler(&gate));
    let contender = batch_router(&second, gated_handler(&Gate::new()));

    let held = tokio::spawn(async move { send(&holder, batch(&["sku:1500"])).await });
    within(
        Duration::from_secs(10),
        "the first grant",
        gate.wait_entered(),
    )
    .await;
    // 3,000 keys over every master, one of them held by the other process: refused, and
    // the groups the other masters granted are released.
    for _ in 0..3 {
        let reply = send(&contender, batch(&keys("sku:", 3000))).await;
        assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.text());
        let left: BTreeSet<String> = cluster.locks_on_masters().into_iter().flatten().collect();
        assert_eq!(left, BTreeSet::from(["lock:sku:1500".to_owned()]));
    }
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert_emptied(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plain_pass_that_meets_a_moved_slot_leaves_nothing_behind() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let (first, second) = (locks(&cluster), locks(&cluster));
    let gate = Gate::new();
    let holder = batch_router(&first, gated_handler(&gate));
    let contender = batch_router(&second, counting_handler(&Arc::default()));
    // 300 keys: about 100 on each master, enough for plain `SET`s there.
    let batch_keys = keys("sku:", 300);
    // The contender reads the slot map, then the slot of one key of the batch moves to
    // another master behind its back.
    assert_eq!(
        send(&contender, batch(&batch_keys)).await.status,
        StatusCode::OK
    );
    assert_emptied(&cluster).await;
    let masters = cluster.masters();
    let (from, _) = cluster.shard_of(masters[0], "lock:sku:0");
    let to = masters.iter().copied().find(|&port| port != from).unwrap();
    cluster.move_slot("lock:sku:0", to);
    // The other process holds a key that `from` serves in neither map, so that the batch
    // is refused rather than made again on a fresh map (where the same hold would find
    // and release what it left, and hide a leak).
    let held_key = batch_keys[1..]
        .iter()
        .find(|key| cluster.shard_of(to, &format!("lock:{key}")).0 != from)
        .unwrap()
        .clone();
    let held = tokio::spawn(async move { send(&holder, batch(&[held_key])).await });
    within(Duration::from_secs(10), "the grant", gate.wait_entered()).await;
    let rejected_before = cluster.rejected_calls_of("set");

    // `from` takes the rest of its group with plain `SET`s, and its `SET` of `sku:0`
    // answers `MOVED`: the attempt releases that group too (on the new map), so the
    // refusal leaves nothing but the other process's key.
    let reply = send(&contender, batch(&batch_keys)).await;
    assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.text());
    assert!(cluster.rejected_calls_of("set") > rejected_before);
    let left: Vec<String> = cluster.locks_on_masters().into_iter().flatten().collect();
    assert_eq!(left.len(), 1, "{left:?}");

    // Once the key is free, the batch meets the moved slot again, and is granted on the
    // fresh map.
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let reply = send(&contender, batch(&batch_keys)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_emptied(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_made_again_after_a_moved_slot_keeps_every_key_while_it_runs() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    // Steps of 10 keys: a release sent to a master that lost one slot of its group still
    // frees the steps without a key of that slot.
    let locks = locks_with(&cluster, |store| store.step_keys(10));
    let gate = Gate::new();
    let app = batch_router(&locks, gated_handler(&gate));
    let batch_keys = keys("sku:", 300);
    // The store reads the slot map; then one slot of the batch moves behind its back.
    gate.open();
    assert_eq!(send(&app, batch(&batch_keys)).await.status, StatusCode::OK);
    assert_emptied(&cluster).await;
    let masters = cluster.masters();
    let (from, _) = cluster.shard_of(masters[0], "lock:sku:0");
    let to = masters.iter().copied().find(|&port| port != from).unwrap();
    cluster.move_slot("lock:sku:0", to);

    // The first attempt's group on `from` answers `MOVED`; the batch is made again on a
    // fresh map under the same hold, and granted.
    let gate = Gate::new();
    let app = batch_router(&locks, gated_handler(&gate));
    let request = tokio::spawn({
        let batch_keys = batch_keys.clone();
        async move { send(&app, batch(&batch_keys)).await }
    });
    within(Duration::from_secs(10), "the grant", gate.wait_entered()).await;
    let wanted: BTreeSet<String> = batch_keys.iter().map(|k| format!("lock:{k}")).collect();
    let held =
        || -> BTreeSet<String> { cluster.locks_on_masters().into_iter().flatten().collect() };
    assert_eq!(held(), wanted);
    // Nothing of the first attempt is released again later: a release sent after it (the
    // fan-out's re-sends are due at 0.25 s and 1.25 s) would free the keys that the
    // second attempt holds, under the same hold, while its handler runs.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let lost = &wanted - &held();
    assert!(
        lost.is_empty(),
        "{} keys freed under a running handler: {lost:?}",
        lost.len()
    );
    let_finish(&cluster, &gate, request).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn masters_announced_without_a_host_are_reached_at_the_host_of_the_urls() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    // `CLUSTER SLOTS` as every node gives it, once each says the same of every master.
    let cluster = &cluster;
    let slots_agree = |agree: fn(&[redis::Value]) -> bool| {
        poll_every(
            Duration::from_millis(50),
            Duration::from_secs(10),
            move || {
                cluster
                    .slots_everywhere()
                    .iter()
                    .all(|slots| agree(&master_fields(slots, 0)))
            },
        )
    };
    // As behind a load balancer: `CLUSTER SLOTS` gives each master's port, and NULL for its
    // host (the host the client asked is the one to use).
    cluster.config_set("cluster-preferred-endpoint-type", "unknown-endpoint");
    let no_host =
        slots_agree(|hosts| hosts.len() == 3 && hosts.iter().all(|h| *h == redis::Value::Nil))
            .await;
    assert!(no_host.is_some(), "{:?}", cluster.slots_everywhere());
    let locks = locks(cluster);
    let app = batch_router(&locks, counting_handler(&Arc::default()));
    let reply = send(&app, batch(&keys("sku:", 300))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_emptied(cluster).await;

    // Hostnames announced by two masters, one of them the fencing counter's (every grant
    // counts there), and none by the third, which `CLUSTER SLOTS` then gives as "?": its
    // keys get 503, the others are served.
    let masters = cluster.masters();
    let (counter, _) = cluster.shard_of(masters[0], "lock:");
    let unknown = masters
        .iter()
        .copied()
        .find(|&port| port != counter)
        .unwrap();
    let announced: Vec<u16> = masters.into_iter().filter(|&p| p != unknown).collect();
    for &port in &announced {
        let announce = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-announce-hostname")
            .arg("localhost")
            .to_owned();
        let _: () = cluster.cmd(port, &mut announce.clone());
    }
    cluster.config_set("cluster-preferred-endpoint-type", "hostname");
    let gossiped = slots_agree(|hosts| {
        let named = |name: &[u8]| {
            let name = redis::Value::BulkString(name.to_vec());
            hosts.iter().filter(|&h| *h == name).count()
        };
        named(b"localhost") == 2 && named(b"?") == 1
    })
    .await;
    assert!(gossiped.is_some(), "{:?}", cluster.slots_everywhere());
    let on = |port: u16| keys_on(cluster, port, "sku:", 1);
    let locks = self::locks(cluster);
    let app = batch_router(&locks, counting_handler(&Arc::default()));
    let reply = send(&app, batch(&on(announced[0]))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let reply = send(&app, batch(&on(unknown))).await;
    let unavailable = StatusCode::SERVICE_UNAVAILABLE;
    assert_eq!(reply.status, unavailable, "{}", reply.text());
    assert_emptied(cluster).await;
}

/// Field `field` of each range's master in a `CLUSTER SLOTS` answer: 0 its host, 1 its
/// port (its replicas follow it there, and are left out).
fn master_fields(slots: &redis::Value, field: usize) -> Vec<redis::Value> {
    slot_map(slots)
        .into_iter()
        .filter_map(|(_, _, master)| master.get(field).cloned())
        .collect()
}

/// Each range of a `CLUSTER SLOTS` answer: its first and last slot, and its master's
/// fields (host, port, id, ...).
fn slot_map(slots: &redis::Value) -> Vec<(u16, u16, Vec<redis::Value>)> {
    let redis::Value::Array(ranges) = slots else {
        return Vec::new();
    };
    ranges
        .iter()
        .filter_map(|range| {
            let redis::Value::Array(fields) = range else {
                return None;
            };
            let first: u16 = redis::from_redis_value(fields.first()?.clone()).ok()?;
            let last: u16 = redis::from_redis_value(fields.get(1)?.clone()).ok()?;
            let redis::Value::Array(master) = fields.get(2)? else {
                return None;
            };
            Some((first, last, master.clone()))
        })
        .collect()
}

/// Two "processes" send `requests` random, overlapping batches out of `space` keys, at
/// once, retrying on 409, while `meanwhile` runs: request `i` draws `size(i, rng)` keys. No
/// two critical sections that share a key overlap, and the later one carries the larger
/// fencing token. Returns how many were granted and how many got 503.
async fn load<F: std::future::Future + Send + 'static>(
    cluster: &Cluster,
    requests: usize,
    size: fn(usize, &mut Rng) -> u64,
    space: u64,
    meanwhile: F,
) -> (usize, usize)
where
    F::Output: Send,
{
    let ledger = Arc::new(Ledger::default());
    let apps = [
        batch_router(&locks(cluster), ledger_handler(&ledger)),
        batch_router(&locks(cluster), ledger_handler(&ledger)),
    ];
    let background = tokio::spawn(meanwhile);
    let started = Instant::now();
    // Bounded in count and in time: a request that keeps meeting contention gives up, in
    // time to answer within the 60 s below (each attempt is bounded by the store's
    // timeout: 200 attempts of a purchase order outlasted them on a slow machine).
    let give_up_at = started + Duration::from_secs(40);
    let tasks: Vec<_> = (0..requests)
        .map(|i| {
            let app = apps[i % 2].clone();
            tokio::spawn(async move {
                let mut rng = Rng::seeded(i as u64);
                let count = size(i, &mut rng);
                let keys: Vec<String> = (0..count)
                    .map(|_| format!("k{}", rng.below(space)))
                    .collect();
                for _ in 0..200 {
                    if Instant::now() > give_up_at {
                        break;
                    }
                    let reply = send(&app, batch(&keys)).await;
                    match reply.status {
                        StatusCode::CONFLICT => {
                            tokio::time::sleep(Duration::from_millis(2)).await;
                        }
                        status => return status,
                    }
                }
                StatusCode::CONFLICT
            })
        })
        .collect();
    let (mut granted, mut unavailable) = (0, 0);
    for task in tasks {
        let status = within(Duration::from_secs(60), "a request", task)
            .await
            .unwrap();
        match status {
            StatusCode::OK => granted += 1,
            StatusCode::SERVICE_UNAVAILABLE => unavailable += 1,
            StatusCode::CONFLICT => {}
            other => panic!("a request got {other}"),
        }
    }
    within(Duration::from_secs(60), "the background work", background)
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(90));
    assert_eq!(
        ledger.overlaps.load(Ordering::SeqCst),
        0,
        "two holders were inside the same key at once"
    );
    let visits = std::mem::take(&mut *ledger.visits.lock().unwrap());
    for (i, a) in visits.iter().enumerate() {
        for b in &visits[i + 1..] {
            if a.keys.iter().any(|k| b.keys.contains(k)) {
                let (first, second) = if a.exit <= b.enter { (a, b) } else { (b, a) };
                assert!(
                    first.fence < second.fence,
                    "fencing tokens out of order: {first:?} then {second:?}"
                );
            }
        }
    }
    (granted, unavailable)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_batches_never_run_together_across_two_processes() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let (granted, unavailable) = load(&cluster, 120, |_, rng| 1 + rng.below(6), 60, async {}).await;
    assert_eq!(unavailable, 0);
    assert!(granted >= 110, "only {granted} granted");
    assert_emptied(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resharding_under_load_loses_no_update_and_leaves_nothing_behind() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let masters = cluster.masters();
    let (from, to) = (masters[0], masters[1]);
    let slots_before = cluster.slots_of(from);
    // redis-cli moves 1,500 slots while the two processes lock batches of up to 40 keys out
    // of 3,000 (so that most batches have keys in slots on the move), and every tenth batch
    // is a purchase order of 360 draws (about 340 keys, 110 a master: enough for plain
    // `SET`s, which may then meet `MOVED` and `ASK`). Out of 600 keys, requests that do not
    // wait kept refusing one another on a slow machine: 88-90 of 300 granted in 40 s.
    let reshard = async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        tokio::task::spawn_blocking(move || Cluster::reshard(from, to, 1500))
            .await
            .unwrap();
        eprintln!("the resharding took {:?}", started.elapsed());
    };
    let (granted, unavailable) =
        load(&cluster, 300, purchase_orders_among_retail, 3_000, reshard).await;
    assert_eq!(cluster.slots_of(from), slots_before - 1500);
    eprintln!("resharding under load: {granted} of 300 granted, {unavailable} got 503");
    assert!(
        granted >= 100,
        "only {granted} granted ({unavailable} got 503)"
    );
    assert_emptied(&cluster).await;
}

/// Every tenth request a purchase order of 360 draws, the others up to 40.
fn purchase_orders_among_retail(i: usize, rng: &mut Rng) -> u64 {
    if i.is_multiple_of(10) {
        360
    } else {
        1 + rng.below(40)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_master_gives_503_for_its_keys_and_grants_resume_after_the_failover() {
    let (_serial, mut cluster) = Cluster::start_in_turn().await;
    let locks = Locks::new(
        RedisCluster::new(cluster.urls())
            .node_timeout(Duration::from_millis(300))
            .retry_for(Duration::from_millis(500))
            .build()
            .unwrap(),
    );
    let app = batch_router(&locks, counting_handler(&Arc::default()));
    let masters = cluster.masters();
    // Not the master of the fencing counter (`lock:`): while that one is down, no batch
    // can be granted anywhere (see `RedisCluster`).
    let counter_slot: u16 = cluster.cmd(
        masters[0],
        redis::cmd("CLUSTER").arg("KEYSLOT").arg("lock:"),
    );
    let (victim, other) = match owns(&cluster, masters[0], counter_slot) {
        true => (masters[1], masters[0]),
        false => (masters[0], masters[1]),
    };
    // A key the victim serves, and one another master serves.
    let served_by = |port: u16| {
        (0..)
            .map(|i| format!("key{i}"))
            .find(|key| {
                let keyslot = redis::cmd("CLUSTER")
                    .arg("KEYSLOT")
                    .arg(format!("lock:{key}"))
                    .to_owned();
                owns(&cluster, port, cluster.cmd(port, &mut keyslot.clone()))
            })
            .unwrap()
    };
    let (doomed, safe) = (served_by(victim), served_by(other));
    assert_eq!(send(&app, batch(&[&doomed])).await.status, StatusCode::OK);

    cluster.kill(victim);
    let reply = send(&app, batch(&[&doomed])).await;
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.text()
    );
    let reply = send(&app, batch(&[&safe])).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    // Both at once: all or nothing, so 503, and the other master keeps nothing.
    let reply = send(&app, batch(&[&doomed, &safe])).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(cluster.empty(), "{:?}", cluster.locks_on_masters());

    cluster.wait_for_failover(victim, Duration::from_secs(20));
    grants_resume(&app, &[&doomed, &safe], "failover").await;
    assert_emptied(&cluster).await;
}

/// Asks for `keys` every 100 ms, for up to 5 s, until they are granted, or fails naming
/// `after` (the event the grants should resume after).
async fn grants_resume(app: &axum::Router, keys: &[&String], after: &str) {
    for _ in 0..50 {
        if send(app, batch(keys)).await.status == StatusCode::OK {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("grants did not resume after the {after}");
}

/// Whether the master at `port` serves `slot`, by its own `CLUSTER SLOTS`.
fn owns(cluster: &Cluster, port: u16, slot: u16) -> bool {
    slot_ranges(cluster, port)
        .iter()
        .any(|&(first, last)| (first..=last).contains(&slot))
}

/// The ranges of slots that the master at `port` serves, by its own map.
fn slot_ranges(cluster: &Cluster, port: u16) -> Vec<(u16, u16)> {
    let slots: redis::Value = cluster.cmd(port, redis::cmd("CLUSTER").arg("SLOTS"));
    let served_by = |master: &[redis::Value]| {
        master
            .get(1)
            .and_then(|p| redis::from_redis_value::<u16>(p.clone()).ok())
            == Some(port)
    };
    slot_map(&slots)
        .into_iter()
        .filter(|(_, _, master)| served_by(master))
        .map(|(first, last, _)| (first, last))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_on_every_master_renews_and_an_operator_sees_and_frees_it() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    // Renewed every 200 ms: the batch outlives several TTLs while its handler runs.
    let locks = locks(&cluster).ttl(Duration::from_millis(600));
    let gate = Gate::new();
    let app = batch_router(&locks, gated_handler(&gate));
    let batch_keys = keys("sku:", 300);
    let request = tokio::spawn({
        let (app, batch_keys) = (app.clone(), batch_keys.clone());
        async move { send(&app, batch(&batch_keys)).await }
    });
    gate.wait_entered().await;
    assert!(cluster
        .locks_on_masters()
        .iter()
        .all(|keys| !keys.is_empty()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !gate.lease().is_lost(),
        "the lease was renewed on every master"
    );
    let states = locks.inspect(batch_keys.clone()).await.unwrap();
    assert!(
        states.iter().all(|s| s.is_held() && s.holds() == 1),
        "every key held, seen from the operator's side"
    );
    assert!(states
        .iter()
        .all(|s| s.ttl().is_some_and(|t| t <= Duration::from_millis(600))));

    // An operator frees the batch from under its holder, on every master.
    let freed = locks
        .force_release(batch_keys.clone(), "test")
        .await
        .unwrap();
    assert_eq!(freed, 300);
    assert!(cluster.empty(), "{:?}", cluster.locks_on_masters());
    let lease = gate.lease();
    within(Duration::from_secs(3), "the holder learns", lease.lost()).await;
    gate.open();
    assert_eq!(request.await.unwrap().status, StatusCode::OK);
    assert_emptied(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_in_another_process_wakes_on_a_sharded_release() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let (first, second) = (
        locks(&cluster),
        locks(&cluster).wait(Wait::up_to(Duration::from_secs(5))),
    );
    let gate = Gate::new();
    let holder = batch_router(&first, gated_handler(&gate));
    let waiter = batch_router(&second, counting_handler(&Arc::default()));
    let spublish_before = cluster.calls_of("spublish");
    let held = tokio::spawn(async move { send(&holder, batch(&["a", "b"])).await });
    gate.wait_entered().await;
    let waiting = tokio::spawn(async move {
        let reply = send(&waiter, batch(&["b", "c"])).await;
        (reply, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the waiter waits for `b`");
    let released = Instant::now();
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let (reply, granted) = waiting.await.unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    eprintln!("granted {:?} after the release", granted - released);
    assert!(
        cluster.calls_of("spublish") > spublish_before,
        "the release was announced with SPUBLISH"
    );
    assert_emptied(&cluster).await;
}

/// The process id of the node at `port`, by its own `INFO`.
fn pid_of(cluster: &Cluster, port: u16) -> String {
    let info: String = cluster.cmd(port, redis::cmd("INFO").arg("server"));
    info.lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .expect("INFO names the process")
        .trim()
        .to_owned()
}

/// Freezes (`STOP`) or thaws (`CONT`) the process `pid`.
fn signal(pid: &str, signal: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid)
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_master_costs_its_own_keys_a_bounded_503_and_nothing_else() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let locks = Locks::new(
        RedisCluster::new(cluster.urls())
            .node_timeout(Duration::from_millis(300))
            .retry_for(Duration::from_millis(500))
            .build()
            .unwrap(),
    )
    .store_timeout(Duration::from_secs(2))
    // An acquisition the frozen master runs when it thaws, after its batch's release,
    // is released again (`late`), or expires with this.
    .ttl(Duration::from_secs(2));
    let app = batch_router(&locks, counting_handler(&Arc::default()));
    let masters = cluster.masters();
    let counter_slot: u16 = cluster.cmd(
        masters[0],
        redis::cmd("CLUSTER").arg("KEYSLOT").arg("lock:"),
    );
    let victim = *masters
        .iter()
        .find(|&&port| !owns(&cluster, port, counter_slot))
        .unwrap();
    let served_by = |port: u16, not: bool| {
        (0..)
            .map(|i| format!("key{i}"))
            .find(|key| serves(&cluster, port, key) != not)
            .unwrap()
    };
    let (frozen_key, free_key) = (served_by(victim, false), served_by(victim, true));
    // Connections to every master, before the freeze.
    assert_eq!(
        send(&app, batch(&[&frozen_key, &free_key])).await.status,
        StatusCode::OK
    );

    let pid = pid_of(&cluster, victim);
    signal(&pid, "STOP");
    let started = Instant::now();
    let reply = send(&app, batch(&[&frozen_key])).await;
    let took = started.elapsed();
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.text()
    );
    // Node timeout and retries on a moving map (300 + 500 ms), and the rollback's.
    assert!(took < Duration::from_millis(1800), "{took:?}");
    let reply = send(&app, batch(&[&free_key])).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    signal(&pid, "CONT");

    grants_resume(&app, &[&frozen_key, &free_key], "thaw").await;
    assert_emptied(&cluster).await;
}

/// A waiter's attempt that one master never answered, held up on the wire: the attempt
/// fails (503), and the waiter withdraws its place. When the held attempt lands later
/// and is refused there (another request holds its key by then), it puts the place back,
/// which kept every later arrival out of the key until the waiter's deadline (8 s here).
/// The withdrawal is sent again after such an attempt (`late`), and ends it within
/// seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiters_place_put_back_by_an_attempt_a_master_never_answered_is_withdrawn_again() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let direct = locks_with(&cluster, short_timeouts);
    let proxied = Proxied::start(&cluster, &direct).await;
    let waiting = locks_with(&cluster, short_timeouts).wait(Wait::up_to(Duration::from_secs(8)));
    let (on_victim, on_other) = (
        proxied.keys_on_victim(&cluster, "late", 3),
        keys_on(&cluster, proxied.other, "late", 3),
    );
    for round in 0..3 {
        let (wanted, blocked) = (&on_victim[round], &on_other[round]);
        if put_back_and_withdrawn(&direct, &waiting, &proxied.proxy, wanted, blocked).await {
            assert_emptied(&cluster).await;
            return;
        }
        eprintln!("round {round}: the held attempt did not land in time; again");
    }
    panic!("the held attempt never landed in time in three rounds");
}

/// A waiter refused by one master and granted by another keeps its place on the keys it
/// was granted: it reserves them before it rolls them back. That reservation's answer is
/// lost on the wire (held up there), it is sent again and answered, and the waiter goes on
/// waiting and is granted; then the held reservation lands, and puts the place back. The
/// refusal said that a part of it may land later, and the place is withdrawn again after
/// the grant, within seconds, where it kept later arrivals out of the key to the waiter's
/// deadline (10 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiters_reservation_that_lands_after_its_grant_is_withdrawn_again() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let direct = locks(&cluster);
    let proxied = Proxied::start(&cluster, &direct).await;
    let waiting = locks(&cluster).wait(Wait::up_to(Duration::from_secs(10)));
    let (on_victim, on_other) = (
        proxied.keys_on_victim(&cluster, "stray", 4),
        keys_on(&cluster, proxied.other, "stray", 4),
    );
    // The waiting store learns the map and reaches both masters before one stops.
    let warm = batch_router(&waiting, counting_handler(&Arc::default()));
    let reply = send(&warm, batch(&[&on_victim[3], &on_other[3]])).await;
    assert_eq!(reply.status, StatusCode::OK);
    for round in 0..3 {
        let (wanted, blocked) = (&on_victim[round], &on_other[round]);
        if reservation_lands_after_the_grant(&cluster, &direct, &waiting, &proxied, wanted, blocked)
            .await
        {
            assert_emptied(&cluster).await;
            return;
        }
        eprintln!("round {round}: the wire held no reservation; again");
    }
    panic!("no reservation was held up in three rounds");
}

/// One round of the test above: whether the waiter's reservation on `wanted` was held up
/// and landed after its grant (and then, that the place it put back ended within seconds).
async fn reservation_lands_after_the_grant(
    cluster: &Cluster,
    direct: &Locks,
    waiting: &Locks,
    proxied: &Proxied,
    wanted: &str,
    blocked: &str,
) -> bool {
    let (gate, held) = hold(direct, blocked).await;
    // The other master, stopped, answers the waiter's attempt late: the victim has granted
    // `wanted` by then, and the wire holds what goes to it next (the reservation).
    cluster.signal(proxied.other, "STOP");
    let waiter = batch_router(waiting, counting_handler(&Arc::default()));
    let batch_keys = [wanted.to_owned(), blocked.to_owned()];
    let request = tokio::spawn(async move { send(&waiter, batch(&batch_keys)).await });
    let granted_there = key_until(direct, wanted, KeyState::is_held, Duration::from_secs(2)).await;
    proxied.proxy.hold_open();
    cluster.signal(proxied.other, "CONT");
    assert!(
        granted_there.is_some(),
        "the victim never granted its group"
    );
    // The reservation sent again, and the roll-back, are answered: the waiter waits in line
    // behind `blocked`, and is granted when it is released.
    let in_line = |state: &KeyState| state.waiters() > 0;
    let five = Duration::from_secs(5);
    assert!(
        key_until(direct, blocked, in_line, five).await.is_some(),
        "in line"
    );
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let reply = within(five, "the waiter", request).await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let granted = Instant::now();
    let none = |state: &KeyState| state.waiters() == 0;
    assert!(key_until(direct, wanted, none, five).await.is_some());
    // The held reservation lands, before the grant's last re-send of the withdrawal
    // (3.25 s after it).
    proxied.proxy.release_held();
    let landed = key_until(direct, wanted, in_line, Duration::from_secs(1)).await;
    let in_time = granted.elapsed() < Duration::from_secs(2);
    if landed.is_some() && in_time {
        let ended = key_until(direct, wanted, none, Duration::from_secs(9)).await;
        eprintln!("a place put back after the grant ended {ended:?} after it landed");
        assert!(
            ended.is_some_and(|after| after < Duration::from_secs(4)),
            "a place put back after the grant kept its place {ended:?}"
        );
    }
    landed.is_some() && in_time
}

/// A node timeout of 300 ms, and 500 ms to retry on a moving map.
fn short_timeouts(store: RedisCluster) -> RedisCluster {
    store
        .node_timeout(Duration::from_millis(300))
        .retry_for(Duration::from_millis(500))
}

/// A master of the cluster (the victim) behind a proxy whose port it announces, so that
/// the groups of later stores' batches on it go through a wire that the proxy can hold
/// up or cut; it counts no grant and carries no announcement, so that nothing else does.
struct Proxied {
    /// The slots the victim serves, read before it announced the proxy's port (the map
    /// the test reads names the proxy's since).
    victim_slots: Vec<(u16, u16)>,
    /// Another master.
    other: u16,
    proxy: Proxy,
}

impl Proxied {
    /// Puts the victim behind the proxy, once `direct` ("another process") learned the map
    /// and reached every master: it goes on reaching them directly, as no move makes it
    /// read the map again. Every node names the proxy then.
    async fn start(cluster: &Cluster, direct: &Locks) -> Self {
        let masters = cluster.masters();
        let slot_of = |key: &str| -> u16 {
            cluster.cmd(masters[0], redis::cmd("CLUSTER").arg("KEYSLOT").arg(key))
        };
        let (counter, channel) = (slot_of("lock:"), slot_of("tower-batch-lock:released"));
        let victim = *masters
            .iter()
            .find(|&&port| !owns(cluster, port, counter) && !owns(cluster, port, channel))
            .unwrap();
        let other = *masters.iter().find(|&&port| port != victim).unwrap();
        let warm = batch_router(direct, counting_handler(&Arc::default()));
        let everywhere: Vec<String> = masters
            .iter()
            .flat_map(|&port| keys_on(cluster, port, "warm", 1))
            .collect();
        assert_eq!(send(&warm, batch(&everywhere)).await.status, StatusCode::OK);

        let victim_slots = slot_ranges(cluster, victim);
        let proxy = Proxy::start(victim).await;
        let announce = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-announce-port")
            .arg(proxy.port())
            .to_owned();
        let _: () = cluster.cmd(victim, &mut announce.clone());
        let port = redis::Value::Int(proxy.port().into());
        let announced = poll_every(Duration::from_millis(50), Duration::from_secs(10), || {
            cluster
                .slots_everywhere()
                .iter()
                .all(|slots| master_fields(slots, 1).contains(&port))
        });
        assert!(announced.await.is_some(), "every node names the proxy");
        Self {
            victim_slots,
            other,
            proxy,
        }
    }

    /// The first `count` keys `{prefix}{i}` whose lock keys' slots the victim serves.
    fn keys_on_victim(&self, cluster: &Cluster, prefix: &str, count: usize) -> Vec<String> {
        keys_in(cluster, &self.victim_slots, prefix, count)
    }
}

/// A release whose answer was lost: the master freed the key, and the retry that was
/// answered found nothing left to free, nor a waiter to name. A cluster's release is
/// announced by the client, which named nobody then, and every process's waiters in line
/// waited for their next look, 1-2 s after the one before behind a hold of 30 s. The
/// announcement says now that it could not name them, and each process wakes its own
/// first in line on the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_whose_answer_was_lost_wakes_the_waiters_in_every_process() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let direct = locks_with(&cluster, short_timeouts).wait(Wait::up_to(Duration::from_secs(10)));
    let proxied = Proxied::start(&cluster, &direct).await;
    let holder = locks_with(&cluster, short_timeouts).ttl(Duration::from_secs(30));
    let key = proxied.keys_on_victim(&cluster, "lost", 1).remove(0);
    let (gate, held) = hold(&holder, &key).await;
    let app = batch_router(&direct, counting_handler(&Arc::default()));
    let request = batch(&[&key]);
    let waiter = tokio::spawn(async move { send(&app, request).await });
    let five = Duration::from_secs(5);
    let in_line = key_until(&direct, &key, |state| state.waiters() == 1, five).await;
    assert!(in_line.is_some(), "the waiter never stood in line");
    // The waiter's next look (a script): its next one comes 1 s or more after it.
    let calls = cluster.calls_of("fcall");
    let looked = poll_every(Duration::from_millis(5), Duration::from_secs(3), || {
        cluster.calls_of("fcall") > calls
    });
    assert!(looked.await.is_some(), "the waiter never looked");
    tokio::time::sleep(Duration::from_millis(50)).await;

    proxied.proxy.set(Fault::DropReplies);
    let released = Instant::now();
    gate.open();
    let freed = key_until(&direct, &key, |state| state.holds() == 0, five).await;
    assert!(freed.is_some(), "the release never ran");
    // Its answer is lost; the retry after the node timeout is answered.
    proxied.proxy.set(Fault::None);
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let reply = within(five, "the waiter", waiter).await;
    assert_eq!(reply.unwrap().status, StatusCode::OK);
    let granted = released.elapsed();
    eprintln!("granted {granted:?} after the release whose answer was lost");
    assert!(
        granted < Duration::from_millis(800),
        "the waiter waited {granted:?} for its own look"
    );
    assert_emptied(&cluster).await;
}

/// One round of the test above: a waiter for `wanted` (behind the proxy) and `blocked`
/// (held by `direct`) in line; whether its held attempt landed in time, and then, that
/// the place it put back ended within seconds.
async fn put_back_and_withdrawn(
    direct: &Locks,
    waiting: &Locks,
    proxy: &Proxy,
    wanted: &str,
    blocked: &str,
) -> bool {
    let (gate, held) = hold(direct, blocked).await;
    let waiter = batch_router(waiting, counting_handler(&Arc::default()));
    let batch_keys = [wanted.to_owned(), blocked.to_owned()];
    let request = tokio::spawn(async move { send(&waiter, batch(&batch_keys)).await });
    // The victim granted `wanted` and the other master refused `blocked`: the waiter keeps
    // its place on both.
    let in_line = |state: &KeyState| state.waiters() > 0;
    let five = Duration::from_secs(5);
    assert!(
        key_until(direct, wanted, in_line, five).await.is_some(),
        "in line"
    );
    assert!(
        key_until(direct, blocked, in_line, five).await.is_some(),
        "in line"
    );
    // The release of `blocked` wakes the waiter; its attempt on the victim is held up on
    // the wire, and fails.
    proxy.hold_open();
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let reply = within(five, "the waiter", request).await.unwrap();
    let unavailable = StatusCode::SERVICE_UNAVAILABLE;
    assert_eq!(reply.status, unavailable, "{}", reply.text());
    let none = |state: &KeyState| state.waiters() == 0;
    let withdrawn = key_until(direct, wanted, none, Duration::from_secs(3)).await;
    assert!(withdrawn.is_some(), "the waiter withdrew its place");
    let withdrawn = Instant::now();
    // Another request holds `wanted` now, and the held attempt lands: refused, it puts the
    // place back, after the first withdrawal's first re-send (0.25 s after it; the next
    // is due a second later, the last 3.25 s after it).
    let (gate, held) = hold(direct, wanted).await;
    tokio::time::sleep(Duration::from_millis(400).saturating_sub(withdrawn.elapsed())).await;
    let in_time = withdrawn.elapsed() < Duration::from_millis(1_200);
    proxy.release_held();
    let landed = key_until(direct, wanted, in_line, Duration::from_secs(2)).await;
    if in_time && landed.is_some() {
        let ended = key_until(direct, wanted, none, Duration::from_secs(9)).await;
        eprintln!("a place put back late ended {ended:?} after it landed");
        assert!(
            ended.is_some_and(|after| after < Duration::from_secs(4)),
            "a place put back late kept its place {ended:?}"
        );
    }
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    in_time && landed.is_some()
}

/// How long until `key`, as `locks` sees it, is as `until` wants, looked at every 10 ms
/// up to `limit`.
async fn key_until(
    locks: &Locks,
    key: &str,
    until: fn(&KeyState) -> bool,
    limit: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() <= limit {
        if until(&locks.inspect([key.to_owned()]).await.unwrap()[0]) {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_keeps_its_place_on_the_masters_that_granted_part_of_its_batch() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let masters = cluster.masters();
    // `held` on one master, `wanted` on another.
    let on = |port: u16| keys_on(&cluster, port, "key", 1).remove(0);
    let (held, wanted) = (on(masters[0]), on(masters[1]));

    // A waiter for both: the master of `wanted` grants its group, the other refuses, and
    // the grant is rolled back; the waiter's reservation stays on `wanted` all the same.
    let processes = (&locks(&cluster), &locks(&cluster));
    let line = Line::behind_a_hold(
        processes,
        &held,
        vec![held.clone(), wanted.clone()],
        &wanted,
    )
    .await;
    // A later request that does not wait is kept out of `wanted`, free as it is.
    let later = batch_router(&line.first, counting_handler(&Arc::default()));
    let reply = send(&later, batch(&[&wanted])).await;
    assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.text());

    line.served(&cluster).await;
}

/// A waiter in one process (the second of two `Locks`) for `batch`, in line behind `held`,
/// which the first holds until [`served`](Self::served).
struct Line {
    first: Locks,
    gate: Arc<Gate>,
    holding: tokio::task::JoinHandle<Reply>,
    waiting: tokio::task::JoinHandle<Reply>,
}

impl Line {
    /// Once the first process sees a waiter on `watched`.
    async fn behind_a_hold(
        (first, second): (&Locks, &Locks),
        held: &str,
        batch: Vec<String>,
        watched: &str,
    ) -> Self {
        let first = first.clone();
        let gate = Gate::new();
        let holder = batch_router(&first, gated_handler(&gate));
        let holding = {
            let held = held.to_owned();
            tokio::spawn(async move { send(&holder, self::batch(&[&held])).await })
        };
        gate.wait_entered().await;
        let waiting_locks = second.clone().wait(Wait::up_to(Duration::from_secs(10)));
        let waiter = batch_router(&waiting_locks, counting_handler(&Arc::default()));
        let waiting = tokio::spawn(async move { send(&waiter, self::batch(&batch)).await });
        within(Duration::from_secs(5), "the waiter stands in line", async {
            while first.inspect([watched.to_owned()]).await.unwrap()[0].waiters() == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        Self {
            first,
            gate,
            holding,
            waiting,
        }
    }

    /// Ends the hold: the holder and then the waiter are served, and no lock key is left
    /// on any master of `cluster`.
    async fn served(self, cluster: &Cluster) {
        self.gate.open();
        assert_eq!(self.holding.await.unwrap().status, StatusCode::OK);
        let waited = within(Duration::from_secs(5), "the waiter", self.waiting).await;
        assert_eq!(waited.unwrap().status, StatusCode::OK);
        assert_emptied(cluster).await;
    }
}

/// The first `count` keys `{prefix}{i}` whose slots the master at `port` serves.
fn keys_on(cluster: &Cluster, port: u16, prefix: &str, count: usize) -> Vec<String> {
    keys_in(cluster, &slot_ranges(cluster, port), prefix, count)
}

/// The first `count` keys `{prefix}{i}` whose lock keys' slots are in `ranges`.
fn keys_in(cluster: &Cluster, ranges: &[(u16, u16)], prefix: &str, count: usize) -> Vec<String> {
    let port = cluster.masters()[0];
    let in_ranges = |key: &String| {
        let lock_key = format!("lock:{key}");
        let slot: u16 = cluster.cmd(port, redis::cmd("CLUSTER").arg("KEYSLOT").arg(lock_key));
        ranges
            .iter()
            .any(|&(first, last)| (first..=last).contains(&slot))
    };
    (0..)
        .map(|i| format!("{prefix}{i}"))
        .filter(in_ranges)
        .take(count)
        .collect()
}

/// Whether the master at `port` serves the lock key of `key`, by its own map.
fn serves(cluster: &Cluster, port: u16, key: &str) -> bool {
    let slot: u16 = cluster.cmd(
        port,
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(format!("lock:{key}")),
    );
    owns(cluster, port, slot)
}

/// 80 keys on each master, by master: a group of 64 keys or more, whose waiter keeps its
/// place there with a claim.
fn groups_on_every_master(cluster: &Cluster) -> Vec<Vec<String>> {
    cluster
        .masters()
        .into_iter()
        .map(|port| keys_on(cluster, port, "big", 80))
        .collect()
}

/// Asserts that every master keeps `keys` keys of claims (`claims.lua`): its registry and
/// each claim's set (2 for one waiter's claim).
fn assert_claims_on_every_master(cluster: &Cluster, keys: usize) {
    for port in cluster.masters() {
        let claims = claims_on(cluster, port);
        assert_eq!(claims.len(), keys, "master {port}: {claims:?}");
    }
}

/// The keys of claims (registries and claims' sets) that the master at `port` keeps.
fn claims_on(cluster: &Cluster, port: u16) -> Vec<String> {
    cluster.cmd(port, redis::cmd("KEYS").arg("tower-batch-lock:claims*"))
}

/// A big waiter keeps its place on each master with a claim (its keys stay as they are),
/// on the masters that refused its groups and on those that granted theirs and rolled
/// them back; a later request is kept out of a free key that the claim names, and the
/// grant ends every claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_big_waiter_keeps_its_place_with_a_claim_on_every_master() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    // One key of the first master's group is held.
    let groups = groups_on_every_master(&cluster);
    let big = groups.concat();
    // Free keys on the other masters, which granted their groups and rolled them back.
    let elsewhere = [&groups[1][0], &groups[2][79]];
    let processes = (&locks(&cluster), &locks(&cluster));
    let line = Line::behind_a_hold(processes, &groups[0][0], big, elsewhere[0]).await;
    assert_claims_on_every_master(&cluster, 2);
    assert_eq!(
        cluster
            .locks_on_masters()
            .into_iter()
            .flatten()
            .collect::<Vec<_>>(),
        vec![format!("lock:{}", groups[0][0])],
        "a claim leaves its free keys as they are"
    );
    // A later request that does not wait is kept out of free keys the claim names.
    let later = batch_router(&line.first, counting_handler(&Arc::default()));
    for key in elsewhere {
        let reply = send(&later, batch(&[key])).await;
        assert_eq!(
            reply.status,
            StatusCode::CONFLICT,
            "{key}: {}",
            reply.text()
        );
    }

    line.served(&cluster).await;
    assert_claims_on_every_master(&cluster, 0);
}

/// A big group refused by its master, right after a refusal (no plain pass then), reads its
/// keys and writes none, where taking its free keys to give them back cost Redis two writes
/// a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_big_group_reads_its_keys_and_writes_none() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let group = keys_on(&cluster, cluster.masters()[0], "one", 80);
    let (first, second) = (locks(&cluster), locks(&cluster));
    let gate = Gate::new();
    let holder = batch_router(&first, gated_handler(&gate));
    let holding = {
        let held = group[40].clone();
        tokio::spawn(async move { send(&holder, batch(&[&held])).await })
    };
    gate.wait_entered().await;

    let contender = batch_router(&second, counting_handler(&Arc::default()));
    let reply = send(&contender, batch(&group)).await;
    assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.text());
    let (sets, dels) = (cluster.calls_of("set"), cluster.calls_of("del"));
    let reply = send(&contender, batch(&group)).await;
    assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.text());
    assert_eq!(
        (
            cluster.calls_of("set") - sets,
            cluster.calls_of("del") - dels
        ),
        (0, 0),
        "the refused group wrote keys"
    );
    assert!(cluster.calls_of("get") >= 80, "the group read its keys");

    gate.open();
    assert_eq!(holding.await.unwrap().status, StatusCode::OK);
    assert_emptied(&cluster).await;
}

/// The claims registry a process names for the master at `port`, as the store names it
/// (`topology.rs`): the first hash tag, from 0, of a slot the master serves.
fn registry_of(cluster: &Cluster, port: u16) -> String {
    (0..)
        .map(|tag| format!("tower-batch-lock:claims{{{tag}}}"))
        .find(|name| {
            let slot: u16 = cluster.cmd(port, redis::cmd("CLUSTER").arg("KEYSLOT").arg(name));
            owns(cluster, port, slot)
        })
        .unwrap()
}

/// Once the slot of a master's claims registry moves, the calls that named it fail until
/// the store reads the new map, which names another: a big waiter then keeps its place
/// with claims on every master, and is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_moved_claims_registry_is_named_again_from_the_new_map() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let masters = cluster.masters();
    let groups = groups_on_every_master(&cluster);
    let big = groups.concat();
    // Both processes read the map (a wait, a grant and its release), before the move.
    let processes = (&locks(&cluster), &locks(&cluster));
    let line = Line::behind_a_hold(processes, &groups[0][0], big.clone(), &groups[1][0]).await;
    line.served(&cluster).await;
    let moved = registry_of(&cluster, masters[0]);
    cluster.move_slot(&moved, masters[1]);
    assert_ne!(registry_of(&cluster, masters[0]), moved);

    let line = Line::behind_a_hold(processes, &groups[0][0], big, &groups[1][0]).await;
    assert_claims_on_every_master(&cluster, 2);
    line.served(&cluster).await;
    assert_claims_on_every_master(&cluster, 0);
}

/// A master's claims registry moved with the claims in it (its slot resharded, keys and
/// all) while a big waiter stands in line: the holder's release, named against the old
/// map, is sent again on the new one, the waiter is served (its claim on that master is
/// gone, so a later arrival could pass it there meanwhile; nobody is let into a held
/// key), and nothing is left on any lock key. The claims that moved, and those of a
/// registry that the new map no longer names, are ended by the grant where the new map
/// names their registry again, and end by themselves by the waiter's deadline where it
/// does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_registry_moved_with_its_claims_still_serves_its_waiter() {
    let (_serial, cluster) = Cluster::start_in_turn().await;
    let masters = cluster.masters();
    let groups = groups_on_every_master(&cluster);
    let big = groups.concat();
    let processes = (&locks(&cluster), &locks(&cluster));
    let line = Line::behind_a_hold(processes, &groups[0][0], big, &groups[1][0]).await;
    assert_claims_on_every_master(&cluster, 2);
    let moved = registry_of(&cluster, masters[0]);
    cluster.move_slot(&moved, masters[1]);
    assert!(claims_on(&cluster, masters[0]).is_empty());
    let moved_keys = claims_on(&cluster, masters[1])
        .into_iter()
        .filter(|key| key.starts_with(&moved))
        .count();
    assert_eq!(moved_keys, 2, "the registry and the claim moved");

    line.served(&cluster).await;
    // The waiter waits up to 10 s, and keeps its place 500 ms past that.
    for port in masters {
        for key in claims_on(&cluster, port) {
            let ttl: i64 = cluster.cmd(port, redis::cmd("PTTL").arg(&key));
            assert!((1..=10_500).contains(&ttl), "{key} lives {ttl} ms more");
        }
    }
}
