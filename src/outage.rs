//! The log of a store outage: one error when it starts, a summary while it lasts, and one
//! line when it ends, instead of an error per request. Every request still gets its 503,
//! and the metrics still count each one. Releases and lease extensions that fail (each
//! retried until the store answers or the keys expire) count in the same outage, where
//! each attempt logged a warning of its own.
//!
//! An outage ends at the first answer that comes [`SETTLED_AFTER`] after its last
//! failure, not at the first answer: a store that fails some calls and answers others
//! (one master of a cluster down, a Redlock master timing out now and then) is one outage,
//! where ending it at each answer logged a start and an end for nearly every request.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        LazyLock, Mutex, PoisonError,
    },
    time::{Duration, Instant},
};

/// How often an outage that goes on is summarized.
const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// How long the store must go without a failure for an answer to end its outage: as long
/// as between two summaries, so that a store that fails now and then logs at most a line
/// per 10 s.
const SETTLED_AFTER: Duration = SUMMARY_EVERY;

/// The outage of one [`Locks`](crate::Locks) handle's store, if it is down now.
#[derive(Debug, Default)]
pub(crate) struct OutageLog {
    /// When an answer may end the outage under way ([`now_ms`]), or 0 when there is none:
    /// the one read on the way of every answer, so that an answer costs one atomic load,
    /// in an outage too (one cluster master down: most calls answer), until one may end it.
    settles_at: AtomicU64,
    outage: Mutex<Option<Outage>>,
}

/// Milliseconds on the process's monotonic clock, from 1: what [`OutageLog::settles_at`]
/// counts in.
fn now_ms() -> u64 {
    static START: LazyLock<Instant> = LazyLock::new(Instant::now);
    u64::try_from(START.elapsed().as_millis()).unwrap_or(u64::MAX) + 1
}

#[derive(Debug)]
struct Outage {
    since: Instant,
    last_failure: Instant,
    /// Failed calls since the outage began, and since the last summary.
    failures: u64,
    unreported: u64,
    summarized_at: Instant,
}

impl OutageLog {
    /// A call to the store failed with `why` (a batch of `keys` keys): logged as an error
    /// if it starts an outage, counted for the next summary otherwise.
    pub(crate) fn failed(&self, why: &dyn std::fmt::Display, keys: usize) {
        let now = Instant::now();
        let mut outage = self.outage.lock().unwrap_or_else(PoisonError::into_inner);
        let settled_ms = u64::try_from(SETTLED_AFTER.as_millis()).unwrap_or(u64::MAX);
        self.settles_at
            .store(now_ms() + settled_ms, Ordering::Release);
        let Some(outage) = outage.as_mut() else {
            *outage = Some(Outage {
                since: now,
                last_failure: now,
                failures: 1,
                unreported: 0,
                summarized_at: now,
            });
            tracing::error!(
                error = %why,
                keys,
                "the lock store failed; requests whose calls fail get 503 (further \
                 failures are summarized every 10 s, and the outage ends 10 s after the last)"
            );
            return;
        };
        outage.failures += 1;
        outage.unreported += 1;
        outage.last_failure = now;
        if now.duration_since(outage.summarized_at) >= SUMMARY_EVERY {
            tracing::error!(
                error = %why,
                failed = outage.unreported,
                down_for_s = outage.since.elapsed().as_secs(),
                "the lock store is still failing"
            );
            outage.unreported = 0;
            outage.summarized_at = now;
        }
    }

    /// The store answered: ends the outage, if there was one and its last failure was
    /// [`SETTLED_AFTER`] ago, with a line that says how long it lasted.
    pub(crate) fn answered(&self) {
        let settles_at = self.settles_at.load(Ordering::Acquire);
        if settles_at == 0 || now_ms() < settles_at {
            return;
        }
        let mut outage = self.outage.lock().unwrap_or_else(PoisonError::into_inner);
        let settled = |o: &Outage| o.last_failure.elapsed() >= SETTLED_AFTER;
        if let Some(ended) = outage.take_if(|o| settled(o)) {
            self.settles_at.store(0, Ordering::Release);
            tracing::warn!(
                failed = ended.failures,
                failing_for_ms = ended.last_failure.duration_since(ended.since).as_millis() as u64,
                "the lock store answers again (no call failed for 10 s)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// When the outage began and how many calls failed in it, if one is under way.
    fn outage(log: &OutageLog) -> Option<(Instant, u64)> {
        let outage = log.outage.lock().unwrap();
        outage.as_ref().map(|o| (o.since, o.failures))
    }

    #[test]
    fn an_outage_starts_once_counts_its_failures_and_ends_once_settled() {
        let log = OutageLog::default();
        log.answered();
        assert_eq!(log.settles_at.load(Ordering::Acquire), 0);
        for _ in 0..3 {
            log.failed(&"connection refused", 1);
        }
        let (since, failures) = outage(&log).unwrap();
        assert_eq!(failures, 3);
        // Answers between failures (one master of several down) do not end it: the same
        // outage counts every failure.
        for _ in 0..3 {
            log.answered();
            log.failed(&"connection refused", 1);
        }
        assert_eq!(outage(&log), Some((since, 6)));
        // The first answer once no call failed for a while ends it.
        let settled_since = Instant::now().checked_sub(SETTLED_AFTER).unwrap();
        log.outage.lock().unwrap().as_mut().unwrap().last_failure = settled_since;
        log.settles_at.store(1, Ordering::Release);
        log.answered();
        assert_eq!(outage(&log), None);
        assert_eq!(log.settles_at.load(Ordering::Acquire), 0);
    }
}
