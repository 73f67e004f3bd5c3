//! The release message: how a release tells the waiters of other processes what it freed
//! (the wake-up slots of its keys, and the tickets of the waiters first in line on them),
//! over Redis pub/sub or PostgreSQL's `NOTIFY`.

use std::{fmt::Write as _, time::Duration};

use super::{
    failing::{Failing, Lines},
    wake::{Handover, Wakeups, SLOTS},
};
use crate::backoff::Backoff;

/// A listener's attempts to hear release messages (Redis pub/sub, PostgreSQL's `LISTEN`),
/// again and again while its server is away: the pauses between them, and their log
/// ([`Failing`]). Waiters poll meanwhile.
pub(crate) struct Reconnecting {
    backoff: Backoff,
    log: Failing,
}

static LISTENING: Lines = Lines {
    failed: "not listening for lock releases; waiters poll until it does again (its further \
             attempts are logged at debug level)",
    still: "still not listening for lock releases",
    back: "listening for lock releases again",
};

impl Reconnecting {
    /// A listener to the server at `at`.
    pub(crate) fn new(at: String) -> Self {
        Self {
            backoff: Self::backoff(),
            log: Failing::new(&LISTENING, at),
        }
    }

    fn backoff() -> Backoff {
        Backoff::new(Duration::from_millis(100), Duration::from_secs(5))
    }

    /// It listens (again).
    pub(crate) fn listening(&mut self) {
        self.log.succeeded();
        self.backoff = Self::backoff();
    }

    /// It could not listen, or lost its connection, for `why`.
    pub(crate) fn failed(&mut self, why: &dyn std::fmt::Display) {
        self.log.failed(why);
    }

    /// The pause before the next attempt.
    pub(crate) async fn pause(&mut self) {
        tokio::time::sleep(self.backoff.pause()).await;
    }
}

/// A release of more slots than this wakes every waiter instead of naming them.
const MAX_NAMED_SLOTS: usize = 64;

/// The message of a release by the store tagged `tag` ([`Wakeups::tag`]): its slots and
/// the tag, `3,17,512,@5f0c…`, or `*` for all; the release script adds the tickets of the
/// waiters it lets in (`,#<36 digits>`, and on PostgreSQL the key's grant for a waiter it
/// handed its key: see [`wake_heads`]). The store's own listener skips the messages
/// with its tag, since the release woke its waiters already: woken a second time while
/// they try again, they would try once more for nothing. Listeners of earlier versions
/// take the slots and skip the tag, which is not a number; `*` goes without one, since
/// they wake every waiter only for `*` alone.
pub(crate) fn release_message(slots: &[usize], tag: u64) -> String {
    if slots.len() > MAX_NAMED_SLOTS {
        return "*".to_owned();
    }
    slots_and_tag(slots, tag)
}

/// `3,17,512,@5f0c…`: every one of `slots`, and the tag.
fn slots_and_tag(slots: &[usize], tag: u64) -> String {
    let mut message = String::with_capacity(slots.len() * 5 + 21);
    for slot in slots {
        let _ = write!(message, "{slot},");
    }
    let _ = write!(message, "@{tag:x}");
    message
}

/// The entry of a release message that says its waiters first in line are unknown: a
/// release whose answer was lost, whose retry found nothing left to free (a cluster's,
/// announced by the client once answered). Its listeners wake, on each key of theirs in
/// its slots, their waiter in line with the earliest ticket
/// ([`Wakeups::wake_first_in_line`]). Listeners of earlier versions skip it, as a ticket
/// they cannot read.
const UNNAMED_HEADS: &str = "#?";

/// The message of a release by the store tagged `tag` whose waiters first in line are
/// unknown ([`UNNAMED_HEADS`]). It names every slot, however many (a cluster's
/// `SPUBLISH`, which has no payload limit to keep under): `*` would wake every waiter of
/// every process, for a lost answer.
#[cfg(feature = "cluster")]
pub(crate) fn unnamed_heads_message(slots: &[usize], tag: u64) -> String {
    let mut message = slots_and_tag(slots, tag);
    let _ = write!(message, ",{UNNAMED_HEADS}");
    message
}

/// Wakes the waiters that a release message names, unless this store sent it: those of
/// its slots (`*`: of every slot), and the waiters in line whose tickets follow a `#`
/// (the release script adds those: the first in line on each key it freed; see
/// [`Wakeups`]); `#*` wakes every waiter in line, for a release whose list did not fit
/// in one message (PostgreSQL's payload), and [`UNNAMED_HEADS`] those first in line
/// on its slots' keys.
pub(crate) fn wake_from_message(wakeups: &Wakeups, payload: &[u8]) {
    let text = std::str::from_utf8(payload).unwrap_or_default();
    let own = |entry: &str| {
        entry
            .strip_prefix('@')
            .and_then(|tag| u64::from_str_radix(tag, 16).ok())
            == Some(wakeups.tag())
    };
    if text.split(',').any(own) {
        return;
    }
    if text.split(',').any(|entry| entry == "#*") {
        wakeups.wake_all();
        return;
    }
    if text.split(',').any(|entry| entry == UNNAMED_HEADS) {
        let mut slots: Vec<usize> = text.split(',').filter_map(|s| s.parse().ok()).collect();
        slots.sort_unstable();
        wakeups.wake_first_in_line(&slots, None);
        return;
    }
    if text.split(',').any(|entry| entry == "*") {
        wakeups.wake_slots(0..SLOTS);
    } else {
        wakeups.wake_slots(text.split(',').filter_map(|s| s.parse().ok()));
    }
    wake_heads(
        wakeups,
        text.split(',').filter_map(|entry| entry.strip_prefix('#')),
    );
}

/// Wakes the waiters first in line that a release names: `<ticket>`, or
/// `<ticket>:<token>:<hold>` for one it handed its key ([`Handover`]; the hold as
/// PostgreSQL's signed `bigint`).
pub(crate) fn wake_heads<'a>(wakeups: &Wakeups, heads: impl IntoIterator<Item = &'a str>) {
    let mut woken = Vec::new();
    for head in heads {
        let mut parts = head.split(':');
        let Some(Ok(ticket)) = parts.next().map(str::parse::<u128>) else {
            continue;
        };
        let handover = match (parts.next(), parts.next()) {
            (Some(token), Some(hold)) => token.parse().ok().zip(hold.parse::<i64>().ok()),
            _ => None,
        };
        match handover {
            Some((token, hold)) => wakeups.hand_over(
                ticket,
                Handover {
                    token,
                    hold: u64::from_ne_bytes(hold.to_ne_bytes()),
                },
            ),
            None => woken.push(ticket),
        }
    }
    wakeups.wake_tickets(woken);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::wake::{any_released, slots_of};

    /// Whether the waiter of `keys` wakes within 50 ms of `payload`.
    async fn wakes(wakeups: &Wakeups, keys: &[String], payload: &str) -> bool {
        let mut watches = wakeups.watch(keys);
        wake_from_message(wakeups, payload.as_bytes());
        tokio::time::timeout(Duration::from_millis(50), any_released(&mut watches))
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_store_skips_its_own_release_messages_and_wakes_for_others() {
        let (ours, theirs) = (Wakeups::new(), Wakeups::new());
        let keys = vec!["lock:a".to_owned()];
        let slots = slots_of(&keys);
        let message = release_message(&slots, ours.tag());
        assert!(!wakes(&ours, &keys, &message).await, "{message}");
        assert!(wakes(&theirs, &keys, &message).await, "{message}");
        // An earlier version's message, without a tag.
        assert!(wakes(&ours, &keys, &slots[0].to_string()).await);
        // What an earlier version's listener reads of it: the slots.
        let read: Vec<usize> = message.split(',').filter_map(|s| s.parse().ok()).collect();
        assert_eq!(read, slots);
    }

    #[tokio::test]
    async fn a_message_wakes_the_waiters_first_in_line_it_names_and_no_other() {
        let wakeups = Wakeups::new();
        let (named, behind) = (61_420_580_338_024, 61_420_580_338_025);
        let (mut named_watch, mut behind_watch) = (
            wakeups.watch_ticket(named, Default::default()),
            wakeups.watch_ticket(behind, Default::default()),
        );
        // As the release script sends it: the slots as given (every one, for a big
        // batch), then the first in line; from another store, so not skipped.
        let message = format!("*,#{named}");
        wake_from_message(&wakeups, message.as_bytes());
        let soon = Duration::from_millis(50);
        let woke = |watch| async move {
            tokio::time::timeout(soon, any_released(watch))
                .await
                .is_ok()
        };
        assert!(woke(&mut named_watch).await, "{message}");
        assert!(!woke(&mut behind_watch).await, "{message}");
        // The slots still wake the waiters in no line.
        let keys = vec!["lock:a".to_owned()];
        assert!(wakes(&wakeups, &keys, &message).await);
    }

    /// A head the release handed its key (PostgreSQL: `ticket:token:hold`, the hold as a
    /// signed `bigint`) is woken with the grant, once; a plain head, or one whose grant
    /// does not parse, is woken without one (its attempt finds what the release did).
    #[tokio::test]
    async fn a_handed_head_is_woken_with_its_grant_and_a_plain_one_without() {
        let wakeups = Wakeups::new();
        let (handed, plain, garbled) = (61_420_580_338_024, 61_420_580_338_025, 61_420_580_338_026);
        let mut watches =
            [handed, plain, garbled].map(|ticket| wakeups.watch_ticket(ticket, Default::default()));
        let message = format!("3,@1,#{handed}:42:-2,#{plain},#{garbled}:x:1");
        wake_from_message(&wakeups, message.as_bytes());
        for watch in &mut watches {
            tokio::time::timeout(Duration::from_millis(50), any_released(watch))
                .await
                .expect("woken");
        }
        let grant = Handover {
            token: 42,
            hold: u64::MAX - 1,
        };
        assert_eq!(watches[0].take_handover(), Some(grant));
        assert_eq!(watches[0].take_handover(), None, "taken once");
        assert_eq!(watches[1].take_handover(), None);
        assert_eq!(watches[2].take_handover(), None);
    }

    /// A cluster's release whose answer was lost, answered by a retry that found nothing
    /// left to free, cannot name the waiters first in line: its message says so, and each
    /// listener wakes its own first in line on each key of the message's slots.
    #[cfg(feature = "cluster")]
    #[tokio::test]
    async fn a_release_that_cannot_name_its_waiters_wakes_the_first_in_line_on_its_slots() {
        let wakeups = Wakeups::new();
        let batch = |keys: &[&str]| -> std::sync::Arc<[String]> {
            keys.iter().map(|k| (*k).to_owned()).collect()
        };
        let (freed, other) = ("lock:b", "lock:c");
        assert_ne!(slots_of(&batch(&[freed])), slots_of(&batch(&[other])));
        let mut first = wakeups.watch_ticket(1, batch(&["lock:a", freed]));
        let mut behind = wakeups.watch_ticket(2, batch(&[freed]));
        let mut elsewhere = wakeups.watch_ticket(3, batch(&[other]));
        let mut in_no_line = wakeups.watch(&batch(&[freed]));
        let message = unnamed_heads_message(&slots_of(&batch(&[freed])), Wakeups::new().tag());
        wake_from_message(&wakeups, message.as_bytes());
        assert!(woke(&mut first).await, "{message}");
        assert!(!woke(&mut behind).await, "{message}");
        assert!(!woke(&mut elsewhere).await, "{message}");
        assert!(woke(&mut in_no_line).await, "{message}");
        // The store that sent it skips it.
        let own = unnamed_heads_message(&slots_of(&batch(&[freed])), wakeups.tag());
        wake_from_message(&wakeups, own.as_bytes());
        assert!(!woke(&mut first).await, "{own}");
        assert!(!woke(&mut in_no_line).await, "{own}");
        // However many slots: each named, none skipped, never `*`.
        let slots: Vec<usize> = (0..SLOTS).collect();
        let message = unnamed_heads_message(&slots, 1);
        let named: Vec<usize> = message.split(',').filter_map(|s| s.parse().ok()).collect();
        assert_eq!(named, slots);
    }

    /// Whether `watch` wakes within 50 ms.
    #[cfg(feature = "cluster")]
    async fn woke(watch: &mut crate::store::wake::Watches<'_>) -> bool {
        tokio::time::timeout(Duration::from_millis(50), any_released(watch))
            .await
            .is_ok()
    }

    /// PostgreSQL's release whose list of waiters would not fit in one notification
    /// sends `*,#*`: every waiter wakes, in line or not.
    #[tokio::test]
    async fn a_release_too_long_to_name_its_waiters_wakes_every_waiter() {
        let wakeups = Wakeups::new();
        let mut watches = [61_420_580_338_024, 61_420_580_338_025]
            .map(|ticket| wakeups.watch_ticket(ticket, Default::default()));
        wake_from_message(&wakeups, b"*,#*");
        for watch in &mut watches {
            tokio::time::timeout(Duration::from_millis(50), any_released(watch))
                .await
                .expect("a waiter in line woken");
        }
        let keys = vec!["lock:a".to_owned()];
        assert!(
            wakes(&wakeups, &keys, "*,#*").await,
            "a waiter in no line woken"
        );
    }

    #[test]
    fn many_slots_go_as_every_slot() {
        let slots: Vec<usize> = (0..=MAX_NAMED_SLOTS).collect();
        assert_eq!(release_message(&slots, 7), "*");
        assert_eq!(release_message(&[3, 17], 255), "3,17,@ff");
    }
}
