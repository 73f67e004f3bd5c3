//! The handle that carries a lock store and the policy, and hands out layers.

use std::{
    fmt,
    future::Future,
    sync::{Arc, LazyLock},
    time::{Duration, Instant},
};

use axum::response::{IntoResponse, Response};
use http::{Request, StatusCode};
use tracing::Span;

use crate::{
    backend::{memory::MemoryBackend, Acquire, Backend, BoxFuture, OwnerToken},
    guard::LockGuard,
    keys::{normalize, KeyExtractor, KeyPolicy},
    LockLayer, Rejection,
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
    backend: Arc<dyn Backend>,
    policy: Arc<Policy>,
}

#[derive(Debug, Clone)]
struct Policy {
    keys: KeyPolicy,
    ttl: Duration,
    contention_status: StatusCode,
    name_conflicts: usize,
    backend_timeout: Duration,
    require_keys: bool,
}

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
        }
    }
}

/// The store behind [`LockLayer::new`] and [`Locks::global`].
static GLOBAL: LazyLock<Locks> = LazyLock::new(Locks::memory);

impl Locks {
    /// Locks in this process's memory: for a service that runs as one process, and for
    /// tests. A new, empty store, shared by the clones of this handle only.
    pub fn memory() -> Self {
        Self::with_backend(Arc::new(MemoryBackend::new()))
    }

    /// The process-wide in-memory locks that [`LockLayer::new`] uses, with the default
    /// policy. Tune a copy (`Locks::global().ttl(..)`): it keeps sharing the store.
    pub fn global() -> Self {
        GLOBAL.clone()
    }

    /// Locks in Redis, shared by every process that uses the same Redis and prefix.
    ///
    /// Needs Redis 6.2 or later (or a compatible server with Lua scripting). A pool from
    /// `deadpool_redis::Config::from_url("redis://127.0.0.1/").create_pool(Some(Runtime::Tokio1))`
    /// will do; `rediss://` and credentials go in the URL.
    #[cfg(feature = "redis")]
    pub fn redis(pool: deadpool_redis::Pool) -> Self {
        Self::with_backend(Arc::new(crate::backend::redis::RedisBackend::new(pool)))
    }

    fn with_backend(backend: Arc<dyn Backend>) -> Self {
        Self {
            backend,
            policy: Arc::new(Policy::default()),
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

    /// The namespace in front of every key in the store. Default `lock:`.
    pub fn prefix(self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
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
        let extracted = extractor.extract(request);
        let locks = self.clone();
        Box::pin(async move { locks.acquire(extracted, &span).await })
    }

    async fn acquire<B>(
        self,
        extracted: impl Future<Output = crate::keys::Extracted<B>>,
        span: &Span,
    ) -> Locked<B> {
        let policy = &self.policy;
        let (mut request, keys) = extracted.await.inspect_err(|_| {
            span.record("outcome", "rejected");
        })?;
        let keys = normalize(keys, &policy.keys).map_err(|rejection| {
            span.record("outcome", "rejected");
            rejection.into_response()
        })?;
        span.record("keys", keys.len());
        if keys.is_empty() {
            if policy.require_keys {
                span.record("outcome", "rejected");
                let rejection = Rejection::limit(
                    StatusCode::BAD_REQUEST,
                    "no_keys",
                    "the request does not name a resource to lock".to_owned(),
                );
                return Err(rejection.into_response());
            }
            span.record("outcome", "unlocked");
            return Ok((request, None));
        }

        let keys: Arc<[String]> = keys.into();
        let owner = OwnerToken::random();
        let started = Instant::now();
        let guard = LockGuard::new(
            self.backend.clone(),
            keys.clone(),
            owner,
            policy.backend_timeout,
            started + policy.ttl,
        );
        let acquired = tokio::time::timeout(
            policy.backend_timeout,
            self.backend
                .acquire(&keys, owner, policy.ttl, policy.name_conflicts),
        )
        .await;
        span.record("acquire_ms", started.elapsed().as_secs_f64() * 1e3);

        match acquired {
            Ok(Ok(Acquire::Granted)) => {
                span.record("outcome", "granted");
                if let Some(lease) = guard.lease(policy.keys.prefix.len()) {
                    request.extensions_mut().insert(lease);
                }
                Ok((request, Some(guard)))
            }
            Ok(Ok(Acquire::Held(contention))) => {
                span.record("outcome", "contended");
                guard.disarm();
                let prefix = policy.keys.prefix.len();
                let named = contention
                    .keys
                    .into_iter()
                    .map(|mut k| k.split_off(prefix))
                    .collect();
                let rejection = Rejection::contention(
                    policy.contention_status,
                    contention.total,
                    keys.len(),
                    named,
                    contention.earliest_expiry.unwrap_or(Duration::from_secs(1)),
                );
                tracing::debug!(held = contention.total, "locks held by another owner");
                Err(rejection.into_response())
            }
            Ok(Err(error)) => {
                span.record("outcome", "unavailable");
                tracing::error!(%error, keys = keys.len(), "could not acquire locks");
                if !error.may_have_applied {
                    guard.disarm();
                }
                // Otherwise the guard's drop releases whatever the store may have granted.
                Err(Rejection::unavailable().into_response())
            }
            Err(_elapsed) => {
                span.record("outcome", "unavailable");
                tracing::error!(
                    timeout_ms = policy.backend_timeout.as_millis() as u64,
                    keys = keys.len(),
                    "acquiring locks timed out"
                );
                Err(Rejection::unavailable().into_response())
            }
        }
    }
}

/// The request, with the guard of its keys, or the response that refuses it.
pub(crate) type Locked<B> = Result<(Request<B>, Option<LockGuard>), Response>;

impl fmt::Debug for Locks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locks")
            .field("backend", &self.backend)
            .field("policy", &self.policy)
            .finish()
    }
}
