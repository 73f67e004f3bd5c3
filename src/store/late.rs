//! Grants that land after their release, and reservations after their withdrawal: the one
//! mechanism for them, on every store.
//!
//! An acquisition whose answer never came (a timeout, a stall, a connection given up, a
//! request dropped while its call was in flight) is released at once, and again until the
//! store answers. But the acquisition itself may still be on its way: its command queued
//! on a connection given up, in a delayed packet, on a node that was slow. If it lands
//! after the release, its grant holds its keys for no one, unrenewed, until its TTL ends.
//!
//! So after such an acquisition, once its release was answered, the release is sent
//! again on a short schedule ([`AFTER`]): a queued command runs as soon as its store runs
//! again, which is when the first release is answered, and a few seconds catch nearly
//! every late grant. One that lands later still (a packet held up for longer) keeps its
//! keys until its TTL ends: the bound every store states.
//!
//! A waiter's refused attempt may land late in the same way, after the waiter withdrew
//! its place in line: the withdrawal is sent again on the same schedule (`acquire::place`).
//! A reservation that lands later still keeps its place to the waiter's deadline.

use std::{future::Future, time::Duration};

/// When the release (or withdrawal) is sent again, each pause counted from the one before:
/// 0.25 s, 1.25 s and 3.25 s after the first was answered.
pub(crate) const AFTER: [Duration; 3] = [
    Duration::from_millis(250),
    Duration::from_secs(1),
    Duration::from_secs(2),
];

/// Sends `undo` (a release, or a withdrawal) again on the schedule of [`AFTER`], after an
/// acquisition whose answer never came and whose first `undo` was answered.
pub(crate) async fn send_again<F, Fut>(mut undo: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    for pause in AFTER {
        tokio::time::sleep(pause).await;
        undo().await;
    }
}
