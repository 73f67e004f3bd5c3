//! What an [`Idempotency`](super::Idempotency) layer is set to, as its service reads it.

use std::{sync::Arc, time::Duration};

use http::{request, response};

/// A request's part that makes it the same request, for [`Idempotency::fingerprint`](super::Idempotency::fingerprint).
pub(super) type FingerprintFn = Arc<dyn Fn(&request::Parts, &[u8]) -> Vec<u8> + Send + Sync>;
/// Whose key it is, for [`Idempotency::scope`](super::Idempotency::scope).
pub(super) type ScopeFn = Arc<dyn Fn(&request::Parts) -> String + Send + Sync>;
/// Whether an answer is kept, for [`Idempotency::store_if`](super::Idempotency::store_if).
pub(super) type StoreIfFn = Arc<dyn Fn(&response::Parts) -> bool + Send + Sync>;

#[derive(Clone)]
pub(super) struct Config {
    pub(super) required: bool,
    pub(super) retention: Duration,
    pub(super) max_key_len: usize,
    pub(super) body_limit: usize,
    pub(super) max_answer: usize,
    pub(super) fingerprint: Option<FingerprintFn>,
    pub(super) scope: Option<ScopeFn>,
    pub(super) store_if: StoreIfFn,
}
