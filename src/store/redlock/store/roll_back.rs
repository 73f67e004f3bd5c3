//! Undoing a failed acquisition: on the masters that granted it now, and on those still at
//! work on it when they answer.

use std::{future::Future, sync::Arc};

use futures_util::{future::join_all, StreamExt};

use super::{RedlockStore, Replies};
use crate::store::{
    contract::{Acquire, AcquireRequest, Line},
    fanout::{bounded, Fanout},
    redis::{Freeing, RedisStore},
    redlock::majority::Tally,
};

impl RedlockStore {
    /// Undoes a failed acquisition: `tally` holds the masters' answers so far, `rest` the
    /// masters still at work on it (the caller marked it released first, so that a grant
    /// the fan-out sees land from now on undoes itself too). A master that refused wrote
    /// nothing (its steps undo themselves) and is sent nothing. The masters that granted
    /// are undone before this returns; those that gave no answer and may still run the
    /// acquisition get their release in the background rather than hold the request up
    /// again, as do those of `rest`, once they answer: no release overtakes the
    /// acquisition it undoes on its master, and a refusal by a majority is answered
    /// without waiting for the slowest master.
    pub(super) async fn roll_back(
        &self,
        request: &AcquireRequest,
        tally: &Tally,
        rest: Replies<Acquire>,
    ) {
        let undo = |node: usize, granted| {
            undo_on(&self.fanout, &self.masters[node].node, request, granted)
        };
        for &node in &tally.unanswered {
            tokio::spawn(undo(node, false));
        }
        if !rest.is_empty() {
            self.roll_back_when_answered(request, rest);
        }
        join_all(tally.granted.iter().map(|&(node, _)| undo(node, true))).await;
    }

    /// Undoes the acquisition on the masters of `rest` as each answers, in the background.
    fn roll_back_when_answered(&self, request: &AcquireRequest, mut rest: Replies<Acquire>) {
        let (fanout, masters, request) =
            (self.fanout.clone(), self.masters.clone(), request.clone());
        tokio::spawn(async move {
            while let Some((node, reply)) = rest.next().await {
                let master = &masters[node];
                match reply {
                    Ok(Acquire::Granted(_)) => undo_on(&fanout, &master.node, &request, true).await,
                    Ok(Acquire::Held(_)) => {}
                    Err(failure) => {
                        fanout.report(&master.address, "acquire", &failure);
                        if failure.may_run_later() {
                            undo_on(&fanout, &master.node, &request, false).await;
                        }
                    }
                }
            }
        });
    }
}

/// Undoes `request`'s acquisition on `master`, each call bounded by a node timeout a step.
/// Where it `granted`, a waiter in line first puts its reservations back, as on one Redis:
/// a release keeps a key's reservations, so the keys are never free of both in between, and
/// the waiter keeps its place everywhere. Then the hold ends, retried in the background
/// while the outcome is unknown ([`Fanout::release_on`]).
fn undo_on(
    fanout: &Arc<Fanout>,
    master: &Arc<RedisStore>,
    request: &AcquireRequest,
    granted: bool,
) -> impl Future<Output = ()> + Send + 'static {
    let (fanout, master, keys) = (fanout.clone(), master.clone(), request.keys.clone());
    let (holder, line, reserve) = (request.holder, request.line, request.reserve);
    async move {
        let how = match line {
            Line::At(ticket) => {
                if granted {
                    let timeout = fanout.timeout_for(keys.len(), master.step());
                    let claim = master.claims(keys.len());
                    let _ = bounded(timeout, master.reserve(&keys, ticket, reserve, claim)).await;
                }
                Freeing::RollBack(holder, ticket)
            }
            Line::Outside | Line::Holder(_) => Freeing::Release(holder),
        };
        let _ = fanout.release_on(master, keys, how).await;
    }
}
