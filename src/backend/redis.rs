//! Locks in one Redis, shared by every process that uses it, through a deadpool-redis pool.
//!
//! Data model: one string key per resource, `{prefix}{key}` -> owner token, with a `PX`
//! ttl. One script acquires a whole batch and one releases it, so a batch of any size costs
//! one round trip each way. `redis::Script` sends `EVALSHA` and falls back to loading the
//! script when the server answers `NOSCRIPT` (after a restart or `SCRIPT FLUSH`).

use std::{sync::LazyLock, time::Duration};

use deadpool_redis::Pool;
use redis::Script;

use super::{Acquire, Backend, BackendError, BoxFuture, Contention, OwnerToken};

/// KEYS: the batch. ARGV: owner token, ttl in milliseconds, how many conflicts to name.
/// Returns `{granted (1 or 0), conflicts, earliest pttl or -1, {named conflicting keys}}`.
///
/// It reads every key before it writes any, so a refused batch writes nothing, and Redis
/// runs a script without interleaving other commands, so nobody sees half a batch. It
/// loops over KEYS instead of `unpack`ing them: `unpack` fails near 8,000 values.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local owner, ttl, report = ARGV[1], ARGV[2], tonumber(ARGV[3])
local named, conflicts, earliest = {}, 0, -1
for i = 1, #KEYS do
  local holder = redis.call('GET', KEYS[i])
  if holder and holder ~= owner then
    conflicts = conflicts + 1
    if #named < report then named[#named + 1] = KEYS[i] end
    local left = redis.call('PTTL', KEYS[i])
    if left >= 0 and (earliest < 0 or left < earliest) then earliest = left end
  end
end
if conflicts > 0 then return {0, conflicts, earliest, named} end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], owner, 'PX', ttl)
end
return {1, 0, -1, {}}
",
    )
});

/// KEYS: the batch. ARGV: owner token. Deletes only the keys that still hold the token, so
/// a late release never frees a key that expired and went to someone else.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local released = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
    released = released + 1
  end
end
return released
",
    )
});

pub(crate) struct RedisBackend {
    pool: Pool,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("pool", &self.pool.status())
            .finish()
    }
}

impl RedisBackend {
    pub(crate) fn new(pool: Pool) -> Self {
        Self { pool }
    }

    async fn connection(&self) -> Result<deadpool_redis::Connection, BackendError> {
        self.pool.get().await.map_err(BackendError::not_sent)
    }
}

/// The acquire script's reply.
type AcquireReply = (i64, i64, i64, Vec<String>);

impl Backend for RedisBackend {
    fn acquire<'a>(
        &'a self,
        keys: &'a [String],
        owner: OwnerToken,
        ttl: Duration,
        report: usize,
    ) -> BoxFuture<'a, Result<Acquire, BackendError>> {
        Box::pin(async move {
            let mut conn = self.connection().await?;
            let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
            let (granted, conflicts, earliest, named): AcquireReply = ACQUIRE
                .key(keys)
                .arg(owner.as_hex())
                .arg(ttl_ms)
                .arg(report)
                .invoke_async(&mut conn)
                .await
                .map_err(BackendError::unknown)?;
            if granted == 1 {
                return Ok(Acquire::Granted);
            }
            Ok(Acquire::Held(Contention {
                keys: named,
                total: usize::try_from(conflicts).unwrap_or(1),
                // -1: no conflicting key had a ttl the script could read.
                earliest_expiry: u64::try_from(earliest).ok().map(Duration::from_millis),
            }))
        })
    }

    fn release<'a>(
        &'a self,
        keys: &'a [String],
        owner: OwnerToken,
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let mut conn = self.connection().await?;
            RELEASE
                .key(keys)
                .arg(owner.as_hex())
                .invoke_async(&mut conn)
                .await
                .map_err(BackendError::unknown)
        })
    }
}
