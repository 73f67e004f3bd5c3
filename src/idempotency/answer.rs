//! The stored answer: what is kept of a response, in the store's bytes, and its replay.

use axum::{body::Body, response::Response};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{header, response::Parts, HeaderMap, HeaderName, HeaderValue, StatusCode};
use sha2::{Digest, Sha256};

use super::refusals;

/// What makes two requests with one key the same request: a SHA-256 digest.
pub(super) type Fingerprint = [u8; 32];

/// The response header that marks a replayed answer (Stripe's name for it).
pub(crate) const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Version 1 of the layout below. A later layout takes another tag, and this version
/// reads it as no answer it knows.
const TAG: &[u8; 4] = b"TBI1";

/// What is kept of the first response to a key, with the request's fingerprint.
///
/// Stored as: the tag, the fingerprint, the status (u16), whether the body was kept (u8),
/// the number of headers (u16), each header as name length (u16), name, value length
/// (u32), value; then the body to the end. Lengths are big-endian.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Answer {
    pub(super) fingerprint: Fingerprint,
    pub(super) status: StatusCode,
    pub(super) headers: HeaderMap,
    /// The body, byte for byte; `None` when it was larger than the layer keeps.
    pub(super) body: Option<Bytes>,
}

impl Answer {
    /// What a replay needs of a response: its status and the headers that describe the
    /// answer rather than the connection or the moment it was sent. `Set-Cookie` only
    /// with `cookies`: where keys are not scoped to a client, another client may send the
    /// same key and request, and must not get the first one's session.
    pub(super) fn of(
        fingerprint: Fingerprint,
        parts: &Parts,
        body: Option<Bytes>,
        cookies: bool,
    ) -> Self {
        let mut headers = parts.headers.clone();
        // Headers that `Connection` names are the connection's too (RFC 9110, 7.6.1).
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect();
        for name in NOT_KEPT.iter().chain(&named) {
            headers.remove(name);
        }
        if !cookies {
            headers.remove(header::SET_COOKIE);
        }
        Self {
            fingerprint,
            status: parts.status,
            headers,
            body,
        }
    }

    pub(super) fn encode(&self) -> Bytes {
        let body = self.body.as_deref().unwrap_or_default();
        let mut out = BytesMut::with_capacity(64 + body.len());
        out.put_slice(TAG);
        out.put_slice(&self.fingerprint);
        out.put_u16(self.status.as_u16());
        out.put_u8(u8::from(self.body.is_some()));
        // Counts and lengths fit: http caps a map's entries and a header's size far below.
        out.put_u16(self.headers.len() as u16);
        for (name, value) in &self.headers {
            out.put_u16(name.as_str().len() as u16);
            out.put_slice(name.as_str().as_bytes());
            out.put_u32(value.len() as u32);
            out.put_slice(value.as_bytes());
        }
        out.put_slice(body);
        out.freeze()
    }

    /// The answer in `bytes`, or `None` when they are not one this version wrote.
    pub(super) fn decode(mut bytes: Bytes) -> Option<Self> {
        if bytes.len() < TAG.len() + 32 + 5 || !bytes.starts_with(TAG) {
            return None;
        }
        bytes.advance(TAG.len());
        let mut fingerprint = [0; 32];
        bytes.copy_to_slice(&mut fingerprint);
        let status = StatusCode::from_u16(bytes.get_u16()).ok()?;
        let kept = bytes.get_u8() == 1;
        let count = bytes.get_u16();
        // Grown as the bytes prove out, not sized by a count they claim.
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let length = bytes.try_get_u16().ok()?.into();
            let name = take(&mut bytes, length)?;
            let length = bytes.try_get_u32().ok()?.try_into().ok()?;
            let value = take(&mut bytes, length)?;
            let name = HeaderName::from_bytes(&name).ok()?;
            let value = HeaderValue::from_maybe_shared(value).ok()?;
            headers.try_append(name, value).ok()?;
        }
        Some(Self {
            fingerprint,
            status,
            headers,
            body: kept.then_some(bytes),
        })
    }

    /// The stored answer as a response, marked as a replay. An answer whose body was not
    /// kept is refused instead: the layer cannot give it again, and running the request
    /// again is what the key is there to prevent.
    pub(super) fn replay(self) -> Response {
        let Some(body) = self.body else {
            return refusals::too_large_to_replay(self.status);
        };
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers;
        response
            .headers_mut()
            .insert(REPLAYED, HeaderValue::from_static("true"));
        response
    }
}

/// Headers of the connection or of the moment, not of the answer. `Content-Length` is
/// set again from the replayed body.
const NOT_KEPT: [HeaderName; 8] = [
    header::CONNECTION,
    header::CONTENT_LENGTH,
    header::DATE,
    HeaderName::from_static("keep-alive"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn take(bytes: &mut Bytes, length: usize) -> Option<Bytes> {
    (bytes.remaining() >= length).then(|| bytes.split_to(length))
}

/// The digest of what makes a request the same request: its method, its path, and
/// `content` (by default its query and body). Each part goes in with its length, so that
/// no two different requests feed the same bytes.
pub(super) fn fingerprint(method: &http::Method, path: &str, content: &[&[u8]]) -> Fingerprint {
    let mut digest = Sha256::new();
    let parts = [method.as_str().as_bytes(), path.as_bytes()];
    for part in parts.iter().chain(content) {
        digest.update((part.len() as u64).to_be_bytes());
        digest.update(part);
    }
    digest.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(body: Option<&'static [u8]>) -> Answer {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        headers.append(header::SET_COOKIE, "a=1".parse().unwrap());
        headers.append(header::SET_COOKIE, "b=2".parse().unwrap());
        headers.insert(
            "x-binary",
            HeaderValue::from_bytes(b"\xff\x80 obs-text").unwrap(),
        );
        Answer {
            fingerprint: fingerprint(&http::Method::POST, "/orders", &[b"q", b"{}"]),
            status: StatusCode::CREATED,
            headers,
            body: body.map(Bytes::from_static),
        }
    }

    #[test]
    fn an_answer_comes_back_whole_from_its_bytes() {
        for body in [Some(&b"{\"id\":1}\x00\xff"[..]), Some(&b""[..]), None] {
            let answer = answer(body);
            assert_eq!(Answer::decode(answer.encode()), Some(answer));
        }
    }

    #[test]
    fn a_replay_keeps_no_header_of_the_connection_and_no_cookie_unless_scoped() {
        let response = http::Response::builder()
            .status(StatusCode::CREATED)
            .header(header::CONNECTION, "x-hop, keep-alive")
            .header("x-hop", "1")
            .header("keep-alive", "timeout=5")
            .header(header::DATE, "Sun, 22 Nov 2026 18:00:00 GMT")
            .header(header::CONTENT_LENGTH, "2")
            .header(header::SET_COOKIE, "session=1")
            .header(header::LOCATION, "/orders/1")
            .body(())
            .unwrap();
        let (parts, ()) = response.into_parts();
        let kept = |cookies| {
            let answer = Answer::of([0; 32], &parts, None, cookies);
            let mut names: Vec<&str> = answer.headers.keys().map(|n| n.as_str()).collect();
            names.sort_unstable();
            names.iter().map(|n| n.to_string()).collect::<Vec<_>>()
        };
        assert_eq!(kept(false), ["location"]);
        assert_eq!(kept(true), ["location", "set-cookie"]);
    }

    proptest::proptest! {
        /// Whatever the store holds under an answer's key, reading it never panics.
        #[test]
        fn decoding_any_bytes_never_panics(
            rest in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            tagged in proptest::prelude::any::<bool>(),
        ) {
            let mut bytes = if tagged { TAG.to_vec() } else { Vec::new() };
            bytes.extend(rest);
            let _ = Answer::decode(Bytes::from(bytes));
        }
    }

    #[test]
    fn a_header_count_past_what_a_map_holds_decodes_to_none() {
        let mut bytes = BytesMut::from(&TAG[..]);
        bytes.put_slice(&[0; 32]);
        bytes.put_u16(200);
        bytes.put_u8(1);
        bytes.put_u16(u16::MAX);
        assert_eq!(Answer::decode(bytes.freeze()), None);
    }

    #[test]
    fn bytes_that_are_no_answer_of_this_version_decode_to_none() {
        let bytes = answer(Some(b"body")).encode();
        assert_eq!(Answer::decode(Bytes::from_static(b"")), None);
        assert_eq!(Answer::decode(Bytes::from_static(b"lock-value")), None);
        // Cut inside the headers.
        assert_eq!(Answer::decode(bytes.slice(..50)), None);
        let mut other = BytesMut::from(&bytes[..]);
        other[3] = b'9';
        assert_eq!(Answer::decode(other.freeze()), None);
    }

    #[test]
    fn fingerprints_tell_apart_the_parts_of_a_request() {
        let post = http::Method::POST;
        let base = fingerprint(&post, "/orders", &[b"", b"{}"]);
        assert_eq!(base, fingerprint(&post, "/orders", &[b"", b"{}"]));
        assert_ne!(
            base,
            fingerprint(&http::Method::PUT, "/orders", &[b"", b"{}"])
        );
        assert_ne!(base, fingerprint(&post, "/orders/", &[b"", b"{}"]));
        assert_ne!(base, fingerprint(&post, "/orders", &[b"", b"{ }"]));
        // The same bytes split differently are another request.
        assert_ne!(
            fingerprint(&post, "/a", &[b"b", b""]),
            fingerprint(&post, "/a", &[b"", b"b"])
        );
    }
}
