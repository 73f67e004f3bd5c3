//! Wake-ups for waiters when keys are released, so that waiting is not polling.
//!
//! A waiter in line (fair waiting) has reserved every key of its batch, and a key it
//! reserved can let in only the first waiter in its line: a release (or a withdrawal)
//! names, for each key it frees, the ticket of that first waiter, and wakes that waiter
//! alone ([`Wakeups::watch_ticket`]). However many wait behind it, a release wakes one
//! waiter a key, not every waiter that watches the key.
//!
//! Waiters in no line (unfair waiting, an owner that already holds keys) watch slots:
//! keys hash into a fixed number of slots; a release bumps the slots of its keys, and such
//! a waiter watches the slots of the keys that stopped it. Two keys may share a slot: a
//! waiter then wakes for nothing and simply tries again. The hash is the same in every
//! process (FNV-1a), so slot numbers (and tickets) can travel between processes over
//! Redis pub/sub.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
};

use tokio::sync::{watch, Notify};

/// Enough slots that unrelated releases rarely wake a waiter, few enough that a release
/// of thousands of keys bumps them all cheaply.
pub(crate) const SLOTS: usize = 1024;

#[derive(Debug)]
pub(crate) struct Wakeups {
    slots: Box<[watch::Sender<()>]>,
    /// How many [`Watches`] live: while none does, which is the rule when nothing is
    /// contended, a release looks at this count alone, and not at its keys' slots, each
    /// a cache line of its own somewhere in the store's memory.
    watching: AtomicUsize,
    /// This store's tag in the release messages it sends to other processes: its own
    /// listener hears them too, and skips them, since the release woke its waiters already.
    tag: u64,
    /// This process's waiters in line, by ticket. Read by a release only for a key that
    /// has a reservation, and so never on the uncontended path.
    in_line: Mutex<HashMap<u128, Arc<Turn>>>,
}

/// A waiter in line's turn: woken when it is first in line on a key that was freed, and
/// handed the key by the call that freed it, where the store grants it there (PostgreSQL,
/// for a waiter of one key: see [`Handover`]). A wake-up before the waiter awaits it is
/// kept (one, however many came).
#[derive(Debug)]
pub(crate) struct Turn {
    notify: Notify,
    handed: Mutex<Option<Handover>>,
    /// The waiter's batch (sorted), which its reservations cover: read only to wake it
    /// after a release whose answer was lost ([`Wakeups::wake_first_in_line`]).
    keys: Arc<[String]>,
}

impl Turn {
    /// The key handed to the waiter, if any.
    fn handed(&self) -> std::sync::MutexGuard<'_, Option<Handover>> {
        // Nothing panics while holding it; a poisoned slot is still a slot.
        self.handed.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A key granted to a waiter in line by the call that freed it, in that call: the grant's
/// fencing token, and the hold it is held under (the one the waiter's refused attempt
/// named). The waiter is granted without an attempt of its own, if that hold is one of its
/// refused attempts' (a notification is no proof: anybody connected to the database may
/// send one); its guard releases that hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handover {
    pub(crate) token: u64,
    pub(crate) hold: u64,
}

/// A waiter's watch, from [`Wakeups::watch`] or [`Wakeups::watch_ticket`] until dropped.
#[derive(Debug)]
pub(crate) struct Watches<'a> {
    watched: Watched,
    wakeups: &'a Wakeups,
}

#[derive(Debug)]
enum Watched {
    /// The slots watched, ascending, each with its receiver in `receivers`.
    Slots {
        slots: Vec<usize>,
        receivers: Vec<watch::Receiver<()>>,
    },
    /// A waiter in line.
    Ticket(u128, Arc<Turn>),
}

impl Drop for Watches<'_> {
    fn drop(&mut self) {
        match &self.watched {
            Watched::Slots { .. } => {
                self.wakeups.watching.fetch_sub(1, Ordering::Release);
            }
            Watched::Ticket(ticket, _) => {
                self.wakeups.lines().remove(ticket);
            }
        }
    }
}

impl Wakeups {
    pub(crate) fn new() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| watch::Sender::new(())).collect(),
            watching: AtomicUsize::new(0),
            tag: fastrand::u64(..),
            in_line: Mutex::new(HashMap::new()),
        }
    }

    fn lines(&self) -> std::sync::MutexGuard<'_, HashMap<u128, Arc<Turn>>> {
        // Nothing panics while holding it; a poisoned map is still a map.
        self.in_line.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Watches for the turn of the waiter in line with `ticket`: a release or withdrawal
    /// that leaves it first in line on a key wakes it, here or in another process. Its
    /// watch covers every key of its batch, which its reservations cover, for as long as
    /// it waits.
    /// (Tickets as numbers, as they travel in release messages.)
    pub(crate) fn watch_ticket(&self, ticket: u128, keys: Arc<[String]>) -> Watches<'_> {
        let turn = Arc::new(Turn {
            notify: Notify::new(),
            handed: Mutex::new(None),
            keys,
        });
        self.lines().insert(ticket, turn.clone());
        Watches {
            watched: Watched::Ticket(ticket, turn),
            wakeups: self,
        }
    }

    /// Wakes the waiters in line of this process that have these tickets: each one first
    /// in line on a key just freed.
    pub(crate) fn wake_tickets(&self, tickets: impl IntoIterator<Item = u128>) {
        let lines = self.lines();
        if lines.is_empty() {
            return;
        }
        for ticket in tickets {
            if let Some(turn) = lines.get(&ticket) {
                turn.notify.notify_one();
            }
        }
    }

    /// Hands the waiter in line of this process with `ticket`, if there is one, the key
    /// that a release granted it ([`Handover`]), and wakes it.
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) fn hand_over(&self, ticket: u128, handover: Handover) {
        if let Some(turn) = self.lines().get(&ticket) {
            *turn.handed() = Some(handover);
            turn.notify.notify_one();
        }
    }

    /// This store's tag in the release messages it sends to other processes.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn tag(&self) -> u64 {
        self.tag
    }

    /// Watches the slots of `keys`. A release after this call wakes the returned watch,
    /// even if it happens before the watch is awaited.
    ///
    /// A release between the attempt that found the keys held and this call is missed
    /// (the waiter's pause bounds the loss): a waiter keeps its watch through its next
    /// attempt, so that only its first attempt has that gap (see
    /// [`Watches::covers`]).
    pub(crate) fn watch(&self, keys: &[String]) -> Watches<'_> {
        // Counted before subscribing, so that a release that reads the count after a
        // subscription sees it.
        self.watching.fetch_add(1, Ordering::AcqRel);
        let slots = slots_of(keys);
        let receivers = slots.iter().map(|&s| self.slots[s].subscribe()).collect();
        Watches {
            watched: Watched::Slots { slots, receivers },
            wakeups: self,
        }
    }

    /// Wakes the waiters that watch the slots of `keys`.
    pub(crate) fn wake_keys(&self, keys: &[String]) {
        // Hashed one by one as `wake_slots` goes, so that nothing is hashed while nobody
        // watches; a slot two keys share is woken twice, which wakes its waiters once.
        self.wake_slots(keys.iter().map(|key| slot(key)));
    }

    /// Wakes the waiters of these slots.
    pub(crate) fn wake_slots(&self, slots: impl IntoIterator<Item = usize>) {
        if self.watching.load(Ordering::Acquire) == 0 {
            return;
        }
        for s in slots {
            // Nobody watching: nothing to wake, and no lock to take on the release path.
            if let Some(sender) = self.slots.get(s).filter(|s| s.receiver_count() > 0) {
                sender.send_replace(());
            }
        }
    }

    /// Wakes this process's waiters that a release of keys in `slots` (ascending) would
    /// have, for a release that could not name them: the watchers of those slots, and on
    /// each key of theirs in those slots the waiter in line with the earliest ticket
    /// (tickets are arrivals), the only one of this process that may be first in line
    /// there. For a call that freed keys and whose answer was lost, once another attempt
    /// of it is answered: this process's own ([`LostAnswers`]), or another's that says so
    /// in its message (a cluster's, whose release is announced by the client). Not the
    /// waiter with the ticket `except`, first in line or not: the roll-back of its own
    /// refused attempt, after which it waits for the keys that refused it (woken, it would
    /// try again at once, and be refused again), as the roll-back's script names it not.
    pub(crate) fn wake_first_in_line(&self, slots: &[usize], except: Option<u128>) {
        self.wake_slots(slots.iter().copied());
        // Their keys are hashed outside the lock, which every watch's start and end takes.
        let turns: Vec<(u128, Arc<Turn>)> = self
            .lines()
            .iter()
            .map(|(&ticket, turn)| (ticket, turn.clone()))
            .collect();
        let mut first: HashMap<&str, (u128, &Turn)> = HashMap::new();
        for (ticket, turn) in &turns {
            let (ticket, turn) = (*ticket, &**turn);
            let in_slots = |key: &&String| slots.binary_search(&slot(key)).is_ok();
            for key in turn.keys.iter().filter(in_slots) {
                let earliest = first.entry(key).or_insert((ticket, turn));
                if ticket < earliest.0 {
                    *earliest = (ticket, turn);
                }
            }
        }
        for (ticket, turn) in first.values() {
            if Some(*ticket) != except {
                turn.notify.notify_one();
            }
        }
    }

    /// Wakes every waiter: after a gap in which releases may have gone unnoticed, or for a
    /// release that could not name them.
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) fn wake_all(&self) {
        self.wake_slots(0..SLOTS);
        for turn in self.lines().values() {
            turn.notify.notify_one();
        }
    }
}

/// Whether a call that frees keys for one holder or one waiter (its releases, its
/// withdrawals) was sent and not answered (lost, late, failed, or dropped on the way): it
/// may have freed them, and the wake-ups it named for this process's waiters went with
/// its answer (other processes hear the store's message; this one skips its own, which it
/// takes for delivered). The next call answered wakes them. Atomic, as the holder's state
/// is shared between the tasks that send its calls one after another.
#[derive(Debug, Default)]
pub(crate) struct LostAnswers(AtomicBool);

impl LostAnswers {
    /// Counts a call as lost until [`answered`](Self::answered): whether one before it was.
    pub(crate) fn sent(&self) -> bool {
        self.0.swap(true, Ordering::Relaxed)
    }

    /// The call is answered: if one before it was lost (`earlier`, from
    /// [`sent`](Self::sent)), wakes this process's waiters on `keys` (the first in line on
    /// each key of their slots, [`Wakeups::wake_first_in_line`]).
    pub(crate) fn answered(&self, earlier: bool, wakeups: &Wakeups, keys: &[String]) {
        self.0.store(false, Ordering::Relaxed);
        if earlier {
            wakeups.wake_first_in_line(&slots_of(keys), None);
        }
    }
}

impl Watches<'_> {
    /// Whether these watches cover the slots of every one of `keys`: then a waiter whose
    /// attempt ran under them and found `keys` held keeps them, and a release that came
    /// while that attempt was under way has already woken them.
    pub(crate) fn covers(&self, keys: &[String]) -> bool {
        match &self.watched {
            Watched::Slots { slots, .. } => keys
                .iter()
                .all(|key| slots.binary_search(&slot(key)).is_ok()),
            Watched::Ticket(..) => true,
        }
    }

    /// The key a release handed this waiter in line, if one did: taken, once.
    pub(crate) fn take_handover(&self) -> Option<Handover> {
        match &self.watched {
            Watched::Ticket(_, turn) => turn.handed().take(),
            Watched::Slots { .. } => None,
        }
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
pub(crate) async fn any_released(watches: &mut Watches<'_>) {
    let receivers = match &mut watches.watched {
        Watched::Ticket(_, turn) => return turn.notify.notified().await,
        Watched::Slots { receivers, .. } => receivers,
    };
    if receivers.is_empty() {
        return std::future::pending().await;
    }
    let changes = receivers.iter_mut().map(|w| Box::pin(w.changed()));
    // An error means the store was dropped: nothing will be released any more, and the
    // waiter's own deadline ends the wait.
    if futures_util::future::select_all(changes).await.0.is_err() {
        std::future::pending::<()>().await;
    }
    // A release bumps the slots of all its keys: every one of them is seen now, so that a
    // watch kept for the next wait waits for a release after this one, not for this one
    // again through another of its slots.
    for receiver in receivers {
        receiver.borrow_and_update();
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
    async fn a_watch_counts_while_it_lives_and_later_ones_still_wake() {
        let wakeups = Wakeups::new();
        let keys = vec!["lock:a".to_owned()];
        drop(wakeups.watch(&keys));
        // No watcher left: releases skip the slots.
        assert_eq!(wakeups.watching.load(Ordering::Acquire), 0);
        let mut watches = wakeups.watch(&keys);
        wakeups.wake_keys(&keys);
        tokio::time::timeout(
            std::time::Duration::from_secs(1),
            any_released(&mut watches),
        )
        .await
        .expect("the release was missed");
    }

    #[tokio::test]
    async fn a_watch_kept_through_an_attempt_sees_a_release_during_it() {
        let wakeups = Wakeups::new();
        let keys = vec!["lock:a".to_owned()];
        let mut watches = wakeups.watch(&keys);
        wakeups.wake_keys(&keys);
        any_released(&mut watches).await;
        // The next attempt finds the key held, and it is released before the answer
        // comes back: the watch that lived through the attempt has the release.
        wakeups.wake_keys(&keys);
        assert!(watches.covers(&keys));
        tokio::time::timeout(
            std::time::Duration::from_secs(1),
            any_released(&mut watches),
        )
        .await
        .expect("the release during the attempt was missed");
        let other = (0..)
            .map(|i| format!("lock:{i}"))
            .find(|k| slot(k) != slot("lock:a"))
            .unwrap();
        assert!(!watches.covers(&[other]));
    }

    #[tokio::test]
    async fn one_release_of_many_slots_wakes_a_kept_watch_once() {
        let wakeups = Wakeups::new();
        let keys: Vec<String> = (0..50).map(|i| format!("lock:{i}")).collect();
        let mut watches = wakeups.watch(&keys);
        wakeups.wake_keys(&keys);
        any_released(&mut watches).await;
        let again = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            any_released(&mut watches),
        )
        .await;
        assert!(again.is_err(), "one release woke the watch twice");
    }

    #[tokio::test]
    async fn a_lost_release_wakes_the_first_waiters_in_line_on_its_keys() {
        let wakeups = Wakeups::new();
        let batch =
            |keys: &[&str]| -> Arc<[String]> { keys.iter().map(|k| (*k).to_owned()).collect() };
        let mut first_on_b = wakeups.watch_ticket(1, batch(&["lock:a", "lock:b"]));
        let mut behind_on_b = wakeups.watch_ticket(2, batch(&["lock:b"]));
        let mut elsewhere = wakeups.watch_ticket(3, batch(&["lock:c", "lock:d"]));
        let lost = LostAnswers::default();
        assert!(!lost.sent());
        assert!(lost.sent(), "the lost call was forgotten");
        lost.answered(true, &wakeups, &batch(&["lock:b", "lock:bb"]));
        assert!(!lost.sent(), "an answered call still counts as lost");
        let timeout = std::time::Duration::from_millis(50);
        let woke = tokio::time::timeout(timeout, any_released(&mut first_on_b)).await;
        assert!(
            woke.is_ok(),
            "the first waiter on a released key was not woken"
        );
        for (watch, who) in [(&mut behind_on_b, "behind"), (&mut elsewhere, "elsewhere")] {
            let woke = tokio::time::timeout(timeout, any_released(watch)).await;
            assert!(woke.is_err(), "a waiter {who} was woken");
        }
    }

    /// The roll-back of a waiter's own refused attempt, whose answer was lost, wakes no
    /// one on the keys where that waiter is first in line: it waits for the keys that
    /// refused it, and woken it would be refused again; a waiter first on another key is
    /// woken.
    #[tokio::test]
    async fn a_lost_roll_back_does_not_wake_its_own_waiter() {
        let wakeups = Wakeups::new();
        let batch =
            |keys: &[&str]| -> Arc<[String]> { keys.iter().map(|k| (*k).to_owned()).collect() };
        let mut rolling_back = wakeups.watch_ticket(1, batch(&["lock:a", "lock:b"]));
        let mut behind_on_a = wakeups.watch_ticket(2, batch(&["lock:a"]));
        let mut first_on_c = wakeups.watch_ticket(3, batch(&["lock:c"]));
        wakeups.wake_first_in_line(&slots_of(&batch(&["lock:a", "lock:c"])), Some(1));
        let timeout = std::time::Duration::from_millis(50);
        let woke = tokio::time::timeout(timeout, any_released(&mut first_on_c)).await;
        assert!(
            woke.is_ok(),
            "the first waiter on another key was not woken"
        );
        for (watch, who) in [
            (&mut rolling_back, "rolling back"),
            (&mut behind_on_a, "behind"),
        ] {
            let woke = tokio::time::timeout(timeout, any_released(watch)).await;
            assert!(woke.is_err(), "the waiter {who} was woken");
        }
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

    #[tokio::test]
    async fn a_waiter_in_line_wakes_for_its_ticket_alone_and_keeps_an_early_wake() {
        let wakeups = Wakeups::new();
        let (first, second) = (61_420_580_338_024, 61_420_580_338_025);
        let mut first_watch = wakeups.watch_ticket(first, Default::default());
        let mut second_watch = wakeups.watch_ticket(second, Default::default());
        // Before either awaits: the wake-up is kept for the first, and only for it.
        wakeups.wake_tickets([first]);
        let soon = std::time::Duration::from_millis(50);
        assert!(
            tokio::time::timeout(soon, any_released(&mut first_watch))
                .await
                .is_ok(),
            "the first in line missed its turn"
        );
        assert!(
            tokio::time::timeout(soon, any_released(&mut second_watch))
                .await
                .is_err(),
            "a release woke a waiter behind the first"
        );
        // Gone with its watch: a late wake-up finds nobody.
        drop(first_watch);
        assert!(wakeups.lines().get(&first).is_none());
        // A lost gap wakes everyone.
        wakeups.wake_all();
        assert!(tokio::time::timeout(soon, any_released(&mut second_watch))
            .await
            .is_ok());
    }

    #[test]
    fn slots_are_the_same_in_every_process() {
        // FNV-1a 64 of "lock:a" is 0xab7576dfe5401b6b; processes of two versions must agree on it.
        assert_eq!(slot("lock:a"), 875);
    }
}
