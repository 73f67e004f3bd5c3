//! What a request holds while its inner service runs.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::backend::{Backend, BoxFuture, OwnerToken};

/// The locks a request holds, as its handler sees them.
///
/// The layer puts a `Lease` into the request's extensions before it calls the inner
/// service, so a handler can take it with `axum::Extension<Lease>`:
///
/// ```
/// use axum::Extension;
/// use tower_batch_lock::Lease;
///
/// async fn handler(Extension(lease): Extension<Lease>) -> String {
///     format!("holding {} keys", lease.keys().len())
/// }
/// ```
///
/// It only describes the locks: they are released by the layer when the response is ready,
/// or when the request is dropped, however long a copy of the lease lives.
#[derive(Debug, Clone)]
pub struct Lease {
    keys: Arc<[String]>,
    prefix_len: usize,
    expires_at: Instant,
}

impl Lease {
    /// The keys held, sorted and without the namespace prefix.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.keys.iter().map(|k| &k[self.prefix_len..])
    }

    /// When the locks expire if nobody releases them: the TTL counted from the moment the
    /// acquisition was sent, so the real expiry in the store is never earlier.
    pub fn expires_at(&self) -> Instant {
        self.expires_at
    }
}

/// Releases a batch of keys when dropped, unless [released](Self::release) before.
///
/// `Drop` cannot wait for the store, so a drop spawns the release onto the Tokio runtime;
/// the keys' TTL frees them if even that fails.
#[derive(Debug)]
pub(crate) struct LockGuard {
    held: Option<Held>,
}

#[derive(Debug)]
struct Held {
    backend: Arc<dyn Backend>,
    keys: Arc<[String]>,
    owner: OwnerToken,
    timeout: Duration,
}

impl LockGuard {
    /// A guard for `keys` under `owner`, made *before* the acquisition is sent: if the
    /// acquiring future is dropped mid-flight, the store may have granted the batch, and
    /// only this guard's drop then releases it.
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        keys: Arc<[String]>,
        owner: OwnerToken,
        timeout: Duration,
    ) -> Self {
        Self {
            held: Some(Held {
                backend,
                keys,
                owner,
                timeout,
            }),
        }
    }

    /// What the handler may see of these locks.
    pub(crate) fn lease(&self, prefix_len: usize, expires_at: Instant) -> Option<Lease> {
        let held = self.held.as_ref()?;
        Some(Lease {
            keys: held.keys.clone(),
            prefix_len,
            expires_at,
        })
    }

    /// Forgets the keys without releasing them: for a batch the store refused, which
    /// wrote nothing to release.
    pub(crate) fn disarm(mut self) {
        self.held = None;
    }

    /// Releases the keys now. The returned future logs failures instead of returning them:
    /// by the time it runs, nobody could do better than wait for the TTL.
    pub(crate) fn release(mut self) -> BoxFuture<'static, ()> {
        match self.held.take() {
            Some(held) => Box::pin(held.release()),
            None => Box::pin(std::future::ready(())),
        }
    }
}

impl Held {
    async fn release(self) {
        let released =
            tokio::time::timeout(self.timeout, self.backend.release(&self.keys, self.owner)).await;
        match released {
            Ok(Ok(count)) => {
                tracing::trace!(keys = self.keys.len(), released = count, "released locks")
            }
            Ok(Err(error)) => {
                tracing::warn!(keys = self.keys.len(), %error, "could not release locks; they expire with their TTL")
            }
            Err(_) => tracing::warn!(
                keys = self.keys.len(),
                timeout_ms = self.timeout.as_millis() as u64,
                "releasing locks timed out; they expire with their TTL"
            ),
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(held.release());
            }
            Err(_) => tracing::warn!(
                keys = held.keys.len(),
                "locks dropped outside a Tokio runtime; they expire with their TTL"
            ),
        }
    }
}
