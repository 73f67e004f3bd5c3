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
        jittered(ceiling)
    }

    /// The pause before a look at what nothing announces and is `due` (zero: due now):
    /// until then, where that comes within a longest pause (drawn as the pauses are), or a
    /// longest pause, to look now and then for what was announced and lost; once it is
    /// due, the next pause.
    pub(crate) fn pause_until(&mut self, due: Duration) -> Duration {
        if due.is_zero() {
            self.pause()
        } else {
            due.min(jittered(self.last))
        }
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

/// A pause drawn at random between half and all of `ceiling`.
fn jittered(ceiling: Duration) -> Duration {
    ceiling.mul_f64(fastrand::f64().mul_add(0.5, 0.5))
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

    #[test]
    fn a_pause_until_what_is_due_ends_when_it_is_due_or_at_the_longest() {
        let (first, last) = (Duration::from_millis(5), Duration::from_millis(100));
        let mut backoff = Backoff::new(first, last);
        let due = Duration::from_millis(40);
        assert_eq!(backoff.pause_until(due), due);
        let capped = backoff.pause_until(Duration::from_secs(30));
        assert!(capped >= last / 2 && capped <= last, "{capped:?}");
        // Once due, the pauses start from the first.
        assert!(backoff.pause_until(Duration::ZERO) <= first);
    }
}
