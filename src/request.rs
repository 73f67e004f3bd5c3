//! The request path: extract → normalize → acquire → guard, for each request a
//! [`LockService`](crate::middleware::LockService) sees. The configuration it follows is
//! [`Locks`]'s; the waiting is [`acquire`]'s.

use std::{fmt, sync::Arc, time::Instant};

use axum::{extract::MatchedPath, response::Response};
use futures_util::future::BoxFuture;
use http::{Request, StatusCode};
use tracing::Span;

use crate::{
    acquire::{Acquisition, Granted},
    keys::{
        extractor::{Extracted, KeyExtractor},
        normalize::{normalize, Batch},
    },
    lease::Lease,
    locks::{Locks, OnLostLease},
    observe::{self, Labels, Layer, Outcome},
    owner::{ExtraHolds, RequestGuard, RequestOwner},
    rejection::{Refused, Rejection},
    store::contract::{Modes, OwnerToken},
    unrouted,
};

/// Extracts, normalizes and acquires the keys of one request: the work before the inner
/// service runs. Gives back the request with its guard (none when there are no keys),
/// or the response that refuses it: at once where the keys are in the request's head and
/// the store answers at once, and otherwise as a future.
pub(crate) fn lock<B, E>(
    locks: &Locks,
    labels: &Labels,
    extractor: &E,
    request: Request<B>,
    span: Span,
) -> Locking<B>
where
    B: Send + 'static,
    E: KeyExtractor<B>,
{
    // Named before the extractor takes the request: a refused one is counted too.
    let policy = locks.policy();
    let route = request.extensions().get::<MatchedPath>();
    let name = policy.metrics_label.as_deref();
    let layer = labels.of(name.or(route.map(MatchedPath::as_str)), policy.all_shared);
    let (request, unrouted) = unrouted::request_matched_no_route(request);
    if unrouted {
        // The router's fallback answers it (see `unrouted`): nothing to lock, nothing to
        // count.
        span.record("outcome", "unrouted");
        return Locking::Now(Ok((request, None)));
    }
    let extracting = match extractor.extract_now(request) {
        Ok(extracted) => {
            let pending = match admit(locks, extracted, layer, &span) {
                Ok(Admitted::Keys(pending)) => pending,
                Ok(Admitted::Unlocked(request)) => return Locking::Now(Ok((request, None))),
                Err(refusal) => return Locking::Now(Err(refusal)),
            };
            if let Some(acquired) = pending.claim.acquire_now(locks, &span) {
                return Locking::Now(pending.hold(locks, acquired));
            }
            let locks = locks.clone();
            return Locking::Later(Box::pin(async move { pending.lock(&locks, &span).await }));
        }
        Err(extracting) => extracting,
    };
    let locks = locks.clone();
    Locking::Later(Box::pin(async move {
        match admit(&locks, extracting.await, layer, &span)? {
            Admitted::Keys(pending) => pending.lock(&locks, &span).await,
            Admitted::Unlocked(request) => Ok((request, None)),
        }
    }))
}

/// How a request's locking goes on: decided already, or a future that decides it.
// Made once per request and taken apart at once: boxing the large variant would bring back
// the allocation that it saves.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Locking<B> {
    Now(Locked<B>),
    Later(BoxFuture<'static, Locked<B>>),
}

/// A request whose keys the layer is to lock.
enum Admitted<B> {
    Keys(Pending<B>),
    /// It names none, and the layer lets such requests through.
    Unlocked(Request<B>),
}

/// An admitted request, and what it claims.
struct Pending<B> {
    request: Request<B>,
    claim: Claim,
}

/// A request's keys, in order, and their owner.
struct Claim {
    keys: Arc<[String]>,
    modes: Modes,
    owner: Arc<RequestOwner>,
    /// Whether this layer made the owner, and so gives back the handler's holds too.
    made_here: bool,
    /// Whether the owner holds keys already (see [`Line::Holder`](crate::store::contract::Line)).
    holds_keys: bool,
    layer: Layer,
}

/// Checks and normalizes the keys the extractor found, and finds the request's owner.
fn admit<B>(
    locks: &Locks,
    extracted: Extracted<B>,
    layer: Layer,
    span: &Span,
) -> Result<Admitted<B>, Response> {
    let policy = locks.policy();
    let rejected = || {
        span.record("outcome", "rejected");
        observe::outcome(&layer, Outcome::Rejected, None);
    };
    let (mut request, keys) = extracted.map_err(|mut refusal| {
        rejected();
        // The extractor refused the request before it ran: a layer around this one (the
        // idempotency layer) must not keep the answer, so that the corrected request runs.
        refusal
            .extensions_mut()
            .insert(Refused { contended: false });
        refusal
    })?;
    let Batch { keys, modes } =
        normalize(keys, &policy.keys, policy.all_shared).map_err(|rejection| {
            rejected();
            locks.refuse(rejection)
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
            return Err(locks.refuse(rejection));
        }
        span.record("outcome", "unlocked");
        return Ok(Admitted::Unlocked(request));
    }

    // One owner per request: an outer layer's (its lease names it), a trusted caller's, or
    // a new one. This layer's lease names it to the layers inside.
    let existing = request.extensions().get::<Lease>().map(Lease::owner);
    // An owner from an outer layer or a trusted caller already holds keys.
    let (owner, made_here, holds_keys) = match existing {
        Some(owner) => (owner.clone(), false, true),
        None => {
            let trusted;
            (request, trusted) = trusted_owner(locks, request);
            let token = trusted.unwrap_or_else(OwnerToken::random);
            (RequestOwner::new(token), true, trusted.is_some())
        }
    };

    let layer = layer.holding(&modes);
    observe::batch(&layer, keys.len());
    let claim = Claim {
        keys,
        modes,
        owner,
        made_here,
        holds_keys,
        layer,
    };
    Ok(Admitted::Keys(Pending { request, claim }))
}

impl Claim {
    /// [`Acquisition::acquire_now`]: the store's first answer, where it is at once and
    /// settles.
    fn acquire_now(&self, locks: &Locks, span: &Span) -> Option<Result<Granted, Rejection>> {
        self.acquisition(locks).acquire_now(self.owner.token, span)
    }

    /// [`Acquisition::acquire`]: until granted, refused or out of time, waiting as the
    /// policy says.
    async fn acquire(&self, locks: &Locks, span: &Span) -> Result<Granted, Rejection> {
        self.acquisition(locks)
            .acquire(self.owner.token, span)
            .await
    }

    fn acquisition<'a>(&'a self, locks: &'a Locks) -> Acquisition<'a> {
        let layer = Some(&self.layer);
        let holder_since = self.holds_keys.then(|| self.owner.arrived());
        Acquisition::new(locks, &self.keys, &self.modes, holder_since, layer)
    }
}

impl<B> Pending<B> {
    /// Acquires the keys, waiting as the policy says, and holds them.
    async fn lock(self, locks: &Locks, span: &Span) -> Locked<B> {
        let acquired = self.claim.acquire(locks, span).await;
        self.hold(locks, acquired)
    }

    /// The request with its hold on the keys `acquired` granted, or the response that
    /// refuses it.
    fn hold(self, locks: &Locks, acquired: Result<Granted, Rejection>) -> Locked<B> {
        let Self {
            mut request,
            claim:
                Claim {
                    keys,
                    modes,
                    owner,
                    made_here,
                    layer,
                    ..
                },
        } = self;
        let policy = locks.policy();
        // The hold, and `max_hold`, count from the grant: the time spent waiting for the keys
        // is not holding.
        let Granted {
            mut guard,
            fencing_token,
            started,
            at: granted_at,
        } = acquired.map_err(|rejection| locks.refuse(rejection))?;
        owner.granted(started);
        // The handler's view of its locks, and of those of the layers around this one, for
        // the request's extensions (a granted guard is always armed, so there is one).
        let lease = guard.status().map(|status| {
            Lease::new(
                keys.clone(),
                modes.clone(),
                fencing_token,
                status,
                locks.clone(),
                owner.clone(),
            )
            .inside(&request)
        });
        guard.time_into(locks.holds().clone(), layer, granted_at);
        let listed =
            locks
                .batches()
                .register(&request, keys.len(), modes.shared(keys.len()), granted_at);
        if let Some(entry) = listed {
            guard.list_in(entry);
        }
        // The response future starts the renewal if the request still holds its keys when
        // the first extension is due.
        let renew_at = if policy.renew {
            let until = policy.max_hold.and_then(|max| granted_at.checked_add(max));
            guard.renew_later(policy.ttl, until, granted_at)
        } else {
            None
        };
        let cancel_on_loss = lease
            .as_ref()
            .filter(|_| policy.on_lost_lease == OnLostLease::Cancel)
            .map(|lease| {
                let (lease, locks) = (lease.clone(), locks.clone());
                Box::pin(async move {
                    lease.lost_cancelling().await;
                    tracing::warn!("lease lost while the handler ran; cancelling it");
                    locks.refuse(Rejection::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the locks of this request were lost before it finished; try again",
                    ))
                }) as BoxFuture<'static, Response>
            });
        if let Some(lease) = lease {
            request.extensions_mut().insert(lease);
        }
        // The layer that made the owner gives back the handler's holds too.
        let runs_from = owner.runs_from();
        let extra = made_here.then(|| ExtraHolds(owner.clone()));
        Ok((
            request,
            Some(Holding {
                guard: RequestGuard {
                    guard,
                    extra,
                    owner,
                    runs_from,
                },
                cancel_on_loss,
                until_body_end: policy.hold_until_body_end,
                renew_at,
            }),
        ))
    }
}

/// The owner token a trusted caller sent, if this service trusts the header and the
/// caller; and the request back.
fn trusted_owner<B>(locks: &Locks, request: Request<B>) -> (Request<B>, Option<OwnerToken>) {
    let Some(header) = &locks.policy().trusted_owner_header else {
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
