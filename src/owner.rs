//! One owner per request: shared by nested layers and by the handler's own acquisitions.

#[cfg(feature = "idempotency")]
use std::future::Future;
use std::{
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Instant,
};

use futures_util::future::{join_all, select, BoxFuture, Either};
use tokio::sync::watch;

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
    /// The holds the handler took through [`Lease::lock`], released with the request;
    /// `None` once the request ended, when a hold taken later has nobody to release it.
    extra: Mutex<Option<Vec<(u64, LockGuard)>>>,
    /// The runs of the request's inner service that go on in tasks of their own
    /// ([`run_apart`](Self::run_apart)), once there is one: most requests never have one.
    apart: OnceLock<watch::Sender<Apart>>,
}

/// The runs of a request that go on apart from its future, numbered as they start.
#[derive(Debug, Default)]
struct Apart {
    /// The number of the next run to start.
    next: u64,
    /// Those still running.
    running: Vec<u64>,
    /// The runs from this number on are cancelled (a layer around them lost its lease and
    /// cancels its inner service).
    cancelled_from: Option<u64>,
}

impl Apart {
    /// Whether a run numbered `from` or later is still running.
    fn running_from(&self, from: u64) -> bool {
        self.running.iter().any(|&n| n >= from)
    }
}

impl RequestOwner {
    pub(crate) fn new(token: OwnerToken) -> Arc<Self> {
        Arc::new(Self {
            token,
            arrived_at: OnceLock::new(),
            extra: Mutex::new(Some(Vec::new())),
            apart: OnceLock::new(),
        })
    }

    /// Where the owner's runs apart stand now: a layer's guard made now is around every
    /// run that starts from here on, and none that started before.
    pub(crate) fn runs_from(&self) -> u64 {
        self.apart.get().map_or(0, |apart| apart.borrow().next)
    }

    /// Runs `run` (the inner service, in the idempotency layer's task, which goes on when
    /// the request's future is dropped) apart from the request: until it ends, the layers
    /// around it keep their holds and renew them even when the request is dropped (a
    /// client that left), and a layer around it that cancels its inner service when it
    /// loses its lease cancels this run (`None`).
    #[cfg(feature = "idempotency")]
    pub(crate) fn run_apart<F: Future>(
        self: &Arc<Self>,
        run: F,
    ) -> impl Future<Output = Option<F::Output>> {
        let mut number = 0;
        let apart = self
            .apart
            .get_or_init(|| watch::Sender::new(Apart::default()));
        apart.send_modify(|apart| {
            number = apart.next;
            apart.next += 1;
            apart.running.push(number);
        });
        let ended = RunEnded(self.clone(), number);
        let mut cancels = apart.subscribe();
        async move {
            let _ended = ended;
            let cancelled = cancels.wait_for(|a| a.cancelled_from.is_some_and(|c| c <= number));
            // The cancellation first: a run woken by both (its handler's last wait ended
            // just as its lease was lost) is cancelled, as the layer already answered. A
            // statement of its own: a cancellation's answer borrows the channel, which
            // `_ended` then changes.
            let output = match select(std::pin::pin!(cancelled), std::pin::pin!(run)).await {
                Either::Left(_) => None,
                Either::Right((output, _)) => Some(output),
            };
            output
        }
    }

    /// Cancels the runs apart that started at `from` or later.
    fn cancel_runs_from(&self, from: u64) {
        if let Some(apart) = self.apart.get() {
            apart.send_modify(|apart| {
                apart.cancelled_from = Some(apart.cancelled_from.map_or(from, |c| c.min(from)));
            });
        }
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

    fn extra(&self) -> std::sync::MutexGuard<'_, Option<Vec<(u64, LockGuard)>>> {
        // Every change is one push or one removal: a poisoned list is still whole.
        self.extra.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps a hold the handler took, to release it with the request; gives it back if
    /// the request has ended (a task of the handler's that outlived it locked it).
    pub(crate) fn keep(&self, hold: u64, guard: LockGuard) -> Result<(), LockGuard> {
        match self.extra().as_mut() {
            Some(extra) => {
                extra.push((hold, guard));
                Ok(())
            }
            None => Err(guard),
        }
    }

    /// Whether the request has ended: its holds were given back.
    pub(crate) fn ended(&self) -> bool {
        self.extra().is_none()
    }

    pub(crate) fn take(&self, hold: u64) -> Option<LockGuard> {
        let mut extra = self.extra();
        let extra = extra.as_mut()?;
        let at = extra.iter().position(|(h, _)| *h == hold)?;
        Some(extra.swap_remove(at).1)
    }

    /// The holds the handler took, and the end of the request for later ones.
    fn take_all(&self) -> Vec<LockGuard> {
        let taken = self.extra().take().unwrap_or_default();
        taken.into_iter().map(|(_, guard)| guard).collect()
    }
}

/// Ends a run apart, however it ends.
#[cfg(feature = "idempotency")]
struct RunEnded(Arc<RequestOwner>, u64);

#[cfg(feature = "idempotency")]
impl Drop for RunEnded {
    fn drop(&mut self) {
        let number = self.1;
        if let Some(apart) = self.0.apart.get() {
            apart.send_modify(|apart| apart.running.retain(|&n| n != number));
        }
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
        self.0
            .extra()
            .as_ref()
            .is_some_and(|extra| !extra.is_empty())
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
    pub(crate) owner: Arc<RequestOwner>,
    /// The owner's runs apart from this number on run inside this layer
    /// ([`RequestOwner::runs_from`] when the guard was made).
    pub(crate) runs_from: u64,
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

    /// Releases the handler's holds and the layer's, as [`LockGuard::release`] does: all at
    /// once, so that a store that does not answer delays the response by one store
    /// timeout, not one a hold. What a drop midway leaves is released in the background.
    pub(crate) fn release(self) -> BoxFuture<'static, ()> {
        let Self { guard, extra, .. } = self;
        Box::pin(async move {
            let extra = extra.as_ref().map(ExtraHolds::take).unwrap_or_default();
            join_all(extra.into_iter().chain([guard]).map(LockGuard::release)).await;
        })
    }

    /// Releases, as [`release`](Self::release) does, after cancelling the runs apart
    /// inside this layer: it lost its lease, which cancels its inner service.
    pub(crate) fn cancel(self) -> BoxFuture<'static, ()> {
        self.owner.cancel_runs_from(self.runs_from);
        self.release()
    }

    /// Whether a run of the inner service goes on apart ([`RequestOwner::run_apart`]):
    /// the request's future was dropped, or a layer inside answered for it.
    pub(crate) fn runs_apart(&self) -> bool {
        let apart = self.owner.apart.get();
        apart.is_some_and(|apart| apart.borrow().running_from(self.runs_from))
    }

    /// Lets the guard go while its request no longer waits for its inner service: at once,
    /// unless a run of that service goes on apart, which still uses the keys. They then
    /// stay held, and renewed, until it ends, and are released in the background; if the
    /// layer's lease is lost first where that cancels its inner service (`lost`), the run
    /// is cancelled.
    pub(crate) fn release_after_runs_apart<R: 'static>(
        mut self,
        lost: Option<BoxFuture<'static, R>>,
    ) {
        let from = self.runs_from;
        let apart = self.owner.apart.get().map(watch::Sender::subscribe);
        let (Some(mut apart), Ok(runtime)) = (apart, tokio::runtime::Handle::try_current()) else {
            return;
        };
        if !apart.borrow().running_from(from) {
            return;
        }
        self.start_deferred_renewal();
        runtime.spawn(async move {
            // The sender lives in the owner, which this guard keeps. A statement of its
            // own: the answer of `wait_for` borrows the channel, which a cancel changes.
            let ended = apart.wait_for(|a| !a.running_from(from));
            let lost_first = match lost {
                Some(lost) => matches!(select(Box::pin(ended), lost).await, Either::Right(_)),
                None => {
                    let _ = ended.await;
                    false
                }
            };
            if lost_first {
                self.owner.cancel_runs_from(from);
            }
            drop(self);
        });
    }
}
