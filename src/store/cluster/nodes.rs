//! The cluster's masters as the store knows them (the slot map, a pool per master, the
//! cluster connection), and each call on the groups of a batch.

use std::{
    collections::HashMap,
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, PoisonError, RwLock,
    },
    time::{Duration, Instant},
};

use futures_util::{stream::FuturesUnordered, StreamExt};
use redis::{
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
    cluster_routing::{RoutingInfo, SingleNodeRoutingInfo},
    ConnectionAddr, ConnectionInfo, FromRedisValue, Script,
};
use tokio::sync::OnceCell;

use super::{announce, topology::Topology};
use crate::{
    backoff::Backoff,
    store::{
        error::StoreError,
        fanout::{bounded, node_pool, Fanout},
        message::unnamed_heads_message,
        redis::{replicas::ReplicaAck, Freed, Freeing, RedisStore},
        wake::{slots_of, Wakeups},
    },
};

/// The pauses before a call is tried again on a moving cluster.
pub(super) fn moving_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(10), Duration::from_millis(200))
}

/// The answers of a call on the groups of a batch ([`Nodes::on_groups`]).
pub(super) struct Answered<T> {
    /// Each group's keys, by index, with its answer.
    pub(super) answers: Vec<(Vec<usize>, T)>,
    /// The keys, by index, of the calls whose answer was lost (none came in time, or the
    /// connection broke after the send): they may have run, were sent again, and were
    /// answered then.
    pub(super) lost: Vec<usize>,
}

/// What the store's tasks share.
pub(super) struct Nodes {
    /// The first URL's settings (credentials, TLS), for a pool to any master.
    pub(super) seed: ConnectionInfo,
    /// The client of the cluster connection that reads the slot map, counts grants and
    /// announces releases: redis-rs routes each of those by its one key.
    pub(super) control_client: ClusterClient,
    pub(super) control: OnceCell<ClusterConnection>,
    pub(super) topology: RwLock<Arc<Topology>>,
    /// One refresh of the map at a time.
    pub(super) refreshing: tokio::sync::Mutex<()>,
    /// A store per master address, kept across maps, so that a master keeps its pool.
    pub(super) pools: Mutex<HashMap<String, Arc<RedisStore>>>,
    pub(super) retry_for: Duration,
    pub(super) fanout: Arc<Fanout>,
    pub(super) wakeups: Arc<Wakeups>,
    /// How many replicas of its master must have a group's grant, if any.
    pub(super) replicas: Option<ReplicaAck>,
    /// How many keys one script takes at most on a master.
    pub(super) step: usize,
}

impl Nodes {
    pub(super) fn current(&self) -> Arc<Topology> {
        self.topology
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(super) async fn control(&self) -> Result<ClusterConnection, StoreError> {
        self.control
            .get_or_try_init(|| async {
                bounded(self.fanout.node_timeout(), async {
                    self.control_client
                        .get_async_connection()
                        .await
                        .map_err(StoreError::not_sent)
                })
                .await
                .map_err(|failure| StoreError::not_sent(failure.to_string()))
            })
            .await
            .cloned()
    }

    /// The slot map, read from the cluster if this store has none yet.
    pub(super) async fn topology(&self) -> Result<Arc<Topology>, StoreError> {
        let current = self.current();
        if !current.masters.is_empty() {
            return Ok(current);
        }
        self.refresh(current.generation).await
    }

    /// A slot map newer than generation `seen`: read from the cluster, unless another call
    /// did that in the meantime.
    pub(super) async fn refresh(&self, seen: u64) -> Result<Arc<Topology>, StoreError> {
        let _one = self.refreshing.lock().await;
        let current = self.current();
        if current.generation > seen && !current.masters.is_empty() {
            return Ok(current);
        }
        let mut control = self.control().await?;
        let slots = redis::cmd("CLUSTER").arg("SLOTS").to_owned();
        let reply = bounded(self.fanout.node_timeout(), async {
            control
                .route_command(
                    slots,
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                )
                .await
                .map_err(StoreError::left_nothing)
        })
        .await
        .map_err(|failure| StoreError::left_nothing(failure.to_string()))?;
        let asked_host = match self.seed.addr() {
            ConnectionAddr::Tcp(host, _) | ConnectionAddr::TcpTls { host, .. } => host.as_str(),
            _ => "",
        };
        let topology = Arc::new(Topology::from_slots(
            &reply,
            current.generation + 1,
            asked_host,
            |host, port| self.pool_for(host, port),
        )?);
        *self
            .topology
            .write()
            .unwrap_or_else(PoisonError::into_inner) = topology.clone();
        Ok(topology)
    }

    /// The store of the master at `host:port`, with a pool of its own, made on first use.
    pub(super) fn pool_for(&self, host: &str, port: u16) -> Result<Arc<RedisStore>, StoreError> {
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
        let pool = node_pool(info, self.fanout.node_timeout())?;
        let node = Arc::new(
            RedisStore::cluster_node(pool, self.wakeups.clone())
                .with_replicas(self.replicas)
                .with_step(self.step),
        );
        pools.insert(address, node.clone());
        Ok(node)
    }

    /// Runs `call` on every group of `keys`, each on its master at once, bounded by the
    /// node timeout; the keys of a group that failed are regrouped on a fresh map and sent
    /// again after a pause, until `until`. Only for calls that may run twice (everything
    /// but acquire). `unsure` is raised when a call failed in a way that may still let it
    /// run later (no answer in time, a broken connection): it was sent again, and the
    /// first may land after that.
    pub(super) async fn on_groups<T, F, Fut>(
        &self,
        name: &'static str,
        keys: &Arc<[String]>,
        until: Instant,
        unsure: Option<&AtomicBool>,
        call: F,
    ) -> Result<Answered<T>, StoreError>
    where
        T: Send + 'static,
        F: Fn(Arc<RedisStore>, Arc<[String]>) -> Fut,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        let mut answered = Answered {
            answers: Vec::new(),
            lost: Vec::new(),
        };
        let mut backoff = moving_backoff();
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
                            let group_keys = group.keys_of(keys);
                            let timeout = self.fanout.timeout_for(group_keys.len(), node.step());
                            let call = bounded(timeout, call(node, group_keys));
                            self.fanout.spawn(group, call)
                        })
                        .collect();
                    let (mut retry, mut failure) = (Vec::new(), None);
                    while let Some((group, reply)) = calls.next().await {
                        match reply {
                            Ok(answer) => answered.answers.push((group.indices, answer)),
                            Err(error) => {
                                if error.may_run_later() {
                                    unsure.inspect(|flag| flag.store(true, Ordering::SeqCst));
                                    answered.lost.extend(&group.indices);
                                }
                                let address = &topology.masters[group.master].address;
                                self.fanout.report(address, name, &error);
                                failure = Some(error.to_string());
                                retry.extend(group.indices);
                            }
                        }
                    }
                    if retry.is_empty() {
                        answered.lost.sort_unstable();
                        answered.lost.dedup();
                        return Ok(answered);
                    }
                    // In the batch's order again, as on the first pass: a group's keys in
                    // any other order would let a probe count keys as free past one that
                    // it did not read.
                    retry.sort_unstable();
                    pending = retry;
                    failure.unwrap_or_default()
                }
                Err(error) => error.to_string(),
            };
            if !backoff.sleep_before(until).await {
                return Err(StoreError::unknown(format!(
                    "the cluster did not serve {} of {} keys in time: {failure}",
                    pending.len(),
                    keys.len()
                )));
            }
            let _ = self.refresh(seen).await;
        }
    }

    /// Ends a hold on `keys` wherever they are, as `how` says (a release, or a refused
    /// attempt's roll-back, which does not wake its own waiter), in a task of its own that
    /// retries until no key of ours can be left (the longest TTL); wakes this process's
    /// waiters and announces the release to the others. The handle gives how many keys had
    /// the hold.
    pub(super) fn start_release(
        self: &Arc<Self>,
        keys: Arc<[String]>,
        how: Freeing,
        unsure: Option<Arc<AtomicBool>>,
    ) -> tokio::task::JoinHandle<Result<usize, StoreError>> {
        let inner = self.clone();
        tokio::spawn(async move {
            let until = Instant::now() + inner.fanout.longest_ttl().max(inner.retry_for);
            let released = inner
                .on_groups(
                    "release",
                    &keys,
                    until,
                    unsure.as_deref(),
                    |node, keys| async move { node.free(how, &keys).await },
                )
                .await?;
            Ok(inner.freed(&keys, how, &released).await)
        })
    }

    /// After the groups of `keys` freed them (`freed`), wakes this process's waiters in
    /// no line for `keys` (the nodes woke those first in line), and announces the release
    /// to the other processes, naming those first in line. Returns how many keys the groups
    /// changed: nothing changed wakes nobody, here or elsewhere. But a call whose answer
    /// was lost may have freed its keys, and the retry that was answered found nothing
    /// left there, nor anyone to name: on those keys, the waiters first in line in every
    /// process are woken, each process finding its own ([`Wakeups::wake_first_in_line`]),
    /// but for the waiter whose refused attempt `how` rolls back.
    pub(super) async fn freed(
        &self,
        keys: &[String],
        how: Freeing,
        freed: &Answered<Freed>,
    ) -> usize {
        let count = freed.answers.iter().map(|(_, freed)| freed.count).sum();
        let lost: Vec<String> = freed.lost.iter().map(|&i| keys[i].clone()).collect();
        if count == 0 && lost.is_empty() {
            return 0;
        }
        let control = self.control().await;
        if count > 0 {
            self.wakeups.wake_keys(keys);
            if let Ok(control) = &control {
                let heads = freed
                    .answers
                    .iter()
                    .flat_map(|(_, freed)| freed.heads.iter().copied());
                let message = announce::message(keys, heads, self.wakeups.tag());
                announce::announce(control.clone(), message);
            }
        }
        if !lost.is_empty() {
            let slots = slots_of(&lost);
            self.wakeups.wake_first_in_line(&slots, how.rolling_back());
            if let Ok(control) = control {
                let message = unnamed_heads_message(&slots, self.wakeups.tag());
                announce::announce(control, message);
            }
        }
        count
    }

    /// Runs the script of `source` (whose hash `script` has) on its one key `key`, on the
    /// cluster connection, which redis-rs routes to the key's master, bounded by the node
    /// timeout: `EVALSHA`, then `EVAL` on a master that does not have it cached (one promoted
    /// since, say). Never `SCRIPT LOAD`, which redis-rs would send to every master, and
    /// which would fail while any of them is down.
    pub(super) async fn eval<T: FromRedisValue + Send>(
        &self,
        script: &Script,
        source: &str,
        key: &str,
    ) -> Result<T, StoreError> {
        let mut control = self.control().await?;
        bounded(self.fanout.node_timeout(), async move {
            let mut evalsha = redis::cmd("EVALSHA");
            evalsha.arg(script.get_hash()).arg(1).arg(key);
            match evalsha.query_async::<T>(&mut control).await {
                Err(error) if error.code() == Some("NOSCRIPT") => {
                    let mut eval = redis::cmd("EVAL");
                    eval.arg(source).arg(1).arg(key);
                    eval.query_async::<T>(&mut control).await
                }
                reply => reply,
            }
            .map_err(StoreError::unknown)
        })
        .await
        .map_err(|failure| StoreError::unknown(failure.to_string()))
    }

    /// Runs `command` on the cluster connection, which redis-rs routes to the master of
    /// its one key, bounded by the node timeout (the idempotency layer's answers).
    #[cfg(feature = "idempotency")]
    pub(super) async fn query<T: FromRedisValue + Send>(
        &self,
        command: redis::Cmd,
    ) -> Result<T, StoreError> {
        let mut control = self.control().await?;
        bounded(self.fanout.node_timeout(), async move {
            command
                .query_async::<T>(&mut control)
                .await
                .map_err(StoreError::unknown)
        })
        .await
        .map_err(|failure| StoreError::unknown(failure.to_string()))
    }
}
