//! Bounded stall (DESIGN.md, property 12): a batch of any size goes to Redis in steps of
//! at most [`RedisStore::with_step`] keys, so that no one script keeps Redis from its other
//! clients for longer than a step takes, whatever the batch.
//!
//! An acquisition takes its steps in key order. The keys of a granted step stay held while
//! the next ones are tried (others see them held, as they would a moment later), and only
//! the last step counts the grant: no fencing token, and so no grant, before every step
//! succeeded. A step that is refused ends the attempt: the steps before it are released,
//! and a waiter in line first reserves every key of its batch, so that its place in line
//! holds for the whole batch, as it does for a batch taken in one step. Keys are sorted,
//! so two batches in steps meet in the same order and never hold out for each other.

use std::ops::Range;

use super::{
    super::{
        contract::{Acquire, AcquireRequest, Keys, Line, LockStore},
        error::StoreError,
    },
    RedisStore,
};

impl RedisStore {
    /// Acquires a batch larger than a step, a step at a time (see the module docs).
    pub(super) async fn acquire_in_steps(
        &self,
        request: &AcquireRequest,
    ) -> Result<Acquire, StoreError> {
        let total = request.keys.len();
        let mut taken = 0;
        // Ends with the last step's answer, or with a refusal or failure before it.
        loop {
            let step = taken..(taken + self.step).min(total);
            let last = step.end == total;
            let part = request.of(&step.clone().collect::<Vec<_>>());
            match self.acquire_step(&part, last).await {
                Ok(Acquire::Granted(fence)) if last => return Ok(Acquire::Granted(fence)),
                Ok(Acquire::Granted(_)) => taken = step.end,
                Ok(Acquire::Held(contention)) => {
                    self.undo(request, step).await.map_err(|error| {
                        // The caller releases the whole batch again, as for any answer
                        // that may have left keys behind.
                        StoreError::unknown(format!(
                            "a step was refused, and undoing the steps before it failed: {error}"
                        ))
                    })?;
                    return Ok(Acquire::Held(contention));
                }
                Err(error) if taken == 0 => return Err(error),
                Err(error) => {
                    return Err(StoreError::unknown(format!(
                        "a step failed after {taken} keys of the batch were taken: {error}"
                    )))
                }
            }
        }
    }

    /// Undoes the steps before `refused`: a waiter in line reserves the keys of every other
    /// step (the refused step's script reserved its own) before the taken ones are released,
    /// so that they are never free of both in between.
    async fn undo(
        &self,
        request: &AcquireRequest,
        refused: Range<usize>,
    ) -> Result<(), StoreError> {
        let keys = &request.keys;
        if let Line::At(ticket) = request.line {
            self.reserve(&keys[..refused.start], ticket).await?;
            self.reserve(&keys[refused.end..], ticket).await?;
        }
        if refused.start > 0 {
            let taken: Keys = keys[..refused.start].into();
            self.release(&taken, request.holder).await?;
        }
        Ok(())
    }
}
