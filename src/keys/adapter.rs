//! Keys from any axum extractor: the types handlers already take.

use std::{fmt, future::Future, marker::PhantomData, pin::Pin};

use axum::{
    extract::{FromRequest, FromRequestParts},
    response::IntoResponse,
};
use bytes::Bytes;
use http::Request;
use http_body::Body;

use super::{body::read_capped, Extracted, KeyExtractor, DEFAULT_BODY_LIMIT};

/// Keys from an extractor of the request head: any [`FromRequestParts`] type, such as
/// [`Path<T>`](axum::extract::Path), `Query<T>`, a typed header, a tuple of those, or one of
/// your own. `keys` turns the extracted value into keys.
///
/// The extractor runs as it would for a handler, with the state `()`; when it refuses the
/// request, its rejection is the response, unchanged (axum's own rejections are
/// `text/plain`). Extractors that need the application's state (`State<T>`, or your own
/// extractors over `S: FromRef<..>`) cannot run here: write them for any `S`, or read the
/// head with a closure over [`Parts`](http::request::Parts) instead.
///
/// ```
/// use axum::{body::Body, extract::Path, routing::put, Extension, Router};
/// use http::{Request, StatusCode};
/// use tower::ServiceExt;
/// use tower_batch_lock::{keys, Lease, LockLayer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let app = Router::new().route(
///     "/accounts/{id}",
///     put(|Extension(lease): Extension<Lease>| async move { lease.keys().collect::<String>() })
///         .layer(LockLayer::new(keys::from_parts(|Path(id): Path<u64>| {
///             [format!("account:{id}")]
///         }))),
/// );
///
/// let locked = app.clone().oneshot(Request::put("/accounts/7").body(Body::empty()).unwrap());
/// let response = locked.await.unwrap();
/// assert_eq!(response.status(), StatusCode::OK);
/// let body = axum::body::to_bytes(response.into_body(), 64).await.unwrap();
/// assert_eq!(body, "account:7");
///
/// // `Path<u64>` refuses an id that is not a number, before anything is locked.
/// let refused = app.oneshot(Request::put("/accounts/x").body(Body::empty()).unwrap());
/// assert_eq!(refused.await.unwrap().status(), StatusCode::BAD_REQUEST);
/// # }
/// ```
pub fn from_parts<X, F>(keys: F) -> FromPartsKeys<X, F> {
    FromPartsKeys {
        keys,
        extractor: PhantomData,
    }
}

/// The extractor [`from_parts`] builds.
pub struct FromPartsKeys<X, F> {
    keys: F,
    extractor: PhantomData<fn() -> X>,
}

// By hand: deriving would demand `X: Clone` and `X: Debug` of the extracted type.
impl<X, F: Clone> Clone for FromPartsKeys<X, F> {
    fn clone(&self) -> Self {
        Self {
            keys: self.keys.clone(),
            extractor: PhantomData,
        }
    }
}

impl<X, F> fmt::Debug for FromPartsKeys<X, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromPartsKeys")
            .field("extractor", &std::any::type_name::<X>())
            .finish_non_exhaustive()
    }
}

impl<B, X, F, I> KeyExtractor<B> for FromPartsKeys<X, F>
where
    B: Send + 'static,
    X: FromRequestParts<()> + 'static,
    F: Fn(X) -> I + Clone + Send + Sync + 'static,
    I: IntoIterator,
    I::Item: Into<String>,
{
    type Future = Pin<Box<dyn Future<Output = Extracted<B>> + Send>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let keys = self.keys.clone();
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let value = X::from_request_parts(&mut parts, &())
                .await
                .map_err(IntoResponse::into_response)?;
            let keys = keys(value).into_iter().map(Into::into).collect();
            Ok((Request::from_parts(parts, body), keys))
        })
    }
}

/// Keys from an extractor that reads the body: any [`FromRequest`] type, such as
/// `Json<T>`, `Form<T>`, [`Bytes`], [`String`], or one of your own. `keys` turns the
/// extracted value into keys.
///
/// The body is read first, up to a limit ([`DEFAULT_BODY_LIMIT`], or
/// [`FromRequestKeys::limit`]; a longer body is refused with 413 without reading the rest,
/// whether it declares its length or comes in chunks). The extractor then runs on a copy of
/// the request with those bytes, with the state `()`, and the very same bytes go on to the
/// handler, which extracts them again. When the extractor refuses the request, its
/// rejection is the response, unchanged: `Json<T>` answers 415, 400 or 422 in
/// `text/plain`. For `application/problem+json` answers to bad JSON, use
/// [`json`](super::json).
///
/// ```
/// use axum::{body::Body, routing::post, Extension, Form, Router};
/// use http::{header, Request, StatusCode};
/// use serde::Deserialize;
/// use tower::ServiceExt;
/// use tower_batch_lock::{keys, Lease, LockLayer};
///
/// #[derive(Deserialize)]
/// struct Transfer { from: u64, to: u64 }
///
/// async fn transfer(Extension(lease): Extension<Lease>, Form(t): Form<Transfer>) -> String {
///     // The handler reads the same form the extractor read.
///     format!("{} -> {}, locked {}", t.from, t.to, lease.keys().collect::<Vec<_>>().join(" "))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let app = Router::new().route(
///     "/transfers",
///     post(transfer).layer(LockLayer::new(keys::from_request(|Form(t): Form<Transfer>| {
///         [format!("account:{}", t.from), format!("account:{}", t.to)]
///     }))),
/// );
///
/// let request = Request::post("/transfers")
///     .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
///     .body(Body::from("from=9&to=3"))
///     .unwrap();
/// let response = app.oneshot(request).await.unwrap();
/// assert_eq!(response.status(), StatusCode::OK);
/// let body = axum::body::to_bytes(response.into_body(), 64).await.unwrap();
/// assert_eq!(body, "9 -> 3, locked account:3 account:9");
/// # }
/// ```
pub fn from_request<X, F>(keys: F) -> FromRequestKeys<X, F> {
    FromRequestKeys {
        keys,
        limit: DEFAULT_BODY_LIMIT,
        extractor: PhantomData,
    }
}

/// The extractor [`from_request`] builds.
pub struct FromRequestKeys<X, F> {
    keys: F,
    limit: usize,
    extractor: PhantomData<fn() -> X>,
}

impl<X, F> FromRequestKeys<X, F> {
    /// Reads at most `bytes` of the body; a longer body is refused with 413.
    pub fn limit(mut self, bytes: usize) -> Self {
        self.limit = bytes;
        self
    }
}

// By hand: deriving would demand `X: Clone` and `X: Debug` of the extracted type.
impl<X, F: Clone> Clone for FromRequestKeys<X, F> {
    fn clone(&self) -> Self {
        Self {
            keys: self.keys.clone(),
            limit: self.limit,
            extractor: PhantomData,
        }
    }
}

impl<X, F> fmt::Debug for FromRequestKeys<X, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromRequestKeys")
            .field("extractor", &std::any::type_name::<X>())
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl<B, X, F, I> KeyExtractor<B> for FromRequestKeys<X, F>
where
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    X: FromRequest<()> + 'static,
    F: Fn(X) -> I + Clone + Send + Sync + 'static,
    I: IntoIterator,
    I::Item: Into<String>,
{
    type Future = Pin<Box<dyn Future<Output = Extracted<B>> + Send>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let (keys, limit) = (self.keys.clone(), self.limit);
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let bytes = read_capped(&parts.headers, body, limit)
                .await
                .map_err(IntoResponse::into_response)?;
            // The extractor takes the request whole; it gets a copy of the head, and the
            // handler the original, so nothing the extractor does to it leaks through.
            let copy = Request::from_parts(parts.clone(), axum::body::Body::from(bytes.clone()));
            let value = X::from_request(copy, &())
                .await
                .map_err(IntoResponse::into_response)?;
            let keys = keys(value).into_iter().map(Into::into).collect();
            Ok((Request::from_parts(parts, B::from(bytes)), keys))
        })
    }
}
