//! The store contract, executable: a reference model of the lock semantics (exclusive and
//! shared holds, re-entry and upgrades, all-or-nothing batches, release of one hold, the
//! end of a request, expiry, fencing, what the operator's view shows), and property tests
//! that drive random sequences of operations from several owners through the public API
//! against the model and against every store, and compare every answer.
//!
//! An owner is a request in flight, holding a key of its own through its layer; its
//! handler runs the test's commands: [`Lease::lock`] for more keys (strings exclusive,
//! [`Key::shared`] shared), [`HeldKeys::release`] for one of them, and the end of the
//! request, which releases all. Requests do not wait (a busy key is a 409 at once).
//!
//! What the model leaves out, each covered by tests of its own: waiting and reservations
//! (`fairness::*`, `waiting::*`), renewal (`waiting::*`, `defaults::*`), a store that
//! fails (`wire::*`, `redis::a_frozen_*`), and the idempotency answers (`idempotency::*`).
//! A new store passes this before anything else: add it to [`stores`].
//!
//! `SPEC_CASES` and `SPEC_EXPIRY_CASES` set the number of random sequences.

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
    HeldKeys, KeyStatus, Lease, Locks, Mode, Rejection,
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
}

/// The operations, with [`Op::Sleep`] among them if `sleeps`.
fn op(sleeps: bool) -> impl Strategy<Value = Op> {
    let owner = 0..OWNERS;
    prop_oneof![
        4 => (owner.clone(), vec((0..KEYS.len(), any::<bool>()), 1..4))
            .prop_map(|(owner, keys)| Op::Lock { owner, keys }),
        2 => (owner.clone(), 0..4usize).prop_map(|(owner, handle)| Op::Release { owner, handle }),
        1 => owner.prop_map(|owner| Op::End { owner }),
        2 => Just(Op::Inspect),
        u32::from(sleeps) => Just(Op::Sleep),
    ]
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
    Done,
    /// Each key's status and number of holds.
    Seen(Vec<(KeyStatus, usize)>),
}

/// The semantics, stated as plainly as they can be.
#[derive(Debug, Default)]
struct Model {
    /// Each owner's grants, in order, by key (and how it holds it); `None` once released.
    grants: Vec<Vec<Option<BTreeMap<usize, Mode>>>>,
}

impl Model {
    fn new() -> Self {
        Self {
            grants: vec![Vec::new(); OWNERS],
        }
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
                // An exclusive hold needs no other owner on the key (an owner upgrades
                // only while alone); a shared one, no other owner's exclusive hold. An
                // owner's own holds never keep it out.
                let fits = batch.iter().all(|(&key, &mode)| {
                    let mut others = self.holds(key).filter(|&(o, _)| o != *owner);
                    match mode {
                        Mode::Exclusive => others.next().is_none(),
                        _ => others.all(|(_, m)| m == Mode::Shared),
                    }
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
                Answer::Done
            }
            Op::End { owner } => {
                self.grants[*owner].clear();
                Answer::Done
            }
            // Every grant so far has expired; the owners still hold their handles, whose
            // release then frees nothing, and no one else's hold.
            Op::Sleep => {
                for grants in &mut self.grants {
                    grants.iter_mut().for_each(|grant| *grant = None);
                }
                Answer::Done
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
                        (status, holds.len())
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
}

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
        Self {
            locks,
            app,
            inboxes,
            owners: (0..OWNERS).map(|_| None).collect(),
            started: 0,
            handles: vec![Vec::new(); OWNERS],
            sent: vec![0; OWNERS],
            fences: BTreeMap::new(),
        }
    }

    /// The command queue of `owner`'s request, started if it is not running.
    fn owner(&mut self, owner: usize) -> mpsc::UnboundedSender<Command> {
        if self.owners[owner].is_none() {
            self.started += 1;
            let id = self.started.to_string();
            let (send, receive) = mpsc::unbounded_channel();
            self.inboxes.lock().unwrap().insert(id.clone(), receive);
            let request = Request::post("/")
                .header("x-owner", id)
                .body(Body::empty())
                .unwrap();
            let app = self.app.clone();
            let response =
                tokio::spawn(async move { app.oneshot(request).await.unwrap().status() });
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

    async fn apply(&mut self, op: &Op) -> Result<Answer, String> {
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
                let queue = self.owner(*owner);
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
                    let queue = self.owner(*owner);
                    let _ = queue.send(Command::Release(store_handle, reply));
                    done.await.map_err(|_| "no answer".to_owned())?;
                }
                Answer::Done
            }
            Op::End { owner } => {
                self.end(*owner).await?;
                Answer::Done
            }
            Op::Sleep => {
                tokio::time::sleep(TTL + Duration::from_millis(300)).await;
                Answer::Done
            }
            Op::Inspect => {
                let states = self.locks.inspect(KEYS).await.map_err(|r| r.to_string())?;
                Answer::Seen(states.iter().map(|s| (s.status(), s.holds())).collect())
            }
        })
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
}

/// The stores under test, each in a namespace of this case's: memory, one Redis, Redlock
/// over three masters, and a Redis Cluster.
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
    stores
        .into_iter()
        .map(|(name, store)| (name, Locks::new(store).prefix(prefix.clone())))
        .collect()
}

#[test]
fn every_store_answers_every_sequence_as_the_model_does() {
    let cases = std::env::var("SPEC_CASES").map_or(24, |n| n.parse().unwrap());
    check_every_store(cases, vec(op(false), 1..40), |locks| locks);
}

/// Grants that expire: the keys are free again for others, and a late release of them
/// frees nothing. `SPEC_EXPIRY_CASES` sets the number of sequences (6 by default).
#[test]
fn grants_expire_after_their_ttl_on_every_store_as_the_model_says() {
    let cases = std::env::var("SPEC_EXPIRY_CASES").map_or(6, |n| n.parse().unwrap());
    check_every_store(cases, vec(op(true), 1..12), EXPIRING);
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
/// request ends, and every key is free.
async fn run(ops: &[Op], locks: Locks) -> Result<(), String> {
    let mut model = Model::new();
    let mut driver = Driver::new(locks);
    for (step, op) in ops.iter().enumerate() {
        let expected = model.apply(op);
        let got = driver.apply(op).await?;
        if got != expected {
            return Err(format!(
                "step {step}, {op:?}: the model answers {expected:?}, the store {got:?}"
            ));
        }
    }
    for owner in 0..OWNERS {
        driver.end(owner).await?;
        model.apply(&Op::End { owner });
    }
    let all_free = Answer::Seen(vec![(KeyStatus::Free, 0); KEYS.len()]);
    let got = driver.apply(&Op::Inspect).await?;
    if got != all_free {
        return Err(format!("after every request ended: {got:?}"));
    }
    Ok(())
}
