//! The key extractors, through the layer and an axum `Router`, on the in-memory store: which
//! keys each one locks, what it hands the handler, and how it refuses bad input.

use std::{
    convert::Infallible,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
};
use tower_batch_lock::store::Store;

use axum::{
    body::{Body, Bytes},
    extract::{FromRequestParts, Path, Query, State},
    response::{IntoResponse, Response},
    routing::{post, put},
    Extension, Form, Json, Router,
};
use http::{header, request::Parts, HeaderValue, Request, StatusCode};
use serde::Deserialize;
use tokio::sync::Notify;
use tower_batch_lock::{keys, Lease, Locks, Rejection};

use crate::support::{
    self,
    http::{send_text, TextReply},
    logs::errors_logged,
};

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
    let locks = Locks::new(Store::isolated_memory());
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

    // Each extractor's own refusal, as a problem: axum's with its status and message, the
    // custom one as it is.
    let axum = Router::new()
        .route(
            "/shops/{shop}/items/{item}",
            post(|_: Path<(String, u64)>| async {}),
        )
        .route("/seats", post(|_: Query<Range>| async {}))
        .route("/mine/{id}", post(|_: Tenant, _: Path<String>| async {}));
    for uri in [
        "/shops/a/items/seven",
        "/seats?from=3",
        "/seats?from=x&to=3",
    ] {
        let reply = refused_as_axum_refuses(&app, &axum, || empty(uri)).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    }
    let reply = send_text(&app, empty("/shops/a/items/seven")).await;
    assert_eq!(
        reply.detail(),
        "Invalid URL: Cannot parse value at index 1 with value `seven` to a `u64`"
    );
    let reply = send_text(&app, empty("/mine/x")).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.detail(), "who are you? send x-tenant");
    // A tuple answers with the refusal of its first extractor that refuses.
    let mut request = empty("/mine/x");
    request
        .headers_mut()
        .insert("x-tenant", HeaderValue::from_static("acme"));
    assert_eq!(send_text(&app, request).await.body, "doc:acme/x");
}

/// Sends `request()` to `app`, whose key extractor refuses it, and to `axum`, whose handler
/// takes the same axum extractor: the layer answers with axum's status and headers, and
/// axum's plain text as the `detail` of a problem document.
async fn refused_as_axum_refuses(
    app: &Router,
    axum: &Router,
    request: impl Fn() -> Request<Body>,
) -> TextReply {
    let ours = send_text(app, request()).await;
    let theirs = send_text(axum, request()).await;
    assert!(theirs.status.is_client_error(), "{theirs:?}");
    assert!(
        theirs
            .content_type
            .as_deref()
            .unwrap()
            .starts_with("text/plain"),
        "{theirs:?}"
    );
    assert_eq!(ours.status, theirs.status, "{ours:?}");
    assert_eq!(ours.detail(), theirs.body);
    ours
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
    let locks = Locks::new(Store::isolated_memory());
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
async fn from_request_answers_with_axums_refusal_as_a_problem() {
    let app = Router::new()
        .route(
            "/json",
            post(held).layer(
                Locks::new(Store::isolated_memory()).layer(keys::from_request(
                    |Json(ids): Json<Vec<u64>>| ids.into_iter().map(|id| format!("n:{id}")),
                )),
            ),
        )
        .route(
            "/form",
            post(held).layer(
                Locks::new(Store::isolated_memory()).layer(keys::from_request(
                    |Form(t): Form<Transfer>| [format!("account:{}", t.from)],
                )),
            ),
        )
        .route(
            "/text",
            post(held).layer(
                Locks::new(Store::isolated_memory())
                    .layer(keys::from_request(|text: String| [text])),
            ),
        );
    let axum = Router::new()
        .route("/json", post(|_: Json<Vec<u64>>| async {}))
        .route("/form", post(|_: Form<Transfer>| async {}))
        .route("/text", post(|_: String| async {}));
    let form = |body: &'static str| {
        Request::post("/form")
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(Body::from(body))
            .unwrap()
    };
    let cases: [(&dyn Fn() -> Request<Body>, StatusCode); 7] = [
        (&|| empty("/json"), StatusCode::UNSUPPORTED_MEDIA_TYPE),
        (&|| json("/json", "[1, 2"), StatusCode::BAD_REQUEST),
        (
            &|| json("/json", r#"[1, "2"]"#),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (&|| json("/form", "{}"), StatusCode::UNSUPPORTED_MEDIA_TYPE),
        (&|| form("from=a"), StatusCode::UNPROCESSABLE_ENTITY),
        (
            &|| form("from=a&to=b&from=c"),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            &|| {
                Request::post("/text")
                    .body(Body::from(vec![b'a', 0xff]))
                    .unwrap()
            },
            StatusCode::BAD_REQUEST,
        ),
    ];
    for (request, status) in cases {
        let reply = refused_as_axum_refuses(&app, &axum, request).await;
        assert_eq!(reply.status, status, "{reply:?}");
    }
    // axum's `Json` names the element that does not fit.
    let reply = send_text(&app, json("/json", r#"[1, "2"]"#)).await;
    assert!(reply.detail().contains("[1]: invalid type"), "{reply:?}");
    let reply = send_text(&app, json("/json", "[3, 1, 3]")).await;
    assert_eq!(reply.body, "n:1\nn:3");
}

/// Refuses every request the way an authentication extractor does: a bare status, a
/// challenge header, no body.
struct Authenticated;

impl<S: Send + Sync> FromRequestParts<S> for Authenticated {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        match parts.headers.get("x-refuse").map(HeaderValue::as_bytes) {
            Some(b"json") => Err((
                StatusCode::FORBIDDEN,
                Json(serde_json::json!({ "error": "yours, as it is" })),
            )
                .into_response()),
            _ => Err((
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
            )
                .into_response()),
        }
    }
}

#[tokio::test]
async fn a_refusal_without_text_keeps_its_headers_and_one_in_json_stays_as_it_is() {
    let app = Router::new().route(
        "/",
        post(held).layer(
            Locks::new(Store::isolated_memory())
                .layer(keys::from_parts(|_: Authenticated| -> [String; 0] { [] })),
        ),
    );
    let reply = support::http::send(&app, empty("/")).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(reply.headers[header::WWW_AUTHENTICATE], "Bearer");
    assert_eq!(reply.problem()["detail"], "Unauthorized");

    let mut request = empty("/");
    request
        .headers_mut()
        .insert("x-refuse", HeaderValue::from_static("json"));
    let reply = send_text(&app, request).await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    assert_eq!(reply.content_type.as_deref(), Some("application/json"));
    assert_eq!(reply.body, r#"{"error":"yours, as it is"}"#);
}

/// The state of the router in the tests of `*_with_state`.
#[derive(Clone)]
struct Bank {
    code: &'static str,
}

#[tokio::test]
async fn extractors_that_need_the_routers_state_run_with_the_state_given() {
    let bank = Bank { code: "b1" };
    let locks = Locks::new(Store::isolated_memory());
    let app = Router::new()
        .route(
            "/accounts/{id}",
            post(
                |State(bank): State<Bank>, lease: Option<Extension<Lease>>| async move {
                    format!("{}: {}", bank.code, held(lease).await)
                },
            )
            .layer(locks.layer(keys::from_parts_with_state(
                bank.clone(),
                |(State(bank), Path(id)): (State<Bank>, Path<u32>)| {
                    [format!("account:{}/{id}", bank.code)]
                },
            ))),
        )
        .route(
            "/transfers",
            post(held).layer(locks.layer(keys::from_request_with_state(
                bank.clone(),
                |(State(bank), Json(ids)): (State<Bank>, Json<Vec<u32>>)| {
                    ids.into_iter()
                        .map(move |id| format!("account:{}/{id}", bank.code))
                },
            ))),
        )
        .with_state(bank);

    let reply = send_text(&app, empty("/accounts/7")).await;
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (StatusCode::OK, "b1: account:b1/7")
    );
    let reply = send_text(&app, json("/transfers", "[9, 3]")).await;
    assert_eq!(reply.body, "account:b1/3\naccount:b1/9");
    // Refusals are problems there too.
    let reply = send_text(&app, empty("/accounts/x")).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.detail(), "Invalid URL: Cannot parse `x` to a `u32`");
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
            post(held).layer(Locks::new(Store::isolated_memory()).layer(
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
    // A request without the header may run unlocked on `/pay`: it opts in.
    let locks = Locks::new(Store::isolated_memory()).require_keys(false);
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

    // No header: unlocked where the route allows it, refused where the key is required.
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
    let locks = Locks::new(Store::isolated_memory());
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

#[tokio::test]
async fn path_keys_on_a_route_with_several_parameters_lock_the_one_named() {
    let locks = Locks::new(Store::isolated_memory());
    let gate = Gate::default();
    let app = Router::new()
        .route(
            "/accounts/{id}",
            put({
                let gate = gate.clone();
                move || gate.clone().hold()
            })
            .layer(locks.layer(keys::path("account"))),
        )
        .route(
            "/banks/{bank}/accounts/{id}",
            post(held).layer(locks.layer(keys::path("account").param("id"))),
        )
        .route(
            "/tenants/{tenant}/orders/{id}",
            post(held).layer(locks.layer(keys::path("order").param("tenant").param("id"))),
        );

    let holder = tokio::spawn({
        let app = app.clone();
        async move {
            send_text(
                &app,
                Request::put("/accounts/7").body(Body::empty()).unwrap(),
            )
            .await
        }
    });
    gate.entered.notified().await;
    // The one account, whichever route names it: the two exclude each other.
    let reply = send_text(&app, empty("/banks/b1/accounts/7")).await;
    assert_eq!(reply.status, StatusCode::CONFLICT, "{reply:?}");
    assert_eq!(
        reply.problem()["conflicting_keys"],
        serde_json::json!(["account:7"])
    );
    gate.release.notify_one();
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);
    let reply = send_text(&app, empty("/banks/b1/accounts/7")).await;
    assert_eq!(reply.body, "account:7");

    // Ids unique only together: joined in the order named.
    let reply = send_text(&app, empty("/tenants/acme/orders/42")).await;
    assert_eq!(reply.body, "order:acme/42");
}

#[tokio::test]
async fn a_route_that_cannot_give_a_path_key_is_a_500_and_one_logged_error_a_route() {
    errors_logged();
    let locks = Locks::new(Store::isolated_memory());
    let app = Router::new()
        .route(
            "/branches/{bank}/{branch}/accounts/{id}",
            post(held).layer(locks.layer(keys::path("account"))),
        )
        .route(
            "/ledgers/{ledger}",
            post(held).layer(locks.layer(keys::path("ledger").param("id"))),
        )
        .route(
            "/audits",
            post(held).layer(locks.layer(keys::path("audit"))),
        );
    // Each twice: the answer each time, the error line once a route (its repeats at debug
    // level, where a busy route wrote an error line a request).
    let uris = ["/branches/b1/x/accounts/7", "/ledgers/2024", "/audits"];
    for uri in uris.iter().chain(&uris) {
        let reply = send_text(&app, empty(uri)).await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{uri}");
        assert_eq!(
            reply.detail(),
            "the server could not determine what to lock"
        );
    }

    let logged = errors_logged();
    let lines =
        |route: &str| -> Vec<&str> { logged.lines().filter(|l| l.contains(route)).collect() };
    // Several parameters and none named: joining them would make `account:b1/x/7`, which
    // `/accounts/{id}` would not exclude.
    let ambiguous = lines("/branches/{bank}/{branch}/accounts/{id}");
    assert_eq!(ambiguous.len(), 1, "{logged}");
    assert!(ambiguous[0].contains("ERROR"), "{logged}");
    assert!(
        ambiguous[0].contains("it has `bank`, `branch`, `id`; name the one"),
        "{logged}"
    );
    let missing = lines("/ledgers/{ledger}");
    assert_eq!(missing.len(), 1, "{logged}");
    assert!(
        missing[0].contains(
            r#"keys::path("ledger").param("id"): the route /ledgers/{ledger} has no parameter `id`; its parameters: `ledger`"#
        ),
        "{logged}"
    );
    let none = lines("/audits");
    assert_eq!(none.len(), 1, "{logged}");
    assert!(none[0].contains("found no path parameter"), "{logged}");
}

#[tokio::test]
async fn json_refusals_name_the_field_that_does_not_fit() {
    #[derive(Deserialize)]
    struct Order {
        lines: Vec<Line>,
    }
    #[derive(Deserialize)]
    struct Line {
        sku: String,
    }
    let app = Router::new().route(
        "/orders",
        post(held).layer(
            Locks::new(Store::isolated_memory()).layer(keys::json(|order: Order| {
                order
                    .lines
                    .into_iter()
                    .map(|line| format!("sku:{}", line.sku))
            })),
        ),
    );
    let reply = send_text(
        &app,
        json(
            "/orders",
            r#"{"lines": [{"sku": "a"}, {"sku": "b"}, {"sku": 5}]}"#,
        ),
    )
    .await;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        reply.detail(),
        "the JSON body is not valid: lines[2].sku: invalid type: integer `5`, expected a \
         string at line 1 column 48"
    );
    let reply = send_text(&app, json("/orders", r#"{"lines": [{"sku": "a"}, {}]}"#)).await;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        reply.detail().contains("lines[1]: missing field `sku`"),
        "{reply:?}"
    );
}

#[derive(Deserialize)]
struct Lines {
    skus: Vec<String>,
}

#[tokio::test]
async fn all_locks_the_path_and_the_body_as_one_batch() {
    let locks = Locks::new(Store::isolated_memory()).max_keys(4);
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
