//! Locks over several independent Redis masters: the Redlock algorithm, for whole batches.
//!
//! Every master is a [`RedisBackend`] of its own (its own pool, the same scripts), and every
//! call fans out to all of them at once, each bounded by the node timeout:
//!
//! - **acquire** sends the whole batch to every master. It holds once a majority has
//!   granted the whole batch (a master that granted part of it does not exist: the script
//!   is all or nothing) within the validity window `ttl - drift`, counted from before the
//!   first request on a monotonic clock. Masters that have not answered by then are not
//!   waited for: whatever they grant is released with the batch. When the majority cannot
//!   be had (refusals, errors, timeouts) or came too late, the batch is released on every
//!   master that may hold any of it, after each has answered its acquisition (so that the
//!   release runs after it); a master that did not answer in time gets its release in the
//!   background, retried until it answers.
//! - **extend** needs a majority that still holds every key; otherwise the lease is lost.
//! - **release** goes to every master, and succeeds once a majority has answered; the
//!   others get as long again, then finish in the background.
//!
//! Every call runs on each master in a task of its own, so that a call nobody waits for
//! any more still completes (a half-sent command or a half-opened connection is not lost).
//! A flag per acquisition, by owner, lets an acquisition that lands on a master after the
//! batch was released undo itself there.
//!
//! The fencing token is the largest of the granting masters' counters, after bringing a
//! majority of them up to it; see [`Redlock`](crate::Redlock) for why and what that buys.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    future::Future,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::{Duration, Instant},
};

use futures_util::{future::join_all, stream::FuturesUnordered, StreamExt};
use redis::IntoConnectionInfo;

use super::{
    redis::RedisBackend,
    wake::{slots_of, Wakeups},
    Acquire, Backend, BackendError, BoxFuture, Contention, Holder, KeyView, Line, Ticket,
};
use crate::{FencingToken, KeyStatus, Locks};

/// How long one master may take to answer one call, unless [`Redlock::node_timeout`] says
/// otherwise.
const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(100);

/// Locks over several independent Redis masters, with the Redlock algorithm: a batch is
/// locked when a majority of the masters locked all of it, so the locks survive the loss
/// of any minority of the masters.
///
/// [`Locks::redlock`] builds one with the defaults; `Redlock` adds the knobs:
///
/// ```
/// use std::time::Duration;
/// use tower_batch_lock::Redlock;
///
/// # fn main() -> Result<(), tower_batch_lock::redis::RedisError> {
/// // Nothing connects yet: each master gets a pool that connects on first use.
/// let locks = Redlock::new([
///     "redis://10.0.0.1:6379/",
///     "redis://10.0.0.2:6379/",
///     "redis://10.0.0.3:6379/",
/// ])
/// .node_timeout(Duration::from_millis(50))
/// .build()?
/// .ttl(Duration::from_secs(10));
///
/// // Fewer than three masters, or one listed twice, is refused.
/// assert!(Redlock::new(["redis://10.0.0.1/", "redis://10.0.0.2/"]).build().is_err());
/// # drop(locks);
/// # Ok(())
/// # }
/// ```
///
/// # The algorithm, for batches
///
/// Each master holds the same data as a single Redis does with [`Locks::redis`]: one key per
/// resource holding the owner token, with a `PX` TTL, and a fencing counter per namespace,
/// written by the same scripts. An acquisition sends the whole batch to every master at
/// once, each call bounded by the node timeout, and measures the time it takes on a
/// monotonic clock. It is granted when a majority (`N / 2 + 1`) of the masters granted the
/// *whole* batch and `validity = ttl - elapsed - drift` is still positive, with
/// `drift = ttl / 100 + 2 ms` for the masters' clocks running at different rates. The
/// [`Lease`](crate::Lease) expires at `start + ttl - drift`, earlier than any master lets the
/// keys go. Otherwise the batch is released on every master that might hold any of it,
/// and the request is refused: 409 when a majority answered, some of them with a
/// conflicting key (with [`Locks::wait`] it tries again after a random pause of 5 to 100 ms,
/// the algorithm's retry delay), 503 when a majority could not answer or the majority came
/// too late. A failed attempt never leaves a key behind on a master that answers.
///
/// Renewal ([`Locks::renew_lease`]) extends the keys on every master and keeps the lease only
/// if a majority still held all of them; release goes to every master at once.
///
/// # Failures
///
/// - A master that is down (connection refused) costs nothing; one that is frozen, slow or
///   cut off costs at most the node timeout, and only when its answer is needed: neither an
///   acquisition nor a release waits for the masters beyond a majority (a release gives
///   them as long again as the majority took), and their calls finish in the background.
/// - With a majority down, requests get 503 at once (refused connections) or after the
///   node timeout (frozen masters), never after the TTL.
/// - Keys left on a master that did not answer in time are released in the background as
///   soon as it answers, and expire with their TTL if it never does.
/// - Waiting requests wake at once for releases in this process; releases in other
///   processes are not relayed (they would arrive once per master), so those waiters poll
///   (every 5 to 100 ms).
///
/// # What it guarantees, and what it does not
///
/// Mutual exclusion holds under the assumptions of Redlock: the masters do not lose their
/// keys, their clocks advance at about the right rate (within the drift allowance over a
/// TTL), and a holder finishes its work before its lease expires.
///
/// - **Restarts.** A master restarted without its data (no persistence, or `appendfsync`
///   not `always`) forgets the locks it held. While a majority of the masters that granted
///   a batch still hold it, it stays locked; once restarts have cost it its majority,
///   another request can be granted the same keys while the first still runs, and the
///   first learns of it only at its next renewal ([`Lease::lost`](crate::Lease::lost)).
///   Either keep a crashed master out for at least one TTL before it rejoins (antirez's
///   *delayed restarts*), or run the masters with `appendonly yes` and
///   `appendfsync always`.
/// - **Pauses and clocks.** As Martin Kleppmann argues in *How to do distributed locking*
///   (2016), a lease cannot stop a holder that stalls past its expiry (a GC pause, a slow
///   disk, a lost network) from writing after another holder got the keys, and Redlock's
///   expiry rests on clocks: a master whose clock jumps forward lets keys go early.
///   Salvatore Sanfilippo's reply, *Is Redlock safe?* (2016), holds that the algorithm
///   only assumes clocks that advance at about the same rate (no jumps: slew, do not step,
///   with NTP), and that the validity check after acquiring covers delays before the grant.
///   Both agree that a pause *after* the grant hits every lock that expires, and that only
///   the resource can then refuse the stale writer: Kleppmann with fencing tokens (which,
///   he notes, Redlock has no way to produce), antirez also by checking the holder's
///   unique value. This crate does produce tokens, under the conditions below.
/// - **Fencing tokens.** Each master counts grants per namespace, as a single Redis does.
///   The token of a grant is the largest count among the masters that granted it. A
///   maximum over different majorities does not grow by itself: a master that refused
///   (or missed) some grants falls behind, and a later majority of lagging masters would
///   count from a smaller number. So when fewer than a majority of the granting masters
///   reached the largest count, the grant first raises the lagging ones to it (one more
///   round trip, only then), and is granted only once a majority holds at least that
///   count. Any later grant of a shared key needs a majority as well, which shares a master
///   with that one; there it could not be granted before the key was released or expired,
///   so it counts on from a larger number. Tokens therefore strictly increase across
///   grants that share a key, under the assumptions above. A master that loses its
///   counter (a restart without persistence, a failover to a replica that missed an
///   increment) breaks that: the next tokens may repeat or go back, and delayed restarts
///   do not help, since the counter is lost for good. If you rely on fencing, run the
///   masters with `appendfsync always`, and do not let the token alone decide.
///
/// Use Redlock when one Redis is a single point of failure you cannot accept and you can
/// run three (or five) independent masters; not to make a lock stronger than the
/// resource it protects. For correctness that must survive pauses and clock trouble, let
/// the resource check fencing tokens or use a consensus store.
#[derive(Clone)]
pub struct Redlock {
    urls: Vec<String>,
    node_timeout: Duration,
}

impl fmt::Debug for Redlock {
    // By hand: URLs may carry passwords.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redlock")
            .field("masters", &self.urls.len())
            .field("node_timeout", &self.node_timeout)
            .finish()
    }
}

impl Redlock {
    /// Redlock over the independent Redis masters at `urls` (`redis://host:port/db`;
    /// credentials go in the URL). [`build`](Self::build) checks them.
    pub fn new<I>(urls: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Self {
            urls: urls.into_iter().map(|u| u.as_ref().to_owned()).collect(),
            node_timeout: DEFAULT_NODE_TIMEOUT,
        }
    }

    /// How long one master may take to answer one call (getting a connection included)
    /// before it counts as failed for that call. Default 100 ms: many times a round trip
    /// and a script over a thousand keys in one data center, and a small part of any
    /// sensible TTL. Raise it for batches of many thousands of keys: a 3,000-key
    /// acquisition keeps a master busy for 5 to 25 ms on the machines the benchmarks ran
    /// on, and longer while a waiter reserves them or the master shares its core. Keep it
    /// far below the TTL: an acquisition whose majority answers later than `ttl - drift`
    /// fails anyway.
    ///
    /// # Panics
    ///
    /// If `timeout` is zero.
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        assert!(
            !timeout.is_zero(),
            "a Redlock node timeout must not be zero"
        );
        self.node_timeout = timeout;
        self
    }

    /// The locks, with the default policy ([`Locks::ttl`] and the rest tune it). Logs a
    /// warning for an even number of masters: four tolerate one failure, as three do.
    ///
    /// # Errors
    ///
    /// When there are fewer than three masters (one is [`Locks::redis_url`]; two tolerate no
    /// failure at all), when a URL is not a valid Redis URL, or when two URLs name the same
    /// server. Nothing connects yet.
    pub fn build(self) -> Result<Locks, redis::RedisError> {
        let count = self.urls.len();
        if count < 3 {
            return Err(config_error(format!(
                "Redlock needs at least 3 independent Redis masters, got {count}; \
                 for one, use Locks::redis_url"
            )));
        }
        let mut servers = HashSet::new();
        let mut nodes = Vec::with_capacity(count);
        let mut addresses = Vec::with_capacity(count);
        for url in &self.urls {
            let info = url.as_str().into_connection_info()?;
            let server = info.addr().to_string();
            if !servers.insert(server.clone()) {
                return Err(config_error(format!(
                    "the Redis server {server} is listed twice: Redlock's masters must be \
                     independent servers"
                )));
            }
            // The node timeout bounds every call anyway; the client's own timeouts (500 ms
            // for a response by default) must not cut a longer one short.
            let config = redis::AsyncConnectionConfig::new()
                .set_connection_timeout(Some(self.node_timeout))
                .set_response_timeout(Some(self.node_timeout));
            let manager = deadpool_redis::Manager::new_with_config(info, config)?;
            let pool = deadpool_redis::Pool::builder(manager)
                .runtime(deadpool_redis::Runtime::Tokio1)
                .build()
                .map_err(|e| config_error(format!("could not create a Redis pool: {e}")))?;
            nodes.push(Arc::new(RedisBackend::new(pool, None)));
            addresses.push(server);
        }
        if count.is_multiple_of(2) {
            tracing::warn!(
                masters = count,
                "Redlock over an even number of masters tolerates no more failures than over \
                 one fewer"
            );
        }
        let backend = RedlockBackend {
            quorum: count / 2 + 1,
            nodes: nodes.into(),
            addresses: addresses.into(),
            warned_at_ms: (0..count).map(|_| AtomicU64::new(0)).collect(),
            epoch: Instant::now(),
            node_timeout: self.node_timeout,
            longest_ttl_ms: AtomicU64::new(0),
            late: Mutex::default(),
            wakeups: Wakeups::new(),
        };
        Ok(Locks::with_backend(Arc::new(backend)))
    }
}

fn config_error(detail: String) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "invalid Redlock configuration",
        detail,
    ))
}

pub(crate) struct RedlockBackend {
    nodes: Box<[Arc<RedisBackend>]>,
    /// `host:port` of each master, for the logs (never the URL: it may carry a password).
    addresses: Box<[String]>,
    /// When each master's failure was last logged as a warning, in ms since `epoch`.
    warned_at_ms: Box<[AtomicU64]>,
    epoch: Instant,
    quorum: usize,
    node_timeout: Duration,
    /// The longest TTL asked for so far: no key of ours outlives it on a master after the
    /// master last ran one of our commands, so retrying a release longer is pointless.
    longest_ttl_ms: AtomicU64,
    /// A flag per acquisition that is running or granted, by owner. The release raises it;
    /// a master's acquisition that completes after that releases on its master itself, so
    /// that a release never leaves behind a grant that landed after it.
    late: Mutex<HashMap<Holder, Arc<AtomicBool>>>,
    wakeups: Wakeups,
}

impl fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockBackend")
            .field("masters", &self.addresses)
            .field("nodes", &self.nodes)
            .field("quorum", &self.quorum)
            .field("node_timeout", &self.node_timeout)
            .finish_non_exhaustive()
    }
}

/// Why one master gave no answer to one call.
#[derive(Debug)]
pub(crate) enum NodeFailure {
    /// No answer within the node timeout: the command may still run there.
    TimedOut,
    Failed(BackendError),
}

impl fmt::Display for NodeFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TimedOut => f.write_str("no answer within the node timeout"),
            Self::Failed(error) => error.fmt(f),
        }
    }
}

impl NodeFailure {
    pub(crate) fn may_have_applied(&self) -> bool {
        match self {
            Self::TimedOut => true,
            Self::Failed(error) => error.may_have_applied,
        }
    }
}

pub(crate) type NodeReply<T> = Result<T, NodeFailure>;

/// The masters' replies to one call, as they come.
type Replies<T> = FuturesUnordered<BoxFuture<'static, (usize, NodeReply<T>)>>;

/// `call`, bounded by `timeout`.
pub(crate) async fn bounded<T>(
    timeout: Duration,
    call: impl Future<Output = Result<T, BackendError>>,
) -> NodeReply<T> {
    match tokio::time::timeout(timeout, call).await {
        Ok(reply) => reply.map_err(NodeFailure::Failed),
        Err(_) => Err(NodeFailure::TimedOut),
    }
}

/// Releases on one master, and when the outcome is unknown (the master may still run an
/// earlier command of ours, such as the acquisition), keeps trying in the background
/// until it answers or until `give_up_at`, when no key of ours can be left there.
pub(crate) async fn release_on(
    node: usize,
    master: Arc<RedisBackend>,
    keys: Arc<[String]>,
    owner: Holder,
    timeout: Duration,
    give_up_at: Instant,
) -> NodeReply<usize> {
    let reply = bounded(timeout, master.release(&keys, owner)).await;
    if matches!(&reply, Err(failure) if failure.may_have_applied()) {
        tokio::spawn(async move {
            let mut pause = Duration::from_millis(50);
            while Instant::now() + pause < give_up_at {
                tokio::time::sleep(pause).await;
                match bounded(timeout, master.release(&keys, owner)).await {
                    Err(failure) if failure.may_have_applied() => {}
                    // Answered, or the master cannot be reached at all (so it runs nothing
                    // of ours): whatever it holds expires with its TTL.
                    _ => return,
                }
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            tracing::warn!(
                node,
                keys = keys.len(),
                "a Redlock master never answered a release; its keys expire with their TTL"
            );
        });
    }
    reply
}

/// Lets calls that nobody waits for any more run to their end (each is bounded by the node
/// timeout): a command half sent, or a connection half opened, would otherwise be lost, and
/// a master that is always a little slower than the others would never get a connection.
/// Each runs in a task of its own already; dropping its handle detaches it.
fn finish_in_background<T>(rest: Replies<T>) {
    drop(rest);
}

/// What the masters answered an acquisition, so far.
#[derive(Debug, Default)]
struct Tally {
    /// The masters that granted the batch, with their fencing counters.
    granted: Vec<(usize, u64)>,
    held: Vec<Contention>,
    /// The masters that gave no answer in time: their acquisition may still run.
    timed_out: Vec<usize>,
    /// Masters that gave no answer, for whatever reason.
    failed: usize,
}

impl Tally {
    fn record(&mut self, node: usize, reply: NodeReply<Acquire>) {
        match reply {
            Ok(Acquire::Granted(fence)) => self.granted.push((node, fence.get())),
            Ok(Acquire::Held(contention)) => self.held.push(contention),
            Err(failure) => {
                self.failed += 1;
                if matches!(failure, NodeFailure::TimedOut) {
                    self.timed_out.push(node);
                }
            }
        }
    }
}

impl RedlockBackend {
    /// `call` on each of `nodes` at once. A call the caller stops waiting for still runs to
    /// its end (see [`finish_in_background`]).
    fn start_on<T, F, Fut>(&self, nodes: impl Iterator<Item = usize>, call: F) -> Replies<T>
    where
        T: Send + 'static,
        F: Fn(usize, Arc<RedisBackend>) -> Fut,
        Fut: Future<Output = NodeReply<T>> + Send + 'static,
    {
        nodes
            .map(|node| {
                // A task per master: the masters' commands are encoded and their replies
                // parsed on every core at once, which shows with thousands of keys.
                let task = tokio::spawn(call(node, self.nodes[node].clone()));
                let reply: BoxFuture<'static, _> = Box::pin(async move {
                    let reply = task.await.unwrap_or_else(|error| {
                        Err(NodeFailure::Failed(BackendError::unknown(error)))
                    });
                    (node, reply)
                });
                reply
            })
            .collect()
    }

    /// Releases on each of `nodes` at once (see [`release_on`]).
    fn start_releases(
        &self,
        nodes: impl Iterator<Item = usize>,
        keys: &Arc<[String]>,
        owner: Holder,
    ) -> Replies<usize> {
        let give_up_at =
            Instant::now() + Duration::from_millis(self.longest_ttl_ms.load(Ordering::Relaxed));
        let timeout = self.node_timeout;
        self.start_on(nodes, |node, master| {
            release_on(node, master, keys.clone(), owner, timeout, give_up_at)
        })
    }

    /// Withdraws a waiter's reservations on each of `nodes` at once.
    fn start_withdrawals(
        &self,
        nodes: impl Iterator<Item = usize>,
        keys: &Arc<[String]>,
        ticket: Ticket,
    ) -> Replies<usize> {
        let timeout = self.node_timeout;
        self.start_on(nodes, |_, master| {
            let keys = keys.clone();
            async move { bounded(timeout, master.withdraw(&keys, ticket)).await }
        })
    }

    /// Waits for every master's answer to `call`, which frees `keys` for others (each is
    /// bounded by the node timeout), reports those that failed, and wakes this process's
    /// waiters: how many answered, and the largest count any of them gave.
    async fn freed_everywhere(
        &self,
        call: &'static str,
        mut replies: Replies<usize>,
        keys: &[String],
    ) -> (usize, usize) {
        let (mut answered, mut freed) = (0, 0);
        while let Some((node, reply)) = replies.next().await {
            match reply {
                Ok(count) => {
                    answered += 1;
                    freed = freed.max(count);
                }
                Err(failure) => self.report(node, call, &failure),
            }
        }
        self.wakeups.wake_slots(slots_of(keys));
        (answered, freed)
    }

    /// Logs that a master did not answer a call: as a warning at most every 10 s per
    /// master, so that a master that is down shows in the logs without flooding them
    /// (requests that still find a majority succeed without a word); at debug level
    /// otherwise.
    fn report(&self, node: usize, call: &'static str, failure: &NodeFailure) {
        const WARN_EVERY_MS: u64 = 10_000;
        let now = u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let warned = &self.warned_at_ms[node];
        let last = warned.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= WARN_EVERY_MS;
        let master = &self.addresses[node];
        crate::observe::node_error(master, call);
        if due
            && warned
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                %master,
                call,
                %failure,
                "a Redlock master did not answer (warned at most every 10 s per master)"
            );
        } else {
            tracing::debug!(%master, call, %failure, "a Redlock master did not answer");
        }
    }

    fn note_ttl(&self, ttl: Duration) {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.longest_ttl_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// The largest of the granting masters' counters, once a majority of the masters holds
    /// at least that count (raising the lagging granting masters first if needed), and
    /// while the validity window is still open.
    async fn agree_on_fence(
        &self,
        namespace: &str,
        granted: &[(usize, u64)],
        valid_until: Instant,
    ) -> Result<FencingToken, &'static str> {
        let top = granted.iter().map(|&(_, fence)| fence).max().unwrap_or(0);
        let at_top = granted.iter().filter(|&&(_, fence)| fence == top).count();
        if at_top < self.quorum {
            let lagging = granted
                .iter()
                .filter(|&&(_, fence)| fence < top)
                .map(|&(node, _)| {
                    bounded(
                        self.node_timeout,
                        self.nodes[node].raise_fence(namespace, top),
                    )
                });
            let raised = join_all(lagging).await.iter().filter(|r| r.is_ok()).count();
            if at_top + raised < self.quorum {
                return Err("a majority of the Redlock masters could not agree on a fencing token");
            }
        }
        if Instant::now() >= valid_until {
            return Err("the Redlock majority answered after the lock's validity had run out");
        }
        Ok(FencingToken::new(top))
    }

    /// Releases whatever a failed acquisition may have left: on every master, unless every
    /// one of them refused (and so wrote nothing). It waits for the masters that answered
    /// the acquisition; those that did not answer in time get their release in the
    /// background rather than hold the request up again.
    async fn roll_back(&self, keys: &Arc<[String]>, owner: Holder, tally: &Tally) {
        if tally.granted.is_empty() && tally.failed == 0 {
            return;
        }
        finish_in_background(self.start_releases(tally.timed_out.iter().copied(), keys, owner));
        let answered = (0..self.nodes.len()).filter(|node| !tally.timed_out.contains(node));
        let mut releases = self.start_releases(answered, keys, owner);
        while releases.next().await.is_some() {}
    }

    fn late_acquisitions(&self) -> std::sync::MutexGuard<'_, HashMap<Holder, Arc<AtomicBool>>> {
        self.late.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The allowance for masters' clocks running at different rates over `ttl`: a lease on
/// several masters ends this much before `ttl` after it was asked for.
pub(crate) fn clock_drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// One contention out of the masters' refusals: the conflicting keys any master named,
/// and the earliest expiry any master reported.
fn merge(held: Vec<Contention>, report: usize) -> Contention {
    let total = held.iter().map(|c| c.total).max().unwrap_or(1);
    let earliest_expiry = held.iter().filter_map(|c| c.earliest_expiry).min();
    let mut keys: Vec<String> = held.into_iter().flat_map(|c| c.keys).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.truncate(report);
    Contention {
        keys,
        total,
        earliest_expiry,
    }
}

/// The `quorum`-th largest of `values`: the most that `quorum` of them reach.
fn reached_by<T: Ord + Copy>(mut values: Vec<T>, quorum: usize) -> Option<T> {
    values.sort_unstable_by(|a, b| b.cmp(a));
    values.get(quorum.checked_sub(1)?).copied()
}

/// One key as a majority of the masters that answered see it: held when `quorum` of them
/// hold it (then no acquisition can get a majority), with the time left and the holds that
/// `quorum` of them still have; foreign when `quorum` of them are kept out by something
/// else; free otherwise, even if a minority still holds it (what is left there expires,
/// and keeps nobody out). The waiters that `quorum` of them have in line.
fn majority_view(views: &[KeyView], quorum: usize) -> KeyView {
    let held: Vec<&KeyView> = views
        .iter()
        .filter(|v| v.status == KeyStatus::Held)
        .collect();
    let blocked: Vec<&KeyView> = views
        .iter()
        .filter(|v| v.status != KeyStatus::Free)
        .collect();
    let waiters = reached_by(views.iter().map(|v| v.waiters).collect(), quorum).unwrap_or(0);
    let (status, seen) = if held.len() >= quorum {
        (KeyStatus::Held, held)
    } else if blocked.len() >= quorum {
        (KeyStatus::Foreign, blocked)
    } else {
        return KeyView {
            waiters,
            ..KeyView::FREE
        };
    };
    KeyView {
        status,
        ttl: reached_by(seen.iter().filter_map(|v| v.ttl).collect(), quorum),
        holds: reached_by(seen.iter().map(|v| v.holds).collect(), quorum).unwrap_or(0),
        waiters,
    }
}

impl Backend for RedlockBackend {
    fn acquire<'a>(
        &'a self,
        namespace: &'a str,
        keys: &'a [String],
        owner: Holder,
        ttl: Duration,
        report: usize,
        line: Line,
    ) -> BoxFuture<'a, Result<Acquire, BackendError>> {
        Box::pin(async move {
            self.note_ttl(ttl);
            let valid_until = Instant::now() + ttl.saturating_sub(self.drift(ttl));
            let keys: Arc<[String]> = keys.into();
            let shared_namespace: Arc<str> = namespace.into();
            // Registered before anything is sent: if this future is dropped midway (the
            // client left), the release that the caller's guard sends finds it, and
            // acquisitions that land after that release undo themselves.
            let released = Arc::new(AtomicBool::new(false));
            self.late_acquisitions().insert(owner, released.clone());
            let (timeout, give_up_at) = (self.node_timeout, valid_until + ttl);
            let mut replies = self.start_on(0..self.nodes.len(), |node, master| {
                let (namespace, keys) = (shared_namespace.clone(), keys.clone());
                let released = released.clone();
                async move {
                    let reply = bounded(
                        timeout,
                        master.acquire(&namespace, &keys, owner, ttl, report, line),
                    )
                    .await;
                    // Granted here after the caller already released the batch: undo it.
                    if matches!(reply, Ok(Acquire::Granted(_))) && released.load(Ordering::SeqCst) {
                        let _ = release_on(node, master, keys, owner, timeout, give_up_at).await;
                    }
                    reply
                }
            });
            let mut tally = Tally::default();
            while tally.granted.len() < self.quorum {
                let Some((node, reply)) = replies.next().await else {
                    break;
                };
                if let Err(failure) = &reply {
                    self.report(node, "acquire", failure);
                }
                tally.record(node, reply);
            }
            let mut why = "no majority of the Redlock masters granted the batch";
            if tally.granted.len() >= self.quorum {
                match self
                    .agree_on_fence(namespace, &tally.granted, valid_until)
                    .await
                {
                    Ok(fence) => {
                        // The masters still working on it are not waited for: what they
                        // grant is released with the batch, by the release or by their
                        // own task.
                        finish_in_background(replies);
                        // A waiter's reservations stay on the masters that refused it,
                        // where they would keep later requests out until they expire.
                        if let Line::At(ticket) = line {
                            let refused = (0..self.nodes.len())
                                .filter(|node| tally.granted.iter().all(|(g, _)| g != node));
                            finish_in_background(self.start_withdrawals(refused, &keys, ticket));
                        }
                        return Ok(Acquire::Granted(fence));
                    }
                    Err(reason) => why = reason,
                }
            }

            // Failed. Every master answers (or times out) before the rollback, so that a
            // release never overtakes the acquisition it undoes.
            while let Some((node, reply)) = replies.next().await {
                if let Err(failure) = &reply {
                    self.report(node, "acquire", failure);
                }
                tally.record(node, reply);
            }
            self.roll_back(&keys, owner, &tally).await;
            self.late_acquisitions().remove(&owner);
            let masters = self.nodes.len();
            if tally.failed >= self.quorum {
                return Err(BackendError::not_sent(format!(
                    "{} of {masters} Redlock masters did not answer in time",
                    tally.failed
                )));
            }
            if tally.granted.len() < self.quorum && !tally.held.is_empty() {
                return Ok(Acquire::Held(merge(tally.held, report)));
            }
            // The rollback is done or under way: nothing is left for the caller to undo.
            Err(BackendError::not_sent(why))
        })
    }

    fn extend<'a>(
        &'a self,
        keys: &'a [String],
        owner: Holder,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, BackendError>> {
        Box::pin(async move {
            self.note_ttl(ttl);
            let valid_until = Instant::now() + ttl.saturating_sub(self.drift(ttl));
            let keys: Arc<[String]> = keys.into();
            let timeout = self.node_timeout;
            let mut replies = self.start_on(0..self.nodes.len(), |_, master| {
                let keys = keys.clone();
                async move { bounded(timeout, master.extend(&keys, owner, ttl)).await }
            });
            let masters = self.nodes.len();
            let (mut kept, mut lost) = (0, 0);
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(true) => kept += 1,
                    Ok(false) => lost += 1,
                    Err(failure) => self.report(node, "extend", &failure),
                }
                if kept >= self.quorum || lost > masters - self.quorum {
                    break;
                }
            }
            finish_in_background(replies);
            if kept >= self.quorum {
                return Ok(Instant::now() < valid_until);
            }
            if lost > masters - self.quorum {
                return Ok(false);
            }
            Err(BackendError::unknown(format!(
                "only {} of {masters} Redlock masters answered the extension",
                kept + lost
            )))
        })
    }

    fn release<'a>(
        &'a self,
        keys: &'a [String],
        owner: Holder,
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            if let Some(released) = self.late_acquisitions().remove(&owner) {
                released.store(true, Ordering::SeqCst);
            }
            let keys: Arc<[String]> = keys.into();
            let started = Instant::now();
            let mut replies = self.start_releases(0..self.nodes.len(), &keys, owner);
            let (mut answered, mut deleted, mut unsure) = (0, 0, false);
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(count) => {
                        answered += 1;
                        deleted = deleted.max(count);
                    }
                    Err(failure) => {
                        self.report(node, "release", &failure);
                        unsure |= failure.may_have_applied();
                    }
                }
                if answered >= self.quorum {
                    // A majority suffices. The others get as long again, so that the next
                    // holder usually finds the keys free on every master; a frozen or
                    // slow one finishes in the background.
                    let grace = started.elapsed().max(Duration::from_millis(1));
                    let _ = tokio::time::timeout(grace, async {
                        while let Some((_, reply)) = replies.next().await {
                            if let Ok(count) = reply {
                                deleted = deleted.max(count);
                            }
                        }
                    })
                    .await;
                    finish_in_background(replies);
                    self.wakeups.wake_slots(slots_of(&keys));
                    return Ok(deleted);
                }
            }
            let detail = format!(
                "only {answered} of {} Redlock masters answered the release",
                self.nodes.len()
            );
            Err(if unsure {
                BackendError::unknown(detail)
            } else {
                BackendError::not_sent(detail)
            })
        })
    }

    /// Withdraws on every master at once, and waits for each (each bounded by the node
    /// timeout): a reservation left on a master that does not answer expires on its own.
    fn withdraw<'a>(
        &'a self,
        keys: &'a [String],
        ticket: Ticket,
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let keys: Arc<[String]> = keys.into();
            let replies = self.start_withdrawals(0..self.nodes.len(), &keys, ticket);
            let (answered, withdrawn) = self.freed_everywhere("withdraw", replies, &keys).await;
            if answered == 0 {
                return Err(BackendError::unknown(
                    "no Redlock master answered the withdrawal",
                ));
            }
            Ok(withdrawn)
        })
    }

    /// Asks every master (each bounded by the node timeout) and reports, per key, what a
    /// majority of them see ([`majority_view`]); fails when fewer than a majority answer.
    fn inspect<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<KeyView>, BackendError>> {
        Box::pin(async move {
            let keys: Arc<[String]> = keys.into();
            let timeout = self.node_timeout;
            let mut replies = self.start_on(0..self.nodes.len(), |_, master| {
                let keys = keys.clone();
                async move { bounded(timeout, master.inspect(&keys)).await }
            });
            let mut answers = Vec::with_capacity(self.nodes.len());
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(views) if views.len() == keys.len() => answers.push(views),
                    Ok(_) => tracing::warn!(
                        master = %self.addresses[node],
                        "a Redlock master answered an inspection for other keys"
                    ),
                    Err(failure) => self.report(node, "inspect", &failure),
                }
            }
            if answers.len() < self.quorum {
                return Err(BackendError::not_sent(format!(
                    "only {} of {} Redlock masters answered the inspection, {} needed",
                    answers.len(),
                    self.nodes.len(),
                    self.quorum
                )));
            }
            Ok((0..keys.len())
                .map(|i| {
                    let views: Vec<KeyView> = answers.iter().map(|a| a[i]).collect();
                    majority_view(&views, self.quorum)
                })
                .collect())
        })
    }

    /// Ends the holds on every master at once (each bounded by the node timeout), and
    /// succeeds when a majority answered: a master that did not keeps its holds until they
    /// expire, and alone they keep nobody out.
    fn force_release<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let keys: Arc<[String]> = keys.into();
            let timeout = self.node_timeout;
            let replies = self.start_on(0..self.nodes.len(), |_, master| {
                let keys = keys.clone();
                async move { bounded(timeout, master.force_release(&keys)).await }
            });
            let (answered, released) = self.freed_everywhere("force_release", replies, &keys).await;
            if answered < self.quorum {
                return Err(BackendError::unknown(format!(
                    "only {answered} of {} Redlock masters answered the forced release",
                    self.nodes.len()
                )));
            }
            Ok(released)
        })
    }

    /// A majority of the masters pass their own check within the node timeout.
    fn check(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            let timeout = self.node_timeout;
            let mut replies = self.start_on(0..self.nodes.len(), |_, master| async move {
                bounded(timeout, master.check()).await
            });
            let (mut passed, mut failures) = (0, Vec::new());
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(()) => passed += 1,
                    Err(failure) => failures.push(format!("{}: {failure}", self.addresses[node])),
                }
            }
            if passed >= self.quorum {
                for failure in &failures {
                    tracing::warn!(failure, "a Redlock master failed its check");
                }
                return Ok(());
            }
            Err(BackendError::not_sent(format!(
                "only {passed} of {} Redlock masters passed their check, {} needed: {}",
                self.nodes.len(),
                self.quorum,
                failures.join("; ")
            )))
        })
    }

    /// Asks every master at once and gives the first answer found: only the request that
    /// held the in-flight lock stores one, so any copy is that answer. "None" needs a
    /// majority to say so: a minority may have missed the store.
    #[cfg(feature = "idempotency")]
    fn load_answer<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<bytes::Bytes>, BackendError>> {
        Box::pin(async move {
            let key: Arc<str> = key.into();
            let timeout = self.node_timeout;
            let mut replies = self.start_on(0..self.nodes.len(), |_, master| {
                let key = key.clone();
                async move { bounded(timeout, master.load_answer(&key)).await }
            });
            let mut answered = 0;
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(Some(answer)) => {
                        finish_in_background(replies);
                        return Ok(Some(answer));
                    }
                    Ok(None) => answered += 1,
                    Err(failure) => self.report(node, "load_answer", &failure),
                }
            }
            if answered < self.quorum {
                return Err(BackendError::not_sent(format!(
                    "only {answered} of {} Redlock masters answered a read of a stored answer",
                    self.nodes.len()
                )));
            }
            Ok(None)
        })
    }

    /// Stores on every master at once; succeeds once a majority answered, and says whether
    /// a majority now has this answer.
    #[cfg(feature = "idempotency")]
    fn store_answer<'a>(
        &'a self,
        key: &'a str,
        answer: bytes::Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, BackendError>> {
        Box::pin(async move {
            let key: Arc<str> = key.into();
            let timeout = self.node_timeout;
            let mut replies = self.start_on(0..self.nodes.len(), |_, master| {
                let (key, answer) = (key.clone(), answer.clone());
                async move { bounded(timeout, master.store_answer(&key, answer, retention)).await }
            });
            let (mut answered, mut stored) = (0, 0);
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(ours) => {
                        answered += 1;
                        stored += usize::from(ours);
                    }
                    Err(failure) => self.report(node, "store_answer", &failure),
                }
            }
            if answered < self.quorum {
                return Err(BackendError::unknown(format!(
                    "only {answered} of {} Redlock masters answered the store of an answer",
                    self.nodes.len()
                )));
            }
            Ok(stored >= self.quorum)
        })
    }

    fn drift(&self, ttl: Duration) -> Duration {
        clock_drift(ttl)
    }

    fn wakeups(&self) -> &Wakeups {
        &self.wakeups
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contention(keys: &[&str], total: usize, earliest: Option<u64>) -> Contention {
        Contention {
            keys: keys.iter().map(|&k| k.to_owned()).collect(),
            total,
            earliest_expiry: earliest.map(Duration::from_millis),
        }
    }

    #[test]
    fn refusals_merge_into_one_contention() {
        let merged = merge(
            vec![
                contention(&["lock:b", "lock:c"], 2, Some(900)),
                contention(&["lock:a", "lock:b"], 3, None),
                contention(&["lock:d"], 1, Some(400)),
            ],
            3,
        );
        assert_eq!(merged.keys, ["lock:a", "lock:b", "lock:c"]);
        assert_eq!(merged.total, 3);
        assert_eq!(merged.earliest_expiry, Some(Duration::from_millis(400)));
    }

    #[test]
    fn a_key_is_held_when_a_majority_holds_it() {
        let held = |ttl: u64, holds: usize, waiters: usize| KeyView {
            status: KeyStatus::Held,
            ttl: Some(Duration::from_millis(ttl)),
            holds,
            waiters,
        };
        let free = |waiters: usize| KeyView {
            waiters,
            ..KeyView::FREE
        };
        let view = majority_view(&[held(900, 2, 1), held(500, 1, 0), free(3)], 2);
        assert_eq!(view.status, KeyStatus::Held);
        // Two masters still hold it for 500 ms, with one hold each; one waiter on two.
        assert_eq!(view.ttl, Some(Duration::from_millis(500)));
        assert_eq!((view.holds, view.waiters), (1, 1));
        // A leftover on one master keeps nobody out.
        let view = majority_view(&[held(900, 1, 0), free(0), free(0)], 2);
        assert_eq!(view, KeyView::FREE);
    }

    #[test]
    fn fewer_than_three_masters_or_a_repeated_one_are_refused() {
        let two = Redlock::new(["redis://127.0.0.1:1/", "redis://127.0.0.1:2/"]).build();
        assert!(two.unwrap_err().to_string().contains("at least 3"));
        let repeated = Redlock::new([
            "redis://127.0.0.1:1/",
            "redis://127.0.0.1:2/",
            "redis://127.0.0.1:1/0",
        ])
        .build();
        assert!(repeated.unwrap_err().to_string().contains("listed twice"));
        let invalid = Redlock::new(["redis://127.0.0.1:1/", "redis://127.0.0.1:2/", "nope://"]);
        assert!(invalid.build().is_err());
    }

    #[test]
    fn debug_output_does_not_show_the_urls() {
        let redlock = Redlock::new(["redis://user:secret@a/", "redis://b/", "redis://c/"]);
        let debug = format!("{redlock:?}");
        assert!(!debug.contains("secret"), "{debug}");
        assert!(debug.contains("masters: 3"), "{debug}");
    }
}
