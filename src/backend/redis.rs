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
    sync::{Arc, LazyLock, OnceLock, Weak},
    time::Duration,
};

use deadpool_redis::Pool;
use futures_util::StreamExt;
use redis::Script;

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

    async fn connection(&self) -> Result<deadpool_redis::Connection, BackendError> {
        self.pool.get().await.map_err(BackendError::not_sent)
    }

    /// Raises the fencing counter of `namespace` to at least `floor`.
    pub(crate) async fn raise_fence(
        &self,
        namespace: &str,
        floor: u64,
    ) -> Result<(), BackendError> {
        let mut conn = self.connection().await?;
        let _: i64 = RAISE_FENCE
            .key(namespace)
            .arg(floor)
            .invoke_async(&mut conn)
            .await
            .map_err(BackendError::unknown)?;
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
            let mut conn = self.connection().await?;
            let (granted, count, earliest, named): AcquireReply = ACQUIRE
                .key(namespace)
                .key(keys)
                .arg(holder.owner.as_hex())
                .arg(holder.hold_hex())
                .arg(millis(ttl))
                .arg(report)
                .invoke_async(&mut conn)
                .await
                .map_err(BackendError::unknown)?;
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
            let mut conn = self.connection().await?;
            let extended: i64 = EXTEND
                .key(keys)
                .arg(holder.owner.as_hex())
                .arg(holder.hold_hex())
                .arg(millis(ttl))
                .invoke_async(&mut conn)
                .await
                .map_err(BackendError::unknown)?;
            Ok(extended == 1)
        })
    }

    fn release<'a>(
        &'a self,
        keys: &'a [String],
        holder: Holder,
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let mut conn = self.connection().await?;
            let slots = slots_of(keys);
            let released = RELEASE
                .key(keys)
                .arg(holder.owner.as_hex())
                .arg(holder.hold_hex())
                .arg(RELEASED_CHANNEL)
                .arg(slot_list(&slots))
                .invoke_async(&mut conn)
                .await
                .map_err(BackendError::unknown)?;
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
