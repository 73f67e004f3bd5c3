//! A waiter's place in line: its [`Ticket`], and where an acquisition stands with respect
//! to the reservations of waiters ([`Line`]).

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// A waiter's place in line: smaller is earlier. Reservations of a waiter keep out every
/// request with a larger ticket, and every request that waits in no line at all.
///
/// A ticket is the milliseconds of the wall clock (since 2025) with 10 random bits below
/// them, which strictly increase within a process, then 64 random bits: those tell apart
/// two waiters of two processes that drew the same first part, which happened about once in
/// 1,024 arrivals in the same millisecond, and made them share one place in line (the
/// withdrawal of one took the other's). Across processes, tickets order waiters by arrival
/// as far as the machines' clocks agree; a skew only reorders waiters that arrived that
/// close together, and since a waiter keeps its ticket, every waiter is eventually the
/// earliest: none starves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Ticket {
    at: u64,
    id: u64,
}

impl Ticket {
    /// The ticket of a waiter that arrives now.
    pub(crate) fn take() -> Self {
        static LAST: AtomicU64 = AtomicU64::new(0);
        let drawn = (millis_since_epoch() << 10) | fastrand::u64(..1024);
        let previous = LAST
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                Some(drawn.max(last + 1))
            })
            .unwrap_or_default();
        Self {
            at: drawn.max(previous + 1),
            id: fastrand::u64(..),
        }
    }

    /// The ticket of an arrival `ago` before now: before every ticket taken since.
    pub(crate) fn since(ago: Duration) -> Self {
        let ago = u64::try_from(ago.as_millis()).unwrap_or(u64::MAX);
        Self {
            at: millis_since_epoch().saturating_sub(ago.saturating_add(1)) << 10,
            id: fastrand::u64(..),
        }
    }

    /// The ticket as a number of 36 decimal digits, in order: how wake-up messages name it.
    pub(crate) fn key(self) -> u128 {
        u128::from(self.at) * 10u128.pow(20) + u128::from(self.id)
    }

    /// The ticket as the scripts compare it: [`key`](Self::key) as 36 digits, leading
    /// zeros included, so that comparing two as strings compares them as numbers (which
    /// Lua's doubles could not hold).
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) fn as_arg(self) -> String {
        format!("{:036}", self.key())
    }
}

/// Milliseconds of the wall clock since 2025-01-01T00:00:00Z, the epoch of tickets and of
/// fencing tokens' clock floor (the scripts' `clock.lua` has the same): small enough that
/// these numbers, shifted by 10 bits, stay exact in the doubles of Redis's Lua (below 2^53)
/// for centuries. 0 for a clock set before 2025.
pub(super) fn millis_since_epoch() -> u64 {
    const EPOCH_MS: u64 = 1_735_689_600_000;
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .saturating_sub(EPOCH_MS)
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
    /// trusted caller's owner), which arrived with this ticket: the keys it holds keep it
    /// out of nothing; on the others it is kept out by the reservations of the waiters
    /// that arrived before it, and it reserves nothing. Every waiter that its holds keep
    /// waiting came after it (or it could not have taken them), so it never waits for one
    /// of those: no deadlock; and a waiter that came before it keeps its place.
    Holder(Ticket),
}

impl Line {
    /// Whether a live reservation with `ticket` keeps this acquisition out.
    pub(crate) fn kept_out_by(self, ticket: Ticket) -> bool {
        match self {
            Self::Outside => true,
            Self::At(mine) | Self::Holder(mine) => ticket < mine,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_strictly_increase_and_compare_as_their_script_strings() {
        let tickets: Vec<Ticket> = (0..10_000).map(|_| Ticket::take()).collect();
        assert!(tickets.windows(2).all(|w| w[0] < w[1]));
        // The scripts compare them as strings of one length: in the same order.
        assert!(tickets
            .windows(2)
            .all(|w| w[0].as_arg() < w[1].as_arg() && w[0].as_arg().len() == 36));
        assert!(tickets.windows(2).all(|w| w[0].key() < w[1].key()));
        // Two processes that draw the same first part still differ.
        let (mut a, mut b) = (tickets[0], tickets[0]);
        (a.id, b.id) = (1, 2);
        assert!(a != b && a < b);
    }
}
