//! A fair waiter's place in line, which withdraws its reservations when the waiter goes
//! without its grant.
//!
//! An attempt whose answer never came (a timeout, a request dropped while its call was in
//! flight), or whose answer says that a part of it got none (a Redlock master, a cluster
//! group's reservation), may still reserve the batch after the wait ended, its command
//! queued on a connection given up: that reservation would keep later arrivals out of its
//! keys until the waiter's deadline, for a waiter long gone. So, as for a grant that lands
//! after its release ([`late`]), the withdrawal is sent again a few times once it was
//! answered, or after the grant that ended the wait.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    backoff::Backoff,
    store::{
        contract::{LockStore, Ticket},
        late,
        wake::LostAnswers,
    },
};

/// A fair waiter's place in line: its ticket, and the batch its attempts reserve. Dropped
/// while armed (the request was dropped, or the store failed), it withdraws the
/// reservations in the background.
pub(super) struct Place {
    pub(super) ticket: Ticket,
    armed: Option<Reserved>,
}

/// What a withdrawal needs: where, which keys, how long an attempt may take, when the
/// reservations end anyway, and whether they may still be put on after it.
struct Reserved {
    store: Arc<dyn LockStore>,
    keys: Arc<[String]>,
    timeout: Duration,
    until: Instant,
    /// Whether an attempt went out whose answer has not come (yet): it may reserve the
    /// batch later, after the withdrawal.
    unanswered: bool,
    /// Whether an answered attempt said that a part of it may still reserve the batch
    /// later: that stays so for the rest of the wait.
    strays: bool,
    /// The withdrawals whose answers were lost, for the waiters behind this place.
    lost: LostAnswers,
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
                unanswered: false,
                strays: false,
                lost: LostAnswers::default(),
            }),
        }
    }

    /// An attempt goes out: until it is [`answered`](Self::answered), it may reserve the
    /// batch at any time.
    pub(super) fn sent(&mut self) {
        if let Some(reserved) = &mut self.armed {
            reserved.unanswered = true;
        }
    }

    /// The store answered the attempt (a refusal, or a failure): it reserves nothing later,
    /// unless the answer says that a part of it `may_reserve_later`.
    pub(super) fn answered(&mut self, may_reserve_later: bool) {
        if let Some(reserved) = &mut self.armed {
            reserved.unanswered = false;
            reserved.strays |= may_reserve_later;
        }
    }

    /// The grant ended the reservations; an earlier attempt that may still put the place
    /// back is withdrawn again later, in the background.
    pub(super) fn granted(mut self) {
        if let Some(reserved) = self.armed.take() {
            if reserved.strays {
                spawn_rest(reserved, self.ticket, true);
            }
        }
    }

    /// Withdraws the reservations: one attempt now, bounded by the store's timeout, so
    /// that the refusal goes out within its limits; if it fails, more in the background.
    /// The place stays armed until that attempt is answered: dropped before (the request
    /// was dropped meanwhile), it withdraws in the background.
    pub(super) async fn withdraw(mut self) {
        let Some(reserved) = &self.armed else {
            return;
        };
        let answered = reserved.withdraw_once(self.ticket).await;
        if let Some(reserved) = self.armed.take() {
            if !answered || reserved.may_reserve_later() {
                spawn_rest(reserved, self.ticket, answered);
            }
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(reserved) = self.armed.take() {
            spawn_rest(reserved, self.ticket, false);
        }
    }
}

/// Withdraws `ticket`'s reservations in the background: until the store answers (unless
/// it `answered` already, or a grant ended them), then again on [`late`]'s schedule if an
/// attempt may still reserve the batch.
fn spawn_rest(reserved: Reserved, ticket: Ticket, answered: bool) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            if !answered && !reserved.withdraw_until_answered(ticket).await {
                return;
            }
            if reserved.may_reserve_later() {
                let reserved = &reserved;
                late::send_again(|| async move {
                    reserved.withdraw_once(ticket).await;
                })
                .await;
            }
        });
    }
}

impl Reserved {
    /// Whether an attempt of the wait may still reserve the batch.
    fn may_reserve_later(&self) -> bool {
        self.unanswered || self.strays
    }

    /// Attempts until the store answers (`true`), or until the reservations would have
    /// ended anyway. A place left behind keeps every later arrival out of its keys to its
    /// end; on PostgreSQL, a key that a release handed to this waiter stays held for its
    /// TTL.
    async fn withdraw_until_answered(&self, ticket: Ticket) -> bool {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        while !self.withdraw_once(ticket).await {
            if !backoff.sleep_before(self.until).await {
                tracing::debug!(
                    keys = self.keys.len(),
                    "could not withdraw reservations; they expire on their own"
                );
                return false;
            }
        }
        true
    }

    /// One attempt, bounded by the store's timeout; whether the store answered.
    async fn withdraw_once(&self, ticket: Ticket) -> bool {
        let earlier_lost = self.lost.sent();
        match tokio::time::timeout(self.timeout, self.store.withdraw(&self.keys, ticket)).await {
            Ok(Ok(_)) => {
                self.lost
                    .answered(earlier_lost, self.store.wakeups(), &self.keys);
                true
            }
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
