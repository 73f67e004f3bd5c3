//! How a request gets its batch: one attempt after another until it is granted, refused or
//! out of time, with a place in line while it waits ([`Locks`] holds the policy; this is
//! the mechanism).
//!
//! # The waiting protocol, on every store
//!
//! 1. **A place in line.** A fair waiter takes a [`Ticket`] when it starts: its arrival
//!    (milliseconds, then bits that increase within a process, then 64 random bits, so that
//!    two processes' waiters never share one). Its first refused attempt reserves every key
//!    of its batch until its deadline, and half a second more ([`RESERVATION_MARGIN`](waiter::RESERVATION_MARGIN)): a
//!    reservation keeps out every later arrival, waiting or not, and lives on whatever
//!    happens to the holds before it (on Redis, holds that reservations outlive keep their
//!    end in the value, so that a holder that dies takes only its holds). On every shared
//!    store a batch of 64 keys or more keeps its place as one record, a *claim* (the set
//!    of its keys, and its ticket in a registry: on a Redis Cluster one on each master
//!    that serves 64 of its keys or more, on PostgreSQL a row, for exclusive batches), and
//!    leaves its keys as they are: a key that an earlier claim names keeps a caller out as
//!    an earlier reservation does, and a release wakes the earliest of both. A grant ends the waiter's reservations (its
//!    claim); giving up, failing or being dropped withdraws them, again and again while
//!    the store does not answer, until they would have ended anyway.
//! 2. **Wake only who can win.** A release (a withdrawal, a forced release) names, for each
//!    key it frees, the waiter first in line on it, and wakes that waiter alone, here and,
//!    through the store's pub/sub, in other processes ([`Wakeups`](crate::store::wake));
//!    a reader granted wakes the next in line, who may be a reader too. A claim's waiter
//!    that an earlier claim keeps out (the two name a key in common) is not woken: it is,
//!    when that claim's keys are freed or withdrawn. Waiters
//!    in no line (unfair waiting, an owner that holds keys) watch the keys that kept them
//!    out. On PostgreSQL, a release grants a waiter of one key, first in line on it, its
//!    key in the release's own statement, and its wake-up carries the grant
//!    ([`Handover`](crate::store::wake::Handover)): that waiter is granted without an
//!    attempt of its own. A release or a withdrawal whose answer was lost took this
//!    process's wake-ups with it (other processes hear the store's message; this one skips
//!    its own): once a retry of it is answered, it wakes this process's waiters first in
//!    line on its keys. A cluster retries a group's call within the store, and its
//!    client announces the release: the retry announces too that it cannot name the
//!    waiters, and every process wakes its own first in line on those keys.
//! 3. **Retry only what blocked.** A refusal names every key that kept the batch out (on a
//!    store that [probes](LockStore::probe); or, for a big batch that arrives while its
//!    Redis store refuses batches, the first key found held and those after it); a woken
//!    waiter reads those keys, stopping at
//!    the first still in the way, and sends its whole batch again only once none is; or
//!    at once, when a release woke it and one key alone kept it out, or its batch has
//!    fewer than 64 keys (its blockers were most often freed together, by one holder),
//!    on a store where no refusal of its own wakes it (one Redis, PostgreSQL; on
//!    Redlock and a cluster, a batch of one key; see [`LockStore::whole_attempts`]). On
//!    one Redis, Redlock and a cluster, a refused attempt granted in part (a step, a
//!    master, a group) and rolled back does not wake its own waiter. A big batch so makes
//!    about two passes to be granted (the refused one that reserves, and the grant) and
//!    one to be released, however long it waits. On every shared store the refused pass
//!    of a big batch only reads its keys (and claims them); on Redis, amid refusals, it
//!    reads its first keys and claims the batch unread; its grant takes its free keys
//!    with plain commands, as an uncontended batch does.
//! 4. **Polls for what nobody announces.** A release wakes; an expiry does not. A waiter
//!    in line polls after 100-200 ms, then less and less often, down to every 1-2 s: for a
//!    hold or a place before it that expired with its process, or a wake-up that was lost.
//!    Kept out by a hold, where this process hears every process's releases
//!    ([`LockStore::announces_releases`]), it looks when that hold ends (its refusal says
//!    when), which finds the key free if its holder died, and before then only every
//!    1-2 s. On a shared store a poll is a probe of what blocked it.
//! 5. **Owners.** An owner that holds keys (a nested layer, `Lease::lock`) stands in line
//!    at its own arrival ([`Line::Holder`]): its keys keep it out of nothing, and only the
//!    waiters that came before it keep it out of others.
//! 6. **A bound.** At most [`Locks::max_waiters`] requests wait at once; the next that would
//!    is refused at once with 503 and `Retry-After`, holding nothing.

mod place;
mod waiter;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use tracing::Span;

use self::{place::Place, waiter::Waiter};

use crate::{
    guard::LockGuard,
    locks::Locks,
    observe::{self, Layer, Outcome, Unanswered},
    outage::OutageLog,
    rejection::Rejection,
    store::{
        call::within,
        contract::{
            Acquire, AcquireRequest, Contention, FencingToken, Holder, Line, LockStore, Modes,
            OwnerToken, Ticket,
        },
        error::StoreError,
    },
    wait::Wait,
};

/// How many conflicting keys a waiting request watches for releases, whatever the
/// response names, on a store that cannot probe them (see [`LockStore::probe`]): a lost
/// wake-up only costs a poll interval.
const WATCHED_CONFLICTS: usize = 20;

/// A granted batch: its guard, its fencing token, and when the grant was asked for and
/// seen.
pub(crate) struct Granted {
    pub(crate) guard: LockGuard,
    pub(crate) fencing_token: FencingToken,
    /// When the acquisition started: the owner's arrival ([`Line::Holder`]).
    pub(crate) started: Instant,
    /// When the store's answer arrived: the hold starts here.
    pub(crate) at: Instant,
}

/// The response for a batch refused because `contention` holds some of its `of` keys.
fn contention_rejection(locks: &Locks, of: usize, contention: Contention) -> Rejection {
    let policy = locks.policy();
    let prefix = policy.keys.prefix.len();
    // Uncounted, the keys after the first may be free.
    let named_at_most = match contention.counted {
        true => policy.max_named_conflicts,
        false => policy.max_named_conflicts.min(1),
    };
    let named = contention
        .keys
        .into_iter()
        .take(named_at_most)
        .map(|mut key| key.split_off(prefix))
        .collect();
    Rejection::contention(
        policy.contention_status,
        (contention.total, contention.counted),
        of,
        named,
        policy
            .retry_after
            .advise(locks.holds(), contention.earliest_expiry),
    )
}

/// One request's acquisition of one batch, under the policy of a [`Locks`] handle (which
/// holds the policy; this is the mechanism).
pub(crate) struct Acquisition<'a> {
    locks: &'a Locks,
    store: &'a Arc<dyn LockStore>,
    /// The key prefix: the namespace of the fencing counter.
    namespace: &'a Arc<str>,
    keys: &'a Arc<[String]>,
    modes: &'a Modes,
    ttl: Duration,
    wait: Wait,
    /// How long one call to the store may take.
    timeout: Duration,
    /// How many conflicting keys to learn of, to name them and to watch for their release.
    report: usize,
    /// When the owner arrived, if it already holds keys (see [`Line::Holder`]).
    holder_since: Option<Ticket>,
    /// The metrics label of a request's acquisition (not of a handler's `Lease::lock`).
    layer: Option<&'a Layer>,
    /// Where a failed store is logged.
    outage: &'a Arc<OutageLog>,
}

/// Why a batch was not granted.
enum Refusal {
    /// Held or reserved by others, after any waiting.
    Contended(Contention),
    /// The store did not answer in time, or failed.
    Unavailable,
    /// It would have waited while as many requests as the policy allows already do.
    Crowded,
}

/// An attempt's answer.
enum Attempt {
    Granted((LockGuard, FencingToken)),
    /// Held or reserved by others.
    Held(Contention),
}

impl<'a> Acquisition<'a> {
    /// The acquisition of `keys` in `modes` under the policy of `locks`, for an owner that
    /// may already hold others, having arrived at `holder_since` (see [`Line::Holder`]).
    /// A request's has the
    /// `layer` its metrics and waiting count under; a handler's `Lease::lock` has none.
    pub(crate) fn new(
        locks: &'a Locks,
        keys: &'a Arc<[String]>,
        modes: &'a Modes,
        holder_since: Option<Ticket>,
        layer: Option<&'a Layer>,
    ) -> Self {
        let policy = locks.policy();
        let store = &locks.store().locks;
        // A waiter on a store that probes learns of every key that kept it out, to probe
        // those alone until they are free.
        let report = if policy.wait.bound().is_zero() {
            policy.max_named_conflicts
        } else if store.probes() {
            keys.len()
        } else {
            policy.max_named_conflicts.max(WATCHED_CONFLICTS)
        };
        Self {
            locks,
            store,
            namespace: &policy.keys.prefix,
            keys,
            modes,
            ttl: policy.ttl,
            wait: policy.wait,
            timeout: policy.store_timeout,
            report,
            holder_since,
            layer,
            outage: locks.outage(),
        }
    }

    /// Acquires the batch for `owner`: see [`run`](Self::run). Records the outcome and the
    /// time in the layer's metrics and in `span`.
    pub(crate) async fn acquire(
        &self,
        owner: OwnerToken,
        span: &Span,
    ) -> Result<Granted, Rejection> {
        // The clock is read once before and once after: the first attempt starts at
        // `started`, and the hold at the answer.
        let started = Instant::now();
        let unanswered = self.layer.map(|layer| Unanswered::new(layer, started));
        let acquired = self.run(owner, started).await;
        if let Some(unanswered) = unanswered {
            unanswered.answered();
        }
        self.conclude(span, (started, Instant::now()), acquired)
    }

    /// [`acquire`](Self::acquire) without a future, where the store answers at once (in
    /// memory) and its first answer settles the request: a grant, or a refusal that waiting
    /// cannot change. `None` otherwise, having changed nothing: the request then goes the
    /// way of `acquire`, which asks again, with the waiter's ticket where it waits in line.
    pub(crate) fn acquire_now(
        &self,
        owner: OwnerToken,
        span: &Span,
    ) -> Option<Result<Granted, Rejection>> {
        // One clock read: the store answered at once, so the hold starts with the attempt.
        let started = Instant::now();
        let acquired = self.now(owner, started)?;
        Some(self.conclude(span, (started, started), acquired))
    }

    /// Records how the acquisition, from its start to its answer, ended, and gives the
    /// grant, or the response that refuses the request.
    fn conclude(
        &self,
        span: &Span,
        (started, at): (Instant, Instant),
        acquired: Result<(LockGuard, FencingToken), Refusal>,
    ) -> Result<Granted, Rejection> {
        let (granted, outcome) = match acquired {
            Ok((guard, fencing_token)) => {
                let granted = Granted {
                    guard,
                    fencing_token,
                    started,
                    at,
                };
                (Ok(granted), Outcome::Granted)
            }
            Err(Refusal::Contended(contention)) => {
                span.record("outcome", "contended");
                tracing::debug!(held = contention.total, "locks held by another owner");
                let rejection = contention_rejection(self.locks, self.keys.len(), contention);
                (Err(rejection), Outcome::Contended)
            }
            Err(Refusal::Unavailable) => {
                span.record("outcome", "unavailable");
                (Err(Rejection::unavailable()), Outcome::Unavailable)
            }
            Err(Refusal::Crowded) => {
                span.record("outcome", "crowded");
                tracing::debug!("too many requests wait for locks");
                (Err(Rejection::crowded()), Outcome::Unavailable)
            }
        };
        if let Some(layer) = self.layer {
            let took = at - started;
            span.record("acquire_ms", took.as_secs_f64() * 1e3);
            if granted.is_ok() {
                span.record("outcome", "granted");
            }
            observe::outcome(layer, outcome, Some(took));
        }
        granted
    }

    /// One attempt, where the store answers at once; `None` where it does not, or where
    /// the batch is refused and the policy waits (see [`acquire_now`](Self::acquire_now)).
    /// It stands in no line: kept out by every reservation, it reserves nothing, and a
    /// waiter takes its ticket when it starts waiting.
    fn now(
        &self,
        owner: OwnerToken,
        started: Instant,
    ) -> Option<Result<(LockGuard, FencingToken), Refusal>> {
        let holder = Holder::new(owner);
        let line = self.holder_since.map_or(Line::Outside, Line::Holder);
        let answer = self
            .store
            .acquire_now(&self.request(holder, line, Duration::ZERO), started)?;
        self.outage.answered();
        match answer {
            // Nothing was in flight, so the guard is made once there is something to hold.
            Acquire::Granted(fence) => {
                let mut guard = self.guard(holder, started);
                guard.answered();
                Some(Ok((guard, fence)))
            }
            // Answered at once: the attempt's start is the time of its answer.
            Acquire::Held(contention)
                if Self::gives_up(&contention, started + self.wait.bound(), started) =>
            {
                Some(Err(Refusal::Contended(contention)))
            }
            Acquire::Held(_) => None,
        }
    }

    /// What an attempt under `holder`, standing in `line`, asks of the store; a waiter in
    /// line kept out keeps its reservations for `reserve`.
    fn request(&self, holder: Holder, line: Line, reserve: Duration) -> AcquireRequest {
        AcquireRequest {
            namespace: self.namespace.clone(),
            keys: self.keys.clone(),
            modes: self.modes.clone(),
            holder,
            ttl: self.ttl,
            report: self.report,
            line,
            reserve,
            retry: false,
        }
    }

    /// The guard of `holder`'s hold, for an attempt sent at `attempted`: the keys expire
    /// no earlier than the TTL after it (less the store's clock-drift allowance).
    fn guard(&self, holder: Holder, attempted: Instant) -> LockGuard {
        LockGuard::new(
            self.store.clone(),
            self.keys.clone(),
            holder,
            self.timeout,
            self.valid_until(attempted),
            self.outage.clone(),
        )
    }

    /// Until when every key of a grant of an attempt sent at `attempted` is surely still
    /// held: a TTL after it, less the store's clock-drift allowance.
    fn valid_until(&self, attempted: Instant) -> Instant {
        attempted + self.ttl.saturating_sub(self.store.drift(self.ttl))
    }

    /// Tries the whole batch until it is granted, the store fails, the wait bound passes,
    /// or an upgrade is refused (see [`Mode`](crate::Mode)). Between attempts it sleeps
    /// until a release wakes it, or a short jittered pause in case that wake-up is lost.
    ///
    /// A fair waiter takes its ticket before the first attempt, so that its place in line is
    /// its arrival; a refused attempt reserves the batch until the waiter's deadline. The
    /// reservations are withdrawn when it gives up or fails, and when this future is
    /// dropped; a grant ends them. While it waits, it is woken only when it is first in
    /// line on a key just freed ([`Wakeups::watch_ticket`](crate::store::wake::Wakeups)).
    /// An owner that already holds keys stands in no line ([`Line::Holder`]), and neither
    /// does an unfair waiter: those watch the keys that kept them out.
    ///
    /// On a store that probes ([`LockStore::probe`]), a waiter that wakes first probes the
    /// keys that kept its last attempt out, and tries the whole batch again only once none
    /// of them does (or at once, when a release woke it and one key alone kept it out, or
    /// its batch is small): its retries cost in proportion to what blocked it, not to its
    /// batch.
    async fn run(
        &self,
        owner: OwnerToken,
        started: Instant,
    ) -> Result<(LockGuard, FencingToken), Refusal> {
        let mut waiter = self.waiter(started);
        loop {
            let contention = match self.attempt(owner, &mut waiter).await? {
                Attempt::Granted(granted) => return Ok(granted),
                Attempt::Held(contention) => contention,
            };
            if let Some(granted) = self.wait(owner, &mut waiter, contention).await? {
                return Ok(granted);
            }
        }
    }

    /// One attempt at the whole batch, sent at `waiter.attempted`.
    async fn attempt(
        &self,
        owner: OwnerToken,
        waiter: &mut Waiter<'a>,
    ) -> Result<Attempt, Refusal> {
        // A hold of its own for each attempt: a release of a failed attempt that is still
        // retried in the background (Redlock's, on a slow master) must never end the hold
        // of a later attempt that was granted.
        let holder = Holder::new(owner);
        let guard = self.guard(holder, waiter.attempted);
        let reserve = Self::reserve_until(waiter.deadline, waiter.attempted);
        let request = AcquireRequest {
            // Past its first refusal, a waiter in line has reserved its whole batch.
            retry: waiter.slot.is_some() && matches!(waiter.line, Line::At(_)),
            ..self.request(holder, waiter.line, reserve)
        };
        // Until it is answered, the attempt may reserve the batch at any time: after a
        // withdrawal, say, if its answer never comes.
        if let Some(place) = &mut waiter.place {
            place.sent();
        }
        let outcome = within(self.timeout, self.store.acquire(&request)).await;
        if matches!(outcome, Ok(Ok(_))) {
            self.outage.answered();
        }
        match outcome {
            // A grant answered after its TTL may have lost its first keys already: a batch
            // granted in steps (a big one on one Redis) or group by group (a cluster) set
            // each key's TTL as it took it, and another request may hold those now. Not a
            // grant: released, and a 503 that says why (a TTL shorter than a grant takes).
            Ok(Ok(Acquire::Granted(fence)))
                if Instant::now() >= self.valid_until(waiter.attempted) =>
            {
                let (expired, _) = Self::granted(guard, waiter.place.take(), fence);
                drop(expired);
                let why = StoreError::timed_out(self.ttl).context(
                    "the lock store granted the batch only after its TTL: the TTL is shorter \
                     than a grant takes",
                );
                self.outage.failed(&why, self.keys.len());
                Err(Refusal::Unavailable)
            }
            Ok(Ok(Acquire::Granted(fence))) => Ok(Attempt::Granted(Self::granted(
                guard,
                waiter.place.take(),
                fence,
            ))),
            Ok(Ok(Acquire::Held(contention))) => {
                // The store locked nothing: there is nothing to release.
                guard.disarm();
                if let Some(place) = &mut waiter.place {
                    place.answered(contention.may_reserve_later);
                }
                waiter.refused_holds.push(holder.hold);
                Ok(Attempt::Held(contention))
            }
            Ok(Err(error)) => {
                self.outage.failed(&error, self.keys.len());
                if !error.may_have_applied() {
                    guard.disarm();
                }
                if let Some(place) = &mut waiter.place {
                    place.answered(error.may_reserve_later());
                }
                // Otherwise the guard's drop releases whatever the store may have granted,
                // and the place's drop withdraws the reservations, again later if need be.
                Err(Refusal::Unavailable)
            }
            Err(_elapsed) => {
                let why = StoreError::timed_out(self.timeout);
                self.outage.failed(&why, self.keys.len());
                Err(Refusal::Unavailable)
            }
        }
    }

    /// A grant, by the waiter's attempt or handed over by a release: the guard answered,
    /// and the waiter's place in line ended with it (the grant took its reservations off
    /// the batch).
    fn granted(
        mut guard: LockGuard,
        place: Option<Place>,
        fence: FencingToken,
    ) -> (LockGuard, FencingToken) {
        guard.answered();
        if let Some(place) = place {
            place.granted();
        }
        (guard, fence)
    }
}

#[cfg(test)]
mod tests;
