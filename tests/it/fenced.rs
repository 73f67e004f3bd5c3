//! Writes a paused process cannot corrupt: the paused-holder story, on the locks of one
//! Redis and of Redlock, with the data in a Redis of its own.
//!
//! A is granted `sku:pz1` and reads its stock (10); A pauses past its lease (its lease is
//! not renewed: a paused process renews nothing); B is granted the sku and sells one
//! (9); A resumes and writes what it computed (9). A plain `SET` loses B's sale: two
//! orders answered 201, the stock reads 9. [`fenced::set`] refuses A's write, whose token
//! is older than B's: A answers 409, and the stock reads 10 less the orders answered 201.

use std::time::Duration;

use axum::{
    extract::{Path, State},
    http::{HeaderMap, StatusCode},
    routing::post,
    Router,
};
use tower_batch_lock::{
    deadpool_redis::Pool,
    fenced, keys,
    store::{Redis, Redlock, Store},
    Lease, Locks,
};

use crate::support::{http::send, RedisServer};

/// Sells one unit of `sku`: reads the stock, pauses as long as `x-pause-ms` says, writes
/// the stock less one (fenced or not, as the app is set).
async fn sell(
    State((data, fencing)): State<(Pool, bool)>,
    Path(sku): Path<String>,
    headers: HeaderMap,
    lease: Lease,
) -> StatusCode {
    let key = format!("stock:{sku}");
    let mut redis = data.get().await.unwrap();
    let stock: u64 = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut *redis)
        .await
        .unwrap();
    if let Some(pause) = headers.get("x-pause-ms") {
        let pause = pause.to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    let left = (stock - 1).to_string();
    let written = if fencing {
        fenced::set(&mut *redis, lease.fencing_token(), &[(key.as_str(), left)])
            .await
            .unwrap()
    } else {
        let () = redis::cmd("SET")
            .arg(&key)
            .arg(left)
            .query_async(&mut *redis)
            .await
            .unwrap();
        true
    };
    if written {
        StatusCode::CREATED
    } else {
        StatusCode::CONFLICT
    }
}

/// Runs the story on `store`: the statuses of A and B, and the stock after.
async fn paused_holder(
    store: Store,
    data: &RedisServer,
    fencing: bool,
) -> (StatusCode, StatusCode, u64) {
    let pool = data.pool();
    let mut redis = pool.get().await.unwrap();
    let () = redis::cmd("SET")
        .arg("stock:pz1")
        .arg(10)
        .query_async(&mut *redis)
        .await
        .unwrap();
    let _: u64 = redis::cmd("DEL")
        .arg(fenced::fence_key("stock:pz1"))
        .query_async(&mut *redis)
        .await
        .unwrap();
    let locks = Locks::new(store)
        .ttl(Duration::from_millis(300))
        .renew_lease(false)
        .wait(tower_batch_lock::Wait::up_to(Duration::from_secs(2)));
    let app = Router::new()
        .route(
            "/sell/{sku}",
            post(sell).layer(locks.layer(keys::path("sku"))),
        )
        .with_state((pool.clone(), fencing));
    let a = {
        let app = app.clone();
        tokio::spawn(async move {
            let request = http::Request::post("/sell/pz1")
                .header("x-pause-ms", "800")
                .body(axum::body::Body::empty())
                .unwrap();
            send(&app, request).await.status
        })
    };
    // B arrives while A holds the sku, waits for A's lease to run out, and sells.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let request = http::Request::post("/sell/pz1")
        .body(axum::body::Body::empty())
        .unwrap();
    let b = send(&app, request).await.status;
    let a = a.await.unwrap();
    let stock: u64 = redis::cmd("GET")
        .arg("stock:pz1")
        .query_async(&mut *redis)
        .await
        .unwrap();
    (a, b, stock)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_paused_past_its_lease_cannot_overwrite_the_next_holders_write() {
    let data = RedisServer::start();
    let lock_redis = RedisServer::start();
    let masters: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    let stores = || {
        [
            ("redis", Redis::pool(lock_redis.pool()).build().unwrap()),
            ("redlock", Redlock::new(&urls).build().unwrap()),
        ]
    };
    for (name, store) in stores() {
        // The control: a plain write loses B's sale.
        let (a, b, stock) = paused_holder(store, &data, false).await;
        assert_eq!(
            (a, b, stock),
            (StatusCode::CREATED, StatusCode::CREATED, 9),
            "{name}"
        );
    }
    for (name, store) in stores() {
        let (a, b, stock) = paused_holder(store, &data, true).await;
        assert_eq!(
            (a, b),
            (StatusCode::CONFLICT, StatusCode::CREATED),
            "{name}"
        );
        assert_eq!(stock, 9, "{name}: 10 less the one order answered 201");
    }
}

/// The write takes all its keys or none, and an equal token (the same grant) writes
/// again.
#[tokio::test]
async fn a_fenced_write_is_all_or_nothing() {
    let data = RedisServer::start();
    let pool = data.pool();
    let locks = Locks::new(Store::isolated_memory());
    let (first, second) = (
        token_of_a_grant(&locks).await,
        token_of_a_grant(&locks).await,
    );
    assert!(second > first);
    let write = |token, value: &'static str| {
        let pool = pool.clone();
        async move {
            let mut redis = pool.get().await.unwrap();
            let writes = [("a", value), ("b", value)];
            fenced::set(&mut *redis, token, &writes).await.unwrap()
        }
    };
    assert!(write(first, "1").await);
    assert!(write(second, "2").await);
    assert!(
        write(second, "2 again").await,
        "the same grant writes again"
    );
    assert!(!write(first, "1 late").await);
    // `b` alone was written by a newer token: neither key takes the older one.
    let mut redis = pool.get().await.unwrap();
    let () = redis::cmd("SET")
        .arg(fenced::fence_key("a"))
        .arg(first.get())
        .query_async(&mut *redis)
        .await
        .unwrap();
    assert!(!write(first, "1 again").await);
    let values: Vec<String> = redis::cmd("MGET")
        .arg(&["a", "b"])
        .query_async(&mut *redis)
        .await
        .unwrap();
    assert_eq!(values, ["2 again", "2 again"]);
}

/// The fencing token of a fresh grant on `locks`, as its handler saw it.
async fn token_of_a_grant(locks: &Locks) -> tower_batch_lock::FencingToken {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let app = {
        let seen = seen.clone();
        Router::new().route(
            "/",
            post(move |lease: Lease| async move {
                *seen.lock().unwrap() = Some(lease.fencing_token());
            })
            .layer(locks.layer(|_: &http::request::Parts| Ok::<_, StatusCode>(["t"]))),
        )
    };
    let request = http::Request::post("/")
        .body(axum::body::Body::empty())
        .unwrap();
    assert_eq!(send(&app, request).await.status, StatusCode::OK);
    let token = seen.lock().unwrap().take();
    token.unwrap()
}

/// On a cluster, a write over keys of several slots: written whole with the newest token,
/// refused whole (nothing written in any slot) when a later token wrote one of its keys.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_write_across_slots_is_refused_whole_when_a_later_token_wrote_one_key() {
    use fenced::Written;
    use redis::cluster_routing::Slot;

    let (_serial, cluster) = crate::support::cluster::Cluster::start_in_turn().await;
    let client = redis::cluster::ClusterClient::new(cluster.urls()).unwrap();
    let mut data = client.get_async_connection().await.unwrap();
    let keys = ["stock:apple", "stock:pear", "stock:plum", "order:1"];
    let slots: std::collections::HashSet<Slot> = keys.iter().map(Slot::for_key).collect();
    assert!(slots.len() > 2, "the keys span slots");
    let locks = Locks::new(Store::isolated_memory());
    let (first, second) = (
        token_of_a_grant(&locks).await,
        token_of_a_grant(&locks).await,
    );
    let writes = |value: &'static str| keys.map(|key| (key, value));

    let written = fenced::set_across_slots(&mut data, first, &writes("1")).await;
    assert_eq!(written.unwrap(), Written::All);
    // A later holder writes one key, in its slot alone.
    let newer = [("stock:plum", "2")];
    assert!(fenced::set(&mut data, second, &newer).await.unwrap());
    let stale = fenced::set_across_slots(&mut data, first, &writes("1 late")).await;
    assert_eq!(stale.unwrap(), Written::Nothing);
    let values: Vec<String> = redis::cmd("MGET")
        .arg(&keys)
        .query_async(&mut data)
        .await
        .unwrap();
    assert_eq!(values, ["1", "1", "2", "1"], "no slot took the stale write");
    let again = fenced::set_across_slots(&mut data, second, &writes("2 again")).await;
    assert_eq!(
        again.unwrap(),
        Written::All,
        "the later grant writes every slot"
    );
}
