//! Where a request's lock keys come from.
//!
//! A [`KeyExtractor`] takes the request, reads its keys, and hands the request back for the
//! inner service. Keys are plain strings, each naming one resource with its kind in front
//! (`order:42`, `sku:ab-12`); the layer puts its namespace before them (`lock:` by
//! default), removes duplicates and sorts them, so an extractor returns them in any order.
//!
//! ```
//! use axum::{body::Body, routing::put, Router};
//! use axum::http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_batch_lock::{keys, LockLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new()
//!     .route("/orders/{id}", put(|| async {}).layer(LockLayer::new(keys::path("order"))));
//!
//! let response = app.oneshot(Request::put("/orders/42").body(Body::empty()).unwrap());
//! assert_eq!(response.await.unwrap().status(), StatusCode::OK); // with `order:42` locked
//! # }
//! ```
//!
//! | extractor | reads | keys |
//! | --- | --- | --- |
//! | [`path`] | the route's path parameter, [by name](PathKeys::param) where it has several | `{kind}:{value}` |
//! | [`header`] | one header, such as `Idempotency-Key` | `{kind}:{value}` for each value |
//! | [`query`] | one query parameter | `{kind}:{value}` for each value |
//! | [`json`] | a JSON body, parsed into your type, refusals in problem+json | what your closure makes of it |
//! | [`from_parts`] | any axum extractor of the head: `Path<T>`, `Query<T>`, typed headers, your own; `State<T>` with [`from_parts_with_state`] | what your closure makes of it |
//! | [`from_request`] | any axum extractor of the body: `Json<T>`, `Form<T>`, `Bytes`; `State<T>` with [`from_request_with_state`] | what your closure makes of it |
//! | [`all`] | several of the above, in turn | all of their keys, as one batch |
//! | a closure `Fn(&Parts) -> Result<keys, impl IntoResponse>` | anything in the head | what it returns |
//!
//! A key closure returns its keys as strings, in any collection or iterator: a `Vec`, an
//! array, an `Option`, `ids.map(|id| format!("sku:{id}"))` (see [`IntoKeys`]), each held
//! exclusively; or [`Key`]s, to hold some of them [shared](Key::shared). Every refusal
//! of the extractors here is a problem document (`application/problem+json`), also those
//! of the axum extractors that [`from_parts`] and [`from_request`] run: with axum's status,
//! and its message as the `detail`. A key closure's error is sent as it is (a bare
//! `StatusCode` is a response without a body): return a [`Rejection`](crate::Rejection)
//! for a problem document with your status and `detail`.
//!
//! Extractors that read the body ([`json`], [`from_request`]) read it up to a cap
//! ([`DEFAULT_BODY_LIMIT`], 2 MiB, or their `limit`), refuse a longer one with 413 without
//! reading the rest (with or without a `Content-Length`), and hand the very same bytes to
//! the handler, which extracts them again.
//!
//! # What a key may hold
//!
//! Anything: a key is one opaque value in the store, compared byte for byte, never parsed
//! or split. Braces, spaces, newlines, quotes, `*` and non-ASCII text are kept as they are,
//! and every stored key starts with the namespace, so nothing a client sends can name or
//! touch a key outside it. Keys are not Unicode-normalized: `é` composed and decomposed
//! are two keys, as they are two ids in your own store. Where the request holds bytes
//! rather than text (a header, a percent-encoded query or path), the extractors here take
//! them as UTF-8 and refuse anything else with 400 rather than guess. A request with more
//! keys than [`Locks::max_keys`](crate::Locks::max_keys) gets 413, and a key longer than
//! [`Locks::max_key_len`](crate::Locks::max_key_len) bytes, an empty one, or one with a
//! NUL character (U+0000, which PostgreSQL's `text` cannot hold), gets 400.
//!
//! Two spellings of one resource must make one key, or they would not exclude each other:
//! make every route that touches a resource name it the same way (`format!("sku:{sku}")`
//! in a body extractor is the key [`path("sku")`](path) makes for `/stock/{sku}`). Two
//! resources that happen to share a key only wait for each other.
//!
//! # Cookbook
//!
//! Each recipe answers with the keys it locked, from the [`Lease`](crate::Lease) the layer
//! gives the handler.
//!
//! ## A resource id in the path
//!
//! [`path`] locks the route's parameter as axum decoded it; on a route with several, name
//! the one that identifies the resource (without a name, such a route answers 500 and logs
//! why: see [`path`]). For a typed id, run axum's `Path<T>` through [`from_parts`]: an id
//! that does not parse is refused before anything is locked.
//!
//! ```
//! use axum::{body::Body, extract::Path, routing::put, Extension, Router};
//! use axum::http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_batch_lock::{keys, Lease, LockLayer};
//!
//! async fn locked(Extension(lease): Extension<Lease>) -> String {
//!     lease.keys().collect::<Vec<_>>().join(" ")
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new()
//!     .route("/orders/{id}", put(locked).layer(LockLayer::new(keys::path("order"))))
//!     .route(
//!         "/shops/{shop}/carts/{cart}",
//!         put(locked).layer(LockLayer::new(keys::path("cart").param("cart"))),
//!     )
//!     .route(
//!         "/invoices/{number}",
//!         put(locked).layer(LockLayer::new(keys::from_parts(|Path(number): Path<u32>| {
//!             [format!("invoice:{number}")]
//!         }))),
//!     );
//!
//! # let call = |uri: &str| {
//! #     let request = Request::put(uri).body(Body::empty()).unwrap();
//! #     let app = app.clone();
//! #     async move {
//! #         let response = app.oneshot(request).await.unwrap();
//! #         let status = response.status();
//! #         (status, axum::body::to_bytes(response.into_body(), 1024).await.unwrap())
//! #     }
//! # };
//! // `call` sends a PUT and gives back the status and the body.
//! assert_eq!(call("/orders/a%2Fb").await.1, "order:a/b");
//! assert_eq!(call("/shops/7/carts/c-1").await.1, "cart:c-1");
//! assert_eq!(call("/invoices/1001").await.1, "invoice:1001");
//! assert_eq!(call("/invoices/x").await.0, StatusCode::BAD_REQUEST);
//! # }
//! ```
//!
//! ## An array of ids in the body
//!
//! [`json`] parses the body into your type and hands it to your closure, which lists the
//! keys; thousands of them are one batch, locked in one round trip. A body that is not
//! JSON, or does not fit the type, is refused with a problem document (400, 422).
//!
//! ```
//! use axum::{body::Body, routing::post, Extension, Json, Router};
//! use axum::http::{header, Request, StatusCode};
//! use serde::Deserialize;
//! use tower::ServiceExt;
//! use tower_batch_lock::{keys, Lease, LockLayer};
//!
//! #[derive(Deserialize)]
//! struct Payout { account_ids: Vec<u64>, cents: u64 }
//!
//! async fn pay(Extension(lease): Extension<Lease>, Json(payout): Json<Payout>) -> String {
//!     format!("{} cents to {} accounts", payout.cents, lease.keys().len())
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new().route(
//!     "/payouts",
//!     post(pay).layer(LockLayer::new(keys::json(|payout: Payout| {
//!         payout.account_ids.into_iter().map(|id| format!("account:{id}"))
//!     }))),
//! );
//!
//! let ids: Vec<String> = (1..=2_000).map(|id: u64| id.to_string()).collect();
//! let body = format!(r#"{{"account_ids": [{}], "cents": 5}}"#, ids.join(","));
//! let request = Request::post("/payouts")
//!     .header(header::CONTENT_TYPE, "application/json")
//!     .body(Body::from(body))
//!     .unwrap();
//! let response = app.clone().oneshot(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! let body = axum::body::to_bytes(response.into_body(), 1024).await.unwrap();
//! assert_eq!(body, "5 cents to 2000 accounts");
//!
//! let wrong = Request::post("/payouts")
//!     .header(header::CONTENT_TYPE, "application/json")
//!     .body(Body::from(r#"{"account_ids": "all", "cents": 5}"#))
//!     .unwrap();
//! let response = app.oneshot(wrong).await.unwrap();
//! assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
//! assert_eq!(response.headers()[header::CONTENT_TYPE], "application/problem+json");
//! # }
//! ```
//!
//! ## An idempotency key
//!
//! [`header`] locks the value of a header, so two deliveries of one request (a client's
//! retry after a timeout) never run at once: the second gets 409 while the first runs, and
//! the handler can answer it from what the first stored. [`HeaderKeys::required`] refuses
//! a request without the header, where by default it would run unlocked.
//!
//! ```
//! use axum::{body::Body, routing::post, Extension, Router};
//! use axum::http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_batch_lock::{keys, Lease, LockLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new().route(
//!     "/charges",
//!     post(|Extension(lease): Extension<Lease>| async move { lease.keys().collect::<String>() })
//!         .layer(LockLayer::new(keys::header("idempotency-key", "idem").required())),
//! );
//!
//! let request = Request::post("/charges").header("idempotency-key", "3f9c {retry: 2}");
//! let response = app.clone().oneshot(request.body(Body::empty()).unwrap()).await.unwrap();
//! let body = axum::body::to_bytes(response.into_body(), 1024).await.unwrap();
//! assert_eq!(body, "idem:3f9c {retry: 2}");
//!
//! let without = Request::post("/charges").body(Body::empty()).unwrap();
//! assert_eq!(app.oneshot(without).await.unwrap().status(), StatusCode::BAD_REQUEST);
//! # }
//! ```
//!
//! ## A tenant plus a resource
//!
//! When ids are only unique within a tenant, the key must hold both, or two tenants'
//! order 42 would wait for each other (and a `/tenants/{tenant}/orders/{id}` route gets
//! that from [`path("order").param("tenant").param("id")`](PathKeys::param):
//! `order:acme/42`). Here the tenant comes from a header, through an
//! extractor of your own that the handlers use too, and the id from the path: axum runs a
//! tuple of extractors as one.
//!
//! ```
//! use axum::{
//!     body::Body,
//!     extract::{FromRequestParts, Path},
//!     routing::put,
//!     Extension, Router,
//! };
//! use axum::http::{request::Parts, Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_batch_lock::{keys, Lease, LockLayer, Rejection};
//!
//! /// The tenant named by the `x-tenant` header.
//! struct Tenant(String);
//!
//! impl<S: Send + Sync> FromRequestParts<S> for Tenant {
//!     type Rejection = Rejection;
//!
//!     async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Rejection> {
//!         let tenant = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok());
//!         match tenant {
//!             Some(tenant) if !tenant.is_empty() => Ok(Tenant(tenant.to_owned())),
//!             _ => Err(Rejection::new(StatusCode::BAD_REQUEST, "send an x-tenant header")),
//!         }
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new().route(
//!     "/orders/{id}",
//!     put(|Extension(lease): Extension<Lease>| async move { lease.keys().collect::<String>() })
//!         .layer(LockLayer::new(keys::from_parts(
//!             |(Tenant(tenant), Path(id)): (Tenant, Path<u64>)| [format!("order:{tenant}/{id}")],
//!         ))),
//! );
//!
//! let request = Request::put("/orders/42").header("x-tenant", "acme");
//! let response = app.clone().oneshot(request.body(Body::empty()).unwrap()).await.unwrap();
//! let body = axum::body::to_bytes(response.into_body(), 1024).await.unwrap();
//! assert_eq!(body, "order:acme/42");
//!
//! let anonymous = Request::put("/orders/42").body(Body::empty()).unwrap();
//! assert_eq!(app.oneshot(anonymous).await.unwrap().status(), StatusCode::BAD_REQUEST);
//! # }
//! ```
//!
//! ## The path and the body at once
//!
//! [`all`] runs several extractors and locks all their keys as one batch: see its example,
//! which locks an order from the path, products from the body and an idempotency key.
//!
//! ## Anything else in the head
//!
//! A closure over the request head returns keys, or a response that refuses the request.
//!
//! ```
//! use axum::{routing::post, Router};
//! use axum::http::request::Parts;
//! use tower_batch_lock::{LockLayer, Rejection};
//!
//! // `report:{year}-{month}` from `?period=2024-05`, or no lock at all.
//! let app: Router = Router::new().route(
//!     "/reports",
//!     post(|| async {}).layer(LockLayer::new(|parts: &Parts| {
//!         let period = parts.uri.query().and_then(|q| q.strip_prefix("period="));
//!         Ok::<_, Rejection>(period.map(|p| format!("report:{p}")))
//!     })),
//! );
//! ```

mod adapter;
mod all;
pub(crate) mod body;
pub(crate) mod extractor;
mod head;
mod json;
pub(crate) mod normalize;
mod path;

pub use adapter::{
    from_parts, from_parts_with_state, from_request, from_request_with_state, FromPartsKeys,
    FromRequestKeys,
};
pub use all::{all, All};
pub use body::DEFAULT_BODY_LIMIT;
pub use extractor::{Extracted, IntoKeys, Key, KeyExtractor};
pub use head::{header, query, HeaderKeys, QueryKeys};
pub use json::{json, JsonKeys};
pub use path::{path, PathKeys};
