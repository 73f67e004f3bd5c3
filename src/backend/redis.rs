//! Locks in one Redis, shared by every process that uses it, through a deadpool-redis pool.
//!
//! Data model: one hash per resource, `{prefix}{key}` -> {hold id -> owner token}, with a
//! `PX` ttl (see [`ACQUIRE`] for why a hash); the prefix itself (never a lock key: empty keys are refused) holds the namespace's
//! fencing counter. One script acquires a whole batch, one extends it and one releases it,
//! so a batch of any size costs one round trip each. `redis::Script` sends `EVALSHA` and
//! falls back to loading the script when the server answers `NOSCRIPT` (after a restart or
//! `SCRIPT FLUSH`).
//!
//! Releases are published on [`RELEASED_CHANNEL`]; a process built with a
//! [`redis::Client`] subscribes to it, so that its waiters wake when another process
//! releases their keys.

use std::{
    sync::{Arc, LazyLock, Mutex, OnceLock, PoisonError, Weak},
    time::Duration,
};

use deadpool_redis::Pool;
use futures_util::StreamExt;
use redis::{aio::MultiplexedConnection, FromRedisValue, RedisResult, Script, ScriptInvocation};

use super::{
    wake::{slots_of, Wakeups},
    Acquire, Backend, BackendError, BoxFuture, Contention, Holder,
};
use crate::FencingToken;

/// The pub/sub channel on which releases name the wake-up slots of their keys.
pub(crate) const RELEASED_CHANNEL: &str = "tower-batch-lock:released";

/// A release of more slots than this wakes every waiter instead of naming them.
const MAX_NAMED_SLOTS: usize = 64;

/// KEYS: the fencing counter, then the batch. ARGV: owner token, hold id, ttl in
/// milliseconds, how many conflicts to name. Returns `{granted (1 or 0), fencing token or
/// conflicts, earliest pttl or -1, {named conflicting keys}}`.
///
/// A lock key is a hash of hold id -> owner token: an owner may hold a key several times
/// (nested layers, a handler locking more), and the key goes with its last hold. A key held
/// only by the caller's owner is entered again, and keeps the longer of its ttl and this
/// one; any other value under the name (another owner's hash, or foreign data) conflicts.
///
/// It reads every key before it writes any, so a refused batch writes nothing, and Redis
/// runs a script without interleaving other commands, so nobody sees half a batch. It
/// loops over KEYS instead of `unpack`ing them: `unpack` fails near 8,000 values.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local owner, hold, ttl, report = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local named, conflicts, earliest, fresh = {}, 0, -1, {}
for i = 2, #KEYS do
  local owners = redis.pcall('HVALS', KEYS[i])
  local foreign = owners.err ~= nil
  for _, other in ipairs(foreign and {} or owners) do
    if other ~= owner then foreign = true break end
  end
  if foreign then
    conflicts = conflicts + 1
    if #named < report then named[#named + 1] = KEYS[i] end
    local left = redis.call('PTTL', KEYS[i])
    if left >= 0 and (earliest < 0 or left < earliest) then earliest = left end
  else
    fresh[i] = #owners == 0
  end
end
if conflicts > 0 then return {0, conflicts, earliest, named} end
for i = 2, #KEYS do
  redis.call('HSET', KEYS[i], hold, owner)
  if fresh[i] or redis.call('PTTL', KEYS[i]) < ttl then
    redis.call('PEXPIRE', KEYS[i], ttl)
  end
end
return {1, redis.call('INCR', KEYS[1]), -1, {}}
",
    )
});

/// KEYS: the batch. ARGV: owner token, hold id, ttl in milliseconds. Extends every key to
/// at least the ttl if every key still has the hold, and returns 1; otherwise changes
/// nothing and returns 0: a lease that lost one key has lost the batch.
static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
for i = 1, #KEYS do
  if redis.pcall('HGET', KEYS[i], ARGV[2]) ~= ARGV[1] then return 0 end
end
local ttl = tonumber(ARGV[3])
for i = 1, #KEYS do
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl) end
end
return 1
",
    )
});

/// KEYS: the batch. ARGV: owner token, hold id, channel, wake-up slots. Ends the hold on
/// the keys that still have it (a key goes with its last hold), so a late release never
/// frees a key that expired and went to someone else, nor another hold of the same owner,
/// and announces the release to waiters in other processes.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local released = 0
for i = 1, #KEYS do
  if redis.pcall('HGET', KEYS[i], ARGV[2]) == ARGV[1] then
    redis.call('HDEL', KEYS[i], ARGV[2])
    released = released + 1
  end
end
if released > 0 then redis.call('PUBLISH', ARGV[3], ARGV[4]) end
return released
",
    )
});

/// KEYS: the fencing counter. ARGV: a floor. Raises the counter to the floor if it is
/// lower, never lowers it. Redlock uses it to bring a node's counter up to the token a
/// majority agreed on (see `redlock`), so that the next grant anywhere in that majority
/// counts on from there.
static RAISE_FENCE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
",
    )
});

pub(crate) struct RedisBackend {
    pool: Pool,
    /// One connection, taken from the pool and shared by every call: redis-rs pipelines
    /// concurrent commands over it, where checking a connection out for each call would
    /// cost a round trip of its own (deadpool-redis checks every connection it hands out
    /// with a `PING`). One whose call failed or stalled is not used again.
    shared: Mutex<Shared>,
    wakeups: Arc<Wakeups>,
    /// Where to open the subscription to other processes' releases, if anywhere.
    subscriber: Option<redis::Client>,
    subscribed: OnceLock<()>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("pool", &self.pool.status())
            .field("subscribes", &self.subscriber.is_some())
            .finish()
    }
}

impl RedisBackend {
    /// `subscriber`: the Redis to listen on for other processes' releases; without it,
    /// waiters wake on this process's releases and otherwise poll.
    pub(crate) fn new(pool: Pool, subscriber: Option<redis::Client>) -> Self {
        let backend = Self {
            pool,
            shared: Mutex::default(),
            wakeups: Arc::new(Wakeups::new()),
            subscriber,
            subscribed: OnceLock::new(),
        };
        // Built inside a runtime (the usual case), subscribe now, so that the first waiter
        // already hears of releases; otherwise on first use.
        if tokio::runtime::Handle::try_current().is_ok() {
            backend.listen_for_releases();
        }
        backend
    }

    /// Starts relaying other processes' releases to this process's waiters, once.
    fn listen_for_releases(&self) {
        if let Some(client) = &self.subscriber {
            self.subscribed.get_or_init(|| {
                let (client, wakeups) = (client.clone(), Arc::downgrade(&self.wakeups));
                tokio::spawn(listen_for_releases(client, wakeups));
            });
        }
    }

    /// Runs a script on the shared connection. A connection that broke since its last use
    /// (the server restarted, say) fails the first command sent on it: then the script runs
    /// once more on a new one. Every script here is idempotent for its hold (acquiring
    /// again rewrites the same field; at worst it takes one more fencing number), so
    /// running one twice is harmless.
    async fn invoke<T: FromRedisValue>(
        &self,
        script: &ScriptInvocation<'_>,
    ) -> Result<T, BackendError> {
        let mut call = self.call().await?;
        let result = script.invoke_async(&mut call.connection).await;
        match result {
            Err(error) if call.reused && broken(&error) => {
                drop(call);
                let mut call = self.call().await?;
                let result = script.invoke_async(&mut call.connection).await;
                call.end(result)
            }
            result => call.end(result),
        }
    }

    /// The shared connection for one call, taken from the pool if there is none.
    async fn call(&self) -> Result<Call<'_>, BackendError> {
        let cached = self.shared().connection.clone();
        let reused = cached.is_some();
        let (connection, generation) = match cached {
            Some(cached) => cached,
            None => {
                let pooled = self.pool.get().await.map_err(BackendError::not_sent)?;
                let mut connection = deadpool_redis::Connection::take(pooled);
                // Every call is bounded by the caller (the layer's backend timeout,
                // Redlock's per-master timeout), and a call cut short retires the
                // connection. Its own limit (500 ms in redis-rs by default) would refuse a
                // big batch that the backend timeout allows.
                connection.set_response_timeout(Duration::from_secs(3600));
                let mut shared = self.shared();
                shared.generation += 1;
                shared.connection = Some((connection.clone(), shared.generation));
                (connection, shared.generation)
            }
        };
        Ok(Call {
            connection,
            generation,
            reused,
            backend: self,
            ended: false,
        })
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        // Every change is one assignment: a poisoned state is still whole.
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops sharing the connection of `generation`, if it is still the shared one.
    fn forget(&self, generation: u64) {
        let mut shared = self.shared();
        if shared
            .connection
            .as_ref()
            .is_some_and(|(_, g)| *g == generation)
        {
            shared.connection = None;
        }
    }

    /// Raises the fencing counter of `namespace` to at least `floor`.
    pub(crate) async fn raise_fence(
        &self,
        namespace: &str,
        floor: u64,
    ) -> Result<(), BackendError> {
        let mut script = RAISE_FENCE.prepare_invoke();
        script.key(namespace).arg(floor);
        self.invoke::<i64>(&script).await?;
        Ok(())
    }
}

/// The acquire script's reply.
type AcquireReply = (i64, i64, i64, Vec<String>);

impl Backend for RedisBackend {
    fn acquire<'a>(
        &'a self,
        namespace: &'a str,
        keys: &'a [String],
        holder: Holder,
        ttl: Duration,
        report: usize,
    ) -> BoxFuture<'a, Result<Acquire, BackendError>> {
        Box::pin(async move {
            let mut script = ACQUIRE.prepare_invoke();
            script.key(namespace).key(keys);
            script
                .arg(holder.owner.as_hex())
                .arg(holder.hold_hex())
                .arg(millis(ttl))
                .arg(report);
            let (granted, count, earliest, named): AcquireReply = self.invoke(&script).await?;
            if granted == 1 {
                let fence = u64::try_from(count).map_err(|_| {
                    BackendError::unknown(format!("the fencing counter {namespace:?} is negative"))
                })?;
                return Ok(Acquire::Granted(FencingToken::new(fence)));
            }
            Ok(Acquire::Held(Contention {
                keys: named,
                total: usize::try_from(count).unwrap_or(1),
                // -1: no conflicting key had a ttl the script could read.
                earliest_expiry: u64::try_from(earliest).ok().map(Duration::from_millis),
            }))
        })
    }

    fn extend<'a>(
        &'a self,
        keys: &'a [String],
        holder: Holder,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, BackendError>> {
        Box::pin(async move {
            let mut script = EXTEND.prepare_invoke();
            script
                .key(keys)
                .arg(holder.owner.as_hex())
                .arg(holder.hold_hex())
                .arg(millis(ttl));
            Ok(self.invoke::<i64>(&script).await? == 1)
        })
    }

    fn release<'a>(
        &'a self,
        keys: &'a [String],
        holder: Holder,
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let slots = slots_of(keys);
            let mut script = RELEASE.prepare_invoke();
            script
                .key(keys)
                .arg(holder.owner.as_hex())
                .arg(holder.hold_hex());
            script.arg(RELEASED_CHANNEL).arg(slot_list(&slots));
            let released = self.invoke(&script).await?;
            // This process's waiters need not wait for the message to come back.
            self.wakeups.wake_slots(slots);
            Ok(released)
        })
    }

    fn wakeups(&self) -> &Wakeups {
        self.listen_for_releases();
        &self.wakeups
    }
}

/// The shared connection, and which one it is: connections are replaced, and a late failure
/// of an old one must not throw away its successor.
#[derive(Default)]
struct Shared {
    connection: Option<(MultiplexedConnection, u64)>,
    generation: u64,
}

/// One call on the shared connection. If the call fails with the connection (not with an
/// answer from Redis), or is dropped before it ends (a timeout around it gave up), the
/// connection may be broken or stalled, and the next call takes a new one from the pool.
struct Call<'a> {
    connection: MultiplexedConnection,
    generation: u64,
    /// Whether the connection served calls before this one.
    reused: bool,
    backend: &'a RedisBackend,
    ended: bool,
}

impl Call<'_> {
    fn end<T>(mut self, result: RedisResult<T>) -> Result<T, BackendError> {
        self.ended = match &result {
            Ok(_) => true,
            Err(error) => !(broken(error) || error.is_timeout()),
        };
        result.map_err(BackendError::unknown)
    }
}

/// An error of the connection rather than an answer from Redis.
fn broken(error: &redis::RedisError) -> bool {
    error.is_unrecoverable_error() || error.is_connection_dropped() || error.is_io_error()
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.backend.forget(self.generation);
        }
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The slots as the release message carries them: `3,17,512`, or `*` for all.
fn slot_list(slots: &[usize]) -> String {
    if slots.len() > MAX_NAMED_SLOTS {
        return "*".to_owned();
    }
    slots
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Wakes this process's waiters for every release announced on [`RELEASED_CHANNEL`], until
/// the store is dropped. Reconnects after a lost connection, and then wakes every waiter:
/// releases in the gap went unheard.
async fn listen_for_releases(client: redis::Client, wakeups: Weak<Wakeups>) {
    let mut pause = Duration::from_millis(100);
    while wakeups.strong_count() > 0 {
        match subscribe(&client).await {
            Ok(pubsub) => {
                pause = Duration::from_millis(100);
                if let Some(wakeups) = wakeups.upgrade() {
                    wakeups.wake_all();
                }
                let mut messages = pubsub.into_on_message();
                loop {
                    // Wake up now and then to notice that the store is gone.
                    match tokio::time::timeout(Duration::from_secs(1), messages.next()).await {
                        Ok(Some(message)) => {
                            let Some(wakeups) = wakeups.upgrade() else {
                                return;
                            };
                            wake_from_message(&wakeups, message.get_payload_bytes());
                        }
                        Ok(None) => break,
                        Err(_) if wakeups.strong_count() == 0 => return,
                        Err(_) => {}
                    }
                }
                tracing::warn!("lost the subscription to lock releases; reconnecting");
            }
            Err(error) => {
                tracing::warn!(%error, "could not subscribe to lock releases; waiters poll")
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

async fn subscribe(client: &redis::Client) -> redis::RedisResult<redis::aio::PubSub> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(RELEASED_CHANNEL).await?;
    Ok(pubsub)
}

fn wake_from_message(wakeups: &Wakeups, payload: &[u8]) {
    if payload == b"*" {
        return wakeups.wake_all();
    }
    let slots = std::str::from_utf8(payload).unwrap_or_default().split(',');
    wakeups.wake_slots(slots.filter_map(|s| s.parse().ok()));
}
