//! Keys from the route's path parameters.

use std::{future::Future, pin::Pin, sync::Arc};

use axum::{
    extract::{rejection::RawPathParamsRejection, FromRequestParts, MatchedPath, RawPathParams},
    response::{IntoResponse, Response},
};
use http::{request::Parts, Request, StatusCode};

use super::extractor::{first_poll, Extracted, Key, KeyExtractor};
use crate::{log_once::error_once_for, rejection::Rejection};

/// One key from a path parameter of the matched route: `{kind}:{value}`.
///
/// `keys::path("order")` on `/orders/{id}` locks `order:42` for `/orders/42`. On a route
/// with several parameters, [`PathKeys::param`] names the one that identifies the resource:
/// `keys::path("account").param("id")` on `/banks/{bank}/accounts/{id}` locks `account:7`,
/// the key `/accounts/{id}` locks for the same account, so the two routes exclude each
/// other. Naming several joins their values with `/`, in the order named, for ids that
/// are only unique together: `.param("tenant").param("id")` locks `order:acme/42`.
///
/// Values are used as axum decoded them (`/stock/a%2Fb` locks `sku:a/b`), so the key is the
/// one a body extractor makes from the same id with `format!("sku:{id}")`: two spellings of
/// one resource must never lock different keys. (Two resources that happen to share a key
/// only wait for each other.) A value that is not UTF-8 once decoded (`%FF`) is refused with
/// 400, as a problem document.
///
/// It reads the parameters axum's router found, so it works under any axum layering
/// ([`MethodRouter::layer`](axum::routing::MethodRouter::layer),
/// [`Router::route_layer`](axum::Router::route_layer), [`Router::layer`](axum::Router::layer));
/// the parameters of a router that [nests](axum::Router::nest) this one count too. Where it
/// cannot tell what to lock, the route is set up wrong, not the request: it answers 500
/// (a problem document) and logs an error that names the route and its parameters (once a
/// route; its repeats at debug level):
///
/// | route | answer |
/// | --- | --- |
/// | one parameter, or `.param(..)` names some it has | the key |
/// | several parameters, and no `.param(..)` | 500: joining them all would lock `account:b1/7` where `/accounts/{id}` locks `account:7` |
/// | `.param(name)` names a parameter the route does not have | 500 |
/// | no parameter, or a service outside an axum router | 500 |
/// | a path that no route matches (the layer is on a whole `Router`) | the router's 404: the layer passes it on |
///
/// ```
/// use axum::{body::Body, routing::put, Router};
/// use axum::http::{Request, StatusCode};
/// use tower::ServiceExt;
/// use tower_batch_lock::{keys, Locks};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let locks = Locks::memory();
/// let app = Router::new()
///     .route("/accounts/{id}", put(|| async {}))
///     .route("/banks/{bank}/accounts/{id}", put(|| async {}))
///     .route_layer(locks.layer(keys::path("account").param("id")));
///
/// let response = app.oneshot(Request::put("/banks/b1/accounts/7").body(Body::empty()).unwrap());
/// assert_eq!(response.await.unwrap().status(), StatusCode::OK); // with `account:7` locked
///
/// // Without `.param("id")`, the route does not say which of its two parameters to lock.
/// let unsure = Router::new()
///     .route("/banks/{bank}/accounts/{id}", put(|| async {}))
///     .route_layer(locks.layer(keys::path("account")));
/// let response = unsure.oneshot(Request::put("/banks/b1/accounts/7").body(Body::empty()).unwrap());
/// assert_eq!(response.await.unwrap().status(), StatusCode::INTERNAL_SERVER_ERROR);
/// # }
/// ```
pub fn path(kind: impl Into<String>) -> PathKeys {
    PathKeys {
        kind: kind.into().into(),
        params: Arc::new([]),
    }
}

/// The extractor [`path`] builds.
#[derive(Debug, Clone)]
pub struct PathKeys {
    kind: Arc<str>,
    /// The parameters to lock, in key order; none for the route's only one.
    params: Arc<[Arc<str>]>,
}

/// Why a route gives no key: its set-up, not the request, is wrong.
#[derive(Debug, PartialEq)]
enum Misconfigured {
    /// The route has no parameter, or is not in an axum router.
    NoParameter,
    /// The route has several parameters, and the extractor names none of them.
    Ambiguous,
    /// The extractor names a parameter that the route does not have.
    Missing(Arc<str>),
}

impl PathKeys {
    /// Locks the parameter called `name` (`{name}` in the route), and not the others. Each
    /// call adds one, joined with `/` in the order of the calls.
    pub fn param(mut self, name: impl Into<String>) -> Self {
        let mut params = self.params.to_vec();
        params.push(name.into().into());
        self.params = params.into();
        self
    }

    /// The key for the route's `(name, value)` parameters.
    fn key(&self, params: &[(&str, &str)]) -> Result<String, Misconfigured> {
        let mut key = format!("{}:", self.kind);
        if self.params.is_empty() {
            match params {
                [(_, value)] => key.push_str(value),
                [] => return Err(Misconfigured::NoParameter),
                _ => return Err(Misconfigured::Ambiguous),
            }
            return Ok(key);
        }
        for (i, wanted) in self.params.iter().enumerate() {
            let Some((_, value)) = params.iter().find(|(name, _)| *name == &**wanted) else {
                return Err(Misconfigured::Missing(wanted.clone()));
            };
            if i > 0 {
                key.push('/');
            }
            key.push_str(value);
        }
        Ok(key)
    }

    /// Logs why the route cannot be locked (once a route at error level), and answers 500.
    fn misconfigured(
        &self,
        parts: &Parts,
        params: &[(&str, &str)],
        why: Misconfigured,
    ) -> Response {
        let kind = &*self.kind;
        let Some(route) = parts
            .extensions
            .get::<MatchedPath>()
            .map(MatchedPath::as_str)
        else {
            error_once_for!(
                kind,
                kind,
                "keys::path(\"{kind}\") found no route, so no path parameter to lock: \
                 it runs outside an axum Router, or inside a nested service"
            );
            return Self::refusal();
        };
        let names = params
            .iter()
            .map(|(name, _)| format!("`{name}`"))
            .collect::<Vec<_>>()
            .join(", ");
        match why {
            Misconfigured::NoParameter => error_once_for!(
                route,
                kind,
                route,
                "keys::path(\"{kind}\") found no path parameter to lock on the route {route}; \
                 use it on a route with parameters"
            ),
            Misconfigured::Ambiguous => error_once_for!(
                route,
                kind,
                route,
                "keys::path(\"{kind}\") does not know which parameter of the route {route} \
                 to lock: it has {names}; name the one that identifies the resource with \
                 .param(name), so that every route locks it under the same key"
            ),
            Misconfigured::Missing(param) => error_once_for!(
                route,
                kind,
                route,
                "keys::path(\"{kind}\").param(\"{param}\"): the route {route} has no parameter \
                 `{param}`; its parameters: {}",
                if names.is_empty() { "none" } else { &names }
            ),
        }
        Self::refusal()
    }

    /// The answer to a request on a misconfigured route: the client did nothing wrong.
    fn refusal() -> Response {
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
                    return Err(this.misconfigured(&parts, &[], Misconfigured::NoParameter))
                }
                // Invalid UTF-8 in a parameter (`%FF`): the client's fault, a 400, in the
                // crate's problem+json like every refusal of its own extractors.
                Err(rejection) => {
                    let rejection = Rejection::new(rejection.status(), rejection.body_text());
                    return Err(rejection.into_response());
                }
            };
            let params: Vec<(&str, &str)> = params.iter().collect();
            let key = this
                .key(&params)
                .map_err(|why| this.misconfigured(&parts, &params, why))?;
            Ok((Request::from_parts(parts, body), vec![Key::from(key)]))
        })
    }

    /// axum's path parameters are in the request's extensions already: the extraction
    /// finishes on its first poll.
    fn extract_now(&self, request: Request<B>) -> Result<Extracted<B>, Self::Future> {
        first_poll(self.extract(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_only_parameter_or_the_named_ones_in_the_order_named() {
        let params = [("tenant", "acme"), ("id", "4/2 %")];
        assert_eq!(path("order").key(&params[1..]).unwrap(), "order:4/2 %");
        assert_eq!(
            path("order").param("id").key(&params).unwrap(),
            "order:4/2 %"
        );
        assert_eq!(
            path("order")
                .param("id")
                .param("tenant")
                .key(&params)
                .unwrap(),
            "order:4/2 %/acme"
        );
    }

    #[test]
    fn several_parameters_without_a_name_or_a_missing_name_give_no_key() {
        let params = [("bank", "b1"), ("id", "7")];
        assert_eq!(path("account").key(&params), Err(Misconfigured::Ambiguous));
        assert_eq!(
            path("account").param("id").param("branch").key(&params),
            Err(Misconfigured::Missing("branch".into()))
        );
        assert_eq!(path("account").key(&[]), Err(Misconfigured::NoParameter));
        assert_eq!(
            path("account").param("id").key(&[]),
            Err(Misconfigured::Missing("id".into()))
        );
    }
}
