//! Locks in one Redis, shared by every process that uses it, through a deadpool-redis pool.
//!
//! Data model: one string per resource, `{prefix}{key}` -> the owner token and its hold
//! ids, then the reservations of waiters in line, with a `PX` ttl (`scripts/value.lua`
//! describes it); the prefix itself (never a lock key: empty keys are refused) holds the
//! namespace's fencing counter. One script acquires a whole batch, one extends it, one
//! releases it and one withdraws a waiter's reservations, so a batch of any size costs one
//! round trip each. The scripts live in `scripts/`, one file each. `redis::Script` sends
//! `EVALSHA` and falls back to loading the script when the server answers `NOSCRIPT`
//! (after a restart or `SCRIPT FLUSH`).
//!
//! Needs Redis 7.0 or later (or a compatible server such as Valkey): the scripts use
//! `SET ... NX GET` and `PEXPIRE ... GT`.
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
    Acquire, Backend, BackendError, BoxFuture, Contention, Holder, KeyView, Line, Ticket,
};
use crate::{FencingToken, KeyStatus, Wait};

/// The pub/sub channel on which releases name the wake-up slots of their keys.
pub(crate) const RELEASED_CHANNEL: &str = "tower-batch-lock:released";

/// A release of more slots than this wakes every waiter instead of naming them.
const MAX_NAMED_SLOTS: usize = 64;

/// The scripts that read or write lock values, each its prelude (`single.lua` or
/// `cluster.lua`: where the keys come from, and what a node may do with them), the value
/// format's functions (`value.lua`), then its own body.
pub(crate) struct Scripts {
    /// Locks a batch, all or nothing, or reserves it for a waiter in line.
    acquire: Script,
    /// Extends a batch if every key still has the hold.
    extend: Script,
    /// Ends a hold on the keys that still have it, and announces the release.
    release: Script,
    /// Takes a waiter's reservations off its keys, and announces it.
    withdraw: Script,
    /// Reads what an operator may see of keys: state, ttl, holds, waiters; never owners.
    inspect: Script,
    /// Ends every hold on keys, whoever has it, and announces it.
    force_release: Script,
    /// Puts a waiter's reservation on keys (the cluster store's refused batches).
    #[cfg(feature = "cluster")]
    reserve: Script,
    /// Whether the keys go as arguments (a group of a batch on a cluster node) rather than
    /// as declared keys.
    keys_as_args: bool,
}

impl Scripts {
    fn with_prelude(prelude: &str, keys_as_args: bool) -> Self {
        let script =
            |body: &str| Script::new(&[prelude, include_str!("scripts/value.lua"), body].concat());
        Self {
            acquire: script(include_str!("scripts/acquire.lua")),
            extend: script(include_str!("scripts/extend.lua")),
            release: script(include_str!("scripts/release.lua")),
            withdraw: script(include_str!("scripts/withdraw.lua")),
            inspect: script(include_str!("scripts/inspect.lua")),
            force_release: script(include_str!("scripts/force_release.lua")),
            #[cfg(feature = "cluster")]
            reserve: script(include_str!("scripts/reserve.lua")),
            keys_as_args,
        }
    }

    /// An invocation of `script` (one of these) on `keys`.
    fn prepare<'a>(&self, script: &'a Script, keys: &[String]) -> ScriptInvocation<'a> {
        let mut invocation = script.prepare_invoke();
        if self.keys_as_args {
            invocation.arg(keys.len()).arg(keys);
        } else {
            invocation.key(keys);
        }
        invocation
    }
}

/// The scripts on one Redis, and on each Redlock master.
pub(crate) static SINGLE: LazyLock<Scripts> =
    LazyLock::new(|| Scripts::with_prelude(include_str!("scripts/single.lua"), false));

/// The scripts on a Redis Cluster node, for the keys of a batch that the node serves.
#[cfg(feature = "cluster")]
pub(crate) static CLUSTER: LazyLock<Scripts> =
    LazyLock::new(|| Scripts::with_prelude(include_str!("scripts/cluster.lua"), true));

/// Raises a namespace's fencing counter to a floor (for Redlock).
static RAISE_FENCE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/raise_fence.lua")));

pub(crate) struct RedisBackend {
    pool: Pool,
    /// One connection, taken from the pool and shared by every call: redis-rs pipelines
    /// concurrent commands over it, where checking a connection out for each call would
    /// cost a round trip of its own (deadpool-redis checks every connection it hands out
    /// with a `PING`). One whose call failed or stalled is not used again.
    shared: Mutex<Shared>,
    wakeups: Arc<Wakeups>,
    /// The scripts' form: for one Redis, or for a cluster node.
    scripts: &'static Scripts,
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
        Self::with_scripts(pool, subscriber, &SINGLE)
    }

    /// A master of a Redis Cluster, which gets the keys of a batch that it serves, of many
    /// slots ([`CLUSTER`]). Its acquisitions count no grant (the cluster store takes the
    /// token from one counter) and its releases announce nothing (the cluster store does).
    #[cfg(feature = "cluster")]
    pub(crate) fn cluster_node(pool: Pool) -> Self {
        Self::with_scripts(pool, None, &CLUSTER)
    }

    fn with_scripts(
        pool: Pool,
        subscriber: Option<redis::Client>,
        scripts: &'static Scripts,
    ) -> Self {
        let backend = Self {
            pool,
            shared: Mutex::default(),
            wakeups: Arc::new(Wakeups::new()),
            scripts,
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

    /// Runs a script on the shared connection (see [`send`](Self::send)).
    async fn invoke<T: FromRedisValue>(
        &self,
        script: &ScriptInvocation<'_>,
    ) -> Result<T, BackendError> {
        self.send(Command::Script(script)).await
    }

    /// Sends a command on the shared connection. A connection that broke since its last use
    /// (the server restarted, say) fails the first command sent on it: then the command
    /// runs once more on a new one. Every command here is idempotent for its caller (a
    /// script acquiring again rewrites the same hold, and at worst takes one more fencing
    /// number; an answer is stored only where none is), so running one twice is harmless.
    async fn send<T: FromRedisValue>(&self, command: Command<'_>) -> Result<T, BackendError> {
        let mut call = self.call().await?;
        let result = command.send_on(&mut call.connection).await;
        match result {
            Err(error) if call.reused && broken(&error) => {
                drop(call);
                let mut call = self.call().await?;
                let result = command.send_on(&mut call.connection).await;
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

    /// Runs a script that frees `keys` for others (a release, a withdrawal) and announces
    /// it: the channel and the keys' wake-up slots go last among its arguments, for it to
    /// publish; this process's waiters are woken at once, without waiting for the message
    /// to come back. Returns the script's count.
    async fn invoke_announcing(
        &self,
        mut script: ScriptInvocation<'_>,
        keys: &[String],
    ) -> Result<usize, BackendError> {
        let slots = slots_of(keys);
        script.arg(RELEASED_CHANNEL).arg(slot_list(&slots));
        let count = self.invoke(&script).await?;
        self.wakeups.wake_slots(slots);
        Ok(count)
    }

    /// Puts the reservation of the waiter with `ticket` on `keys`, for
    /// [`Wait::RESERVATION_TTL`]: the part of a batch that the cluster store granted and
    /// rolled back, when another part kept the waiter out.
    #[cfg(feature = "cluster")]
    pub(crate) async fn reserve(
        &self,
        keys: &[String],
        ticket: Ticket,
    ) -> Result<(), BackendError> {
        let mut script = self.scripts.prepare(&self.scripts.reserve, keys);
        script.arg(ticket.get()).arg(millis(Wait::RESERVATION_TTL));
        self.invoke::<i64>(&script).await?;
        Ok(())
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
        line: Line,
    ) -> BoxFuture<'a, Result<Acquire, BackendError>> {
        Box::pin(async move {
            let mut script = self.scripts.acquire.prepare_invoke();
            if self.scripts.keys_as_args {
                // KEYS[1], the counter, is a placeholder on a cluster node (cluster.lua).
                script.arg(keys.len() + 1).arg("").arg(keys);
            } else {
                script.key(namespace).key(keys);
            }
            script
                .arg(holder.owner.as_hex())
                .arg(holder.hold_hex())
                .arg(millis(ttl))
                .arg(report)
                .arg(match line {
                    Line::Outside => String::new(),
                    Line::At(ticket) => ticket.get().to_string(),
                    // Earlier than every ticket: no reservation keeps it out.
                    Line::Holder => "0".to_owned(),
                })
                .arg(match line {
                    Line::At(_) => millis(Wait::RESERVATION_TTL),
                    Line::Outside | Line::Holder => 0,
                });
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
            let mut script = self.scripts.prepare(&self.scripts.extend, keys);
            script
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
            let mut script = self.scripts.prepare(&self.scripts.release, keys);
            script.arg(holder.owner.as_hex()).arg(holder.hold_hex());
            self.invoke_announcing(script, keys).await
        })
    }

    fn withdraw<'a>(
        &'a self,
        keys: &'a [String],
        ticket: Ticket,
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let mut script = self.scripts.prepare(&self.scripts.withdraw, keys);
            script.arg(ticket.get());
            self.invoke_announcing(script, keys).await
        })
    }

    fn inspect<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<KeyView>, BackendError>> {
        Box::pin(async move {
            let script = self.scripts.prepare(&self.scripts.inspect, keys);
            let reply: Vec<i64> = self.invoke(&script).await?;
            if reply.len() != keys.len() * 4 {
                return Err(BackendError::unknown(format!(
                    "the inspect script answered {} numbers for {} keys",
                    reply.len(),
                    keys.len()
                )));
            }
            Ok(reply.chunks_exact(4).map(key_view).collect())
        })
    }

    fn force_release<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let script = self.scripts.prepare(&self.scripts.force_release, keys);
            self.invoke_announcing(script, keys).await
        })
    }

    /// Redis 7.0 or later (the scripts need it), and every script loads.
    fn check(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            let mut call = self.call().await?;
            let info: RedisResult<String> = redis::cmd("INFO")
                .arg("server")
                .query_async(&mut call.connection)
                .await;
            let version = match info {
                Ok(info) => server_version(&info),
                Err(error) => return call.end::<()>(Err(error)),
            };
            if version.is_some_and(|(major, _)| major < 7) {
                let (major, minor) = version.unwrap_or_default();
                return Err(BackendError::not_sent(format!(
                    "the lock store needs Redis 7.0 or later; this server is {major}.{minor}"
                )));
            }
            let own = &self.scripts;
            let mut scripts = vec![&own.acquire, &own.extend, &own.release, &own.withdraw];
            // Redlock raises fences; a cluster node keeps no counter.
            if !own.keys_as_args {
                scripts.push(&*RAISE_FENCE);
            }
            // Inspect and force_release are an operator's: they load when first used.
            for script in scripts {
                let loaded = script.load_async(&mut call.connection).await;
                if loaded.is_err() {
                    return call.end(loaded).map(drop);
                }
            }
            call.end(Ok(()))
        })
    }

    #[cfg(feature = "idempotency")]
    fn load_answer<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<bytes::Bytes>, BackendError>> {
        Box::pin(async move {
            let answer: Option<Vec<u8>> = self
                .send(Command::Plain(redis::cmd("GET").arg(key)))
                .await?;
            Ok(answer.map(bytes::Bytes::from))
        })
    }

    #[cfg(feature = "idempotency")]
    fn store_answer<'a>(
        &'a self,
        key: &'a str,
        answer: bytes::Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, BackendError>> {
        Box::pin(async move {
            let set = store_answer_command(key, &answer, retention);
            let stored: Option<String> = self.send(Command::Plain(&set)).await?;
            Ok(stored.is_some())
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

/// What one call sends.
#[derive(Clone, Copy)]
enum Command<'a> {
    Script(&'a ScriptInvocation<'a>),
    /// A plain command (the idempotency layer's answers need no script).
    #[cfg(feature = "idempotency")]
    Plain(&'a redis::Cmd),
}

impl Command<'_> {
    async fn send_on<T: FromRedisValue>(
        self,
        connection: &mut MultiplexedConnection,
    ) -> RedisResult<T> {
        match self {
            Self::Script(script) => script.invoke_async(connection).await,
            #[cfg(feature = "idempotency")]
            Self::Plain(command) => command.query_async(connection).await,
        }
    }
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

/// One key's four numbers from the inspect script.
fn key_view(numbers: &[i64]) -> KeyView {
    let count = |n: i64| usize::try_from(n).unwrap_or(0);
    let status = match numbers[0] {
        0 => KeyStatus::Free,
        1 => KeyStatus::Held,
        _ => KeyStatus::Foreign,
    };
    KeyView {
        status,
        // -1: no ttl; -2: gone since (it cannot be, inside a script).
        ttl: u64::try_from(numbers[1]).ok().map(Duration::from_millis),
        holds: count(numbers[2]),
        waiters: count(numbers[3]),
    }
}

/// `SET key answer PX retention NX`: keeps an idempotent answer unless one is there.
#[cfg(feature = "idempotency")]
pub(crate) fn store_answer_command(key: &str, answer: &[u8], retention: Duration) -> redis::Cmd {
    let mut set = redis::cmd("SET");
    set.arg(key)
        .arg(answer)
        .arg("PX")
        .arg(millis(retention))
        .arg("NX");
    set
}

pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The major and minor version in the answer to `INFO server`.
fn server_version(info: &str) -> Option<(u32, u32)> {
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))?;
    let mut parts = version.trim().split('.').map(|p| p.parse().ok());
    Some((parts.next()??, parts.next()??))
}

/// The slots as the release message carries them: `3,17,512`, or `*` for all.
pub(crate) fn slot_list(slots: &[usize]) -> String {
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

pub(crate) fn wake_from_message(wakeups: &Wakeups, payload: &[u8]) {
    if payload == b"*" {
        return wakeups.wake_all();
    }
    let slots = std::str::from_utf8(payload).unwrap_or_default().split(',');
    wakeups.wake_slots(slots.filter_map(|s| s.parse().ok()));
}
