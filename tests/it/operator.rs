//! The operator's view: `Locks::inspect`, `Locks::held_batches`, `Locks::force_release` and
//! the admin router, on memory, on Redis, and (inspect) on Redlock over three masters.

use std::{
    sync::{atomic::AtomicUsize, Arc},
    time::Duration,
};

use axum::{body::Body, routing::post, Router};
use http::{Request, StatusCode};
use tokio::task::JoinHandle;
use tower_batch_lock::{store::Store, KeyState, KeyStatus, Locks, Wait};

use crate::support::{
    handlers::{counting_handler, gated_handler, Gate},
    http::{header_keys, send, Reply},
};

const TTL: Duration = Duration::from_secs(10);

/// `/work/{n}` passes the gate, holding the keys of its `x-keys` header; `/wait/{n}` does
/// the same, waiting up to 5 s for busy keys, in line; `/quick` returns at once.
fn router(locks: &Locks, gate: &Arc<Gate>) -> Router {
    let runs = Arc::new(AtomicUsize::new(0));
    Router::new()
        .route(
            "/work/{n}",
            post(gated_handler(gate)).layer(locks.layer(header_keys)),
        )
        .route(
            "/wait/{n}",
            post(gated_handler(gate)).layer(
                locks
                    .layer(header_keys)
                    .wait(Wait::up_to(Duration::from_secs(5))),
            ),
        )
        .route(
            "/quick",
            post(counting_handler(&runs)).layer(locks.layer(header_keys)),
        )
}

fn request(uri: &str, keys: &str, id: Option<&str>) -> Request<Body> {
    let mut request = Request::post(uri).header("x-keys", keys);
    if let Some(id) = id {
        request = request.header("x-request-id", id);
    }
    request.body(Body::empty()).unwrap()
}

fn spawn_send(app: &Router, request: Request<Body>) -> JoinHandle<Reply> {
    let app = app.clone();
    tokio::spawn(async move { send(&app, request).await })
}

async fn inspect(locks: &Locks, keys: &[&str]) -> Vec<KeyState> {
    locks.inspect(keys.iter().copied()).await.unwrap()
}

/// A held key shows held with its TTL and holds; a key a waiter has in line shows the
/// waiter; free keys show free. The held batch lists its route, keys and request id, and
/// is gone once released.
async fn inspect_and_held_batches(locks: Locks) {
    let locks = locks.ttl(TTL);
    let gate = Gate::new();
    let app = router(&locks, &gate);
    assert!(locks.held_batches().is_empty());

    let first = spawn_send(&app, request("/work/1", "a,b", Some("req-1")));
    gate.wait_entered().await;
    let batches = locks.held_batches();
    assert_eq!(batches.len(), 1, "{batches:?}");
    assert_eq!(batches[0].route(), Some("/work/{n}"));
    assert_eq!(batches[0].key_count(), 2);
    assert_eq!(batches[0].request_id(), Some("req-1"));
    assert!(batches[0].age() < TTL);

    // A waiter in line for b and c: it reserves both.
    let waiter = spawn_send(&app, request("/wait/2", "b,c", None));
    let mut queued = false;
    for _ in 0..500 {
        if inspect(&locks, &["c"]).await[0].waiters() == 1 {
            queued = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(queued, "the waiter never showed on c");

    let states = inspect(&locks, &["d", "c", "b", "a", "a"]).await;
    let keys: Vec<&str> = states.iter().map(KeyState::key).collect();
    assert_eq!(
        keys,
        ["a", "b", "c", "d"],
        "sorted and deduplicated, as a batch"
    );
    let (a, b, c, d) = (&states[0], &states[1], &states[2], &states[3]);
    assert_eq!(a.status(), KeyStatus::Held);
    assert!(a.is_held());
    assert!(
        a.ttl()
            .is_some_and(|ttl| ttl > Duration::ZERO && ttl <= TTL),
        "{a:?}"
    );
    assert_eq!((a.holds(), a.waiters()), (1, 0));
    assert_eq!(b.status(), KeyStatus::Held);
    assert_eq!((b.holds(), b.waiters()), (1, 1));
    assert_eq!(c.status(), KeyStatus::Free);
    assert_eq!((c.ttl(), c.holds(), c.waiters()), (None, 0, 1));
    assert_eq!(d.status(), KeyStatus::Free);
    assert_eq!((d.ttl(), d.holds(), d.waiters()), (None, 0, 0));
    // Nothing in the answer shows who holds a key.
    assert!(!format!("{states:?}").contains("owner"));

    gate.open();
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    gate.wait_entered().await;
    let batches = locks.held_batches();
    assert_eq!(batches.len(), 1, "{batches:?}");
    assert_eq!(batches[0].route(), Some("/wait/{n}"));
    assert_eq!(batches[0].request_id(), None);
    gate.open();
    assert_eq!(waiter.await.unwrap().status, StatusCode::OK);

    assert!(locks.held_batches().is_empty());
    for _ in 0..200 {
        if inspect(&locks, &["a", "b", "c"])
            .await
            .iter()
            .all(|s| !s.is_held())
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the keys were not free after both requests");
}

/// A forced release frees a held key for the next request; the old holder's release then
/// neither fails nor frees the new holder's key.
async fn force_release_frees_a_held_key(locks: Locks) {
    let locks = locks.ttl(TTL);
    let gate = Gate::new();
    let app = router(&locks, &gate);

    let old = spawn_send(&app, request("/work/1", "x", None));
    gate.wait_entered().await;
    assert_eq!(
        send(&app, request("/quick", "x", None)).await.status,
        StatusCode::CONFLICT
    );

    let released = locks
        .force_release(["x", "unheld"], "test: a stuck holder")
        .await
        .unwrap();
    assert_eq!(released, 1);
    assert_eq!(inspect(&locks, &["x"]).await[0].status(), KeyStatus::Free);
    assert_eq!(
        send(&app, request("/quick", "x", None)).await.status,
        StatusCode::OK
    );

    // A new holder takes x; then the old one finishes and releases.
    let new = spawn_send(&app, request("/work/2", "x", None));
    gate.wait_entered().await;
    // The gate lets its waiters go first come, first served: the old holder goes on.
    gate.open();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let states = inspect(&locks, &["x"]).await;
    assert_eq!(
        states[0].status(),
        KeyStatus::Held,
        "the old holder's release freed the new holder's key"
    );
    gate.open();
    assert_eq!(old.await.unwrap().status, StatusCode::OK);
    assert_eq!(new.await.unwrap().status, StatusCode::OK);
    assert!(locks.held_batches().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_inspect_and_held_batches() {
    inspect_and_held_batches(Locks::new(Store::isolated_memory())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_batches_are_listed_from_the_first_look_on() {
    // Until someone asks, requests keep no list: a batch granted before the first look is
    // not in it, and one granted after is, until its release.
    let locks = Locks::new(Store::isolated_memory()).ttl(TTL);
    let gate = Gate::new();
    let app = router(&locks, &gate);
    let before = spawn_send(&app, request("/work/1", "a", Some("req-1")));
    gate.wait_entered().await;
    assert!(locks.held_batches().is_empty());

    let after = spawn_send(&app, request("/work/2", "b", Some("req-2")));
    gate.wait_entered().await;
    let batches = locks.held_batches();
    assert_eq!(batches.len(), 1, "{batches:?}");
    assert_eq!(batches[0].request_id(), Some("req-2"));

    gate.open();
    gate.open();
    assert_eq!(before.await.unwrap().status, StatusCode::OK);
    assert_eq!(after.await.unwrap().status, StatusCode::OK);
    assert!(locks.held_batches().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_force_release() {
    force_release_frees_a_held_key(Locks::new(Store::isolated_memory())).await;
}

#[tokio::test]
async fn inspect_and_force_release_refuse_keys_a_request_could_not_lock() {
    let locks = Locks::new(Store::isolated_memory()).max_keys(2);
    let error = locks.inspect(["a", "b", "c"]).await.unwrap_err();
    assert_eq!(error.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let error = locks.force_release([""], "test").await.unwrap_err();
    assert_eq!(error.status(), StatusCode::BAD_REQUEST);
    assert!(locks
        .inspect(Vec::<String>::new())
        .await
        .unwrap()
        .is_empty());
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use crate::support::RedisServer;
    use tower_batch_lock::store::{Redis, Redlock};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_inspect_and_held_batches() {
        let server = RedisServer::start();
        inspect_and_held_batches(Locks::new(Redis::url(server.url()).build().unwrap())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_force_release() {
        let server = RedisServer::start();
        force_release_frees_a_held_key(Locks::new(Redis::url(server.url()).build().unwrap())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_foreign_values_show_and_stay() {
        let server = RedisServer::start();
        let locks = Locks::new(Redis::pool(server.pool()).build().unwrap());
        let mut connection = server.connection();
        let _: () = ::redis::cmd("SET")
            .arg("lock:alien")
            .arg("not a lock")
            .query(&mut connection)
            .unwrap();
        let _: () = ::redis::cmd("HSET")
            .arg("lock:hash")
            .arg("f")
            .arg("v")
            .query(&mut connection)
            .unwrap();
        let states = locks.inspect(["alien", "hash"]).await.unwrap();
        assert!(
            states.iter().all(|s| s.status() == KeyStatus::Foreign),
            "{states:?}"
        );
        assert_eq!(
            locks
                .force_release(["alien", "hash"], "test")
                .await
                .unwrap(),
            0
        );
        assert_eq!(
            server.dbsize(),
            2,
            "a forced release left foreign values alone"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redlock_inspect_and_force_release_over_three_masters() {
        let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
        let locks = Locks::new(
            Redlock::new(servers.iter().map(RedisServer::url))
                .node_timeout(Duration::from_millis(500))
                .build()
                .unwrap(),
        );
        inspect_and_held_batches(locks.clone()).await;
        force_release_frees_a_held_key(locks).await;
    }
}

#[cfg(feature = "admin")]
mod admin {
    use super::*;
    use serde_json::{json, Value};
    use tower_batch_lock::admin;

    async fn json(app: &Router, request: Request<Body>) -> (StatusCode, Value) {
        let reply = send(app, request).await;
        let body = serde_json::from_slice(&reply.body).unwrap_or(Value::Null);
        (reply.status, body)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_admin_routes_answer_json() {
        let locks = Locks::new(Store::isolated_memory()).ttl(TTL);
        let gate = Gate::new();
        let app = router(&locks, &gate);
        let admin_app: Router = Router::new().nest("/admin", admin::router(locks.clone()));

        let held = spawn_send(&app, request("/work/7", "a,b", Some("req-7")));
        gate.wait_entered().await;

        let get = |uri: &str| Request::get(uri).body(Body::empty()).unwrap();
        let (status, body) = json(&admin_app, get("/admin/locks?key=a&key=z")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let keys = body["keys"].as_array().unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0]["key"], "a");
        assert_eq!(keys[0]["status"], "held");
        assert!(keys[0]["ttl_ms"]
            .as_u64()
            .is_some_and(|ms| ms > 0 && ms <= 10_000));
        assert_eq!(
            (keys[0]["holds"].clone(), keys[0]["waiters"].clone()),
            (json!(1), json!(0))
        );
        assert_eq!(
            keys[1],
            json!({"key": "z", "status": "free", "ttl_ms": null, "holds": 0, "waiters": 0})
        );

        let (status, body) = json(&admin_app, get("/admin/locks")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");

        let (status, body) = json(&admin_app, get("/admin/locks/held")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let batches = body["batches"].as_array().unwrap();
        assert_eq!(batches.len(), 1, "{body}");
        assert_eq!(batches[0]["route"], "/work/{n}");
        assert_eq!(batches[0]["request_id"], "req-7");
        assert_eq!(batches[0]["keys"], 2);
        assert!(batches[0]["age_ms"].is_u64());

        let force = |body: &str| {
            Request::post("/admin/locks/force-release")
                .header("content-type", "application/json")
                .body(Body::from(body.to_owned()))
                .unwrap()
        };
        let (status, body) = json(
            &admin_app,
            force(r#"{"keys": ["a", "b"], "reason": "test: stuck"}"#),
        )
        .await;
        assert_eq!((status, body), (StatusCode::OK, json!({"released": 2})));
        let (status, body) = json(&admin_app, force(r#"["a"]"#)).await;
        assert_eq!((status, body), (StatusCode::OK, json!({"released": 0})));
        let (status, _) = json(&admin_app, force(r#"{"keys": "a"}"#)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);

        gate.open();
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
        let (_, body) = json(&admin_app, get("/admin/locks/held")).await;
        assert_eq!(body, json!({"batches": []}));
    }
}
