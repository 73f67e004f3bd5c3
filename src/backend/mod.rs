//! Where locks live: one trait, one implementation per store.
//!
//! A backend locks a whole batch or nothing, and releases only the keys that still hold
//! the caller's owner token. Keys arrive normalized (prefixed, sorted, deduplicated), so a
//! backend never parses or namespaces them itself.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

#[cfg(feature = "idempotency")]
use bytes::Bytes;
use uuid::Uuid;

#[cfg(feature = "cluster")]
pub(crate) mod cluster;
pub(crate) mod memory;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "redis")]
pub(crate) mod redlock;
pub(crate) mod wake;

use crate::FencingToken;
use wake::Wakeups;

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

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

/// A waiter's place in line: smaller is earlier. Reservations of a waiter keep out every
/// request with a larger ticket, and every request that waits in no line at all.
///
/// Tickets are milliseconds of the wall clock (since 2025, so that they stay exact in the
/// doubles of Redis's Lua) with 10 random bits below them, and strictly increase within a
/// process. Across processes they order waiters by arrival as far as the machines' clocks
/// agree; a skew only reorders waiters that arrived that close together, and since a
/// waiter keeps its ticket, every waiter is eventually the earliest: none starves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Ticket(u64);

impl Ticket {
    /// The ticket of a waiter that arrives now.
    pub(crate) fn take() -> Self {
        /// 2025-01-01T00:00:00Z.
        const EPOCH_SECS: u64 = 1_735_689_600;
        static LAST: AtomicU64 = AtomicU64::new(0);
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
            .saturating_sub(EPOCH_SECS * 1000);
        let drawn = (ms << 10) | fastrand::u64(..1024);
        let previous = LAST
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                Some(drawn.max(last + 1))
            })
            .unwrap_or_default();
        Self(drawn.max(previous + 1))
    }

    /// The ticket as the lock store compares it.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn get(self) -> u64 {
        self.0
    }
}

/// Where an acquisition stands with respect to waiters' reservations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Line {
    /// In no line (a request that does not wait, or waits without fairness): kept out by
    /// every live reservation, and reserves nothing.
    Outside,
    /// A waiter in line: kept out by the reservations of earlier tickets, and, when kept
    /// out, reserves its whole batch.
    At(Ticket),
    /// An owner that already holds keys (a nested layer, a handler's `Lease::lock`, a
    /// trusted caller's owner): kept out by no reservation, and reserves nothing. It came
    /// before every waiter that its holds keep waiting, and making it wait for them would
    /// deadlock.
    Holder,
}

impl Line {
    /// Whether a live reservation with `ticket` keeps this acquisition out.
    pub(crate) fn kept_out_by(self, ticket: Ticket) -> bool {
        match self {
            Self::Outside => true,
            Self::At(mine) => ticket < mine,
            Self::Holder => false,
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
    /// was locked; a caller with a ticket now has its reservation on every key of the batch.
    Held(Contention),
}

/// The keys that stopped a batch.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Contention {
    /// Up to the requested number of conflicting keys, as stored (with the prefix): held by
    /// another owner, or reserved by an earlier waiter.
    pub(crate) keys: Vec<String>,
    /// How many keys of the batch are held by others in all.
    pub(crate) total: usize,
    /// Time until the earliest of the conflicting keys expires, when the store knows it.
    pub(crate) earliest_expiry: Option<Duration>,
}

/// What a store knows of one key, for an operator ([`Backend::inspect`]): never who holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyView {
    pub(crate) status: crate::KeyStatus,
    /// Time left on the key's holds (or on a foreign value's ttl), when held.
    pub(crate) ttl: Option<Duration>,
    /// How many holds the key has: more than one when its owner re-entered it.
    pub(crate) holds: usize,
    /// How many live reservations of waiters in line are on the key.
    pub(crate) waiters: usize,
}

impl KeyView {
    /// A key nobody holds or reserves.
    pub(crate) const FREE: Self = Self {
        status: crate::KeyStatus::Free,
        ttl: None,
        holds: 0,
        waiters: 0,
    };
}

/// A lock store that could not answer.
#[derive(Debug)]
pub(crate) struct BackendError {
    /// Whether the store may have carried out the command before failing, so that the
    /// caller has to clean up after itself.
    pub(crate) may_have_applied: bool,
    source: Box<dyn std::error::Error + Send + Sync>,
}

// The memory store never fails, so without the `redis` feature nothing builds these.
impl BackendError {
    /// The command never reached the store (for example, no connection could be made).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn not_sent(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self {
            may_have_applied: false,
            source: source.into(),
        }
    }

    /// The command was sent, and its effect is unknown.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn unknown(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self {
            may_have_applied: true,
            source: source.into(),
        }
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lock store error: {}", self.source)
    }
}

impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// A lock store. Every call takes the whole batch, so each costs one round trip.
pub(crate) trait Backend: fmt::Debug + Send + Sync + 'static {
    /// Locks every key for `ttl` under a new hold, or none of them: a key held only by
    /// `holder`'s owner is entered again, and keeps the longer of its ttl and `ttl`.
    /// `report` bounds how many conflicting keys a [`Contention`] names.
    ///
    /// A key that nobody holds but a waiter reserved conflicts as `line` says
    /// ([`Line::kept_out_by`]); a key that `holder`'s owner holds never does. When the
    /// batch conflicts and the caller waits in line ([`Line::At`]), its reservation is put
    /// on (or renewed on) every key of the batch, for
    /// [`Wait::RESERVATION_TTL`](crate::Wait::RESERVATION_TTL); when it is granted, its
    /// reservations on the batch are gone.
    ///
    /// A grant carries a fencing token larger than that of every earlier grant in the
    /// same `namespace` (the key prefix), so larger than every earlier grant of any of
    /// these keys. (Redlock promises less: larger than every earlier grant that shares a
    /// key, while no master loses its counter; see `Redlock`.)
    fn acquire<'a>(
        &'a self,
        namespace: &'a str,
        keys: &'a [String],
        holder: Holder,
        ttl: Duration,
        report: usize,
        line: Line,
    ) -> BoxFuture<'a, Result<Acquire, BackendError>>;

    /// Extends every key to at least `ttl` from now if every key still has `holder`'s
    /// hold; otherwise changes nothing and returns `false`: the lease is lost.
    fn extend<'a>(
        &'a self,
        keys: &'a [String],
        holder: Holder,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, BackendError>>;

    /// Ends `holder`'s hold on the keys that still have it, and returns how many had it.
    /// A key is deleted with its last hold; keys that expired or that another owner took
    /// since are left alone.
    fn release<'a>(
        &'a self,
        keys: &'a [String],
        holder: Holder,
    ) -> BoxFuture<'a, Result<usize, BackendError>>;

    /// Takes the reservations of the waiter with `ticket` off the keys, and wakes the
    /// waiters they held up. Returns how many keys had one.
    fn withdraw<'a>(
        &'a self,
        keys: &'a [String],
        ticket: Ticket,
    ) -> BoxFuture<'a, Result<usize, BackendError>>;

    /// What the store knows of each key, in the order given, without changing anything.
    fn inspect<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<KeyView>, BackendError>>;

    /// Ends every hold on the keys, whoever has it, and wakes the waiters they kept out;
    /// waiters' reservations stay. Foreign values are left alone. Returns how many keys
    /// were held. For [`Locks::force_release`](crate::Locks::force_release) only: it takes
    /// the keys from under their holders.
    fn force_release<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<usize, BackendError>>;

    /// The answer that [`store_answer`](Self::store_answer) keeps under `key`, if it is
    /// still there. For the idempotency layer: `key` is a whole store key (namespaced by
    /// the layer), never a lock key.
    #[cfg(feature = "idempotency")]
    fn load_answer<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Bytes>, BackendError>>;

    /// Keeps `answer` under `key` for `retention`, unless an answer is there already: the
    /// first answer stays. Returns whether this one is now the stored answer.
    #[cfg(feature = "idempotency")]
    fn store_answer<'a>(
        &'a self,
        key: &'a str,
        answer: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, BackendError>>;

    /// Whether the store can serve locks: it answers, and has what the locks need.
    fn check(&self) -> BoxFuture<'_, Result<(), BackendError>>;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_strictly_increase_and_stay_exact_in_luas_doubles() {
        let tickets: Vec<Ticket> = (0..10_000).map(|_| Ticket::take()).collect();
        assert!(tickets.windows(2).all(|w| w[0] < w[1]));
        // Redis's Lua compares them as doubles: exact below 2^53.
        assert!(tickets.iter().all(|t| t.get() > 0 && t.get() < 1 << 53));
    }
}
