//! The guard's release against a store that answers late or never.

use std::sync::atomic::{AtomicBool, Ordering};

use super::*;
use crate::store::{
    contract::{Acquire, AcquireRequest, Keys, OwnerToken, Reply},
    memory::{
        intercept::{exclusive, Hooks, Intercepted},
        MemoryStore,
    },
};

/// The store's next release never answers: a store that went silent just as a response
/// was finishing.
#[derive(Debug)]
struct StallNextRelease(AtomicBool);

impl Hooks for StallNextRelease {
    fn release<'a>(
        &'a self,
        store: &'a MemoryStore,
        keys: &'a Keys,
        holder: Holder,
    ) -> Reply<'a, usize> {
        if self.0.swap(false, Ordering::SeqCst) {
            return Box::pin(std::future::pending());
        }
        store.release(keys, holder)
    }
}

/// One exclusive key, `lock:a`, for `holder`.
fn request(holder: Holder, ttl: Duration) -> AcquireRequest {
    exclusive(vec!["lock:a".to_owned()].into(), holder, ttl)
}

/// `lock:a` granted to a new owner, and its guard, with `ttl` as its store timeout too.
async fn granted(store: Arc<dyn LockStore>, ttl: Duration) -> LockGuard {
    let owner = Holder::new(OwnerToken::random());
    let request = request(owner, ttl);
    let granted = store.acquire(&request).await.unwrap();
    assert!(matches!(granted, Acquire::Granted(_)));
    LockGuard::new(
        store,
        request.keys,
        owner,
        ttl,
        Instant::now() + ttl,
        Arc::default(),
    )
}

#[tokio::test]
async fn a_release_dropped_midway_is_sent_again() {
    let store = Arc::new(Intercepted::new(StallNextRelease(AtomicBool::new(true))));
    let ttl = Duration::from_secs(30);
    let guard = granted(store.clone(), ttl).await;
    let stalled = tokio::time::timeout(Duration::from_millis(20), guard.release()).await;
    assert!(stalled.is_err(), "the first release should have stalled");

    // Dropping the stalled release spawned another one; let it run.
    let other = request(Holder::new(OwnerToken::random()), ttl);
    for _ in 0..100 {
        let retried = store.acquire(&other).await.unwrap();
        if matches!(retried, Acquire::Granted(_)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the keys were not released after the release future was dropped");
}

/// Extensions wait for the test's word; the calls that reached the store, in order.
#[derive(Debug, Default)]
struct ExtensionsOnHold {
    extending: tokio::sync::Notify,
    go: tokio::sync::Notify,
    calls: std::sync::Mutex<Vec<&'static str>>,
}

impl Hooks for ExtensionsOnHold {
    fn extend<'a>(
        &'a self,
        store: &'a MemoryStore,
        keys: &'a Keys,
        holder: Holder,
        ttl: Duration,
    ) -> Reply<'a, bool> {
        Box::pin(async move {
            self.extending.notify_one();
            self.go.notified().await;
            let extended = store.extend(keys, holder, ttl).await;
            self.calls.lock().unwrap().push("extend");
            extended
        })
    }

    fn release<'a>(
        &'a self,
        store: &'a MemoryStore,
        keys: &'a Keys,
        holder: Holder,
    ) -> Reply<'a, usize> {
        self.calls.lock().unwrap().push("release");
        store.release(keys, holder)
    }
}

/// A response's release dropped (its client left) while it waits for an extension in
/// flight: the release that the guard's drop sends still waits for it, so that the
/// extension never finds the keys gone (a lease reported lost after its release).
#[tokio::test]
async fn a_release_dropped_during_an_extension_comes_after_it() {
    let store = Arc::new(Intercepted::new(ExtensionsOnHold::default()));
    let ttl = Duration::from_secs(30);
    let mut guard = granted(store.clone(), ttl).await;
    guard.start_renewal(ttl, None, Instant::now());
    store.hooks.extending.notified().await;
    let dropped = tokio::time::timeout(Duration::from_millis(20), guard.release()).await;
    assert!(
        dropped.is_err(),
        "the release should have waited for the extension"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(*store.hooks.calls.lock().unwrap(), Vec::<&str>::new());

    store.hooks.go.notify_one();
    for _ in 0..100 {
        if store.hooks.calls.lock().unwrap().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(*store.hooks.calls.lock().unwrap(), ["extend", "release"]);
}
