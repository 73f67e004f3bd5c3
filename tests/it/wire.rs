//! Faults on the wire between the service and Redis (`support::proxy`): latency, a stalled
//! connection, replies lost after the command ran, connections reset. Under each, with
//! bounded load from two "processes" on overlapping keys, one through the faulty proxy and
//! one straight to Redis: no two critical sections that share a key overlap, a refusal is
//! a 503 within the store timeout, the proxied process recovers by itself once the fault
//! ends, and no key is left past its TTL.

use std::{
    sync::{atomic::Ordering, Arc, Mutex},
    time::{Duration, Instant},
};

use axum::Router;
use http::StatusCode;
use tower_batch_lock::{
    store::{Redis, Redlock},
    Lease, Locks, Wait,
};

use crate::support::{
    handlers::{gated_handler, hold, ledger_handler, Gate, Ledger},
    http::{batch, batch_router, poll_every, send, within},
    proxy::{Fault, Proxy},
    Observer, RedisServer, Rng,
};

const STORE_TIMEOUT: Duration = Duration::from_millis(500);
const TTL: Duration = Duration::from_secs(2);
/// Requests per process.
const REQUESTS: usize = 20;

/// Every answer the proxied process got: its status and how long it took.
type Answers = Arc<Mutex<Vec<(StatusCode, Duration)>>>;

fn locks(url: String) -> Locks {
    Locks::new(Redis::url(url).build().unwrap())
        .ttl(TTL)
        .store_timeout(STORE_TIMEOUT)
}

/// `REQUESTS` random batches of 1 or 2 keys out of 4, at once, each retried on 409 up to
/// 20 times; the proxied process's answers go to `answers`.
async fn load(app: &Router, seed: u64, answers: Option<&Answers>) {
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let (app, answers) = (app.clone(), answers.cloned());
            tokio::spawn(async move {
                let mut rng = Rng::seeded(seed * 1000 + i as u64);
                let keys: Vec<String> = (0..1 + rng.below(2))
                    .map(|_| format!("k{}", rng.below(4)))
                    .collect();
                for _ in 0..20 {
                    let started = Instant::now();
                    let status = send(&app, batch(&keys)).await.status;
                    if let Some(answers) = &answers {
                        answers.lock().unwrap().push((status, started.elapsed()));
                    }
                    if status != StatusCode::CONFLICT {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
}

/// Runs the load with `fault` on the proxy while `during` runs beside it, then checks.
async fn under(
    name: &str,
    fault: Fault,
    during: impl FnOnce(Arc<Proxy>) -> Option<tokio::task::JoinHandle<()>>,
) {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let proxy = Arc::new(Proxy::start(server.port()).await);
    let ledger = Arc::new(Ledger::default());
    let proxied = batch_router(&locks(proxy.url()), ledger_handler(&ledger));
    let direct = batch_router(&locks(server.url()), ledger_handler(&ledger));
    assert_eq!(send(&proxied, batch(&["k0"])).await.status, StatusCode::OK);

    proxy.set(fault);
    let beside = during(proxy.clone());
    let answers = Answers::default();
    let started = Instant::now();
    tokio::join!(load(&proxied, 1, Some(&answers)), load(&direct, 2, None));
    let took = started.elapsed();
    if let Some(beside) = beside {
        beside.abort();
    }
    proxy.set(Fault::None);
    let loaded = Instant::now();

    assert_eq!(
        ledger.overlaps.load(Ordering::SeqCst),
        0,
        "{name}: two holders were inside the same key at once"
    );
    let answers = std::mem::take(&mut *answers.lock().unwrap());
    let count = |status| answers.iter().filter(|(s, _)| *s == status).count();
    for &(status, took) in &answers {
        assert!(
            [
                StatusCode::OK,
                StatusCode::CONFLICT,
                StatusCode::SERVICE_UNAVAILABLE
            ]
            .contains(&status),
            "{name}: {status}"
        );
        if status == StatusCode::SERVICE_UNAVAILABLE {
            assert!(
                took < STORE_TIMEOUT + Duration::from_millis(300),
                "{name}: a 503 took {took:?}"
            );
        }
    }

    // The proxied process recovers by itself: a grant within 5 s.
    let mut recovered = None;
    for _ in 0..50 {
        if send(&proxied, batch(&["recovery"])).await.status == StatusCode::OK {
            recovered = Some(loaded.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let recovered = recovered.unwrap_or_else(|| panic!("{name}: no grant within 5 s"));

    // Nothing is left past its TTL (counted from the end of the load).
    let emptied = poll_every(
        Duration::from_millis(50),
        TTL + Duration::from_secs(2),
        || observer.locks().is_empty(),
    )
    .await;
    assert!(emptied.is_some(), "{name}: left {:?}", observer.locks());
    eprintln!(
        "{name}: load {took:?}; proxied answers {} ok, {} 409, {} 503; recovered in \
         {recovered:?}; no key left {:?} after the load",
        count(StatusCode::OK),
        count(StatusCode::CONFLICT),
        count(StatusCode::SERVICE_UNAVAILABLE),
        loaded.elapsed(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_slows_grants_and_breaks_nothing() {
    under(
        "latency 30 ms",
        Fault::Latency(Duration::from_millis(30)),
        |_| None,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_connection_gives_503_within_the_store_timeout() {
    under("stall", Fault::Stall, |_| None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_lost_after_the_script_ran_leave_nothing_behind() {
    under("replies dropped", Fault::DropReplies, |_| None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_reset_under_load_break_nothing() {
    under("resets every 50 ms", Fault::None, |proxy| {
        Some(tokio::spawn(async move {
            for _ in 0..200 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                proxy.reset();
            }
        }))
    })
    .await;
}

/// A store that stalls as a response is ready, with the handler's own hold beside the
/// layer's and an extension of each in flight: the response waits one store timeout in
/// all, not one for each extension and each hold (the release goes on in the background).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_release_delays_the_response_by_one_store_timeout_whatever_it_holds() {
    const STORE_TIMEOUT: Duration = Duration::from_millis(400);
    let server = RedisServer::start();
    let proxy = Arc::new(Proxy::start(server.port()).await);
    // Extended every 300 ms, each extension given 300 ms.
    let locks = Locks::new(Redis::url(proxy.url()).build().unwrap())
        .ttl(Duration::from_millis(900))
        .store_timeout(STORE_TIMEOUT);
    let done = Arc::new(Mutex::new(None));
    let handler = {
        let (proxy, done) = (proxy.clone(), done.clone());
        move |lease: Lease| async move {
            let _more = lease.lock(["stall:extra"]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            proxy.set(Fault::Stall);
            // Both holds' first extensions went out at about 300 ms, and hang.
            tokio::time::sleep(Duration::from_millis(200)).await;
            *done.lock().unwrap() = Some(Instant::now());
        }
    };
    let app = batch_router(&locks, handler);
    let reply = send(&app, batch(&["stall:a"])).await;
    let waited = done.lock().unwrap().expect("the handler ran").elapsed();
    proxy.set(Fault::None);
    assert_eq!(reply.status, StatusCode::OK);
    assert!(
        waited < STORE_TIMEOUT + Duration::from_millis(250),
        "the response waited {waited:?} for its release"
    );
}

/// An acquisition held up on the wire past its timeout (its connection's bytes held, as a
/// network holds a delayed packet) while its release goes out on a new connection and
/// finds nothing: when the acquisition lands after it, its grant holds the key for no
/// one. The release is sent again after such an acquisition (`late`), and ends that grant
/// within seconds, where it would have kept the key for its whole TTL (10 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_that_lands_after_its_release_is_ended_within_seconds_not_its_ttl() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let proxy = Proxy::start(server.port()).await;
    let locks = Locks::new(Redis::url(proxy.url()).build().unwrap())
        .ttl(Duration::from_secs(10))
        .store_timeout(Duration::from_millis(300));
    let ledger = Arc::new(Ledger::default());
    let app = batch_router(&locks, ledger_handler(&ledger));
    assert_eq!(
        send(&app, batch(&["late:warm"])).await.status,
        StatusCode::OK
    );

    proxy.hold_open();
    let reply = send(&app, batch(&["late:1"])).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    // The release went out on a new connection, and found nothing to release.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(observer.lock("lock:late:1").is_none());

    a_late_grant_ends_within_seconds(&proxy, &observer, "lock:late:1").await;
}

/// Lets the bytes `proxy` holds go on, waits for the held acquisition to land (its grant
/// of `key` appears on `observer`'s server), and checks that the grant ends within 4 s of
/// landing, where its TTL (10 s in these tests) would have kept it.
async fn a_late_grant_ends_within_seconds(proxy: &Proxy, observer: &Observer, key: &str) {
    let landed = lands_and_ends_within_seconds(
        proxy,
        "a late grant",
        || observer.lock(key).is_some(),
        || observer.lock(key).is_none(),
    )
    .await;
    assert!(landed, "the held acquisition never landed");
}

/// Lets the bytes `proxy` holds go on and waits up to 2 s for what they carry to land
/// (`landed`); once it has, checks that it ends (`ended`) within 4 s, where a TTL or a
/// waiter's deadline would have kept it. Whether it landed.
async fn lands_and_ends_within_seconds(
    proxy: &Proxy,
    what: &str,
    landed: impl FnMut() -> bool,
    ended: impl FnMut() -> bool,
) -> bool {
    proxy.release_held();
    let landed = poll_every(Duration::from_millis(5), Duration::from_secs(2), landed).await;
    if landed.is_some() {
        let ended = poll_every(Duration::from_millis(20), Duration::from_secs(9), ended).await;
        eprintln!("{what} ended {ended:?} after it landed");
        assert!(
            ended.is_some_and(|after| after < Duration::from_secs(4)),
            "{what} kept its place {ended:?}"
        );
    }
    landed.is_some()
}

/// A waiter's refused attempt held up on the wire past its timeout while its withdrawal
/// goes out on a new connection and finds nothing: when the attempt lands after it, its
/// reservation keeps later arrivals out of the key for a waiter long gone, to the end of
/// its wait (10 s here). The withdrawal is sent again after such an attempt (`late`), and
/// ends that reservation within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reservation_that_lands_after_its_withdrawal_is_ended_within_seconds() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let proxy = Proxy::start(server.port()).await;
    let direct = Locks::new(Redis::url(server.url()).build().unwrap());
    let proxied = Locks::new(Redis::url(proxy.url()).build().unwrap())
        .store_timeout(Duration::from_millis(300))
        .wait(Wait::up_to(Duration::from_secs(10)));
    let ledger = Arc::new(Ledger::default());
    let app = batch_router(&proxied, ledger_handler(&ledger));
    assert_eq!(
        send(&app, batch(&["late:warm"])).await.status,
        StatusCode::OK
    );
    let reservations = || {
        observer
            .lock("lock:late:1")
            .map_or(0, |value| value.reservations.len())
    };
    let (gate, held) = hold(&direct, "late:1").await;

    proxy.hold_open();
    let reply = send(&app, batch(&["late:1"])).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    // The withdrawal went out on a new connection, and found nothing to withdraw.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(reservations(), 0);

    let landed = lands_and_ends_within_seconds(
        &proxy,
        "a late reservation",
        || reservations() == 1,
        || reservations() == 0,
    )
    .await;
    assert!(landed, "the held attempt never landed and reserved");

    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let freed = poll_every(Duration::from_millis(10), Duration::from_secs(2), || {
        observer.lock("lock:late:1").is_none()
    })
    .await;
    assert!(freed.is_some(), "the key is gone with its hold");
}

/// Redlock: an acquisition refused by a majority (the key is held on two masters) while
/// the third master's answer is held up on the wire past the node timeout. Its rollback
/// goes out on a new connection and finds nothing there; when the acquisition lands after
/// it, its grant holds that master's key for no one. The rollback is sent again after such
/// an acquisition (`late`), and ends that grant within seconds, where it would have kept
/// the key for its whole TTL (10 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redlock_grant_that_lands_after_its_rollback_is_ended_within_seconds() {
    let servers: Vec<_> = (0..3).map(|_| RedisServer::start()).collect();
    let observer = Observer::of(&servers[0]);
    let proxy = Proxy::start(servers[0].port()).await;
    let urls = [proxy.url(), servers[1].url(), servers[2].url()];
    let redlock = Redlock::new(urls)
        .node_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let locks = Locks::new(redlock).ttl(Duration::from_secs(10));
    let ledger = Arc::new(Ledger::default());
    let app = batch_router(&locks, ledger_handler(&ledger));
    assert_eq!(
        send(&app, batch(&["late:warm"])).await.status,
        StatusCode::OK
    );
    // Another process holds the key on two masters of three: a majority refuses.
    let (b, c) = (locks_on(&servers[1]), locks_on(&servers[2]));
    let ((gate_b, held_b), (gate_c, held_c)) = (hold(&b, "late:1").await, hold(&c, "late:1").await);

    proxy.hold_open();
    let reply = send(&app, batch(&["late:1"])).await;
    assert_eq!(reply.status, StatusCode::CONFLICT);
    // The rollback went out on a new connection, and found nothing to release.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(observer.lock("lock:late:1").is_none());

    a_late_grant_ends_within_seconds(&proxy, &observer, "lock:late:1").await;
    for (gate, held) in [(gate_b, held_b), (gate_c, held_c)] {
        gate.open();
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
    }
}

/// A Redlock lease on a batch that goes to each master in several steps, over a link
/// slow enough that the steps together take longer than one node timeout (each within
/// it): its renewals get a node timeout a step, as its acquisition did, and the lease
/// renews. Bounded by one node timeout, every renewal failed and the lease was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redlock_lease_on_a_batch_of_many_steps_renews_over_a_slow_link() {
    let servers: Vec<_> = (0..3).map(|_| RedisServer::start()).collect();
    let mut proxies = Vec::new();
    for server in &servers {
        let proxy = Proxy::start(server.port()).await;
        proxy.set(Fault::Latency(Duration::from_millis(10)));
        proxies.push(proxy);
    }
    // 100 keys in steps of 10: ten round trips of 20 ms or more a call, against a node
    // timeout of 100 ms.
    let redlock = Redlock::new(proxies.iter().map(Proxy::url))
        .node_timeout(Duration::from_millis(100))
        .step_keys(10)
        .build()
        .unwrap();
    let locks = Locks::new(redlock)
        .ttl(Duration::from_millis(1500))
        .store_timeout(Duration::from_secs(3));
    let gate = Gate::new();
    let app = batch_router(&locks, gated_handler(&gate));
    let keys: Vec<String> = (0..100).map(|i| format!("steps:{i}")).collect();
    let request = tokio::spawn(async move { send(&app, batch(&keys)).await });
    gate.wait_entered().await;
    // Twice the TTL: three renewals or more.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let lease = gate.lease();
    assert!(!lease.is_lost(), "the lease was lost");
    assert!(lease.expires_at() > Instant::now());
    gate.open();
    assert_eq!(request.await.unwrap().status, StatusCode::OK);
}

/// A Redlock waiter granted by two masters while its attempt on the third is held up on
/// the wire: the place it withdraws there comes back when that attempt lands and is
/// refused (another holder has the key there), and is withdrawn again within seconds,
/// where it kept later requests out of that master to the waiter's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redlock_waiters_place_put_back_by_a_late_attempt_is_withdrawn_again() {
    let servers: Vec<_> = (0..3).map(|_| RedisServer::start()).collect();
    let proxy = Proxy::start(servers[2].port()).await;
    let redlock = |urls: [String; 3]| {
        let store = Redlock::new(urls)
            .node_timeout(Duration::from_millis(200))
            .build()
            .unwrap();
        Locks::new(store).ttl(Duration::from_secs(10))
    };
    let waiting = redlock([servers[0].url(), servers[1].url(), proxy.url()])
        .wait(Wait::up_to(Duration::from_secs(8)));
    let app = batch_router(&waiting, ledger_handler(&Arc::new(Ledger::default())));
    assert_eq!(
        send(&app, batch(&["late:warm"])).await.status,
        StatusCode::OK
    );
    let holder = redlock([servers[0].url(), servers[1].url(), servers[2].url()]);
    // A round counts when the waiter's attempt is what the wire held up (on a loaded
    // machine its probe may be, and the attempt then goes on a connection of its own).
    for round in 0..3 {
        let key = format!("late:k{round}");
        if waiter_put_back(&waiting, &holder, &servers[2], &proxy, &key).await {
            return;
        }
        eprintln!("round {round}: the wire held no attempt; again");
    }
    panic!("the held attempt never landed in three rounds");
}

/// One round of the test above on `key`: whether the waiter's held attempt landed (and
/// then, that the place it put back ended within seconds).
async fn waiter_put_back(
    waiting: &Locks,
    holder: &Locks,
    third: &RedisServer,
    proxy: &Proxy,
    key: &str,
) -> bool {
    let app = batch_router(waiting, ledger_handler(&Arc::new(Ledger::default())));
    // Another process holds the key on the third master alone, where it refuses every
    // batch; a Redlock holder has it on the other two.
    let (gate_third, held_third) = hold(&locks_on(third), key).await;
    let (gate, held) = hold(holder, key).await;
    let observer = Observer::of(third);
    let lock_key = format!("lock:{key}");
    let place = || observer.lock(&lock_key).map_or(0, |v| v.reservations.len());

    let keys = [key.to_owned()];
    let waiter = tokio::spawn(async move { send(&app, batch(&keys)).await });
    let in_line = poll_every(Duration::from_millis(5), Duration::from_secs(3), || {
        place() == 1
    });
    assert!(in_line.await.is_some(), "the waiter never stood in line");
    // Its next attempt on the third master is held up on the wire; the holder's release
    // wakes it, and the other two grant it.
    proxy.hold_open();
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let reply = within(Duration::from_secs(5), "the waiter", waiter).await;
    assert_eq!(reply.unwrap().status, StatusCode::OK);
    let granted = Instant::now();
    let withdrawn = poll_every(Duration::from_millis(10), Duration::from_secs(2), || {
        place() == 0
    });
    assert!(withdrawn.await.is_some(), "the place was never withdrawn");

    // The held attempt lands, is refused, and puts the place back; it is withdrawn again
    // (let go after the first withdrawal's first re-send, 0.25 s after it: the next is
    // due a second later, the last 3.25 s after it). A round in which this test ran so
    // late (a loaded machine) that the attempt could land after the last re-send does not
    // count.
    tokio::time::sleep(Duration::from_millis(400)).await;
    if granted.elapsed() > Duration::from_millis(1_200) {
        eprintln!("ran {:?} after the grant: too late", granted.elapsed());
        proxy.release_held();
        gate_third.open();
        assert_eq!(held_third.await.unwrap().status, StatusCode::OK);
        return false;
    }
    let landed = lands_and_ends_within_seconds(
        proxy,
        "a place put back late",
        || place() == 1,
        || place() == 0,
    )
    .await;
    gate_third.open();
    assert_eq!(held_third.await.unwrap().status, StatusCode::OK);
    landed
}

/// A Redlock waiter refused by two masters and granted by the third keeps its place on
/// that one: it reserves there before its roll-back. That reservation is held up on the
/// wire past the node timeout, and the waiter, its refusal answered by the other two,
/// waits in line and is granted by them; then the held reservation lands, and puts the
/// place back on the third master. The refusal said that a part of it may land later, and
/// the place is withdrawn again after the grant, within seconds, where it kept later
/// arrivals out of that master's key to the waiter's deadline (10 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redlock_waiters_reservation_that_lands_after_its_grant_is_withdrawn_again() {
    let servers: Vec<_> = (0..3).map(|_| RedisServer::start()).collect();
    let proxy = Proxy::start(servers[0].port()).await;
    let store = Redlock::new([proxy.url(), servers[1].url(), servers[2].url()])
        .node_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let waiting = Locks::new(store)
        .ttl(Duration::from_secs(10))
        .wait(Wait::up_to(Duration::from_secs(10)));
    let app = batch_router(&waiting, ledger_handler(&Arc::new(Ledger::default())));
    assert_eq!(
        send(&app, batch(&["stray:warm"])).await.status,
        StatusCode::OK
    );
    // A round counts when the wire held the reservation (on a loaded machine it may not).
    for round in 0..3 {
        let key = format!("stray:k{round}");
        if reservation_put_back(&app, &servers, &proxy, &key).await {
            return;
        }
        eprintln!("round {round}: the held reservation never landed; again");
    }
    panic!("no reservation was held up in three rounds");
}

/// One round of the test above on `key`: whether the waiter's reservation on the first
/// master landed after its grant (and then, that the place it put back ended within
/// seconds).
async fn reservation_put_back(
    app: &Router,
    servers: &[RedisServer],
    proxy: &Proxy,
    key: &str,
) -> bool {
    let lock_key = format!("lock:{key}");
    let observer = Observer::of(&servers[0]);
    let place = || observer.lock(&lock_key).map_or(0, |v| v.reservations.len());
    // Other processes hold the key on the second and third masters alone.
    let (gate_second, held_second) = hold(&locks_on(&servers[1]), key).await;
    let (gate_third, held_third) = hold(&locks_on(&servers[2]), key).await;

    // Those two, stopped, answer the waiter's attempt late: the first master has granted
    // it by then, and the wire holds what goes to it next (the reservation).
    servers[1].pause();
    servers[2].pause();
    let (app, keys) = (app.clone(), [key.to_owned()]);
    let waiter = tokio::spawn(async move { send(&app, batch(&keys)).await });
    let granted_there = poll_every(Duration::from_millis(2), Duration::from_secs(2), || {
        observer.lock(&lock_key).is_some()
    })
    .await;
    proxy.hold_open();
    servers[1].resume();
    servers[2].resume();
    assert!(granted_there.is_some(), "the first master never granted");
    // The roll-back goes out on a new connection; the waiter stands in line on the other
    // two, and is granted by them once their holders release.
    let second = Observer::of(&servers[1]);
    let in_line = poll_every(Duration::from_millis(5), Duration::from_secs(5), || {
        second
            .lock(&lock_key)
            .is_some_and(|v| v.reservations.len() == 1)
    });
    assert!(in_line.await.is_some(), "the waiter never stood in line");
    gate_second.open();
    gate_third.open();
    assert_eq!(held_second.await.unwrap().status, StatusCode::OK);
    assert_eq!(held_third.await.unwrap().status, StatusCode::OK);
    let reply = within(Duration::from_secs(5), "the waiter", waiter).await;
    assert_eq!(reply.unwrap().status, StatusCode::OK);
    if place() != 0 {
        // The reservation was not the call the wire held: it is there already.
        proxy.release_held();
        return false;
    }
    lands_and_ends_within_seconds(
        proxy,
        "a place put back after the grant",
        || place() == 1,
        || place() == 0,
    )
    .await
}

/// Locks on one Redis of a Redlock's masters, with the same prefix.
fn locks_on(server: &RedisServer) -> Locks {
    Locks::new(Redis::url(server.url()).build().unwrap())
}

/// A Redis, a proxy to it, and locks through the proxy whose requests wait up to 10 s,
/// behind holds of 30 s, with a store timeout of 200 ms: a call whose reply the proxy
/// drops fails fast, and a waiter kept out looks again only every 1-2 s.
async fn waiting_behind_a_proxy() -> (RedisServer, Proxy, Locks) {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await;
    let locks = Locks::new(Redis::url(proxy.url()).build().unwrap())
        .ttl(Duration::from_secs(30))
        .store_timeout(Duration::from_millis(200))
        .wait(Wait::up_to(Duration::from_secs(10)));
    (server, proxy, locks)
}

/// A withdrawal whose answer is lost has taken the waiter's place out of Redis, and the
/// wake-up it named for the waiter behind it in this process went with its answer (the
/// store's message wakes other processes; this process skips its own): once a retry of
/// the withdrawal is answered, this process's first waiter in line on its keys is woken,
/// where it waited for its next look, 1-2 s after the one before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_withdrawal_whose_answer_was_lost_wakes_the_waiter_behind_it_once_answered() {
    let (server, proxy, locks) = waiting_behind_a_proxy().await;
    let observer = Observer::of(&server);
    let in_line_on_a = |count: usize| {
        observer
            .lock("lock:a")
            .is_some_and(|v| v.reservations.len() == count)
    };
    let waiting_on_a = |count: usize| {
        poll_every(
            Duration::from_millis(5),
            Duration::from_secs(3),
            move || in_line_on_a(count),
        )
    };
    // `b` is held: the first waiter stands in line on `a` and `b`, and the second behind
    // it on `a`, which is free.
    let (gate, held) = hold(&locks, "b").await;
    let app = batch_router(&locks, ledger_handler(&Arc::new(Ledger::default())));
    let first = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, batch(&["a", "b"])).await })
    };
    assert!(
        waiting_on_a(1).await.is_some(),
        "the first never stood in line"
    );
    let second = tokio::spawn(async move { send(&app, batch(&["a"])).await });
    assert!(
        waiting_on_a(2).await.is_some(),
        "the second never stood in line"
    );
    // After a few seconds the second waiter looks every 1-2 s (a probe of `a` alone; the
    // first one's looks probe `b`): one of its looks, and the next is 1 s or more away.
    observer.log_every_command();
    let looks = || {
        observer
            .logged_commands(false)
            .iter()
            .filter(|command| {
                command[0] == "fcall"
                    && command[1].ends_with("_probe")
                    && command.iter().any(|arg| arg == "lock:a")
            })
            .count()
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let seen = looks();
    let looked = poll_every(Duration::from_millis(5), Duration::from_secs(3), || {
        looks() > seen
    });
    assert!(looked.await.is_some(), "the second waiter never looked");
    tokio::time::sleep(Duration::from_millis(50)).await;

    // The first waiter's request is dropped: it withdraws its place, and that answer is
    // lost; the retry is answered.
    proxy.set(Fault::DropReplies);
    let dropped = Instant::now();
    first.abort();
    assert!(waiting_on_a(1).await.is_some(), "the withdrawal never ran");
    proxy.set(Fault::None);
    let reply = within(Duration::from_secs(5), "the second waiter", second).await;
    assert_eq!(reply.unwrap().status, StatusCode::OK);
    let granted = dropped.elapsed();
    eprintln!("granted {granted:?} after the withdrawal whose answer was lost");
    assert!(
        granted < Duration::from_millis(800),
        "the waiter waited {granted:?} for its own look"
    );
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
}

/// A release whose answer is lost has freed its keys in Redis, and the wake-ups it named
/// for this process's waiters went with its answer (the store's message wakes other
/// processes; this process skips its own): once a retry of the release is answered, this
/// process's waiters on its keys are woken, where they waited for their next poll, 1-2 s
/// after the last one behind a hold of 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_whose_answer_was_lost_wakes_this_process_waiters_once_answered() {
    let (server, proxy, locks) = waiting_behind_a_proxy().await;
    let observer = Observer::of(&server);
    let (gate, held) = hold(&locks, "lost").await;
    let app = batch_router(&locks, ledger_handler(&Arc::new(Ledger::default())));
    let waiter = tokio::spawn(async move { send(&app, batch(&["lost"])).await });
    let in_line = poll_every(Duration::from_millis(5), Duration::from_secs(3), || {
        observer
            .lock("lock:lost")
            .is_some_and(|v| v.reservations.len() == 1)
    });
    assert!(in_line.await.is_some(), "the waiter never stood in line");
    // The waiter's next poll (its refusal's reply through the proxy, 50 ms later): its
    // next one comes 1 s or more after it.
    let calls = observer.script_calls();
    let polled = poll_every(Duration::from_millis(5), Duration::from_secs(3), || {
        observer.script_calls() > calls
    });
    assert!(polled.await.is_some(), "the waiter never polled");
    tokio::time::sleep(Duration::from_millis(50)).await;

    proxy.set(Fault::DropReplies);
    let released = Instant::now();
    gate.open();
    // Answered after the layer's release timed out.
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    proxy.set(Fault::None);
    let reply = within(Duration::from_secs(5), "the waiter", waiter).await;
    assert_eq!(reply.unwrap().status, StatusCode::OK);
    let granted = released.elapsed();
    eprintln!("granted {granted:?} after the release whose answer was lost");
    assert!(
        granted < Duration::from_millis(800),
        "the waiter waited {granted:?} for its own poll"
    );
}
