//! Several Redis nodes called at once: what Redlock (every key to every master, a majority
//! decides) and the cluster (each master its group of keys, every group must grant) share.
//!
//! - Every call on a node is bounded by the node timeout and runs in a task of its own, so
//!   that a call nobody waits for any more still completes (a half-sent command or a
//!   half-opened connection is not lost), and the nodes' commands are encoded and their
//!   replies parsed on every core at once.
//! - An acquisition is registered, by holder, before anything is sent. Its release raises
//!   a flag, and a node's grant whose answer arrives after that (the node was slow, the
//!   caller gave up) is undone there at once. A node that gave no answer in time is sent
//!   the release again a few times once the flag is raised ([`late`]), for a grant that
//!   lands later still; one that lands after those keeps its keys until its TTL ends.
//! - A release whose outcome on a node is unknown (the node may still run an earlier
//!   command of ours, such as the acquisition) is retried in the background until the node
//!   answers, or until no key of ours can be left there (the longest TTL asked for).
//! - A node that does not answer is counted in the metrics, and logged as a warning at
//!   most every 10 s per node (at debug level otherwise), so that a node that is down shows
//!   in the logs without flooding them.

use std::{
    collections::HashMap,
    fmt,
    future::Future,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, Instant},
};

use futures_util::{future::BoxFuture, FutureExt};
use redis::ConnectionInfo;

use super::{
    contract::{Acquire, AcquireRequest, Holder, LockStore},
    error::StoreError,
    redis::{Freeing, RedisStore, DEFAULT_STEP},
};
use crate::{backoff::Backoff, duration::capped, observe, store::late};

/// How often a node that keeps failing is logged as a warning, at most.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The nodes a multi-node store is built from, and how long each may take to answer one
/// call: the settings that Redlock's and the cluster's builders share.
#[derive(Clone)]
pub(super) struct NodeUrls {
    pub(super) urls: Vec<String>,
    pub(super) node_timeout: Duration,
    /// How many keys one script takes at most, on each node.
    pub(super) step: usize,
}

impl NodeUrls {
    pub(super) fn new<I>(urls: I, node_timeout: Duration) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Self {
            urls: urls.into_iter().map(|u| u.as_ref().to_owned()).collect(),
            node_timeout,
            step: DEFAULT_STEP,
        }
    }

    /// # Panics
    ///
    /// If `keys` is zero.
    pub(super) fn set_step(&mut self, keys: usize) {
        assert!(keys > 0, "a step must take at least one key");
        self.step = keys;
    }

    /// # Panics
    ///
    /// If `timeout` is zero.
    pub(super) fn set_node_timeout(&mut self, timeout: Duration) {
        assert!(!timeout.is_zero(), "a node timeout must not be zero");
        self.node_timeout = capped(timeout);
    }
}

impl fmt::Debug for NodeUrls {
    // By hand: URLs may carry passwords.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeUrls")
            .field("nodes", &self.urls.len())
            .field("node_timeout", &self.node_timeout)
            .field("step", &self.step)
            .finish()
    }
}

/// A pool of connections to one node, whose client-side timeouts never cut a call shorter
/// than the node timeout, which bounds every call anyway (redis-rs's own default of 500 ms
/// for a response would refuse a big batch that the node timeout allows).
pub(super) fn node_pool(
    info: ConnectionInfo,
    node_timeout: Duration,
) -> Result<deadpool_redis::Pool, StoreError> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(node_timeout))
        .set_response_timeout(Some(node_timeout));
    let manager =
        deadpool_redis::Manager::new_with_config(info, config).map_err(StoreError::not_sent)?;
    deadpool_redis::Pool::builder(manager)
        .runtime(deadpool_redis::Runtime::Tokio1)
        .build()
        .map_err(StoreError::not_sent)
}

/// Why one node gave no answer to one call.
#[derive(Debug)]
pub(super) enum NodeFailure {
    /// No answer within the node timeout: the command may still run there.
    TimedOut,
    Failed(StoreError),
}

impl fmt::Display for NodeFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TimedOut => f.write_str("no answer within the node timeout"),
            Self::Failed(error) => error.fmt(f),
        }
    }
}

impl NodeFailure {
    pub(super) fn may_have_applied(&self) -> bool {
        match self {
            Self::TimedOut => true,
            Self::Failed(error) => error.may_have_applied(),
        }
    }

    /// Whether the command may still run on the node later: it got no answer in time, or
    /// its connection failed; an error that the node answered with ended it, and a
    /// connection refused (a step after earlier ones, say, on a master failing over) sent
    /// nothing.
    pub(super) fn may_run_later(&self) -> bool {
        let ended = self.redis_error().is_some_and(|error| {
            error.is_connection_refusal()
                || matches!(
                    error.kind(),
                    redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
                )
        });
        self.may_have_applied() && !ended
    }

    /// The error of Redis, or of the connection to it, that the node failed with, if any:
    /// the first among the causes of its error.
    pub(super) fn redis_error(&self) -> Option<&redis::RedisError> {
        let Self::Failed(error) = self else {
            return None;
        };
        std::iter::successors(std::error::Error::source(error), |&cause| cause.source())
            .find_map(|cause| cause.downcast_ref())
    }
}

pub(super) type NodeReply<T> = Result<T, NodeFailure>;

/// `call`, bounded by `timeout`.
pub(super) async fn bounded<T>(
    timeout: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> NodeReply<T> {
    match tokio::time::timeout(timeout, call).await {
        Ok(reply) => reply.map_err(NodeFailure::Failed),
        Err(_) => Err(NodeFailure::TimedOut),
    }
}

/// The allowance for nodes' clocks running at different rates over `ttl`: a lease on
/// several nodes ends this much before `ttl` after it was asked for.
pub(super) fn clock_drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// What a multi-node store keeps about its calls, whatever its topology.
pub(super) struct Fanout {
    /// The store's name in the logs and metrics: `redlock` or `cluster`.
    store: &'static str,
    node_timeout: Duration,
    /// The longest TTL asked for so far: no key of ours outlives it on a node after the
    /// node last ran one of our commands, so retrying a release longer is pointless.
    longest_ttl_ms: AtomicU64,
    /// A flag per acquisition that is running or granted, by holder (see the module doc).
    late: Mutex<HashMap<Holder, Arc<AtomicBool>>>,
    /// When each node's failure was last logged as a warning, by address.
    warned: Mutex<HashMap<Arc<str>, Instant>>,
}

impl fmt::Debug for Fanout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fanout")
            .field("store", &self.store)
            .field("node_timeout", &self.node_timeout)
            .finish_non_exhaustive()
    }
}

impl Fanout {
    pub(super) fn new(store: &'static str, node_timeout: Duration) -> Self {
        Self {
            store,
            node_timeout,
            longest_ttl_ms: AtomicU64::new(0),
            late: Mutex::default(),
            warned: Mutex::default(),
        }
    }

    pub(super) fn node_timeout(&self) -> Duration {
        self.node_timeout
    }

    /// How long a node may take for a call on `keys` keys: the node timeout for each script
    /// the call takes (a batch goes in steps of `step` keys). A node whose queue holds big
    /// batches of other requests is busy, not down: bounding a 2,000-key batch by the time
    /// one script may take counted such a node as failed, turned load into 503s, and the
    /// clients' retries into more load.
    pub(super) fn timeout_for(&self, keys: usize, step: usize) -> Duration {
        let steps = keys.div_ceil(step.max(1)).max(1);
        self.node_timeout
            .saturating_mul(u32::try_from(steps).unwrap_or(u32::MAX))
    }

    /// Remembers `ttl`, for how long releases are worth retrying.
    pub(super) fn note_ttl(&self, ttl: Duration) {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.longest_ttl_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// The longest TTL asked for so far.
    pub(super) fn longest_ttl(&self) -> Duration {
        Duration::from_millis(self.longest_ttl_ms.load(Ordering::Relaxed))
    }

    fn late(&self) -> MutexGuard<'_, HashMap<Holder, Arc<AtomicBool>>> {
        // Every change is one map operation: a poisoned map is still whole.
        self.late.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers an acquisition of `holder` before anything is sent, and gives the flag
    /// that its release raises.
    pub(super) fn register(&self, holder: Holder) -> Arc<AtomicBool> {
        let released = Arc::new(AtomicBool::new(false));
        self.late().insert(holder, released.clone());
        released
    }

    /// The acquisition of `holder` is released, or rolled back when it failed: a grant of
    /// it that lands from now on undoes itself.
    pub(super) fn mark_released(&self, holder: Holder) {
        if let Some(released) = self.late().remove(&holder) {
            released.store(true, Ordering::SeqCst);
        }
    }

    /// Runs `call` in a task of its own; the future gives its reply with `tag` (which node
    /// or group it was), and goes on running if dropped.
    pub(super) fn spawn<T, Tag>(
        &self,
        tag: Tag,
        call: impl Future<Output = NodeReply<T>> + Send + 'static,
    ) -> BoxFuture<'static, (Tag, NodeReply<T>)>
    where
        T: Send + 'static,
        Tag: Send + 'static,
    {
        let task = tokio::spawn(call);
        async move {
            let reply = task
                .await
                .unwrap_or_else(|error| Err(NodeFailure::Failed(StoreError::unknown(error))));
            (tag, reply)
        }
        .boxed()
    }

    /// Acquires `request` on `node`, bounded by the node timeout; a grant whose answer
    /// comes after the acquisition was released (`released` raised) is undone at once,
    /// and when no answer comes in time, the release is sent again ([`late`]) once the
    /// acquisition is released.
    pub(super) fn acquire_on(
        self: &Arc<Self>,
        node: Arc<RedisStore>,
        request: AcquireRequest,
        released: Arc<AtomicBool>,
    ) -> impl Future<Output = NodeReply<Acquire>> + Send + 'static {
        let fanout = self.clone();
        async move {
            let timeout = fanout.timeout_for(request.keys.len(), node.step());
            let reply = bounded(timeout, node.acquire(&request)).await;
            match &reply {
                Ok(Acquire::Granted(_)) if released.load(Ordering::SeqCst) => {
                    let release = Freeing::Release(request.holder);
                    let _ = fanout.release_on(node, request.keys, release).await;
                }
                // The grant may still land. (While the batch holds, with a majority of
                // Redlock's masters, a grant there is the batch's own: left alone.) A node
                // that answered, even with an error, ran all of the call it ever will: the
                // caller's release undoes that, and nothing is sent again later, which
                // could end a next attempt under the same hold (the cluster's, after a
                // moved slot).
                Err(failure) if failure.may_run_later() => {
                    tokio::spawn(async move {
                        let (node, request, released) = (&node, &request, &released);
                        late::send_again(|| async move {
                            if released.load(Ordering::SeqCst) {
                                let release = node.release(&request.keys, request.holder);
                                let _ = bounded(timeout, release).await;
                            }
                        })
                        .await;
                    });
                }
                _ => {}
            }
            reply
        }
    }

    /// Frees `keys` on `node` (a release, or a waiter's roll-back), and when the outcome is
    /// unknown (the node may still run an earlier command of ours, such as the
    /// acquisition), keeps trying in the background until it answers or until no key of
    /// ours can be left there.
    pub(super) async fn release_on(
        self: &Arc<Self>,
        node: Arc<RedisStore>,
        keys: Arc<[String]>,
        how: Freeing,
    ) -> NodeReply<usize> {
        let timeout = self.timeout_for(keys.len(), node.step());
        let reply = bounded(timeout, node.free_count(how, &keys)).await;
        if matches!(&reply, Err(failure) if failure.may_have_applied()) {
            let give_up_at = Instant::now() + self.longest_ttl();
            let store = self.store;
            tokio::spawn(async move {
                let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
                while backoff.sleep_before(give_up_at).await {
                    match bounded(timeout, node.free_count(how, &keys)).await {
                        Err(failure) if failure.may_have_applied() => {}
                        // Answered, or the node cannot be reached at all (so it runs
                        // nothing of ours): whatever it holds expires with its TTL.
                        _ => return,
                    }
                }
                // The node's failures are logged where they are reported (at most every
                // 10 s per node), not once per release.
                tracing::debug!(
                    store,
                    keys = keys.len(),
                    "a node never answered a release; its keys expire with their TTL"
                );
            });
        }
        reply
    }

    /// Counts that the node at `address` did not answer `call`, and logs it: as a warning
    /// at most every 10 s per node, at debug level otherwise.
    pub(super) fn report(&self, address: &Arc<str>, call: &'static str, failure: &NodeFailure) {
        observe::node_error(self.store, address, call);
        let now = Instant::now();
        let due = {
            let mut warned = self.warned.lock().unwrap_or_else(PoisonError::into_inner);
            let last = warned.get(address).copied();
            let due = last.is_none_or(|last| now.duration_since(last) >= WARN_EVERY);
            if due {
                warned.insert(address.clone(), now);
            }
            due
        };
        let store = self.store;
        if due {
            tracing::warn!(
                store,
                node = %address,
                call,
                %failure,
                "a node did not answer (warned at most every 10 s per node)"
            );
        } else {
            tracing::debug!(store, node = %address, call, %failure, "a node did not answer");
        }
    }
}
