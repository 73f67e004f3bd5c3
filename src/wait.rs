//! How long a request waits for busy keys.

use std::time::Duration;

use crate::duration::capped;

/// Whether a request whose keys are busy is refused at once or waits for them, and
/// whether waiters are served in order.
///
/// A waiting request never holds part of its batch: it tries the whole batch again,
/// atomically, when a release wakes it (see [`Locks::wait`](crate::Locks::wait)), or after
/// a jittered pause in case a wake-up was lost. A client that disconnects stops waiting at
/// once. When the bound passes, the request gets the contention response.
///
/// # Fair waiting
///
/// Waiting is fair unless turned off with [`fair(false)`](Self::fair): a waiter takes a
/// place in line when it starts, and while it waits, the keys of its batch are *reserved*
/// against everyone who came after it, waiting or not. A later request that wants a
/// reserved key waits behind it, or gets the contention response if it does not wait; an
/// earlier waiter is never held up by a later one's reservation, and an owner is never held
/// up by reservations on keys it already holds (re-entry). So a batch of thousands of keys
/// is granted as soon as the holds that were there before it (and the earlier waiters) end,
/// however many small requests keep coming.
///
/// A reservation is not a lock: it keeps nobody out who came earlier, and it never makes a
/// deadlock. It ends when its waiter is granted, gives up or is dropped, and on its own at
/// the waiter's deadline (its bound after it arrived, and half a second more for its last
/// attempt) when its process dies: a place in line outlives whatever happens to the holds
/// before it, a holder's process that dies included.
///
/// # What waiting costs the store
///
/// A release wakes, for each key it frees, only the waiter first in line on it (the one
/// waiter that key can let in; a reader granted wakes the next in line, who may be a
/// reader too), in this process and, through the store's pub/sub, in the others. However
/// long the line, a grant costs about the same: on one Redis, a hot key with 32 waiters
/// took 4.5 script calls a grant (18.4 when every release woke every waiter). On
/// PostgreSQL, a release hands a key to its first waiter when that waiter wants that key
/// alone, exclusively: it grants it in its own statement, and the waiter is granted without
/// a call of its own (a waiter whose process dies after that keeps the key for its ttl, as
/// a holder that dies does; see the store's page). A woken
/// waiter on a shared store (every store but memory) first probes the keys that kept it
/// out, reading them without writing, and stopping at the first still held; it sends its
/// whole batch again only once none is: a purchase order of 2,000 keys held up by small
/// orders pays for a few reads a release, not for 2,000 writes. (A batch of fewer than 64
/// keys on one Redis or PostgreSQL is tried at once: an attempt costs about a probe.) On
/// a shared store, a waiter with a batch of 64 keys or more keeps its place in line as
/// one record (a *claim*: the set of its keys) rather than with a reservation written
/// into each key, so that its keys are not rewritten to wait, again to be granted and
/// again to be released:
/// on a Redis Cluster, a claim on each master that serves 64 of its keys or more (and
/// reservations on the others); on PostgreSQL, for an exclusive batch (each store's page
/// gives its data model). A waiter in line also polls, seldom (after 100-200 ms, then
/// less often, down to every 1-2 s), for what no release announces: a hold or a place
/// before it that expired with its process. Kept out by a hold, it looks when that hold
/// ends, and before then only every 1-2 s (not on one Redis without a subscription or
/// PostgreSQL without a listener, whose waiters poll for other processes' releases).
/// Waiters in no line
/// (unfair waiting) watch the keys that kept them out and poll every 5-100 ms.
///
/// ```
/// use std::time::Duration;
/// use tower_batch_lock::{Locks, Wait};
///
/// // Served in order of arrival (the default when waiting):
/// let locks = Locks::memory().wait(Wait::up_to(Duration::from_millis(250)));
/// // First come is not first served: every attempt races the new arrivals.
/// let racing = Locks::memory().wait(Wait::up_to(Duration::from_millis(250)).fair(false));
/// assert!(Wait::up_to(Duration::from_secs(1)).is_fair());
/// # drop((locks, racing));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    bound: Duration,
    fair: bool,
}

impl Default for Wait {
    fn default() -> Self {
        Self::none()
    }
}

impl Wait {
    /// Refuse at once (the default): right for duplicate submissions.
    pub const fn none() -> Self {
        Self {
            bound: Duration::ZERO,
            fair: true,
        }
    }

    /// Wait at most `bound` for the keys to become free, served in order of arrival. A
    /// bound over a century (`Duration::MAX`) is a century.
    pub const fn up_to(bound: Duration) -> Self {
        Self {
            bound: capped(bound),
            fair: true,
        }
    }

    /// Whether waiters are served in order of arrival, reserving their keys against later
    /// requests while they wait (`true`, the default), or every attempt races whoever
    /// comes (`false`). Either way, a request respects other waiters' reservations.
    pub const fn fair(mut self, fair: bool) -> Self {
        self.fair = fair;
        self
    }

    /// The longest a request waits.
    pub const fn bound(self) -> Duration {
        self.bound
    }

    /// Whether waiting is fair (see [`fair`](Self::fair)).
    pub const fn is_fair(self) -> bool {
        self.fair
    }

    /// Whether requests wait (the bound is not zero) in a line: they take a place and
    /// reserve their keys.
    pub(crate) fn queues(self) -> bool {
        self.fair && !self.bound.is_zero()
    }
}
