//! Reading a request body under a size cap, for the extractors that need the body.

use bytes::Bytes;
use http::{header, HeaderMap, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::rejection::Rejection;

/// How much of a body [`json`](super::json) and [`from_request`](super::from_request) read
/// by default before they refuse the request: 2 MiB.
pub const DEFAULT_BODY_LIMIT: usize = 2 * 1024 * 1024;

/// Reads all of `body`, refusing it with 413 as soon as it is known to pass `limit` bytes.
///
/// Three checks, cheapest first: the declared `Content-Length`, the body's own size hint
/// (exact for a body built from bytes, and hyper's for a request with a length), and the
/// bytes as they arrive. The last one is what counts for a chunked body without a length:
/// [`Limited`] stops at the frame that passes the limit, so the rest of an endless body is
/// never read, let alone kept.
///
/// # Errors
///
/// 413 for a body over `limit`; 400 for a body that fails while it is read (a client that
/// went away half-way, a broken chunked encoding).
pub(crate) async fn read_capped<B>(
    headers: &HeaderMap,
    body: B,
    limit: usize,
) -> Result<Bytes, Rejection>
where
    B: Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let too_large = || {
        Rejection::limit(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_limit",
            format!("the request body is larger than the limit of {limit} bytes"),
        )
    };
    // `limit as u64` never truncates: usize is at most 64 bits on every supported target.
    let limit_u64 = limit as u64;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit_u64) || body.size_hint().lower() > limit_u64 {
        return Err(too_large());
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(too_large()),
        Err(e) => {
            tracing::debug!(error = %e, "could not read the request body");
            Err(Rejection::new(
                StatusCode::BAD_REQUEST,
                "the request body could not be read to its end",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http_body_util::{Full, StreamBody};

    use super::*;

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(future)
    }

    #[test]
    fn reads_a_body_up_to_the_limit_exactly() {
        let body = Full::new(Bytes::from_static(b"0123456789"));
        let bytes = block_on(read_capped(&HeaderMap::new(), body, 10)).unwrap();
        assert_eq!(bytes, "0123456789");
    }

    #[test]
    fn refuses_by_the_size_hint_before_reading() {
        let body = Full::new(Bytes::from_static(b"0123456789"));
        let refused = block_on(read_capped(&HeaderMap::new(), body, 9)).unwrap_err();
        assert_eq!(refused.status(), StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn refuses_a_stream_without_a_length_at_the_frame_that_passes_the_limit() {
        let frames = (0..100)
            .map(|_| Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(b"xxxx"))));
        let body = StreamBody::new(futures_util::stream::iter(frames));
        let refused = block_on(read_capped(&HeaderMap::new(), body, 10)).unwrap_err();
        assert_eq!(refused.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            refused.detail(),
            "the request body is larger than the limit of 10 bytes"
        );
    }

    #[test]
    fn trusts_a_declared_length_only_to_refuse() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, "11".parse().unwrap());
        let body = Full::new(Bytes::from_static(b"small"));
        let refused = block_on(read_capped(&headers, body, 10)).unwrap_err();
        assert_eq!(refused.status(), StatusCode::PAYLOAD_TOO_LARGE);

        // A length that understates the body does not let more than the limit through.
        headers.insert(header::CONTENT_LENGTH, "1".parse().unwrap());
        let frames = (0..100)
            .map(|_| Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(b"xxxx"))));
        let body = StreamBody::new(futures_util::stream::iter(frames));
        let refused = block_on(read_capped(&headers, body, 10)).unwrap_err();
        assert_eq!(refused.status(), StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn a_body_that_fails_half_way_is_a_400() {
        let frames = vec![
            Ok(http_body::Frame::data(Bytes::from_static(b"{\"a\""))),
            Err(std::io::Error::other("connection reset")),
        ];
        let body = StreamBody::new(futures_util::stream::iter(frames));
        let refused = block_on(read_capped(&HeaderMap::new(), body, 100)).unwrap_err();
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    }
}
