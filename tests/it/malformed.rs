//! A corpus of malformed requests, sent through the `orders` example's router on the memory
//! store and on a real `redis-server`: truncated and deeply nested JSON, wrong types,
//! invalid UTF-8, missing fields, wrong content types, oversized and chunked bodies, too
//! many and over-long keys. Each must get the 4xx it deserves with a problem document that
//! says what is wrong; none may crash the service or leave anything in Redis. The bodies
//! go to `POST /orders` and to `POST /quotes`, which takes the same body and must refuse
//! it alike.
//!
//! And one upload over TCP, to show that a chunked body over the cap is answered without
//! the server reading the rest.

use std::{
    convert::Infallible,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{body::Body, Router};
use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, StatusCode};
use serde_json::{json, Value};
use tower_batch_lock::{keys::DEFAULT_BODY_LIMIT, Locks};

use crate::orders_app::{self as orders, Store};
use crate::support::http::send_text;

/// Who must refuse a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum By {
    /// The lock layer, while reading the keys: nothing reaches the lock store.
    Layer,
    /// The handler, with the locks held: they must be released.
    Handler,
}

struct Case {
    what: String,
    request: Request<Body>,
    status: StatusCode,
    by: By,
    /// The `limit` member the problem must name, for a refusal by a limit.
    limit: Option<&'static str>,
}

const ORDERS: &str = "/orders";
const QUOTES: &str = "/quotes";

/// Builds the corpus, one request at a time.
struct Corpus {
    /// Where the bodies go: [`ORDERS`] or [`QUOTES`].
    route: &'static str,
    cases: Vec<Case>,
}

impl Corpus {
    fn add(&mut self, what: impl Into<String>, request: Request<Body>, status: StatusCode, by: By) {
        self.cases.push(Case {
            what: what.into(),
            request,
            status,
            by,
            limit: None,
        });
    }

    fn limit(
        &mut self,
        what: &str,
        request: Request<Body>,
        status: StatusCode,
        limit: &'static str,
    ) {
        self.add(what, request, status, By::Layer);
        self.cases.last_mut().unwrap().limit = Some(limit);
    }

    /// `POST` to the route, with a JSON content type and these bytes.
    fn order(&mut self, what: &str, body: impl Into<Body>, status: StatusCode) {
        self.add(what, post_json(self.route, body), status, By::Layer);
    }
}

fn request(
    method: Method,
    uri: &str,
    content_type: Option<&[u8]>,
    body: impl Into<Body>,
) -> Request<Body> {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(content_type) = content_type {
        request = request.header(
            header::CONTENT_TYPE,
            HeaderValue::from_bytes(content_type).unwrap(),
        );
    }
    request.body(body.into()).unwrap()
}

fn post_json(route: &str, body: impl Into<Body>) -> Request<Body> {
    request(Method::POST, route, Some(b"application/json"), body)
}

fn put_stock(sku: &str, body: &str) -> Request<Body> {
    request(
        Method::PUT,
        &format!("/stock/{sku}"),
        Some(b"application/json"),
        body.to_owned(),
    )
}

fn order_json(order_id: &str, items: &[(&str, u64)]) -> String {
    let items: Vec<Value> = items
        .iter()
        .map(|(sku, qty)| json!({ "sku": sku, "qty": qty }))
        .collect();
    json!({ "order_id": order_id, "items": items }).to_string()
}

/// A body that arrives in these chunks, without a length.
fn chunked(chunks: Vec<Result<Bytes, std::io::Error>>) -> Body {
    Body::from_stream(futures_util::stream::iter(chunks))
}

/// Every malformed request, with its answer, its bodies posted to `route`; `pulled` counts
/// the bytes the server read of an endless chunked body. The stock route's cases come with
/// the orders' corpus only.
fn corpus(pulled: &Arc<AtomicUsize>, route: &'static str) -> Vec<Case> {
    use StatusCode as S;
    let mut c = Corpus {
        route,
        cases: Vec::new(),
    };
    let fine = order_json("a", &[("x", 1)]);

    // Truncated JSON: 400.
    c.order(
        "truncated in a key",
        r#"{"order_id": "a", "items": [{"sku""#,
        S::BAD_REQUEST,
    );
    c.order(
        "truncated in a string",
        r#"{"order_id": "a"#,
        S::BAD_REQUEST,
    );
    c.order(
        "truncated in an escape",
        r#"{"order_id": "a\u00"#,
        S::BAD_REQUEST,
    );
    c.order(
        "truncated before the last brackets",
        fine[..fine.len() - 2].to_owned(),
        S::BAD_REQUEST,
    );
    c.order("an opening brace only", "{", S::BAD_REQUEST);
    c.order("an empty body", "", S::BAD_REQUEST);
    c.order("whitespace only", " \r\n\t ", S::BAD_REQUEST);

    // Not JSON, or more than one JSON value: 400.
    c.order("not JSON", "order a, 3 apples", S::BAD_REQUEST);
    c.order("trailing characters", format!("{fine} x"), S::BAD_REQUEST);
    c.order("two documents", format!("{fine}{fine}"), S::BAD_REQUEST);
    c.order(
        "single quotes",
        "{'order_id': 'a', 'items': []}",
        S::BAD_REQUEST,
    );
    c.order(
        "a trailing comma",
        r#"{"order_id": "a", "items": [],}"#,
        S::BAD_REQUEST,
    );
    c.order(
        "NaN",
        r#"{"order_id": "a", "items": [{"sku": "x", "qty": NaN}]}"#,
        S::BAD_REQUEST,
    );
    c.order("a comment", format!("// order\n{fine}"), S::BAD_REQUEST);
    c.order(
        "a byte order mark",
        format!("\u{feff}{fine}"),
        S::BAD_REQUEST,
    );

    // Deeply nested. Where the type fixes the shape, the parser stops at the first value
    // that does not fit it; in a field the type ignores, it walks any depth without
    // recursing (and the handler gets the well-formed one below, by the handler).
    let brackets = "[".repeat(100_000);
    let deep = format!(r#"{{"order_id": "a", "items": {brackets}"#);
    c.order(
        "100,000 open brackets for the items",
        deep,
        S::UNPROCESSABLE_ENTITY,
    );
    let deep = format!(r#"{{"order_id": "a", "items": [], "note": {brackets}"#);
    c.order(
        "100,000 open brackets in an unknown field",
        deep,
        S::BAD_REQUEST,
    );
    let objects = r#"{"a":"#.repeat(5_000);
    let deep = format!(r#"{{"order_id": "a", "items": [{{"sku": {objects}1"#);
    c.order(
        "5,000 nested objects for a sku",
        deep,
        S::UNPROCESSABLE_ENTITY,
    );

    // Invalid UTF-8, raw or escaped, and control characters: 400.
    let with_sku = |sku: &[u8]| {
        let mut body = br#"{"order_id": "a", "items": [{"sku": ""#.to_vec();
        body.extend_from_slice(sku);
        body.extend_from_slice(br#"", "qty": 1}]}"#);
        body
    };
    c.order(
        "a 0xFF byte in a string",
        with_sku(b"a\xffb"),
        S::BAD_REQUEST,
    );
    c.order(
        "an overlong encoding of `/`",
        with_sku(b"\xc0\xaf"),
        S::BAD_REQUEST,
    );
    c.order(
        "a cut multi-byte character",
        with_sku(b"\xe2\x82"),
        S::BAD_REQUEST,
    );
    c.order(
        "a lone surrogate escape",
        with_sku(br"\ud800"),
        S::BAD_REQUEST,
    );
    c.order("a raw NUL in a string", with_sku(b"a\x00b"), S::BAD_REQUEST);
    c.order(
        "a raw newline in a string",
        with_sku(b"a\nb"),
        S::BAD_REQUEST,
    );
    c.add(
        "a path parameter that is not UTF-8",
        put_stock("%FF%FE", r#"{"qty": 1}"#),
        S::BAD_REQUEST,
        By::Layer,
    );

    // Well-formed JSON of the wrong shape: 422.
    c.order(
        "wrong types",
        r#"{"order_id": 7, "items": "x"}"#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order(
        "a negative qty",
        r#"{"order_id": "a", "items": [{"sku": "x", "qty": -1}]}"#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order(
        "a string qty",
        r#"{"order_id": "a", "items": [{"sku": "x", "qty": "1"}]}"#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order(
        "a fractional qty",
        r#"{"order_id": "a", "items": [{"sku": "x", "qty": 1.5}]}"#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order(
        "a qty over u64",
        r#"{"order_id": "a", "items": [{"sku": "x", "qty": 18446744073709551616}]}"#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order(
        "a numeric sku",
        r#"{"order_id": "a", "items": [{"sku": 5, "qty": 1}]}"#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order(
        "null items",
        r#"{"order_id": "a", "items": null}"#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order(
        "an object order_id",
        r#"{"order_id": {}, "items": []}"#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order("an array, not an object", "[]", S::UNPROCESSABLE_ENTITY);
    c.order(
        "a string, not an object",
        r#""order""#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order("null, not an object", "null", S::UNPROCESSABLE_ENTITY);

    // Missing and repeated fields: 422.
    c.order("an empty object", "{}", S::UNPROCESSABLE_ENTITY);
    c.order("no order_id", r#"{"items": []}"#, S::UNPROCESSABLE_ENTITY);
    c.order(
        "no items field",
        r#"{"order_id": "a"}"#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order(
        "an item without qty",
        r#"{"order_id": "a", "items": [{"sku": "x"}]}"#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order(
        "an item without sku",
        r#"{"order_id": "a", "items": [{"qty": 1}]}"#,
        S::UNPROCESSABLE_ENTITY,
    );
    c.order(
        "order_id twice",
        r#"{"order_id": "a", "order_id": "b", "items": []}"#,
        S::UNPROCESSABLE_ENTITY,
    );

    // Wrong content types: 415, before the body is read.
    let post = |content_type: Option<&[u8]>, body: &str| {
        request(Method::POST, route, content_type, body.to_owned())
    };
    let media = S::UNSUPPORTED_MEDIA_TYPE;
    c.add(
        "text/plain",
        post(Some(b"text/plain"), &fine),
        media,
        By::Layer,
    );
    c.add("no content type", post(None, &fine), media, By::Layer);
    c.add(
        "a form",
        post(
            Some(b"application/x-www-form-urlencoded"),
            "order_id=a&items=x",
        ),
        media,
        By::Layer,
    );
    c.add(
        "multipart",
        post(Some(b"multipart/form-data; boundary=x"), &fine),
        media,
        By::Layer,
    );
    c.add(
        "text/json",
        post(Some(b"text/json"), &fine),
        media,
        By::Layer,
    );
    c.add(
        "application/jsonx",
        post(Some(b"application/jsonx"), &fine),
        media,
        By::Layer,
    );
    c.add(
        "a content type with a 0xFF byte",
        post(Some(b"application/json\xff"), &fine),
        media,
        By::Layer,
    );

    // Oversized bodies, with a length or chunked: 413 without reading the rest.
    let oversized = fine.clone() + &" ".repeat(DEFAULT_BODY_LIMIT);
    let mut announced = post_json(route, oversized.clone());
    announced
        .headers_mut()
        .insert(header::CONTENT_LENGTH, oversized.len().into());
    c.limit(
        "over 2 MiB, announced",
        announced,
        S::PAYLOAD_TOO_LARGE,
        "body_limit",
    );
    c.limit(
        "over 2 MiB, length known",
        post_json(route, oversized),
        S::PAYLOAD_TOO_LARGE,
        "body_limit",
    );
    let mut lying = post_json(route, "{}");
    lying.headers_mut().insert(
        header::CONTENT_LENGTH,
        HeaderValue::from_static("10000000000"),
    );
    c.limit(
        "10 GB announced, 2 bytes sent",
        lying,
        S::PAYLOAD_TOO_LARGE,
        "body_limit",
    );
    let counter = pulled.clone();
    let endless = futures_util::stream::repeat_with(move || {
        counter.fetch_add(64 * 1024, Ordering::Relaxed);
        Ok::<_, Infallible>(Bytes::from_static(&[b' '; 64 * 1024]))
    });
    c.limit(
        "an endless chunked body",
        post_json(route, Body::from_stream(endless)),
        S::PAYLOAD_TOO_LARGE,
        "body_limit",
    );

    // Chunked bodies that go wrong on the way: 400.
    let chunk = |bytes: &'static [u8]| Ok(Bytes::from_static(bytes));
    c.order(
        "chunked, the last chunk missing",
        chunked(vec![
            chunk(br#"{"order_id": "a","#),
            chunk(br#" "items": ["#),
        ]),
        S::BAD_REQUEST,
    );
    c.order(
        "chunked, a character split across chunks, then a bad byte",
        chunked(vec![
            chunk(b"{\"order_id\": \"a\xe2\x82"),
            chunk(b"\xac\xff\", \"items\": []}"),
        ]),
        S::BAD_REQUEST,
    );
    c.order(
        "chunked, the client gone half-way",
        chunked(vec![
            chunk(br#"{"order_id": "#),
            Err(std::io::Error::other("connection reset")),
        ]),
        S::BAD_REQUEST,
    );

    // Too many keys, and keys too long: 413 and 400 from the layer's limits.
    let skus: Vec<String> = (0..10_001).map(|i| format!("s-{i}")).collect();
    let items: Vec<(&str, u64)> = skus.iter().map(|s| (s.as_str(), 1)).collect();
    c.limit(
        "10,001 distinct SKUs",
        post_json(route, order_json("a", &items)),
        S::PAYLOAD_TOO_LARGE,
        "max_keys",
    );
    let long = "x".repeat(300);
    c.limit(
        "a 300-byte SKU",
        post_json(route, order_json("a", &[(&long, 1)])),
        S::BAD_REQUEST,
        "max_key_len",
    );
    // Only an order locks its `order_id`: a quote takes one of any length.
    if route == ORDERS {
        c.limit(
            "a 300-byte order_id",
            post_json(route, order_json(&long, &[("x", 1)])),
            S::BAD_REQUEST,
            "max_key_len",
        );
    }
    let euros = "€".repeat(100); // 100 characters, 300 bytes: the limit counts bytes
    c.limit(
        "a SKU of 100 euro signs",
        post_json(route, order_json("a", &[(&euros, 1)])),
        S::BAD_REQUEST,
        "max_key_len",
    );
    c.limit(
        "a 300-byte SKU in the path",
        put_stock(&long, r#"{"qty": 1}"#),
        S::BAD_REQUEST,
        "max_key_len",
    );

    // Well-formed to the lock layer, refused by the handler with its locks held.
    let mut handler = |what: &str, request: Request<Body>| {
        c.add(what, request, S::UNPROCESSABLE_ENTITY, By::Handler)
    };
    let nested = format!(
        r#"{{"order_id": "a", "items": [], "note": {}1{}}}"#,
        r#"{"a":["#.repeat(50_000),
        "]}".repeat(50_000)
    );
    handler(
        "no items, and 100,000 levels of nesting in an unknown field",
        post_json(route, nested),
    );
    handler(
        "no items",
        post_json(route, r#"{"order_id": "a", "items": []}"#),
    );
    handler(
        "qty 0",
        post_json(route, order_json("a", &[("x", 1), ("y", 0)])),
    );
    handler(
        "an empty sku",
        post_json(route, order_json("a", &[("", 1)])),
    );
    handler(
        "an empty order_id",
        post_json(route, order_json("", &[("x", 1)])),
    );
    handler(
        "quantities that overflow",
        post_json(route, order_json("a", &[("x", u64::MAX), ("x", 1)])),
    );
    handler("stock: a string qty", put_stock("x", r#"{"qty": "ten"}"#));
    handler("stock: no qty", put_stock("x", "{}"));
    let mut stock =
        |what: &str, request: Request<Body>, status| c.add(what, request, status, By::Handler);
    stock(
        "stock: truncated JSON",
        put_stock("x", r#"{"qty": "#),
        S::BAD_REQUEST,
    );
    stock(
        "stock: text/plain",
        request(Method::PUT, "/stock/x", Some(b"text/plain"), "10"),
        S::UNSUPPORTED_MEDIA_TYPE,
    );
    if route != ORDERS {
        c.cases.retain(|case| case.request.uri().path() == route);
    }
    c.cases
}

/// Sends `cases` and checks every answer.
async fn send_cases(app: &Router, cases: Vec<Case>) {
    for case in cases {
        let what = format!(
            "{} {}: {}",
            case.request.method(),
            case.request.uri(),
            case.what
        );
        let reply = send_text(app, case.request).await;
        assert_eq!(reply.status, case.status, "{what}: {}", reply.body);
        assert_eq!(
            reply.content_type.as_deref(),
            Some("application/problem+json"),
            "{what}: {}",
            reply.body
        );
        let problem: Value = serde_json::from_str(&reply.body).expect("a JSON problem document");
        assert_eq!(problem["status"], case.status.as_u16(), "{what}: {problem}");
        assert!(problem["title"].is_string(), "{what}: {problem}");
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(
            detail.len() > 10 && detail.len() < 1_000,
            "{what}: a problem needs a short, readable detail: {problem}"
        );
        if let Some(limit) = case.limit {
            assert_eq!(problem["limit"], limit, "{what}: {problem}");
        }
        eprintln!("{what}: {} {detail}", case.status);
    }
}

/// The service still works after the corpus: it places an order.
async fn still_serves(app: &Router) {
    let reply = send_text(app, put_stock("apple", r#"{"qty": 1}"#)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let reply = send_text(app, post_json(ORDERS, order_json("after", &[("apple", 1)]))).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
}

/// The corpus of `route`, split into the cases the layer refuses and those the handler
/// refuses, and the count of bytes read of its endless body.
fn split_corpus(route: &'static str) -> (Vec<Case>, Vec<Case>, Arc<AtomicUsize>) {
    let pulled = Arc::new(AtomicUsize::new(0));
    let cases = corpus(&pulled, route);
    assert!(cases.len() >= 40, "the corpus has {} cases", cases.len());
    let (layer, handler) = cases.into_iter().partition(|c| c.by == By::Layer);
    (layer, handler, pulled)
}

fn assert_read_at_most_the_cap(pulled: &AtomicUsize) {
    let pulled = pulled.load(Ordering::Relaxed);
    assert!(
        pulled <= DEFAULT_BODY_LIMIT + 64 * 1024,
        "read {pulled} bytes of an endless body with a cap of {DEFAULT_BODY_LIMIT}"
    );
}

#[tokio::test]
async fn memory_malformed_requests_get_the_right_4xx() {
    let app = orders::app(
        Store::memory(),
        Some(Locks::new(tower_batch_lock::store::Store::isolated_memory())),
        Duration::ZERO,
    );
    for route in [ORDERS, QUOTES] {
        let (layer, handler, pulled) = split_corpus(route);
        eprintln!(
            "{route}: {} refused by the layer, {} by the handler",
            layer.len(),
            handler.len()
        );
        send_cases(&app, layer).await;
        assert_read_at_most_the_cap(&pulled);
        send_cases(&app, handler).await;
    }
    let reply = send_text(&app, Request::get("/orders/a").body(Body::empty()).unwrap()).await;
    assert_eq!(
        reply.status,
        StatusCode::NOT_FOUND,
        "a refused order was stored"
    );
    still_serves(&app).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_malformed_requests_get_the_right_4xx_and_leave_nothing_behind() {
    let server = crate::support::RedisServer::start();
    let pool = server.pool();
    let app = orders::app(
        Store::redis(pool.clone()),
        Some(Locks::new(
            tower_batch_lock::store::Redis::pool(pool).build().unwrap(),
        )),
        Duration::ZERO,
    );
    let mut handled = Vec::new();
    for route in [ORDERS, QUOTES] {
        let (layer, handler, pulled) = split_corpus(route);
        send_cases(&app, layer).await;
        assert_read_at_most_the_cap(&pulled);
        handled.extend(handler);
    }
    // Refused while the keys were read (or, an empty quote, refused unlocked by the
    // handler): nothing at all was written to Redis.
    assert_eq!(
        server.keys("*"),
        Vec::<String>::new(),
        "refused requests wrote to Redis"
    );

    send_cases(&app, handled).await;
    // Refused by the handler: its locks were taken and released, and it wrote no data.
    // (`lock:` itself is the namespace's fencing counter, never a lock.)
    assert_eq!(server.keys("lock:?*"), Vec::<String>::new(), "locks left");
    assert_eq!(server.keys("*"), ["lock:"], "a refused request wrote data");

    still_serves(&app).await;
    assert_eq!(server.keys("lock:?*"), Vec::<String>::new(), "locks left");
}

/// Over a real connection: a client that streams a chunked body far past the cap gets 413
/// while it is still sending, and the server stops reading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_upload_over_the_cap_is_answered_before_it_ends() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let app = orders::app(
        Store::memory(),
        Some(Locks::new(tower_batch_lock::store::Store::isolated_memory())),
        Duration::ZERO,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    const TOTAL: usize = 256 * 1024 * 1024;
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let sent = Arc::new(AtomicUsize::new(0));
    let writer = tokio::spawn({
        let sent = sent.clone();
        async move {
            let head = "POST /orders HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
                        Transfer-Encoding: chunked\r\n\r\n";
            write.write_all(head.as_bytes()).await?;
            let chunk = format!("{:x}\r\n{}\r\n", 64 * 1024, " ".repeat(64 * 1024));
            while sent.load(Ordering::Relaxed) < TOTAL {
                write.write_all(chunk.as_bytes()).await?;
                sent.fetch_add(64 * 1024, Ordering::Relaxed);
            }
            Ok::<_, std::io::Error>(())
        }
    });

    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    let answered = tokio::time::timeout(Duration::from_secs(10), async {
        while !String::from_utf8_lossy(&response).contains("\r\n\r\n") {
            let n = read.read(&mut buf).await.unwrap();
            assert!(n > 0, "the connection closed without an answer");
            response.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    assert!(answered.is_ok(), "no answer within 10 s");
    let sent_when_answered = sent.load(Ordering::Relaxed);
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    assert!(
        sent_when_answered < TOTAL / 4,
        "the answer came after {sent_when_answered} bytes of {TOTAL}"
    );
    writer.abort();
    server.abort();
}
