//! Keys from one named value of the request head: a header, a query parameter.

use std::{
    fmt,
    future::{ready, Ready},
    sync::Arc,
};

use axum::response::IntoResponse;
use http::{header::HeaderName, request::Parts, Request, StatusCode};

use super::extractor::{Extracted, Key, KeyExtractor};
use crate::rejection::Rejection;

/// One key per value of the header `name`: `{kind}:{value}`.
///
/// `keys::header("idempotency-key", "idem")` locks `idem:8e0f-41` for a request with
/// `Idempotency-Key: 8e0f-41`, so two deliveries of one request never run at once. The
/// value is used as sent, byte for byte, less the spaces and tabs around it (which HTTP
/// does not count as part of it); a header sent several times gives a key per value.
///
/// HTTP lets a proxy fold a header sent several times into one line, its values joined
/// with commas (RFC 9110, section 5.3): `x-sku: a` and `x-sku: b` may arrive as
/// `x-sku: a, b`, which locks the one key `sku:a, b`. For a header that names several
/// resources, read it as a list with [`HeaderKeys::list`], and folding changes nothing.
///
/// | request | answer |
/// | --- | --- |
/// | no such header | no key: the request runs unlocked (or is refused by [`Locks::require_keys`](crate::Locks::require_keys)), or 400 with [`HeaderKeys::required`] |
/// | an empty value | 400 |
/// | a value that is not UTF-8 (obsolete `obs-text` bytes) | 400 |
///
/// Refusals are `application/problem+json` and name the header.
///
/// ```
/// use axum::{body::Body, routing::post, Router};
/// use axum::http::{Request, StatusCode};
/// use tower::ServiceExt;
/// use tower_batch_lock::{keys, Locks};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let locks = Locks::memory();
/// let app = Router::new().route(
///     "/payments",
///     post(|| async { "paid" })
///         .layer(locks.layer(keys::header("idempotency-key", "idem").required())),
/// );
///
/// let unkeyed = Request::post("/payments").body(Body::empty()).unwrap();
/// let response = app.oneshot(unkeyed).await.unwrap();
/// assert_eq!(response.status(), StatusCode::BAD_REQUEST);
/// # }
/// ```
///
/// # Panics
///
/// If `name` is not a valid header name: a mistake in the code, not in a request.
pub fn header<N>(name: N, kind: impl Into<String>) -> HeaderKeys
where
    N: TryInto<HeaderName>,
    N::Error: fmt::Debug,
{
    let name = name
        .try_into()
        .unwrap_or_else(|e| panic!("keys::header needs a valid header name: {e:?}"));
    HeaderKeys {
        name,
        kind: kind.into().into(),
        required: false,
        list: false,
    }
}

/// The extractor [`header`] builds.
#[derive(Debug, Clone)]
pub struct HeaderKeys {
    name: HeaderName,
    kind: Arc<str>,
    required: bool,
    list: bool,
}

/// The whitespace HTTP allows around a field value and a list's elements (RFC 9110's `OWS`).
const OWS: [char; 2] = [' ', '\t'];

impl HeaderKeys {
    /// Refuses a request without the header with 400, instead of letting it run unlocked.
    pub fn required(mut self) -> Self {
        self.required = true;
        self
    }

    /// Reads each value as a comma-separated list (RFC 9110's `#element`), a key per
    /// element: `x-sku: a, b` locks `sku:a` and `sku:b`, as the two lines `x-sku: a` and
    /// `x-sku: b` do, so a proxy that folds them changes nothing. Spaces and tabs around an
    /// element are not part of it, and empty elements are skipped, as RFC 9110 asks; a
    /// value with no element is refused with 400. An id that contains a comma cannot be
    /// sent this way.
    ///
    /// ```
    /// use tower_batch_lock::keys;
    ///
    /// let skus = keys::header("x-sku", "sku").list().required();
    /// # drop(skus);
    /// ```
    pub fn list(mut self) -> Self {
        self.list = true;
        self
    }

    /// The keys of the header's values.
    ///
    /// # Errors
    ///
    /// 400 for an empty value, a value that is not UTF-8, or a missing header that is
    /// required.
    pub(crate) fn keys(&self, parts: &Parts) -> Result<Vec<String>, Rejection> {
        let name = &self.name;
        let mut keys = Vec::new();
        for value in parts.headers.get_all(name) {
            let Ok(text) = std::str::from_utf8(value.as_bytes()) else {
                return Err(bad_request(format!(
                    "the `{name}` header is not valid UTF-8"
                )));
            };
            let text = text.trim_matches(OWS);
            let before = keys.len();
            if self.list {
                let elements = text.split(',').map(|e| e.trim_matches(OWS));
                let named = elements.filter(|e| !e.is_empty());
                keys.extend(named.map(|e| format!("{}:{e}", self.kind)));
            } else if !text.is_empty() {
                keys.push(format!("{}:{text}", self.kind));
            }
            if keys.len() == before {
                return Err(bad_request(format!("the `{name}` header is empty")));
            }
        }
        if keys.is_empty() && self.required {
            return Err(bad_request(format!(
                "the request needs the `{name}` header"
            )));
        }
        Ok(keys)
    }
}

impl<B: Send + 'static> KeyExtractor<B> for HeaderKeys {
    type Future = Ready<Extracted<B>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let (parts, body) = request.into_parts();
        ready(match self.keys(&parts) {
            Ok(keys) => Ok((Request::from_parts(parts, body), exclusive(keys))),
            Err(rejection) => Err(rejection.into_response()),
        })
    }

    fn extract_now(&self, request: Request<B>) -> Result<Extracted<B>, Self::Future> {
        Ok(self.extract(request).into_inner())
    }
}

/// One key per value of the query parameter `name`: `{kind}:{value}`.
///
/// `keys::query("account", "account")` locks `account:1` and `account:2` for
/// `?account=1&account=2`. Names and values are decoded as HTML forms encode them (`%2F`
/// is `/`, `+` is a space; a `%` not followed by two hex digits stays as it is), and the
/// decoded value is the key, so `?sku=a%2Fb` and a JSON body's `"a/b"` lock the same key.
///
/// | request | answer |
/// | --- | --- |
/// | no such parameter | no key: the request runs unlocked (or is refused by [`Locks::require_keys`](crate::Locks::require_keys)), or 400 with [`QueryKeys::required`] |
/// | an empty value (`?account=`, `?account`) | 400 |
/// | a value that does not decode to UTF-8 (`?account=%FF`) | 400 |
///
/// Refusals are `application/problem+json` and name the parameter.
///
/// ```
/// use axum::{body::Body, routing::post, Extension, Router};
/// use axum::http::{Request, StatusCode};
/// use tower::ServiceExt;
/// use tower_batch_lock::{keys, Lease, LockLayer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let app = Router::new().route(
///     "/statements",
///     post(|Extension(lease): Extension<Lease>| async move {
///         lease.keys().collect::<Vec<_>>().join(" ")
///     })
///     .layer(LockLayer::new(keys::query("account", "account"))),
/// );
///
/// let request = Request::post("/statements?account=2&account=1&year=2024");
/// let response = app.oneshot(request.body(Body::empty()).unwrap()).await.unwrap();
/// let body = axum::body::to_bytes(response.into_body(), 64).await.unwrap();
/// assert_eq!(body, "account:1 account:2");
/// # }
/// ```
pub fn query(name: impl Into<String>, kind: impl Into<String>) -> QueryKeys {
    QueryKeys {
        name: name.into().into(),
        kind: kind.into().into(),
        required: false,
    }
}

/// The extractor [`query`] builds.
#[derive(Debug, Clone)]
pub struct QueryKeys {
    name: Arc<str>,
    kind: Arc<str>,
    required: bool,
}

impl QueryKeys {
    /// Refuses a request without the parameter with 400, instead of letting it run unlocked.
    pub fn required(mut self) -> Self {
        self.required = true;
        self
    }

    /// The keys of the parameter's values in `query` (the part of the URI after `?`).
    ///
    /// # Errors
    ///
    /// 400 for an empty value, a value that does not decode to UTF-8, or a missing
    /// parameter that is required.
    pub(crate) fn keys(&self, query: Option<&str>) -> Result<Vec<String>, Rejection> {
        let name = &*self.name;
        let mut keys = Vec::new();
        let pairs = query
            .unwrap_or_default()
            .split('&')
            .filter(|p| !p.is_empty());
        for pair in pairs {
            let (raw_name, raw_value) = pair.split_once('=').unwrap_or((pair, ""));
            if form_decode(raw_name) != name.as_bytes() {
                continue;
            }
            let Ok(value) = String::from_utf8(form_decode(raw_value)) else {
                return Err(bad_request(format!(
                    "the query parameter `{name}` is not valid UTF-8 once decoded"
                )));
            };
            if value.is_empty() {
                return Err(bad_request(format!(
                    "the query parameter `{name}` is empty"
                )));
            }
            keys.push(format!("{}:{value}", self.kind));
        }
        if keys.is_empty() && self.required {
            return Err(bad_request(format!(
                "the request needs the `{name}` query parameter"
            )));
        }
        Ok(keys)
    }
}

impl<B: Send + 'static> KeyExtractor<B> for QueryKeys {
    type Future = Ready<Extracted<B>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let (parts, body) = request.into_parts();
        ready(match self.keys(parts.uri.query()) {
            Ok(keys) => Ok((Request::from_parts(parts, body), exclusive(keys))),
            Err(rejection) => Err(rejection.into_response()),
        })
    }

    fn extract_now(&self, request: Request<B>) -> Result<Extracted<B>, Self::Future> {
        Ok(self.extract(request).into_inner())
    }
}

/// Decodes one name or value of `application/x-www-form-urlencoded` text into bytes: `+` is
/// a space, `%XY` the byte 0xXY, and anything else, a stray `%` included, itself. (The rules
/// of the URL standard, which browsers and `serde_urlencoded` follow.)
pub(crate) fn form_decode(text: &str) -> Vec<u8> {
    // The standard's order: `+` first, so that `%2B` stays a `+`. (`form_urlencoded` does
    // the same, but turns bytes that are not UTF-8 into U+FFFD, which would lock `%FF` and
    // `%FE` under one key where they must be refused.)
    let spaced = text.replace('+', " ");
    percent_encoding::percent_decode_str(&spaced).collect()
}

fn bad_request(detail: String) -> Rejection {
    Rejection::new(StatusCode::BAD_REQUEST, detail)
}

/// Keys read from the head, each held exclusively (unless the layer is shared).
fn exclusive(keys: Vec<String>) -> Vec<Key> {
    keys.into_iter().map(Key::from).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded(text: &str) -> Vec<u8> {
        form_decode(text)
    }

    #[test]
    fn form_decoding_follows_the_url_standard() {
        assert_eq!(decoded("a+b%20c"), b"a b c");
        assert_eq!(decoded("a%2Fb%2f"), b"a/b/");
        assert_eq!(decoded("%"), b"%");
        assert_eq!(decoded("%4"), b"%4");
        assert_eq!(decoded("%zz%41"), b"%zzA");
        assert_eq!(decoded("%+1"), b"% 1", "`+1` is not hex");
        assert_eq!(decoded("%FF%fe"), [0xff, 0xfe]);
        assert_eq!(decoded("é%C3%A9"), "éé".as_bytes());
        assert_eq!(decoded("%%41"), b"%A");
    }

    fn header_keys(extractor: HeaderKeys, values: &[&str]) -> Result<Vec<String>, String> {
        let mut request = Request::builder();
        for value in values {
            request = request.header("x-sku", *value);
        }
        let (parts, ()) = request.body(()).unwrap().into_parts();
        extractor.keys(&parts).map_err(|r| r.detail().to_owned())
    }

    #[test]
    fn a_header_read_as_a_list_locks_the_same_keys_folded_or_not() {
        let list = || header("x-sku", "sku").list();
        let folded = header_keys(list(), &["a, b,\tc"]).unwrap();
        assert_eq!(folded, ["sku:a", "sku:b", "sku:c"]);
        assert_eq!(header_keys(list(), &["a", "b ", " c"]).unwrap(), folded);
        assert_eq!(header_keys(list(), &[" ,a,, b,c, "]).unwrap(), folded);
        assert!(header_keys(list(), &[" , ,"])
            .unwrap_err()
            .contains("empty"));
        // Not a list: one value, one key, byte for byte.
        let plain = header_keys(header("x-sku", "sku"), &["a, b"]).unwrap();
        assert_eq!(plain, ["sku:a, b"]);
    }

    fn query_keys(query: &str) -> Result<Vec<String>, String> {
        super::query("id", "order")
            .keys(Some(query))
            .map_err(|r| r.detail().to_owned())
    }

    #[test]
    fn every_value_of_the_parameter_is_a_key() {
        assert_eq!(
            query_keys("id=1&x=2&id=a%2Fb&&i%64=+c+").unwrap(),
            ["order:1", "order:a/b", "order: c "]
        );
        assert_eq!(query_keys("ids=1&xid=2").unwrap(), Vec::<String>::new());
        assert_eq!(
            super::query("id", "order").keys(None).unwrap(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn empty_and_undecodable_values_are_refused() {
        assert_eq!(
            query_keys("id=").unwrap_err(),
            "the query parameter `id` is empty"
        );
        assert_eq!(
            query_keys("x=1&id").unwrap_err(),
            "the query parameter `id` is empty"
        );
        assert_eq!(
            query_keys("id=%FF").unwrap_err(),
            "the query parameter `id` is not valid UTF-8 once decoded"
        );
        // Another parameter's bad encoding is not this extractor's business.
        assert_eq!(query_keys("x=%FF&id=1").unwrap(), ["order:1"]);
    }

    #[test]
    fn a_required_parameter_must_be_there() {
        let required = super::query("id", "order").required();
        let refused = required.keys(Some("x=1")).unwrap_err();
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            refused.detail(),
            "the request needs the `id` query parameter"
        );
    }

    fn head(headers: &[(&str, &[u8])]) -> Parts {
        let mut request = Request::builder();
        for (name, value) in headers {
            request = request.header(*name, http::HeaderValue::from_bytes(value).unwrap());
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn every_value_of_the_header_is_a_key_as_sent() {
        let keys = header("idempotency-key", "idem");
        let parts = head(&[
            ("idempotency-key", b" a {b} c\t"),
            ("Idempotency-Key", "é€".as_bytes()),
            ("other", b"x"),
        ]);
        assert_eq!(keys.keys(&parts).unwrap(), ["idem:a {b} c", "idem:é€"]);
        assert_eq!(keys.keys(&head(&[])).unwrap(), Vec::<String>::new());
    }

    #[test]
    fn empty_non_utf8_and_missing_required_headers_are_refused() {
        let keys = header("idempotency-key", "idem");
        let text = |parts: &Parts| keys.keys(parts).unwrap_err().detail().to_owned();
        assert_eq!(
            text(&head(&[("idempotency-key", b" ")])),
            "the `idempotency-key` header is empty"
        );
        assert_eq!(
            text(&head(&[("idempotency-key", &[b'a', 0xff])])),
            "the `idempotency-key` header is not valid UTF-8"
        );
        let required = keys.clone().required();
        assert_eq!(
            required.keys(&head(&[])).unwrap_err().detail(),
            "the request needs the `idempotency-key` header"
        );
    }

    #[test]
    #[should_panic(expected = "keys::header needs a valid header name")]
    fn an_invalid_header_name_is_a_panic_at_start_up() {
        let _ = header("not a header", "x");
    }
}

/// The property over query strings and their decoding, with random queries and values; the
/// other properties, which drive the public API, are in `tests/it/fuzz.rs`, whose
/// documentation says how to run them for longer (`FUZZ_SECS`).
#[cfg(test)]
mod fuzz {
    use proptest::{collection::vec, prelude::*};

    use super::*;
    use crate::keys::normalize::fuzz::{check, key};

    /// Percent-encodes `text` the way a client might: some characters as they are, some
    /// escaped, spaces as `+` or `%20`.
    fn encode(text: &str, choices: &[bool]) -> String {
        let mut encoded = String::new();
        let mut choice = choices.iter().cycle();
        for (i, ch) in text.char_indices() {
            let escape = *choice.next().unwrap_or(&true);
            match ch {
                ' ' if escape => encoded.push('+'),
                'a'..='z' | 'A'..='Z' | '0'..='9' | '-' | '.' | '_' | '~' if !escape => {
                    encoded.push(ch)
                }
                _ => {
                    for byte in text[i..i + ch.len_utf8()].bytes() {
                        encoded.push_str(&format!("%{byte:02X}"));
                    }
                }
            }
        }
        encoded
    }

    #[test]
    fn query_keys_decode_any_query_and_round_trip_any_value() {
        // Any query string at all: no panic, and every key is the kind and a decoded value.
        check("query: any", 512, any::<String>(), |query| {
            let extractor = super::query("id", "order");
            match extractor.keys(Some(&query)) {
                Ok(found) => {
                    for key in found {
                        prop_assert!(key.len() > "order:".len() && key.starts_with("order:"));
                    }
                }
                Err(rejection) => prop_assert_eq!(rejection.status(), StatusCode::BAD_REQUEST),
            }
            Ok(())
        });
        // Any value, however encoded, comes back as itself.
        let strategy = (vec(key(), 1..4), vec(any::<bool>(), 1..8));
        check("query: round trip", 512, strategy, |(values, choices)| {
            let query: Vec<String> = values
                .iter()
                .map(|v| format!("x=1&id={}", encode(v, &choices)))
                .collect();
            let found = super::query("id", "order").keys(Some(&query.join("&")));
            if values.iter().any(String::is_empty) {
                prop_assert!(found.is_err());
            } else {
                let expected: Vec<String> = values.iter().map(|v| format!("order:{v}")).collect();
                prop_assert_eq!(found.ok(), Some(expected));
            }
            for value in &values {
                prop_assert_eq!(form_decode(&encode(value, &choices)), value.as_bytes());
            }
            Ok(())
        });
    }
}
