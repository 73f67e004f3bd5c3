//! The responses the layer gives instead of calling the inner service.

use std::{borrow::Cow, fmt, time::Duration};

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};

/// Why a request was answered without running the inner service.
///
/// Every rejection knows its [`StatusCode`] and renders as `application/problem+json`
/// ([RFC 9457]) with a `detail` a person can act on; where waiting helps (contention, an
/// unavailable lock store) it also sets `Retry-After`. Extractors return it too:
///
/// ```
/// use axum::http::{request::Parts, StatusCode};
/// use tower_batch_lock::Rejection;
///
/// fn idempotency_key(parts: &Parts) -> Result<Vec<String>, Rejection> {
///     let key = parts
///         .headers
///         .get("idempotency-key")
///         .and_then(|v| v.to_str().ok())
///         .ok_or_else(|| Rejection::new(StatusCode::BAD_REQUEST, "send an Idempotency-Key header"))?;
///     Ok(vec![format!("idem:{key}")])
/// }
/// # let _ = tower_batch_lock::LockLayer::new(idempotency_key);
/// ```
///
/// [RFC 9457]: https://www.rfc-editor.org/rfc/rfc9457
#[derive(Debug, Clone)]
pub struct Rejection {
    status: StatusCode,
    detail: Cow<'static, str>,
    retry_after: Option<Duration>,
    extension: Option<(&'static str, serde_json::Value)>,
    /// Whether other requests' locks caused it (rather than the request itself, or the
    /// store).
    contended: bool,
}

/// Marks a response that a lock layer gave instead of running its inner service, so that
/// a layer around it knows the request did not run (the idempotency layer stores no such
/// answer).
#[cfg_attr(not(feature = "idempotency"), allow(dead_code))]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Refused {
    /// Whether other requests' locks were in the way ([`Rejection::contention`]).
    pub(crate) contended: bool,
}

impl Rejection {
    /// A rejection with this status and explanation.
    pub fn new(status: StatusCode, detail: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status,
            detail: detail.into(),
            retry_after: None,
            extension: None,
            contended: false,
        }
    }

    /// Some of the request's keys are held by another owner.
    pub(crate) fn contention(
        status: StatusCode,
        (held, counted): (usize, bool),
        of: usize,
        named: Vec<String>,
        retry_after: Duration,
    ) -> Self {
        // Not counted: the store stopped at the first key it found held.
        let at_least = if counted { "" } else { "at least " };
        let detail = match (held, of) {
            (1, 1) => "the resource this request locks is held by another request".to_owned(),
            (1, _) => format!(
                "{at_least}1 of the {of} resources this request locks is held by another request"
            ),
            _ => format!(
                "{at_least}{held} of the {of} resources this request locks are held by another \
                 request"
            ),
        };
        let mut rejection = Self::new(status, detail).retry_after(retry_after);
        rejection.contended = true;
        if !named.is_empty() {
            rejection.extension = Some(("conflicting_keys", named.into()));
        }
        rejection
    }

    /// The lock store could not be reached in time. Says nothing of why: that is logged.
    pub(crate) fn unavailable() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the lock service is unavailable; try again later",
        )
        .retry_after(Duration::from_secs(1))
    }

    /// Too many requests already wait for their keys ([`Locks::max_waiters`]): refused at
    /// once, holding nothing.
    ///
    /// [`Locks::max_waiters`]: crate::Locks::max_waiters
    pub(crate) fn crowded() -> Self {
        Self::limit(
            StatusCode::SERVICE_UNAVAILABLE,
            "max_waiters",
            "too many requests are waiting for locks; try again later".to_owned(),
        )
        .retry_after(Duration::from_secs(1))
    }

    /// The handler takes a [`Lease`](crate::lease::Lease) that the request does not have. The
    /// server's mistake, not the client's: the log says what to change.
    pub(crate) fn missing_lease() -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the handler needs locks on this request's resources, but the request holds none",
        )
    }

    /// The request broke one of the configured limits, named in the `limit` member.
    pub(crate) fn limit(status: StatusCode, limit: &'static str, detail: String) -> Self {
        Self {
            extension: Some(("limit", limit.into())),
            ..Self::new(status, detail)
        }
    }

    fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The marker of the response that refuses a request with this rejection.
    pub(crate) fn refused(&self) -> Refused {
        Refused {
            contended: self.contended,
        }
    }

    /// The status code of the response.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The explanation, as the `detail` member of the problem document.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The problem document ([RFC 9457]) of the response body.
    ///
    /// [RFC 9457]: https://www.rfc-editor.org/rfc/rfc9457
    fn problem(&self) -> serde_json::Value {
        let mut problem = serde_json::json!({
            "type": "about:blank",
            "title": self.status.canonical_reason().unwrap_or("Error"),
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        if let (Some((name, value)), Some(members)) = (&self.extension, problem.as_object_mut()) {
            members.insert((*name).to_owned(), value.clone());
        }
        problem
    }
}

/// Whole seconds, rounded up, and at least one: `Retry-After: 0` invites a busy loop.
fn retry_after_secs(after: Duration) -> u64 {
    (after.as_secs())
        .saturating_add(u64::from(after.subsec_nanos() > 0))
        .max(1)
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status, self.detail)
    }
}

impl std::error::Error for Rejection {}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.problem().to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = self.retry_after {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs(after)),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let secs = |ms| retry_after_secs(Duration::from_millis(ms));
        assert_eq!(
            [secs(0), secs(1), secs(999), secs(1000), secs(1001)],
            [1, 1, 1, 1, 2]
        );
    }

    #[test]
    fn problem_has_the_rfc_9457_members_and_the_extension() {
        let rejection = Rejection::contention(
            StatusCode::CONFLICT,
            (2, true),
            5,
            vec!["sku:1".into()],
            Duration::from_secs(3),
        );
        assert_eq!(
            rejection.problem(),
            serde_json::json!({
                "type": "about:blank",
                "title": "Conflict",
                "status": 409,
                "detail": "2 of the 5 resources this request locks are held by another request",
                "conflicting_keys": ["sku:1"],
            })
        );
        let response = rejection.into_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "3");
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
    }

    #[test]
    fn contention_detail_agrees_in_number() {
        let detail = |held, of| {
            let rejection = Rejection::contention(
                StatusCode::CONFLICT,
                (held, true),
                of,
                vec![],
                Duration::ZERO,
            );
            rejection.detail().to_owned()
        };
        assert_eq!(
            detail(1, 1),
            "the resource this request locks is held by another request"
        );
        assert_eq!(
            detail(1, 2),
            "1 of the 2 resources this request locks is held by another request"
        );
        assert_eq!(
            detail(2, 3),
            "2 of the 3 resources this request locks are held by another request"
        );
        // A store that stopped at the first key it found held.
        let rejection = Rejection::contention(
            StatusCode::CONFLICT,
            (1, false),
            2_000,
            vec![],
            Duration::ZERO,
        );
        assert_eq!(
            rejection.detail(),
            "at least 1 of the 2000 resources this request locks is held by another request"
        );
    }
}
