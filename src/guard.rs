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
/// `Drop` cannot wait for the store, so a drop spawns the release onto the Tokio runtime,
/// which retries while the store does not answer, until the keys would have expired anyway;
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
    /// When the keys expire in the store if nobody releases them (never earlier): past
    /// this, retrying a release has nothing left to free.
    expires_at: Instant,
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
        expires_at: Instant,
    ) -> Self {
        Self {
            held: Some(Held {
                backend,
                keys,
                owner,
                timeout,
                expires_at,
            }),
        }
    }

    /// What the handler may see of these locks.
    pub(crate) fn lease(&self, prefix_len: usize) -> Option<Lease> {
        let held = self.held.as_ref()?;
        Some(Lease {
            keys: held.keys.clone(),
            prefix_len,
            expires_at: held.expires_at,
        })
    }

    /// Forgets the keys without releasing them: for a batch the store refused (it wrote
    /// nothing), or one already released.
    pub(crate) fn disarm(mut self) {
        self.held = None;
    }

    /// Releases the keys now. The returned future logs failures instead of returning them:
    /// by the time it runs, nobody could do better than wait for the TTL.
    ///
    /// The future owns the guard, still armed, until the store has answered: if the future
    /// is dropped midway (the client left just as the handler finished), the guard's drop
    /// sends the release again. Releasing twice is harmless; releasing never is not.
    /// Likewise when the store does not answer: the response goes out after one attempt,
    /// and the guard's drop keeps retrying in the background.
    pub(crate) fn release(self) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            if let Some(held) = &self.held {
                if !held.release().await {
                    return; // dropped armed: retried from `Drop`
                }
            }
            self.disarm();
        })
    }
}

impl Held {
    /// One attempt; whether the store answered.
    async fn release(&self) -> bool {
        let released =
            tokio::time::timeout(self.timeout, self.backend.release(&self.keys, self.owner)).await;
        match released {
            Ok(Ok(count)) => {
                tracing::trace!(keys = self.keys.len(), released = count, "released locks");
                true
            }
            Ok(Err(error)) => {
                tracing::warn!(keys = self.keys.len(), %error, "could not release locks");
                false
            }
            Err(_) => {
                tracing::warn!(
                    keys = self.keys.len(),
                    timeout_ms = self.timeout.as_millis() as u64,
                    "releasing locks timed out"
                );
                false
            }
        }
    }

    /// Retries until the store answers, or until the keys would have expired anyway.
    ///
    /// One attempt is not enough after an acquisition whose outcome is unknown: the store
    /// that was too slow to answer it is usually too slow for the release that follows
    /// at once, and the acquisition may still run when it recovers. A release sent after
    /// the store recovered runs after it, on any connection.
    async fn release_until_answered(&self) {
        let mut pause = Duration::from_millis(50);
        while !self.release().await {
            if Instant::now() + pause >= self.expires_at {
                tracing::warn!(
                    keys = self.keys.len(),
                    "gave up releasing locks; they expire with their TTL"
                );
                return;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move { held.release_until_answered().await });
            }
            Err(_) => tracing::warn!(
                keys = held.keys.len(),
                "locks dropped outside a Tokio runtime; they expire with their TTL"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::backend::{memory::MemoryBackend, Acquire, BackendError};

    /// The memory store, except that its next release never answers: a store that went
    /// silent just as a response was finishing.
    #[derive(Debug)]
    struct StallingRelease {
        store: MemoryBackend,
        stall_next: AtomicBool,
    }

    impl Backend for StallingRelease {
        fn acquire<'a>(
            &'a self,
            keys: &'a [String],
            owner: OwnerToken,
            ttl: Duration,
            report: usize,
        ) -> BoxFuture<'a, Result<Acquire, BackendError>> {
            self.store.acquire(keys, owner, ttl, report)
        }

        fn release<'a>(
            &'a self,
            keys: &'a [String],
            owner: OwnerToken,
        ) -> BoxFuture<'a, Result<usize, BackendError>> {
            if self.stall_next.swap(false, Ordering::SeqCst) {
                return Box::pin(std::future::pending());
            }
            self.store.release(keys, owner)
        }
    }

    #[tokio::test]
    async fn a_release_dropped_midway_is_sent_again() {
        let backend = Arc::new(StallingRelease {
            store: MemoryBackend::new(),
            stall_next: AtomicBool::new(true),
        });
        let keys: Arc<[String]> = vec!["lock:a".to_owned()].into();
        let (owner, other) = (OwnerToken::random(), OwnerToken::random());
        let ttl = Duration::from_secs(30);
        let granted = backend.acquire(&keys, owner, ttl, 0).await.unwrap();
        assert_eq!(granted, Acquire::Granted);

        let guard = LockGuard::new(
            backend.clone(),
            keys.clone(),
            owner,
            ttl,
            Instant::now() + ttl,
        );
        let stalled = tokio::time::timeout(Duration::from_millis(20), guard.release()).await;
        assert!(stalled.is_err(), "the first release should have stalled");

        // Dropping the stalled release spawned another one; let it run.
        for _ in 0..100 {
            if backend.acquire(&keys, other, ttl, 0).await.unwrap() == Acquire::Granted {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the keys were not released after the release future was dropped");
    }
}
