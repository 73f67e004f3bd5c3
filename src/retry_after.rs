//! How long a refused client is told to wait before it tries again.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

/// What a contention response's `Retry-After` says (see [`Locks::retry_after`]).
///
/// Whatever the choice, it is never later than the earliest expiry among the conflicting
/// keys (by then they are free, whoever held them), and never less than a second (the
/// header counts whole seconds).
///
/// ```
/// use std::time::Duration;
/// use tower_batch_lock::{Locks, RetryAfter};
///
/// // Holds usually last a few hundred milliseconds: the default tells clients so.
/// let locks = Locks::memory().retry_after(RetryAfter::Observed);
/// // A fixed hint, for clients you know.
/// let fixed = Locks::memory().retry_after(RetryAfter::Fixed(Duration::from_secs(2)));
/// # drop((locks, fixed));
/// ```
///
/// [`Locks::retry_after`]: crate::Locks::retry_after
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RetryAfter {
    /// How long the locks of this [`Locks`](crate::Locks) handle were held lately, in this
    /// process: a moving average of recent holds, from grant to release. The default.
    /// Before the first hold ends, a second.
    #[default]
    Observed,
    /// When the earliest of the conflicting keys expires: an upper bound, which for a lock
    /// released long before its TTL tells clients to wait far too long.
    Expiry,
    /// This long.
    Fixed(Duration),
}

impl RetryAfter {
    /// The wait to advise, from the typical hold time and the earliest expiry among the
    /// conflicting keys, when the store knows it.
    pub(crate) fn advise(self, holds: &HoldTimes, earliest_expiry: Option<Duration>) -> Duration {
        const UNKNOWN: Duration = Duration::from_secs(1);
        let advice = match self {
            Self::Observed => holds.typical().unwrap_or(UNKNOWN),
            Self::Expiry => earliest_expiry.unwrap_or(UNKNOWN),
            Self::Fixed(after) => after,
        };
        earliest_expiry.map_or(advice, |expiry| advice.min(expiry))
    }
}

/// A moving average of how long holds last, shared by every clone of a `Locks` handle.
#[derive(Debug, Default)]
pub(crate) struct HoldTimes {
    /// Microseconds; 0 until the first hold ends.
    average_us: AtomicU64,
}

impl HoldTimes {
    /// Counts a hold that lasted `held`. Each weighs an eighth: the average follows a
    /// change in the handlers' pace within a few dozen requests, and one slow request
    /// moves it little. Concurrent updates may lose one another's sample: it is a hint.
    pub(crate) fn record(&self, held: Duration) {
        let sample = u64::try_from(held.as_micros()).unwrap_or(u64::MAX).max(1);
        let average = self.average_us.load(Ordering::Relaxed);
        let next = if average == 0 {
            sample
        } else {
            average - average / 8 + sample / 8
        };
        self.average_us.store(next.max(1), Ordering::Relaxed);
    }

    /// The average hold, once one has ended.
    pub(crate) fn typical(&self) -> Option<Duration> {
        match self.average_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advice_follows_observed_holds_and_never_passes_the_expiry() {
        let holds = HoldTimes::default();
        let expiry = Some(Duration::from_secs(30));
        assert_eq!(
            RetryAfter::Observed.advise(&holds, expiry),
            Duration::from_secs(1)
        );
        for _ in 0..50 {
            holds.record(Duration::from_millis(300));
        }
        let observed = RetryAfter::Observed.advise(&holds, expiry);
        assert!(observed.abs_diff(Duration::from_millis(300)) < Duration::from_millis(5));
        assert_eq!(
            RetryAfter::Expiry.advise(&holds, expiry),
            Duration::from_secs(30)
        );
        let fixed = RetryAfter::Fixed(Duration::from_secs(60));
        assert_eq!(fixed.advise(&holds, expiry), Duration::from_secs(30));
        let soon = Some(Duration::from_millis(100));
        assert_eq!(
            RetryAfter::Observed.advise(&holds, soon),
            Duration::from_millis(100)
        );
    }

    #[test]
    fn one_slow_hold_moves_the_average_little() {
        let holds = HoldTimes::default();
        for _ in 0..50 {
            holds.record(Duration::from_millis(100));
        }
        holds.record(Duration::from_secs(10));
        let typical = holds.typical().unwrap();
        assert!(typical < Duration::from_millis(1_400), "{typical:?}");
    }
}
