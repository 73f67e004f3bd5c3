//! The store contract: what the request path asks of a lock store, and what it answers.
//!
//! A store locks a whole batch or nothing, and releases only the keys that still hold the
//! caller's hold. Keys arrive normalized (prefixed, sorted, deduplicated), so a store never
//! parses or namespaces them itself. Every call takes the whole batch, so that each costs
//! one round trip on a single store.

use std::{
    fmt,
    sync::Arc,
    time::{Duration, Instant},
};

#[cfg(feature = "idempotency")]
use bytes::Bytes;
use futures_util::future::BoxFuture;
use uuid::Uuid;

pub(crate) use super::line::{Line, Ticket};
use super::{error::StoreError, line::millis_since_epoch, wake::Wakeups};

/// A batch of normalized keys, shared by the calls on it.
pub(crate) type Keys = Arc<[String]>;

/// What a store's call gives back, in time: its answer, or why the store failed.
pub(crate) type Reply<'a, T> = BoxFuture<'a, Result<T, StoreError>>;

/// Who holds a lock: 128 random bits, one per request (nested layers on a request share
/// it, and so may a trusted downstream service). They come from uuid's v4 with rand's
/// thread-local ChaCha generator, seeded and reseeded from the OS: unguessable, without a
/// system call per request.
///
/// It is a capability (whoever knows it can re-enter the keys), so it never leaves the
/// process except to the lock store and to services the user chose to trust, and it is
/// never derived from a thread or process id.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct OwnerToken(Uuid);

impl OwnerToken {
    pub(crate) fn random() -> Self {
        Self(Uuid::new_v4())
    }

    /// The token as the lock store keeps it: 32 lowercase hex digits.
    pub(crate) fn as_hex(&self) -> String {
        self.0.simple().to_string()
    }

    /// A token in the form [`as_hex`](Self::as_hex) gives, from a trusted caller.
    pub(crate) fn from_hex(hex: &str) -> Option<Self> {
        (hex.len() == 32)
            .then(|| Uuid::try_parse(hex).ok())
            .flatten()
            .map(Self)
    }
}

impl fmt::Debug for OwnerToken {
    // The token is a secret: debug output must not leak it into logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OwnerToken(..)")
    }
}

/// One acquisition by an owner: the owner, and a random id of this hold.
///
/// An owner may hold a key several times over (nested layers, a handler locking more):
/// each hold is released on its own, and the key is free once its last hold is gone.
/// Releasing one hold twice is harmless, which a count of re-entries could not promise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Holder {
    pub(crate) owner: OwnerToken,
    pub(crate) hold: u64,
}

impl Holder {
    /// A new hold of `owner`.
    pub(crate) fn new(owner: OwnerToken) -> Self {
        Self {
            owner,
            hold: fastrand::u64(..),
        }
    }

    /// The hold id as the lock store keeps it.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn hold_hex(&self) -> String {
        format!("{:016x}", self.hold)
    }
}

/// A number that grows with every grant: give it to the resource you write, and let the
/// resource refuse writes that carry a smaller one than it has seen.
///
/// A lease protects a critical section only while its holder runs on time. A holder that
/// stalls (a long GC or VM pause, a slow disk, a lost network) can wake up after its lease
/// expired and another request got the same keys, and still write. Neither holder can tell
/// from the clock alone; the resource can, by comparing tokens:
///
/// ```
/// use tower_batch_lock::FencingToken;
///
/// /// A record that remembers the largest token that wrote it.
/// struct Record { value: u64, fence: Option<FencingToken> }
///
/// impl Record {
///     /// Check-and-set: a write fenced below the last one is stale, and refused.
///     fn write(&mut self, value: u64, fence: FencingToken) -> Result<(), &'static str> {
///         if self.fence.is_some_and(|seen| fence < seen) {
///             return Err("a newer lock holder has written since");
///         }
///         (self.value, self.fence) = (value, Some(fence));
///         Ok(())
///     }
/// }
/// ```
///
/// In SQL the same check is `UPDATE … SET value = $1, fence = $2 WHERE id = $3 AND fence <= $2`.
///
/// Tokens strictly increase across every grant that shares any key: with Redis there is one
/// counter per key namespace (the prefix), in memory one per store, and Redlock brings a
/// majority of its masters up to each token it hands out
/// ([`Redlock`](crate::store::Redlock) says how). With Redlock alone, two
/// [shared](Mode::Shared) grants made at the same time may get the same token (each is the
/// largest of the masters' counters it saw); readers do not write, and a writer's token
/// is larger than both.
///
/// # Across restarts and failovers
///
/// Tokens never go backwards, even when the store loses its counter: a Redis restarted
/// without persistence, a failover to a replica that missed the last counts, Redlock
/// masters that come back empty, a process (and its memory store) restarted. Every counter
/// is floored by a clock: a grant's token is one more than the counter, and at least the
/// clock's milliseconds since 2025-01-01 times 1024 (Redis's clock, read by the script; for
/// the memory store, this machine's, when the store is made). A counter that starts over
/// so starts above every token handed out before, provided that:
///
/// - **on PostgreSQL, an operator raises it after restoring a copy of the files**: its
///   counter is a sequence, which survives restarts and crashes, starts at the database
///   clock's floor when the store makes it, and is raised to it at the first grant on
///   another server (a promoted replica, a point-in-time recovery), but not at each grant
///   (see the store's docs: after restoring a copy of the database's files,
///   `SELECT <schema>.<table>_raise_fence()` before the first grant);
///
/// - **the clock moves forward**: a store that lost its counter *and* whose clock now reads
///   earlier than when the last token was counted (a clock stepped back, a failover to a
///   machine whose clock is behind) can hand out tokens it handed out before, until its
///   clock catches up. While the counter survives, a clock that steps back changes
///   nothing: the counter only grows;
/// - **fewer than 1,024 grants a millisecond**: a counter that counts faster than that for
///   long runs ahead of its clock, by the excess; if it is then lost, the tokens repeat
///   until the clock has caught up with it. (Over a counter's life, or since it last fell
///   behind the clock: bursts are fine, a sustained million grants a second is not.)
/// - **with Redlock, clocks that agree**: a token comes from the counter of one master (the
///   largest), so after *every* master of a majority lost its counter, the next tokens are
///   floored by their clocks, and they are larger only if those clocks read later than that
///   master's did when it counted the last token: by more than their skew. A restart takes
///   longer than NTP's skew; a master whose clock is far behind may not. While a majority
///   keeps its counters, no clock matters: a master whose clock is behind is still raised
///   to the token.
///
/// The numbers stay below 2^53 (exact in the doubles of Redis's Lua, and in JSON numbers)
/// for centuries; they are large (about 6 * 10^13 in 2026) and not consecutive, so compare
/// them, never count with them. Tokens of different namespaces, or of different stores, do
/// not compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    pub(crate) fn new(value: u64) -> Self {
        Self(value)
    }

    /// The least token a counter starts from now: this machine's milliseconds since 2025
    /// times 1024, as the scripts floor theirs by the store's clock.
    pub(crate) fn clock_floor() -> u64 {
        millis_since_epoch() << 10
    }

    /// The token as a number, to store beside the data it guards.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// How a key is held: by one owner alone, or together with other shared holders.
///
/// A key held [shared](Self::Shared) admits any number of shared holds and no exclusive
/// one; a key held [exclusively](Self::Exclusive) admits nobody else. One batch may mix
/// the two, and is still granted all or nothing. An owner is never kept out of its own
/// keys: holding a key exclusively, it takes it shared as well; holding it shared, it
/// takes it exclusively only while nobody else holds it (an *upgrade*), and is refused at
/// once otherwise, without waiting: two readers that both wait to upgrade would wait for
/// each other. A key is exclusive while one of its owner's exclusive holds lasts, and
/// shared again, with the owner's shared holds, once the last of them ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    /// Nobody else holds the key: the default, for requests that change what it names.
    #[default]
    Exclusive,
    /// Other shared holders may hold it too, no exclusive one: for requests that read a
    /// consistent set of resources and change none of them.
    Shared,
}

impl Mode {
    /// `"exclusive"` or `"shared"`: the `mode` label of the crate's metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exclusive => "exclusive",
            Self::Shared => "shared",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The mode of each key of a batch: one for all of them (the common case, which
/// allocates nothing), or one per key, in the order of the keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Modes {
    All(Mode),
    Each(Arc<[Mode]>),
}

impl Modes {
    /// The modes of a batch whose keys have `modes`, in order: one for all when they agree,
    /// which allocates nothing.
    pub(crate) fn of_each(modes: impl Iterator<Item = Mode> + Clone) -> Self {
        let mut all = modes.clone();
        let first = all.next().unwrap_or_default();
        if all.all(|mode| mode == first) {
            Self::All(first)
        } else {
            Self::Each(modes.collect())
        }
    }

    /// The mode of the key at `index`.
    pub(crate) fn at(&self, index: usize) -> Mode {
        match self {
            Self::All(mode) => *mode,
            Self::Each(modes) => modes[index],
        }
    }

    /// How many keys are held shared, of `len`.
    pub(crate) fn shared(&self, len: usize) -> usize {
        match self {
            Self::All(Mode::Shared) => len,
            Self::All(Mode::Exclusive) => 0,
            Self::Each(modes) => modes.iter().filter(|&&m| m == Mode::Shared).count(),
        }
    }

    /// The modes of the keys at `indices`, in that order: a part of the batch.
    pub(crate) fn part(&self, indices: &[usize]) -> Self {
        match self {
            Self::All(mode) => Self::All(*mode),
            Self::Each(_) => Self::of_each(indices.iter().map(|&i| self.at(i))),
        }
    }

    /// The modes as the scripts read them: `x` (exclusive) or `s` (shared), once for the
    /// whole batch or once per key.
    #[cfg(any(feature = "redis", feature = "postgres"))]
    pub(crate) fn script_arg(&self) -> String {
        let letter = |mode| match mode {
            Mode::Exclusive => 'x',
            Mode::Shared => 's',
        };
        match self {
            Self::All(mode) => letter(*mode).to_string(),
            Self::Each(modes) => modes.iter().map(|&m| letter(m)).collect(),
        }
    }
}

/// Whether a key is locked, as [`Locks::inspect`](crate::Locks::inspect) sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyStatus {
    /// Nobody holds the key (waiters may still have it reserved).
    Free,
    /// A request holds the key exclusively.
    Held,
    /// One or more requests hold the key [shared](Mode::Shared).
    Shared,
    /// The store keeps something under the key that this crate did not write (another
    /// program's value, an older version's lock). It keeps every request out, and
    /// [`Locks::force_release`](crate::Locks::force_release) leaves it alone.
    Foreign,
}

impl KeyStatus {
    /// `"free"`, `"held"`, `"shared"` or `"foreign"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Held => "held",
            Self::Shared => "shared",
            Self::Foreign => "foreign",
        }
    }
}

impl fmt::Display for KeyStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One acquisition of a batch, as a store receives it: cheap to clone into the tasks of a
/// store that sends it to several nodes.
#[derive(Debug, Clone)]
pub(crate) struct AcquireRequest {
    /// The key prefix: the namespace of the fencing counter (the memory store has one
    /// counter for all).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) namespace: Arc<str>,
    pub(crate) keys: Arc<[String]>,
    /// How each key is to be held.
    pub(crate) modes: Modes,
    /// The new hold the batch is acquired under.
    pub(crate) holder: Holder,
    /// How long the keys live unless extended.
    pub(crate) ttl: Duration,
    /// How many conflicting keys a [`Contention`] names at most.
    pub(crate) report: usize,
    /// Where the acquisition stands with respect to waiters' reservations.
    pub(crate) line: Line,
    /// How long, from this attempt, a waiter in line ([`Line::At`]) that is kept out keeps
    /// its reservations: to the end of its wait, so that its place in line outlives every
    /// hold before it, whatever happens to those holds, and goes when the waiter would
    /// have given up (or sooner, withdrawn). Unused by a request in no line.
    pub(crate) reserve: Duration,
    /// Whether an earlier attempt of this waiter in line was refused: its reservations are
    /// on every key of the batch, so that a store's shortcut for free keys finds none.
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) retry: bool,
}

impl AcquireRequest {
    /// The same acquisition, of the keys at `indices`: one node's group, or one step.
    #[cfg(feature = "redis")]
    pub(crate) fn of(&self, indices: &[usize]) -> Self {
        Self {
            keys: indices.iter().map(|&i| self.keys[i].clone()).collect(),
            modes: self.modes.part(indices),
            ..self.clone()
        }
    }
}

/// What an acquisition found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Acquire {
    /// Every key of the batch now holds the caller's token, and the caller's reservations
    /// on them are gone.
    Granted(FencingToken),
    /// At least one key is held by another owner, or reserved by an earlier waiter. No key
    /// was locked; a caller with a ticket now has its reservation on every key of the batch,
    /// unless the refusal names no key: the store could not read the keys in time (on
    /// PostgreSQL, rows another transaction kept), and changed nothing; the caller's next
    /// attempt reserves them.
    Held(Contention),
}

/// The keys that stopped a batch.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Contention {
    /// Up to the requested number of conflicting keys, as stored (with the prefix): held by
    /// another owner, or reserved by an earlier waiter (when not [`counted`](Self::counted),
    /// the first of them, and the keys after it, which may be).
    pub(crate) keys: Vec<String>,
    /// How many keys of the batch are held by others in all (when not
    /// [`counted`](Self::counted), at least).
    pub(crate) total: usize,
    /// Time until the earliest of the conflicting keys expires, when the store knows it.
    pub(crate) earliest_expiry: Option<Duration>,
    /// Whether a conflicting key is one the caller's owner holds shared with others, and
    /// asked for exclusively: an upgrade, which waiting cannot help while another holder
    /// may be waiting to upgrade too.
    pub(crate) upgrade: bool,
    /// Whether a part of the refused attempt got no answer and may still run later (on a
    /// Redlock master, or a cluster group's reservation): refused there, it puts the
    /// waiter's place in line back, after whatever ends the wait. The waiter's place then
    /// withdraws itself again later (`acquire::place`), as it does after an attempt whose
    /// answer never came.
    pub(crate) may_reserve_later: bool,
    /// Whether every key of the batch that keeps the caller out was counted in `total`
    /// and, room allowing, named in `keys`. Not when a waiter joined the line on a probe
    /// that stopped at the first held key (`store::redis::steps`): `total` counts that
    /// one, and `keys` names the keys from it on, which the waiter probes before it tries
    /// again (some of them may be free).
    pub(crate) counted: bool,
}

impl Contention {
    /// One contention out of the refusals of several nodes, naming at most `report` keys.
    /// With `same_batch` (every node was asked the whole batch, as Redlock's masters are)
    /// the keys held in all are the most any node counted; otherwise (each node was asked
    /// its own part) they add up.
    #[cfg(feature = "redis")]
    pub(crate) fn merge(held: Vec<Self>, report: usize, same_batch: bool) -> Self {
        let counts = held.iter().map(|c| c.total);
        let total = if same_batch {
            counts.max().unwrap_or(1)
        } else {
            counts.sum()
        };
        let earliest_expiry = held.iter().filter_map(|c| c.earliest_expiry).min();
        let upgrade = held.iter().any(|c| c.upgrade);
        let counted = held.iter().all(|c| c.counted);
        let may_reserve_later = held.iter().any(|c| c.may_reserve_later);
        let mut keys: Vec<String> = held.into_iter().flat_map(|c| c.keys).collect();
        keys.sort_unstable();
        keys.dedup();
        keys.truncate(report);
        Self {
            keys,
            total,
            earliest_expiry,
            upgrade,
            may_reserve_later,
            // Uncounted, each node's keys start with one found held, and so do the merged
            // ones.
            counted,
        }
    }
}

/// What a store knows of one key, for an operator ([`LockStore::inspect`]): never who holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyView {
    pub(crate) status: KeyStatus,
    /// Time left on the key's holds (or on a foreign value's ttl), when held.
    pub(crate) ttl: Option<Duration>,
    /// How many holds the key has: more than one when its owner re-entered it, or when
    /// several holders share it.
    pub(crate) holds: usize,
    /// How many live reservations of waiters in line are on the key.
    pub(crate) waiters: usize,
}

impl KeyView {
    /// A key nobody holds or reserves.
    pub(crate) const FREE: Self = Self {
        status: KeyStatus::Free,
        ttl: None,
        holds: 0,
        waiters: 0,
    };
}

/// A lock store.
pub(crate) trait LockStore: fmt::Debug + Send + Sync + 'static {
    /// Locks every key of `request` in its mode for its ttl under its new hold, or none of
    /// them (see [`Mode`] for which holds admit which): a key held exclusively by the
    /// holder's owner is entered again, and keeps the longer of its ttl and the request's;
    /// a key held shared by the owner alone is upgraded when asked for exclusively. A
    /// shared hold lives by its own ttl: the key lives as long as its longest hold.
    ///
    /// A key that nobody else holds exclusively but a waiter reserved conflicts as the
    /// request's line says ([`Line::kept_out_by`]), whatever the modes, so that a waiting
    /// writer keeps new readers out; a key that the holder's owner holds never does. When the
    /// batch conflicts and the caller waits in line ([`Line::At`]), its reservation is put
    /// on (or renewed on) every key of the batch, for [`AcquireRequest::reserve`]; when it is
    /// granted, its reservations on the batch are gone.
    ///
    /// A grant carries a fencing token larger than that of every earlier grant in the
    /// same namespace (the key prefix), so larger than every earlier grant of any of
    /// these keys, even after the store lost its counter, under the assumptions of
    /// [`FencingToken`]. (Redlock promises less: larger than every earlier grant that
    /// shares a key; see `Redlock`.)
    fn acquire<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, Acquire>;

    /// Whether the store spreads keys over nodes by their Redis hash slot (a Redis Cluster),
    /// where a `{hash tag}` in the prefix would put every key on one node.
    fn spreads_by_hash_slot(&self) -> bool {
        false
    }

    /// Whether this process hears every process's releases (a message that may still be
    /// lost, at a reconnection): then a waiter in line does not poll a hold that kept it
    /// out before that hold ends. Not so on one Redis without a subscription
    /// (`Redis::pool` without `wakeups`) or PostgreSQL without a listener.
    fn announces_releases(&self) -> bool {
        false
    }

    /// Whether [`probe`](Self::probe) costs a waiter less than an attempt of its whole
    /// batch: then a refusal names every key that kept the batch out (up to
    /// [`AcquireRequest::report`]), for the waiter to probe those alone.
    fn probes(&self) -> bool {
        false
    }

    /// Whether a woken waiter of `keys` keys may try its batch at once, without a probe
    /// first (when one key alone still kept it out, or its batch is small): where no
    /// refusal of its own wakes the waiter (a refused attempt granted in part and rolled
    /// back must not name its waiter in the roll-back's wake-ups, or the waiter would take
    /// that wake for its turn), and a refused retry of a small batch costs about what a
    /// probe does.
    fn whole_attempts(&self, keys: usize) -> bool {
        let _ = keys;
        false
    }

    /// How many keys of `request`, from the first, would not keep it out now (every one of
    /// them: try the batch); changes nothing. The keys are those that kept an earlier
    /// attempt out: a waiter probes them when it wakes, and tries its whole batch again
    /// only once none of them keeps it out, so that its retries cost in proportion to what
    /// blocked it, not to its batch. A store that [`probes`](Self::probes) stops at the
    /// first key that still keeps it out; the default (which costs nothing, for a store
    /// whose attempts are cheap) says that all are free.
    fn probe<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, usize> {
        Box::pin(std::future::ready(Ok(request.keys.len())))
    }

    /// [`acquire`](Self::acquire)'s answer without a future, from a store that has it at
    /// once (the memory store); `None` from one that must be asked over the network. The
    /// request path takes its first attempt this way where it can: a boxed future for an
    /// answer that is already there costs more than the rest of the attempt. `now` is
    /// when the attempt started, which a store that keeps time in this process counts
    /// the TTL from.
    fn acquire_now(&self, _request: &AcquireRequest, _now: Instant) -> Option<Acquire> {
        None
    }

    /// Extends `holder`'s hold on every key (only that hold, where the key is shared) to at
    /// least `ttl` from now if every key still has it; otherwise changes nothing and
    /// returns `false`: the lease is lost.
    fn extend<'a>(&'a self, keys: &'a Keys, holder: Holder, ttl: Duration) -> Reply<'a, bool>;

    /// Ends `holder`'s hold on the keys that still have it, and returns how many had it.
    /// A key is deleted with its last hold; keys that expired or that another owner took
    /// since are left alone.
    fn release<'a>(&'a self, keys: &'a Keys, holder: Holder) -> Reply<'a, usize>;

    /// [`release`](Self::release)'s answer without a future, as
    /// [`acquire_now`](Self::acquire_now) gives [`acquire`](Self::acquire)'s; `now` is when
    /// the release began.
    fn release_now(&self, _keys: &Keys, _holder: Holder, _now: Instant) -> Option<usize> {
        None
    }

    /// Takes the reservations of the waiter with `ticket` off the keys, and wakes the
    /// waiters they held up. Returns how many keys had one.
    fn withdraw<'a>(&'a self, keys: &'a Keys, ticket: Ticket) -> Reply<'a, usize>;

    /// What the store knows of each key, in the order given, without changing anything.
    fn inspect<'a>(&'a self, keys: &'a Keys) -> Reply<'a, Vec<KeyView>>;

    /// Ends every hold on the keys, whoever has it, and wakes the waiters they kept out;
    /// waiters' reservations stay. Foreign values are left alone. Returns how many keys
    /// were held. For [`Locks::force_release`](crate::Locks::force_release) only: it takes
    /// the keys from under their holders.
    fn force_release<'a>(&'a self, keys: &'a Keys) -> Reply<'a, usize>;

    /// Whether the store can serve locks: it answers, and has what the locks need.
    fn check(&self) -> Reply<'_, ()>;

    /// How much sooner than `ttl` after an acquisition or extension was sent its lease must
    /// be taken as over: an allowance for the stores' clocks running at different rates.
    /// None for a single store, whose own clock is the only one that counts.
    fn drift(&self, _ttl: Duration) -> Duration {
        Duration::ZERO
    }

    /// Where waiters learn of releases: this process's own, and, where the store can tell,
    /// other processes' too.
    fn wakeups(&self) -> &Wakeups;
}

/// Where the idempotency layer keeps its answers: on the same store as the locks, apart
/// from them (the keys are whole store keys, namespaced by the layer, never lock keys).
#[cfg(feature = "idempotency")]
pub(crate) trait AnswerStore: fmt::Debug + Send + Sync + 'static {
    /// The answer that [`store_answer`](Self::store_answer) keeps under `key`, if it is
    /// still there.
    fn load_answer<'a>(&'a self, key: &'a str) -> Reply<'a, Option<Bytes>>;

    /// Keeps `answer` unless an answer is there already: the first answer stays. Returns
    /// whether this one is now the stored answer.
    fn store_answer<'a>(&'a self, answer: &'a StoredAnswer) -> Reply<'a, bool>;
}

/// An answer for the idempotency layer to keep: under `key`, a whole store key, for
/// `retention`. Cheap to clone into the tasks of a store of several nodes.
#[cfg(feature = "idempotency")]
#[derive(Debug, Clone)]
pub(crate) struct StoredAnswer {
    pub(crate) key: Arc<str>,
    pub(crate) bytes: Bytes,
    pub(crate) retention: Duration,
}

// `Contention::merge` serves the stores over several Redis nodes.
#[cfg(all(test, feature = "redis"))]
mod tests {
    use super::*;

    fn contention(keys: &[&str], total: usize, earliest: Option<u64>) -> Contention {
        Contention {
            keys: keys.iter().map(|&k| k.to_owned()).collect(),
            total,
            earliest_expiry: earliest.map(Duration::from_millis),
            upgrade: false,
            may_reserve_later: false,
            counted: true,
        }
    }

    #[test]
    fn refusals_merge_into_one_contention() {
        let refusals = || {
            vec![
                contention(&["lock:b", "lock:c"], 2, Some(900)),
                contention(&["lock:a", "lock:b"], 3, None),
                contention(&["lock:d"], 1, Some(400)),
            ]
        };
        let merged = Contention::merge(refusals(), 3, true);
        assert_eq!(merged.keys, ["lock:a", "lock:b", "lock:c"]);
        assert_eq!(merged.total, 3);
        assert_eq!(merged.earliest_expiry, Some(Duration::from_millis(400)));
        // Parts of one batch: each counted its own keys.
        assert_eq!(Contention::merge(refusals(), 3, false).total, 6);
    }
}
