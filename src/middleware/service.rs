//! The middleware service.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use http::{Request, Response};
use tower_service::Service;

use super::{body::ResponseBody, future::ResponseFuture};
use crate::{
    keys::extractor::KeyExtractor,
    locks::Locks,
    observe::Labels,
    request::{self, Locking},
};

/// The service [`LockLayer`](super::LockLayer) wraps around its inner service.
#[derive(Debug, Clone)]
pub struct LockService<S, E> {
    inner: S,
    extractor: E,
    shared: Arc<Shared>,
}

/// What a service and its clones share, behind one reference count: axum clones a route's
/// service for every request, on whichever thread serves it.
#[derive(Debug)]
struct Shared {
    locks: Locks,
    /// The metrics labels of this service and its clones.
    labels: Labels,
}

impl<S, E> LockService<S, E> {
    pub(crate) fn new(inner: S, locks: Locks, extractor: E) -> Self {
        let labels = Labels::default();
        Self {
            inner,
            extractor,
            shared: Arc::new(Shared { locks, labels }),
        }
    }
}

impl<S, E, B, ResBody> Service<Request<B>> for LockService<S, E>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    E: KeyExtractor<B>,
    B: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let span = tracing::debug_span!(
            "lock",
            keys = tracing::field::Empty,
            outcome = tracing::field::Empty,
            acquire_ms = tracing::field::Empty,
        );
        let locking = {
            let _entered = span.enter();
            request::lock(
                &self.shared.locks,
                &self.shared.labels,
                &self.extractor,
                request,
                span.clone(),
            )
        };
        match locking {
            // Decided already: the ready inner service is called here, as any middleware
            // calls it, and no clone of it is made.
            Locking::Now(locked) => ResponseFuture::start(locked, &mut self.inner, span),
            // The inner service was made ready by `poll_ready`, and is called once the keys
            // are held: move the ready one into the future and keep a fresh clone here.
            Locking::Later(locking) => {
                let clone = self.inner.clone();
                let ready = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::later(locking, ready, span)
            }
        }
    }
}
