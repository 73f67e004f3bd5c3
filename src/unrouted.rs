//! Requests that axum's `Router` matched to none of its routes.
//!
//! A layer put on a whole `Router` (`Router::layer`, not `route_layer`) wraps its fallback
//! too: the service that answers a path no route matches (404 by default, or the
//! application's own fallback). Such a request touches no resource the routes protect, so
//! the layers of this crate pass it to the fallback as it is, and a typo in a URL gets the
//! router's 404, never a refusal about keys it could not have.
//!
//! axum marks every request it routes with its path parameters (none for the fallback),
//! and a request matched to a route with its [`MatchedPath`]; a service nested with
//! `Router::nest_service` sees a [`NestedPath`]. A request with parameters and neither of
//! the others went to the fallback. A request outside any `Router` has no parameters, and
//! is locked as always.
//!
//! One shape looks the same and is not a fallback: a layer put *around* a `nest_service`
//! endpoint (on the outer router) sees the request before axum names its route. The docs
//! of [`LockLayer`](crate::LockLayer) say to lock such a service from inside it.

use axum::extract::{
    rejection::RawPathParamsRejection, FromRequestParts, MatchedPath, NestedPath, RawPathParams,
};
use futures_util::FutureExt;
use http::{request::Parts, Request};

/// Whether axum's `Router` sent this request to its fallback: it matched no route.
pub(crate) fn matched_no_route(parts: &mut Parts) -> bool {
    let extensions = &parts.extensions;
    if extensions.get::<MatchedPath>().is_some() || extensions.get::<NestedPath>().is_some() {
        return false;
    }
    // Read at once: the parameters are in the extensions, or not.
    let params = RawPathParams::from_request_parts(parts, &()).now_or_never();
    !matches!(
        params,
        None | Some(Err(RawPathParamsRejection::MissingPathParams(_)))
    )
}

/// [`matched_no_route`] for a whole request, which it gives back.
pub(crate) fn request_matched_no_route<B>(request: Request<B>) -> (Request<B>, bool) {
    // The common case, a matched route, without taking the request apart.
    if request.extensions().get::<MatchedPath>().is_some() {
        return (request, false);
    }
    let (mut parts, body) = request.into_parts();
    let unrouted = matched_no_route(&mut parts);
    (Request::from_parts(parts, body), unrouted)
}
