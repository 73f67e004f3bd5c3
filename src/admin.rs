//! An axum router that serves the operator's view of the locks as JSON (feature `admin`).
//!
//! **Serve it only on an admin port**, never on the public one: it shows which resources
//! are locked and for how long, and its `force-release` route takes locks from under
//! running requests. Put it behind whatever authenticates your operators.
//!
//! | route | answer |
//! | --- | --- |
//! | `GET /locks?key=a&key=b` | [`Locks::inspect`]: `{"keys": [{"key", "status", "ttl_ms", "holds", "waiters"}]}` |
//! | `GET /locks/held` | [`Locks::held_batches`]: `{"batches": [{"route", "request_id", "age_ms", "keys", "shared_keys"}]}` |
//! | `POST /locks/force-release` | [`Locks::force_release`] of `{"keys": [..], "reason": ".."}` (or a bare array of keys): `{"released": n}` |
//!
//! `status` is `"free"`, `"held"` (exclusively), `"shared"` or `"foreign"`
//! ([`KeyStatus`](crate::KeyStatus)); `holds` counts a shared key's holders;
//! `ttl_ms`, `route` and `request_id` are `null` when there is none. Errors are
//! `application/problem+json`: 400 for a missing or bad key, 413 for too many, 503 when
//! the store does not answer.
//!
//! ```
//! use axum::{body::Body, Router};
//! use axum::http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_batch_lock::{admin, store::Store, Locks};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let locks = Locks::new(Store::isolated_memory());
//! // In a real service: its own listener on an internal address, e.g. 127.0.0.1:9000.
//! let admin_app: Router = Router::new().nest("/admin", admin::router(locks.clone()));
//!
//! let response = admin_app
//!     .oneshot(Request::get("/admin/locks?key=order:42").body(Body::empty()).unwrap())
//!     .await
//!     .unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! # }
//! ```

use axum::{
    body::Bytes,
    extract::{Query, State},
    response::{IntoResponse, Response},
    routing::{get, post},
    Router,
};
use http::{header, StatusCode};
use serde_json::{json, Value};

use crate::{inspect::KeyState, locks::Locks, rejection::Rejection};

/// The operator's routes over `locks`, as JSON: see [the module](self). Nest or merge it
/// into a router that only an admin port serves.
pub fn router<S>(locks: Locks) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    // From now on, for `GET /locks/held`.
    locks.batches().start_listing();
    Router::new()
        .route("/locks", get(inspect))
        .route("/locks/held", get(held))
        .route("/locks/force-release", post(force_release))
        .with_state(locks)
}

async fn inspect(
    State(locks): State<Locks>,
    Query(query): Query<Vec<(String, String)>>,
) -> Response {
    let keys: Vec<String> = query
        .into_iter()
        .filter(|(name, _)| name == "key")
        .map(|(_, key)| key)
        .collect();
    if keys.is_empty() {
        return problem(
            StatusCode::BAD_REQUEST,
            "name the keys to inspect: /locks?key=a&key=b",
        );
    }
    match locks.inspect(keys).await {
        Ok(states) => {
            let keys: Vec<Value> = states.iter().map(key_json).collect();
            json_response(&json!({ "keys": keys }))
        }
        Err(rejection) => rejection.into_response(),
    }
}

fn key_json(state: &KeyState) -> Value {
    json!({
        "key": state.key(),
        "status": state.status().as_str(),
        "ttl_ms": state.ttl().map(|ttl| ttl.as_millis() as u64),
        "holds": state.holds(),
        "waiters": state.waiters(),
    })
}

async fn held(State(locks): State<Locks>) -> Response {
    let batches: Vec<Value> = locks
        .held_batches()
        .iter()
        .map(|batch| {
            json!({
                "route": batch.route(),
                "request_id": batch.request_id(),
                "age_ms": batch.age().as_millis() as u64,
                "keys": batch.key_count(),
                "shared_keys": batch.shared_key_count(),
            })
        })
        .collect();
    json_response(&json!({ "batches": batches }))
}

async fn force_release(State(locks): State<Locks>, body: Bytes) -> Response {
    const EXPECTED: &str =
        r#"send the keys as JSON: {"keys": ["a", "b"], "reason": "why"} or ["a", "b"]"#;
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return problem(StatusCode::BAD_REQUEST, EXPECTED);
    };
    let (keys, reason) = match &body {
        Value::Array(_) => (&body, None),
        Value::Object(fields) => (
            fields.get("keys").unwrap_or(&Value::Null),
            fields.get("reason").and_then(Value::as_str),
        ),
        _ => (&Value::Null, None),
    };
    let Some(keys) = keys.as_array().and_then(|keys| {
        keys.iter()
            .map(|key| key.as_str().map(str::to_owned))
            .collect::<Option<Vec<String>>>()
    }) else {
        return problem(StatusCode::BAD_REQUEST, EXPECTED);
    };
    if keys.is_empty() {
        return problem(StatusCode::BAD_REQUEST, EXPECTED);
    }
    let reason = reason.unwrap_or("none given (admin router)");
    match locks.force_release(keys, reason).await {
        Ok(released) => json_response(&json!({ "released": released })),
        Err(rejection) => rejection.into_response(),
    }
}

fn json_response(value: &Value) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

/// An RFC 9457 problem document, as every refusal of this crate is.
fn problem(status: StatusCode, detail: &'static str) -> Response {
    Rejection::new(status, detail).into_response()
}
