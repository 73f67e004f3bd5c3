//! How a majority of the masters decides: an acquisition's tally, and what a majority
//! sees of a key.

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
    use std::{io, time::Duration};

    use super::*;
    use crate::store::{error::StoreError, fanout::NodeFailure};

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
