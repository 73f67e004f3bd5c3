//! The idempotency layer's answers in the memory store.

use std::{
    collections::{HashMap, VecDeque},
    time::{Duration, Instant},
};

use bytes::Bytes;

/// A table sweeps its expired answers when it has grown to this many, and then again
/// whenever it has doubled since the last sweep, as a lock shard does; and when its order
/// has more than twice as many records as that (keys stored again after they expired add
/// a record each, and no entry).
const FIRST_SWEEP_AT: usize = 1024;

/// How often the memory store says, at most, that it dropped answers for want of room.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The idempotency layer's answers, each until its retention ends, within
/// [`ANSWER_BUDGET`] bytes. Answers are few next to locks (one per request with an
/// `Idempotency-Key`, not one per key of a batch), so one mutex serves them; expired ones
/// are swept as the table grows, as a shard's are.
#[derive(Debug, Default)]
pub(super) struct Answers {
    entries: HashMap<String, (Bytes, Instant)>,
    /// The keys in the order they were stored, with their entry's end (an entry that was
    /// swept or stored again since has another, or none).
    order: VecDeque<(String, Instant)>,
    /// The bytes of all entries' answers.
    bytes: usize,
    sweep_at: usize,
    /// When answers dropped for want of room were last logged.
    warned_at: Option<Instant>,
}

/// How many bytes of answers the memory store keeps: past it, the oldest go first, and a
/// retry of theirs runs again. A day of answers of a busy service does not fit in a
/// process; a service of several processes needs Redis for its answers anyway.
const ANSWER_BUDGET: usize = 64 * 1024 * 1024;

impl Answers {
    pub(super) fn load(&self, key: &str, now: Instant) -> Option<Bytes> {
        let (answer, until) = self.entries.get(key)?;
        (*until > now).then(|| answer.clone())
    }

    pub(super) fn store(
        &mut self,
        key: &str,
        answer: Bytes,
        retention: Duration,
        now: Instant,
    ) -> bool {
        if self.load(key, now).is_some() {
            return false;
        }
        let sweep_at = self.sweep_at.max(FIRST_SWEEP_AT);
        if self.entries.len() >= sweep_at || self.order.len() >= 2 * sweep_at {
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
                // One that had expired was gone for its retries already.
                evicted += usize::from(until > now);
            }
        }
        if evicted > 0 && self.warned_at.is_none_or(|at| now >= at + WARN_EVERY) {
            self.warned_at = Some(now);
            tracing::warn!(
                evicted,
                budget_mib = ANSWER_BUDGET >> 20,
                "the memory store dropped stored idempotent answers before their retention \
                 ended; retries with their keys run again (use Redis for many answers; \
                 warned at most every 10 s)"
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
    use super::*;

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

    #[test]
    fn expired_answers_dropped_for_room_are_not_reported_as_lost() {
        let mut answers = Answers::default();
        let now = Instant::now();
        let mib = Bytes::from(vec![0; 1024 * 1024]);
        for i in 0..ANSWER_BUDGET / mib.len() {
            assert!(answers.store(&format!("k{i}"), mib.clone(), Duration::from_secs(1), now));
        }
        // All expired, and not swept yet (a table of 64 entries): the room they take is
        // made without a warning that answers were lost.
        let later = now + Duration::from_secs(2);
        assert!(answers.store("new", mib.clone(), Duration::from_secs(60), later));
        assert!(answers.bytes <= ANSWER_BUDGET);
        assert_eq!(answers.warned_at, None);
        // A live one dropped is reported.
        for i in 0..ANSWER_BUDGET / mib.len() {
            let retention = Duration::from_secs(60);
            assert!(answers.store(&format!("live{i}"), mib.clone(), retention, later));
        }
        assert_eq!(answers.warned_at, Some(later));
    }

    #[test]
    fn a_few_keys_stored_again_and_again_keep_the_table_small() {
        let mut answers = Answers::default();
        let mut now = Instant::now();
        let second = Duration::from_secs(1);
        // Ten keys, each stored again once its answer has expired, 100,000 times in all.
        for i in 0..100_000 {
            if i % 10 == 0 {
                now += 2 * second;
            }
            let key = format!("k{}", i % 10);
            assert!(answers.store(&key, Bytes::from_static(b"ok"), second, now));
        }
        assert!(answers.entries.len() <= 10);
        assert!(
            answers.order.len() <= 2 * FIRST_SWEEP_AT + 10,
            "{}",
            answers.order.len()
        );
    }
}
