//! The layer users add to a route.

use std::time::Duration;

use http::StatusCode;
use tower_layer::Layer;

use super::service::LockService;
use crate::{locks::Locks, wait::Wait};

/// Locks the keys that an extractor reads from each request, all or nothing, around the
/// inner service.
///
/// `LockLayer::new` uses the process-wide in-memory store ([`Locks::memory`]); for Redis or
/// a tuned policy, make the layer with [`Locks::layer`].
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_batch_lock::{keys, LockLayer};
///
/// let app: Router = Router::new()
///     .route("/jobs/{id}", post(|| async { "done" }).layer(LockLayer::new(keys::path("job"))));
/// ```
///
/// # Where to put it
///
/// Anywhere axum takes a layer: on a route's method router (`post(h).layer(..)` or
/// `.route_layer(..)`), on a router's routes ([`Router::route_layer`](axum::Router::route_layer))
/// or on the whole router ([`Router::layer`](axum::Router::layer)), which wraps its
/// fallback too. A path that no route matches gets the router's 404 (or its own
/// fallback's answer) under each: the layer locks nothing for it, and refuses nothing.
///
/// A method that the route does not serve still goes through the layer, except under a
/// method router's `route_layer`, where axum answers 405 first (axum's docs say the same
/// of every middleware that answers early). Elsewhere the layer reads the request's keys
/// before axum's 405: a `GET` with no body, on a route locked by [`keys::json`](crate::keys::json),
/// gets 415. Use `route_layer` on the method router where an exact 405 matters.
///
/// A service nested with [`Router::nest_service`](axum::Router::nest_service) is no route
/// of the outer router to axum, and a layer there cannot tell its requests from the
/// fallback's: it passes them on unlocked. Lock such a service from inside it
/// (`nest_service("/x", locks.layer(..).layer(service))`); a router nested with
/// [`Router::nest`](axum::Router::nest) is made of routes, and locks as they do.
#[derive(Debug, Clone)]
pub struct LockLayer<E> {
    locks: Locks,
    extractor: E,
}

impl<E> LockLayer<E> {
    /// A layer on the process-wide in-memory store: every layer made this way in one
    /// process shares it, so two routes that lock the same key exclude each other.
    pub fn new(extractor: E) -> Self {
        Self::with_locks(Locks::memory(), extractor)
    }

    fn with_locks(locks: Locks, extractor: E) -> Self {
        Self { locks, extractor }
    }

    /// How long this layer's requests wait for busy keys, whatever its [`Locks`] says.
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum::{routing::put, Router};
    /// use tower_batch_lock::{keys, Locks, Wait};
    ///
    /// let locks = Locks::memory(); // fail fast by default
    /// let app: Router = Router::new().route(
    ///     "/stock/{sku}",
    ///     put(|| async {}).layer(locks.layer(keys::path("sku")).wait(Wait::up_to(Duration::from_secs(1)))),
    /// );
    /// ```
    pub fn wait(mut self, wait: Wait) -> Self {
        self.locks = self.locks.wait(wait);
        self
    }

    /// How long this layer's locks live if nobody releases them, whatever its [`Locks`]
    /// says (see [`Locks::ttl`]).
    ///
    /// # Panics
    ///
    /// If `ttl` is shorter than a millisecond.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.locks = self.locks.ttl(ttl);
        self
    }

    /// Holds every key of this layer [shared](crate::Mode::Shared): with other shared
    /// holders, and no exclusive one. For routes that read a consistent set of resources
    /// and change none of them: many run together, and none while a request holds one of
    /// their keys exclusively.
    ///
    /// ```
    /// use axum::{routing::{get, post}, Router};
    /// use tower_batch_lock::{keys, Locks};
    ///
    /// let locks = Locks::memory();
    /// let app: Router = Router::new()
    ///     // Quotes read the SKUs together; an order waits until they are done, and they
    ///     // wait for it.
    ///     .route("/quotes/{sku}", get(|| async {}).layer(locks.layer(keys::path("sku")).shared()))
    ///     .route("/orders/{sku}", post(|| async {}).layer(locks.layer(keys::path("sku"))));
    /// ```
    ///
    /// To hold only some keys shared, mark them in the extractor with
    /// [`Key::shared`](crate::keys::Key::shared).
    pub fn shared(mut self) -> Self {
        self.locks = self.locks.all_shared();
        self
    }

    /// The status this layer answers contention with, whatever its [`Locks`] says (see
    /// [`Locks::contention_status`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum::{routing::put, Router};
    /// use axum::http::StatusCode;
    /// use tower_batch_lock::{keys, Locks};
    ///
    /// let locks = Locks::memory();
    /// let app: Router = Router::new().route(
    ///     "/documents/{id}",
    ///     put(|| async {}).layer(
    ///         locks
    ///             .layer(keys::path("document"))
    ///             .ttl(Duration::from_secs(120))
    ///             .contention_status(StatusCode::LOCKED),
    ///     ),
    /// );
    /// ```
    ///
    /// # Panics
    ///
    /// If `status` is not a 4xx client error.
    pub fn contention_status(mut self, status: StatusCode) -> Self {
        self.locks = self.locks.contention_status(status);
        self
    }
}

impl<S, E: Clone> Layer<S> for LockLayer<E> {
    type Service = LockService<S, E>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService::new(inner, self.locks.clone(), self.extractor.clone())
    }
}

impl Locks {
    /// A layer that locks the keys `extractor` reads from each request.
    pub fn layer<E>(&self, extractor: E) -> LockLayer<E> {
        LockLayer::with_locks(self.clone(), extractor)
    }
}
