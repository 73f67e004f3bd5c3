//! A fair waiter's place in line, which withdraws its reservations when the waiter goes
//! without its grant.

use std::{sync::Arc, time::Duration};

use crate::store::contract::{LockStore, Ticket};

/// A fair waiter's place in line: its ticket, and the batch its attempts reserve. Dropped
/// while armed (the request was dropped, or the store failed), it withdraws the
/// reservations in the background; they expire at the waiter's deadline anyway.
pub(super) struct Place {
    pub(super) ticket: Ticket,
    armed: Option<Reserved>,
}

/// What a withdrawal needs: where, which keys, and how long it may take.
struct Reserved {
    store: Arc<dyn LockStore>,
    keys: Arc<[String]>,
    timeout: Duration,
}

impl Place {
    pub(super) fn take(store: Arc<dyn LockStore>, keys: Arc<[String]>, timeout: Duration) -> Self {
        Self {
            ticket: Ticket::take(),
            armed: Some(Reserved {
                store,
                keys,
                timeout,
            }),
        }
    }

    /// Forgets the reservations: the grant ended them.
    pub(super) fn disarm(mut self) {
        self.armed = None;
    }

    /// Withdraws the reservations now: one attempt, bounded by the store's timeout.
    pub(super) async fn withdraw(mut self) {
        if let Some(reserved) = self.armed.take() {
            reserved.withdraw(self.ticket).await;
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let Some(reserved) = self.armed.take() else {
            return;
        };
        let ticket = self.ticket;
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { reserved.withdraw(ticket).await });
        }
    }
}

impl Reserved {
    /// One attempt, bounded by the store's timeout: the reservations expire on their own.
    async fn withdraw(&self, ticket: Ticket) {
        let keys = self.keys.len();
        match tokio::time::timeout(self.timeout, self.store.withdraw(&self.keys, ticket)).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::debug!(
                %error,
                keys,
                "could not withdraw reservations; they expire on their own"
            ),
            Err(_) => tracing::debug!(
                keys,
                "withdrawing reservations timed out; they expire on their own"
            ),
        }
    }
}
