//! The layer users add to a route.

use tower_layer::Layer;

use crate::{LockService, Locks};

/// Locks the keys that an extractor reads from each request, all or nothing, around the
/// inner service.
///
/// `LockLayer::new` uses the process-wide in-memory store ([`Locks::global`]); for Redis or
/// a tuned policy, make the layer with [`Locks::layer`].
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_batch_lock::{keys, LockLayer};
///
/// let app: Router = Router::new()
///     .route("/jobs/{id}", post(|| async { "done" }).layer(LockLayer::new(keys::path("job"))));
/// ```
#[derive(Debug, Clone)]
pub struct LockLayer<E> {
    locks: Locks,
    extractor: E,
}

impl<E> LockLayer<E> {
    /// A layer on the process-wide in-memory store: every layer made this way in one
    /// process shares it, so two routes that lock the same key exclude each other.
    pub fn new(extractor: E) -> Self {
        Self::with_locks(Locks::global(), extractor)
    }

    pub(crate) fn with_locks(locks: Locks, extractor: E) -> Self {
        Self { locks, extractor }
    }
}

impl<S, E: Clone> Layer<S> for LockLayer<E> {
    type Service = LockService<S, E>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService::new(inner, self.locks.clone(), self.extractor.clone())
    }
}
