//! Property tests over everything a client controls on the way to a key, through the
//! public API: the header extractor, the body extractors, and the whole layer. (The
//! properties of normalization and of query decoding test crate internals: they are unit
//! tests in `src/keys/normalize.rs` and `src/keys/head.rs`, each in a `fuzz` module.)
//!
//! Each property runs a bounded number of random cases in `cargo test` (a few seconds in
//! all). For a long run, give each property a time budget in seconds: the first command
//! runs these, the second the two unit tests (without `--test` or `--lib`, one command
//! runs all five).
//!
//! ```text
//! FUZZ_SECS=300 cargo test --release --all-features --test it fuzz -- --test-threads 2 --nocapture
//! FUZZ_SECS=300 cargo test --release --all-features --lib fuzz -- --test-threads 2 --nocapture
//! ```
//!
//! A failure prints the smallest input proptest could shrink it to; `PROPTEST_RNG_SEED`
//! makes a run repeatable.

use std::{
    convert::Infallible,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};
use tower_batch_lock::store::Store;

use axum::{body::Body, routing::post, Extension, Router};
use bytes::Bytes;
use futures_util::FutureExt;
use http::{header, HeaderValue, Request, StatusCode};
use proptest::{
    collection::vec,
    prelude::*,
    test_runner::{Config, TestCaseError, TestRunner},
};
use tower::ServiceExt;
use tower_batch_lock::{
    keys::{self, KeyExtractor},
    Lease, Locks,
};

/// Runs `test` over `strategy`: `cases` cases, or batches of them until `FUZZ_SECS` have
/// passed.
fn check<S>(
    name: &str,
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S: Strategy,
    S::Value: std::fmt::Debug,
{
    let budget = std::env::var("FUZZ_SECS")
        .ok()
        .map(|secs| Duration::from_secs(secs.parse().expect("FUZZ_SECS is a number of seconds")));
    let started = Instant::now();
    let mut ran = 0u64;
    loop {
        let mut runner = TestRunner::new(Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        });
        if let Err(failure) = runner.run(&strategy, &test) {
            panic!("{name}: {failure}");
        }
        ran += u64::from(cases);
        if budget.is_none_or(|budget| started.elapsed() >= budget) {
            break;
        }
    }
    eprintln!(
        "{name}: {ran} cases in {:.1?}, no failure",
        started.elapsed()
    );
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a Tokio runtime")
}

/// Keys as clients send them: any Unicode at all, or a few characters that collide,
/// repeat and stress the store (braces, spaces, newlines, globs, non-ASCII).
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[ab{}: \n\t*?\"\\\\é€\u{0}]{0,6}",
        "[a-z]{0,12}",
    ]
}

#[test]
fn header_keys_take_any_header_value_as_sent_or_refuse_it() {
    // Mostly bytes a header value may hold (visible ASCII, spaces, tabs, `obs-text`), some
    // that it may not.
    let byte = prop_oneof![
        8 => 0x20u8..0x7f,
        2 => 0x80u8..=0xff,
        1 => Just(b'\t'),
        1 => any::<u8>(),
    ];
    check("header", 512, vec(byte, 0..24), |bytes| {
        let Ok(value) = HeaderValue::from_bytes(&bytes) else {
            return Ok(()); // not a header value: hyper would never hand it over
        };
        let request = Request::builder()
            .header("idempotency-key", value)
            .body(())
            .unwrap();
        let found = keys::header("idempotency-key", "idem")
            .extract(request)
            .now_or_never()
            .expect("the header extractor answers at once")
            .map(|(_, keys)| keys);
        let text = std::str::from_utf8(&bytes).map(|t| t.trim_matches([' ', '\t']));
        match (text, found) {
            (Ok(text), Ok(found)) if !text.is_empty() => {
                prop_assert_eq!(found, vec![keys::Key::from(format!("idem:{text}"))]);
            }
            (_, Err(rejection)) => prop_assert_eq!(rejection.status(), StatusCode::BAD_REQUEST),
            (text, found) => prop_assert!(false, "{text:?} gave {found:?}"),
        }
        Ok(())
    });
}

/// A request body as a client may send it: its bytes, in which chunks, what its
/// `Content-Length` says, and its content type.
#[derive(Debug, Clone)]
struct SentBody {
    bytes: Vec<u8>,
    chunk: usize,
    declared: Declared,
    content_type: &'static str,
    limit: usize,
}

#[derive(Debug, Clone, Copy)]
enum Declared {
    /// No `Content-Length`, and no size hint: chunked.
    Nothing,
    /// The true length.
    Truly,
    /// A length off by this much (a lying or broken client).
    Off(i64),
}

/// JSON-ish text: valid values, truncated ones, deep nesting, and raw bytes.
fn json_ish() -> impl Strategy<Value = Vec<u8>> {
    let leaf = prop_oneof![
        Just("null".to_owned()),
        any::<i64>().prop_map(|n| n.to_string()),
        key().prop_map(|k| serde_json::Value::String(k).to_string()),
    ];
    let value = leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(|items| format!("[{}]", items.join(","))),
            vec((key(), inner), 0..6).prop_map(|fields| {
                let fields: Vec<String> = fields
                    .into_iter()
                    .map(|(k, v)| format!("{}:{v}", serde_json::Value::String(k)))
                    .collect();
                format!("{{{}}}", fields.join(","))
            }),
        ]
    });
    prop_oneof![
        value.clone().prop_map(String::into_bytes),
        (value, any::<prop::sample::Index>()).prop_map(|(text, cut)| {
            let mut bytes = text.into_bytes();
            bytes.truncate(cut.index(bytes.len() + 1));
            bytes
        }),
        (1usize..400).prop_map(|depth| "[".repeat(depth).into_bytes()),
        (1usize..200)
            .prop_map(|depth| format!("{}1{}", "[".repeat(depth), "]".repeat(depth)).into_bytes()),
        vec(any::<u8>(), 0..300),
    ]
}

fn sent_body() -> impl Strategy<Value = SentBody> {
    let declared = prop_oneof![
        Just(Declared::Nothing),
        Just(Declared::Truly),
        (-50i64..50).prop_map(Declared::Off),
    ];
    let content_type = prop::sample::select(vec![
        "application/json",
        "application/json; charset=utf-8",
        "application/merge-patch+json",
        "text/plain",
        "",
    ]);
    (json_ish(), 1usize..64, declared, content_type, 0usize..400).prop_map(
        |(bytes, chunk, declared, content_type, limit)| SentBody {
            bytes,
            chunk,
            declared,
            content_type,
            limit,
        },
    )
}

impl SentBody {
    /// The request, and a count of the body bytes the server pulled from it.
    fn request(&self) -> (Request<Body>, Arc<AtomicUsize>) {
        let pulled = Arc::new(AtomicUsize::new(0));
        let counter = pulled.clone();
        let chunks: Vec<Bytes> = self
            .bytes
            .chunks(self.chunk)
            .map(Bytes::copy_from_slice)
            .collect();
        // A stream has no size hint, as a chunked request's body has none.
        let stream = futures_util::stream::iter(chunks.into_iter().map(move |chunk| {
            counter.fetch_add(chunk.len(), Ordering::Relaxed);
            Ok::<_, Infallible>(chunk)
        }));
        let mut request = Request::post("/").body(Body::from_stream(stream)).unwrap();
        let headers = request.headers_mut();
        if !self.content_type.is_empty() {
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(self.content_type),
            );
        }
        let length = match self.declared {
            Declared::Nothing => None,
            Declared::Truly => Some(self.bytes.len() as i64),
            Declared::Off(by) => Some((self.bytes.len() as i64 + by).max(0)),
        };
        if let Some(length) = length {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
        }
        (request, pulled)
    }

    fn is_json(&self) -> bool {
        self.content_type.starts_with("application/") && self.content_type.contains("json")
    }

    /// Whether the client says or shows that the body is over the limit.
    fn over_limit(&self) -> bool {
        let declared_over = match self.declared {
            Declared::Nothing => false,
            Declared::Truly => self.bytes.len() > self.limit,
            Declared::Off(by) => self.bytes.len() as i64 + by > self.limit as i64,
        };
        declared_over || self.bytes.len() > self.limit
    }
}

/// The body a body extractor handed on, or its refusal's status.
async fn outcome<E: KeyExtractor<Body>>(
    extractor: &E,
    request: Request<Body>,
) -> Result<(Bytes, Vec<String>), StatusCode> {
    match extractor.extract(request).await {
        Ok((request, keys)) => {
            let body = axum::body::to_bytes(request.into_body(), usize::MAX)
                .await
                .expect("a body handed on is readable");
            Ok((body, keys.iter().map(|k| k.name().to_owned()).collect()))
        }
        Err(response) => Err(response.status()),
    }
}

/// Every string in a JSON value, as keys: the widest use of a body a key extractor makes.
fn strings(value: serde_json::Value) -> Vec<String> {
    match value {
        serde_json::Value::String(s) => vec![s],
        serde_json::Value::Array(items) => items.into_iter().flat_map(strings).collect(),
        serde_json::Value::Object(fields) => fields
            .into_iter()
            .flat_map(|(k, v)| std::iter::once(k).chain(strings(v)))
            .collect(),
        _ => Vec::new(),
    }
}

#[test]
fn body_extractors_hand_on_the_bytes_or_refuse_within_the_cap() {
    let runtime = runtime();
    check("body", 384, sent_body(), |sent| {
        runtime.block_on(async {
            // The JSON extractor: problem+json refusals of its own.
            let json = keys::json(strings).limit(sent.limit);
            let (request, pulled) = sent.request();
            let answer = outcome(&json, request).await;
            // The rest of an over-long body is never read: at most one chunk past the cap.
            prop_assert!(pulled.load(Ordering::Relaxed) <= sent.limit + sent.chunk);
            match &answer {
                Ok((body, keys)) => {
                    prop_assert!(sent.is_json() && !sent.over_limit());
                    prop_assert_eq!(&body[..], &sent.bytes[..]);
                    let value: serde_json::Value = serde_json::from_slice(&sent.bytes).unwrap();
                    prop_assert_eq!(keys, &strings(value));
                }
                Err(status) if !sent.is_json() => {
                    prop_assert_eq!(*status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
                }
                Err(status) if sent.over_limit() => {
                    prop_assert_eq!(*status, StatusCode::PAYLOAD_TOO_LARGE);
                }
                Err(status) => {
                    prop_assert!(serde_json::from_slice::<serde_json::Value>(&sent.bytes).is_err());
                    prop_assert_eq!(*status, StatusCode::BAD_REQUEST);
                }
            }
            // The same request, the same answer.
            let (request, _) = sent.request();
            prop_assert_eq!(&outcome(&json, request).await, &answer);

            // The generic adapter over `Bytes` and over axum's `Json`: the same cap, the
            // same bytes handed on, the extractor's own refusals.
            let raw =
                keys::from_request(|bytes: Bytes| [format!("{}", bytes.len())]).limit(sent.limit);
            let (request, pulled) = sent.request();
            let answer = outcome(&raw, request).await;
            prop_assert!(pulled.load(Ordering::Relaxed) <= sent.limit + sent.chunk);
            if sent.over_limit() {
                prop_assert_eq!(answer, Err(StatusCode::PAYLOAD_TOO_LARGE));
            } else {
                let keys = vec![sent.bytes.len().to_string()];
                prop_assert_eq!(answer, Ok((Bytes::from(sent.bytes.clone()), keys)));
            }

            let typed = keys::from_request(|axum::Json(value): axum::Json<serde_json::Value>| {
                strings(value)
            })
            .limit(sent.limit);
            let (request, _) = sent.request();
            match outcome(&typed, request).await {
                Ok((body, _)) => prop_assert_eq!(&body[..], &sent.bytes[..]),
                Err(status) => prop_assert!(status.is_client_error(), "{status}"),
            }
            Ok(())
        })
    });
}

#[test]
fn the_layer_answers_every_key_list_and_leaves_nothing_locked() {
    let runtime = runtime();
    let locks = Locks::new(Store::isolated_memory())
        .max_keys(8)
        .max_key_len(12);
    let app = Router::new().route(
        "/",
        post(|Extension(lease): Extension<Lease>| async move {
            serde_json::to_string(&lease.keys().collect::<Vec<_>>()).unwrap()
        })
        .layer(locks.layer(keys::json(|keys: Vec<String>| keys))),
    );
    check("layer", 256, vec(key(), 1..12), |keys| {
        runtime.block_on(async {
            let body = serde_json::to_vec(&keys).unwrap();
            let mut statuses = Vec::new();
            // Twice: a key left locked by the first would make the second a 409.
            for _ in 0..2 {
                let request = Request::post("/")
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Body::from(body.clone()))
                    .unwrap();
                let response = app.clone().oneshot(request).await.unwrap();
                let status = response.status();
                let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
                let answer = axum::body::to_bytes(response.into_body(), usize::MAX)
                    .await
                    .unwrap();
                let mut distinct = keys.clone();
                distinct.sort();
                distinct.dedup();
                let valid = distinct.len() <= 8
                    && distinct
                        .iter()
                        .all(|k| !k.is_empty() && !k.contains('\0') && k.len() <= 12);
                if valid {
                    prop_assert_eq!(status, StatusCode::OK);
                    let locked: Vec<String> = serde_json::from_slice(&answer).unwrap();
                    prop_assert_eq!(locked, distinct);
                } else {
                    prop_assert!(
                        status == StatusCode::BAD_REQUEST
                            || status == StatusCode::PAYLOAD_TOO_LARGE
                    );
                    prop_assert_eq!(content_type.unwrap(), "application/problem+json");
                    let problem: serde_json::Value = serde_json::from_slice(&answer).unwrap();
                    prop_assert!(problem["detail"].as_str().is_some_and(|d| d.len() > 10));
                }
                statuses.push(status);
            }
            prop_assert_eq!(statuses[0], statuses[1]);
            Ok(())
        })
    });
}
