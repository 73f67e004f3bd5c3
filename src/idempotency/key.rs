//! Reading the `Idempotency-Key` header.

use std::convert::Infallible;

use http::{HeaderMap, StatusCode};
use sfv::{visitor::Ignored, BareItemFromInput, Parser};

use crate::rejection::Rejection;

/// The header's name, as the draft gives it.
pub(super) const HEADER: &str = "idempotency-key";

/// The key a request sent: `Ok(None)` when it sent none.
///
/// The draft makes the field a Structured Field string (`Idempotency-Key: "8e03..."`,
/// RFC 9651); many clients (Stripe's among them) send the bare value instead
/// (`Idempotency-Key: 8e03...`), and a bare value of visible ASCII without quotes is taken
/// as the same key. Parameters after the string are ignored, as the RFC asks of parameters
/// a recipient does not know.
///
/// # Errors
///
/// 400 for a header sent twice, one that is neither form, an empty key, or a key longer
/// than `max_len` bytes.
pub(super) fn read(headers: &HeaderMap, max_len: usize) -> Result<Option<String>, Rejection> {
    let mut values = headers.get_all(HEADER).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(bad("send one Idempotency-Key header, not several"));
    }
    let value = value.as_bytes();
    let key = structured_string(value)
        .or_else(|| bare(value))
        .ok_or_else(|| {
            bad("the Idempotency-Key header must be a string such as \
                 \"8e03978e-40d5-43e8-bc93-6894a57f9324\" (quoted, or without quotes)")
        })?;
    if key.is_empty() {
        return Err(bad("the Idempotency-Key header is empty"));
    }
    if key.len() > max_len {
        return Err(Rejection::limit(
            StatusCode::BAD_REQUEST,
            "idempotency_key_length",
            format!("the Idempotency-Key is longer than the limit of {max_len} bytes"),
        ));
    }
    Ok(Some(key))
}

/// The string of a Structured Field item, if the value is one.
fn structured_string(value: &[u8]) -> Option<String> {
    let mut string = None;
    Parser::new(value)
        .parse_item_with_visitor(|item: BareItemFromInput<'_>| {
            string = item.as_string().map(|s| s.as_str().to_owned());
            Ok::<_, Infallible>(Ignored)
        })
        .ok()?;
    string
}

/// A bare key: visible ASCII, no quotes, no spaces.
fn bare(value: &[u8]) -> Option<String> {
    let visible = |b: &u8| (0x21..=0x7e).contains(b) && *b != b'"';
    value
        .iter()
        .all(visible)
        .then(|| String::from_utf8_lossy(value).into_owned())
}

fn bad(detail: &'static str) -> Rejection {
    Rejection::new(StatusCode::BAD_REQUEST, detail)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn key(values: &[&[u8]]) -> Result<Option<String>, u16> {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(HEADER, HeaderValue::from_bytes(value).unwrap());
        }
        read(&headers, 16).map_err(|r| r.status().as_u16())
    }

    #[test]
    fn reads_structured_strings_and_bare_values() {
        assert_eq!(key(&[]), Ok(None));
        assert_eq!(key(&[b"\"abc-1\""]), Ok(Some("abc-1".into())));
        assert_eq!(key(&[b"abc-1"]), Ok(Some("abc-1".into())));
        // One key, either way it is sent.
        assert_eq!(key(&[b"8e03978e"]), key(&[b"\"8e03978e\""]));
        // Escapes and parameters, as RFC 9651 has them.
        assert_eq!(key(&[br#""a\"b\\c";v=1"#]), Ok(Some(r#"a"b\c"#.into())));
    }

    #[test]
    fn refuses_what_is_no_key() {
        assert_eq!(key(&[b"\"\""]), Err(400));
        assert_eq!(key(&[b"\"a\"", b"\"b\""]), Err(400));
        assert_eq!(key(&[b"a b"]), Err(400));
        assert_eq!(key(&[b"\"open"]), Err(400));
        assert_eq!(key(&[b"\"\xc3\xa9\""]), Err(400));
        assert_eq!(
            key(&[b"0123456789abcdef"]),
            Ok(Some("0123456789abcdef".into()))
        );
        assert_eq!(key(&[b"0123456789abcdefg"]), Err(400));
    }
}
