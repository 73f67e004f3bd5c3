//! The store contract, executable: a reference model of the lock semantics (exclusive and
//! shared holds, re-entry and upgrades, all-or-nothing batches, release of one hold, the
//! end of a request, expiry, waiting in line with reservations served in order of
//! arrival, fencing, what the operator's view shows), and property tests that drive random
//! sequences of operations from several owners through the public API against the model
//! and against every store, and compare every answer.
//!
//! An owner is a request in flight, holding a key of its own through its layer; its
//! handler runs the test's commands: [`Lease::lock`] for more keys (strings exclusive,
//! [`Key::shared`] shared), [`HeldKeys::release`] for one of them, and the end of the
//! request, which releases all. Requests do not wait (a busy key is a 409 at once).
//!
//! A waiter is a request of its own that waits for its keys (exclusively) and ends once
//! granted; the owners' locks do not wait, and a waiter that came before an owner's
//! request keeps it out of the keys it waits for, but those the owner holds already. Places
//! in line are milliseconds: the driver lets one pass between arrivals.
//!
//! What the model leaves out, each covered by tests of its own: a waiter that gives up
//! and withdraws (`fairness::a_waiter_that_gives_up_*`), renewal (`waiting::*`,
//! `defaults::*`), a store that fails (`wire::*`, `redis::a_frozen_*`), and the
//! idempotency answers (`idempotency::*`). A new store passes this before anything else:
//! add it to [`stores`].
//!
//! `SPEC_CASES`, `SPEC_EXPIRY_CASES` and `SPEC_WAIT_CASES` set the number of random
//! sequences.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{body::Body, routing::post, Extension, Router};
use http::{request::Parts, Request, StatusCode};
use proptest::{
    collection::vec,
    prelude::*,
    test_runner::{Config, TestCaseError, TestRunner},
};
use tokio::sync::{mpsc, oneshot};
use tower::ServiceExt;
use tower_batch_lock::{
    keys::Key,
    store::{Redis, Redlock, Store},
    HeldKeys, KeyStatus, Lease, Locks, Mode, Rejection, Wait,
};

use crate::support::RedisServer;

/// The keys the operations name.
const KEYS: [&str; 4] = ["k0", "k1", "k2", "k3"];
/// How many owners take turns.
const OWNERS: usize = 3;

/// One step of a sequence.
#[derive(Debug, Clone)]
enum Op {
    /// `owner` locks these keys (index into [`KEYS`], shared or not), all or none.
    Lock {
        owner: usize,
        keys: Vec<(usize, bool)>,
    },
    /// `owner` releases the keys of its `handle`-th grant, if it holds them still.
    Release { owner: usize, handle: usize },
    /// `owner`'s request ends: everything it holds is released.
    End { owner: usize },
    /// The operator's view of every key.
    Inspect,
    /// Time passes beyond the TTL of every grant so far (with [`EXPIRING`] locks, which
    /// are not renewed).
    Sleep,
    /// A request of its own locks these keys exclusively, waiting in line for them as long
    /// as it takes, and ends as soon as it has them.
    Wait { keys: Vec<usize> },
}

/// The operations: with [`Op::Sleep`] among them if `sleeps`, [`Op::Wait`] if `waits`.
/// (Left out, not weighted 0: shrinking a failure would bring them back.)
fn op(sleeps: bool, waits: bool) -> impl Strategy<Value = Op> {
    let owner = 0..OWNERS;
    let lock = (owner.clone(), vec((0..KEYS.len(), any::<bool>()), 1..4))
        .prop_map(|(owner, keys)| Op::Lock { owner, keys });
    let release =
        (owner.clone(), 0..4usize).prop_map(|(owner, handle)| Op::Release { owner, handle });
    let mut choices = vec![
        (4, lock.boxed()),
        (2, release.boxed()),
        (1, owner.prop_map(|owner| Op::End { owner }).boxed()),
        (2, Just(Op::Inspect).boxed()),
    ];
    if sleeps {
        choices.push((1, Just(Op::Sleep).boxed()));
    }
    if waits {
        let wait = vec(0..KEYS.len(), 1..3).prop_map(|keys| Op::Wait { keys });
        choices.push((2, wait.boxed()));
    }
    proptest::strategy::Union::new_weighted(choices)
}

/// The TTL of [`EXPIRING`] locks: long enough for a sequence between two sleeps, on a
/// loaded machine.
const TTL: Duration = Duration::from_millis(1500);

/// Locks whose grants expire after [`TTL`], unrenewed.
const EXPIRING: fn(Locks) -> Locks = |locks| locks.ttl(TTL).renew_lease(false);

/// What an operation answered: the same from the model and from every store.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    Granted,
    Refused(StatusCode),
    /// Done; the waiters (by number) that this granted, which then ended.
    Woke(Vec<usize>),
    /// A waiter (by number) took its place in line.
    Waiting(usize),
    /// Each key's status, number of holds, and number of waiters in line for it.
    Seen(Vec<(KeyStatus, usize, usize)>),
}

/// The semantics, stated as plainly as they can be.
#[derive(Debug, Default)]
struct Model {
    /// Each owner's grants, in order, by key (and how it holds it); `None` once released.
    grants: Vec<Vec<Option<BTreeMap<usize, Mode>>>>,
    /// When each owner's request began, while it runs: its place among the waiters.
    arrived: Vec<Option<u64>>,
    /// The waiters in line, in order of arrival: number, arrival, keys.
    line: Vec<(usize, u64, Vec<usize>)>,
    /// How many waiters came: the next one's number.
    waiters: usize,
    /// A clock of events, for the order of arrivals.
    clock: u64,
}

impl Model {
    fn new() -> Self {
        Self {
            grants: vec![Vec::new(); OWNERS],
            arrived: vec![None; OWNERS],
            ..Self::default()
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Whether a waiter that arrived at `arrived` for `keys` may have them now: no one
    /// holds them, and no waiter before it is in line for one of them.
    fn waiter_fits(&self, arrived: u64, keys: &[usize]) -> bool {
        keys.iter().all(|&key| {
            self.holds(key).next().is_none()
                && !self
                    .line
                    .iter()
                    .any(|(_, before, wanted)| *before < arrived && wanted.contains(&key))
        })
    }

    /// How many waiters are in line for each key.
    fn in_line(&self) -> Vec<usize> {
        (0..KEYS.len())
            .map(|key| {
                self.line
                    .iter()
                    .filter(|(_, _, k)| k.contains(&key))
                    .count()
            })
            .collect()
    }

    /// Grants the waiters whose turn it is, in order of arrival; each ends at once.
    fn settle(&mut self) -> Answer {
        let mut woke = Vec::new();
        while let Some(index) = (0..self.line.len()).find(|&i| {
            let (_, arrived, keys) = &self.line[i];
            self.waiter_fits(*arrived, keys)
        }) {
            woke.push(self.line.remove(index).0);
        }
        woke.sort_unstable();
        Answer::Woke(woke)
    }

    /// Every hold on `key`: by whom, and how.
    fn holds(&self, key: usize) -> impl Iterator<Item = (usize, Mode)> + '_ {
        self.grants
            .iter()
            .enumerate()
            .flat_map(move |(owner, grants)| {
                grants
                    .iter()
                    .flatten()
                    .filter_map(move |grant| grant.get(&key).map(|&mode| (owner, mode)))
            })
    }

    fn apply(&mut self, op: &Op) -> Answer {
        match op {
            Op::Lock { owner, keys } => {
                // A key named twice is held once, exclusively if either names it so.
                let mut batch = BTreeMap::new();
                for &(key, shared) in keys {
                    let mode = if shared {
                        Mode::Shared
                    } else {
                        Mode::Exclusive
                    };
                    let held = batch.entry(key).or_insert(mode);
                    if mode == Mode::Exclusive {
                        *held = Mode::Exclusive;
                    }
                }
                // The owner's request arrives with its first lock.
                if self.arrived[*owner].is_none() {
                    self.arrived[*owner] = Some(self.tick());
                }
                let arrived = self.arrived[*owner].expect("set above");
                // An exclusive hold needs no other owner on the key (an owner upgrades
                // only while alone); a shared one, no other owner's exclusive hold. An
                // owner's own holds never keep it out. A waiter in line that arrived
                // before the owner keeps it out of the keys it waits for, but those the
                // owner holds already.
                let fits = batch.iter().all(|(&key, &mode)| {
                    let mut others = self.holds(key).filter(|&(o, _)| o != *owner);
                    let free = match mode {
                        Mode::Exclusive => others.next().is_none(),
                        _ => others.all(|(_, m)| m == Mode::Shared),
                    };
                    let mine = self.holds(key).any(|(o, _)| o == *owner);
                    let reserved = self
                        .line
                        .iter()
                        .any(|(_, before, wanted)| *before < arrived && wanted.contains(&key));
                    free && (mine || !reserved)
                });
                if !fits {
                    return Answer::Refused(StatusCode::CONFLICT);
                }
                self.grants[*owner].push(Some(batch));
                Answer::Granted
            }
            Op::Release { owner, handle } => {
                if let Some(grant) = self.grants[*owner].get_mut(*handle) {
                    *grant = None;
                }
                self.settle()
            }
            Op::End { owner } => {
                self.grants[*owner].clear();
                self.arrived[*owner] = None;
                self.settle()
            }
            // Every grant so far has expired; the owners still hold their handles, whose
            // release then frees nothing, and no one else's hold.
            Op::Sleep => {
                for grants in &mut self.grants {
                    grants.iter_mut().for_each(|grant| *grant = None);
                }
                self.settle()
            }
            Op::Wait { keys } => {
                let number = self.waiters;
                self.waiters += 1;
                let arrived = self.tick();
                if self.waiter_fits(arrived, keys) {
                    return Answer::Granted;
                }
                self.line.push((number, arrived, keys.clone()));
                Answer::Waiting(number)
            }
            Op::Inspect => Answer::Seen(
                (0..KEYS.len())
                    .map(|key| {
                        let holds: Vec<Mode> = self.holds(key).map(|(_, m)| m).collect();
                        let status = if holds.is_empty() {
                            KeyStatus::Free
                        } else if holds.contains(&Mode::Exclusive) {
                            KeyStatus::Held
                        } else {
                            KeyStatus::Shared
                        };
                        let waiting = self.line.iter().filter(|(_, _, k)| k.contains(&key));
                        (status, holds.len(), waiting.count())
                    })
                    .collect(),
            ),
        }
    }
}

/// A command for an owner's handler.
enum Command {
    Lock(Vec<Key>, oneshot::Sender<Result<u64, StatusCode>>),
    Release(usize, oneshot::Sender<()>),
    End,
}

/// The command queues of the owners' requests, by the owner header.
type Inboxes = Arc<Mutex<HashMap<String, mpsc::UnboundedReceiver<Command>>>>;

/// An owner's request, running its commands until told to end.
async fn owner_handler(
    lease: Lease,
    Extension(inboxes): Extension<Inboxes>,
    parts: Parts,
) -> &'static str {
    let id = parts.headers["x-owner"].to_str().unwrap().to_owned();
    let mut inbox = inboxes.lock().unwrap().remove(&id).unwrap();
    let mut grants: Vec<Option<HeldKeys>> = Vec::new();
    while let Some(command) = inbox.recv().await {
        match command {
            Command::Lock(keys, reply) => {
                let answer = match lease.lock(keys).await {
                    Ok(held) => {
                        let token = held.lease().fencing_token().get();
                        grants.push(Some(held));
                        Ok(token)
                    }
                    Err(rejection) => {
                        grants.push(None);
                        Err(Rejection::status(&rejection))
                    }
                };
                let _ = reply.send(answer);
            }
            Command::Release(handle, reply) => {
                if let Some(held) = grants.get_mut(handle).and_then(Option::take) {
                    held.release().await;
                }
                let _ = reply.send(());
            }
            Command::End => break,
        }
    }
    "ended"
}

/// One store under test, driven by the operations.
struct Driver {
    locks: Locks,
    app: Router,
    inboxes: Inboxes,
    /// Each owner's running request: its command queue and its response.
    owners: Vec<
        Option<(
            mpsc::UnboundedSender<Command>,
            tokio::task::JoinHandle<StatusCode>,
        )>,
    >,
    /// How many requests have started, for their ids.
    started: usize,
    /// Each owner's grants, as indices into its handler's list, which counts every lock
    /// (the model counts grants alone).
    handles: Vec<Vec<usize>>,
    /// How many locks each owner's request was sent.
    sent: Vec<usize>,
    /// The largest fencing token granted on each key.
    fences: BTreeMap<usize, u64>,
    /// The route of the requests that wait ([`Op::Wait`]).
    waiting: Router,
    /// The waiters not yet granted, by number: their responses.
    line: BTreeMap<usize, tokio::task::JoinHandle<StatusCode>>,
    /// How many waiters came: the next one's number.
    waiters: usize,
}

/// `request`'s status from `app`, once its body has ended, as a server sends it: the
/// layer releases the request's keys before it reports the end. (A response dropped
/// unread releases them in the background, and the next step could find them held: the
/// cluster, whose release takes longest, answered a lock 409 there now and then.)
async fn served(app: Router, request: Request<Body>) -> StatusCode {
    let response = app.oneshot(request).await.unwrap();
    let status = response.status();
    axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    status
}

/// How long the driver gives a request the model says ends now.
const PROMPTLY: Duration = Duration::from_secs(5);

impl Driver {
    fn new(locks: Locks) -> Self {
        let inboxes = Inboxes::default();
        let app = Router::new()
            .route(
                "/",
                post(owner_handler).layer(locks.layer(|parts: &Parts| {
                    let id = parts.headers["x-owner"].to_str().unwrap();
                    Ok::<_, Rejection>([format!("owner:{id}")])
                })),
            )
            .layer(Extension(inboxes.clone()));
        let waiting = Router::new().route(
            "/wait",
            post(|| async {}).layer(
                locks
                    .clone()
                    .wait(Wait::up_to(Duration::from_secs(60)))
                    .layer(|parts: &Parts| {
                        let keys = parts.headers["x-keys"].to_str().unwrap();
                        Ok::<_, Rejection>(keys.split(',').map(str::to_owned).collect::<Vec<_>>())
                    }),
            ),
        );
        Self {
            locks,
            app,
            inboxes,
            owners: (0..OWNERS).map(|_| None).collect(),
            started: 0,
            handles: vec![Vec::new(); OWNERS],
            sent: vec![0; OWNERS],
            fences: BTreeMap::new(),
            waiting,
            line: BTreeMap::new(),
            waiters: 0,
        }
    }

    /// The waiters that have ended: those the model says this step granted, given time to,
    /// and any other that has (which the model then disputes).
    async fn woke(&mut self, expected: &Answer) -> Result<Answer, String> {
        if let Answer::Woke(granted) = expected {
            for number in granted {
                if let Some(waiter) = self.line.get(number) {
                    let deadline = std::time::Instant::now() + PROMPTLY;
                    while !waiter.is_finished() && std::time::Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
        }
        let ended: Vec<usize> = self
            .line
            .iter()
            .filter(|(_, waiter)| waiter.is_finished())
            .map(|(&number, _)| number)
            .collect();
        for number in &ended {
            let status = self.line.remove(number).unwrap().await.unwrap();
            if status != StatusCode::OK {
                return Err(format!("waiter {number} answered {status}"));
            }
        }
        Ok(Answer::Woke(ended))
    }

    /// The waiters in line for each key, as the store shows them.
    async fn in_line(&self) -> Result<Vec<usize>, String> {
        let states = self.locks.inspect(KEYS).await.map_err(|r| r.to_string())?;
        Ok(states
            .iter()
            .map(tower_batch_lock::KeyState::waiters)
            .collect())
    }

    /// The command queue of `owner`'s request, started if it is not running.
    async fn owner(&mut self, owner: usize) -> mpsc::UnboundedSender<Command> {
        if self.owners[owner].is_none() {
            // Places in line are times in milliseconds: this one is after every one before.
            tokio::time::sleep(Duration::from_millis(2)).await;
            self.started += 1;
            let id = self.started.to_string();
            let (send, receive) = mpsc::unbounded_channel();
            self.inboxes.lock().unwrap().insert(id.clone(), receive);
            let request = Request::post("/")
                .header("x-owner", id)
                .body(Body::empty())
                .unwrap();
            let app = self.app.clone();
            let response = tokio::spawn(served(app, request));
            self.owners[owner] = Some((send, response));
        }
        self.owners[owner].as_ref().unwrap().0.clone()
    }

    async fn end(&mut self, owner: usize) -> Result<(), String> {
        self.handles[owner].clear();
        self.sent[owner] = 0;
        let Some((send, response)) = self.owners[owner].take() else {
            return Ok(());
        };
        let _ = send.send(Command::End);
        let status = response.await.unwrap();
        if status != StatusCode::OK {
            return Err(format!("an owner's request answered {status}"));
        }
        Ok(())
    }

    /// Applies `op`; the model's `expected` answer and its `in_line` waiters for each key
    /// after it tell the driver what to wait for, not what to answer.
    async fn apply(
        &mut self,
        op: &Op,
        expected: &Answer,
        in_line: &[usize],
    ) -> Result<Answer, String> {
        Ok(match op {
            Op::Lock { owner, keys } => {
                let named: Vec<Key> = keys
                    .iter()
                    .map(|&(key, shared)| match shared {
                        true => Key::shared(KEYS[key]),
                        false => Key::from(KEYS[key]),
                    })
                    .collect();
                let (reply, answer) = oneshot::channel();
                let queue = self.owner(*owner).await;
                let sent = queue.send(Command::Lock(named, reply));
                sent.map_err(|_| "an owner's request ended early".to_owned())?;
                let store_handle = self.sent[*owner];
                self.sent[*owner] += 1;
                match answer.await.map_err(|_| "no answer".to_owned())? {
                    Ok(token) => {
                        // Larger than every earlier grant's on any of its keys.
                        let named: std::collections::BTreeSet<usize> =
                            keys.iter().map(|&(key, _)| key).collect();
                        for key in named {
                            let fence = self.fences.entry(key).or_default();
                            if token <= *fence {
                                return Err(format!("fencing token {token} after {fence}"));
                            }
                            *fence = token;
                        }
                        self.handles[*owner].push(store_handle);
                        Answer::Granted
                    }
                    Err(status) => Answer::Refused(status),
                }
            }
            Op::Release { owner, handle } => {
                if let Some(&store_handle) = self.handles[*owner].get(*handle) {
                    let (reply, done) = oneshot::channel();
                    let queue = self.owner(*owner).await;
                    let _ = queue.send(Command::Release(store_handle, reply));
                    done.await.map_err(|_| "no answer".to_owned())?;
                }
                self.woke(expected).await?
            }
            Op::End { owner } => {
                self.end(*owner).await?;
                self.woke(expected).await?
            }
            Op::Sleep => {
                tokio::time::sleep(TTL + Duration::from_millis(300)).await;
                self.woke(expected).await?
            }
            Op::Wait { keys } => {
                // Places in line are times in milliseconds: this one is after every one
                // before.
                tokio::time::sleep(Duration::from_millis(2)).await;
                let number = self.waiters;
                self.waiters += 1;
                let names: Vec<&str> = keys.iter().map(|&key| KEYS[key]).collect();
                let request = Request::post("/wait")
                    .header("x-keys", names.join(","))
                    .body(Body::empty())
                    .unwrap();
                let app = self.waiting.clone();
                let mut waiter = tokio::spawn(served(app, request));
                if *expected == Answer::Granted {
                    let status = tokio::time::timeout(PROMPTLY, &mut waiter).await;
                    return match status {
                        Ok(Ok(StatusCode::OK)) => Ok(Answer::Granted),
                        other => Err(format!("waiter {number}: {other:?}")),
                    };
                }
                // In line once the store counts it (or granted, which the model disputes).
                let started = std::time::Instant::now();
                while !waiter.is_finished()
                    && self.in_line().await? != in_line
                    && started.elapsed() < PROMPTLY
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                if waiter.is_finished() {
                    let status = waiter.await.unwrap();
                    return Ok(if status == StatusCode::OK {
                        Answer::Granted
                    } else {
                        Answer::Refused(status)
                    });
                }
                self.line.insert(number, waiter);
                Answer::Waiting(number)
            }
            // A store whose batches span servers (the cluster's groups, Redlock's masters)
            // shows a waiter's attempt in flight, granted on one server and refused on
            // another, until it is rolled back: an attempt that a release woke, which the
            // model does not see. So the view is read again until it agrees, for at most
            // 300 ms: a round trip's state passes by then, and a hold or reservation left
            // behind (which lives a TTL, 1.5 s at the shortest here) still fails.
            Op::Inspect => {
                let started = std::time::Instant::now();
                loop {
                    let seen = self.seen().await?;
                    if seen == *expected || started.elapsed() >= Duration::from_millis(300) {
                        break seen;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        })
    }

    /// The operator's view of every key.
    async fn seen(&self) -> Result<Answer, String> {
        let states = self.locks.inspect(KEYS).await.map_err(|r| r.to_string())?;
        Ok(Answer::Seen(
            states
                .iter()
                .map(|s| (s.status(), s.holds(), s.waiters()))
                .collect(),
        ))
    }
}

/// The servers the stores run on: one Redis, three Redlock masters, and a Redis Cluster
/// with the `cluster` feature.
struct Servers {
    redis: RedisServer,
    masters: Vec<RedisServer>,
    #[cfg(feature = "cluster")]
    cluster: (
        tokio::sync::MutexGuard<'static, ()>,
        crate::support::cluster::Cluster,
    ),
    #[cfg(feature = "postgres")]
    postgres: crate::support::postgres::Database,
}

/// The stores under test, each in a namespace of this case's: memory, one Redis, Redlock
/// over three masters, a Redis Cluster, and PostgreSQL.
fn stores(case: usize, servers: &Servers) -> Vec<(&'static str, Locks)> {
    let prefix = format!("spec{case}:");
    let urls: Vec<String> = servers.masters.iter().map(RedisServer::url).collect();
    let stores = [
        ("memory", Store::isolated_memory()),
        ("redis", Redis::pool(servers.redis.pool()).build().unwrap()),
        ("redlock", Redlock::new(&urls).build().unwrap()),
    ];
    #[cfg(feature = "cluster")]
    let stores = stores.into_iter().chain([(
        "cluster",
        tower_batch_lock::store::RedisCluster::new(servers.cluster.1.urls())
            .build()
            .unwrap(),
    )]);
    #[cfg(feature = "postgres")]
    let stores = stores.into_iter().chain([(
        "postgres",
        tower_batch_lock::store::Postgres::url(servers.postgres.url())
            .build()
            .unwrap(),
    )]);
    stores
        .into_iter()
        .map(|(name, store)| (name, Locks::new(store).prefix(prefix.clone())))
        .collect()
}

#[test]
fn every_store_answers_every_sequence_as_the_model_does() {
    let cases = std::env::var("SPEC_CASES").map_or(24, |n| n.parse().unwrap());
    check_every_store(cases, vec(op(false, false), 1..40), |locks| locks);
}

/// Grants that expire: the keys are free again for others, and a late release of them
/// frees nothing. `SPEC_EXPIRY_CASES` sets the number of sequences (6 by default).
#[test]
fn grants_expire_after_their_ttl_on_every_store_as_the_model_says() {
    let cases = std::env::var("SPEC_EXPIRY_CASES").map_or(6, |n| n.parse().unwrap());
    check_every_store(cases, vec(op(true, false), 1..12), EXPIRING);
}

/// Requests that wait in line: each reserves its keys against requests that came after
/// it, is granted in order of arrival once the holds before it end, and leaves no
/// reservation behind. `SPEC_WAIT_CASES` sets the number of sequences (12 by default).
#[test]
fn waiters_are_served_in_order_of_arrival_on_every_store_as_the_model_says() {
    let cases = std::env::var("SPEC_WAIT_CASES").map_or(12, |n| n.parse().unwrap());
    check_every_store(cases, vec(op(false, true), 1..30), |locks| locks);
}

/// Runs `cases` sequences of `ops` on every store (configured by `configure`) at once,
/// each against the model.
fn check_every_store(
    cases: u32,
    ops: impl Strategy<Value = Vec<Op>>,
    configure: fn(Locks) -> Locks,
) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let servers = Servers {
        redis: RedisServer::start(),
        masters: (0..3).map(|_| RedisServer::start()).collect(),
        #[cfg(feature = "cluster")]
        cluster: runtime
            .block_on(runtime.spawn(crate::support::cluster::Cluster::start_in_turn()))
            .unwrap(),
        #[cfg(feature = "postgres")]
        postgres: crate::support::postgres::Database::create(),
    };
    let case = std::sync::atomic::AtomicUsize::new(0);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&ops, |ops| {
        let case = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let failures = runtime.block_on(async {
            let runs = stores(case, &servers).into_iter().map(|(name, locks)| {
                let ops = &ops;
                async move {
                    let limit = Duration::from_secs(60);
                    match tokio::time::timeout(limit, run(ops, configure(locks))).await {
                        Ok(Ok(())) => None,
                        Ok(Err(failure)) => Some(format!("{name}: {failure}")),
                        Err(_) => Some(format!("{name}: no end in {limit:?}")),
                    }
                }
            });
            futures_util::future::join_all(runs).await
        });
        match failures.into_iter().flatten().next() {
            Some(failure) => Err(TestCaseError::fail(failure)),
            None => Ok(()),
        }
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

/// Runs `ops` on `locks` and on the model, and compares every answer; at the end, every
/// request ends, every waiter is granted, and every key is free.
async fn run(ops: &[Op], locks: Locks) -> Result<(), String> {
    let mut model = Model::new();
    let mut driver = Driver::new(locks);
    for (step, op) in ops.iter().enumerate() {
        let expected = model.apply(op);
        let got = driver.apply(op, &expected, &model.in_line()).await?;
        if got != expected {
            return Err(format!(
                "step {step}, {op:?}: the model answers {expected:?}, the store {got:?}"
            ));
        }
    }
    for owner in 0..OWNERS {
        let end = Op::End { owner };
        let expected = model.apply(&end);
        driver.apply(&end, &expected, &model.in_line()).await?;
    }
    for (number, waiter) in std::mem::take(&mut driver.line) {
        let status = tokio::time::timeout(PROMPTLY, waiter).await;
        if !matches!(status, Ok(Ok(StatusCode::OK))) {
            return Err(format!(
                "waiter {number}, with every request ended: {status:?}"
            ));
        }
    }
    let all_free = Answer::Seen(vec![(KeyStatus::Free, 0, 0); KEYS.len()]);
    let got = driver
        .apply(&Op::Inspect, &all_free, &[0; KEYS.len()])
        .await?;
    if got != all_free {
        return Err(format!("after every request ended: {got:?}"));
    }
    Ok(())
}
