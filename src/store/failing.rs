//! The log of a task that runs beside the store's calls (a release listener, PostgreSQL's
//! sweeper of dead rows) and fails again and again while its server is away: its first
//! failure is a warning, the next are debug lines until it succeeds again, which it says
//! then. A server away for ten minutes is two lines, not one an attempt.

use std::fmt::Display;

/// What a task says of itself: when it first fails, when it fails again, when it is back.
pub(crate) struct Lines {
    pub(crate) failed: &'static str,
    pub(crate) still: &'static str,
    pub(crate) back: &'static str,
}

/// One task's failures since it last succeeded, and their log.
pub(crate) struct Failing {
    lines: &'static Lines,
    /// Where it works: a server's address (never a URL: it may carry a password), or the
    /// table it sweeps.
    at: String,
    failures: u32,
}

impl Failing {
    pub(crate) fn new(lines: &'static Lines, at: String) -> Self {
        Self {
            lines,
            at,
            failures: 0,
        }
    }

    /// It failed, for `why`.
    pub(crate) fn failed(&mut self, why: &dyn Display) {
        let (at, lines) = (&self.at, self.lines);
        if self.failures == 0 {
            tracing::warn!(%at, error = %why, "{}", lines.failed);
        } else {
            tracing::debug!(%at, error = %why, "{}", lines.still);
        }
        self.failures = self.failures.saturating_add(1);
    }

    /// It succeeded (again).
    pub(crate) fn succeeded(&mut self) {
        if self.failures > 0 {
            let (at, failed_attempts) = (&self.at, self.failures);
            tracing::info!(%at, failed_attempts, "{}", self.lines.back);
        }
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use tracing::Level;

    use super::*;
    use crate::log_once::tests::levels_logged;

    static LINES: Lines = Lines {
        failed: "failed",
        still: "still failing",
        back: "back",
    };

    #[test]
    fn a_task_that_keeps_failing_warns_once_and_says_when_it_is_back() {
        let logged = levels_logged(|| {
            let mut task = Failing::new(&LINES, "127.0.0.1:5432".to_owned());
            task.succeeded();
            for _ in 0..3 {
                task.failed(&"connection refused");
            }
            task.succeeded();
            task.succeeded();
            task.failed(&"connection refused");
        });
        let expected = [
            Level::WARN,
            Level::DEBUG,
            Level::DEBUG,
            Level::INFO,
            Level::WARN,
        ];
        assert_eq!(logged, expected);
    }
}
