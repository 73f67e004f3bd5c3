//! The handle that carries a lock store and the policy, and hands out layers.

use std::{
    fmt,
    future::Future,
    sync::{Arc, LazyLock},
    time::{Duration, Instant},
};

use axum::{
    extract::MatchedPath,
    response::{IntoResponse, Response},
};
use http::{request::Parts, HeaderName, Request, StatusCode};
use tracing::Span;

#[cfg(doc)]
use crate::Lease;
use crate::{
    acquire::{Acquisition, Refusal},
    backend::{memory::MemoryBackend, Backend, BoxFuture, Contention, OwnerToken},
    guard::{LockGuard, RequestGuard},
    inspect::Batches,
    keys::{normalize, KeyExtractor, KeyPolicy},
    observe::{self, Layer, Outcome},
    owner::{ExtraHolds, HeldKeys, OwnerExtension, RequestOwner},
    retry_after::HoldTimes,
    CheckError, FencingToken, LockLayer, Rejection, RetryAfter, Wait,
};

/// A lock store and the rules for using it; cheap to clone, and every clone shares the store.
///
/// Build one per store at start-up, tune it, and make a layer per route with
/// [`Locks::layer`]:
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::put, Router};
/// use http::StatusCode;
/// use tower_batch_lock::{keys, Locks};
///
/// let locks = Locks::memory()
///     .ttl(Duration::from_secs(10))
///     .contention_status(StatusCode::LOCKED);
///
/// let app: Router = Router::new()
///     .route("/orders/{id}", put(|| async {}).layer(locks.layer(keys::path("order"))));
/// ```
#[derive(Clone)]
pub struct Locks {
    pub(crate) backend: Arc<dyn Backend>,
    policy: Arc<Policy>,
    /// How long this handle's holds lasted lately, for [`RetryAfter::Observed`].
    holds: Arc<HoldTimes>,
    /// The batches this handle's requests hold now, for [`Locks::held_batches`].
    pub(crate) batches: Arc<Batches>,
}

#[derive(Debug, Clone)]
struct Policy {
    keys: KeyPolicy,
    ttl: Duration,
    contention_status: StatusCode,
    name_conflicts: usize,
    backend_timeout: Duration,
    require_keys: bool,
    wait: Wait,
    renew: bool,
    max_hold: Option<Duration>,
    on_lost_lease: OnLostLease,
    hold_until_body_end: bool,
    trusted_owner_header: Option<TrustedOwnerHeader>,
    retry_after: RetryAfter,
    refusal: Option<RefusalResponse>,
    /// The `layer` label of the metrics, when not the route.
    name: Option<Arc<str>>,
}

/// A user's way to build the responses the layer refuses requests with.
#[derive(Clone)]
struct RefusalResponse(Arc<dyn Fn(Rejection) -> Response + Send + Sync>);

impl fmt::Debug for RefusalResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RefusalResponse(..)")
    }
}

/// A header that carries an owner token from a caller this service trusts.
#[derive(Clone)]
struct TrustedOwnerHeader {
    name: HeaderName,
    trusts: Arc<dyn Fn(&Parts) -> bool + Send + Sync>,
}

impl fmt::Debug for TrustedOwnerHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrustedOwnerHeader")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// What happens to a request whose lease is lost while its handler runs (see
/// [`Locks::on_lost_lease`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnLostLease {
    /// The handler goes on; it learns of the loss through [`Lease::lost`] and
    /// [`Lease::is_lost`]. The default.
    #[default]
    Continue,
    /// The handler is cancelled (its future dropped) and the client gets 503.
    Cancel,
}

/// How long a request may keep its keys by renewal unless [`Locks::max_hold`] says
/// otherwise: far longer than any sensible handler, short enough that a hung one does not
/// hold its keys for good.
const DEFAULT_MAX_HOLD: Duration = Duration::from_secs(300);

/// How many conflicting keys a waiting request watches for releases, whatever the
/// response names: a lost wake-up only costs a poll interval.
const WATCHED_CONFLICTS: usize = 20;

impl Default for Policy {
    fn default() -> Self {
        Self {
            keys: KeyPolicy {
                prefix: "lock:".to_owned(),
                max_keys: 10_000,
                max_key_len: 256,
            },
            ttl: Duration::from_secs(30),
            contention_status: StatusCode::CONFLICT,
            name_conflicts: 20,
            backend_timeout: Duration::from_secs(2),
            require_keys: false,
            wait: Wait::none(),
            renew: true,
            max_hold: Some(DEFAULT_MAX_HOLD),
            on_lost_lease: OnLostLease::Continue,
            hold_until_body_end: false,
            trusted_owner_header: None,
            retry_after: RetryAfter::Observed,
            refusal: None,
            name: None,
        }
    }
}

/// The process-wide in-memory store: [`Locks::memory`]'s and [`LockLayer::new`]'s.
static MEMORY: LazyLock<Arc<MemoryBackend>> = LazyLock::new(|| Arc::new(MemoryBackend::new()));

impl Locks {
    /// Locks in this process's memory, for a service that runs as one process: the
    /// process-wide store, which [`LockLayer::new`] uses too, so that every in-memory layer
    /// of a process excludes every other on the same key, however it was made. Each call
    /// gives a handle with the default policy; tune it (`Locks::memory().ttl(..)`), and it
    /// keeps sharing the store.
    pub fn memory() -> Self {
        Self::with_backend(MEMORY.clone())
    }

    /// A new, empty in-memory store, shared only by the clones of this handle: for tests
    /// that must not see each other's locks. Layers on it do not exclude layers on
    /// [`Locks::memory`] or [`LockLayer::new`], even on the same key.
    pub fn isolated_memory() -> Self {
        Self::with_backend(Arc::new(MemoryBackend::new()))
    }

    /// Locks in the Redis at `url`, shared by every process that uses the same Redis and
    /// prefix, with a pool of its own and a subscription that wakes waiting requests when
    /// any process releases their keys. `rediss://` and credentials go in the URL.
    ///
    /// Needs a Redis with Lua scripting (2.6.12 or later) or a compatible server. The
    /// subscription opens at once when this is called inside a Tokio runtime, and
    /// otherwise when the first request waits.
    ///
    /// # Errors
    ///
    /// When `url` is not a valid Redis URL. Nothing connects yet.
    #[cfg(feature = "redis")]
    pub fn redis_url(url: &str) -> Result<Self, redis::RedisError> {
        let client = redis::Client::open(url)?;
        let pool = deadpool_redis::Config::from_url(url)
            .create_pool(Some(deadpool_redis::Runtime::Tokio1))
            .map_err(|e| {
                redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "could not create a Redis pool",
                    e.to_string(),
                ))
            })?;
        let backend = crate::backend::redis::RedisBackend::new(pool, Some(client));
        Ok(Self::with_backend(Arc::new(backend)))
    }

    /// Locks in Redis through a pool you already have, shared by every process that uses
    /// the same Redis and prefix.
    ///
    /// A pool knows no URL to subscribe with, so waiting requests wake at once for this
    /// process's releases and otherwise poll (every 5 to 100 ms); [`Locks::redis_url`] and
    /// [`Locks::redis_with_wakeups`] wake them for every process's releases.
    ///
    /// The locks take one connection out of the pool for good and share it (redis-rs
    /// pipelines concurrent commands over one connection, and a checkout from a
    /// deadpool-redis pool costs a `PING` round trip); after a connection error they take
    /// another. The pool is one connection smaller each time.
    #[cfg(feature = "redis")]
    pub fn redis(pool: deadpool_redis::Pool) -> Self {
        Self::with_backend(Arc::new(crate::backend::redis::RedisBackend::new(
            pool, None,
        )))
    }

    /// Locks in Redis through a pool you already have, like [`Locks::redis`], and with a
    /// subscription opened at `url` (the same Redis) that wakes waiting requests when any
    /// process releases their keys, like [`Locks::redis_url`].
    ///
    /// ```
    /// use tower_batch_lock::{deadpool_redis, Locks};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let url = "redis://127.0.0.1/";
    /// let pool = deadpool_redis::Config::from_url(url).create_pool(Some(deadpool_redis::Runtime::Tokio1))?;
    /// let locks = Locks::redis_with_wakeups(pool, url)?;
    /// # drop(locks);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// When `url` is not a valid Redis URL. Nothing connects yet.
    #[cfg(feature = "redis")]
    pub fn redis_with_wakeups(
        pool: deadpool_redis::Pool,
        url: &str,
    ) -> Result<Self, redis::RedisError> {
        let client = redis::Client::open(url)?;
        let backend = crate::backend::redis::RedisBackend::new(pool, Some(client));
        Ok(Self::with_backend(Arc::new(backend)))
    }

    /// Locks over several independent Redis masters with the Redlock algorithm, shared by
    /// every process that uses the same masters and prefix: a batch is locked when a
    /// majority of the masters locked all of it, so the locks outlive the loss of any
    /// minority of them. [`Redlock`](crate::Redlock) explains what that guarantees, and
    /// sets the per-master timeout (100 ms by default).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_batch_lock::Locks;
    ///
    /// # fn main() -> Result<(), tower_batch_lock::redis::RedisError> {
    /// let locks = Locks::redlock([
    ///     "redis://10.0.0.1:6379/",
    ///     "redis://10.0.0.2:6379/",
    ///     "redis://10.0.0.3:6379/",
    /// ])?
    /// .ttl(Duration::from_secs(10));
    /// # drop(locks);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// When there are fewer than three URLs, one is not a valid Redis URL, or two name the
    /// same server. Nothing connects yet.
    #[cfg(feature = "redis")]
    pub fn redlock<I>(urls: I) -> Result<Self, redis::RedisError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        crate::Redlock::new(urls).build()
    }

    /// Locks on a Redis Cluster, shared by every process that uses it with the same
    /// prefix: each batch is grouped by the master that serves its keys, one script call
    /// per master, all at once, granted when every master granted its group.
    /// [`RedisCluster`](crate::RedisCluster) explains what that guarantees, and sets the
    /// timeouts.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_batch_lock::Locks;
    ///
    /// # fn main() -> Result<(), tower_batch_lock::redis::RedisError> {
    /// // Any subset of the nodes: the rest comes from the cluster's slot map.
    /// let locks = Locks::redis_cluster(["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"])?
    ///     .ttl(Duration::from_secs(10));
    /// # drop(locks);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// When there is no URL, or one is not a valid Redis URL. Nothing connects yet.
    #[cfg(feature = "cluster")]
    pub fn redis_cluster<I>(urls: I) -> Result<Self, redis::RedisError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        crate::RedisCluster::new(urls).build()
    }

    pub(crate) fn with_backend(backend: Arc<dyn Backend>) -> Self {
        Self {
            backend,
            policy: Arc::new(Policy::default()),
            holds: Arc::default(),
            batches: Arc::default(),
        }
    }

    fn tune(mut self, change: impl FnOnce(&mut Policy)) -> Self {
        change(Arc::make_mut(&mut self.policy));
        self
    }

    /// How long locks live if nobody releases them (a crashed process, a lost release).
    /// Default 30 s. Choose it longer than the slowest handler: a lock that expires while
    /// its handler still runs no longer keeps others out.
    ///
    /// # Panics
    ///
    /// If `ttl` is shorter than a millisecond, the store's resolution.
    pub fn ttl(self, ttl: Duration) -> Self {
        assert!(
            ttl >= Duration::from_millis(1),
            "a lock TTL must be at least 1 ms"
        );
        self.tune(|p| p.ttl = ttl)
    }

    /// The namespace in front of every key in the store. Default `lock:`. The prefix alone
    /// names the namespace's fencing counter (never a lock: empty keys are refused).
    ///
    /// # Panics
    ///
    /// If `prefix` is empty: client-supplied keys would then name any key in the store.
    pub fn prefix(self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        assert!(
            !prefix.is_empty(),
            "a lock prefix must not be empty: it keeps client keys apart from other data"
        );
        self.tune(|p| p.keys.prefix = prefix)
    }

    /// The status for a request whose keys are held by someone else: 409 Conflict (the
    /// default) or 423 Locked, say.
    ///
    /// # Panics
    ///
    /// If `status` is not a 4xx client error.
    pub fn contention_status(self, status: StatusCode) -> Self {
        assert!(
            status.is_client_error(),
            "contention must be answered with a 4xx status, not {status}"
        );
        self.tune(|p| p.contention_status = status)
    }

    /// What a contention response's `Retry-After` tells the client: by default how long
    /// this handle's holds lasted lately ([`RetryAfter::Observed`]), never later than the
    /// earliest expiry among the conflicting keys.
    pub fn retry_after(self, retry_after: RetryAfter) -> Self {
        self.tune(|p| p.retry_after = retry_after)
    }

    /// How many distinct keys one request may lock. Default 10,000; more is a 413.
    pub fn max_keys(self, max: usize) -> Self {
        self.tune(|p| p.keys.max_keys = max)
    }

    /// How long one key may be, in bytes and without the prefix. Default 256; longer is a 400.
    pub fn max_key_len(self, max: usize) -> Self {
        self.tune(|p| p.keys.max_key_len = max)
    }

    /// How many of the conflicting keys a contention response names, in its
    /// `conflicting_keys` member. Default 20; 0 names none, for keys that clients must not
    /// learn of.
    pub fn name_conflicts(self, at_most: usize) -> Self {
        self.tune(|p| p.name_conflicts = at_most)
    }

    /// How long one call to the store may take in all (pool checkout and command) before
    /// the request gets 503. Default 2 s.
    pub fn backend_timeout(self, timeout: Duration) -> Self {
        self.tune(|p| p.backend_timeout = timeout)
    }

    /// Whether a request whose extractor finds no keys is refused with 400 (`true`) or
    /// passes through unlocked (`false`, the default).
    pub fn require_keys(self, require: bool) -> Self {
        self.tune(|p| p.require_keys = require)
    }

    /// Whether a request whose keys are busy is refused at once (the default) or waits for
    /// them, up to a bound, and in order of arrival unless [`Wait::fair`] says otherwise. A
    /// layer can set its own with [`LockLayer::wait`].
    pub fn wait(self, wait: Wait) -> Self {
        self.tune(|p| p.wait = wait)
    }

    /// Whether the lease is extended while the inner service runs (and, with
    /// [`hold_until_body_end`](Self::hold_until_body_end), until the body ends): every
    /// TTL / 3, by an owner-checked, all-or-nothing extension. On by default, so that a
    /// handler slower than the TTL keeps its keys (up to [`max_hold`](Self::max_hold));
    /// off, the TTL is the longest a request holds its keys, and a second request may run
    /// beside a slow first one once it has passed.
    ///
    /// When an extension finds the keys gone or taken, or cannot reach the store before the
    /// lease runs out, the lease is lost: [`Lease::lost`] resolves, it is logged, and
    /// [`on_lost_lease`](Self::on_lost_lease) decides the rest.
    pub fn renew_lease(self, renew: bool) -> Self {
        self.tune(|p| p.renew = renew)
    }

    /// With [`renew_lease`](Self::renew_lease), stops renewing once the keys have been held
    /// this long (waiting for them does not count); they then expire with their TTL, and
    /// the lease is lost. Default 5 minutes: a hung handler does not hold its keys for
    /// good. `Duration::MAX` removes the limit.
    pub fn max_hold(self, max: Duration) -> Self {
        self.tune(|p| p.max_hold = Some(max))
    }

    /// What happens when the lease is lost while the inner service runs: go on (the
    /// default) or cancel it and answer 503.
    ///
    /// Going on is the default because cancelling drops the handler at whatever `.await`
    /// it has reached, which can leave its work half done (one write made, the next not),
    /// while a handler that goes on can finish or undo what it started: it learns of the
    /// loss from [`Lease::lost`] and [`Lease::is_lost`], and a resource that checks
    /// [fencing tokens](Lease::fencing_token) refuses it anyway once another holder wrote.
    /// With renewal on (the default), a lease is only lost when the store loses or hands
    /// over the keys, cannot be reached for a whole TTL, or `max_hold` has passed.
    pub fn on_lost_lease(self, then: OnLostLease) -> Self {
        self.tune(|p| p.on_lost_lease = then)
    }

    /// Whether the keys stay locked until the response body has been sent (`true`), for
    /// streaming responses, or are released as soon as the response head is ready
    /// (`false`, the default).
    ///
    /// A held response states no exact body size, so HTTP/1.1 sends it chunked: the
    /// server then reads the body to its end, and the release happens before the client
    /// has the last byte. (A response without a body on the wire, to `HEAD` or with 204 or
    /// 304, is released in the background as soon as it is sent.)
    pub fn hold_until_body_end(self, hold: bool) -> Self {
        self.tune(|p| p.hold_until_body_end = hold)
    }

    /// Lets trusted callers pass their owner token in the header `name`, so that this
    /// service re-enters the keys the caller holds instead of contending with them: for a
    /// request that runs on behalf of another one which shares the lock store (the caller
    /// sends [`Lease::owner_header_value`]). Off by default.
    ///
    /// The token is a capability: whoever presents it re-enters every key its owner holds,
    /// past the lock that was meant to keep them out. So the header counts only when
    /// `trusts` accepts the request (check a client certificate, a network peer, a signed
    /// service credential: never the header itself); from anyone else it is ignored, and
    /// the request contends like any other.
    ///
    /// ```
    /// use http::{request::Parts, HeaderName};
    /// use tower_batch_lock::Locks;
    ///
    /// // A downstream service that trusts callers its gateway marked as internal.
    /// let locks = Locks::memory().trust_owner_header(
    ///     HeaderName::from_static("x-lock-owner"),
    ///     |parts: &Parts| parts.extensions.get::<InternalCaller>().is_some(),
    /// );
    /// # #[derive(Clone)] struct InternalCaller;
    /// ```
    pub fn trust_owner_header<F>(self, name: HeaderName, trusts: F) -> Self
    where
        F: Fn(&Parts) -> bool + Send + Sync + 'static,
    {
        let header = TrustedOwnerHeader {
            name,
            trusts: Arc::new(trusts),
        };
        self.tune(|p| p.trusted_owner_header = Some(header))
    }

    /// These locks without [`trust_owner_header`](Self::trust_owner_header): for locks
    /// that no caller may enter again, whatever owner it brings.
    #[cfg(feature = "idempotency")]
    pub(crate) fn trusting_no_owner(self) -> Self {
        self.tune(|p| p.trusted_owner_header = None)
    }

    /// Whether the lock store can serve locks now: it answers within the
    /// [backend timeout](Self::backend_timeout), and has what the locks need (for Redis:
    /// version 7.0 or later, and every script loads; for Redlock: a majority of the masters
    /// pass that check). For readiness probes, and for `main` before it serves:
    ///
    /// ```no_run
    /// use tower_batch_lock::Locks;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let locks = Locks::redis_url("redis://127.0.0.1/")?;
    /// locks.check().await?; // "could not reach the lock store: ..." when Redis is down
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// A [`CheckError`] that says what is wrong.
    pub async fn check(&self) -> Result<(), CheckError> {
        let timeout = self.policy.backend_timeout;
        match tokio::time::timeout(timeout, self.backend.check()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(CheckError::new(
                "the lock store cannot serve locks",
                Some(error.into()),
            )),
            Err(_) => Err(CheckError::new(
                format!(
                    "the lock store did not answer within the backend timeout ({} ms)",
                    timeout.as_millis()
                ),
                None,
            )),
        }
    }

    /// Builds the responses this layer refuses requests with, instead of the default
    /// problem+json ones: contention, an unavailable store, keys over the limits, no keys
    /// with [`require_keys`](Self::require_keys), and a lost lease with
    /// [`OnLostLease::Cancel`]. The [`Rejection`] says which (its
    /// [`status`](Rejection::status), [`body_text`](Rejection::body_text)), and
    /// `rejection.into_response()` gives the default, to change a part of it. An
    /// extractor's own refusals (a body that is not JSON, say) are already responses, and
    /// are sent as they are.
    ///
    /// ```
    /// use axum::response::{IntoResponse, Response};
    /// use http::{header, HeaderValue};
    /// use tower_batch_lock::{Locks, Rejection};
    ///
    /// // The default answer, with a header the API's clients look for.
    /// let locks = Locks::memory().refusal_response(|rejection: Rejection| -> Response {
    ///     let mut response = rejection.into_response();
    ///     response
    ///         .headers_mut()
    ///         .insert("x-lock-refused", HeaderValue::from_static("1"));
    ///     response
    /// });
    /// ```
    pub fn refusal_response<F>(self, build: F) -> Self
    where
        F: Fn(Rejection) -> Response + Send + Sync + 'static,
    {
        self.tune(|p| p.refusal = Some(RefusalResponse(Arc::new(build))))
    }

    /// The response for a refusal: the user's, or the rejection's own.
    fn refuse(&self, rejection: Rejection) -> Response {
        let refused = rejection.refused();
        let mut response = match &self.policy.refusal {
            Some(build) => (build.0)(rejection),
            None => rejection.into_response(),
        };
        response.extensions_mut().insert(refused);
        response
    }

    /// The name of these locks in metrics (the `layer` label; see the README's metrics
    /// table). By default a request's metrics carry the route it matched: a name groups
    /// several routes, or tells apart two layers on one route. Choose a fixed word, never
    /// anything from a request.
    pub fn name(self, name: impl Into<String>) -> Self {
        let name: Arc<str> = name.into().into();
        self.tune(|p| p.name = Some(name))
    }

    /// A layer that locks the keys `extractor` reads from each request.
    pub fn layer<E>(&self, extractor: E) -> LockLayer<E> {
        LockLayer::with_locks(self.clone(), extractor)
    }

    /// Extracts, normalizes and acquires the keys of one request: the work before the inner
    /// service runs. Gives back the request with its guard (none when there are no keys),
    /// or the response that refuses it.
    pub(crate) fn lock<B, E>(
        &self,
        extractor: &E,
        request: Request<B>,
        span: Span,
    ) -> BoxFuture<'static, Locked<B>>
    where
        B: Send + 'static,
        E: KeyExtractor<B>,
    {
        // Named before the extractor takes the request: a refused one is counted too.
        let route = request.extensions().get::<MatchedPath>();
        let layer = Layer::new(self.policy.name.as_ref(), route.map(MatchedPath::as_str));
        let extracted = extractor.extract(request);
        let locks = self.clone();
        Box::pin(async move { locks.acquire(extracted, &layer, &span).await })
    }

    async fn acquire<B>(
        self,
        extracted: impl Future<Output = crate::keys::Extracted<B>>,
        layer: &Layer,
        span: &Span,
    ) -> Locked<B> {
        let policy = &self.policy;
        let rejected = || {
            span.record("outcome", "rejected");
            observe::outcome(layer, Outcome::Rejected, None);
        };
        let (mut request, keys) = extracted.await.inspect_err(|_| rejected())?;
        let keys = normalize(keys, &policy.keys).map_err(|rejection| {
            rejected();
            self.refuse(rejection)
        })?;
        span.record("keys", keys.len());
        if keys.is_empty() {
            if policy.require_keys {
                rejected();
                let rejection = Rejection::limit(
                    StatusCode::BAD_REQUEST,
                    "no_keys",
                    "the request does not name a resource to lock".to_owned(),
                );
                return Err(self.refuse(rejection));
            }
            span.record("outcome", "unlocked");
            return Ok((request, None));
        }

        // One owner per request: an outer layer's, a trusted caller's, or a new one.
        let existing = request
            .extensions()
            .get::<OwnerExtension>()
            .map(|o| o.0.clone());
        // An owner from an outer layer or a trusted caller already holds keys.
        let (owner, made_here, holds_keys) = match existing {
            Some(owner) => (owner, false, true),
            None => {
                let trusted;
                (request, trusted) = self.trusted_owner(request);
                let token = trusted.unwrap_or_else(OwnerToken::random);
                let owner = RequestOwner::new(token);
                request
                    .extensions_mut()
                    .insert(OwnerExtension(owner.clone()));
                (owner, true, trusted.is_some())
            }
        };

        observe::batch(layer, keys.len());
        let keys: Arc<[String]> = keys.into();
        let started = Instant::now();
        let granted = self
            .acquire_waiting(&keys, owner.token, holds_keys, Some(layer), span)
            .await;
        let took = started.elapsed();
        span.record("acquire_ms", took.as_secs_f64() * 1e3);
        let outcome = granted
            .as_ref()
            .map_or_else(|(_, o)| *o, |_| Outcome::Granted);
        observe::outcome(layer, outcome, Some(took));
        let (mut guard, fencing_token) =
            granted.map_err(|(rejection, _)| self.refuse(rejection))?;
        // `max_hold` counts from here: the time spent waiting for the keys is not holding.
        let granted_at = Instant::now();
        span.record("outcome", "granted");

        let lease = guard.lease(fencing_token, self.clone(), owner.clone());
        guard.time_into(self.holds.clone(), layer.clone());
        guard.list_in(self.batches.register(&request, keys.len()));
        // The response future starts the renewal if the request still holds its keys when
        // the first extension is due.
        let renew_at = if policy.renew {
            let until = policy.max_hold.and_then(|max| granted_at.checked_add(max));
            guard.renew_later(policy.ttl, until)
        } else {
            None
        };
        if let Some(lease) = &lease {
            request.extensions_mut().insert(lease.clone());
        }
        let cancel_on_loss = (policy.on_lost_lease == OnLostLease::Cancel)
            .then_some(lease)
            .flatten()
            .map(|lease| {
                let locks = self.clone();
                Box::pin(async move {
                    lease.lost().await;
                    tracing::warn!("lease lost while the handler ran; cancelling it");
                    locks.refuse(Rejection::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the locks of this request were lost before it finished; try again",
                    ))
                }) as BoxFuture<'static, Response>
            });
        // The layer that made the owner gives back the handler's holds too.
        let extra = made_here.then(|| ExtraHolds(owner));
        Ok((
            request,
            Some(Holding {
                guard: RequestGuard { guard, extra },
                cancel_on_loss,
                until_body_end: policy.hold_until_body_end,
                renew_at,
            }),
        ))
    }

    /// The owner token a trusted caller sent, if this service trusts the header and the
    /// caller; and the request back.
    fn trusted_owner<B>(&self, request: Request<B>) -> (Request<B>, Option<OwnerToken>) {
        let Some(header) = &self.policy.trusted_owner_header else {
            return (request, None);
        };
        let sent = request
            .headers()
            .get(&header.name)
            .and_then(|v| v.to_str().ok());
        let Some(token) = sent.and_then(OwnerToken::from_hex) else {
            return (request, None);
        };
        let (parts, body) = request.into_parts();
        let trusted = (header.trusts)(&parts);
        (Request::from_parts(parts, body), trusted.then_some(token))
    }

    /// Locks more keys for a request's owner, for [`Lease::lock`].
    pub(crate) async fn lock_for(
        &self,
        owner: &Arc<RequestOwner>,
        keys: Vec<String>,
    ) -> Result<HeldKeys, Rejection> {
        let policy = &self.policy;
        let keys: Arc<[String]> = normalize(keys, &policy.keys)?.into();
        if keys.is_empty() {
            let detail = "there are no keys to lock".to_owned();
            return Err(Rejection::limit(StatusCode::BAD_REQUEST, "no_keys", detail));
        }
        let (mut guard, fencing_token) = self
            .acquire_waiting(&keys, owner.token, true, None, &Span::current())
            .await
            .map_err(|(rejection, _)| rejection)?;
        if policy.renew {
            let until = policy
                .max_hold
                .and_then(|max| Instant::now().checked_add(max));
            guard.renew(policy.ttl, until);
        }
        let lease = guard.lease(fencing_token, self.clone(), owner.clone());
        let (Some(lease), Some(hold)) = (lease, guard.hold()) else {
            unreachable!("a granted guard is armed");
        };
        owner.keep(hold, guard);
        Ok(HeldKeys::new(lease, hold, owner.clone()))
    }

    /// How long the namespace prefix is, to show keys without it.
    pub(crate) fn prefix_len(&self) -> usize {
        self.policy.keys.prefix.len()
    }

    /// The key policy: prefix and limits, to normalize keys as requests' are.
    pub(crate) fn key_policy(&self) -> &KeyPolicy {
        &self.policy.keys
    }

    /// How long a lease lasts unless renewed ([`Locks::ttl`]).
    #[cfg(feature = "idempotency")]
    pub(crate) fn lease_ttl(&self) -> Duration {
        self.policy.ttl
    }

    /// How long one call to the store may take ([`Locks::backend_timeout`]).
    pub(crate) fn call_timeout(&self) -> Duration {
        self.policy.backend_timeout
    }

    /// Acquires `keys` for `owner`, which may already hold others, under this policy: see
    /// [`Acquisition`]. A refusal comes with what it counts as; a request's acquisition has
    /// the `layer` its waiting counts under.
    async fn acquire_waiting(
        &self,
        keys: &Arc<[String]>,
        owner: OwnerToken,
        holds_keys: bool,
        layer: Option<&Layer>,
        span: &Span,
    ) -> Result<(LockGuard, FencingToken), (Rejection, Outcome)> {
        let policy = &self.policy;
        let report = if policy.wait.bound().is_zero() {
            policy.name_conflicts
        } else {
            policy.name_conflicts.max(WATCHED_CONFLICTS)
        };
        let acquisition = Acquisition {
            backend: &self.backend,
            namespace: &policy.keys.prefix,
            keys,
            ttl: policy.ttl,
            wait: policy.wait,
            timeout: policy.backend_timeout,
            report,
            holds_keys,
            layer,
        };
        acquisition
            .run(owner)
            .await
            .map_err(|refusal| match refusal {
                Refusal::Contended(contention) => {
                    span.record("outcome", "contended");
                    tracing::debug!(held = contention.total, "locks held by another owner");
                    (self.contention(keys.len(), contention), Outcome::Contended)
                }
                Refusal::Unavailable => {
                    span.record("outcome", "unavailable");
                    (Rejection::unavailable(), Outcome::Unavailable)
                }
            })
    }

    /// The response for a batch refused because `contention` holds some of its `of` keys.
    fn contention(&self, of: usize, contention: Contention) -> Rejection {
        let policy = &self.policy;
        let prefix = policy.keys.prefix.len();
        let named = contention
            .keys
            .into_iter()
            .take(policy.name_conflicts)
            .map(|mut key| key.split_off(prefix))
            .collect();
        Rejection::contention(
            policy.contention_status,
            contention.total,
            of,
            named,
            policy
                .retry_after
                .advise(&self.holds, contention.earliest_expiry),
        )
    }
}

/// A granted request's hold on its keys, for the response future.
pub(crate) struct Holding {
    pub(crate) guard: RequestGuard,
    /// When losing the lease cancels the inner service: resolves, once it is lost, to the
    /// response that replaces the inner service's.
    pub(crate) cancel_on_loss: Option<BoxFuture<'static, Response>>,
    /// Whether the keys stay locked until the response body ends.
    pub(crate) until_body_end: bool,
    /// When the guard's deferred renewal must start, if the keys are still held then.
    pub(crate) renew_at: Option<Instant>,
}

impl fmt::Debug for Holding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Holding")
            .field("guard", &self.guard)
            .field("cancel_on_loss", &self.cancel_on_loss.is_some())
            .field("until_body_end", &self.until_body_end)
            .field("renew_at", &self.renew_at)
            .finish()
    }
}

/// The request, with the guard of its keys, or the response that refuses it.
pub(crate) type Locked<B> = Result<(Request<B>, Option<Holding>), Response>;

impl fmt::Debug for Locks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locks")
            .field("backend", &self.backend)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}
