//! How a majority of the masters decides: an acquisition's tally, and what a majority
//! sees of a key.

use std::time::Duration;

use crate::store::{
    contract::{Acquire, Contention, KeyStatus, KeyView},
    fanout::NodeReply,
};

/// What the masters answered an acquisition, so far.
#[derive(Debug, Default)]
pub(super) struct Tally {
    /// The masters that granted the batch, with their fencing counters.
    pub(super) granted: Vec<(usize, u64)>,
    pub(super) held: Vec<Contention>,
    /// The masters that gave no answer and may still run the acquisition later (see
    /// [`NodeFailure::may_run_later`]): a connection that broke after the send is one, as
    /// a timeout is, where a refused connection sent nothing.
    pub(super) unanswered: Vec<usize>,
    /// Masters that gave no answer, for whatever reason.
    pub(super) failed: usize,
}

impl Tally {
    pub(super) fn record(&mut self, node: usize, reply: NodeReply<Acquire>) {
        match reply {
            Ok(Acquire::Granted(fence)) => self.granted.push((node, fence.get())),
            Ok(Acquire::Held(contention)) => self.held.push(contention),
            Err(failure) => {
                self.failed += 1;
                if failure.may_run_later() {
                    self.unanswered.push(node);
                }
            }
        }
    }

    /// When a majority of the masters may let a refused batch in, as far as the holds that
    /// kept it out say: the masters that granted it do already, and each that refused
    /// does when the earliest of those holds ends there; the batch needs `quorum` of them.
    /// (The earliest end of any one master came first, before a majority's where the
    /// masters' clocks or the holder's writes to them differ, and a look then found the
    /// keys still held: the waiter looked again after each of its backoff's pauses, and
    /// `Retry-After` said too little. Behind a holder that died with holds ending 1 s / 2 s
    /// / 2 s from then on three masters: 8-9 scripts on a master and granted 7-810 ms
    /// after the majority's end, against 6-7 and 11-13 ms.)
    pub(super) fn majority_free_in(&self, quorum: usize) -> Option<Duration> {
        let needed = quorum.checked_sub(self.granted.len()).filter(|&n| n > 0)?;
        let mut ends: Vec<Duration> = self.held.iter().filter_map(|c| c.earliest_expiry).collect();
        ends.sort_unstable();
        ends.get(needed - 1).copied()
    }
}

/// The `quorum`-th largest of `values`: the most that `quorum` of them reach.
fn reached_by<T: Ord + Copy>(mut values: Vec<T>, quorum: usize) -> Option<T> {
    values.sort_unstable_by(|a, b| b.cmp(a));
    values.get(quorum.checked_sub(1)?).copied()
}

/// One key as a majority of the masters that answered see it: held (exclusively, or
/// shared) when `quorum` of them hold it so, held when they hold it in different modes (then no acquisition that the mode excludes can
/// get a majority), with the time left and the holds that `quorum` of them still have;
/// foreign when `quorum` of them are kept out by something else; free otherwise, even if a
/// minority still holds it (what is left there expires, and keeps nobody out). The waiters
/// that `quorum` of them have in line.
pub(super) fn majority_view(views: &[KeyView], quorum: usize) -> KeyView {
    let with = |status: fn(KeyStatus) -> bool| -> Vec<&KeyView> {
        views.iter().filter(|v| status(v.status)).collect()
    };
    let waiters = reached_by(views.iter().map(|v| v.waiters).collect(), quorum).unwrap_or(0);
    let held = with(|s| s == KeyStatus::Held);
    let shared = with(|s| s == KeyStatus::Shared);
    let either = with(|s| matches!(s, KeyStatus::Held | KeyStatus::Shared));
    let blocked = with(|s| s != KeyStatus::Free);
    let (status, seen) = if held.len() >= quorum {
        (KeyStatus::Held, held)
    } else if shared.len() >= quorum {
        (KeyStatus::Shared, shared)
    } else if either.len() >= quorum {
        // Held by a majority, in modes that differ from master to master (a late grant
        // or release on some): it keeps an exclusive request out, as held does.
        (KeyStatus::Held, either)
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

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;
    use crate::store::{contract::FencingToken, error::StoreError, fanout::NodeFailure};

    /// A master that gave no answer may run the acquisition later, and gets its release or
    /// withdrawal again then, whatever the failure: a timeout, or a connection that broke
    /// after the send. A refused connection sent nothing, and a command never sent runs
    /// nowhere.
    #[test]
    fn a_master_whose_connection_broke_after_the_send_may_run_the_acquisition_later() {
        let io_failure = |kind: io::ErrorKind| {
            let error = redis::RedisError::from(io::Error::new(kind, "on the wire"));
            Err(NodeFailure::Failed(StoreError::unknown(error)))
        };
        let mut tally = Tally::default();
        tally.record(0, Err(NodeFailure::TimedOut));
        tally.record(1, io_failure(io::ErrorKind::ConnectionReset));
        tally.record(2, io_failure(io::ErrorKind::ConnectionRefused));
        let not_sent = StoreError::not_sent(io::Error::other("no connection"));
        tally.record(3, Err(NodeFailure::Failed(not_sent)));
        assert_eq!(tally.unanswered, [0, 1]);
        assert_eq!(tally.failed, 4);
    }

    /// A refused batch is let in by a majority when the holds that kept it out end on
    /// enough masters, with those that granted it: the second end of three, the first of
    /// two when the third granted; never, as far as they say, when too few refusals name
    /// an end.
    #[test]
    fn a_refused_batch_is_free_on_a_majority_when_enough_of_its_holds_ended() {
        let refused = |ends_in: Option<Duration>| -> NodeReply<Acquire> {
            Ok(Acquire::Held(Contention {
                keys: vec!["lock:a".to_owned()],
                total: 1,
                earliest_expiry: ends_in,
                upgrade: false,
                may_reserve_later: false,
                counted: true,
            }))
        };
        let granted = || -> NodeReply<Acquire> { Ok(Acquire::Granted(FencingToken::new(1))) };
        let tally = |replies: Vec<NodeReply<Acquire>>| {
            let mut tally = Tally::default();
            for (node, reply) in replies.into_iter().enumerate() {
                tally.record(node, reply);
            }
            tally
        };
        let ms = |ms: u64| Some(Duration::from_millis(ms));
        let all_held = tally(vec![refused(ms(900)), refused(ms(300)), refused(ms(305))]);
        assert_eq!(all_held.majority_free_in(2), ms(305));
        let one_granted = tally(vec![refused(ms(900)), granted(), refused(ms(300))]);
        assert_eq!(one_granted.majority_free_in(2), ms(300));
        let unknown = tally(vec![
            refused(None),
            refused(ms(300)),
            Err(NodeFailure::TimedOut),
        ]);
        assert_eq!(unknown.majority_free_in(2), None);
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
}
