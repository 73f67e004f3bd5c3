//! An operator's view of the locks: what the store holds for some keys
//! ([`Locks::inspect`]), the batches this process holds ([`Locks::held_batches`]), and a
//! way out of a stuck lock ([`Locks::force_release`]).

use std::{
    collections::HashMap,
    fmt,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::{Duration, Instant},
};

use axum::extract::MatchedPath;
use http::{HeaderValue, Request, StatusCode};

use crate::{keys::normalize, Locks};

/// Whether a key is locked, as [`Locks::inspect`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyStatus {
    /// Nobody holds the key (waiters may still have it reserved).
    Free,
    /// A request holds the key.
    Held,
    /// The store keeps something under the key that this crate did not write (another
    /// program's value, an older version's lock). It keeps every request out, and
    /// [`Locks::force_release`] leaves it alone.
    Foreign,
}

impl KeyStatus {
    /// `"free"`, `"held"` or `"foreign"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Held => "held",
            Self::Foreign => "foreign",
        }
    }
}

impl fmt::Display for KeyStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the store holds for one key: [`Locks::inspect`]'s answer. Never who holds it: the
/// owner token is a capability, and it stays in the store.
///
/// ```
/// use tower_batch_lock::{KeyStatus, Locks};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_batch_lock::OperatorError> {
/// let locks = Locks::isolated_memory();
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

    /// Free, held, or foreign.
    pub fn status(&self) -> KeyStatus {
        self.status
    }

    /// Whether the key keeps requests out: [held](KeyStatus::Held) or
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
    /// nested layer or the handler's [`Lease::lock`](crate::Lease::lock) entered it again);
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

/// A batch of keys this process holds now: [`Locks::held_batches`]'s answer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldBatch {
    route: Option<String>,
    request_id: Option<String>,
    age: Duration,
    keys: usize,
}

impl HeldBatch {
    /// The route that took it (axum's [`MatchedPath`], such as `/orders/{id}`), when the
    /// layer ran inside an axum router.
    pub fn route(&self) -> Option<&str> {
        self.route.as_deref()
    }

    /// The request's `x-request-id` header, when it had one.
    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }

    /// How long it has been held.
    pub fn age(&self) -> Duration {
        self.age
    }

    /// How many keys it holds.
    pub fn key_count(&self) -> usize {
        self.keys
    }
}

/// An operator's call ([`Locks::inspect`], [`Locks::force_release`]) that failed: keys the
/// layer would refuse (a 4xx), or a store that did not answer in time (503).
#[derive(Debug)]
pub struct OperatorError {
    status: StatusCode,
    detail: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl OperatorError {
    /// The HTTP status that fits: the 400 or 413 of a key a request could not lock either,
    /// or 503 when the store could not answer.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    fn unavailable(
        detail: String,
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            detail,
            source,
        }
    }
}

impl fmt::Display for OperatorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for OperatorError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|s| s as _)
    }
}

/// How many keys the warning of a forced release names; it counts them all.
const LOGGED_KEYS: usize = 100;

impl Locks {
    /// What the store holds for each of `keys`, without changing anything: held or free,
    /// the time left, the number of holds, the waiters in line. Never who holds them.
    ///
    /// The keys are the ones requests name (the [prefix](Locks::prefix) goes in front), and
    /// the answer lists them as a request's batch would be: sorted, each once. On
    /// [Redlock](crate::Redlock), each key is what a majority of the masters see: held when
    /// a majority holds it, since that is when it keeps requests out; a leftover on a
    /// minority keeps nobody out and expires on its own, so it shows as free. The time
    /// left and the holds are those that a majority still has. A per-master view would
    /// answer a question the locks never ask; `redis-cli` on each master gives it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_batch_lock::{KeyStatus, Locks};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_batch_lock::OperatorError> {
    /// let locks = Locks::isolated_memory();
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
    /// An [`OperatorError`]: a key a request could not lock either (empty, too long, too
    /// many keys: 400 or 413), or a store that did not answer within the
    /// [backend timeout](Locks::backend_timeout) (for Redlock, fewer than a majority of
    /// the masters answered).
    pub async fn inspect<I>(&self, keys: I) -> Result<Vec<KeyState>, OperatorError>
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let keys = self.operator_keys(keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let views =
            match tokio::time::timeout(self.call_timeout(), self.backend.inspect(&keys)).await {
                Ok(Ok(views)) => views,
                Ok(Err(error)) => {
                    return Err(OperatorError::unavailable(
                        "the lock store could not be inspected".to_owned(),
                        Some(error.into()),
                    ))
                }
                Err(_) => return Err(self.timed_out("inspecting")),
            };
        let prefix = self.prefix_len();
        Ok(keys
            .into_iter()
            .zip(views)
            .map(|(mut key, view)| KeyState {
                key: key.split_off(prefix),
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
    /// [`Locks::hold_until_body_end`] until the body ends.
    ///
    /// ```
    /// use tower_batch_lock::Locks;
    ///
    /// let locks = Locks::isolated_memory();
    /// for batch in locks.held_batches() {
    ///     println!("{:?} holds {} keys for {:?}", batch.route(), batch.key_count(), batch.age());
    /// }
    /// assert!(locks.held_batches().is_empty());
    /// ```
    pub fn held_batches(&self) -> Vec<HeldBatch> {
        self.batches.list()
    }

    /// **Dangerous.** Ends every hold on `keys`, whoever has it: for a lock that is stuck
    /// (a holder that hangs, a TTL set far too long), when waiting for its expiry is worse.
    ///
    /// The holder is not stopped: its critical section goes on **without exclusion**, side
    /// by side with the next request that takes the keys, until it ends. Its lease learns
    /// of the loss only at its next renewal ([`Lease::lost`](crate::Lease::lost); with
    /// [`OnLostLease::Cancel`](crate::OnLostLease::Cancel) its handler is then cancelled),
    /// and its release later finds nothing to release and does no harm. Resources that
    /// check [fencing tokens](crate::FencingToken) refuse its late writes; nothing else
    /// does. Prefer waiting for the TTL when you can.
    ///
    /// Waiters' reservations stay: the waiters in line take the keys next, in their order,
    /// rather than a request that arrived just now (and a waiter that is gone loses its
    /// reservations within [`Wait::RESERVATION_TTL`](crate::Wait::RESERVATION_TTL)). The
    /// waiters are woken, in this process and (on Redis) in every process that subscribes
    /// to releases. A foreign value under a key is left alone. On Redlock, it succeeds when
    /// a majority of the masters answered.
    ///
    /// Every call is logged as a warning, with the keys, the `reason` and how many were
    /// held.
    ///
    /// ```
    /// use tower_batch_lock::Locks;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_batch_lock::OperatorError> {
    /// let locks = Locks::isolated_memory();
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
    pub async fn force_release<I>(&self, keys: I, reason: &str) -> Result<usize, OperatorError>
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
            tokio::time::timeout(self.call_timeout(), self.backend.force_release(&keys)).await;
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
                Err(OperatorError::unavailable(
                    "the lock store could not release the keys".to_owned(),
                    Some(error.into()),
                ))
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
    fn operator_keys<I>(&self, keys: I) -> Result<Vec<String>, OperatorError>
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let keys = keys.into_iter().map(Into::into).collect();
        normalize(keys, self.key_policy()).map_err(|rejection| OperatorError {
            status: rejection.status(),
            detail: rejection.body_text().to_owned(),
            source: None,
        })
    }

    fn timed_out(&self, doing: &str) -> OperatorError {
        OperatorError::unavailable(
            format!(
                "the lock store did not answer within the backend timeout ({} ms) while {doing}",
                self.call_timeout().as_millis()
            ),
            None,
        )
    }
}

/// The batches a [`Locks`] handle and its clones hold now. Sharded, so that requests on
/// different cores rarely share a mutex on the way in and out.
#[derive(Debug, Default)]
pub(crate) struct Batches {
    next: AtomicU64,
    shards: [Mutex<HashMap<u64, Batch>>; BATCH_SHARDS],
}

const BATCH_SHARDS: usize = 8;

#[derive(Debug)]
struct Batch {
    route: Option<MatchedPath>,
    request_id: Option<HeaderValue>,
    since: Instant,
    keys: usize,
}

impl Batches {
    /// Lists a batch of `keys` keys granted to `request` now, until the returned
    /// registration drops.
    pub(crate) fn register<B>(self: &Arc<Self>, request: &Request<B>, keys: usize) -> Registered {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let batch = Batch {
            route: request.extensions().get::<MatchedPath>().cloned(),
            request_id: request.headers().get("x-request-id").cloned(),
            since: Instant::now(),
            keys,
        };
        self.shard(id).insert(id, batch);
        Registered {
            batches: self.clone(),
            id,
        }
    }

    fn shard(&self, id: u64) -> std::sync::MutexGuard<'_, HashMap<u64, Batch>> {
        // Every change is one insert or remove: a poisoned map is still whole.
        self.shards[(id % BATCH_SHARDS as u64) as usize]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn list(&self) -> Vec<HeldBatch> {
        let now = Instant::now();
        let mut listed: Vec<(u64, HeldBatch)> = Vec::new();
        for shard in 0..BATCH_SHARDS as u64 {
            listed.extend(self.shard(shard).iter().map(|(&id, batch)| {
                let held = HeldBatch {
                    route: batch.route.as_ref().map(|r| r.as_str().to_owned()),
                    request_id: batch
                        .request_id
                        .as_ref()
                        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
                    age: now.saturating_duration_since(batch.since),
                    keys: batch.keys,
                };
                (id, held)
            }));
        }
        listed.sort_unstable_by_key(|&(id, _)| id);
        listed.into_iter().map(|(_, batch)| batch).collect()
    }
}

/// A batch's place in [`Batches`]: it leaves the list when this drops.
#[derive(Debug)]
pub(crate) struct Registered {
    batches: Arc<Batches>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.batches.shard(self.id).remove(&self.id);
    }
}
