//! The cluster store: each call of the contract on the groups of its keys, made again
//! while the cluster moves.

use std::{
    fmt,
    sync::{Arc, Mutex, OnceLock, RwLock},
    time::{Duration, Instant},
};

#[cfg(feature = "idempotency")]
use bytes::Bytes;
use redis::{cluster::ClusterClient, ConnectionInfo, ProtocolVersion};
use tokio::sync::OnceCell;

use super::{
    announce,
    attempt::Attempt,
    nodes::{moving_backoff, Nodes},
};
use crate::store::{
    contract::{Acquire, AcquireRequest, Holder, KeyView, Keys, LockStore, Modes, Reply, Ticket},
    error::StoreError,
    fanout::{bounded, clock_drift, Fanout},
    message::Reconnecting,
    redis::{pubsub::RELEASED_CHANNEL, replicas::ReplicaAck, Freeing},
    wake::Wakeups,
};
#[cfg(feature = "idempotency")]
use crate::store::{
    contract::{AnswerStore, StoredAnswer},
    redis::answers::store_answer_command,
};

pub(crate) struct ClusterStore {
    inner: Arc<Nodes>,
    /// The client of the subscription to other processes' releases.
    subscriber: ClusterClient,
    subscribed: OnceLock<()>,
}

impl fmt::Debug for ClusterStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let topology = self.inner.current();
        let masters: Vec<&str> = topology.masters.iter().map(|m| &*m.address).collect();
        f.debug_struct("ClusterStore")
            .field("masters", &masters)
            .field("fanout", &self.inner.fanout)
            .field("retry_for", &self.inner.retry_for)
            .finish_non_exhaustive()
    }
}

impl ClusterStore {
    /// A store that learns the cluster from the nodes at `seeds`; nothing connects yet.
    pub(super) fn new(
        seeds: Vec<ConnectionInfo>,
        node_timeout: Duration,
        retry_for: Duration,
        replicas: Option<ReplicaAck>,
        step: usize,
    ) -> Result<Self, redis::RedisError> {
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
                .connection_timeout(node_timeout)
                .response_timeout(node_timeout);
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
        let inner = Nodes {
            seed,
            control_client,
            control: OnceCell::new(),
            topology: RwLock::default(),
            refreshing: tokio::sync::Mutex::new(()),
            pools: Mutex::default(),
            retry_for,
            fanout: Arc::new(Fanout::new("cluster", node_timeout)),
            wakeups,
            replicas,
            step,
        };
        let store = Self {
            inner: Arc::new(inner),
            subscriber,
            subscribed: OnceLock::new(),
        };
        // Built inside a runtime (the usual case), subscribe now, so that the first waiter
        // already hears of releases; otherwise on first use.
        if tokio::runtime::Handle::try_current().is_ok() {
            store.listen_for_releases();
        }
        Ok(store)
    }

    /// Starts relaying other processes' releases to this process's waiters, once.
    fn listen_for_releases(&self) {
        self.subscribed.get_or_init(|| {
            let (client, wakeups) = (self.subscriber.clone(), Arc::downgrade(&self.inner.wakeups));
            tokio::spawn(async move {
                let mut reconnecting = Reconnecting::new("the cluster".to_owned());
                while wakeups.strong_count() > 0 {
                    let subscribed = match client.get_async_connection().await {
                        Ok(mut connection) => connection
                            .ssubscribe(RELEASED_CHANNEL)
                            .await
                            .map(|()| connection),
                        Err(error) => Err(error),
                    };
                    match subscribed {
                        // redis-rs subscribes again after a reconnection or a move of the
                        // channel's slot; hold the connection while the store lives.
                        Ok(_connection) => {
                            reconnecting.listening();
                            while wakeups.strong_count() > 0 {
                                tokio::time::sleep(Duration::from_secs(1)).await;
                            }
                            return;
                        }
                        Err(error) => reconnecting.failed(&error),
                    }
                    reconnecting.pause().await;
                }
            });
        });
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.inner.retry_for
    }
}

impl LockStore for ClusterStore {
    fn announces_releases(&self) -> bool {
        true
    }

    fn acquire<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, Acquire> {
        Box::pin(async move {
            let inner = &self.inner;
            inner.fanout.note_ttl(request.ttl);
            let until = self.deadline();
            let mut backoff = moving_backoff();
            loop {
                let topology = inner.topology().await;
                let moved = match &topology {
                    Ok(topology) => match inner.attempt(topology, request).await {
                        Attempt::Done(answer) => return answer,
                        Attempt::Moved(why) => why,
                    },
                    Err(error) => error.to_string(),
                };
                if !backoff.sleep_before(until).await {
                    return Err(StoreError::left_nothing(format!(
                        "the cluster kept moving for {} ms: {moved}",
                        inner.retry_for.as_millis()
                    )));
                }
                tracing::debug!(moved, "the cluster moved under a batch; trying again");
                if let Ok(topology) = topology {
                    let _ = inner.refresh(topology.generation).await;
                }
            }
        })
    }

    fn extend<'a>(&'a self, keys: &'a Keys, holder: Holder, ttl: Duration) -> Reply<'a, bool> {
        Box::pin(async move {
            self.inner.fanout.note_ttl(ttl);
            let answers = self
                .inner
                .on_groups(
                    "extend",
                    keys,
                    self.deadline(),
                    None,
                    |node, keys| async move { node.extend(&keys, holder, ttl).await },
                )
                .await?;
            Ok(answers.answers.iter().all(|(_, kept)| *kept))
        })
    }

    fn release<'a>(&'a self, keys: &'a Keys, holder: Holder) -> Reply<'a, usize> {
        Box::pin(async move {
            self.inner.fanout.mark_released(holder);
            // In a task of its own: it finishes even if the caller stops waiting.
            self.inner
                .start_release(keys.clone(), Freeing::Release(holder), None)
                .await
                .unwrap_or_else(|error| Err(StoreError::unknown(error)))
        })
    }

    fn withdraw<'a>(&'a self, keys: &'a Keys, ticket: Ticket) -> Reply<'a, usize> {
        Box::pin(async move {
            let answers = self
                .inner
                .on_groups(
                    "withdraw",
                    keys,
                    self.deadline(),
                    None,
                    |node, keys| async move { node.free(Freeing::Withdraw(ticket), &keys).await },
                )
                .await?;
            Ok(self
                .inner
                .freed(keys, Freeing::Withdraw(ticket), &answers)
                .await)
        })
    }

    fn probes(&self) -> bool {
        true
    }

    /// One key is one master's group: one script, granted or refused whole. A batch of
    /// more may be granted by one master and rolled back.
    fn whole_attempts(&self, keys: usize) -> bool {
        keys == 1
    }

    fn spreads_by_hash_slot(&self) -> bool {
        true
    }

    /// Probes each group on its master at once: the keys free, from the first, are those
    /// before the first key that a group's probe found still in the way.
    fn probe<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, usize> {
        Box::pin(async move {
            let answers = self
                .inner
                .on_groups(
                    "probe",
                    &request.keys,
                    self.deadline(),
                    None,
                    |node, keys| {
                        // The group's keys are some of the request's, which are sorted.
                        let position = |key: &String| request.keys.binary_search(key).unwrap_or(0);
                        let modes =
                            Modes::of_each(keys.iter().map(|k| request.modes.at(position(k))));
                        let request = AcquireRequest {
                            keys,
                            modes,
                            ..request.clone()
                        };
                        async move { node.probe(&request).await }
                    },
                )
                .await?;
            Ok(answers
                .answers
                .iter()
                .filter_map(|(indices, free)| indices.get(*free).copied())
                .min()
                .unwrap_or(request.keys.len()))
        })
    }

    fn inspect<'a>(&'a self, keys: &'a Keys) -> Reply<'a, Vec<KeyView>> {
        Box::pin(async move {
            let answers = self
                .inner
                .on_groups(
                    "inspect",
                    keys,
                    self.deadline(),
                    None,
                    |node, keys| async move { node.inspect(&keys).await },
                )
                .await?;
            let mut views = vec![KeyView::FREE; keys.len()];
            for (indices, group_views) in answers.answers {
                for (index, view) in indices.into_iter().zip(group_views) {
                    views[index] = view;
                }
            }
            Ok(views)
        })
    }

    fn force_release<'a>(&'a self, keys: &'a Keys) -> Reply<'a, usize> {
        Box::pin(async move {
            let answers = self
                .inner
                .on_groups(
                    "force_release",
                    keys,
                    self.deadline(),
                    None,
                    |node, keys| async move { node.free(Freeing::Force, &keys).await },
                )
                .await?;
            Ok(self.inner.freed(keys, Freeing::Force, &answers).await)
        })
    }

    /// The cluster answers with a map that serves every slot, and every master passes the
    /// single store's check (Redis 7.0 or later, the scripts load).
    fn check(&self) -> Reply<'_, ()> {
        Box::pin(async move {
            let seen = self.inner.current().generation;
            let topology = self.inner.refresh(seen).await?;
            if !topology.serves_every_slot() {
                return Err(StoreError::left_nothing(
                    "the cluster leaves hash slots without a master",
                ));
            }
            let checks = topology.masters.iter().map(|master| async move {
                bounded(self.inner.fanout.node_timeout(), master.node.check())
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
                Err(StoreError::left_nothing(failures.join("; ")))
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

#[cfg(feature = "idempotency")]
impl AnswerStore for ClusterStore {
    /// One `GET`, which redis-rs routes to the key's master.
    fn load_answer<'a>(&'a self, key: &'a str) -> Reply<'a, Option<Bytes>> {
        Box::pin(async move {
            let get = redis::cmd("GET").arg(key).to_owned();
            let answer: Option<Vec<u8>> = self.inner.query(get).await?;
            Ok(answer.map(Bytes::from))
        })
    }

    /// One `SET ... NX`, which redis-rs routes to the key's master.
    fn store_answer<'a>(&'a self, answer: &'a StoredAnswer) -> Reply<'a, bool> {
        Box::pin(async move {
            let set = store_answer_command(answer);
            let stored: Option<String> = self.inner.query(set).await?;
            Ok(stored.is_some())
        })
    }
}
