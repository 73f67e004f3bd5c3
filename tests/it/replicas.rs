//! Replica acknowledgement (`store::Redis::replicas`): a grant counts only once a replica
//! has it. A real master and replica (`--replicaof`) on free loopback ports: with the
//! replica up, the handler runs under a lock the replica already holds; with the replica
//! frozen or stopped, the request gets 503 within the wait and nothing is left on the
//! master; thawed, grants resume.

use std::time::{Duration, Instant};

use http::StatusCode;
use tower_batch_lock::{store::Redis, Locks};

use crate::support::{
    http::{batch, batch_router, poll_every, send},
    Observer, RedisServer,
};

/// How long a grant waits for its replica.
const WAIT: Duration = Duration::from_millis(300);

/// Whether the replica's link to its master is up (it is in sync).
fn in_sync(replica: &Observer) -> bool {
    let info: String = replica.cmd(redis::cmd("INFO").arg("replication"));
    info.contains("master_link_status:up")
}

/// A route that answers whether the replica holds `lock:doc` while the handler runs.
fn app(locks: &Locks, replica: &Observer) -> axum::Router {
    let replica = replica.clone();
    batch_router(locks, move || {
        let replica = replica.clone();
        async move {
            let held = tokio::task::spawn_blocking(move || replica.get("lock:doc").is_some());
            format!("on the replica: {}", held.await.unwrap())
        }
    })
}

/// A route whose handler does nothing.
fn bare(locks: &Locks) -> axum::Router {
    batch_router(locks, || async {})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_waits_for_its_replica_and_is_refused_and_released_without_it() {
    let master = RedisServer::start();
    let mut replica = RedisServer::start_replica_of(&master);
    let (on_master, on_replica) = (Observer::of(&master), Observer::of(&replica));
    let synced = poll_every(Duration::from_millis(20), Duration::from_secs(10), || {
        in_sync(&on_replica)
    })
    .await;
    assert!(synced.is_some(), "the replica did not sync");
    let plain_locks = Locks::new(Redis::url(master.url()).build().unwrap());
    let locks = Locks::new(Redis::url(master.url()).replicas(1, WAIT).build().unwrap());
    let (plain, acknowledged) = (bare(&plain_locks), bare(&locks));

    // The check sees the replica; asking for two fails it.
    assert!(locks.check().await.is_ok());
    let two = Locks::new(Redis::url(master.url()).replicas(2, WAIT).build().unwrap());
    let error = two.check().await.unwrap_err().to_string();
    assert!(error.contains("waits for 2 replicas"), "{error}");

    // Up: granted, and the replica holds the lock before the handler runs.
    let reply = send(&app(&locks, &on_replica), batch(&["doc"])).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.text(), "on the replica: true");
    // What it costs: sequential grants with and without the acknowledgement.
    let mut took = Vec::new();
    for app in [&plain, &acknowledged] {
        let started = Instant::now();
        for _ in 0..50 {
            assert_eq!(send(app, batch(&["doc"])).await.status, StatusCode::OK);
        }
        took.push(started.elapsed() / 50);
    }
    eprintln!(
        "a grant and its release: {:?} plain, {:?} with WAIT 1",
        took[0], took[1]
    );

    // Frozen: no acknowledgement, so 503 after the wait, and the grant released.
    replica.pause();
    let started = Instant::now();
    let reply = send(&acknowledged, batch(&["doc", "other"])).await;
    let refused_in = started.elapsed();
    replica.resume();
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.text()
    );
    assert!(reply.headers.contains_key("retry-after"));
    assert!(
        refused_in >= WAIT && refused_in < WAIT + Duration::from_millis(500),
        "refused in {refused_in:?}"
    );
    assert!(on_master.locks().is_empty(), "{:?}", on_master.locks());
    eprintln!("replica frozen: 503 in {refused_in:?}, nothing left on the master");

    // Thawed: grants resume.
    let reply = send(&acknowledged, batch(&["doc"])).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());

    // Stopped: the same.
    replica.kill();
    let reply = send(&acknowledged, batch(&["doc"])).await;
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.text()
    );
    assert!(on_master.locks().is_empty(), "{:?}", on_master.locks());
    // Without the option, the master alone grants.
    assert_eq!(send(&plain, batch(&["doc"])).await.status, StatusCode::OK);
}

/// On a cluster, each master's group waits for that master's replica: with the replica of
/// the key's master frozen, the batch is refused (503) and rolled back on every master;
/// thawed, grants resume.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_grant_waits_for_the_replicas_of_its_masters() {
    use crate::support::cluster::Cluster;
    use tower_batch_lock::store::RedisCluster;

    let (_turn, cluster) = Cluster::start_in_turn().await;
    let store = RedisCluster::new(cluster.urls())
        .node_timeout(Duration::from_secs(1))
        .retry_for(Duration::from_secs(1))
        .replicas(1, WAIT)
        .build()
        .unwrap();
    let locks = Locks::new(store).store_timeout(Duration::from_secs(3));
    let app = bare(&locks);
    // Keys on every master, so that the batch has a group on each.
    let keys: Vec<String> = (0..30).map(|i| format!("k{i}")).collect();
    // A few tries: on a loaded machine a fresh replica can miss one `WAIT` of 300 ms.
    assert!(
        granted_within_tries(&app, &keys).await,
        "no grant with healthy replicas"
    );

    let (master, replicas) = cluster.shard_of(cluster.masters()[0], "lock:doc");
    cluster.signal(replicas[0], "STOP");
    let started = Instant::now();
    let reply = send(&app, batch(&["doc".to_owned()])).await;
    let refused_in = started.elapsed();
    let mixed = send(&app, batch(&keys)).await;
    cluster.signal(replicas[0], "CONT");
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.text()
    );
    let doc_on_master = keys.iter().any(|k| {
        let (owner, _) = cluster.shard_of(master, &format!("lock:{k}"));
        owner == master
    });
    if doc_on_master {
        assert_eq!(
            mixed.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            mixed.text()
        );
    }
    let emptied = poll_every(Duration::from_millis(20), Duration::from_secs(3), || {
        cluster.empty()
    })
    .await;
    assert!(emptied.is_some(), "left: {:?}", cluster.locks_on_masters());
    eprintln!("cluster, a master's replica frozen: 503 in {refused_in:?}, nothing left");

    assert!(
        granted_within_tries(&app, &keys).await,
        "grants did not resume after the thaw"
    );
}

/// Whether a batch of `keys` was granted within 30 tries, 100 ms apart.
#[cfg(feature = "cluster")]
async fn granted_within_tries(app: &axum::Router, keys: &[String]) -> bool {
    for _ in 0..30 {
        if send(app, batch(keys)).await.status == StatusCode::OK {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// A grant's `WAIT` runs on a connection of the store's own: one cut short (the store
/// timeout gave up on it) is closed, never handed back busy to the pool you gave
/// (`Redis::pool`), whose next user would wait behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_cut_short_leaves_no_busy_connection_in_your_pool() {
    let master = RedisServer::start();
    let replica = RedisServer::start_replica_of(&master);
    let on_replica = Observer::of(&replica);
    let synced = poll_every(Duration::from_millis(20), Duration::from_secs(10), || {
        in_sync(&on_replica)
    })
    .await;
    assert!(synced.is_some(), "the replica did not sync");
    let pool = master.pool_of(1);
    let store = Redis::pool(pool.clone())
        .replicas(1, Duration::from_secs(2))
        .build()
        .unwrap();
    let locks = Locks::new(store).store_timeout(Duration::from_millis(300));

    replica.pause();
    let reply = send(&bare(&locks), batch(&["doc"])).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    // The pool's connection answers at once (1 ms here), not behind the `WAIT` (300 ms
    // when it was handed back to the pool).
    let started = Instant::now();
    let mut connection = pool.get().await.unwrap();
    let () = redis::cmd("PING")
        .query_async(&mut *connection)
        .await
        .unwrap();
    let took = started.elapsed();
    replica.resume();
    assert!(took < Duration::from_millis(150), "{took:?}");
}
