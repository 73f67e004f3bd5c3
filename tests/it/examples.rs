//! The small examples, run as their users run them: each example's router, on the store it
//! is for (real `redis-server` processes, a real cluster), driven through HTTP requests.

use axum::{body::Body, Router};
use http::{header, Request, StatusCode};

use crate::support::http::send;
#[cfg(feature = "redis")]
use crate::support::{handlers::Gate, http::Reply};

#[path = "../../examples/memory.rs"]
#[allow(dead_code, unreachable_pub)] // its `main`
mod memory_example;

fn order(skus: &str) -> Request<Body> {
    Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(format!(r#"{{"skus": [{skus}]}}"#)))
        .unwrap()
}

/// Checks the routes every store's example serves: both lock, a batch answers with its
/// fence, a request that names no sku is a 400 problem, and an update goes through.
async fn serves_the_orders_routes(app: &Router) {
    let created = send(app, order(r#""a", "b""#)).await;
    assert_eq!(created.status, StatusCode::OK, "{}", created.text());
    assert!(
        created.text().starts_with("2 skus locked under fence "),
        "{}",
        created.text()
    );
    let empty = send(app, order("")).await;
    assert_eq!(empty.status, StatusCode::BAD_REQUEST);
    assert_eq!(empty.problem()["limit"], "no_keys");
    let updated = send(app, Request::put("/orders/42").body(Body::empty()).unwrap()).await;
    assert_eq!(updated.status, StatusCode::OK);
}

#[tokio::test]
async fn memory_example_locks_its_routes() {
    let locks = tower_batch_lock::Locks::new(tower_batch_lock::store::Store::isolated_memory());
    serves_the_orders_routes(&memory_example::app(&locks)).await;
}

#[cfg(feature = "redis")]
#[path = "../../examples/redis.rs"]
#[allow(dead_code, unreachable_pub)]
mod redis_example;

#[cfg(feature = "redis")]
#[path = "../../examples/redlock.rs"]
#[allow(dead_code, unreachable_pub)]
mod redlock_example;

#[cfg(feature = "redis")]
mod redis {
    use std::time::Instant;

    use axum::routing::post;
    use tower_batch_lock::{store::Redis, Locks};

    use super::{redis_example, redlock_example, *};
    use crate::support::{
        handlers::gated_handler,
        http::{header_keys, post_keys},
        RedisServer,
    };

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_example_locks_across_processes() {
        let server = RedisServer::start();
        let app = redis_example::app(&server.url()).unwrap();
        serves_the_orders_routes(&app).await;

        // Another process holds `sku:x`: the example waits its 300 ms, then answers 409.
        let other = Locks::new(Redis::url(server.url()).build().unwrap());
        let gate = Gate::new();
        let holder = Router::new().route(
            "/",
            post(gated_handler(&gate)).layer(other.layer(header_keys)),
        );
        let held = tokio::spawn(async move { send(&holder, post_keys("/", "sku:x")).await });
        gate.wait_entered().await;
        let started = Instant::now();
        let refused = send(&app, order(r#""x", "y""#)).await;
        assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
        assert!(started.elapsed() >= std::time::Duration::from_millis(300));
        gate.open();
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
        assert_eq!(
            send(&app, order(r#""x", "y""#)).await.status,
            StatusCode::OK
        );
        // Nothing is left but the namespace's fencing counter.
        assert_eq!(server.keys("lock:?*"), Vec::<String>::new());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redlock_example_locks_on_three_masters() {
        let masters: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
        let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
        serves_the_orders_routes(&redlock_example::app(&urls).unwrap()).await;
        // Two masters are a majority: the locks go on without the third.
        let mut masters = masters;
        masters[0].kill();
        let app = redlock_example::app(&urls).unwrap();
        let reply: Reply = send(&app, order(r#""c""#)).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    }
}

#[cfg(feature = "cluster")]
#[path = "../../examples/cluster.rs"]
#[allow(dead_code, unreachable_pub)]
mod cluster_example;

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_example_locks_on_a_cluster() {
    let (_turn, cluster) = crate::support::cluster::Cluster::start_in_turn().await;
    let app = cluster_example::app(&cluster.urls()).unwrap();
    serves_the_orders_routes(&app).await;
}

#[cfg(feature = "idempotency")]
#[path = "../../examples/idempotency.rs"]
#[allow(dead_code, unreachable_pub)]
mod idempotency_example;

#[cfg(feature = "idempotency")]
#[tokio::test]
async fn idempotency_example_replays_a_retry_and_never_stores_a_refusal() {
    use std::sync::{atomic::Ordering, Arc};
    let created = Arc::default();
    let locks = tower_batch_lock::Locks::new(tower_batch_lock::store::Store::isolated_memory());
    let app = idempotency_example::app(&locks, Arc::clone(&created));
    let with_key = |body: &str| {
        Request::post("/orders")
            .header(header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", "\"k-1\"")
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    // A body the lock layer refuses is not stored: its correction, with the same key, runs.
    let refused = send(&app, with_key(r#"{"skus": [1]}"#)).await;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
    let first = send(&app, with_key(r#"{"skus": ["a"]}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = send(&app, with_key(r#"{"skus": ["a"]}"#)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry.body, first.body);
    assert_eq!(created.load(Ordering::SeqCst), 1);
    // Without a key: 400, as the route requires one.
    let keyless = Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(r#"{"skus": ["a"]}"#))
        .unwrap();
    assert_eq!(send(&app, keyless).await.status, StatusCode::BAD_REQUEST);
}

#[cfg(feature = "metrics")]
#[path = "../../examples/metrics.rs"]
#[allow(dead_code, unreachable_pub)]
mod metrics_example;

#[cfg(feature = "metrics")]
#[tokio::test]
async fn metrics_example_renders_the_layers_metrics_with_buckets() {
    let recorder = metrics_example::recorder().unwrap();
    let admin = metrics_example::admin(&recorder);
    let locks = tower_batch_lock::Locks::new(tower_batch_lock::store::Store::isolated_memory());
    let app = metrics_example::app(&locks);
    // The recorder of this test only: the binary's global one is another test's.
    let _local = metrics::set_default_local_recorder(&recorder);
    let updated = send(
        &app,
        Request::put("/orders/42").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(updated.status, StatusCode::OK);
    let rendered = send(
        &admin,
        Request::get("/metrics").body(Body::empty()).unwrap(),
    )
    .await;
    let text = rendered.text();
    assert!(
        text.contains(r#"tower_batch_lock_acquisitions_total{layer="orders",mode="exclusive",outcome="granted"} 1"#),
        "{text}"
    );
    // Histograms, with buckets: not summaries.
    assert!(
        text.contains("tower_batch_lock_keys_bucket{layer=\"orders\",le=\"1\"} 1"),
        "{text}"
    );
}
