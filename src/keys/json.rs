//! Keys from a JSON request body.

use std::{any::type_name, fmt, future::Future, pin::Pin, sync::Arc};

use axum::response::IntoResponse;
use bytes::Bytes;
use http::{header, HeaderMap, Request, StatusCode};
use http_body::Body;
use serde::de::DeserializeOwned;

use super::{
    body::{read_capped, DEFAULT_BODY_LIMIT},
    extractor::{Extracted, IntoKeys, Key, KeyExtractor},
};
use crate::rejection::Rejection;

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
/// The `detail` of a 400 or 422 says where the body went wrong, field and place: for
/// `{"items": [{"sku": "a"}, {"sku": 5}]}` it reads ``the JSON body is not valid:
/// items[1].sku: invalid type: integer `5`, expected a string at line 1 column 34``.
///
/// `keys` returns the keys as strings, in any collection or iterator ([`IntoKeys`]).
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
pub fn json<T, F, K>(keys: F) -> JsonKeys
where
    T: DeserializeOwned,
    F: Fn(T) -> K + Send + Sync + 'static,
    K: IntoKeys,
{
    JsonKeys {
        keys: Arc::new(move |bytes: &[u8]| parse(bytes).map(|value| keys(value).into_keys())),
        body: type_name::<T>(),
        limit: DEFAULT_BODY_LIMIT,
    }
}

/// The extractor [`json`] builds.
#[derive(Clone)]
pub struct JsonKeys {
    // The parser and the closure behind one pointer: the type names neither, so the
    // compiler checks them where the user wrote them (`json`), and only there.
    keys: Arc<KeysOfJson>,
    body: &'static str,
    limit: usize,
}

/// Parses a body and gives its keys.
type KeysOfJson = dyn Fn(&[u8]) -> Result<Vec<Key>, Rejection> + Send + Sync;

impl JsonKeys {
    /// Reads at most `bytes` of the body; a longer body is refused with 413.
    pub fn limit(mut self, bytes: usize) -> Self {
        self.limit = bytes;
        self
    }
}

impl fmt::Debug for JsonKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonKeys")
            .field("type", &self.body)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl<B> KeyExtractor<B> for JsonKeys
where
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Future = Pin<Box<dyn Future<Output = Extracted<B>> + Send>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let (keys, limit) = (self.keys.clone(), self.limit);
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let bytes = read_json_body(&parts.headers, body, limit)
                .await
                .map_err(IntoResponse::into_response)?;
            let keys = keys(&bytes).map_err(IntoResponse::into_response)?;
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

/// Parses the body into `T`, as `serde_json::from_slice` does (trailing characters
/// included), and names the field where it went wrong.
///
/// # Errors
///
/// 400 for text that is not JSON, 422 for JSON that does not fit the type, as axum's `Json`.
fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Rejection> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        // `items[2].sku: invalid type: ...`; serde_json's own message alone has no field.
        let detail = format!("the JSON body is not valid: {error}");
        Rejection::new(status_of(error.inner()), detail)
    })?;
    deserializer.end().map_err(|error| {
        let detail = format!("the JSON body is not valid: {error}");
        Rejection::new(status_of(&error), detail)
    })?;
    Ok(value)
}

/// 422 for JSON that does not fit the type, 400 for anything else.
fn status_of(error: &serde_json::Error) -> StatusCode {
    match error.classify() {
        serde_json::error::Category::Data => StatusCode::UNPROCESSABLE_ENTITY,
        _ => StatusCode::BAD_REQUEST,
    }
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

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)] // only parsed
    struct Order {
        id: u64,
        items: Vec<Item>,
    }

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)] // only parsed
    struct Item {
        sku: String,
    }

    fn refusal(body: &str) -> Rejection {
        parse::<Order>(body.as_bytes()).unwrap_err()
    }

    #[test]
    fn syntax_errors_are_400_and_shape_errors_422() {
        let status = |body: &str| refusal(body).status();
        assert_eq!(status("{\"id\": "), StatusCode::BAD_REQUEST);
        assert_eq!(status("{id}"), StatusCode::BAD_REQUEST);
        assert_eq!(
            status("{\"id\": 1, \"items\": []} {}"),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(status("{\"id\": \"x\"}"), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(status("{}"), StatusCode::UNPROCESSABLE_ENTITY);
        assert!(parse::<Order>(br#" {"id": 1, "items": []} "#).is_ok());
    }

    #[test]
    fn refusals_name_the_field() {
        // The example of `json`'s docs.
        assert_eq!(
            refusal(r#"{"items": [{"sku": "a"}, {"sku": 5}]}"#).detail(),
            "the JSON body is not valid: items[1].sku: invalid type: integer `5`, \
             expected a string at line 1 column 34"
        );
        // A missing field is named by the object that misses it, as serde words it.
        assert_eq!(
            refusal(r#"{"id": 1, "items": [{}]}"#).detail(),
            "the JSON body is not valid: items[0]: missing field `sku` at line 1 column 22"
        );
    }
}
