//! The batches a [`Locks`](crate::Locks) handle's requests hold now, for
//! [`Locks::held_batches`](crate::Locks::held_batches): listed at the grant, gone when the
//! release begins, once someone has asked for the list.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, Instant},
};

use axum::extract::MatchedPath;
use http::{HeaderName, HeaderValue, Request};

/// A batch of keys this process holds now: [`Locks::held_batches`](crate::Locks::held_batches)'s answer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldBatch {
    route: Option<String>,
    request_id: Option<String>,
    age: Duration,
    keys: usize,
    shared: usize,
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

    /// How many of its keys it holds [shared](crate::Mode::Shared); the others it holds
    /// exclusively.
    pub fn shared_key_count(&self) -> usize {
        self.shared
    }
}

/// The batches a [`Locks`](crate::Locks) handle and its clones hold now. Sharded, so that requests on
/// different cores rarely share a mutex on the way in and out; each shard is ordered by
/// id, which only grows, so a new batch goes to its end and no id is hashed.
#[derive(Debug, Default)]
pub(crate) struct Batches {
    /// Whether anyone has asked for the list. Until then no grant is listed: a request
    /// would update a map that no one reads.
    listing: AtomicBool,
    next: AtomicU64,
    shards: [Mutex<BTreeMap<u64, Batch>>; BATCH_SHARDS],
}

const BATCH_SHARDS: usize = 8;

/// The header a batch's request is known by; named once, not parsed for every request.
static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

#[derive(Debug)]
struct Batch {
    route: Option<MatchedPath>,
    request_id: Option<HeaderValue>,
    since: Instant,
    keys: usize,
    shared: usize,
}

impl Batches {
    /// Lists a batch of `keys` keys, `shared` of them shared, granted to `request` at
    /// `since`, until the returned registration drops; nothing before anyone asked for
    /// the list.
    pub(crate) fn register<B>(
        self: &Arc<Self>,
        request: &Request<B>,
        keys: usize,
        shared: usize,
        since: Instant,
    ) -> Option<Registered> {
        if !self.listing.load(Ordering::Relaxed) {
            return None;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let batch = Batch {
            route: request.extensions().get::<MatchedPath>().cloned(),
            request_id: request.headers().get(&REQUEST_ID).cloned(),
            since,
            keys,
            shared,
        };
        self.shard(id).insert(id, batch);
        Some(Registered {
            batches: self.clone(),
            id,
        })
    }

    fn shard(&self, id: u64) -> MutexGuard<'_, BTreeMap<u64, Batch>> {
        // Every change is one insert or remove: a poisoned map is still whole.
        self.shards[(id % BATCH_SHARDS as u64) as usize]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Lists every batch granted from now on.
    pub(crate) fn start_listing(&self) {
        self.listing.store(true, Ordering::Relaxed);
    }

    /// The batches held now, oldest first; the first call starts the listing.
    pub(crate) fn list(&self) -> Vec<HeldBatch> {
        self.start_listing();
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
                    shared: batch.shared,
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
