//! What a request holds, as its handler sees it.

use std::{convert::Infallible, fmt, sync::Arc, time::Instant};

use axum::extract::{FromRequestParts, MatchedPath, OptionalFromRequestParts};
use http::{request::Parts, HeaderValue, StatusCode};
use tracing::Span;

use crate::{
    acquire::{Acquisition, Granted},
    guard::LeaseState,
    keys::{
        extractor::Key,
        normalize::{normalize, Batch},
    },
    locks::Locks,
    log_once::error_once_for,
    owner::RequestOwner,
    rejection::Rejection,
    store::contract::{FencingToken, Mode, Modes},
};

/// The locks a request holds, as its handler sees them.
///
/// The layer puts a `Lease` into the request's extensions before it calls the inner
/// service, and a handler takes it like any axum extractor:
///
/// ```
/// use tower_batch_lock::Lease;
///
/// async fn handler(lease: Lease) -> String {
///     // Stop writing when the locks no longer protect this request.
///     tokio::select! {
///         _ = lease.lost() => "lease lost: stopped".to_owned(),
///         done = work(lease.fencing_token().get()) => done,
///     }
/// }
/// # async fn work(_fence: u64) -> String { String::new() }
/// ```
///
/// A request that names no keys passes the layer unlocked and has no lease (unless
/// [`Locks::require_keys`] refuses it), and neither has a request on a route without a
/// [`LockLayer`](crate::LockLayer). Where that is expected, take `Option<Lease>`: `None`
/// then. Where it is not, `Lease` answers with a `500 Internal Server Error` in
/// problem+json ([`Rejection`]) and logs an error that says why (once a route; its repeats
/// at debug level), instead of running the handler without its locks.
/// `axum::Extension<Lease>` works too, with axum's plain-text rejection.
///
/// ```
/// use tower_batch_lock::Lease;
///
/// async fn handler(lease: Option<Lease>) -> String {
///     match lease {
///         Some(lease) => format!("locked {} keys", lease.keys().len()),
///         None => "named nothing to lock".to_owned(),
///     }
/// }
/// ```
///
/// A request under several layers (two lock layers, the idempotency layer around a lock
/// layer) has one lease that speaks for all of them: the innermost layer's, which knows
/// those around it. Its [`keys`](Self::keys) are all the keys the layers hold, it
/// [expires](Self::expires_at) with the earliest of their holds, and it is
/// [lost](Self::lost) when any of them is.
///
/// It only describes the locks: the layer releases them when the response is ready (or
/// its body has ended, with [`Locks::hold_until_body_end`](crate::Locks::hold_until_body_end)),
/// or when the request is dropped (or, with an idempotency layer inside, when the run it
/// finishes for a client that left ends), however long a copy of the lease lives.
///
/// Its `Debug` output is what a log line needs: the keys (the first 20 of a larger batch,
/// and how many more), the fencing token, the time left until expiry and whether the lease
/// is lost.
#[derive(Clone)]
pub struct Lease {
    keys: Arc<[String]>,
    modes: Modes,
    fencing_token: FencingToken,
    status: Arc<LeaseState>,
    /// The rules and the store these locks came from, for [`Lease::lock`].
    locks: Locks,
    owner: Arc<RequestOwner>,
    /// The lease of the holds around this one: an outer lock layer's (with those around
    /// it), the idempotency layer's in-flight hold.
    enclosing: Option<Arc<Lease>>,
    /// Whether losing this hold cancels a lock layer's inner service, where the layer's
    /// [`on_lost_lease`](Locks::on_lost_lease) says so: not the idempotency layer's
    /// in-flight hold (see [`Locks::idempotency`](crate::Locks::idempotency)).
    cancels: bool,
}

/// A hold around the request that is not its owner's, for the lock layers inside to count
/// in their leases: the idempotency layer's in-flight lock, where no lock layer is outside
/// it (one that is gets it in its own lease, [`Lease::within`]).
#[derive(Clone)]
pub(crate) struct Enclosing(pub(crate) Lease);

impl Lease {
    pub(crate) fn new(
        keys: Arc<[String]>,
        modes: Modes,
        fencing_token: FencingToken,
        status: Arc<LeaseState>,
        locks: Locks,
        owner: Arc<RequestOwner>,
    ) -> Self {
        Self {
            keys,
            modes,
            fencing_token,
            status,
            locks,
            owner,
            enclosing: None,
            cancels: true,
        }
    }

    /// This lease, inside the holds of the request that it came with: an outer layer's
    /// lease, or an [`Enclosing`] hold.
    pub(crate) fn inside<B>(mut self, request: &http::Request<B>) -> Self {
        let extensions = request.extensions();
        let outer = extensions.get::<Lease>().cloned();
        self.enclosing = outer
            .or_else(|| extensions.get::<Enclosing>().map(|e| e.0.clone()))
            .map(Arc::new);
        self
    }

    /// This hold, whose loss never cancels a lock layer's inner service (it still counts
    /// in [`lost`](Self::lost) and [`expires_at`](Self::expires_at)).
    #[cfg(feature = "idempotency")]
    pub(crate) fn never_cancelling(mut self) -> Self {
        self.cancels = false;
        self
    }

    /// This lease, with `hold` among the holds around it.
    #[cfg(feature = "idempotency")]
    pub(crate) fn within(&self, hold: Lease) -> Self {
        let enclosing = match &self.enclosing {
            Some(enclosing) => enclosing.within(hold),
            None => hold,
        };
        Self {
            enclosing: Some(Arc::new(enclosing)),
            ..self.clone()
        }
    }

    /// This lease and those around it.
    fn chain(&self) -> impl Iterator<Item = &Lease> {
        std::iter::successors(Some(self), |lease| lease.enclosing.as_deref())
    }

    /// This hold's keys, without the namespace prefix, with their modes.
    fn own_keys(&self) -> impl Iterator<Item = (&str, Mode)> {
        let prefix_len = self.locks.prefix_len();
        let modes = (0..self.keys.len()).map(|i| self.modes.at(i));
        self.keys.iter().map(move |k| &k[prefix_len..]).zip(modes)
    }

    /// The request's owner, which every lock layer on the request shares.
    pub(crate) fn owner(&self) -> &Arc<RequestOwner> {
        &self.owner
    }

    /// Locks more keys for this request, all or none, under the same rules (prefix,
    /// limits, TTL, renewal, wait policy) as the layer that granted this lease. Strings
    /// are locked exclusively, and [`Key::shared`] keys shared, whatever the layer's mode.
    /// Keys the request already holds are entered again, not contended; a key it holds
    /// shared with others and asks for exclusively is refused at once (see [`Mode`]).
    /// They are released with the request, or earlier with [`HeldKeys::release`].
    ///
    /// ```
    /// use tower_batch_lock::{keys::Key, Lease, Rejection};
    ///
    /// async fn checkout(lease: Lease) -> Result<String, Rejection> {
    ///     // Halfway through, the handler learns it must also lock the customer's account,
    ///     // and read the customer's tier, which other requests read too.
    ///     let more = lease.lock([Key::from("account:7"), Key::shared("tier:gold")]).await?;
    ///     Ok(format!("under fence {}", more.lease().fencing_token()))
    /// }
    /// ```
    ///
    /// # Errors
    ///
    /// The [`Rejection`] the layer would have answered: contention (after waiting, if the
    /// policy waits), an unavailable store, or keys that break the limits; and a 500 once
    /// the request has ended (a task of the handler's that outlived it), whose keys would
    /// be held with nobody to release them.
    pub async fn lock<I>(&self, keys: I) -> Result<HeldKeys, Rejection>
    where
        I: IntoIterator,
        I::Item: Into<Key>,
    {
        let keys = keys.into_iter().map(Into::into).collect();
        lock_for(&self.locks, &self.owner, keys).await
    }

    /// The request's owner token, to send to a downstream service that shares the lock
    /// store and trusts this one ([`Locks::trust_owner_header`]), so that it re-enters the
    /// keys this request holds instead of contending with them.
    ///
    /// The token is a capability: whoever presents it can re-enter, and so release its own
    /// holds on, every key this request holds. Send it only over channels you trust, to
    /// services that only accept it from you.
    pub fn owner_header_value(&self) -> HeaderValue {
        HeaderValue::try_from(self.owner.token.as_hex())
            .expect("hex digits are a valid header value")
    }

    /// The keys held, by this layer and the layers around it: sorted, each once, without
    /// the namespace prefix.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        let mut keys: Vec<&str> = self
            .chain()
            .flat_map(|lease| lease.own_keys().map(|(key, _)| key))
            .collect();
        if self.enclosing.is_some() {
            keys.sort_unstable();
            keys.dedup();
        }
        keys.into_iter()
    }

    /// How the request holds `key` (named as in [`keys`](Self::keys)), or `None` when it
    /// does not hold it: exclusively when any layer holds it so.
    pub fn mode_of(&self, key: &str) -> Option<Mode> {
        let modes = self.chain().filter_map(|lease| lease.own_mode_of(key));
        modes.reduce(|a, b| if a == Mode::Exclusive { a } else { b })
    }

    /// How this hold, not those around it, holds `key`.
    fn own_mode_of(&self, key: &str) -> Option<Mode> {
        // One prefix in front of every key: sorted with it, sorted without it.
        let prefix_len = self.locks.prefix_len();
        let index = self
            .keys
            .binary_search_by(|held| held[prefix_len..].cmp(key))
            .ok()?;
        Some(self.modes.at(index))
    }

    /// What a transaction in the locks' PostgreSQL database needs to check, where it
    /// writes, that this request still holds this layer's keys
    /// ([`PostgresGuard`](crate::store::PostgresGuard) says how).
    #[cfg(feature = "postgres")]
    pub fn postgres_guard(&self) -> crate::store::PostgresGuard {
        crate::store::PostgresGuard {
            keys: self.keys.to_vec(),
            owner: self.owner.token.as_hex(),
        }
    }

    /// The fencing token of this layer's grant. The layers around it were granted before,
    /// from the same counter where they share its store and prefix: this token is then
    /// larger than theirs, and than every earlier grant's on any of the [keys](Self::keys).
    pub fn fencing_token(&self) -> FencingToken {
        self.fencing_token
    }

    /// When the locks expire if they are not renewed again: the TTL counted from the
    /// moment the last acquisition or renewal was sent, so the real expiry in the store is
    /// never earlier; the earliest of those of the layers around this one. With
    /// [`Redlock`](crate::store::Redlock) it is the validity deadline, sooner by the
    /// allowance for clock drift between the masters (`ttl / 100 + 2 ms`).
    pub fn expires_at(&self) -> Instant {
        let expiries = self.chain().map(|lease| lease.status.get().expires_at);
        expiries.min().expect("a lease is in its own chain")
    }

    /// Whether the locks no longer protect the request: this layer's or one around it was
    /// lost or ran out, or released.
    pub fn is_lost(&self) -> bool {
        let now = Instant::now();
        self.chain().any(|lease| {
            let status = lease.status.get();
            status.lost || status.ended || now >= status.expires_at
        })
    }

    /// Resolves when the locks no longer protect the request: a renewal found them gone or
    /// taken, or could not reach the store before the lease ran out, or the lease expired
    /// without renewal, or the layer released it; this layer's, or one around it.
    ///
    /// Select on it around work that must stop when the locks are gone.
    pub async fn lost(&self) {
        if self.enclosing.is_none() {
            return self.own_lost().await;
        }
        self.any_lost(|_| true).await;
    }

    /// [`lost`](Self::lost), of the holds whose loss cancels a lock layer's inner service
    /// (every hold but the idempotency layer's in-flight one).
    pub(crate) async fn lost_cancelling(&self) {
        self.any_lost(|lease| lease.cancels).await;
    }

    /// Resolves when one of the holds of the chain that `counts` is lost; never, if it
    /// counts none.
    async fn any_lost(&self, counts: impl Fn(&Lease) -> bool) {
        let each: Vec<_> = self
            .chain()
            .filter(|lease| counts(lease))
            .map(|lease| Box::pin(lease.own_lost()))
            .collect();
        if each.is_empty() {
            return std::future::pending().await;
        }
        futures_util::future::select_all(each).await;
    }

    /// [`lost`](Self::lost) for this hold alone.
    async fn own_lost(&self) {
        loop {
            let changed = self.status.changed();
            let status = self.status.get();
            if status.lost || status.ended {
                return;
            }
            // Renewed (or lost, or ended): look again. Expired without renewal: lost.
            if tokio::time::timeout_at(status.expires_at.into(), changed)
                .await
                .is_err()
            {
                return;
            }
        }
    }
}

/// How many keys `Debug` shows: a lease can hold thousands, and a log line should not.
const DEBUG_KEYS: usize = 20;

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The time left reads at a glance where an `Instant` does not; the store, the owner
        // and the shared state say nothing a reader of the lease can act on.
        let expires_in = self.expires_at().saturating_duration_since(Instant::now());
        f.debug_struct("Lease")
            .field("keys", &DebugKeys(self))
            .field("fencing_token", &self.fencing_token.get())
            .field("expires_in", &expires_in)
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// The first [`DEBUG_KEYS`] keys of a lease, and how many more it holds.
struct DebugKeys<'a>(&'a Lease);

impl fmt::Debug for DebugKeys<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let keys = self.0.keys();
        let more = keys.len().saturating_sub(DEBUG_KEYS);
        let mut list = f.debug_list();
        list.entries(keys.take(DEBUG_KEYS));
        if more > 0 {
            list.entry(&format_args!("... and {more} more"));
        }
        list.finish()
    }
}

/// `lease: Lease` in a handler: the lease the layer granted, or a problem+json 500.
impl<S: Send + Sync> FromRequestParts<S> for Lease {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or_else(|| {
            // A mistake in the server, not the client's: say what to change, where the
            // developer looks, once a route.
            // Once a route: a request no route matched (a fallback) counts as one, whatever
            // its path, which the client chose.
            let route = parts
                .extensions
                .get::<MatchedPath>()
                .map_or("", MatchedPath::as_str);
            error_once_for!(
                route,
                method = %parts.method,
                path = %parts.uri.path(),
                "the handler takes a Lease, but the request holds no locks: the route has no \
                 LockLayer, or the request named no keys (take Option<Lease> where that is \
                 expected, or refuse such requests with Locks::require_keys)"
            );
            Rejection::missing_lease()
        })
    }
}

/// `lease: Option<Lease>` in a handler: `None` when the request holds no locks.
impl<S: Send + Sync> OptionalFromRequestParts<S> for Lease {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Option<Self>, Infallible> {
        Ok(parts.extensions.get::<Self>().cloned())
    }
}

/// The refusal of [`Lease::lock`] once the request has ended: its keys would be held with
/// nobody to release them.
fn request_ended() -> Rejection {
    Rejection::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the request these locks were for has ended: a lease locks keys only while its \
         request runs",
    )
}

/// Locks more keys for a request's owner, for [`Lease::lock`].
async fn lock_for(
    locks: &Locks,
    owner: &Arc<RequestOwner>,
    keys: Vec<Key>,
) -> Result<HeldKeys, Rejection> {
    if owner.ended() {
        return Err(request_ended());
    }
    let policy = locks.policy();
    let Batch { keys, modes } = normalize(keys, &policy.keys, false)?;
    if keys.is_empty() {
        let detail = "there are no keys to lock".to_owned();
        return Err(Rejection::limit(StatusCode::BAD_REQUEST, "no_keys", detail));
    }
    let Granted {
        mut guard,
        fencing_token,
        at,
        ..
    } = Acquisition::new(locks, &keys, &modes, Some(owner.arrived()), None)
        .acquire(owner.token, &Span::current())
        .await?;
    if policy.renew {
        let until = policy.max_hold.and_then(|max| at.checked_add(max));
        guard.renew(policy.ttl, until, at);
    }
    let (Some(status), Some(hold)) = (guard.status(), guard.hold()) else {
        unreachable!("a granted guard is armed");
    };
    let lease = Lease::new(
        keys,
        modes,
        fencing_token,
        status,
        locks.clone(),
        owner.clone(),
    );
    // The request ended while the acquisition was under way: dropped, the guard
    // releases in the background.
    owner
        .keep(hold, guard)
        .map_err(|_released| request_ended())?;
    Ok(HeldKeys {
        lease,
        hold,
        owner: owner.clone(),
    })
}

/// Keys a handler locked with [`Lease::lock`]: they belong to the request, and are released
/// with it, or earlier with [`release`](Self::release). Dropping this handle does not
/// release them.
#[derive(Debug)]
pub struct HeldKeys {
    lease: Lease,
    hold: u64,
    owner: Arc<RequestOwner>,
}

impl HeldKeys {
    /// The lease of these keys: their fencing token, expiry and loss.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Releases these keys now rather than with the request. Keys the request also holds
    /// through a layer (or another [`Lease::lock`]) stay held by it.
    pub async fn release(self) {
        if let Some(guard) = self.owner.take(self.hold) {
            guard.release().await;
        }
    }
}
