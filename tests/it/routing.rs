//! A layer on a whole `Router` (`Router::layer`) as on its routes (`route_layer`): a path
//! no route matches gets the router's 404, never a refusal about keys, and a wrong method
//! a 4xx (405 exactly under a method router's `route_layer`, as axum documents).

use axum::{
    body::Body,
    routing::{any_service, post},
    Router,
};
use http::{Method, Request, StatusCode};
use tower::ServiceExt;
use tower_batch_lock::{keys, store::Store, Lease, Locks};

use crate::support::{http::required_header_keys, logs::errors_logged};

/// The route, with the layer that `$make` builds put on the whole router, on its routes,
/// and on the route's method router alone: `(how, router)`.
macro_rules! three_ways {
    ($make:expr) => {{
        let handler = || post(|_lease: Lease| async { "locked and run" });
        let routes = || Router::new().route("/orders/{id}", handler());
        [
            ("Router::layer", routes().layer($make)),
            ("Router::route_layer", routes().route_layer($make)),
            (
                "MethodRouter::route_layer",
                Router::new().route("/orders/{id}", handler().route_layer($make)),
            ),
        ]
    }};
}

/// A request that every extractor of these tests can read keys from.
fn request(method: Method, uri: &str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .header("x-keys", "routing-test:a")
        .body(Body::from(r#"["routing-test:a"]"#))
        .unwrap()
}

async fn status(app: &Router, method: Method, uri: &str) -> StatusCode {
    app.clone()
        .oneshot(request(method, uri))
        .await
        .unwrap()
        .status()
}

/// What each layer answers: the route's own requests are locked and run; an unknown path
/// gets 404 whatever its method; a known path with the wrong method a 4xx, 405 under the
/// method router's `route_layer`.
async fn check(extractor: &str, apps: [(&str, Router); 3]) {
    for (how, app) in apps {
        let at = format!("{extractor} under {how}");
        let routed = status(&app, Method::POST, "/orders/7").await;
        assert_eq!(routed, StatusCode::OK, "{at}");
        for method in [Method::GET, Method::POST, Method::PUT] {
            let unknown = status(&app, method.clone(), "/nope").await;
            assert_eq!(unknown, StatusCode::NOT_FOUND, "{method} /nope, {at}");
            let below = status(&app, method.clone(), "/orders/7/items").await;
            assert_eq!(
                below,
                StatusCode::NOT_FOUND,
                "{method} /orders/7/items, {at}"
            );
        }
        // A GET without a body, which `keys::json` refuses (415) before the method router
        // could answer 405, where the layer wraps that router's fallback.
        let wrong_method = app
            .clone()
            .oneshot(Request::get("/orders/7").body(Body::empty()).unwrap())
            .await
            .unwrap()
            .status();
        if how == "MethodRouter::route_layer" {
            assert_eq!(wrong_method, StatusCode::METHOD_NOT_ALLOWED, "{at}");
        } else {
            assert!(wrong_method.is_client_error(), "{wrong_method}, {at}");
        }
    }
}

#[tokio::test]
async fn a_path_no_route_matches_gets_the_routers_404_under_either_layer() {
    let locks = Locks::new(Store::isolated_memory());
    let path = keys::path("routing-test-order");
    check("keys::path", three_ways!(locks.layer(path.clone()))).await;
    let json = keys::json(|ids: Vec<String>| ids);
    check("keys::json", three_ways!(locks.layer(json.clone()))).await;
    check("a closure", three_ways!(locks.layer(required_header_keys))).await;
    let logged = errors_logged();
    assert!(!logged.contains("routing-test"), "{logged}");
}

#[tokio::test]
async fn an_unknown_path_reaches_the_applications_own_fallback() {
    let locks = Locks::new(Store::isolated_memory());
    let app = Router::new()
        .route("/orders/{id}", post(|| async {}))
        .fallback(|| async { (StatusCode::NOT_FOUND, "no such page here") })
        .layer(locks.layer(keys::path("routing-test-fallback")));
    let response = app
        .oneshot(Request::delete("/nope").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(body, "no such page here");
}

/// A service nested with `nest_service` is a route too: a layer inside it reads its keys
/// and refuses a request that names none.
#[tokio::test]
async fn a_layer_inside_a_nested_service_still_locks_it() {
    let locks = Locks::new(Store::isolated_memory());
    let service = any_service(tower::service_fn(|_: Request<Body>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Body::from("served")))
    }));
    let nested = Router::new().nest_service(
        "/tenants",
        tower::ServiceBuilder::new()
            .layer(locks.layer(required_header_keys))
            .service(service),
    );
    let missing = nested
        .clone()
        .oneshot(Request::post("/tenants/1").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    let named = status(&nested, Method::POST, "/tenants/1").await;
    assert_eq!(named, StatusCode::OK);
}

#[cfg(feature = "idempotency")]
#[tokio::test]
async fn the_idempotency_layer_on_a_whole_router_leaves_unknown_paths_to_the_404() {
    let locks = Locks::new(Store::isolated_memory());
    let app = Router::new()
        .route("/orders/{id}", post(|| async { "created" }))
        .layer(locks.idempotency().required(true));
    let unknown = app
        .clone()
        .oneshot(Request::post("/nope").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    let without_key = app
        .oneshot(Request::post("/orders/1").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(without_key.status(), StatusCode::BAD_REQUEST);
}
