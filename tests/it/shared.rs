//! Shared holds (DESIGN.md, "Holds", and properties 1, 5, 7 and 10 for readers and
//! writers): readers hold keys together, a writer excludes them and they exclude it, a
//! writer behind a stream of readers is granted once the readers before it end, a reader
//! that dies takes only its own hold with it, upgrades go only to a sole reader and never
//! wait, and re-entry works across nested layers in any mode; nothing is left behind.
//!
//! Every case runs on the memory store, one real Redis, Redlock over three real masters
//! and a real Redis Cluster, each with two `Locks` handles standing for two processes.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use axum::{routing::post, Router};
use http::{request::Parts, HeaderMap, Request, StatusCode};
use tower::{ServiceBuilder, ServiceExt};
use tower_batch_lock::{
    keys::Key, store::RedisCluster, KeyStatus, Lease, Locks, Mode, Rejection, Wait,
};

use crate::support::{
    cluster::Cluster,
    handlers::{gated_handler, Gate},
    http::{header_keys, poll_every, post_keys, send, within},
    stores::Store,
};

/// One store under test: its name, two handles on it, and what it still keeps (the
/// closure owns the servers, which stop when it drops).
struct Target {
    name: &'static str,
    locks: [Locks; 2],
    left: Box<dyn Fn() -> Vec<String> + Send + Sync>,
}

impl Target {
    fn of(store: Store) -> Self {
        Self {
            name: store.name,
            locks: store.locks.clone(),
            left: Box::new(move || store.left_under("")),
        }
    }

    /// Waits until the store keeps nothing (releases of requests that answered may still
    /// be on their way to a Redlock minority), or fails naming what is left.
    async fn assert_nothing_left(&self) {
        let settled = poll_every(Duration::from_millis(20), Duration::from_secs(3), || {
            (self.left)().is_empty()
        })
        .await;
        assert!(
            settled.is_some(),
            "{}: left behind {:?}",
            self.name,
            (self.left)()
        );
    }
}

/// Who is inside the routes' handlers now, key by key, across both handles: a key held
/// exclusively by two, or by one beside a reader, is an overlap.
#[derive(Default)]
struct Inside {
    /// Per key: how many hold it shared, and how many exclusively, inside a handler now.
    keys: Mutex<HashMap<String, (usize, usize)>>,
    /// How many readers of the key `s:0` were inside at once, at most.
    most_readers: AtomicUsize,
    overlap: AtomicBool,
    /// The fencing token of every grant, and whether it held a key exclusively.
    fences: Mutex<Vec<(u64, bool)>>,
}

impl Inside {
    /// Runs `work` inside, with the keys of `lease` in their modes.
    async fn hold(&self, lease: &Lease, work: Duration) {
        let keys: Vec<(String, Mode)> = lease
            .keys()
            .map(|key| {
                (
                    key.to_owned(),
                    lease.mode_of(key).expect("a key of the lease"),
                )
            })
            .collect();
        {
            let mut inside = self.keys.lock().unwrap();
            for (key, mode) in &keys {
                let (readers, writers) = inside.entry(key.clone()).or_default();
                let overlap = match mode {
                    Mode::Shared => *writers > 0,
                    Mode::Exclusive => *writers > 0 || *readers > 0,
                };
                if overlap {
                    self.overlap.store(true, Ordering::SeqCst);
                }
                match mode {
                    Mode::Shared => *readers += 1,
                    Mode::Exclusive => *writers += 1,
                }
                if key == "s:0" {
                    self.most_readers.fetch_max(*readers, Ordering::SeqCst);
                }
            }
        }
        let writer = keys.iter().any(|&(_, mode)| mode == Mode::Exclusive);
        self.fences
            .lock()
            .unwrap()
            .push((lease.fencing_token().get(), writer));
        tokio::time::sleep(work).await;
        let mut inside = self.keys.lock().unwrap();
        for (key, mode) in keys {
            let (readers, writers) = inside.get_mut(&key).expect("entered");
            match mode {
                Mode::Shared => *readers -= 1,
                Mode::Exclusive => *writers -= 1,
            }
        }
    }

    /// How many hold `key` in `mode` inside now.
    fn count(&self, key: &str, mode: Mode) -> usize {
        let inside = self.keys.lock().unwrap();
        let (readers, writers) = inside.get(key).copied().unwrap_or_default();
        match mode {
            Mode::Shared => readers,
            Mode::Exclusive => writers,
        }
    }

    /// No overlap, and no fencing token handed out twice, but to readers on Redlock: there
    /// a token is the largest of the masters' counters, so two readers granted at the same
    /// time may get the same one (`FencingToken` says so); a writer, which never runs
    /// beside another grant of its keys, never shares its token.
    fn assert_fenced_apart(&self, name: &str) {
        assert!(
            !self.overlap.load(Ordering::SeqCst),
            "{name}: a writer overlapped"
        );
        let fences = self.fences.lock().unwrap().clone();
        let handed_out = |token: u64| fences.iter().filter(|&&(t, _)| t == token).count();
        for &(token, writer) in &fences {
            if writer || name != "redlock" {
                assert_eq!(
                    handed_out(token),
                    1,
                    "{name}: token {token} handed out twice"
                );
            }
        }
    }
}

/// Keys from the comma-separated `x-read` header, each held shared.
fn read_keys(parts: &Parts) -> Result<Vec<Key>, Rejection> {
    let keys = parts.headers.get("x-read").and_then(|v| v.to_str().ok());
    Ok(keys
        .unwrap_or("")
        .split(',')
        .filter(|k| !k.is_empty())
        .map(Key::shared)
        .collect())
}

/// `x-keys` exclusively and `x-read` shared, as one batch.
fn mixed_keys(parts: &Parts) -> Result<Vec<Key>, Rejection> {
    let mut keys = read_keys(parts)?;
    keys.extend(header_keys(parts)?.into_iter().map(Key::from));
    Ok(keys)
}

fn work(headers: &HeaderMap) -> Duration {
    let ms = headers.get("x-work-ms").and_then(|v| v.to_str().ok());
    Duration::from_millis(ms.and_then(|ms| ms.parse().ok()).unwrap_or(0))
}

/// The routes of one "process":
///
/// - `POST /read`: the `x-keys`, shared; `POST /write`: exclusively; `POST /mixed`:
///   `x-keys` exclusively and `x-read` shared. Each works `x-work-ms` inside `inside`.
/// - `POST /gated-read`: the `x-keys` shared, until `gate` opens.
/// - `POST /upgrade`: the `x-keys` shared, then the handler locks them exclusively; it
///   answers the status of that and how long it took (`x-took-ms`). `POST
///   /upgrade-and-back`: the same, then it releases the exclusive hold and waits for `gate`.
/// - `POST /nested`: an outer layer holds `x-keys` exclusively, an inner one `x-read`
///   shared; `POST /nested-upgrade`: outer `x-read` shared, inner `x-keys` exclusively.
fn router(locks: &Locks, inside: &Arc<Inside>, gate: &Arc<Gate>) -> Router {
    let held = {
        let inside = inside.clone();
        move |lease: Lease, headers: HeaderMap| async move {
            inside.hold(&lease, work(&headers)).await;
        }
    };
    let upgrade = |lease: Lease| async move {
        let keys: Vec<String> = lease.keys().map(str::to_owned).collect();
        let started = Instant::now();
        let status = match lease.lock(keys).await {
            Ok(_) => StatusCode::OK,
            Err(rejection) => rejection.status(),
        };
        let took = started.elapsed().as_millis().to_string();
        (status, [("x-took-ms", took)])
    };
    let upgrade_and_back = {
        let gate = gate.clone();
        move |lease: Lease| async move {
            let keys: Vec<String> = lease.keys().map(str::to_owned).collect();
            let upgraded = lease.lock(keys).await.expect("a sole reader upgrades");
            upgraded.release().await;
            gate.pass().await;
        }
    };
    let entered = |lease: Lease| async move { lease.keys().collect::<Vec<_>>().join(",") };
    Router::new()
        .route(
            "/read",
            post(held.clone()).layer(locks.layer(header_keys).shared()),
        )
        .route("/write", post(held.clone()).layer(locks.layer(header_keys)))
        .route("/mixed", post(held).layer(locks.layer(mixed_keys)))
        .route(
            "/gated-read",
            post(gated_handler(gate)).layer(locks.layer(header_keys).shared()),
        )
        .route(
            "/upgrade",
            post(upgrade).layer(locks.layer(header_keys).shared()),
        )
        .route(
            "/upgrade-and-back",
            post(upgrade_and_back).layer(locks.layer(header_keys).shared()),
        )
        .route(
            "/nested",
            post(entered).layer(
                ServiceBuilder::new()
                    .layer(locks.layer(header_keys))
                    .layer(locks.layer(read_keys)),
            ),
        )
        .route(
            "/nested-upgrade",
            post(entered).layer(
                ServiceBuilder::new()
                    .layer(locks.layer(read_keys))
                    .layer(locks.layer(header_keys)),
            ),
        )
}

/// `POST uri` with `keys` in `x-keys`, `read` in `x-read`, and `work_ms` of work.
fn request(uri: &str, keys: &str, read: &str, work_ms: u64) -> Request<axum::body::Body> {
    let mut request = post_keys(uri, keys);
    let headers = request.headers_mut();
    headers.insert("x-read", read.parse().unwrap());
    headers.insert("x-work-ms", work_ms.to_string().parse().unwrap());
    request
}

async fn every_case(target: Target) {
    let name = target.name;
    readers_overlap_and_writers_exclude_them(&target).await;
    eprintln!("{name}: readers overlap, writers exclude them");
    a_writer_behind_a_stream_of_readers_is_granted_in_bounded_time(&target).await;
    eprintln!("{name}: a writer behind readers is granted");
    a_killed_reader_takes_only_its_own_hold(&target).await;
    eprintln!("{name}: a killed reader takes only its own hold");
    upgrades_go_to_a_sole_reader_at_once_and_nested_layers_reenter(&target).await;
    eprintln!("{name}: upgrades and nested layers");
    target.assert_nothing_left().await;
}

async fn readers_overlap_and_writers_exclude_them(target: &Target) {
    let (name, inside, gate) = (target.name, Arc::new(Inside::default()), Gate::new());
    let apps = target
        .locks
        .clone()
        .map(|locks| router(&locks, &inside, &gate));
    let skus = (0..20)
        .map(|i| format!("s:{i}"))
        .collect::<Vec<_>>()
        .join(",");

    // Six readers of one batch at once, over two processes, none waiting: all get in.
    let readers: Vec<_> = (0..6)
        .map(|i| {
            let (app, skus) = (apps[i % 2].clone(), skus.clone());
            tokio::spawn(async move { send(&app, request("/read", &skus, "", 400)).await })
        })
        .collect();
    let observed = poll_every(Duration::from_millis(10), Duration::from_secs(5), || {
        inside.count("s:0", Mode::Shared) >= 2
    })
    .await;
    assert!(observed.is_some(), "{name}: readers never overlapped");
    // The operator sees the key shared, by several holders; a writer is kept out.
    let state = &target.locks[0].inspect(["s:7"]).await.unwrap()[0];
    assert_eq!(state.status(), KeyStatus::Shared, "{name}");
    assert!(state.holds() >= 2, "{name}: {} holds", state.holds());
    let writer = send(&apps[1], request("/write", "s:7", "", 0)).await;
    assert_eq!(writer.status, StatusCode::CONFLICT, "{name}");
    for reader in readers {
        assert_eq!(reader.await.unwrap().status, StatusCode::OK, "{name}");
    }
    let most = inside.most_readers.load(Ordering::SeqCst);
    eprintln!("{name}: {most} of 6 readers inside at once");
    assert!(most > 1, "{name}: readers ran one at a time");

    // A held key keeps readers out; a refused reader's batch took nothing, even its keys
    // that nobody held.
    let held = {
        let app = apps[0].clone();
        tokio::spawn(async move { send(&app, request("/write", "w:1", "", 300)).await })
    };
    poll_every(Duration::from_millis(5), Duration::from_secs(5), || {
        inside.count("w:1", Mode::Exclusive) == 1
    })
    .await
    .expect("the writer got in");
    let reader = send(&apps[1], request("/read", "w:1,w:2", "", 0)).await;
    assert_eq!(reader.status, StatusCode::CONFLICT, "{name}");
    assert_eq!(
        reader.problem()["conflicting_keys"],
        serde_json::json!(["w:1"])
    );
    assert_eq!(
        send(&apps[1], request("/write", "w:2", "", 0)).await.status,
        StatusCode::OK
    );
    assert_eq!(held.await.unwrap().status, StatusCode::OK);

    // A batch that mixes modes: its shared key beside a reader, all or nothing.
    let gated = {
        let app = apps[0].clone();
        tokio::spawn(async move { send(&app, request("/gated-read", "mixed-r", "", 0)).await })
    };
    gate.wait_entered().await;
    let beside = send(&apps[1], request("/mixed", "mixed-w", "mixed-r", 0)).await;
    assert_eq!(
        beside.status,
        StatusCode::OK,
        "{name}: shared beside a reader"
    );
    let over = send(&apps[1], request("/mixed", "mixed-r", "mixed-x", 0)).await;
    assert_eq!(
        over.status,
        StatusCode::CONFLICT,
        "{name}: exclusive over a reader"
    );
    let after = send(&apps[1], request("/write", "mixed-x", "", 0)).await;
    assert_eq!(
        after.status,
        StatusCode::OK,
        "{name}: the refused batch took nothing"
    );
    gate.open();
    assert_eq!(gated.await.unwrap().status, StatusCode::OK);
    inside.assert_fenced_apart(name);
    target.assert_nothing_left().await;
}

async fn a_writer_behind_a_stream_of_readers_is_granted_in_bounded_time(target: &Target) {
    let (name, inside, gate) = (target.name, Arc::new(Inside::default()), Gate::new());
    // Fair waiting, long enough that nobody here is refused.
    let waiting = |locks: &Locks| locks.clone().wait(Wait::up_to(Duration::from_secs(5)));
    let apps = target
        .locks
        .clone()
        .map(|locks| router(&waiting(&locks), &inside, &gate));
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(6);
    // Four readers in a loop, 80 ms each, staggered: the keys are never free of readers,
    // so without reservations a writer would wait for as long as they go on.
    let readers: Vec<_> = (0..4)
        .map(|i| {
            let (app, stop) = (apps[i % 2].clone(), stop.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20 * i as u64)).await;
                let mut granted = Vec::new();
                for _ in 0..200 {
                    if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
                        break;
                    }
                    let reply = send(&app, request("/read", "h:1,h:2", "", 80)).await;
                    assert_eq!(reply.status, StatusCode::OK, "a reader was refused");
                    granted.push(Instant::now());
                }
                granted
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sent = Instant::now();
    let writer = send(&apps[0], request("/write", "h:2", "", 50)).await;
    let waited = sent.elapsed();
    assert_eq!(
        writer.status,
        StatusCode::OK,
        "{name}: the writer was refused"
    );
    // The readers let it in after them, and go on after it.
    tokio::time::sleep(Duration::from_millis(400)).await;
    stop.store(true, Ordering::SeqCst);
    let mut after = 0;
    for reader in readers {
        after += reader
            .await
            .unwrap()
            .iter()
            .filter(|&&at| at > sent + waited)
            .count();
    }
    eprintln!(
        "{name}: the writer waited {waited:?} behind readers of 80 ms; {after} reads after it"
    );
    assert!(
        waited < Duration::from_millis(1500),
        "{name}: the writer waited {waited:?}"
    );
    assert!(after > 0, "{name}: no reader got in after the writer");
    inside.assert_fenced_apart(name);
    target.assert_nothing_left().await;
}

async fn a_killed_reader_takes_only_its_own_hold(target: &Target) {
    let (name, inside) = (target.name, Arc::new(Inside::default()));
    let ttl = Duration::from_millis(500);
    // The reader that dies has no renewal, as a dead process has none; the one that
    // stays renews its lease.
    let (dying_gate, living_gate) = (Gate::new(), Gate::new());
    let dying = router(
        &target.locks[0].clone().ttl(ttl).renew_lease(false),
        &inside,
        &dying_gate,
    );
    let living = router(&target.locks[1].clone().ttl(ttl), &inside, &living_gate);
    let writer = router(&target.locks[0], &inside, &Gate::new());

    let mut killed = Box::pin(dying.oneshot(request("/gated-read", "k:1", "", 0)));
    tokio::select! {
        () = dying_gate.wait_entered() => {}
        _ = &mut killed => panic!("{name}: the gated reader answered"),
    }
    // Never dropped, never released: only its TTL ends its hold.
    std::mem::forget(killed);
    let stays =
        tokio::spawn(async move { send(&living, request("/gated-read", "k:1", "", 0)).await });
    living_gate.wait_entered().await;
    let lease = living_gate.lease();
    assert_eq!(
        target.locks[1].inspect(["k:1"]).await.unwrap()[0].holds(),
        2,
        "{name}"
    );

    // Past the dead reader's TTL, the key keeps only the living reader's hold, which is
    // intact, and still keeps writers out.
    tokio::time::sleep(ttl + Duration::from_millis(300)).await;
    let state = &target.locks[1].inspect(["k:1"]).await.unwrap()[0];
    assert_eq!(
        (state.status(), state.holds()),
        (KeyStatus::Shared, 1),
        "{name}"
    );
    assert!(
        !lease.is_lost(),
        "{name}: the dead reader's end cut the living one's"
    );
    let kept_out = send(&writer, request("/write", "k:1", "", 0)).await;
    assert_eq!(kept_out.status, StatusCode::CONFLICT, "{name}");
    living_gate.open();
    assert_eq!(stays.await.unwrap().status, StatusCode::OK);
    let granted = within(Duration::from_secs(2), "the writer", async {
        send(&writer, request("/write", "k:1", "", 0)).await
    })
    .await;
    assert_eq!(granted.status, StatusCode::OK, "{name}");
    target.assert_nothing_left().await;
}

async fn upgrades_go_to_a_sole_reader_at_once_and_nested_layers_reenter(target: &Target) {
    let (name, inside, gate) = (target.name, Arc::new(Inside::default()), Gate::new());
    let waiting = target.locks[0]
        .clone()
        .wait(Wait::up_to(Duration::from_secs(3)));
    let app = router(&waiting, &inside, &gate);
    let other = router(&target.locks[1], &inside, &gate);

    // A sole reader takes its keys exclusively.
    let alone = send(&app, request("/upgrade", "u:1,u:2", "", 0)).await;
    assert_eq!(
        alone.status,
        StatusCode::OK,
        "{name}: a sole reader's upgrade"
    );

    // Beside another reader, the upgrade is refused at once, although the policy waits:
    // the other reader may be waiting to upgrade too.
    let reading =
        tokio::spawn(async move { send(&other, request("/gated-read", "u:2", "", 0)).await });
    gate.wait_entered().await;
    let beside = send(&app, request("/upgrade", "u:1,u:2", "", 0)).await;
    assert_eq!(
        beside.status,
        StatusCode::CONFLICT,
        "{name}: an upgrade beside a reader"
    );
    let took: u64 = beside.headers["x-took-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(took < 1000, "{name}: the refused upgrade waited {took} ms");
    gate.open();
    assert_eq!(reading.await.unwrap().status, StatusCode::OK);

    // Once the upgrade ends, the key is shared again: readers come in beside the owner's
    // remaining shared hold, writers do not.
    let back = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, request("/upgrade-and-back", "u:3", "", 0)).await })
    };
    gate.wait_entered().await;
    let other = router(&target.locks[1], &inside, &Gate::new());
    let reader = send(&other, request("/read", "u:3", "", 0)).await;
    assert_eq!(
        reader.status,
        StatusCode::OK,
        "{name}: a reader after the upgrade ended"
    );
    let writer = send(&other, request("/write", "u:3", "", 0)).await;
    assert_eq!(
        writer.status,
        StatusCode::CONFLICT,
        "{name}: a writer beside the reader"
    );
    gate.open();
    assert_eq!(back.await.unwrap().status, StatusCode::OK);

    // Nested layers share the owner: exclusive then shared re-enters, and shared then
    // exclusive upgrades, alone.
    let nested = send(&app, request("/nested", "n:1", "n:1,n:2", 0)).await;
    assert_eq!(nested.status, StatusCode::OK, "{name}: {}", nested.text());
    let upgraded = send(&app, request("/nested-upgrade", "n:3", "n:3", 0)).await;
    assert_eq!(
        upgraded.status,
        StatusCode::OK,
        "{name}: {}",
        upgraded.text()
    );
    target.assert_nothing_left().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_holds_on_memory() {
    every_case(Target::of(Store::memory())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_holds_on_redis() {
    every_case(Target::of(Store::redis())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_holds_on_redlock() {
    every_case(Target::of(Store::redlock())).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_holds_on_postgres() {
    every_case(Target::of(Store::postgres())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_holds_on_the_cluster() {
    let (_turn, cluster) = Cluster::start_in_turn().await;
    let cluster = Arc::new(cluster);
    let handle = || {
        Locks::new(
            RedisCluster::new(cluster.urls())
                .node_timeout(Duration::from_secs(1))
                .build()
                .expect("valid cluster URLs"),
        )
    };
    let masters = cluster.clone();
    let target = Target {
        name: "cluster",
        locks: [handle(), handle()],
        left: Box::new(move || masters.locks_on_masters().into_iter().flatten().collect()),
    };
    every_case(target).await;
}
