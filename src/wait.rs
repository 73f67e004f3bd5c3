//! How long a request waits for busy keys.

use std::time::Duration;

/// Whether a request whose keys are busy is refused at once or waits for them.
///
/// A waiting request never holds part of its batch: it tries the whole batch again,
/// atomically, when a release wakes it (see [`Locks::wait`](crate::Locks::wait)), or after
/// a short jittered pause in case a wake-up was lost. A client that disconnects stops
/// waiting at once. When the bound passes, the request gets the contention response.
///
/// ```
/// use std::time::Duration;
/// use tower_batch_lock::{Locks, Wait};
///
/// let locks = Locks::memory().wait(Wait::up_to(Duration::from_millis(250)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Wait {
    bound: Duration,
}

impl Wait {
    /// Refuse at once (the default): right for duplicate submissions.
    pub const fn none() -> Self {
        Self {
            bound: Duration::ZERO,
        }
    }

    /// Wait at most `bound` for the keys to become free.
    pub const fn up_to(bound: Duration) -> Self {
        Self { bound }
    }

    /// The longest a request waits.
    pub const fn bound(self) -> Duration {
        self.bound
    }
}

/// The pauses between attempts while waiting, for when a wake-up is lost: growing from
/// 5 ms to 100 ms, each picked at random from its upper half, so that waiters that
/// missed the same release do not all retry at the same moment.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(5);
    const LAST: Duration = Duration::from_millis(100);

    pub(crate) fn new() -> Self {
        Self { next: Self::FIRST }
    }

    pub(crate) fn pause(&mut self) -> Duration {
        let ceiling = self.next;
        self.next = (self.next * 2).min(Self::LAST);
        ceiling.mul_f64(fastrand::f64().mul_add(0.5, 0.5))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_ceiling_with_jitter() {
        let mut backoff = Backoff::new();
        let pauses: Vec<Duration> = (0..10).map(|_| backoff.pause()).collect();
        assert!(pauses[0] >= Duration::from_micros(2500) && pauses[0] <= Backoff::FIRST);
        assert!(pauses.iter().all(|&p| p <= Backoff::LAST));
        assert!(pauses[9] >= Backoff::LAST / 2);
    }
}
