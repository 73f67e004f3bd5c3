//! The Redlock store: every call on every master at once, through the fanout, and the
//! majority's answer.

use std::{
    fmt,
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

#[cfg(feature = "idempotency")]
use bytes::Bytes;
use futures_util::{
    future::{join_all, BoxFuture},
    stream::FuturesUnordered,
    StreamExt,
};

mod place;

use super::majority::{majority_view, Tally};
#[cfg(feature = "idempotency")]
use crate::store::contract::{AnswerStore, StoredAnswer};
use crate::store::{
    contract::{
        Acquire, AcquireRequest, Contention, FencingToken, Holder, KeyView, Keys, Line, LockStore,
        Reply, Ticket,
    },
    error::StoreError,
    fanout::{bounded, clock_drift, Fanout, NodeFailure, NodeReply},
    redis::{Freeing, RedisStore},
    wake::Wakeups,
};

/// One master: its store, and its `host:port` for the logs (never the URL: it may carry a
/// password).
#[derive(Debug)]
pub(super) struct Master {
    pub(super) node: Arc<RedisStore>,
    pub(super) address: Arc<str>,
}

pub(crate) struct RedlockStore {
    masters: Box<[Master]>,
    quorum: usize,
    fanout: Arc<Fanout>,
    /// Shared with the masters, whose releases wake the waiters first in line.
    wakeups: Arc<Wakeups>,
}

impl RedlockStore {
    /// A store over `masters`, whose calls each may take `node_timeout`.
    pub(super) fn new(masters: Vec<Master>, node_timeout: Duration, wakeups: Arc<Wakeups>) -> Self {
        Self {
            quorum: masters.len() / 2 + 1,
            masters: masters.into(),
            fanout: Arc::new(Fanout::new("redlock", node_timeout)),
            wakeups,
        }
    }
}

impl fmt::Debug for RedlockStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let addresses: Vec<&str> = self.masters.iter().map(|m| &*m.address).collect();
        f.debug_struct("RedlockStore")
            .field("masters", &addresses)
            .field("quorum", &self.quorum)
            .field("fanout", &self.fanout)
            .finish_non_exhaustive()
    }
}

/// The masters' replies to one call, as they come.
type Replies<T> = FuturesUnordered<BoxFuture<'static, (usize, NodeReply<T>)>>;

/// Lets calls that nobody waits for any more run to their end (each is bounded by the node
/// timeout): a command half sent, or a connection half opened, would otherwise be lost, and
/// a master that is always a little slower than the others would never get a connection.
/// Each runs in a task of its own already; dropping its handle detaches it.
fn finish_in_background<T>(rest: Replies<T>) {
    drop(rest);
}

impl RedlockStore {
    /// `call` on each of `nodes` at once, each in a task of its own (see
    /// [`finish_in_background`]).
    fn start_on<T, F, Fut>(&self, nodes: impl Iterator<Item = usize>, call: F) -> Replies<T>
    where
        T: Send + 'static,
        F: Fn(usize, Arc<RedisStore>) -> Fut,
        Fut: Future<Output = NodeReply<T>> + Send + 'static,
    {
        nodes
            .map(|node| {
                let call = call(node, self.masters[node].node.clone());
                self.fanout.spawn(node, call)
            })
            .collect()
    }

    /// `call` on every master at once, a call on `keys` keys: each bounded by the time its
    /// master may take for it ([`Fanout::timeout_for`], a node timeout a step), as an
    /// acquisition is. A renewal of a big batch bounded by one node timeout missed it on
    /// every master, and its lease was lost, where its acquisition had fit.
    fn start_everywhere<T, F, Fut>(&self, keys: usize, call: F) -> Replies<T>
    where
        T: Send + 'static,
        F: Fn(Arc<RedisStore>) -> Fut,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        self.start_on(0..self.masters.len(), |_, node| {
            let timeout = self.fanout.timeout_for(keys, node.step());
            bounded(timeout, call(node))
        })
    }

    /// Releases on each of `nodes` at once (see [`Fanout::release_on`]).
    fn start_releases(
        &self,
        nodes: impl Iterator<Item = usize>,
        keys: &Arc<[String]>,
        how: Freeing,
    ) -> Replies<usize> {
        self.start_on(nodes, |_, node| {
            let (fanout, keys) = (self.fanout.clone(), keys.clone());
            async move { fanout.release_on(node, keys, how).await }
        })
    }

    /// Counts and logs that a master did not answer a call (see [`Fanout::report`]).
    fn report(&self, node: usize, call: &'static str, failure: &NodeFailure) {
        self.fanout
            .report(&self.masters[node].address, call, failure);
    }

    /// Waits for every master's answer to `call`, which frees `keys` for others (each is
    /// bounded by its node timeouts, one a step), reports those that failed, and wakes this
    /// process's waiters: how many answered, and the largest count any of them gave.
    async fn freed_everywhere(
        &self,
        call: &'static str,
        mut replies: Replies<usize>,
        keys: &[String],
    ) -> (usize, usize) {
        let (mut answered, mut freed) = (0, 0);
        while let Some((node, reply)) = replies.next().await {
            match reply {
                Ok(count) => {
                    answered += 1;
                    freed = freed.max(count);
                }
                Err(failure) => self.report(node, call, &failure),
            }
        }
        self.wakeups.wake_keys(keys);
        (answered, freed)
    }

    /// The largest of the granting masters' counters, once a majority of the masters holds
    /// at least that count (raising the lagging granting masters first if needed), and
    /// while the validity window is still open.
    async fn agree_on_fence(
        &self,
        namespace: &str,
        granted: &[(usize, u64)],
        valid_until: Instant,
    ) -> Result<FencingToken, &'static str> {
        let top = granted.iter().map(|&(_, fence)| fence).max().unwrap_or(0);
        let at_top = granted.iter().filter(|&&(_, fence)| fence == top).count();
        if at_top < self.quorum {
            let lagging = granted
                .iter()
                .filter(|&&(_, fence)| fence < top)
                .map(|&(node, _)| {
                    bounded(
                        self.fanout.node_timeout(),
                        self.masters[node].node.raise_fence(namespace, top),
                    )
                });
            let raised = join_all(lagging).await.iter().filter(|r| r.is_ok()).count();
            if at_top + raised < self.quorum {
                return Err("a majority of the Redlock masters could not agree on a fencing token");
            }
        }
        if Instant::now() >= valid_until {
            return Err("the Redlock majority answered after the lock's validity had run out");
        }
        Ok(FencingToken::new(top))
    }

    /// Releases whatever a failed acquisition may have left: on every master, unless every
    /// one of them refused (and so wrote nothing). It waits for the masters that answered
    /// the acquisition; those that gave no answer and may still run it get their release
    /// in the background rather than hold the request up again. A waiter in line first
    /// puts its reservations on the masters that granted (the others reserved when they
    /// refused), as on one Redis: a release keeps a key's reservations, so the keys are
    /// never free of both in between, and the waiter keeps its place everywhere.
    ///
    /// Returns whether a reservation of the waiter's may still land later: the acquisition
    /// on a master that gave no answer (refused there, it reserves), or a reservation here
    /// whose answer was lost.
    async fn roll_back(&self, request: &AcquireRequest, tally: &Tally) -> bool {
        let (keys, holder) = (&request.keys, request.holder);
        let mut strays = matches!(request.line, Line::At(_)) && !tally.unanswered.is_empty();
        if tally.granted.is_empty() && tally.failed == 0 {
            return strays;
        }
        let mut how = Freeing::Release(holder);
        if let (Line::At(ticket), false) = (request.line, tally.granted.is_empty()) {
            how = Freeing::RollBack(holder, ticket);
            let reserve = request.reserve;
            let mut reserved =
                self.start_on(tally.granted.iter().map(|&(node, _)| node), |_, node| {
                    let (keys, timeout, claim) = (
                        keys.clone(),
                        self.fanout.timeout_for(keys.len(), node.step()),
                        node.claims(keys.len()),
                    );
                    async move {
                        bounded(timeout, node.reserve(&keys, ticket, reserve, claim)).await
                    }
                });
            while let Some((_, reply)) = reserved.next().await {
                strays |= reply.is_err_and(|failure| failure.may_run_later());
            }
        }
        finish_in_background(self.start_releases(tally.unanswered.iter().copied(), keys, how));
        let answered = (0..self.masters.len()).filter(|node| !tally.unanswered.contains(node));
        let mut releases = self.start_releases(answered, keys, how);
        while releases.next().await.is_some() {}
        strays
    }
}

impl LockStore for RedlockStore {
    fn announces_releases(&self) -> bool {
        true
    }

    fn acquire<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, Acquire> {
        Box::pin(async move {
            let (keys, holder, ttl) = (&request.keys, request.holder, request.ttl);
            self.fanout.note_ttl(ttl);
            let valid_until = Instant::now() + ttl.saturating_sub(self.drift(ttl));
            // Registered before anything is sent: if this future is dropped midway (the
            // client left), the release that the caller's guard sends finds it, and
            // acquisitions that land after that release undo themselves.
            let released = self.fanout.register(holder);
            let mut replies = self.start_on(0..self.masters.len(), |_, node| {
                self.fanout
                    .acquire_on(node, request.clone(), released.clone())
            });
            let mut tally = Tally::default();
            while tally.granted.len() < self.quorum {
                let Some((node, reply)) = replies.next().await else {
                    break;
                };
                if let Err(failure) = &reply {
                    self.report(node, "acquire", failure);
                }
                tally.record(node, reply);
            }
            let mut why = "no majority of the Redlock masters granted the batch";
            if tally.granted.len() >= self.quorum {
                match self
                    .agree_on_fence(&request.namespace, &tally.granted, valid_until)
                    .await
                {
                    Ok(fence) => {
                        // The masters still working on it are not waited for: what they
                        // grant is released with the batch, by the release or by their
                        // own task.
                        match request.line {
                            Line::At(ticket) => {
                                let unanswered = tally.unanswered.clone();
                                self.withdraw_when_answered(
                                    replies,
                                    &tally.granted,
                                    keys,
                                    ticket,
                                    unanswered,
                                );
                            }
                            Line::Outside | Line::Holder(_) => finish_in_background(replies),
                        }
                        return Ok(Acquire::Granted(fence));
                    }
                    Err(reason) => why = reason,
                }
            }

            // Failed. Every master answers (or times out) before the rollback, so that a
            // release never overtakes the acquisition it undoes.
            while let Some((node, reply)) = replies.next().await {
                if let Err(failure) = &reply {
                    self.report(node, "acquire", failure);
                }
                tally.record(node, reply);
            }
            // Released before the rollback goes out: a grant that lands later still, on a
            // master that timed out, is released again by the fan-out (`late`).
            self.fanout.mark_released(holder);
            let strays = self.roll_back(request, &tally).await;
            // The rollback is done or under way: nothing is left for the caller to undo,
            // but a place in line that a master may still put back.
            let failed = |why: String| match strays {
                true => StoreError::left_place(why),
                false => StoreError::left_nothing(why),
            };
            let masters = self.masters.len();
            if tally.failed >= self.quorum {
                return Err(failed(format!(
                    "{} of {masters} Redlock masters did not answer in time",
                    tally.failed
                )));
            }
            if tally.granted.len() < self.quorum && !tally.held.is_empty() {
                let free_in = tally.majority_free_in(self.quorum);
                let mut contention = Contention::merge(tally.held, request.report, true);
                contention.earliest_expiry = free_in;
                contention.may_reserve_later = strays;
                return Ok(Acquire::Held(contention));
            }
            Err(failed(why.to_owned()))
        })
    }

    fn extend<'a>(&'a self, keys: &'a Keys, holder: Holder, ttl: Duration) -> Reply<'a, bool> {
        Box::pin(async move {
            self.fanout.note_ttl(ttl);
            let valid_until = Instant::now() + ttl.saturating_sub(self.drift(ttl));
            let mut replies = self.start_everywhere(keys.len(), |node| {
                let keys = keys.clone();
                async move { node.extend(&keys, holder, ttl).await }
            });
            let masters = self.masters.len();
            let (mut kept, mut lost) = (0, 0);
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(true) => kept += 1,
                    Ok(false) => lost += 1,
                    Err(failure) => self.report(node, "extend", &failure),
                }
                if kept >= self.quorum || lost > masters - self.quorum {
                    break;
                }
            }
            finish_in_background(replies);
            if kept >= self.quorum {
                return Ok(Instant::now() < valid_until);
            }
            if lost > masters - self.quorum {
                return Ok(false);
            }
            Err(StoreError::unknown(format!(
                "only {} of {masters} Redlock masters answered the extension",
                kept + lost
            )))
        })
    }

    fn release<'a>(&'a self, keys: &'a Keys, holder: Holder) -> Reply<'a, usize> {
        Box::pin(async move {
            self.fanout.mark_released(holder);
            let started = Instant::now();
            let release = Freeing::Release(holder);
            let mut replies = self.start_releases(0..self.masters.len(), keys, release);
            let (mut answered, mut deleted, mut unsure) = (0, 0, false);
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(count) => {
                        answered += 1;
                        deleted = deleted.max(count);
                    }
                    Err(failure) => {
                        self.report(node, "release", &failure);
                        unsure |= failure.may_have_applied();
                    }
                }
                if answered >= self.quorum {
                    // A majority suffices. The others get as long again, so that the next
                    // holder usually finds the keys free on every master; a frozen or
                    // slow one finishes in the background.
                    let grace = started.elapsed().max(Duration::from_millis(1));
                    let _ = tokio::time::timeout(grace, async {
                        while let Some((_, reply)) = replies.next().await {
                            if let Ok(count) = reply {
                                deleted = deleted.max(count);
                            }
                        }
                    })
                    .await;
                    finish_in_background(replies);
                    self.wakeups.wake_keys(keys);
                    return Ok(deleted);
                }
            }
            let detail = format!(
                "only {answered} of {} Redlock masters answered the release",
                self.masters.len()
            );
            Err(if unsure {
                StoreError::unknown(detail)
            } else {
                StoreError::left_nothing(detail)
            })
        })
    }

    /// Withdraws on every master at once, and waits for each (each bounded by its node
    /// timeouts, one a step): a reservation left on a master that does not answer expires
    /// on its own, unless the waiter's place sends the withdrawal again (`acquire::place`,
    /// after an attempt that may still reserve later).
    fn withdraw<'a>(&'a self, keys: &'a Keys, ticket: Ticket) -> Reply<'a, usize> {
        Box::pin(async move {
            let replies = self.start_withdrawals(0..self.masters.len(), keys, ticket);
            let (answered, withdrawn) = self.freed_everywhere("withdraw", replies, keys).await;
            if answered == 0 {
                return Err(StoreError::unknown(
                    "no Redlock master answered the withdrawal",
                ));
            }
            Ok(withdrawn)
        })
    }

    fn probes(&self) -> bool {
        true
    }

    /// One key: a retry is one script a master, as a probe is, and the roll-back of a
    /// refused one does not wake its waiter.
    fn whole_attempts(&self, keys: usize) -> bool {
        keys == 1
    }

    /// Probes every master at once (each bounded by its node timeouts, one a step): the
    /// keys free on a majority, from the first, are free. With fewer than a majority
    /// answering, it says all are: the attempt that follows gets the masters' own answer.
    fn probe<'a>(&'a self, request: &'a AcquireRequest) -> Reply<'a, usize> {
        Box::pin(async move {
            let mut replies = self.start_everywhere(request.keys.len(), |node| {
                let request = request.clone();
                async move { node.probe(&request).await }
            });
            let mut free = Vec::with_capacity(self.masters.len());
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(count) => free.push(count),
                    Err(failure) => self.report(node, "probe", &failure),
                }
            }
            if free.len() < self.quorum {
                return Ok(request.keys.len());
            }
            free.sort_unstable_by(|a, b| b.cmp(a));
            Ok(free[self.quorum - 1])
        })
    }

    /// Asks every master (each bounded by its node timeouts, one a step) and reports, per
    /// key, what a majority of them see ([`majority_view`]); fails when fewer than a
    /// majority answer.
    fn inspect<'a>(&'a self, keys: &'a Keys) -> Reply<'a, Vec<KeyView>> {
        Box::pin(async move {
            let mut replies = self.start_everywhere(keys.len(), |node| {
                let keys = keys.clone();
                async move { node.inspect(&keys).await }
            });
            let mut answers = Vec::with_capacity(self.masters.len());
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(views) if views.len() == keys.len() => answers.push(views),
                    Ok(_) => tracing::warn!(
                        master = %self.masters[node].address,
                        "a Redlock master answered an inspection for other keys"
                    ),
                    Err(failure) => self.report(node, "inspect", &failure),
                }
            }
            if answers.len() < self.quorum {
                return Err(StoreError::left_nothing(format!(
                    "only {} of {} Redlock masters answered the inspection, {} needed",
                    answers.len(),
                    self.masters.len(),
                    self.quorum
                )));
            }
            Ok((0..keys.len())
                .map(|i| {
                    let views: Vec<KeyView> = answers.iter().map(|a| a[i]).collect();
                    majority_view(&views, self.quorum)
                })
                .collect())
        })
    }

    /// Ends the holds on every master at once (each bounded by its node timeouts, one a
    /// step), and succeeds when a majority answered: a master that did not keeps its holds
    /// until they expire, and alone they keep nobody out.
    fn force_release<'a>(&'a self, keys: &'a Keys) -> Reply<'a, usize> {
        Box::pin(async move {
            let replies = self.start_everywhere(keys.len(), |node| {
                let keys = keys.clone();
                async move { node.force_release(&keys).await }
            });
            let (answered, released) = self.freed_everywhere("force_release", replies, keys).await;
            if answered < self.quorum {
                return Err(StoreError::unknown(format!(
                    "only {answered} of {} Redlock masters answered the forced release",
                    self.masters.len()
                )));
            }
            Ok(released)
        })
    }

    /// A majority of the masters pass their own check within the node timeout.
    fn check(&self) -> Reply<'_, ()> {
        Box::pin(async move {
            let mut replies = self.start_everywhere(1, |node| async move { node.check().await });
            let (mut passed, mut failures) = (0, Vec::new());
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(()) => passed += 1,
                    Err(failure) => {
                        failures.push(format!("{}: {failure}", self.masters[node].address));
                    }
                }
            }
            if passed >= self.quorum {
                for failure in &failures {
                    tracing::warn!(failure, "a Redlock master failed its check");
                }
                return Ok(());
            }
            Err(StoreError::left_nothing(format!(
                "only {passed} of {} Redlock masters passed their check, {} needed: {}",
                self.masters.len(),
                self.quorum,
                failures.join("; ")
            )))
        })
    }

    fn drift(&self, ttl: Duration) -> Duration {
        clock_drift(ttl)
    }

    fn wakeups(&self) -> &Wakeups {
        &self.wakeups
    }
}

#[cfg(feature = "idempotency")]
impl AnswerStore for RedlockStore {
    /// Asks every master at once and gives the first answer found: only the request that
    /// held the in-flight lock stores one, so any copy is that answer. "None" needs a
    /// majority to say so: a minority may have missed the store.
    fn load_answer<'a>(&'a self, key: &'a str) -> Reply<'a, Option<Bytes>> {
        Box::pin(async move {
            let key: Arc<str> = key.into();
            let mut replies = self.start_everywhere(1, |node| {
                let key = key.clone();
                async move { node.load_answer(&key).await }
            });
            let mut answered = 0;
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(Some(answer)) => {
                        finish_in_background(replies);
                        return Ok(Some(answer));
                    }
                    Ok(None) => answered += 1,
                    Err(failure) => self.report(node, "load_answer", &failure),
                }
            }
            if answered < self.quorum {
                return Err(StoreError::left_nothing(format!(
                    "only {answered} of {} Redlock masters answered a read of a stored answer",
                    self.masters.len()
                )));
            }
            Ok(None)
        })
    }

    /// Stores on every master at once; succeeds once a majority answered, and says whether
    /// a majority now has this answer.
    fn store_answer<'a>(&'a self, answer: &'a StoredAnswer) -> Reply<'a, bool> {
        Box::pin(async move {
            let mut replies = self.start_everywhere(1, |node| {
                let answer = answer.clone();
                async move { node.store_answer(&answer).await }
            });
            let (mut answered, mut stored) = (0, 0);
            while let Some((node, reply)) = replies.next().await {
                match reply {
                    Ok(ours) => {
                        answered += 1;
                        stored += usize::from(ours);
                    }
                    Err(failure) => self.report(node, "store_answer", &failure),
                }
            }
            if answered < self.quorum {
                return Err(StoreError::unknown(format!(
                    "only {answered} of {} Redlock masters answered the store of an answer",
                    self.masters.len()
                )));
            }
            Ok(stored >= self.quorum)
        })
    }
}
