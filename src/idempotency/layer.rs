//! The [`Idempotency`] layer and its settings.

use std::{fmt, sync::Arc, time::Duration};

use http::{request, response, StatusCode};
use tower_layer::Layer;

use super::{config::Config, service::IdempotencyService};
use crate::{
    keys::body::DEFAULT_BODY_LIMIT,
    locks::{Locks, OnLostLease},
    wait::Wait,
};

/// How long a stored answer is replayed unless [`Idempotency::retention`] says otherwise:
/// 24 hours, as Stripe keeps its keys.
const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// The longest [`Idempotency::retention`]: a year.
const MAX_RETENTION: Duration = Duration::from_secs(366 * 24 * 60 * 60);

/// The longest key a client may send, unless [`Idempotency::max_key_len`] says otherwise.
const DEFAULT_MAX_KEY_LEN: usize = 255;

/// Room in the in-flight lock's key for what goes around the client's key: the scope, and
/// its length.
const SCOPE_ROOM: usize = 4096;

/// The in-flight lock's key limit, for client keys of up to `max_key_len` bytes: a key the
/// layer takes must never be refused by its own lock (a 400 that names a lock key).
fn in_flight_key_len(max_key_len: usize) -> usize {
    max_key_len.saturating_add(SCOPE_ROOM)
}

/// The largest response body kept for replay, unless [`Idempotency::max_answer`] says
/// otherwise: 1 MiB.
const DEFAULT_MAX_ANSWER: usize = 1024 * 1024;

/// The namespace of the in-flight locks and the stored answers, in front of the locks'
/// prefix, unless [`Idempotency::namespace`] says otherwise.
const NAMESPACE: &str = "idempotency:";

/// A layer that makes requests with an `Idempotency-Key` header run once: a retry gets the
/// first request's answer again instead of running the handler a second time, on every
/// process that shares the lock store.
///
/// It follows the IETF draft [The Idempotency-Key HTTP Header Field]
/// (draft-ietf-httpapi-idempotency-key-header):
///
/// | situation | answer |
/// | --- | --- |
/// | the first request with a key | the handler's, which is stored for [`retention`](Self::retention) |
/// | a retry after it finished, same method, path and body | the stored answer, byte for byte, with `Idempotent-Replayed: true` |
/// | a request while the first still runs, on any process (whatever its body: the first's fingerprint is known once it is stored) | 409, `Retry-After` (or it waits: [`wait`](Self::wait)) |
/// | the same key with another method, path or body | 422 |
/// | no key, on a layer that [requires](Self::required) one | 400 |
/// | a malformed key, or one longer than [`max_key_len`](Self::max_key_len) | 400 |
/// | a retry whose first answer was not stored (see [`store_if`](Self::store_if)) | the handler runs again |
/// | a retry whose first answer's body passed [`max_answer`](Self::max_answer) | 422, naming the first status |
/// | the store cannot be reached in time | 503, `Retry-After` |
///
/// Every refusal is `application/problem+json`. While a request runs, its key is locked
/// with the [`Locks`]' lease: renewed while the handler runs, released when the answer is
/// stored, and free again one TTL after its process died, so that a retry then runs. A
/// request with a key runs to its end even when its client goes away or a timeout around
/// the layer gives up on it, so that its answer is there for the retry. A lock layer
/// around this one (a lock on the whole router, say) keeps its keys, renewed, until that
/// run ends, and one whose [`on_lost_lease`](crate::Locks::on_lost_lease) cancels
/// cancels the run when it loses them.
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_batch_lock::Locks;
///
/// # async fn create_order() -> &'static str { "created" }
/// let locks = Locks::memory();
/// let app: Router = Router::new().route(
///     "/orders",
///     post(create_order).layer(locks.idempotency().required(true)),
/// );
/// ```
///
/// With a [`LockLayer`](crate::LockLayer) on the same route, put the idempotency layer
/// outside (the later `.layer(..)`), so that a retry is answered from the store without
/// taking the resources' locks, and a refusal by the lock layer (409, 503, a body its
/// extractor refuses, a request that names no key) is never stored: the retry, or the
/// corrected request with the same key, runs.
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_batch_lock::{keys, Locks};
///
/// # async fn create_order() -> &'static str { "created" }
/// let locks = Locks::memory();
/// let app: Router = Router::new().route(
///     "/orders",
///     post(create_order)
///         .layer(locks.layer(keys::header("x-sku", "sku")))
///         .layer(locks.idempotency()),
/// );
/// ```
///
/// The other order does not compile: axum cannot infer the error type between two
/// `.layer(..)` calls (E0283, "cannot infer type of the type parameter `NewError`")
/// unless the outer layer's service fixes it, as this one does (it serves axum's
/// infallible services only). A `tower::ServiceBuilder` lists the same two layers
/// outermost first.
///
/// # What is stored, and what is not
///
/// - **Stored:** the status, the headers that describe the answer, and the body byte for
///   byte, for [`retention`](Self::retention), when [`store_if`](Self::store_if) says so:
///   by default every answer except the lock layer's refusals and 401, 403, 407, 408, 413,
///   415, 425, 429, 502, 503 and 504 (a 500 is kept: it may have done half its work). A
///   body that fails half-way is not stored.
/// - **A handler that panics** may have done part of its work: a 500 problem+json that
///   says so is stored for its retries (if [`store_if`](Self::store_if) takes a 500), and
///   the panic goes on to what handles panics around the layer (tower-http's
///   `CatchPanicLayer`, or hyper, which closes the connection).
/// - **A handler cancelled by a lock layer inside or around** (one with
///   [`OnLostLease::Cancel`](crate::OnLostLease::Cancel), when its lease is lost) answers
///   503, which is not stored: its retry runs the handler again, which must then be safe
///   after a run stopped at any `.await`. The default,
///   [`OnLostLease::Continue`](crate::OnLostLease::Continue), lets a handler finish.
/// - **Fingerprint.** By default a SHA-256 of the method, the path, the query and the body;
///   [`fingerprint`](Self::fingerprint) replaces the query and body part (a re-serialized
///   JSON value, say, so that key order and spacing do not matter).
/// - **Scope.** The key is scoped by the layer's namespace, and by [`scope`](Self::scope)
///   when requests come from different clients: without a scope, a client that sends
///   another client's key with the same request gets that client's answer.
/// - **Not replayed:** response trailers, the headers of the connection (`Connection` and
///   those it names, `Keep-Alive`, `Transfer-Encoding`, ...) and `Date`; `Content-Length` is
///   the replayed body's. `Set-Cookie` is replayed only with a `scope`.
///
/// [The Idempotency-Key HTTP Header Field]: https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/
#[derive(Clone)]
pub struct Idempotency {
    locks: Locks,
    config: Config,
}

impl Locks {
    /// An [`Idempotency`] layer on this store: its in-flight locks and its stored answers
    /// live where these locks do (memory, one Redis, Redlock), under a namespace of their
    /// own, `idempotency:` and these locks' prefix (`idempotency:lock:` by default: two
    /// deployments that keep their locks apart keep their answers apart too), with these
    /// locks' TTL and store timeout. An in-flight lock is renewed for as long as its
    /// request runs, whatever these locks' [`max_hold`](Locks::max_hold), and its loss
    /// never cancels the request, whatever their [`on_lost_lease`](Locks::on_lost_lease)
    /// or that of a lock layer inside (whose [`Lease`](crate::Lease) counts it, lost with
    /// it, for the handler to see):
    /// a retry must not run beside a slow first request, nor after one that was stopped
    /// half-way with nothing stored.
    ///
    /// A concurrent duplicate gets 409 at once, as the draft says, whatever these locks'
    /// waiting: [`Idempotency::wait`] lets it wait instead.
    pub fn idempotency(&self) -> Idempotency {
        let namespace = format!("{NAMESPACE}{}", self.key_policy().prefix);
        let locks = self
            .clone()
            .prefix(namespace)
            // Without renewal, a handler slower than the TTL would let its retry run
            // beside it; so would a limit on renewal. And a run cancelled when its lock
            // is lost would store nothing, so that its retry ran it again.
            .renew_lease(true)
            .max_hold(Duration::MAX)
            .on_lost_lease(OnLostLease::Continue)
            .metrics_label("idempotency")
            .wait(Wait::none())
            .contention_status(StatusCode::CONFLICT)
            .require_keys(false)
            .max_keys(1)
            .max_key_len(in_flight_key_len(DEFAULT_MAX_KEY_LEN))
            .hold_until_body_end(false)
            // Two requests with one key are duplicates, whoever sent them: a trusted
            // caller's owner must not enter another's in-flight lock again.
            .trusting_no_owner();
        Idempotency {
            locks,
            config: Config {
                required: false,
                retention: DEFAULT_RETENTION,
                max_key_len: DEFAULT_MAX_KEY_LEN,
                body_limit: DEFAULT_BODY_LIMIT,
                max_answer: DEFAULT_MAX_ANSWER,
                fingerprint: None,
                scope: None,
                store_if: Arc::new(|parts| stored_by_default(parts.status)),
            },
        }
    }
}

impl Idempotency {
    /// Whether a request without an `Idempotency-Key` is refused (400) rather than run as
    /// it is, unprotected. Off by default. A path that no route matches, where the layer is
    /// on a whole `Router`, is never refused: it gets the router's 404, and nothing is kept
    /// of it (see [`LockLayer`](crate::LockLayer#where-to-put-it)).
    pub fn required(mut self, required: bool) -> Self {
        self.config.required = required;
        self
    }

    /// How long a stored answer is replayed: 24 hours unless set,
    /// at most a year. After it, the key is free: a request with it runs again.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config.retention = retention.min(MAX_RETENTION);
        self
    }

    /// The longest key a client may send, in bytes: 255 unless set. A longer one is 400.
    /// On PostgreSQL keep it, with the [`scope`](Self::scope), below about 2,600 bytes: the
    /// store takes no longer key (see its page).
    pub fn max_key_len(mut self, max: usize) -> Self {
        self.config.max_key_len = max;
        self.locks = self.locks.max_key_len(in_flight_key_len(max));
        self
    }

    /// How much of a request body is read to fingerprint it:
    /// [`DEFAULT_BODY_LIMIT`] unless set; a larger body
    /// is 413. The handler gets the same bytes.
    pub fn body_limit(mut self, limit: usize) -> Self {
        self.config.body_limit = limit;
        self
    }

    /// The largest response body kept for replay, in bytes: 1 MiB unless set. The first
    /// request still gets all of a larger one; its retries get 422 naming the first
    /// status, since the layer can neither replay it nor run the request again (not 409,
    /// which clients that follow the draft take for "still running" and retry).
    ///
    /// An answer to store is read up to this size before its head goes out (it is stored
    /// before the in-flight lock is released): a streamed body reaches its first client
    /// when it ends or passes this size. Stream long answers from a route without this
    /// layer, or leave them out with [`store_if`](Self::store_if).
    pub fn max_answer(mut self, max: usize) -> Self {
        self.config.max_answer = max;
        self
    }

    /// The namespace of the in-flight locks and the stored answers: `idempotency:` and the
    /// locks' prefix unless set. Layers that share a namespace share keys: give a route its
    /// own when its keys may repeat another route's.
    ///
    /// # Panics
    ///
    /// If `namespace` is empty, as [`Locks::prefix`] does.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.locks = self.locks.prefix(namespace);
        self
    }

    /// How long a request waits for a concurrent duplicate to finish (and then gets its
    /// answer) instead of getting 409 at once. No waiting unless set.
    pub fn wait(mut self, wait: Wait) -> Self {
        self.locks = self.locks.wait(wait);
        self
    }

    /// The TTL of the in-flight lock: how long after its process died a key is free again
    /// for a retry. The [`Locks`]' TTL unless set; the lock is renewed while the handler
    /// runs ([`Locks::renew_lease`]).
    ///
    /// # Panics
    ///
    /// If `ttl` is shorter than a millisecond, as [`Locks::ttl`] does.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.locks = self.locks.ttl(ttl);
        self
    }

    /// What makes two requests with one key the same request, besides their method and
    /// path: by default the query string and the body, byte for byte. A function of the
    /// request head and body that returns the bytes to compare replaces that, for example
    /// to compare JSON bodies by value rather than by spelling:
    ///
    /// ```
    /// // Cargo.toml: serde_json = "1"
    /// use tower_batch_lock::Locks;
    ///
    /// let layer = Locks::memory().idempotency().fingerprint(|_parts, body| {
    ///     // serde_json's maps are sorted: one value, one spelling.
    ///     match serde_json::from_slice::<serde_json::Value>(body) {
    ///         Ok(value) => value.to_string().into_bytes(),
    ///         Err(_) => body.to_vec(),
    ///     }
    /// });
    /// # drop(layer);
    /// ```
    pub fn fingerprint<F, T>(mut self, fingerprint: F) -> Self
    where
        F: Fn(&request::Parts, &[u8]) -> T + Send + Sync + 'static,
        T: AsRef<[u8]>,
    {
        self.config.fingerprint = Some(Arc::new(move |parts, body| {
            fingerprint(parts, body).as_ref().to_vec()
        }));
        self
    }

    /// Whose keys a request's are: keys of different scopes never meet. Use the
    /// authenticated client (an account id that an authentication layer put in the
    /// request's extensions, say), so that no client can be answered with another's
    /// stored answer:
    ///
    /// ```
    /// use tower_batch_lock::Locks;
    ///
    /// #[derive(Clone)]
    /// struct Account(String);
    ///
    /// let layer = Locks::memory().idempotency().scope(|parts| {
    ///     parts
    ///         .extensions
    ///         .get::<Account>()
    ///         .map_or_else(String::new, |account| account.0.clone())
    /// });
    /// # drop(layer);
    /// ```
    pub fn scope<F>(mut self, scope: F) -> Self
    where
        F: Fn(&request::Parts) -> String + Send + Sync + 'static,
    {
        self.config.scope = Some(Arc::new(scope));
        self
    }

    /// Which answers are stored and replayed; a request whose answer was not stored runs
    /// again when it is retried. By default every answer of the handler is, errors
    /// included (a retry must not repeat work that may have been half done), except
    /// those that say the request did not run and that a retry, perhaps with other
    /// headers, may: 401, 403, 407 (credentials), 408, 413, 415 (the body's size or
    /// type), 425, 429, 502, 503 and 504. A refusal by a [`LockLayer`](crate::LockLayer)
    /// inside this layer is never stored, whatever this says.
    ///
    /// ```
    /// use tower_batch_lock::Locks;
    ///
    /// // Store only successes: a failed request runs again when it is retried.
    /// let layer = Locks::memory()
    ///     .idempotency()
    ///     .store_if(|response| response.status.is_success());
    /// # drop(layer);
    /// ```
    pub fn store_if<F>(mut self, store: F) -> Self
    where
        F: Fn(&response::Parts) -> bool + Send + Sync + 'static,
    {
        self.config.store_if = Arc::new(store);
        self
    }
}

/// Statuses that say "not done, try again", which a retry must not be answered with.
fn stored_by_default(status: StatusCode) -> bool {
    !matches!(
        status.as_u16(),
        401 | 403 | 407 | 408 | 413 | 415 | 425 | 429 | 502 | 503 | 504
    )
}

impl<S> Layer<S> for Idempotency {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.locks.clone(), self.config.clone())
    }
}

impl fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("locks", &self.locks)
            .field("required", &self.config.required)
            .field("retention", &self.config.retention)
            .field("max_key_len", &self.config.max_key_len)
            .field("body_limit", &self.config.body_limit)
            .field("max_answer", &self.config.max_answer)
            .field("custom_fingerprint", &self.config.fingerprint.is_some())
            .field("scoped", &self.config.scope.is_some())
            .finish_non_exhaustive()
    }
}
