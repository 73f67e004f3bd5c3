//! One key's locks in memory: its holds, exclusive or shared, and the reservations of the
//! waiters that want it; what keeps a request out, and what a grant or a reservation
//! changes. The store (`mod.rs`) finds the entries and ends holds on release.

use std::time::Instant;

use smallvec::SmallVec;

use crate::store::contract::{Holder, Line, Mode, OwnerToken, Ticket};

/// A key's holds, and the reservations of the waiters that want it.
#[derive(Debug, Default)]
pub(super) struct Entry {
    pub(super) holds: Option<Holds>,
    /// Waiters' reservations, earliest ticket first.
    pub(super) queue: Vec<Reservation>,
}

#[derive(Debug)]
pub(super) enum Holds {
    /// One owner's holds (re-entry adds more), which end together.
    Exclusive {
        owner: OwnerToken,
        /// The owner's holds on the key, each in the mode it was taken in: it is free when
        /// the last one is released, and shared again when the last exclusive one is.
        /// Mostly one, kept without an allocation.
        holds: SmallVec<[(u64, Mode); 1]>,
        expires_at: Instant,
    },
    /// Shared holds, each ending on its own: a reader that dies takes only its own hold
    /// with it. Expired ones are dropped when the key is next written.
    Shared(Vec<(Holder, Instant)>),
}

/// Why a key keeps an acquisition out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Block {
    /// Held by another owner, or reserved by an earlier waiter.
    Held,
    /// Held shared by the caller's owner and others, and asked for exclusively.
    Upgrade,
}

impl Holds {
    /// When the last live hold ends, if one is live.
    pub(super) fn expires_at(&self, now: Instant) -> Option<Instant> {
        match self {
            Self::Exclusive { expires_at, .. } => Some(*expires_at),
            Self::Shared(holds) => holds.iter().map(|&(_, until)| until).max(),
        }
        .filter(|&until| until > now)
    }

    pub(super) fn held_by(&self, holder: Holder, now: Instant) -> bool {
        match self {
            Self::Exclusive {
                owner,
                holds,
                expires_at,
            } => {
                *expires_at > now
                    && *owner == holder.owner
                    && holds.iter().any(|&(h, _)| h == holder.hold)
            }
            Self::Shared(holds) => holds.iter().any(|&(h, until)| h == holder && until > now),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Reservation {
    ticket: Ticket,
    pub(super) until: Instant,
}

impl Entry {
    /// The holds, if one of them is live.
    pub(super) fn live(&self, now: Instant) -> Option<&Holds> {
        self.holds.as_ref().filter(|h| h.expires_at(now).is_some())
    }

    /// Whether and why the key keeps out `owner`, asking for it in `mode` and standing in
    /// `line`: held by others in a mode that excludes it, or, unless `owner` holds it,
    /// reserved by a waiter that `line` must let go first.
    pub(super) fn blocks(
        &self,
        owner: OwnerToken,
        mode: Mode,
        line: Line,
        now: Instant,
    ) -> Option<Block> {
        let reserved = || {
            self.queue
                .iter()
                .any(|r| r.until > now && line.kept_out_by(r.ticket))
                .then_some(Block::Held)
        };
        match self.live(now) {
            None => reserved(),
            Some(Holds::Exclusive { owner: holder, .. }) => {
                (*holder != owner).then_some(Block::Held)
            }
            Some(Holds::Shared(holds)) => {
                let live = || holds.iter().filter(|&&(_, until)| until > now);
                let mine = live().any(|(h, _)| h.owner == owner);
                let others = live().any(|(h, _)| h.owner != owner);
                match mode {
                    Mode::Shared if mine => None,
                    Mode::Shared => reserved(),
                    Mode::Exclusive if !others => None,
                    Mode::Exclusive if mine => Some(Block::Upgrade),
                    Mode::Exclusive => Some(Block::Held),
                }
            }
        }
    }

    /// Adds `holder`'s hold in `mode` until `expires_at`, once [`blocks`](Self::blocks)
    /// found nothing in the way: the owner's own exclusive holds take it whatever the
    /// mode; its shared holds, alone on the key, become exclusive when asked so.
    pub(super) fn grant(&mut self, holder: Holder, mode: Mode, expires_at: Instant, now: Instant) {
        let live = self.holds.take().filter(|h| h.expires_at(now).is_some());
        self.holds = Some(match (live, mode) {
            (
                Some(Holds::Exclusive {
                    owner,
                    mut holds,
                    expires_at: until,
                }),
                _,
            ) => {
                holds.push((holder.hold, mode));
                Holds::Exclusive {
                    owner,
                    holds,
                    expires_at: until.max(expires_at),
                }
            }
            (Some(Holds::Shared(mut holds)), Mode::Shared) => {
                holds.retain(|&(_, until)| until > now);
                holds.push((holder, expires_at));
                Holds::Shared(holds)
            }
            // Blocks found nobody else: the owner's shared holds are carried under the
            // exclusive one, until it ends.
            (Some(Holds::Shared(holds)), Mode::Exclusive) => {
                let mine = holds.iter().filter(|&&(_, until)| until > now);
                Holds::Exclusive {
                    owner: holder.owner,
                    holds: mine
                        .clone()
                        .map(|(h, _)| (h.hold, Mode::Shared))
                        .chain([(holder.hold, Mode::Exclusive)])
                        .collect(),
                    expires_at: mine.map(|&(_, until)| until).fold(expires_at, Instant::max),
                }
            }
            (None, Mode::Exclusive) => Holds::Exclusive {
                owner: holder.owner,
                holds: SmallVec::from_buf([(holder.hold, Mode::Exclusive)]),
                expires_at,
            },
            (None, Mode::Shared) => Holds::Shared(vec![(holder, expires_at)]),
        });
    }

    /// Still held, by this hold.
    pub(super) fn held_by(&self, holder: Holder, now: Instant) -> bool {
        self.holds.as_ref().is_some_and(|h| h.held_by(holder, now))
    }

    /// Puts `ticket`'s reservation in line (or renews it), dropping expired ones.
    pub(super) fn reserve(&mut self, ticket: Ticket, until: Instant, now: Instant) {
        self.queue.retain(|r| r.until > now && r.ticket != ticket);
        let at = self.queue.partition_point(|r| r.ticket < ticket);
        self.queue.insert(at, Reservation { ticket, until });
    }

    /// Takes `ticket`'s reservation out of line; whether it was there.
    pub(super) fn withdraw(&mut self, ticket: Ticket, now: Instant) -> bool {
        let had = self.queue.iter().any(|r| r.ticket == ticket);
        self.queue.retain(|r| r.until > now && r.ticket != ticket);
        had
    }

    /// The waiter first in line, if it may come in now that the key changed: the key is
    /// not held exclusively. (Held shared, it lets in a shared waiter; an exclusive one
    /// woken for nothing tries again, at the cost of one attempt.)
    pub(super) fn next_in(&self, now: Instant) -> Option<Ticket> {
        if matches!(self.live(now), Some(Holds::Exclusive { .. })) {
            return None;
        }
        self.queue.iter().find(|r| r.until > now).map(|r| r.ticket)
    }

    /// Whether the entry still means anything: a live hold or a live reservation.
    pub(super) fn in_use(&self, now: Instant) -> bool {
        self.live(now).is_some() || self.queue.iter().any(|r| r.until > now)
    }
}
