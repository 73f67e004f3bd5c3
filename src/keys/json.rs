//! Keys from a JSON request body.

use std::{fmt, future::Future, marker::PhantomData, pin::Pin};

use axum::response::IntoResponse;
use bytes::Bytes;
use http::{header, HeaderMap, Request, StatusCode};
use http_body::Body;
use serde::de::DeserializeOwned;

use super::{body::read_capped, Extracted, KeyExtractor, DEFAULT_BODY_LIMIT};
use crate::Rejection;

/// Keys from a JSON body: parses it into `T` and gives the value to `keys`.
///
/// The body is read up to a limit ([`DEFAULT_BODY_LIMIT`], or [`JsonKeys::limit`]) and the
/// very same bytes go on to the handler, which parses them again with its own extractor
/// (`axum::Json<T>`, say). Refusals, each `application/problem+json`:
///
/// | request | status |
/// | --- | --- |
/// | no `application/json` (or `+json`) content type | 415 |
/// | body over the limit, by `Content-Length` or as it streams | 413 |
/// | not JSON, or cut short | 400 |
/// | JSON that does not fit `T` (a missing field, a wrong type) | 422 |
///
/// ```
/// use axum::{routing::post, Json, Router};
/// use serde::Deserialize;
/// use tower_batch_lock::{keys, LockLayer};
///
/// #[derive(Deserialize)]
/// struct NewOrder { items: Vec<Item> }
/// #[derive(Deserialize)]
/// struct Item { sku: String }
///
/// async fn create(Json(order): Json<NewOrder>) { /* every sku is locked here */ }
///
/// let app: Router = Router::new().route(
///     "/orders",
///     post(create).layer(LockLayer::new(keys::json(|order: NewOrder| {
///         order.items.into_iter().map(|item| format!("sku:{}", item.sku))
///     }))),
/// );
/// ```
pub fn json<T, F>(keys: F) -> JsonKeys<T, F> {
    JsonKeys {
        keys,
        limit: DEFAULT_BODY_LIMIT,
        body: PhantomData,
    }
}

/// The extractor [`json`] builds.
pub struct JsonKeys<T, F> {
    keys: F,
    limit: usize,
    body: PhantomData<fn() -> T>,
}

impl<T, F> JsonKeys<T, F> {
    /// Reads at most `bytes` of the body; a longer body is refused with 413.
    pub fn limit(mut self, bytes: usize) -> Self {
        self.limit = bytes;
        self
    }
}

// By hand: deriving would demand `T: Clone` and `T: Debug` of the parsed type.
impl<T, F: Clone> Clone for JsonKeys<T, F> {
    fn clone(&self) -> Self {
        Self {
            keys: self.keys.clone(),
            limit: self.limit,
            body: PhantomData,
        }
    }
}

impl<T, F> fmt::Debug for JsonKeys<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonKeys")
            .field("type", &std::any::type_name::<T>())
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl<B, T, F, I> KeyExtractor<B> for JsonKeys<T, F>
where
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    T: DeserializeOwned + 'static,
    F: Fn(T) -> I + Clone + Send + Sync + 'static,
    I: IntoIterator,
    I::Item: Into<String>,
{
    type Future = Pin<Box<dyn Future<Output = Extracted<B>> + Send>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let (keys, limit) = (self.keys.clone(), self.limit);
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let bytes = read_json_body(&parts.headers, body, limit)
                .await
                .map_err(IntoResponse::into_response)?;
            let value: T =
                serde_json::from_slice(&bytes).map_err(|e| parse_rejection(&e).into_response())?;
            let keys = keys(value).into_iter().map(Into::into).collect();
            Ok((Request::from_parts(parts, B::from(bytes)), keys))
        })
    }
}

/// Reads the body of a JSON request, refusing it as soon as it passes `limit` bytes.
async fn read_json_body<B>(headers: &HeaderMap, body: B, limit: usize) -> Result<Bytes, Rejection>
where
    B: Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // Before the body: a client that sends the wrong kind of body learns it without
    // uploading it.
    if !is_json(headers) {
        return Err(Rejection::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "expected a request with `Content-Type: application/json`",
        ));
    }
    read_capped(headers, body, limit).await
}

/// `application/json`, or any `application/*+json`, with or without parameters.
fn is_json(headers: &HeaderMap) -> bool {
    let Some(content_type) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|subtype| subtype.ends_with("+json"))
}

/// 400 for text that is not JSON, 422 for JSON that does not fit the type, as axum's `Json`.
fn parse_rejection(error: &serde_json::Error) -> Rejection {
    let status = match error.classify() {
        serde_json::error::Category::Data => StatusCode::UNPROCESSABLE_ENTITY,
        _ => StatusCode::BAD_REQUEST,
    };
    Rejection::new(status, format!("the JSON body is not valid: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content_type(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, value.parse().unwrap());
        headers
    }

    #[test]
    fn accepts_json_media_types_only() {
        for ok in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/problem+json",
        ] {
            assert!(is_json(&content_type(ok)), "{ok}");
        }
        for bad in [
            "text/plain",
            "application/jsonx",
            "text/json",
            "application/x-www-form-urlencoded",
        ] {
            assert!(!is_json(&content_type(bad)), "{bad}");
        }
        assert!(!is_json(&HeaderMap::new()));
    }

    #[test]
    fn syntax_errors_are_400_and_shape_errors_422() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct Order {
            id: u64,
        }
        let status = |body: &str| {
            parse_rejection(&serde_json::from_str::<Order>(body).unwrap_err()).status()
        };
        assert_eq!(status("{\"id\": "), StatusCode::BAD_REQUEST);
        assert_eq!(status("{id}"), StatusCode::BAD_REQUEST);
        assert_eq!(status("{\"id\": \"x\"}"), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(status("{}"), StatusCode::UNPROCESSABLE_ENTITY);
    }
}
