//! One owner per request: shared by nested layers and by the handler's own acquisitions.

use std::{
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Instant,
};

use futures_util::future::{join_all, BoxFuture};

#[cfg(doc)]
use crate::lease::Lease;
use crate::{
    guard::LockGuard,
    store::contract::{OwnerToken, Ticket},
};

/// The owner of a request's locks, named by the [`Lease`] in the request's extensions: every
/// layer on the request locks under it, so a key an outer layer holds is re-entered by an
/// inner one instead of contended, and so are keys the handler locks through its lease.
#[derive(Debug)]
pub(crate) struct RequestOwner {
    pub(crate) token: OwnerToken,
    /// When the acquisition that first granted the owner keys started (a clock read the
    /// acquisition already made, rather than a ticket taken for every request): its place
    /// in line on keys it does not hold yet, when it locks more (see
    /// [`Line::Holder`](crate::store::contract::Line)). Not the grant's answer: a waiter
    /// that arrived while the grant was on its way, and that the grant then kept out, would
    /// be ahead of the owner on its next keys, and each would wait for the other.
    arrived_at: OnceLock<Instant>,
    /// The holds the handler took through [`Lease::lock`], released with the request.
    extra: Mutex<Vec<(u64, LockGuard)>>,
}

impl RequestOwner {
    pub(crate) fn new(token: OwnerToken) -> Arc<Self> {
        Arc::new(Self {
            token,
            arrived_at: OnceLock::new(),
            extra: Mutex::default(),
        })
    }

    /// Notes that the owner was granted keys by an acquisition that started at `started`
    /// (the first grant counts).
    pub(crate) fn granted(&self, started: Instant) {
        let _ = self.arrived_at.set(started);
    }

    /// The owner's place in line: the start of its first granted acquisition, or now,
    /// before it holds anything (a trusted caller's owner).
    pub(crate) fn arrived(&self) -> Ticket {
        self.arrived_at
            .get()
            .map_or_else(Ticket::take, |at| Ticket::since(at.elapsed()))
    }

    fn extra(&self) -> std::sync::MutexGuard<'_, Vec<(u64, LockGuard)>> {
        // Every change is one push or one removal: a poisoned list is still whole.
        self.extra.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn keep(&self, hold: u64, guard: LockGuard) {
        self.extra().push((hold, guard));
    }

    pub(crate) fn take(&self, hold: u64) -> Option<LockGuard> {
        let mut extra = self.extra();
        let at = extra.iter().position(|(h, _)| *h == hold)?;
        Some(extra.swap_remove(at).1)
    }

    fn take_all(&self) -> Vec<LockGuard> {
        self.extra().drain(..).map(|(_, guard)| guard).collect()
    }
}

/// The handler's extra holds of a request, given back when the request ends. Held by the
/// layer that made the request's owner; dropped early (the request was dropped), it drops
/// the guards, which release in the background.
#[derive(Debug)]
pub(crate) struct ExtraHolds(pub(crate) Arc<RequestOwner>);

impl ExtraHolds {
    /// Whether the handler took any.
    fn any(&self) -> bool {
        !self.0.extra().is_empty()
    }

    /// Takes the holds out, to release them now.
    pub(crate) fn take(&self) -> Vec<LockGuard> {
        self.0.take_all()
    }
}

impl Drop for ExtraHolds {
    fn drop(&mut self) {
        drop(self.0.take_all());
    }
}

/// Everything a request gives back when it ends: its layer's guard and, for the layer
/// that made the request's owner, the holds its handler took through its lease.
#[derive(Debug)]
pub(crate) struct RequestGuard {
    pub(crate) guard: LockGuard,
    pub(crate) extra: Option<ExtraHolds>,
}

impl RequestGuard {
    /// Starts the layer's deferred renewal (see [`LockGuard::renew_later`]).
    pub(crate) fn start_deferred_renewal(&mut self) {
        self.guard.start_deferred_renewal();
    }

    /// Releases the layer's hold without a future, as [`LockGuard::release_now`] does, where
    /// the handler took no holds of its own. Whether it did: otherwise the guard is as it
    /// was, for [`release`](Self::release).
    pub(crate) fn release_now(&mut self) -> bool {
        !self.extra.as_ref().is_some_and(ExtraHolds::any) && self.guard.release_now()
    }

    /// Releases the handler's holds and the layer's, as [`LockGuard::release`] does; what
    /// a drop midway leaves is released in the background.
    pub(crate) fn release(self) -> BoxFuture<'static, ()> {
        let Self { guard, extra } = self;
        Box::pin(async move {
            if let Some(extra) = &extra {
                join_all(extra.take().into_iter().map(LockGuard::release)).await;
            }
            guard.release().await;
        })
    }
}
