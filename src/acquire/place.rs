//! A fair waiter's place in line, which withdraws its reservations when the waiter goes
//! without its grant.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    backoff::Backoff,
    store::contract::{LockStore, Ticket},
};

/// A fair waiter's place in line: its ticket, and the batch its attempts reserve. Dropped
/// while armed (the request was dropped, or the store failed), it withdraws the
/// reservations in the background.
pub(super) struct Place {
    pub(super) ticket: Ticket,
    armed: Option<Reserved>,
}

/// What a withdrawal needs: where, which keys, how long an attempt may take, and when the
/// reservations end anyway.
struct Reserved {
    store: Arc<dyn LockStore>,
    keys: Arc<[String]>,
    timeout: Duration,
    until: Instant,
}

impl Place {
    /// A place for `keys`, whose reservations end at `until` unless withdrawn before.
    pub(super) fn take(
        store: Arc<dyn LockStore>,
        keys: Arc<[String]>,
        timeout: Duration,
        until: Instant,
    ) -> Self {
        Self {
            ticket: Ticket::take(),
            armed: Some(Reserved {
                store,
                keys,
                timeout,
                until,
            }),
        }
    }

    /// Forgets the reservations: the grant ended them.
    pub(super) fn disarm(mut self) {
        self.armed = None;
    }

    /// Withdraws the reservations: one attempt now, bounded by the store's timeout, so
    /// that the refusal goes out within its limits; if it fails, more in the background.
    pub(super) async fn withdraw(mut self) {
        if let Some(reserved) = self.armed.take() {
            if !reserved.withdraw_once(self.ticket).await {
                spawn_retries(reserved, self.ticket);
            }
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(reserved) = self.armed.take() {
            spawn_retries(reserved, self.ticket);
        }
    }
}

/// Withdraws `ticket`'s reservations in the background, until the store answers.
fn spawn_retries(reserved: Reserved, ticket: Ticket) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move { reserved.withdraw_until_answered(ticket).await });
    }
}

impl Reserved {
    /// Attempts until the store answers, or until the reservations would have ended
    /// anyway. A place left behind keeps every later arrival out of its keys to its end;
    /// on PostgreSQL, a key that a release handed to this waiter stays held for its TTL.
    async fn withdraw_until_answered(&self, ticket: Ticket) {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        while !self.withdraw_once(ticket).await {
            if !backoff.sleep_before(self.until).await {
                tracing::debug!(
                    keys = self.keys.len(),
                    "could not withdraw reservations; they expire on their own"
                );
                return;
            }
        }
    }

    /// One attempt, bounded by the store's timeout; whether the store answered.
    async fn withdraw_once(&self, ticket: Ticket) -> bool {
        match tokio::time::timeout(self.timeout, self.store.withdraw(&self.keys, ticket)).await {
            Ok(Ok(_)) => true,
            Ok(Err(error)) => {
                tracing::debug!(%error, keys = self.keys.len(), "withdrawing reservations failed");
                false
            }
            Err(_) => {
                tracing::debug!(keys = self.keys.len(), "withdrawing reservations timed out");
                false
            }
        }
    }
}
