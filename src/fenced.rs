//! Writes to your own data in Redis that a holder past its lease cannot make.
//!
//! A lease can run out while its holder still works: a pause (garbage collection, a
//! stopped VM, a slow disk) longer than the TTL, and the next holder is granted the keys
//! and writes. When the first one resumes, its write would overwrite the second's: a lost
//! update that no lock can prevent alone. Its [fencing token](crate::FencingToken) can:
//! every grant on a key gets a larger token than every grant on it before, so the data
//! refuses a write whose token is smaller than the last one that wrote it.
//!
//! [`set`] is that write for data kept in Redis (any Redis: the one of the locks, or
//! another): it sets the values with the token of the request's lease, all or none, and
//! refuses them when a larger token has written any of the keys. Each key keeps the last
//! token that wrote it beside it, under the key with `:fence` after it.
//!
//! Which tokens compare: those of grants that share a lock key. Guard a piece of data with
//! the lock key that every writer of it takes (`sku:{sku}` for `stock:{sku}`), and write
//! it only under that lock.
//!
//! ```no_run
//! use axum::http::StatusCode;
//! use tower_batch_lock::{deadpool_redis::Pool, fenced, Lease};
//!
//! async fn restock(lease: Lease, pool: Pool) -> Result<&'static str, StatusCode> {
//!     let mut redis = pool.get().await.map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
//!     // ... read, think, maybe pause for longer than the lease ...
//!     let writes = [("stock:apple", "12".to_owned())];
//!     match fenced::set(&mut redis, lease.fencing_token(), &writes).await {
//!         Ok(true) => Ok("restocked"),
//!         // A later holder of `sku:apple` wrote it: this request's lease ran out.
//!         Ok(false) => Err(StatusCode::CONFLICT),
//!         Err(_) => Err(StatusCode::SERVICE_UNAVAILABLE),
//!     }
//! }
//! # let _ = restock;
//! ```
//!
//! On a Redis Cluster, the keys of one call must share a hash slot (with their fences:
//! give the data keys a `{hash tag}`); write other slots' keys in calls of their own.

use std::sync::LazyLock;

use redis::{aio::ConnectionLike, RedisResult, Script};

use crate::FencingToken;

/// KEYS: the data keys, then their fences, in the same order. ARGV: the writer's token in
/// decimal, then the values. (Tokens stay below 2^53, exact in Lua's numbers.) One `MGET`
/// reads the fences and one `MSET` writes, a thousand keys a command: a command a key
/// from Lua cost eight times an `MSET` at 2,000 keys.
static FENCED_SET: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local n = #ARGV - 1
local token = tonumber(ARGV[1])
local STEP = 1000
for first = 1, n, STEP do
  local last = math.min(first + STEP - 1, n)
  local fences = redis.call('MGET', unpack(KEYS, n + first, n + last))
  for i = 1, last - first + 1 do
    local fence = tonumber(fences[i])
    if fence and fence > token then
      return 0
    end
  end
end
for first = 1, n, STEP do
  local last = math.min(first + STEP - 1, n)
  local args = {}
  for i = first, last do
    args[#args + 1] = KEYS[i]
    args[#args + 1] = ARGV[i + 1]
    args[#args + 1] = KEYS[n + i]
    args[#args + 1] = ARGV[1]
  end
  redis.call('MSET', unpack(args))
end
return 1
",
    )
});

/// The key that keeps the last token that wrote `key`.
pub fn fence_key(key: &str) -> String {
    format!("{key}:fence")
}

/// Sets each `(key, value)` of `writes` under `token`, all or none: `true` when written,
/// `false` when a larger token has written one of the keys (the writer's lease ran out,
/// and a later holder wrote), and nothing was written. A token equal to the last one
/// writes: the same grant may write again.
///
/// # Errors
///
/// Redis's, when the script cannot run.
pub async fn set<C, V>(
    connection: &mut C,
    token: FencingToken,
    writes: &[(&str, V)],
) -> RedisResult<bool>
where
    C: ConnectionLike + Send,
    V: redis::ToRedisArgs + Send + Sync,
{
    let mut invocation = FENCED_SET.prepare_invoke();
    for (key, _) in writes {
        invocation.key(*key);
    }
    for (key, _) in writes {
        invocation.key(fence_key(key));
    }
    invocation.arg(token.get().to_string());
    for (_, value) in writes {
        invocation.arg(value);
    }
    invocation.invoke_async(connection).await
}
