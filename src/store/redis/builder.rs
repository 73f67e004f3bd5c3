//! [`Redis`]: the public builder of the store on one Redis.

use std::{fmt, sync::Arc, time::Duration};

use deadpool_redis::Pool;

use super::{replicas::ReplicaAck, RedisStore, DEFAULT_STEP};
use crate::store::handle::Store;

/// Locks in one Redis, shared by every process that uses it with the same
/// [prefix](crate::Locks::prefix): built from a URL (a pool of its own) or from your
/// deadpool-redis pool.
///
/// ```
/// use tower_batch_lock::{deadpool_redis, store::Redis, Locks};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let url = "redis://127.0.0.1/";
/// // A pool of its own, and waiting requests woken by every process's releases.
/// let locks = Locks::new(Redis::url(url).build()?);
///
/// // Or your pool; `wakeups` subscribes at the same Redis for other processes' releases.
/// let pool = deadpool_redis::Config::from_url(url)
///     .create_pool(Some(deadpool_redis::Runtime::Tokio1))?;
/// let shared = Locks::new(Redis::pool(pool).wakeups(url).build()?);
/// # drop((locks, shared));
/// # Ok(())
/// # }
/// ```
///
/// Nothing connects until the first request (or [`Locks::check`](crate::Locks::check)).
///
/// # Data model
///
/// One string per resource, `lock:{key}`: the owner (a random 128-bit token, one per
/// request) and its holds (one random 64-bit id per acquisition, so that re-entry and a
/// release sent twice stay exact), then the reservations of waiters in line (ticket and
/// expiry), with a `PX` expiry: `<owner>:<hold>[:<hold>...]|<ticket>/<until>...`. A key
/// held [shared](crate::Mode::Shared) lists its holds each with its own end (Redis time in
/// ms, 13 digits, so that every entry is 64 bytes), so that a reader that dies takes only
/// its own hold with it: `*<owner>:<hold>/<until>[*<owner>:<hold>/<until>...]|...`, the
/// key's own expiry at least its longest hold's; in an exclusive value, a hold its owner
/// took shared follows a `;`. The prefix itself, `lock:`, holds the namespace's fencing
/// counter (it is never a lock: empty keys are refused). A waiter in line with a batch of
/// 64 keys or more keeps its place apart from its keys, which stay as they are: its
/// *claim*, a set of its keys under `tower-batch-lock:claims:<ticket>`, and its ticket in
/// the sorted set `tower-batch-lock:claims`, scored by the claim's end (both live until
/// the waiter's deadline; one registry for every namespace on the server, which
/// [`Locks::prefix`](crate::Locks::prefix) keeps out of every namespace's reach). The Lua scripts, one file each
/// under `src/store/redis/scripts/`, are the functions of one library, which the store
/// loads (`FUNCTION LOAD`) where a call finds it missing (the first call, after a restart
/// without persistence or a `FUNCTION FLUSH`) and calls with `FCALL`. The library is
/// named after a hash of its source, `tower_batch_lock_<12 hex digits>`, so that two
/// versions of the crate each run their own during a rolling upgrade; each version leaves
/// its library (about 30 KB, replicated and persisted like any function) until
/// `FUNCTION DELETE` removes it, which is safe once no process of that version runs:
///
/// - *acquire* takes each free key with one `SET key value PX ttl NX GET`; `GET` shows what
///   was there instead. A key the caller's owner holds is entered again, and a shared key
///   gains the caller's shared hold beside the others (parsed only then); any conflict undoes
///   the keys taken so far before the script ends, so nobody ever sees part of a batch. A
///   waiter in line then reserves the whole batch, or claims it. A key that a claim with an
///   earlier ticket names keeps the caller out, unless its owner holds the key. A grant counts in the namespace's
///   counter, floored by Redis's clock (`TIME`), so that it never goes back after a
///   restart without persistence or a failover ([`FencingToken`](crate::FencingToken)
///   says under which assumptions).
/// - *extend* checks every key for the caller's hold, then `PEXPIRE ... GT`: all or
///   nothing, never shortening a key.
/// - *release* ends only the caller's hold, keeps a key with other holds or reservations,
///   and publishes the release on the channel `tower-batch-lock:released`, which every
///   process built with a subscription ([`Redis::url`], [`Redis::wakeups`]) listens to.
/// - *withdraw* takes a waiter's reservations off its batch (its keys out of its claim), and
///   publishes too.
///
/// Anything else under a lock key (another program's value, another type, a lock of the
/// previous version of this crate) counts as held by someone else and is never changed.
/// Processes of 0.1 (a hash per lock key) and of this version can share a Redis during a
/// rolling upgrade: each counts the other's keys as held, so no batch is granted over a
/// lock of the other version. The same holds for the string format before shared holds:
/// its values are this version's exclusive ones, and a shared value starts with `*`, which
/// the earlier scripts take for foreign (they neither acquire nor release it).
///
/// # Running it
///
/// - **Version.** Redis 7.0 or later, or a compatible server such as Valkey: the scripts
///   use `SET ... NX GET` and `PEXPIRE ... GT`. [`Locks::check`](crate::Locks::check) says
///   so at start-up. For a Redis Cluster, use `store::RedisCluster` (feature `cluster`):
///   this store needs every key of a batch on one node.
/// - **Eviction.** Use `maxmemory-policy noeviction` (the default) on the Redis that holds
///   the locks: under `allkeys-*` or `volatile-*` policies Redis may evict a held lock.
/// - **ACL.** The user needs `+fcall +function|load +set +get +mget +del +exists +pttl
///   +pexpire +pexpireat +time +publish +subscribe +info +zrange +zadd +zrem
///   +zremrangebyscore +sadd +srem +smismember +sintercard` (and `+wait +ping` with
///   [`replicas`](Redis::replicas)) on `~lock:*` (or your prefix; and `~idempotency:*` for
///   the idempotency layer) and `~tower-batch-lock:claims*` (waiters' claims), and
///   `&tower-batch-lock:released`.
/// - **TLS and auth** go in the URL: `rediss://user:password@host:6380/`. TLS needs one
///   of the `redis` crate's TLS features, which this crate leaves off: add
///   `redis = { version = "1", features = ["tokio-rustls-comp"] }` (or
///   `tokio-native-tls-comp`) to your `Cargo.toml`, and Cargo turns it on for the
///   store's connections too. Without it, [`build`](Redis::build) fails on a `rediss://`
///   URL ("can't connect with TLS, the feature is not enabled").
/// - **Failover.** A lock lives on one Redis: if it restarts without persistence, or fails
///   over to a replica that had not received the key, the lock is lost, and another
///   request can be granted its keys while the first still runs (the first learns of it at
///   its next renewal, [`Lease::lost`](crate::Lease::lost)). [`replicas`](Redis::replicas)
///   narrows that window (below); where it must not happen at all, use
///   [`Redlock`](crate::store::Redlock), and check [fencing tokens](crate::FencingToken) at the
///   resource.
///
/// # Replicas
///
/// A Redis with replicas replicates each grant after answering it: a master that fails
/// before a grant reached a replica, replaced by that replica, has lost the lock, and
/// another request can be granted the same keys while the first still runs.
/// [`replicas`](Redis::replicas) narrows that window: a grant counts only once enough
/// replicas have it.
#[derive(Clone)]
pub struct Redis {
    source: Source,
    /// Where to subscribe to other processes' releases.
    wakeups: Option<String>,
    /// How many replicas must have a grant before it counts.
    replicas: Option<ReplicaAck>,
    /// How many keys one script takes at most.
    step: usize,
}

#[derive(Clone)]
enum Source {
    Url(String),
    Pool(Pool),
}

impl fmt::Debug for Redis {
    // By hand: URLs may carry passwords.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match self.source {
            Source::Url(_) => "url",
            Source::Pool(_) => "pool",
        };
        f.debug_struct("Redis")
            .field("source", &source)
            .field("wakeups", &self.wakeups.is_some())
            .field("replicas", &self.replicas)
            .field("step", &self.step)
            .finish()
    }
}

impl Redis {
    /// The Redis at `url` (`redis://host:port/db`, or `rediss://` for TLS with a TLS
    /// feature of `redis`, above; credentials go in the URL), with a pool of its own, and a subscription at the same URL that wakes
    /// waiting requests when any process releases their keys.
    pub fn url(url: impl Into<String>) -> Self {
        let url = url.into();
        Self {
            wakeups: Some(url.clone()),
            source: Source::Url(url),
            replicas: None,
            step: DEFAULT_STEP,
        }
    }

    /// The Redis behind `pool`. The locks take one connection out of it for good and share
    /// it (redis-rs pipelines concurrent commands over one connection, and a checkout from
    /// a deadpool-redis pool costs a `PING` round trip); after a connection error they take
    /// another. Without [`wakeups`](Self::wakeups), waiting requests wake at once for this
    /// process's releases and poll for other processes': a waiter in line (fair waiting,
    /// the default) after 100-200 ms, then less and less often, down to every 1-2 s; one
    /// in no line every 5 to 100 ms.
    pub fn pool(pool: Pool) -> Self {
        Self {
            source: Source::Pool(pool),
            wakeups: None,
            replicas: None,
            step: DEFAULT_STEP,
        }
    }

    /// Subscribes at `url` (the same Redis) to every process's releases, to wake waiting
    /// requests at once.
    pub fn wakeups(mut self, url: impl Into<String>) -> Self {
        self.wakeups = Some(url.into());
        self
    }

    /// Makes a grant count only once `replicas` replicas of this Redis have it: after the
    /// acquire script granted a batch, the store sends `WAIT replicas timeout` on the
    /// connection that ran it. A grant that fewer replicas acknowledged within `timeout` is
    /// released at once, and the request gets 503 (as when the store cannot be reached):
    /// its lock could not be made to outlive the master.
    ///
    /// What it promises: a handler runs only under a grant that was in the memory of at
    /// least `replicas` replicas, so that a failover to one of them keeps the lock (and
    /// the fencing counter, counted in the same script). What it does not:
    ///
    /// - `WAIT` does not make Redis strongly consistent. A failover may still promote a
    ///   replica that did not acknowledge the grant (one of more replicas than `replicas`,
    ///   or one that lagged when the failover was decided; Sentinel and the cluster prefer
    ///   the most up-to-date replica, they do not guarantee it), and a replica acknowledges
    ///   what it received, not what it wrote to disk: one that restarts without
    ///   persistence loses it.
    /// - Only grants wait. A renewal ([`Locks::renew_lease`](crate::Locks::renew_lease)),
    ///   a release and a waiter's reservation are not acknowledged: a failover just after
    ///   a renewal can bring the lock back to its earlier expiry, and one after a release
    ///   can bring a released lock back until its TTL.
    /// - It refuses grants while fewer than `replicas` replicas answer: a replica down
    ///   costs every acquisition `timeout` and a 503, and
    ///   [`Locks::check`](crate::Locks::check) fails while fewer are connected. Keep
    ///   `timeout` far below [`Locks::store_timeout`](crate::Locks::store_timeout) (2 s by
    ///   default), which bounds the whole acquisition.
    ///
    /// The cost: each grant takes a connection of its own from the pool (a `PING` round
    /// trip; `WAIT` blocks its connection, and on the shared one it would hold up every
    /// other call) and one more round trip, in which the master waits for its replicas:
    /// on one local master and replica, an acquire + release cycle through the layer took
    /// 1.7 times as long for one key (+200 µs) and 1.15 times for 1,000 keys
    /// (`cargo bench --bench replicas`). Redis's own `min-replicas-to-write` refuses writes
    /// on a master that lost its replicas, which complements this.
    ///
    /// # Panics
    ///
    /// If `replicas` or `timeout` is zero.
    pub fn replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.replicas = Some(ReplicaAck::new(replicas, timeout));
        self
    }

    /// How many keys one script takes at most (1,000 by default): a bigger batch is
    /// acquired, extended and released in steps of this many keys, so that no single
    /// script keeps Redis from its other clients for long, whatever the batch.
    ///
    /// An exclusive batch of 64 keys or more first takes its free keys with plain
    /// `SET key value PX ttl NX` commands, pipelined, which cost Redis less than the same
    /// command called from a script, and which Redis interleaves with its other clients'
    /// commands; the steps then take the keys that were not free (held, reserved by
    /// waiters, re-entered), which the script must read. With
    /// [`replicas`](Self::replicas) every key goes through the script; so do a store's big
    /// batches for a second after it refused a batch, because a refused plain pass keeps
    /// others from the keys it took until it gives them back, which starves orders that
    /// keep meeting each other, where the script refuses without showing anyone anything
    /// (and, for a big batch, without writing anything: it reads the keys first). A
    /// waiter's retry whose place in line is a claim goes with the plain pass all the same:
    /// its claim keeps later arrivals out of its free keys already.
    /// Each master of a `RedisCluster` and of a `Redlock` does the same with its part of a
    /// batch.
    ///
    /// Each step of an acquisition (and the plain pass, as a first step) holds its keys
    /// while the next is tried, and only the last step grants: a step that is refused
    /// releases the keys taken before it (a waiter in line keeps its reservation on the
    /// whole batch). What other clients see meanwhile: the keys taken so far, held, as they
    /// would see them a moment later once the batch is granted; a batch that is refused
    /// at a later step held its first keys for those round trips. At about 2 µs of Redis's
    /// time a key for an acquisition in a script, a step of 1,000 keys keeps Redis for
    /// about 2 ms; a batch of 100,000 keys that a script must read takes 100 steps, and
    /// 100 round trips, instead of one call of about 400 ms.
    ///
    /// # Panics
    ///
    /// If `keys` is zero.
    pub fn step_keys(mut self, keys: usize) -> Self {
        assert!(keys > 0, "a step must take at least one key");
        self.step = keys;
        self
    }

    /// The store. The subscription opens at once when this is called inside a Tokio
    /// runtime, and otherwise when the first request waits.
    ///
    /// # Errors
    ///
    /// When a URL is not a valid Redis URL. Nothing connects yet.
    pub fn build(self) -> Result<Store, redis::RedisError> {
        let pool = match self.source {
            Source::Pool(pool) => pool,
            Source::Url(url) => deadpool_redis::Config::from_url(url)
                .create_pool(Some(deadpool_redis::Runtime::Tokio1))
                .map_err(|e| {
                    redis::RedisError::from((
                        redis::ErrorKind::InvalidClientConfig,
                        "could not create a Redis pool",
                        e.to_string(),
                    ))
                })?,
        };
        let subscriber = self
            .wakeups
            .map(|url| redis::Client::open(url.as_str()))
            .transpose()?;
        let store = RedisStore::new(pool, subscriber)
            .with_replicas(self.replicas)
            .with_step(self.step);
        Ok(Store::of(Arc::new(store)))
    }
}
