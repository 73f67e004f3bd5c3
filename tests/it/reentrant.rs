//! Re-entrant locking, against real `redis-server` processes (and the memory store): nested
//! layers on one request, locks taken by the handler, and an owner passed to a trusted
//! downstream service.

use std::time::Duration;
use tower_batch_lock::store::{Redis, Store};

use axum::{
    body::Body,
    extract::Request as AxumRequest,
    routing::{post, put},
    Extension, Router,
};
use http::{request::Parts, HeaderName, Request, StatusCode};
use tokio::sync::oneshot;
use tower::ServiceExt;
use tower_batch_lock::{keys, Lease, Locks, Rejection};

use crate::support::{
    self,
    http::{header_keys, post_keys},
    lock_value, RedisServer,
};

/// The status and the body of `request`'s response.
async fn send(app: &Router, request: Request<Body>) -> (StatusCode, String) {
    let reply = support::http::send(app, request).await;
    (reply.status, reply.text())
}

/// How many holds a lock key has (0: free), and how many owners among them.
fn holds(server: &RedisServer, key: &str) -> (usize, usize) {
    let value = lock_value(&mut server.connection(), key);
    value.map_or((0, 0), |v| (v.holds.len(), usize::from(v.owner.is_some())))
}

/// A route that another owner holds `keys` on until the returned sender fires.
async fn hold_elsewhere(locks: &Locks, keys: &str) -> oneshot::Sender<()> {
    let (release, released) = oneshot::channel::<()>();
    let (entered, is_entered) = oneshot::channel::<()>();
    let (released, entered) = (
        std::sync::Mutex::new(Some(released)),
        std::sync::Mutex::new(Some(entered)),
    );
    let released = std::sync::Arc::new(released);
    let entered = std::sync::Arc::new(entered);
    let app = Router::new().route(
        "/",
        post(move || {
            let (released, entered) = (released.clone(), entered.clone());
            async move {
                let _ = entered.lock().unwrap().take().unwrap().send(());
                let released = released.lock().unwrap().take().unwrap();
                let _ = released.await;
            }
        })
        .layer(locks.layer(header_keys)),
    );
    let request = post_keys("/", keys);
    tokio::spawn(async move { app.oneshot(request).await });
    is_entered.await.expect("the other owner got its keys");
    release
}

/// A router-wide layer locks the tenant and the SKU; the route's own layer locks the SKU
/// again (and the handler checks what Redis holds).
fn nested(locks: &Locks, server: &RedisServer) -> Router {
    let url = server.url();
    let inspect = move |Extension(lease): Extension<Lease>| {
        let url = url.clone();
        async move {
            let server = redis::Client::open(url).unwrap();
            let mut redis = server.get_connection().unwrap();
            let sku = lock_value(&mut redis, "lock:sku:1").unwrap();
            let tenant = lock_value(&mut redis, "lock:tenant:acme").unwrap();
            // Two holds of one owner on the SKU, one on the tenant.
            let one_owner =
                sku.holds.len() == 2 && tenant.holds.len() == 1 && sku.owner == tenant.owner;
            format!("{one_owner} {}", lease.keys().collect::<Vec<_>>().join(","))
        }
    };
    Router::new()
        .route(
            "/skus/{sku}",
            put(inspect).layer(locks.layer(keys::path("sku"))),
        )
        .layer(locks.layer(|_: &Parts| Ok::<_, Rejection>(["tenant:acme", "sku:1"])))
}

#[tokio::test]
async fn nested_layers_reenter_their_own_keys_and_free_them_after_the_request() {
    let server = RedisServer::start();
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap());
    let app = nested(&locks, &server);

    let (status, body) = send(&app, Request::put("/skus/1").body(Body::empty()).unwrap()).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the request contended with itself: {body}"
    );
    // The handler sees the innermost layer's lease, which speaks for both layers.
    assert_eq!(body, "true sku:1,tenant:acme");
    assert_eq!(
        server.keys("lock:?*"),
        Vec::<String>::new(),
        "keys left after the request"
    );

    // Another owner is still kept out while the request holds them.
    let release = hold_elsewhere(&locks, "sku:1").await;
    let (status, _) = send(&app, Request::put("/skus/1").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(
        holds(&server, "lock:tenant:acme"),
        (0, 0),
        "a refused nested request kept its outer keys"
    );
    let _ = release.send(());
}

#[tokio::test]
async fn nested_layers_reenter_on_the_memory_store_too() {
    let locks = Locks::new(Store::isolated_memory());
    let app = Router::new()
        .route(
            "/skus/{sku}",
            put(|| async { "ok" }).layer(locks.layer(keys::path("sku"))),
        )
        .layer(locks.layer(|_: &Parts| Ok::<_, Rejection>(["sku:1"])));
    for _ in 0..3 {
        let (status, _) = send(&app, Request::put("/skus/1").body(Body::empty()).unwrap()).await;
        assert_eq!(status, StatusCode::OK);
    }
}

/// A task of the handler's that outlives its request cannot lock more keys for it: they
/// would be held, and renewed, with nobody to release them. It gets a 500 that says why,
/// and the keys stay free.
#[tokio::test]
async fn a_lock_after_the_request_ended_is_refused_and_holds_nothing() {
    let locks = Locks::new(Store::isolated_memory());
    let (ended, ended_seen) = oneshot::channel::<()>();
    let (late_lock, late_lock_seen) = oneshot::channel();
    let once = std::sync::Arc::new(std::sync::Mutex::new(Some((ended_seen, late_lock))));
    let app = Router::new().route(
        "/",
        post(move |Extension(lease): Extension<Lease>| {
            let (ended_seen, late_lock) = once.lock().unwrap().take().unwrap();
            tokio::spawn(async move {
                let _ = ended_seen.await;
                let _ = late_lock.send(lease.lock(["account:7"]).await.map(|_| ()));
            });
            async { "ok" }
        })
        .layer(locks.layer(header_keys)),
    );
    let (status, _) = send(&app, post_keys("/", "order:1")).await;
    assert_eq!(status, StatusCode::OK);
    ended.send(()).unwrap();
    let refused = late_lock_seen.await.unwrap().unwrap_err();
    assert_eq!(refused.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let view = locks.inspect(["account:7"]).await.unwrap();
    assert_eq!(view[0].status(), tower_batch_lock::KeyStatus::Free);
}

/// A handler that also locks the keys in `x-more`, and says how that went.
fn locking_more(locks: &Locks) -> Router {
    Router::new().route(
        "/",
        post(
            |Extension(lease): Extension<Lease>, request: AxumRequest| async move {
                let more = request
                    .headers()
                    .get("x-more")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                match lease.lock(more.split(',')).await {
                    Ok(held) => Ok(format!("fence {}", held.lease().fencing_token())),
                    Err(refused) => Err(refused),
                }
            },
        )
        .layer(locks.layer(header_keys)),
    )
}

#[tokio::test]
async fn a_handler_locks_more_keys_all_or_nothing_and_they_go_with_the_request() {
    let server = RedisServer::start();
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap())
        .contention_status(StatusCode::LOCKED);
    let app = locking_more(&locks);

    // Granted: the layer's key, re-entered, and a new one.
    let request = Request::post("/")
        .header("x-keys", "order:1")
        .header("x-more", "order:1,account:7");
    let (status, body) = send(&app, request.body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.starts_with("fence "), "{body}");
    assert_eq!(
        server.keys("lock:?*"),
        Vec::<String>::new(),
        "the handler's keys outlived the request"
    );

    // Refused as configured when another owner holds one of them, and nothing taken.
    let release = hold_elsewhere(&locks, "account:8").await;
    let request = Request::post("/")
        .header("x-keys", "order:2")
        .header("x-more", "account:7,account:8");
    let (status, body) = send(&app, request.body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::LOCKED, "{body}");
    assert!(body.contains("account:8"), "{body}");
    assert_eq!(
        holds(&server, "lock:account:7"),
        (0, 0),
        "a refused batch took a key"
    );
    let _ = release.send(());
    assert!(
        eventually_free(&server).await,
        "{:?}",
        server.keys("lock:?*")
    );
}

async fn eventually_free(server: &RedisServer) -> bool {
    for _ in 0..100 {
        if server.keys("lock:?*").is_empty() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[tokio::test]
async fn an_inner_release_keeps_the_outer_hold_and_the_outermost_frees_everything() {
    let server = RedisServer::start();
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap());
    let (observe, observed) = oneshot::channel::<(usize, usize)>();
    let observe = std::sync::Arc::new(std::sync::Mutex::new(Some(observe)));
    let url = server.url();
    let app = Router::new().route(
        "/",
        post(move |Extension(lease): Extension<Lease>| {
            let observe = observe.lock().unwrap().take();
            let url = url.clone();
            async move {
                let inner = lease.lock(["doc:1", "doc:2"]).await.unwrap();
                inner.release().await;
                let mut redis = redis::Client::open(url).unwrap().get_connection().unwrap();
                let holds = |redis: &mut redis::Connection, key| {
                    lock_value(redis, key).map_or(0, |v| v.holds.len())
                };
                let outer = holds(&mut redis, "lock:doc:1");
                let extra = holds(&mut redis, "lock:doc:2");
                let _ = observe.unwrap().send((outer, extra));
            }
        })
        .layer(locks.layer(|_: &Parts| Ok::<_, Rejection>(["doc:1"]))),
    );
    let (status, _) = send(&app, Request::post("/").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    // After the inner release: the layer's hold on doc:1 remained, doc:2 was freed.
    assert_eq!(observed.await.unwrap(), (1, 0));
    assert_eq!(server.keys("lock:?*"), Vec::<String>::new());
}

#[tokio::test]
async fn a_big_inner_batch_reenters_the_outer_keys_and_its_release_keeps_them() {
    // The inner batch is big enough that its free keys go with plain `SET`s: the outer
    // layer's keys are not free, and the script enters them again.
    let server = RedisServer::start();
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap());
    let outer: Vec<String> = (0..100).map(|i| format!("doc:{i:03}")).collect();
    let inner: Vec<String> = (0..200).map(|i| format!("doc:{i:03}")).collect();
    let (observe, observed) = oneshot::channel::<(usize, usize, usize)>();
    let observe = std::sync::Arc::new(std::sync::Mutex::new(Some(observe)));
    let url = server.url();
    let app = Router::new().route(
        "/",
        post(move |Extension(lease): Extension<Lease>| {
            let (observe, url, inner) =
                (observe.lock().unwrap().take(), url.clone(), inner.clone());
            async move {
                let taken = lease.lock(inner).await.unwrap();
                let mut redis = redis::Client::open(url).unwrap().get_connection().unwrap();
                let holds = |redis: &mut redis::Connection, key| {
                    lock_value(redis, key).map_or(0, |v| v.holds.len())
                };
                let both = holds(&mut redis, "lock:doc:050");
                taken.release().await;
                let outer = holds(&mut redis, "lock:doc:050");
                let extra = holds(&mut redis, "lock:doc:150");
                let _ = observe.unwrap().send((both, outer, extra));
            }
        })
        .layer(locks.layer(move |_: &Parts| Ok::<_, Rejection>(outer.clone()))),
    );
    let (status, body) = send(&app, Request::post("/").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // Two holds of one owner while both ran; after the inner release, the layer's hold on
    // its keys remained, and the inner batch's other keys were freed.
    assert_eq!(observed.await.unwrap(), (2, 1, 0));
    assert_eq!(server.keys("lock:?*"), Vec::<String>::new());
}

const OWNER_HEADER: &str = "x-lock-owner";

/// Service B: locks `order:1` too, and trusts owner headers only from callers that show
/// the `x-internal` marker (standing for a verified peer).
fn downstream(server: &RedisServer) -> Router {
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap())
        .trust_owner_header(HeaderName::from_static(OWNER_HEADER), |parts: &Parts| {
            parts.headers.contains_key("x-internal")
        });
    Router::new().route(
        "/b",
        post(|| async { "b done" }).layer(locks.layer(|_: &Parts| Ok::<_, Rejection>(["order:1"]))),
    )
}

/// Service A: locks `order:1`, and calls B on its behalf, with or without the marker.
fn upstream(server: &RedisServer, b: Router) -> Router {
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap());
    Router::new().route(
        "/a",
        post(
            move |Extension(lease): Extension<Lease>, request: AxumRequest| {
                let b = b.clone();
                async move {
                    let mut call =
                        Request::post("/b").header(OWNER_HEADER, lease.owner_header_value());
                    if request.headers().contains_key("x-internal") {
                        call = call.header("x-internal", "1");
                    }
                    let response = b.oneshot(call.body(Body::empty()).unwrap()).await.unwrap();
                    response.status().as_u16().to_string()
                }
            },
        )
        .layer(locks.layer(|_: &Parts| Ok::<_, Rejection>(["order:1"]))),
    )
}

#[tokio::test]
async fn a_propagated_owner_reenters_downstream_only_from_a_trusted_caller() {
    let server = RedisServer::start();
    let a = upstream(&server, downstream(&server));

    let trusted = Request::post("/a")
        .header("x-internal", "1")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        send(&a, trusted).await,
        (StatusCode::OK, "200".to_owned()),
        "B contended with its caller"
    );
    assert_eq!(
        server.keys("lock:?*"),
        Vec::<String>::new(),
        "B's release took A's hold, or A's was left"
    );

    // The same header from a caller B does not trust is ignored: B contends like anyone.
    let untrusted = Request::post("/a").body(Body::empty()).unwrap();
    assert_eq!(
        send(&a, untrusted).await,
        (StatusCode::OK, "409".to_owned())
    );
    assert_eq!(server.keys("lock:?*"), Vec::<String>::new());
}

#[tokio::test]
async fn a_forged_or_malformed_owner_header_never_reenters() {
    let server = RedisServer::start();
    let b = downstream(&server);
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap());
    let release = hold_elsewhere(&locks, "order:1").await;
    for forged in ["0123456789abcdef0123456789abcdef", "not a token", ""] {
        let request = Request::post("/b")
            .header("x-internal", "1")
            .header(OWNER_HEADER, forged);
        let (status, _) = send(&b, request.body(Body::empty()).unwrap()).await;
        assert_eq!(status, StatusCode::CONFLICT, "{forged:?}");
    }
    let _ = release.send(());
}

/// The README's shape: a router-wide layer on the tenant, a route layer on the tenant and
/// the order (`keys::all`), and a handler that locks one more key.
#[tokio::test]
async fn a_router_wide_layer_a_route_layer_and_the_handler_share_one_owner() {
    let locks = Locks::new(Store::isolated_memory());
    let update = |Extension(lease): Extension<Lease>| async move {
        let account = lease.lock(["account:7"]).await?;
        account.release().await;
        Ok::<_, Rejection>(lease.keys().collect::<Vec<_>>().join(","))
    };
    let tenant_and_order = keys::all((
        keys::path("tenant").param("tenant"),
        keys::path("order").param("order"),
    ));
    let app = Router::new()
        .route(
            "/tenants/{tenant}/orders/{order}",
            put(update).layer(locks.layer(tenant_and_order)),
        )
        .layer(locks.layer(keys::path("tenant").param("tenant")));
    let request = || {
        Request::put("/tenants/acme/orders/9")
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(
        send(&app, request()).await,
        (StatusCode::OK, "order:9,tenant:acme".to_owned())
    );

    // Everything was released: another owner gets the keys at once.
    let other = Router::new().route(
        "/",
        post(|| async {}).layer(
            locks.layer(|_: &Parts| Ok::<_, Rejection>(["tenant:acme", "order:9", "account:7"])),
        ),
    );
    assert_eq!(
        send(&other, Request::post("/").body(Body::empty()).unwrap())
            .await
            .0,
        StatusCode::OK
    );
}
