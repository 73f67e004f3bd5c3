//! Whether a store refused a batch a moment ago. A big batch's shortcut for its free keys
//! (one Redis's plain pass, PostgreSQL's inserts first) takes them before it knows whether
//! another key keeps the batch out, and gives them back when one does: amid batches that
//! keep meeting each other and retrying, that starves them (`redis/steps.rs` has the
//! figures). So for [`PAUSE`] after a store refused a batch, its big batches go without it.

use std::{
    sync::{Mutex, PoisonError},
    time::{Duration, Instant},
};

use super::{contract::Acquire, error::StoreError};

/// How long after a refusal a store's big batches go without their shortcut: long enough
/// to cover a burst of requests that keep meeting each other and retry within
/// milliseconds, short enough that a quiet store soon saves its time again.
const PAUSE: Duration = Duration::from_secs(1);

/// When a store last refused a batch.
#[derive(Debug, Default)]
pub(crate) struct LastRefusal(Mutex<Option<Instant>>);

impl LastRefusal {
    /// Notes `answer`'s refusal, if it is one.
    pub(crate) fn note(&self, answer: &Result<Acquire, StoreError>) {
        if matches!(answer, Ok(Acquire::Held(_))) {
            *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        }
    }

    /// Whether the last refusal was less than [`PAUSE`] ago.
    pub(crate) fn recent(&self) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|at| at.elapsed() < PAUSE)
    }
}
