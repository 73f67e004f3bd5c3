//! Wake-ups for waiters when keys are released, so that waiting is not polling.
//!
//! Keys hash into a fixed number of slots; a release bumps the slots of its keys, and a
//! waiter watches the slots of the keys that stopped it. Two keys may share a slot: a
//! waiter then wakes for nothing and simply tries again. The hash is the same in every
//! process (FNV-1a), so slot numbers can travel between processes over Redis pub/sub.

use tokio::sync::watch;

/// Enough slots that unrelated releases rarely wake a waiter, few enough that a release
/// of thousands of keys bumps them all cheaply.
pub(crate) const SLOTS: usize = 1024;

#[derive(Debug)]
pub(crate) struct Wakeups {
    slots: Box<[watch::Sender<()>]>,
}

impl Wakeups {
    pub(crate) fn new() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| watch::Sender::new(())).collect(),
        }
    }

    /// Watches the slots of `keys`. A release after this call wakes the returned watch,
    /// even if it happens before the watch is awaited.
    pub(crate) fn watch(&self, keys: &[String]) -> Vec<watch::Receiver<()>> {
        slots_of(keys)
            .into_iter()
            .map(|s| self.slots[s].subscribe())
            .collect()
    }

    /// Wakes the waiters that watch the slots of `keys`.
    pub(crate) fn wake_keys(&self, keys: &[String]) {
        match keys {
            // Most releases free one key: no list of slots to build and sort.
            [key] => self.wake_slots([slot(key)]),
            keys => self.wake_slots(slots_of(keys)),
        }
    }

    /// Wakes the waiters of these slots.
    pub(crate) fn wake_slots(&self, slots: impl IntoIterator<Item = usize>) {
        for s in slots {
            // Nobody watching: nothing to wake, and no lock to take on the release path.
            if let Some(sender) = self.slots.get(s).filter(|s| s.receiver_count() > 0) {
                sender.send_replace(());
            }
        }
    }

    /// Wakes every waiter: after a gap in which releases may have gone unnoticed.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn wake_all(&self) {
        self.wake_slots(0..SLOTS);
    }
}

/// The slot of a key, the same in every process.
pub(crate) fn slot(key: &str) -> usize {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash % SLOTS as u64) as usize
}

/// The distinct slots of `keys`, ascending.
pub(crate) fn slots_of(keys: &[String]) -> Vec<usize> {
    let mut slots: Vec<usize> = keys.iter().map(|k| slot(k)).collect();
    slots.sort_unstable();
    slots.dedup();
    slots
}

/// Waits until any of `watches` sees a release.
pub(crate) async fn any_released(watches: &mut [watch::Receiver<()>]) {
    if watches.is_empty() {
        return std::future::pending().await;
    }
    let changes = watches.iter_mut().map(|w| Box::pin(w.changed()));
    // An error means the store was dropped: nothing will be released any more, and the
    // waiter's own deadline ends the wait.
    if futures_util::future::select_all(changes).await.0.is_err() {
        std::future::pending::<()>().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_release_after_watching_wakes_even_before_awaiting() {
        let wakeups = Wakeups::new();
        let keys = vec!["lock:a".to_owned()];
        let mut watches = wakeups.watch(&keys);
        wakeups.wake_slots(slots_of(&keys));
        tokio::time::timeout(
            std::time::Duration::from_secs(1),
            any_released(&mut watches),
        )
        .await
        .expect("the release was missed");
    }

    #[tokio::test]
    async fn a_release_of_other_slots_does_not_wake() {
        let wakeups = Wakeups::new();
        let mine = vec!["lock:a".to_owned()];
        let other = (0..)
            .map(|i| format!("lock:{i}"))
            .find(|k| slot(k) != slot("lock:a"))
            .unwrap();
        let mut watches = wakeups.watch(&mine);
        wakeups.wake_slots(slots_of(&[other]));
        let woke = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            any_released(&mut watches),
        )
        .await;
        assert!(woke.is_err());
    }

    #[test]
    fn slots_are_the_same_in_every_process() {
        // FNV-1a 64 of "lock:a" is 0xab7576dfe5401b6b; processes of two versions must agree on it.
        assert_eq!(slot("lock:a"), 875);
    }
}
