//! What holds a request's keys, renews them, and releases them.

use std::{
    sync::{
        atomic::{AtomicU8, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, Instant},
};

use tokio::{
    sync::{futures::Notified, oneshot, Notify},
    task::JoinHandle,
};

use crate::{
    backoff::Backoff,
    observe::{self, Layer, ReleaseFailure},
    outage::OutageLog,
    registry::Registered,
    retry_after::HoldTimes,
    store::{
        call::within,
        contract::{Holder, LockStore},
        late,
        wake::LostAnswers,
    },
};

/// A lease's state, shared by its guard and its renewal, which keep it current, and by the
/// handler's [`Lease`](crate::lease::Lease)s, which read it.
///
/// A mutex and one `Notify` rather than a `watch` channel: every request makes one, and
/// most are read by nobody; a channel costs an allocation three times the size, and eight
/// notifications when it drops.
#[derive(Debug)]
pub(crate) struct LeaseState {
    status: Mutex<LeaseStatus>,
    /// Woken on every change of `status`.
    changed: Notify,
}

/// A lease's state at one moment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaseStatus {
    /// When the keys expire in the store unless renewed: never earlier than this.
    pub(crate) expires_at: Instant,
    /// A renewal found the keys gone or foreign, or could not reach the store in time.
    pub(crate) lost: bool,
    /// The guard has released the keys, or given them up.
    pub(crate) ended: bool,
}

impl LeaseState {
    fn new(expires_at: Instant) -> Arc<Self> {
        Arc::new(Self {
            status: Mutex::new(LeaseStatus {
                expires_at,
                lost: false,
                ended: false,
            }),
            changed: Notify::new(),
        })
    }

    pub(crate) fn get(&self) -> LeaseStatus {
        *self.lock()
    }

    /// Resolves at the next change of the state. Taken before reading the state it waits
    /// to change, it misses no change in between: it counts from its creation, not from
    /// its first poll (changes wake with `notify_waiters`).
    pub(crate) fn changed(&self) -> Notified<'_> {
        self.changed.notified()
    }

    fn update(&self, change: impl FnOnce(&mut LeaseStatus)) {
        change(&mut self.lock());
        self.changed.notify_waiters();
    }

    fn lock(&self) -> MutexGuard<'_, LeaseStatus> {
        // Every change is one field written: a poisoned state is still whole.
        self.status.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Releases a batch of keys when dropped, unless [released](Self::release) before.
///
/// `Drop` cannot wait for the store, so a drop spawns the release onto the Tokio runtime,
/// which retries while the store does not answer, until the keys would have expired anyway;
/// the keys' TTL frees them if even that fails.
#[derive(Debug)]
pub(crate) struct LockGuard {
    held: Option<Held>,
}

#[derive(Debug)]
struct Held {
    store: Arc<dyn LockStore>,
    keys: Arc<[String]>,
    holder: Holder,
    timeout: Duration,
    status: Arc<LeaseState>,
    /// Where a release or an extension that fails is logged: once per outage of the
    /// store, with the acquisitions' failures, not once per request and attempt.
    outage: Arc<OutageLog>,
    renewal: Option<Renewal>,
    /// A renewal not started yet: its TTL, its end, and when its first extension is due
    /// (see [`LockGuard::renew_later`]).
    deferred: Option<(Duration, Option<Instant>, Instant)>,
    /// When the hold began, and where to count how long it lasted.
    timed: Option<(Instant, Arc<HoldTimes>)>,
    /// The hold's entry in [`Locks::held_batches`](crate::Locks::held_batches), until it ends.
    listed: Option<Registered>,
    /// The metrics label of the request that holds the keys, once it holds them.
    layer: Option<Layer>,
    /// Whether the store answered the acquisition. When it did not (its answer was lost,
    /// late, or its request dropped while it was in flight), a grant may still land
    /// after the release, which is sent again for it ([`late`]).
    answered: bool,
    /// The releases whose answers were lost, for this process's waiters on the keys.
    lost: LostAnswers,
}

/// The task that keeps extending the lease, and the way to stop it.
#[derive(Debug)]
struct Renewal {
    /// Dropped to stop it (`None` once dropped).
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
    phase: Arc<AtomicU8>,
}

/// What the renewal task is doing, so that stopping it waits only for an extension in
/// flight: most requests end long before their first extension, and waiting for the task
/// itself to wind down would add a scheduling round trip to every response.
const SLEEPING: u8 = 0;
const EXTENDING: u8 = 1;
const STOPPED: u8 = 2;

impl LockGuard {
    /// A guard for `holder`'s hold on `keys`, made *before* the acquisition is sent: if the
    /// acquiring future is dropped mid-flight, the store may have granted the batch, and
    /// only this guard's drop then releases it. `expires_at` is the acquisition's start
    /// plus the TTL (less the store's clock-drift allowance): the keys never expire earlier.
    pub(crate) fn new(
        store: Arc<dyn LockStore>,
        keys: Arc<[String]>,
        holder: Holder,
        timeout: Duration,
        expires_at: Instant,
        outage: Arc<OutageLog>,
    ) -> Self {
        let status = LeaseState::new(expires_at);
        Self {
            held: Some(Held {
                store,
                keys,
                holder,
                timeout,
                status,
                outage,
                renewal: None,
                deferred: None,
                timed: None,
                listed: None,
                layer: None,
                answered: false,
                lost: LostAnswers::default(),
            }),
        }
    }

    /// The store answered the acquisition with a grant: no grant of it can land later.
    pub(crate) fn answered(&mut self) {
        if let Some(held) = &mut self.held {
            held.answered = true;
        }
    }

    /// The lease's state as it changes, while armed: for the handler's
    /// [`Lease`](crate::lease::Lease).
    pub(crate) fn status(&self) -> Option<Arc<LeaseState>> {
        Some(self.held.as_ref()?.status.clone())
    }

    /// The id of this hold, while armed.
    pub(crate) fn hold(&self) -> Option<u64> {
        self.held.as_ref().map(|held| held.holder.hold)
    }

    /// Extends the lease by `ttl` every `ttl / 3`, counted from `now`, until the guard
    /// releases, or until `until`, in a task of its own.
    pub(crate) fn renew(&mut self, ttl: Duration, until: Option<Instant>, now: Instant) {
        self.start_renewal(ttl, until, now + ttl / 3);
    }

    /// Renews as [`renew`](Self::renew) does, once [`start_deferred_renewal`] is called: the
    /// caller calls it at the returned instant, when the first extension is due, if the
    /// keys are still held then. Most requests end long before, and a task spawned for
    /// each of them would cost more than the rest of the layer.
    ///
    /// [`start_deferred_renewal`]: Self::start_deferred_renewal
    pub(crate) fn renew_later(
        &mut self,
        ttl: Duration,
        until: Option<Instant>,
        now: Instant,
    ) -> Option<Instant> {
        let held = self.held.as_mut()?;
        let due = now + ttl / 3;
        held.deferred = Some((ttl, until, due));
        Some(due)
    }

    /// Starts the renewal that [`renew_later`](Self::renew_later) deferred: its first
    /// extension when it was due, or now if that has passed.
    pub(crate) fn start_deferred_renewal(&mut self) {
        if let Some((ttl, until, due)) = self.held.as_mut().and_then(|held| held.deferred.take()) {
            self.start_renewal(ttl, until, due);
        }
    }

    fn start_renewal(&mut self, ttl: Duration, until: Option<Instant>, first: Instant) {
        let Some(held) = &mut self.held else { return };
        let (stop, stopped) = oneshot::channel();
        let phase = Arc::new(AtomicU8::new(SLEEPING));
        let renewer = Renewer {
            phase: phase.clone(),
            store: held.store.clone(),
            keys: held.keys.clone(),
            holder: held.holder,
            ttl,
            until,
            first,
            attempt_limit: held.timeout.min(ttl / 3),
            status: held.status.clone(),
            outage: held.outage.clone(),
            layer: held.layer.clone(),
        };
        let task = tokio::spawn(renewer.run(stopped));
        held.renewal = Some(Renewal {
            stop: Some(stop),
            task,
            phase,
        });
    }

    /// Counts how long the hold lasts, from `since` until its release, in `holds` and in
    /// the metrics of `layer`, which count it as held meanwhile.
    pub(crate) fn time_into(&mut self, holds: Arc<HoldTimes>, layer: Layer, since: Instant) {
        if let Some(held) = &mut self.held {
            observe::holding(&layer, 1.0);
            held.timed = Some((since, holds));
            held.layer = Some(layer);
        }
    }

    /// Lists the hold in [`Locks::held_batches`](crate::Locks::held_batches) until it ends.
    pub(crate) fn list_in(&mut self, entry: Registered) {
        if let Some(held) = &mut self.held {
            held.listed = Some(entry);
        }
    }

    /// Forgets the keys without releasing them: for a batch the store refused (it wrote
    /// nothing), or one already released.
    pub(crate) fn disarm(mut self) {
        self.held = None;
    }

    /// Releases the keys now, after stopping the renewal: no extension reaches the store
    /// after the release. The returned future logs failures instead of returning them: by
    /// the time it runs, nobody could do better than wait for the TTL.
    ///
    /// The future owns the guard, still armed, until the store has answered: if the future
    /// is dropped midway (the client left just as the handler finished), the guard's drop
    /// sends the release again. Releasing twice is harmless; releasing never is not.
    /// Likewise when the store does not answer: the future ends within one store timeout,
    /// an extension in flight included, and the guard's drop keeps retrying in the
    /// background (after that extension).
    pub(crate) async fn release(mut self) {
        if let Some(held) = &mut self.held {
            let started = Instant::now();
            held.hold_ended(started);
            // An extension in flight ends within its attempt limit, at most the store
            // timeout from before this began; the release gets what is left of it.
            held.stop_renewal().await;
            let left = held.timeout.saturating_sub(started.elapsed());
            if !held.release_within(left).await {
                return; // dropped armed: retried from `Drop`
            }
        }
        self.disarm();
    }

    /// Releases the keys without a future, where nothing needs waiting for: no renewal has
    /// started (an extension could be in flight), and the store answers at once. Whether it
    /// did: otherwise the guard still holds the keys, for [`release`](Self::release), with
    /// its hold already counted as ended (counting it again there changes nothing).
    pub(crate) fn release_now(&mut self) -> bool {
        let Some(held) = &mut self.held else {
            return true;
        };
        if held.renewal.is_some() {
            return false;
        }
        // One reading of the clock for both: the hold's end, and the store's time.
        let now = Instant::now();
        held.hold_ended(now);
        let Some(count) = held.store.release_now(&held.keys, held.holder, now) else {
            return false;
        };
        held.released(count);
        self.held = None;
        true
    }
}

impl Drop for Held {
    /// However the hold ends, released or given up, its leases learn of it.
    fn drop(&mut self) {
        self.status.update(|s| s.ended = true);
    }
}

impl Held {
    /// Counts the hold's length, once: it ends when its release begins, at `now`.
    fn hold_ended(&mut self, now: Instant) {
        self.listed = None;
        if let Some((began, holds)) = self.timed.take() {
            let held = now.saturating_duration_since(began);
            holds.record(held);
            if let Some(layer) = &self.layer {
                observe::holding(layer, -1.0);
                observe::held(layer, held);
            }
        }
    }

    /// Stops the renewal and waits for an extension in flight to finish, so that the
    /// release that follows is the last word. Dropped midway, it leaves the renewal for
    /// the next call to wait for: the release the guard's drop sends still comes after it.
    async fn stop_renewal(&mut self) {
        let Some(renewal) = &mut self.renewal else {
            return;
        };
        renewal.stop = None;
        // Sleeping (or ended): no extension is in flight, and none can start after this;
        // the task ends on its own when it sees the stop. Otherwise an extension is in
        // flight: wait for it (the task bounds its own attempts by the store timeout).
        if renewal
            .phase
            .compare_exchange(SLEEPING, STOPPED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            let _ = (&mut renewal.task).await;
        }
        self.renewal = None;
    }

    /// One attempt, within the store timeout; whether the store answered.
    async fn release(&self) -> bool {
        self.release_within(self.timeout).await
    }

    /// One attempt, within `limit`; whether the store answered.
    async fn release_within(&self, limit: Duration) -> bool {
        let earlier_lost = self.lost.sent();
        let released = within(limit, self.store.release(&self.keys, self.holder)).await;
        match released {
            Ok(Ok(count)) => {
                self.lost
                    .answered(earlier_lost, self.store.wakeups(), &self.keys);
                self.outage.answered();
                self.released(count);
                true
            }
            Ok(Err(error)) => {
                let why = format!("could not release locks: {error}");
                self.outage.failed(&why, self.keys.len());
                false
            }
            Err(_) => {
                let ms = limit.as_millis();
                let why = format!("releasing locks timed out after {ms} ms");
                self.outage.failed(&why, self.keys.len());
                false
            }
        }
    }

    fn released(&self, count: usize) {
        tracing::trace!(keys = self.keys.len(), released = count, "released locks");
    }

    fn count_release_failure(&self, result: ReleaseFailure) {
        observe::release(&self.layer.clone().unwrap_or_else(Layer::unnamed), result);
    }

    /// Retries until the store answers, or until the keys would have expired anyway.
    ///
    /// One attempt is not enough after an acquisition whose outcome is unknown: the store
    /// that was too slow to answer it is usually too slow for the release that follows
    /// at once, and the acquisition may still run when it recovers. A release sent after
    /// the store recovered usually runs after it, but not always: the acquisition may
    /// still sit in a retired connection's bytes, or in a delayed packet, and land after
    /// the release. So a guard whose acquisition was never answered sends its release
    /// again a few times after this one was answered ([`late`]); a grant that lands after
    /// those keeps its keys until its TTL ends, the bound that [`store`](crate::store)
    /// states for every store.
    async fn release_until_answered(&self) {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        while !self.release().await {
            self.count_release_failure(ReleaseFailure::Retried);
            if !backoff.sleep_before(self.status.get().expires_at).await {
                // Counted; the outage it belongs to is logged already.
                tracing::debug!(
                    keys = self.keys.len(),
                    "gave up releasing locks; they expire with their TTL"
                );
                self.count_release_failure(ReleaseFailure::GaveUp);
                return;
            }
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(mut held) = self.held.take() else {
            return;
        };
        held.hold_ended(Instant::now());
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    held.stop_renewal().await;
                    held.release_until_answered().await;
                    if !held.answered {
                        let held = &held;
                        late::send_again(|| async move {
                            held.release().await;
                        })
                        .await;
                    }
                });
            }
            Err(_) => tracing::warn!(
                keys = held.keys.len(),
                "locks dropped outside a Tokio runtime; they expire with their TTL"
            ),
        }
    }
}

/// Keeps a lease alive: extends it every third of its TTL, and reports it lost when an
/// extension finds the keys gone or taken, or cannot reach the store before it runs out.
struct Renewer {
    store: Arc<dyn LockStore>,
    keys: Arc<[String]>,
    holder: Holder,
    ttl: Duration,
    until: Option<Instant>,
    /// When the first extension is due.
    first: Instant,
    /// How long one extension may take: never so long that the lease runs out unseen.
    attempt_limit: Duration,
    status: Arc<LeaseState>,
    outage: Arc<OutageLog>,
    layer: Option<Layer>,
    phase: Arc<AtomicU8>,
}

impl Renewer {
    async fn run(self, mut stopped: oneshot::Receiver<()>) {
        let every = self.ttl / 3;
        let mut next = self.first;
        loop {
            // Sleep until the next extension, unless the guard stops us first. An
            // extension in flight is never interrupted: the guard waits for it.
            if tokio::time::timeout_at(next.into(), &mut stopped)
                .await
                .is_ok()
            {
                return;
            }
            let now = Instant::now();
            if self.until.is_some_and(|until| now >= until) {
                tracing::info!(
                    keys = self.keys.len(),
                    "maximum hold time reached; lease renewal ends"
                );
                // The keys expire with this TTL: the lease is lost then, as any other,
                // unless the request ends before (a release at that moment, by a handler
                // that saw the lease run out, comes after it).
                let expires_at = self.status.get().expires_at;
                let _ = tokio::time::timeout_at(expires_at.into(), &mut stopped).await;
                if Instant::now() >= expires_at {
                    self.lost("the maximum hold time passed, and the keys expired");
                }
                return;
            }
            let expires_at = self.status.get().expires_at;
            if now + self.attempt_limit > expires_at {
                return self.lost("the lock store could not be reached before the lease ran out");
            }
            // Only while not stopped: a stop from here on waits for this extension.
            if self
                .phase
                .compare_exchange(SLEEPING, EXTENDING, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                return;
            }
            let extended = tokio::time::timeout(
                self.attempt_limit,
                self.store.extend(&self.keys, self.holder, self.ttl),
            )
            .await;
            self.phase.store(SLEEPING, Ordering::Release);
            match extended {
                Ok(Ok(true)) => {
                    self.outage.answered();
                    let valid_for = self.ttl.saturating_sub(self.store.drift(self.ttl));
                    self.status.update(|s| s.expires_at = now + valid_for);
                    next = now + every;
                    continue;
                }
                Ok(Ok(false)) => {
                    return self.lost("the keys expired or were taken by another owner")
                }
                Ok(Err(error)) => {
                    let why = format!("could not extend a lease (retrying): {error}");
                    self.outage.failed(&why, self.keys.len());
                }
                Err(_) => {
                    let why = "extending a lease timed out (retrying)";
                    self.outage.failed(&why, self.keys.len());
                }
            }
            // Retry soon, and at the latest when an attempt can still finish in time.
            let latest = expires_at.checked_sub(self.attempt_limit).unwrap_or(now);
            next = (Instant::now() + every / 4).min(latest);
        }
    }

    fn lost(&self, why: &'static str) {
        observe::lease_lost(&self.layer.clone().unwrap_or_else(Layer::unnamed));
        tracing::warn!(keys = self.keys.len(), why, "lease lost");
        self.status.update(|s| s.lost = true);
    }
}

#[cfg(test)]
mod tests;
