//! What a request carries from one attempt to the next, and how it waits between them:
//! its place in line, the wake-ups it watches, the probes of what blocked it, and when it
//! gives up (the protocol is in [`acquire`](super)).

use std::time::{Duration, Instant};

use super::{place::Place, Acquisition, Refusal};
use crate::{
    backoff::Backoff,
    guard::LockGuard,
    locks::WaiterSlot,
    observe::Waiting,
    store::{
        call::within,
        contract::{AcquireRequest, Contention, FencingToken, Holder, Line, OwnerToken},
        error::StoreError,
        wake::{any_released, Watches},
    },
};

/// How long a waiter's reservations outlast its deadline: its last attempt, sent just
/// before, still finds them.
pub(super) const RESERVATION_MARGIN: Duration = Duration::from_millis(500);

/// How long after the end that a refusal gives for a hold a waiter looks again: a store
/// counts ends in whole milliseconds, and a look a little late finds the key free rather
/// than about to be.
const AFTER_HOLD_ENDS: Duration = Duration::from_millis(5);

/// A batch of fewer keys than this is small: woken, its waiter tries it whole rather than
/// probe what blocked it first (see [`Acquisition::wait`]). It reads no more keys than
/// a probe's first call may, and keeps its place with reservations, not a claim.
const SMALL_BATCH: usize = 64;

/// What a request carries from one attempt to the next.
pub(super) struct Waiter<'a> {
    /// When its wait is over.
    pub(super) deadline: Instant,
    pub(super) line: Line,
    /// Its place in line, when it waits fairly: withdrawn when it goes without a grant.
    pub(super) place: Option<Place>,
    /// The pauses between attempts, for when a wake-up is lost.
    pub(super) backoff: Backoff,
    /// Counted from the first refusal that makes the request wait, until it ends.
    pub(super) waiting: Option<Waiting>,
    /// Its place among the requests that wait (`Locks::max_waiters`), from then on.
    pub(super) slot: Option<WaiterSlot>,
    /// When its last attempt was sent: a hold it grants starts no earlier.
    pub(super) attempted: Instant,
    /// The holds of its refused attempts: a hand-over names one of them (the store wrote
    /// it beside the waiter's place), which nobody else knows; one that names another (a
    /// notification anybody connected to PostgreSQL could send) grants nothing.
    pub(super) refused_holds: Vec<u64>,
    /// The last wait's watch, kept through the next attempt: a release while that attempt
    /// is under way (after the store found a key held, before its answer came back) has
    /// woken it, and the waiter tries again at once rather than after a pause. Measured
    /// across two processes on one Redis, a release that lands in that gap took 1-2% of
    /// the waits to 20-40 ms. A waiter in line watches for its turn from before its first
    /// attempt.
    pub(super) watched: Option<Watches<'a>>,
}

impl Waiter<'_> {
    /// Withdraws its reservations now, if it has a place in line. Its watch ends first: a
    /// withdrawal that wakes this process's first waiter in line on its keys (one retried
    /// after a lost answer) must wake the one behind it, not the waiter that leaves.
    pub(super) async fn withdraw(&mut self) {
        self.watched = None;
        if let Some(place) = self.place.take() {
            place.withdraw().await;
        }
    }
}

impl<'a> Acquisition<'a> {
    /// Whether a request whose wait is over at `deadline`, refused at `now` for
    /// `contention`, stops there: its wait is over, or it asked for an upgrade that other
    /// readers keep out. Such an upgrade is refused at once: one of them may be waiting to
    /// upgrade too, and each would wait for the other until the bound.
    pub(super) fn gives_up(contention: &Contention, deadline: Instant, now: Instant) -> bool {
        now >= deadline || contention.upgrade
    }

    /// How long a waiter in line that is kept out at `now` keeps its reservations: to its
    /// deadline, and [`RESERVATION_MARGIN`] more.
    pub(super) fn reserve_until(deadline: Instant, now: Instant) -> Duration {
        deadline
            .saturating_duration_since(now)
            .saturating_add(RESERVATION_MARGIN)
    }

    /// How many of `blockers` (positions in the batch, ascending), from the first, no
    /// longer keep `owner`, standing in `line`, out: see [`LockStore::probe`].
    async fn probe(
        &self,
        owner: OwnerToken,
        line: Line,
        blockers: &[usize],
    ) -> Result<usize, Refusal> {
        let request = AcquireRequest {
            keys: blockers.iter().map(|&i| self.keys[i].clone()).collect(),
            modes: self.modes.part(blockers),
            ..self.request(Holder::new(owner), line, Duration::ZERO)
        };
        match within(self.timeout, self.store.probe(&request)).await {
            Ok(Ok(free)) => {
                self.outage.answered();
                Ok(free)
            }
            Ok(Err(error)) => {
                self.outage.failed(&error, self.keys.len());
                Err(Refusal::Unavailable)
            }
            Err(_elapsed) => {
                let why = StoreError::timed_out(self.timeout);
                self.outage.failed(&why, self.keys.len());
                Err(Refusal::Unavailable)
            }
        }
    }

    /// The state of a request that may wait, which started at `started`: its place in
    /// line, when it waits fairly and holds nothing yet.
    pub(super) fn waiter(&self, started: Instant) -> Waiter<'a> {
        let deadline = started + self.wait.bound();
        let place = (self.wait.queues() && self.holder_since.is_none()).then(|| {
            let until = deadline + RESERVATION_MARGIN;
            Place::take(self.store.clone(), self.keys.clone(), self.timeout, until)
        });
        let line = match (&place, self.holder_since) {
            (_, Some(arrived)) => Line::Holder(arrived),
            (Some(place), None) => Line::At(place.ticket),
            (None, None) => Line::Outside,
        };
        // A waiter in line is woken when its turn comes, and otherwise it could only
        // notice a hold or a place before it that expired (its process died): it polls
        // seldom, so that a long line does not cost the store a probe per waiter every few
        // milliseconds.
        let backoff = match line {
            Line::At(_) => Backoff::new(Duration::from_millis(200), Duration::from_secs(2)),
            Line::Outside | Line::Holder(_) => {
                Backoff::new(Duration::from_millis(5), Duration::from_millis(100))
            }
        };
        Waiter {
            deadline,
            line,
            place,
            backoff,
            waiting: None,
            slot: None,
            attempted: started,
            refused_holds: Vec::new(),
            watched: matches!(line, Line::At(_)).then(|| self.watch(line, self.keys)),
        }
    }

    /// Waits after an attempt refused for `contention`: until the waiter should send its
    /// whole batch again (`None`), a release hands it the batch, or it gives up.
    pub(super) async fn wait(
        &self,
        owner: OwnerToken,
        waiter: &mut Waiter<'a>,
        contention: Contention,
    ) -> Result<Option<(LockGuard, FencingToken)>, Refusal> {
        if let (None, Some(layer)) = (&waiter.waiting, self.layer) {
            waiter.waiting = Some(Waiting::start(layer));
        }
        // Where the store probes: the positions of the keys that kept the attempt out (the
        // batch is sorted), less those that a probe finds free as the wait goes.
        let mut blockers: Vec<usize> = if self.store.probes() {
            let position = |key: &String| self.keys.binary_search(key).ok();
            contention.keys.iter().filter_map(position).collect()
        } else {
            Vec::new()
        };
        // A waiter in line is woken when its turn comes: before the earliest hold that
        // kept it out ends, only a wake-up that was lost could let it in (a release wakes,
        // an expiry does not), and a poll then costs the store a probe a waiter for
        // nothing (a hot key's waiters made one a grant). So it looks when that hold ends
        // (a holder that died leaves the key free then), and before, only every 1-2 s, for
        // a wake-up that was lost; past the end (the hold was renewed), as the backoff
        // says.
        let hold_ends = match waiter.line {
            Line::At(_) if self.store.announces_releases() => contention.earliest_expiry,
            Line::At(_) | Line::Outside | Line::Holder(_) => None,
        }
        .map(|left| Instant::now() + left + AFTER_HOLD_ENDS);
        loop {
            let now = Instant::now();
            if Self::gives_up(&contention, waiter.deadline, now) {
                // Withdrawn before the answer, so that the client's retry does not find
                // them in its way.
                waiter.withdraw().await;
                return Err(Refusal::Contended(contention));
            }
            if waiter.slot.is_none() {
                // It waits: only while fewer than the bound already do.
                waiter.slot = self.locks.start_waiting();
                if waiter.slot.is_none() {
                    waiter.withdraw().await;
                    return Err(Refusal::Crowded);
                }
            }
            let mut released = match waiter.watched.take() {
                Some(watches) if watches.covers(&contention.keys) => watches,
                _ => self.watch(waiter.line, &contention.keys),
            };
            let due = hold_ends.map_or(Duration::ZERO, |end| end.saturating_duration_since(now));
            let wake_at = (now + waiter.backoff.pause_until(due)).min(waiter.deadline);
            let woken = tokio::time::timeout_at(wake_at.into(), any_released(&mut released))
                .await
                .is_ok();
            // Granted by the release itself (PostgreSQL, a waiter of one key): its hold
            // began after the attempt before this wait, which its guard counts from.
            let handover = released.take_handover();
            if let Some(handover) = handover.filter(|h| waiter.refused_holds.contains(&h.hold)) {
                let holder = Holder {
                    owner,
                    hold: handover.hold,
                };
                let guard = self.guard(holder, waiter.attempted);
                let fence = FencingToken::new(handover.token);
                return Ok(Some(Self::granted(guard, waiter.place.take(), fence)));
            }
            waiter.watched = Some(released);
            waiter.attempted = Instant::now();
            // Woken on a store where nothing else wakes it, it tries its batch at once,
            // without a probe first: when one key still kept it out (first in line on it,
            // or its watcher), a probe would find that key free, and only add a round
            // trip to the grant (a hot key's waiters made one a grant); and when its batch
            // is small, its blockers were most often freed together (one holder's
            // release), and an attempt costs about what a probe does.
            let turn = woken && self.store.whole_attempts(self.keys.len());
            let whole = blockers.len() == 1 || self.keys.len() < SMALL_BATCH;
            if blockers.is_empty() || (turn && whole) {
                return Ok(None);
            }
            let free = self.probe(owner, waiter.line, &blockers).await?;
            blockers.drain(..free.min(blockers.len()));
            if blockers.is_empty() {
                return Ok(None);
            }
        }
    }

    /// What a waiter kept out by `keys` waits for: its turn, when it stands in line (its
    /// reservations cover its whole batch); otherwise a release of one of those keys.
    fn watch(&self, line: Line, keys: &[String]) -> Watches<'a> {
        let wakeups = self.store.wakeups();
        match line {
            Line::At(ticket) => wakeups.watch_ticket(ticket.key(), self.keys.clone()),
            Line::Outside | Line::Holder(_) => wakeups.watch(keys),
        }
    }
}
