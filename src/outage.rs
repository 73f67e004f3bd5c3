//! The log of a store outage: one error when it starts, a summary while it lasts, and one
//! line when it ends, instead of an error per request. Every request still gets its 503,
//! and the metrics still count each one.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex, PoisonError,
    },
    time::{Duration, Instant},
};

/// How often an outage that goes on is summarized.
const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// The outage of one [`Locks`](crate::Locks) handle's store, if it is down now.
#[derive(Debug, Default)]
pub(crate) struct OutageLog {
    /// Whether an outage is under way: the one read on the way of every answer, so that a
    /// store that answers costs one atomic load.
    down: AtomicBool,
    outage: Mutex<Option<Outage>>,
}

#[derive(Debug)]
struct Outage {
    since: Instant,
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
        let Some(outage) = outage.as_mut() else {
            *outage = Some(Outage {
                since: now,
                failures: 1,
                unreported: 0,
                summarized_at: now,
            });
            self.down.store(true, Ordering::Release);
            tracing::error!(
                error = %why,
                keys,
                "the lock store failed; requests get 503 until it answers again \
                 (further failures are summarized every 10 s)"
            );
            return;
        };
        outage.failures += 1;
        outage.unreported += 1;
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

    /// The store answered: ends the outage, if there was one, with a line that says how
    /// long it lasted.
    pub(crate) fn answered(&self) {
        if !self.down.load(Ordering::Acquire) {
            return;
        }
        let mut outage = self.outage.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(ended) = outage.take() {
            self.down.store(false, Ordering::Release);
            tracing::warn!(
                failed = ended.failures,
                down_for_ms = ended.since.elapsed().as_millis() as u64,
                "the lock store answers again"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_starts_once_counts_its_failures_and_ends() {
        let log = OutageLog::default();
        log.answered();
        assert!(!log.down.load(Ordering::Acquire));
        for _ in 0..3 {
            log.failed(&"connection refused", 1);
        }
        let failures = log.outage.lock().unwrap().as_ref().map(|o| o.failures);
        assert_eq!(failures, Some(3));
        log.answered();
        assert!(log.outage.lock().unwrap().is_none());
        assert!(!log.down.load(Ordering::Acquire));
    }
}
