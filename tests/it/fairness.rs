//! Fair waiting (DESIGN.md, property 10): waiters are served in order of arrival, whatever
//! their batch sizes; while they wait, their reservations keep later requests out, and
//! never an earlier waiter or an owner that already holds keys; a reservation ends with
//! its waiter (granted, given up, dropped, or its process killed), and nothing is left.
//!
//! Every case runs on the memory store, on one real Redis and on Redlock over three real
//! masters, each with two `Locks` handles standing for two processes.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};
use tower_batch_lock::store::Redis;

use axum::{
    body::Body,
    routing::{get, post},
    Extension, Router,
};
use http::{HeaderMap, Request, StatusCode};
use tower_batch_lock::{Lease, Locks, Wait};

use crate::support::{
    handlers::{hold, Gate},
    http::{header_keys, poll_every, post_keys, send, within, Reply},
    proxy::{Fault, Proxy},
    stores::Store,
    Observer, RedisServer, Rng,
};

/// A way to look inside a store.
impl Store {
    /// Fails the test if any server still has a lock key, held or reserved.
    fn assert_nothing_left(&self) {
        let left = self.left_under("");
        assert!(left.is_empty(), "{}: keeps {left:?}", self.name);
    }

    /// Waits until no server has a lock key: releases and withdrawals of requests that
    /// already answered may still be on their way (a Redlock minority's, say).
    async fn settle(&self) {
        let settled = poll_every(Duration::from_millis(20), Duration::from_secs(3), || {
            self.left_under("").is_empty()
        })
        .await;
        if settled.is_none() {
            self.assert_nothing_left();
        }
    }
}

/// A route `POST /` that locks the keys of the `x-keys` header, records the name in the
/// `x-name` header when its handler starts, and works for `x-work-ms`.
fn recording_router(locks: &Locks, order: &Arc<Mutex<Vec<String>>>) -> Router {
    let order = order.clone();
    let handler = move |headers: HeaderMap| {
        let order = order.clone();
        async move {
            let text = |name: &str| {
                headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned()
            };
            order.lock().unwrap().push(text("x-name"));
            let work = text("x-work-ms").parse().unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(work)).await;
        }
    };
    Router::new().route("/", post(handler).layer(locks.layer(header_keys)))
}

fn named(keys: &str, name: &str, work_ms: u64) -> Request<Body> {
    let mut request = post_keys("/", keys);
    let headers = request.headers_mut();
    headers.insert("x-name", name.parse().unwrap());
    headers.insert("x-work-ms", work_ms.to_string().parse().unwrap());
    request
}

fn waiting(locks: &Locks, bound: Duration) -> Locks {
    locks.clone().wait(Wait::up_to(bound))
}

// ---------------------------------------------------------------------------------------
// 1. Waiters are served in order of arrival; later requests respect their reservations
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_on_one_key_are_served_in_order_of_arrival() {
    const WAITERS: usize = 6;
    for store in Store::all() {
        let [first, second] = &store.locks;
        let (gate, held) = hold(first, "k").await;

        // Waiters arrive one after another, from both processes by turns; each also wants
        // `free`, a key nobody holds.
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..WAITERS {
            let process = if i % 2 == 0 { first } else { second };
            let app = recording_router(&waiting(process, Duration::from_secs(10)), &order);
            let request = named("k,free", &i.to_string(), 5);
            waiters.push(tokio::spawn(async move { send(&app, request).await }));
            // In line before the next one arrives: its reservation is on the key.
            let in_line = poll_every(Duration::from_millis(5), Duration::from_secs(5), || {
                store
                    .line("lock:free")
                    .is_none_or(|line| line.len() == i + 1)
            })
            .await;
            assert!(
                in_line.is_some(),
                "{}: waiter {i} never got in line",
                store.name
            );
            if store.line("lock:free").is_none() {
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        }
        if let Some(line) = store.line("lock:free") {
            assert!(line.is_sorted(), "{}: {line:?}", store.name);
        }

        // `free` is free, but reserved: a request that does not wait is refused, and one
        // that waits goes to the back of the line.
        let refused = send(&recording_router(second, &order), named("free", "late", 0)).await;
        assert_eq!(refused.status, StatusCode::CONFLICT, "{}", store.name);
        assert_eq!(
            refused.problem()["conflicting_keys"],
            serde_json::json!(["free"]),
            "{}",
            store.name
        );
        let app = recording_router(&waiting(second, Duration::from_secs(10)), &order);
        let last = tokio::spawn(async move { send(&app, named("free", "last", 0)).await });

        gate.open();
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
        for waiter in waiters {
            let reply = within(Duration::from_secs(10), "a waiter's answer", waiter).await;
            assert_eq!(reply.unwrap().status, StatusCode::OK, "{}", store.name);
        }
        assert_eq!(last.await.unwrap().status, StatusCode::OK, "{}", store.name);
        let served = order.lock().unwrap().clone();
        let expected: Vec<String> = (0..WAITERS)
            .map(|i| i.to_string())
            .chain(["last".to_owned()])
            .collect();
        assert_eq!(served, expected, "{}: served out of order", store.name);
        store.settle().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_later_waiter_never_holds_up_an_earlier_one() {
    for store in Store::all() {
        let [first, second] = &store.locks;
        // The earlier waiter wants `a` (held) and `b`; the later one wants `b` and `c`
        // (held). When `a` is freed, the earlier waiter goes, though the later one reserved
        // `b` in the meantime; the later one then waits for `c` and the earlier one.
        let (gate_a, held_a) = hold(first, "a").await;
        let (gate_c, held_c) = hold(first, "c").await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let early_app = recording_router(&waiting(first, Duration::from_secs(10)), &order);
        let early = tokio::spawn(async move { send(&early_app, named("a,b", "early", 0)).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let late_app = recording_router(&waiting(second, Duration::from_secs(10)), &order);
        let late = tokio::spawn(async move { send(&late_app, named("b,c", "late", 0)).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Some(line) = store.line("lock:b") {
            assert_eq!(line.len(), 2, "{}: both waiters reserve `b`", store.name);
        }

        gate_a.open();
        let early = within(Duration::from_secs(5), "the earlier waiter", early).await;
        assert_eq!(early.unwrap().status, StatusCode::OK, "{}", store.name);
        assert!(!late.is_finished(), "{}: `c` is still held", store.name);
        gate_c.open();
        let late = within(Duration::from_secs(5), "the later waiter", late).await;
        assert_eq!(late.unwrap().status, StatusCode::OK, "{}", store.name);
        assert_eq!(*order.lock().unwrap(), ["early", "late"], "{}", store.name);
        for held in [held_a, held_c] {
            assert_eq!(held.await.unwrap().status, StatusCode::OK);
        }
        store.settle().await;
    }
}

/// A big batch's waiter keeps later arrivals out of the keys it waits for that are free,
/// and goes before a later waiter for one. On Redis its place in line is a claim, and its
/// keys are left as they are: a free one stays absent, where a reservation in each key
/// would rewrite the batch to wait, again to be granted, and again to be released.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_big_batchs_waiter_keeps_later_arrivals_out_of_its_free_keys() {
    for store in Store::all() {
        let [first, second] = &store.locks;
        let [_, big] = small_and_big("a,b");
        let (gate, held) = hold(first, "a").await;
        let waiter = waiter_in_line_on_b(&store, second, &big).await;
        if let Some(observer) = store.observers().first() {
            assert_eq!(
                observer.get("lock:b"),
                None,
                "{}: `b` was written",
                store.name
            );
            assert_eq!(observer.claims_on("lock:b").len(), 1, "{}", store.name);
        }
        // A big newcomer (64 keys) first: its store refused nothing yet, so it takes its free
        // keys with plain `SET`s, which cannot see the claim on `b`.
        let [_, big_newcomer] = small_and_big("b,c");
        assert!(
            !free_now(first, &big_newcomer).await,
            "{}: a big newcomer took `b`",
            store.name
        );
        assert!(
            !free_now(first, "b").await,
            "{}: a newcomer took `b`",
            store.name
        );

        let order = Arc::new(Mutex::new(Vec::new()));
        let app = recording_router(&waiting(first, Duration::from_secs(10)), &order);
        let later = tokio::spawn(async move { send(&app, named("b", "later", 0)).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !later.is_finished(),
            "{}: the later waiter went",
            store.name
        );
        gate.open();
        let waited = within(Duration::from_secs(5), "the big waiter", waiter).await;
        assert_eq!(waited.unwrap().status, StatusCode::OK, "{}", store.name);
        let later = within(Duration::from_secs(5), "the later waiter", later).await;
        assert_eq!(later.unwrap().status, StatusCode::OK, "{}", store.name);
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
        store.settle().await;
    }
}

/// A big waiter that came later does not pass an earlier big one. On Redis, through a store
/// that refused nothing yet, its first attempt takes its free keys with plain `SET`s, which
/// cannot see the earlier waiter's claim: finding a claim with an earlier ticket than its
/// own, it gives them back, and the script refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_later_big_waiter_does_not_pass_an_earlier_ones_claim() {
    for store in Store::all() {
        let [first, second] = &store.locks;
        let [_, early_batch] = small_and_big("a,b");
        let [_, late_batch] = small_and_big("b,c");
        let (gate, held) = hold(first, "a").await;
        let early = waiter_in_line_on_b(&store, second, &early_batch).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let late_app = recording_router(
            &waiting(&store.another_process(), Duration::from_secs(10)),
            &order,
        );
        let request = named(&late_batch, "late", 0);
        let late = tokio::spawn(async move { send(&late_app, request).await });
        let in_line = poll_every(Duration::from_millis(5), Duration::from_secs(5), || {
            store.in_line("lock:c").is_none_or(|waiters| waiters == 1)
        })
        .await;
        assert!(
            in_line.is_some(),
            "{}: the later waiter never stood in line",
            store.name
        );
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(
            !late.is_finished(),
            "{}: the later big waiter went",
            store.name
        );
        if let Some(observer) = store.observers().first() {
            assert_eq!(observer.get("lock:c"), None, "{}: `c` is held", store.name);
        }

        gate.open();
        let early = within(Duration::from_secs(5), "the earlier waiter", early).await;
        assert_eq!(early.unwrap().status, StatusCode::OK, "{}", store.name);
        let late = within(Duration::from_secs(5), "the later waiter", late).await;
        assert_eq!(late.unwrap().status, StatusCode::OK, "{}", store.name);
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
        store.settle().await;
    }
}

// ---------------------------------------------------------------------------------------
// 2. A big batch is granted under a storm of small requests
// ---------------------------------------------------------------------------------------

/// Sends one-key requests on random keys of `catalogue` from `clients` tasks, back to
/// back, until `stop` is set, `STORM_LIMIT` has passed or each has sent `STORM_REQUESTS`;
/// counts the answers by class.
async fn storm(
    locks: &Locks,
    catalogue: usize,
    clients: usize,
    stop: &Arc<AtomicBool>,
) -> [usize; 3] {
    const STORM_LIMIT: Duration = Duration::from_secs(10);
    const STORM_REQUESTS: usize = 50_000;
    let until = Instant::now() + STORM_LIMIT;
    let answers: Arc<[AtomicUsize; 3]> = Arc::default();
    let order = Arc::new(Mutex::new(Vec::new()));
    let app = recording_router(&waiting(locks, Duration::from_secs(5)), &order);
    let tasks: Vec<_> = (0..clients)
        .map(|client| {
            let (app, stop, answers) = (app.clone(), stop.clone(), answers.clone());
            tokio::spawn(async move {
                let mut rng = Rng::seeded(client as u64 + 1);
                for _ in 0..STORM_REQUESTS {
                    if stop.load(Ordering::SeqCst) || Instant::now() > until {
                        break;
                    }
                    let key = format!("sku:{}", rng.below(catalogue as u64));
                    let reply = send(&app, named(&key, "retail", 2)).await;
                    let class = match reply.status {
                        StatusCode::OK => 0,
                        StatusCode::CONFLICT => 1,
                        _ => 2,
                    };
                    answers[class].fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for task in tasks {
        within(Duration::from_secs(30), "a storm client", task)
            .await
            .unwrap();
    }
    std::array::from_fn(|i| answers[i].load(Ordering::SeqCst))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_3000_keys_is_granted_under_a_storm_of_one_key_requests() {
    const CATALOGUE: usize = 3_000;
    for store in [Store::memory(), Store::redis()] {
        let [first, second] = &store.locks;
        let stop = Arc::new(AtomicBool::new(false));
        let storm = {
            let (locks, stop) = (first.clone(), stop.clone());
            tokio::spawn(async move { storm(&locks, CATALOGUE, 12, &stop).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;

        let skus: Vec<String> = (0..CATALOGUE).map(|i| format!("sku:{i}")).collect();
        let order = Arc::new(Mutex::new(Vec::new()));
        // Far shorter than the storm: without fairness, the batch would still find some key
        // held at every attempt, and be refused when its bound passes (tried: 409 on
        // the memory store).
        let purchase = recording_router(&waiting(second, Duration::from_secs(4)), &order);
        let started = Instant::now();
        let reply = send(&purchase, named(&skus.join(","), "purchase", 0)).await;
        let took = started.elapsed();
        let storm_went_on = !storm.is_finished();
        stop.store(true, Ordering::SeqCst);
        let [ok, conflict, other] = storm.await.unwrap();
        eprintln!(
            "{}: 3,000-key batch answered {} after {took:?}; storm: {ok} ok, {conflict} 409",
            store.name, reply.status
        );
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "{}: {}",
            store.name,
            reply.text()
        );
        assert!(storm_went_on, "{}: the storm ended first", store.name);
        assert!(ok > 0, "{}: the storm never ran", store.name);
        assert_eq!(other, 0, "{}: answers other than 200 and 409", store.name);
        store.settle().await;
    }
}

// ---------------------------------------------------------------------------------------
// 3. A reservation ends with its waiter
// ---------------------------------------------------------------------------------------

/// Whether a request that does not wait gets `keys` (one, or several: `a,b`) at once.
async fn free_now(locks: &Locks, keys: &str) -> bool {
    let order = Arc::new(Mutex::new(Vec::new()));
    send(&recording_router(locks, &order), named(keys, "probe", 0))
        .await
        .status
        == StatusCode::OK
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_that_gives_up_or_is_dropped_withdraws_its_reservations_at_once() {
    for store in Store::all() {
        let [first, second] = &store.locks;
        let (gate, held) = hold(first, "a").await;
        let order = Arc::new(Mutex::new(Vec::new()));

        // Gives up: refused after its bound, and `b` is free for the very next request.
        let app = recording_router(&waiting(second, Duration::from_millis(200)), &order);
        let reply = send(&app, named("a,b", "gives up", 0)).await;
        assert_eq!(reply.status, StatusCode::CONFLICT, "{}", store.name);
        assert!(
            free_now(first, "b").await,
            "{}: `b` still reserved",
            store.name
        );

        // Dropped (its client left): `b` is free long before the reservation would expire.
        let app = recording_router(&waiting(second, Duration::from_secs(10)), &order);
        let dropped = tokio::time::timeout(
            Duration::from_millis(200),
            send(&app, named("a,b", "dropped", 0)),
        )
        .await;
        assert!(dropped.is_err(), "{}: the waiter was granted", store.name);
        // The withdrawal runs in the background: well within the reservation's lifetime.
        let dropped_at = Instant::now();
        while !free_now(first, "b").await {
            assert!(
                dropped_at.elapsed() < Duration::from_secs(1) / 2,
                "{}: the dropped waiter's reservation stayed",
                store.name
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }

        gate.open();
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
        assert!(
            order.lock().unwrap().iter().all(|n| n == "probe"),
            "{}",
            store.name
        );
        store.settle().await;
    }
}

/// The environment variable that turns [`waiter_process`] into a waiting client.
const WAITER_URL: &str = "TOWER_BATCH_LOCK_TEST_WAITER_URL";

/// Starts this test binary again to run the ignored test `test` alone, on the Redis at
/// `url`: a process of its own, for a test to kill.
fn child_process(test: &str, url: &str) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--ignored", "--nocapture"])
        .env(WAITER_URL, url)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|error| panic!("could not start {test}: {error}"))
}

/// `keys` as they are, and with 62 more: a batch big enough (64 keys) that its waiter keeps
/// its place in line on Redis with a claim, rather than with a reservation in each key.
fn small_and_big(keys: &str) -> [String; 2] {
    let more: String = (0..62).map(|i| format!(",more:{i:02}")).collect();
    [keys.to_owned(), format!("{keys}{more}")]
}

/// Sends a request for `keys` (`b` among them) through `locks`, waiting up to 10 s, and
/// returns once it stands in line on `b`, by a reservation or a claim (on the memory store,
/// which cannot be looked into, a moment after it was sent).
async fn waiter_in_line_on_b(
    store: &Store,
    locks: &Locks,
    keys: &str,
) -> tokio::task::JoinHandle<Reply> {
    let order = Arc::new(Mutex::new(Vec::new()));
    let app = recording_router(&waiting(locks, Duration::from_secs(10)), &order);
    let request = named(keys, "w", 0);
    let waiter = tokio::spawn(async move { send(&app, request).await });
    let reserved = poll_every(Duration::from_millis(5), Duration::from_secs(5), || {
        store.in_line("lock:b").is_none_or(|waiters| waiters == 1)
    })
    .await;
    assert!(reserved.is_some(), "{}", store.name);
    tokio::time::sleep(Duration::from_millis(30)).await;
    waiter
}

/// Not a test: the process that [`a_killed_waiters_reservations_last_to_its_deadline`]
/// starts and kills. It waits for `a` and `b` on the Redis at `$WAITER_URL`, for
/// [`KILLED_WAITERS_BOUND`].
#[tokio::test]
#[ignore = "a child process of another test"]
async fn waiter_process() {
    let Ok(url) = std::env::var(WAITER_URL) else {
        return;
    };
    let locks =
        Locks::new(Redis::url(&url).build().unwrap()).wait(Wait::up_to(KILLED_WAITERS_BOUND));
    let order = Arc::new(Mutex::new(Vec::new()));
    send(&recording_router(&locks, &order), named("a,b", "killed", 0)).await;
}

/// Not a test: the process that [`a_holders_process_killed_leaves_its_waiters_place_in_line`]
/// starts and kills. It holds `a` on the Redis at `$WAITER_URL` with a TTL of a second,
/// renewed, until it is killed (a minute at most).
#[tokio::test]
#[ignore = "a child process of another test"]
async fn holder_process() {
    let Ok(url) = std::env::var(WAITER_URL) else {
        return;
    };
    let locks = Locks::new(Redis::url(&url).build().unwrap()).ttl(Duration::from_secs(1));
    let (_gate, held) = hold(&locks, "a").await;
    let _ = tokio::time::timeout(Duration::from_secs(60), held).await;
}

/// A holder's process dies while a waiter is in line: its hold ends with its TTL, and the
/// waiter's place does not end with it. A newcomer that keeps asking for the key as it
/// expires is refused until the waiter has had it. (On Redis the waiter's reservation was
/// kept in the holder's value, and went with it: the newcomer won, 3 times in 3.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holders_process_killed_leaves_its_waiters_place_in_line() {
    holder_killed_with_a_waiter_for("a").await;
}

/// The same with a big batch's waiter, whose place in line is a claim, apart from the
/// holder's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holders_process_killed_leaves_a_big_waiters_claim() {
    let [_, big] = small_and_big("a");
    holder_killed_with_a_waiter_for(&big).await;
}

/// A holder's process, holding `a`, is killed while a waiter for `keys` is in line on `a`;
/// a newcomer asks for `a` until the waiter has been granted, and must not be first.
async fn holder_killed_with_a_waiter_for(keys: &str) {
    let store = Store::redis();
    let [locks, _] = &store.locks;
    let mut holder = child_process("fairness::holder_process", &store.servers[0].url());
    let held = poll_every(Duration::from_millis(10), Duration::from_secs(20), || {
        store.line("lock:a").is_some()
            && store.observers()[0]
                .lock("lock:a")
                .is_some_and(|v| v.owner.is_some())
    })
    .await;
    assert!(held.is_some(), "the holder process never took `a`");

    let order = Arc::new(Mutex::new(Vec::new()));
    let waiter_app = recording_router(&waiting(locks, Duration::from_secs(5)), &order);
    let request = named(keys, "waiter", 0);
    let waiter = tokio::spawn(async move { send(&waiter_app, request).await });
    let in_line = poll_every(Duration::from_millis(5), Duration::from_secs(5), || {
        store.in_line("lock:a") == Some(1)
    })
    .await;
    assert!(in_line.is_some(), "the waiter never reserved `a`");

    holder.kill().unwrap();
    holder.wait().unwrap();
    // A newcomer that does not wait asks every 5 ms until the waiter has been granted.
    let newcomer = recording_router(locks, &order);
    let started = Instant::now();
    while order.lock().unwrap().is_empty() && started.elapsed() < Duration::from_secs(5) {
        send(&newcomer, named("a", "newcomer", 0)).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(waiter.await.unwrap().status, StatusCode::OK);
    let order = order.lock().unwrap().clone();
    assert_eq!(
        order.first().map(String::as_str),
        Some("waiter"),
        "{order:?}"
    );
    store.settle().await;
}

/// How long the killed waiter of [`a_killed_waiters_reservations_last_to_its_deadline`]
/// would have waited.
const KILLED_WAITERS_BOUND: Duration = Duration::from_secs(3);

/// A waiter's place in line lasts as long as its wait would have (and half a second more,
/// for its last attempt): not less, whatever happens to its process, and not much more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_waiters_reservations_last_to_its_deadline() {
    let store = Store::redis();
    let [locks, _] = &store.locks;
    let (gate, held) = hold(locks, "a").await;

    let mut waiter = child_process("fairness::waiter_process", &store.servers[0].url());
    let in_line = poll_every(Duration::from_millis(10), Duration::from_secs(20), || {
        store.line("lock:b").is_some_and(|line| line.len() == 1)
    })
    .await;
    assert!(in_line.is_some(), "the waiter process never reserved `b`");
    let reserved = Instant::now();
    assert!(!free_now(locks, "b").await, "`b` is reserved");

    waiter.kill().unwrap();
    waiter.wait().unwrap();
    // Its place does not go with its process: the line keeps it until its deadline.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        !free_now(locks, "b").await,
        "the reservation went before the deadline"
    );
    let freed = poll_every(Duration::from_millis(20), Duration::from_secs(10), || {
        store.line("lock:b").is_some_and(|line| line.is_empty())
    })
    .await;
    let took = reserved.elapsed();
    eprintln!("a killed waiter's reservation of `b` gone {took:?} after it was seen");
    assert!(
        freed.is_some(),
        "the killed waiter's reservation never expired"
    );
    assert!(
        took <= KILLED_WAITERS_BOUND + Duration::from_millis(500 + 300),
        "{took:?}"
    );
    assert!(free_now(locks, "b").await, "`b` is free again");
    // On `a` the expired reservation sits beside the hold until the hold's release, which
    // leaves nothing behind.
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    store.settle().await;
}

// ---------------------------------------------------------------------------------------
// 4. An owner is never kept out of its own keys, nor by waiters that came after it
// ---------------------------------------------------------------------------------------

/// Locks `b` for `lease`'s owner without waiting, and releases it: says whether it could.
async fn lock_b(lease: &Lease) -> &'static str {
    match lease.lock(["b"]).await {
        Ok(held) => {
            held.release().await;
            "locked b"
        }
        Err(_) => "kept out of b",
    }
}

/// An owner that holds a key and locks another is kept out of that one by the reservation
/// of a waiter that arrived before it: holding `a` lets it past the line on `a`, not on
/// `b`. (It used to pass every reservation on every key of its batch.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_owner_with_a_held_key_is_kept_out_of_another_by_an_earlier_waiter() {
    for store in Store::all() {
        for keys in small_and_big("b,c") {
            let [first, second] = &store.locks;
            // `c` is held: a waiter for `b` and `c` reserves both, `b` free.
            let (gate_c, held_c) = hold(first, "c").await;
            let waiter = waiter_in_line_on_b(&store, second, &keys).await;

            // A request that arrives now holds `a`, and its handler locks `b` without waiting.
            let inner = |Extension(lease): Extension<Lease>| async move { lock_b(&lease).await };
            let only_a = |_: &http::request::Parts| Ok::<_, tower_batch_lock::Rejection>(["a"]);
            let app = Router::new().route("/", get(inner).layer(first.layer(only_a)));
            let reply = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
            assert_eq!(reply.text(), "kept out of b", "{}", store.name);

            gate_c.open();
            assert_eq!(held_c.await.unwrap().status, StatusCode::OK);
            let waited = within(Duration::from_secs(5), "the waiter", waiter).await;
            assert_eq!(waited.unwrap().status, StatusCode::OK, "{}", store.name);
            store.settle().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_owner_that_holds_keys_is_not_kept_out_by_a_waiters_reservations() {
    for store in Store::all() {
        for keys in small_and_big("a,b") {
            let [first, second] = &store.locks;
            // The request holds `a`; a waiter, held up by it, reserves `a` and `b`. The
            // handler then locks `b` for the same owner and re-enters `a` through a nested
            // layer: waiting for the waiter would deadlock, so neither is kept out.
            let gate = Gate::new();
            let inner = {
                let gate = gate.clone();
                move |Extension(lease): Extension<Lease>| {
                    let gate = gate.clone();
                    async move {
                        gate.pass().await;
                        lock_b(&lease).await
                    }
                }
            };
            let only_a = |_: &http::request::Parts| Ok::<_, tower_batch_lock::Rejection>(["a"]);
            let app = Router::new()
                .route("/", get(inner).layer(first.layer(only_a)))
                .layer(first.layer(only_a));
            let holder = tokio::spawn(async move {
                send(&app, Request::get("/").body(Body::empty()).unwrap()).await
            });
            gate.wait_entered().await;

            let waiter = waiter_in_line_on_b(&store, second, &keys).await;

            gate.open();
            let reply = within(Duration::from_secs(5), "the holder", holder)
                .await
                .unwrap();
            assert_eq!(reply.text(), "locked b", "{}", store.name);
            let waited = within(Duration::from_secs(5), "the waiter", waiter).await;
            assert_eq!(waited.unwrap().status, StatusCode::OK, "{}", store.name);
            store.settle().await;
        }
    }
}

/// A waiter that arrives while an owner's first grant is on its way, and that the grant
/// then keeps out, came after the owner: it does not keep the owner out of the next key
/// its handler locks. (The owner stood in line from its grant's answer: the waiter was
/// ahead of it on that key, and each waited for the other until one's bound.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_that_arrives_while_an_owners_grant_is_on_its_way_comes_after_it() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let proxy = Proxy::start(server.port()).await;
    let slow =
        Locks::new(Redis::url(proxy.url()).build().unwrap()).store_timeout(Duration::from_secs(5));
    let direct = Locks::new(Redis::url(server.url()).build().unwrap());
    // Whether the owner's grant has been answered: its handler has run.
    let answered = Arc::new(AtomicBool::new(false));
    let inner = {
        let answered = answered.clone();
        move |Extension(lease): Extension<Lease>| {
            answered.store(true, Ordering::SeqCst);
            async move { lock_b(&lease).await }
        }
    };
    let only_a = |_: &http::request::Parts| Ok::<_, tower_batch_lock::Rejection>(["a"]);
    let app = Router::new().route("/", get(inner).layer(slow.layer(only_a)));
    let get_root = || Request::get("/").body(Body::empty()).unwrap();
    // Connected first: the proxy's latency then only delays each command and its answer.
    assert_eq!(send(&app, get_root()).await.text(), "locked b");
    proxy.set(Fault::Latency(Duration::from_millis(100)));
    answered.store(false, Ordering::SeqCst);

    let owner = tokio::spawn(async move { send(&app, get_root()).await });
    // The owner's attempt reaches Redis about 100 ms after it was sent; its answer comes
    // back 100 ms after that. A waiter for `a` and `b` arrives in between: `a` held, it
    // reserves both.
    let granted = poll_every(Duration::from_millis(2), Duration::from_secs(2), || {
        observer.lock("lock:a").is_some()
    })
    .await;
    assert!(granted.is_some(), "the owner's grant never landed");
    let order = Arc::new(Mutex::new(Vec::new()));
    let app = recording_router(&waiting(&direct, Duration::from_secs(5)), &order);
    let waiter = tokio::spawn(async move { send(&app, named("a,b", "w", 0)).await });
    let reserved = poll_every(Duration::from_millis(2), Duration::from_secs(2), || {
        observer
            .lock("lock:b")
            .is_some_and(|v| v.reservations.len() == 1)
    })
    .await;
    assert!(reserved.is_some(), "the waiter never stood in line on b");
    // Otherwise this run missed the moment it tests (a loaded machine): not a pass.
    assert!(
        !answered.load(Ordering::SeqCst),
        "the waiter stood in line after the owner's grant was answered"
    );

    let reply = within(Duration::from_secs(5), "the owner", owner).await;
    assert_eq!(reply.unwrap().text(), "locked b");
    let waited = within(Duration::from_secs(5), "the waiter", waiter).await;
    assert_eq!(waited.unwrap().status, StatusCode::OK);
}

// ---------------------------------------------------------------------------------------
// 5. Without fairness, waiters race whoever comes
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_fairness_a_waiter_reserves_nothing() {
    for store in Store::all() {
        let [first, second] = &store.locks;
        let (gate, held) = hold(first, "a").await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let unfair = second
            .clone()
            .wait(Wait::up_to(Duration::from_secs(10)).fair(false));
        let app = recording_router(&unfair, &order);
        let waiter = tokio::spawn(async move { send(&app, named("a,b", "w", 0)).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            free_now(first, "b").await,
            "{}: `b` was reserved",
            store.name
        );
        assert_eq!(store.line("lock:b").unwrap_or_default(), Vec::<u128>::new());
        gate.open();
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
        let waited = within(Duration::from_secs(5), "the waiter", waiter).await;
        assert_eq!(waited.unwrap().status, StatusCode::OK, "{}", store.name);
        store.settle().await;
    }
}
