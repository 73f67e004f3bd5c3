//! Locks on a Redis Cluster: each batch grouped by the master that serves its keys' slots,
//! one script call per master, all at once ([`RedisCluster`] tells the user's side).
//!
//! - **acquire** sends each master the keys of the batch it serves, as one call of the
//!   acquire script in its cluster form (`scripts/cluster.lua`: keys of many slots pass as
//!   arguments, which `allow-cross-slot-keys` lets the script touch one command at a time).
//!   Each group is all or nothing on its master; the batch is granted when every group
//!   was, and then takes its fencing token from the namespace's one counter. Otherwise every
//!   group that granted or may have is released. A group refused because the map moved
//!   under it (a slot moved or is migrating, a master failed over, the cluster is down)
//!   refreshes the map, and the whole attempt is made again, until [`RedisCluster::retry_for`].
//! - **extend, release, withdraw, inspect, force_release** run on each group the same
//!   way; a group refused for a moved slot is regrouped on a fresh map and sent again (each
//!   of these is idempotent). A release finishes in the background if its caller stops
//!   waiting.
//!
//! Every group runs in a task of its own, so that a call nobody waits for any more still
//! ends (see Redlock's store, whose pieces this one shares), and a flag per acquisition,
//! by holder, lets a group granted after the batch's release undo itself.

mod announce;
mod topology;

use std::{
    collections::HashMap,
    fmt,
    future::Future,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, PoisonError, RwLock,
    },
    time::{Duration, Instant},
};

use futures_util::{stream::FuturesUnordered, StreamExt};
use redis::{
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
    cluster_routing::{RoutingInfo, SingleNodeRoutingInfo},
    ConnectionAddr, ConnectionInfo, FromRedisValue, IntoConnectionInfo, ProtocolVersion,
};
use tokio::sync::OnceCell;

use super::{
    redis::RedisBackend,
    redlock::{bounded, clock_drift, release_on, NodeFailure},
    wake::{slots_of, Wakeups},
    Acquire, Backend, BackendError, BoxFuture, Contention, Holder, KeyView, Line, Ticket,
};
use crate::{FencingToken, Locks};
use topology::Topology;

/// How long one master may take to answer one call, unless [`RedisCluster::node_timeout`]
/// says otherwise.
const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a call keeps trying while the cluster moves, unless
/// [`RedisCluster::retry_for`] says otherwise.
const DEFAULT_RETRY_FOR: Duration = Duration::from_secs(1);

/// The first pause before a call is tried again on a moving cluster; it doubles up to
/// [`LONGEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(10);
const LONGEST_PAUSE: Duration = Duration::from_millis(200);

/// Locks on a Redis Cluster (or a managed cluster-mode Redis or Valkey): every batch is
/// grouped by the master that serves each key's hash slot, each master gets its group as
/// one script call, all at once, and the batch is granted when every group was.
///
/// [`Locks::redis_cluster`] builds one with the defaults; `RedisCluster` adds the knobs:
///
/// ```
/// use std::time::Duration;
/// use tower_batch_lock::RedisCluster;
///
/// # fn main() -> Result<(), tower_batch_lock::redis::RedisError> {
/// // Any of the cluster's nodes: the store reads the slot map from them. Nothing connects
/// // yet.
/// let locks = RedisCluster::new(["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"])
///     .node_timeout(Duration::from_millis(200))
///     .retry_for(Duration::from_millis(1500))
///     .build()?
///     .ttl(Duration::from_secs(10));
///
/// assert!(RedisCluster::new(Vec::<String>::new()).build().is_err());
/// # drop(locks);
/// # Ok(())
/// # }
/// ```
///
/// # What it guarantees
///
/// The same as one Redis ([`Locks::redis`]), batch by batch: all or nothing (a batch
/// refused on one master is released on every master that granted its group, and a group
/// that lands after its batch was released undoes itself), owner-only release, re-entry,
/// TTLs and renewal, fair waiting (each key keeps its waiters' reservations where it lives),
/// release on drop.
///
/// - **Fencing tokens.** Masters cannot share a counter, and a counter per master would
///   move with its slot during a resharding (or give different masters different counts,
///   as Redlock's do). So a grant takes its token from the namespace's one counter (the
///   key named by the prefix, on whichever master serves its slot), with `INCR`, *after*
///   every group was granted: any later grant of a shared key was granted its group after
///   this one's release, so after this `INCR`, and counts a larger number. Tokens strictly
///   increase across every grant of the namespace, as on one Redis. The cost: one more
///   round trip per acquisition, to that master (a few microseconds of its time).
/// - **Resharding.** While a slot migrates, a group with keys of it is refused by its node
///   (`ASK` or `TRYAGAIN`: a script over several keys cannot follow an `ASK`, since the
///   importing node serves a multi-key call only when it has every key already); the
///   attempt is released and made again after a pause, on a fresh map once the slot has
///   moved (`MOVED`), until [`retry_for`](Self::retry_for) runs out (then 503). A lock
///   value migrates with its ttl like any key, so a held key stays held where it goes.
/// - **The counter's master.** While the master that serves the counter's slot is down,
///   no batch can be granted (503) until its replica takes over.
/// - **Failover.** A master that dies makes the calls for its keys fail (after the node
///   timeout when it is frozen): those requests get 503 until a replica takes over and
///   the map shows it. Replication is asynchronous: a lock granted just before its master
///   died may be missing on the replica that replaces it, so another request can be granted
///   the same keys while the first still runs, and the namespace's counter can go back by
///   the increments the replica missed. See the README's Redis Cluster section for what to
///   do about it (`WAIT`, `min-replicas-to-write`, fencing checks at the resource).
///
/// # Requirements
///
/// Redis 7.0 or later (or Valkey): the scripts carry the `allow-cross-slot-keys` flag, and
/// wake-ups use sharded pub/sub. The user needs `EVALSHA`, `SCRIPT LOAD`, `INCR`, `SET`,
/// `GET`, `DEL`, `PTTL`, `PEXPIRE`, `TIME`, `CLUSTER SLOTS`, `SPUBLISH` and `SSUBSCRIBE`
/// on the prefix's keys and on the channel `tower-batch-lock:released`.
#[derive(Clone)]
pub struct RedisCluster {
    urls: Vec<String>,
    node_timeout: Duration,
    retry_for: Duration,
}

impl fmt::Debug for RedisCluster {
    // By hand: URLs may carry passwords.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisCluster")
            .field("seeds", &self.urls.len())
            .field("node_timeout", &self.node_timeout)
            .field("retry_for", &self.retry_for)
            .finish()
    }
}

impl RedisCluster {
    /// A cluster store that learns the cluster from any of the nodes at `urls`
    /// (`redis://host:port`, or `rediss://` for TLS; credentials go in the URL, and every
    /// node takes the first URL's). [`build`](Self::build) checks them.
    pub fn new<I>(urls: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Self {
            urls: urls.into_iter().map(|u| u.as_ref().to_owned()).collect(),
            node_timeout: DEFAULT_NODE_TIMEOUT,
            retry_for: DEFAULT_RETRY_FOR,
        }
    }

    /// How long one master may take to answer one call (getting a connection included)
    /// before the call counts as failed. Default 500 ms: a 3,000-key batch keeps a master
    /// busy for a few milliseconds; a frozen master costs this much before its requests get
    /// 503.
    ///
    /// # Panics
    ///
    /// If `timeout` is zero.
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        assert!(
            !timeout.is_zero(),
            "a cluster node timeout must not be zero"
        );
        self.node_timeout = timeout;
        self
    }

    /// How long a call keeps trying again while the cluster moves under it (a slot
    /// migrating, a failover, `CLUSTERDOWN`), before it fails (503). Default 1 s. An
    /// acquisition may take up to about twice this, plus a few node timeouts, since each
    /// refused attempt is rolled back (bounded by this too) before the next; keep it below
    /// half of [`Locks::backend_timeout`] (2 s by default), which bounds every call anyway.
    pub fn retry_for(mut self, duration: Duration) -> Self {
        self.retry_for = duration;
        self
    }

    /// The locks, with the default policy ([`Locks::ttl`] and the rest tune it).
    ///
    /// # Errors
    ///
    /// When there is no URL, or one is not a valid Redis URL. Nothing connects yet.
    pub fn build(self) -> Result<Locks, redis::RedisError> {
        let seeds = self
            .urls
            .iter()
            .map(|url| url.as_str().into_connection_info())
            .collect::<Result<Vec<_>, _>>()?;
        let Some(seed) = seeds.first().cloned() else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "invalid Redis Cluster configuration",
                "no node URL".to_owned(),
            )));
        };
        let wakeups = Arc::new(Wakeups::new());
        let client = |push: bool| {
            let builder = ClusterClient::builder(seeds.clone())
                .connection_timeout(self.node_timeout)
                .response_timeout(self.node_timeout);
            if push {
                builder
                    .use_protocol(ProtocolVersion::RESP3)
                    .push_sender(announce::relay(Arc::downgrade(&wakeups)))
                    .build()
            } else {
                builder.build()
            }
        };
        let (control_client, subscriber) = (client(false)?, client(true)?);
        let inner = Inner {
            seed,
            control_client,
            control: OnceCell::new(),
            topology: RwLock::default(),
            refreshing: tokio::sync::Mutex::new(()),
            pools: Mutex::default(),
            node_timeout: self.node_timeout,
            retry_for: self.retry_for,
            longest_ttl_ms: AtomicU64::new(0),
            late: Mutex::default(),
            wakeups,
        };
        let backend = ClusterBackend {
            inner: Arc::new(inner),
            subscriber,
            subscribed: std::sync::OnceLock::new(),
        };
        // Built inside a runtime (the usual case), subscribe now, so that the first waiter
        // already hears of releases; otherwise on first use.
        if tokio::runtime::Handle::try_current().is_ok() {
            backend.listen_for_releases();
        }
        Ok(Locks::with_backend(Arc::new(backend)))
    }
}

pub(crate) struct ClusterBackend {
    inner: Arc<Inner>,
    /// The client of the subscription to other processes' releases.
    subscriber: ClusterClient,
    subscribed: std::sync::OnceLock<()>,
}

impl fmt::Debug for ClusterBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let topology = self.inner.current();
        let masters: Vec<&str> = topology.masters.iter().map(|m| &*m.address).collect();
        f.debug_struct("ClusterBackend")
            .field("masters", &masters)
            .field("node_timeout", &self.inner.node_timeout)
            .field("retry_for", &self.inner.retry_for)
            .finish_non_exhaustive()
    }
}

/// What the store's tasks share.
struct Inner {
    /// The first URL's settings (credentials, TLS), for a pool to any master.
    seed: ConnectionInfo,
    /// The client of the cluster connection that reads the slot map, counts grants and
    /// announces releases: redis-rs routes each of those by its one key.
    control_client: ClusterClient,
    control: OnceCell<ClusterConnection>,
    topology: RwLock<Arc<Topology>>,
    /// One refresh of the map at a time.
    refreshing: tokio::sync::Mutex<()>,
    /// A store per master address, kept across maps, so that a master keeps its pool.
    pools: Mutex<HashMap<String, Arc<RedisBackend>>>,
    node_timeout: Duration,
    retry_for: Duration,
    /// The longest TTL asked for so far: a release retried longer finds nothing of ours.
    longest_ttl_ms: AtomicU64,
    /// A flag per acquisition that is running or granted, by holder (see Redlock's store).
    late: Mutex<HashMap<Holder, Arc<AtomicBool>>>,
    wakeups: Arc<Wakeups>,
}

/// What one attempt at a batch came to.
enum Attempt {
    /// The answer for the caller.
    Done(Result<Acquire, BackendError>),
    /// A group was refused because the cluster moved under it: nothing of the attempt is
    /// left anywhere, and it may be made again on a fresh map.
    Moved(String),
}

impl Inner {
    fn current(&self) -> Arc<Topology> {
        self.topology
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    async fn control(&self) -> Result<ClusterConnection, BackendError> {
        self.control
            .get_or_try_init(|| async {
                bounded(self.node_timeout, async {
                    self.control_client
                        .get_async_connection()
                        .await
                        .map_err(BackendError::not_sent)
                })
                .await
                .map_err(|failure| BackendError::not_sent(failure.to_string()))
            })
            .await
            .cloned()
    }

    /// The slot map, read from the cluster if this store has none yet.
    async fn topology(&self) -> Result<Arc<Topology>, BackendError> {
        let current = self.current();
        if !current.masters.is_empty() {
            return Ok(current);
        }
        self.refresh(current.generation).await
    }

    /// A slot map newer than generation `seen`: read from the cluster, unless another call
    /// did that in the meantime.
    async fn refresh(&self, seen: u64) -> Result<Arc<Topology>, BackendError> {
        let _one = self.refreshing.lock().await;
        let current = self.current();
        if current.generation > seen && !current.masters.is_empty() {
            return Ok(current);
        }
        let mut control = self.control().await?;
        let slots = redis::cmd("CLUSTER").arg("SLOTS").to_owned();
        let reply = bounded(self.node_timeout, async {
            control
                .route_command(
                    slots,
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                )
                .await
                .map_err(BackendError::not_sent)
        })
        .await
        .map_err(|failure| BackendError::not_sent(failure.to_string()))?;
        let topology = Arc::new(Topology::from_slots(
            &reply,
            current.generation + 1,
            |host, port| self.pool_for(host, port),
        )?);
        *self
            .topology
            .write()
            .unwrap_or_else(PoisonError::into_inner) = topology.clone();
        Ok(topology)
    }

    /// The store of the master at `host:port`, with a pool of its own, made on first use.
    fn pool_for(&self, host: &str, port: u16) -> Result<Arc<RedisBackend>, BackendError> {
        let address = format!("{host}:{port}");
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(node) = pools.get(&address) {
            return Ok(node.clone());
        }
        let addr = match self.seed.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host.to_owned(), port),
        };
        let info = self.seed.clone().set_addr(addr);
        // The node timeout bounds every call; the client's own response timeout (500 ms by
        // default) must not cut a longer one short.
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.node_timeout))
            .set_response_timeout(Some(self.node_timeout));
        let manager = deadpool_redis::Manager::new_with_config(info, config)
            .map_err(BackendError::not_sent)?;
        let pool = deadpool_redis::Pool::builder(manager)
            .runtime(deadpool_redis::Runtime::Tokio1)
            .build()
            .map_err(BackendError::not_sent)?;
        let node = Arc::new(RedisBackend::cluster_node(pool));
        pools.insert(address, node.clone());
        Ok(node)
    }

    fn note_ttl(&self, ttl: Duration) {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.longest_ttl_ms.fetch_max(ms, Ordering::Relaxed);
    }

    fn late_acquisitions(&self) -> std::sync::MutexGuard<'_, HashMap<Holder, Arc<AtomicBool>>> {
        self.late.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `call` on every group of `keys`, each on its master at once, bounded by the
    /// node timeout; the keys of a group that failed are regrouped on a fresh map and sent
    /// again after a pause, until `until`. Only for calls that may run twice (everything
    /// but acquire). Returns each group's keys, by index, with its answer. `unsure` is
    /// raised when a call failed in a way that may still let it run later (no answer in
    /// time, a broken connection): it was sent again, and the first may land after that.
    async fn on_groups<T, F, Fut>(
        &self,
        keys: &Arc<[String]>,
        until: Instant,
        unsure: Option<&AtomicBool>,
        call: F,
    ) -> Result<Vec<(Vec<usize>, T)>, BackendError>
    where
        T: Send + 'static,
        F: Fn(Arc<RedisBackend>, Arc<[String]>) -> Fut,
        Fut: Future<Output = Result<T, BackendError>> + Send + 'static,
    {
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        let mut answered = Vec::new();
        let mut pause = FIRST_PAUSE;
        let mut seen = self.current().generation;
        loop {
            let failure = match self.topology().await.and_then(|t| {
                let groups = t.group(keys, pending.iter().copied())?;
                Ok((t, groups))
            }) {
                Ok((topology, groups)) => {
                    seen = topology.generation;
                    let mut calls: FuturesUnordered<_> = groups
                        .into_iter()
                        .map(|group| {
                            let node = topology.masters[group.master].node.clone();
                            let group_keys: Arc<[String]> =
                                group.indices.iter().map(|&i| keys[i].clone()).collect();
                            let task =
                                tokio::spawn(bounded(self.node_timeout, call(node, group_keys)));
                            async move { (group.indices, task.await) }
                        })
                        .collect();
                    let (mut retry, mut failure) = (Vec::new(), None);
                    while let Some((indices, joined)) = calls.next().await {
                        match joined {
                            Ok(Ok(answer)) => answered.push((indices, answer)),
                            Ok(Err(error)) => {
                                if error.may_have_applied() {
                                    unsure.inspect(|flag| flag.store(true, Ordering::SeqCst));
                                }
                                failure = Some(error.to_string());
                                retry.extend(indices);
                            }
                            Err(error) => {
                                failure = Some(error.to_string());
                                retry.extend(indices);
                            }
                        }
                    }
                    if retry.is_empty() {
                        return Ok(answered);
                    }
                    pending = retry;
                    failure.unwrap_or_default()
                }
                Err(error) => error.to_string(),
            };
            if Instant::now() + pause >= until {
                return Err(BackendError::unknown(format!(
                    "the cluster did not serve {} of {} keys in time: {failure}",
                    pending.len(),
                    keys.len()
                )));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(LONGEST_PAUSE);
            let _ = self.refresh(seen).await;
        }
    }

    /// Releases `holder`'s hold on `keys` wherever they are, in a task of its own that
    /// retries until no key of ours can be left (the longest TTL); wakes this process's
    /// waiters and announces the release to the others. The handle gives how many keys had
    /// the hold.
    fn start_release(
        self: &Arc<Self>,
        keys: Arc<[String]>,
        holder: Holder,
        unsure: Option<Arc<AtomicBool>>,
    ) -> tokio::task::JoinHandle<Result<usize, BackendError>> {
        let inner = self.clone();
        tokio::spawn(async move {
            let until = Instant::now()
                + Duration::from_millis(inner.longest_ttl_ms.load(Ordering::Relaxed))
                    .max(inner.retry_for);
            let released = inner
                .on_groups(&keys, until, unsure.as_deref(), |node, keys| async move {
                    node.release(&keys, holder).await
                })
                .await?;
            inner.freed(&keys).await;
            Ok(released.iter().map(|(_, count)| count).sum())
        })
    }

    /// Wakes this process's waiters for `keys`, and announces their release to the others.
    async fn freed(&self, keys: &[String]) {
        self.wakeups.wake_slots(slots_of(keys));
        if let Ok(control) = self.control().await {
            announce::announce(control, keys);
        }
    }

    /// One attempt at the batch on the map `topology`.
    #[allow(clippy::too_many_arguments)]
    async fn attempt(
        self: &Arc<Self>,
        topology: &Topology,
        namespace: &str,
        keys: &Arc<[String]>,
        holder: Holder,
        ttl: Duration,
        report: usize,
        line: Line,
    ) -> Attempt {
        let groups = match topology.group(keys, 0..keys.len()) {
            Ok(groups) => groups,
            Err(error) => return Attempt::Moved(error.to_string()),
        };
        // Registered before anything is sent: the release that the caller's guard sends if
        // this future is dropped midway raises it, and groups that land after that undo
        // themselves.
        let released = Arc::new(AtomicBool::new(false));
        self.late_acquisitions().insert(holder, released.clone());
        let give_up_at = Instant::now() + ttl;
        let namespace_owned: Arc<str> = namespace.into();
        let mut calls: FuturesUnordered<_> = groups
            .iter()
            .enumerate()
            .map(|(index, group)| {
                let (master, node) = (group.master, topology.masters[group.master].node.clone());
                let group_keys: Arc<[String]> =
                    group.indices.iter().map(|&i| keys[i].clone()).collect();
                let (released, namespace, timeout) =
                    (released.clone(), namespace_owned.clone(), self.node_timeout);
                let task = tokio::spawn(async move {
                    let reply = bounded(
                        timeout,
                        node.acquire(&namespace, &group_keys, holder, ttl, report, line),
                    )
                    .await;
                    // Granted here after the caller already released the batch: undo it.
                    if matches!(reply, Ok(Acquire::Granted(_))) && released.load(Ordering::SeqCst) {
                        let _ =
                            release_on(master, node, group_keys, holder, timeout, give_up_at).await;
                    }
                    reply
                });
                async move {
                    let reply = task.await.unwrap_or_else(|error| {
                        Err(NodeFailure::Failed(BackendError::unknown(error)))
                    });
                    (index, reply)
                }
            })
            .collect();
        // The groups that granted, and those that may have (no answer in time).
        let (mut granted, mut unsure) = (Vec::new(), Vec::new());
        let (mut held, mut moved, mut why_unsure) = (Vec::new(), None, None);
        while let Some((index, reply)) = calls.next().await {
            match reply {
                Ok(Acquire::Granted(_)) => granted.push(index),
                Ok(Acquire::Held(contention)) => held.push(contention),
                Err(failure) if !failure.may_have_applied() || cluster_moved(&failure) => {
                    moved = Some(failure.to_string());
                }
                Err(failure) => {
                    why_unsure = Some(failure.to_string());
                    unsure.push(index);
                }
            }
        }
        if granted.len() == groups.len() {
            let counted = self.count_grant(namespace).await;
            if let Ok(fence) = counted {
                return Attempt::Done(Ok(Acquire::Granted(fence)));
            }
            // Nothing was handed out: release it all, and fail.
            self.roll_back(keys, holder, &released).await;
            self.late_acquisitions().remove(&holder);
            let error = counted.err().map(|e| e.to_string()).unwrap_or_default();
            return Attempt::Done(Err(BackendError::not_sent(format!(
                "could not count the grant: {error}"
            ))));
        }
        // Refused: release every group that granted or may have, on wherever its keys are
        // now, before answering, so that nothing is left behind and a next attempt with
        // the same holder cannot meet a late release of this one.
        if !unsure.is_empty() {
            let late: Arc<[String]> = unsure
                .iter()
                .flat_map(|&g| groups[g].indices.iter().map(|&i| keys[i].clone()))
                .collect();
            self.release_late_landings(late, holder, give_up_at);
        }
        granted.extend(unsure);
        let rolled_back = if granted.is_empty() {
            true
        } else {
            let indices = granted
                .iter()
                .flat_map(|&g| groups[g].indices.iter().copied());
            let subset: Arc<[String]> = indices.map(|i| keys[i].clone()).collect();
            self.roll_back(&subset, holder, &released).await
        };
        self.late_acquisitions().remove(&holder);
        // A waiter in line kept out by some groups was granted the others, which were just
        // rolled back: it keeps its place in line on those keys too, as on one Redis
        // (the refused groups' scripts reserved theirs).
        if let (Line::At(ticket), false, false) = (line, held.is_empty(), granted.is_empty()) {
            let indices = granted
                .iter()
                .flat_map(|&g| groups[g].indices.iter().copied());
            let subset: Arc<[String]> = indices.map(|i| keys[i].clone()).collect();
            let deadline = Instant::now() + self.retry_for;
            let reserved = self
                .on_groups(&subset, deadline, None, |node, keys| async move {
                    node.reserve(&keys, ticket).await
                })
                .await;
            if let Err(error) = reserved {
                tracing::debug!(%error, "a waiter's reservations on a rolled-back group failed");
            }
        }
        if let Some(why) = why_unsure {
            return Attempt::Done(Err(BackendError::not_sent(format!(
                "a cluster master did not answer in time: {why}"
            ))));
        }
        if !held.is_empty() {
            return Attempt::Done(Ok(Acquire::Held(merge(held, report))));
        }
        match moved {
            Some(why) if rolled_back => Attempt::Moved(why),
            Some(why) => Attempt::Done(Err(BackendError::not_sent(why))),
            None => Attempt::Done(Err(BackendError::not_sent("the cluster refused the batch"))),
        }
    }

    /// Releases `keys` of a refused attempt everywhere. Whether that is certain: it finished
    /// in time (otherwise it goes on in the background), and no release command of it may
    /// still land later (one that got no answer in time was sent again; the first could
    /// then end a next attempt's grant of the same hold).
    async fn roll_back(
        self: &Arc<Self>,
        keys: &Arc<[String]>,
        holder: Holder,
        released: &AtomicBool,
    ) -> bool {
        released.store(true, Ordering::SeqCst);
        let unsure = Arc::new(AtomicBool::new(false));
        let release = self.start_release(keys.clone(), holder, Some(unsure.clone()));
        let finished = matches!(
            tokio::time::timeout(self.retry_for, release).await,
            Ok(Ok(Ok(_)))
        );
        finished && !unsure.load(Ordering::SeqCst)
    }

    /// Releases `keys` again and again, a while after a refused attempt, until `until`: an
    /// acquisition that got no answer in time (a frozen master) may still run when the
    /// master thaws, after the attempt's release. The hold is never used again (the caller
    /// gets an error, and its next attempt has a hold of its own), so these releases can
    /// end nothing but such a late grant.
    fn release_late_landings(
        self: &Arc<Self>,
        keys: Arc<[String]>,
        holder: Holder,
        until: Instant,
    ) {
        let inner = self.clone();
        tokio::spawn(async move {
            let mut pause = Duration::from_secs(1);
            while Instant::now() + pause < until {
                tokio::time::sleep(pause).await;
                let deadline = Instant::now() + inner.retry_for;
                let _ = inner
                    .on_groups(&keys, deadline, None, |node, keys| async move {
                        node.release(&keys, holder).await
                    })
                    .await;
                pause *= 2;
            }
        });
    }

    /// The token of a grant: the next number of the namespace's counter, counted after every
    /// group was granted (see [`RedisCluster`]'s docs).
    async fn count_grant(&self, namespace: &str) -> Result<FencingToken, BackendError> {
        let counted = self
            .query(redis::cmd("INCR").arg(namespace).to_owned())
            .await?;
        Ok(FencingToken::new(counted))
    }

    /// Runs `command` on the cluster connection, which redis-rs routes to the master of
    /// its one key, bounded by the node timeout.
    async fn query<T: FromRedisValue + Send>(
        &self,
        command: redis::Cmd,
    ) -> Result<T, BackendError> {
        let mut control = self.control().await?;
        bounded(self.node_timeout, async move {
            command
                .query_async::<T>(&mut control)
                .await
                .map_err(BackendError::unknown)
        })
        .await
        .map_err(|failure| BackendError::unknown(failure.to_string()))
    }
}

/// Whether a group's failure says that the map moved under it (the node does not serve a
/// key's slot any more, or not yet; the cluster is down; a master became a replica): then
/// the node ran nothing of the call, or undid it (acquire's script undoes what it took
/// before it fails).
fn cluster_moved(failure: &NodeFailure) -> bool {
    let NodeFailure::Failed(error) = failure else {
        return false;
    };
    let Some(redis) = std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<redis::RedisError>())
    else {
        return false;
    };
    if redis.is_connection_refusal() {
        return true;
    }
    let moved_codes = [
        "MOVED",
        "ASK",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "READONLY",
        "MASTERDOWN",
        "LOADING",
    ];
    if redis.code().is_some_and(|code| moved_codes.contains(&code)) {
        return true;
    }
    // A script that touched a key of a slot this node does not serve: see cluster.lua.
    let text = redis.to_string();
    text.contains("non local key") || text.contains("cluster is down")
}

/// One contention out of the groups' refusals: each group counts its own keys.
fn merge(held: Vec<Contention>, report: usize) -> Contention {
    let total = held.iter().map(|c| c.total).sum();
    let earliest_expiry = held.iter().filter_map(|c| c.earliest_expiry).min();
    let mut keys: Vec<String> = held.into_iter().flat_map(|c| c.keys).collect();
    keys.sort_unstable();
    keys.truncate(report);
    Contention {
        keys,
        total,
        earliest_expiry,
    }
}

impl ClusterBackend {
    /// Starts relaying other processes' releases to this process's waiters, once.
    fn listen_for_releases(&self) {
        self.subscribed.get_or_init(|| {
            let (client, wakeups) = (self.subscriber.clone(), Arc::downgrade(&self.inner.wakeups));
            tokio::spawn(async move {
                let mut pause = Duration::from_millis(100);
                while wakeups.strong_count() > 0 {
                    match client.get_async_connection().await {
                        Ok(mut connection) => match connection.ssubscribe(super::redis::RELEASED_CHANNEL).await {
                            // redis-rs subscribes again after a reconnection or a move of
                            // the channel's slot; hold the connection while the store lives.
                            Ok(()) => {
                                while wakeups.strong_count() > 0 {
                                    tokio::time::sleep(Duration::from_secs(1)).await;
                                }
                                return;
                            }
                            Err(error) => tracing::warn!(%error, "could not subscribe to lock releases on the cluster; waiters poll"),
                        },
                        Err(error) => tracing::warn!(%error, "could not subscribe to lock releases on the cluster; waiters poll"),
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            });
        });
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.inner.retry_for
    }
}

impl Backend for ClusterBackend {
    fn acquire<'a>(
        &'a self,
        namespace: &'a str,
        keys: &'a [String],
        holder: Holder,
        ttl: Duration,
        report: usize,
        line: Line,
    ) -> BoxFuture<'a, Result<Acquire, BackendError>> {
        Box::pin(async move {
            let inner = &self.inner;
            inner.note_ttl(ttl);
            let keys: Arc<[String]> = keys.into();
            let until = self.deadline();
            let mut pause = FIRST_PAUSE;
            loop {
                let topology = match inner.topology().await {
                    Ok(topology) => topology,
                    Err(error) if Instant::now() + pause >= until => return Err(error),
                    Err(_) => {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(LONGEST_PAUSE);
                        continue;
                    }
                };
                let attempt = inner
                    .attempt(&topology, namespace, &keys, holder, ttl, report, line)
                    .await;
                match attempt {
                    Attempt::Done(answer) => return answer,
                    Attempt::Moved(why) if Instant::now() + pause >= until => {
                        return Err(BackendError::not_sent(format!(
                            "the cluster kept moving for {} ms: {why}",
                            inner.retry_for.as_millis()
                        )))
                    }
                    Attempt::Moved(why) => {
                        tracing::debug!(why, "the cluster moved under a batch; trying again");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(LONGEST_PAUSE);
                        let _ = inner.refresh(topology.generation).await;
                    }
                }
            }
        })
    }

    fn extend<'a>(
        &'a self,
        keys: &'a [String],
        holder: Holder,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, BackendError>> {
        Box::pin(async move {
            self.inner.note_ttl(ttl);
            let keys: Arc<[String]> = keys.into();
            let answers = self
                .inner
                .on_groups(&keys, self.deadline(), None, |node, keys| async move {
                    node.extend(&keys, holder, ttl).await
                })
                .await?;
            Ok(answers.iter().all(|(_, kept)| *kept))
        })
    }

    fn release<'a>(
        &'a self,
        keys: &'a [String],
        holder: Holder,
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            if let Some(released) = self.inner.late_acquisitions().remove(&holder) {
                released.store(true, Ordering::SeqCst);
            }
            // In a task of its own: it finishes even if the caller stops waiting.
            self.inner
                .start_release(keys.into(), holder, None)
                .await
                .unwrap_or_else(|error| Err(BackendError::unknown(error)))
        })
    }

    fn withdraw<'a>(
        &'a self,
        keys: &'a [String],
        ticket: Ticket,
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let keys: Arc<[String]> = keys.into();
            let answers = self
                .inner
                .on_groups(&keys, self.deadline(), None, |node, keys| async move {
                    node.withdraw(&keys, ticket).await
                })
                .await?;
            let withdrawn = answers.iter().map(|(_, count)| count).sum();
            // Nothing freed wakes nobody, here or elsewhere.
            if withdrawn > 0 {
                self.inner.freed(&keys).await;
            }
            Ok(withdrawn)
        })
    }

    fn inspect<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<KeyView>, BackendError>> {
        Box::pin(async move {
            let keys: Arc<[String]> = keys.into();
            let answers = self
                .inner
                .on_groups(&keys, self.deadline(), None, |node, keys| async move {
                    node.inspect(&keys).await
                })
                .await?;
            let mut views = vec![KeyView::FREE; keys.len()];
            for (indices, group_views) in answers {
                for (index, view) in indices.into_iter().zip(group_views) {
                    views[index] = view;
                }
            }
            Ok(views)
        })
    }

    fn force_release<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let keys: Arc<[String]> = keys.into();
            let answers = self
                .inner
                .on_groups(&keys, self.deadline(), None, |node, keys| async move {
                    node.force_release(&keys).await
                })
                .await?;
            let released = answers.iter().map(|(_, count)| count).sum();
            if released > 0 {
                self.inner.freed(&keys).await;
            }
            Ok(released)
        })
    }

    /// One `GET`, which redis-rs routes to the key's master.
    #[cfg(feature = "idempotency")]
    fn load_answer<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<bytes::Bytes>, BackendError>> {
        Box::pin(async move {
            let get = redis::cmd("GET").arg(key).to_owned();
            let answer: Option<Vec<u8>> = self.inner.query(get).await?;
            Ok(answer.map(bytes::Bytes::from))
        })
    }

    /// One `SET ... NX`, which redis-rs routes to the key's master.
    #[cfg(feature = "idempotency")]
    fn store_answer<'a>(
        &'a self,
        key: &'a str,
        answer: bytes::Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, BackendError>> {
        Box::pin(async move {
            let set = super::redis::store_answer_command(key, &answer, retention);
            let stored: Option<String> = self.inner.query(set).await?;
            Ok(stored.is_some())
        })
    }

    /// The cluster answers with a map that serves every slot, and every master passes the
    /// single store's check (Redis 7.0 or later, the scripts load).
    fn check(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            let seen = self.inner.current().generation;
            let topology = self.inner.refresh(seen).await?;
            if !topology.serves_every_slot() {
                return Err(BackendError::not_sent(
                    "the cluster leaves hash slots without a master",
                ));
            }
            let checks = topology.masters.iter().map(|master| async move {
                bounded(self.inner.node_timeout, master.node.check())
                    .await
                    .map_err(|failure| format!("{}: {failure}", master.address))
            });
            let failures: Vec<String> = futures_util::future::join_all(checks)
                .await
                .into_iter()
                .filter_map(Result::err)
                .collect();
            if failures.is_empty() {
                Ok(())
            } else {
                Err(BackendError::not_sent(failures.join("; ")))
            }
        })
    }

    fn drift(&self, ttl: Duration) -> Duration {
        // Keys of one batch expire by the clocks of several masters.
        clock_drift(ttl)
    }

    fn wakeups(&self) -> &Wakeups {
        self.listen_for_releases();
        &self.inner.wakeups
    }
}
