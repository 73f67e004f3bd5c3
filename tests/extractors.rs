//! The key extractors, through the layer and an axum `Router`, on the in-memory store: which
//! keys each one locks, what it hands the handler, and how it refuses bad input.

mod support;

use std::{
    convert::Infallible,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
};

use axum::{
    body::{Body, Bytes},
    extract::{FromRequestParts, Path, Query},
    routing::{post, put},
    Extension, Form, Json, Router,
};
use http::{header, request::Parts, HeaderValue, Request, StatusCode};
use serde::Deserialize;
use support::http::send_text;
use tokio::sync::Notify;
use tower_batch_lock::{keys, Lease, Locks, Rejection};

/// The keys the handler holds, one per line; `-` when it runs unlocked.
async fn held(lease: Option<Extension<Lease>>) -> String {
    match lease {
        Some(Extension(lease)) => lease.keys().collect::<Vec<_>>().join("\n"),
        None => "-".to_owned(),
    }
}

fn json(uri: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .unwrap()
}

fn empty(uri: &str) -> Request<Body> {
    Request::post(uri).body(Body::empty()).unwrap()
}

/// A handler that holds its keys until the test lets it go.
#[derive(Clone, Default)]
struct Gate {
    entered: Arc<Notify>,
    release: Arc<Notify>,
}

impl Gate {
    async fn hold(self) -> &'static str {
        self.entered.notify_one();
        self.release.notified().await;
        "done"
    }
}

// ---------------------------------------------------------------------------------------
// Any axum extractor

#[derive(Deserialize)]
struct Range {
    from: u32,
    to: u32,
}

/// The tenant of the `x-tenant` header, or a problem document.
struct Tenant(String);

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Rejection> {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(|t| Tenant(t.to_owned()))
            .ok_or_else(|| Rejection::new(StatusCode::BAD_REQUEST, "who are you? send x-tenant"))
    }
}

#[tokio::test]
async fn from_parts_runs_any_head_extractor_and_answers_with_its_rejection() {
    let locks = Locks::memory();
    let app = Router::new()
        .route(
            "/shops/{shop}/items/{item}",
            post(held).layer(locks.layer(keys::from_parts(
                |Path((shop, item)): Path<(String, u64)>| [format!("item:{shop}/{item}")],
            ))),
        )
        .route(
            "/seats",
            post(held).layer(locks.layer(keys::from_parts(|Query(r): Query<Range>| {
                (r.from..r.to).map(|seat| format!("seat:{seat}"))
            }))),
        )
        .route(
            "/mine/{id}",
            post(held).layer(locks.layer(keys::from_parts(
                |(Tenant(tenant), Path(id)): (Tenant, Path<String>)| [format!("doc:{tenant}/{id}")],
            ))),
        );

    let reply = send_text(&app, empty("/shops/a%20b/items/7")).await;
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (StatusCode::OK, "item:a b/7")
    );
    let reply = send_text(&app, empty("/seats?from=3&to=6")).await;
    assert_eq!(reply.body, "seat:3\nseat:4\nseat:5");
    let mut request = empty("/mine/x");
    request
        .headers_mut()
        .insert("x-tenant", HeaderValue::from_static("acme"));
    assert_eq!(send_text(&app, request).await.body, "doc:acme/x");

    // Each extractor's own refusal, as it is: axum's in text, the custom one a problem.
    let reply = send_text(&app, empty("/shops/a/items/seven")).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(reply.body.contains("`seven`"), "{}", reply.body);
    let reply = send_text(&app, empty("/seats?from=3")).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(reply.body.contains("to"), "{}", reply.body);
    let reply = send_text(&app, empty("/mine/x")).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.detail(), "who are you? send x-tenant");
}

#[derive(Deserialize)]
struct Transfer {
    from: String,
    to: String,
}

/// An extension an outer layer put into the request.
#[derive(Clone)]
struct RequestId(&'static str);

#[tokio::test]
async fn from_request_hands_the_handler_the_same_bytes_and_head() {
    let locks = Locks::memory();
    let app = Router::new()
        .route(
            "/raw",
            post(
                |Extension(RequestId(id)): Extension<RequestId>, body: Bytes| async move {
                    format!("{id} {}", String::from_utf8_lossy(&body))
                },
            )
            .layer(
                locks.layer(keys::from_request(|Json(ids): Json<Vec<String>>| {
                    ids.into_iter().map(|id| format!("id:{id}"))
                })),
            ),
        )
        .route(
            "/transfers",
            post(
                |lease: Option<Extension<Lease>>, Form(t): Form<Transfer>| async move {
                    format!("{} -> {}: {}", t.from, t.to, held(lease).await)
                },
            )
            .layer(locks.layer(keys::from_request(|Form(t): Form<Transfer>| {
                [format!("account:{}", t.from), format!("account:{}", t.to)]
            }))),
        )
        .layer(Extension(RequestId("req-1")));

    // Odd spacing and escapes survive: the handler gets the bytes, not a re-encoding.
    let body = " [ \"a\\u0062\" ,\n\"é\" ] ";
    let reply = send_text(&app, json("/raw", body)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body, format!("req-1 {body}"));

    let form = Request::post("/transfers")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from("from=a%2Fb&to=c+d"))
        .unwrap();
    let reply = send_text(&app, form).await;
    assert_eq!(reply.body, "a/b -> c d: account:a/b\naccount:c d");
}

#[tokio::test]
async fn from_request_answers_with_the_extractors_rejection() {
    let app = Router::new()
        .route(
            "/json",
            post(held).layer(Locks::memory().layer(keys::from_request(
                |Json(ids): Json<Vec<u64>>| ids.into_iter().map(|id| format!("n:{id}")),
            ))),
        )
        .route(
            "/text",
            post(held).layer(Locks::memory().layer(keys::from_request(|text: String| [text]))),
        );
    let cases = [
        (empty("/json"), StatusCode::UNSUPPORTED_MEDIA_TYPE),
        (json("/json", "[1, 2"), StatusCode::BAD_REQUEST),
        (json("/json", r#"["1"]"#), StatusCode::UNPROCESSABLE_ENTITY),
        (
            Request::post("/text")
                .body(Body::from(vec![b'a', 0xff]))
                .unwrap(),
            StatusCode::BAD_REQUEST,
        ),
    ];
    for (request, status) in cases {
        let reply = send_text(&app, request).await;
        assert_eq!(reply.status, status, "{}", reply.body);
        // axum's rejections, as a handler taking the same extractor would answer.
        assert!(reply.content_type.unwrap().starts_with("text/plain"));
        assert!(!reply.body.is_empty());
    }
    let reply = send_text(&app, json("/json", "[3, 1, 3]")).await;
    assert_eq!(reply.body, "n:1\nn:3");
}

#[tokio::test]
async fn from_request_refuses_an_endless_chunked_body_at_the_cap() {
    let pulled = Arc::new(AtomicUsize::new(0));
    let counter = pulled.clone();
    let endless = futures_util::stream::repeat_with(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        Ok::<_, Infallible>(Bytes::from_static(&[b'7'; 1024]))
    });
    let app =
        Router::new().route(
            "/",
            post(held).layer(Locks::memory().layer(
                keys::from_request(|body: Bytes| [format!("{}", body.len())]).limit(64 * 1024),
            )),
        );
    let reply = send_text(
        &app,
        Request::post("/").body(Body::from_stream(endless)).unwrap(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(reply.problem()["limit"], "body_limit");
    let chunks = pulled.load(Ordering::Relaxed);
    assert!(
        chunks <= 66,
        "read {chunks} chunks of 1 KiB for a 64 KiB cap"
    );

    let declared = Request::post("/")
        .header(header::CONTENT_LENGTH, "65537")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        send_text(&app, declared).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
}

// ---------------------------------------------------------------------------------------
// Ready-made extractors

#[tokio::test]
async fn header_keys_serialize_deliveries_of_one_idempotency_key() {
    let locks = Locks::memory();
    let gate = Gate::default();
    let idem = keys::header("idempotency-key", "idem");
    let app = Router::new()
        .route(
            "/slow",
            post({
                let gate = gate.clone();
                move || gate.clone().hold()
            })
            .layer(locks.layer(idem.clone())),
        )
        .route("/pay", post(held).layer(locks.layer(idem.clone())))
        .route("/strict", post(held).layer(locks.layer(idem.required())));
    let with_key = |uri: &str, key: &'static [u8]| {
        let mut request = empty(uri);
        request
            .headers_mut()
            .insert("idempotency-key", HeaderValue::from_bytes(key).unwrap());
        request
    };

    let first = tokio::spawn({
        let app = app.clone();
        let request = with_key("/slow", "k 1 {é}".as_bytes());
        async move { send_text(&app, request).await }
    });
    gate.entered.notified().await;
    let retry = send_text(&app, with_key("/pay", "k 1 {é}".as_bytes())).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(
        retry.problem()["conflicting_keys"],
        serde_json::json!(["idem:k 1 {é}"])
    );
    let other = send_text(&app, with_key("/pay", b"k-2")).await;
    assert_eq!(
        (other.status, other.body.as_str()),
        (StatusCode::OK, "idem:k-2")
    );
    gate.release.notify_one();
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    assert_eq!(
        send_text(&app, with_key("/pay", b"k 1 {\xc3\xa9}"))
            .await
            .status,
        StatusCode::OK
    );

    // No header: unlocked, unless it is required.
    assert_eq!(send_text(&app, empty("/pay")).await.body, "-");
    let refused = send_text(&app, empty("/strict")).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        refused.detail(),
        "the request needs the `idempotency-key` header"
    );
    // Bytes that are not UTF-8 are refused, not guessed at.
    let refused = send_text(&app, with_key("/pay", b"k\xff")).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        refused.detail(),
        "the `idempotency-key` header is not valid UTF-8"
    );
}

#[tokio::test]
async fn query_and_path_keys_name_one_resource_alike() {
    let locks = Locks::memory();
    let gate = Gate::default();
    let app = Router::new()
        .route(
            "/stock/{sku}",
            put({
                let gate = gate.clone();
                move || gate.clone().hold()
            })
            .layer(locks.layer(keys::path("sku"))),
        )
        .route(
            "/restock",
            post(held).layer(locks.layer(keys::query("sku", "sku"))),
        );

    let reply = send_text(
        &app,
        empty("/restock?sku=c+d&sku=%E2%82%AC&other=%FF&sku=c%20d"),
    )
    .await;
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (StatusCode::OK, "sku:c d\nsku:€")
    );

    let holder = tokio::spawn({
        let app = app.clone();
        async move {
            send_text(
                &app,
                Request::put("/stock/a%2Fb").body(Body::empty()).unwrap(),
            )
            .await
        }
    });
    gate.entered.notified().await;
    let reply = send_text(&app, empty("/restock?sku=a%2Fb")).await;
    assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.body);
    assert_eq!(
        reply.problem()["conflicting_keys"],
        serde_json::json!(["sku:a/b"])
    );
    gate.release.notify_one();
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);

    let refused = send_text(&app, empty("/restock?sku=%FF")).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        refused.detail(),
        "the query parameter `sku` is not valid UTF-8 once decoded"
    );
    let refused = send_text(&app, empty("/restock?sku=")).await;
    assert_eq!(refused.detail(), "the query parameter `sku` is empty");
    // A path parameter that is not UTF-8 gets a problem document too.
    let refused = send_text(
        &app,
        Request::put("/stock/%FF").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(refused.detail(), "Invalid UTF-8 in `sku`");
}

#[derive(Deserialize)]
struct Lines {
    skus: Vec<String>,
}

#[tokio::test]
async fn all_locks_the_path_and_the_body_as_one_batch() {
    let locks = Locks::memory().max_keys(4);
    let app = Router::new().route(
        "/orders/{id}/lines",
        put(
            |lease: Option<Extension<Lease>>, Json(lines): Json<Lines>| async move {
                format!("{}\n{}", lines.skus.join(","), held(lease).await)
            },
        )
        .layer(locks.layer(keys::all((
            keys::json(|l: Lines| l.skus.into_iter().map(|s| format!("sku:{s}"))),
            keys::path("order"),
        )))),
    );
    let put_lines = |id: &str, body: &'static str| {
        let mut request = json(&format!("/orders/{id}/lines"), body);
        *request.method_mut() = http::Method::PUT;
        request
    };

    // The body reached the handler after the JSON extractor read it.
    let reply = send_text(&app, put_lines("7", r#"{"skus": ["b", "a", "b"]}"#)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body, "b,a,b\norder:7\nsku:a\nsku:b");

    // The first refusal answers; limits count the keys of all extractors together.
    let reply = send_text(&app, put_lines("7", r#"{"skus": "a"}"#)).await;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY);
    reply.problem();
    let reply = send_text(&app, put_lines("7", r#"{"skus": ["a", "b", "c", "d"]}"#)).await;
    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(reply.problem()["limit"], "max_keys");
}
