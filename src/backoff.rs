//! One backoff for every retry loop: waiting for busy keys, retrying a release, a
//! subscription, a moving cluster.

use std::time::{Duration, Instant};

/// Pauses that start at `first` and double up to `last`, each drawn at random between
/// half and all of that (so that processes that failed together do not retry together).
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    next: Duration,
    last: Duration,
}

impl Backoff {
    pub(crate) fn new(first: Duration, last: Duration) -> Self {
        Self { next: first, last }
    }

    /// The next pause.
    pub(crate) fn pause(&mut self) -> Duration {
        let ceiling = self.next;
        self.next = (self.next * 2).min(self.last);
        ceiling.mul_f64(fastrand::f64().mul_add(0.5, 0.5))
    }

    /// Sleeps the next pause before another try, unless that would take it to `until` or
    /// past it: then `false` at once, and the caller gives up. The skeleton of every retry
    /// loop: try, [`sleep_before`](Self::sleep_before) the deadline, try again.
    pub(crate) async fn sleep_before(&mut self, until: Instant) -> bool {
        let pause = self.pause();
        if Instant::now() + pause >= until {
            return false;
        }
        tokio::time::sleep(pause).await;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_grow_to_their_ceiling_with_jitter() {
        let (first, last) = (Duration::from_millis(5), Duration::from_millis(100));
        let mut backoff = Backoff::new(first, last);
        let pauses: Vec<Duration> = (0..10).map(|_| backoff.pause()).collect();
        assert!(pauses[0] >= first / 2 && pauses[0] <= first);
        assert!(pauses.iter().all(|&p| p <= last));
        assert!(pauses[9] >= last / 2);
    }
}
