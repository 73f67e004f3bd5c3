//! Locks in this process's memory, with the same semantics as the Redis backend.

use std::{
    collections::HashMap,
    hash::BuildHasher,
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, Instant},
};

#[cfg(feature = "idempotency")]
use bytes::Bytes;

use super::{
    wake::{slots_of, Wakeups},
    Acquire, Backend, BackendError, BoxFuture, Contention, Holder, KeyView, Line, OwnerToken,
    Ticket,
};
use crate::{FencingToken, KeyStatus, Wait};

/// Enough shards that small batches on different keys rarely share a mutex on two cores
/// or twenty, few enough that a batch of thousands locks them all cheaply.
const SHARDS: usize = 64;

/// A shard sweeps its expired entries when it has grown to this many, and then again
/// whenever it has doubled since the last sweep, so sweeping stays amortized O(1).
const FIRST_SWEEP_AT: usize = 1024;

pub(crate) struct MemoryBackend {
    shards: Box<[Mutex<Shard>]>,
    hasher: std::hash::RandomState,
    /// The last fencing token granted. One counter for the whole store: strictly
    /// increasing across all grants, so across every grant that shares a key.
    fence: AtomicU64,
    wakeups: Wakeups,
    /// The idempotency layer's stored answers.
    #[cfg(feature = "idempotency")]
    answers: Mutex<Answers>,
}

#[derive(Debug, Default)]
struct Shard {
    entries: HashMap<String, Entry>,
    sweep_at: usize,
}

/// A key's holds, and the reservations of the waiters that want it.
#[derive(Debug, Default)]
struct Entry {
    holds: Option<Holds>,
    /// Waiters' reservations, earliest ticket first.
    queue: Vec<Reservation>,
}

#[derive(Debug)]
struct Holds {
    owner: OwnerToken,
    /// The owner's holds on the key: it is free when the last one is released.
    holds: Vec<u64>,
    expires_at: Instant,
}

#[derive(Debug, Clone, Copy)]
struct Reservation {
    ticket: Ticket,
    until: Instant,
}

impl Entry {
    /// The live holds, if any.
    fn live(&self, now: Instant) -> Option<&Holds> {
        self.holds.as_ref().filter(|h| h.expires_at > now)
    }

    /// Whether the key keeps out `owner`, standing in `line`: held by someone else, or,
    /// unless `owner` holds it, reserved by a waiter that `line` must let go first.
    fn blocks(&self, owner: OwnerToken, line: Line, now: Instant) -> bool {
        match self.live(now) {
            Some(holds) => holds.owner != owner,
            None => self
                .queue
                .iter()
                .any(|r| r.until > now && line.kept_out_by(r.ticket)),
        }
    }

    /// Still held, by this hold.
    fn held_by(&self, holder: Holder, now: Instant) -> bool {
        self.live(now)
            .is_some_and(|h| h.owner == holder.owner && h.holds.contains(&holder.hold))
    }

    /// Puts `ticket`'s reservation in line (or renews it), dropping expired ones.
    fn reserve(&mut self, ticket: Ticket, until: Instant, now: Instant) {
        self.queue.retain(|r| r.until > now && r.ticket != ticket);
        let at = self.queue.partition_point(|r| r.ticket < ticket);
        self.queue.insert(at, Reservation { ticket, until });
    }

    /// Takes `ticket`'s reservation out of line; whether it was there.
    fn withdraw(&mut self, ticket: Ticket, now: Instant) -> bool {
        let had = self.queue.iter().any(|r| r.ticket == ticket);
        self.queue.retain(|r| r.until > now && r.ticket != ticket);
        had
    }

    /// Whether the entry still means anything: a live hold or a live reservation.
    fn in_use(&self, now: Instant) -> bool {
        self.live(now).is_some() || self.queue.iter().any(|r| r.until > now)
    }
}

impl std::fmt::Debug for MemoryBackend {
    // By hand: the derived form would print every lock held.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

impl MemoryBackend {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: std::hash::RandomState::new(),
            fence: AtomicU64::new(0),
            wakeups: Wakeups::new(),
            #[cfg(feature = "idempotency")]
            answers: Mutex::default(),
        }
    }

    fn shard_of(&self, key: &str) -> usize {
        (self.hasher.hash_one(key) % SHARDS as u64) as usize
    }

    /// Locks the shards of `slots` in ascending order (every batch takes them in the same
    /// order, so two batches never wait on each other), indexed by shard number.
    fn lock_shards(&self, slots: &[usize]) -> Vec<Option<MutexGuard<'_, Shard>>> {
        let mut wanted = [false; SHARDS];
        for &slot in slots {
            wanted[slot] = true;
        }
        (0..SHARDS)
            // A panic cannot leave a shard half-written (every write is one insert or
            // remove), so a poisoned shard is still consistent.
            .map(|i| {
                wanted[i].then(|| {
                    self.shards[i]
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                })
            })
            .collect()
    }

    fn try_acquire(
        &self,
        keys: &[String],
        holder: Holder,
        ttl: Duration,
        report: usize,
        line: Line,
    ) -> Acquire {
        let slots: Vec<usize> = keys.iter().map(|k| self.shard_of(k)).collect();
        let mut shards = self.lock_shards(&slots);
        let now = Instant::now();
        // Check every key before writing any, so a refused batch locks nothing.
        let mut contention = Contention {
            keys: Vec::new(),
            total: 0,
            earliest_expiry: None,
        };
        for (key, &slot) in keys.iter().zip(&slots) {
            let Some(entry) = locked(&mut shards, slot).entries.get(key.as_str()) else {
                continue;
            };
            if entry.blocks(holder.owner, line, now) {
                contention.total += 1;
                if contention.keys.len() < report {
                    contention.keys.push(key.clone());
                }
                if let Some(holds) = entry.live(now) {
                    let left = holds.expires_at - now;
                    contention.earliest_expiry =
                        Some(contention.earliest_expiry.map_or(left, |e| e.min(left)));
                }
            }
        }
        if contention.total > 0 {
            // A waiter in line reserves the whole batch against later arrivals.
            if let Line::At(ticket) = line {
                let until = now + Wait::RESERVATION_TTL;
                for (key, &slot) in keys.iter().zip(&slots) {
                    let entries = &mut locked(&mut shards, slot).entries;
                    entries
                        .entry(key.clone())
                        .or_default()
                        .reserve(ticket, until, now);
                }
            }
            return Acquire::Held(contention);
        }

        let expires_at = now + ttl;
        for (key, &slot) in keys.iter().zip(&slots) {
            let entry = locked(&mut shards, slot)
                .entries
                .entry(key.clone())
                .or_default();
            if let Line::At(ticket) = line {
                entry.withdraw(ticket, now);
            }
            match &mut entry.holds {
                // The owner's own, still live: enter it again, never shortening it.
                Some(holds) if holds.expires_at > now => {
                    holds.holds.push(holder.hold);
                    holds.expires_at = holds.expires_at.max(expires_at);
                }
                _ => {
                    entry.holds = Some(Holds {
                        owner: holder.owner,
                        holds: vec![holder.hold],
                        expires_at,
                    });
                }
            }
        }
        for shard in shards.iter_mut().flatten() {
            shard.sweep_if_grown(now);
        }
        // Taken while the shards are still locked, so a later grant of any of these keys,
        // which must wait for the shards, gets a larger token.
        Acquire::Granted(FencingToken::new(
            self.fence.fetch_add(1, Ordering::SeqCst) + 1,
        ))
    }

    fn try_extend(&self, keys: &[String], holder: Holder, ttl: Duration) -> bool {
        let slots: Vec<usize> = keys.iter().map(|k| self.shard_of(k)).collect();
        let mut shards = self.lock_shards(&slots);
        let now = Instant::now();
        let held = keys.iter().zip(&slots).all(|(key, &slot)| {
            locked(&mut shards, slot)
                .entries
                .get(key.as_str())
                .is_some_and(|e| e.held_by(holder, now))
        });
        if held {
            for (key, &slot) in keys.iter().zip(&slots) {
                let entry = locked(&mut shards, slot).entries.get_mut(key.as_str());
                if let Some(holds) = entry.and_then(|e| e.holds.as_mut()) {
                    holds.expires_at = holds.expires_at.max(now + ttl);
                }
            }
        }
        held
    }

    fn release_owned(&self, keys: &[String], holder: Holder) -> usize {
        // Release needs no cross-shard atomicity: a competitor that sees some keys free
        // and others still held is refused, which is what it would see a moment earlier.
        let now = Instant::now();
        let released = self.each_entry(keys, now, |entry| {
            let Some(holds) = entry.holds.as_mut().filter(|h| h.owner == holder.owner) else {
                return false;
            };
            let Some(at) = holds.holds.iter().position(|&h| h == holder.hold) else {
                return false;
            };
            holds.holds.swap_remove(at);
            if holds.holds.is_empty() {
                entry.holds = None;
            }
            true
        });
        self.wakeups.wake_slots(slots_of(keys));
        released
    }

    fn withdraw_reservations(&self, keys: &[String], ticket: Ticket) -> usize {
        let now = Instant::now();
        let withdrawn = self.each_entry(keys, now, |entry| entry.withdraw(ticket, now));
        // Requests that only this waiter kept out may go now.
        self.wakeups.wake_slots(slots_of(keys));
        withdrawn
    }

    /// What each key looks like now, seen all at once (every shard of the batch locked).
    fn view(&self, keys: &[String]) -> Vec<KeyView> {
        let slots: Vec<usize> = keys.iter().map(|k| self.shard_of(k)).collect();
        let mut shards = self.lock_shards(&slots);
        let now = Instant::now();
        keys.iter()
            .zip(&slots)
            .map(|(key, &slot)| {
                let Some(entry) = locked(&mut shards, slot).entries.get(key.as_str()) else {
                    return KeyView::FREE;
                };
                let waiters = entry.queue.iter().filter(|r| r.until > now).count();
                match entry.live(now) {
                    Some(holds) => KeyView {
                        status: KeyStatus::Held,
                        ttl: Some(holds.expires_at - now),
                        holds: holds.holds.len(),
                        waiters,
                    },
                    None => KeyView {
                        waiters,
                        ..KeyView::FREE
                    },
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
        self.wakeups.wake_slots(slots_of(keys));
        released
    }

    /// Changes the entry of each key that has one, shard by shard, dropping entries left
    /// with neither a live hold nor a live reservation; counts the changes that `change`
    /// reports.
    fn each_entry(
        &self,
        keys: &[String],
        now: Instant,
        mut change: impl FnMut(&mut Entry) -> bool,
    ) -> usize {
        let mut changed = 0;
        for key in keys {
            let mut shard = self.shards[self.shard_of(key)]
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let Some(entry) = shard.entries.get_mut(key.as_str()) else {
                continue;
            };
            if change(entry) {
                changed += 1;
            }
            if !entry.in_use(now) {
                shard.entries.remove(key.as_str());
            }
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

/// The shard `slot` out of the shards [`MemoryBackend::lock_shards`] locked for a batch.
fn locked<'s, 'g>(shards: &'s mut [Option<MutexGuard<'g, Shard>>], slot: usize) -> &'s mut Shard {
    shards[slot]
        .as_deref_mut()
        .expect("every shard of the batch is locked")
}

impl Shard {
    /// Drops expired entries that nobody released or withdrew (their holder or waiter
    /// crashed, or its release was lost), so that the map does not grow without bound.
    fn sweep_if_grown(&mut self, now: Instant) {
        if self.entries.len() >= self.sweep_at.max(FIRST_SWEEP_AT) {
            self.entries.retain(|_, e| e.in_use(now));
            self.sweep_at = self.entries.len() * 2;
        }
    }
}

impl Backend for MemoryBackend {
    fn acquire<'a>(
        &'a self,
        _namespace: &'a str,
        keys: &'a [String],
        holder: Holder,
        ttl: Duration,
        report: usize,
        line: Line,
    ) -> BoxFuture<'a, Result<Acquire, BackendError>> {
        let outcome = self.try_acquire(keys, holder, ttl, report, line);
        Box::pin(std::future::ready(Ok(outcome)))
    }

    fn extend<'a>(
        &'a self,
        keys: &'a [String],
        holder: Holder,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, BackendError>> {
        Box::pin(std::future::ready(Ok(self.try_extend(keys, holder, ttl))))
    }

    fn release<'a>(
        &'a self,
        keys: &'a [String],
        holder: Holder,
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(std::future::ready(Ok(self.release_owned(keys, holder))))
    }

    fn withdraw<'a>(
        &'a self,
        keys: &'a [String],
        ticket: Ticket,
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        let withdrawn = self.withdraw_reservations(keys, ticket);
        Box::pin(std::future::ready(Ok(withdrawn)))
    }

    fn check(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn inspect<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<KeyView>, BackendError>> {
        Box::pin(std::future::ready(Ok(self.view(keys))))
    }

    fn force_release<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(std::future::ready(Ok(self.release_all(keys))))
    }

    #[cfg(feature = "idempotency")]
    fn load_answer<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Bytes>, BackendError>> {
        let answer = self.answers().load(key, Instant::now());
        Box::pin(std::future::ready(Ok(answer)))
    }

    #[cfg(feature = "idempotency")]
    fn store_answer<'a>(
        &'a self,
        key: &'a str,
        answer: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, BackendError>> {
        let stored = self.answers().store(key, answer, retention, Instant::now());
        Box::pin(std::future::ready(Ok(stored)))
    }

    fn wakeups(&self) -> &Wakeups {
        &self.wakeups
    }
}

#[cfg(feature = "idempotency")]
impl MemoryBackend {
    fn answers(&self) -> MutexGuard<'_, Answers> {
        // Every change is one map operation: a poisoned table is still whole.
        self.answers.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The idempotency layer's answers, each until its retention ends, within
/// [`ANSWER_BUDGET`] bytes. Answers are few next to locks (one per request with an
/// `Idempotency-Key`, not one per key of a batch), so one mutex serves them; expired ones
/// are swept as the table grows, as a shard's are.
#[cfg(feature = "idempotency")]
#[derive(Debug, Default)]
struct Answers {
    entries: HashMap<String, (Bytes, Instant)>,
    /// The keys in the order they were stored, with their entry's end (an entry that was
    /// swept or stored again since has another, or none).
    order: std::collections::VecDeque<(String, Instant)>,
    /// The bytes of all entries' answers.
    bytes: usize,
    sweep_at: usize,
}

/// How many bytes of answers the memory store keeps: past it, the oldest go first, and a
/// retry of theirs runs again. A day of answers of a busy service does not fit in a
/// process; a service of several processes needs Redis for its answers anyway.
#[cfg(feature = "idempotency")]
const ANSWER_BUDGET: usize = 64 * 1024 * 1024;

#[cfg(feature = "idempotency")]
impl Answers {
    fn load(&self, key: &str, now: Instant) -> Option<Bytes> {
        let (answer, until) = self.entries.get(key)?;
        (*until > now).then(|| answer.clone())
    }

    fn store(&mut self, key: &str, answer: Bytes, retention: Duration, now: Instant) -> bool {
        if self.load(key, now).is_some() {
            return false;
        }
        if self.entries.len() >= self.sweep_at.max(FIRST_SWEEP_AT) {
            self.entries.retain(|_, (_, until)| *until > now);
            self.forget_gone();
            self.sweep_at = self.entries.len() * 2;
        }
        // The layer bounds retention to a year, far from the clock's end.
        let until = now + retention;
        self.bytes += answer.len();
        if let Some((old, _)) = self.entries.insert(key.to_owned(), (answer, until)) {
            self.bytes -= old.len();
        }
        self.order.push_back((key.to_owned(), until));
        let mut evicted = 0;
        while self.bytes > ANSWER_BUDGET {
            let Some((oldest, until)) = self.order.pop_front() else {
                break;
            };
            if self.entries.get(&oldest).is_some_and(|(_, u)| *u == until) {
                let (answer, _) = self.entries.remove(&oldest).expect("just seen");
                self.bytes -= answer.len();
                evicted += 1;
            }
        }
        if evicted > 0 {
            tracing::warn!(
                evicted,
                budget_mib = ANSWER_BUDGET >> 20,
                "the memory store dropped stored idempotent answers before their retention \
                 ended; retries with their keys run again (use Redis for many answers)"
            );
        }
        true
    }

    /// Drops the order's records of entries that are gone, and recounts their bytes.
    fn forget_gone(&mut self) {
        let entries = &self.entries;
        self.order
            .retain(|(key, until)| entries.get(key).is_some_and(|(_, u)| u == until));
        self.bytes = entries.values().map(|(answer, _)| answer.len()).sum();
    }
}

#[cfg(test)]
mod tests {
    #[cfg(feature = "idempotency")]
    #[test]
    fn stored_answers_stay_within_the_budget_oldest_first() {
        let mut answers = Answers::default();
        let now = Instant::now();
        let day = Duration::from_secs(86_400);
        let mib = Bytes::from(vec![0; 1024 * 1024]);
        let budget = ANSWER_BUDGET / mib.len();
        for i in 0..budget + 3 {
            assert!(answers.store(&format!("k{i}"), mib.clone(), day, now));
        }
        assert!(answers.bytes <= ANSWER_BUDGET);
        assert_eq!(answers.entries.len(), budget);
        // The three oldest went; the newest stay; the first answer of a key stays first.
        assert!((0..3).all(|i| answers.load(&format!("k{i}"), now).is_none()));
        assert!(answers.load(&format!("k{}", budget + 2), now).is_some());
        assert!(!answers.store("k5", Bytes::from_static(b"other"), day, now));
        // Expired answers are gone, and another may take their key.
        let later = now + day + Duration::from_secs(1);
        assert!(answers.load("k5", later).is_none());
        assert!(answers.store("k5", Bytes::from_static(b"new"), day, later));
        assert_eq!(answers.load("k5", later).as_deref(), Some(&b"new"[..]));
    }

    use super::*;

    fn keys(names: &[&str]) -> Vec<String> {
        let mut keys: Vec<String> = names.iter().map(|n| format!("lock:{n}")).collect();
        keys.sort();
        keys
    }

    const TTL: Duration = Duration::from_secs(30);

    /// A new owner's first hold.
    fn holder() -> Holder {
        Holder::new(OwnerToken::random())
    }

    fn granted(outcome: Acquire) -> bool {
        matches!(outcome, Acquire::Granted(_))
    }

    /// Whether `holder`, waiting in no line, is granted `keys`.
    fn grants(backend: &MemoryBackend, keys: &[String], holder: Holder, ttl: Duration) -> bool {
        granted(backend.try_acquire(keys, holder, ttl, 0, Line::Outside))
    }

    #[test]
    fn overlapping_batch_is_refused_and_writes_nothing() {
        let backend = MemoryBackend::new();
        let (a, b) = (holder(), holder());
        assert!(granted(backend.try_acquire(
            &keys(&["1", "2"]),
            a,
            TTL,
            20,
            Line::Outside
        )));

        let Acquire::Held(c) =
            backend.try_acquire(&keys(&["2", "3", "4"]), b, TTL, 20, Line::Outside)
        else {
            panic!("an overlapping batch was granted");
        };
        assert_eq!(c.keys, keys(&["2"]));
        assert_eq!(c.total, 1);
        assert!(c.earliest_expiry.is_some_and(|e| e <= TTL));
        // All or nothing: the free keys of the refused batch were not taken.
        assert_eq!(backend.len(), 2);
        assert!(granted(backend.try_acquire(
            &keys(&["3", "4"]),
            b,
            TTL,
            20,
            Line::Outside
        )));
    }

    #[test]
    fn release_only_deletes_the_owners_keys() {
        let backend = MemoryBackend::new();
        let (a, b) = (holder(), holder());
        assert!(granted(backend.try_acquire(
            &keys(&["1"]),
            a,
            TTL,
            20,
            Line::Outside
        )));
        assert_eq!(backend.release_owned(&keys(&["1"]), b), 0);
        assert!(matches!(
            backend.try_acquire(&keys(&["1"]), b, TTL, 20, Line::Outside),
            Acquire::Held(_)
        ));
        assert_eq!(backend.release_owned(&keys(&["1"]), a), 1);
        assert_eq!(
            backend.release_owned(&keys(&["1"]), a),
            0,
            "release is idempotent"
        );
        assert!(granted(backend.try_acquire(
            &keys(&["1"]),
            b,
            TTL,
            20,
            Line::Outside
        )));
    }

    #[test]
    fn expired_keys_are_free_and_cannot_be_released_by_their_old_owner() {
        let backend = MemoryBackend::new();
        let (a, b) = (holder(), holder());
        let short = Duration::from_millis(20);
        assert!(granted(backend.try_acquire(
            &keys(&["1"]),
            a,
            short,
            20,
            Line::Outside
        )));
        std::thread::sleep(short * 2);
        assert!(granted(backend.try_acquire(
            &keys(&["1"]),
            b,
            TTL,
            20,
            Line::Outside
        )));
        assert_eq!(backend.release_owned(&keys(&["1"]), a), 0);
        assert!(matches!(
            backend.try_acquire(&keys(&["1"]), a, TTL, 20, Line::Outside),
            Acquire::Held(_)
        ));
    }

    #[test]
    fn contention_names_at_most_the_report_limit_but_counts_all() {
        let backend = MemoryBackend::new();
        let names: Vec<String> = (0..50).map(|i| i.to_string()).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let batch = keys(&names);
        assert!(granted(backend.try_acquire(
            &batch,
            holder(),
            TTL,
            20,
            Line::Outside
        )));
        let Acquire::Held(c) = backend.try_acquire(&batch, holder(), TTL, 3, Line::Outside) else {
            panic!("granted twice");
        };
        assert_eq!((c.keys.len(), c.total), (3, 50));
    }

    #[test]
    fn expired_entries_are_swept_as_the_map_grows() {
        let backend = MemoryBackend::new();
        let short = Duration::from_millis(1);
        for i in 0..(SHARDS * FIRST_SWEEP_AT) {
            let key = vec![format!("lock:{i}")];
            assert!(grants(&backend, &key, holder(), short));
        }
        std::thread::sleep(Duration::from_millis(5));
        for i in 0..(SHARDS * FIRST_SWEEP_AT) {
            let key = vec![format!("again:{i}")];
            assert!(grants(&backend, &key, holder(), TTL));
        }
        // Without sweeping all 2 * 65,536 entries would remain.
        assert!(
            backend.len() < 2 * SHARDS * FIRST_SWEEP_AT * 3 / 4,
            "{}",
            backend.len()
        );
    }

    #[test]
    fn extend_needs_every_key_still_held_by_the_owner() {
        let backend = MemoryBackend::new();
        let (a, b) = (holder(), holder());
        let short = Duration::from_millis(30);
        assert!(grants(&backend, &keys(&["1", "2"]), a, short));
        assert!(
            !backend.try_extend(&keys(&["1", "2"]), b, TTL),
            "a foreign owner extended"
        );
        assert!(backend.try_extend(&keys(&["1", "2"]), a, TTL));
        std::thread::sleep(short * 2);
        // Extended past the original expiry: still held.
        assert!(!grants(&backend, &keys(&["2"]), b, TTL));

        assert_eq!(backend.release_owned(&keys(&["2"]), a), 1);
        assert!(
            !backend.try_extend(&keys(&["1", "2"]), a, TTL),
            "extended a partly lost lease"
        );
    }

    #[test]
    fn fencing_tokens_increase_with_every_grant() {
        let backend = MemoryBackend::new();
        let fence = |outcome| match outcome {
            Acquire::Granted(token) => token,
            Acquire::Held(_) => panic!("refused"),
        };
        let first = fence(backend.try_acquire(&keys(&["1"]), holder(), TTL, 0, Line::Outside));
        let second = fence(backend.try_acquire(&keys(&["2"]), holder(), TTL, 0, Line::Outside));
        assert!(second > first);
    }

    #[test]
    fn an_owner_reenters_its_keys_and_frees_them_with_its_last_hold() {
        let backend = MemoryBackend::new();
        let outer = holder();
        let inner = Holder::new(outer.owner);
        let stranger = holder();
        assert!(grants(&backend, &keys(&["1"]), outer, TTL));
        // Re-entry, with a new key in the same batch: granted, not contended.
        assert!(grants(&backend, &keys(&["1", "2"]), inner, TTL));
        assert!(!grants(&backend, &keys(&["1"]), stranger, TTL));

        // The inner release keeps the outer hold, and is harmless twice.
        assert_eq!(backend.release_owned(&keys(&["1", "2"]), inner), 2);
        assert_eq!(backend.release_owned(&keys(&["1", "2"]), inner), 0);
        assert!(!grants(&backend, &keys(&["1"]), stranger, TTL));
        assert!(grants(&backend, &keys(&["2"]), stranger, TTL));

        // The outermost release frees the key.
        assert_eq!(backend.release_owned(&keys(&["1"]), outer), 1);
        assert!(grants(&backend, &keys(&["1"]), stranger, TTL));
    }

    #[test]
    fn reentry_never_shortens_a_lease_and_extends_only_its_own_hold() {
        let backend = MemoryBackend::new();
        let outer = holder();
        let inner = Holder::new(outer.owner);
        let short = Duration::from_millis(20);
        assert!(grants(&backend, &keys(&["1"]), outer, TTL));
        assert!(grants(&backend, &keys(&["1"]), inner, short));
        std::thread::sleep(short * 2);
        assert!(
            !grants(&backend, &keys(&["1"]), holder(), TTL),
            "re-entry shortened the lease"
        );
        assert!(backend.try_extend(&keys(&["1"]), inner, TTL));
        assert_eq!(backend.release_owned(&keys(&["1"]), inner), 1);
        assert!(
            !backend.try_extend(&keys(&["1"]), inner, TTL),
            "extended a released hold"
        );
        assert!(backend.try_extend(&keys(&["1"]), outer, TTL));
    }
}
