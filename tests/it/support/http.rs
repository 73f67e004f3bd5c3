//! Driving a router the way users do: requests whose keys travel in an `x-keys` header or
//! a JSON body, answers read to the end, and waits that are always bounded.

#[cfg(any(feature = "redis", feature = "postgres"))]
use std::time::Instant;
use std::{future::Future, time::Duration};

#[cfg(any(feature = "redis", feature = "postgres"))]
use axum::routing::post;
#[cfg(any(feature = "redis", feature = "postgres"))]
use axum::Extension;
use axum::{body::Body, Router};
use bytes::Bytes;
use http::{header, request::Parts, HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
#[cfg(any(feature = "redis", feature = "postgres"))]
use tower_batch_lock::Lease;
use tower_batch_lock::Rejection;
#[cfg(any(feature = "redis", feature = "postgres"))]
use tower_batch_lock::{keys, Locks};

/// How long [`send`] waits for a response before it fails the test.
pub(crate) const RESPONSE_LIMIT: Duration = Duration::from_secs(10);

/// Keys from the comma-separated `x-keys` header; none when it is missing or empty.
pub(crate) fn header_keys(parts: &Parts) -> Result<Vec<String>, Rejection> {
    let keys = parts
        .headers
        .get("x-keys")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    Ok(keys
        .split(',')
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .collect())
}

/// Keys from the comma-separated `x-keys` header, which must be there: a closure extractor
/// over the head that refuses with 400 without it.
pub(crate) fn required_header_keys(parts: &Parts) -> Result<Vec<String>, Rejection> {
    let value = parts
        .headers
        .get("x-keys")
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| Rejection::new(StatusCode::BAD_REQUEST, "send an x-keys header"))?;
    Ok(value.split(',').map(str::to_owned).collect())
}

/// `POST uri` with `keys` (comma-separated) in the `x-keys` header.
pub(crate) fn post_keys(uri: &str, keys: &str) -> Request<Body> {
    Request::post(uri)
        .header("x-keys", keys)
        .body(Body::empty())
        .unwrap()
}

/// A route `POST /batch` that locks the JSON array of strings in the body.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn batch_router<H, T>(locks: &Locks, handler: H) -> Router
where
    H: axum::handler::Handler<T, ()>,
    T: 'static,
{
    Router::new().route(
        "/batch",
        post(handler).layer(locks.layer(keys::json(|keys: Vec<String>| keys))),
    )
}

/// A [`batch_router`] whose handler answers with the fencing token of its lease.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn fence_router(locks: &Locks) -> Router {
    batch_router(locks, |Extension(lease): Extension<Lease>| async move {
        lease.fencing_token().get().to_string()
    })
}

/// `POST /batch` with `keys` as a JSON array.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn batch<K: AsRef<str>>(keys: &[K]) -> Request<Body> {
    let keys: Vec<&str> = keys.iter().map(AsRef::as_ref).collect();
    Request::post("/batch")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(&keys).unwrap()))
        .unwrap()
}

/// A response, read to the end.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Reply {
    /// The problem+json document of a refusal, after checking that it is one and that its
    /// `status` is the response's.
    pub(crate) fn problem(&self) -> serde_json::Value {
        assert_eq!(
            self.headers[header::CONTENT_TYPE],
            "application/problem+json",
            "a refusal is problem+json: {self:?}"
        );
        let problem: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(problem["status"], self.status.as_u16(), "{problem}");
        problem
    }

    #[cfg(feature = "redis")]
    pub(crate) fn retry_after(&self) -> u64 {
        self.headers
            .get(header::RETRY_AFTER)
            .unwrap_or_else(|| panic!("no Retry-After on {self:?}"))
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// The fencing token a [`fence_router`] answered with; the test fails on any other answer.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) trait Fence {
    fn fence(&self) -> u64;
}

#[cfg(any(feature = "redis", feature = "postgres"))]
impl Fence for Reply {
    fn fence(&self) -> u64 {
        assert_eq!(self.status, StatusCode::OK, "{}", self.text());
        self.text().parse().unwrap()
    }
}

/// Calls `app` with `request` and reads the whole response, or fails the test after
/// [`RESPONSE_LIMIT`].
pub(crate) async fn send(app: &Router, request: Request<Body>) -> Reply {
    let response = within(RESPONSE_LIMIT, "a response", app.clone().oneshot(request))
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// `future`, or a panic naming `what` after `limit`.
pub(crate) async fn within<F: Future>(limit: Duration, what: &str, future: F) -> F::Output {
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: did not happen within {limit:?}"))
}

/// Polls `check` every `every` until it holds; how long that took, or `None` after `limit`.
///
/// Each suite picks its own interval: fine enough for the latencies it measures, coarse
/// enough that checks which open connections do not load the servers they look at.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) async fn poll_every(
    every: Duration,
    limit: Duration,
    mut check: impl FnMut() -> bool,
) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if check() {
            return Some(start.elapsed());
        }
        if start.elapsed() > limit {
            return None;
        }
        tokio::time::sleep(every).await;
    }
}

/// A response whose body is text, read to the end.
#[derive(Debug)]
pub(crate) struct TextReply {
    pub(crate) status: StatusCode,
    pub(crate) content_type: Option<String>,
    pub(crate) body: String,
}

impl TextReply {
    /// The problem document of a refusal, after checking that it is one and that its
    /// `status` is the response's.
    pub(crate) fn problem(&self) -> serde_json::Value {
        assert_eq!(
            self.content_type.as_deref(),
            Some("application/problem+json"),
            "{} {}",
            self.status,
            self.body
        );
        let problem: serde_json::Value = serde_json::from_str(&self.body).unwrap();
        assert_eq!(problem["status"], self.status.as_u16());
        problem
    }

    /// The `detail` of the problem document.
    pub(crate) fn detail(&self) -> String {
        self.problem()["detail"].as_str().unwrap().to_owned()
    }
}

/// [`send`], for a response whose body must be UTF-8 text.
pub(crate) async fn send_text(app: &Router, request: Request<Body>) -> TextReply {
    let reply = send(app, request).await;
    let content_type = reply
        .headers
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_owned());
    TextReply {
        status: reply.status,
        content_type,
        body: String::from_utf8(reply.body.to_vec()).expect("a UTF-8 answer"),
    }
}
