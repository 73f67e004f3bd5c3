//! Keys from several extractors at once.

use std::{future::Future, pin::Pin};

use http::Request;

use super::extractor::{first_poll, Extracted, KeyExtractor};

/// The keys of every extractor in a tuple, together: `keys::all((keys::path("order"),
/// keys::json(f)))` locks the order of the path and the products of the body as one batch.
///
/// The extractors run one after the other, in tuple order, each on the request the one
/// before gave back (so one of them may read the body, and the next still finds it). The
/// first one to refuse the request answers it, and the rest do not run. Tuples of two to
/// six extractors are supported; nest `all` for more.
///
/// ```
/// use axum::{body::Body, routing::put, Extension, Router};
/// use axum::http::{header, Request, StatusCode};
/// use serde::Deserialize;
/// use tower::ServiceExt;
/// use tower_batch_lock::{keys, Lease, LockLayer};
///
/// #[derive(Deserialize)]
/// struct Lines { skus: Vec<String> }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let app = Router::new().route(
///     "/orders/{id}/lines",
///     put(|Extension(lease): Extension<Lease>| async move {
///         lease.keys().collect::<Vec<_>>().join(" ")
///     })
///     .layer(LockLayer::new(keys::all((
///         keys::path("order"),
///         keys::json(|lines: Lines| lines.skus.into_iter().map(|sku| format!("sku:{sku}"))),
///         keys::header("idempotency-key", "idem"),
///     )))),
/// );
///
/// let request = Request::put("/orders/42/lines")
///     .header(header::CONTENT_TYPE, "application/json")
///     .header("idempotency-key", "k-1")
///     .body(Body::from(r#"{"skus": ["b", "a"]}"#))
///     .unwrap();
/// let response = app.oneshot(request).await.unwrap();
/// assert_eq!(response.status(), StatusCode::OK);
/// let body = axum::body::to_bytes(response.into_body(), 256).await.unwrap();
/// assert_eq!(body, "idem:k-1 order:42 sku:a sku:b");
/// # }
/// ```
pub fn all<T>(extractors: T) -> All<T> {
    All(extractors)
}

/// The extractor [`all`] builds.
#[derive(Debug, Clone)]
pub struct All<T>(T);

macro_rules! impl_all {
    ($($extractor:ident),+) => {
        impl<B, $($extractor),+> KeyExtractor<B> for All<($($extractor,)+)>
        where
            B: Send + 'static,
            $($extractor: KeyExtractor<B>,)+
        {
            type Future = Pin<Box<dyn Future<Output = Extracted<B>> + Send>>;

            #[allow(non_snake_case)] // the extractors are named after their types
            fn extract(&self, request: Request<B>) -> Self::Future {
                let ($($extractor,)+) = self.0.clone();
                Box::pin(async move {
                    let mut keys = Vec::new();
                    $(
                        let (request, more) = $extractor.extract(request).await?;
                        keys.extend(more);
                    )+
                    Ok((request, keys))
                })
            }

            /// At once where every extractor's keys are in the head.
            fn extract_now(&self, request: Request<B>) -> Result<Extracted<B>, Self::Future> {
                first_poll(self.extract(request))
            }
        }
    };
}

impl_all!(E1, E2);
impl_all!(E1, E2, E3);
impl_all!(E1, E2, E3, E4);
impl_all!(E1, E2, E3, E4, E5);
impl_all!(E1, E2, E3, E4, E5, E6);
