//! One attempt at a batch on one slot map: each master its group, all at once; granted
//! when every group was, and then counted; otherwise rolled back everywhere.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Instant,
};

use futures_util::{stream::FuturesUnordered, StreamExt};

use super::{
    nodes::Nodes,
    topology::{Group, Topology},
};
use crate::store::{
    contract::{Acquire, AcquireRequest, Contention, FencingToken, Line},
    error::StoreError,
    fanout::NodeFailure,
    redis::{
        scripts::{COUNT_GRANT, COUNT_GRANT_SOURCE},
        Freeing,
    },
};

/// What one attempt at a batch came to.
pub(super) enum Attempt {
    /// The answer for the caller.
    Done(Result<Acquire, StoreError>),
    /// A group was refused because the cluster moved under it: nothing of the attempt is
    /// left anywhere, nor can land later, and it may be made again on a fresh map, under
    /// the same hold.
    Moved(String),
}

impl Nodes {
    /// One attempt at `request` on the map `topology`.
    pub(super) async fn attempt(
        self: &Arc<Self>,
        topology: &Topology,
        request: &AcquireRequest,
    ) -> Attempt {
        let AcquireRequest {
            namespace,
            keys,
            holder,
            report,
            line,
            reserve,
            ..
        } = request;
        let (holder, reserve) = (*holder, *reserve);
        let groups = match topology.group(keys, 0..keys.len()) {
            Ok(groups) => groups,
            Err(error) => return Attempt::Moved(error.to_string()),
        };
        // Registered before anything is sent: the release that the caller's guard sends if
        // this future is dropped midway raises it, and groups that land after that undo
        // themselves.
        let released = self.fanout.register(holder);
        let mut calls: FuturesUnordered<_> = groups
            .iter()
            .enumerate()
            .map(|(index, group)| {
                let node = topology.masters[group.master].node.clone();
                let part = request.of(&group.indices);
                let call = self.fanout.acquire_on(node, part, released.clone());
                self.fanout.spawn(index, call)
            })
            .collect();
        // The groups that granted, those that may have (no answer in time), and those that
        // met a moved slot after they may have taken some of their keys.
        let (mut granted, mut unsure, mut moved_under) = (Vec::new(), Vec::new(), Vec::new());
        let (mut held, mut moved, mut why_unsure) = (Vec::new(), None, None);
        while let Some((index, reply)) = calls.next().await {
            match reply {
                Ok(Acquire::Granted(_)) => granted.push(index),
                Ok(Acquire::Held(contention)) => held.push(contention),
                Err(failure) if !failure.may_have_applied() => moved = Some(failure.to_string()),
                // The map moved under the group: its node may have taken keys before it met
                // the move (a plain pass, or the steps before), which are released with the
                // granted groups, on the new map. Only when the node answered: the batch is
                // then made again under the same hold, which no part of this attempt may
                // land on later (one that may is unsure, below).
                Err(failure) if cluster_moved(&failure) && !failure.may_run_later() => {
                    moved = Some(failure.to_string());
                    moved_under.push(index);
                }
                Err(failure) => {
                    let address = &topology.masters[groups[index].master].address;
                    self.fanout.report(address, "acquire", &failure);
                    why_unsure = Some(failure.to_string());
                    unsure.push(index);
                }
            }
        }
        if granted.len() == groups.len() {
            let counted = self.count_grant(namespace).await;
            if let Ok(fence) = counted {
                return Attempt::Done(Ok(Acquire::Granted(fence)));
            }
            // Nothing was handed out: release it all, and fail.
            self.roll_back(keys, Freeing::Release(holder), &released)
                .await;
            self.fanout.mark_released(holder);
            let error = counted.err().map(|e| e.to_string()).unwrap_or_default();
            return Attempt::Done(Err(StoreError::left_nothing(format!(
                "could not count the grant: {error}"
            ))));
        }
        // Refused: release every group that granted or may have, on wherever its keys are
        // now, before answering, so that nothing is left behind and a next attempt with
        // the same holder cannot meet a late release of this one. (A group that may land
        // later still is released again by the fan-out, `late`.)
        granted.extend(unsure);
        granted.extend(moved_under);
        // A waiter in line kept out by some groups was granted the others: it keeps its
        // place in line on those keys too, as on one Redis (the refused groups' scripts
        // reserved theirs). The reservation goes on before the rollback, so that the keys
        // are never free of both between the two: a release keeps a key's reservations.
        // A reservation whose answer was lost, sent again, may land after the wait ended:
        // the refusal says so, and the waiter's place withdraws itself again later.
        let mut how = Freeing::Release(holder);
        let reserved_unsure = AtomicBool::new(false);
        if let (Line::At(ticket), false, false) = (*line, held.is_empty(), granted.is_empty()) {
            how = Freeing::RollBack(holder, ticket);
            let subset = keys_of_groups(&groups, &granted, keys);
            let deadline = Instant::now() + self.retry_for;
            let reserved = self
                .on_groups(
                    "reserve",
                    &subset,
                    deadline,
                    Some(&reserved_unsure),
                    // A claim where the group's acquisition claimed (`claims.lua`).
                    |node, keys| async move {
                        let claim = node.claims(keys.len());
                        node.reserve(&keys, ticket, reserve, claim).await
                    },
                )
                .await;
            if let Err(error) = reserved {
                tracing::debug!(%error, "a waiter's reservations on a granted group failed");
            }
        }
        let rolled_back = if granted.is_empty() {
            true
        } else {
            let subset = keys_of_groups(&groups, &granted, keys);
            self.roll_back(&subset, how, &released).await
        };
        self.fanout.mark_released(holder);
        if let Some(why) = why_unsure {
            let why = format!("a cluster master did not answer in time: {why}");
            // The group may still run its script there, after the wait ended: refused, it
            // puts the waiter's place in line back, which the waiter alone withdraws (and
            // again later, for such an attempt). A grant there is released by the fan-out
            // (`late`).
            return Attempt::Done(Err(match line {
                Line::At(_) => StoreError::left_place(why),
                Line::Outside | Line::Holder(_) => StoreError::left_nothing(why),
            }));
        }
        if !held.is_empty() {
            let mut contention = Contention::merge(held, *report, false);
            contention.may_reserve_later = reserved_unsure.load(Ordering::SeqCst);
            return Attempt::Done(Ok(Acquire::Held(contention)));
        }
        match moved {
            Some(why) if rolled_back => Attempt::Moved(why),
            Some(why) => Attempt::Done(Err(StoreError::left_nothing(why))),
            None => Attempt::Done(Err(StoreError::left_nothing(
                "the cluster refused the batch",
            ))),
        }
    }

    /// Releases `keys` of a refused attempt everywhere, as `how` says (a waiter's roll-back
    /// behind its reservations does not wake it). Whether that is certain: it finished
    /// in time (otherwise it goes on in the background), and no release command of it may
    /// still land later (one that got no answer in time was sent again; the first could
    /// then end a next attempt's grant of the same hold).
    async fn roll_back(
        self: &Arc<Self>,
        keys: &Arc<[String]>,
        how: Freeing,
        released: &AtomicBool,
    ) -> bool {
        released.store(true, Ordering::SeqCst);
        let unsure = Arc::new(AtomicBool::new(false));
        let release = self.start_release(keys.clone(), how, Some(unsure.clone()));
        let finished = matches!(
            tokio::time::timeout(self.retry_for, release).await,
            Ok(Ok(Ok(_)))
        );
        finished && !unsure.load(Ordering::SeqCst)
    }

    /// The token of a grant: the next number of the namespace's counter, floored by the
    /// clock of its master, counted after every group was granted (see [`RedisCluster`]'s
    /// docs).
    ///
    /// [`RedisCluster`]: super::RedisCluster
    async fn count_grant(&self, namespace: &str) -> Result<FencingToken, StoreError> {
        let counted = self
            .eval(&COUNT_GRANT, &COUNT_GRANT_SOURCE, namespace)
            .await?;
        Ok(FencingToken::new(counted))
    }
}

/// Whether a group's failure says that the map moved under it: the node does not serve a
/// key's slot any more, or not yet; the cluster is down; a master became a replica.
fn cluster_moved(failure: &NodeFailure) -> bool {
    let Some(redis) = failure.redis_error() else {
        return false;
    };
    if redis.is_connection_refusal() {
        return true;
    }
    let moved_codes = [
        "MOVED",
        "ASK",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "READONLY",
        "MASTERDOWN",
        "LOADING",
    ];
    if redis.code().is_some_and(|code| moved_codes.contains(&code)) {
        return true;
    }
    // A script that touched a key of a slot this node does not serve: see cluster.lua.
    let text = redis.to_string();
    text.contains("non local key") || text.contains("cluster is down")
}

/// The keys of the groups at `which`, as one batch.
fn keys_of_groups(groups: &[Group], which: &[usize], keys: &[String]) -> Arc<[String]> {
    which
        .iter()
        .flat_map(|&g| groups[g].indices.iter().map(|&i| keys[i].clone()))
        .collect()
}
