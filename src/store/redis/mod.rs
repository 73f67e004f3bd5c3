//! One Redis: the store that one Redis, each Redlock master and each cluster master run
//! (the scripts in their topology's form, as a function library: `scripts.rs`);
//! `builder.rs` holds the public [`Redis`](builder::Redis).

use std::{
    fmt,
    sync::{Arc, OnceLock, PoisonError, RwLock, RwLockReadGuard},
    time::Duration,
};

use deadpool_redis::Pool;
use futures_util::future::join_all;
use redis::{FromRedisValue, RedisResult};

use super::{
    contract::{
        Acquire, AcquireRequest, Contention, FencingToken, Holder, KeyStatus, KeyView, Keys, Line,
        LockStore, Reply, Ticket,
    },
    error::StoreError,
    message::release_message,
    refusals::LastRefusal,
    wake::{slots_of, Wakeups},
};
use connection::{Command, SharedConnection};
use pubsub::{listen_for_releases, RELEASED_CHANNEL};
use replicas::{acquire_acknowledged, missing_replicas, Acknowledged, ReplicaAck};
#[cfg(feature = "cluster")]
use scripts::CLUSTER;
use scripts::{Function, Invocation, Scripts, CLAIMS, SINGLE};

#[cfg(feature = "idempotency")]
pub(super) mod answers;
pub(super) mod builder;
mod connection;
pub(super) mod pubsub;
pub(super) mod replicas;
pub(super) mod scripts;
mod steps;

/// Keys a script takes at most unless the store says otherwise (`steps.rs`): about 2 ms of
/// Redis's time for an acquisition on the machine the bench ran on (1.7-3.7 µs a key,
/// measured with `cargo run --release --manifest-path bench/Cargo.toml -- batch`), and few
/// enough round trips that a batch of 3,000 keys takes 3 of them.
pub(super) const DEFAULT_STEP: usize = 1000;

/// How many keys a probe's first call names at most. Redis reads every name a call sends
/// before the script starts, and a woken waiter that a key still keeps out often finds it
/// among its first blockers: amid 16 retail and 4 purchase clients, a third to a half of
/// the purchase orders' probes stopped within their first 64 keys (`SLOWLOG`), where each
/// had sent all of its 1,900 or so. One that finds them all free takes a round trip more.
const FIRST_PROBE: usize = 64;

/// One Redis, or one node of a Redlock or a cluster.
pub(crate) struct RedisStore {
    connection: SharedConnection,
    wakeups: Arc<Wakeups>,
    /// The scripts' form: for one Redis, or for a cluster node.
    scripts: &'static Scripts,
    /// Where to open the subscription to other processes' releases, if anywhere.
    subscriber: Option<redis::Client>,
    subscribed: OnceLock<()>,
    /// How many replicas must have a grant before it counts, if any.
    replicas: Option<ReplicaAck>,
    /// How many keys one script takes at most (see `steps.rs`).
    step: usize,
    /// When this store last refused a batch: big ones skip the plain pass for a while after.
    last_refusal: LastRefusal,
    /// The claims registry of this Redis (`claims.lua`): [`CLAIMS`], or a cluster node's
    /// own, named from the slot map.
    claims: RwLock<Arc<str>>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("pool", &self.connection.status())
            .field("subscribes", &self.subscriber.is_some())
            .field("replicas", &self.replicas)
            .field("step", &self.step)
            .finish()
    }
}

impl RedisStore {
    /// `subscriber`: the Redis to listen on for other processes' releases; without it,
    /// waiters wake on this process's releases and otherwise poll.
    pub(crate) fn new(pool: Pool, subscriber: Option<redis::Client>) -> Self {
        Self::with_scripts(pool, subscriber, &SINGLE, Arc::new(Wakeups::new()))
    }

    /// A Redlock master, whose releases wake the waiters of `wakeups`: the Redlock store's,
    /// shared by all its masters.
    pub(crate) fn master(
        pool: Pool,
        subscriber: Option<redis::Client>,
        wakeups: Arc<Wakeups>,
    ) -> Self {
        Self::with_scripts(pool, subscriber, &SINGLE, wakeups)
    }

    /// A master of a Redis Cluster, which gets the keys of a batch that it serves, of many
    /// slots ([`CLUSTER`]). Its acquisitions count no grant (the cluster store takes the
    /// token from one counter) and its releases announce nothing (the cluster store does).
    #[cfg(feature = "cluster")]
    pub(crate) fn cluster_node(pool: Pool, wakeups: Arc<Wakeups>) -> Self {
        Self::with_scripts(pool, None, &CLUSTER, wakeups)
    }

    fn with_scripts(
        pool: Pool,
        subscriber: Option<redis::Client>,
        scripts: &'static Scripts,
        wakeups: Arc<Wakeups>,
    ) -> Self {
        let store = Self {
            connection: SharedConnection::new(pool),
            wakeups,
            scripts,
            subscriber,
            subscribed: OnceLock::new(),
            replicas: None,
            step: DEFAULT_STEP,
            last_refusal: LastRefusal::default(),
            claims: RwLock::new(CLAIMS.into()),
        };
        // Built inside a runtime (the usual case), subscribe now, so that the first waiter
        // already hears of releases; otherwise on first use.
        if tokio::runtime::Handle::try_current().is_ok() {
            store.listen_for_releases();
        }
        store
    }

    /// The same store, whose grants count only once `replicas` acknowledged them (see
    /// [`Redis::replicas`]).
    pub(crate) fn with_replicas(mut self, replicas: Option<ReplicaAck>) -> Self {
        self.replicas = replicas;
        self
    }

    /// How many keys one script takes at most.
    pub(crate) fn step(&self) -> usize {
        self.step
    }

    /// The same store, whose scripts take at most `step` keys each.
    pub(crate) fn with_step(mut self, step: usize) -> Self {
        self.step = step;
        self
    }

    /// The claims registry of this Redis (`claims.lua`), for the call being built (a read
    /// of the name, not a copy: every script call asks).
    fn claims_registry(&self) -> RwLockReadGuard<'_, Arc<str>> {
        self.claims.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Names a cluster node's claims registry: a key of a slot it serves, from the slot map.
    #[cfg(feature = "cluster")]
    pub(crate) fn name_claims_registry(&self, registry: Arc<str>) {
        *self.claims.write().unwrap_or_else(PoisonError::into_inner) = registry;
    }

    /// A call of `function` of this store's scripts on `keys`, after `lead` (see
    /// [`Scripts::prepare`]).
    fn prepare(&self, function: &Function, lead: Option<&str>, keys: &[String]) -> Invocation {
        self.scripts
            .prepare(function, &self.claims_registry(), lead, keys)
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

    /// Runs a script on the shared connection (see [`SharedConnection::send`]).
    async fn invoke<T: FromRedisValue>(&self, script: &Invocation) -> Result<T, StoreError> {
        self.connection.send(Command::Script(script)).await
    }

    /// Frees `keys` for others as `how` says, in steps sent at once, and announces each
    /// step: the channel and the step's wake-up slots go last among the script's
    /// arguments, for it to publish, with the waiters it finds first in line on a key it
    /// frees; this process's waiters are woken at once, without waiting for the message to
    /// come back.
    pub(crate) async fn free(&self, how: Freeing, keys: &[String]) -> Result<Freed, StoreError> {
        let mut freed = Freed {
            count: 0,
            heads: Vec::new(),
        };
        let rolled_back = how.rolling_back();
        let steps: Vec<(_, Invocation)> = keys
            .chunks(self.step)
            .map(|step| {
                let mut invocation = match how {
                    Freeing::Release(holder) | Freeing::RollBack(holder, _) => {
                        let mut call = self.prepare(&self.scripts.release, None, step);
                        call.arg(holder.owner.as_hex()).arg(holder.hold_hex());
                        call
                    }
                    Freeing::Withdraw(ticket) => {
                        let mut call = self.prepare(&self.scripts.withdraw, None, step);
                        call.arg(ticket.as_arg());
                        call
                    }
                    Freeing::Force => self.prepare(&self.scripts.force_release, None, step),
                };
                let slots = slots_of(step);
                invocation
                    .arg(RELEASED_CHANNEL)
                    .arg(release_message(&slots, self.wakeups.tag()));
                (slots, invocation)
            })
            .collect();
        // Every step at once, pipelined on the shared connection: Redis runs them one
        // after another, between other clients' commands, and a waiter that the first
        // step wakes finds the later steps' keys freed too when it looks, where one step
        // a round trip made it look, find them held, and wait again.
        let replies = join_all(
            steps
                .iter()
                .map(|(_, invocation)| self.invoke::<Vec<redis::Value>>(invocation)),
        )
        .await;
        for ((slots, _), reply) in steps.into_iter().zip(replies) {
            // How many keys the step changed, then the tickets of the waiters first in
            // line on the keys it freed.
            let reply = reply?;
            let count = match reply.first() {
                Some(redis::Value::Int(count)) => usize::try_from(*count).unwrap_or(0),
                _ => 0,
            };
            let heads = reply.iter().skip(1).filter_map(|head| match head {
                redis::Value::BulkString(digits) => {
                    std::str::from_utf8(digits).ok()?.parse::<u128>().ok()
                }
                _ => None,
            });
            let first = freed.heads.len();
            freed.count += count;
            freed.heads.extend(heads);
            self.wakeups.wake_slots(slots);
            self.wakeups.wake_tickets(
                freed.heads[first..]
                    .iter()
                    .copied()
                    .filter(|&head| Some(head) != rolled_back),
            );
        }
        Ok(freed)
    }

    /// [`free`](Self::free)'s count of the keys it changed.
    pub(crate) async fn free_count(
        &self,
        how: Freeing,
        keys: &[String],
    ) -> Result<usize, StoreError> {
        Ok(self.free(how, keys).await?.count)
    }

    /// Puts the reservation of the waiter with `ticket` on `keys`, for `reserve`
    /// ([`AcquireRequest::reserve`]), a step at a time: the part of a batch that the cluster store
    /// or an earlier step granted, before it is rolled back, when another part kept the
    /// waiter out; and the steps after a refused one. Returns the positions in `keys` of
    /// those that keep the waiter out as far as the script can tell (see `reserve.lua`).
    /// `claim`: whether the waiter keeps its place with a claim ([`claims`](Self::claims)).
    pub(crate) async fn reserve(
        &self,
        keys: &[String],
        ticket: Ticket,
        reserve: Duration,
        claim: bool,
    ) -> Result<Vec<usize>, StoreError> {
        let mut blockers = Vec::new();
        for (n, step) in keys.chunks(self.step).enumerate() {
            let mut script = self.prepare(&self.scripts.reserve, None, step);
            script
                .arg(ticket.as_arg())
                .arg(millis(reserve))
                .arg(if claim { "1" } else { "0" });
            let found: Vec<usize> = self.invoke(&script).await?;
            // The script counts from 1, in its step.
            let at = |i: usize| i.checked_sub(1).map(|i| n * self.step + i);
            blockers.extend(found.into_iter().filter_map(at));
        }
        Ok(blockers)
    }

    /// Raises the fencing counter of `namespace` to at least `floor`.
    pub(crate) async fn raise_fence(&self, namespace: &str, floor: u64) -> Result<(), StoreError> {
        let mut script = self.prepare(&self.scripts.raise_fence, Some(namespace), &[]);
        script.arg(floor);
        self.invoke::<i64>(&script).await?;
        Ok(())
    }
}

/// A call that frees keys for others ([`RedisStore::free`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Freeing {
    /// Ends a hold on the keys that still have it.
    Release(Holder),
    /// Ends the hold of a refused attempt of the waiter with this ticket, which reserved
    /// the keys first: as `Release`, but it does not wake that waiter, which is first in
    /// line on them and waits for the keys that refused it (woken by its own roll-back, it
    /// would try again at once, and be refused again).
    RollBack(Holder, Ticket),
    /// Takes a waiter's reservations off the keys.
    Withdraw(Ticket),
    /// Ends every hold on the keys, whoever has it.
    Force,
}

impl Freeing {
    /// The ticket of the waiter whose refused attempt this rolls back, as a number: a
    /// wake-up leaves it asleep.
    pub(crate) fn rolling_back(self) -> Option<u128> {
        match self {
            Self::RollBack(_, ticket) => Some(ticket.key()),
            Self::Release(_) | Self::Withdraw(_) | Self::Force => None,
        }
    }
}

/// What a call that freed keys did: how many keys it changed, and the tickets of the
/// waiters first in line on the keys it freed (woken in this process already), for a
/// store that announces releases itself (the cluster's) to name in its announcement.
#[derive(Debug)]
pub(crate) struct Freed {
    pub(crate) count: usize,
    pub(crate) heads: Vec<u128>,
}

/// The acquire script's reply: a grant's fencing token (0 where the grant is not counted),
/// or what kept the batch out: how many keys conflict, the earliest pttl among the held
/// ones (-1: none could be read), the keys it names, and whether a conflict is an upgrade
/// that the owner's fellow readers keep out.
enum AcquireReply {
    Granted(i64),
    Held(i64, i64, Vec<String>, i64),
}

impl FromRedisValue for AcquireReply {
    fn from_redis_value(value: redis::Value) -> Result<Self, redis::ParsingError> {
        match value {
            redis::Value::Int(token) => Ok(Self::Granted(token)),
            held => {
                let (count, earliest, named, upgrade) = FromRedisValue::from_redis_value(held)?;
                Ok(Self::Held(count, earliest, named, upgrade))
            }
        }
    }
}

impl RedisStore {
    /// Runs the acquire script on a connection of its own and, when it grants, waits for
    /// `ack` (see [`Redis::replicas`]). A grant that too few replicas acknowledged is
    /// released before this fails, so that nothing is left when the request gets its 503.
    /// The error still says that the acquisition may have applied: the caller releases
    /// again (one more release, harmless, on this path only), and a cluster attempt rolls
    /// back as for a master that did not answer, rather than take it for a moved slot and
    /// try again.
    async fn invoke_acknowledged(
        &self,
        script: &Invocation,
        request: &AcquireRequest,
        ack: ReplicaAck,
    ) -> Result<AcquireReply, StoreError> {
        let mut dedicated = self.connection.dedicated().await?;
        let granted = |reply: &AcquireReply| matches!(reply, AcquireReply::Granted(_));
        let acknowledged =
            acquire_acknowledged(&mut dedicated.connection, script, granted, ack).await?;
        dedicated.done();
        match acknowledged {
            Acknowledged::Answer(reply) => Ok(reply),
            Acknowledged::Short(acknowledged) => {
                let released = self.release(&request.keys, request.holder).await;
                let detail = format!(
                    "only {acknowledged} of {} replicas acknowledged the grant within {} ms",
                    ack.replicas,
                    ack.timeout.as_millis()
                );
                Err(StoreError::unknown(match released {
                    Ok(_) => format!("{detail}; it was released"),
                    Err(error) => format!("{detail}; releasing it failed: {error}"),
                }))
            }
        }
    }

    /// One script of an acquisition: the whole batch, or one step of it, which counts the
    /// grant when `count` (the last step). `claim`: whether the waiter keeps its place with
    /// a claim ([`claims`](Self::claims)).
    async fn acquire_step(
        &self,
        request: &AcquireRequest,
        count: bool,
        claim: bool,
    ) -> Result<Acquire, StoreError> {
        let (keys, line) = (&*request.keys, request.line);
        // KEYS[1], the counter, is a placeholder on a cluster node (cluster.lua).
        let counter = if self.scripts.keys_as_args {
            ""
        } else {
            &request.namespace
        };
        let mut script = self.prepare(&self.scripts.acquire, Some(counter), keys);
        script
            .arg(request.holder.owner.as_hex())
            .arg(request.holder.hold_hex())
            .arg(millis(request.ttl))
            .arg(request.report)
            .arg(line_arg(line))
            .arg(match line {
                Line::At(_) => millis(request.reserve),
                Line::Outside | Line::Holder(_) => 0,
            })
            .arg(request.modes.script_arg())
            .arg(if count { "1" } else { "0" })
            .arg(RELEASED_CHANNEL)
            // A claim leaves the keys as they were: a retry finds no reservation on them.
            .arg(
                if (request.retry && !claim) || keys.len() >= steps::PLAIN_FROM {
                    "1"
                } else {
                    "0"
                },
            )
            .arg(if claim { "1" } else { "0" });
        let reply = match self.replicas {
            None => self.invoke(&script).await?,
            Some(ack) => self.invoke_acknowledged(&script, request, ack).await?,
        };
        match reply {
            AcquireReply::Granted(token) => {
                let fence = u64::try_from(token).map_err(|_| {
                    let counter = &request.namespace;
                    StoreError::unknown(format!("the fencing counter {counter:?} is negative"))
                })?;
                Ok(Acquire::Granted(FencingToken::new(fence)))
            }
            AcquireReply::Held(count, earliest, named, upgrade) => {
                Ok(Acquire::Held(Contention {
                    keys: named,
                    total: usize::try_from(count).unwrap_or(1),
                    // -1: no conflicting key had a ttl the script could read.
                    earliest_expiry: u64::try_from(earliest).ok().map(Duration::from_millis),
                    upgrade: upgrade == 1,
                    may_reserve_later: false,
                    counted: true,
                }))
            }
        }
    }
}

/// Where a caller stands in line, as the scripts read it: its ticket (a waiter's, or the
/// arrival of an owner that holds keys, whose own keys keep it out of nothing anyway); `''`
/// in no line (kept out by every reservation).
pub(super) fn line_arg(line: Line) -> String {
    match line {
        Line::Outside => String::new(),
        Line::At(ticket) | Line::Holder(ticket) => ticket.as_arg(),
    }
}

impl LockStore for RedisStore {
    /// When it subscribes to other processes' releases.
    fn announces_releases(&self) -> bool {
        self.subscriber.is_some()
    }

    fn acquire<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, Acquire> {
        Box::pin(self.acquire_batch(request))
    }

    /// A probe reads the keys that blocked a waiter, a few first, then a step at a time,
    /// and stops at the first that still does: a woken waiter of 2,000 keys blocked by one
    /// retail order reads one key, where an attempt writes 2,000.
    fn probes(&self) -> bool {
        true
    }

    /// One script: a batch too small for the plain pass (whose refused keys are released,
    /// and that release announced), in one step.
    fn whole_attempts(&self, keys: usize) -> bool {
        keys < steps::PLAIN_FROM && keys <= self.step
    }

    fn probe<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, usize> {
        Box::pin(async move {
            let (owner, line) = (request.holder.owner.as_hex(), line_arg(request.line));
            let mut free = 0;
            // The first call names a few keys (`FIRST_PROBE`), the next ones a step each.
            let (first, rest) = request
                .keys
                .split_at(FIRST_PROBE.min(self.step).min(request.keys.len()));
            let steps = std::iter::once(first).chain(rest.chunks(self.step));
            for step in steps.filter(|step| !step.is_empty()) {
                let indices: Vec<usize> = (free..free + step.len()).collect();
                let mut script = self.prepare(&self.scripts.probe, None, step);
                script
                    .arg(&owner)
                    .arg(&line)
                    .arg(request.modes.part(&indices).script_arg());
                let found: usize = self.invoke(&script).await?;
                free += found;
                if found < step.len() {
                    break;
                }
            }
            Ok(free)
        })
    }

    fn extend<'a>(&'a self, keys: &'a Keys, holder: Holder, ttl: Duration) -> Reply<'a, bool> {
        Box::pin(async move {
            let (owner, hold) = (holder.owner.as_hex(), holder.hold_hex());
            // A step that lost a key ends the extension, and the lease is lost; the keys
            // of the steps before stay extended until the request releases them (or their
            // TTL ends).
            for step in keys.chunks(self.step) {
                let mut script = self.prepare(&self.scripts.extend, None, step);
                script.arg(&owner).arg(&hold).arg(millis(ttl));
                if self.invoke::<i64>(&script).await? != 1 {
                    return Ok(false);
                }
            }
            Ok(true)
        })
    }

    fn release<'a>(&'a self, keys: &'a Keys, holder: Holder) -> Reply<'a, usize> {
        Box::pin(self.free_count(Freeing::Release(holder), keys))
    }

    fn withdraw<'a>(&'a self, keys: &'a Keys, ticket: Ticket) -> Reply<'a, usize> {
        Box::pin(self.free_count(Freeing::Withdraw(ticket), keys))
    }

    fn inspect<'a>(&'a self, keys: &'a Keys) -> Reply<'a, Vec<KeyView>> {
        Box::pin(async move {
            let mut views = Vec::with_capacity(keys.len());
            for step in keys.chunks(self.step) {
                let script = self.prepare(&self.scripts.inspect, None, step);
                let reply: Vec<i64> = self.invoke(&script).await?;
                if reply.len() != step.len() * 4 {
                    return Err(StoreError::unknown(format!(
                        "the inspect script answered {} numbers for {} keys",
                        reply.len(),
                        step.len()
                    )));
                }
                views.extend(reply.chunks_exact(4).map(key_view));
            }
            Ok(views)
        })
    }

    fn force_release<'a>(&'a self, keys: &'a Keys) -> Reply<'a, usize> {
        Box::pin(self.free_count(Freeing::Force, keys))
    }

    /// Redis 7.0 or later (the scripts need it), and the library of scripts loads.
    fn check(&self) -> Reply<'_, ()> {
        Box::pin(async move {
            let mut call = self.connection.call().await?;
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
                return Err(StoreError::left_nothing(format!(
                    "the lock store needs Redis 7.0 or later; this server is {major}.{minor}"
                )));
            }
            if let Some(ack) = self.replicas {
                match missing_replicas(&mut call.connection, ack).await {
                    Ok(None) => {}
                    Ok(Some(missing)) => {
                        return call.end(Ok(())).and(Err(StoreError::left_nothing(missing)))
                    }
                    Err(error) => return call.end(Err(error)),
                }
            }
            // Every function, the operator's included, loads with the library.
            if let Err(error) = self.scripts.load(&mut call.connection).await {
                return call.end(Err(error));
            }
            call.end(Ok(()))
        })
    }

    fn wakeups(&self) -> &Wakeups {
        self.listen_for_releases();
        &self.wakeups
    }
}

/// One key's four numbers from the inspect script.
fn key_view(numbers: &[i64]) -> KeyView {
    let count = |n: i64| usize::try_from(n).unwrap_or(0);
    let status = match numbers[0] {
        0 => KeyStatus::Free,
        1 => KeyStatus::Held,
        3 => KeyStatus::Shared,
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
