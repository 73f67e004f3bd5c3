//! An operator's view of the locks: what the store holds for some keys
//! ([`Locks::inspect`]), the batches this process holds ([`Locks::held_batches`]), and a
//! way out of a stuck lock ([`Locks::force_release`]).

use std::{sync::Arc, time::Duration};

use http::StatusCode;

use crate::{
    keys::{extractor::Key, normalize::normalize},
    locks::Locks,
    registry::HeldBatch,
    rejection::Rejection,
    store::{contract::KeyStatus, error::StoreError},
};
#[cfg(doc)]
use crate::{lease::Lease, locks::OnLostLease, store::contract::FencingToken};

/// What the store holds for one key: [`Locks::inspect`]'s answer. Never who holds it: the
/// owner token is a capability, and it stays in the store.
///
/// ```
/// use tower_batch_lock::{store::Store, KeyStatus, Locks};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_batch_lock::Rejection> {
/// let locks = Locks::new(Store::isolated_memory());
/// let states = locks.inspect(["order:42"]).await?;
/// assert_eq!(states[0].key(), "order:42");
/// assert_eq!(states[0].status(), KeyStatus::Free);
/// assert_eq!((states[0].holds(), states[0].waiters()), (0, 0));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyState {
    key: String,
    status: KeyStatus,
    ttl: Option<Duration>,
    holds: usize,
    waiters: usize,
}

impl KeyState {
    /// The key as requests name it (without the [prefix](Locks::prefix)).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Free, held (exclusively), shared, or foreign.
    pub fn status(&self) -> KeyStatus {
        self.status
    }

    /// Whether the key keeps some requests out: [held](KeyStatus::Held),
    /// [shared](KeyStatus::Shared) (which keeps out exclusive requests) or
    /// [foreign](KeyStatus::Foreign).
    pub fn is_held(&self) -> bool {
        self.status != KeyStatus::Free
    }

    /// How long until the key expires if nobody releases or renews it; `None` when it is
    /// free (or a foreign value without a TTL).
    pub fn ttl(&self) -> Option<Duration> {
        self.ttl
    }

    /// How many holds the key has: one per acquisition of its owner (more than one when a
    /// nested layer or the handler's [`Lease::lock`](crate::Lease::lock) entered it again),
    /// or, for a [shared](KeyStatus::Shared) key, one per shared holder (and per re-entry);
    /// 0 when free.
    pub fn holds(&self) -> usize {
        self.holds
    }

    /// How many waiters in line have the key reserved ([`Wait::fair`](crate::Wait::fair)),
    /// counting only live reservations.
    pub fn waiters(&self) -> usize {
        self.waiters
    }
}

/// How many keys the warning of a forced release names; it counts them all.
const LOGGED_KEYS: usize = 100;

impl Locks {
    /// What the store holds for each of `keys`, without changing anything: held
    /// (exclusively or shared) or free, the time left, the number of holds, the waiters in
    /// line. Never who holds them.
    ///
    /// The keys are the ones requests name (the [prefix](Locks::prefix) goes in front), and
    /// the answer lists them as a request's batch would be: sorted, each once. On
    /// [Redlock](crate::store::Redlock), each key is what a majority of the masters see: held when
    /// a majority holds it (in one mode), since that is when it keeps requests out; a leftover on a
    /// minority keeps nobody out and expires on its own, so it shows as free. The time
    /// left and the holds are those that a majority still has. A per-master view would
    /// answer a question the locks never ask; `redis-cli` on each master gives it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_batch_lock::{store::Store, KeyStatus, Locks};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_batch_lock::Rejection> {
    /// let locks = Locks::new(Store::isolated_memory());
    /// for state in locks.inspect(["sku:1", "sku:2"]).await? {
    ///     if state.status() == KeyStatus::Held {
    ///         println!("{} held for {:?} more", state.key(), state.ttl().unwrap_or_default());
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// The [`Rejection`] a request would get: a key it could not lock either (empty, too
    /// long, too many keys: 400 or 413), or a store that failed or did not answer within
    /// the [store timeout](Locks::store_timeout) (503; for Redlock, fewer than a majority
    /// of the masters answered). A store's failure is logged with its cause.
    pub async fn inspect<I>(&self, keys: I) -> Result<Vec<KeyState>, Rejection>
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let keys = self.operator_keys(keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let inspected =
            tokio::time::timeout(self.call_timeout(), self.store().locks.inspect(&keys));
        let views = match inspected.await {
            Ok(Ok(views)) => views,
            Ok(Err(error)) => return Err(operator_failure("inspecting", error)),
            Err(_) => return Err(self.timed_out("inspecting")),
        };
        let prefix = self.prefix_len();
        Ok(keys
            .iter()
            .zip(views)
            .map(|(key, view)| KeyState {
                key: key[prefix..].to_owned(),
                status: view.status,
                ttl: view.ttl,
                holds: view.holds,
                waiters: view.waiters,
            })
            .collect())
    }

    /// The batches that requests hold now through this handle and its clones (every layer
    /// made from it, every handle tuned from it): the route, how long it has been held, how
    /// many keys, and the request id. Newest last. Another handle on the same store, and
    /// other processes, keep their own lists; [`inspect`](Self::inspect) sees every holder.
    ///
    /// A batch is listed from its grant until its release begins, with
    /// [`Locks::hold_until_body_end`] until the body ends. Listing starts with the first
    /// call of this method, or where the operator's routes are built (`admin::router`, with
    /// the `admin` feature): until someone asks, requests keep no list, and the batches
    /// granted before are not in it.
    ///
    /// ```
    /// use tower_batch_lock::{store::Store, Locks};
    ///
    /// let locks = Locks::new(Store::isolated_memory());
    /// for batch in locks.held_batches() {
    ///     println!("{:?} holds {} keys for {:?}", batch.route(), batch.key_count(), batch.age());
    /// }
    /// assert!(locks.held_batches().is_empty());
    /// ```
    pub fn held_batches(&self) -> Vec<HeldBatch> {
        self.batches().list()
    }

    /// **Dangerous.** Ends every hold on `keys`, whoever has it: for a lock that is stuck
    /// (a holder that hangs, a TTL set far too long), when waiting for its expiry is worse.
    ///
    /// The holder is not stopped: its critical section goes on **without exclusion**, side
    /// by side with the next request that takes the keys, until it ends. Its lease learns
    /// of the loss only at its next renewal ([`Lease::lost`](Lease::lost); with
    /// [`OnLostLease::Cancel`](OnLostLease::Cancel) its handler is then cancelled),
    /// and its release later finds nothing to release and does no harm. Resources that
    /// check [fencing tokens](FencingToken) refuse its late writes; nothing else
    /// does. Prefer waiting for the TTL when you can.
    ///
    /// Waiters' reservations stay: the waiters in line take the keys next, in their order,
    /// rather than a request that arrived just now (and a waiter whose process is gone loses
    /// its reservations at its deadline). The waiters first in line are woken, in this
    /// process and (on Redis) in every process that subscribes to releases. A foreign
    /// value under a key is left alone. On Redlock, it succeeds when a majority of the
    /// masters answered.
    ///
    /// Every call is logged as a warning, with the keys, the `reason` and how many were
    /// held.
    ///
    /// ```
    /// use tower_batch_lock::{store::Store, Locks};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_batch_lock::Rejection> {
    /// let locks = Locks::new(Store::isolated_memory());
    /// let released = locks
    ///     .force_release(["order:42"], "holder hung since 10:02, ticket OPS-1234")
    ///     .await?;
    /// assert_eq!(released, 0); // nobody held it
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`inspect`](Self::inspect). After a timeout, some holds may have ended.
    pub async fn force_release<I>(&self, keys: I, reason: &str) -> Result<usize, Rejection>
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let keys = self.operator_keys(keys)?;
        if keys.is_empty() {
            return Ok(0);
        }
        let prefix = self.prefix_len();
        let named: Vec<&str> = keys
            .iter()
            .take(LOGGED_KEYS)
            .map(|k| &k[prefix..])
            .collect();
        let released =
            tokio::time::timeout(self.call_timeout(), self.store().locks.force_release(&keys))
                .await;
        match released {
            Ok(Ok(released)) => {
                tracing::warn!(
                    keys = ?named,
                    key_count = keys.len(),
                    released,
                    reason,
                    "FORCED RELEASE of locks: their holders no longer exclude others"
                );
                Ok(released)
            }
            Ok(Err(error)) => {
                tracing::warn!(
                    keys = ?named,
                    key_count = keys.len(),
                    reason,
                    %error,
                    "a forced release of locks failed; some may have been released"
                );
                Err(operator_failure("releasing", error))
            }
            Err(_) => {
                tracing::warn!(
                    keys = ?named,
                    key_count = keys.len(),
                    reason,
                    "a forced release of locks timed out; some may have been released"
                );
                Err(self.timed_out("releasing"))
            }
        }
    }

    /// `keys` normalized as a request's are.
    fn operator_keys<I>(&self, keys: I) -> Result<Arc<[String]>, Rejection>
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let keys = keys.into_iter().map(|key| Key::from(key.into())).collect();
        Ok(normalize(keys, self.key_policy(), false)?.keys)
    }

    fn timed_out(&self, doing: &str) -> Rejection {
        let timeout = self.call_timeout();
        tracing::warn!(
            timeout_ms = timeout.as_millis() as u64,
            doing,
            "the lock store did not answer an operator's call in time"
        );
        Rejection::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the lock store did not answer within the store timeout ({} ms) while {doing}",
                timeout.as_millis()
            ),
        )
    }
}

/// The answer to an operator's call that the store failed; the cause goes to the log.
fn operator_failure(doing: &'static str, error: StoreError) -> Rejection {
    tracing::warn!(%error, doing, "the lock store failed an operator's call");
    Rejection::new(
        error.status(),
        format!("the lock store failed while {doing}; the cause is logged"),
    )
}
