//! Handlers that report what they saw: a gate that holds its locks until the test opens
//! it, a count of runs, and a ledger of critical sections that notices any overlap.
//!
//! The `*_handler` functions return closures for any route, so that each suite keeps its
//! own routes and extractors.

#[cfg(feature = "redis")]
use std::{collections::HashMap, time::Instant};
use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use axum::Extension;
use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use tower_batch_lock::Lease;

use super::http::{header_keys, post_keys, send, within, Reply};

/// A handler that says it entered (with its lease, if it has one) and then waits until the
/// test opens the gate.
#[derive(Default)]
pub(crate) struct Gate {
    entered: Notify,
    open: Notify,
    runs: AtomicUsize,
    lease: Mutex<Option<Lease>>,
}

impl Gate {
    pub(crate) fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Counts a run, says it entered, and waits for [`open`](Self::open).
    pub(crate) async fn pass(&self) {
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.entered.notify_one();
        self.open.notified().await;
    }

    pub(crate) async fn wait_entered(&self) {
        within(
            Duration::from_secs(5),
            "the handler entered",
            self.entered.notified(),
        )
        .await;
    }

    /// The lease of the last handler that entered.
    ///
    /// # Panics
    ///
    /// When no handler with a lease has entered.
    pub(crate) fn lease(&self) -> Lease {
        self.lease
            .lock()
            .unwrap()
            .clone()
            .expect("a handler entered with a lease")
    }

    pub(crate) fn open(&self) {
        self.open.notify_one();
    }

    #[cfg(feature = "redis")]
    pub(crate) fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

/// A handler that passes `gate`, keeping its lease there.
pub(crate) fn gated_handler(
    gate: &Arc<Gate>,
) -> impl Fn(Option<Extension<Lease>>) -> BoxFuture<'static, ()> + Clone + Send + Sync + 'static {
    let gate = gate.clone();
    move |lease: Option<Extension<Lease>>| {
        let gate = gate.clone();
        Box::pin(async move {
            if let Some(Extension(lease)) = lease {
                *gate.lease.lock().unwrap() = Some(lease);
            }
            gate.pass().await;
        })
    }
}

/// A request that holds `keys` (comma-separated, read by [`header_keys`]) on `locks` until
/// its gate opens: the gate, once its handler entered, and the request's reply.
pub(crate) async fn hold(
    locks: &tower_batch_lock::Locks,
    keys: &str,
) -> (Arc<Gate>, tokio::task::JoinHandle<Reply>) {
    let gate = Gate::new();
    let holder = axum::Router::new().route(
        "/",
        axum::routing::post(gated_handler(&gate)).layer(locks.layer(header_keys)),
    );
    let request = post_keys("/", keys);
    let held = tokio::spawn(async move { send(&holder, request).await });
    gate.wait_entered().await;
    (gate, held)
}

/// A handler that counts its runs and returns at once.
pub(crate) fn counting_handler(
    runs: &Arc<AtomicUsize>,
) -> impl Fn() -> BoxFuture<'static, ()> + Clone + Send + Sync + 'static {
    let runs = runs.clone();
    move || {
        let runs = runs.clone();
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
        })
    }
}

/// One critical section as a handler saw it.
#[cfg(feature = "redis")]
#[derive(Debug)]
pub(crate) struct Visit {
    pub(crate) keys: Vec<String>,
    pub(crate) fence: u64,
    pub(crate) enter: Instant,
    pub(crate) exit: Instant,
}

/// Who is inside which key right now, and every visit so far.
#[cfg(feature = "redis")]
#[derive(Default)]
pub(crate) struct Ledger {
    holding: Mutex<HashMap<String, usize>>,
    pub(crate) overlaps: AtomicUsize,
    pub(crate) visits: Mutex<Vec<Visit>>,
}

#[cfg(feature = "redis")]
impl Ledger {
    /// Marks `keys` as held, counting an overlap for each that someone else holds.
    pub(crate) fn enter(&self, keys: &[String]) -> Instant {
        let mut holding = self.holding.lock().unwrap();
        for key in keys {
            let holders = holding.entry(key.clone()).or_default();
            *holders += 1;
            if *holders > 1 {
                self.overlaps.fetch_add(1, Ordering::SeqCst);
            }
        }
        Instant::now()
    }

    /// Marks `keys` as free again and records the visit.
    pub(crate) fn exit(&self, keys: Vec<String>, fence: u64, enter: Instant) {
        let exit = Instant::now();
        let mut holding = self.holding.lock().unwrap();
        for key in &keys {
            *holding.get_mut(key).unwrap() -= 1;
        }
        drop(holding);
        self.visits.lock().unwrap().push(Visit {
            keys,
            fence,
            enter,
            exit,
        });
    }
}

/// A handler that records its critical section, 3 ms long, in `ledger`.
#[cfg(feature = "redis")]
pub(crate) fn ledger_handler(
    ledger: &Arc<Ledger>,
) -> impl Fn(Extension<Lease>) -> BoxFuture<'static, ()> + Clone + Send + Sync + 'static {
    let ledger = ledger.clone();
    move |Extension(lease): Extension<Lease>| {
        let ledger = ledger.clone();
        Box::pin(async move {
            let keys: Vec<String> = lease.keys().map(str::to_owned).collect();
            let enter = ledger.enter(&keys);
            tokio::time::sleep(Duration::from_millis(3)).await;
            ledger.exit(keys, lease.fencing_token().get(), enter);
        })
    }
}
