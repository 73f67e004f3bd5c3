//! Keys from any axum extractor: the types handlers already take.

use std::{any::type_name, fmt, future::Future, pin::Pin, sync::Arc};

use axum::{
    extract::{FromRequest, FromRequestParts},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{header, request::Parts, Request};
use http_body::Body;

use super::{
    body::{read_capped, DEFAULT_BODY_LIMIT},
    extractor::{first_poll, Extracted, IntoKeys, Key, KeyExtractor},
};
use crate::rejection::Rejection;

/// Keys from an extractor of the request head: any [`FromRequestParts`] type, such as
/// [`Path<T>`](axum::extract::Path), `Query<T>`, a typed header, a tuple of those, or one of
/// your own. `keys` turns the extracted value into keys ([`IntoKeys`]).
///
/// Unlike a handler, `keys` takes **one** argument: for several extractors, take a tuple
/// and destructure it, `|(Path(id), Query(q)): (Path<u64>, Query<Filter>)|`. Written as a
/// handler's arguments, `|Path(id), Query(q)|`, it does not compile (E0593, "closure is
/// expected to take 1 argument, but it takes 2").
///
/// The extractor runs as it would for a handler, with the state `()`: extractors that need
/// the router's state (`State<T>`, or your own over `S: FromRef<..>`) run in
/// [`from_parts_with_state`]. When the extractor refuses the request, its status is the
/// answer: axum's rejections, which are plain text, become a problem document
/// (`application/problem+json`) with their text as `detail` (`Path<u64>` on `/accounts/x`
/// answers 400, "Invalid URL: Cannot parse `x` to a `u64`"); a rejection in any other
/// media type, such as a [`Rejection`], is the answer as it is.
///
/// ```
/// use axum::{body::Body, extract::Path, routing::put, Extension, Router};
/// use axum::http::{header, Request, StatusCode};
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
/// let response = refused.await.unwrap();
/// assert_eq!(response.status(), StatusCode::BAD_REQUEST);
/// assert_eq!(response.headers()[header::CONTENT_TYPE], "application/problem+json");
/// # }
/// ```
pub fn from_parts<X, F, K>(keys: F) -> FromPartsKeys
where
    X: PartsExtractor<()>,
    F: Fn(X) -> K + Send + Sync + 'static,
    K: IntoKeys,
{
    from_parts_with_state((), keys)
}

/// [`from_parts`] for extractors that need the router's state, such as
/// [`State<T>`](axum::extract::State): they run with `state`, as a handler's would with the
/// state of [`Router::with_state`](axum::Router::with_state). As axum's
/// [`from_fn_with_state`](axum::middleware::from_fn_with_state), since a layer does not
/// see the router's state: pass the same value (or its part the extractors read). As for
/// [`from_parts`], `keys` takes one argument: the extractors' values as one tuple.
///
/// ```
/// use axum::{body::Body, extract::{Path, State}, routing::put, Extension, Router};
/// use axum::http::Request;
/// use tower::ServiceExt;
/// use tower_batch_lock::{keys, Lease, LockLayer};
///
/// #[derive(Clone)]
/// struct App { region: &'static str }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let state = App { region: "eu" };
/// let app = Router::new()
///     .route(
///         "/accounts/{id}",
///         put(|Extension(lease): Extension<Lease>| async move { lease.keys().collect::<String>() })
///             .layer(LockLayer::new(keys::from_parts_with_state(
///                 state.clone(),
///                 |(State(app), Path(id)): (State<App>, Path<u64>)| {
///                     [format!("account:{}/{id}", app.region)]
///                 },
///             ))),
///     )
///     .with_state(state);
///
/// let response = app.oneshot(Request::put("/accounts/7").body(Body::empty()).unwrap());
/// let body = axum::body::to_bytes(response.await.unwrap().into_body(), 64).await.unwrap();
/// assert_eq!(body, "account:eu/7");
/// # }
/// ```
pub fn from_parts_with_state<S, X, F, K>(state: S, keys: F) -> FromPartsKeys
where
    S: Clone + Send + Sync + 'static,
    X: PartsExtractor<S>,
    F: Fn(X) -> K + Send + Sync + 'static,
    K: IntoKeys,
{
    let keys = Arc::new(keys);
    let extract = move |mut parts: Parts| -> BoxFuture<'static, _> {
        let (keys, state) = (keys.clone(), state.clone());
        Box::pin(async move {
            let extracted = X::from_request_parts(&mut parts, &state).await;
            let keys = extracted
                .map(|value| keys(value).into_keys())
                .map_err(IntoResponse::into_response);
            (parts, keys)
        })
    };
    FromPartsKeys {
        extract: Arc::new(extract),
        extractor: type_name::<X>(),
    }
}

/// An axum extractor that [`from_parts`] can run with the state `S`: every
/// [`FromRequestParts<S>`] type. It exists for the compiler's message when a closure takes
/// something else: a body extractor, or one that needs a state it was not given.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot run in `keys::from_parts` with the state `{S}`",
    label = "not an extractor of the request head with the state `{S}`",
    note = "`keys::from_parts` runs extractors of the request head (`FromRequestParts`): \
            `Path<T>`, `Query<T>`, headers, your own, and tuples of them",
    note = "extractors that need the router's state, such as `State<T>`, run in \
            `keys::from_parts_with_state(state, keys)`",
    note = "extractors of the body (`Json<T>`, `Form<T>`, `Bytes`, `String`) run in \
            `keys::from_request`"
)]
pub trait PartsExtractor<S>: FromRequestParts<S> + 'static {}

// `do_not_recommend`: the compiler's message is then this trait's, not that of a bound
// deep inside axum's impls (`FromRef<()>` is not implemented for your state).
#[diagnostic::do_not_recommend]
impl<S, X: FromRequestParts<S> + 'static> PartsExtractor<S> for X {}

/// The extractor [`from_parts`] and [`from_parts_with_state`] build.
#[derive(Clone)]
pub struct FromPartsKeys {
    // The extractor and the closure behind one pointer: the type names neither, so the
    // compiler checks them where the user wrote them (`from_parts`), and only there.
    extract: Arc<ExtractFromParts>,
    extractor: &'static str,
}

/// Runs the extractor and the key closure over a request head, and gives the head back.
type ExtractFromParts =
    dyn Fn(Parts) -> BoxFuture<'static, (Parts, Result<Vec<Key>, Response>)> + Send + Sync;

impl fmt::Debug for FromPartsKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromPartsKeys")
            .field("extractor", &self.extractor)
            .finish_non_exhaustive()
    }
}

impl<B: Send + 'static> KeyExtractor<B> for FromPartsKeys {
    type Future = Pin<Box<dyn Future<Output = Extracted<B>> + Send>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let (parts, body) = request.into_parts();
        let extracting = (self.extract)(parts);
        Box::pin(async move {
            match extracting.await {
                (parts, Ok(keys)) => Ok((Request::from_parts(parts, body), keys)),
                (_, Err(rejection)) => Err(as_problem(rejection).await),
            }
        })
    }

    /// At once where the extractors read only the head, as most do.
    fn extract_now(&self, request: Request<B>) -> Result<Extracted<B>, Self::Future> {
        first_poll(self.extract(request))
    }
}

/// Keys from an extractor that reads the body: any [`FromRequest`] type, such as
/// `Json<T>`, `Form<T>`, [`Bytes`], [`String`], or one of your own. `keys` turns the
/// extracted value into keys ([`IntoKeys`]).
///
/// The body is read first, up to a limit ([`DEFAULT_BODY_LIMIT`], or
/// [`FromRequestKeys::limit`]; a longer body is refused with 413 without reading the rest,
/// whether it declares its length or comes in chunks). The extractor then runs on a copy of
/// the request with those bytes, with the state `()` (or that of
/// [`from_request_with_state`]), and the very same bytes go on to the handler, which
/// extracts them again. When the extractor refuses the request, its status is the answer,
/// and axum's plain-text rejections become problem documents with their text as `detail`,
/// as in [`from_parts`]: `Json<T>` answers 415, 400 or 422, `Form<T>` 415 or 422.
///
/// ```
/// use axum::{body::Body, routing::post, Extension, Form, Router};
/// use axum::http::{header, Request, StatusCode};
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
pub fn from_request<X, F, K>(keys: F) -> FromRequestKeys
where
    X: RequestExtractor<()>,
    F: Fn(X) -> K + Send + Sync + 'static,
    K: IntoKeys,
{
    from_request_with_state((), keys)
}

/// [`from_request`] for extractors that need the router's state: they run with `state`,
/// as [`from_parts_with_state`]'s do.
pub fn from_request_with_state<S, X, F, K>(state: S, keys: F) -> FromRequestKeys
where
    S: Clone + Send + Sync + 'static,
    X: RequestExtractor<S>,
    F: Fn(X) -> K + Send + Sync + 'static,
    K: IntoKeys,
{
    let keys = Arc::new(keys);
    let extract = move |request: Request<axum::body::Body>| -> BoxFuture<'static, _> {
        let (keys, state) = (keys.clone(), state.clone());
        Box::pin(async move {
            let extracted = X::from_request(request, &state).await;
            extracted
                .map(|value| keys(value).into_keys())
                .map_err(IntoResponse::into_response)
        })
    };
    FromRequestKeys {
        extract: Arc::new(extract),
        extractor: type_name::<X>(),
        limit: DEFAULT_BODY_LIMIT,
    }
}

/// An axum extractor that [`from_request`] can run with the state `S`: every
/// [`FromRequest<S>`] type, which includes those of the head. It exists for the compiler's
/// message when a closure takes something else.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot run in `keys::from_request` with the state `{S}`",
    label = "not an axum extractor with the state `{S}`",
    note = "`keys::from_request` runs axum extractors (`FromRequest`): `Json<T>`, `Form<T>`, \
            `Bytes`, `String`, your own",
    note = "extractors that need the router's state, such as `State<T>`, run in \
            `keys::from_request_with_state(state, keys)`"
)]
pub trait RequestExtractor<S>: FromRequest<S> + 'static {}

// As for `PartsExtractor`: this trait's message, not one from deep inside axum.
#[diagnostic::do_not_recommend]
impl<S, X: FromRequest<S> + 'static> RequestExtractor<S> for X {}

/// The extractor [`from_request`] and [`from_request_with_state`] build.
#[derive(Clone)]
pub struct FromRequestKeys {
    // As in `FromPartsKeys`: checked where the user wrote it, behind one pointer.
    extract: Arc<ExtractFromRequest>,
    extractor: &'static str,
    limit: usize,
}

/// Runs the extractor and the key closure over a copy of the request.
type ExtractFromRequest = dyn Fn(Request<axum::body::Body>) -> BoxFuture<'static, Result<Vec<Key>, Response>>
    + Send
    + Sync;

impl FromRequestKeys {
    /// Reads at most `bytes` of the body; a longer body is refused with 413.
    pub fn limit(mut self, bytes: usize) -> Self {
        self.limit = bytes;
        self
    }
}

impl fmt::Debug for FromRequestKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromRequestKeys")
            .field("extractor", &self.extractor)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl<B> KeyExtractor<B> for FromRequestKeys
where
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Future = Pin<Box<dyn Future<Output = Extracted<B>> + Send>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let (extract, limit) = (self.extract.clone(), self.limit);
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let bytes = read_capped(&parts.headers, body, limit)
                .await
                .map_err(IntoResponse::into_response)?;
            // The extractor takes the request whole; it gets a copy of the head, and the
            // handler the original, so nothing the extractor does to it leaks through.
            let copy = Request::from_parts(parts.clone(), axum::body::Body::from(bytes.clone()));
            match extract(copy).await {
                Ok(keys) => Ok((Request::from_parts(parts, B::from(bytes)), keys)),
                Err(rejection) => Err(as_problem(rejection).await),
            }
        })
    }
}

/// The longest plain-text rejection that becomes a `detail` (axum's are a line); a longer
/// one gives way to the status's reason phrase.
const MAX_DETAIL: usize = 16 * 1024;

/// An axum extractor's refusal as a problem document, like every other refusal of the
/// layer: same status, its text as `detail`, its other headers (`WWW-Authenticate`,
/// `Allow`) kept. axum's rejections are `text/plain`; a refusal of any other media type
/// (JSON, a [`Rejection`], HTML), or one that is no error (a redirect), is the extractor's
/// own choice and goes out as it is.
async fn as_problem(rejection: Response) -> Response {
    let status = rejection.status();
    let plain = rejection
        .headers()
        .get(header::CONTENT_TYPE)
        .is_none_or(|media| {
            let essence = media.as_bytes().get(..b"text/plain".len());
            essence.is_some_and(|essence| essence.eq_ignore_ascii_case(b"text/plain"))
        });
    if !plain || !(status.is_client_error() || status.is_server_error()) {
        return rejection;
    }
    let (mut head, body) = rejection.into_parts();
    let detail = match axum::body::to_bytes(body, MAX_DETAIL).await {
        Ok(text) if !text.trim_ascii().is_empty() => String::from_utf8_lossy(&text).into_owned(),
        // A bare status, or a text too long for a detail: the status says it all.
        _ => status.canonical_reason().unwrap_or("refused").to_owned(),
    };
    let mut problem = Rejection::new(status, detail).into_response();
    head.headers.remove(header::CONTENT_TYPE);
    head.headers.remove(header::CONTENT_LENGTH);
    problem.headers_mut().extend(head.headers);
    problem.extensions_mut().extend(head.extensions);
    problem
}
