//! Keys from the route's path parameters.

use std::{future::Future, pin::Pin, sync::Arc};

use axum::{
    extract::{rejection::RawPathParamsRejection, FromRequestParts, RawPathParams},
    response::{IntoResponse, Response},
};
use http::{Request, StatusCode};

use super::{Extracted, KeyExtractor};
use crate::Rejection;

/// One key from the path parameters of the matched route: `{kind}:{value}`.
///
/// With one parameter, `keys::path("order")` on `/orders/{id}` locks `order:42` for
/// `/orders/42`. With several, their values are joined with `/` in path order
/// (`/tenants/{t}/orders/{id}` -> `order:acme/42`), and [`PathKeys::param`] picks one by
/// name. Values are used as axum decoded them (`/stock/a%2Fb` locks `sku:a/b`), so the key
/// is the one a body extractor makes from the same id with `format!("sku:{id}")`: two
/// spellings of one resource must never lock different keys. (Two resources that happen to
/// share a key only wait for each other.) A value that is not UTF-8 once decoded (`%FF`) is
/// refused with 400, as a problem document.
///
/// It reads the parameters axum's router found, so it works under any axum layering
/// ([`MethodRouter::layer`](axum::routing::MethodRouter::layer),
/// [`Router::route_layer`](axum::Router::route_layer), [`Router::layer`](axum::Router::layer));
/// on a service outside an axum router it answers 500 and logs why.
///
/// ```
/// use axum::{routing::put, Router};
/// use tower_batch_lock::{keys, LockLayer};
///
/// let app: Router = Router::new()
///     .route("/orders/{id}", put(|| async {}))
///     .route_layer(LockLayer::new(keys::path("order")));
/// ```
pub fn path(kind: impl Into<String>) -> PathKeys {
    PathKeys {
        kind: kind.into().into(),
        param: None,
    }
}

/// The extractor [`path`] builds.
#[derive(Debug, Clone)]
pub struct PathKeys {
    kind: Arc<str>,
    param: Option<Arc<str>>,
}

impl PathKeys {
    /// Uses only the parameter called `name` (`{name}` in the route).
    pub fn param(mut self, name: impl Into<String>) -> Self {
        self.param = Some(name.into().into());
        self
    }

    /// The key for these `(name, value)` parameters; `None` when none of them is wanted.
    fn key<'a>(&self, params: impl IntoIterator<Item = (&'a str, &'a str)>) -> Option<String> {
        let mut key = format!("{}:", self.kind);
        let mut found = 0;
        for (name, value) in params {
            if self.param.as_deref().is_some_and(|wanted| wanted != name) {
                continue;
            }
            if found > 0 {
                key.push('/');
            }
            found += 1;
            key.push_str(value);
        }
        (found > 0).then_some(key)
    }

    /// Used where it cannot work: the client did nothing wrong, the route is set up wrong.
    fn misconfigured(&self) -> Response {
        tracing::error!(
            kind = %self.kind,
            param = self.param.as_deref(),
            "keys::path found no path parameter to lock on; use it on a route with parameters, \
             inside an axum Router"
        );
        Rejection::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the server could not determine what to lock",
        )
        .into_response()
    }
}

impl<B> KeyExtractor<B> for PathKeys
where
    B: Send + 'static,
{
    type Future = Pin<Box<dyn Future<Output = Extracted<B>> + Send>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let params = match RawPathParams::from_request_parts(&mut parts, &()).await {
                Ok(params) => params,
                Err(RawPathParamsRejection::MissingPathParams(_)) => {
                    return Err(this.misconfigured())
                }
                // Invalid UTF-8 in a parameter (`%FF`): the client's fault, a 400, in the
                // crate's problem+json like every refusal of its own extractors.
                Err(rejection) => {
                    let rejection = Rejection::new(rejection.status(), rejection.body_text());
                    return Err(rejection.into_response());
                }
            };
            let key = this.key(&params).ok_or_else(|| this.misconfigured())?;
            Ok((Request::from_parts(parts, body), vec![key]))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_decoded_values_in_path_order() {
        let params = [("tenant", "acme"), ("id", "4/2 %")];
        assert_eq!(path("order").key(params).unwrap(), "order:acme/4/2 %");
        assert_eq!(
            path("order").param("id").key(params).unwrap(),
            "order:4/2 %"
        );
    }

    #[test]
    fn no_matching_parameter_gives_no_key() {
        assert_eq!(path("order").param("id").key([("sku", "1")]), None);
        assert_eq!(path("order").key([]), None);
    }
}
