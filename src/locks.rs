//! The handle that carries a lock store and the policy, and hands out layers.

use std::{
    fmt,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, LazyLock,
    },
    time::Duration,
};

use axum::response::{IntoResponse, Response};
use http::{request::Parts, HeaderName, StatusCode};

use crate::{
    duration::capped,
    keys::normalize::KeyPolicy,
    outage::OutageLog,
    registry::Batches,
    rejection::Rejection,
    retry_after::{HoldTimes, RetryAfter},
    store::{error::StoreError, handle::Store, OWN_NAMES},
    wait::Wait,
};
#[cfg(doc)]
use crate::{lease::Lease, middleware::LockLayer};

/// A lock store and the rules for using it; cheap to clone, and every clone shares the store.
///
/// Build one per store at start-up, tune it, and make a layer per route with
/// [`Locks::layer`]:
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::put, Router};
/// use axum::http::StatusCode;
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
    /// One allocation behind every clone: the request path clones a handle several times
    /// (the layer's service, the request's future, its lease), and each clone then costs
    /// one reference count, not one per part.
    shared: Arc<Shared>,
}

/// What a [`Locks`] handle carries. A builder method that changes the policy of a handle
/// others share gives it a policy of its own; the store and the parts below stay shared
/// with the handles it was cloned from.
#[derive(Clone)]
struct Shared {
    store: Store,
    policy: Policy,
    /// How long this handle's holds lasted lately, for [`RetryAfter::Observed`].
    holds: Arc<HoldTimes>,
    /// The batches this handle's requests hold now, for [`Locks::held_batches`].
    batches: Arc<Batches>,
    /// The store's outage, logged once rather than once per request.
    outage: Arc<OutageLog>,
    /// How many requests wait for their keys now (see [`Locks::max_waiters`]).
    waiting: Arc<AtomicUsize>,
}

/// The rules, as the request path reads them: each is set by the builder method of its
/// name.
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    pub(crate) keys: KeyPolicy,
    pub(crate) ttl: Duration,
    pub(crate) contention_status: StatusCode,
    pub(crate) max_named_conflicts: usize,
    pub(crate) store_timeout: Duration,
    pub(crate) require_keys: bool,
    /// Every key of the layer held shared ([`LockLayer::shared`](crate::LockLayer::shared)).
    pub(crate) all_shared: bool,
    pub(crate) wait: Wait,
    pub(crate) max_waiters: usize,
    pub(crate) renew: bool,
    pub(crate) max_hold: Option<Duration>,
    pub(crate) on_lost_lease: OnLostLease,
    pub(crate) hold_until_body_end: bool,
    pub(crate) trusted_owner_header: Option<TrustedOwnerHeader>,
    pub(crate) retry_after: RetryAfter,
    refusal: Option<RefusalResponse>,
    /// The `layer` label of the metrics, when not the route.
    pub(crate) metrics_label: Option<String>,
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
pub(crate) struct TrustedOwnerHeader {
    pub(crate) name: HeaderName,
    pub(crate) trusts: Arc<dyn Fn(&Parts) -> bool + Send + Sync>,
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

/// See [`Locks::max_waiters`].
const DEFAULT_MAX_WAITERS: usize = 1_024;

impl Default for Policy {
    fn default() -> Self {
        Self {
            keys: KeyPolicy {
                prefix: "lock:".into(),
                max_keys: 10_000,
                max_key_len: 256,
            },
            ttl: Duration::from_secs(30),
            contention_status: StatusCode::CONFLICT,
            max_named_conflicts: 20,
            store_timeout: Duration::from_secs(2),
            require_keys: true,
            all_shared: false,
            wait: Wait::none(),
            max_waiters: DEFAULT_MAX_WAITERS,
            renew: true,
            max_hold: Some(DEFAULT_MAX_HOLD),
            on_lost_lease: OnLostLease::Continue,
            hold_until_body_end: false,
            trusted_owner_header: None,
            retry_after: RetryAfter::Observed,
            refusal: None,
            metrics_label: None,
        }
    }
}

/// The process-wide in-memory store: [`Locks::memory`]'s and [`LockLayer::new`]'s.
static MEMORY: LazyLock<Store> = LazyLock::new(Store::isolated_memory);

impl Locks {
    /// Locks in this process's memory, for a service that runs as one process: the
    /// process-wide store, which [`LockLayer::new`] uses too, so that every in-memory layer
    /// of a process excludes every other on the same key, however it was made. Each call
    /// gives a handle with the default policy; tune it (`Locks::memory().ttl(..)`), and it
    /// keeps sharing the store.
    pub fn memory() -> Self {
        Self::new(MEMORY.clone())
    }

    /// Locks in `store`, with the default policy: build the store with one of the
    /// builders of [`store`](crate::store), then tune the policy.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_batch_lock::{store::Store, Locks};
    ///
    /// let locks = Locks::new(Store::isolated_memory()).ttl(Duration::from_secs(10));
    /// # drop(locks);
    /// ```
    pub fn new(store: Store) -> Self {
        let shared = Shared {
            store,
            policy: Policy::default(),
            holds: Arc::default(),
            batches: Arc::default(),
            outage: Arc::default(),
            waiting: Arc::default(),
        };
        Self {
            shared: Arc::new(shared),
        }
    }

    fn tune(mut self, change: impl FnOnce(&mut Policy)) -> Self {
        change(&mut Arc::make_mut(&mut self.shared).policy);
        self
    }

    /// The store these locks live in.
    pub(crate) fn store(&self) -> &Store {
        &self.shared.store
    }

    /// The rules the request path follows.
    pub(crate) fn policy(&self) -> &Policy {
        &self.shared.policy
    }

    /// How long this handle's holds lasted lately.
    pub(crate) fn holds(&self) -> &Arc<HoldTimes> {
        &self.shared.holds
    }

    /// The batches this handle's requests hold now.
    pub(crate) fn batches(&self) -> &Arc<Batches> {
        &self.shared.batches
    }

    /// Where the store's outage is logged.
    pub(crate) fn outage(&self) -> &Arc<OutageLog> {
        &self.shared.outage
    }

    /// How long locks live if nobody releases them (a crashed process, a lost release).
    /// Default 30 s. Choose it longer than the slowest handler: a lock that expires while
    /// its handler still runs no longer keeps others out. A grant whose answer comes a TTL
    /// (less the store's drift allowance) after its attempt began is released and answered
    /// 503: a batch granted in steps or node by node may have lost its first keys by then.
    ///
    /// # Panics
    ///
    /// If `ttl` is shorter than a millisecond, the store's resolution.
    pub fn ttl(self, ttl: Duration) -> Self {
        assert!(
            ttl >= Duration::from_millis(1),
            "a lock TTL must be at least 1 ms"
        );
        self.tune(|p| p.ttl = capped(ttl))
    }

    /// The namespace in front of every key in the store. Default `lock:`. The prefix alone
    /// names the namespace's fencing counter (never a lock: empty keys are refused).
    ///
    /// # Panics
    ///
    /// If `prefix` is empty: client-supplied keys would then name any key in the store.
    /// If it starts `tower-batch-lock:`, or that name starts with it (`tower-`, say): a
    /// client's key could then name the store's own keys (the waiters' claims on Redis),
    /// and break every call.
    pub fn prefix(self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        assert!(
            !prefix.is_empty(),
            "a lock prefix must not be empty: it keeps client keys apart from other data"
        );
        assert!(
            !OWN_NAMES.starts_with(&prefix) && !prefix.starts_with(OWN_NAMES),
            "a lock prefix must keep client keys apart from the store's own names, which \
             start {OWN_NAMES:?}: {prefix:?} does not"
        );
        if self.store().locks.spreads_by_hash_slot() && has_hash_tag(&prefix) {
            tracing::warn!(
                prefix,
                "the lock prefix has a Redis hash tag ({{...}}): every lock key is in one \
                 hash slot, on one master of the cluster, which then serves every batch \
                 alone; use a prefix without braces"
            );
        }
        self.tune(|p| p.keys.prefix = prefix.into())
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
    /// learn of. A big batch that waited in line on a shared Redis store may be answered
    /// with one key and "at least 1 of the N resources ... is held": under contention, a
    /// waiter joins the line on the first key it finds held, without counting the rest.
    pub fn max_named_conflicts(self, at_most: usize) -> Self {
        self.tune(|p| p.max_named_conflicts = at_most)
    }

    /// How long one call to the store may take in all (pool checkout and command) before
    /// the request gets 503. Default 2 s.
    ///
    /// # Panics
    ///
    /// If `timeout` is zero: no store could answer, and every request would get 503.
    pub fn store_timeout(self, timeout: Duration) -> Self {
        assert!(!timeout.is_zero(), "a store timeout must not be zero");
        self.tune(|p| p.store_timeout = capped(timeout))
    }

    /// Whether a request whose extractor finds no keys is refused with a 400 problem+json
    /// whose `limit` is `no_keys` (`true`, the default), or passes through unlocked
    /// (`false`).
    ///
    /// Refused by default because a handler that needs its locks must not run without
    /// them: an order with no lines, a missing header. Turn it off for a route whose keys
    /// are optional (an extractor that finds none on some requests on purpose), and take
    /// `Option<Lease>` in its handler.
    pub fn require_keys(self, require: bool) -> Self {
        self.tune(|p| p.require_keys = require)
    }

    /// The same locks, whose layer holds every key shared.
    pub(crate) fn all_shared(self) -> Self {
        self.tune(|p| p.all_shared = true)
    }

    /// Whether a request whose keys are busy is refused at once (the default) or waits for
    /// them, up to a bound, and in order of arrival unless [`Wait::fair`] says otherwise. A
    /// layer can set its own with [`LockLayer::wait`].
    pub fn wait(self, wait: Wait) -> Self {
        self.tune(|p| p.wait = wait)
    }

    /// How many requests may wait for their keys at once, across every layer of these
    /// locks (and of the handles made from them with the builder methods). Default 1,024.
    ///
    /// A request that would have to wait while that many already do is refused at once
    /// with `503 Service Unavailable`, `Retry-After: 1` and a problem+json body whose
    /// `limit` member is `"max_waiters"`: this process is overloaded, and a client does
    /// better to come back than to queue behind a line that cannot drain within its wait.
    /// It holds and reserves nothing, and counts as `unavailable` in the metrics' outcomes
    /// (with the reason in the logs, at `DEBUG`).
    ///
    /// A waiter costs the process a task, and the store a poll every 1-2 s (it is woken at
    /// its turn, and polls only for what no release announces); on Redis, every waiter on
    /// a key is an entry in that key's value, which the key's every script reads. Measured
    /// on one Redis (`waiting::a_line_of_waiters_costs_at_most_a_poll_a_waiter_a_second`,
    /// `LINE_WAITERS=n`), n waiters in line behind one held key cost Redis's main thread
    /// 8, 24, 57 and 192 ms a second for n = 64, 256, 512 and 1,024, and the line took 0.06,
    /// 0.12, 0.28 and 1.4 s to form (each waiter that joins rewrites the line). The default
    /// stops there, where one line costs a fifth of Redis; set it near the number of
    /// requests your [`Wait`] bound can let through.
    ///
    /// # Panics
    ///
    /// If `max` is zero: use [`Wait::none`] for requests that never wait.
    pub fn max_waiters(self, max: usize) -> Self {
        assert!(
            max > 0,
            "max_waiters must be at least 1; use Wait::none() instead"
        );
        self.tune(|p| p.max_waiters = max)
    }

    /// A place among the requests that wait (see [`max_waiters`](Self::max_waiters)),
    /// given back when dropped; `None` when they are all taken.
    pub(crate) fn start_waiting(&self) -> Option<WaiterSlot> {
        let waiting = &self.shared.waiting;
        let max = self.shared.policy.max_waiters;
        waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| WaiterSlot(waiting.clone()))
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
    ///
    /// The renewal starts from the response future, when it is polled a third of the TTL
    /// after the grant (no task is spawned for the many requests that end sooner): a
    /// handler that blocks its thread (synchronous work, not `spawn_blocking`) past the
    /// TTL keeps it from running, and loses its keys. Run blocking work in
    /// `tokio::task::spawn_blocking`, as tokio asks of every async handler.
    pub fn renew_lease(self, renew: bool) -> Self {
        self.tune(|p| p.renew = renew)
    }

    /// With [`renew_lease`](Self::renew_lease), stops renewing once the keys have been held
    /// this long (waiting for them does not count); they then expire with their TTL, and
    /// the lease is lost (logged and counted as every lost lease, unless the request
    /// ended first). Default 5 minutes: a hung handler does not hold its keys for
    /// good. `Duration::MAX` removes the limit (a century, as every duration setting at
    /// most).
    pub fn max_hold(self, max: Duration) -> Self {
        self.tune(|p| p.max_hold = Some(capped(max)))
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
    /// use axum::http::{request::Parts, HeaderName};
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
    /// [store timeout](Self::store_timeout), and has what the locks need (for Redis:
    /// version 7.0 or later, and the crate's function library loads, which a user without
    /// `FUNCTION LOAD` may not do; for Redlock: a majority of the masters
    /// pass that check). For readiness probes, and for `main` before it serves:
    ///
    /// ```no_run
    /// use tower_batch_lock::{store, Locks};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let locks = Locks::new(store::Redis::url("redis://127.0.0.1/").build()?);
    /// // When Redis is down: "the lock store cannot serve locks: ..."
    /// locks.check().await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// A [`StoreError`] that says what is wrong.
    pub async fn check(&self) -> Result<(), StoreError> {
        let timeout = self.policy().store_timeout;
        match tokio::time::timeout(timeout, self.store().locks.check()).await {
            Ok(checked) => {
                checked.map_err(|error| error.context("the lock store cannot serve locks"))
            }
            Err(_) => Err(StoreError::timed_out(timeout)),
        }
    }

    /// Builds the responses this layer refuses requests with, instead of the default
    /// problem+json ones: contention, an unavailable store, keys over the limits, no keys
    /// with [`require_keys`](Self::require_keys), and a lost lease with
    /// [`OnLostLease::Cancel`]. The [`Rejection`] says which (its
    /// [`status`](Rejection::status), [`detail`](Rejection::detail)), and
    /// `rejection.into_response()` gives the default, to change a part of it. An
    /// extractor's own refusals (a body that is not JSON, say) are already responses, and
    /// are sent as they are.
    ///
    /// ```
    /// use axum::response::{IntoResponse, Response};
    /// use axum::http::{header, HeaderValue};
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
    pub(crate) fn refuse(&self, rejection: Rejection) -> Response {
        let refused = rejection.refused();
        let mut response = match &self.policy().refusal {
            Some(build) => (build.0)(rejection),
            None => rejection.into_response(),
        };
        response.extensions_mut().insert(refused);
        response
    }

    /// The name of these locks in metrics (the `layer` label; see the crate's
    /// [metrics](crate#metrics) table). By default a request's metrics carry the route it matched: a name groups
    /// several routes, or tells apart two layers on one route. Choose a fixed word, never
    /// anything from a request.
    pub fn metrics_label(self, label: impl Into<String>) -> Self {
        let label = label.into();
        self.tune(|p| p.metrics_label = Some(label))
    }

    /// How long the namespace prefix is, to show keys without it.
    pub(crate) fn prefix_len(&self) -> usize {
        self.policy().keys.prefix.len()
    }

    /// The key policy: prefix and limits, to normalize keys as requests' are.
    pub(crate) fn key_policy(&self) -> &KeyPolicy {
        &self.policy().keys
    }

    /// How long a lease lasts unless renewed ([`Locks::ttl`]).
    #[cfg(feature = "idempotency")]
    pub(crate) fn lease_ttl(&self) -> Duration {
        self.policy().ttl
    }

    /// How long one call to the store may take ([`Locks::store_timeout`]).
    pub(crate) fn call_timeout(&self) -> Duration {
        self.policy().store_timeout
    }
}

impl fmt::Debug for Locks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locks")
            .field("store", self.store())
            .field("policy", self.policy())
            .finish_non_exhaustive()
    }
}

/// One request's place among those that wait ([`Locks::start_waiting`]).
#[derive(Debug)]
pub(crate) struct WaiterSlot(Arc<AtomicUsize>);

impl Drop for WaiterSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Whether every key that starts with `prefix` hashes by the prefix alone on a Redis
/// Cluster: Redis hashes the part between the first `{` and the next `}`, when it is not
/// empty.
fn has_hash_tag(prefix: &str) -> bool {
    let Some(open) = prefix.find('{') else {
        return false;
    };
    prefix[open + 1..].find('}').is_some_and(|close| close > 0)
}

#[cfg(test)]
mod tests {
    use super::has_hash_tag;

    #[test]
    fn a_hash_tag_is_a_non_empty_part_between_the_first_brace_and_the_next() {
        assert!(has_hash_tag("{locks}:"));
        assert!(has_hash_tag("app:{a}{b}:"));
        assert!(!has_hash_tag("lock:"));
        assert!(
            !has_hash_tag("{}lock:"),
            "an empty tag: the whole key is hashed"
        );
        assert!(
            !has_hash_tag("lock{"),
            "closed by the client's key, not by the prefix"
        );
        assert!(!has_hash_tag("lock}{"));
    }
}
