//! A waiter's place in line on the masters: its withdrawal everywhere, and, once the
//! majority granted its batch, on the masters that did not, after they answered.

use std::{future::Future, sync::Arc};

use futures_util::{future::join_all, StreamExt};

use super::{RedlockStore, Replies};
use crate::store::{
    contract::{Acquire, Keys, LockStore, Ticket},
    fanout::{bounded, Fanout, NodeReply},
    late,
    redis::RedisStore,
};

impl RedlockStore {
    /// Withdraws a waiter's reservations on each of `nodes` at once.
    pub(super) fn start_withdrawals(
        &self,
        nodes: impl Iterator<Item = usize>,
        keys: &Arc<[String]>,
        ticket: Ticket,
    ) -> Replies<usize> {
        self.start_on(nodes, |_, node| {
            withdrawal(&self.fanout, &node, keys, ticket)
        })
    }

    /// Withdraws a granted waiter's place in line on the masters that did not grant its
    /// batch, where its reservations (or its claim) would keep later requests out until
    /// its deadline: once the masters still at work on the acquisition (`rest`) have
    /// answered, in the background. A withdrawal that overtook a master's acquisition would
    /// be undone by that master's refusal, which puts the place back; a claim's retry, a
    /// plain pass and then a script, left it behind so in a full run. A master that grants
    /// after the majority did has ended the place there itself, as every grant does: a
    /// withdrawal there found nothing, and read the whole batch to find it (2,000-key
    /// orders one at a time on three masters: every grant sent one, and the masters' CPU a
    /// grant was 10.5-11.7 ms with it, 9.0-9.9 without). A master whose acquisition got
    /// no answer (`unanswered`, and those in `rest` that fail so) may still run it later,
    /// be refused and put the place back: it is sent the withdrawal again on [`late`]'s
    /// schedule. (The waiter's earlier attempts that may do so are its place's to
    /// withdraw again: `acquire::place`.)
    pub(super) fn withdraw_when_answered(
        &self,
        mut rest: Replies<Acquire>,
        granted: &[(usize, u64)],
        keys: &Keys,
        ticket: Ticket,
        mut unanswered: Vec<usize>,
    ) {
        // The masters outside the majority's grants, by index, as `rest` names them.
        let mut refused: Vec<(usize, Arc<RedisStore>)> = (0..self.masters.len())
            .filter(|node| granted.iter().all(|&(g, _)| g != *node))
            .map(|node| (node, self.masters[node].node.clone()))
            .collect();
        let (keys, fanout) = (keys.clone(), self.fanout.clone());
        tokio::spawn(async move {
            while let Some((node, reply)) = rest.next().await {
                match reply {
                    Ok(Acquire::Granted(_)) => refused.retain(|(other, _)| *other != node),
                    Err(failure) if failure.may_run_later() => unanswered.push(node),
                    _ => {}
                }
            }
            let withdraw = |master: &Arc<RedisStore>| withdrawal(&fanout, master, &keys, ticket);
            join_all(refused.iter().map(|(_, master)| withdraw(master))).await;
            refused.retain(|(node, _)| unanswered.contains(node));
            send_again(&refused, &fanout, &keys, ticket).await;
        });
    }
}

/// Sends `ticket`'s withdrawal to `masters` again on [`late`]'s schedule.
async fn send_again(
    masters: &[(usize, Arc<RedisStore>)],
    fanout: &Fanout,
    keys: &Keys,
    ticket: Ticket,
) {
    if masters.is_empty() {
        return;
    }
    late::send_again(|| async move {
        join_all(
            masters
                .iter()
                .map(|(_, m)| withdrawal(fanout, m, keys, ticket)),
        )
        .await;
    })
    .await;
}

/// A withdrawal of `ticket`'s places on `master`, bounded by a node timeout a step.
fn withdrawal(
    fanout: &Fanout,
    master: &Arc<RedisStore>,
    keys: &Keys,
    ticket: Ticket,
) -> impl Future<Output = NodeReply<usize>> + Send + 'static {
    let (master, keys) = (master.clone(), keys.clone());
    let timeout = fanout.timeout_for(keys.len(), master.step());
    async move { bounded(timeout, master.withdraw(&keys, ticket)).await }
}
