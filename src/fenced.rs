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
//! token that wrote it beside it, under its name with `:fence` after it, in its hash slot
//! ([`fence_key`]).
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
//! On a Redis Cluster, [`set`] takes the keys of one hash slot (each fence shares its key's
//! slot), and `set_across_slots` (feature `cluster`) takes keys of any slots, with one call
//! a slot: each slot all or none, and the whole write all or none unless the lease runs
//! out during it (its page says when a write can land on some slots only).

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

/// The key that keeps the last token that wrote `key`: it starts with `key` (so that an
/// ACL pattern that lets a client write `key` lets it write the fence), and lies in the
/// same hash slot of a Redis Cluster: `key:fence` when `key` has a `{hash tag}`,
/// `key:fence{key}` otherwise. (On a cluster, a key with a brace and no tag cannot share
/// its slot with a fence: give it a tag.)
///
/// ```
/// use tower_batch_lock::fenced::fence_key;
///
/// assert_eq!(fence_key("stock:apple"), "stock:apple:fence{stock:apple}");
/// assert_eq!(fence_key("stock:{apple}:qty"), "stock:{apple}:qty:fence");
/// ```
pub fn fence_key(key: &str) -> String {
    if has_hash_tag(key) {
        format!("{key}:fence")
    } else {
        format!("{key}:fence{{{key}}}")
    }
}

/// Whether a part of `key` chooses its hash slot rather than the whole key: something
/// between its first `{` and the first `}` after it (Redis's rule).
fn has_hash_tag(key: &str) -> bool {
    key.split_once('{')
        .and_then(|(_, after)| after.split_once('}'))
        .is_some_and(|(tag, _)| !tag.is_empty())
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

/// What [`set_across_slots`] wrote.
#[cfg(feature = "cluster")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// Every key.
    All,
    /// No key: a larger token had written one of them (the writer's lease ran out).
    Nothing,
    /// The keys of some slots, not of the others: a larger token wrote a key of those
    /// between the check and the write, so the writer's lease ran out during the write.
    /// The slots written hold a stale value; the caller must treat its write as failed and
    /// say so (it cannot be taken back: a later holder may have read it already).
    Partly,
}

/// [`set`] for keys of any hash slots of a Redis Cluster: first one read of every fence
/// (refused, [`Written::Nothing`], when a larger token wrote one of the keys), then one
/// call a slot, all at once, each of which checks its fences again and writes its keys all
/// or none.
///
/// A slot's write cannot wait for the others', so the whole write is all or none only
/// while no later holder writes between the check and the last slot's call, which can
/// only happen when this writer's lease ran out after the check (a pause there): then some
/// slots may be written and the others refused ([`Written::Partly`]). A writer paused
/// before its write, the common case, writes nothing. Data that must change together
/// without that window belongs in one slot (a `{hash tag}`), written with [`set`].
///
/// # Errors
///
/// Redis's, when a call fails; the calls to the other slots may have written theirs.
///
/// ```no_run
/// use axum::http::StatusCode;
/// use tower_batch_lock::{fenced, redis::cluster_async::ClusterConnection, Lease};
///
/// async fn sell(lease: Lease, mut cluster: ClusterConnection) -> StatusCode {
///     let writes = [("stock:apple", "11"), ("stock:pear", "4")];
///     match fenced::set_across_slots(&mut cluster, lease.fencing_token(), &writes).await {
///         Ok(fenced::Written::All) => StatusCode::CREATED,
///         // A later holder wrote first: this request's lease ran out.
///         Ok(fenced::Written::Nothing) => StatusCode::CONFLICT,
///         // The lease ran out during the write, or a slot's master did not answer.
///         Ok(fenced::Written::Partly) | Err(_) => StatusCode::SERVICE_UNAVAILABLE,
///     }
/// }
/// # let _ = sell;
/// ```
#[cfg(feature = "cluster")]
pub async fn set_across_slots<V>(
    cluster: &mut redis::cluster_async::ClusterConnection,
    token: FencingToken,
    writes: &[(&str, V)],
) -> RedisResult<Written>
where
    V: redis::ToRedisArgs + Send + Sync,
{
    use std::collections::HashMap;

    use redis::cluster_routing::Slot;

    let mut slots: HashMap<Slot, Vec<(&str, &V)>> = HashMap::new();
    for (key, value) in writes {
        slots
            .entry(Slot::for_key(key))
            .or_default()
            .push((key, value));
    }
    if slots.len() > 1 {
        // redis-rs splits the read by slot.
        let fences: Vec<Option<u64>> = redis::cmd("MGET")
            .arg(
                writes
                    .iter()
                    .map(|(key, _)| fence_key(key))
                    .collect::<Vec<_>>(),
            )
            .query_async(cluster)
            .await?;
        if fences
            .into_iter()
            .flatten()
            .any(|fence| fence > token.get())
        {
            return Ok(Written::Nothing);
        }
    }
    let calls = slots.values().map(|writes| {
        let mut cluster = cluster.clone();
        async move { set(&mut cluster, token, writes).await }
    });
    let written = futures_util::future::try_join_all(calls).await?;
    Ok(match written.iter().filter(|&&w| w).count() {
        0 => Written::Nothing,
        n if n == written.len() => Written::All,
        _ => Written::Partly,
    })
}
