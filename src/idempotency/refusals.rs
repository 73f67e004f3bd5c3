//! The idempotency layer's own refusals, each a problem+json [`Rejection`].

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};

use crate::rejection::Rejection;

/// The answer to a request without a key, where one is required.
pub(super) fn missing_key() -> Response {
    Rejection::new(
        StatusCode::BAD_REQUEST,
        "this request needs an Idempotency-Key header, such as \
         Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\"; \
         send a new key for each new request, and the same key when you retry it",
    )
    .into_response()
}

/// The answer to a key that was used for another request.
pub(super) fn reused_key() -> Response {
    Rejection::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "this Idempotency-Key was already used for a different request (another method, \
         path or body); send a new key for a new request",
    )
    .into_response()
}

/// The answer to a retry of a request whose answer was too large to keep.
pub(super) fn too_large_to_replay(first: StatusCode) -> Response {
    // Not 409: clients that follow the draft take that for "still running" and retry.
    Rejection::limit(
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_answer_size",
        format!(
            "the request with this Idempotency-Key was answered with status {}, and its \
             answer was too large to keep for a replay; send a new key to run it again",
            first.as_u16()
        ),
    )
    .into_response()
}

/// The answer kept for a request whose handler panicked, for its retries.
pub(super) fn panicked() -> Response {
    Rejection::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the request with this Idempotency-Key failed on the server part-way, and may have \
         done some of its work; it is not run again with this key: check what it did, and \
         send a new key to try again",
    )
    .into_response()
}

/// The answer to a duplicate of a request that still runs.
pub(super) fn in_progress(retry_after: Option<HeaderValue>) -> Response {
    let mut response = Rejection::new(
        StatusCode::CONFLICT,
        "a request with this Idempotency-Key is still being processed; \
         retry once it has finished",
    )
    .into_response();
    if let Some(after) = retry_after {
        response
            .headers_mut()
            .insert(http::header::RETRY_AFTER, after);
    }
    response
}
