//! Locks in this process's memory, with the same semantics as the Redis stores.

use std::{
    hash::{BuildHasher, RandomState},
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, Instant},
};

#[cfg(feature = "idempotency")]
use bytes::Bytes;
use hashbrown::HashTable;
use smallvec::SmallVec;

#[cfg(feature = "idempotency")]
use super::contract::{AnswerStore, StoredAnswer};
use super::{
    contract::{
        Acquire, AcquireRequest, Contention, FencingToken, Holder, KeyStatus, KeyView, Keys, Line,
        LockStore, Mode, Reply, Ticket,
    },
    wake::Wakeups,
};
#[cfg(feature = "idempotency")]
use answers::Answers;
use entry::{Block, Entry, Holds};

#[cfg(feature = "idempotency")]
mod answers;
mod entry;

/// Enough shards that small batches on different keys rarely share a mutex on two cores
/// or twenty, few enough that a batch of thousands locks them all cheaply.
const SHARDS: usize = 64;

/// A shard sweeps its expired entries when it has grown to this many, and then again
/// whenever it has doubled since the last sweep, so sweeping stays amortized O(1).
const FIRST_SWEEP_AT: usize = 1024;

pub(crate) struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    /// SipHash with a random key, as `std`'s maps: the keys come from requests, and a
    /// client that could make them collide could make every lookup slow.
    hasher: RandomState,
    /// The last fencing token granted. One counter for the whole store: strictly
    /// increasing across all grants, so across every grant that shares a key. It starts at
    /// the clock's floor ([`FencingToken::clock_floor`]), so that a store made later (after
    /// the process restarted) starts above every token this one handed out, as long as it
    /// counted fewer than 1024 grants a millisecond on average. Flooring the start only
    /// costs a grant nothing: a memory store loses its counter with the process alone.
    fence: AtomicU64,
    wakeups: Wakeups,
    /// The idempotency layer's stored answers.
    #[cfg(feature = "idempotency")]
    answers: Mutex<Answers>,
}

/// The hashes of a batch's keys, one per key, in order: each key is hashed once per call,
/// and its hash picks its shard and finds it in the shard's table.
type Hashes = SmallVec<[u64; 4]>;

#[derive(Debug, Default)]
struct Shard {
    /// Each entry with its key and the key's hash: a table rather than a map, so that a
    /// key's hash, taken once, serves its shard, its lookup and its insert, where a map
    /// hashes the key again for each.
    entries: HashTable<Keyed>,
    sweep_at: usize,
}

/// An entry of a shard's table, with its key, and the key's hash for when the table grows.
#[derive(Debug)]
struct Keyed {
    key: String,
    hash: u64,
    entry: Entry,
}

impl std::fmt::Debug for MemoryStore {
    // By hand: the derived form would print every lock held.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

impl MemoryStore {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            fence: AtomicU64::new(FencingToken::clock_floor()),
            wakeups: Wakeups::new(),
            #[cfg(feature = "idempotency")]
            answers: Mutex::default(),
        }
    }

    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    fn hashes(&self, keys: &[String]) -> Hashes {
        keys.iter().map(|key| self.hash(key)).collect()
    }

    /// Locks the shards of the keys of `hashes` in ascending order (every batch takes them
    /// in the same order, so two batches never wait on each other).
    fn lock_shards(&self, hashes: &[u64]) -> LockedShards<'_> {
        // A panic cannot leave a shard half-written (every write is one insert or remove),
        // so a poisoned shard is still consistent.
        let lock = |slot: usize| {
            self.shards[slot]
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        match hashes {
            [first, rest @ ..] if rest.iter().all(|&hash| shard_of(hash) == shard_of(*first)) => {
                LockedShards::One(shard_of(*first), lock(shard_of(*first)))
            }
            _ => {
                let mut wanted = [false; SHARDS];
                for &hash in hashes {
                    wanted[shard_of(hash)] = true;
                }
                let locked = (0..SHARDS).map(|slot| wanted[slot].then(|| lock(slot)));
                LockedShards::Many(locked.collect())
            }
        }
    }

    /// One attempt at `now`.
    fn try_acquire(&self, request: &AcquireRequest, now: Instant) -> Acquire {
        let AcquireRequest {
            keys,
            modes,
            holder,
            ttl,
            report,
            line,
            reserve,
            ..
        } = request;
        let (holder, line) = (*holder, *line);
        let hashes = self.hashes(keys);
        let mut shards = self.lock_shards(&hashes);
        // Check every key before writing any, so a refused batch locks nothing.
        let mut contention = Contention {
            keys: Vec::new(),
            total: 0,
            earliest_expiry: None,
            upgrade: false,
            may_reserve_later: false,
            counted: true,
        };
        for (index, (key, &hash)) in keys.iter().zip(&hashes).enumerate() {
            let Some(entry) = shards.get(hash).get(key, hash) else {
                continue;
            };
            let Some(block) = entry.blocks(holder.owner, modes.at(index), line, now) else {
                continue;
            };
            contention.total += 1;
            contention.upgrade |= block == Block::Upgrade;
            if contention.keys.len() < *report {
                contention.keys.push(key.clone());
            }
            if let Some(until) = entry.holds.as_ref().and_then(|h| h.expires_at(now)) {
                let left = until - now;
                contention.earliest_expiry =
                    Some(contention.earliest_expiry.map_or(left, |e| e.min(left)));
            }
        }
        if contention.total > 0 {
            // A waiter in line reserves the whole batch against later arrivals.
            if let Line::At(ticket) = line {
                let until = now + *reserve;
                for (key, &hash) in keys.iter().zip(&hashes) {
                    shards
                        .get(hash)
                        .entry(key, hash)
                        .reserve(ticket, until, now);
                }
            }
            return Acquire::Held(contention);
        }

        let expires_at = now + *ttl;
        // The waiters next in line on the keys granted shared: the next one may be a
        // reader too, and come in beside this one.
        let mut readers_next: SmallVec<[u128; 2]> = SmallVec::new();
        for (index, (key, &hash)) in keys.iter().zip(&hashes).enumerate() {
            let entry = shards.get(hash).entry(key, hash);
            if let Line::At(ticket) = line {
                entry.withdraw(ticket, now);
            }
            let mode = modes.at(index);
            entry.grant(holder, mode, expires_at, now);
            if mode == Mode::Shared {
                readers_next.extend(entry.next_in(now).map(Ticket::key));
            }
        }
        shards.sweep_if_grown(now);
        // Taken while the shards are still locked, so a later grant of any of these keys,
        // which must wait for the shards, gets a larger token.
        let fence = self.fence.fetch_add(1, Ordering::SeqCst) + 1;
        drop(shards);
        if !readers_next.is_empty() {
            self.wakeups.wake_tickets(readers_next);
        }
        Acquire::Granted(FencingToken::new(fence))
    }

    fn try_extend(&self, keys: &[String], holder: Holder, ttl: Duration) -> bool {
        let hashes = self.hashes(keys);
        let mut shards = self.lock_shards(&hashes);
        let now = Instant::now();
        let held = keys.iter().zip(&hashes).all(|(key, &hash)| {
            shards
                .get(hash)
                .get(key, hash)
                .is_some_and(|e| e.held_by(holder, now))
        });
        if held {
            let until = now + ttl;
            for (key, &hash) in keys.iter().zip(&hashes) {
                let entry = shards.get(hash).get_mut(key, hash);
                match entry.and_then(|e| e.holds.as_mut()) {
                    Some(Holds::Exclusive { expires_at, .. }) => {
                        *expires_at = (*expires_at).max(until);
                    }
                    // Only this hold: the other readers' stand on their own.
                    Some(Holds::Shared(holds)) => {
                        for (_, expires_at) in holds.iter_mut().filter(|(h, _)| *h == holder) {
                            *expires_at = (*expires_at).max(until);
                        }
                    }
                    None => {}
                }
            }
        }
        held
    }

    fn release_owned(&self, keys: &[String], holder: Holder, now: Instant) -> usize {
        // Release needs no cross-shard atomicity: a competitor that sees some keys free
        // and others still held is refused, which is what it would see a moment earlier.
        let released = self.each_entry(keys, now, |entry| {
            let (had, left) = match &mut entry.holds {
                Some(Holds::Exclusive {
                    owner,
                    holds,
                    expires_at,
                }) if *owner == holder.owner => {
                    let at = holds.iter().position(|&(h, _)| h == holder.hold);
                    if let Some(at) = at {
                        holds.swap_remove(at);
                    }
                    let (owner, left) = (*owner, holds.len());
                    // Its last exclusive hold ended: the owner's shared holds under it are
                    // shared ones again, until the key's end, and other readers may come in.
                    if left > 0 && holds.iter().all(|&(_, mode)| mode == Mode::Shared) {
                        let until = *expires_at;
                        let readers = holds
                            .iter()
                            .map(|&(hold, _)| (Holder { owner, hold }, until))
                            .collect();
                        entry.holds = Some(Holds::Shared(readers));
                    }
                    (at.is_some(), left)
                }
                Some(Holds::Shared(holds)) => {
                    let had = holds.iter().any(|&(h, _)| h == holder);
                    holds.retain(|&(h, until)| h != holder && until > now);
                    (had, holds.len())
                }
                _ => return false,
            };
            if left == 0 {
                entry.holds = None;
            }
            had
        });
        released
    }

    fn withdraw_reservations(&self, keys: &[String], ticket: Ticket) -> usize {
        let now = Instant::now();
        // Requests that only this waiter kept out may go now.
        self.each_entry(keys, now, |entry| entry.withdraw(ticket, now))
    }

    /// What each key looks like now, seen all at once (every shard of the batch locked).
    fn view(&self, keys: &[String]) -> Vec<KeyView> {
        let hashes = self.hashes(keys);
        let mut shards = self.lock_shards(&hashes);
        let now = Instant::now();
        keys.iter()
            .zip(&hashes)
            .map(|(key, &hash)| {
                let Some(entry) = shards.get(hash).get(key, hash) else {
                    return KeyView::FREE;
                };
                let waiters = entry.queue.iter().filter(|r| r.until > now).count();
                let Some(holds) = entry.live(now) else {
                    return KeyView {
                        waiters,
                        ..KeyView::FREE
                    };
                };
                let (status, count) = match holds {
                    Holds::Exclusive { holds, .. } => (KeyStatus::Held, holds.len()),
                    Holds::Shared(holds) => (
                        KeyStatus::Shared,
                        holds.iter().filter(|&&(_, until)| until > now).count(),
                    ),
                };
                KeyView {
                    status,
                    ttl: holds.expires_at(now).map(|until| until - now),
                    holds: count,
                    waiters,
                }
            })
            .collect()
    }

    /// Ends every live hold on the keys, and wakes the waiters they kept out.
    fn release_all(&self, keys: &[String]) -> usize {
        let now = Instant::now();
        let released = self.each_entry(keys, now, |entry| {
            let held = entry.live(now).is_some();
            entry.holds = None;
            held
        });
        released
    }

    /// Changes the entry of each key that has one, shard by shard, dropping entries left
    /// with neither a live hold nor a live reservation; counts the changes that `change`
    /// reports, and wakes the waiters they may let in: on each key changed, the first in
    /// line, unless the key is still held exclusively (see [`Wakeups`]), and the waiters
    /// in no line that watch the keys.
    fn each_entry(
        &self,
        keys: &[String],
        now: Instant,
        mut change: impl FnMut(&mut Entry) -> bool,
    ) -> usize {
        let mut changed = 0;
        // Without an allocation unless several keys have waiters in line.
        let mut heads: SmallVec<[u128; 2]> = SmallVec::new();
        for key in keys {
            let hash = self.hash(key);
            let mut shard = self.shards[shard_of(hash)]
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let Ok(mut found) = shard.entries.find_entry(hash, |k| k.key == *key) else {
                continue;
            };
            let entry = &mut found.get_mut().entry;
            if change(entry) {
                changed += 1;
                if let Some(head) = entry.next_in(now) {
                    heads.push(head.key());
                }
            }
            if !entry.in_use(now) {
                found.remove();
            }
        }
        self.wakeups.wake_keys(keys);
        if !heads.is_empty() {
            self.wakeups.wake_tickets(heads);
        }
        changed
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                s.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entries
                    .len()
            })
            .sum()
    }
}

/// The shards [`MemoryStore::lock_shards`] locked for a batch.
enum LockedShards<'a> {
    /// Every key is in this one: a request of one key, without an allocation.
    One(usize, MutexGuard<'a, Shard>),
    /// Indexed by shard number.
    Many(Vec<Option<MutexGuard<'a, Shard>>>),
}

impl LockedShards<'_> {
    /// The shard of the key of `hash`, one of the batch's.
    fn get(&mut self, hash: u64) -> &mut Shard {
        let slot = shard_of(hash);
        let shard = match self {
            Self::One(one, shard) => (*one == slot).then_some(shard),
            Self::Many(shards) => shards[slot].as_mut(),
        };
        shard.expect("every shard of the batch is locked")
    }

    /// [`Shard::sweep_if_grown`] on each.
    fn sweep_if_grown(&mut self, now: Instant) {
        match self {
            Self::One(_, shard) => shard.sweep_if_grown(now),
            Self::Many(shards) => shards
                .iter_mut()
                .flatten()
                .for_each(|shard| shard.sweep_if_grown(now)),
        }
    }
}

/// The shard of the key of `hash`: from bits that the shard's table does not read, so that
/// the keys of one shard still spread over its table. hashbrown takes a key's bucket from
/// the low bits of its hash (as many as it takes to count its buckets: fewer than 32 below
/// four billion buckets) and its control byte from the top seven.
fn shard_of(hash: u64) -> usize {
    (hash >> 32) as usize % SHARDS
}

impl Shard {
    /// The entry of `key`, whose hash is `hash`.
    fn get(&self, key: &str, hash: u64) -> Option<&Entry> {
        let found = self.entries.find(hash, |k| k.key == key);
        found.map(|k| &k.entry)
    }

    fn get_mut(&mut self, key: &str, hash: u64) -> Option<&mut Entry> {
        let found = self.entries.find_mut(hash, |k| k.key == key);
        found.map(|k| &mut k.entry)
    }

    /// The entry of `key`, a new one if it has none.
    fn entry(&mut self, key: &str, hash: u64) -> &mut Entry {
        let found = self
            .entries
            .entry(hash, |k| k.key == key, |k| k.hash)
            .or_insert_with(|| Keyed {
                key: key.to_owned(),
                hash,
                entry: Entry::default(),
            });
        &mut found.into_mut().entry
    }

    /// Drops expired entries that nobody released or withdrew (their holder or waiter
    /// crashed, or its release was lost), so that the map does not grow without bound.
    fn sweep_if_grown(&mut self, now: Instant) {
        if self.entries.len() >= self.sweep_at.max(FIRST_SWEEP_AT) {
            self.entries.retain(|k| k.entry.in_use(now));
            self.sweep_at = self.entries.len() * 2;
        }
    }
}

impl LockStore for MemoryStore {
    /// Its releases wake this process's waiters, and there is no other.
    fn announces_releases(&self) -> bool {
        true
    }

    fn acquire<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, Acquire> {
        Box::pin(std::future::ready(Ok(
            self.try_acquire(request, Instant::now())
        )))
    }

    fn acquire_now(&self, request: &AcquireRequest, now: Instant) -> Option<Acquire> {
        Some(self.try_acquire(request, now))
    }

    fn extend<'a>(&'a self, keys: &'a Keys, holder: Holder, ttl: Duration) -> Reply<'a, bool> {
        Box::pin(std::future::ready(Ok(self.try_extend(keys, holder, ttl))))
    }

    fn release<'a>(&'a self, keys: &'a Keys, holder: Holder) -> Reply<'a, usize> {
        let released = self.release_owned(keys, holder, Instant::now());
        Box::pin(std::future::ready(Ok(released)))
    }

    fn release_now(&self, keys: &Keys, holder: Holder, now: Instant) -> Option<usize> {
        Some(self.release_owned(keys, holder, now))
    }

    fn withdraw<'a>(&'a self, keys: &'a Keys, ticket: Ticket) -> Reply<'a, usize> {
        let withdrawn = self.withdraw_reservations(keys, ticket);
        Box::pin(std::future::ready(Ok(withdrawn)))
    }

    fn check(&self) -> Reply<'_, ()> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn inspect<'a>(&'a self, keys: &'a Keys) -> Reply<'a, Vec<KeyView>> {
        Box::pin(std::future::ready(Ok(self.view(keys))))
    }

    fn force_release<'a>(&'a self, keys: &'a Keys) -> Reply<'a, usize> {
        Box::pin(std::future::ready(Ok(self.release_all(keys))))
    }

    fn wakeups(&self) -> &Wakeups {
        &self.wakeups
    }
}

#[cfg(feature = "idempotency")]
impl AnswerStore for MemoryStore {
    fn load_answer<'a>(&'a self, key: &'a str) -> Reply<'a, Option<Bytes>> {
        let answer = self.answers().load(key, Instant::now());
        Box::pin(std::future::ready(Ok(answer)))
    }

    fn store_answer<'a>(&'a self, answer: &'a StoredAnswer) -> Reply<'a, bool> {
        let (bytes, now) = (answer.bytes.clone(), Instant::now());
        let stored = self
            .answers()
            .store(&answer.key, bytes, answer.retention, now);
        Box::pin(std::future::ready(Ok(stored)))
    }
}

#[cfg(feature = "idempotency")]
impl MemoryStore {
    fn answers(&self) -> MutexGuard<'_, Answers> {
        // Every change is one map operation: a poisoned table is still whole.
        self.answers.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
pub(crate) mod intercept;
#[cfg(test)]
mod tests;
