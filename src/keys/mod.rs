//! Where a request's lock keys come from.
//!
//! A [`KeyExtractor`] takes the request, reads its keys, and hands the request back for the
//! inner service. Three kinds cover most endpoints:
//!
//! - a closure over the request head, `Fn(&http::request::Parts) -> Result<keys, impl
//!   IntoResponse>`, for headers, the query string or anything else in the head;
//! - [`path`], for routes that name their resource in the path (`PUT /orders/{id}`);
//! - [`json`], for bodies that list the resources (an order and its products).
//!
//! Keys are plain strings. The layer prefixes them with its namespace, removes duplicates
//! and sorts them, so an extractor returns them in any order.
//!
//! ```
//! use axum::{routing::{post, put}, Router};
//! use http::request::Parts;
//! use serde::Deserialize;
//! use tower_batch_lock::{keys, LockLayer, Rejection};
//!
//! #[derive(Deserialize)]
//! struct Transfer { from: u64, to: u64 }
//!
//! let app: Router = Router::new()
//!     // `sku:{sku}` for `PUT /stock/ab-12`
//!     .route("/stock/{sku}", put(|| async {}).layer(LockLayer::new(keys::path("sku"))))
//!     // `account:{from}` and `account:{to}`, read from the JSON body
//!     .route("/transfers", post(|| async {}).layer(LockLayer::new(keys::json(|t: Transfer| {
//!         [format!("account:{}", t.from), format!("account:{}", t.to)]
//!     }))))
//!     // `tenant:{x-tenant}`, from a header; no header, no lock
//!     .route("/reports", post(|| async {}).layer(LockLayer::new(|parts: &Parts| {
//!         let tenant = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok());
//!         Ok::<_, Rejection>(tenant.map(|t| format!("tenant:{t}")))
//!     })));
//! ```

use std::future::{ready, Future, Ready};

use axum::response::{IntoResponse, Response};
use http::{request::Parts, Request};

mod body;
mod json;
mod normalize;
mod path;

pub use body::DEFAULT_BODY_LIMIT;
pub use json::{json, JsonKeys};
pub(crate) use normalize::{normalize, KeyPolicy};
pub use path::{path, PathKeys};

/// What an extractor gives back: the request, for the inner service, and its keys; or the
/// response that refuses the request.
pub type Extracted<B> = Result<(Request<B>, Vec<String>), Response>;

/// Reads the lock keys of a request.
///
/// Implemented for closures over the request head (see the [module docs](self)), for
/// [`PathKeys`] and for [`JsonKeys`]. An extractor that reads the body must put the same
/// bytes back into the request it returns.
pub trait KeyExtractor<B>: Clone + Send + Sync + 'static {
    /// The future that [`extract`](Self::extract) returns.
    type Future: Future<Output = Extracted<B>> + Send + 'static;

    /// Reads the keys of `request`.
    ///
    /// # Errors
    ///
    /// Returns the response to send instead of running the inner service, when the request
    /// does not say which resources it touches in a usable way: a 4xx for bad input.
    fn extract(&self, request: Request<B>) -> Self::Future;
}

impl<B, F, I, E> KeyExtractor<B> for F
where
    B: Send + 'static,
    F: Fn(&Parts) -> Result<I, E> + Clone + Send + Sync + 'static,
    I: IntoIterator,
    I::Item: Into<String>,
    E: IntoResponse,
{
    type Future = Ready<Extracted<B>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let (parts, body) = request.into_parts();
        let keys = match self(&parts) {
            Ok(keys) => keys.into_iter().map(Into::into).collect(),
            Err(rejection) => return ready(Err(rejection.into_response())),
        };
        ready(Ok((Request::from_parts(parts, body), keys)))
    }
}
