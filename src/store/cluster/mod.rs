//! Locks on a Redis Cluster: each batch grouped by the master that serves its keys' slots,
//! one script call per master, all at once ([`RedisCluster`] tells the user's side).
//!
//! - **acquire** sends each master the keys of the batch it serves, as one store of one
//!   Redis acquires a batch (`redis/steps.rs`: the free keys of a big group with plain
//!   `SET`s, the rest with the acquire script in its cluster form, `scripts/cluster.lua`:
//!   keys of many slots pass as arguments, which `allow-cross-slot-keys` lets the script
//!   touch one command at a time). Each group is all or nothing on its master; the batch is
//!   granted when every group was, and then takes its fencing token from the namespace's
//!   one counter. Otherwise every group that granted or may have is released. A group
//!   refused because the map moved under it (a slot moved or is migrating, a master failed
//!   over, the cluster is down) is released too, on the new map (its plain `SET`s or first
//!   steps may have taken keys before one met the move), and the whole attempt is made
//!   again, until [`RedisCluster::retry_for`].
//! - **extend, release, withdraw, inspect, force_release** run on each group the same
//!   way; a group refused for a moved slot is regrouped on a fresh map and sent again (each
//!   of these is idempotent). A release finishes in the background if its caller stops
//!   waiting.
//!
//! Every group runs in a task of its own, so that a call nobody waits for any more still
//! ends (see the fanout, which Redlock shares), and a flag per acquisition,
//! by holder, lets a group granted after the batch's release undo itself.

use std::{sync::Arc, time::Duration};

use redis::IntoConnectionInfo;

use super::{fanout::NodeUrls, handle::Store, redis::replicas::ReplicaAck};
use store::ClusterStore;

use crate::duration::capped;

mod announce;
mod attempt;
mod nodes;
mod store;
mod topology;

/// How long one master may take to answer one call, unless [`RedisCluster::node_timeout`]
/// says otherwise.
const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a call keeps trying while the cluster moves, unless
/// [`RedisCluster::retry_for`] says otherwise.
const DEFAULT_RETRY_FOR: Duration = Duration::from_secs(1);

/// Locks on a Redis Cluster (or a managed cluster-mode Redis or Valkey): every batch is
/// grouped by the master that serves each key's hash slot, each master gets its group as
/// one script call, all at once, and the batch is granted when every group was.
///
///
/// ```
/// use std::time::Duration;
/// use tower_batch_lock::{store::RedisCluster, Locks};
///
/// # fn main() -> Result<(), tower_batch_lock::redis::RedisError> {
/// // Any of the cluster's nodes: the store reads the slot map from them. Nothing connects
/// // yet.
/// let store = RedisCluster::new(["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"])
///     .node_timeout(Duration::from_millis(200))
///     .retry_for(Duration::from_millis(1500))
///     .build()?;
/// let locks = Locks::new(store).ttl(Duration::from_secs(10));
///
/// assert!(RedisCluster::new(Vec::<String>::new()).build().is_err());
/// # drop(locks);
/// # Ok(())
/// # }
/// ```
///
/// # What it guarantees
///
/// The same as one Redis ([`Redis`](super::Redis)), batch by batch: all or nothing (a batch
/// refused on one master is released on every master that granted its group, and a group
/// that lands after its batch was released undoes itself), owner-only release, re-entry,
/// TTLs and renewal, fair waiting, release on drop. A waiter with a small batch keeps its
/// place in line with a reservation in each key, where the key lives; one with a big batch
/// (64 keys or more on a master) with a *claim* on each master its keys live on, as on one
/// Redis: a set of its keys there and its ticket in that master's registry of claims (a
/// sorted set under `tower-batch-lock:claims{<tag>}`, the hash tag of a slot the master
/// serves, which every process with the same slot map names alike).
///
/// - **An attempt in flight.** The groups of one attempt are decided by their masters
///   independently: until a refused attempt's granted groups are released (a round trip
///   later), their keys are held, so that a request that comes for one of them in that
///   moment is kept out (a 409, or it waits) and the operator's view shows them held. No
///   batch is ever granted in part.
/// - **Fencing tokens.** Masters cannot share a counter, and a counter per master would
///   move with its slot during a resharding (or give different masters different counts,
///   as Redlock's do). So a grant takes its token from the namespace's one counter (the
///   key named by the prefix, on whichever master serves its slot), with a small script
///   that counts it *after* every group was granted: any later grant of a shared key was
///   granted its group after this one's release, so after this count, and counts a larger
///   number. Tokens strictly increase across every grant of the namespace, as on one
///   Redis, and, floored by the clock of the counter's master, they keep increasing when
///   that master fails over to a replica that missed the last counts
///   ([`FencingToken`](crate::FencingToken) says under which assumptions). The cost: one
///   more round trip per acquisition, to that master (a few microseconds of its time).
/// - **Resharding.** While a slot migrates, a group with keys of it is refused by its node
///   (`ASK` or `TRYAGAIN`: a script over several keys cannot follow an `ASK`, since the
///   importing node serves a multi-key call only when it has every key already); the
///   attempt is released and made again after a pause, on a fresh map once the slot has
///   moved (`MOVED`), until [`retry_for`](Self::retry_for) runs out (then 503). A lock
///   value migrates with its ttl like any key, so a held key stays held where it goes.
///   When the slot of a master's registry of claims moves, calls there fail alike until the
///   map shows it (a release is sent again on the new map), and then name a registry of a
///   slot the master still serves. The claims in the old one move with its slot: they end
///   with their waiters' grants where the new map names it again (as the registry of the
///   master it went to), and by themselves at their waiters' deadlines where it does not;
///   their waiters claim again when next refused (meanwhile a later arrival may pass them;
///   no one is let into a held key).
/// - **The counter's master.** While the master that serves the counter's slot is down,
///   no batch can be granted (503) until its replica takes over.
/// - **Failover.** A master that dies makes the calls for its keys fail (after the node
///   timeout when it is frozen): those requests get 503 until a replica takes over and
///   the map shows it. Replication is asynchronous: a lock granted just before its master
///   died may be missing on the replica that replaces it, so another request can be granted
///   the same keys while the first still runs (the fencing tokens still increase: let the
///   resource check them). [`replicas`](Self::replicas) narrows that window (`WAIT`); see
///   the requirements below for what else helps.
///
/// # When to choose it
///
/// One Redis is simplest and cheapest per key, and its one thread bounds how many batches
/// per second the whole service can lock: a 3,000-key acquire and release keep it busy for
/// tens of milliseconds. A cluster spreads every batch over its masters, so that each
/// carries a share of it, and fails over to replicas, which can lose recent locks (above).
/// [`Redlock`](super::Redlock) is for not losing locks when a Redis dies. A service that
/// already runs a cluster (or a managed cluster-mode Redis) uses it as it is.
///
/// Redis refuses a script whose declared keys span several hash slots (`CROSSSLOT`), even
/// with Redis 7's `allow-cross-slot-keys` flag, which only lets a script touch keys of
/// several slots *of its node*, one command per key: hence the grouping by master.
///
/// # Requirements
///
/// - Redis 7.0 or later (or Valkey): the scripts are functions (loaded on each master
///   where a call finds them missing) with the `allow-cross-slot-keys` flag,
///   and wake-ups use sharded pub/sub (`SPUBLISH` to the channel
///   `tower-batch-lock:released`, `SSUBSCRIBE` in each process: only the shard of the
///   channel carries them, where a plain `PUBLISH` goes to every node).
/// - **ACL.** The user needs `FCALL`, `FUNCTION LOAD`, `EVALSHA`, `EVAL` (the fencing
///   counter's script), `SET`, `GET`, `MGET`, `DEL`, `EXISTS`, `PTTL`, `PEXPIRE`,
///   `PEXPIREAT`, `TIME`, `PING`, `INFO`, `CLUSTER SLOTS`, `ZRANGE`, `ZADD`, `ZREM`,
///   `ZREMRANGEBYSCORE`, `SADD`, `SREM`, `SMISMEMBER`, `SINTERCARD`, `SPUBLISH` and
///   `SSUBSCRIBE` (and `WAIT` with [`replicas`](Self::replicas)) on the prefix's keys (and
///   `idempotency:*` for the idempotency layer), on `tower-batch-lock:claims*` (waiters'
///   claims) and on the channel.
/// - **Keys and slots.** Redis puts a key in the hash slot of its `{hash tag}`, when it
///   has one. A [prefix](crate::Locks::prefix) with a tag would put every lock on one
///   master (the crate logs a warning); braces in the keys a client sends choose their
///   slots, so a client can put all of its keys on one master, which then serves its
///   batches alone.
/// - **Managed services.** The service must let clients load and run Lua functions and
///   scripts and `CLUSTER
///   SLOTS`. Services that put a proxy in front of the cluster (one endpoint that hides the
///   slots) refuse scripts over keys of several slots: use their cluster-API endpoint. The
///   store never uses the commands services often disable or rename (`KEYS`, `CONFIG`,
///   `DEBUG`, `FLUSHALL`, `CLUSTER` subcommands other than `SLOTS`). TLS and credentials go
///   in the URLs (`rediss://user:password@host:port/`); every node takes the first URL's.
///   TLS needs a TLS feature of the `redis` crate in your `Cargo.toml`, as for
///   [`Redis`](crate::store::Redis).
/// - **Masters' addresses.** Each master is reached where `CLUSTER SLOTS` says. One given
///   without a host (NULL or `""`: nodes behind a load balancer, with
///   `cluster-preferred-endpoint-type unknown-endpoint`) is reached at the first URL's
///   host with the port it gives: nodes that have hosts of their own must announce them.
///   One given as `"?"` (`cluster-preferred-endpoint-type hostname` on a node that
///   announces no hostname) cannot be reached: its keys get 503 once the store has read
///   the map again for [`retry_for`](Self::retry_for), and the store logs why, while the
///   other masters' keys are served (unless it serves the namespace's fencing counter,
///   which every grant counts on).
/// - **Failover.** What helps against the loss described above: `min-replicas-to-write 1`
///   with a small `min-replicas-max-lag` (a master that lost its replicas refuses writes:
///   503 instead of an unreplicated lock), a TTL longer than a failover takes, and fencing
///   checks at the resource.
#[derive(Clone, Debug)]
pub struct RedisCluster {
    seeds: NodeUrls,
    retry_for: Duration,
    replicas: Option<ReplicaAck>,
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
            seeds: NodeUrls::new(urls, DEFAULT_NODE_TIMEOUT),
            retry_for: DEFAULT_RETRY_FOR,
            replicas: None,
        }
    }

    /// How long one master may take to answer one call (getting a connection included)
    /// before the call counts as failed. Default 500 ms: a 3,000-key batch keeps a master
    /// busy for a few milliseconds; a frozen master costs this much before its requests get
    /// 503. A group bigger than a step goes in several scripts, and gets this much for
    /// each.
    ///
    /// # Panics
    ///
    /// If `timeout` is zero.
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.seeds.set_node_timeout(timeout);
        self
    }

    /// How long a call keeps trying again while the cluster moves under it (a slot
    /// migrating, a failover, `CLUSTERDOWN`), before it fails (503). Default 1 s. An
    /// acquisition may take up to about twice this, plus a few node timeouts, since each
    /// refused attempt is rolled back (bounded by this too) before the next; keep it below
    /// half of [`Locks::store_timeout`](crate::Locks::store_timeout) (2 s by default), which bounds every call anyway.
    pub fn retry_for(mut self, duration: Duration) -> Self {
        self.retry_for = capped(duration);
        self
    }

    /// Makes a batch count as granted only once `replicas` replicas of each master that
    /// granted a group of it have that group: each master's acquisition is followed by
    /// `WAIT replicas timeout` on its connection, as [`Redis::replicas`](super::Redis::replicas)
    /// does on one Redis, which says what it promises and what it does not. A group that
    /// too few replicas acknowledged within `timeout` is released, the batch is rolled back
    /// on every master, and the request gets 503. Keep `timeout` below the
    /// [node timeout](Self::node_timeout), which bounds each master's call, wait included.
    ///
    /// # Panics
    ///
    /// If `replicas` or `timeout` is zero.
    pub fn replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.replicas = Some(ReplicaAck::new(replicas, timeout));
        self
    }

    /// How many keys one script takes at most on each master (1,000 by default): a master's
    /// group of a bigger batch goes in steps, as on one Redis
    /// ([`Redis::step_keys`](super::Redis::step_keys) says what others see meanwhile).
    ///
    /// # Panics
    ///
    /// If `keys` is zero.
    pub fn step_keys(mut self, keys: usize) -> Self {
        self.seeds.set_step(keys);
        self
    }

    /// The store, for [`Locks::new`](crate::Locks::new).
    ///
    /// # Errors
    ///
    /// When there is no URL, or one is not a valid Redis URL. Nothing connects yet.
    pub fn build(self) -> Result<Store, redis::RedisError> {
        let NodeUrls {
            urls,
            node_timeout,
            step,
        } = self.seeds;
        let seeds = urls
            .iter()
            .map(|url| url.as_str().into_connection_info())
            .collect::<Result<Vec<_>, _>>()?;
        let store = ClusterStore::new(seeds, node_timeout, self.retry_for, self.replicas, step)?;
        Ok(Store::of(Arc::new(store)))
    }
}
