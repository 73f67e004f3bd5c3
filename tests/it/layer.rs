//! The layer's behaviour on the in-memory store, driven the way users drive it.

use std::{
    convert::Infallible,
    future::Future,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};
use tower_batch_lock::store::Store;

use axum::{
    body::{Body, Bytes},
    routing::{post, put},
    Extension, Router,
};
use http::{header, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde::Deserialize;
use tokio::sync::Notify;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_batch_lock::{keys, Lease, LockLayer, Locks, ResponseBody};

use crate::support::http::{header_keys, post_keys};

/// `POST /` locking `keys` (comma-separated).
fn request(keys: &str) -> Request<Body> {
    post_keys("/", keys)
}

async fn problem(
    response: Response<impl http_body::Body<Error = impl std::fmt::Debug>>,
) -> serde_json::Value {
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&body).expect("a JSON problem document")
}

/// A handler that holds its keys until the test lets it go.
#[derive(Clone, Default)]
struct Gate {
    entered: Arc<Notify>,
    release: Arc<Notify>,
}

impl Gate {
    fn router(&self, locks: &Locks) -> Router {
        let gate = self.clone();
        Router::new().route(
            "/",
            post(move || async move {
                gate.entered.notify_one();
                gate.release.notified().await;
                "done"
            })
            .layer(locks.layer(header_keys)),
        )
    }
}

fn quick(locks: &Locks) -> Router {
    Router::new().route("/", post(|| async { "ok" }).layer(locks.layer(header_keys)))
}

#[tokio::test]
async fn held_keys_are_refused_with_409_naming_them_and_retry_after() {
    let locks = Locks::new(Store::isolated_memory()).ttl(Duration::from_secs(5));
    let gate = Gate::default();
    let holder = tokio::spawn(gate.router(&locks).oneshot(request("a,b")));
    gate.entered.notified().await;

    let response = quick(&locks).oneshot(request("b,c,a")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    // No hold of this store has ended yet: a second (`RetryAfter::Observed`), not the TTL.
    assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    let problem = problem(response).await;
    assert_eq!(problem["status"], 409);
    assert_eq!(problem["conflicting_keys"], serde_json::json!(["a", "b"]));
    assert_eq!(
        problem["detail"],
        "2 of the 3 resources this request locks are held by another request"
    );

    // Disjoint keys run in parallel with the holder.
    let response = quick(&locks).oneshot(request("c,d")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    gate.release.notify_one();
    assert_eq!(holder.await.unwrap().unwrap().status(), StatusCode::OK);
    // The holder's keys were released before its response came back.
    let response = quick(&locks).oneshot(request("a,b,c")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn contention_status_and_naming_are_configurable() {
    let locks = Locks::new(Store::isolated_memory())
        .contention_status(StatusCode::LOCKED)
        .max_named_conflicts(0);
    let gate = Gate::default();
    let holder = tokio::spawn(gate.router(&locks).oneshot(request("a")));
    gate.entered.notified().await;

    let response = quick(&locks).oneshot(request("a")).await.unwrap();
    assert_eq!(response.status(), StatusCode::LOCKED);
    let problem = problem(response).await;
    assert_eq!(
        problem["detail"],
        "the resource this request locks is held by another request"
    );
    assert!(problem.get("conflicting_keys").is_none(), "{problem}");

    gate.release.notify_one();
    holder.await.unwrap().unwrap();
}

#[tokio::test]
async fn requests_without_keys_are_refused_unless_the_route_lets_them_pass_unlocked() {
    // The default: a handler that needs its locks never runs without them.
    let response = quick(&Locks::new(Store::isolated_memory()))
        .oneshot(request(""))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let problem = problem(response).await;
    assert_eq!(problem["limit"], "no_keys");
    assert_eq!(
        problem["detail"],
        "the request does not name a resource to lock"
    );

    let response = quick(&Locks::new(Store::isolated_memory()).require_keys(false))
        .oneshot(request(""))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn key_limits_are_4xx_naming_the_limit() {
    let locks = Locks::new(Store::isolated_memory())
        .max_keys(3)
        .max_key_len(5);
    let response = quick(&locks).oneshot(request("a,b,c,d")).await.unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(problem(response).await["limit"], "max_keys");

    let response = quick(&locks).oneshot(request("a,b,a,b,c")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK, "duplicates count once");

    let response = quick(&locks).oneshot(request("abcdef")).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem(response).await["limit"], "max_key_len");
}

#[tokio::test]
async fn dropping_the_response_future_releases_the_keys() {
    let locks = Locks::new(Store::isolated_memory());
    let gate = Gate::default();
    let holder = tokio::spawn(gate.router(&locks).oneshot(request("a")));
    gate.entered.notified().await;
    assert_eq!(
        quick(&locks).oneshot(request("a")).await.unwrap().status(),
        StatusCode::CONFLICT
    );

    // The client goes away while the handler runs.
    holder.abort();
    assert!(holder.await.unwrap_err().is_cancelled());
    assert!(
        eventually_ok(&locks, "a").await,
        "the keys of a dropped request were not released"
    );
}

#[tokio::test]
async fn an_inner_error_or_panic_releases_the_keys() {
    let locks = Locks::new(Store::isolated_memory());
    let failing =
        tower::service_fn(|_: Request<Body>| async { Err::<Response<Body>, _>("inner failed") });
    let result = ServiceBuilder::new()
        .layer(locks.layer(header_keys))
        .service(failing)
        .oneshot(request("a"))
        .await;
    assert_eq!(result.unwrap_err(), "inner failed");
    assert_eq!(
        quick(&locks).oneshot(request("a")).await.unwrap().status(),
        StatusCode::OK
    );

    let panicking = Router::new().route(
        "/",
        post(|| async {
            if true {
                panic!("handler bug");
            }
        })
        .layer(locks.layer(header_keys)),
    );
    let task = tokio::spawn(panicking.oneshot(request("b")));
    assert!(task.await.unwrap_err().is_panic());
    assert!(
        eventually_ok(&locks, "b").await,
        "the keys of a panicked request were not released"
    );
}

/// Whether a request on `key` succeeds within a second (a dropped guard's release is
/// spawned, so it lands a moment later).
async fn eventually_ok(locks: &Locks, key: &str) -> bool {
    for _ in 0..100 {
        if quick(locks).oneshot(request(key)).await.unwrap().status() == StatusCode::OK {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[tokio::test]
async fn the_handler_sees_its_lease() {
    let locks = Locks::new(Store::isolated_memory())
        .prefix("app:")
        .ttl(Duration::from_secs(7));
    let app = Router::new().route(
        "/",
        post(|Extension(lease): Extension<Lease>| async move {
            let left = lease.expires_at() - std::time::Instant::now();
            assert!(left > Duration::from_secs(6) && left <= Duration::from_secs(7));
            lease.keys().collect::<Vec<_>>().join(",")
        })
        .layer(locks.layer(header_keys)),
    );
    let response = app.oneshot(request("b,a,b")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.into_body().collect().await.unwrap().to_bytes(),
        "a,b"
    );
}

#[derive(Deserialize)]
struct Order {
    items: Vec<String>,
}

fn json_app(locks: &Locks, limit: usize) -> Router {
    Router::new().route(
        "/orders",
        post(|body: Bytes| async move { body }).layer(locks.layer(
            keys::json(|o: Order| o.items.into_iter().map(|i| format!("sku:{i}"))).limit(limit),
        )),
    )
}

fn json_request(body: impl Into<Body>) -> Request<Body> {
    Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .unwrap()
}

#[tokio::test]
async fn the_json_extractor_hands_the_same_bytes_to_the_handler() {
    let body = r#"{"items": ["1", "2"], "note": "kept as sent"}"#;
    let response = json_app(&Locks::new(Store::isolated_memory()), 1024)
        .oneshot(json_request(body))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.into_body().collect().await.unwrap().to_bytes(),
        body
    );
}

#[tokio::test]
async fn the_json_extractor_locks_the_ids_of_the_body() {
    let locks = Locks::new(Store::isolated_memory());
    let gate = Gate::default();
    let holder = tokio::spawn(gate.router(&locks).oneshot(request("sku:2")));
    gate.entered.notified().await;

    let response = json_app(&locks, 1024)
        .oneshot(json_request(r#"{"items": ["1", "2"]}"#))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(
        problem(response).await["conflicting_keys"],
        serde_json::json!(["sku:2"])
    );
    gate.release.notify_one();
    holder.await.unwrap().unwrap();
}

#[tokio::test]
async fn the_json_extractor_refuses_bad_bodies_with_problems() {
    let app = json_app(&Locks::new(Store::isolated_memory()), 64);
    let cases: Vec<(Request<Body>, StatusCode)> = vec![
        (
            Request::post("/orders")
                .body(Body::from(r#"{"items": []}"#))
                .unwrap(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
        (
            Request::post("/orders")
                .header(header::CONTENT_TYPE, "text/plain")
                .body(Body::from("{}"))
                .unwrap(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
        (json_request(r#"{"items": ["#), StatusCode::BAD_REQUEST),
        (json_request("not json"), StatusCode::BAD_REQUEST),
        (
            json_request(vec![b'"', 0xff, 0xfe, b'"']),
            StatusCode::BAD_REQUEST,
        ),
        (
            json_request(r#"{"items": "1"}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            json_request(r#"{"other": 1}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            json_request(format!(r#"{{"items": ["{}"]}}"#, "x".repeat(100))),
            StatusCode::PAYLOAD_TOO_LARGE,
        ),
    ];
    for (request, status) in cases {
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), status);
        let problem = problem(response).await;
        assert!(!problem["detail"].as_str().unwrap().is_empty());
    }
}

#[tokio::test]
async fn a_chunked_body_over_the_limit_is_refused_without_reading_the_rest() {
    // An endless body without a length: the extractor must stop at the limit.
    let produced = Arc::new(AtomicUsize::new(0));
    let counter = produced.clone();
    let chunks = futures_util::stream::repeat_with(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        Ok::<_, Infallible>(Bytes::from_static(&[b' '; 1024]))
    });
    let request = json_request(Body::from_stream(chunks));
    let response = json_app(&Locks::new(Store::isolated_memory()), 16 * 1024)
        .oneshot(request)
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        produced.load(Ordering::Relaxed) <= 20,
        "read {} chunks",
        produced.load(Ordering::Relaxed)
    );
}

#[tokio::test]
async fn a_declared_length_over_the_limit_is_refused_up_front() {
    let request = Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, "1000000")
        .body(Body::empty())
        .unwrap();
    let response = json_app(&Locks::new(Store::isolated_memory()), 1024)
        .oneshot(request)
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn path_keys_work_under_every_way_of_layering_a_route() {
    let locks = Locks::new(Store::isolated_memory());
    let gate = Gate::default();
    let holder = tokio::spawn(gate.router(&locks).oneshot(request("order:7")));
    gate.entered.notified().await;

    let handler = put(|| async { "ok" });
    let apps = [
        Router::new().route(
            "/orders/{id}",
            handler.clone().layer(locks.layer(keys::path("order"))),
        ),
        Router::new()
            .route("/orders/{id}", handler.clone())
            .route_layer(locks.layer(keys::path("order"))),
        Router::new()
            .route("/orders/{id}", handler.clone())
            .layer(locks.layer(keys::path("order"))),
        Router::new().route(
            "/orders/{id}",
            handler
                .clone()
                .route_layer(ServiceBuilder::new().layer(locks.layer(keys::path("order")))),
        ),
    ];
    for app in apps {
        let status = |id: &'static str| {
            let app = app.clone();
            async move {
                app.oneshot(
                    Request::put(format!("/orders/{id}"))
                        .body(Body::empty())
                        .unwrap(),
                )
                .await
                .unwrap()
                .status()
            }
        };
        assert_eq!(status("7").await, StatusCode::CONFLICT);
        assert_eq!(status("8").await, StatusCode::OK);
    }
    gate.release.notify_one();
    holder.await.unwrap().unwrap();
}

#[tokio::test]
async fn path_keys_outside_an_axum_router_are_a_logged_server_error() {
    let bare = tower::service_fn(|_: Request<Body>| async {
        Ok::<_, Infallible>(Response::new(Body::empty()))
    });
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(keys::path("order")))
        .service(bare);
    let response = service
        .oneshot(Request::put("/orders/1").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        problem(response).await["detail"],
        "the server could not determine what to lock"
    );
}

#[tokio::test]
async fn layers_made_with_new_share_the_process_wide_store() {
    let gate = Gate::default();
    let holding = Router::new().route(
        "/",
        post({
            let gate = gate.clone();
            move || async move {
                gate.entered.notify_one();
                gate.release.notified().await;
            }
        })
        .layer(LockLayer::new(header_keys)),
    );
    let holder = tokio::spawn(holding.oneshot(request("shared-by-new")));
    gate.entered.notified().await;

    let other = Router::new().route("/", post(|| async {}).layer(LockLayer::new(header_keys)));
    assert_eq!(
        other
            .oneshot(request("shared-by-new"))
            .await
            .unwrap()
            .status(),
        StatusCode::CONFLICT
    );
    gate.release.notify_one();
    holder.await.unwrap().unwrap();
}

/// A service that must be driven to readiness before each call, on the same instance;
/// a clone starts unready. Calling a clone that was never polled is a bug it catches.
#[derive(Default)]
struct MustBeReady {
    ready: bool,
}

impl Clone for MustBeReady {
    fn clone(&self) -> Self {
        Self { ready: false }
    }
}

impl Service<Request<Body>> for MustBeReady {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.ready = true;
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<Body>) -> Self::Future {
        assert!(self.ready, "called a service that was not made ready");
        self.ready = false;
        std::future::ready(Ok(Response::new(Body::empty())))
    }
}

#[tokio::test]
async fn the_ready_inner_service_is_the_one_called() {
    // Requests without keys pass unlocked here, so that every kind of request reaches it.
    let locks = Locks::new(Store::isolated_memory()).require_keys(false);
    let mut service = ServiceBuilder::new()
        .layer(locks.layer(header_keys))
        .service(MustBeReady::default());
    for keys in ["a", "", "a,b"] {
        let response = service
            .ready()
            .await
            .unwrap()
            .call(request(keys))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
}

#[tokio::test]
async fn head_keys_in_memory_are_decided_on_the_first_poll() {
    // Keys in the head, and a store that answers at once: nothing to wait for, so the
    // response (granted and released, or refused) is ready on the future's first poll.
    let locks = Locks::new(Store::isolated_memory());
    let mut service = ServiceBuilder::new()
        .layer(locks.layer(header_keys))
        .service(MustBeReady::default());
    assert_eq!(first_poll(&mut service, "a,b").await, StatusCode::OK);
    // Released with the response: the same keys are free at once.
    assert_eq!(first_poll(&mut service, "b,a").await, StatusCode::OK);

    let gate = Gate::default();
    let holder = tokio::spawn(gate.router(&locks).oneshot(request("a")));
    gate.entered.notified().await;
    assert_eq!(first_poll(&mut service, "b,a").await, StatusCode::CONFLICT);
    gate.release.notify_one();
    assert_eq!(holder.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(first_poll(&mut service, "a").await, StatusCode::OK);
}

#[tokio::test]
async fn path_composite_and_parts_keys_are_decided_on_the_first_poll_too() {
    let locks = Locks::new(Store::isolated_memory());
    let from_parts = keys::from_parts(|axum::extract::Path(sku): axum::extract::Path<String>| {
        [format!("sku:{sku}")]
    });
    let both = keys::all((keys::path("sku"), keys::header("x-keys", "line")));
    let mut router: Router = Router::new()
        .route(
            "/path/{sku}",
            put(|| async {}).layer(locks.layer(keys::path("sku"))),
        )
        .route(
            "/parts/{sku}",
            put(|| async {}).layer(locks.layer(from_parts)),
        )
        .route("/all/{sku}", put(|| async {}).layer(locks.layer(both)));
    for uri in ["/path/7", "/parts/7", "/all/7"] {
        ServiceExt::<Request<Body>>::ready(&mut router)
            .await
            .unwrap();
        let request = Request::put(uri)
            .header("x-keys", "1")
            .body(Body::empty())
            .unwrap();
        let mut future = std::pin::pin!(router.call(request));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(response) => assert_eq!(response.unwrap().status(), StatusCode::OK),
            Poll::Pending => panic!("{uri} was not decided on the first poll"),
        }
    }
}

/// The status of the response to a request on `keys`, which must be ready on the first poll
/// of `service`'s future.
async fn first_poll<S>(service: &mut S, keys: &str) -> StatusCode
where
    S: Service<Request<Body>, Response = Response<ResponseBody<Body>>, Error = Infallible>,
{
    service.ready().await.unwrap();
    let mut future = std::pin::pin!(service.call(request(keys)));
    let mut cx = Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut cx) {
        Poll::Ready(response) => response.unwrap().status(),
        Poll::Pending => panic!("`{keys}` was not decided on the first poll"),
    }
}

#[test]
#[should_panic(expected = "a lock prefix must not be empty")]
fn an_empty_prefix_is_refused_at_configuration() {
    let _ = Locks::new(Store::isolated_memory()).prefix("");
}

/// A prefix that could let a client's key name the store's own keys (Redis's claims
/// registry, `tower-batch-lock:claims`, under the key `claims`) is refused, on every store.
#[test]
fn a_prefix_that_reaches_the_stores_own_names_is_refused_at_configuration() {
    for prefix in ["tower-batch-lock:", "tower-", "tower-batch-lock:claims:"] {
        let refused = std::panic::catch_unwind(|| {
            let _ = Locks::new(Store::isolated_memory()).prefix(prefix);
        });
        assert!(refused.is_err(), "{prefix:?} was taken");
    }
    for prefix in ["lock:", "tower:", "orders:tower-batch-lock:"] {
        let _ = Locks::new(Store::isolated_memory()).prefix(prefix);
    }
}
